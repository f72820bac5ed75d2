"""mlxfun's product of a few rows with dense bf16 / fp16 weights, on CUDA.

MLX 0.32 on CUDA runs a one-row product with its matrix-vector kernel, and 2 rows or more with
cuBLASLt, which at few rows reads the weights no faster, and costs the host more per call: MLX
builds the matmul's descriptors and asks cuBLASLt for a heuristic at every call, and captures it
into its CUDA graph. A verify pass of speculative decoding (k + 1 rows per sequence) and decode
steps of 2 to 8 rows are host-bound on an H200 (8B bf16, batch 1: queueing a verify round took
6.3-10.4 ms of host time against 6.0 ms of GPU time, benchmarks/README.md). `product` reads each
weight once for all rows, as one custom kernel.

On by default wherever mlxfun's kernels run (`fast`, as the steps of `mlxfun.step` ask, on CUDA);
`MLXFUN_DENSE_KERNEL=0` when mlxfun is imported turns it off (an environment setting, like
`MLXFUN_BLAS`, so that a benchmark compares both in two processes). Measured on an H200
(`2026-12-02-h200-s6-*`): 1B decode at batch 2 / 4 / 8, 1.60x / 1.40x / 1.39x the tokens/s
without it; 8B speculative decoding at batch 1 (oracle, alpha 0.7, k = 4): 1.92x plain with it
(before its launches were tuned: one warp per block), where without it the same run gave 0.28x.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mlx.core as mx

from mlxfun.kernels import compact
from mlxfun.qmv import _MMA_HEADER

_DMV = compact(r"""
    // A block of W warps computes R output features (from f0) for all M rows of x. The warps split
    // the inputs: lane l of warp w reads 16-byte chunks (V values) w * 32 + l, then every 32 * W
    // after, U chunks per feature in flight; a chunk's x values are read once per row and serve
    // all R features. Partial sums meet by warp shuffles, then across the warps in shared memory.
    // Splitting the inputs keeps the device full when OUT / R blocks are few (4096 x 14336: 1024).
    constexpr int V = 16 / sizeof(T), STRIDE = 32 * W;
    const int IN = x_shape[1], OUT = w_shape[0], chunks = IN / V;
    const int f0 = blockIdx.x * R, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[M][R];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
    }
    for (int c0 = warp * 32 + lane; c0 < chunks; c0 += STRIDE * U) {
        uint4 wv[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + STRIDE * u;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const int64_t f = min(f0 + r, OUT - 1);  // past the end: recomputes the last, never stored
                if (c < chunks) wv[u][r] = reinterpret_cast<const uint4*>(w + f * IN)[c];
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + STRIDE * u;
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
    __shared__ float part[W][M * R];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (lane == 0) part[warp][m * R + r] = v;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < M * R; t += STRIDE) {
        float v = 0.f;
        #pragma unroll
        for (int i = 0; i < W; ++i) v += part[i][t];
        const int m = t / R, r = t % R;
        if (f0 + r < OUT) y[(int64_t)m * OUT + f0 + r] = static_cast<T>(v);
    }
""")

_MMA = compact(r"""
    // y (M, OUT) = x (M, IN) W^T for M <= 8 rows, W dense, on tensor cores: mma m16n8k16 with
    // A = 16 features x 16 inputs of W, B = 16 inputs x 8 rows of x (rows past M read row M - 1,
    // never stored). A dot product may take its inputs in any order, so lane (g, t) =
    // (lane / 4, lane % 4) fills its A and B slots from the same 8 inputs of each 32: 8 t .. 8 t + 7,
    // one 16-byte load each from features g and g + 8 and from x. The SIMT version (`_DMV`) spent
    // M x 8 FMAs per 16 bytes of W, so at 5-8 rows it was bound by arithmetic, not by the reads.
    // The KW warps of a block take every KW-th 32 inputs, U of them in flight, each U with its own
    // accumulators (consecutive mma on one accumulator wait for each other); shared memory sums
    // the warps' partials.
    const int IN = x_shape[1], OUT = w_shape[0], blocks = IN / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int f0 = blockIdx.x * 16;
    const T* wa = w + (int64_t)min(f0 + g, OUT - 1) * IN;  // past OUT: recomputes the last, never stored
    const T* wb = w + (int64_t)min(f0 + g + 8, OUT - 1) * IN;
    const T* xr = x + (int64_t)min(g, M - 1) * IN;
    float c[U][4];
    #pragma unroll
    for (int u = 0; u < U; ++u) c[u][0] = c[u][1] = c[u][2] = c[u][3] = 0.f;
    for (int b0 = warp; b0 < blocks; b0 += KW * U) {  // the same trip count on every lane of a warp
        AlignedVector<T, 8> va[U], vb[U], xv[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = b0 + KW * u;
            if (b < blocks) {
                va[u] = unsafe_load_vector<8>(wa + 32 * b, t);
                vb[u] = unsafe_load_vector<8>(wb + 32 * b, t);
                xv[u] = unsafe_load_vector<8>(xr + 32 * b, t);
            } else {  // zero weights times zero inputs
                #pragma unroll
                for (int i = 0; i < 8; ++i) va[u][i] = vb[u][i] = xv[u][i] = static_cast<T>(0.f);
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const Pair* pa = reinterpret_cast<const Pair*>(&va[u]);  // Pair i: inputs 2 i, 2 i + 1
            const Pair* pb = reinterpret_cast<const Pair*>(&vb[u]);
            const Pair* px = reinterpret_cast<const Pair*>(&xv[u]);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {  // two mma: inputs 4 h .. 4 h + 3 of the lane's 8
                Pair a[4] = {pa[2 * h], pb[2 * h], pa[2 * h + 1], pb[2 * h + 1]};
                Pair b[2] = {px[2 * h], px[2 * h + 1]};
                qmv_mma<T>(c[u], a, b);
            }
        }
    }
    __shared__ float partial[KW][32][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        float v = 0.f;
        #pragma unroll
        for (int u = 0; u < U; ++u) v += c[u][i];
        partial[warp][lane][i] = v;
    }
    __syncthreads();
    if (warp == 0) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {  // c[i]: feature f0 + g (+ 8 for i >= 2), row 2 t + i % 2
            float v = 0.f;
            #pragma unroll
            for (int k = 0; k < KW; ++k) v += partial[k][lane][i];
            const int f = f0 + g + 8 * (i >> 1), row = 2 * t + (i & 1);
            if (f < OUT && row < M) y[(int64_t)row * OUT + f] = static_cast<T>(v);
        }
    }
""")

ENV = "MLXFUN_DENSE_KERNEL"
# Read once, at import (see the module docstring).
ENABLED = os.environ.get(ENV, "").strip() != "0"
# Which kernel: tensor cores (`_MMA`), unless the setting is "simt" (`_DMV`, for comparison).
TENSOR_CORES = os.environ.get(ENV, "").strip() != "simt"

MIN_ROWS, MAX_ROWS = 2, 8  # one row: MLX's matrix-vector kernel; more than 8: its matrix product
_DTYPES = (mx.bfloat16, mx.float16)


class Launch(NamedTuple):
    per_block: int = 4  # R: output features per block
    in_flight: int = 2  # U: 16-byte chunks per feature each lane has in flight
    warps: int = 4  # W: warps per block, splitting the inputs


def fits(x: mx.array, w: mx.array) -> bool:
    """x (M, IN), w (OUT, IN): 2 to MAX_ROWS rows, bf16 or fp16 on both, inputs in whole 16-byte
    chunks (whole 32-input blocks on tensor cores)."""
    step = 32 if TENSOR_CORES else 16 // x.dtype.size
    return (ENABLED and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES and w.dtype == x.dtype
            and x.shape[-1] % step == 0)


class MmaLaunch(NamedTuple):
    warps: int = 4  # KW: warps per block (16 features), splitting the inputs
    in_flight: int = 2  # U: 32-input blocks a warp loads at once


def mma_grid(out_features: int, launch: MmaLaunch) -> tuple[int, int]:
    """(threads in the grid, threads per block) of an `mma` launch: a block per 16 features."""
    return 32 * launch.warps * -(-out_features // 16), 32 * launch.warps


# The fastest `mma` launch (warps, in flight) per (OUT, IN), timed on an H200 with each product
# waiting for the one before (`kernels_check.py --time-dmv`). Timed side by side instead, the
# picks were launches of few warps that ran 2x slower in the decoder (benchmarks/README.md).
MMA_TUNED: dict[tuple[int, int], tuple[int, int]] = {}


def mma_launch_for(out_features: int, in_features: int) -> MmaLaunch:
    """The timed launch for the shape, else warps enough for about 4096 in the grid (at least 4
    input blocks each): 16 features per block leave few blocks where features are few."""
    tuned = MMA_TUNED.get((out_features, in_features))
    if tuned is not None:
        return MmaLaunch(*tuned)
    blocks, warps = -(-out_features // 16), 1
    while warps < 16 and blocks * warps * 2 <= 4096 and in_features // 32 >= 8 * warps:
        warps *= 2
    return MmaLaunch(warps, 2)


def mma(x: mx.array, w: mx.array, launch: MmaLaunch | None = None) -> mx.array:
    """x (M, IN) @ w (OUT, IN)^T -> (M, OUT) on tensor cores, each weight read once; needs `fits`."""
    M, out = x.shape[0], w.shape[0]
    launch = mma_launch_for(out, x.shape[1]) if launch is None else launch
    kernel = mx.fast.cuda_kernel(name="mlxfun_dmv_mma", input_names=["x", "w"], output_names=["y"], source=_MMA,
                                 header=_MMA_HEADER)
    threads, block = mma_grid(out, launch)
    template = [("T", x.dtype), ("M", M), ("KW", launch.warps), ("U", launch.in_flight)]
    return kernel(inputs=[x, w], template=template, grid=(threads, 1, 1), threadgroup=(block, 1, 1),
                  output_shapes=[(M, out)], output_dtypes=[x.dtype])[0]


def grid(out_features: int, launch: Launch = Launch()) -> tuple[int, int]:
    """(threads in the grid, threads per block): one block per `per_block` output features."""
    block = 32 * launch.warps
    return block * -(-out_features // launch.per_block), block


# The fastest launch per (OUT, IN) at 2 / 5 / 8 rows, timed on an H200 for the maps of the 8B and
# 1B shapes (`kernels_check.py --time-dmv`, 32 launches, 50 products queued each). Maps under
# ~20 us are near the host's launch cost there, so their picks carry noise.
TUNED = {(6144, 4096): ((2, 4, 8), (2, 1, 1), (2, 1, 1)), (4096, 4096): ((2, 4, 2), (4, 1, 1), (8, 2, 1)),
         (28672, 4096): ((4, 1, 8), (4, 2, 1), (4, 4, 1)), (4096, 14336): ((4, 1, 2), (4, 1, 1), (4, 1, 1)),
         (128256, 4096): ((4, 1, 8), (4, 2, 1), (4, 4, 1)), (3072, 2048): ((8, 1, 2), (4, 1, 2), (2, 2, 2)),
         (2048, 2048): ((4, 2, 4), (4, 1, 2), (4, 1, 1)), (16384, 2048): ((4, 1, 2), (2, 2, 2), (8, 2, 2)),
         (2048, 8192): ((4, 2, 2), (8, 1, 4), (8, 2, 1)), (128256, 2048): ((4, 1, 4), (4, 2, 1), (4, 2, 1))}
TUNED_ROWS = (2, 5, 8)


def launch_for(rows: int, out_features: int, in_features: int) -> Launch:
    """The launch for a product's shape: the timed one at the nearest row count, else by the
    number of blocks: many output features fill the device with one warp per block; few need the
    inputs split across warps."""
    tuned = TUNED.get((out_features, in_features))
    if tuned is not None:
        return Launch(*tuned[min(range(len(TUNED_ROWS)), key=lambda i: abs(TUNED_ROWS[i] - rows))])
    return Launch(4, 2, 1) if out_features >= 16384 else Launch(4, 1, 2)


def product(x: mx.array, w: mx.array, launch: Launch | None = None) -> mx.array:
    """x (M, IN) @ w (OUT, IN)^T -> (M, OUT), each weight read once; needs `fits`."""
    if TENSOR_CORES and launch is None:
        return mma(x, w)
    return simt(x, w, launch)


def simt(x: mx.array, w: mx.array, launch: Launch | None = None) -> mx.array:
    """`product` on CUDA cores (`_DMV`)."""
    M, out = x.shape[0], w.shape[0]
    launch = launch_for(M, out, x.shape[1]) if launch is None else launch
    kernel = mx.fast.cuda_kernel(name="mlxfun_dmv", input_names=["x", "w"], output_names=["y"], source=_DMV)
    threads, block = grid(out, launch)
    template = [("T", x.dtype), ("M", M), ("R", launch.per_block), ("U", launch.in_flight), ("W", launch.warps)]
    return kernel(inputs=[x, w], template=template, grid=(threads, 1, 1), threadgroup=(block, 1, 1),
                  output_shapes=[(M, out)], output_dtypes=[x.dtype])[0]
