"""`hetrain run` with a [parallel] table: train the workload's model under an AutoDDL plan.

One process per cluster device, no parameter server. The plan (searched at start-up with the
cluster's speeds, links and memory caps, or read from a `hetrain plan --out` file) decides
who holds which parameter shards: a one-stage plan runs with DTensor (execute.PlanExecutor),
a pipeline plan with torch.distributed.pipelining (pipeline.PipelineExecutor; with batch
shares, one pipeline per column of devices), a one-stage plan with uneven batch shares with
uneven.UnevenExecutor (every mesh row a full replica). Rank r is
cluster device r: every stage runs on the devices the plan sized it for (a slow or small
device holds fewer layers), ranks the plan leaves out idle. Every process computes on its CPU
over gloo; under dist.emulate = "cluster" (the default) the ranks pad their compute to their
cluster device's time for the work the plan gives it (compute_budget; a pipeline stage per
micro-batch), so one machine paces like the cluster file.

Every rank draws the same global batch (train.batch_size samples of an epoch permutation
seeded by train.seed and the epoch), so data needs no shipping, and a resumed run sees the
batches the uncut run would have. Rank 0 decides when to evaluate, checkpoint and stop
(wall time differs between ranks) and tells the others with one small broadcast per step.
To evaluate or checkpoint, every rank gathers its parameters (DTensor shards made full) to
rank 0, which evaluates a plain copy of the model on the test split (it must hold one copy
of the parameters, not their gradients or optimizer state) and writes the checkpoint: a
full, unsharded state dict of model and optimizer, tensors and plain data only, read back
with torch.load(weights_only=True). What ranks send each other (the plan, parameters, a
resumed state) goes through hetrain.engine.codec, as the strategies' messages do: a typed JSON
header plus raw tensor bytes, bounded and checked, nothing received is unpickled.
Processes meet through hetrain.engine.dist's rendezvous
and prove the run's secret (hetrain.engine.auth), as the strategies' processes do.

Faults, as in the strategies' runs (hetrain.engine.signals): SIGINT/SIGTERM reach rank 0 (alone
or with every rank; the others ignore SIGINT and outlive SIGTERM by WORKER_GRACE_S), which
records them and, at the end of the step in progress, broadcasts "checkpoint and stop": every
rank agrees on that step, rank 0 writes it and raises RunInterrupted (exit 128 + signal). A
rank that dies or freezes: during training every collective and pipeline P2P receive times out
after dist.worker_timeout_s (rank 0's evaluations excepted) instead of gloo's 30 min, and
each rank bumps a heartbeat key in the rendezvous store; rank 0, on a failed collective, names
the ranks whose heartbeat stopped and that did not report the failure themselves, and raises
WorkerLostError (one line, exit 2) with the latest checkpoint. A plan's shards are spread over
the ranks, so nothing can be checkpointed after a loss; the spawner then kills every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hetrain.cluster import Cluster, load_cluster
from hetrain.config import OptimizerConfig, RunConfig
from hetrain.engine import codec
from hetrain.errors import ConfigError
from hetrain.plan.cost import (
    CostOptions,
    Plan,
    plan_cost,
    read_plan_file,
    require_shares,
    stage_graphs,
    training_flops_per_sample,
)
from hetrain.plan.graph import LayerGraph, gpt_graph, graph_from_module, vgg_graph
from hetrain.plan.search import SearchOptions, _gib, search_plan
from hetrain.report.metrics import MetricsLog, RunResult, WorkerTimes
from hetrain.workloads import Workload, evaluate_workload, workload_from_config

MODELS = ("gpt", "cnn", "mlp", "vgg")
"""Models the executors can split (a graph builder and pipeline pieces exist for them)."""
CHECKPOINT_KIND = "hetrain-parallel"  # hetrain.engine.checkpoint.PARALLEL_KIND
CHECKPOINT_FORMAT = 1


# ---- the plan ----------------------------------------------------------------------------------
def check_supported(cfg: RunConfig) -> None:
    """Options the plan executors do not implement, refused in one line each rather than
    ignored."""
    w, o, t, d = cfg.workload, cfg.optimizer, cfg.train, cfg.dist
    if cfg.engine != "dist":
        raise ConfigError("[parallel] runs on real processes: set engine = \"dist\" (or "
                          "--engine dist), or remove the [parallel] table to simulate a "
                          "strategy")
    if w.model not in MODELS:
        raise ConfigError(f"[parallel]: model '{w.model}' is not supported by the plan "
                          f"executors; use one of: {', '.join(MODELS)}")
    if w.model == "vgg" and w.model_options.get("batch_norm"):
        raise ConfigError("[parallel]: vgg with batch_norm = true is not supported (the plan "
                          "graph has no batch norm); set batch_norm = false")
    if w.model == "gpt" and (w.model_options.get("tie_weights")
                             or w.model_options.get("dropout", 0.0)):
        raise ConfigError("[parallel]: gpt with tie_weights or dropout > 0 is not supported; "
                          "set tie_weights = false and dropout = 0")
    refused = [(o.scheduler, "optimizer.scheduler", "remove it (a constant lr)"),
               (o.clip_grad_norm > 0, "optimizer.clip_grad_norm", "set it to 0"),
               (t.precision != "fp32", "train.precision", "use \"fp32\""),
               (t.compression != "none", "train.compression", "use \"none\""),
               (d.ps_shards != 1, "dist.ps_shards", "use 1 (there is no parameter server)"),
               (d.backend != "gloo", "dist.backend", "use \"gloo\""),
               (d.device != "cpu", "dist.device", "use \"cpu\""),
               (d.emulate == "relative", "dist.emulate = \"relative\"",
                "use \"cluster\" (pad to the cluster file's speeds) or \"none\"")]
    for bad, key, fix in refused:
        if bad:
            raise ConfigError(f"[parallel] does not support {key} (plans run on CPU processes "
                              f"over gloo); {fix}, or remove the [parallel] table")


def optimizer_states(o: OptimizerConfig) -> float:
    """Optimizer state bytes per parameter byte, for the cost model's memory."""
    if o.name in ("adam", "adamw"):
        return 2.0
    if o.name == "sgd":
        return 1.0 if o.momentum > 0 else 0.0
    return 2.0  # another torch.optim class: assume Adam-like state (the safe side)


