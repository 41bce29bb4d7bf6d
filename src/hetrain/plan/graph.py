"""Layer graphs: the operators of a model with their FLOPs, parameter and activation sizes.

A LayerGraph is what the AutoDDL planner reasons about: a topologically ordered tuple of Ops,
each naming its producers. Shapes are logical (the whole global batch); every op keeps its
feature/channel dim at one index `fdim` in its inputs and output ([B, T, C] -> 2, [B, C, H, W]
and [B, F] -> 1), which is the dim tensor parallelism splits. `flops` counts the forward pass
(2 per multiply-add); training costs about 3x that (backward = data grad + weight grad).

Three builders: `gpt_graph` and `vgg_graph` from a model description (no torch needed), and
`graph_from_module`, which traces the leaf modules of a real nn.Module with forward hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

OP_KINDS = ("linear", "conv", "embedding", "layernorm", "attention", "elementwise", "reshape",
            "add", "cross_entropy")
"""linear/conv/embedding carry weights; reshape (flatten, view) may carry partial sums, the
other elementwise ops (activations, pooling, dropout) may not; add takes two inputs."""


@dataclass(frozen=True)
class Op:
    """One operator of a layer graph."""

    name: str
    """Unique name; for traced graphs the module path (e.g. "transformer.h.0.mlp.fc")."""
    kind: str
    """One of OP_KINDS."""
    inputs: tuple[str, ...]
    """Producer op names, one per input; "" is the graph input (the data)."""
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    flops: float
    """Forward FLOPs for the whole batch."""
    weight_shape: tuple[int, ...] = ()
    """Shape of the main weight ((out, in) for linear, (out, in, k, k) conv, (vocab, dim)
    embedding, (dim,) layer norm); () when the op has no parameters."""
    param_bytes: float = 0.0
    """All parameter bytes of the op (weight + bias)."""
    fdim: int = 1
    """Index of the feature/channel dim in the op's inputs and output."""
    heads: int = 0
    """Attention heads (a head-parallel split must divide them); 0 for other ops."""
    dtype_bytes: int = 4
    stage_start: bool = False
    """A pipeline stage may begin here: the op starts a piece of the model's forward that
    runs on its own (a GPT's embedding, attention half, MLP half, final norm, head; a child of
    a Sequential). The graph builders set it; LayerGraph.stage_starts reads it, and both the
    planner and the pipeline executor (parallel.pipeline) cut only there."""

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op '{self.name}': unknown kind '{self.kind}'; one of {OP_KINDS}")
        if len(self.inputs) != len(self.in_shapes):
            raise ValueError(f"op '{self.name}': {len(self.inputs)} inputs, "
                             f"{len(self.in_shapes)} input shapes")

    @property
    def out_bytes(self) -> float:
        return float(math.prod(self.out_shape)) * self.dtype_bytes


