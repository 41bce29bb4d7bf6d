"""Training protocols as pure state machines; every module registers its strategy by name."""

from hetrain.strategies import adsp, ashl, asp, auto, cadp, ddp, local_sgd, ssp  # noqa: F401  (registration)
from hetrain.strategies.base import (
    BarrierMixin,
    Decision,
    OuterOptimizer,
    Push,
    RunContext,
    Strategy,
    WorkTask,
)
from hetrain.strategies.contract import ContractError, check_decision
from hetrain.strategies.registry import REGISTRY, make_strategy, register, strategy_options

__all__ = [
    "REGISTRY",
    "BarrierMixin",
    "ContractError",
    "Decision",
    "OuterOptimizer",
    "Push",
    "RunContext",
    "Strategy",
    "WorkTask",
    "check_decision",
    "make_strategy",
    "register",
    "strategy_options",
]