def run_graph(workload: Workload, model: nn.Module, batch: int) -> LayerGraph:
    """The layer graph of the workload's model at global batch `batch`, named and shaped as
    `hetrain plan --model ...` builds it for the same model."""
    from hetrain.workloads.gpt import GPT

    name = workload.name.rsplit("-", 1)[1]
    if isinstance(model, GPT):
        blk = model.block(0)
        return gpt_graph(len(model.blocks), model.tok_emb.embedding_dim,
                         model.tok_emb.embedding_dim // blk.attn.head_dim,
                         model.tok_emb.num_embeddings, workload.input_shape[0], batch,
                         bias=model.ln_f.bias is not None)
    if name == "vgg":
        o = workload.model_options
        c, h, w = workload.input_shape
        return vgg_graph(batch, (c, h, w), int(o.get("width", 16)), tuple(o.get("convs", (1, 1, 2))),
                         int(o.get("fc", 128)), workload.num_classes)
    with torch.random.fork_rng(devices=[]):
        return graph_from_module(model, torch.zeros(batch, *workload.input_shape), name=name)


@dataclass(frozen=True)
class Setup:
    """What rank 0 decided before the processes start (plain data: it travels to them)."""

    plan: dict[str, Any]
    source: str
    """"auto" or the plan file's path."""
    predicted_step_s: float
    memory_bytes: float
    memory_limit_bytes: float
    world_size: int
    calibration: dict[str, Any] | None = None
    """plan = "auto" with parallel.calibrate: the start-up microbenchmarks' figures
    (hetrain.parallel.calibrate) the plan was searched with; None: the cluster file's alone."""
    uncalibrated: str = ""
    """The layout the search picked before calibration (where calibration ran)."""


def _plan_file(path: str, graph: LayerGraph, cluster: Cluster, model: str) -> Plan:
    from hetrain.parallel.cli_plan import graph_digest

    plan, meta = read_plan_file(path)
    devices = meta.get("devices")
    if devices is not None and devices != cluster.n:
        raise ConfigError(f"plan file '{path}' was searched for {devices} devices, the cluster "
                          f"'{cluster.name}' has {cluster.n}; search one for this cluster "
                          f"(`hetrain plan --cluster ... --out`) or use parallel.plan = \"auto\"")
    used = [i for st in plan.stages for i in st.mesh.devices]
    if any(not 0 <= i < cluster.n for i in used):
        raise ConfigError(f"plan file '{path}' uses device {max(used)}, the cluster "
                          f"'{cluster.name}' has devices 0..{cluster.n - 1}")
    if meta.get("graph_digest", graph_digest(graph)) != graph_digest(graph):
        raise ConfigError(f"plan file '{path}' was made for another model or batch (its "
                          f"model {meta.get('model')!r}, options {meta.get('model_options')}, "
                          f"batch {meta.get('batch')}); this config's {model} at batch "
                          f"{graph.batch} has graph {graph.name}: make it with "
                          f"{_plan_command(graph, model)}")
    ops = [op for st in plan.stages for op in st.ops]
    if ops != [op.name for op in graph.ops]:
        raise ConfigError(f"plan file '{path}' covers ops {ops[:3]}..., not those of this "
                          f"config's graph {graph.name}: make it with {_plan_command(graph, model)}")
    return plan


def _plan_command(graph: LayerGraph, model: str) -> str:
    """The `hetrain plan` command that builds this graph (gpt: its options from the graph)."""
    cmd = f"`hetrain plan --model {model} --batch {graph.batch}"
    if model == "gpt":
        emb, head = graph.ops[0], graph.index("head")
        n_layer = sum(op.name.endswith(".ln1") for op in graph.ops)
        n_head = graph.ops[graph.index("blocks.0.attn.core")].heads if n_layer else 1
        opts = dict(n_layer=n_layer, n_embd=emb.weight_shape[1], n_head=n_head,
                    vocab=graph.ops[head].weight_shape[0], block_size=emb.out_shape[1])
        cmd += "".join(f" --model-option {k}={v}" for k, v in opts.items())
    return cmd + " --cluster CLUSTER --out FILE`"


def make_setup(cfg: RunConfig, cluster: Cluster, workload: Workload, *,
               options: CostOptions | None = None, plan: Plan | None = None) -> Setup:
    """Search or read the plan and check everything a process would otherwise fail on, in
    one ConfigError line each (no process started yet). `options`: the cost model's (default:
    uncalibrated, the optimizer's state bytes); `plan`: this plan instead of searching or
    reading one (a resumed run's)."""
    par = cfg.parallel
    assert par is not None
    check_supported(cfg)
    batch = cfg.train.batch_size
    if len(workload.train) < batch:  # type: ignore[arg-type]
        raise ConfigError(f"train.batch_size = {batch} is larger than the training set "
                          f"({len(workload.train)} samples)")  # type: ignore[arg-type]
    if par.n_micro and batch % par.n_micro:
        raise ConfigError(f"parallel.n_micro = {par.n_micro} must divide train.batch_size "
                          f"({batch})")
    with torch.random.fork_rng(devices=[]):
        model = workload.build_model()
    graph = run_graph(workload, model, batch)
    copts = options or CostOptions(optimizer_states=optimizer_states(cfg.optimizer))
    if plan is None and par.plan == "auto":
        plan = search_plan(graph, cluster, SearchOptions(restarts=par.restarts,
                                                         pipeline=par.pipeline,
                                                         subsets=par.subsets,
                                                         uneven=par.uneven), copts).plan
    elif plan is None:
        plan = _plan_file(par.plan, graph, cluster, cfg.workload.model)
    if len(plan.stages) > 1 and par.n_micro:
        plan = dataclasses.replace(plan, n_micro=par.n_micro)
    if any(st.shares for st in plan.stages):
        _check_uneven(graph, plan)  # shares that do not fit the batch: before pricing them
    report = plan_cost(graph, plan, cluster, copts)
    if not report.feasible:
        raise ConfigError(f"the plan ({_layout(plan)}) needs {_gib(report.memory_bytes)} on a "
                          f"device of {_gib(report.memory_limit_bytes)}, short by "
                          f"{_gib(report.memory_bytes - report.memory_limit_bytes)}; use "
                          "parallel.plan = \"auto\" (it searches for a plan that fits), a "
                          "smaller batch or model, or devices with more memory")
    _check_executable(model, graph, plan, par.schedule)
    return Setup(plan.to_dict(), par.plan, report.time_s, report.memory_bytes,
                 report.memory_limit_bytes, cluster.n)


