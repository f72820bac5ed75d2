"""mlxfun's product of a few rows with dense bf16 / fp16 weights, on CUDA.

MLX 0.32 on CUDA runs a one-row product with its matrix-vector kernel, and 2 rows or more with
its general matrix product, which reads the weights at a fraction of the bandwidth at few rows:
on an H200 the maps of an 8B step cost 10.4 ms at 1 row, 14.2 ms at 5 and as much at 8 as at 40
(`benchmarks/step_costs.py`, timed per map). A verify pass of speculative decoding (k + 1 rows per
sequence) and decode steps of 2 to 8 rows pay that. `product` reads each weight once for all rows.

Opt-in until measured on a GPU: the decoder runs it only where its caller asks (`fast`, as the
steps of `mlxfun.step` do) and `MLXFUN_DENSE_KERNEL=1` was set when mlxfun was imported (an
environment setting, like `MLXFUN_BLAS`, so that a benchmark can compare both in two processes).
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlxfun.kernels import compact

_DMV = compact(r"""
    // One warp computes R output features for all M rows of x. Each lane reads 16-byte chunks of
    // a feature's weights (V values), U chunks per feature in flight; a chunk's x values are read
    // once per row and serve all R features. The lanes' partial sums meet by warp shuffles.
    constexpr int V = 16 / sizeof(T), U = 2;
    const int IN = x_shape[1], OUT = w_shape[0], chunks = IN / V;
    const int f0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R, lane = threadIdx.x & 31;
    if (f0 >= OUT) return;  // a whole warp: the kernel has no block-wide barrier
    float acc[M][R];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
    }
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 wv[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const int64_t f = min(f0 + r, OUT - 1);  // past the end: recomputes the last, never stored
                if (c < chunks) wv[u][r] = reinterpret_cast<const uint4*>(w + f * IN)[c];
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                auto xv = unsafe_load_vector<V>(x + (int64_t)m * IN, c);
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    const T* wr = reinterpret_cast<const T*>(&wv[u][r]);
                    #pragma unroll
                    for (int k = 0; k < V; ++k) acc[m][r] += static_cast<float>(xv[k]) * static_cast<float>(wr[k]);
                }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (lane == (m * R + r) % 32 && f0 + r < OUT) y[(int64_t)m * OUT + f0 + r] = static_cast<T>(v);
        }
    }
""")

ENV = "MLXFUN_DENSE_KERNEL"
# Read once, at import (see the module docstring).
ENABLED = os.environ.get(ENV, "").strip() == "1"

MIN_ROWS, MAX_ROWS = 2, 8  # one row: MLX's matrix-vector kernel; more than 8: its matrix product
FEATURES_PER_WARP = 4
WARPS = 4
_DTYPES = (mx.bfloat16, mx.float16)


def fits(x: mx.array, w: mx.array) -> bool:
    """x (M, IN), w (OUT, IN): 2 to MAX_ROWS rows, bf16 or fp16 on both, inputs in whole 16-byte chunks."""
    return (ENABLED and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES and w.dtype == x.dtype
            and x.shape[-1] % (16 // x.dtype.size) == 0)


def grid(out_features: int, per_warp: int = FEATURES_PER_WARP) -> tuple[int, int]:
    """(threads in the grid, threads per block): one warp per `per_warp` output features."""
    threads = 32 * WARPS
    return threads * -(-out_features // (per_warp * WARPS)), threads


def product(x: mx.array, w: mx.array, per_warp: int = FEATURES_PER_WARP) -> mx.array:
    """x (M, IN) @ w (OUT, IN)^T -> (M, OUT), each weight read once; needs `fits`."""
    M, out = x.shape[0], w.shape[0]
    kernel = mx.fast.cuda_kernel(name="mlxfun_dmv", input_names=["x", "w"], output_names=["y"], source=_DMV)
    threads, block = grid(out, per_warp)
    return kernel(inputs=[x, w], template=[("T", x.dtype), ("M", M), ("R", per_warp)], grid=(threads, 1, 1),
                  threadgroup=(block, 1, 1), output_shapes=[(M, out)], output_dtypes=[x.dtype])[0]
