"""The auto strategy: planning at setup, re-planning from measured noise, the PS placement, and
training on the simulator."""

from __future__ import annotations

import itertools
import math

import pytest

from hetrain.cluster import Cluster, Device, Link, Site, preset
from hetrain.config import config_from_dict
from hetrain.engine.setup import prepare
from hetrain.engine.sim import Simulator
from hetrain.errors import ConfigError
from hetrain.plan.noise import GradProbe
from hetrain.strategies import Decision, Push, RunContext, make_strategy


def _ctx(cluster: Cluster, batch_size: int = 32, train_samples: int = 16_000) -> RunContext:
    return RunContext(cluster=cluster, flops_per_sample=1e6, model_bytes=200_000,
                      sample_bytes=100, train_samples=train_samples, batch_size=batch_size,
                      lr=0.05)


def _two_sites(fast_far: bool) -> Cluster:
    """PS site 'home' with one slow device; site 'far' (100 ms, 10 Mbit/s away) with 3 fast."""
    sites = (Site("home", Link(1.25e9, 5e-5), Link(1.25e6, 0.05)),
             Site("far", Link(1.25e9, 5e-5), Link(1.25e6, 0.05)))
    fast = 8e8 if fast_far else 2e8
    devices = (Device("slow", 2e8, site="home", step_overhead_s=2e-3),
               *(Device(f"fast{j}", fast, site="far", step_overhead_s=2e-3) for j in range(3)))
    return Cluster("two-sites", devices, sites, ps_site="home")


def _probe(noise: float, batch: int = 16, grad_sq: float = 1.0) -> GradProbe:
    """A noiseless probe of a problem with |G|^2 = grad_sq and tr(Sigma) = noise * grad_sq."""
    trace = noise * grad_sq
    return GradProbe(grad_sq + trace / (batch / 2), batch / 2, grad_sq + trace / batch, batch)


def _run_rounds(s, rounds: int, noise: float, loss: float = 1.0) -> Decision:
    """`rounds` rounds of every member pushing `loss`; the last round's closing decision."""
    decision = Decision()
    for _ in range(rounds):
        members = sorted(s._members)
        for w in members:
            task = s.next_task(w)
            decision = s.on_push(Push(
                worker=w, base_version=0, samples=task.samples, steps=task.local_steps,
                loss=loss, compute_s=task.samples * 1e6 / s.context.cluster.devices[w].flops
                + task.local_steps * 2e-3,
                comm_s=0.001, arrival_s=0.0, probe=_probe(noise, task.batch_size)))
    return decision


def test_setup_plans_a_small_batch_on_the_devices_worth_their_links() -> None:
    s = make_strategy("auto")
    s.setup(_ctx(preset("hetero-8")))
    plan = s.goodput_plan
    # site-b is 5 ms + 5 ms and 12.5 MB/s away: at a small batch only site-a trains
    assert plan.ps_site == "site-a" and plan.global_batch <= 32
    assert set(plan.active) <= {0, 2, 4, 6} and 6 in plan.active
    tasks = {w: s.next_task(w) for w in range(8)}
    assert sum(tasks[w].samples for w in plan.active) == plan.global_batch * plan.local_steps
    assert all(tasks[w].probe_noise for w in plan.active if tasks[w].batch_size >= 2)
    assert s.lr_scale == pytest.approx(plan.lr_scale) and s.lr_scale <= 1.0


def test_the_ps_moves_to_the_site_worth_training_in() -> None:
    s = make_strategy("auto")
    s.setup(_ctx(_two_sites(fast_far=True)))
    assert s.ps_placement() == "far" and set(s.goodput_plan.active) == {1, 2, 3}
    kept = make_strategy("auto", move_ps=False)
    kept.setup(_ctx(_two_sites(fast_far=True)))
    assert kept.ps_placement() == "home"