def first_setup(cfg: RunConfig, cluster: Cluster, workload: Workload,
                run_dir: Path | None) -> Setup:
    """Rank 0's setup before any process starts. A resumed run keeps its checkpoint's plan
    where the plan is "auto" (a search at another time, calibrated or not, may pick another
    one); a plan file must match the checkpoint's."""
    par = cfg.parallel
    assert par is not None
    if cfg.train.resume and par.plan == "auto":  # no search: the checkpoint's plan, checked
        saved = load_checkpoint(run_dir, cfg, None)["meta"]["plan"]
        return make_setup(cfg, cluster, workload, plan=Plan.from_dict(saved))
    setup = make_setup(cfg, cluster, workload)
    if cfg.train.resume:
        load_checkpoint(run_dir, cfg, setup.plan)
    return setup


def calibrated_setup(cfg: RunConfig, setup: Setup, cluster: Cluster,
                     workload: Workload) -> Setup:
    """plan = "auto" with parallel.calibrate (every rank calls, before training): time the
    collectives and op kinds on these processes (calibrate.calibrate, quick) and let rank 0
    search again with those corrections; every rank gets rank 0's setup. Under dist.emulate
    = "cluster" compute is padded to the cluster file's figures, so only the collectives'
    corrections apply; with "none" the op kinds' too. A calibrated pick that fails a check
    the uncalibrated one passed keeps the uncalibrated plan (`uncalibrated` says so)."""
    from hetrain.parallel.calibrate import calibrate, cost_options

    calib = calibrate(quick=True, timeout_s=cfg.dist.worker_timeout_s)
    new = None
    if dist.get_rank() == 0:
        compute = cfg.dist.emulate == "none"  # under "cluster" compute is padded to the file's
        options = cost_options(calib, CostOptions(optimizer_states=optimizer_states(cfg.optimizer)),
                               compute=compute)
        figures = {k: v for k, v in calib.items() if k != "collective_rows"}
        figures["compute"] = compute  # were the op kinds' corrections used
        was = _layout(Plan.from_dict(setup.plan))
        try:
            found = make_setup(cfg, cluster, workload, options=options)
            new = dataclasses.replace(found, calibration=figures, uncalibrated=was)
        except ConfigError as e:
            new = dataclasses.replace(setup, calibration=figures,
                                      uncalibrated=f"{was} (kept: the calibrated pick {e})")
    return Setup(**broadcast_from_rank0(dataclasses.asdict(new) if new is not None else None))


def _layout(plan: Plan) -> str:
    stages = " | ".join(f"mesh {st.mesh.label} on devices {list(st.mesh.devices)}"
                        + (f", batch shares {list(st.shares)}" if st.shares else "")
                        for st in plan.stages)
    return stages + (f", {plan.n_micro} micro-batches" if len(plan.stages) > 1 else "")


def _check_uneven(graph: LayerGraph, plan: Plan) -> None:
    """A plan with batch shares: legal shares for this batch and, on a 2-D mesh, inner
    signatures that every row can run on its share (a split of the batch must divide it)."""
    require_shares(plan, graph.batch)
    st = plan.stages[0]
    if len(st.mesh.shape) == 1:
        return  # every row is one device running the plain model
    from hetrain.parallel.execute import resolve_signatures
    from hetrain.parallel.uneven import row_plan

    for share in sorted(set(st.shares)):
        try:
            resolve_signatures(graph.scaled(share / graph.batch), row_plan(plan))
        except ConfigError as e:
            raise ConfigError(f"plan: a row's share of {share} samples cannot run the inner "
                              f"signatures: {e}") from None


def _check_executable(model: nn.Module, graph: LayerGraph, plan: Plan, schedule: str) -> None:
    if len(plan.stages) == 1 and plan.stages[0].shares:
        _check_uneven(graph, plan)
        return
    if len(plan.stages) == 1:
        from hetrain.parallel.execute import resolve_signatures

        resolve_signatures(graph, plan)
        return
    from hetrain.parallel.pipeline import pipeline_layout

    pipeline_layout(model, graph, plan)
    if schedule == "1f1b" and plan.n_micro < len(plan.stages):
        raise ConfigError(f"parallel.schedule = \"1f1b\" needs at least as many micro-batches "
                          f"as stages ({plan.n_micro} < {len(plan.stages)}); set "
                          f"parallel.n_micro >= {len(plan.stages)} or use \"gpipe\"")
    for s, (a, b) in enumerate(stage_graphs(graph, plan)):
        if len(plan.stages[s].mesh.devices) > 1:
            from hetrain.parallel.execute import resolve_signatures

            resolve_signatures(graph.subgraph(a, b), Plan(plan.graph, (plan.stages[s],)))


# ---- one rank ----------------------------------------------------------------------------------
def emulation(cfg: RunConfig, plan: Plan) -> str:
    """How the cluster's speeds are emulated: "cluster" (dist.emulate = "cluster", every
    plan: one-stage plans pad each step, pipeline stages each micro-batch) or "none"."""
    return "none" if cfg.dist.emulate == "none" else "cluster"


def compute_budget(cfg: RunConfig, cluster: Cluster, graph: LayerGraph, plan: Plan,
                   rank: int) -> Callable[[float], float] | None:
    """dist.emulate = "cluster": this rank's forward + backward is padded to the time its
    cluster device takes for n samples' worth of the whole model's work (step_overhead_s + n x
    the cost model's FLOPs per sample / flops, x dist.time_scale), n being what the plan gives
    the device (cost.device_work_fraction of the batch), as the strategies' real engine pads
    its tasks, so a run on one machine paces like the cluster file; the planner priced the
    same figures. A pipeline stage pads each micro-batch (pipeline.StagePadding)."""
    if emulation(cfg, plan) != "cluster":
        return None
    device, scale = cluster.devices[rank], cfg.dist.time_scale
    fps = training_flops_per_sample(graph)
    return lambda samples: scale * device.compute_time_s(samples, fps)


