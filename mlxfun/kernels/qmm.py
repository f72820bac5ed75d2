"""A tiled product of many rows with 4-bit, 8-bit or dense bf16 / fp16 weights, on CUDA tensor cores.

`qmv` computes 16 F output features per block and reads x again for every such block, which is
cheap for a few rows and the larger part of the traffic from about 32 rows on: at 128 rows it took
1.9x bf16's time per product on an H100 (benchmarks/results/h100/2026-12-06-qmv-shapes.json).
Here a block stages a tile of x (BM rows x 64 inputs) and a tile of W (BN features x 64 inputs,
dequantized once, by the whole block) in shared memory, and its warps multiply the tiles from
there: x is read once per BN features, W once per BM rows, and no dense weights reach memory.

Each output's sum runs over the inputs in steps of 64, in order, each step as four mma of 16
inputs. A map with few blocks of features (a 1B's 2,048 outputs: 16 blocks) splits its inputs into
S parts (`splits`), each block storing float32 partial sums that the tile's last block adds in
split order. So each sum's order is fixed by IN and S, whatever the rows, their number or the
tile; the batch-invariant mode picks S by the map alone.

Correct on an H200 (within 3e-3 of the float32 product), but slower than bf16 at every row count:
1.5x bf16's time at 8 rows, 3.0x at 128, 8x on 4,096 rows of an 8B map (about 85 TFLOPs;
benchmarks/results/h200/2026-12-06-qmm-tiled.json). A step takes 3-5 us whatever the rows: the
inner loop (32-bit shared-memory loads per fragment, two barriers a step, one 8-warp block per SM)
bounds it, not the reads of W; ldmatrix, 2-D warp tiles and double-buffered copies are what it
lacks. It is checked on the CPU through `tests/cuda_emulator.py` (PTX's fragment layouts) and
against ptxas for registers and shared memory. Nothing calls it by default; two settings, read
once at import, let a benchmark try it in a process of its own:
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

from mlxfun.kernels.attention import compact
from mlxfun.kernels.qmv import MMA_HEADER

_BODY = r"""
    // y (M, OUT) = x (M, IN) W^T. A block: BN features (blockIdx.x) x BM rows (blockIdx.y) x the
    // inputs of split blockIdx.z; warp w takes features 16 FW w ... of the block, for all BM rows
    // (NT tiles of 8). Per step of 64 inputs the block stores x's tile and W's (dequantized: q *
    // scale + bias, rounded once to T) in shared memory, then each warp runs 4 x FW x NT mma
    // m16n8k16 (A: 16 features x 16 inputs, B: 16 inputs x 8 rows), fragments read in PTX's
    // layouts. The next step's tiles are loaded into registers while the mma run, so that the
    // global loads of one step overlap the arithmetic of the one before. A step's inputs sit in
    // shared memory in the order the dequantization gives them (`perm`: 4-bit, nibbles p and p + 4
    // of a word side by side), x's in the same order, so each product is unchanged. Rows past M
    // and features past OUT are zeros, never stored; tile rows are padded by 8 values so that a
    // fragment's 32 lanes read 32 different banks.
    constexpr int BK = 64, PAD = 8, NT = BM / 8, THREADS = 32 * (BN / (16 * FW));
    constexpr int XV = (BM * 8 + THREADS - 1) / THREADS;  // x's 16-byte loads a thread makes per step
    const int M = x_shape[0], IN = x_shape[1], OUT = w_shape[0], S = gridDim.z;
    const int K0 = blockIdx.z * (IN / S), K1 = K0 + IN / S;  // split blockIdx.z of S: these inputs
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int fb = blockIdx.x * BN, rb = blockIdx.y * BM;
    __shared__ T xs[BM][BK + PAD];
    __shared__ T ws[BN][BK + PAD];
    float c[FW][NT][4];
    #pragma unroll
    for (int i = 0; i < FW; ++i) {
        #pragma unroll
        for (int n = 0; n < NT; ++n) c[i][n][0] = c[i][n][1] = c[i][n][2] = c[i][n][3] = 0.f;
    }
    auto perm = [](int e) { return PERMUTATION; };  // the input at place e of 8 in shared memory
    // Values 8 v ... 8 v + 7 of a row from `src` (zeros where !inside): one 16-byte load.
    auto load8 = [](const T* src, bool inside, int v) {
        AlignedVector<T, 8> vals;
        if (inside) {
            vals = unsafe_load_vector<8>(src, v);
        } else {
            #pragma unroll
            for (int e = 0; e < 8; ++e) vals[e] = static_cast<T>(0.f);
        }
        return vals;
    };
    AlignedVector<T, 8> xr[XV];
    W_REGS
    auto fetch = [&](int k0) {  // the step at k0, global memory -> registers
        #pragma unroll
        for (int j = 0; j < XV; ++j) {
            const int i = tid + j * THREADS, row = rb + (i >> 3);
            if (i < BM * 8) xr[j] = load8(x + (int64_t)min(row, M - 1) * IN + k0, row < M, i & 7);
        }
        W_FETCH
    };
    auto put = [&]() {  // registers -> shared memory, x in W's order of inputs
        #pragma unroll
        for (int j = 0; j < XV; ++j) {
            const int i = tid + j * THREADS;
            if (i < BM * 8) {
                Pair* dst = reinterpret_cast<Pair*>(&xs[i >> 3][8 * (i & 7)]);
                #pragma unroll
                for (int e = 0; e < 4; ++e) dst[e] = qmv_pack<T>(xr[j][perm(2 * e)], xr[j][perm(2 * e + 1)]);
            }
        }
        W_PUT
    };
    fetch(K0);
    for (int k0 = K0; k0 < K1; k0 += BK) {
        put();
        __syncthreads();
        if (k0 + BK < K1) fetch(k0 + BK);  // in flight during this step's mma
        #pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            Pair a[FW][4];
            #pragma unroll
            for (int i = 0; i < FW; ++i) {  // A register r: feature g + 8 (r & 1), inputs 2 t + 8 (r >> 1) + {0, 1}
                const int f = 16 * (FW * warp + i) + g;
                a[i][0] = *reinterpret_cast<const Pair*>(&ws[f][kk + 2 * t]);  // two values a 32-bit load
                a[i][1] = *reinterpret_cast<const Pair*>(&ws[f + 8][kk + 2 * t]);
                a[i][2] = *reinterpret_cast<const Pair*>(&ws[f][kk + 2 * t + 8]);
                a[i][3] = *reinterpret_cast<const Pair*>(&ws[f + 8][kk + 2 * t + 8]);
            }
            #pragma unroll
            for (int n = 0; n < NT; ++n) {  // B register r: inputs 2 t + 8 r + {0, 1}, row g of tile n
                const int r = 8 * n + g;
                Pair b[2] = {*reinterpret_cast<const Pair*>(&xs[r][kk + 2 * t]),
                             *reinterpret_cast<const Pair*>(&xs[r][kk + 2 * t + 8])};
                #pragma unroll
                for (int i = 0; i < FW; ++i) qmv_mma<T>(c[i][n], a[i], b);
            }
        }
        __syncthreads();  // every warp has read the tiles before the next put
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

