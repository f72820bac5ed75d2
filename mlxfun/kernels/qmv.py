"""mlxfun's product of a few rows with 4-bit weights, on CUDA (MLX 0.32's 4-bit product at one
row runs no faster than bf16, which reads four times the bytes).

`product` reads only the 4-bit bytes. With bf16 or fp16 activations it runs on tensor cores, the
weights dequantized in registers (`_MMA`); with float32 on CUDA cores (`_SIMT`). The decoder runs
it only when its caller asks (`llama.hidden(..., fast=True)`, as the steps of `mlxfun.engine.step` do):
it has no gradient, and the default path is MLX ops.

MLX's 4-bit affine format: w (OUT, IN / 8) uint32, value k of a word in bits [4k, 4k + 4), in input
order; scales, biases (OUT, IN / GS); a weight is q * scale + bias.
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlxfun.kernels import settings
from mlxfun.kernels.attention import compact

_SIMT = compact(r"""
    // One warp computes R output features for all M rows of x. Each lane takes 32-value chunks
    // (16 bytes of 4-bit weights per feature), U of them in flight; a chunk's x values are read
    // and converted once and serve all R features. A nibble q at bits 4k (k < 5; the upper three
    // after a shift by 12) is read exactly as the float q * 16^k by OR-ing it into the mantissa of
    // 2^23 and subtracting 2^23 (two full-rate ops; an int-to-float conversion runs at 1/8 rate),
    // and x is pre-scaled by 16^-k once per chunk, so x * q is exact as before.
    constexpr int U = 2;
    const int IN = x_shape[1], OUT = w_shape[0], chunks = IN / 32, groups = IN / GS;
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
        float sc[U][R], bi[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const int64_t f = min(f0 + r, OUT - 1);  // past the end: recomputes the last, never stored
                if (c < chunks) {
                    wv[u][r] = reinterpret_cast<const uint4*>(w + f * (IN / 8))[c];
                    sc[u][r] = static_cast<float>(scales[f * groups + c * 32 / GS]);
                    bi[u][r] = static_cast<float>(biases[f * groups + c * 32 / GS]);
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
            float dot[M][R], xs[M];
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                xs[m] = 0.f;
                #pragma unroll
                for (int r = 0; r < R; ++r) dot[m][r] = 0.f;
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {  // 32-bit word j of the chunk: 8 weights
                float q[R][8];
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    const uint32_t word = j == 0 ? wv[u][r].x : j == 1 ? wv[u][r].y : j == 2 ? wv[u][r].z : wv[u][r].w;
                    const uint32_t high = word >> 12;
                    #pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const uint32_t bits = k < 5 ? word & (0xFu << (4 * k)) : high & (0xFu << (4 * (k - 3)));
                        q[r][k] = __int_as_float(0x4B000000u | bits) - 8388608.f;
                    }
                }
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    auto xv = unsafe_load_vector<8>(x + (int64_t)m * IN + c * 32, j);
                    #pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float xf = static_cast<float>(xv[k]);
                        xs[m] += xf;
                        const float xs16 = xf * __int_as_float((127 - 4 * (k < 5 ? k : k - 3)) << 23);  // x 16^-k
                        #pragma unroll
                        for (int r = 0; r < R; ++r) dot[m][r] += xs16 * q[r][k];
                    }
                }
            }
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                #pragma unroll
                for (int r = 0; r < R; ++r) acc[m][r] += sc[u][r] * dot[m][r] + bi[u][r] * xs[m];
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

SIMT_ROWS = 8  # float32 x: every row's accumulators in registers
# bf16 / fp16 x (tensor cores): more rows multiply a dense copy of the one map (`llama.linear`),
# which costs what the product does at 128 rows and 0.63x at 256 (an H100, 1B and 8B maps).
MAX_ROWS = 128


def fits(rows: int, in_features: int, group_size: int, bits: int, dtype: mx.Dtype = mx.bfloat16) -> bool:
    """The product's layout: 4-bit weights and at most SIMT_ROWS rows of float32 x, or 4- or 8-bit
    weights and at most MAX_ROWS rows of bf16 / fp16 x (each weight is unpacked once for all of
    them); inputs in whole 32-value chunks, a chunk inside one group."""
    if dtype == mx.float32:
        return bits == 4 and rows <= SIMT_ROWS and in_features % 32 == 0 and group_size % 32 == 0
    return bits in (4, 8) and rows <= MAX_ROWS and in_features % 32 == 0 and group_size % 32 == 0