def build_executor(model: nn.Module, graph: LayerGraph, plan: Plan, workload: Workload,
                   cluster: Cluster, schedule: str, timeout_s: float | None = None,
                   budget: Callable[[float], float] | None = None) -> Any:
    """This rank's executor (call on every rank: meshes and groups are collective). Rank r
    is cluster device r: a stage runs on the devices the plan sized it for, ranks the plan
    leaves out idle (execute.make_executor). `timeout_s`: a pipeline's P2P receive timeout
    (collectives get theirs from `set_timeouts`); `budget`: see compute_budget."""
    from hetrain.parallel.execute import make_executor

    return make_executor(model, graph, plan, workload.loss_fn, cluster=cluster,
                         schedule=schedule, timeout_s=timeout_s, compute_budget=budget)


def _local_state(model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer | None
                 ) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]]]:
    """This rank's parameters and optimizer state by parameter name, DTensor shards made full
    (a collective over each DTensor's mesh: every member calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor().detach().cpu().clone()
        return t.detach().cpu().clone() if isinstance(t, Tensor) else t

    mine = {id(p) for p in params}
    weights, states = {}, {}
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        weights[name] = full(p)
        if opt is not None and p in opt.state:
            states[name] = {k: full(v) for k, v in opt.state[p].items()}
    return weights, states


def _restore(model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer | None,
             weights: dict[str, Tensor], states: dict[str, dict[str, Any]],
             groups: list[dict[str, Any]]) -> None:
    """Load a full state dict into this rank's (possibly sharded) parameters and optimizer:
    every rank holds the full tensors, so each slices its own shard without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def shard(full: Tensor, like: Tensor) -> Tensor:
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, list(like.placements),
                                     src_data_rank=None)
        return full.clone()

    mine = {id(p) for p in params}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) not in mine:
                continue
            p.copy_(shard(weights[name], p))
            if opt is not None and name in states:
                opt.state[p] = {k: shard(v, p) if isinstance(v, Tensor) and v.shape == p.shape
                                else (v.clone() if isinstance(v, Tensor) else v)
                                for k, v in states[name].items()}
    if opt is not None:
        for g, saved in zip(opt.param_groups, groups, strict=False):
            g.update({k: v for k, v in saved.items() if k != "params"})


# ---- exchange between ranks: hetrain.engine.codec (typed JSON + raw bytes, nothing unpickled) --
def gather_to_rank0(tree: Any) -> list[Any] | None:
    """Every rank's `tree` on rank 0 (None elsewhere); collective over all ranks."""
    buf = codec.pack(tree)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([buf.numel()]))
    most = int(max(s.item() for s in sizes))
    padded = torch.cat([buf, torch.zeros(most - buf.numel(), dtype=torch.uint8)])
    parts = [torch.empty(most, dtype=torch.uint8) for _ in range(world)] \
        if dist.get_rank() == 0 else None
    dist.gather(padded, parts, dst=0)
    if parts is None:
        return None
    return [codec.unpack(p[:int(s.item())]) for p, s in zip(parts, sizes, strict=True)]


def broadcast_from_rank0(tree: Any) -> Any:
    """Rank 0's `tree` on every rank (others pass None); collective over all ranks."""
    buf = codec.pack(tree) if dist.get_rank() == 0 else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([buf.numel()])
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return codec.unpack(buf) if dist.get_rank() != 0 else tree


def _gather(model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer | None,
            busy_s: float, with_optimizer: bool) -> tuple[dict[str, Tensor],
                                                          dict[str, dict[str, Any]],
                                                          list[float]] | None:
    """Rank 0: the whole model's parameters (and optimizer state), and every rank's busy
    seconds; None on the other ranks. Collective over all ranks. Replicas (data parallel,
    every row of a plan with batch shares) are identical: rank 0 keeps the first copy."""
    weights, states = _local_state(model, params, opt if with_optimizer else None)
    parts = gather_to_rank0([weights, states, busy_s])
    if parts is None:
        return None
    all_w: dict[str, Tensor] = {}
    all_s: dict[str, dict[str, Any]] = {}
    for w, s, _ in parts:
        for k, v in w.items():
            all_w.setdefault(k, v)
        for k, v in s.items():
            all_s.setdefault(k, v)
    return all_w, all_s, [float(b) for _, _, b in parts]


# ---- checkpoints -------------------------------------------------------------------------------
def checkpoint_file(run_dir: Path) -> Path:
    from hetrain.engine.checkpoint import checkpoint_path

    return checkpoint_path(run_dir)


def save_checkpoint(run_dir: Path, weights: dict[str, Tensor], states: dict[str, Any],
                    groups: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """runs/<name>/checkpoint.pt: tensors and plain data only (weights_only-loadable);
    written to a temporary file and renamed, so a crash keeps the previous one."""
    path = checkpoint_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"kind": CHECKPOINT_KIND, "format": CHECKPOINT_FORMAT, "model": weights,
                "optimizer": {"state": states,
                              "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                               for g in groups]},
                "meta": json.dumps(meta)}, tmp)
    os.replace(tmp, path)
    return path


def _strategy_of(data: Any) -> str:
    """" (strategy 'asp')" for a strategy run's checkpoint, from its JSON tree only (the
    codec's {"d": [[key, value], ...]} dicts), "" when it is not one."""
    try:
        fields = dict(json.loads(data["tree"])["d"])
        return f" (strategy '{dict(dict(fields['config']['d'])['strategy']['d'])['name']}')"
    except (KeyError, TypeError, ValueError, AttributeError):
        return ""


