"""The cadp strategy: the protocol as a state machine, convergence, speed against DDP, re-planning."""

from __future__ import annotations

import pytest

from hetrain.cluster import Cluster, Device, Link, Site, preset
from hetrain.config import config_from_dict
from hetrain.engine.setup import prepare
from hetrain.engine.sim import Simulator
from hetrain.errors import ConfigError
from hetrain.runner import run_config
from hetrain.strategies import Push, RunContext, make_strategy


def _cfg(strategy: str, cluster: str = "hetero-4", epochs: float = 4.0, target: float = 0.0,
         seed: int = 0, **options):
    return config_from_dict({
        "name": f"t-{strategy}", "cluster": cluster,
        "workload": {"model": "mlp", "dataset": "digits"},
        "strategy": {"name": strategy, **options},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"batch_size": 16, "seed": seed},
        "stop": {"max_epochs": epochs, "target_accuracy": target}})


def _ctx(cluster: Cluster, batch_size: int = 16) -> RunContext:
    return RunContext(cluster=cluster, flops_per_sample=1e6, model_bytes=40_000, sample_bytes=100,
                      train_samples=16_000, batch_size=batch_size, lr=0.05)


def _push(w: int, samples: int, steps: int, compute_s: float, comm_s: float = 0.01) -> Push:
    return Push(worker=w, base_version=0, samples=samples, steps=steps, loss=1.0,
                compute_s=compute_s, comm_s=comm_s, arrival_s=0.0)


def test_protocol_weights_by_share_and_releases_the_active_workers() -> None:
    s = make_strategy("cadp", local_steps=4, batch_size=32, replan_every=0)
    s.setup(_ctx(preset("hetero-4")))
    assert s.samples_per_round == 4 * 4 * 32 and s.plan is not None
    tasks = [s.next_task(w) for w in range(4)]
    assert all(t.local_steps == 4 for t in tasks)
    assert sum(t.samples for t in tasks) == s.samples_per_round
    b = [t.batch_size for t in tasks]
    assert b[3] > b[2] > max(b[0], b[1]) and abs(b[0] - b[1]) <= 1  # speeds 1:1:2:4
    assert all(t.data_bytes == t.samples * 100 for t in tasks)  # the share is shipped
    assert s.lr_scale == 2.0  # global batch 128 against DDP's 4 * 16: linear scaling
    for w in range(3):
        assert s.on_push(_push(w, tasks[w].samples, 4, 1.0)).apply == ()
    d = s.on_push(_push(3, tasks[3].samples, 4, 1.0))
    total = s.samples_per_round
    assert d.apply == tuple((w, tasks[w].samples / total) for w in range(4))
    assert d.release == (0, 1, 2, 3) and s.rounds == 1


def test_zero_share_worker_gets_a_probe_then_idles() -> None:
    site = Site("s", Link(1e9, 1e-4), Link(1e9, 1e-4))
    far = Device("far", 2e8, site="s", link=Link(1e9, 30.0))  # its fixed cost exceeds any round
    cl = Cluster("c", (Device("a", 2e8, site="s"), Device("b", 4e8, site="s"), far), (site,))
    s = make_strategy("cadp", local_steps=2, batch_size=16)
    s.setup(_ctx(cl))
    assert s.plan is not None and s.plan.shares[2] == 0 and s.plan.total == s.samples_per_round
    probe = s.next_task(2)
    assert probe.samples == 1
    t0, t1 = s.next_task(0), s.next_task(1)
    assert s.on_push(_push(2, 1, 1, 0.01, comm_s=60.0)).apply == ()  # the probe: a stray
    s.on_push(_push(0, t0.samples, 2, 0.2))
    d = s.on_push(_push(1, t1.samples, 2, 0.2))
    assert dict(d.apply)[2] == 0.0 and sum(w for _, w in d.apply) == pytest.approx(1.0)
    assert d.release == (0, 1)


def test_options_are_checked() -> None:
    for bad in ({"lr_scaling": "cubic"}, {"comm_fraction": 0.0}, {"local_steps": -1},
                {"min_local_steps": 4, "max_local_steps": 2}, {"ema_weight": 0.0}):
        with pytest.raises(ConfigError, match="cadp"):
            make_strategy("cadp", **bad)
    s = make_strategy("cadp", batch_size=200, max_lr_scale=3.0)
    s.setup(_ctx(preset("hetero-4")))
    assert s.lr_scale == 3.0  # capped


