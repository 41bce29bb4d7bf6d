"""The Python API: bring your own nn.Module and Dataset, train them on a heterogeneous cluster.

    import hetrain
    result = hetrain.train(model=Net(), dataset=train_set, test_dataset=test_set,
                           optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
                           cluster="hetero-4", strategy="local_sgd", batch_size=32,
                           max_epochs=5, target_accuracy=0.9)
    result.summary["tta_s"], result.summary["hardware_efficiency"], result.model

`train` builds the same validated RunConfig a TOML file gives (so every option has the name and
the checks of the config reference, docs/config.md) and runs it on the same engines as
`hetrain run`: "sim" (virtual clock, in this process) or "dist" (real processes; under torchrun
every rank makes the same call). Nothing here is a second training loop.

Any map-style Dataset whose items are (input, target) pairs and any nn.Module work:
`make_workload` wraps them in a `hetrain.workloads.Workload`. For any other batch (dicts, several
inputs, masks) pass `train_step(model, batch) -> loss`, and `eval_fn(model, batch) -> (correct,
counted)` for an accuracy:

    def step(model, batch):                   # batch = {"x": (B, 64) tensor, "y": (B,) tensor}
        return F.cross_entropy(model(batch["x"]), batch["y"])
    def correct(model, batch):
        return (model(batch["x"]).argmax(-1) == batch["y"]).sum(), len(batch["y"])
    hetrain.train(model, dict_dataset, train_step=step, eval_fn=correct, collate_fn=None) Workers need identical fresh
copies of the model, so an instance is snapshotted (deep-copied, on the CPU) at the call and
copied again for every replica; a zero-argument factory (a class, a functools.partial) is called
under the run's seed instead. For `engine="dist"` without torchrun the workers are spawned
processes, so the model, the data set and the loss (train_step, eval_fn, collate_fn) must be
picklable (module-level classes and functions; guard the script with `if __name__ ==
"__main__":`); a lambda or a nested function is refused before any process starts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import os
import pickle
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, default_collate

from hetrain.cluster import Cluster, load_cluster
from hetrain.config import RunConfig, StopConfig, WorkloadConfig, config_from_dict
from hetrain.context import ProgressFn
from hetrain.errors import ConfigError
from hetrain.report.metrics import RunResult
from hetrain.runner import run_config_with_model
from hetrain.strategies import Strategy, make_strategy
from hetrain.workloads import (
    LoaderOptions,
    Workload,
    cross_entropy,
    map_tensors,
    sample_bytes_of,
    tensor_leaves,
)
from hetrain.workloads.base import EvalFn, TrainStep

ModelSpec = nn.Module | Callable[[], nn.Module]
TASKS = ("classification", "language_model")
_TORCH_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
_LOADER_HONOURED = ("collate_fn", "num_workers", "pin_memory", "prefetch_factor",
                    "worker_init_fn", "timeout")
_LOADER_PLANNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")
_SUPPORTED_KWARGS = {"sgd": {"lr", "momentum", "weight_decay", "nesterov"},
                     "adam": {"lr", "weight_decay"}, "adamw": {"lr", "weight_decay"}}


@dataclass
class TrainResult(RunResult):
    """A RunResult (rows, summary, run_dir, tta_s, final_accuracy) plus the trained model."""

    model: nn.Module | None = None
    """The final global model (on the dist engine: read back from the run's checkpoint; None
    on a torchrun worker rank, which returns no metrics either)."""


# ---- wrapping the user's model and data -------------------------------------------------------
def _first_item(dataset: Any, what: str) -> tuple[Tensor, Tensor]:
    """Check that `dataset` is a non-empty map-style set of (input, target); collate item 0."""
    _check_map_style(dataset, what)
    item = dataset[0]
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ConfigError(f"{what}[0] must be an (input, target) pair, got "
                          f"{type(item).__name__}; return `x, y` from __getitem__")
    x, y = default_collate([tuple(item)])
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise ConfigError(f"{what}[0] must hold tensors or numbers, got "
                          f"({type(item[0]).__name__}, {type(item[1]).__name__})")
    return x, y


def _probe_model(build: Callable[[], Any]) -> nn.Module:
    """One model from the user's factory, checked before any process starts."""
    probe = build()
    if not isinstance(probe, nn.Module):
        raise ConfigError(f"the model factory returned {type(probe).__name__}, not an "
                          "nn.Module")
    if not any(p.requires_grad for p in probe.parameters()):
        raise ConfigError(f"model {type(probe).__name__} has no trainable parameters")
    return probe


def _check_map_style(dataset: Any, what: str) -> None:
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__")
                                                    and hasattr(dataset, "__len__")):
        raise ConfigError(f"{what} must be a map-style torch Dataset (with __len__ and "
                          f"__getitem__), got {type(dataset).__name__}; wrap an iterable data "
                          "set in a list or a Dataset class that indexes it")
    if len(dataset) == 0:
        raise ConfigError(f"{what} is empty")


def _collate(dataset: Any, n: int, collate: Callable[[list[Any]], Any], what: str) -> Any:
    """Items 0..n-1 of `dataset` collated as the engines will (the user's collate_fn)."""
    try:
        return collate([dataset[i] for i in range(n)])
    except Exception as e:
        raise ConfigError(f"collating {n} item(s) of {what} failed: {type(e).__name__}: "
                          f"{e}") from e