def test_the_noise_scale_grows_the_batch_gradually_and_without_flapping() -> None:
    s = make_strategy("auto", replan_every_epochs=0.01, min_probes=1)
    s.setup(_ctx(preset("hetero-4")))
    g0 = s.global_batch
    _run_rounds(s, 400, noise=4000.0)
    gs = [g for _, g, _ in s.switches]
    assert gs[0] == g0 and gs[-1] > g0
    assert all(b <= 2 * a for a, b in itertools.pairwise(gs))   # at most x2 per switch
    rounds = [g * h for _, g, h in s.switches]                   # and so do the rounds
    assert all(b <= 2 * a for a, b in itertools.pairwise(rounds))
    assert gs == sorted(gs)                                              # no flapping back
    assert s.lr_scale <= s.max_lr_scale
    assert s.noise.noise_scale == pytest.approx(4000.0, rel=1e-6)
    # a noise scale that stays put: no more switches
    n = len(s.switches)
    _run_rounds(s, 200, noise=4000.0)
    assert len(s.switches) <= n + 1


@pytest.mark.parametrize("blow_up", [math.nan, math.inf, 4.5])
def test_a_blown_up_round_is_discarded_and_the_plan_backs_off(blow_up: float) -> None:
    """A round whose loss is not finite, or over divergence_factor (4) x the first round's
    (1.0 here), is applied with weight 0; the plan goes back to the one before, every member
    starts afresh, and no round that large is planned again."""
    s = make_strategy("auto", replan_every_epochs=0.01, min_probes=1)
    s.setup(_ctx(preset("hetero-4")))
    _run_rounds(s, 400, noise=4000.0)
    assert len(s.switches) >= 2
    before, failed = s.switches[-2][1:], s.switches[-1][1:]
    assert _run_rounds(s, 1, noise=4000.0, loss=3.9).apply[0][1] > 0   # under 4x: applied
    decision = _run_rounds(s, 1, noise=4000.0, loss=blow_up)
    assert decision.apply and all(w == 0.0 for _, w in decision.apply)
    assert s.switches[-1][1:] == before and s.stats()["discarded_rounds"] == 1
    assert all(s.next_task(w).reset_optimizer for w in sorted(s._members))
    backed_off = len(s.switches)
    _run_rounds(s, 400, noise=4000.0)
    assert all(g * h < failed[0] * failed[1] for _, g, h in s.switches[backed_off - 1:])
    assert s.stats()["discarded_rounds"] == 1


def test_the_lr_follows_the_noise_between_switches() -> None:
    """With lr_follows_noise the lr scale is AdaScale's gain at every round's noise estimate,
    so it moves between switches; without (the default) it stays at the last switch's. Either
    way the metrics log the scale tasks run with."""
    for follows in (True, False):
        s = make_strategy("auto", replan_every_epochs=0.01, min_probes=1,
                          noise_ema_weight=1.0, lr_follows_noise=follows)
        s.setup(_ctx(preset("hetero-4")))
        at_setup = s.lr_scale
        _run_rounds(s, 200, noise=24.0)
        assert len(s.switches) == 1                               # the setup plan, no switch
        plan = s.goodput_plan
        assert plan.lr_scale != pytest.approx(at_setup)           # re-evaluated at noise 24
        expected = plan.lr_scale if follows else at_setup
        task = s.next_task(sorted(s._members)[0])
        assert s.metrics()["lr_scale"] == task.lr_scale == pytest.approx(expected)


def test_adam_scales_the_lr_by_the_square_root_of_the_gain() -> None:
    from dataclasses import replace

    sgd, adam = make_strategy("auto", noise_scale=1e6), make_strategy("auto", noise_scale=1e6)
    sgd.setup(_ctx(preset("hetero-4")))
    adam.setup(replace(_ctx(preset("hetero-4")), optimizer="adamw"))
    g = sgd.global_batch
    assert sgd.lr_scale == pytest.approx(min(2.0, g / 32), rel=1e-3)
    assert adam.lr_scale == pytest.approx(min(2.0, (adam.global_batch / 32) ** 0.5), rel=1e-3)