def load_checkpoint(run_dir: Path | None, cfg: RunConfig, plan: dict[str, Any] | None
                    ) -> dict[str, Any]:
    """A [parallel] checkpoint, checked against the config: one line for a missing,
    unreadable or foreign file (another workload, cluster, optimizer or plan; plan None:
    any plan, the caller takes the checkpoint's)."""
    if run_dir is None:
        raise ConfigError("train.resume = true needs a run directory (runs_root is None)")
    path = checkpoint_file(run_dir)
    if not path.is_file():
        raise ConfigError(f"train.resume = true but there is no checkpoint at '{path}'; run "
                          "without --resume first")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # a bad zip, pickle record or tensor: torch raises many kinds
        raise ConfigError(f"checkpoint '{path}' cannot be read ({str(e).splitlines()[0][:120]});"
                          " move it away and start afresh") from None
    if not isinstance(data, dict) or data.get("kind") != CHECKPOINT_KIND:
        raise ConfigError(f"checkpoint '{path}' is of a strategy run{_strategy_of(data)}, but "
                          "this config has a [parallel] table (an AutoDDL plan); resume it "
                          "without [parallel] (with the run's [strategy]), or start afresh")
    if data.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"checkpoint '{path}' has format {data.get('format')!r}, expected "
                          f"{CHECKPOINT_FORMAT}; start the run afresh")
    try:
        meta = json.loads(data["meta"])
        model, opt = data["model"], data["optimizer"]
        states, groups = opt["state"], opt["param_groups"]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint '{path}' is damaged ({e}); start the run afresh") from None
    now = cfg.to_dict()
    for key in ("workload", "cluster"):
        if meta["config"].get(key) != now.get(key):
            raise ConfigError(f"checkpoint '{path}' was written with another {key}; resume "
                              f"with the same {key} or start afresh")
    if meta["config"]["optimizer"]["name"] != cfg.optimizer.name:
        raise ConfigError(f"checkpoint '{path}' was written with optimizer.name = "
                          f"{meta['config']['optimizer']['name']!r}, the config says "
                          f"{cfg.optimizer.name!r}; resume with the same optimizer")
    if plan is not None and meta["plan"] != plan:
        raise ConfigError(f"checkpoint '{path}' was written under another plan; resume with "
                          "the same parallel.plan (a plan file of that run) or start afresh")
    return {"model": model, "states": states, "groups": groups, "meta": meta}


# ---- the training loop -------------------------------------------------------------------------
_EVAL, _CKPT, _STOP = 0, 1, 2
HEARTBEAT_S = 0.2
"""Seconds between a rank's heartbeats in the rendezvous store."""
_ALIVE, _FAILED = "hetrain/parallel/alive/", "hetrain/parallel/failed/"


class Heartbeat:
    """This rank's liveness in the rendezvous store: a thread bumps a counter, so it goes on
    while the main thread waits in a collective and stops when the process dies or freezes."""

    def __init__(self, store: dist.Store | None, rank: int) -> None:
        self.store, self.rank = store, rank
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="hetrain-heartbeat")

    def __enter__(self) -> Heartbeat:
        if self.store is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(1.0)

    def _beat(self) -> None:
        assert self.store is not None
        while not self._done.is_set():
            try:
                self.store.add(f"{_ALIVE}{self.rank}", 1)
            except Exception:  # the store (rank 0) is gone: nobody is listening
                return
            self._done.wait(HEARTBEAT_S)

    def report_failure(self) -> None:
        """A rank that saw a collective fail is not the lost one: say so to rank 0."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # rank 0 (the store) is gone too
                self.store.set(f"{_FAILED}{self.rank}", "1")


def lost_ranks(store: dist.Store, world: int, watch_s: float = 5 * HEARTBEAT_S) -> list[int]:
    """Ranks 1..world-1 whose heartbeat does not move for `watch_s` and that did not report
    the failure themselves (rank 0, after a failed collective)."""
    def beats() -> list[int]:
        return [int(store.add(f"{_ALIVE}{r}", 0)) for r in range(world)]

    before = beats()
    time.sleep(watch_s)
    after = beats()
    return [r for r in range(1, world)
            if after[r] == before[r] and not store.check([f"{_FAILED}{r}"])]


def set_timeouts(seconds: float, default_only: bool = False) -> None:
    """Timeout of every collective on this rank's process groups (the default group and the
    plan's mesh and stage groups, created with gloo's 30 min default), or the default's."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    groups = [None] if default_only else list(_world.pg_map)
    for pg in groups:
        try:
            _set_pg_timeout(timedelta(seconds=seconds), pg)
        except (ValueError, AssertionError):  # a group this rank is not a member of
            continue