FEATURES_PER_WARP = 4
SIMT_WARPS = 4


def simt_grid(out_features: int, per_warp: int) -> tuple[int, int]:
    """(threads in the grid, threads per block) of a `simt` launch: one warp per `per_warp` features."""
    threads = 32 * SIMT_WARPS
    return threads * -(-out_features // (per_warp * SIMT_WARPS)), threads


def product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
            bits: int = 4) -> mx.array:
    """x (M, IN) @ dequantize(w, scales, biases)^T -> (M, OUT); needs `fits`.
    bf16 and fp16 run on tensor cores, float32 on CUDA cores (4-bit)."""
    if x.dtype == mx.float32:
        return simt(x, w, scales, biases, group_size)
    return mma(x, w, scales, biases, group_size, bits=bits)


def simt(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
         per_warp: int = FEATURES_PER_WARP) -> mx.array:
    """`product` on CUDA cores, `per_warp` output features per warp (a benchmark varies it)."""
    M, out = x.shape[0], w.shape[0]
    kernel = mx.fast.cuda_kernel(name="mlxfun_qmv4", input_names=["x", "w", "scales", "biases"],
                                 output_names=["y"], source=_SIMT)
    grid, block = simt_grid(out, per_warp)
    return kernel(inputs=[x, w, scales, biases],
                  template=[("T", x.dtype), ("GS", group_size), ("M", M), ("R", per_warp)],
                  grid=(grid, 1, 1), threadgroup=(block, 1, 1),
                  output_shapes=[(M, out)], output_dtypes=[x.dtype])[0]


# Tensor-core helpers for `_MMA` and `dmv._MMA` (bf16 and fp16 activations). A `Pair` is two values of T in
# one register, the operand of mma.sync; `tests/cuda_emulator.py` defines the same names on the CPU.
MMA_HEADER = compact(r"""
using Pair = uint32_t;
template <typename T> struct QmvOps;
template <> struct QmvOps<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    static constexpr uint32_t MAGIC = 0x43004300u;  // bf16 128: OR a nibble in, read 128 + q
};
template <> struct QmvOps<__half> {
    using T2 = __half2;
    static constexpr uint32_t MAGIC = 0x64006400u;  // fp16 1024
};
template <typename T> __device__ inline Pair qmv_pack(T lo, T hi) {
    typename QmvOps<T>::T2 v{lo, hi};
    return *reinterpret_cast<Pair*>(&v);
}
// Values p and p + 32 / BITS / 2 of `word` (4-bit: nibbles p, p + 4; 8-bit: bytes p, p + 2),
// dequantized: q * scale + bias, rounded once to T (as mx.dequantize).
template <typename T, int BITS> __device__ inline Pair qmv_dequant(uint32_t word, int p, Pair scale, Pair bias) {
    using T2 = typename QmvOps<T>::T2;
    T2 q;
    if constexpr (BITS == 4) {
        Pair bits = ((word >> (4 * p)) & 0x000F000Fu) | QmvOps<T>::MAGIC, magic = QmvOps<T>::MAGIC;
        q = __hsub2(*reinterpret_cast<T2*>(&bits), *reinterpret_cast<T2*>(&magic));  // exact
    } else {  // a byte, exact in float through the 2^23 magic (no integer conversion, a quarter-rate
              // instruction), then exact in fp16 and bf16 alike (8 significant bits)
        const float lo = __uint_as_float(0x4B000000u | ((word >> (8 * p)) & 0xFFu)) - 8388608.f;
        const float hi = __uint_as_float(0x4B000000u | ((word >> (8 * p + 16)) & 0xFFu)) - 8388608.f;
        q = T2{static_cast<T>(lo), static_cast<T>(hi)};
    }
    T2 w = __hfma2(q, *reinterpret_cast<T2*>(&scale), *reinterpret_cast<T2*>(&bias));
    return *reinterpret_cast<Pair*>(&w);
}
// c (16 x 8, f32) += a (16 x 16) b (16 x 8): one warp, PTX fragment layouts of m16n8k16.
template <typename T> __device__ inline void qmv_mma(float* c, const Pair* a, const Pair* b);
template <> __device__ inline void qmv_mma<__nv_bfloat16>(float* c, const Pair* a, const Pair* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ inline void qmv_mma<__half>(float* c, const Pair* a, const Pair* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
""")