def _shapes(batch: Any) -> str:
    """A batch's structure with tensors shown as their shapes, for error messages."""
    return repr(map_tensors(lambda t: tuple(t.shape), batch))


def _model_factory(model: ModelSpec) -> Callable[[], nn.Module]:
    if isinstance(model, nn.Module):
        # Snapshot now: later changes to the caller's instance must not leak into the run.
        return functools.partial(copy.deepcopy, copy.deepcopy(model).cpu())
    if callable(model):
        return model
    raise ConfigError(f"model must be an nn.Module or a zero-argument callable returning one, "
                      f"got {type(model).__name__}")


def _split(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """A seeded random (train, held-out) split as Subsets (which `gather` indexes fast)."""
    n = len(dataset)  # type: ignore[arg-type]
    n_test = max(1, round(n * fraction))
    if n - n_test < 1:
        raise ConfigError(f"dataset has {n} samples: too few to hold out a test set; pass "
                          "test_dataset=")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(dataset, sorted(perm[n_test:])), Subset(dataset, sorted(perm[:n_test]))


def make_workload(model: ModelSpec, dataset: Dataset, test_dataset: Dataset | None = None, *,
                  loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                  task: str = "classification", name: str | None = None,
                  test_fraction: float = 0.1, seed: int = 0,
                  train_step: TrainStep | None = None, eval_fn: EvalFn | None = None,
                  loader: LoaderOptions | None = None) -> Workload:
    """Wrap a user's model and map-style data set(s) into a Workload the engines run.

    test_dataset None holds out a seeded `test_fraction` of `dataset`. loss_fn(output, target)
    must return the mean loss (default: cross-entropy, per token for a language model).
    Accuracy is argmax(output) == target, per token for task="language_model"; for other
    tasks stop on a loss target (target_loss) instead. The model is checked on two samples
    here, so a shape mismatch fails now with the shapes named, not in a worker. The result
    works with every lower-level piece, e.g. hetrain.workloads.flops_per_sample(workload) or
    hetrain.runner.run_config(cfg, workload=workload).

    Batches of any structure: train_step(model, batch) returns the batch's mean loss (a scalar
    tensor the engine back-propagates; do not call backward or step in it) and replaces
    loss_fn(model(x), y), so items may be dicts, tuples of several inputs, anything `loader`'s
    collate_fn (default: torch's default_collate) turns into tensors. With train_step the test
    loss is train_step's loss on the test set, weighted by samples, and the test accuracy comes
    only from eval_fn(model, batch) -> (correct, counted) (summed over batches, then divided);
    without eval_fn a train_step run reports no accuracy (None). eval_fn also replaces the
    argmax accuracy of the (x, y) path.
    """
    if task not in TASKS:
        raise ConfigError(f"task = {task!r} is not allowed; choose one of: {', '.join(TASKS)}")
    for what, fn in (("train_step", train_step), ("eval_fn", eval_fn)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"{what} must be callable (model, batch) -> ..., got {fn!r}")
    if train_step is not None and loss_fn is not None:
        raise ConfigError("give loss_fn or train_step, not both: train_step computes the loss")
    loader = loader or LoaderOptions()
    build = _model_factory(model)
    if train_step is not None or loader.collate_fn is not None:
        return _custom_workload(build, model, dataset, test_dataset, loss_fn, task, name,
                                test_fraction, seed, train_step, eval_fn, loader)
    x0, y0 = _first_item(dataset, "dataset")
    if test_dataset is None:
        if not 0 < test_fraction < 1:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
        dataset, test_dataset = _split(dataset, test_fraction, seed)
    else:
        _first_item(test_dataset, "test_dataset")
    loss_fn = cross_entropy if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable (output, target) -> loss, got {loss_fn!r}")
    n = min(2, len(dataset))  # type: ignore[arg-type]
    x, y = default_collate([tuple(dataset[i]) for i in range(n)])
    with torch.random.fork_rng(devices=[]):  # the probe must not move the caller's RNG
        probe = _probe_model(build)
        try:
            out = probe.train()(x)
            loss = loss_fn(out, y)
        except Exception as e:
            raise ConfigError(f"model/loss_fn failed on a batch of {n} samples (input shape "
                              f"{tuple(x.shape)}, target shape {tuple(y.shape)}): {e}") from e
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ConfigError("loss_fn must return a scalar tensor (the mean loss over the batch)")
    num_classes = int(out.shape[-1]) if out.dim() > 1 else 1
    # The flops cache is keyed on (name, model_options, ...): fingerprint the architecture so
    # two user models of the same class but different sizes are not confused.
    arch = hashlib.sha1(repr(probe).encode()).hexdigest()[:12]
    model_name = getattr(model, "__name__", None) or type(probe).__name__
    if eval_fn is not None:
        _probe_eval_fn(eval_fn, probe, (x, y))
    return Workload(
        name=name or f"{type(dataset).__name__}-{model_name}".lower(), train=dataset,
        test=test_dataset, build_model=build, loss_fn=loss_fn, task=task,  # type: ignore[arg-type]
        num_classes=num_classes, sample_bytes=sample_bytes_of(x0[0], y0[0]),
        input_shape=tuple(x0.shape[1:]), model_options={"architecture": arch},
        meta={"source": "hetrain.api", "model_class": type(probe).__qualname__},
        eval_fn=eval_fn, loader=loader)


def _custom_workload(build: Callable[[], nn.Module], model: ModelSpec, dataset: Dataset,
                     test_dataset: Dataset | None, loss_fn: Any, task: str, name: str | None,
                     test_fraction: float, seed: int, train_step: TrainStep | None,
                     eval_fn: EvalFn | None, loader: LoaderOptions) -> Workload:
    """make_workload for a train_step and/or a collate_fn: items may be anything the collate
    function takes, so the checks run on collated batches instead of on (input, target) items."""
    _check_map_style(dataset, "dataset")
    collate = loader.collate_fn or default_collate
    one = _collate(dataset, 1, collate, "dataset")
    if test_dataset is None:
        if not 0 < test_fraction < 1:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
        dataset, test_dataset = _split(dataset, test_fraction, seed)
    else:
        _check_map_style(test_dataset, "test_dataset")
        _collate(test_dataset, 1, collate, "test_dataset")
    n = min(2, len(dataset))  # type: ignore[arg-type]
    batch = _collate(dataset, n, collate, "dataset")
    if not tensor_leaves(one):
        raise ConfigError(f"a collated batch of dataset holds no tensors ({_shapes(one)}); "
                          "make __getitem__ return tensors or numbers, or pass collate_fn=")
    loss_fn = cross_entropy if loss_fn is None else loss_fn
    with torch.random.fork_rng(devices=[]):  # the probe must not move the caller's RNG
        probe = _probe_model(build)
        what = "train_step" if train_step is not None else "model/loss_fn"
        try:
            if train_step is not None:
                loss = train_step(probe.train(), batch)
            else:
                if not (isinstance(batch, tuple | list) and len(batch) == 2
                        and all(isinstance(t, Tensor) for t in batch)):
                    raise ConfigError(f"collate_fn must return an (inputs, targets) pair of "
                                      f"tensors without train_step, got {_shapes(batch)}; or "
                                      "pass train_step=")
                out = probe.train()(batch[0])
                loss = loss_fn(out, batch[1])
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{what} failed on a batch of {n} samples {_shapes(batch)}: "
                              f"{type(e).__name__}: {e}") from e
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ConfigError(f"{what} must return a scalar tensor (the mean loss over the "
                              f"batch), got {type(loss).__name__}")
        if not loss.requires_grad:
            raise ConfigError(f"{what}'s loss does not depend on the model's parameters; return "
                              "the loss tensor (not loss.item() or a detached copy)")
        if eval_fn is not None:
            _probe_eval_fn(eval_fn, probe, batch)
    first = tensor_leaves(one)[0]
    num_classes = 0 if train_step is not None else (int(out.shape[-1]) if out.dim() > 1 else 1)
    arch = hashlib.sha1(repr(probe).encode()).hexdigest()[:12]
    model_name = getattr(model, "__name__", None) or type(probe).__name__
    return Workload(
        name=name or f"{type(dataset).__name__}-{model_name}".lower(), train=dataset,
        test=test_dataset, build_model=build, loss_fn=loss_fn, task=task,  # type: ignore[arg-type]
        num_classes=num_classes, sample_bytes=sample_bytes_of(one),
        input_shape=tuple(first.shape[1:]), model_options={"architecture": arch},
        meta={"source": "hetrain.api", "model_class": type(probe).__qualname__},
        train_step=train_step, eval_fn=eval_fn, loader=loader)


