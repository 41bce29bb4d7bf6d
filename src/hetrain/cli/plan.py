"""`hetrain plan --cluster C --model M`: the AutoDDL plan per layer vs pure data parallel."""

from __future__ import annotations

import argparse

from hetrain.parallel.cli_plan import add_plan_arguments, plan_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search a data/tensor/pipeline parallel plan (AutoDDL)",
                       description="Search SBP placements per layer with the analytical cost "
                       "model and coordinate descent; print the plan, its predicted step time "
                       "and memory, and the data-parallel baseline's.")
    add_plan_arguments(p)
    p.set_defaults(func=plan_from_args)
