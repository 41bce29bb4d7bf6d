"""DeepSpeed ZeRO stage 0 / 1 as a peer in the real benchmark (optional dependency).

DeepSpeed runs on CPU here (its CPU accelerator; DS_ACCELERATOR=cpu skips GPU detection) over
gloo: `deepspeed.init_distributed(dist_backend="gloo")` from the torchrun-style environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) that `real_peers._worker` sets. The engine wraps
the same CNN and the same SGD (lr, momentum) as the torch DDP peer, fp32, micro-batch 32 per
rank, no gradient accumulation, so each step averages the ranks' gradients like DDP:

- stage 0: DeepSpeed's own data parallelism (an all-reduce of the gradients per step);
- stage 1: ZeRO-1, optimizer state partitioned: reduce-scatter of the gradients, each rank
  steps its partition, all-gather of the parameters.

Throttling: a multi-gradient hook over all parameters fires once backward has produced every
gradient and sleeps to the step's compute deadline; DeepSpeed reduces only after that (the
model's 55 kB is far below its 500 MB reduce bucket), so communication starts when the
emulated slowest device would have finished, as in the torch DDP peer.

    .venv/bin/pip install -r benchmarks/requirements.txt   # deepspeed, torch kept
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from hetrain.engine.emulate import sleep_until

SYSTEMS = {"deepspeed_zero0": 0, "deepspeed_zero1": 1}
"""peer name -> ZeRO stage."""


def available() -> str | None:
    """None when DeepSpeed is importable, else why not (for the benchmark's note)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install -r benchmarks/requirements.txt)"
    return None


def init_deepspeed() -> None:
    """Join the process group from the environment, the way DeepSpeed does under torchrun."""
    from datetime import timedelta

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False,
                               timeout=timedelta(seconds=120))


def build_deepspeed(run: Any, pad: Any) -> tuple[torch.nn.Module, Any]:
    """(module to evaluate, step(batch)) for a `real_peers.PeerRun` whose system is ours."""
    import deepspeed
    import torch.distributed as dist

    stage = SYSTEMS[run.system]
    model = run.workload.build_model()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=run.lr, momentum=run.momentum)
    config = {
        "train_micro_batch_size_per_gpu": run.batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": run.batch_size * dist.get_world_size(),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def at_deadline(_grads: Any) -> None:
        sleep_until(pad.deadline_s)

    torch.autograd.graph.register_multi_grad_hook(
        [p for p in engine.module.parameters() if p.requires_grad], at_deadline, mode="all")

    def step(batch: Any) -> None:
        x, y = batch
        loss = run.workload.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    return engine.module, step
