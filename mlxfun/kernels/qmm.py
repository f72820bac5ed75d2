"""A tiled product of many rows with 4-bit, 8-bit or dense bf16 / fp16 weights, on CUDA tensor cores.

`qmv` computes 16 F output features per block and reads x again for every such block, which is
cheap for a few rows and the larger part of the traffic from about 32 rows on: at 128 rows it took
1.9x bf16's time per product on an H100 (benchmarks/results/h100/2026-12-06-qmv-shapes.json).
Here a block of 4 warps takes BN = 128 features and BM = 16-64 rows; warp w takes features
32 w ... 32 w + 31 for all BM rows, so each weight is dequantized once per block, in registers,
straight into mma's A fragments, and no dense weights reach memory.

The pipeline is the one of the fast CUDA GEMMs: a ring of STAGES shared-memory stages, each
holding 64 inputs of x's tile (BM rows) and of W's (BN features: 4- or 8-bit words as stored, or
dense values), filled by cp.async STAGES - 1 steps ahead of the step the warps multiply, with one
block barrier a step. x's fragments (and dense W's) come from shared memory by ldmatrix, its
16-byte chunks stored XOR-swizzled so that the 8 rows a ldmatrix reads lie in 8 different banks.
Quantized W is read as words (MLX's affine layout, no repacking): lane (g, t) needs inputs 2 t,
2 t + 1 (+ 8) of features g and g + 8, which are byte t of a 4-bit word (one prmt, then the
0x4300 / 0x6400 magic) or half t & 1 of an 8-bit one; a group's scale and bias for the next step
are loaded into registers a step ahead.

Each output's sum runs over the inputs in steps of 64, in order, each step as four mma of 16
inputs. A map with few blocks of features (a 1B's 2,048 outputs make 16 blocks) splits its inputs
into S parts (`splits`), each block storing float32 partial sums that the tile's last block adds in
split order. So each sum's order is fixed by IN and S, whatever the rows, their number or the
tile; the batch-invariant mode picks S by the map alone.

Correct on an H100 (within 3.6e-3 of the float32 product), but slower than bf16 at every row
count: summed over the 1B and 8B maps, 4-bit takes 1.28x bf16's time at 8 rows, 1.51x at 32,
1.78x at 128, and 3.1x on 4,096 rows of an 8B map, about 205 TFLOPs
(benchmarks/results/h100/2026-12-07-qmm-v3-shapes.json); `qmv` beats it up to 64 rows. At 64 rows
it holds 166-200 registers a thread, two blocks an SM. It is checked on the CPU through
`tests/cuda_emulator.py` (PTX's fragment layouts, ldmatrix, and cp.async copies that land only
when waited for) and against ptxas for registers. Nothing calls it
by default; two settings, read once at import, let a benchmark try it in a process of its own:
`MLXFUN_TILED_FROM=N` runs quantized products of N rows or more through it (prompts included, and
no dense copy of the weights at any batch), and `MLXFUN_INVARIANT_TILED=1` makes it the
batch-invariant mode's product (`llama.linear(..., invariant=True)`) at every row count, quantized
maps included without a dequantized copy. `benchmarks/qmv_shapes.py` times it beside `qmv` and bf16.

MLX's affine format: w (OUT, IN * BITS / 32) uint32, value k of a word in bits [BITS k, BITS
(k + 1)), in input order; scales, biases (OUT, IN / GS); a weight is q * scale + bias.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mlx.core as mx

from mlxfun.kernels import settings
from mlxfun.kernels.attention import compact
from mlxfun.kernels.qmv import MMA_HEADER

# What the tiled product adds to `qmv.MMA_HEADER`: asynchronous copies into shared memory, ldmatrix,
# the dynamic shared memory, and the dequantization of two neighbouring values of a word.
QMM_HEADER = MMA_HEADER + "\n" + compact(r"""
#define QMM_SMEM(name, bytes) extern __shared__ __align__(16) unsigned char name[]
// 16 bytes global -> shared, landing by cp_async_wait (8 values of T, or 4 words).
template <typename E> __device__ inline void cp_async16(E* dst, const E* src) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Until at most N of this thread's latest groups are in flight.
template <int N> __device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
// Four 8 x 8 matrices of 2-byte values: lane 8 m + r gives the address of row r of matrix m;
// r[m] of lane (g, t) is row g, values 2 t and 2 t + 1 of matrix m.
template <typename E> __device__ inline void ldsm_x4(Pair* r, const E* row) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// Values 2 p and 2 p + 1 of `word` (4-bit: the nibbles of byte p; 8-bit: the bytes of half p),
// dequantized: q * scale + bias, rounded once to T (as mx.dequantize).
template <typename T, int BITS> __device__ inline Pair qmm_dequant(uint32_t word, int p, Pair scale, Pair bias) {
    using T2 = typename QmvOps<T>::T2;
    T2 q;
    if constexpr (BITS == 4) {  // byte p of word -> byte 0, byte p of word >> 4 -> byte 2: nibbles 2 p, 2 p + 1
        uint32_t both;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(both) : "r"(word), "r"(word >> 4), "r"(p * 0x1111u + 0x4400u));
        Pair bits = (both & 0x000F000Fu) | QmvOps<T>::MAGIC, magic = QmvOps<T>::MAGIC;
        q = __hsub2(*reinterpret_cast<T2*>(&bits), *reinterpret_cast<T2*>(&magic));  // exact
    } else {  // exact in float through the 2^23 magic, then in fp16 and bf16 alike (8 significant bits)
        const float lo = __uint_as_float(0x4B000000u | ((word >> (16 * p)) & 0xFFu)) - 8388608.f;
        const float hi = __uint_as_float(0x4B000000u | ((word >> (16 * p + 8)) & 0xFFu)) - 8388608.f;
        q = T2{static_cast<T>(lo), static_cast<T>(hi)};
    }
    T2 w = __hfma2(q, *reinterpret_cast<T2*>(&scale), *reinterpret_cast<T2*>(&bias));
    return *reinterpret_cast<Pair*>(&w);
}
""")

_BODY = r"""
    // y (M, OUT) = x (M, IN) W^T. A block: BN features (blockIdx.x) x BM rows (blockIdx.y) x the
    // inputs of split blockIdx.z; warp w takes features 16 FW w ... for all BM rows (NT tiles of
    // 8), as FW x NT mma m16n8k16 per 16 inputs (A: 16 features x 16 inputs, B: 16 inputs x 8
    // rows). Stage s of the ring holds x's tile (BM x 64, 16-byte chunk c of row r at chunk
    // c ^ (r & 7)) and W's. Rows past M and features past OUT read row M - 1 / OUT - 1,
    // and are never stored.
    constexpr int BK = 64, NT = BM / 8, THREADS = 32 * (BN / (16 * FW));
    const int M = x_shape[0], IN = x_shape[1], OUT = w_shape[0], S = gridDim.z;
    const int K0 = blockIdx.z * (IN / S), STEPS = IN / S / BK;  // split blockIdx.z of S: these inputs
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int fb = blockIdx.x * BN, rb = blockIdx.y * BM;
    W_CONSTS
    QMM_SMEM(smem, STAGES * (BM * BK * 2 + W_STAGE_BYTES));
    T* xs = reinterpret_cast<T*>(smem);
    W_SETUP
    float c[FW][NT][4];
    #pragma unroll
    for (int i = 0; i < FW; ++i) {
        #pragma unroll
        for (int n = 0; n < NT; ++n) c[i][n][0] = c[i][n][1] = c[i][n][2] = c[i][n][3] = 0.f;
    }
    auto load = [&](int stage, int k0) {  // the step at k0 into `stage`: cp.async, 16 bytes a copy
        T* xd = xs + stage * BM * BK;
        #pragma unroll
        for (int j = 0; j < (BM * 8 + THREADS - 1) / THREADS; ++j) {
            const int i = tid + j * THREADS, r = i >> 3, ch = i & 7;
            if (i < BM * 8)
                cp_async16(xd + r * BK + 8 * (ch ^ (r & 7)), x + (int64_t)min(rb + r, M - 1) * IN + k0 + 8 * ch);
        }
        W_LOAD
    };
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < STEPS) load(s, K0 + s * BK);
        cp_async_commit();
    }
    SCALES_FIRST
    for (int step = 0; step < STEPS; ++step) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of the step have landed
        __syncthreads();  // everyone's have; and everyone is done with the stage refilled next
        const int next = step + STAGES - 1;
        if (next < STEPS) load(next % STAGES, K0 + next * BK);
        cp_async_commit();
        SCALES_NEXT
        const int stage = step % STAGES;
        const T* xc = xs + stage * BM * BK;
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            Pair b[NT][2];  // B register r of tile n: inputs 2 t + 8 r + {0, 1} of row 8 n + g
            #pragma unroll
            for (int j = 0; j < NT / 2; ++j) {  // matrices: rows 16 j + 8 (m >> 1) ..., chunk 2 kk + (m & 1)
                const int m = lane >> 3, r = 16 * j + 8 * (m >> 1) + (lane & 7), ch = 2 * kk + (m & 1);
                ldsm_x4(&b[2 * j][0], xc + r * BK + 8 * (ch ^ (r & 7)));
            }
            #pragma unroll
            for (int i = 0; i < FW; ++i) {
                Pair a[4];  // A register r: feature g + 8 (r & 1), inputs 2 t + 8 (r >> 1) + {0, 1}
                A_FRAGMENT
                #pragma unroll
                for (int n = 0; n < NT; ++n) qmv_mma<T>(c[i][n], a, b[n]);
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < FW; ++i) {
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {  // c[e]: feature g (+ 8 for e >= 2), row 2 t + e % 2 of tile n
                const int f = fb + 16 * (FW * warp + i) + g + 8 * (e >> 1), row = rb + 8 * n + 2 * t + (e & 1);
                if (f < OUT && row < M) STORE;
            }
        }
    }
    SPLIT_SUM
