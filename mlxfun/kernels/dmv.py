"""mlxfun's product of a few rows with dense bf16 / fp16 weights, on CUDA tensor cores.

MLX 0.32 on CUDA runs a one-row product with its matrix-vector kernel, and 2 rows or more with
cuBLASLt, which at few rows reads the weights no faster, and costs the host more per call: MLX
builds the matmul's descriptors and asks cuBLASLt for a heuristic at every call, and captures it
into its CUDA graph. A verify pass of speculative decoding (k + 1 rows per sequence) and decode
steps of 2 to 8 rows are host-bound on an H200 (8B bf16, batch 1: queueing a verify round took
6.3-10.4 ms of host time against 6.0 ms of GPU time, 7fbc90b:benchmarks/README.md). `product` reads each
weight once for all rows, as one custom kernel; tensor cores take the rows 8 at a time, so its
time hardly depends on how many there are.

On by default wherever mlxfun's kernels run (`fast`, as the steps of `mlxfun.engine.step` ask, on CUDA),
for 2 to 8 rows; `MLXFUN_DENSE_KERNEL=0` when mlxfun is imported turns it off, and a number up to
32 sets the most rows it takes (an environment setting, like `MLXFUN_BLAS`, so that a benchmark
compares them in two processes; past 8 rows, tiles of 8 share each read of W, not yet timed).
Measured on an H200 (7fbc90b:benchmarks/2026-12-02-h200-s7-*): 8B speculative decoding at batch 1
(oracle, alpha 0.7, k = 4) 2.25x plain, where the CUDA-core kernel it replaced gave 1.75-1.96x;
per map at 5 rows, 0.6-1.0x the time of that kernel and 0.4-1.1x cuBLAS's (slower on the 8B
gate/up map and the heads).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mlx.core as mx

from mlxfun.kernels import settings
from mlxfun.kernels.attention import compact
from mlxfun.kernels.qmv import MMA_HEADER

_BODY = r"""
    // y (M, OUT) = x (M, IN) W^T, W dense, on tensor cores: mma m16n8k16 with A = 16 features x
    // 16 inputs of W, B = 16 inputs x 8 rows of x, N tiles of 8 rows sharing each A (block row
    // blockIdx.y: rows 8 N y ...; rows past M read row M - 1, never stored). A dot product may take its inputs in any
    // order, so lane (g, t) = (lane / 4, lane % 4) fills its A and B slots from the same 8 inputs
    // of each 32: 8 t .. 8 t + 7, one 16-byte load each from features g and g + 8 and from row g of
    // each tile. (A CUDA-core version spent M x 8 FMAs per 16 bytes of W: at 5-8 rows it was
    // bound by arithmetic, not by the reads.) The KW warps of a block take every KW-th 32 inputs,
    // U of them in flight, each U with its own accumulators (consecutive mma on one accumulator
    // wait for each other); shared memory sums the warps' partials. The order of every sum is fixed
    // by IN, KW and U alone: a row's outputs are the same bits whatever the other rows, their
    // number or the row's place among them (`batch_invariant`). The block's W (wm) and
    // the rows it takes from row_first to row_end, 8 N at a time (one pass in the plain product).
    const int M = x_shape[0], IN = x_shape[1], blocks = IN / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int f0 = blockIdx.x * 16;
    ROW_SETUP
    const T* wa = wm + (int64_t)min(f0 + g, OUT - 1) * IN;  // past OUT: recomputes the last, never stored
    const T* wb = wm + (int64_t)min(f0 + g + 8, OUT - 1) * IN;
    __shared__ float partial[KW][32][N * 4];
    for (int row0 = row_first; row0 < row_end; row0 += row_step) {
    const T* xr[N];
    #pragma unroll
    for (int n = 0; n < N; ++n) xr[n] = x + (int64_t)min(row0 + 8 * n + g, row_end - 1) * IN;
    float c[U][N][4];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        #pragma unroll
        for (int n = 0; n < N; ++n) c[u][n][0] = c[u][n][1] = c[u][n][2] = c[u][n][3] = 0.f;
    }
    for (int b0 = warp; b0 < blocks; b0 += KW * U) {  // the same trip count on every lane of a warp
        AlignedVector<T, 8> va[U], vb[U], xv[U][N];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = b0 + KW * u;
            if (b < blocks) {
                va[u] = unsafe_load_vector<8>(wa + 32 * b, t);
                vb[u] = unsafe_load_vector<8>(wb + 32 * b, t);
                #pragma unroll
                for (int n = 0; n < N; ++n) xv[u][n] = unsafe_load_vector<8>(xr[n] + 32 * b, t);
            } else {  // zero weights times zero inputs
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    va[u][i] = vb[u][i] = static_cast<T>(0.f);
                    #pragma unroll
                    for (int n = 0; n < N; ++n) xv[u][n][i] = static_cast<T>(0.f);
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const Pair* pa = reinterpret_cast<const Pair*>(&va[u]);  // Pair i: inputs 2 i, 2 i + 1
            const Pair* pb = reinterpret_cast<const Pair*>(&vb[u]);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {  // two mma per tile: inputs 4 h .. 4 h + 3 of the lane's 8
                Pair a[4] = {pa[2 * h], pb[2 * h], pa[2 * h + 1], pb[2 * h + 1]};
                #pragma unroll
                for (int n = 0; n < N; ++n) {
                    const Pair* px = reinterpret_cast<const Pair*>(&xv[u][n]);
                    Pair b[2] = {px[2 * h], px[2 * h + 1]};
                    qmv_mma<T>(c[u][n], a, b);
                }
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < N * 4; ++i) {
        float v = 0.f;
        #pragma unroll
        for (int u = 0; u < U; ++u) v += c[u][i / 4][i % 4];
        partial[warp][lane][i] = v;
    }
    __syncthreads();
    if (warp == 0) {
        #pragma unroll
        // i: tile n = i / 4, its c[j = i % 4]: feature f0 + g (+ 8 for j >= 2), row 8 n + 2 t + j % 2
        for (int i = 0; i < N * 4; ++i) {
            float v = 0.f;
            #pragma unroll
            for (int k = 0; k < KW; ++k) v += partial[k][lane][i];
            const int j = i % 4, f = f0 + g + 8 * (j >> 1), row = row0 + 8 * (i / 4) + 2 * t + (j & 1);
            if (f < OUT && row < row_end) y[(int64_t)row * OUT + f] = static_cast<T>(v);
        }
    }
    __syncthreads();  // warp 0 has read `partial` before the next rows write it
    }
"""

# The plain product: a block's rows are its 8 N of blockIdx.y. The experts' product: x's rows are
# sorted by the expert each goes to (`index`, ascending), and blockIdx.z is the expert: its rows
# are found by binary search, taken 8 N at a time, with that expert's map of w (E, OUT, IN).
_PLAIN = """const int OUT = w_shape[0], row_first = blockIdx.y * 8 * N, row_end = M, row_step = M;
const T* wm = w;"""
_EXPERTS = """const int OUT = w_shape[1];
auto lower = [&](uint32_t v) {  // the first row whose expert is v or later
    int lo = 0, hi = M;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (index[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo;
};
const int row_first = lower(blockIdx.z), row_end = lower(blockIdx.z + 1), row_step = 8 * N;
const T* wm = w + (int64_t)blockIdx.z * OUT * IN;"""
_MMA = compact(_BODY.replace("ROW_SETUP", _PLAIN))
_MMA_EXPERTS = compact(_BODY.replace("ROW_SETUP", _EXPERTS))


ENV = "MLXFUN_DENSE_KERNEL"
LIMIT = 32  # rows the kernel takes at most: 4 tiles of 8
DEFAULT_ROWS = 8  # the rows measured on an H200; more run MLX's matrix product unless the setting says


def max_rows(setting: str) -> int:
    """$MLXFUN_DENSE_KERNEL -> the most rows the kernel takes: unset or "1", DEFAULT_ROWS; "0", none
    (off); a number from 2 to LIMIT, that many (to measure it beyond what was measured)."""
    setting = setting.strip()
    if setting in ("", "1"):
        return DEFAULT_ROWS
    if not setting.isdigit() or int(setting) not in (0, *range(2, LIMIT + 1)):
        raise ValueError(f"{ENV}={setting!r}: expected 0 (off), 1 (on, up to {DEFAULT_ROWS} rows) or the most rows, "
                         f"2 to {LIMIT}")
    return int(setting)


# Read once, at import (see the module docstring).
MAX_ROWS = max_rows(os.environ.get(ENV, ""))
ENABLED = MAX_ROWS > 0
MIN_ROWS = 2  # one row: MLX's matrix-vector kernel; more than MAX_ROWS: its matrix product
_DTYPES = (mx.bfloat16, mx.float16)


def invariant_fits(x: mx.array, w: mx.array) -> bool:
    """Whether `product` takes x at any row count (batch-invariant mode): bf16 or fp16 on both,
    inputs in whole blocks of 32."""
    return x.dtype in _DTYPES and w.dtype == x.dtype and x.shape[-1] % 32 == 0


def fits(x: mx.array, w: mx.array) -> bool:
    """x (M, IN), w (OUT, IN): 2 to MAX_ROWS rows, bf16 or fp16 on both, inputs in whole blocks of 32."""
    return ENABLED and MIN_ROWS <= x.shape[0] <= MAX_ROWS and invariant_fits(x, w)


class Launch(NamedTuple):
    warps: int = 4  # KW: warps per block (16 features), splitting the inputs
    in_flight: int = 2  # U: 32-input blocks a warp loads at once


TILES = 4  # tiles of 8 rows a block takes at most


def tiles(rows: int) -> int:
    """N, the tiles of 8 rows per block: a power of two up to TILES (few kernel variants)."""
    return min(TILES, 1 << (-(-rows // 8) - 1).bit_length())


def grid(out_features: int, launch: Launch, rows: int = 1) -> tuple[tuple[int, int, int], int]:
    """(grid in threads, threads per block): a block per 16 output features and 8 `tiles(rows)` rows."""
    return (32 * launch.warps * -(-out_features // 16), -(-rows // (8 * tiles(rows))), 1), 32 * launch.warps


# The fastest launch per (OUT, IN) at 5 rows, the maps of the 8B and 1B shapes timed on an H200
# with each product waiting for the one before, as in the decoder (`kernels_check.py --time-dmv`,
# 10 launches, 50 products each; 7fbc90b:benchmarks/2026-12-02-h200-s7-dmv-mma-tune-chained.json). Timed
# side by side instead, the picks were launches of few warps, and a verify round took twice as long.
TUNED = {(6144, 4096): (16, 1), (4096, 4096): (16, 1), (28672, 4096): (8, 2), (4096, 14336): (16, 1),
         (128256, 4096): (4, 1), (3072, 2048): (8, 1), (2048, 2048): (4, 1), (16384, 2048): (4, 1),
         (2048, 8192): (8, 1), (128256, 2048): (4, 1)}


def launch_for(out_features: int, in_features: int) -> Launch:
    """The timed launch for the shape, else warps enough for about 4096 in the grid (at least 8
    input blocks each): with 16 features per block, few features leave few blocks."""
    tuned = TUNED.get((out_features, in_features))
    if tuned is not None:
        return Launch(*tuned)
    blocks, warps = -(-out_features // 16), 1
    while warps < 16 and blocks * warps * 2 <= 4096 and in_features // 32 >= 16 * warps:  # 8 each, doubled
        warps *= 2
    return Launch(warps, 2)


def product(x: mx.array, w: mx.array, launch: Launch | None = None) -> mx.array:
    """x (M, IN) @ w (OUT, IN)^T -> (M, OUT), each weight read once per 8 `tiles(M)` rows; needs
    `fits`, or (batch-invariant products) any M with `invariant_fits`."""
    M, out = x.shape[0], w.shape[0]
    launch = launch_for(out, x.shape[1]) if launch is None else launch
    kernel = mx.fast.cuda_kernel(name="mlxfun_dmv_mma", input_names=["x", "w"], output_names=["y"], source=_MMA,
                                 header=MMA_HEADER)
    threads, block = grid(out, launch, M)
    template = [("T", x.dtype), ("N", tiles(M)), ("KW", launch.warps), ("U", launch.in_flight)]
    return kernel(inputs=[x, w], template=template, grid=threads, threadgroup=(block, 1, 1),
                  output_shapes=[(M, out)], output_dtypes=[x.dtype])[0]


EXPERTS_ENV = "MLXFUN_EXPERTS_KERNEL"
# On: a 6-layer Qwen3-30B-A3B shape in bf16 (H100) decoded 3,253 / 8,065 / 22,060 tok/s at batch
# 8 / 32 / 128 with it against 1,389 / 3,003 / 10,170 with MLX's grouped product
# (benchmarks/results/h100/2026-12-07-moe-ab-6L-{0,1}.json). $MLXFUN_EXPERTS_KERNEL=0 turns it off.
EXPERTS_DEFAULT = True


EXPERTS = settings.switch(EXPERTS_ENV, os.environ.get(EXPERTS_ENV, ""), EXPERTS_DEFAULT)  # read once, at import


def experts_fit(x: mx.array, w: mx.array) -> bool:
    """x (R, IN) rows, w (E, OUT, IN) stacked experts: bf16 or fp16 on both, inputs in whole blocks of
    32 (and the kernel on: EXPERTS)."""
    return EXPERTS and x.ndim == 2 and w.ndim == 3 and x.shape[-1] == w.shape[-1] and invariant_fits(x, w)


def experts_product(x: mx.array, w: mx.array, index: mx.array, launch: Launch | None = None) -> mx.array:
    """Row r of x (R, IN) times expert index[r]'s map of w (E, OUT, IN), transposed -> (R, OUT); the
    rows sorted by expert (`index` ascending, uint32). A block per 16 features and expert reads that
    map once for all the expert's rows, 8 N at a time, N for about twice the mean rows an expert
    gets (most take one pass); experts without rows return at once. Needs `experts_fit`."""
    (R, IN), (E, out) = x.shape, w.shape[:2]
    launch = Launch(2 if IN // 32 >= 32 else 1, 2) if launch is None else launch
    N = tiles(max(1, 2 * R // E))
    kernel = mx.fast.cuda_kernel(name="mlxfun_dmv_experts", input_names=["x", "w", "index"], output_names=["y"],
                                 source=_MMA_EXPERTS, header=MMA_HEADER)
    threads, block = grid(out, launch)
    return kernel(inputs=[x, w, index], template=[("T", x.dtype), ("N", N), ("KW", launch.warps),
                                                  ("U", launch.in_flight)],
                  grid=(threads[0], 1, E), threadgroup=(block, 1, 1), output_shapes=[(R, out)],
                  output_dtypes=[x.dtype])[0]
