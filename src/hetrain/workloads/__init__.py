"""Models and data sets for the simulator, the engines, the planners and the examples.

    wl = get_workload("cnn", "mnist1d", dataset_options={"num_samples": 2000})
    model = wl.build_model(); x, y = gather(wl.train, torch.arange(64))
    loss = wl.loss_fn(model(x), y); flops = flops_per_sample(wl)

Models: mlp, cnn, vgg, resnet (classifiers) and gpt (needs the text data set). Data sets: digits,
mnist1d, text (char-level LM), imagefolder and cifar10 (read from a `root` you provide).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from hetrain.errors import ConfigError
from hetrain.validate import check_options
from hetrain.workloads import datasets, gpt, images, models, text  # noqa: F401  (registration)
from hetrain.workloads.base import (
    Batcher,
    BatchLoader,
    LoaderOptions,
    Workload,
    correct_count,
    cross_entropy,
    evaluate,
    evaluate_workload,
    gather,
    map_tensors,
    sample_bytes_of,
    tensor_leaves,
)
from hetrain.workloads.flops import flops_per_sample, num_params
from hetrain.workloads.registry import (
    DATASETS,
    MODEL_INPUTS,
    MODELS,
    input_kind,
    register_dataset,
    register_model,
)

__all__ = [
    "DATASETS", "MODELS", "MODEL_INPUTS", "BatchLoader", "Batcher", "LoaderOptions", "Workload",
    "correct_count", "cross_entropy", "evaluate", "evaluate_workload", "flops_per_sample", "gather",
    "get_workload", "map_tensors", "num_params", "register_dataset", "register_model",
    "sample_bytes_of", "tensor_leaves", "workload_from_config",
]


def _check_name(what: str, name: str, registry: Mapping[str, Any]) -> None:
    if name not in registry:
        raise ConfigError(f"unknown {what} '{name}'; choose one of: {', '.join(sorted(registry))}")


def workload_from_config(w: Any) -> Workload:
    """The Workload a run config's [workload] table names (a config.WorkloadConfig)."""
    return get_workload(w.model, w.dataset, model_options=w.model_options,
                        dataset_options=w.dataset_options)


def get_workload(
    model: str,
    dataset: str,
    model_options: Mapping[str, Any] | None = None,
    dataset_options: Mapping[str, Any] | None = None,
) -> Workload:
    """Load `dataset`, check that `model` fits it and return the Workload "<dataset>-<model>".

    Errors (ConfigError, a ValueError) name the bad value and the allowed ones. The model is
    built once here (under a forked RNG) so bad model options fail now, not in a worker.
    """
    _check_name("model", model, MODELS)
    _check_name("dataset", dataset, DATASETS)
    mopts, dopts = dict(model_options or {}), dict(dataset_options or {})
    check_options("model", model, MODELS[model], mopts, skip=2)
    check_options("dataset", dataset, DATASETS[dataset], dopts)
    if (model == "gpt") != (dataset == "text"):
        raise ConfigError(
            f"model 'gpt' needs dataset 'text', got '{dataset}'" if model == "gpt"
            else f"dataset 'text' needs model 'gpt', got '{model}'"
        )
    train, test, meta = DATASETS[dataset](**dopts)
    shape, kind = tuple(meta["input_shape"]), input_kind(meta["task"], tuple(meta["input_shape"]))
    if kind not in MODEL_INPUTS[model]:
        raise ConfigError(
            f"model '{model}' takes {', '.join(sorted(MODEL_INPUTS[model]))} inputs; dataset "
            f"'{dataset}' gives {kind} inputs of shape {shape}"
        )
    build = functools.partial(MODELS[model], shape, meta["num_classes"], **mopts)
    with torch.random.fork_rng(devices=[]):
        build()
    extra = {k: v for k, v in meta.items()
             if k not in ("num_classes", "input_shape", "task", "sample_bytes")}
    return Workload(
        name=f"{dataset}-{model}", train=train, test=test, build_model=build, loss_fn=cross_entropy,
        task=meta["task"], num_classes=meta["num_classes"], sample_bytes=meta["sample_bytes"],
        input_shape=shape, model_options=mopts, meta=extra,
    )
