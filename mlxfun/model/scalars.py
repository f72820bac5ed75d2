"""Integers a compiled graph reads at run time rather than from its kernels' source.

`mx.compile` writes a scalar constant (an array of one element made while tracing, as `x % 512`
makes of 512) into the source of the fused kernel that uses it. A value that changes with a
shape, such as a block table's width, then makes new kernels for each new value: on CUDA each is
compiled by NVRTC, and the first decode step after a 1B row's table grew from 16 to 32 columns
took 9 s on an H200 (`benchmarks/stall_probe.py`, a probe since removed), against 0.03 s once those kernels were built.
"""

from __future__ import annotations

import mlx.core as mx


def dynamic(n: int, dtype: mx.Dtype = mx.int32) -> mx.array:
    """n as a (1,) array that kernels read from memory: a slice of a two-element constant (only
    one-element constants are written into a kernel's source)."""
    return mx.array([n, n], dtype)[:1]
