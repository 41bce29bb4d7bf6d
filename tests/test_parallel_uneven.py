"""Plans with uneven batch shares (StagePlan.shares) on 4 gloo processes train exactly like
one process; checkpoints gather and restore their replicas; bad shares fail in one line."""

from __future__ import annotations

import dataclasses
import functools
import json
from itertools import accumulate
from pathlib import Path

import pytest
import torch

from hetrain.errors import ConfigError
from hetrain.plan.cost import Plan, StagePlan, read_plan_file, training_flops_per_sample
from hetrain.plan.graph import gpt_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import template_plan
from hetrain.workloads import MODELS
from hetrain.workloads.base import cross_entropy
from test_parallel import M4, M22, _assert_same_losses, _batches, _vgg_run


def _with_shares(plan: Plan, *shares: int) -> Plan:
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0],
                                                                 shares=shares),))


def _gpt_run():  # type: ignore[no-untyped-def]
    """test_parallel's GPT (same sizes and batches) under uneven plans: 1-D, 2-D dp x tp and
    a 1-D mesh on ranks 0 and 2 only."""
    from hetrain.parallel.runs import PlanRun

    V, T, B = 32, 16, 8
    g = gpt_graph(2, 32, 4, V, T, B)
    plans = (_with_shares(template_plan(g, M4, "dp"), 5, 1, 1, 1),
             _with_shares(template_plan(g, M22, "dp-tp"), 6, 2),
             _with_shares(template_plan(g, Mesh((2,), (0, 2)), "dp"), 6, 2))
    return PlanRun(functools.partial(MODELS["gpt"], (T,), V, n_layer=2, n_head=4, n_embd=32),
                   cross_entropy, g, plans,
                   _batches(lambda gen: (torch.randint(0, V, (B, T), generator=gen),
                                         torch.randint(0, V, (B, T), generator=gen))), lr=0.5)


def _uneven_vgg_run():  # type: ignore[no-untyped-def]
    run = _vgg_run()
    return dataclasses.replace(run, plans=(_with_shares(template_plan(run.graph, M4, "dp"),
                                                        4, 2, 1, 1),))


def _checkpoint_run():  # type: ignore[no-untyped-def]
    """The 2-D GPT plan with AdamW (optimizer state to gather and restore)."""
    run = _gpt_run()
    return dataclasses.replace(run, plans=run.plans[1:2], optimizer="adamw", lr=0.01)


def _round_trip(rank: int, run, plan: Plan) -> dict | None:  # type: ignore[no-untyped-def]
    """Train under the plan, gather the checkpoint (train._gather), restore it into a model
    built under another seed (train._restore) and take two more steps with both: the second
    step's loss depends on the first update, i.e. on the restored Adam state too."""
    from hetrain.parallel.execute import make_executor
    from hetrain.parallel.runs import _optimizer
    from hetrain.parallel.train import _gather, _restore, broadcast_from_rank0

    def build(seed: int):  # type: ignore[no-untyped-def]
        torch.manual_seed(seed)
        model = run.build_model()
        ex = make_executor(model, run.graph, plan, run.loss_fn)
        return model, ex, _optimizer(run, ex.parameters())

    model, ex, opt = build(run.seed)
    for x, y in run.batches:
        ex.step(x, y, opt)
    got = _gather(model, ex.parameters(), opt, 0.0, with_optimizer=True)
    full = broadcast_from_rank0(got[:2] if got is not None else None)
    fresh, ex2, opt2 = build(run.seed + 1)
    _restore(fresh, ex2.parameters(), opt2, full[0], full[1], opt.param_groups)
    after = [(ex.step(x, y, opt), ex2.step(x, y, opt2)) for x, y in run.batches[:2]]
    if got is None:
        return None
    # numpy, not tensors: torch would pass tensors back by file descriptor of a dead process
    return {"weights": {k: v.numpy() for k, v in got[0].items()},
            "states": {k: {n: v.numpy() for n, v in s.items()} for k, s in got[1].items()},
            "after": after}