@pytest.mark.parametrize(("optimizer", "option", "factor"),
                         [("sgd", 0.0, 3.0), ("adamw", 0.0, 1.0), ("adamw", 2.0, 2.0)])
def test_the_planner_scales_the_measured_noise_by_the_lr_rules_factor(
        optimizer: str, option: float, factor: float) -> None:
    """noise_scale_factor 0: 3x the measured B_simple for SGD, 1x for Adam-type (each chosen
    on its workload's selection seeds); a set factor is used as given."""
    from dataclasses import replace

    s = make_strategy("auto", noise_scale_factor=option)
    s.setup(replace(_ctx(preset("hetero-4")), optimizer=optimizer))
    _run_rounds(s, 60, noise=200.0)
    measured = s.noise.noise_scale
    assert measured == pytest.approx(200.0, rel=0.2)
    assert s._stat().noise_scale == pytest.approx(factor * measured)


@pytest.mark.parametrize(("optimizer", "options", "prior"),
                         [("sgd", {}, 32.0), ("adamw", {}, 16.0), ("adam", {"min_batch": 4}, 16.0),
                          ("adamw", {"noise_scale": 50.0}, 50.0)])
def test_the_prior_noise_scale_follows_the_lr_rule(optimizer: str, options: dict[str, float],
                                                   prior: float) -> None:
    """Before enough probes the planner plans at the prior: train.batch_size (32 here) for
    SGD, 16 for Adam-type optimizers whatever min_batch is (each chosen on its workload's
    selection seeds); a set noise_scale is used as given."""
    from dataclasses import replace

    s = make_strategy("auto", **options)
    s.setup(replace(_ctx(preset("hetero-4")), optimizer=optimizer))
    assert s._stat().noise_scale == prior


@pytest.mark.parametrize(("optimizer", "options", "smallest"),
                         [("sgd", {}, 8), ("adamw", {}, 2), ("adam", {"min_batch": 4}, 4),
                          ("sgd", {"min_batch": 3}, 3)])
def test_the_smallest_batch_follows_the_lr_rule(optimizer: str, options: dict[str, int],
                                                smallest: int) -> None:
    """min_batch 0: the planner's batches start at 8 for SGD, at 2 for Adam-type optimizers
    (the tiny GPT's lone device is fastest at batch 2-4); a set min_batch is used as given."""
    from dataclasses import replace

    s = make_strategy("auto", **options)
    s.setup(replace(_ctx(preset("hetero-4")), optimizer=optimizer))
    assert s._grid[0] == smallest and s.global_batch >= smallest


def test_a_lost_worker_is_planned_out() -> None:
    s = make_strategy("auto")
    s.setup(_ctx(preset("hetero-4")))
    assert 3 in s.goodput_plan.active
    for w in range(4):
        s.next_task(w)
    s.on_worker_lost(3)
    assert s.goodput_plan.shares[3] == 0 and sum(s.goodput_plan.shares) == s.samples_per_round


def test_bad_options_are_one_line_errors() -> None:
    for bad in ({"min_device_batch": 0}, {"local_step_penalty": 2.0}, {"hysteresis": -1.0},
                {"max_batch_growth": 0.5}, {"replan_every_epochs": 0.0}):
        with pytest.raises(ConfigError, match="strategy auto"):
            make_strategy("auto", **bad)


def _cfg(cluster, epochs: float = 3.0, target: float = 0.0, **options):
    return config_from_dict({
        "name": "t-auto", "cluster": cluster.to_dict() if isinstance(cluster, Cluster) else cluster,
        "workload": {"model": "mlp", "dataset": "digits"},
        "strategy": {"name": "auto", **options},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"batch_size": 16, "seed": 0, "eval_every_epochs": 0.5},
        "stop": {"max_epochs": epochs, "target_accuracy": target}})


