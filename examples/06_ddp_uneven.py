"""Your own DDP script with uneven per-rank batches (hetrain.ddp): lines marked # hetrain.

    torchrun --standalone --nproc-per-node 3 examples/06_ddp_uneven.py   # gloo on CPUs
    torchrun --standalone --nproc-per-node 2 examples/06_ddp_uneven.py --smoke

--smoke: 2000 samples, 3 epochs of global batch 32 (1 epoch of 1200 at batch 128 was 7 steps
and stayed at chance, 0.125).
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from hetrain.ddp import HeteroDDP  # hetrain
from hetrain.workloads import evaluate, get_workload

ap = argparse.ArgumentParser()
ap.add_argument("--smoke", action="store_true", help="a small data set, 3 epochs (CI)")
args = ap.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
n, epochs, batch = (2000, 3, 32) if args.smoke else (8000, 10, 128)
wl = get_workload("cnn", "mnist1d", dataset_options={"num_samples": n})
torch.manual_seed(0)
model = DDP(wl.build_model())
het = HeteroDDP(global_batch=batch, seed=0, rebalance_every=5 if args.smoke else 20)  # hetrain
het.attach(model)                                   # hetrain: weighted gradient all-reduce
sampler = het.batch_sampler(wl.train)               # hetrain: was DistributedSampler(wl.train)
loader = DataLoader(wl.train, batch_sampler=sampler)  # hetrain: was batch_size=batch // world
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        with het.step():                            # hetrain: times the step, rebalances
            loss = wl.loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if dist.get_rank() == 0:
        _, acc = evaluate(model.module, wl.test, wl.loss_fn)
        print(f"epoch {epoch}: test accuracy {acc:.3f}, batches per rank {list(het.sizes)}")
dist.barrier()  # rank 0 may still evaluate: gloo aborts a rank that tears down under a busy peer
dist.destroy_process_group()