_MMA = compact(r"""
    // y (M, OUT) = x (M, IN) W^T, W 4- or 8-bit (BITS), on tensor cores: mma m16n8k16, A = 16
    // features x 16 inputs of W dequantized in registers, B = 16 inputs x 8 rows of x. A block
    // computes F groups of 16 output features for N tiles of 8 rows (block row blockIdx.y: rows
    // 8 N y ...; rows past M read row M - 1, never stored): each dequantized A serves the N tiles,
    // and each x fragment the F groups (x is read once per 16 F features, W once per 8 N rows).
    // A dot product may take its inputs in any order, so each lane's A slots are filled from the
    // 32-bit words it loads itself, and its B slots with the x values of those same inputs: lane
    // (g, t) = (lane / 4, lane % 4) takes features g and g + 8 of each group and, of each 128
    // inputs, the 32 at 32 t (BITS words of W per feature, one group). A word holds 32 / BITS
    // inputs: 4-bit, nibbles (p, p + 4) and (p + 1, p + 5) feed one mma; 8-bit, bytes (0, 2) and
    // (1, 3). The KW warps of a block take every KW-th 128 inputs, U of them in flight, each U with
    // its own accumulators (consecutive mma on one accumulator wait for each other); shared memory
    // sums the warps' partials, tile by tile. The order of every sum is fixed by IN, KW and U
    // alone: at one KW and U, a row's outputs are the same bits whatever the other rows, their
    // number (N, the grid), F, or the row's place among them.
    constexpr int PER_WORD = 32 / BITS;  // inputs per 32-bit word
    const int M = x_shape[0], IN = x_shape[1], OUT = w_shape[0], groups = IN / GS, blocks = (IN + 127) / 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int f0 = blockIdx.x * 16 * F, row0 = blockIdx.y * 8 * N;
    int64_t fa[F], fb[F];
    #pragma unroll
    for (int i = 0; i < F; ++i) {  // past OUT: the last feature again, never stored
        fa[i] = min(f0 + 16 * i + g, OUT - 1);
        fb[i] = min(f0 + 16 * i + g + 8, OUT - 1);
    }
    float c[U][F][N][4];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        #pragma unroll
        for (int i = 0; i < F; ++i) {
            #pragma unroll
            for (int n = 0; n < N; ++n) c[u][i][n][0] = c[u][i][n][1] = c[u][i][n][2] = c[u][i][n][3] = 0.f;
        }
    }
    for (int b0 = warp; b0 < blocks; b0 += KW * U) {  // the same trip count on every lane of a warp
        uint4 qa[U][F][BITS / 4], qb[U][F][BITS / 4];
        int ks[U];
        Pair sa[U][F], ba[U][F], sb[U][F], bb[U][F];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = (b0 + KW * u) * 128 + 32 * t;
            ks[u] = -1;
            if (b0 + KW * u < blocks && k < IN) {
                ks[u] = k;
                #pragma unroll
                for (int i = 0; i < F; ++i) {
                    const uint4* wa = reinterpret_cast<const uint4*>(w + fa[i] * (IN / PER_WORD));
                    const uint4* wb = reinterpret_cast<const uint4*>(w + fb[i] * (IN / PER_WORD));
                    #pragma unroll
                    for (int v = 0; v < BITS / 4; ++v) {
                        qa[u][i][v] = wa[k / 32 * (BITS / 4) + v];
                        qb[u][i][v] = wb[k / 32 * (BITS / 4) + v];
                    }
                    // Through float: scales may have another dtype than x (bf16 <-> fp16 has no implicit cast).
                    const int64_t ga = fa[i] * groups + k / GS, gb = fb[i] * groups + k / GS;
                    const T s0 = static_cast<T>(static_cast<float>(scales[ga]));
                    const T s1 = static_cast<T>(static_cast<float>(scales[gb]));
                    const T z0 = static_cast<T>(static_cast<float>(biases[ga]));
                    const T z1 = static_cast<T>(static_cast<float>(biases[gb]));
                    sa[u][i] = qmv_pack<T>(s0, s0); ba[u][i] = qmv_pack<T>(z0, z0);
                    sb[u][i] = qmv_pack<T>(s1, s1); bb[u][i] = qmv_pack<T>(z1, z1);
                }
            } else {  // zero weights times zero inputs
                const T zero = static_cast<T>(0.f);
                #pragma unroll
                for (int i = 0; i < F; ++i) {
                    #pragma unroll
                    for (int v = 0; v < BITS / 4; ++v) qa[u][i][v] = qb[u][i][v] = uint4{0u, 0u, 0u, 0u};
                    sa[u][i] = ba[u][i] = sb[u][i] = bb[u][i] = qmv_pack<T>(zero, zero);
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int j = 0; j < BITS; ++j) {  // word j: inputs PER_WORD j ... of the lane's 32
                constexpr int H = PER_WORD / 2, PAIRS = PER_WORD / 4;  // PAIRS mma per word
                Pair a[F][PAIRS][4];  // dequantized once for the N tiles (few registers: KW warps share a block)
                #pragma unroll
                for (int i = 0; i < F; ++i) {
                    const uint4 va = qa[u][i][j / 4], vb = qb[u][i][j / 4];
                    const uint32_t word_a = j % 4 == 0 ? va.x : j % 4 == 1 ? va.y : j % 4 == 2 ? va.z : va.w;
                    const uint32_t word_b = j % 4 == 0 ? vb.x : j % 4 == 1 ? vb.y : j % 4 == 2 ? vb.z : vb.w;
                    #pragma unroll
                    for (int q = 0; q < PAIRS; ++q) {  // values (2 q, 2 q + H) and (2 q + 1, 2 q + 1 + H)
                        a[i][q][0] = qmv_dequant<T, BITS>(word_a, 2 * q, sa[u][i], ba[u][i]);
                        a[i][q][1] = qmv_dequant<T, BITS>(word_b, 2 * q, sb[u][i], bb[u][i]);
                        a[i][q][2] = qmv_dequant<T, BITS>(word_a, 2 * q + 1, sa[u][i], ba[u][i]);
                        a[i][q][3] = qmv_dequant<T, BITS>(word_b, 2 * q + 1, sb[u][i], bb[u][i]);
                    }
                }
                #pragma unroll
                for (int n = 0; n < N; ++n) {
                    AlignedVector<T, PER_WORD> xv;
                    if (ks[u] >= 0) {
                        const T* xr = x + (int64_t)min(row0 + 8 * n + g, M - 1) * IN;  // past M: never stored
                        xv = unsafe_load_vector<PER_WORD>(xr + ks[u], j);
                    } else {
                        #pragma unroll
                        for (int e = 0; e < PER_WORD; ++e) xv[e] = static_cast<T>(0.f);
                    }
                    #pragma unroll
                    for (int q = 0; q < PAIRS; ++q) {
                        Pair b[2] = {qmv_pack<T>(xv[2 * q], xv[2 * q + H]),
                                     qmv_pack<T>(xv[2 * q + 1], xv[2 * q + 1 + H])};
                        #pragma unroll
                        for (int i = 0; i < F; ++i) qmv_mma<T>(c[u][i][n], a[i][q], b);
                    }
                }
            }
        }
    }
    __shared__ float partial[KW][32][4];
    #pragma unroll
    for (int i = 0; i < F; ++i) {
        #pragma unroll
        for (int n = 0; n < N; ++n) {
            if (i || n) __syncthreads();  // warp 0 has read the tile before
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = 0.f;
                #pragma unroll
                for (int u = 0; u < U; ++u) v += c[u][i][n][e];
                partial[warp][lane][e] = v;
            }
            __syncthreads();
            if (warp == 0) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {  // c[e]: feature 16 i + g (+ 8 for e >= 2), row 8 n + 2 t + e % 2
                    float v = 0.f;
                    #pragma unroll
                    for (int k = 0; k < KW; ++k) v += partial[k][lane][e];
                    const int f = f0 + 16 * i + g + 8 * (e >> 1), row = row0 + 8 * n + 2 * t + (e & 1);
                    if (f < OUT && row < M) y[(int64_t)row * OUT + f] = static_cast<T>(v);
                }
            }
        }
    }
""")