def _probe_eval_fn(eval_fn: EvalFn, probe: nn.Module, batch: Any) -> None:
    """Run eval_fn once on a probe batch so a wrong return shape fails here, named."""
    was_training = probe.training
    try:
        with torch.no_grad():
            result = eval_fn(probe.eval(), batch)
        correct, counted = result
        int(correct), int(counted)
    except Exception as e:
        raise ConfigError(f"eval_fn(model, batch) must return (correct, counted) numbers (or "
                          f"0-d tensors); on a batch {_shapes(batch)} it gave "
                          f"{type(e).__name__}: {e}") from e
    finally:
        probe.train(was_training)


def _unwrap_loader(data: Any, what: str) -> tuple[Any, dict[str, Any]]:
    """A DataLoader given as the data set: its dataset, and the options it was built with that
    hetrain honours (collate_fn, num_workers, pin_memory, prefetch_factor, worker_init_fn,
    timeout). Its batch_size, shuffle, sampler and drop_last are the plan's to decide, so they
    are not used; an iterable-style one is refused (the engines index samples)."""
    if not isinstance(data, DataLoader):
        return data, {}
    if isinstance(data.dataset, IterableDataset):
        raise ConfigError(f"{what} is a DataLoader over an IterableDataset; hetrain picks sample "
                          "indices per device, so it needs a map-style Dataset")
    opts: dict[str, Any] = {"num_workers": data.num_workers}
    if data.collate_fn is not default_collate:
        opts["collate_fn"] = data.collate_fn
    if data.pin_memory:
        opts["pin_memory"] = True
    if data.num_workers > 0:
        opts.update(prefetch_factor=data.prefetch_factor, worker_init_fn=data.worker_init_fn,
                    timeout=data.timeout)
    return data.dataset, opts