@dataclass(frozen=True)
class LayerGraph:
    """Ops in topological order; `batch` is the global batch size (dim 0 of every tensor)."""

    name: str
    ops: tuple[Op, ...]
    batch: int
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for k, op in enumerate(self.ops):
            for src in op.inputs:
                if src and src not in self._index:
                    raise ValueError(f"op '{op.name}' reads '{src}', which is not an earlier op")
            if op.name in self._index:
                raise ValueError(f"duplicate op name '{op.name}'")
            self._index[op.name] = k

    def index(self, name: str) -> int:
        return self._index[name]

    def edges(self) -> list[tuple[int, int, int]]:
        """(producer index, consumer index, consumer input slot) for every internal edge."""
        return [(self._index[src], k, slot) for k, op in enumerate(self.ops)
                for slot, src in enumerate(op.inputs) if src]

    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def param_bytes(self) -> float:
        return sum(op.param_bytes for op in self.ops)

    def cut_points(self) -> list[int]:
        """Indices i such that exactly one tensor (op i's output) crosses from ops[:i+1] to the
        rest: the places a pipeline may cut."""
        last_use = {k: k for k in range(len(self.ops))}
        for u, v, _ in self.edges():
            last_use[u] = max(last_use[u], v)
        cuts = []
        for i in range(len(self.ops) - 1):
            live = [u for u in range(i + 1) if last_use[u] > i]
            if live == [i]:
                cuts.append(i)
        return cuts

    def stage_starts(self) -> list[int]:
        """Indices i > 0 where a pipeline stage may begin (ops[:i] | ops[i:]): exactly one
        tensor crosses (a cut point) and ops[i] is marked `stage_start`, or ops[i] begins a
        run of reshape ops just before a marked op (a free reshape may go with either stage).
        A graph with no op marked (built by hand) may be cut at every cut point except before
        a cross-entropy op (a stage of only the loss runs no module). The one definition of
        the allowed boundaries, for the planner and the pipeline executor alike."""
        cuts = {c + 1 for c in self.cut_points()}
        marked = [op.stage_start for op in self.ops]
        if not any(marked):
            return sorted(i for i in cuts if self.ops[i].kind != "cross_entropy")
        out = []
        for i in sorted(cuts):
            j = i
            while j < len(self.ops) and self.ops[j].kind == "reshape" and not marked[j]:
                j += 1
            if j < len(self.ops) and marked[j]:
                out.append(i)
        return out

    def scaled(self, fraction: float) -> LayerGraph:
        """The same graph on a micro-batch of `fraction` of the batch (FLOPs and activations
        scale, parameters do not)."""
        def shp(s: tuple[int, ...]) -> tuple[int, ...]:
            return (max(1, round(s[0] * fraction)), *s[1:]) if s else s
        ops = tuple(replace(op, flops=op.flops * fraction, out_shape=shp(op.out_shape),
                            in_shapes=tuple(shp(s) for s in op.in_shapes)) for op in self.ops)
        return LayerGraph(self.name, ops, max(1, round(self.batch * fraction)))

    def subgraph(self, start: int, stop: int) -> LayerGraph:
        """ops[start:stop]; inputs from earlier ops become graph inputs ("")."""
        names = {op.name for op in self.ops[start:stop]}
        ops = tuple(replace(op, inputs=tuple(s if s in names else "" for s in op.inputs))
                    for op in self.ops[start:stop])
        return LayerGraph(f"{self.name}[{start}:{stop}]", ops, self.batch)


def _linear(name: str, src: str, shape: tuple[int, ...], out: int, fdim: int, bias: bool = True,
            dt: int = 4) -> Op:
    fin = shape[fdim]
    out_shape = (*shape[:fdim], out, *shape[fdim + 1:])
    rows = math.prod(shape) // fin
    return Op(name, "linear", (src,), (shape,), out_shape, 2.0 * rows * fin * out, (out, fin),
              float(out * fin + (out if bias else 0)) * dt, fdim)


def _simple(name: str, kind: str, srcs: tuple[str, ...], shape: tuple[int, ...], fdim: int,
            flops_per_elem: float = 1.0, out_shape: tuple[int, ...] | None = None) -> Op:
    return Op(name, kind, srcs, tuple(shape for _ in srcs), out_shape or shape,
              flops_per_elem * math.prod(shape), (), 0.0, fdim)