"""

# One split: each output stored at once. S splits: each block stores its partial sums in float32;
# the last of a tile's S blocks to finish (a counter per tile) adds the S partials in split order
# and stores the outputs: the same order whichever block finishes last.
_STORE = "y[(int64_t)row * OUT + f] = static_cast<T>(c[i][n][e])"
_STORE_PART = "part[((int64_t)blockIdx.z * M + row) * OUT + f] = c[i][n][e]"
_SPLIT_SUM = r"""
    __threadfence();  // the partials visible to the block that adds them
    __syncthreads();
    __shared__ int last;
    if (tid == 0) last = atomicAdd(&count[blockIdx.y * gridDim.x + blockIdx.x], 1) == S - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        for (int i = tid; i < BM * BN; i += THREADS) {
            const int row = rb + i / BN, f = fb + i % BN;
            if (row < M && f < OUT) {
                float v = 0.f;
                for (int q = 0; q < S; ++q) v += __ldcg(part + ((int64_t)q * M + row) * OUT + f);
                y[(int64_t)row * OUT + f] = static_cast<T>(v);
            }
        }
    }
"""

# W's stage. Dense: BN x 64 values, swizzled as x's, A fragments by ldmatrix. Quantized: BN rows of
# WPS words (64 inputs) padded to WROW, so that the 8 features a fragment reads lie in different
# banks; lane (g, t) dequantizes byte t of 4-bit words (inputs 2 t, 2 t + 1 of 8), or half t & 1 of
# 8-bit ones (of 4), with the group's scale and bias (G groups a step: 2 for groups of 32).
_DENSE = dict(W_CONSTS="", W_STAGE_BYTES="BN * BK * 2", W_SETUP=r"""
    T* ws = xs + STAGES * BM * BK;  // [STAGES][BN][BK]
