"""Compressed communication: one small interface, error feedback for lossy compressors."""

from hetrain.compress.base import (
    COMPRESSORS,
    Compressed,
    Compressor,
    ErrorFeedback,
    make_compressor,
    register_compressor,
)
from hetrain.compress.qsgd import QSGD
from hetrain.compress.topk import TopK

__all__ = ["COMPRESSORS", "QSGD", "Compressed", "Compressor", "ErrorFeedback", "TopK",
           "make_compressor", "register_compressor"]