def _loader_options(options: Mapping[str, Any] | None, from_loader: Mapping[str, Any],
                    **explicit: Any) -> LoaderOptions:
    """The options of a DataLoader given as the data set, loader_options= and the explicit
    collate_fn= / num_workers= / pin_memory= arguments merged into LoaderOptions; a key given
    two ways with different values, a key the plan owns (batch_size, shuffle, samplers,
    drop_last, generator) or an unknown key is refused."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"loader_options must be a dict of DataLoader options, got "
                          f"{type(options).__name__}")
    opts = dict(from_loader)
    layers = (("the DataLoader given as dataset", "loader_options", dict(options or {})),
              ("loader_options (or the DataLoader)", "the argument",
               {k: v for k, v in explicit.items() if v is not None}))
    for before, now, layer in layers:
        for key, value in layer.items():
            if key in opts and opts[key] is not value and opts[key] != value:
                raise ConfigError(f"{key} is given twice with different values: {before} says "
                                  f"{opts[key]!r}, {now} {key}={value!r}; give it once")
            opts[key] = value
    if planned := [k for k in _LOADER_PLANNED if k in opts]:
        raise ConfigError(f"loader_options {planned}: the plan decides per-device batch sizes "
                          "and the sample order (batch_size= is the reference batch, the seed "
                          "orders the samples); remove them")
    if unknown := sorted(set(opts) - set(_LOADER_HONOURED)):
        raise ConfigError(f"loader_options: unsupported key(s) {unknown}; supported: "
                          f"{list(_LOADER_HONOURED)}")
    workers = opts.get("num_workers", 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"num_workers must be an integer >= 0, got {workers!r}")
    if opts.get("prefetch_factor") is not None and workers == 0:
        raise ConfigError("prefetch_factor needs num_workers > 0 (as in torch's DataLoader)")
    if opts.get("pin_memory") not in (None, True, False):
        raise ConfigError(f"pin_memory must be True or False, got {opts['pin_memory']!r}")
    for key in ("collate_fn", "worker_init_fn"):
        if opts.get(key) is not None and not callable(opts[key]):
            raise ConfigError(f"{key} must be callable, got {opts[key]!r}")
    return LoaderOptions(**opts)


# ---- options ----------------------------------------------------------------------------------
def _torch_optimizer_class(cls: Any) -> TypeGuard[type[torch.optim.Optimizer]]:
    """Whether `cls` is an optimizer class torch.optim exports under its own name."""
    return (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and getattr(torch.optim, cls.__name__, None) is cls)


def _optimizer_table(optimizer: Any) -> dict[str, Any]:
    """A dict, a torch optimizer class, (class, kwargs) or functools.partial(class, **kwargs)
    -> the [optimizer] table. The engines rebuild the optimizer on every replica from it:
    SGD, Adam and AdamW map to their own keys, any other torch.optim class to its name and
    `options` (hetrain.validate.check_optimizer checks them)."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, Mapping):
        return dict(optimizer)
    cls, kwargs = optimizer, {}
    if isinstance(optimizer, functools.partial):
        cls, kwargs = optimizer.func, dict(optimizer.keywords)
    elif isinstance(optimizer, tuple) and len(optimizer) == 2:
        cls, kwargs = optimizer[0], dict(optimizer[1])
    name = _TORCH_OPTIMIZERS.get(cls)
    if name is None:
        if not _torch_optimizer_class(cls):
            raise ConfigError(f"optimizer {optimizer!r} is not supported; give a dict like "
                              "{'name': 'sgd', 'lr': 0.05} or a torch.optim optimizer class "
                              "(as a class, (class, kwargs) or functools.partial)")
        lr = {"lr": kwargs.pop("lr")} if "lr" in kwargs else {}
        return {"name": cls.__name__, **lr, "options": kwargs}
    if unknown := sorted(set(kwargs) - _SUPPORTED_KWARGS[name]):
        raise ConfigError(f"optimizer {cls.__name__}: option(s) {unknown} are not supported; "
                          f"allowed: {sorted(_SUPPORTED_KWARGS[name])}")
    return {"name": name, **kwargs}