def comm_failure(e: BaseException) -> BaseException | None:
    """The failed collective behind `e` (a peer died, froze or its link broke: gloo), or None.
    The cause chain is searched: torch.distributed.pipelining re-raises a failure inside a
    stage's backward (a DTensor stage's gradient all-reduce) as a RuntimeError of its own."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur).lower()
        if isinstance(cur, dist.DistError) or any(
                k in text for k in ("gloo", "timed out", "connection closed", "connection reset")):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def _lost(cfg: RunConfig, cluster: Cluster, store: dist.Store | None, run_dir: Path | None,
          beat: Heartbeat, e: BaseException, checkpointed: int | None, when: str
          ) -> BaseException:
    """What a rank raises for `e` during `when`: `e` itself unless a collective failed; on
    rank 0 the one line naming the lost ranks (_lost_error), elsewhere ConnectionLostError
    after reporting the failure (so rank 0 does not name this rank)."""
    failed = comm_failure(e)
    if failed is None:
        return e
    rank = dist.get_rank()
    if rank != 0:
        from hetrain.engine.dist import ConnectionLostError, _gloo_reason

        beat.report_failure()
        return ConnectionLostError(f"rank {rank}: {_gloo_reason(failed)}: a rank of the run "
                                   "was lost (rank 0 says which)")
    return _lost_error(cfg, cluster, store, dist.get_world_size(), run_dir, checkpointed, when, e)


@contextlib.contextmanager
def _lost_in(cfg: RunConfig, cluster: Cluster, store: dist.Store | None, run_dir: Path | None,
             when: str) -> Iterator[None]:
    """A lost rank during `when` (before training) ends the run in one line, as in training
    (this rank's heartbeat runs meanwhile, so rank 0 can tell who was lost)."""
    with Heartbeat(store, dist.get_rank()) as beat:
        try:
            yield
        except Exception as e:
            err = _lost(cfg, cluster, store, run_dir, beat, e, None, when)
            if err is e:
                raise
            raise err from None


def _lost_error(cfg: RunConfig, cluster: Cluster, store: dist.Store | None, world: int,
                run_dir: Path | None, checkpointed: int | None, when: str,
                e: BaseException) -> Exception:
    """Rank 0's one line for a rank that died or froze during `when` ("step 12", "the
    start-up calibration"): who, why, the checkpoint to resume."""
    from hetrain.engine.dist import _gloo_reason
    from hetrain.engine.dist_server import WorkerLostError

    lost = lost_ranks(store, world) if store is not None else []
    reason = _gloo_reason(comm_failure(e) or e)
    if lost:
        who = ", ".join(f"rank {r} (device '{cluster.devices[r].name}')" for r in lost)
        what = f"{who} {'was' if len(lost) == 1 else 'were'} lost during {when} ({reason})"
    else:
        what = f"a collective failed during {when} ({reason})"
    if run_dir is None:
        where = "no checkpoint (the run has no run folder)"
    elif not cfg.train.checkpoint:
        where = "no checkpoint (train.checkpoint = false)"
    elif checkpointed is None:
        where = ("no checkpoint was written yet (set train.checkpoint_every to keep one); "
                 "start afresh")
    else:
        where = (f"latest checkpoint: {checkpoint_file(run_dir)} (step {checkpointed}; continue "
                 "with the same command and --resume)")
    return WorkerLostError(f"run '{cfg.name}' stopped: {what}; a [parallel] run cannot go on "
                           f"without a rank (it holds part of the model); {where}")


def train_rank(cfg: RunConfig, setup: Setup, workload: Workload, cluster: Cluster,
               run_dir: Path | None, progress: Any = None,
               store: dist.Store | None = None) -> RunResult | None:
    """Train on this rank of an initialised process group; rank 0 returns the RunResult.
    `store` (the rendezvous store) carries the heartbeats that name a lost rank."""
    from hetrain.engine.signals import StopSignal

    par = cfg.parallel
    assert par is not None
    rank = dist.get_rank()
    if par.plan == "auto" and par.calibrate and not cfg.train.resume and dist.get_world_size() > 1:
        with _lost_in(cfg, cluster, store, run_dir, "the start-up calibration"):
            set_timeouts(cfg.dist.worker_timeout_s)
            setup = calibrated_setup(cfg, setup, cluster, workload)
    plan = Plan.from_dict(setup.plan)
    batch = cfg.train.batch_size
    torch.manual_seed(cfg.train.seed)
    model = workload.build_model()
    graph = run_graph(workload, model, batch)
    with _lost_in(cfg, cluster, store, run_dir, "the set-up of the plan's process groups"):
        # every rank meets here, within dist.worker_timeout_s, before any creates a group:
        # a rank that died or froze since joining is named in one line (before, a pipeline's
        # group creation failed with gloo's own error and a traceback)
        set_timeouts(cfg.dist.worker_timeout_s, default_only=True)
        dist.barrier()
        ex = build_executor(model, graph, plan, workload, cluster, par.schedule,
                            cfg.dist.worker_timeout_s,
                            compute_budget(cfg, cluster, graph, plan, rank))
    params = ex.parameters()
    from hetrain.engine.core import build_optimizer

    opt = build_optimizer(cfg.optimizer, iter(params)) if params else None
    reference = workload.build_model() if rank == 0 else None  # rank 0 evaluates a plain copy

    n_train = len(workload.train)  # type: ignore[arg-type]
    per_epoch = n_train // batch
    max_steps = max(1, math.ceil(cfg.stop.max_epochs * n_train / batch))
    step, offset_s, busy = 0, 0.0, 0.0
    loss_sum, loss_n = 0.0, 0
    checkpointed: int | None = None
    log: MetricsLog | None = None
    next_eval = _eval_interval(cfg, n_train)
    if rank == 0:
        log = MetricsLog(cfg.name, [WorkerTimes(d.name) for d in cluster.devices], run_dir,
                         cfg.stop.target_accuracy, cfg.stop.target_loss,
                         tensorboard=cfg.train.tensorboard)
    if cfg.train.resume:
        with _lost_in(cfg, cluster, store, run_dir, "the loading of the checkpoint"):
            set_timeouts(cfg.dist.init_timeout_s, default_only=True)  # rank 0 reads the file
            ck = broadcast_from_rank0(load_checkpoint(run_dir, cfg, setup.plan) if rank == 0
                                      else None)
        _restore(model, params, opt, ck["model"], ck["states"], ck["groups"])
        meta = ck["meta"]
        step, offset_s, busy = meta["step"], meta["elapsed_s"], meta["busy_s"][rank]
        next_eval, checkpointed = meta["next_eval"], meta["step"]
        loss_sum, loss_n = meta.get("loss", [0.0, 0])  # since the last evaluation
        if log is not None:
            log.restore(meta["rows"], step)
            log.tta_s, log.tta_samples = meta["tta"]
        ck = None

    t0 = time.perf_counter() - offset_s
    busy_all: list[float] = [busy] * dist.get_world_size()
    perm, perm_epoch = torch.empty(0, dtype=torch.long), -1
    stop_reason = "max_epochs"
    signals = StopSignal()  # rank 0's; the others ignore SIGINT (hetrain.engine.signals)
    interrupted = None
    try:
        with signals.installed() if rank == 0 else contextlib.nullcontext(), Heartbeat(store, rank) as beat:
            set_timeouts(cfg.dist.worker_timeout_s)  # a dead or frozen peer: an error, soon
            try:
                while step < max_steps:
                    epoch_i, k = divmod(step, per_epoch)
                    if epoch_i != perm_epoch:
                        g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + epoch_i)
                        perm, perm_epoch = torch.randperm(n_train, generator=g), epoch_i
                    x, y = workload.batch(perm[k * batch:(k + 1) * batch])
                    tb = time.perf_counter()
                    loss = ex.step(x, y, opt)
                    busy += time.perf_counter() - tb
                    step += 1
                    loss_sum, loss_n = loss_sum + loss, loss_n + 1
                    flags = torch.zeros(3, dtype=torch.int64)
                    if rank == 0:
                        elapsed = time.perf_counter() - t0
                        due = (elapsed >= next_eval if cfg.train.eval_every_s
                               else step * batch >= next_eval)
                        timed_out = cfg.stop.max_time_s > 0 and elapsed >= cfg.stop.max_time_s
                        last = step >= max_steps or timed_out
                        every = cfg.train.checkpoint_every
                        flags[_EVAL] = int(due or last)
                        flags[_CKPT] = int(cfg.train.checkpoint
                                           and (last or (every and step % every == 0)))
                        flags[_STOP] = int(timed_out)
                        if timed_out:
                            stop_reason = "max_time_s"
                        if signals.signum is not None:  # every rank stops after this step
                            interrupted = signals.error()
                            signals.stopping()  # a second signal stops at once
                            flags[_CKPT], flags[_STOP] = int(cfg.train.checkpoint), 1
                            stop_reason = "interrupted"
                        if progress is not None:
                            progress(min(1.0, max(step / max_steps,
                                                  elapsed / cfg.stop.max_time_s
                                                  if cfg.stop.max_time_s else 0.0)), None)
                    dist.broadcast(flags, src=0)
                    if flags[_EVAL] or flags[_CKPT]:
                        paused = time.perf_counter()
                        got = _gather(model, params, opt, busy,
                                      with_optimizer=bool(flags[_CKPT]))
                        stop = torch.zeros(1, dtype=torch.int64)
                        if got is not None:
                            assert log is not None and reference is not None
                            weights, states, busy_all = got
                            elapsed = paused - t0
                            if flags[_EVAL]:
                                row = _evaluate(log, reference, weights, workload, cfg, step,
                                                elapsed, loss_sum / max(loss_n, 1), busy_all,
                                                n_train, plan)
                                loss_sum, loss_n = 0.0, 0
                                while next_eval <= (elapsed if cfg.train.eval_every_s
                                                    else step * batch):
                                    next_eval += _eval_interval(cfg, n_train)
                                if progress is not None:
                                    progress(min(1.0, step / max_steps), row)
                                if cfg.stop.stop_at_target and log.target_reached():
                                    stop[0], stop_reason = 1, "target"
                            if flags[_CKPT] and run_dir is not None:
                                save_checkpoint(run_dir, weights, states, opt.param_groups
                                                if opt else [],
                                                {"step": step, "elapsed_s": elapsed,
                                                 "busy_s": busy_all, "next_eval": next_eval,
                                                 "rows": log.rows, "loss": [loss_sum, loss_n],
                                                 "tta": [log.tta_s, log.tta_samples],
                                                 "config": cfg.to_dict(),
                                                 "plan": setup.plan})
                                checkpointed = step
                        # the others wait while rank 0 evaluates and writes: the long timeout
                        set_timeouts(cfg.dist.init_timeout_s, default_only=True)
                        dist.broadcast(stop, src=0)
                        set_timeouts(cfg.dist.worker_timeout_s, default_only=True)
                        t0 += time.perf_counter() - paused  # run time excludes evaluations
                        if stop[0]:
                            break
                    if flags[_STOP]:
                        break
            except RuntimeError as e:
                err = _lost(cfg, cluster, store, run_dir, beat, e, checkpointed,
                            f"step {step + 1}")
                if err is e:
                    raise
                raise err from None
    finally:
        if log is not None:
            log.close()
    if interrupted is not None:
        raise _interrupted(cfg, run_dir, interrupted, checkpointed, step)
    if rank != 0:
        return None
    assert log is not None
    return _summary(log, cfg, setup, cluster, workload, step, time.perf_counter() - t0,
                    busy_all, stop_reason)