def gpt_graph(n_layer: int, n_embd: int, n_head: int, vocab: int, block_size: int,
              batch: int, bias: bool = True) -> LayerGraph:
    """The GPT of hetrain.workloads (nanoGPT-style): token + position embedding, n_layer
    pre-norm blocks (q, k, v projections, causal attention, output projection, 4x MLP with
    GELU, two residual adds), final layer norm, LM head, cross-entropy. Op names are the
    module paths (tok_emb, blocks.<i>.attn.q, ...); functional ops get descriptive names.
    The position embedding's parameters are counted with tok_emb. Pipeline stages may start
    at tok_emb, each block's ln1 (attention half) and ln2 (MLP half), ln_f and head."""
    b, t, c = batch, block_size, n_embd
    x = (b, t, c)
    ln_bytes = float(c * (2 if bias else 1)) * 4
    ops: list[Op] = [Op("tok_emb", "embedding", ("",), ((b, t),), x, 2.0 * b * t * c,
                        (vocab, c), float((vocab + block_size) * c) * 4, 2, stage_start=True)]
    prev = "tok_emb"
    for i in range(n_layer):
        p = f"blocks.{i}"
        ops += [Op(f"{p}.ln1", "layernorm", (prev,), (x,), x, 8.0 * b * t * c, (c,), ln_bytes, 2,
                   stage_start=True),
                *(_linear(f"{p}.attn.{w}", f"{p}.ln1", x, c, 2, bias) for w in "qkv"),
                Op(f"{p}.attn.core", "attention", tuple(f"{p}.attn.{w}" for w in "qkv"),
                   (x, x, x), x, 4.0 * b * t * t * c + 5.0 * b * n_head * t * t, (), 0.0, 2,
                   heads=n_head),
                _linear(f"{p}.attn.proj", f"{p}.attn.core", x, c, 2, bias),
                _simple(f"{p}.add_1", "add", (prev, f"{p}.attn.proj"), x, 2),
                Op(f"{p}.ln2", "layernorm", (f"{p}.add_1",), (x,), x, 8.0 * b * t * c, (c,),
                   ln_bytes, 2, stage_start=True),
                _linear(f"{p}.mlp.fc", f"{p}.ln2", x, 4 * c, 2, bias),
                _simple(f"{p}.mlp.gelu", "elementwise", (f"{p}.mlp.fc",), (b, t, 4 * c), 2, 8.0),
                _linear(f"{p}.mlp.proj", f"{p}.mlp.gelu", (b, t, 4 * c), c, 2, bias),
                _simple(f"{p}.add_2", "add", (f"{p}.add_1", f"{p}.mlp.proj"), x, 2)]
        prev = f"{p}.add_2"
    ops += [Op("ln_f", "layernorm", (prev,), (x,), x, 8.0 * b * t * c, (c,), ln_bytes, 2,
               stage_start=True),
            replace(_linear("head", "ln_f", x, vocab, 2, bias=False), stage_start=True),
            _simple("loss", "cross_entropy", ("head",), (b, t, vocab), 2, 4.0, out_shape=())]
    return LayerGraph(f"gpt-{n_layer}x{n_embd}", tuple(ops), batch)