""", W_LOAD=r"""
        T* wd = ws + stage * BN * BK;
        #pragma unroll
        for (int j = 0; j < (BN * 8 + THREADS - 1) / THREADS; ++j) {
            const int i = tid + j * THREADS, f = i >> 3, ch = i & 7;
            if (i < BN * 8)
                cp_async16(wd + f * BK + 8 * (ch ^ (f & 7)), w + (int64_t)min(fb + f, OUT - 1) * IN + k0 + 8 * ch);
        }
""", A_FRAGMENT=r"""
                {  // matrices: features 8 (m & 1) ..., chunk 2 kk + (m >> 1)
                    const int m = lane >> 3, ch = 2 * kk + (m >> 1);
                    const int f = 16 * (FW * warp + i) + 8 * (m & 1) + (lane & 7);
                    ldsm_x4(a, ws + (stage * BN + f) * BK + 8 * (ch ^ (f & 7)));
                }
""", SCALES_FIRST="", SCALES_NEXT="")
_QUANTIZED = dict(W_CONSTS="constexpr int PER_WORD = 32 / BITS, WPS = BK / PER_WORD, WROW = WPS + 4, "
                         "G = GS < BK ? BK / GS : 1;",
                  W_STAGE_BYTES="BN * WROW * 4", W_SETUP=r"""
    uint32_t* wq = reinterpret_cast<uint32_t*>(xs + STAGES * BM * BK);  // [STAGES][BN][WROW]
    Pair sc[FW][2][G], bi[FW][2][G], sn[FW][2][G], bn[FW][2][G];  // this step's scales and biases, the next's
    auto scales_at = [&](int k0) {  // features 16 (FW warp + i) + g + 8 h, groups of inputs k0 ...
        #pragma unroll
        for (int i = 0; i < FW; ++i) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int f = min(fb + 16 * (FW * warp + i) + g + 8 * h, OUT - 1);
                #pragma unroll
                for (int q = 0; q < G; ++q) {
                    const int64_t at = (int64_t)f * (IN / GS) + (k0 + q * GS) / GS;
                    sn[i][h][q] = qmv_pack<T>(scales[at], scales[at]);
                    bn[i][h][q] = qmv_pack<T>(biases[at], biases[at]);
                }
            }
        }
    };