# W's step: dense, 8 values a 16-byte load, in input order; quantized, 16-byte loads of 4 words
# (4-bit: 32 inputs, 8-bit: 16, within one group of 32 or more) and their group's scale and bias,
# dequantized by `qmv_dequant` two values at a time: 4-bit nibbles (p, p + 4) of a word, 8-bit
# bytes (p, p + 2), stored side by side (`perm` gives the input at each place of 8).
_DENSE = dict(REGS=r"""
    constexpr int WV = (BN * 8 + THREADS - 1) / THREADS;
    AlignedVector<T, 8> wr[WV];
""", FETCH=r"""
        #pragma unroll
        for (int j = 0; j < WV; ++j) {
            const int i = tid + j * THREADS, feature = fb + (i >> 3);
            if (i < BN * 8) wr[j] = load8(w + (int64_t)min(feature, OUT - 1) * IN + k0, feature < OUT, i & 7);
        }
""", PUT=r"""
        #pragma unroll
        for (int j = 0; j < WV; ++j) {
            const int i = tid + j * THREADS;
            if (i < BN * 8) *reinterpret_cast<AlignedVector<T, 8>*>(&ws[i >> 3][8 * (i & 7)]) = wr[j];
        }
""", PERM="e")
_QUANTIZED = dict(REGS=r"""
    constexpr int PER_WORD = 32 / BITS, VPF = BK / PER_WORD / 4;  // inputs a word; 16-byte loads a feature
    constexpr int WV = (BN * VPF + THREADS - 1) / THREADS;
    uint4 wr[WV];
    Pair sr[WV], br[WV];
""", FETCH=r"""
        #pragma unroll
        for (int j = 0; j < WV; ++j) {
            const int i = tid + j * THREADS, v = i % VPF, feature = fb + i / VPF;
            if (i < BN * VPF) {
                if (feature < OUT) {
                    const uint32_t* row = w + (int64_t)feature * (IN / PER_WORD) + k0 / PER_WORD;
                    wr[j] = *reinterpret_cast<const uint4*>(row + 4 * v);
                    const int64_t group = (int64_t)feature * (IN / GS) + (k0 + 4 * PER_WORD * v) / GS;
                    sr[j] = qmv_pack<T>(scales[group], scales[group]);
                    br[j] = qmv_pack<T>(biases[group], biases[group]);
                } else {  // 0 * 0 + 0
                    wr[j] = uint4{0u, 0u, 0u, 0u};
                    sr[j] = br[j] = qmv_pack<T>(static_cast<T>(0.f), static_cast<T>(0.f));
                }
            }
        }
""", PUT=r"""
        #pragma unroll
        for (int j = 0; j < WV; ++j) {
            const int i = tid + j * THREADS;
            if (i < BN * VPF) {
                const uint32_t words[4] = {wr[j].x, wr[j].y, wr[j].z, wr[j].w};
                Pair* dst = reinterpret_cast<Pair*>(&ws[i / VPF][4 * PER_WORD * (i % VPF)]);
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    #pragma unroll
                    for (int p = 0; p < PER_WORD / 2; ++p)
                        dst[PER_WORD / 2 * u + p] = qmv_dequant<T, BITS>(words[u], p, sr[j], br[j]);
                }
            }
        }
""", PERM="BITS == 4 ? (e >> 1) + 4 * (e & 1) : (e & 4) + ((e >> 1) & 1) + 2 * (e & 1)")


