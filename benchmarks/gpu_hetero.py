"""REAL devices, no emulation: one GPU worker beside two CPU workers vs the GPU alone.

A heterogeneous cluster as a user with one GPU machine has it: the GPU and two single-thread
CPU workers, each its own process (hetrain's dist engine, gloo to the PS on the CPU). First
`hetrain profile`'s measurement (`measure`, dist.emulate = none: each worker times steps on its
own device) gives the planners the real speeds; then, on that measured cluster, to a test
accuracy on MNIST-1D (CNN), evaluated every `--eval-s` wall seconds in every arm:

  - plain loop: the user's own single-process PyTorch loop on the GPU (data in GPU memory),
    over a small grid of batch x lr (the lone device tuned as we tune ours);
  - gpu-alone: ddp on a one-device cluster (the GPU) through hetrain's engine, NCCL for its
    collective group, over the same grid (it pays hetrain's per-step coordination);
  - cadp and auto on the three devices (their own plans from the measured speeds).

    python3 benchmarks/gpu_hetero.py --out DIR [--gpu-kind cuda] [--target 0.96] [--seeds 0,1]

writes DIR/gpu_hetero.json and .md. A few seeds in a few minutes: a check that the GPU paths
train and what they achieve here, not a claim with a tight spread. `--gpu-kind cpu` runs the same arms with the "GPU"
worker on the CPU (a smoke test of the script where there is no GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hetrain.cluster import Cluster
from hetrain.config import RunConfig, config_from_dict
from hetrain.engine.measure import measure
from hetrain.runner import run_config
from hetrain.workloads import Workload, evaluate, gather, get_workload

LONE_GRID = ((32, 0.05), (128, 0.1), (256, 0.2))
"""(batch, lr) for the GPU alone: the base setting and linear-scaled larger batches."""


def cluster_dict(gpu_kind: str) -> dict[str, Any]:
    lan = {"bandwidth_Bps": 1e10}
    return {"name": "gpu+2cpu", "sites": [{"name": "host", "lan": lan, "wan": lan}],
            "devices": [{"name": "gpu", "flops": 1e12, "torch_device": gpu_kind},
                        {"name": "cpu", "flops": 1e9, "count": 2, "torch_device": "cpu"}]}


def make_cfg(name: str, strategy: str, cluster: Any, args: argparse.Namespace,
             batch: int = 32, lr: float = 0.05, backend: str = "gloo") -> RunConfig:
    return config_from_dict({
        "name": name, "engine": "dist", "cluster": cluster,
        "workload": {"model": "cnn", "dataset": "mnist1d"},
        "strategy": {"name": strategy}, "optimizer": {"lr": lr, "momentum": 0.9},
        "train": {"batch_size": batch, "eval_every_s": args.eval_s},
        "stop": {"max_epochs": 1000.0, "max_time_s": args.max_time_s,
                 "target_accuracy": args.target, "stop_at_target": True},
        "dist": {"emulate": "none", "backend": backend, "worker_timeout_s": 120.0}})


def plain_loop(wl: Workload, device: torch.device, batch: int, lr: float, seed: int,
               args: argparse.Namespace) -> dict[str, Any]:
    """The user's own alternative: one process, a plain PyTorch loop on the GPU with the whole
    training set in GPU memory (no data loader, no coordination), SGD lr x momentum 0.9 as
    the other arms, evaluated every eval_s seconds of training (the clock stops while it
    evaluates, as hetrain's does)."""
    torch.manual_seed(seed)
    model = wl.build_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = gather(wl.train, torch.arange(len(wl.train)))  # type: ignore[arg-type]
    x, y = x.to(device), y.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    trained_s, next_eval, tta, acc, samples = 0.0, 0.0, None, 0.0, 0
    while trained_s < args.max_time_s and tta is None:
        if trained_s >= next_eval:
            _, acc = evaluate(model, wl.test, wl.loss_fn)
            next_eval += args.eval_s
            if acc >= args.target:
                tta = trained_s
                break
        start = time.perf_counter()
        for idx in torch.randperm(len(x), device=device, generator=gen).split(batch):
            opt.zero_grad(set_to_none=True)
            wl.loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
            samples += len(idx)
            if device.type == "cuda" and samples % (8 * batch) == 0:
                torch.cuda.synchronize(device)
            if time.perf_counter() - start + trained_s >= next_eval:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        trained_s += time.perf_counter() - start
    return {"tta_s": None if tta is None else round(tta, 2), "final_accuracy": acc,
            "epochs": samples / len(x), "worker_devices": [str(device)],
            "strategy_stats": None}


def save_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    """After every arm, so a run cut short keeps what it measured."""
    (out / "gpu_hetero_rows.json").write_text(json.dumps(rows, indent=1, default=str))


def arm_row(name: str, summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    tta = summary.get("tta_s")
    return {"arm": name, "tta_s": None if tta is None else round(tta, 2), "final_accuracy":
            summary.get("final_accuracy"), "epochs": summary.get("epochs"),
            "worker_devices": summary.get("worker_devices"),
            "strategy_stats": summary.get("strategy_stats"), "wall_s": round(wall_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu-kind", default="cuda", help="torch_device of the 'gpu' worker")
    ap.add_argument("--target", type=float, default=0.96)
    ap.add_argument("--eval-s", type=float, default=0.5)
    ap.add_argument("--max-time-s", type=float, default=25.0)
    ap.add_argument("--arms", default="plain,gpu-alone,cadp,auto",
                    help="which arms to run (comma-separated name prefixes)")
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    wl = get_workload("cnn", "mnist1d")
    base = make_cfg("gpu-profile", "cadp", cluster_dict(args.gpu_kind), args)
    t = time.perf_counter()
    m = measure(base, workload=wl, steps=10, force=True)
    profile_s = time.perf_counter() - t
    measured: Cluster = m.cluster
    print(f"profile ({profile_s:.0f} s): {m.sources}", flush=True)
    for d in measured.devices:
        print(f"  {d.name}: {d.flops:.3g} FLOP/s, step overhead {d.step_overhead_s * 1e3:.2f} "
              f"ms ({d.torch_device})", flush=True)
    if m.warning:
        print(f"  warning: {m.warning}", flush=True)
    gpu = next(d for d in measured.devices if d.name == "gpu")
    alone = Cluster("gpu-alone", (gpu,), measured.sites, ps_site=measured.ps_site)
    arms: list[tuple[str, RunConfig, Cluster]] = []
    for batch, lr in LONE_GRID:
        backend = "nccl" if args.gpu_kind.startswith("cuda") else "gloo"
        arms.append((f"gpu-alone b{batch} lr{lr:g}",
                     make_cfg(f"alone-b{batch}", "ddp", "hetero-4", args, batch, lr, backend),
                     alone))
    for strategy in ("cadp", "auto"):
        arms.append((strategy, make_cfg(strategy, strategy, "hetero-4", args), measured))
    plain_device = torch.device("cuda" if args.gpu_kind.startswith("cuda") else "cpu")
    wanted = tuple(args.arms.split(","))
    arms = [a for a in arms if a[0].startswith(wanted)]
    grid = LONE_GRID if "plain loop".startswith(wanted) else ()
    names = [f"plain loop b{b} lr{lr:g}" for b, lr in grid] + [a[0] for a in arms]
    rows = []
    for seed in args.seeds:
        for b, lr in grid:
            t = time.perf_counter()
            row = plain_loop(wl, plain_device, b, lr, seed, args)
            rows.append({"seed": seed, "arm": f"plain loop b{b} lr{lr:g}", **row,
                         "wall_s": round(time.perf_counter() - t, 1)})
            print(f"seed {seed} {rows[-1]['arm']}: time to {args.target:.0%} "
                  f"{row['tta_s']} s, final acc {row['final_accuracy']:.3f}", flush=True)
            save_rows(args.out, rows)
        for name, cfg, cluster in arms:
            cfg = cfg.replace(train=replace(cfg.train, seed=seed))
            t = time.perf_counter()
            r = run_config(cfg, runs_root=None, cluster=cluster, workload=wl)
            rows.append({"seed": seed, **arm_row(name, r.summary, time.perf_counter() - t)})
            row = rows[-1]
            save_rows(args.out, rows)
            print(f"seed {seed} {name}: time to {args.target:.0%} {row['tta_s']} s, final acc "
                  f"{row['final_accuracy']:.3f}, devices {row['worker_devices']}", flush=True)
    cap = args.max_time_s  # policy: a run that misses the target counts as the time cap

    def tta(row: dict[str, Any]) -> float:
        return row["tta_s"] if row["tta_s"] is not None else cap

    def lone(row: dict[str, Any]) -> bool:
        return row["arm"].startswith(("gpu-alone", "plain loop"))

    best_lone = {seed: min(tta(r) for r in rows if r["seed"] == seed and lone(r))
                 for seed in args.seeds}
    lines = [f"# 1 GPU + 2 CPU workers vs the GPU alone (real devices, {args.gpu_kind})", "",
             "    python3 benchmarks/gpu_hetero.py " + " ".join(sys.argv[1:]), "",
             f"Profile: {m.sources}", ""]
    lines += [f"- {d.name} ({d.torch_device}): {d.flops:.3g} FLOP/s, step overhead "
              f"{d.step_overhead_s * 1e3:.2f} ms" for d in measured.devices]
    lines += ["", f"Time to {args.target:.0%} test accuracy in wall s (evaluated every "
              f"{args.eval_s:g} s; a run that misses it within {cap:g} s counts as {cap:g} s), "
              f"seeds {','.join(map(str, args.seeds))}. 'vs best GPU alone' is, per seed, the "
              "best of the GPU-alone arms (hetrain's engine and the plain loop, over the batch "
              "x lr grid) on that same seed, an oracle choice that favours the lone GPU, over "
              "the arm's time; median [min, max] over seeds.", "",
              "| arm | TTA s per seed | vs best GPU alone | final acc per seed | "
              "worker devices |", "|---|---|---|---|---|"]
    for name in names:
        mine = [r for r in rows if r["arm"] == name]
        ratios = [best_lone[r["seed"]] / tta(r) for r in mine]
        ttas = ", ".join(f"{r['tta_s']}" if r["tta_s"] is not None else "missed" for r in mine)
        accs = ", ".join(f"{r['final_accuracy']:.3f}" for r in mine)
        lines.append(f"| {name} | {ttas} | {statistics.median(ratios):.2f}x "
                     f"[{min(ratios):.2f}, {max(ratios):.2f}] | {accs} | "
                     f"{mine[0]['worker_devices']} |")
    (args.out / "gpu_hetero.md").write_text("\n".join(lines) + "\n")
    (args.out / "gpu_hetero.json").write_text(json.dumps(
        {"command": sys.argv, "profile": {"sources": m.sources, "warning": m.warning,
                                          "devices": measured.to_dict()["devices"]},
         "rows": rows}, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
