"""Write your own training protocol: register a strategy and run it by name.

    python examples/05_custom_strategy.py [--smoke]

A strategy is a small state machine (hetrain.strategies.base): for each worker it says what
task to run next (batch size, local steps), and for each push that reaches the server which
buffered pushes to aggregate, with what weights, and whom to release. It never sees a clock or
a socket, so the same object runs on the simulator and on torch.distributed.

This one is post-local SGD (Lin et al., "Don't use large mini-batches, use local SGD", ICLR
2020; torch.distributed.algorithms' PostLocalSGD): synchronous averaging every step for the
first `warmup_rounds` rounds, while the loss falls fastest, then `local_steps` local steps per
round to cut communication. Registered under a name, it is also usable from a TOML config
(`[strategy] name = "post_local_sgd"`) once the module defining it is imported. Its options
declare their ranges with the fields (hetrain.strategies.options), so a bad value in a config
or a call is one error naming the option and the range, before anything runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated

import torch

import hetrain
from hetrain.strategies import (
    BarrierMixin,
    Decision,
    Push,
    RunContext,
    Strategy,
    WorkTask,
    register,
)
from hetrain.strategies.options import MAX_STEPS, integer


@register
@dataclass
class PostLocalSGD(BarrierMixin, Strategy):
    """Averaging after every step for `warmup_rounds` rounds, then every `local_steps` steps."""

    name = "post_local_sgd"
    comm = "allreduce"          # a collective of all workers (not a parameter server)
    update = "delta"            # workers step their own replica and push start - end params

    warmup_rounds: Annotated[int, integer(0)] = 20
    """Rounds of one local step (synchronous SGD) before switching to local SGD."""
    local_steps: Annotated[int, integer(1, MAX_STEPS)] = 8
    """Local steps per round after the warm-up."""

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        self.barrier_init(ctx.n_workers)
        self.rounds = 0

    def next_task(self, worker: int) -> WorkTask:
        steps = 1 if self.rounds < self.warmup_rounds else self.local_steps
        return WorkTask(batch_size=self.context.batch_size, local_steps=steps)

    def on_push(self, push: Push) -> Decision:
        decision = self.barrier_push(push, weight_by_samples=True)
        if decision.apply:  # a full round arrived: average it and release everyone
            self.rounds += 1
        return decision

    def stats(self) -> dict[str, float | int | str]:
        return {"rounds": self.rounds}


def r_name(strategy: str | dict) -> str:
    return strategy if isinstance(strategy, str) else strategy["name"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one short run (CI)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hetrain.workloads import get_workload

    # smoke: 0.5 epochs of 2000 samples (batch 32) stayed at chance (0.11); batch 8 gives
    # 4x the steps per epoch, and 5 epochs of 4000 reach 0.6-0.8 in a few seconds
    n, epochs, batch, warmup = (4000, 5.0, 8, 10) if args.smoke else (20000, 3.0, 32, 20)
    wl = get_workload("cnn", "mnist1d", dataset_options={"num_samples": n})
    results = {}
    for strategy in ("ddp", {"name": "post_local_sgd", "warmup_rounds": warmup}):
        r = hetrain.train(model=wl.build_model, dataset=wl.train, test_dataset=wl.test,
                          optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
                          cluster="hetero-8", strategy=strategy, batch_size=batch,
                          max_epochs=epochs, target_accuracy=0.6, name=r_name(strategy))
        results[r_name(strategy)] = r.summary
        tta = r.summary["tta_s"]
        print(f"{r_name(strategy):15s} accuracy {r.summary['final_accuracy']:.3f}  virtual time "
              f"{r.summary['time_s']:7.2f} s  time to 60% "
              f"{'not reached' if tta is None else f'{tta:.2f} s'}  "
              f"bytes {r.summary['bytes_total'] / 1e6:.1f} MB  {r.summary['strategy_stats']}")
    ratio = results["ddp"]["time_s"] / results["post_local_sgd"]["time_s"]
    if ratio >= 1:
        print(f"post-local SGD ran the same epochs {ratio:.1f}x sooner (simulated) than DDP")
    else:
        print(f"post-local SGD ran the same epochs {1 / ratio:.1f}x slower (simulated) than DDP")


if __name__ == "__main__":
    main()