""", W_LOAD=r"""
        uint32_t* wd = wq + stage * BN * WROW;
        #pragma unroll
        for (int j = 0; j < (BN * WPS / 4 + THREADS - 1) / THREADS; ++j) {
            const int i = tid + j * THREADS, f = i / (WPS / 4), ch = i % (WPS / 4);
            if (i < BN * WPS / 4)
                cp_async16(wd + f * WROW + 4 * ch,
                           w + (int64_t)min(fb + f, OUT - 1) * (IN / PER_WORD) + k0 / PER_WORD + 4 * ch);
        }
""", A_FRAGMENT=r"""
                {
                    const uint32_t* w0 = wq + (stage * BN + 16 * (FW * warp + i) + g) * WROW;
                    const uint32_t* w1 = w0 + 8 * WROW;
                    const int q = G == 1 ? 0 : kk * 16 / GS;
                    // 4-bit: words 2 kk, 2 kk + 1 (inputs 0-7, 8-15 of the 16); 8-bit: 4 kk + t / 2, 4 kk + 2 + t / 2
                    const int lo = BITS == 4 ? 2 * kk : 4 * kk + (t >> 1), hi = BITS == 4 ? lo + 1 : lo + 2;
                    const int p = BITS == 4 ? t : t & 1;
                    a[0] = qmm_dequant<T, BITS>(w0[lo], p, sc[i][0][q], bi[i][0][q]);
                    a[1] = qmm_dequant<T, BITS>(w1[lo], p, sc[i][1][q], bi[i][1][q]);
                    a[2] = qmm_dequant<T, BITS>(w0[hi], p, sc[i][0][q], bi[i][0][q]);
                    a[3] = qmm_dequant<T, BITS>(w1[hi], p, sc[i][1][q], bi[i][1][q]);
                }
