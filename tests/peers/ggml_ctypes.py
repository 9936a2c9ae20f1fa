"""ggml's C functions the llama.cpp peer tests call through ctypes, declared once."""

from __future__ import annotations

import ctypes


def declare_quantize_chunk(lib: ctypes.CDLL) -> None:
    """Declare ``size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst,
    int64_t start, int64_t nrows, int64_t n_per_row, const float * imatrix)`` on ``lib``
    (libggml-base)."""
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