def test_cadp_converges_on_digits(digits_mlp) -> None:
    r = run_config(_cfg("cadp", epochs=4.0), runs_root=None, workload=digits_mlp)
    assert r.final_accuracy >= 0.9
    assert r.summary["strategy_stats"]["rounds"] >= 8


def test_cadp_beats_ddp_in_virtual_time_on_hetero4(digits_mlp) -> None:
    cadp = run_config(_cfg("cadp", epochs=4.0, target=0.9), runs_root=None, workload=digits_mlp)
    ddp = run_config(_cfg("ddp", epochs=4.0, target=0.9), runs_root=None, workload=digits_mlp)
    assert cadp.tta_s is not None and ddp.tta_s is not None
    assert cadp.tta_s < ddp.tta_s / 1.5
    assert cadp.summary["hardware_efficiency"] > 1.3 * ddp.summary["hardware_efficiency"]
    assert cadp.final_accuracy >= ddp.final_accuracy - 0.02


def test_a_device_slowed_mid_run_gets_a_smaller_share(digits_mlp) -> None:
    def run(replan_every: int) -> tuple[Simulator, float]:
        prep = prepare(_cfg("cadp", epochs=6.0, replan_every=replan_every), workload=digits_mlp)
        sim = Simulator(prep, speed_schedule=[(0.2, 3, 0.25)])  # dev3: speed 4 -> 1 at 0.2 s
        return sim, sim.run().summary["time_s"]

    sim, time_s = run(replan_every=1)
    hist = sim.strategy.history
    first, last = hist[0], hist[-1]
    assert first[3] > first[2] > first[0]                   # speeds 1:1:2:4
    assert last[3] < 0.5 * first[3] and last[3] < last[2]   # now speeds 1:1:2:1
    assert abs(last[3] - last[0]) <= 0.25 * last[0]
    _, fixed_time_s = run(replan_every=0)
    assert time_s < 0.9 * fixed_time_s


def test_a_device_behind_a_hopeless_link_gets_no_share(digits_mlp) -> None:
    cl = preset("hetero-4").with_device(0, link=Link(1e9, 5.0))  # 10 s per pull + push
    r = run_config(_cfg("cadp", epochs=3.0), runs_root=None, workload=digits_mlp, cluster=cl)
    assert r.summary["strategy_stats"]["zero_share_workers"] == 1
    far = r.summary["workers"][0]
    assert far["samples"] <= 1 and far["busy_s"] < 0.01  # at most its 1-sample probe
    assert r.final_accuracy >= 0.9 and r.summary["time_s"] < 5.0


def test_lost_worker_closes_the_round_and_its_share_is_replanned_to_the_others() -> None:
    s = make_strategy("cadp", local_steps=2, batch_size=32)
    s.setup(_ctx(preset("hetero-4")))
    tasks = [s.next_task(w) for w in range(4)]
    for w in range(3):
        assert s.on_push(_push(w, tasks[w].samples, 2, tasks[w].samples / 400)).apply == ()
    d = s.on_worker_lost(3)  # the fastest device dies before pushing
    assert d is not None and [w for w, _ in d.apply] == [0, 1, 2]
    assert sum(wt for _, wt in d.apply) == pytest.approx(1.0)
    assert d.release == (0, 1, 2)
    assert s.history[-1][3] == 0 and sum(s.history[-1]) == s.samples_per_round
    again = [s.next_task(w) for w in d.release]
    assert sum(t.samples for t in again) == s.samples_per_round
    for w, t in zip(d.release, again, strict=True):
        d2 = s.on_push(_push(w, t.samples, 2, t.samples / 400))
    assert d2.release == (0, 1, 2) and s.rounds == 2


def test_lost_worker_between_rounds_is_simply_left_out() -> None:
    s = make_strategy("cadp", local_steps=2, batch_size=32)
    s.setup(_ctx(preset("hetero-4")))
    tasks = [s.next_task(w) for w in range(4)]
    for w in range(4):
        d = s.on_push(_push(w, tasks[w].samples, 2, tasks[w].samples / 400))
    assert d.release == (0, 1, 2, 3)
    assert s.on_worker_lost(1) is None  # nobody has pushed in the new round yet
    assert s.history[-1][1] == 0