def _interrupted(cfg: RunConfig, run_dir: Path | None, e: Any, checkpointed: int | None,
                 step: int) -> Exception:
    """Rank 0's RunInterrupted, worded as the strategies' runs word it."""
    from hetrain.engine.signals import RunInterrupted

    if checkpointed == step and run_dir is not None:
        where = (f"; checkpoint of the last step ({step}): {checkpoint_file(run_dir)} (continue "
                 "with the same command and --resume)")
    elif run_dir is None:
        where = "; no checkpoint (the run has no run folder)"
    else:
        where = "; no checkpoint (train.checkpoint = false)"
    return RunInterrupted(f"run '{cfg.name}' {e}{where}", e.signum)


def _eval_interval(cfg: RunConfig, n_train: int) -> float:
    """Seconds (train.eval_every_s) or samples (train.eval_every_epochs) between evaluations."""
    if cfg.train.eval_every_s:
        return cfg.train.eval_every_s
    return max(1.0, cfg.train.eval_every_epochs * n_train)


def _evaluate(log: MetricsLog, reference: nn.Module, weights: dict[str, Tensor],
              workload: Workload, cfg: RunConfig, step: int, elapsed: float, train_loss: float,
              busy: list[float], n_train: int, plan: Plan | None = None) -> dict[str, Any]:
    assert cfg.parallel is not None
    reference.load_state_dict(weights)
    test_loss, acc = evaluate_workload(reference, workload,
                                       batch_size=cfg.parallel.eval_batch_size)
    samples = step * cfg.train.batch_size
    _worker_times(log, busy, elapsed, samples, plan)
    return log.record(time_s=elapsed, samples=samples, epoch=samples / n_train, updates=step,
                      test_loss=test_loss, test_accuracy=acc, train_loss=train_loss,
                      bytes_total=0)


