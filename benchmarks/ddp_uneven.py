"""hetrain.ddp vs plain DDP + DistributedSampler on 4 gloo ranks emulating speeds 1:1:2:4.

    PYTHONPATH=src .venv/bin/python benchmarks/ddp_uneven.py [--seeds 0 1 2] [--steps 600]
        [--workload cnn] [--ms-per-sample 1.0] [--target 0.90] [--out ddp_uneven]

Real processes (torch.multiprocessing spawn, gloo on 127.0.0.1, one thread each). Both arms run
the SAME user training loop (DDP, SGD lr 0.05 momentum 0.9, global batch 128, seeded model):
  plain   BatchSampler(DistributedSampler(train), 128 // 4): 32 samples per rank, DDP's mean;
  hetero  HeteroDDP(global_batch=128, rebalance_every=K=20) starting from the EVEN split (32
          each): the first K steps are as slow as plain DDP, then the measured times re-plan.
  auto    (--auto-batch only) hetero with auto_batch=True, max_global_batch=--max-global-batch
          (1024): the global batch follows the gradient noise scale from 128 and the lr follows
          (AdaScale, capped at 2x); its samples/s counts the samples it actually trained on.
Emulated speeds: a rank of speed s pads every step's compute (forward + backward) to the budget
    budget = overhead_s + b * ms_per_sample / s      (hetrain.engine.emulate's budget idea)
with sleep_until in a comm-hook wrapper (before the gradient all-reduce), so a slow rank delays
its gradient like a slow device would; real compute must fit in the budget (overruns are
counted). The clock (rank 0) excludes evaluation: every `eval_every` steps all ranks meet at a
barrier, rank 0 evaluates on the test set, the clock resumes.
Reported per seed: samples/s (global batch x steps / training seconds), time to --target test
accuracy (TTA), the plans; medians over seeds of hetero/plain: samples_per_s_ratio, tta_ratio.
Slowdown run (seed 0, hetero only): rank 3 (speed 4) becomes 2x slower from step K0 = 10 K;
reported: the step of the first plan that is near-optimal for the new speeds (predicted step
time within 5% of the optimum), whether that is within 2 K-step windows, and the throughput
after that vs (a) the budget optimum B / T*(new speeds) and (b) a run started with the optimal
plan for the slowed cluster (an oracle, rebalancing off).
Writes benchmarks/results/<out>.json and .md.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

OUT = Path(__file__).parent / "results"
SPEEDS = (1.0, 1.0, 2.0, 4.0)
GLOBAL_BATCH = 128
K = 20
LR, MOMENTUM = 0.05, 0.9


class Emu:
    """The rank's emulated device: pads the step's compute to its budget."""

    def __init__(self, speed: float, ms_per_sample: float, overhead_s: float) -> None:
        self.speed, self.c, self.overhead = speed, ms_per_sample * 1e-3, overhead_s
        self.t0 = 0.0
        self.batch = 0
        self.padded = True
        self.overruns = 0
        self.steps = 0

    def begin(self, batch: int) -> None:
        self.t0, self.batch, self.padded = time.perf_counter(), batch, False
        self.steps += 1

    def budget(self) -> float:
        return self.overhead + self.batch * self.c / self.speed

    def pad(self) -> None:
        if not self.padded:
            from hetrain.engine.emulate import sleep_until

            self.padded = True
            if sleep_until(self.t0 + self.budget()) == 0.0:
                self.overruns += 1


def padded(emu: Emu, inner):
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        emu.pad()
        return inner(state, bucket)

    return hook


def optimum(speeds, ms_per_sample, overhead_s):
    """The optimal integer plan and step time for the budgets (every rank >= 1 sample)."""
    from hetrain.ddp import plan_from_measurements

    c = [ms_per_sample * 1e-3 / s for s in speeds]
    sizes = plan_from_measurements(c, GLOBAL_BATCH)
    return sizes, overhead_s + max(x * b for x, b in zip(c, sizes, strict=True))


def train(rank: int, world: int, wl, arm: str, seed: int, steps: int, emu: Emu,
          target: float, eval_every: int, slow_from: int | None = None,
          batch_sizes=None, rebalance_every: int = K,
          max_global_batch: int = 1024) -> dict[str, Any]:
    """The user's DDP loop; `arm` only changes the sampler and the gradient hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import BatchSampler, DistributedSampler

    from hetrain.ddp import HeteroDDP, weighted_allreduce_hook
    from hetrain.workloads import evaluate, gather

    torch.manual_seed(seed)
    model = DDP(wl.build_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    het = None
    if arm in ("hetero", "auto"):
        auto = {"auto_batch": True, "max_global_batch": max_global_batch} if arm == "auto" \
            else {}
        het = HeteroDDP(global_batch=GLOBAL_BATCH, seed=seed, rebalance_every=rebalance_every,
                        batch_sizes=batch_sizes, **auto)
        sampler = het.batch_sampler(wl.train)
        model.register_comm_hook(het.hook_state, padded(emu, weighted_allreduce_hook))
        het.follow_lr(opt)
        epoch_sampler: Any = sampler
    else:
        dsamp = DistributedSampler(wl.train, shuffle=True, seed=seed, drop_last=True)
        sampler = BatchSampler(dsamp, GLOBAL_BATCH // world, drop_last=True)
        model.register_comm_hook(None, padded(emu, allreduce_hook))
        epoch_sampler = dsamp
    base_speed = emu.speed
    clock, seg, tta, step, epoch, samples = 0.0, 0.0, None, 0, 0, 0
    stamps: list[float] = []
    evals: list[tuple[int, float, float]] = []
    dist.barrier()
    seg = time.perf_counter()
    while step < steps:
        epoch_sampler.set_epoch(epoch)
        for idx in sampler:
            x, y = gather(wl.train, idx)
            if slow_from is not None and rank == world - 1 and step >= slow_from:
                emu.speed = base_speed / 2
            emu.begin(len(idx))
            if het is not None:
                with het.step():
                    loss = wl.loss_fn(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            else:
                loss = wl.loss_fn(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            step += 1
            samples += sum(het._step_sizes) if het is not None else GLOBAL_BATCH
            if rank == 0:
                stamps.append(clock + time.perf_counter() - seg)
            if eval_every and (step % eval_every == 0 or step == steps):
                dist.barrier()
                clock += time.perf_counter() - seg
                if rank == 0:
                    _, acc = evaluate(model.module, wl.test, wl.loss_fn)
                    evals.append((step, clock, acc))
                    if tta is None and acc >= target:
                        tta = clock
                dist.barrier()
                seg = time.perf_counter()
            if step >= steps:
                break
        epoch += 1
    dist.barrier()
    clock += time.perf_counter() - seg
    emu.speed = base_speed
    overruns = torch.tensor([emu.overruns], dtype=torch.long)
    dist.all_reduce(overruns)
    emu.overruns = 0
    return {"arm": arm, "seed": seed, "steps": steps, "train_s": clock,
            "samples_per_s": samples / clock, "tta_s": tta, "evals": evals,
            "final_accuracy": evals[-1][2] if evals else None, "stamps": stamps,
            "plans": het.history if het is not None else None,
            "final_plan": list(het.sizes) if het is not None else [GLOBAL_BATCH // world] * world,
            "overruns": int(overruns)}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, wl,
              out_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    emu = Emu(SPEEDS[rank], args.ms_per_sample, args.overhead_ms * 1e-3)
    runs = []
    for seed in args.seeds:
        for arm in ("plain", "hetero") + (("auto",) if args.auto_batch else ()):
            r = train(rank, world, wl, arm, seed, args.steps, emu, args.target, args.eval_every,
                      max_global_batch=args.max_global_batch)
            runs.append(r)
            if rank == 0:
                print(f"seed {seed} {arm:6s}: {r['samples_per_s']:7.0f} samples/s, TTA "
                      f"{r['tta_s']}, final acc {r['final_accuracy']:.3f}, plan "
                      f"{r['final_plan']}, overruns {r['overruns']}", flush=True)
    slow = {}
    if args.slow_steps:
        k0 = 10 * K
        slow["run"] = train(rank, world, wl, "hetero", args.seeds[0], args.slow_steps, emu,
                            args.target, 0, slow_from=k0)
        slowed = list(SPEEDS)
        slowed[-1] /= 2
        opt_sizes, _ = optimum(slowed, args.ms_per_sample, args.overhead_ms * 1e-3)
        slow["oracle"] = train(rank, world, wl, "hetero", args.seeds[0], args.slow_steps - k0,
                               emu, args.target, 0, slow_from=0, batch_sizes=opt_sizes,
                               rebalance_every=0)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"runs": runs, "slow": slow}))
    dist.destroy_process_group()


def summarize(args: argparse.Namespace, raw: dict[str, Any], wall_s: float) -> dict[str, Any]:
    overhead = args.overhead_ms * 1e-3
    per_seed = []
    for seed in args.seeds:
        p = next(r for r in raw["runs"] if r["seed"] == seed and r["arm"] == "plain")
        h = next(r for r in raw["runs"] if r["seed"] == seed and r["arm"] == "hetero")
        w0 = min(3 * K, len(p["stamps"]) // 2)  # steady state: after the first re-plans
        ss = {a: (r["stamps"][-1] - r["stamps"][w0]) / (len(r["stamps"]) - 1 - w0)
              for a, r in (("plain", p), ("hetero", h))}
        per_seed.append({
            "seed": seed,
            "plain": {k: p[k] for k in ("samples_per_s", "tta_s", "final_accuracy", "train_s",
                                        "overruns", "final_plan")},
            "hetero": {k: h[k] for k in ("samples_per_s", "tta_s", "final_accuracy", "train_s",
                                         "overruns", "final_plan")},
            "hetero_plans": [(x["step"], x["new"]) for x in h["plans"] if x["new"] != x["old"]],
            "samples_per_s_ratio": h["samples_per_s"] / p["samples_per_s"],
            "steady_samples_per_s_ratio": ss["plain"] / ss["hetero"],
            "tta_ratio": (p["tta_s"] / h["tta_s"]) if p["tta_s"] and h["tta_s"] else None,
        })
    med = statistics.median
    tta = [s["tta_ratio"] for s in per_seed if s["tta_ratio"] is not None]
    t_plain_budget = overhead + (GLOBAL_BATCH // 4) * args.ms_per_sample * 1e-3 / min(SPEEDS)
    opt_sizes, t_opt = optimum(SPEEDS, args.ms_per_sample, overhead)
    out: dict[str, Any] = {
        "command": "PYTHONPATH=src .venv/bin/python " + " ".join(sys.argv),
        "workload": args.workload, "speeds": SPEEDS, "global_batch": GLOBAL_BATCH,
        "rebalance_every": K, "steps": args.steps, "target_accuracy": args.target,
        "ms_per_sample_speed1": args.ms_per_sample, "overhead_ms": args.overhead_ms,
        "budget_ratio_ideal": t_plain_budget / t_opt, "optimal_plan": opt_sizes,
        "samples_per_s_ratio": med(s["samples_per_s_ratio"] for s in per_seed),
        "steady_samples_per_s_ratio": med(s["steady_samples_per_s_ratio"] for s in per_seed),
        "tta_ratio": med(tta) if len(tta) == len(per_seed) else None,
        "per_seed": per_seed, "wall_s": wall_s,
    }
    autos = [r for r in raw["runs"] if r["arm"] == "auto"]
    if autos:
        out["auto"] = [{k: r[k] for k in ("seed", "samples_per_s", "tta_s", "final_accuracy",
                                          "train_s", "overruns", "final_plan")}
                       | {"batches": [(x["step"], x.get("global_batch"), x.get("lr_scale"))
                                      for x in r["plans"]]} for r in autos]
    if raw["slow"]:
        run, oracle = raw["slow"]["run"], raw["slow"]["oracle"]
        k0 = 10 * K
        slowed = list(SPEEDS)
        slowed[-1] /= 2
        new_sizes, t_new = optimum(slowed, args.ms_per_sample, overhead)
        c = [args.ms_per_sample * 1e-3 / s for s in slowed]
        near = None
        for x in run["plans"]:
            pred = overhead + max(ci * b for ci, b in zip(c, x["new"], strict=True))
            if x["step"] > k0 and pred <= 1.05 * t_new:
                near = x["step"]
                break
        after = near if near is not None else k0 + 2 * K
        st = run["stamps"]
        rate = GLOBAL_BATCH * (len(st) - 1 - after) / (st[-1] - st[after])
        ost = oracle["stamps"]
        orate = GLOBAL_BATCH * (len(ost) - 1 - K) / (ost[-1] - ost[K])
        out["slowdown"] = {
            "slow_rank": 3, "from_step": k0, "factor": 2.0,
            "plans": [(x["step"], x["new"]) for x in run["plans"] if x["new"] != x["old"]],
            "optimal_plan_after": new_sizes,
            "near_optimal_plan_at_step": near,
            "windows_to_rebalance": None if near is None else (near - k0) / K,
            "rebalanced_within_2_windows": near is not None and near <= k0 + 2 * K,
            "samples_per_s_after": rate,
            "budget_optimum_samples_per_s": GLOBAL_BATCH / t_new,
            "oracle_plan_samples_per_s": orate,
            "vs_budget_optimum": rate * t_new / GLOBAL_BATCH,
            "vs_oracle": rate / orate,
            "within_15pct_of_oracle": rate >= 0.85 * orate,
        }
    return out


def write_md(res: dict[str, Any], path: Path) -> None:
    L = [f"# hetrain.ddp vs plain DDP, 4 gloo ranks emulating 1:1:2:4 ({res['workload']})", "",
         "```", res["command"], "```", "",
         f"Global batch {res['global_batch']}, {res['steps']} steps per arm, K = "
         f"{res['rebalance_every']}, speed-1 rank {res['ms_per_sample_speed1']} ms/sample + "
         f"{res['overhead_ms']} ms per step (emulated budgets; ideal budget ratio "
         f"{res['budget_ratio_ideal']:.2f}x, optimal plan {res['optimal_plan']}). "
         f"Hetero starts from the even split. Target accuracy {res['target_accuracy']}.", "",
         f"**Medians over seeds: samples_per_s_ratio {res['samples_per_s_ratio']:.2f}x, "
         f"tta_ratio {res['tta_ratio'] if res['tta_ratio'] is None else round(res['tta_ratio'], 2)}"
         f"x** (steady state after step {3 * K}: {res['steady_samples_per_s_ratio']:.2f}x). "
         f"Targets: >= 1.7x and >= 1.6x.", "",
         "| seed | plain samples/s | hetero samples/s | ratio | plain TTA s | hetero TTA s | "
         "TTA ratio | final acc plain / hetero | hetero plan | overruns |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["per_seed"]:
        p, h = s["plain"], s["hetero"]
        fmt = (lambda v: "-" if v is None else f"{v:.1f}")  # noqa: E731
        L.append(f"| {s['seed']} | {p['samples_per_s']:.0f} | {h['samples_per_s']:.0f} | "
                 f"{s['samples_per_s_ratio']:.2f} | {fmt(p['tta_s'])} | {fmt(h['tta_s'])} | "
                 f"{'-' if s['tta_ratio'] is None else round(s['tta_ratio'], 2)} | "
                 f"{p['final_accuracy']:.3f} / {h['final_accuracy']:.3f} | {h['final_plan']} | "
                 f"{p['overruns']} / {h['overruns']} |")
    if "auto" in res:
        L += ["", "## auto_batch arm (the global batch follows the gradient noise scale)", "",
              "| seed | samples/s | TTA s | final acc | final plan | (step, global batch, lr "
              "scale) at the last rebalance |", "|---|---|---|---|---|---|"]
        for a in res["auto"]:
            last = a["batches"][-1] if a["batches"] else None
            L.append(f"| {a['seed']} | {a['samples_per_s']:.0f} | {a['tta_s']} | "
                     f"{a['final_accuracy']:.3f} | {a['final_plan']} | {last} |")
    if "slowdown" in res:
        d = res["slowdown"]
        L += ["", f"## Rank 3 becomes 2x slower from step {d['from_step']}", "",
              f"Plan changes (step, plan): {d['plans']}; optimum for the new speeds "
              f"{d['optimal_plan_after']}.",
              f"Near-optimal plan (predicted step time within 5% of the optimum) from step "
              f"{d['near_optimal_plan_at_step']}: {d['windows_to_rebalance']} windows of K "
              f"-> rebalanced within 2 windows: **{d['rebalanced_within_2_windows']}**.",
              f"Throughput after: {d['samples_per_s_after']:.0f} samples/s = "
              f"{d['vs_oracle']:.2f} x a run started with the optimal plan "
              f"({d['oracle_plan_samples_per_s']:.0f}), {d['vs_budget_optimum']:.2f} x the "
              f"budget-only optimum ({d['budget_optimum_samples_per_s']:.0f}, no all-reduce or "
              f"optimizer time) -> within 15% of the re-planned optimum (oracle run): "
              f"**{d['within_15pct_of_oracle']}**."]
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--slow-steps", type=int, default=400, help="0: no slowdown run")
    ap.add_argument("--workload", choices=("cnn", "gpt"), default="cnn")
    ap.add_argument("--ms-per-sample", type=float, default=1.0,
                    help="budget of the speed-1 rank per sample (ms)")
    ap.add_argument("--overhead-ms", type=float, default=0.5)
    ap.add_argument("--target", type=float, default=0.90)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--auto-batch", action="store_true",
                    help="also run HeteroDDP(auto_batch=True): the global batch follows the "
                         "gradient noise scale")
    ap.add_argument("--max-global-batch", type=int, default=1024)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from hetrain.engine.wire import free_port
    from hetrain.workloads import get_workload

    wl = get_workload("cnn", "mnist1d") if args.workload == "cnn" else get_workload(
        "gpt", "text", model_options={"n_layer": 2, "n_embd": 64},
        dataset_options={"block_size": 64})
    out = args.out or f"ddp_uneven_{args.workload}"
    OUT.mkdir(exist_ok=True)
    raw_file = OUT / f"{out}.raw.json"
    t = time.perf_counter()
    ctx = mp.start_processes(rank_main, args=(4, free_port(), args, wl, str(raw_file)),
                             nprocs=4, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=2):
            if time.perf_counter() - t > args.timeout:
                raise TimeoutError(f"ranks did not finish in {args.timeout} s")
    except mp.ProcessExitedException as e:  # a rank dying at exit, after rank 0 wrote all
        if not raw_file.exists():
            raise
        print(f"warning: {e} (after the results were written)", file=sys.stderr)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    raw = json.loads(raw_file.read_text())
    raw_file.unlink()
    res = summarize(args, raw, time.perf_counter() - t)
    (OUT / f"{out}.json").write_text(json.dumps(res, indent=1))
    write_md(res, OUT / f"{out}.md")
    print((OUT / f"{out}.md").read_text())


if __name__ == "__main__":
    main()
