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
    scheduler = "CosineAnnealingLR"      # optional: any torch.optim.lr_scheduler, by global step
    scheduler_options = { T_max = 2000 }

    [train]
    batch_size = 32                      # reference per-worker batch (DDP's per-rank batch)
    seed = 0
    compression = "none"                 # none | fp16 | topk | qsgd (pushes)
    eval_every_epochs = 0.25
    tensorboard = false                  # also TensorBoard events (pip install tensorboard)
    checkpoint = true                    # runs/<name>/checkpoint.pt for --resume (false: none)
    checkpoint_every = 0                 # also every this many server updates (0: at the end)

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

from hetrain import validate
from hetrain.errors import ConfigError


def _check_choice(where: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where} = {value!r} is not allowed; choose one of: {', '.join(allowed)}")


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
    """sgd | adam | adamw, or any torch.optim optimizer class by name (e.g. RMSprop, NAdam,
    Adagrad): the workers' optimizer (the server's, for gradient strategies)."""
    lr: float = 0.05
    """Learning rate tuned for train.batch_size on one device; strategies that change the
    batch scale it from there (auto: AdaScale's gain or the square-root rule)."""
    momentum: float = 0.9
    """SGD momentum (ignored by adam / adamw)."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for adamw)."""
    nesterov: bool = False
    """Nesterov momentum (sgd)."""
    options: dict[str, Any] = field(default_factory=dict)
    """A torch.optim class named in `name`: its keyword arguments besides lr (e.g.
    {alpha = 0.9} for RMSprop); momentum, weight_decay and nesterov apply to sgd/adam/adamw."""
    clip_grad_norm: float = 0.0
    """Clip the gradient's L2 norm to this before every optimizer step, a worker's local step
    or the server's (torch.nn.utils.clip_grad_norm_); 0: off."""
    scheduler: str = ""
    """A torch.optim.lr_scheduler class by name (e.g. StepLR, CosineAnnealingLR, OneCycleLR,
    LinearLR); empty: a constant lr. It is stepped by the GLOBAL step, the number of server
    updates applied (the model version), identically on both engines: the workers' lr (delta
    strategies: optimizer.lr x the strategy's lr scale x the schedule's factor) and the
    server's (gradient strategies: optimizer.lr x the update's lr scale, 1 but for auto,
    x the factor). The server's outer step of
    delta strategies (DiLoCo-style outer lr) is not scheduled. SequentialLR and
    ChainedScheduler take their sub-schedulers as tables in scheduler_options.schedulers,
    e.g. {schedulers = [{name = "LinearLR", start_factor = 0.1, total_iters = 5}, {name =
    "CosineAnnealingLR", T_max = 95}], milestones = [5]}. LambdaLR and MultiplicativeLR need
    a Python callable (lr_lambda), which TOML cannot hold: they are refused here and taken
    from the Python API, hetrain.train(scheduler={"name": "LambdaLR", "lr_lambda": fn}).
    ReduceLROnPlateau steps after each evaluation on its test loss (mode = "min") or test
    accuracy (mode = "max"), its factor holding from that global step on; its patience and
    cooldown count EVALUATIONS, not steps (on the dist engine rank 0's factor travels with
    each update to all-reduce workers and PS shards). Evaluation rows get an `lr` column."""
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    """The scheduler's keyword arguments besides the optimizer, e.g. {step_size = 100, gamma
    = 0.5} for StepLR (steps are global steps). Learning rates among them (eta_min, max_lr,
    CyclicLR's base_lr) are FACTORS of optimizer.lr: the schedule runs on a base lr of 1."""

    def __post_init__(self) -> None:
        validate.check_optimizer(self.name, self.options)
        validate.check_scheduler(self.scheduler, self.scheduler_options)
        validate.check_fields("optimizer", self)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32
    """Reference per-worker batch (what DDP gives every rank)."""
    seed: int = 0
    """Seeds the model's initial weights, the data order and the workers' own randomness: the
    simulator repeats a run exactly for a seed (on the same CPU and torch build)."""
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
    precision: str = "fp32"
    """fp32 | bf16 (autocast to bfloat16) | fp16 (autocast to float16 with a dynamic loss
    scale; meant for GPUs); parameters, optimizer state and messages stay fp32."""
    tensorboard: bool = False
    """Also write every evaluation row's numeric columns (test_accuracy, test_loss, train_loss,
    lr, noise_scale, epoch, ...) as TensorBoard scalars to `<runs dir>/<name>/tensorboard/`, at
    step = the row's updates; view with `tensorboard --logdir runs`. On the dist engine rank 0
    writes them. Needs the optional tensorboard package (pip install tensorboard), checked
    when the config is read."""
    checkpoint: bool = True
    """Write `<runs dir>/<name>/checkpoint.pt` (both engines; nothing without a runs dir):
    every `checkpoint_every` server updates, when the run ends and on Ctrl-C / SIGTERM, so
    that `hetrain run --resume` (train.resume) continues the run where it stopped. On by
    default; false writes none (then the Python API's dist engine returns no model, which it
    reads back from that file), and a fresh simulator run removes a checkpoint.pt that an
    earlier run left in its run directory. The simulator's checkpoints change nothing in a
    run's numbers: a run with them and one without give the same figures."""
    checkpoint_every: int = 0
    """With train.checkpoint: also checkpoint every this many server updates; 0: only when the
    run ends or is stopped (Ctrl-C / SIGTERM, on the dist engine also a lost worker)."""
    resume: bool = False
    """Continue from `<runs dir>/<name>/checkpoint.pt` (`hetrain run --resume`): the model, the
    optimizer, the strategy's state, the data order, the clock and the metrics so far. The
    simulator saves its whole state (every replica, the tasks in flight, the RNG), so a
    resumed run goes on exactly as the uncut run would have; the dist engine saves the
    server's and restarts every worker from the global model. A checkpoint of another
    workload, cluster, optimizer, strategy or engine is refused; other keys may change (e.g. a
    larger stop.max_epochs trains a finished run further)."""

    def __post_init__(self) -> None:
        validate.check_fields("train", self)
        _check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.tensorboard:
            validate.check_tensorboard()


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
        validate.check_fields("stop", self)


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "auto"
    """The training protocol (see docs/strategies.md); auto plans devices, batch, local steps
    and lr for time to accuracy."""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DistConfig:
    """[dist]: how `engine = "dist"` runs (the simulator ignores it; see hetrain.engine.dist).
    Checkpoints are configured in [train] for both engines; `dist.checkpoint_every` and
    `dist.resume`, their former place, are still read as train.checkpoint_every / resume."""

    backend: str = "gloo"
    """gloo | nccl: the backend of the workers' collectives (ddp, local_sgd); nccl needs every
    worker on a GPU. Messages to and from the PS always go over gloo (host memory)."""
    device: str = "cpu"
    """Where workers compute: cpu | cuda (the node's next free GPU, in rank order) | cuda:N |
    auto (a free GPU if the node has one, else the CPU); a cluster device's torch_device
    overrides it (hetrain.engine.devices)."""
    ps_device: str = "cpu"
    """Where rank 0 keeps the global model, applies updates and evaluates: cpu | cuda | cuda:N
    | auto (the first GPU of its node, shared with the first GPU worker: the PS's work is
    light)."""
    emulate: str = "cluster"
    """none | cluster (pad compute and links to the Cluster's times) | relative (K x slowdown x
    the measured solo step time). [parallel] runs: cluster pads each rank's compute to the
    work the plan gives its device (a pipeline stage's per micro-batch; links are real);
    relative is refused."""
    time_scale: float = 1.0
    """Emulated seconds per cluster-model second (e.g. 0.25 runs the cluster 4x faster)."""
    contention_k: float = 3.0
    """emulate = "relative": budget allowance for processes sharing cores (~3: 4 procs/2 cores)."""
    worker_timeout_s: float = 60.0
    """A worker whose push has not come this long after its task was sent is dropped; a
    [parallel] run stops (naming the rank) when a step's collective waits this long."""
    init_timeout_s: float = 60.0
    """Timeout of process-group initialisation and of collectives ([parallel]: of all but a
    training step's, e.g. the wait for rank 0's evaluation)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host when hetrain spawns the processes itself."""
    port: int = 0
    """Rendezvous port when hetrain spawns the processes itself (0: a free one)."""
    ps_shards: int = 1
    """PS strategies: parameter-server ranks, each holding a block of the parameter tensors
    (world size = devices + ps_shards); rank 0 is also the coordinator and holds block 0.
    At most the cluster's number of devices and the model's number of parameter tensors."""

    def __post_init__(self) -> None:
        _check_choice("dist.backend", self.backend, ("gloo", "nccl"))
        validate.check_device_kind("dist.device", self.device)
        validate.check_device_kind("dist.ps_device", self.ps_device)
        _check_choice("dist.emulate", self.emulate, ("none", "cluster", "relative"))
        validate.check_fields("dist", self)


