"""The Workload record plus the batching and evaluation helpers every engine shares.

A Workload is plain data: two map-style datasets, a model factory, a loss and the few numbers the
planners need (classes, input shape, bytes per sample). Everything in it is picklable (module-level
functions and functools.partial, no lambdas) so it can be shipped to spawned worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

Task = Literal["classification", "language_model"]


@dataclass(frozen=True)
class Workload:
    """A model + data pair, e.g. "mnist1d-cnn"."""

    name: str
    """"<dataset>-<model>", e.g. "mnist1d-cnn"."""
    train: Dataset
    """Map-style training set; items are (input, target)."""
    test: Dataset
    """Map-style held-out set."""
    build_model: Callable[[], nn.Module]
    """Fresh model; deterministic under torch.manual_seed."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """(model output, target) -> mean loss (scalar)."""
    task: Task
    num_classes: int
    """Number of classes, or the vocabulary size for a language model."""
    sample_bytes: int
    """Bytes of one training sample (input + target) on the wire, for data-shipping cost."""
    input_shape: tuple[int, ...]
    """Shape of one input sample (no batch dimension)."""
    model_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The options build_model was made with (part of the flops_per_sample cache key)."""
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Loader extras: class names, the vocabulary of a text corpus, the source paths."""


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy over every prediction: (B, C) vs (B,) or per token (B, T, V) vs (B, T)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def correct_count(output: Tensor, target: Tensor) -> tuple[int, int]:
    """(number correct, number counted); a language model counts every token."""
    return int((output.argmax(-1) == target).sum()), target.numel()


def sample_bytes_of(x: Tensor, y: Tensor) -> int:
    """Wire bytes of one (input, target) sample as `gather` returns it."""
    return x.numel() * x.element_size() + y.numel() * y.element_size()


def gather(dataset: Dataset, indices: Tensor | Sequence[int]) -> tuple[Tensor, Tensor]:
    """Batch `dataset[indices]` as (inputs, targets); hot in the simulator, so avoid per-item work.

    Fast paths: TensorDataset (index the tensors), datasets with their own `gather(indices)`
    (token windows, uint8 image stores) and Subsets of those. Anything else is fetched item by item
    and collated with torch's default_collate.
    """
    idx = torch.as_tensor(indices, dtype=torch.long)
    if isinstance(dataset, Subset):
        parent = torch.as_tensor(dataset.indices, dtype=torch.long)
        return gather(dataset.dataset, parent[idx])
    if isinstance(dataset, TensorDataset):
        x, y = (t[idx] for t in dataset.tensors)
        return x, y
    fast = getattr(dataset, "gather", None)
    if callable(fast):
        return fast(idx)
    x, y = default_collate([dataset[i] for i in idx.tolist()])
    return x, y


class Batcher:
    """Shuffled mini-batches over a dataset (or a shard of it) through `gather`, no DataLoader.

    Each pass over the Batcher is one epoch; the order is a function of (seed, epoch) only, so a
    replayed run sees the same batches. `indices` restricts it to a shard (e.g. one device's).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        indices: Tensor | Sequence[int] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size, self.shuffle = dataset, batch_size, shuffle
        self.seed, self.drop_last, self.epoch = seed, drop_last, 0
        n = len(dataset)  # type: ignore[arg-type]
        self.indices = torch.arange(n) if indices is None else torch.as_tensor(indices).long()

    def __len__(self) -> int:
        n, b = len(self.indices), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = self.indices
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = order[torch.randperm(len(order), generator=g)]
        self.epoch += 1
        for i in range(len(self)):
            yield gather(self.dataset, order[i * self.batch_size : (i + 1) * self.batch_size])


def _device_of(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch_size: int = 1024,
) -> tuple[float, float]:
    """(mean loss, accuracy) over `dataset` in eval mode; the caller's train/eval mode is restored.

    Losses are weighted by the number of predictions in each batch (tokens for a language model),
    so the result does not depend on batch_size.
    """
    was_training, device = model.training, _device_of(model)
    model.eval()
    try:
        loss_sum, correct, count = 0.0, 0, 0
        n = len(dataset)  # type: ignore[arg-type]
        for start in range(0, n, batch_size):
            x, y = gather(dataset, torch.arange(start, min(start + batch_size, n)))
            x, y = x.to(device), y.to(device)
            out = model(x)
            c, k = correct_count(out, y)
            loss_sum += float(loss_fn(out, y)) * k
            correct, count = correct + c, count + k
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate: the dataset is empty")
    return loss_sum / count, correct / count
