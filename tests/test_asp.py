"""ASP: every push applied on arrival, nobody waits; converges on digits in the simulator."""

from __future__ import annotations

import pytest

from hetrain.cluster import preset
from hetrain.config import config_from_dict
from hetrain.errors import ConfigError
from hetrain.runner import run_config
from hetrain.strategies import Push, RunContext, make_strategy


def ctx(cluster: str = "hetero-4") -> RunContext:
    return RunContext(cluster=preset(cluster), flops_per_sample=1e6, model_bytes=10_000,
                      sample_bytes=64, train_samples=1000, batch_size=16, lr=0.05)


def push(worker: int, base: int, loss: float = 1.0, t: float = 0.0, steps: int = 1) -> Push:
    return Push(worker=worker, base_version=base, samples=16 * steps, steps=steps, loss=loss,
                compute_s=0.01 * steps, comm_s=0.001, arrival_s=t)


def run_digits(name: str, cluster: str = "hetero-4", epochs: float = 4.0, **options):
    cfg = config_from_dict({"name": f"t-{name}", "cluster": cluster,
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": name, **options},
                            "train": {"batch_size": 16, "eval_every_epochs": 1.0},
                            "stop": {"max_epochs": epochs}})
    return run_config(cfg, runs_root=None)


def test_every_push_is_applied_at_once_and_released():
    s = make_strategy("asp", staleness_weighting=True)
    s.setup(ctx())
    d = s.on_push(push(2, base=0))
    assert d.apply == ((2, 0.25),) and d.release == (2,)
    d = s.on_push(push(0, base=0))  # one update happened since worker 0 pulled
    assert d.apply == ((0, 0.25 / 2),) and d.release == (0,)
    assert s.stats()["max_staleness"] == 1
    s2 = make_strategy("asp", local_steps=4, push_weight=1.0)
    s2.setup(ctx())
    assert s2.next_task(1).local_steps == 4
    assert s2.on_push(push(1, base=0)).apply == ((1, 1.0),)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="local_steps"):
        make_strategy("asp", local_steps=0)
    with pytest.raises(ConfigError, match="unknown option"):
        make_strategy("asp", staleness=3)


def test_asp_converges_on_digits():
    r = run_digits("asp")
    assert r.rows[0]["test_accuracy"] < 0.3
    assert r.final_accuracy > 0.85
    assert r.summary["strategy_stats"]["mean_staleness"] > 1  # really asynchronous
    idle = [w["idle_s"] for w in r.summary["workers"]]
    assert max(idle) < 1e-9  # nobody waits
