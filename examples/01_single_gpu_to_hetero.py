"""From a single-device training script to a heterogeneous cluster in a few lines.

    python examples/01_single_gpu_to_hetero.py            # ~20 s
    python examples/01_single_gpu_to_hetero.py --smoke    # a few steps (CI)
    python examples/01_single_gpu_to_hetero.py --engine dist   # real processes on this box
    torchrun --standalone --nproc-per-node 5 --local-ranks-filter 0 \
        examples/01_single_gpu_to_hetero.py --engine dist

BEFORE is an ordinary PyTorch script: a model, a Dataset class, a DataLoader loop. AFTER hands
the same model and data set to `hetrain.train`, which trains them on a cluster of 4 devices of
speeds 1:1:2:4 (the "hetero-4" preset; the simulator's virtual clock, so this runs on a laptop)
and reports time-to-accuracy and hardware efficiency (achieved samples/s over the sum of the
devices' samples/s). The same call with engine="dist" runs real processes: one parameter
server plus one process per device, spawned here, or started by torchrun (world size = devices
+ 1; every rank runs this script, rank 0 reports).
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hetrain


class Spirals(Dataset):
    """Three interleaved 2-D spirals: a small problem a linear model cannot solve."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        r = torch.rand(n, generator=g)
        angle = 4.0 * r + self.y * (2 * math.pi / 3) + 0.2 * torch.randn(n, generator=g)
        self.x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


class Net(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                    nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def before(train_set: Dataset, test_set: Dataset, epochs: int) -> float:
    """BEFORE: the single-device loop (what you have today)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(epochs):
        for x, y in DataLoader(train_set, batch_size=32, shuffle=True):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    with torch.no_grad():
        x, y = next(iter(DataLoader(test_set, batch_size=len(test_set))))
        return float((model(x).argmax(1) == y).float().mean())


def after(train_set: Dataset, test_set: Dataset, epochs: int,
          engine: str = "sim") -> hetrain.TrainResult:
    """AFTER: the same model and data, trained across 4 uneven devices."""
    return hetrain.train(
        model=Net(), dataset=train_set, test_dataset=test_set,
        loss_fn=nn.functional.cross_entropy,
        optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        cluster="hetero-4",              # or "path/to/cluster.toml", or a hetrain.Cluster
        strategy=STRATEGY,               # a name in hetrain.strategies.REGISTRY (+ options)
        batch_size=32, max_epochs=epochs, target_accuracy=0.9,
        engine=engine,                   # "sim": virtual clock; "dist": torch.distributed
    )


# C-ADP: batches sized to each device's speed and link, local steps, share-weighted averaging.
STRATEGY = "cadp"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="less data, fewer epochs (CI)")
    ap.add_argument("--engine", default="sim", choices=("sim", "dist"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, epochs = (3000, 5) if args.smoke else (6000, 5)
    train_set, test_set = Spirals(n, seed=0), Spirals(n // 5, seed=1)

    acc = before(train_set, test_set, epochs)
    print(f"before (one device, {epochs} epochs): test accuracy {acc:.3f}")

    r = after(train_set, test_set, epochs, args.engine)
    s = r.summary
    if s.get("role") == "worker":  # a torchrun worker rank: rank 0 reports
        return
    tta = "not reached" if s["tta_s"] is None else f"{s['tta_s']:.2f} s"
    clock = "simulated" if s["engine"] == "sim" else "wall clock"
    print(f"after  ({s['strategy']} on {s['cluster']}, {clock}): accuracy "
          f"{s['final_accuracy']:.3f}, time to 90%: {tta}, virtual time {s['time_s']:.2f} s, "
          f"hardware efficiency {s['hardware_efficiency']:.2f}")
    assert isinstance(r.model, Net)  # the trained global model comes back


if __name__ == "__main__":
    main()