def _scheduler_keys(scheduler: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A torch.optim.lr_scheduler name, or {"name": ..., **its options} -> the [optimizer]
    keys scheduler / scheduler_options (hetrain.validate.check_scheduler checks them). A name,
    not a scheduler object: the engines rebuild the schedule on every server from it."""
    if scheduler is None:
        return {}
    if isinstance(scheduler, str):
        return {"scheduler": scheduler}
    if isinstance(scheduler, Mapping) and "name" in scheduler:
        options = {k: v for k, v in scheduler.items() if k != "name"}
        return {"scheduler": scheduler["name"], "scheduler_options": options}
    raise ConfigError(f"scheduler must be a torch.optim.lr_scheduler name (e.g. 'StepLR') or a "
                      f"table {{'name': 'StepLR', 'step_size': 100, ...}}, got {scheduler!r}")


def _strategy(strategy: str | Mapping[str, Any] | Strategy
              ) -> tuple[dict[str, Any], Strategy | None]:
    """The [strategy] table for the record, and the instance to run if one was given."""
    if isinstance(strategy, Strategy):
        opts = {f.name: getattr(strategy, f.name) for f in fields(strategy) if f.init}
        return {"name": strategy.name, **opts}, strategy
    if isinstance(strategy, str):
        return {"name": strategy}, None
    if isinstance(strategy, Mapping) and "name" in strategy:
        return dict(strategy), None
    raise ConfigError(f"strategy must be a registered name, a table with a 'name' key or a "
                      f"Strategy instance, got {strategy!r}")


def _cluster(cluster: str | Path | Cluster | Mapping[str, Any]
             ) -> tuple[str | dict[str, Any], Cluster | None]:
    if isinstance(cluster, Cluster):
        return cluster.to_dict(), cluster
    if isinstance(cluster, Path) or (isinstance(cluster, str) and cluster.endswith(".toml")):
        return str(Path(cluster).resolve()), None
    if isinstance(cluster, str):
        return cluster, None
    if isinstance(cluster, Mapping):
        return dict(cluster), None
    raise ConfigError(f"cluster must be a preset name, a path to a cluster TOML, a table or a "
                      f"hetrain.Cluster, got {type(cluster).__name__}")


def _printing_progress(name: str) -> ProgressFn:
    def show(fraction: float, row: dict[str, Any] | None) -> None:
        if row is not None:
            acc = row["test_accuracy"]  # None: a train_step run without eval_fn
            print(f"[{name}] {fraction:4.0%}  t={row['time_s']:8.2f}s  epoch={row['epoch']:5.2f}"
                  f"  test_loss={row['test_loss']:.4f}"
                  f"  test_acc={'-' if acc is None else format(acc, '.4f')}", flush=True)
    return show


# ---- training ---------------------------------------------------------------------------------
def train(model: ModelSpec, dataset: Dataset, *, test_dataset: Dataset | None = None,
          loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
          train_step: TrainStep | None = None, eval_fn: EvalFn | None = None,
          collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int | None = None,
          pin_memory: bool | None = None, loader_options: Mapping[str, Any] | None = None,
          task: str = "classification", optimizer: Any = None,
          scheduler: str | Mapping[str, Any] | None = None,
          cluster: str | Path | Cluster | Mapping[str, Any] = "hetero-4",
          strategy: str | Mapping[str, Any] | Strategy = "auto", engine: str = "sim",
          batch_size: int = 32, stop: Mapping[str, Any] | None = None,
          max_epochs: float | None = None, target_accuracy: float | None = None,
          target_loss: float | None = None, seed: int = 0, name: str = "train",
          runs_dir: str | Path | None = None, tensorboard: bool = False,
          checkpoint: bool = True, resume: bool = False,
          progress: bool | ProgressFn = False,
          config: Mapping[str, Mapping[str, Any]] | None = None) -> TrainResult:
    """Train `model` on `dataset` across `cluster` with `strategy`; return metrics and model.

    - optimizer: {"name": "sgd"|"adam"|"adamw", "lr": ..., ...} (the [optimizer] table), or
      torch.optim.SGD / Adam / AdamW as a class, (class, kwargs) or functools.partial.
    - scheduler: a torch.optim.lr_scheduler by name ("CosineAnnealingLR") or a table
      {"name": "StepLR", "step_size": 100, "gamma": 0.5}: stepped by the global step (server
      updates), the same on both engines; lr-valued options (eta_min, max_lr) are factors of
      the optimizer's lr (optimizer.scheduler in docs/config.md). Rows get an "lr" column.
      LambdaLR / MultiplicativeLR take their callable here: {"name": "LambdaLR", "lr_lambda":
      fn}, fn(global step) -> factor (engine="dist": a module-level def, so that it pickles).
    - cluster: a preset ("homo-4", "hetero-4", "hetero-8", "geo-16"), a cluster TOML path, a
      table, or a hetrain.Cluster. strategy: a registered name (see hetrain.strategies.REGISTRY,
      user strategies included), a table {"name": ..., **options}, or a Strategy instance;
      the default, "auto", plans devices, batch, local steps and lr for time to accuracy.
    - batch_size: the reference per-worker batch (DDP's per-rank batch); strategies that
      balance load derive each device's batch from it.
    - stop: the [stop] table; max_epochs / target_accuracy / target_loss override its keys.
      TTA (summary["tta_s"]) is the first evaluation time at which the target is reached.
    - runs_dir: write runs_dir/<name>/metrics.jsonl and summary.json (None: no files).
    - tensorboard: also write TensorBoard events to runs_dir/<name>/tensorboard/ (the
      train.tensorboard key); needs runs_dir and the tensorboard package, both checked before
      training.
    - checkpoint: with runs_dir, write runs_dir/<name>/checkpoint.pt when the run ends,
      every train.checkpoint_every server updates, and on Ctrl-C / SIGTERM (the run then
      raises hetrain.engine.signals.RunInterrupted); False writes none (the train.checkpoint
      key; the dist engine then returns no model, which it reads back from that file).
    - resume: continue the run runs_dir/<name> from its checkpoint (the train.resume key;
      `hetrain run --resume`), on the engine that wrote it; a simulator run goes on exactly
      as the uncut run would have. A checkpoint of another model, data set, cluster,
      optimizer, strategy or engine is refused. A larger max_epochs trains a finished run
      further.
    - progress: True prints a line per evaluation; or a callback (fraction, row | None).
    - config: any other tables of the run config reference, e.g. {"train": {"threads": 2,
      "compression": "fp16"}, "dist": {"backend": "nccl"}}; validated the same way.
    - train_step(model, batch) -> mean loss tensor, for batches of any structure (dicts,
      tuples of several inputs); eval_fn(model, batch) -> (correct, counted) for the test
      accuracy (see make_workload). Without eval_fn a train_step run evaluates its loss only,
      so stop on target_loss (target_accuracy is refused).
    - collate_fn, num_workers, pin_memory (or loader_options={...} with those keys and
      prefetch_factor, worker_init_fn, timeout): the DataLoader options honoured when the
      engines turn planned indices into batches. dataset (and test_dataset) may be a
      DataLoader: its dataset is trained on and those options of it are taken. batch_size, shuffle, sampler, batch_sampler,
      drop_last and generator are refused: the plan sets each device's batch and the seed the
      order. num_workers > 0 starts DataLoader workers on the sim (shared by the replicas),
      and in every worker process on the dist engine (spawned or under torchrun).
    """
    doc = _document(name=name, cluster=cluster, engine=engine, strategy=strategy,
                    optimizer=optimizer, scheduler=scheduler, batch_size=batch_size, seed=seed, stop=stop,
                    config=config, max_epochs=max_epochs, target_accuracy=target_accuracy,
                    target_loss=target_loss, tensorboard=tensorboard, checkpoint=checkpoint,
                    resume=resume)
    strategy_instance = _strategy(strategy)[1]
    cfg = config_from_dict(doc)
    if cfg.train.tensorboard and runs_dir is None:
        raise ConfigError("tensorboard=True writes runs_dir/<name>/tensorboard/ beside "
                          "metrics.jsonl: pass runs_dir as well (e.g. runs_dir='runs')")
    if cfg.train.resume and runs_dir is None:
        raise ConfigError("resume=True continues from runs_dir/<name>/checkpoint.pt: pass the "
                          "runs_dir of the run to continue")
    cluster_obj = cluster if isinstance(cluster, Cluster) else load_cluster(cfg.cluster)
    strategy_obj = strategy_instance or make_strategy(cfg.strategy.name, **cfg.strategy.options)
    dataset, from_loader = _unwrap_loader(dataset, "dataset")
    test_dataset, _ = _unwrap_loader(test_dataset, "test_dataset")
    loader = _loader_options(loader_options, from_loader, collate_fn=collate_fn,
                             num_workers=num_workers, pin_memory=pin_memory)
    if train_step is not None and eval_fn is None and cfg.stop.target_accuracy > 0:
        raise ConfigError("target_accuracy needs an accuracy, which a train_step run measures "
                          "only with eval_fn=(model, batch) -> (correct, counted); pass eval_fn "
                          "or stop on target_loss")
    workload = make_workload(model, dataset, test_dataset, loss_fn=loss_fn, task=task, seed=seed,
                             train_step=train_step, eval_fn=eval_fn, loader=loader)
    cfg = cfg.replace(workload=WorkloadConfig(
        model=f"user:{workload.meta['model_class']}", dataset=f"user:{type(dataset).__name__}"))
    fn = _printing_progress(name) if progress is True else (progress or None)
    threads = torch.get_num_threads()
    try:
        if cfg.engine == "sim":
            return _train_sim(cfg, cluster_obj, workload, strategy_obj, runs_dir, fn)
        return _train_dist(cfg, cluster_obj, workload, strategy_obj, runs_dir, fn)
    finally:
        torch.set_num_threads(threads)  # prepare() sets cfg.train.threads for the run


def _document(*, name: str, cluster: Any, engine: str, strategy: Any, optimizer: Any,
              scheduler: str | Mapping[str, Any] | None = None, batch_size: int, seed: int, stop: Mapping[str, Any] | None,
              config: Mapping[str, Mapping[str, Any]] | None, tensorboard: bool = False,
              checkpoint: bool = True, resume: bool = False,
              **stop_keys: Any) -> dict[str, Any]:
    """The run config document train() validates with config_from_dict."""
    extra = {k: dict(v) for k, v in (config or {}).items()}
    if bad := sorted(set(extra) - {"train", "stop", "optimizer", "dist"}):
        raise ConfigError(f"config: table(s) {bad} cannot be given here; pass model, dataset, "
                          "cluster, strategy and engine as arguments (allowed tables: train, "
                          "stop, optimizer, dist)")
    stop_table = {**dict(stop or {}), **extra.pop("stop", {})}
    stop_table.update({k: v for k, v in stop_keys.items() if v is not None})
    cluster_spec, _ = _cluster(cluster)
    doc: dict[str, Any] = {
        "name": name, "cluster": cluster_spec, "engine": engine,
        "strategy": _strategy(strategy)[0],
        "optimizer": {**_optimizer_table(optimizer), **_scheduler_keys(scheduler),
                      **extra.pop("optimizer", {})},
        "train": {"batch_size": batch_size, "seed": seed, "tensorboard": tensorboard,
                  "checkpoint": checkpoint, "resume": resume,
                  **extra.pop("train", {})},
        "stop": stop_table, **extra,
    }
    if not isinstance(batch_size, int) or isinstance(batch_size, bool):
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    unknown = sorted(set(stop_table) - {f.name for f in fields(StopConfig)})
    if unknown:
        raise ConfigError(f"stop: unknown key(s) {unknown}; allowed keys: "
                          f"{sorted(f.name for f in fields(StopConfig))}")
    return doc


def _train_sim(cfg: RunConfig, cluster: Cluster, workload: Workload, strategy: Strategy,
               runs_dir: str | Path | None, progress: ProgressFn | None) -> TrainResult:
    r, model = run_config_with_model(cfg, runs_root=runs_dir, progress=progress,
                                     cluster=cluster, workload=workload, strategy=strategy)
    return TrainResult(r.name, r.rows, r.summary, r.run_dir, model=model)


def _train_dist(cfg: RunConfig, cluster: Cluster, workload: Workload, strategy: Strategy,
                runs_dir: str | Path | None, progress: ProgressFn | None) -> TrainResult:
    """Real processes (see hetrain.engine.dist); the model comes back through the checkpoint
    rank 0 writes when the run stops, so a run directory is needed (a temporary one if none)."""
    if "RANK" not in os.environ:
        _check_spawnable(workload, cfg)
        try:
            pickle.dumps((workload, strategy))
        except Exception as e:
            raise ConfigError(f"engine='dist' spawns worker processes, which receive the model, "
                              f"data set and loss by pickling, and they are not picklable "
                              f"({e}); define them at module level (no lambdas or local "
                              f"classes) and guard the script with `if __name__ == "
                              f"'__main__':`") from e
    if runs_dir is None:  # the model comes back through a checkpoint in a temporary directory
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, checkpoint=True))
    if runs_dir is None and "RANK" in os.environ:
        root = _torchrun_scratch()
        try:
            r, model = run_config_with_model(cfg, runs_root=root, progress=progress,
                                             cluster=cluster, workload=workload,
                                             strategy=strategy)
        finally:  # the secret went at the handshake; rank 0's checkpoint goes now
            if os.environ.get("RANK") == "0":
                shutil.rmtree(root, ignore_errors=True)
        return TrainResult(r.name, r.rows, r.summary, None, model=model)
    with tempfile.TemporaryDirectory(prefix="hetrain-") as tmp:
        root = Path(runs_dir) if runs_dir is not None else Path(tmp)
        r, model = run_config_with_model(cfg, runs_root=root, progress=progress,
                                         cluster=cluster, workload=workload, strategy=strategy)
    return TrainResult(r.name, r.rows, r.summary, r.run_dir if runs_dir is not None else None,
                       model=model)


def _torchrun_scratch() -> Path:
    """The folder the ranks of one machine share under torchrun when the script passes no
    runs_dir: rank 0 writes the run's generated secret there for the others to read (a
    private temporary folder per rank hid it: every worker stopped with "no secret") and its
    checkpoint, from which the model comes back. One per job (torchrun's run id and master
    port), this user's only (0700, checked): on several machines set HETRAIN_SECRET."""
    env = os.environ
    job = "-".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    safe_job = re.sub(r"[^A-Za-z0-9.-]", "_", job)
    path = Path(tempfile.gettempdir()) / f"hetrain-{os.getuid()}-{safe_job}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path} is not a folder private to this user (torchrun ranks share "
                          f"it without runs_dir); remove it, or pass runs_dir to train()")
    return path


