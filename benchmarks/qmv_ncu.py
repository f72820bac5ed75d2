"""Kernels of an 8B decode step, one launch each, for Nsight Compute (CUDA only, diagnostic):
`qmv.mma` at 1 and 8 rows on the o, gate_up and down shapes, the stream probe of
`qmv_probe.py` on gate_up, and MLX's bf16 product on gate_up at one row. Each runs eagerly
(not compiled), after a warm-up, so the profiler sees them one by one.
Run: ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
         -k regex:'mlxfun|gemv|gemm' python benchmarks/qmv_ncu.py
"""

from __future__ import annotations

import sys

import mlx.core as mx
import qmv_probe

from mlxfun import kernels, qmv

SHAPES = {"o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> int:
    if not kernels.available(mx.bfloat16):
        print("qmv_ncu: CUDA only", file=sys.stderr)
        return 2
    weights = {n: (mx.random.normal(s) * s[1] ** -0.5).astype(mx.bfloat16) for n, s in SHAPES.items()}
    quantized = {n: mx.quantize(w, group_size=64, bits=4) for n, w in weights.items()}
    mx.eval(weights, quantized)
    runs = []
    for n, q in quantized.items():
        for M in (1, 8):
            x = mx.random.normal((M, q[0].shape[1] * 8)).astype(mx.bfloat16)
            runs.append((f"qmv.mma {n} M={M}", lambda x=x, q=q: qmv.mma(x, *q, 64)))
    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    stream = qmv_probe.probe("stream")
    runs.append(("stream gate_up", lambda: stream(x, quantized["gate_up"])))
    runs.append(("dense bf16 gate_up M=1", lambda: x @ weights["gate_up"].T))
    for name, fn in runs:
        mx.eval(fn())  # compile, warm
        mx.synchronize()
        print(name, flush=True)
        mx.eval(fn())
        mx.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
