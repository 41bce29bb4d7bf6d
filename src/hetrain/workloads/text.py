"""A char-level (or byte-level) language-model corpus read from text files on disk.

The default corpus is the Python standard library's own .py files: always present, no download,
a few MB of real text. Files are read in a deterministic order (sorted directory walk) until
max_chars; the last test_fraction of the token stream is the test set.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from hetrain.errors import ConfigError
from hetrain.workloads.registry import make_meta, register_dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class TokenWindows(Dataset):
    """Fixed-length windows of a token stream: item i is (data[s:s+T], data[s+1:s+T+1]) with
    s = i * stride (stride = T: non-overlapping), so the length is fixed and `gather` is one
    fancy-index instead of a Python loop."""

    def __init__(self, data: Tensor, block_size: int, stride: int | None = None):
        self.data, self.block_size = data, block_size
        self.stride = stride or block_size
        self._n = max(0, (len(data) - 1 - block_size) // self.stride + 1)
        self._offsets = torch.arange(block_size)

    def __len__(self) -> int:
        return self._n

    def gather(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        pos = indices.long()[:, None] * self.stride + self._offsets
        return self.data[pos].long(), self.data[pos + 1].long()

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not -self._n <= i < self._n:
            raise IndexError(f"window {i} out of range for {self._n} windows")
        x, y = self.gather(torch.tensor([i % self._n]))
        return x[0], y[0]


def _walk(root: Path, patterns: Sequence[str]) -> Iterator[Path]:
    """Matching files under root in a sorted, depth-first order (skipping site-packages)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in sorted(filenames):
            p = Path(dirpath, f)
            if any(p.match(pat) for pat in patterns):
                yield p


def _files(paths: Sequence[str], patterns: Sequence[str]) -> Iterator[Path]:
    for s in paths:
        p = Path(s)
        if p.is_dir():
            yield from _walk(p, patterns)
        elif p.is_file():
            with p.open("rb") as f:  # named by the user: refuse what is plainly not text
                if b"\0" in f.read(65536):
                    raise ConfigError(f"text: '{p}' is a binary file, not text; give a text "
                                      "file or a directory")
            yield p
        else:
            raise ConfigError(f"text: path '{p}' does not exist (expected a text file or a directory)")


@functools.lru_cache(maxsize=4)
def _corpus(
    paths: tuple[str, ...], max_chars: int, vocab: str, patterns: tuple[str, ...]
) -> tuple[np.ndarray, str | None, tuple[str, ...]]:
    """(token ids, vocabulary chars or None for bytes, files read)."""
    chunks, used, total = [], [], 0
    for f in _files(paths, patterns):
        chunks.append(f.read_text(encoding="utf-8", errors="replace"))
        used.append(str(f))
        total += len(chunks[-1])
        if total >= max_chars:
            break
    text = "".join(chunks)
    ids: np.ndarray
    chars: str | None
    if vocab == "bytes":
        ids, chars = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)[:max_chars], None
    else:
        codes = np.frombuffer(text[:max_chars].encode("utf-32-le"), dtype="<u4")
        uniq, ids = np.unique(codes, return_inverse=True)
        chars = "".join(map(chr, uniq.tolist()))
    ids = ids.astype(np.int16 if (chars is None or len(chars) < 2**15) else np.int32)
    ids.flags.writeable = False
    return ids, chars, tuple(used)


def decode(ids: Tensor | Sequence[int], vocab: str | None) -> str:
    """Token ids back to text (vocab is meta["vocab"]: the chars, or None for bytes)."""
    ids = torch.as_tensor(ids).tolist()
    if vocab is None:
        return bytes(ids).decode("utf-8", errors="replace")
    return "".join(vocab[i] for i in ids)


@register_dataset("text")
def text(
    *,
    paths: str | Path | Sequence[str | Path] | None = None,
    max_chars: int = 2_000_000,
    block_size: int = 64,
    stride: int | None = None,
    vocab: str = "chars",
    test_fraction: float = 0.1,
    patterns: Sequence[str] = ("*.py", "*.txt"),
) -> tuple[TokenWindows, TokenWindows, dict]:
    """Char-level LM windows; paths: files and/or directories (default: the stdlib's .py files).

    vocab "chars": the sorted set of characters in the corpus; "bytes": UTF-8 bytes 0..255.
    stride defaults to block_size (non-overlapping windows).
    """
    if vocab not in ("chars", "bytes"):
        raise ConfigError(f"text: unknown vocab '{vocab}'; choose one of: chars, bytes")
    if paths is None:
        paths = [sysconfig.get_paths()["stdlib"]]
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    ids, chars, used = _corpus(tuple(map(str, paths)), int(max_chars), vocab, tuple(patterns))
    n_test = int(len(ids) * test_fraction)
    if len(ids) - n_test <= block_size or n_test <= block_size:
        raise ConfigError(
            f"text: corpus from {list(map(str, paths))} has {len(ids)} tokens; need more than "
            f"block_size ({block_size}) in both the train and the test ({test_fraction:.0%}) part"
        )
    data = torch.from_numpy(ids.copy())
    train = TokenWindows(data[: len(ids) - n_test], block_size, stride)
    test = TokenWindows(data[len(ids) - n_test :], block_size, stride)
    num_classes = 256 if chars is None else len(chars)
    meta = make_meta(num_classes, (block_size,), "language_model", 2 * block_size * 8,
                     vocab=chars, files=list(used))
    return train, test, meta
