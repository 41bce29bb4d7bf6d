"""ASHL stage 0: the Profile type (priced from the Cluster, saved and loaded) and the plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hetrain.cluster import Link, preset
from hetrain.config import config_from_dict
from hetrain.engine import measure as measure_mod
from hetrain.engine.measure import Measurement
from hetrain.engine.setup import prepare
from hetrain.errors import ConfigError
from hetrain.plan.local_steps import (
    FractionalSteps,
    OnlineCosts,
    plan_for_comm_fraction,
    plan_for_fastest,
    plan_local_steps,
)
from hetrain.profile import Profile, WorkerProfile, worker_profiles
from hetrain.profile.fit import (
    FIX,
    MAX_PLAUSIBLE_FLOPS,
    StepFit,
    fit_step_time,
    judge_fits,
    profile_batch_sizes,
    sources,
    speed_source,
)
from hetrain.strategies import RunContext


def _ctx(cluster: str = "hetero-8") -> RunContext:
    return RunContext(cluster=preset(cluster), flops_per_sample=1e6, model_bytes=50_000,
                      sample_bytes=160, train_samples=10_000, batch_size=32, lr=0.05)


def test_from_cluster_prices_what_the_cluster_model_says():
    ctx = _ctx()
    p = Profile.from_context(ctx, push_ratio=0.5)
    assert p.n == 8 and p.source == "sim" and p.push_bytes == 25_000
    for i, w in enumerate(p.workers):
        d, link = ctx.cluster.devices[i], ctx.cluster.ps_link(i)
        assert w.step_time_s == pytest.approx(d.compute_time_s(32, 1e6, 1))
        assert w.pull_time_s == pytest.approx(link.transfer_time_s(50_000))
        assert w.push_time_s == pytest.approx(link.transfer_time_s(25_000))
    assert p.speeds()[0] == 1.0 and p.speeds()[-1] == pytest.approx(7.34, rel=0.01)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_save_and_load_round_trip(tmp_path, suffix):
    p = Profile.from_context(_ctx("geo-16"))
    path = tmp_path / f"profile{suffix}"
    p.save(path)
    assert Profile.load(path) == p


def test_bad_profiles_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Profile.load(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="exactly the keys"):
        Profile.from_dict({"workers": [{"name": "a", "batch_size": 1}]})
    with pytest.raises(ConfigError, match="step_time_s"):
        WorkerProfile("a", 32, 0.0, 0.1, 0.1)
    with pytest.raises(ConfigError, match="same length"):
        worker_profiles(["a", "b"], 32, [0.1], [0.1, 0.1], [0.1, 0.1])


def test_plan_equalises_round_times():
    p = Profile.from_context(_ctx())
    plan = plan_local_steps(p, min_steps=4)
    slowest = max(range(p.n), key=lambda i: p.workers[i].round_time_s(4))
    assert plan.local_steps[slowest] == 4
    for w, h, r in zip(p.workers, plan.local_steps, plan.round_times_s, strict=True):
        assert r == pytest.approx(w.round_time_s(h))
        assert abs(r - plan.round_time_s) <= w.step_time_s / 2 + 1e-12  # rounding only
    assert plan.imbalance < 1.1
    assert max(plan.local_steps) >= 7 * min(plan.local_steps)  # 1:8 speeds -> ~1:8 steps


def test_plan_for_fastest_and_for_comm_fraction():
    p = Profile.from_context(_ctx("geo-16"))
    fast = plan_for_fastest(p, 40)
    assert max(fast.local_steps) == 40
    for f in (0.05, 0.3):
        plan = plan_for_comm_fraction(p, f)
        assert all(w.comm_time_s / plan.round_time_s <= f + 1e-12 for w in p.workers)
    slow_links = plan_for_comm_fraction(p, 0.05)
    assert slow_links.round_time_s > plan_for_comm_fraction(p, 0.3).round_time_s
    # on one fast LAN the budget never binds: rounds are the slowest worker's one step
    lan = Profile.from_context(_ctx("hetero-4"))
    assert min(plan_for_comm_fraction(lan, 0.1).local_steps) == 1


def test_fractional_steps_keep_the_long_run_rate():
    r = FractionalSteps(2)
    a = [r.take(0, 1.5) for _ in range(100)]
    b = [r.take(1, 0.4) for _ in range(10)]
    assert sum(a) == 150 and set(a) == {1, 2}
    assert b == [1] * 10  # at least one step


def test_online_costs_follow_measurements():
    p = Profile.from_context(_ctx())
    costs = OnlineCosts(p, weight=0.5)
    w0 = p.workers[0]
    costs.observe(0, compute_s=4 * 2 * w0.step_time_s, steps=4, comm_s=3 * w0.comm_time_s)
    assert costs.step_s[0] == pytest.approx(1.5 * w0.step_time_s)
    assert costs.comm_s[0] == pytest.approx(2 * w0.comm_time_s)
    q = costs.profile()
    assert q.workers[0].comm_time_s == pytest.approx(2 * w0.comm_time_s)
    assert q.workers[1] == p.workers[1]


def test_the_simulator_charges_what_the_profile_predicts():
    """Stage 0 on the simulator is exact: measured step times equal the priced ones."""
    cfg = config_from_dict({"name": "p", "cluster": "hetero-4",
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": "ashl"}, "stop": {"max_epochs": 0.5}})
    prep = prepare(cfg)
    from hetrain.engine.sim import simulate

    simulate(prep)
    strategy = prep.strategy
    for priced, measured in zip(strategy.profile.step_times_s(), strategy.costs.step_s,
                                strict=True):
        assert measured == pytest.approx(priced, rel=1e-9)


# ---- `hetrain profile`: the fit and its refusal (no processes) ----------------------------
SIZES = (16, 32, 64)


def _line(a: float, c: float, repeats: int = 3) -> list[list[float]]:
    return [[a + c * b] * repeats for b in SIZES]


def test_fit_recovers_a_line_exactly():
    fit = fit_step_time(SIZES, _line(2e-3, 5e-5))
    assert fit.overhead_s == pytest.approx(2e-3, rel=1e-9)
    assert fit.per_sample_s == pytest.approx(5e-5, rel=1e-9)
    assert fit.spread == 0.0
    assert judge_fits(["d0"], [fit], 1e6, force=False) is None
    # symmetric noise on every repeat leaves the least-squares line where it was
    noisy = [[t * 0.9, t, t * 1.1] for t in (2e-3 + 5e-5 * b for b in SIZES)]
    assert fit_step_time(SIZES, noisy).per_sample_s == pytest.approx(5e-5, rel=1e-9)


def test_fit_needs_two_distinct_sizes_and_every_size_timed():
    with pytest.raises(ValueError, match="2 distinct"):
        fit_step_time([32, 32], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="non-empty"):
        fit_step_time([16, 32], [[1.0], []])
    assert profile_batch_sizes(32) == (16, 32, 64)
    assert profile_batch_sizes(1) == (1, 2)


@pytest.mark.parametrize(("times", "says"), [
    (_line(5e-3, 0.0), "not positive"),                    # flat
    (_line(5e-3, -1e-5), "not positive"),                  # decreasing
    ([[t * 0.3, t, t * 2.0, t * 0.5] for t in (1e-2, 2e-2, 4e-2)], "spread"),  # noisy
    (_line(5e-3, 1e-12), "above the 1e+16"),  # 1e18 FLOP/s
])
def test_implausible_fits_are_refused_in_one_line_naming_device_and_fix(times, says):
    fits = [fit_step_time(SIZES, _line(2e-3, 5e-5)), fit_step_time(SIZES, times)]
    with pytest.raises(ConfigError) as e:
        judge_fits(["gpu-0", "gpu-1"], fits, 1e6, force=False)
    msg = str(e.value)
    assert "\n" not in msg and says in msg and FIX in msg
    assert "gpu-1" in msg and "gpu-0" not in msg


def test_force_returns_a_warning_instead():
    fits = [fit_step_time(SIZES, _line(5e-3, 1e-12))]
    assert fits[0].flops(1e6) > MAX_PLAUSIBLE_FLOPS
    warning = judge_fits(["gpu-0"], fits, 1e6, force=True)
    assert warning is not None and "--force" in warning and "gpu-0" in warning


def test_sources_say_measured_or_emulated():
    assert sources("none", 1.0, "pair").startswith("measured")
    for mode in ("cluster", "relative"):
        line = sources(mode, 0.5, "pair")
        assert line.startswith("emulated") and "'pair'" in line and "time_scale 0.5" in line
    assert speed_source("none", 0, 24) == "measured"
    assert speed_source("cluster", 0, 24) == "emulated"
    assert "3 of 24" in speed_source("cluster", 3, 24)
    assert speed_source("cluster", 24, 24).startswith("measured, not emulated")


def test_step_times_are_timed_per_size_and_repeat():
    from hetrain.engine.emulate import Throttle
    from hetrain.workloads import get_workload

    wl = get_workload("mlp", "digits")
    times = measure_mod._step_times_s(wl, Throttle(None, None, 1.0), (2, 4), 3,
                                      torch.device("cpu"))
    assert [len(ts) for ts in times] == [3, 3] and all(t > 0 for ts in times for t in ts)


def _cli_with_fake_measure(tmp_path, monkeypatch, force: bool, capsys):
    """`hetrain profile` with `measure` replaced by the fit decision alone (no processes)."""
    from hetrain.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('name = "p"\ncluster = "hetero-4"\n'
                   '[workload]\nmodel = "mlp"\ndataset = "digits"\n')

    def fake(cfg, *, steps, force):  # the CLI's call
        cluster = preset("hetero-4")
        fits = [fit_step_time(SIZES, _line(5e-3, 0.0))] * cluster.n  # flat
        warning = judge_fits([d.name for d in cluster.devices], fits, 1e6, force=force)
        prof = Profile.from_context(_ctx("hetero-4"))
        cluster = replace(cluster, devices=tuple(replace(d, link=Link(1e9, 1e-3))
                                                 for d in cluster.devices))
        return Measurement(prof, cluster, tuple(fits), sources("cluster", 1.0, "hetero-4"),
                           (0,) * cluster.n, 24, warning)

    monkeypatch.setattr(measure_mod, "measure", fake)
    out = tmp_path / "m.toml"
    rc = main(["profile", str(cfg), "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
               *(["--force"] if force else [])])
    return rc, out, capsys.readouterr()


def test_cli_refuses_without_force_and_writes_nothing(tmp_path, monkeypatch, capsys):
    rc, out, cap = _cli_with_fake_measure(tmp_path, monkeypatch, False, capsys)
    assert rc == 2 and not out.exists()
    (line,) = cap.err.strip().splitlines()
    assert line.startswith("hetrain: error: profile refused") and FIX in line


def test_cli_force_writes_with_a_warning_and_says_emulated(tmp_path, monkeypatch, capsys):
    rc, out, cap = _cli_with_fake_measure(tmp_path, monkeypatch, True, capsys)
    assert rc == 0 and out.is_file()
    (line,) = cap.err.strip().splitlines()
    assert line.startswith("hetrain: warning: writing an implausible profile (--force)")
    assert cap.out.startswith("emulated") and "FLOP/s (emulated)" in cap.out


def test_step_fit_flops():
    assert StepFit(0.0, 1e-6, 0.0).flops(1e6) == pytest.approx(1e12)
    assert StepFit(0.0, 0.0, 0.0).flops(1e6) == float("inf")