def _split_evenly(total: int, n: int) -> list[int]:
    """`total` as n whole parts differing by at most one, the larger first."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _worker_times(log: MetricsLog, busy: list[float], elapsed: float, samples: int,
                  plan: Plan | None = None) -> None:
    """Per device: seconds inside training steps (compute and communication: they are not
    told apart), the rest idle; the run's samples split evenly over the devices (a plan
    shares every sample's work among them), or, under batch shares, each row's share split
    evenly over its devices."""
    n = len(log.workers)
    counts = _split_evenly(samples, n)
    if plan is not None and plan.stages[0].shares:
        counts = [0] * n
        for st in plan.stages:  # a pipeline's column j: device j of every stage
            for share, row in zip(st.shares, st.rows(), strict=True):
                for d, c in zip(row, _split_evenly(samples * share // sum(st.shares), len(row)),
                                strict=True):
                    counts[d] = c
    for i, w in enumerate(log.workers):
        b = busy[i] if i < len(busy) else 0.0
        w.busy_s, w.comm_s, w.idle_s = b, 0.0, max(0.0, elapsed - b)
        w.samples = counts[i]


def _summary(log: MetricsLog, cfg: RunConfig, setup: Setup, cluster: Cluster,
             workload: Workload, step: int, elapsed: float, busy: list[float],
             stop_reason: str) -> RunResult:
    from hetrain.workloads import flops_per_sample

    samples = step * cfg.train.batch_size
    plan = Plan.from_dict(setup.plan)
    _worker_times(log, busy, elapsed, samples, plan)
    fps = flops_per_sample(workload)
    extra = {"engine": "dist", "strategy": "parallel", "cluster": cluster.name,
             "workload": workload.name, "n_workers": cluster.n, "flops_per_sample": fps,
             "config": cfg.to_dict(), "stop_reason": stop_reason,
             "parallel": {"plan_source": setup.source, "plan": setup.plan,
                          "layout": _layout(plan), "emulated_speeds": emulation(cfg, plan),
                          "schedule": cfg.parallel.schedule
                          if cfg.parallel else "", "predicted_step_s": setup.predicted_step_s,
                          "measured_step_s": max(busy) / step if step and busy else None,
                          "memory_bytes": setup.memory_bytes,
                          "memory_limit_bytes": setup.memory_limit_bytes,
                          "calibration": setup.calibration,
                          "uncalibrated_layout": setup.uncalibrated or None,
                          "bytes_measured": False}}
    ideal = sum(d.samples_per_s(fps) for d in cluster.devices)
    return log.summarise(time_s=elapsed, ideal_samples_per_s=ideal, extra=extra)


# ---- processes ---------------------------------------------------------------------------------
def _rank_main(rv: Any, cfg: RunConfig, setup: Setup, run_dir: Path | None) -> None:
    """A spawned rank: join the group (rendezvous + the run's secret) and train."""
    from hetrain.engine import dist as engine
    from hetrain.engine.signals import worker_signals

    torch.set_num_threads(cfg.train.threads)
    worker_signals()  # rank 0 decides when the run ends
    cluster = load_cluster(cfg.cluster)
    workload = workload_from_config(cfg.workload)
    store, _, _ = engine.init_process_group(rv, cfg, run_dir)
    try:
        train_rank(cfg, setup, workload, cluster, run_dir, store=store)
    except engine.ConnectionLostError:
        sys.exit(1)  # rank 0, the spawner, says which rank was lost, in one line
    finally:
        dist.destroy_process_group()


def run_parallel(cfg: RunConfig, *, run_dir: Path | None = None, progress: Any = None,
                 cluster: Cluster | None = None, workload: Workload | None = None
                 ) -> RunResult:
    """engine = "dist" with [parallel] (hetrain.engine.dist.run_distributed comes here):
    under torchrun or `hetrain launch --nnodes` (RANK/WORLD_SIZE set) this process runs its
    rank; otherwise rank 0 runs here and one process per other device is spawned locally."""
    from hetrain.engine import dist as engine

    check_supported(cfg)
    env = os.environ
    cluster = cluster or load_cluster(cfg.cluster)
    gpu = [dv.name for dv in cluster.devices if dv.torch_device not in (None, "cpu")]
    if gpu:
        raise ConfigError(f"[parallel] runs on CPU processes over gloo; device '{gpu[0]}' has "
                          "torch_device set: remove it from the cluster, or remove [parallel]")
    if "RANK" in env and "WORLD_SIZE" in env:
        rv = engine.Rendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]),
                               env.get("MASTER_ADDR", "127.0.0.1"),
                               int(env.get("MASTER_PORT", "29500")),
                               from_env=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                               local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                               local_world_size=int(env.get("LOCAL_WORLD_SIZE",
                                                            env["WORLD_SIZE"])))
        return _run_env_rank(rv, cfg, cluster, workload, run_dir, progress)
    return _spawn(cfg, cluster, workload or workload_from_config(cfg.workload), run_dir, progress)


def _check_world(world: int, cluster: Cluster) -> None:
    if world != cluster.n:
        raise ConfigError(f"{world} processes for a cluster of {cluster.n} devices: [parallel] "
                          f"runs one process per device (no parameter server), i.e. "
                          f"{cluster.n} (torchrun --nproc-per-node {cluster.n})")


def _run_env_rank(rv: Any, cfg: RunConfig, cluster: Cluster, workload: Workload | None,
                  run_dir: Path | None, progress: Any) -> RunResult:
    """This process's rank under torchrun / `hetrain launch --nnodes`: rank 0 decides the
    plan and sends it to the others once the group (and its secret) is established."""
    from hetrain.engine import dist as engine

    _check_world(rv.world_size, cluster)
    torch.set_num_threads(cfg.train.threads)
    workload = workload or workload_from_config(cfg.workload)
    setup = first_setup(cfg, cluster, workload, run_dir) if rv.rank == 0 else None
    if rv.rank != 0:
        from hetrain.engine.signals import worker_signals

        worker_signals()  # rank 0 decides when the run ends (SIGTERM: a grace period)
    store, _, _ = engine.init_process_group(rv, cfg, run_dir)
    try:
        setup = Setup(**broadcast_from_rank0(dataclasses.asdict(setup) if setup is not None
                                             else None))
        result = train_rank(cfg, setup, workload, cluster, run_dir,
                            progress if rv.rank == 0 else None, store=store)
    finally:
        dist.destroy_process_group()
    if result is not None:
        return result
    return RunResult(cfg.name, [], {"name": cfg.name, "engine": "dist", "role": "worker",
                                    "rank": rv.rank, "strategy": "parallel",
                                    "final_accuracy": None}, None)


def _spawn(cfg: RunConfig, cluster: Cluster, workload: Workload, run_dir: Path | None,
           progress: Any) -> RunResult:
    """Rank 0 here, ranks 1..n-1 spawned on this machine; listener on dist.master_addr, a
    fresh secret handed to the children only."""
    from hetrain.engine import auth
    from hetrain.engine import dist as engine
    from hetrain.engine.dist_server import WorkerLostError
    from hetrain.engine.spawn import Spawner

    setup = first_setup(cfg, cluster, workload, run_dir)  # every refusal before any process starts
    d = cfg.dist
    listener = engine.bind_listener(d.master_addr, d.port)
    port = listener.getsockname()[1]
    secret = auth.new_secret()
    spawner = Spawner()
    lost: list[int] = []
    result = None
    try:
        for rank in range(1, cluster.n):
            rv = engine.Rendezvous(rank, cluster.n, d.master_addr, port, secret=secret)
            spawner.start(_rank_main, (rv, cfg, setup, run_dir), daemon=False,
                          name=f"hetrain-parallel-{rank}")
        rv0 = engine.Rendezvous(0, cluster.n, d.master_addr, port, secret=secret,
                                listener=listener)
        torch.set_num_threads(cfg.train.threads)
        store, _, _ = engine.init_process_group(rv0, cfg, run_dir)
        try:
            result = train_rank(cfg, setup, workload, cluster, run_dir, progress, store=store)
        except WorkerLostError:
            lost = list(range(len(spawner.procs)))  # the run is over: no rank waits to be told
            raise
        finally:
            dist.destroy_process_group()
    finally:
        listener.close()
        engine.reap(spawner, lost)
    failed = [p.name for p in spawner.procs if p.exitcode not in (0, None)]
    if failed:
        raise RuntimeError(f"[parallel]: process(es) {', '.join(failed)} failed (see above)")
    assert result is not None
    return result
