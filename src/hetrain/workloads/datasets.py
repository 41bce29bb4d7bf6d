"""Small in-memory data sets that need no download: scikit-learn digits and generated MNIST-1D.

Loaders return (train, test, meta) with TensorDatasets, so `gather` indexes them directly.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from hetrain.workloads.registry import make_meta, register_dataset


def _split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random (train, test) index split, independent of the global RNG."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    return perm[n_test:], perm[:n_test]


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images, targets) of scikit-learn's bundled digits.csv.gz, read as `load_digits` reads
    it but without importing scikit-learn (0.9 s in every process that loads the data set,
    each rank of a dist run included); `load_digits` itself where the file is not found or
    is not the 1797 x 65 table it reads."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: finds, does not import
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" \
        if spec is not None and spec.origin else None
    if path is not None and path.is_file():
        with gzip.open(path, mode="rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        if data.shape == (1797, 65):
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images, d.target


@register_dataset("digits")
def digits(*, seed: int = 0, test_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset, dict]:
    """scikit-learn's 1797 8x8 handwritten digits (bundled with sklearn), as (1, 8, 8) floats
    standardised with the training set's mean and std; a seeded 80/20 split."""
    images, targets = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(targets, dtype=torch.long)
    tr, te = _split(len(y), test_fraction, seed)
    x = (x - x[tr].mean()) / x[tr].std()
    meta = make_meta(10, (1, 8, 8), "classification", 64 * 4 + 8, classes=[str(i) for i in range(10)])
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te]), meta


@functools.lru_cache(maxsize=8)
def _mnist1d_arrays(num_samples: int, seed: int, cache_dir: str | None) -> dict[str, np.ndarray]:
    """Generate (or load from cache_dir) MNIST-1D; seconds for 20k samples, hence the caches.

    mnist1d's make_dataset builds samples from its built-in templates (no download) but reseeds
    the global numpy and `random` RNGs, so their states are saved and restored around it.
    """
    path = Path(cache_dir) / f"mnist1d_n{num_samples}_s{seed}.npz" if cache_dir else None
    if path is not None and path.exists():
        with np.load(path) as f:
            arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test")}
    else:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples, args.seed = num_samples, seed
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            data = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = {k: np.asarray(data[k]) for k in ("x", "y", "x_test", "y_test")}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **arrays)
            tmp.replace(path)
    for a in arrays.values():
        a.flags.writeable = False  # shared by every caller of the lru_cache
    return arrays


@register_dataset("mnist1d")
def mnist1d(
    *, num_samples: int = 20000, seed: int = 42, cache_dir: str | Path | None = None
) -> tuple[TensorDataset, TensorDataset, dict]:
    """MNIST-1D (Greydanus 2020) generated locally: 10 classes of (1, 40) float signals, 80/20.

    num_samples is rounded down to a multiple of 10 (equal classes); cache_dir, if given, keeps
    the generated arrays in an .npz file across processes.
    """
    a = _mnist1d_arrays(int(num_samples), int(seed), str(cache_dir) if cache_dir else None)

    def make(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(
            torch.tensor(x, dtype=torch.float32).unsqueeze(1), torch.tensor(y, dtype=torch.long)
        )

    meta = make_meta(10, (1, 40), "classification", 40 * 4 + 8, classes=[str(i) for i in range(10)])
    return make(a["x"], a["y"]), make(a["x_test"], a["y_test"]), meta