def test_auto_trains_and_logs_the_noise_scale(digits_mlp) -> None:
    prep = prepare(_cfg("hetero-4"), workload=digits_mlp)
    r = Simulator(prep).run()
    assert r.final_accuracy > 0.85
    stats = r.summary["strategy_stats"]
    assert stats["noise_probes"] > 100 and stats["noise_scale"] > 0
    rows = r.rows[1:]
    assert all("noise_scale" in row and row["global_batch"] >= 8 for row in rows)
    assert rows[-1]["noise_scale"] is not None and rows[-1]["lr_scale"] <= 2.0


def test_the_simulator_moves_the_ps_and_trains_where_the_plan_says(digits_mlp) -> None:
    prep = prepare(_cfg(_two_sites(fast_far=True), epochs=1.0), workload=digits_mlp)
    assert prep.cluster.ps_site == "far"
    r = Simulator(prep).run()
    pushes = [w["pushes"] for w in r.summary["workers"]]
    assert pushes[0] <= 1 and min(pushes[1:]) > 20   # the slow home device only probed once


def test_a_far_cluster_trains_on_the_fastest_device_alone(digits_mlp) -> None:
    prep = prepare(_cfg(_two_sites(fast_far=False), epochs=1.0, move_ps=False),
                   workload=digits_mlp)
    r = Simulator(prep).run()
    assert r.summary["strategy_stats"]["active_devices"] == 1
    pushes = [w["pushes"] for w in r.summary["workers"]]
    assert pushes[0] >= 4 and max(pushes[1:]) <= 1


@pytest.mark.multiproc
def test_a_real_run_is_told_where_rank_0_should_run(digits_mlp, caplog) -> None:
    from dataclasses import replace

    cfg = replace(_cfg(_two_sites(fast_far=True), epochs=1.0), engine="dist")
    with caplog.at_level("WARNING", logger="hetrain"):
        prep = prepare(cfg, workload=digits_mlp)
    assert prep.cluster.ps_site == "far"
    assert "parameter server in site 'far'" in caplog.text and "rank 0" in caplog.text


def test_a_device_that_rejoins_starts_with_a_fresh_optimizer() -> None:
    s = make_strategy("auto")
    s.setup(_ctx(preset("hetero-4")))
    first = {w: s.next_task(w) for w in sorted(s._members)}
    assert all(t.reset_optimizer for t in first.values())
    assert not any(s.next_task(w).reset_optimizer for w in first)   # members keep their state
    s.on_worker_lost(0)                    # device 0 sits out of the next plans...
    assert s.goodput_plan.shares[0] == 0 and 0 not in s._trained
    s._caps[0] = float("inf")              # ...comes back, and is planned in again
    s._lost.discard(0)
    s._replan()
    s._members.add(0)                      # (what the next round's close does)
    assert s.goodput_plan.shares[0] > 0 and s.next_task(0).reset_optimizer


def _timed_rounds(s, rounds: int, per_member_s: float) -> None:
    """Rounds whose members take exactly the cluster model's time, and whose PS then spends
    `per_member_s` per member (serially), as real processes do and no cluster file says."""
    from hetrain.plan.goodput import cluster_costs

    cl, ctx = s.context.cluster, s.context
    comm = cluster_costs(cl, s.ps_site, ctx.flops_per_sample, ctx.model_bytes).comm_s
    clock = 0.0
    for _ in range(rounds):
        members = sorted(s._members)
        tasks = {w: s.next_task(w) for w in members}
        own = {w: tasks[w].samples * ctx.flops_per_sample / cl.devices[w].flops
               + tasks[w].local_steps * cl.devices[w].step_overhead_s for w in members}
        clock += max(comm[w] + own[w] for w in members) + per_member_s * len(members)
        for w in members:
            s.on_push(Push(worker=w, base_version=0, samples=tasks[w].samples,
                           steps=tasks[w].local_steps, loss=1.0, compute_s=own[w],
                           comm_s=comm[w], arrival_s=clock, probe=None))