def source(bits: int, split: bool) -> str:
    """The kernel for dense (16) or quantized W, in one split or several."""
    parts = _DENSE if bits == 16 else _QUANTIZED
    body = _BODY.replace("W_REGS", parts["REGS"]).replace("W_FETCH", parts["FETCH"]).replace("W_PUT", parts["PUT"])
    body = body.replace("PERMUTATION", parts["PERM"])
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


def invariant_tiled(setting: str) -> bool:
    """$MLXFUN_INVARIANT_TILED -> whether the batch-invariant products run here."""
    if setting.strip() not in ("", "0", "1"):
        raise ValueError(f"{INVARIANT_ENV}={setting!r}: expected 1 (on), 0 or unset (off)")
    return setting.strip() == "1"


FROM_ROWS = tiled_from(os.environ.get(FROM_ENV, ""))
INVARIANT = invariant_tiled(os.environ.get(INVARIANT_ENV, ""))


class Tile(NamedTuple):
    rows: int  # BM: rows of x per block (a multiple of 8)
    features: int  # BN: output features per block
    per_warp: int  # FW: groups of 16 features a warp takes (warps = BN / 16 FW)

    @property
    def threads(self) -> int:
        return 32 * self.features // (16 * self.per_warp)


def tile(rows: int) -> Tile:
    """The tile for `rows` rows: rows rounded up to 16-64 per block, 128 features in 4 warps;
    from 65 rows, 128 rows in 8 warps (accumulators: FW x BM / 8 x 4 floats a thread, at most 64)."""
    if rows > 64:
        return Tile(128, 128, 1)
    return Tile(max(16, 1 << (rows - 1).bit_length()), 128, 2)


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
    return [("T", dtype), *quantized, ("BM", shape.rows), ("BN", shape.features), ("FW", shape.per_warp)]


def _launch(x: mx.array, inputs: list[mx.array], names: list[str], out: int, group_size: int, bits: int,
            shape: Tile | None, invariant: bool, target: int) -> mx.array:
    M, IN = x.shape
    shape = tile(M) if shape is None else shape
    row_blocks = -(-M // shape.rows)
    S = splits(out, IN, 1 if invariant else row_blocks, target)
    kernel = mx.fast.cuda_kernel(name=f"mlxfun_qmm{'_dense' if bits == 16 else ''}{'_split' if S > 1 else ''}",
                                 input_names=names, output_names=["y", "part", "count"] if S > 1 else ["y"],
                                 source=SOURCES[bits == 16, S > 1], header=MMA_HEADER)
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