def _trio(far_latency_s: float = 1e-4) -> Cluster:
    site = Site("s", Link(1e9, 1e-4), Link(1e9, 1e-4))
    return Cluster("c", (Device("a", 2e8, site="s"), Device("b", 4e8, site="s"),
                         Device("c", 4e8, site="s", link=Link(1e9, far_latency_s))), (site,))


def _round(s, members, t: float, slow: dict[int, float] | None = None):
    """Release `members`, let each push at time t (compute as modelled, x slow[w])."""
    d = None
    for w in members:
        task = s.next_task(w)
        per = s._model_compute_s[w] * (slow or {}).get(w, 1.0)
        d = s.on_push(Push(worker=w, base_version=0, samples=task.samples, steps=1, loss=1.0,
                           compute_s=per * task.samples, comm_s=0.01, arrival_s=t))
    return d


def test_a_device_measured_slow_once_is_re_probed_and_rejoins() -> None:
    s = make_strategy("cadp", local_steps=1, batch_size=16, reprobe_after_s=5.0,
                      ship_data=False)
    s.setup(_ctx(_trio()))
    d = _round(s, (0, 1, 2), 1.0, slow={2: 100.0})     # c's first task ran 100x slow
    assert s._shares[2] == 0 and d.release == (0, 1)
    for t in (2.0, 3.0, 4.0, 5.0):                      # its wait (5 s) is not over
        assert _round(s, (0, 1), t).release == (0, 1)
    d = _round(s, (0, 1), 6.0)
    assert d.release == (0, 1, 2)                       # re-probed beside the round
    probe = s.next_task(2)
    assert probe.samples == s.mean_batch and probe.local_steps == 1
    d = s.on_push(Push(worker=2, base_version=0, samples=probe.samples, steps=1, loss=1.0,
                       compute_s=probe.samples * 0.0025, comm_s=0.01, arrival_s=6.5))
    assert d.apply == () and s.costs.compute_s[2] == pytest.approx(0.0025)  # replaced
    d = _round(s, (0, 1), 7.0)
    assert dict(d.apply)[2] == 0.0                      # the probe's update is discarded
    assert s._shares[2] >= s._shares[1] - 1 and 2 in d.release   # back, as fast as b


def test_a_device_still_slow_waits_twice_as_long_each_time() -> None:
    s = make_strategy("cadp", local_steps=1, batch_size=16, reprobe_after_s=5.0,
                      ship_data=False)
    s.setup(_ctx(_trio()))
    _round(s, (0, 1, 2), 1.0, slow={2: 100.0})
    assert _round(s, (0, 1), 6.0).release == (0, 1, 2)
    task = s.next_task(2)
    s.on_push(Push(worker=2, base_version=0, samples=task.samples, steps=1, loss=1.0,
                   compute_s=task.samples * 0.25, comm_s=0.01, arrival_s=6.0))  # still slow
    assert s._shares[2] == 0
    releases = {t: _round(s, (0, 1), t).release for t in (7.0, 11.0, 15.0, 16.0)}
    assert releases == {7.0: (0, 1), 11.0: (0, 1), 15.0: (0, 1), 16.0: (0, 1, 2)}


def test_no_re_probe_when_the_model_is_off_by_the_same_factor_everywhere() -> None:
    s = make_strategy("cadp", local_steps=1, batch_size=16, reprobe_after_s=1.0,
                      ship_data=False)
    s.setup(_ctx(_trio(far_latency_s=30.0)))           # c: a link no round can afford
    assert s._shares[2] == 0 and s.next_task(2).samples == 1   # the first round's probe
    _round(s, (0, 1), 1.0, slow={0: 3.0, 1: 3.0})
    s.on_push(Push(worker=2, base_version=0, samples=1, steps=1, loss=1.0,
                   compute_s=3 * 0.0025, comm_s=60.0, arrival_s=1.0))   # its first probe
    for t in (5.0, 50.0, 500.0):
        assert _round(s, (0, 1), t, slow={0: 3.0, 1: 3.0}).release == (0, 1)