def test_the_ps_cost_no_cluster_file_lists_is_measured_and_priced() -> None:
    exact = make_strategy("auto", replan_every_epochs=0.01)
    exact.setup(_ctx(preset("hetero-4")))
    _timed_rounds(exact, 100, per_member_s=0.0)
    assert exact.stats()["measured_member_s"] == 0.0      # the model explains every round

    slow_ps = make_strategy("auto", replan_every_epochs=0.01)
    slow_ps.setup(_ctx(preset("hetero-4")))
    start = slow_ps.goodput_plan
    _timed_rounds(slow_ps, 300, per_member_s=0.05)
    assert slow_ps.stats()["measured_member_s"] == pytest.approx(0.05, rel=0.05)
    end = slow_ps.goodput_plan
    # 50 ms per member: rounds grow (bigger G or more local steps) or the plan has fewer members
    assert (end.global_batch * end.local_steps > start.global_batch * start.local_steps
            or len(end.active) < len(start.active))

    unmeasured = make_strategy("auto", replan_every_epochs=0.01, measure_member_cost=False)
    unmeasured.setup(_ctx(preset("hetero-4")))
    _timed_rounds(unmeasured, 300, per_member_s=0.05)
    assert unmeasured.goodput_plan.global_batch == start.global_batch


def test_one_device_alone_takes_its_local_steps_without_a_ramp() -> None:
    """The round-growth cap is for replicas averaged together: a PS that costs 50 ms per
    message makes the fast device alone with many local steps the best plan, and auto goes
    there in one switch (ramping H 1, 2, 4, ... would only spend rounds on PS trips)."""
    s = make_strategy("auto", replan_every_epochs=1.0)
    s.setup(_ctx(preset("hetero-4")))
    _timed_rounds(s, s.MEMBER_ROUNDS + 3, per_member_s=0.05)
    (_, g0, h0), (_, g1, h1) = s.switches
    assert len(s.goodput_plan.active) == 1 and g1 * h1 > 2 * g0 * h0


def test_a_ps_cost_far_above_the_model_changes_the_plan_at_once() -> None:
    """Not at the next scheduled check (here an epoch away): a few rounds after it is measured."""
    s = make_strategy("auto", replan_every_epochs=1.0)
    s.setup(_ctx(preset("hetero-4")))
    start = s.goodput_plan
    _timed_rounds(s, s.MEMBER_ROUNDS + 3, per_member_s=0.05)
    assert len(s.switches) == 2 and s._samples_seen < 0.05 * s.context.train_samples
    end = s.goodput_plan
    assert (end.global_batch * end.local_steps > start.global_batch * start.local_steps
            or len(end.active) < len(start.active))
    # the same cost measured on: no further switch until the scheduled check
    _timed_rounds(s, 30, per_member_s=0.05)
    assert len(s.switches) == 2

    exact = make_strategy("auto", replan_every_epochs=1.0)
    exact.setup(_ctx(preset("hetero-4")))
    _timed_rounds(exact, 40, per_member_s=0.0)
    assert len(exact.switches) == 1


def test_the_fastest_device_slow_at_first_is_re_measured_and_rejoins(digits_mlp) -> None:
    """hetero-4's speed-4 device runs at 2% of its speed for its first 0.3 virtual s (a
    first task's one-time costs, say): auto leaves it out after that task, and only a
    re-probe brings it back."""
    slow_start = [(0.0, 3, 0.02), (0.3, 3, 1.0)]

    def run(reprobe_after_s: float) -> tuple[Simulator, dict]:
        prep = prepare(_cfg("hetero-4", epochs=6.0, reprobe_after_s=reprobe_after_s),
                       workload=digits_mlp)
        sim = Simulator(prep, speed_schedule=slow_start)
        return sim, sim.run().summary

    (stuck, stuck_run), (back, back_run) = run(0.0), run(0.2)
    assert stuck.strategy.history[1][3] == 0 and back.strategy.history[1][3] == 0  # left out
    assert stuck.strategy.history[-1][3] == 0                # never measured again
    shares = back.strategy.history[-1]
    assert shares[3] == max(shares) and shares[3] >= 1.5 * shares[2]   # back, the fastest
    samples = [summary["workers"][3]["samples"] for summary in (stuck_run, back_run)]
    assert samples[0] < 50 and samples[1] > 1000
    assert back_run["time_s"] < 0.8 * stuck_run["time_s"]   # the same 6 epochs, sooner