def _scheduler_callables(options: Mapping[str, Any], key: str = "scheduler"
                         ) -> list[tuple[str, Any]]:
    """(where, fn) of the lr_lambda callables in scheduler options, sub-schedulers too."""
    found = [(f"{key}.lr_lambda", options["lr_lambda"])] if "lr_lambda" in options else []
    for k, sub in enumerate(options.get("schedulers", None) or ()):
        if isinstance(sub, Mapping):
            found += _scheduler_callables(sub, f"{key}.schedulers[{k}]")
    return found


def _check_spawnable(workload: Workload, cfg: RunConfig | None = None) -> None:
    """Refuse, in one line and before any process starts, what a spawned dist run cannot ship
    or run: a user callable that does not pickle. The spawned workers receive them (the
    workload through a pipe, the config, with a LambdaLR's lr_lambda, as the spawn's
    arguments) from this process only, never from the network."""
    callables = (("train_step", workload.train_step), ("eval_fn", workload.eval_fn),
                 ("collate_fn", workload.loader.collate_fn), ("loss_fn", workload.loss_fn),
                 ("worker_init_fn", workload.loader.worker_init_fn),
                 *(_scheduler_callables(cfg.optimizer.scheduler_options)
                   if cfg is not None else ()))
    for what, fn in callables:
        if fn is None:
            continue
        try:
            pickle.dumps(fn)
        except Exception as e:
            label = getattr(fn, "__qualname__", None) or repr(fn)
            raise ConfigError(f"engine='dist' spawns worker processes, which receive {what} by "
                              f"pickling, and {what}={label} cannot be pickled "
                              f"({type(e).__name__}); define it with `def` at module level "
                              "(not a lambda or a nested function)") from e


