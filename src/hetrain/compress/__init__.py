"""Compressed communication: one small interface, error feedback for lossy compressors."""

from hetrain.compress.base import (
    COMPRESSORS,
    Compressed,
    Compressor,
    ErrorFeedback,
    make_compressor,
    register_compressor,
)

__all__ = ["COMPRESSORS", "Compressed", "Compressor", "ErrorFeedback", "make_compressor",
           "register_compressor"]
