"""One TOML file per run, validated on load: every error names the key and the allowed values.

    name = "hetero8-cadp"
    cluster = "hetero-8"                 # a preset, a path to a cluster TOML, or an inline table
    engine = "sim"                       # "sim" (virtual clock) or "dist" (torch.distributed)

    [workload]
    model = "cnn"                        # mlp | cnn | vgg | resnet | gpt
    dataset = "mnist1d"                  # digits | mnist1d | text | imagefolder | cifar10
    model_options = {}                   # passed to the model builder
    dataset_options = { num_samples = 20000 }

    [strategy]
    name = "auto"                        # any registered strategy; other keys are its options
    hysteresis = 0.1

    [optimizer]
    name = "sgd"                         # sgd | adam | adamw
    lr = 0.05
    momentum = 0.9

    [train]
    batch_size = 32                      # reference per-worker batch (DDP's per-rank batch)
    seed = 0
    compression = "none"                 # none | fp16 | topk | qsgd (pushes)
    eval_every_epochs = 0.25

    [stop]
    max_epochs = 5
    target_accuracy = 0.8                # time-to-accuracy target (or target_loss)
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from hetrain.errors import ConfigError


def _check_choice(where: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where} = {value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _check_positive(where: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok:
        raise ConfigError(f"{where} must be a {'non-negative' if allow_zero else 'positive'} "
                          f"number, got {value!r}")


@dataclass(frozen=True)
class WorkloadConfig:
    model: str = "cnn"
    """Model name (see `hetrain.workloads.MODELS`)."""
    dataset: str = "mnist1d"
    """Data set name (see `hetrain.workloads.DATASETS`)."""
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"
    """sgd | adam | adamw: the workers' optimizer (the server's, for gradient strategies)."""
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_choice("optimizer.name", self.name, ("sgd", "adam", "adamw"))
        _check_positive("optimizer.lr", self.lr)
        _check_positive("optimizer.momentum", self.momentum, allow_zero=True)
        _check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        if self.momentum >= 1:
            raise ConfigError(f"optimizer.momentum must be < 1, got {self.momentum}")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32
    """Reference per-worker batch (what DDP gives every rank)."""
    seed: int = 0
    compression: str = "none"
    """Compressor for pushes: none | fp16 | topk | qsgd (see hetrain.compress)."""
    compression_options: dict[str, Any] = field(default_factory=dict)
    compress_pulls: bool = False
    """Also compress pulls (PS strategies, simulator): the server sends each worker the
    compressed difference between the global model and the worker's copy."""
    local_residual: bool = False
    """Lossy compression with error feedback, delta-mode strategies: the worker trains from
    the pulled model minus its unsent residual (CSER), not from the pulled model (EF-SGD, which
    re-learns that progress and counts it twice). Better where workers push often (hetero-8
    MNIST-1D top-1%), worse where they push a few times a run (benchmarks/results/ashl_*.md)."""
    eval_every_epochs: float = 0.25
    """Evaluate the global model on the test set every this many epochs of samples."""
    eval_every_s: float = 0.0
    """Evaluate every this many seconds of run time instead (virtual seconds on the simulator,
    wall seconds on the dist engine); 0: by epochs. Runs whose steps differ in size (a lone
    device against a cluster) compare at the same time granularity this way."""
    threads: int = 1
    """torch intra-op threads (1 is fastest for many small replicas)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"train.batch_size must be an integer >= 1, got {self.batch_size!r}")
        _check_positive("train.eval_every_epochs", self.eval_every_epochs)
        _check_positive("train.eval_every_s", self.eval_every_s, allow_zero=True)
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"train.threads must be an integer >= 1, got {self.threads!r}")


@dataclass(frozen=True)
class StopConfig:
    max_epochs: float = 5.0
    """Stop after this many epochs of samples have been consumed."""
    max_time_s: float = 0.0
    """Stop after this much (virtual or wall) time; 0: no limit."""
    target_accuracy: float = 0.0
    """Time-to-accuracy target on the test set; 0: none."""
    target_loss: float = 0.0
    """Time-to-loss target (language models); 0: none."""
    stop_at_target: bool = False
    """End the run as soon as the target is reached."""

    def __post_init__(self) -> None:
        _check_positive("stop.max_epochs", self.max_epochs)
        _check_positive("stop.max_time_s", self.max_time_s, allow_zero=True)
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(f"stop.target_accuracy must be in [0, 1], got {self.target_accuracy}")
        _check_positive("stop.target_loss", self.target_loss, allow_zero=True)


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "auto"
    """The training protocol (see docs/strategies.md); auto plans devices, batch, local steps
    and lr for time to accuracy."""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DistConfig:
    """[dist]: how `engine = "dist"` runs (the simulator ignores it; see hetrain.engine.dist)."""

    backend: str = "gloo"
    """gloo (CPU) | nccl (GPU)."""
    emulate: str = "cluster"
    """none | cluster (pad compute and links to the Cluster's times) | relative (K x slowdown x
    the measured solo step time)."""
    time_scale: float = 1.0
    """Emulated seconds per cluster-model second (e.g. 0.25 runs the cluster 4x faster)."""
    contention_k: float = 3.0
    """emulate = "relative": budget allowance for processes sharing cores (~3: 4 procs/2 cores)."""
    worker_timeout_s: float = 60.0
    """A worker whose push has not come this long after its task was sent is dropped."""
    init_timeout_s: float = 60.0
    """Timeout of process-group initialisation and of collectives."""
    checkpoint_every: int = 0
    """Checkpoint the server state every this many server updates (0: only when stopping)."""
    resume: bool = False
    """Continue from runs/<name>/checkpoint.pt."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host when hetrain spawns the processes itself."""
    port: int = 0
    """Rendezvous port when hetrain spawns the processes itself (0: a free one)."""
    ps_shards: int = 1
    """PS strategies: parameter-server ranks, each holding a block of the parameter tensors
    (world size = devices + ps_shards); rank 0 is also the coordinator and holds block 0."""

    def __post_init__(self) -> None:
        _check_choice("dist.backend", self.backend, ("gloo", "nccl"))
        _check_choice("dist.emulate", self.emulate, ("none", "cluster", "relative"))
        _check_positive("dist.time_scale", self.time_scale)
        _check_positive("dist.contention_k", self.contention_k)
        _check_positive("dist.worker_timeout_s", self.worker_timeout_s)
        _check_positive("dist.init_timeout_s", self.init_timeout_s)
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"dist.checkpoint_every must be an integer >= 0, got "
                              f"{self.checkpoint_every!r}")
        if not isinstance(self.ps_shards, int) or isinstance(self.ps_shards, bool) \
                or self.ps_shards < 1:
            raise ConfigError(f"dist.ps_shards must be an integer >= 1, got {self.ps_shards!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"dist.port must be an integer in [0, 65535], got {self.port!r}")


ENGINES = ("sim", "dist")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    cluster: str | dict[str, Any] = "hetero-8"
    """Preset name, path to a cluster TOML (relative to the config file), or an inline table."""
    engine: str = "sim"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        _check_choice("engine", self.engine, ENGINES)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strategy"] = {"name": self.strategy.name, **self.strategy.options}
        return d


_SECTIONS: dict[str, type] = {"workload": WorkloadConfig, "optimizer": OptimizerConfig,
                              "train": TrainConfig, "stop": StopConfig, "dist": DistConfig}


def _section(name: str, cls: type, data: Any) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{name}] must be a table")
    allowed = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {unknown}; allowed keys: {sorted(allowed)}")
    for key, value in data.items():
        default = allowed[key].default
        if default is dataclasses.MISSING:
            continue
        expected = type(default)
        ok = isinstance(value, expected) or (expected is float and isinstance(value, int))
        if isinstance(value, bool) and expected is not bool:
            ok = False
        if not ok:
            raise ConfigError(f"{name}.{key} must be of type {expected.__name__}, got {value!r}")
    kwargs = {k: (float(v) if type(allowed[k].default) is float else v) for k, v in data.items()}
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any], base_dir: Path | None = None) -> RunConfig:
    """Validate a parsed TOML document into a RunConfig (strategy options checked on build)."""
    top = {"name", "cluster", "engine", "strategy", *_SECTIONS}
    unknown = sorted(set(data) - top)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; allowed: {sorted(top)}")
    kwargs: dict[str, Any] = {k: _section(k, cls, data[k]) for k, cls in _SECTIONS.items()
                              if k in data}
    if "strategy" in data:
        s = dict(data["strategy"]) if isinstance(data["strategy"], Mapping) else None
        if s is None or "name" not in s:
            raise ConfigError("[strategy] must be a table with a 'name' key")
        kwargs["strategy"] = StrategyConfig(str(s.pop("name")), s)
    cluster = data.get("cluster", RunConfig.cluster)
    if isinstance(cluster, str) and base_dir is not None and cluster.endswith(".toml"):
        p = Path(cluster)
        cluster = str(p if p.is_absolute() else base_dir / p)
    elif not isinstance(cluster, str | Mapping):
        raise ConfigError("cluster must be a preset name, a path to a TOML file, or a table")
    return RunConfig(name=str(data.get("name", "run")), cluster=cluster,
                     engine=str(data.get("engine", "sim")), **kwargs)


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{p}' is not valid TOML: {e}") from None
    data.setdefault("name", p.stem)
    return config_from_dict(data, base_dir=p.parent)
