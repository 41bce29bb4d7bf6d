"""The Workload record plus the batching and evaluation helpers every engine shares.

A Workload is plain data: two map-style datasets, a model factory, a loss and the few numbers the
planners need (classes, input shape, bytes per sample). Everything in it is picklable (module-level
functions and functools.partial, no lambdas) so it can be shipped to spawned worker processes.

Batches are (inputs, targets) for the built-in workloads, but a user's workload (hetrain.train with
`train_step=`) may yield any nesting of tuples, lists and dicts of tensors: everything that touches
a batch here (gather, sample_bytes_of, map_tensors, BatchLoader, evaluate_workload) walks the
structure instead of unpacking a pair. The engines pick the sample indices (the plan's per-device
batch sizes, the data owner's permutation); a BatchLoader only turns those indices into batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

Task = Literal["classification", "language_model"]
TrainStep = Callable[[nn.Module, Any], Tensor]
"""(model, batch) -> mean loss of the batch (a scalar tensor; the engine calls backward)."""
EvalFn = Callable[[nn.Module, Any], tuple[Any, Any]]
"""(model, batch) -> (number correct, number counted) in the batch; accuracy = sums' ratio."""


@dataclass(frozen=True)
class LoaderOptions:
    """The torch DataLoader options a run honours when it turns planned indices into batches.

    The plan owns what a DataLoader's batch_size, shuffle, sampler, batch_sampler, drop_last and
    generator would decide (per-device batch sizes, the data owner's seeded order), so those are
    not options here. With num_workers > 0 every replica keeps one DataLoader with persistent
    workers whose batch_sampler is fed each task's planned index batches, so the workers load a
    task's local steps in parallel while the replica computes.
    """

    collate_fn: Callable[[list[Any]], Any] | None = None
    """List of dataset items -> batch (None: gather's fast paths, else torch's default_collate)."""
    num_workers: int = 0
    """DataLoader worker processes per replica (0: batches are loaded in the replica's process)."""
    pin_memory: bool | None = None
    """Pin batches before the copy to a GPU; None: pin on a GPU (the engines' default)."""
    prefetch_factor: int | None = None
    """Batches each DataLoader worker loads ahead (num_workers > 0 only)."""
    worker_init_fn: Callable[[int], None] | None = None
    """Called in each DataLoader worker with its id (num_workers > 0 only)."""
    timeout: float = 0.0
    """Seconds to wait for a batch from the DataLoader workers (0: forever)."""


def map_tensors(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to every tensor in its tuples, lists, dicts and namedtuples
    (other leaves are kept): how a batch of any structure is moved or pinned."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = {k: map_tensors(fn, v) for k, v in tree.items()}
        try:
            return type(tree)(items)  # type: ignore[call-arg]
        except TypeError:  # a Mapping that cannot be built from a dict (e.g. a defaultdict)
            return items
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(map_tensors(fn, v) for v in tree))
    if isinstance(tree, list | tuple):
        return type(tree)(map_tensors(fn, v) for v in tree)
    return tree


def tensor_leaves(tree: Any) -> list[Tensor]:
    """The tensors of a nested batch, in a fixed order (dicts in insertion order)."""
    out: list[Tensor] = []
    map_tensors(out.append, tree)
    return out


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
    train_step: TrainStep | None = None
    """(model, batch) -> mean loss, replacing loss_fn(model(x), y) for batches of any structure."""
    eval_fn: EvalFn | None = None
    """(model, batch) -> (correct, counted) for the test accuracy (None: argmax(model(x)) == y
    without train_step, no accuracy with it)."""
    loader: LoaderOptions = field(default_factory=LoaderOptions, hash=False)
    """How indices become batches (collate_fn, DataLoader workers, pinning)."""

    def batch(self, indices: Tensor | Sequence[int], *, test: bool = False) -> Any:
        """The training (or test) samples at `indices` as one batch, in this process."""
        return gather(self.test if test else self.train, indices, self.loader.collate_fn)

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """The mean loss of `batch`: train_step(model, batch), or loss_fn(model(x), y)."""
        if self.train_step is not None:
            return self.train_step(model, batch)
        x, y = batch
        return self.loss_fn(model(x), y)


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy over every prediction: (B, C) vs (B,) or per token (B, T, V) vs (B, T)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def correct_count(output: Tensor, target: Tensor) -> tuple[int, int]:
    """(number correct, number counted); a language model counts every token."""
    return int((output.argmax(-1) == target).sum()), target.numel()


