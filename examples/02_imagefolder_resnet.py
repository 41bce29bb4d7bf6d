"""An ImageFolder image classifier (the ImageNet100 layout) with a ResNet-style model.

    python examples/02_imagefolder_resnet.py --data /data/imagenet100     # your own tree
    python examples/02_imagefolder_resnet.py --make-fake-data --smoke     # CI: a tiny fake tree

The layout is ROOT/train/<class>/*.png|jpg and ROOT/val/<class>/* (ImageNet100 as it is
usually prepared), or ROOT/<class>/* with a seeded split. Images are decoded lazily and resized
to --size. The model is hetrain's ResNet-8 (GroupNorm by default here: a heterogeneous cluster
gives devices different batch sizes, and GroupNorm's output does not depend on them), trained
across the two-site "hetero-8" preset on the simulator; pass --engine dist for real processes.
Nothing is downloaded: --make-fake-data writes a few coloured-shape PNGs per class.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import numpy as np
import torch

import hetrain
from hetrain.workloads import MODELS
from hetrain.workloads.images import imagefolder


def make_fake_imagefolder(root: Path, classes: int = 4, per_class: int = 12, size: int = 32,
                          seed: int = 0) -> Path:
    """Write ROOT/{train,val}/class<k>/<i>.png: class k is a bright square in quadrant k on
    noise, so a small CNN learns it in a few steps. Returns root."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", max(2, per_class // 4))):
        for k in range(classes):
            d = root / split / f"class{k}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = rng.integers(0, 96, (size, size, 3), dtype=np.uint8)
                h = size // 2
                r0, c0 = (k // 2 % 2) * h, (k % 2) * h
                img[r0:r0 + h, c0:c0 + h, k % 3] = 255
                Image.fromarray(img).save(d / f"{i}.png")
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="ImageFolder root (ROOT/train, ROOT/val)")
    ap.add_argument("--make-fake-data", action="store_true",
                    help="write a tiny fake tree (into --data, or a temporary directory)")
    ap.add_argument("--size", type=int, default=64, help="images are resized to SIZE x SIZE")
    ap.add_argument("--epochs", type=float, default=10.0)
    ap.add_argument("--cluster", default="hetero-8", help="preset or cluster TOML")
    ap.add_argument("--strategy", default="cadp", help="any registered strategy")
    ap.add_argument("--engine", default="sim", choices=("sim", "dist"))
    ap.add_argument("--runs-dir", default=None, help="write runs/<name>/metrics.jsonl here")
    ap.add_argument("--smoke", action="store_true", help="32x32 images, a narrower model (CI)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="hetrain-imagefolder-") as tmp:
        root = args.data
        if args.make_fake_data:
            root = make_fake_imagefolder(root or Path(tmp), size=32)
        if root is None:
            ap.error("give --data ROOT (an ImageFolder tree) or --make-fake-data")
        # 48 images are under one round of hetero-8's 8 workers per epoch: 1 epoch stayed at
        # chance (0.25); 20 epochs reach 1.0 in about 2 s
        size, epochs = (32, 20.0) if args.smoke else (args.size, args.epochs)

        train_set, val_set, meta = imagefolder(root=root, size=size)
        model = functools.partial(MODELS["resnet"], (3, size, size), meta["num_classes"],
                                  width=8 if args.smoke else 16, norm="group")
        print(f"{len(train_set)} training / {len(val_set)} validation images, "
              f"{meta['num_classes']} classes, {args.strategy} on {args.cluster}")
        r = hetrain.train(
            model=model, dataset=train_set, test_dataset=val_set,
            optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
            cluster=args.cluster, strategy=args.strategy, engine=args.engine,
            batch_size=8 if args.smoke else 32, max_epochs=epochs, target_accuracy=0.6,
            name="imagefolder-resnet", runs_dir=args.runs_dir, progress=not args.smoke)
    s = r.summary
    tta = "not reached" if s["tta_s"] is None else f"{s['tta_s']:.2f} s"
    print(f"accuracy {s['final_accuracy']:.3f} (best {s['best_accuracy']:.3f}) after "
          f"{s['epochs']:.2f} epochs, {s['time_s']:.2f} s ({s['engine']}); hardware "
          f"efficiency {s['hardware_efficiency']:.2f}; time to 60% {tta}")


if __name__ == "__main__":
    main()
