"""Reference runs a heterogeneous run is judged against, for the CLI and the benchmarks alike
(library code, so that a benchmark need not import the command line)."""

from __future__ import annotations

import dataclasses

from hetrain.cluster import load_cluster
from hetrain.config import RunConfig, StrategyConfig

FASTEST_ALONE = "fastest-alone"
"""`--compare` name of the reference run: the cluster's fastest device training by itself
(plain DDP on one device, so no communication). A cluster is worth its slower devices only
where it beats this; the demo always shows it."""


def fastest_alone(cfg: RunConfig) -> RunConfig:
    """`cfg` on the cluster's fastest device alone (ddp on one device: no communication)."""
    cluster = load_cluster(cfg.cluster).fastest_alone()
    return dataclasses.replace(cfg, name=f"{cfg.name}-{FASTEST_ALONE}", cluster=cluster.to_dict(),
                               strategy=StrategyConfig("ddp", {}))