def sample_bytes_of(*parts: Any) -> int:
    """Wire bytes of one sample: the tensors in `parts` (an input and a target as `gather`
    returns them, or one sample of any nested structure)."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(parts))


def gather(dataset: Dataset, indices: Tensor | Sequence[int],
           collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """Batch `dataset[indices]`; hot in the simulator, so avoid per-item work.

    Without collate_fn: fast paths for TensorDataset (index the tensors: an (inputs, targets)
    tuple), datasets with their own `gather(indices)` (token windows, uint8 image stores) and
    Subsets of those; anything else is fetched item by item and collated with torch's
    default_collate, so a dict item gives a dict batch. A collate_fn is the user's say on how
    items combine, so it always gets the items (dataset[i], as a DataLoader would).
    """
    idx = torch.as_tensor(indices, dtype=torch.long)
    if collate_fn is not None:
        return collate_fn([dataset[i] for i in idx.tolist()])
    if isinstance(dataset, Subset):
        parent = torch.as_tensor(dataset.indices, dtype=torch.long)
        return gather(dataset.dataset, parent[idx])
    if isinstance(dataset, TensorDataset):
        return tuple(t[idx] for t in dataset.tensors)
    fast = getattr(dataset, "gather", None)
    if callable(fast):
        return fast(idx)
    batch = default_collate([dataset[i] for i in idx.tolist()])
    return tuple(batch) if isinstance(batch, list) else batch


class _PlannedBatches:
    """A DataLoader batch_sampler that yields whatever index batches were set last: the
    planned indices of one task (the DataLoader re-iterates it on each pass)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class BatchLoader:
    """Turns lists of planned index batches into batches, honouring LoaderOptions.

    num_workers == 0: `gather` in this process (with collate_fn if given), exactly the batches
    a run without options sees. num_workers > 0: one torch DataLoader with persistent workers
    whose batch_sampler yields the planned index batches, so the indices (and so the numbers)
    are the same and only who loads them changes. Consume each `batches` iterator to the end
    before the next call (the workers serve one pass at a time).
    """

    def __init__(self, dataset: Dataset, options: LoaderOptions | None = None) -> None:
        self.dataset, self.options = dataset, options or LoaderOptions()
        self._sampler = _PlannedBatches()
        self._loader: DataLoader | None = None

    def batches(self, index_batches: Sequence[Tensor | Sequence[int]]) -> Iterator[Any]:
        o = self.options
        if o.num_workers == 0:
            for idx in index_batches:
                yield gather(self.dataset, idx, o.collate_fn)
            return
        if self._loader is None:
            self._loader = DataLoader(
                self.dataset, batch_sampler=self._sampler, num_workers=o.num_workers,
                collate_fn=o.collate_fn or default_collate, pin_memory=False,
                prefetch_factor=o.prefetch_factor, worker_init_fn=o.worker_init_fn,
                timeout=o.timeout, persistent_workers=True)
        self._sampler.batches = [torch.as_tensor(i, dtype=torch.long).tolist()
                                 for i in index_batches]
        yield from self._loader

    def close(self) -> None:
        """Stop the DataLoader workers (if any were started)."""
        it = getattr(self._loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._loader = None


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

    def __iter__(self) -> Iterator[Any]:
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


def evaluate(
    model: nn.Module,
    dataset: Dataset,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch_size: int = 1024,
) -> tuple[float, float]:
    """(mean loss, accuracy) over `dataset` of (input, target) pairs in eval mode; the caller's
    train/eval mode is restored.

    Losses are weighted by the number of predictions in each batch (tokens for a language model),
    so the result does not depend on batch_size.
    """
    wl = Workload(name="evaluate", train=dataset, test=dataset, build_model=nn.Identity,
                  loss_fn=loss_fn, task="classification", num_classes=0, sample_bytes=0,
                  input_shape=())
    loss, acc = evaluate_workload(model, wl, batch_size=batch_size)
    assert acc is not None
    return loss, acc


@torch.no_grad()
def evaluate_workload(model: nn.Module, workload: Workload, loader: BatchLoader | None = None,
                      batch_size: int = 1024) -> tuple[float, float | None]:
    """(mean loss, accuracy or None) of `model` on workload.test in eval mode; the caller's
    train/eval mode is restored. `loader` (over workload.test) brings the batches.

    Without train_step: loss_fn(model(x), y) weighted by the predictions in each batch (tokens
    for a language model), accuracy argmax == target unless eval_fn says otherwise. With
    train_step: its loss weighted by the samples in each batch, and accuracy only from eval_fn
    (hetrain cannot know what the model's outputs mean): None without one. Both weightings make
    the result independent of batch_size.
    """
    was_training, device = model.training, _device_of(model)
    loader = loader or BatchLoader(workload.test, workload.loader)
    n = len(workload.test)  # type: ignore[arg-type]
    index_batches = [torch.arange(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    model.eval()
    try:
        loss_sum, weight, correct, count = 0.0, 0, 0, 0
        for idx, batch in zip(index_batches, loader.batches(index_batches), strict=True):
            batch = map_tensors(lambda t: t.to(device), batch)
            if workload.train_step is None:
                x, y = batch
                out = model(x)
                loss_sum += float(workload.loss_fn(out, y)) * y.numel()
                weight += y.numel()
                c, k = correct_count(out, y) if workload.eval_fn is None \
                    else workload.eval_fn(model, batch)
            else:
                loss_sum += float(workload.train_step(model, batch)) * len(idx)
                weight += len(idx)
                c, k = workload.eval_fn(model, batch) if workload.eval_fn is not None else (0, 0)
            correct, count = correct + int(c), count + int(k)
    finally:
        model.train(was_training)
    if weight == 0:
        raise ValueError("evaluate: the dataset is empty")
    has_accuracy = workload.train_step is None or workload.eval_fn is not None
    return loss_sum / weight, (correct / count if count else 0.0) if has_accuracy else None