@dataclass(frozen=True)
class ParallelConfig:
    """[parallel]: train one model split over the cluster's devices by an AutoDDL plan (data,
    tensor and pipeline parallel; hetrain.parallel.train) instead of a [strategy]; needs
    engine = "dist" and one process per cluster device. Absent: the strategies run as usual."""

    plan: str = "auto"
    """"auto": search the plan at start-up for the cluster's devices (speeds, links and
    memory_bytes caps) and the workload's model at global batch train.batch_size; or a path
    (relative to the config file) to a plan written by `hetrain plan --out` (.json or .toml)."""
    schedule: str = "gpipe"
    """Pipeline schedule of a plan with several stages: gpipe | 1f1b (1f1b needs n_micro >=
    the number of stages)."""
    n_micro: int = 0
    """Micro-batches per step of a pipeline plan; 0: the plan's own. Must divide
    train.batch_size."""
    pipeline: bool = True
    """plan = "auto": also consider pipeline plans."""
    subsets: bool = True
    """plan = "auto": also consider meshes over some of the devices (the others then idle)."""
    restarts: int = 4
    """plan = "auto": coordinate-descent starts per candidate mesh."""
    uneven: bool = True
    """plan = "auto": also consider data parallelism with uneven batch shares, sized to the
    devices' speeds and memory (where the devices of a mesh differ)."""
    calibrate: bool = True
    """plan = "auto": before training, time collectives and op kinds on the run's own
    processes (a few seconds; hetrain.parallel.calibrate) and search again with those
    corrections to the cluster file's figures (per-call costs the file cannot list); skipped
    on one device and when resuming (the checkpoint's plan). Off: the cluster file's figures
    alone."""
    eval_batch_size: int = 256
    """Samples per forward pass when rank 0 evaluates the test split."""

    def __post_init__(self) -> None:
        if not self.plan:
            raise ConfigError("parallel.plan must be \"auto\" or a path to a plan file "
                              "(`hetrain plan --out FILE`)")
        _check_choice("parallel.schedule", self.schedule, ("gpipe", "1f1b"))
        validate.check_fields("parallel", self)