""", SCALES_FIRST="    scales_at(K0);\n", SCALES_NEXT=r"""
        #pragma unroll
        for (int i = 0; i < FW; ++i) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                #pragma unroll
                for (int q = 0; q < G; ++q) sc[i][h][q] = sn[i][h][q], bi[i][h][q] = bn[i][h][q];
            }
        }
        if (step + 1 < STEPS) scales_at(K0 + (step + 1) * BK);  // in flight during this step's mma
""")


def source(bits: int, split: bool) -> str:
    """The kernel for dense (16) or quantized W, in one split or several."""
    body = _BODY
    for placeholder, text in (_DENSE if bits == 16 else _QUANTIZED).items():
        body = body.replace(placeholder, text)
    body = body.replace("STORE", _STORE_PART if split else _STORE)
    return compact(body.replace("SPLIT_SUM", _SPLIT_SUM if split else ""))


# (dense, split) -> the kernel's source (4- and 8-bit share one: BITS is a template constant).
SOURCES = {(dense, split): source(16 if dense else 4, split) for dense in (False, True) for split in (False, True)}

STEP = 64  # inputs a block stages per step

FROM_ENV, INVARIANT_ENV = "MLXFUN_TILED_FROM", "MLXFUN_INVARIANT_TILED"


def tiled_from(setting: str) -> int | None:
    """$MLXFUN_TILED_FROM -> the rows from which quantized products run `product` (None: unset, never)."""
    setting = setting.strip()
    if not setting:
        return None
    if not setting.isdigit() or int(setting) < 1:
        raise ValueError(f"{FROM_ENV}={setting!r}: expected a row count of 1 or more, or unset")
    return int(setting)


FROM_ROWS = tiled_from(os.environ.get(FROM_ENV, ""))
INVARIANT = settings.switch(INVARIANT_ENV, os.environ.get(INVARIANT_ENV, ""))  # the batch-invariant products here


class Tile(NamedTuple):
    rows: int  # BM: rows of x per block (a multiple of 16: ldmatrix reads two tiles of 8 at a time)
    features: int  # BN: output features per block
    per_warp: int  # FW: groups of 16 features a warp takes (warps = BN / 16 FW)

    @property
    def threads(self) -> int:
        return 32 * self.features // (16 * self.per_warp)


def tile(rows: int) -> Tile:
    """The tile for `rows` rows: rows rounded up to 16, 32 or 64 per block, 128 features in 4 warps
    of 32 (accumulators: FW x BM / 8 x 4 floats a thread, at most 64)."""
    return Tile(min(64, max(16, 1 << (rows - 1).bit_length())), 128, 2)


STAGES = 3  # the ring of shared-memory stages: copies run STAGES - 1 steps ahead of the mma


def shared_bytes(bits: int, shape: Tile) -> int:
    """Dynamic shared memory of a launch: STAGES x (x's tile + W's: dense values, or words in rows
    padded by 4)."""
    w_stage = shape.features * STEP * 2 if bits == 16 else shape.features * (STEP * bits // 32 + 4) * 4
    return STAGES * (shape.rows * STEP * 2 + w_stage)


def fits(rows: int, in_features: int, group_size: int, bits: int, dtype: mx.Dtype) -> bool:
    """bf16 or fp16 x, 4-, 8-bit or dense (16) weights, inputs in whole steps of 64 (and, quantized,
    whole groups of 32 or more)."""
    quantized_ok = bits == 16 or (bits in (4, 8) and group_size % 32 == 0 and in_features % group_size == 0)
    return dtype in (mx.bfloat16, mx.float16) and rows >= 1 and in_features % STEP == 0 and quantized_ok


# Blocks a launch aims for: two per SM of an H100 or H200 (132).
TARGET_BLOCKS = 264
MAX_SPLITS = 16


def splits(out_features: int, in_features: int, row_blocks: int, target: int = TARGET_BLOCKS) -> int:
    """S, the splits of the inputs: a power of two that brings the grid's blocks toward `target`,
    each split at least 4 steps of 64 (a 1B's 2,048 x 2,048 map makes 16 blocks of 128 features
    for a row block). The batch-invariant mode asks with one row block, so that S, and with it
    each sum's order, depends on the map alone."""
    blocks, steps, s = -(-out_features // 128) * row_blocks, in_features // STEP, 1
    while 2 * s <= MAX_SPLITS and blocks * 2 * s <= target and steps % (2 * s) == 0 and steps // (2 * s) >= 4:
        s *= 2
    return s


def grid(out_features: int, rows: int, shape: Tile, split: int = 1) -> tuple[tuple[int, int, int], int]:
    """(grid in threads, threads per block): a block per BN features, BM rows and split."""
    return (shape.threads * -(-out_features // shape.features), -(-rows // shape.rows), split), shape.threads


def template(dtype, bits: int, group_size: int, shape: Tile) -> list:
    """The kernel's template constants (the dense kernel has no BITS or GS; the splits are the
    grid's third axis)."""
    quantized = [("BITS", bits), ("GS", group_size)] if bits != 16 else []
    return [("T", dtype), *quantized, ("BM", shape.rows), ("BN", shape.features), ("FW", shape.per_warp),
            ("STAGES", STAGES)]


def _launch(x: mx.array, inputs: list[mx.array], names: list[str], out: int, group_size: int, bits: int,
            shape: Tile | None, invariant: bool, target: int) -> mx.array:
    M, IN = x.shape
    shape = tile(M) if shape is None else shape
    row_blocks = -(-M // shape.rows)
    S = splits(out, IN, 1 if invariant else row_blocks, target)
    kernel = mx.fast.cuda_kernel(name=f"mlxfun_qmm{'_dense' if bits == 16 else ''}{'_split' if S > 1 else ''}",
                                 input_names=names, output_names=["y", "part", "count"] if S > 1 else ["y"],
                                 source=SOURCES[bits == 16, S > 1], header=QMM_HEADER,
                                 shared_memory=shared_bytes(bits, shape))
    threads, block = grid(out, M, shape, S)
    if S == 1:
        outputs = dict(output_shapes=[(M, out)], output_dtypes=[x.dtype])
    else:  # partial sums, and a counter per tile (zeroed: init_value)
        outputs = dict(output_shapes=[(M, out), (S, M, out), (row_blocks * -(-out // shape.features),)],
                       output_dtypes=[x.dtype, mx.float32, mx.int32], init_value=0)
    return kernel(inputs=inputs, template=template(x.dtype, bits, group_size, shape), grid=threads,
                  threadgroup=(block, 1, 1), **outputs)[0]


def product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int = 4,
            shape: Tile | None = None, invariant: bool = False, target: int = TARGET_BLOCKS) -> mx.array:
    """x (M, IN) @ dequantize(w, scales, biases)^T -> (M, OUT), 4- or 8-bit w; needs `fits`.
    `invariant`: the splits of the inputs follow the map alone; `target`: blocks the splits aim
    for (`splits`)."""
    return _launch(x, [x, w, scales, biases], ["x", "w", "scales", "biases"], w.shape[0], group_size, bits, shape,
                   invariant, target)


def dense(x: mx.array, w: mx.array, shape: Tile | None = None, invariant: bool = False,
          target: int = TARGET_BLOCKS) -> mx.array:
    """x (M, IN) @ w (OUT, IN)^T -> (M, OUT), w of x's dtype; needs `fits(..., bits=16, ...)`."""
    return _launch(x, [x, w], ["x", "w"], w.shape[0], 32, 16, shape, invariant, target)
