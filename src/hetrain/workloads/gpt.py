"""A tiny decoder-only GPT in the style of nanoGPT, for the char-level `text` data set.

Submodule paths (what tensor-parallel and pipeline plans address):

    tok_emb                 nn.Embedding(vocab, n_embd)
    pos_emb                 nn.Embedding(block_size, n_embd)
    blocks.<i>.ln1          nn.LayerNorm
    blocks.<i>.attn.q       nn.Linear(n_embd, n_embd)  \
    blocks.<i>.attn.k       nn.Linear(n_embd, n_embd)   } Colwise: each shard holds whole heads
    blocks.<i>.attn.v       nn.Linear(n_embd, n_embd)  /
    blocks.<i>.attn.proj    nn.Linear(n_embd, n_embd)     Rowwise
    blocks.<i>.ln2          nn.LayerNorm
    blocks.<i>.mlp.fc       nn.Linear(n_embd, 4 n_embd)   Colwise
    blocks.<i>.mlp.proj     nn.Linear(4 n_embd, n_embd)   Rowwise
    ln_f                    nn.LayerNorm
    head                    nn.Linear(n_embd, vocab, bias=False)

Attention reshapes q/k/v with `view(B, T, -1, head_dim)`, i.e. it infers the number of heads from
the width it receives, so a Colwise split of q/k/v over tp ranks (n_head % tp == 0) runs unchanged
on n_head / tp local heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetrain.errors import ConfigError
from hetrain.workloads.registry import register_model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool, dropout: float):
        super().__init__()
        self.head_dim, self.dropout = n_embd // n_head, dropout
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool, dropout: float):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, n_embd: int, n_head: int, bias: bool, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout)
        self.mlp = MLP(n_embd, bias, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """(B, T) token ids -> (B, T, vocab) logits."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
        dropout: float = 0.0, bias: bool = True, tie_weights: bool = False,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ConfigError(f"gpt: n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, bias, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    def block(self, i: int) -> Block:
        """Block i, typed as one (an item of an nn.ModuleList is a plain Module to a type
        checker)."""
        b = self.blocks[i]
        assert isinstance(b, Block)
        return b

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"gpt: sequence length {t} exceeds block_size {self.block_size}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@register_model("gpt", inputs=("tokens",))
def gpt(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    block_size: int | None = None,
    dropout: float = 0.0,
    bias: bool = True,
    tie_weights: bool = False,
) -> nn.Module:
    """Tiny GPT; num_classes is the vocabulary size, block_size defaults to the input length.

    The head is untied by default: tying puts one parameter in both the first and the last
    pipeline stage, which pipeline and tensor-parallel plans would have to special-case.
    """
    if len(input_shape) != 1:
        raise ConfigError(f"model 'gpt' needs token inputs of shape (T,), got {input_shape}")
    block_size = input_shape[0] if block_size is None else block_size
    if block_size < input_shape[0]:
        raise ConfigError(f"gpt: block_size {block_size} < the data's sequence length {input_shape[0]}")
    return GPT(num_classes, block_size, n_layer, n_head, n_embd, dropout, bias, tie_weights)