# ---- planning for users who keep their own loop -----------------------------------------------
@dataclass(frozen=True)
class BatchPlan:
    """Per-device batch sizes for one synchronous step of `total_batch` samples, balanced so
    every device finishes its `local_steps` steps + its pull/push at the same time.

    In your own loop: rank j uses `batch_sizes[j]` samples per step (0: leave it out), runs
    `local_steps` steps between synchronisations, and averages with `weights[j]` (its share of
    the samples) instead of DDP's 1/n, which is what keeps unequal batches unbiased.
    """

    devices: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    """Samples per step on each device; they sum to total_batch."""
    local_steps: int
    """Steps between two synchronisations (the same on every device)."""
    weights: tuple[float, ...]
    """batch_sizes[j] / total_batch: the weight of device j's update in the average."""
    round_time_s: float
    """Predicted time of one round (local_steps steps + pull + push) with these batches."""
    equal_round_time_s: float
    """The same round with equal batches (total_batch / n each, as DDP does)."""
    efficiency: float
    """Predicted hardware efficiency: samples/s of the plan over the devices' summed samples/s
    (compute only), in (0, 1]."""

    @property
    def speedup_vs_equal(self) -> float:
        return self.equal_round_time_s / self.round_time_s if self.round_time_s else 1.0


def plan_batches(cluster: str | Path | Cluster | Mapping[str, Any], total_batch: int, *,
                 model: ModelSpec | None = None, dataset: Dataset | None = None,
                 flops_per_sample: float | None = None, model_bytes: int | None = None,
                 local_steps: int = 1, comm_fraction: float = 0.03, max_local_steps: int = 32,
                 activation_bytes_per_sample: float = 0.0) -> BatchPlan:
    """Split `total_batch` samples per step across the devices of `cluster` (C-ADP's exact
    min-makespan allocation, hetrain.plan.allocate, the planner the `cadp` strategy uses).

    The cost model needs the model's FLOPs and bytes: give `model` and a `dataset` (one sample
    is traced with torch's FLOP counter, as the engines do), or `flops_per_sample` (forward +
    backward FLOPs) and `model_bytes` directly. local_steps=0 picks H so that the devices'
    pull + push time is at most `comm_fraction` of a round (capped at max_local_steps). Memory:
    parameters, gradients and two optimizer states (4 x model_bytes) plus
    `activation_bytes_per_sample` per sample of a batch must fit in each device's memory.
    """
    import numpy as np

    from hetrain.plan.allocate import (
        RoundWork,
        plan_round,
        round_costs,
        speed_weighted_local_steps,
    )
    from hetrain.workloads import flops_per_sample as count_flops

    cl = cluster if isinstance(cluster, Cluster) else load_cluster(_cluster(cluster)[0])
    if isinstance(total_batch, bool) or not isinstance(total_batch, int) or total_batch < 1:
        raise ConfigError(f"total_batch must be an integer >= 1, got {total_batch!r}")
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 0:
        raise ConfigError(f"local_steps must be an integer >= 0 (0: auto), got {local_steps!r}")
    if model is not None:
        if dataset is None:
            raise ConfigError("plan_batches(model=...) needs dataset= (one sample is traced to "
                              "count the model's FLOPs)")
        wl = make_workload(model, dataset, dataset)
        probe = wl.build_model()
        flops_per_sample = flops_per_sample or count_flops(wl)
        if model_bytes is None:
            model_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())
    if flops_per_sample is None or flops_per_sample <= 0:
        raise ConfigError("plan_batches needs model= and dataset=, or flops_per_sample > 0")
    mb = int(model_bytes or 0)
    comm, compute, _ = round_costs(cl, RoundWork(samples=0, flops_per_sample=flops_per_sample,
                                                 model_bytes=mb, steps=0, ship_data=False))
    speed = 1.0 / np.asarray(compute)                      # samples/s of each device
    if local_steps == 0:  # cadp's auto H, at the step time of a balanced split
        local_steps = speed_weighted_local_steps(comm, compute, total_batch / float(speed.sum()),
                                                 comm_fraction, 1, max_local_steps)
    work = RoundWork(samples=local_steps * total_batch, flops_per_sample=flops_per_sample,
                     model_bytes=mb, ship_data=False, steps=local_steps,
                     memory_fixed_bytes=4 * mb,
                     memory_per_sample_bytes=activation_bytes_per_sample / local_steps)
    alloc = plan_round(cl, work, granularity=local_steps)
    batches = tuple(s // local_steps for s in alloc.shares)
    equal = [total_batch // cl.n + (j < total_batch % cl.n) for j in range(cl.n)]
    fixed, per_sample, _ = round_costs(cl, work)
    equal_s = max(a + b * local_steps * x for a, b, x in zip(fixed, per_sample, equal,
                                                             strict=True) if x > 0)
    return BatchPlan(
        devices=tuple(d.name for d in cl.devices), batch_sizes=batches, local_steps=local_steps,
        weights=tuple(b / total_batch for b in batches), round_time_s=alloc.makespan_s,
        equal_round_time_s=equal_s,
        efficiency=alloc.total / alloc.makespan_s / float(speed.sum()) if alloc.makespan_s
        else 1.0)
