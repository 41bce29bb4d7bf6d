"""`auto` (goodput planning) against the cluster's fastest device alone, tuned, and DDP (simulated).

    .venv/bin/python benchmarks/goodput.py [--workload mnist1d-cnn|text-gpt]
        [--clusters hetero-4 hetero-8 geo-16 lab-6] [--select-seeds 0 1 2]
        [--report-seeds 3 4 5] [--epochs E] [--jobs 2] [--from-json RESULTS.json]
        [--widen-json RESULTS.json] [--rerun-auto RESULTS.json]
        [--extend-json RESULTS.json --report-seeds 6 7 8 --out NAME]

On the simulator (virtual clock, real gradients), every run evaluated every 0.5 virtual
seconds (the same time granularity for a lone device and a cluster). Workloads: the MNIST-1D
CNN (SGD lr 0.05 momentum 0.9, targets 85% and 90% test accuracy, 5 epochs) and the tiny GPT
on the text corpus (AdamW lr 3e-3, targets test loss 2.6 and 2.4, 1.5 epochs); batch 32.
Systems:
  * auto: its DEFAULT settings at the workload's base batch and lr, no tuning;
  * ddp: its defaults on the whole cluster;
  * the fastest device alone (plain training on one device, no communication), TUNED: batch
    {8, 16, 32, 64} x lr {0.5, 1, 2} x the base lr on the selection seeds (runs stop at the
    harder target or the workload's time limit), one setting picked per target: the lowest
    median TTA over the selection seeds, settings that miss the target on any selection seed
    ranked after those that never miss. While a pick sits on the edge of what was tried, the
    grid grows past that edge one step at a time (lr x 0.5 or x 2 at the picked batch, batch
    / 2 or x 2 at the picked lr; at most WIDEN_ROUNDS rounds), so no pick is a corner of the
    grid. Identical lone devices (hetero-8 and geo-16 share one) are tuned once.
Reported on the held-out seeds only: per seed, lone TTA / auto TTA and ddp TTA / auto TTA; the
median and min-max over seeds. Policy for a seed that misses a target within the epochs: its
TTA is infinite (so a ratio is 0 when auto misses, inf when the other misses), and the miss
count is shown. The final metric is the mean of a run's last 5 evaluations (one evaluation is
noisy); the gap is auto minus lone (accuracy points, or loss), and a paragraph below the table
says how noisy that gap is (final_noise: one run's spread over seeds, what it makes of the gap
between two identical systems, and auto's gap pooled over all its runs with a bootstrap
interval). The planner's predicted speed-up:
over auto's run up to its TTA, the time-weighted mean of the goodput model's ratio auto plan /
tuned lone device (hetrain.plan.goodput) at the noise scale auto planned with at that time; the
lone device's goodput is its throughput x its batch's statistical efficiency (at the lr tuning
chose for it, as the model assumes of every batch).
Writes benchmarks/results/<--out, default goodput or goodput_gpt>.{json,md}; --from-json
re-summarises a saved results file without running anything; --widen-json widens the lone
grid of a saved results file (runs only what it lacks: the simulator is deterministic for a
seed, so the saved runs are what a fresh run would give); --rerun-auto re-runs every auto
run of a saved results file and keeps its lone and DDP runs, after checking with today's code
that one lone selection run reproduces exactly and every DDP run gives the same TTA at every
target (the only figure taken from it; a DDP run whose losses moved in the last bits since
is counted) - for a change to auto alone, the others' runs would be the same; --extend-json
adds held-out seeds to a saved results file (auto, DDP and the lone device at its saved picks
on the new seeds, after one selection run and one auto run of the file reproduce exactly); the
new file holds only the new runs and names the saved one (its runs' digest checked whenever the
new file is re-summarised; keep the two side by side). --rerun-auto on such a file re-runs its
own auto runs and names its base's runs as they are then (re-run the base's first).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from common import results_dir, spread

EVAL_EVERY_S = 0.5
LONE_BATCHES = (8, 16, 32, 64)
LONE_LR_FACTORS = (0.5, 1.0, 2.0)
WIDEN_ROUNDS = 3
MIN_LONE_BATCH = 2
BASE_BATCH = 32
WORKLOADS: dict[str, dict[str, Any]] = {
    "mnist1d-cnn": {"workload": {"model": "cnn", "dataset": "mnist1d"},
                    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                    "metric": "accuracy", "targets": (0.85, 0.90), "epochs": 5.0,
                    "select_time_s": 30.0, "out": "goodput"},
    "text-gpt": {"workload": {"model": "gpt", "dataset": "text",
                              "dataset_options": {"max_chars": 300_000, "block_size": 32}},
                 "optimizer": {"name": "adamw", "lr": 3e-3},
                 "metric": "loss", "targets": (2.6, 2.4), "epochs": 1.5,
                 "select_time_s": 120.0, "out": "goodput_gpt"},
}
"""metric "loss": a target is reached when the test loss is at most it (lower is better)."""
LAB_6: dict[str, Any] = {
    # Not a preset: two fast GPUs in a lab, four slower cloud GPUs; the cluster file puts the
    # PS (and the data) in the cloud site, 20 ms and 1 Gbit/s away from the lab.
    "name": "lab-6", "ps_site": "cloud",
    "sites": [{"name": "cloud", "lan": {"bandwidth_Bps": 1.25e9, "latency_s": 5e-5},
               "wan": {"bandwidth_Bps": 1.25e8, "latency_s": 0.01}},
              {"name": "lab", "lan": {"bandwidth_Bps": 1.25e9, "latency_s": 5e-5},
               "wan": {"bandwidth_Bps": 1.25e8, "latency_s": 0.01}}],
    "devices": [{"name": "lab-gpu", "flops": 1.2e9, "site": "lab", "count": 2,
                 "step_overhead_s": 2e-3},
                {"name": "cloud-gpu", "flops": 3e8, "site": "cloud", "count": 4,
                 "step_overhead_s": 2e-3}],
}


def cluster_spec(name: str) -> str | dict[str, Any]:
    return LAB_6 if name == "lab-6" else name


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hetrain.baselines import fastest_alone
    from hetrain.config import config_from_dict
    from hetrain.runner import run_config

    torch.set_num_threads(1)
    spec = WORKLOADS[job["workload"]]
    alone = job["system"] == "lone"
    target_key = "target_accuracy" if spec["metric"] == "accuracy" else "target_loss"
    cfg = config_from_dict({
        "name": "bench", "cluster": cluster_spec(job["cluster"]),
        "workload": spec["workload"],
        "strategy": {"name": "ddp" if alone else job["system"], **job.get("options", {})},
        "optimizer": {**spec["optimizer"], "lr": job["lr"]},
        "train": {"batch_size": job["batch"], "seed": job["seed"], "eval_every_s": EVAL_EVERY_S},
        "stop": {"max_epochs": job["epochs"], target_key: job["stop_target"],
                 "stop_at_target": job["stop_target"] > 0, "max_time_s": job["max_time_s"]}})
    if alone:
        cfg = fastest_alone(cfg)
    t0 = time.perf_counter()
    r = run_config(cfg, runs_root=None)
    rows = [{k: row.get(k) for k in ("time_s", "test_accuracy", "test_loss", "noise_scale",
                                     "planned_noise_scale", "global_batch", "local_steps")}
            for row in r.rows]
    return {**job, "wall_s": time.perf_counter() - t0, "rows": rows,
            "strategy_stats": r.summary["strategy_stats"]}


def tta(rows: list[dict[str, Any]], target: float, metric: str = "accuracy") -> float:
    if metric == "accuracy":
        return next((r["time_s"] for r in rows if r["test_accuracy"] >= target), math.inf)
    return next((r["time_s"] for r in rows if r["test_loss"] <= target), math.inf)


def final_metric(rows: list[dict[str, Any]], metric: str = "accuracy") -> float:
    key = "test_accuracy" if metric == "accuracy" else "test_loss"
    return statistics.mean(r[key] for r in rows[-5:])


@functools.cache
def lone_key(cluster: str) -> str:
    """Runs of the fastest device alone depend only on that device: share them."""
    from hetrain.cluster import load_cluster

    d = load_cluster(cluster_spec(cluster)).fastest_alone().devices[0]
    return f"{d.flops:g}-{d.step_overhead_s:g}"


def first_of_each_lone(clusters: list[str]) -> dict[str, str]:
    """lone_key -> the first of `clusters` with that fastest device (its lone runs stand for
    every cluster sharing the device)."""
    lone_of = {c: lone_key(c) for c in clusters}
    return {k: next(c for c in clusters if lone_of[c] == k) for k in set(lone_of.values())}


def ttas_by_setting(selection: list[dict[str, Any]], target: float
                    ) -> dict[tuple[int, float], list[float]]:
    """Each (batch, lr) tried and its TTAs to `target` over the seeds, from selection records
    {batch, lr, tta_s: {str(target): seconds}}."""
    by: dict[tuple[int, float], list[float]] = {}
    for r in selection:
        by.setdefault((r["batch"], r["lr"]), []).append(float(r["tta_s"][str(target)]))
    return by


def pick(selection: list[dict[str, Any]], target: float) -> tuple[int, float]:
    """The tuned lone setting for `target` (see the module docstring) from selection records."""
    by = ttas_by_setting(selection, target)
    return min(by, key=lambda k: (sum(math.isinf(x) for x in by[k]), statistics.median(by[k])))


@functools.cache
def workload_costs(workload: str) -> tuple[float, int]:
    """FLOPs per sample and model bytes (the data set is generated once per workload)."""
    from hetrain.engine.core import model_bytes
    from hetrain.workloads import flops_per_sample, get_workload

    w = WORKLOADS[workload]["workload"]
    wl = get_workload(w["model"], w["dataset"], dataset_options=w.get("dataset_options", {}))
    return flops_per_sample(wl), model_bytes(wl.build_model())


def predicted_vs_lone(auto: dict[str, Any], lone_setting: tuple[int, float], cluster: str,
                      target: float, workload: str) -> float | None:
    """Time-weighted mean of the model's goodput ratio over auto's run up to its TTA."""
    from hetrain.cluster import load_cluster
    from hetrain.plan.goodput import StatModel, best_for, cluster_costs

    spec = WORKLOADS[workload]
    fps, mb = workload_costs(workload)
    exponent = 1.0 if spec["optimizer"]["name"] == "sgd" else 0.5
    cl = load_cluster(cluster_spec(cluster))
    st = auto["strategy_stats"]
    costs = cluster_costs(cl, st["ps_site"], fps, mb)
    lone = max(cl.devices, key=lambda d: d.flops)
    batch = lone_setting[0]
    end = tta(auto["rows"], target, spec["metric"])
    num = den = 0.0
    for a, b in itertools.pairwise(auto["rows"]):
        if a["time_s"] >= end or a["global_batch"] is None:
            break
        noise = a.get("planned_noise_scale") or BASE_BATCH
        stat = StatModel(noise, BASE_BATCH, 1.0, 8, 2.0, exponent)
        plan = best_for(costs, stat, a["global_batch"], a["local_steps"])
        if plan is None:
            continue
        lone_sps = batch / lone.compute_time_s(batch, fps)
        # the lone device's progress per sample: its batch's AdaScale gain. Its lr is the one
        # tuning found best for this batch and target, and the goodput model (as Pollux's)
        # compares batches each at a well-tuned lr; charging the lone device for an lr below
        # the AdaScale scale (as this did until stop 29) said a lower lr is slower, which its
        # own tuning contradicts, and over-predicted Adam 3-5x
        gain = StatModel(noise, BASE_BATCH, lr_exponent=exponent).lr_scale(batch) \
            ** (1 / exponent)
        lone_goodput = lone_sps * gain * BASE_BATCH / batch
        dt = b["time_s"] - a["time_s"]
        num += dt * plan.goodput / lone_goodput
        den += dt
    return num / den if den else None


def summ(xs: list[float]) -> dict[str, Any]:
    s = spread(xs)  # misses are inf here (the policy in the docstring and benchmarks/common)
    return {"median": s[0] if s else None, "min": s[1] if s else None,
            "max": s[2] if s else None, "values": xs}


def fmt(s: dict[str, Any], digits: int = 2) -> str:
    if s["median"] is None:
        return "n/a"
    def f(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x:.{digits}f}"

    return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"


def ratio(num: float, den: float) -> float:
    if math.isinf(den):
        return 0.0 if not math.isinf(num) else math.nan
    return num / den


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="mnist1d-cnn")
    ap.add_argument("--clusters", nargs="+", default=["hetero-4", "hetero-8", "geo-16", "lab-6"])
    ap.add_argument("--select-seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--report-seeds", nargs="+", type=int, default=[3, 4, 5])
    ap.add_argument("--epochs", type=float, default=0.0, help="0: the workload's default")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="", help="results name (default: the workload's)")
    ap.add_argument("--from-json", default="", help="re-summarise this results file")
    ap.add_argument("--widen-json", default="",
                    help="widen the lone grid of this results file (runs only what it lacks)")
    ap.add_argument("--rerun-auto", default="",
                    help="re-run the auto runs of this results file, keep the others")
    ap.add_argument("--extend-json", default="",
                    help="add the --report-seeds this results file lacks (give --out)")
    args = ap.parse_args()
    if args.extend_json:
        if not args.out:
            sys.exit("goodput: --extend-json writes a new results file: name it with --out")
        saved = json.loads(Path(args.extend_json).read_text())
        for key in ("workload", "clusters", "select_seeds"):
            setattr(args, key, saved[key])
        args.epochs = saved["epochs"]
        data = extend(args, saved)
        full = {**data, "runs": saved["runs"] + data["runs"]}
    elif args.widen_json or args.rerun_auto:
        path = Path(args.widen_json or args.rerun_auto)
        saved = json.loads(path.read_text())
        if "extends" in saved and args.widen_json:
            sys.exit("goodput: --widen-json widens a base results file, not one made by "
                     "--extend-json")
        for key in ("workload", "clusters", "select_seeds", "report_seeds"):
            setattr(args, key.replace("-", "_"), saved[key])
        args.epochs = saved["epochs"]
        data = full = run_all(args, saved) if args.widen_json else rerun_auto(args, saved)
        if "extends" in data:
            data = repoint_base(data, path.parent)
            full = with_base_runs(data, path.parent)
    elif args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        data.setdefault("workload", "mnist1d-cnn")
        data["resummarised"] = "python benchmarks/goodput.py " + " ".join(sys.argv[1:])
        full = with_base_runs(data, Path(args.from_json).parent)
    else:
        data = full = run_all(args)
    data["cells"] = full["cells"] = summarise(full)
    data["final_noise"] = final_noise(full)
    spec = WORKLOADS[data["workload"]]
    out = args.out or spec["out"]
    where = results_dir()
    where.mkdir(exist_ok=True)
    (where / f"{out}.json").write_text(json.dumps(data, indent=1, default=str))
    text = markdown(data)
    (where / f"{out}.md").write_text(text)
    print(text)


def make_job(args: argparse.Namespace, system: str, cluster: str, seed: int,
             batch: int = BASE_BATCH, lr: float | None = None,
             select: bool = False) -> dict[str, Any]:
    spec = WORKLOADS[args.workload]
    targets = spec["targets"]
    harder = max(targets) if spec["metric"] == "accuracy" else min(targets)
    return {"system": system, "workload": args.workload, "cluster": cluster, "seed": seed,
            "batch": batch, "lr": spec["optimizer"]["lr"] if lr is None else lr,
            "epochs": args.epochs or spec["epochs"],
            "stop_target": harder if select else 0.0,
            "max_time_s": spec["select_time_s"] if select else 0.0}


def selection_record(run: dict[str, Any]) -> dict[str, Any]:
    spec = WORKLOADS[run["workload"]]
    return {k: run[k] for k in ("cluster", "seed", "batch", "lr")} | {
        "tta_s": {str(t): tta(run["rows"], t, spec["metric"]) for t in spec["targets"]}}


def beyond_edges(tried: set[tuple[int, float]], setting: tuple[int, float]
                 ) -> list[tuple[int, float]]:
    """The untried settings one step past each edge of `tried` that `setting` sits on."""
    batch, lr = setting
    lrs = [x for b, x in tried if b == batch]
    batches = [b for b, x in tried if x == lr]
    out = []
    if lr <= min(lrs):
        out.append((batch, lr * 0.5))
    if lr >= max(lrs):
        out.append((batch, lr * 2.0))
    if batch <= min(batches) and batch // 2 >= MIN_LONE_BATCH:
        out.append((batch // 2, lr))
    if batch >= max(batches):
        out.append((batch * 2, lr))
    return [x for x in out if x not in tried]


def widen(args: argparse.Namespace, pool: ProcessPoolExecutor,
          selection: list[dict[str, Any]], first: dict[str, str]) -> list[dict[str, Any]]:
    """Grow each lone device's grid past every edge a pick sits on (see the docstring)."""
    targets = WORKLOADS[args.workload]["targets"]
    for _ in range(WIDEN_ROUNDS):
        jobs = []
        for key, cluster in sorted(first.items()):
            mine = [r for r in selection if lone_key(r["cluster"]) == key]
            tried = {(r["batch"], r["lr"]) for r in mine}
            new = {x for t in targets for x in beyond_edges(tried, pick(mine, t))}
            jobs += [make_job(args, "lone", cluster, seed, b, lr, select=True)
                     for b, lr in sorted(new) for seed in args.select_seeds]
        if not jobs:
            break
        print(f"widening the lone grid: {len(jobs)} selection runs", flush=True)
        selection += [selection_record(r) for r in pool.map(run_job, jobs)]
    return selection