def _padded(rank: int, run) -> list[tuple[float, float, float, float]]:  # type: ignore[no-untyped-def]
    """Two steps of each GPT plan (uneven 1-D and 2-D, and even DTensor dp) with rank 3
    emulating a slow device (0.3 s of compute, whatever its samples) and the others
    unthrottled, and the same without emulation: (first loss, the same without emulation,
    rank 0's second step time, the same without)."""
    import time

    import torch.distributed as dist

    from hetrain.parallel.execute import make_executor
    from hetrain.parallel.runs import _optimizer

    out = []
    x, y = run.batches[0]
    for plan in (*run.plans[:2], template_plan(run.graph, M4, "dp")):
        losses, took = [], []
        for budget in (None, (lambda n: 0.3) if rank == 3 else None):
            torch.manual_seed(run.seed)
            ex = make_executor(run.build_model(), run.graph, plan, run.loss_fn,
                               compute_budget=budget)
            opt = _optimizer(run, ex.parameters())
            losses.append(ex.step(x, y, opt))  # the first step also pays set-up costs
            dist.barrier()
            t0 = time.perf_counter()
            ex.step(x, y, opt)
            took.append(time.perf_counter() - t0)
        out.append((losses[1], losses[0], took[1], took[0]))
    return out


def _every_run(rank: int, world: int, runs, ckpt) -> tuple:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import plans_worker

    return ([plans_worker(rank, world, run) for run in runs],
            [_round_trip(rank, ckpt, plan) for plan in ckpt.plans], _padded(rank, runs[0]))


@pytest.fixture(scope="module")
def trained() -> dict:
    """Every uneven run on one group of 4 gloo processes: name -> (run, rank 0's results)."""
    from hetrain.parallel.launch import run_local

    runs = {"gpt": _gpt_run(), "vgg": _uneven_vgg_run()}
    ckpt = _checkpoint_run()
    results, state, padded = run_local(_every_run, 4, (tuple(runs.values()), ckpt),
                                       timeout_s=150)[0]
    out = {name: (run, res) for (name, run), res in zip(runs.items(), results, strict=True)}
    out["checkpoint"] = (ckpt, state)
    out["padded"] = (None, padded)
    return out


@pytest.mark.dist
def test_a_slow_device_emulated_by_its_compute_budget_delays_every_rank(trained) -> None:  # type: ignore[no-untyped-def]
    """The padding sits before the gradient sync: rank 0 waits for rank 3's emulated
    compute; the padding changes no number. Ranks leave a barrier a few ms apart (rank 3's
    0.3 s may start before rank 0's clock: 0.299 s was seen), hence 0.28. The budget is a
    total, not an addition: on a loaded machine the unpadded step took 0.12 s and the padded
    one 0.31 s, so the margin over the unpadded step is 0.1 (with padding off it is ~0)."""
    for loss, plain, took, unpadded in trained["padded"][1]:
        assert loss == plain
        assert took >= 0.28 and took - unpadded >= 0.1


@pytest.mark.dist
def test_gpt_with_uneven_shares_trains_like_one_process(trained) -> None:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import reference_run

    run, results = trained["gpt"]
    assert [p.stages[0].shares for p in run.plans] == [(5, 1, 1, 1), (6, 2), (6, 2)]
    _assert_same_losses(results, reference_run(run))


@pytest.mark.dist
def test_vgg_with_uneven_shares_trains_like_one_process(trained) -> None:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import reference_run

    run, results = trained["vgg"]
    _assert_same_losses(results, reference_run(run))


def test_the_shares_weighting_is_what_the_reference_checks() -> None:
    """With these shares the plain mean of the rows' losses is not the batch mean, so a
    run that forgot the shares[j] / G weights would fail the comparisons above."""
    for run in (_gpt_run(), _uneven_vgg_run()):
        torch.manual_seed(run.seed)
        model = run.build_model()
        x, y = run.batches[0]
        with torch.no_grad():
            for plan in run.plans:
                shares = plan.stages[0].shares
                ends = accumulate(shares)
                rows = [run.loss_fn(model(x[b - s:b]), y[b - s:b])
                        for s, b in zip(shares, ends, strict=True)]
                weighted = sum(s / sum(shares) * r for s, r in zip(shares, rows, strict=True))
                whole = run.loss_fn(model(x), y)
                assert float(weighted) == pytest.approx(float(whole), rel=1e-5)
                assert float(sum(rows) / len(rows)) != pytest.approx(float(whole), rel=1e-3)