# The fastest of six launches on an H200 at 1 and 8 rows (7fbc90b:benchmarks/README.md, fourth pass).
MMA_WARPS = 16  # KW: warps per block, sharing the inputs
MMA_IN_FLIGHT = 1  # U: 128-input blocks a warp loads at once


# A block computes N tiles of 8 rows x F groups of 16 features: x is read once per block column
# and W once per block row, so more rows want larger blocks; N x F stays at most 8 (the
# accumulators' registers).
MAX_TILES = 8
# $MLXFUN_QMV_FEATURES, read once at import: "1" keeps F = 1 at every row count (N = `tiles`), so
# that a benchmark compares the block shapes in two processes; unset, `block_shape` picks them.
FEATURES_ENV = "MLXFUN_QMV_FEATURES"


ONE_GROUP = settings.switch(FEATURES_ENV, os.environ.get(FEATURES_ENV, ""))  # F stays 1


def tiles(rows: int) -> int:
    """The tiles of 8 rows that cover `rows`, as a power of two up to MAX_TILES (few kernel
    variants: each is built on its first use)."""
    need = -(-rows // 8)
    return min(MAX_TILES, 1 << (need - 1).bit_length())


def block_shape(rows: int) -> tuple[int, int]:
    """(N, F) for `rows` rows, the least total time over the 1B and 8B maps on an H100, 4- and
    8-bit alike (`benchmarks/qmv_shapes.py`, benchmarks/results/h100/2026-12-06-qmv-shapes.json):
    up to 8 rows 1 x 2, to 16 rows 2 x 2, then 4 x 2 (at 128 rows 0.72x the time of 8 x 1)."""
    if ONE_GROUP:
        return tiles(rows), 1
    return (1, 2) if rows <= 8 else (2, 2) if rows <= 16 else (4, 2)


def warps_for(tiles: int, features: int = 1, bits: int = 4) -> int:
    """Warps per block (KW): a block has 64K registers. ptxas (sm_90, bf16, U = 1), registers a
    thread by (bits, N x F): 4-bit 59 (1x1), 68-76 (2), 90-104 (4: 4x1, 2x2), 126 (1x4), 140-166
    (8); 8-bit 60-84 (1-2, 4x1), 131-164 (2x2, 1x4), 132-140 (8). 16 warps (512 threads) where
    that stays under 128, else 8 (16 warps of 148 failed to launch on an H100)."""
    n = tiles * features
    return MMA_WARPS if n <= 2 or (n <= 4 and (features == 1 or (bits == 4 and features <= 2))) else MMA_WARPS // 2


def mma_grid(out_features: int, rows: int, warps: int = MMA_WARPS, shape: tuple[int, int] | None = None
             ) -> tuple[tuple[int, int, int], int]:
    """(grid in threads, threads per block) of an `mma` launch: a block per 16 F features and
    8 N rows, (N, F) = `shape` (default: `tiles(rows)`, 1)."""
    n, f = (tiles(rows), 1) if shape is None else shape
    return (32 * warps * -(-out_features // (16 * f)), -(-rows // (8 * n)), 1), 32 * warps


def mma(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
        warps: int | None = None, in_flight: int = MMA_IN_FLIGHT, bits: int = 4,
        shape: tuple[int, int] | None = None) -> mx.array:
    """`product` on tensor cores (bf16 or fp16 x, 4- or 8-bit w); `warps` (default `warps_for`),
    `in_flight` and the block's `shape` (N, F; default `block_shape`) as a benchmark varies them."""
    M, out = x.shape[0], w.shape[0]
    N, F = block_shape(M) if shape is None else shape
    warps = warps_for(N, F, bits) if warps is None else warps
    kernel = mx.fast.cuda_kernel(name="mlxfun_qmv4_mma", input_names=["x", "w", "scales", "biases"],
                                 output_names=["y"], source=_MMA, header=MMA_HEADER)
    grid, block = mma_grid(out, M, warps, (N, F))
    return kernel(inputs=[x, w, scales, biases],
                  template=[("T", x.dtype), ("GS", group_size), ("BITS", bits), ("N", N), ("F", F),
                            ("KW", warps), ("U", in_flight)],
                  grid=grid, threadgroup=(block, 1, 1),
                  output_shapes=[(M, out)], output_dtypes=[x.dtype])[0]