def lone_settings(selection: list[dict[str, Any]], targets: tuple[float, ...],
                  first: dict[str, str]) -> set[tuple[str, tuple[int, float]]]:
    return {(key, pick([r for r in selection if lone_key(r["cluster"]) == key], t))
            for key in first for t in targets}


def check_reproduces(args: argparse.Namespace, pool: ProcessPoolExecutor,
                     selection: list[dict[str, Any]], report: list[dict[str, Any]],
                     system: str, flag: str, *, every: bool = False) -> None:
    """Saved runs stand for fresh ones only if today's code gives the same figures: re-run one
    selection run (its TTAs must be equal) and one `system` run of the file (row for row
    equal), or with `every` every `system` run (for DDP, whose TTAs are all the report takes
    from it: equal at every target; rows that moved in the last bits are counted and shown),
    and exit naming `flag` if not."""
    spec = WORKLOADS[args.workload]
    sel = selection[0]
    others = [r for r in report if r["system"] == system][:None if every else 1]
    jobs = [make_job(args, "lone", sel["cluster"], sel["seed"], sel["batch"], sel["lr"],
                     select=True)] + [make_job(args, system, r["cluster"], r["seed"])
                                      for r in others]
    fresh_sel, *fresh = pool.map(run_job, jobs)
    pairs = list(zip(fresh, others, strict=True))
    exact = sum(f["rows"] == o["rows"] for f, o in pairs)
    same_tta = all(tta(f["rows"], t, spec["metric"]) == tta(o["rows"], t, spec["metric"])
                   for f, o in pairs for t in spec["targets"])
    if selection_record(fresh_sel)["tta_s"] != {k: float(v) for k, v in sel["tta_s"].items()} \
            or not (exact == len(pairs) or (every and same_tta)):
        sys.exit(f"goodput: the saved runs do not reproduce with this code; run afresh "
                 f"(without {flag})")
    print(f"the saved runs reproduce (one selection run; {system}: {len(pairs)} run(s), equal "
          f"TTAs, {exact} identical row for row)", flush=True)