ENGINES = ("sim", "dist")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """The run's directory, <runs dir>/<name>/: one path component (no '/', '\\' or '..');
    default: the config file's name without .toml."""
    cluster: str | dict[str, Any] = "hetero-8"
    """Preset name, path to a cluster TOML (relative to the config file), or an inline table."""
    engine: str = "sim"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig | None = None
    """[parallel]: run an AutoDDL plan instead of the strategy (None: no such table)."""

    def __post_init__(self) -> None:
        validate.check_run_name(self.name)
        _check_choice("engine", self.engine, ENGINES)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strategy"] = {"name": self.strategy.name, **self.strategy.options}
        d["optimizer"]["scheduler_options"] = _callables_named(
            d["optimizer"]["scheduler_options"])
        if d["parallel"] is None:  # no [parallel] table: the record is as before it existed
            del d["parallel"]
        return d


def _callables_named(value: Any) -> Any:
    """`value` with every callable (a LambdaLR's lr_lambda from the Python API) replaced by
    its name, "<callable module.qualname>": what the record (summary.json, a checkpoint's
    config) can hold and a resume can compare."""
    if callable(value):
        return (f"<callable {getattr(value, '__module__', '?')}."
                f"{getattr(value, '__qualname__', type(value).__name__)}>")
    if isinstance(value, Mapping):
        return {k: _callables_named(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_callables_named(v) for v in value]
    return value


_SECTIONS: dict[str, type] = {"workload": WorkloadConfig, "optimizer": OptimizerConfig,
                              "train": TrainConfig, "stop": StopConfig, "dist": DistConfig,
                              "parallel": ParallelConfig}


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


MOVED_KEYS = {("dist", "checkpoint_every"): ("train", "checkpoint_every"),
              ("dist", "resume"): ("train", "resume")}
"""Keys read from their former place (old config files) into the current one."""


def _moved_keys(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A document with MOVED_KEYS at their current place; the same key given at both places
    with different values is refused."""
    if not any(isinstance(data.get(old), Mapping) and key in data[old]
               for old, key in MOVED_KEYS):
        return data
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for (old, key), (new, new_key) in MOVED_KEYS.items():
        if not isinstance(out.get(old), dict) or key not in out[old]:
            continue
        value = out[old].pop(key)
        table = out.setdefault(new, {})
        if not isinstance(table, dict):
            continue  # _section says that [new] must be a table
        if new_key in table and table[new_key] != value:
            raise ConfigError(f"{old}.{key} = {value!r} and {new}.{new_key} = "
                              f"{table[new_key]!r}: {old}.{key} is the former name of "
                              f"{new}.{new_key}; give it once, as {new}.{new_key}")
        table[new_key] = value
    return out


def config_from_dict(data: Mapping[str, Any], base_dir: Path | None = None, *,
                     registered_strategy: bool = False) -> RunConfig:
    """Validate a parsed TOML document into a RunConfig: every key, type and range, and the
    option tables against the model, data set, strategy and compressor that take them
    (hetrain.validate), so that a bad value fails here, before any data is loaded.

    A strategy name that is not registered is left to whoever runs the config (a Strategy
    instance passed with it, or make_strategy's error), unless `registered_strategy`: a
    config file or the command line can only name registered strategies."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a run config must be a table, got {type(data).__name__}")
    top = {"name", "cluster", "engine", "strategy", *_SECTIONS}
    unknown = sorted(set(data) - top)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; allowed: {sorted(top)}")
    data = _moved_keys(data)
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
    if isinstance(kwargs.get("parallel"), ParallelConfig):
        kwargs["parallel"] = _plan_path(kwargs["parallel"], base_dir)
    cfg = RunConfig(name=validate.check_run_name(data.get("name", "run")), cluster=cluster,
                    engine=str(data.get("engine", "sim")), **kwargs)
    w = cfg.workload
    validate.check_workload(w.model, w.dataset, w.model_options, w.dataset_options)
    validate.check_strategy(cfg.strategy.name, cfg.strategy.options,
                            registered=registered_strategy)
    validate.check_compression(cfg.train.compression, cfg.train.compression_options)
    if isinstance(cfg.cluster, Mapping):
        from hetrain.cluster import load_cluster

        load_cluster(cfg.cluster)
    return cfg


def _plan_path(par: ParallelConfig, base_dir: Path | None) -> ParallelConfig:
    """A plan file's path relative to the config file, like a cluster file's."""
    if par.plan == "auto" or base_dir is None or Path(par.plan).is_absolute():
        return par
    return dataclasses.replace(par, plan=str(base_dir / par.plan))


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    text = validate.read_text_file(p, "config file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{p}' is not valid TOML: {e}") from None
    data.setdefault("name", p.stem)
    return config_from_dict(data, base_dir=p.parent, registered_strategy=True)
