"""Image data sets read from disk: an ImageFolder tree (ImageNet100 layout) and CIFAR-10 binaries.

Nothing is downloaded: point `root` at files you have. Both give normalised float CHW tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from hetrain.errors import ConfigError
from hetrain.workloads.registry import make_meta, register_dataset

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck"]
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}

_LAYOUT = "root/<class>/<image> or root/train/<class>/<image> with root/val/<class>/<image>"


def _stats(values: Sequence[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)


class ImageFiles(Dataset):
    """Lazy: decodes, converts to RGB and resizes (bilinear, size x size) on each __getitem__."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], size: int,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.samples, self.classes, self.size = samples, classes, size
        self.mean, self.std = _stats(mean), _stats(std)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        from PIL import Image

        path, label = self.samples[i]
        try:
            with Image.open(path) as f:
                im = f.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
                arr = np.asarray(im, dtype=np.float32) / 255.0
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise _unreadable(path, e) from None
        x = torch.from_numpy(arr).permute(2, 0, 1)
        return ((x - self.mean) / self.std).contiguous(), label


def _unreadable(path: str | Path, e: Exception) -> ConfigError:
    why = " ".join(str(e).split()) or type(e).__name__
    return ConfigError(f"imagefolder: '{path}' is not a readable image ({why}); remove or "
                       f"replace the file")


def _check_header(path: str) -> None:
    """Open the file's header (no decoding): a file that is not an image, or not one PIL
    reads, fails at load, naming it, instead of in a worker halfway through a run."""
    from PIL import Image

    try:
        with Image.open(path):
            pass
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _unreadable(path, e) from None


def _scan(d: Path, classes: list[str] | None = None,
          max_per_class: int | None = None) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, label) pairs of d/<class>/<image>, classes sorted (or given by the train split)."""
    if not d.is_dir():
        raise ConfigError(f"imagefolder: '{d}' is missing or not a directory; expected {_LAYOUT}")
    found = sorted(p.name for p in d.iterdir() if p.is_dir())
    if classes is None:
        classes = found
    elif extra := sorted(set(found) - set(classes)):
        raise ConfigError(f"imagefolder: '{d}' has classes not in the train split: {extra}")
    index = {c: i for i, c in enumerate(classes)}
    samples: list[tuple[str, int]] = []
    for c in found:
        files = sorted(p for p in (d / c).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        samples += [(str(p), index[c]) for p in files[:max_per_class]]
    for path, _ in samples:
        _check_header(path)
    if not samples:
        raise ConfigError(
            f"imagefolder: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found under '{d}'; "
            f"expected {_LAYOUT}"
        )
    return samples, classes


@register_dataset("imagefolder")
def imagefolder(
    *,
    root: str | Path,
    size: int = 64,
    test_fraction: float = 0.2,
    seed: int = 0,
    max_per_class: int | None = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[ImageFiles, ImageFiles, dict]:
    """ImageFolder tree; with root/train and root/val (or root/test) the splits are given (the
    ImageNet100 layout), otherwise a seeded per-class test_fraction split of root/<class>/*.
    Every image's header is read at load, so a corrupt file fails then, naming it."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"imagefolder: root '{root}' does not exist; expected {_LAYOUT}")
    if (root / "train").is_dir():
        held = next((root / s for s in ("val", "test") if (root / s).is_dir()), None)
        if held is None:
            raise ConfigError(f"imagefolder: '{root}' has train/ but no val/ or test/; expected {_LAYOUT}")
        train_s, classes = _scan(root / "train", max_per_class=max_per_class)
        test_s, _ = _scan(held, classes, max_per_class)
    else:
        samples, classes = _scan(root, max_per_class=max_per_class)
        g = torch.Generator().manual_seed(seed)
        train_s, test_s = [], []
        for label in range(len(classes)):
            mine = [s for s in samples if s[1] == label]
            perm = torch.randperm(len(mine), generator=g).tolist()
            n_test = round(len(mine) * test_fraction)
            test_s += [mine[i] for i in sorted(perm[:n_test])]
            train_s += [mine[i] for i in sorted(perm[n_test:])]
    meta = make_meta(len(classes), (3, size, size), "classification", 3 * size * size * 4 + 8,
                     classes=classes)
    return (ImageFiles(train_s, classes, size, mean, std),
            ImageFiles(test_s, classes, size, mean, std), meta)


class UInt8Images(Dataset):
    """Images kept as uint8 NCHW (4x less memory than float) and normalised per batch in `gather`."""

    def __init__(self, images: Tensor, labels: Tensor, mean: Sequence[float], std: Sequence[float]):
        self.images, self.labels = images, labels
        self.mean, self.std = _stats(mean), _stats(std)

    def __len__(self) -> int:
        return len(self.labels)

    def gather(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return (self.images[indices].float() / 255.0 - self.mean) / self.std, self.labels[indices]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, y = self.gather(torch.tensor([i]))
        return x[0], y[0]


def read_cifar_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse one CIFAR-10 binary batch: records of 1 label byte + 3072 pixel bytes (R, G, B
    planes of 32x32). Returns (uint8 images (N, 3, 32, 32), int64 labels (N,))."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % 3073:
        raise ConfigError(
            f"cifar10: '{path}' has {raw.size} bytes, not a positive multiple of 3073 "
            "(1 label byte + 3072 pixel bytes per record): truncated or not a CIFAR-10 .bin file"
        )
    rec = raw.reshape(-1, 3073)
    labels = rec[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise ConfigError(f"cifar10: '{path}' has label {labels.max()} > 9: not a CIFAR-10 file")
    return rec[:, 1:].reshape(-1, 3, 32, 32), labels


@register_dataset("cifar10")
def cifar10(
    *,
    root: str | Path,
    max_train: int | None = None,
    mean: Sequence[float] = CIFAR_MEAN,
    std: Sequence[float] = CIFAR_STD,
) -> tuple[UInt8Images, UInt8Images, dict]:
    """CIFAR-10 binary version: root (or root/cifar-10-batches-bin) holds data_batch_1..5.bin and
    test_batch.bin. max_train keeps the first N training images (quick runs)."""
    root = Path(root)
    if (root / "cifar-10-batches-bin").is_dir():
        root = root / "cifar-10-batches-bin"
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    if not root.is_dir():
        raise ConfigError(f"cifar10: root '{root}' does not exist; expected a directory with {names}")
    if missing := [n for n in names if not (root / n).is_file()]:
        raise ConfigError(f"cifar10: '{root}' is missing {missing}; expected all of {names}")
    parts = [read_cifar_bin(root / n) for n in names]
    x_tr = np.concatenate([p[0] for p in parts[:5]])[:max_train]
    y_tr = np.concatenate([p[1] for p in parts[:5]])[:max_train]

    def make(x: np.ndarray, y: np.ndarray) -> UInt8Images:
        return UInt8Images(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y), mean, std)

    meta = make_meta(10, (3, 32, 32), "classification", 3072 * 4 + 8, classes=CIFAR_CLASSES)
    return make(x_tr, y_tr), make(*parts[5]), meta