def rerun_auto(args: argparse.Namespace, saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` with every auto run made afresh (see the module docstring)."""
    old_auto = [r for r in saved["runs"] if r["system"] == "auto"]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        check_reproduces(args, pool, saved["selection"], saved["runs"], "ddp", "--rerun-auto",
                         every=True)
        autos = list(pool.map(run_job, [make_job(args, "auto", r["cluster"], r["seed"])
                                        for r in old_auto]))
    runs = [r for r in saved["runs"] if r["system"] != "auto"] + autos
    command = "python benchmarks/goodput.py " + " ".join(sys.argv[1:])
    kept = {k: v for k, v in saved.items() if k != "resummarised"}  # summarised anew here
    return {**kept, "runs": runs, "auto_rerun": command}


def extend(args: argparse.Namespace, saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` with more held-out seeds (`--report-seeds`, new ones only): auto, DDP and the
    lone device at its picks (the saved selection's, unchanged) run on them, after one saved
    selection run and one saved auto run reproduce exactly; the result covers the saved
    held-out seeds and the new ones."""
    spec = WORKLOADS[args.workload]
    new = [s for s in args.report_seeds if s not in saved["report_seeds"]]
    if not new or set(new) & set(saved["select_seeds"]):
        sys.exit("goodput: --extend-json needs --report-seeds that are neither the file's "
                 f"held-out seeds {saved['report_seeds']} nor its selection seeds "
                 f"{saved['select_seeds']}")
    first = first_of_each_lone(args.clusters)
    picks = sorted(lone_settings(saved["selection"], spec["targets"], first))
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        check_reproduces(args, pool, saved["selection"], saved["runs"], "auto", "--extend-json")
        jobs = [make_job(args, system, c, seed) for c in args.clusters
                for system in ("auto", "ddp") for seed in new]
        jobs += [make_job(args, "lone", first[k], seed, b, lr) for k, (b, lr) in picks
                 for seed in new]
        runs = list(pool.map(run_job, jobs))
    command = "python benchmarks/goodput.py " + " ".join(sys.argv[1:])
    kept = {k: v for k, v in saved.items() if k not in ("resummarised", "cells", "final_noise")}
    return {**kept, "runs": runs, "report_seeds": saved["report_seeds"] + new,
            "extended": command, "extends": {"file": Path(args.extend_json).name,
                                             "runs_sha256": runs_digest(saved["runs"])}}


def runs_digest(runs: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()


def with_base_runs(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """An extended results file holds only its new runs: `data` with its base file's runs
    (read from `folder`, where the base must sit) put first, once they are checked to be the
    runs it was extended from."""
    ext = data.get("extends")
    if not ext:
        return data
    base_path = folder / ext["file"]
    base = json.loads(base_path.read_text())["runs"]
    if runs_digest(base) != ext["runs_sha256"]:
        sys.exit(f"goodput: {base_path} is not the file this one extended (its runs changed); "
                 f"re-run `{data['extended']}`")
    return {**data, "runs": base + data["runs"]}


def repoint_base(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """An extended file whose auto runs were re-made (--rerun-auto), after its base file's
    were: it names the base's runs as they are now (the pair was re-made together)."""
    base = json.loads((folder / data["extends"]["file"]).read_text())["runs"]
    return {**data, "extends": {**data["extends"], "runs_sha256": runs_digest(base)}}


def provenance(saved: dict[str, Any] | None, command: str) -> dict[str, str]:
    """The commands that made a results file: a fresh run's, or a saved file's with this
    widening added (its auto re-run and earlier widenings stay)."""
    if saved is None:
        return {"command": command}
    kept = {k: saved[k] for k in ("command", "auto_rerun") if k in saved}
    return kept | {"widened": f"{saved['widened']}, then {command}" if "widened" in saved
                   else command}


def run_all(args: argparse.Namespace, saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tune the lone device, then run every system on the held-out seeds; with `saved` (a
    results file of the same settings) only what it lacks is run."""
    spec = WORKLOADS[args.workload]
    targets, base_lr = spec["targets"], spec["optimizer"]["lr"]
    pool = ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"))
    first = first_of_each_lone(args.clusters)
    if saved is None:
        lrs = [base_lr * f for f in LONE_LR_FACTORS]
        select_jobs = [make_job(args, "lone", first[k], s, b, lr, select=True)
                       for k in sorted(first) for b in LONE_BATCHES for lr in lrs
                       for s in args.select_seeds]
        selection = [selection_record(r) for r in pool.map(run_job, select_jobs)]
        report_jobs = [make_job(args, s, c, seed) for c in args.clusters
                       for s in ("auto", "ddp") for seed in args.report_seeds]
        report = list(pool.map(run_job, report_jobs))
    else:
        selection, report = saved["selection"], saved["runs"]
        check_reproduces(args, pool, selection, report, "auto", "--widen-json")
    selection = widen(args, pool, selection, first)
    have = {(lone_key(r["cluster"]), (r["batch"], r["lr"]), r["seed"]) for r in report
            if r["system"] == "lone"}
    lone_jobs = [make_job(args, "lone", first[k], seed, b, lr)
                 for k, (b, lr) in sorted(lone_settings(selection, targets, first))
                 for seed in args.report_seeds if (k, (b, lr), seed) not in have]
    report += list(pool.map(run_job, lone_jobs))
    pool.shutdown()
    grid = {first[k]: sorted({(r["batch"], r["lr"]) for r in selection
                              if lone_key(r["cluster"]) == k}) for k in sorted(first)}
    command = "python benchmarks/goodput.py " + " ".join(sys.argv[1:])
    return {**provenance(saved, command),
            "workload": args.workload, "clusters": args.clusters,
            "select_seeds": args.select_seeds, "report_seeds": args.report_seeds,
            "epochs": args.epochs or spec["epochs"], "eval_every_s": EVAL_EVERY_S,
            "lone_grid": {"batch": LONE_BATCHES,
                          "lr": [base_lr * f for f in LONE_LR_FACTORS], "widened": grid},
            "selection": selection, "runs": report}


def summarise(data: dict[str, Any]) -> list[dict[str, Any]]:
    spec = WORKLOADS[data["workload"]]
    targets, metric = spec["targets"], spec["metric"]
    report, seeds = data["runs"], data["report_seeds"]
    clusters = data.get("clusters") or list(dict.fromkeys(r["cluster"] for r in report
                                                          if r["system"] != "lone"))
    lone_of = {c: lone_key(c) for c in clusters}

    def get(system: str, cluster: str, seed: int, setting: tuple[int, float] | None = None):
        for r in report:
            if r["system"] != system or r["seed"] != seed:
                continue
            if system == "lone" and lone_of.get(r["cluster"]) == lone_of[cluster] \
                    and (r["batch"], r["lr"]) == setting:
                return r
            if system != "lone" and r["cluster"] == cluster:
                return r
        raise KeyError((system, cluster, seed, setting))

    def t_of(run: dict[str, Any], t: float) -> float:
        return tta(run["rows"], t, metric)

    def final(run: dict[str, Any]) -> float:
        return final_metric(run["rows"], metric)

    scale = 100.0 if metric == "accuracy" else 1.0
    cells = []
    for c in clusters:
        for t in targets:
            mine = [r for r in data["selection"] if lone_key(r["cluster"]) == lone_of[c]]
            setting = pick(mine, t)
            autos = [get("auto", c, s) for s in seeds]
            lones = [get("lone", c, s, setting) for s in seeds]
            ddps = [get("ddp", c, s) for s in seeds]
            cells.append({
                "cluster": c, "workload": data["workload"], "target": t, "metric": metric,
                "lone_setting": {"batch": setting[0], "lr": setting[1]},
                "auto_tta_s": summ([t_of(a, t) for a in autos]),
                "lone_tta_s": summ([t_of(x, t) for x in lones]),
                "ddp_tta_s": summ([t_of(x, t) for x in ddps]),
                "auto_vs_lone": summ([ratio(t_of(x, t), t_of(a, t))
                                      for a, x in zip(autos, lones, strict=True)]),
                "auto_vs_ddp": summ([ratio(t_of(x, t), t_of(a, t))
                                     for a, x in zip(autos, ddps, strict=True)]),
                "predicted_vs_lone": summ([predicted_vs_lone(a, setting, c, t, data["workload"])
                                           for a in autos]),
                "auto_misses": sum(math.isinf(t_of(a, t)) for a in autos),
                "lone_misses": sum(math.isinf(t_of(x, t)) for x in lones),
                "final_auto": summ([final(a) for a in autos]),
                "final_lone": summ([final(x) for x in lones]),
                "final_gap": summ([scale * (final(a) - final(x))
                                   for a, x in zip(autos, lones, strict=True)]),
                "auto_plans": [a["strategy_stats"].get("plans") for a in autos],
                "auto_ps_site": [a["strategy_stats"].get("ps_site") for a in autos],
            })
        for cell in cells[-len(targets):]:   # the headline figures as plain numbers
            for key in ("auto_vs_lone", "auto_vs_ddp", "predicted_vs_lone"):
                cell[f"{key}_seeds"] = cell[key]
                cell[key] = cell[key]["median"]
    return cells


def final_noise(data: dict[str, Any], resamples: int = 10_000) -> dict[str, Any]:
    """How much of a cell's final gap is noise. A constant-lr run's metric moves from one
    evaluation to the next, and a cell's gap is the median over the held-out seeds of one
    auto run minus one lone run, so two identical systems show gaps too. Three figures:
      * run_sd: the spread of one run's final metric over seeds (pooled sd over the auto runs
        of each cluster and the lone runs of each picked setting);
      * same_system_cell_sd: the sd of a cell's gap between two identical systems whose runs
        vary by run_sd (Monte Carlo, normal runs, as many seeds as here), and for accuracy
        same_system_below_half, how often that gap is below -0.5 points;
      * pooled_gap: auto minus lone over every held-out auto run (each run's gaps against its
        cluster's picks averaged), the mean with a bootstrap 90% interval over those runs."""
    import random

    metric = WORKLOADS[data["workload"]]["metric"]
    scale = 100.0 if metric == "accuracy" else 1.0
    seeds = data["report_seeds"]

    def final(run: dict[str, Any]) -> float:
        return scale * final_metric(run["rows"], metric)

    picks = {(lone_key(c["cluster"]), c["lone_setting"]["batch"], c["lone_setting"]["lr"])
             for c in data["cells"]}
    groups: dict[tuple[Any, ...], dict[int, float]] = {}
    for r in data["runs"]:
        if r["system"] == "auto":
            groups.setdefault(("auto", r["cluster"]), {})[r["seed"]] = final(r)
        elif r["system"] == "lone" and (key := (lone_key(r["cluster"]), r["batch"], r["lr"])) \
                in picks:
            groups.setdefault(("lone", *key), {})[r["seed"]] = final(r)
    variances = [statistics.variance(g.values()) for g in groups.values() if len(g) > 1]
    run_sd = math.sqrt(statistics.mean(variances)) if variances else 0.0
    rng = random.Random(0)
    same = [statistics.median(rng.gauss(0, run_sd) - rng.gauss(0, run_sd) for _ in seeds)
            for _ in range(resamples)]
    per_run: dict[tuple[str, int], list[float]] = {}
    for c in data["cells"]:
        lone = groups[("lone", lone_key(c["cluster"]), c["lone_setting"]["batch"],
                       c["lone_setting"]["lr"])]
        for s in seeds:
            per_run.setdefault((c["cluster"], s), []).append(
                groups[("auto", c["cluster"])][s] - lone[s])
    gaps = [statistics.mean(v) for v in per_run.values()]
    means = sorted(statistics.mean(rng.choices(gaps, k=len(gaps))) for _ in range(resamples))
    out: dict[str, Any] = {
        "run_sd": run_sd, "same_system_cell_sd": statistics.pstdev(same),
        "pooled_gap": {"mean": statistics.mean(gaps), "runs": len(gaps),
                       "ci90": [means[int(0.05 * resamples)],
                                means[int(0.95 * resamples) - 1]]}}
    if metric == "accuracy":
        out["same_system_below_half"] = sum(g < -0.5 for g in same) / resamples
    return out


def markdown(data: dict[str, Any]) -> str:
    spec = WORKLOADS[data["workload"]]
    metric, cells = spec["metric"], data["cells"]
    what = "accuracy" if metric == "accuracy" else "test loss"
    gap = "gap pts" if metric == "accuracy" else "gap (loss)"
    lines = [f"# auto vs the tuned fastest device alone and DDP (simulated, {data['workload']})\n",
             f"Command: `{data['command']}`"
             + (f", lone grid widened by `{data['widened']}`" if "widened" in data else "")
             + (f", auto runs made afresh by `{data['auto_rerun']}` (kept: the lone runs, "
                "a selection run checked to reproduce exactly, and the DDP runs, each checked to "
                "give the same TTAs)" if "auto_rerun" in data else "")
             + (f", held-out seeds added by `{data['extended']}` (the saved runs kept, one "
                "selection run and one auto run checked to reproduce exactly)"
                if "extended" in data else "")
             + (f" (re-summarised: `{data['resummarised']}`)" if "resummarised" in data else "")
             + "\n",
             f"Held-out seeds {data['report_seeds']} (the lone device tuned on "
             f"{data['select_seeds']}); median (min-max); every run evaluated every "
             f"{data['eval_every_s']} virtual s; {data['epochs']} epochs. Ratios are the other "
             "system's TTA / auto's per seed; a seed that misses counts as infinite TTA. Final "
             f"{what}: mean of the last 5 evaluations; gap = auto - lone.\n",
             f"| cluster | target {what} | auto vs lone | predicted | auto vs ddp | auto TTA s | "
             f"lone TTA s (batch, lr) | misses auto/lone | final auto / lone | {gap} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        ls = cell["lone_setting"]
        lines.append(
            f"| {cell['cluster']} | {cell['target']:g} | **{fmt(cell['auto_vs_lone_seeds'])}** | "
            f"{fmt(cell['predicted_vs_lone_seeds'])} | {fmt(cell['auto_vs_ddp_seeds'])} | "
            f"{fmt(cell['auto_tta_s'], 1)} | {fmt(cell['lone_tta_s'], 1)} ({ls['batch']}, "
            f"{ls['lr']:g}) | {cell['auto_misses']}/{cell['lone_misses']} | "
            f"{fmt(cell['final_auto'], 3)} / {fmt(cell['final_lone'], 3)} | "
            f"{fmt(cell['final_gap'], 2)} |")
    widened = data.get("lone_grid", {}).get("widened")
    if widened:
        lines.append("\nThe lone device's settings tried (batch, lr), the grid widened past "
                     "every edge a pick sat on:\n")
        lines += [f"- {c}'s fastest device: " + ", ".join(f"({b}, {lr:g})" for b, lr in grid)
                  for c, grid in widened.items()]
    noise = data.get("final_noise")
    if noise:
        unit = "points" if metric == "accuracy" else "nats"
        pooled = noise["pooled_gap"]
        below = noise.get("same_system_below_half")
        lines.append(
            f"\nHow noisy the final gap is: one run's final {what} varies by "
            f"{noise['run_sd']:.2f} {unit} (sd) over seeds, so between two identical systems "
            f"a cell's gap (the median over {len(data['report_seeds'])} seeds) would vary by "
            f"{noise['same_system_cell_sd']:.2f} {unit} (sd, Monte Carlo)"
            + (f" and fall below -0.5 points in {100 * below:.0f}% of cells"
               if below is not None else "")
            + f". Pooled over all {pooled['runs']} held-out auto runs, auto - lone is "
            f"{pooled['mean']:+.2f} {unit} (bootstrap 90% interval {pooled['ci90'][0]:+.2f} "
            f"to {pooled['ci90'][1]:+.2f}).")
    lines.append("\nauto's plans per held-out seed (epoch:G x H):\n")
    for cell in cells[::len(spec["targets"])]:
        lines.append(f"- {cell['cluster']}: PS in {cell['auto_ps_site'][0]}; "
                     + " | ".join(str(p) for p in cell["auto_plans"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