def _reference_weights(run) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    torch.manual_seed(run.seed)
    model = run.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, foreach=False)
    for x, y in run.batches:
        opt.zero_grad(set_to_none=True)
        run.loss_fn(model(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.dist
def test_checkpoint_gathers_the_replicas_and_restores_them(trained) -> None:  # type: ignore[no-untyped-def]
    run, (state,) = trained["checkpoint"]
    ref = _reference_weights(run)
    assert set(state["weights"]) == set(ref) and set(state["states"]) == set(ref)
    for name, p in ref.items():
        w = torch.from_numpy(state["weights"][name])
        assert w.shape == p.shape  # full, not a row's shard
        # AdamW divides tiny gradients (attention's key bias: zero but for float noise) by
        # their tiny RMS, so float order moves weights by up to ~1e-4 here, under the even
        # dp-tp plan as well; an old or foreign replica is off by whole steps (lr = 1e-2)
        torch.testing.assert_close(w, p, rtol=0, atol=1e-3)
        adam = state["states"][name]
        assert float(adam["step"]) == len(run.batches)
        assert adam["exp_avg"].shape == adam["exp_avg_sq"].shape == p.shape
    for trained_on, restored in state["after"]:
        assert restored == pytest.approx(trained_on, rel=1e-6)


# ---- one-line refusals -------------------------------------------------------------------------
def _plan_dict(**stage) -> dict:  # type: ignore[no-untyped-def]
    g = gpt_graph(1, 32, 4, 32, 16, 8)
    d = template_plan(g, M4, "dp").to_dict()
    d["stages"][0].update(stage)
    return d


@pytest.mark.parametrize("change, words", [
    (dict(shares=[5, 1, 1]), "one count >= 1 per index"),
    (dict(shares=[5, 3, 0, 0]), "one count >= 1 per index"),
    (dict(shares=[5, 1, 1, 1], signatures=None), "data parallel"),
    (dict(shares=[5, 1, 1, 1], n_micro=2), "multiples of n_micro"),
])
def test_bad_shares_in_a_plan_file_fail_in_one_line(tmp_path: Path, change, words) -> None:  # type: ignore[no-untyped-def]
    d = _plan_dict(shares=change["shares"])
    if "signatures" in change:
        d["stages"][0]["signatures"][1] = "col"
    if "n_micro" in change:  # two stages: shares on a pipeline
        st = d["stages"][0]
        half = len(st["ops"]) // 2
        d["stages"] = [dict(st, ops=st["ops"][:half], signatures=st["signatures"][:half]),
                       dict(st, ops=st["ops"][half:], signatures=st["signatures"][half:])]
        d["n_micro"] = 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=words) as e:
        read_plan_file(path)
    assert len(str(e.value).splitlines()) == 1 and str(path) in str(e.value)


def test_each_device_is_credited_its_rows_share_of_the_samples() -> None:
    from hetrain.parallel.train import _worker_times
    from hetrain.report.metrics import MetricsLog, WorkerTimes

    log = MetricsLog("t", [WorkerTimes(f"d{i}") for i in range(5)], None)
    g = gpt_graph(1, 32, 4, 32, 16, 8)
    _worker_times(log, [1.0] * 5, 2.0, 3 * 8, _with_shares(template_plan(g, M22, "dp-tp"), 5, 3))
    assert [w.samples for w in log.workers] == [8, 7, 5, 4, 0]  # 15 and 9 over 2 each
    _worker_times(log, [1.0] * 5, 2.0, 3 * 8, template_plan(g, M22, "dp-tp"))
    assert [w.samples for w in log.workers] == [5, 5, 5, 5, 4]  # unchanged: even over all


def test_shares_that_do_not_fit_the_batch_or_the_row_mesh_are_refused() -> None:
    from hetrain.parallel.train import _check_executable, _layout

    g = gpt_graph(1, 32, 4, 32, 16, 8)
    model = MODELS["gpt"]((16,), 32, n_layer=1, n_head=4, n_embd=32)
    good = _with_shares(template_plan(g, M4, "dp"), 5, 1, 1, 1)
    _check_executable(model, g, good, "gpipe")
    assert _layout(good) == "mesh 4 on devices [0, 1, 2, 3], batch shares [5, 1, 1, 1]"
    with pytest.raises(ConfigError, match="sum to 9, not the batch 8"):
        _check_executable(model, g, _with_shares(good, 6, 1, 1, 1), "gpipe")
    # inner dp on rows of 2 devices: a row's share must split in two
    dpdp = template_plan(g, M22, "dp-dp")
    _check_executable(model, g, _with_shares(dpdp, 6, 2), "gpipe")
    with pytest.raises(ConfigError, match="share of 1 samples") as e:
        _check_executable(model, g, _with_shares(dpdp, 7, 1), "gpipe")
    assert len(str(e.value).splitlines()) == 1


def _column_pipeline(g, shares: tuple[int, int], n_micro: int = 2) -> Plan:  # type: ignore[no-untyped-def]
    """2 data-parallel stages of 2 devices (0, 1 | 2, 3) cut at the second block, its
    columns (0, 2) and (1, 3) taking `shares` of every batch."""
    cut = next(i for i, op in enumerate(g.ops) if op.name == "blocks.1.ln1")
    meshes = (Mesh((2,), (0, 1)), Mesh((2,), (2, 3)))
    return Plan(g.name, tuple(
        StagePlan(mesh, tuple(op.name for op in g.ops[a:b]), ("dp",) * (b - a), shares)
        for mesh, (a, b) in zip(meshes, ((0, cut), (cut, len(g.ops))), strict=True)), n_micro)


def test_a_column_pipeline_is_checked_laid_out_and_credited_per_column() -> None:
    """hetrain run's view of a pipeline with shares: it runs (the schedule's micro-batch
    rule included), its layout names the shares, and device j of every stage is credited
    its column's samples."""
    from hetrain.parallel.train import _check_executable, _layout, _worker_times
    from hetrain.report.metrics import MetricsLog, WorkerTimes

    g = gpt_graph(2, 32, 4, 32, 16, 8)
    model = MODELS["gpt"]((16,), 32, n_layer=2, n_head=4, n_embd=32)
    plan = _column_pipeline(g, (6, 2))
    _check_executable(model, g, plan, "1f1b")
    assert _layout(plan) == ("mesh 2 on devices [0, 1], batch shares [6, 2] | mesh 2 on devices "
                             "[2, 3], batch shares [6, 2], 2 micro-batches")
    with pytest.raises(ConfigError, match="multiples of n_micro"):
        _check_executable(model, g, _column_pipeline(g, (6, 2), n_micro=4), "gpipe")
    with pytest.raises(ConfigError, match="1f1b"):
        _check_executable(model, g, _column_pipeline(g, (4, 4), n_micro=1), "1f1b")
    log = MetricsLog("t", [WorkerTimes(f"d{i}") for i in range(5)], None)
    _worker_times(log, [1.0] * 5, 2.0, 3 * 8, plan)
    assert [w.samples for w in log.workers] == [18, 6, 18, 6, 0]


# ---- hetrain run ------------------------------------------------------------------------------
def _run_plan_files(tmp_path: Path, plans: dict[str, Plan], devices: str) -> dict[str, list]:  # type: ignore[type-arg]
    """`hetrain run` (0.2 epochs) under each plan saved as a plan file on the cluster of
    `devices`; each run's metrics rows."""
    from test_parallel_run import hetrain, rows, write_config

    got = {}
    for name, plan in plans.items():
        plan.save(tmp_path / f"{name}.json", {"devices": devices.count("name =")})
        cfg = write_config(tmp_path, name, epochs=0.2, parallel=f'plan = "{name}.json"',
                           devices=devices)
        r = hetrain("run", str(cfg), "--runs-dir", str(tmp_path / "runs"), "--quiet",
                    "--no-plot")
        assert r.returncode == 0, r.stderr
        got[name] = rows(tmp_path / "runs" / name)
    return got


@pytest.mark.dist
@pytest.mark.slow  # two runs (~25 s); test_hetrain_run_auto_plan_... covers the path by default
@pytest.mark.timeout(300)
def test_hetrain_run_trains_under_a_plan_file_with_shares(tmp_path: Path) -> None:
    """A slow and a three times faster device, each holding the model: the plan file gives
    the fast one 6 of every 8 samples. The run evaluates, checkpoints and summarises, and
    trains like the even data-parallel plan (same batches, same mean loss). Speeds are
    emulated (dist.emulate = "cluster", the default): every step lasts at least the slowest
    row's padded compute, 2 samples on the slow device (4 under the even plan)."""
    from test_parallel_run import vocab

    devices = ('{ name = "slow", flops = 2e8, memory_bytes = 2000000 }, '
               '{ name = "fast", flops = 6e8, memory_bytes = 2000000 }')
    graph = gpt_graph(2, 32, 2, vocab(), 32, 8)
    even = template_plan(graph, Mesh((2,), (0, 1)), "dp")
    got = _run_plan_files(tmp_path, {"shares": _with_shares(even, 2, 6), "even": even}, devices)
    run_dir = tmp_path / "runs" / "shares"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"]["plan"]["stages"][0]["shares"] == [2, 6]
    assert summary["parallel"]["layout"] == "mesh 2 on devices [0, 1], batch shares [2, 6]"
    assert [w["samples"] for w in summary["workers"]] == [29 * 2, 29 * 6]
    uneven = got["shares"]
    assert len(uneven) == 2 and uneven[-1]["updates"] == 29 and uneven[-1]["samples"] == 29 * 8
    assert uneven[-1]["test_loss"] < uneven[0]["test_loss"] < 4.0  # ln(92) = 4.5 at the start
    for key in ("test_loss", "train_loss"):
        assert [x[key] for x in uneven] == pytest.approx([x[key] for x in got["even"]], rel=1e-4)
    ck = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ck["model"]["head.weight"].shape == (vocab(), 32)
    assert set(ck["optimizer"]["state"]) == set(ck["model"])
    fps = training_flops_per_sample(graph)
    for name, slow_samples in (("shares", 2), ("even", 4)):
        par = json.loads((tmp_path / "runs" / name / "summary.json").read_text())["parallel"]
        assert par["emulated_speeds"] == "cluster"
        assert par["measured_step_s"] >= slow_samples * fps / 2e8  # 61 and 123 ms


@pytest.mark.dist
@pytest.mark.slow  # two runs of 4 processes (~40 s)
@pytest.mark.timeout(300)
def test_hetrain_run_trains_a_column_pipeline_from_a_plan_file(tmp_path: Path) -> None:
    """Devices 0 and 2 three times faster than 1 and 3: the plan file's 2-stage pipeline
    gives column (0, 2) 6 of every 8 samples. The run evaluates, checkpoints the whole model
    and summarises, and trains like the same pipeline with even data-parallel stages."""
    from test_parallel_run import vocab

    devices = ", ".join(f'{{ name = "d{i}", flops = {f}, memory_bytes = 2000000 }}'
                        for i, f in enumerate(("6e8", "2e8", "6e8", "2e8")))
    graph = gpt_graph(2, 32, 2, vocab(), 32, 8)
    columns = _column_pipeline(graph, (6, 2))
    even = dataclasses.replace(columns, stages=tuple(dataclasses.replace(st, shares=())
                                                     for st in columns.stages))
    got = _run_plan_files(tmp_path, {"columns": columns, "even": even}, devices)
    run_dir = tmp_path / "runs" / "columns"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"]["layout"].endswith("batch shares [6, 2], 2 micro-batches")
    steps = got["columns"][-1]["updates"]
    assert [w["samples"] for w in summary["workers"]] == [steps * 6, steps * 2] * 2
    assert got["columns"][-1]["test_loss"] < got["columns"][0]["test_loss"]
    for key in ("test_loss", "train_loss"):
        assert [x[key] for x in got["columns"]] == pytest.approx(
            [x[key] for x in got["even"]], rel=1e-4)
    ck = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ck["model"]["head.weight"].shape == (vocab(), 32)
    assert ck["model"]["tok_emb.weight"].shape[1] == 32  # stage 0's and stage 1's, whole
    assert set(ck["optimizer"]["state"]) == set(ck["model"])


def test_compute_budget_follows_the_cluster_file_and_dist_emulate() -> None:
    """dist.emulate = "cluster" pads a one-stage plan's ranks to their device's time (x
    time_scale); "none" does not; pipelines too (each stage pads to its share, test_pipeline);
    "relative" is refused."""
    from hetrain.cluster import Cluster, Device, Link, Site
    from hetrain.config import config_from_dict
    from hetrain.parallel.train import check_supported, compute_budget, emulation
    from hetrain.plan.split import pipeline_plan

    site = Site("s", Link(1e9, 1e-4), Link(1e9, 1e-4))
    cluster = Cluster("c", (Device("a", 1e9, site="s", step_overhead_s=0.01),
                            Device("b", 4e9, site="s")), (site,))
    g = gpt_graph(2, 32, 4, 32, 16, 8)
    one_stage = template_plan(g, Mesh((2,), (0, 1)), "dp")
    piped = pipeline_plan(g, [0, g.stage_starts()[0], len(g.ops)],
                          [Mesh((1,), (0,)), Mesh((1,), (1,))], 2)
    fps = training_flops_per_sample(g)

    def cfg(**dist):  # type: ignore[no-untyped-def]
        return config_from_dict({"engine": "dist", "workload": {"model": "gpt", "dataset": "text"},
                                 "dist": {"time_scale": 0.5, **dist}, "parallel": {}})

    budget = compute_budget(cfg(), cluster, g, one_stage, 0)
    assert budget is not None and budget(3) == pytest.approx(0.5 * (0.01 + 3 * fps / 1e9))
    fast = compute_budget(cfg(), cluster, g, one_stage, 1)
    assert fast is not None and fast(3) == pytest.approx(0.5 * 3 * fps / 4e9)
    assert compute_budget(cfg(emulate="none"), cluster, g, one_stage, 0) is None
    piped_budget = compute_budget(cfg(), cluster, g, piped, 0)  # the stage takes its share
    assert piped_budget is not None and piped_budget(3) == pytest.approx(budget(3))
    assert emulation(cfg(), piped) == "cluster" and emulation(cfg(emulate="none"), piped) == "none"
    with pytest.raises(ConfigError, match="relative"):
        check_supported(cfg(emulate="relative"))