def test_adam_pushes_gradients_and_sgd_deltas() -> None:
    """push = "auto": one optimizer step at the PS on the round's mean gradient with Adam-type
    optimizers (so every plan has H = 1), parameter deltas with SGD or explicit local steps."""
    from dataclasses import replace

    ctx = _ctx(_two_sites(fast_far=False))
    cases = [("sgd", {}, "delta"), ("adamw", {}, "gradient"), ("adam", {}, "gradient"),
             ("adamw", {"local_steps": 4}, "delta"), ("adamw", {"push": "delta"}, "delta"),
             ("sgd", {"push": "gradient"}, "gradient")]
    for optimizer, options, expected in cases:
        s = make_strategy("auto", move_ps=False, **options)
        s.setup(replace(ctx, optimizer=optimizer))
        assert s.pushes == expected and s.stats()["pushes"] == expected, (optimizer, options)
        said = "\n".join(s.explain_plan(s.context.cluster, 1e6)[1])
        assert ("members push gradients" in said) == (expected == "gradient")
        if expected == "gradient":
            assert s.goodput_plan.local_steps == 1
    # the far cluster's plan with deltas: the slow home device alone, with local steps
    s = make_strategy("auto", move_ps=False)
    s.setup(ctx)
    assert s.goodput_plan.local_steps > 1
    with pytest.raises(ConfigError, match=r'push = "gradient".*local_steps = 4'):
        make_strategy("auto", push="gradient", local_steps=4)


def test_a_gradient_round_is_stepped_at_the_lr_scale_it_ran_with() -> None:
    """The PS's step on a round's gradients takes the lr scale of the plan the round ran
    under, also when closing it switches the plan (and the scale of the next round)."""
    from dataclasses import replace

    s = make_strategy("auto", replan_every_epochs=0.01, min_probes=1)
    s.setup(replace(_ctx(preset("hetero-4")), optimizer="adamw"))
    rescaled = 0        # rounds whose close switched the plan to another lr scale
    for _ in range(400):
        members = sorted(s._members)
        scales = {s.next_task(w).lr_scale for w in members}
        assert scales == {s.lr_scale}
        ran_with = scales.pop()
        for w in members:
            decision = s.on_push(Push(worker=w, base_version=0, samples=s._shares[w],
                                      steps=1, loss=1.0, compute_s=0.01, comm_s=0.001,
                                      arrival_s=0.0, probe=_probe(4000.0, 16)))
        assert decision.apply and decision.lr_scale == pytest.approx(ran_with)
        rescaled += s.lr_scale != pytest.approx(ran_with)
    assert rescaled >= 1
    sgd = make_strategy("auto")
    sgd.setup(_ctx(preset("hetero-4")))
    assert _run_rounds(sgd, 1, noise=32.0).lr_scale == 1.0   # deltas: the workers' lr


def test_auto_with_adamw_trains_by_gradient_pushes(digits_mlp) -> None:
    """On the simulator: the workers keep no optimizer state (the PS steps AdamW)."""
    from dataclasses import replace

    cfg = _cfg("hetero-4", epochs=2.0)
    cfg = replace(cfg, optimizer=replace(cfg.optimizer, name="adamw", lr=0.003))
    sim = Simulator(prepare(cfg, workload=digits_mlp))
    r = sim.run()
    assert r.summary["strategy_stats"]["pushes"] == "gradient"
    assert r.final_accuracy > 0.85
    assert all(not rep.optimizer.state for rep in sim.replicas)
    assert sim.server.optimizer.state                     # AdamW's moments live at the PS