def vgg_graph(batch: int, image: tuple[int, int, int] = (3, 32, 32), width: int = 16,
              convs: tuple[int, ...] = (1, 1, 2), fc: int = 128, num_classes: int = 10,
              pool_cap: int = 4) -> LayerGraph:
    """The VGG-style net of hetrain.workloads: stage i = convs[i] x (conv3x3 -> ReLU) at width
    * 2**i channels then a 2x2 max-pool, adaptive average pool to at most pool_cap px, flatten,
    Linear -> ReLU -> Linear, cross-entropy. Names follow the module paths (features.k,
    classifier.k)."""
    c, h, w = image
    ops: list[Op] = []
    prev, k = "", 0

    def add(op: Op) -> None:  # every module of features / classifier may start a stage
        nonlocal prev, k
        ops.append(replace(op, stage_start=op.name.startswith(("features.", "classifier."))))
        prev, k = op.name, k + 1

    for i, n in enumerate(convs):
        out = width * 2**i
        for _ in range(n):
            shape = (batch, c, h, w)
            add(Op(f"features.{k}", "conv", (prev,), (shape,), (batch, out, h, w),
                   2.0 * batch * h * w * out * c * 9, (out, c, 3, 3), float(out * c * 9 + out) * 4, 1))
            c = out
            add(_simple(f"features.{k}", "elementwise", (prev,), (batch, c, h, w), 1))
        if min(h, w) >= 2:
            add(_simple(f"features.{k}", "elementwise", (prev,), (batch, c, h, w), 1,
                        out_shape=(batch, c, h // 2, w // 2)))
            h, w = h // 2, w // 2
    hp, wp = min(h, pool_cap), min(w, pool_cap)
    add(_simple(f"features.{k}", "elementwise", (prev,), (batch, c, h, w), 1,
                out_shape=(batch, c, hp, wp)))
    add(_simple("flatten", "reshape", (prev,), (batch, c, hp, wp), 1, 0.0,
                out_shape=(batch, c * hp * wp)))
    add(_linear("classifier.0", prev, (batch, c * hp * wp), fc, 1))
    add(_simple("classifier.1", "elementwise", (prev,), (batch, fc), 1))
    add(_linear("classifier.2", prev, (batch, fc), num_classes, 1))
    add(_simple("loss", "cross_entropy", (prev,), (batch, num_classes), 1, 4.0, out_shape=()))
    return LayerGraph(f"vgg-{width}", tuple(ops), batch)


def graph_from_module(model: Any, example_input: Any, name: str = "traced") -> LayerGraph:
    """Trace the leaf modules of `model` on `example_input` into a chain graph.

    Each Linear, Conv, Embedding, LayerNorm and activation/pool/flatten/dropout leaf becomes an
    op reading the previous one (residual adds and functional code between modules are not
    seen, so this suits Sequential-like models; use gpt_graph for transformers). A cross-entropy
    op is appended on the last output. The ops of the model's direct children (the pieces of
    a Sequential) may start a pipeline stage.
    """
    import torch
    from torch import nn

    records: list[tuple[str, nn.Module, tuple[int, ...], tuple[int, ...]]] = []

    def hook(mod_name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def fn(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                records.append((mod_name, mod, tuple(args[0].shape), tuple(out.shape)))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if n and not list(m.children())]
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        for hd in handles:
            hd.remove()
    ops: list[Op] = []
    prev = ""
    for mod_name, mod, ins, out in records:
        params = float(sum(p.numel() * p.element_size() for p in mod.parameters()))
        n_out = math.prod(out)
        if ops and ops[-1].out_shape != ins and math.prod(ops[-1].out_shape) == math.prod(ins):
            # functional reshape between modules (e.g. x.flatten(1)): an explicit reshape op
            ops.append(_simple(f"{mod_name}.reshape_in", "reshape", (prev,), ops[-1].out_shape,
                               ops[-1].fdim, 0.0, out_shape=ins))
            prev = ops[-1].name
        if isinstance(mod, nn.Linear):
            op = _linear(mod_name, prev, ins, mod.out_features, len(ins) - 1, mod.bias is not None)
        elif isinstance(mod, nn.Conv1d | nn.Conv2d):
            kk = math.prod(mod.kernel_size)
            op = Op(mod_name, "conv", (prev,), (ins,), out,
                    2.0 * n_out * mod.in_channels * kk / mod.groups, tuple(mod.weight.shape), params, 1)
        elif isinstance(mod, nn.Embedding):
            op = Op(mod_name, "embedding", (prev,), (ins,), out, 2.0 * n_out,
                    tuple(mod.weight.shape), params, len(out) - 1)
        elif isinstance(mod, nn.LayerNorm):
            op = Op(mod_name, "layernorm", (prev,), (ins,), out, 8.0 * n_out,
                    tuple(mod.normalized_shape), params, len(out) - 1)
        elif isinstance(mod, nn.Flatten):
            op = _simple(mod_name, "reshape", (prev,), ins, 1, 0.0, out_shape=out)
        else:
            op = _simple(mod_name, "elementwise", (prev,), ins, ops[-1].fdim if ops else 1,
                         1.0, out_shape=out)
        ops.append(replace(op, stage_start="." not in mod_name))
        prev = mod_name
    last = ops[-1]
    ops.append(_simple("loss", "cross_entropy", (prev,), last.out_shape, last.fdim, 4.0,
                       out_shape=()))
    batch = int(getattr(example_input, "shape", [1])[0])
    return LayerGraph(name, tuple(ops), batch)
