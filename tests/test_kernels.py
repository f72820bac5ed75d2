"""The CUDA decode-attention kernel: its dispatch rules, and its source run on the CPU
(`cuda_emulator`: one thread per CUDA thread) against a float64 NumPy reference. Speed and bf16
rounding are checked on a GPU by benchmarks/kernels_check.py."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from cuda_emulator import QMV_HEADER, run

from mlxfun.kernels import attention as kernels
from mlxfun.kernels import dmv, qmv


def test_layout_limits():
    # 8B / 1B shapes in bfloat16: a key's 16 or 8 lanes divide a warp.
    assert kernels.attention_fits(128, 4, mx.bfloat16)
    assert kernels.attention_fits(64, 4, mx.bfloat16)
    # 96 / 8 = 12 lanes per key do not divide a warp; 16 query heads x 8 elements exceed the registers.
    assert not kernels.attention_fits(96, 4, mx.bfloat16)
    assert not kernels.attention_fits(128, 16, mx.bfloat16)


def test_kernel_launch_for_many_blocks():
    # No batch falls back to MLX ops (they copy every row's blocks out of the pool first; the
    # dispatch is checked in test_kernels_run_in_steps_only). Many blocks: fewer warps each, and at
    # most 2048 blocks with the parts.
    assert kernels.launch(128, 8, 256, 64, 4, mx.bfloat16) == (8, 4, 2)
    assert kernels.launch(512, 8, 256, 64, 4, mx.bfloat16) == (8, 4, 1)


def test_keys_split_into_parts_of_at_most_four_rounds():
    assert kernels.parts_for(8, 256, 64) == 1  # 8B at batch 1, a 256-slot cache: one block per key head
    assert kernels.parts_for(8, 257, 64) == 2
    assert kernels.parts_for(8, 4096, 64) == 16
    assert kernels.parts_for(256, 1024, 32) == 8  # capped at 2048 blocks
    assert kernels.parts_for(256, 100_000, 32) == 8
    assert kernels.parts_for(4096, 1024, 32) == 1


def paged(keys, values, mask, block_size, seed=0):
    """keys/values (B, K, S, D) and mask (B, 1, S) as a shuffled pool of blocks (N * bs, K, 1, D),
    a table (B, W) and a mask padded to W * bs slots."""
    B, K, S, D = keys.shape
    W = -(-S // block_size)
    pad = W * block_size - S
    keys, values = (np.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]) for a in (keys, values))
    table = (1 + np.random.default_rng(seed).permutation(B * W)).reshape(B, W).astype(np.int32)
    # Block 0, the scratch block no row holds, is NaN: a hidden slot's read there (the kernel reads
    # slot 0 for hidden slots, so as not to wait for the mask) must never reach the output.
    pools = [np.full((1 + B * W, block_size, K, D), np.nan, np.float32) for _ in range(2)]
    for b in range(B):
        for w in range(W):
            for pool, a in zip(pools, (keys, values)):
                pool[table[b, w]] = a[b, :, w * block_size:(w + 1) * block_size].transpose(1, 0, 2)
    flat = [p.reshape(-1, K, 1, D) for p in pools]  # the cache's layout: slot by slot
    return flat[0], flat[1], table, np.pad(mask, [(0, 0), (0, 0), (0, pad)])


def emulated_attention(qk, keys, values, mask, num_heads, source=None, block_size=16):
    """`kernels.decode_attention`'s launches (one kernel, or parts then merge), emulated, over
    the keys and values laid out as a shuffled pool of blocks."""
    B, _, _, D = qk.shape
    keys, values, table, mask = paged(keys, values, mask, block_size, seed=B)
    K, S = keys.shape[1], table.shape[1] * block_size
    G = num_heads // K
    per, warps, P = kernels.launch(B, K, S, D, G, mx.float32)
    body = source or kernels._ATTENTION
    template = [("T", 0), ("D", D), ("G", G), ("PER", per), ("NW", warps), ("BS", block_size)]
    grid, inputs = (32 * warps, K * P, B), dict(qk=qk, keys=keys, values=values, table=table, mask=mask)
    if P == 1:
        return run(body + kernels._WHOLE, inputs, {"out": (B, 1, num_heads * D)}, template, grid, 32 * warps)[0], P
    po, pm, pl = run(body + kernels._PART, inputs, {"po": (B, K, P, G, D), "pm": (B, K, P, G), "pl": (B, K, P, G)},
                     template, grid, 32 * warps)
    out = run(kernels._MERGE, dict(po=po, pm=pm, pl=pl), {"out": (B, 1, num_heads * D)},
              [("T", 0), ("D", D), ("G", G)], (D, num_heads, B), D)[0]
    return out, P


def attention_case(B, H, K, D, S, seed, softcap=None):
    rng = np.random.default_rng(seed)
    qk = rng.standard_normal((B, H + K, 1, D)).astype(np.float32)
    keys, values = (rng.standard_normal((B, K, S, D)).astype(np.float32) for _ in range(2))
    mask = (rng.random((B, 1, S)) < 0.6) & (np.arange(S) >= 5 * np.arange(B)[:, None, None])  # holes, padding
    mask[:, :, S - 1] = True  # the step's own key
    mask[0, :, :S - 1] = False  # row 0 sees that key only
    G = H // K
    q = qk[:, :H, 0].astype(np.float64).reshape(B, K, G, D)
    scores = np.einsum("bkgd,bksd->bkgs", q, keys.astype(np.float64)) / np.sqrt(D)
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(mask[:, :, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bkgs,bksd->bkgd", probs, values.astype(np.float64)).reshape(B, 1, H * D)
    return (qk, keys, values, mask), want


@pytest.mark.parametrize("B,H,K,D,S,parts", [
    (1, 8, 2, 128, 40, 1),  # 32 lanes per key (float32), 16 warps
    (3, 6, 3, 32, 77, 1),  # 8 lanes per key: 4 keys per warp at once
    (2, 8, 2, 64, 300, 2),  # a row's keys in two blocks, merged
    (64, 4, 4, 64, 96, 2),  # 256 blocks: 4 warps each, and two parts
])
def test_emulated_kernel_matches_reference(B, H, K, D, S, parts):
    inputs, want = attention_case(B, H, K, D, S, seed=B * S)
    got, P = emulated_attention(*inputs, H)
    assert P == parts
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("B,H,K,D,S,parts", [(3, 6, 3, 32, 77, 1), (2, 8, 2, 64, 300, 2)])
def test_emulated_kernel_soft_caps_its_scores(B, H, K, D, S, parts):
    """Gemma 2's cap * tanh(score / cap), in one block and across parts; a cap of 0.5 bites hard
    (scores of these random heads reach several units), so the uncapped kernel is far off."""
    inputs, want = attention_case(B, H, K, D, S, seed=B * S + 1, softcap=0.5)
    got, P = emulated_attention(*inputs, H, source=kernels.attention_source(0.5))
    assert P == parts
    np.testing.assert_allclose(got, want, atol=1e-5)
    plain, _ = emulated_attention(*inputs, H)
    assert not np.allclose(plain, want, atol=1e-2)


def emulated_invariant_attention(qk, keys, values, mask, num_heads, block_size=16, seed=0):
    """`kernels.decode_attention(..., invariant=True)`'s launches, emulated: parts of
    INVARIANT_CHUNK keys, INVARIANT_WARPS warps, then the merge."""
    B, _, _, D = qk.shape
    keys, values, table, mask = paged(keys, values, mask, block_size, seed=seed)
    K, S = keys.shape[1], table.shape[1] * block_size
    G, chunk, warps = num_heads // K, kernels.INVARIANT_CHUNK, kernels.INVARIANT_WARPS
    P = -(-S // chunk)
    template = [("T", 0), ("D", D), ("G", G), ("PER", kernels._lane_split(D, mx.float32)), ("NW", warps),
                ("BS", block_size)]
    inputs = dict(qk=qk, keys=keys, values=values, table=table, mask=mask)
    po, pm, pl = run(kernels.attention_source(None, chunk) + kernels._PART, inputs,
                     {"po": (B, K, P, G, D), "pm": (B, K, P, G), "pl": (B, K, P, G)}, template,
                     (32 * warps, K * P, B), 32 * warps)
    return run(kernels._MERGE, dict(po=po, pm=pm, pl=pl), {"out": (B, 1, num_heads * D)},
               [("T", 0), ("D", D), ("G", G)], (D, num_heads, B), D)[0]


def test_emulated_invariant_attention_is_the_same_bits_in_any_batch():
    """Batch-invariant launches: a row's output alone (300 keys: two parts) and as the middle row of
    a batch whose table is 1000 slots wide (four parts, two of them empty for it; a launch that
    follows the cache's width splits its keys elsewhere and fails this) are the same bits, and
    match the usual launch to rounding."""
    (qk, keys, values, mask), _ = attention_case(1, 8, 2, 64, 300, seed=11)
    mask[0, 0, :250] = np.random.default_rng(1).random(250) < 0.5  # holes among the row's own keys
    alone = emulated_invariant_attention(qk, keys, values, mask, 8)
    rng = np.random.default_rng(2)
    big_qk = rng.standard_normal((3, 10, 1, 64)).astype(np.float32)
    big_keys, big_values = (rng.standard_normal((3, 2, 1000, 64)).astype(np.float32) for _ in range(2))
    big_mask = np.ones((3, 1, 1000), bool)
    big_qk[1], big_keys[1, :, :300], big_values[1, :, :300] = qk[0], keys[0], values[0]
    big_mask[1] = False
    big_mask[1, :, :300] = mask[0]
    batched = emulated_invariant_attention(big_qk, big_keys, big_values, big_mask, 8, seed=5)
    assert np.array_equal(batched[1], alone[0])
    got, _ = emulated_attention(qk, keys, values, mask, 8)  # the usual launch: the same to rounding
    np.testing.assert_allclose(alone, got, atol=1e-5)


def test_emulator_catches_a_wrong_part_index():
    inputs, want = attention_case(2, 8, 2, 64, 300, seed=600)
    broken = kernels._ATTENTION.replace("p = blockIdx.y % P", "p = 0")
    got, _ = emulated_attention(*inputs, 8, source=broken)
    assert not np.allclose(got, want, atol=1e-3)  # (here NaN: row 0's only key is never read)


def quantized_case(M: int, OUT: int, IN: int, group_size: int, seed: int, bits: int = 4):
    """x (M, IN), the quantized (w, scales, biases) of a random (OUT, IN) weight as NumPy inputs,
    and x @ dequantize(w)^T in float64."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((OUT, IN)).astype(np.float32) * IN**-0.5)
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = rng.standard_normal((M, IN)).astype(np.float32)
    deq = np.array(mx.dequantize(q, scales, biases, group_size=group_size, bits=bits)).astype(np.float64)
    return dict(x=x, w=np.array(q), scales=np.array(scales), biases=np.array(biases)), x.astype(np.float64) @ deq.T


def test_qmv_layout_limits():
    assert qmv.fits(1, 4096, 64, 4)
    assert qmv.fits(qmv.MAX_ROWS, 576, 32, 4)
    assert not qmv.fits(qmv.MAX_ROWS + 1, 4096, 64, 4)  # more rows: a dense product of the one map
    assert qmv.fits(qmv.SIMT_ROWS, 4096, 64, 4, mx.float32)
    assert not qmv.fits(qmv.SIMT_ROWS + 1, 4096, 64, 4, mx.float32)  # float32: CUDA cores, few rows
    assert qmv.fits(qmv.MAX_ROWS, 4096, 64, 8)  # 8 bits on tensor cores
    assert not qmv.fits(1, 4096, 64, 8, mx.float32)  # 4 bits only on CUDA cores
    assert not qmv.fits(1, 4096, 64, 3)
    assert not qmv.fits(1, 4112, 16, 4)  # a 32-value chunk would span groups


# Registers a thread of the tensor-core product, from ptxas (sm_90, bf16, U = 1) by (bits, N, F).
QMV_REGISTERS = {(4, 1, 1): 59, (4, 1, 2): 76, (4, 1, 4): 126, (4, 2, 1): 68, (4, 2, 2): 104, (4, 2, 4): 166,
                 (4, 4, 1): 90, (4, 4, 2): 140, (4, 8, 1): 148, (8, 1, 1): 60, (8, 1, 2): 84, (8, 1, 4): 164,
                 (8, 2, 1): 72, (8, 2, 2): 131, (8, 4, 1): 84, (8, 4, 2): 132, (8, 8, 1): 140}


def test_qmv_warps_fit_a_block_registers():
    """Every block shape at its warps fits a block's 65,536 registers (16 warps of 148 registers
    need 75,776 and failed to launch on an H100); the picked shapes never spill (8-bit at 2 x 4 does)."""
    assert [qmv.warps_for(n) for n in (1, 2, 4, 8)] == [16, 16, 16, 8]
    for (bits, n, f), registers in QMV_REGISTERS.items():
        assert qmv.warps_for(n, f, bits) * 32 * registers <= 65536, (bits, n, f)
    for bits in (4, 8):
        for m in (1, 2, 3, 8, 9, 16, 17, 33, 64, 256, 4096):
            assert qmv.block_shape(m) in {k[1:] for k in QMV_REGISTERS if k[0] == bits}, (bits, m)


def test_qmv_tiles_and_grid():
    """Blocks take 8, 16, 32 or 64 rows (a power of two of tiles, few kernel variants); more
    rows take more blocks along y."""
    assert [qmv.tiles(m) for m in (1, 8, 9, 16, 17, 33, 64, 65, 129, 256)] == [1, 1, 2, 2, 4, 8, 8, 8, 8, 8]
    assert qmv.mma_grid(40, 1, 4) == ((3 * 128, 1, 1), 128)
    assert qmv.mma_grid(40, 129, 4) == ((3 * 128, 3, 1), 128)
    # F groups of 16 features per block: fewer block columns; N tiles: the block rows
    assert qmv.mma_grid(40, 129, 4, (2, 4)) == ((1 * 128, 9, 1), 128)
    assert qmv.mma_grid(80, 8, 16, (1, 2)) == ((3 * 512, 1, 1), 512)
    assert [qmv.block_shape(m) for m in (1, 8, 9, 16, 17, 256)] == [(1, 2)] * 2 + [(2, 2)] * 2 + [(4, 2)] * 2
    assert [qmv.block_shape(m) for m in (1, 9, 256)] == [(1, 2), (2, 2), (4, 2)]  # 8-bit takes the same


@pytest.mark.parametrize("M,OUT,IN,group_size,per_warp", [(1, 70, 256, 64, 4), (3, 33, 576, 32, 2),
                                                          (8, 40, 512, 128, 4), (2, 9, 2048, 64, 1)])
def test_emulated_qmv_matches_reference(M, OUT, IN, group_size, per_warp):
    """Every nibble position (the upper three are shifted before the mantissa trick), features
    past the end of a warp's share (OUT not a multiple), chunks past the end of a lane's loop."""
    inputs, want = quantized_case(M, OUT, IN, group_size, seed=M * OUT)
    grid, block = qmv.simt_grid(OUT, per_warp)  # as qmv.simt launches it
    (got,) = run(qmv._SIMT, inputs, {"y": (M, OUT)}, [("T", 0), ("GS", group_size), ("M", M), ("R", per_warp)],
                 (grid, 1, 1), block)
    np.testing.assert_allclose(got, want, atol=1e-5)


def emulated_qmv_mma(inputs: dict, group_size: int, warps: int, in_flight: int, bits: int = 4,
                     shape: tuple[int, int] | None = None) -> np.ndarray:
    M, OUT = inputs["x"].shape[0], inputs["w"].shape[0]
    n, f = (qmv.tiles(M), 1) if shape is None else shape
    grid, block = qmv.mma_grid(OUT, M, warps, (n, f))  # as qmv.mma launches it
    template = [("T", 0), ("GS", group_size), ("BITS", bits), ("N", n), ("F", f), ("KW", warps), ("U", in_flight)]
    return run(qmv._MMA, inputs, {"y": (M, OUT)}, template, grid, block, header=QMV_HEADER)[0]


@pytest.mark.parametrize("M,OUT,IN,group_size,warps,in_flight", [(1, 40, 256, 64, 8, 4), (3, 16, 1152, 32, 8, 2),
                                                                 (8, 37, 576, 64, 4, 4), (5, 24, 4096, 128, 8, 4),
                                                                 (2, 17, 2048, 64, 4, 1),
                                                                 (2, 17, 4096, 64, qmv.MMA_WARPS, qmv.MMA_IN_FLIGHT),
                                                                 (13, 20, 256, 32, 2, 2), (37, 17, 384, 64, 2, 1),
                                                                 (140, 9, 256, 128, 2, 1)])
def test_emulated_qmv_mma_matches_reference(M, OUT, IN, group_size, warps, in_flight):
    """The tensor-core product through PTX's fragment layouts: every nibble pair, features past
    OUT (not a multiple of 16), rows past M, inputs not a multiple of 128 (576, 1152) and a
    block's warps sharing the inputs (4096 = 32 blocks of 128: one round of 8 warps x 4), the
    launch `qmv.mma` uses by default, and several tiles of 8 rows per block (13: 2, 37: 8 with
    rows past M in the last tiles; 140: 16 tiles and a second block row)."""
    inputs, want = quantized_case(M, OUT, IN, group_size, seed=M * OUT + IN)
    np.testing.assert_allclose(emulated_qmv_mma(inputs, group_size, warps, in_flight), want, atol=1e-5)


@pytest.mark.parametrize("M,OUT,IN,group_size,warps,in_flight", [(1, 40, 256, 64, 8, 4), (3, 16, 1152, 32, 8, 2),
                                                                 (13, 20, 576, 64, 2, 2), (37, 17, 384, 128, 2, 1)])
def test_emulated_qmv_mma_8bit_matches_reference(M, OUT, IN, group_size, warps, in_flight):
    """8-bit weights: every byte pair of a word, two uint4 per feature and 128 inputs, tiles of rows."""
    inputs, want = quantized_case(M, OUT, IN, group_size, seed=M * OUT + IN + 8, bits=8)
    np.testing.assert_allclose(emulated_qmv_mma(inputs, group_size, warps, in_flight, bits=8), want, atol=1e-5)


@pytest.mark.parametrize("M,OUT,IN,group_size,bits,shape", [(3, 40, 256, 64, 4, (1, 2)), (13, 70, 576, 32, 4, (2, 4)),
                                                          (9, 33, 384, 64, 8, (2, 2)), (40, 20, 256, 128, 4, (4, 2)),
                                                          (5, 17, 512, 64, 8, (1, 4))])
def test_emulated_qmv_mma_feature_groups_match_reference(M, OUT, IN, group_size, bits, shape):
    """F groups of 16 features per block sharing each x fragment: groups past OUT (40 of 2 x 16;
    70 of 64-feature blocks: the second block's last three groups; 17 of 64), with row tiles
    past M and the block shapes `block_shape` picks, 4- and 8-bit."""
    inputs, want = quantized_case(M, OUT, IN, group_size, seed=M * OUT + IN + bits, bits=bits)
    np.testing.assert_allclose(emulated_qmv_mma(inputs, group_size, 4, 1, bits=bits, shape=shape), want, atol=1e-5)


def test_emulated_qmv_mma_row_is_the_same_bits_in_any_batch():
    """At one launch (warps, in flight) a row's outputs alone and inside batches of 2-140 rows, at
    any place in them, are the same bits: the order of every sum is fixed by IN and the launch,
    not by the rows, nor by the block shape `block_shape` picks for them (a test of the kernel's
    structure: warps per block following the tiles, as `qmv.warps_for` picks them for registers,
    fail it)."""
    inputs, _ = quantized_case(140, 17, 512, 64, seed=7)
    x = inputs["x"]
    alone = np.concatenate([emulated_qmv_mma({**inputs, "x": x[i:i + 1]}, 64, 4, 2) for i in (0, 9, 77, 139)])
    for M in (2, 9, 40, 140):
        places = {0: 0, M - 1: 3, **({M // 2: 2} if M > 2 else {})}  # place in the batch -> row of `alone`
        batch = x[:M].copy()
        batch[list(places)] = x[[(0, 9, 77, 139)[i] for i in places.values()]]
        got = emulated_qmv_mma({**inputs, "x": batch}, 64, 4, 2, shape=qmv.block_shape(M))
        for place, i in places.items():
            assert np.array_equal(got[place], alone[i]), (M, place)


@pytest.mark.parametrize("M,OUT,IN,launch", [(2, 70, 256, dmv.Launch(4, 2)), (5, 33, 576, dmv.Launch(2, 1)),
                                             (8, 40, 512, dmv.Launch(4, 4)), (3, 17, 96, dmv.Launch(8, 1)),
                                             (7, 16, 2048, dmv.Launch(16, 2)), (4, 9, 64, dmv.Launch(1, 4)),
                                             (13, 20, 128, dmv.Launch(2, 2)), (32, 17, 64, dmv.Launch(1, 1)),
                                             (75, 18, 96, dmv.Launch(2, 1))])
def test_emulated_dense_product_matches_reference(M, OUT, IN, launch):
    """The few-row dense product on tensor cores, through PTX's fragment layouts: features past
    OUT (not a multiple of 16), rows past M (M < 8), blocks of inputs past a warp's share (warps
    with none: 3 blocks of 32 for 8 warps; 2 blocks with 4 in flight), the warps' partial sums,
    tiles of 8 rows sharing each A fragment (13 rows: a part-filled second tile; 32: four), and
    blocks along y for more rows (75: three rows of blocks, the last part-filled)."""
    rng = np.random.default_rng(M * OUT + IN)
    x = rng.standard_normal((M, IN)).astype(np.float32)
    w = (rng.standard_normal((OUT, IN)) * IN**-0.5).astype(np.float32)
    np.testing.assert_allclose(emulated_dmv(x, w, launch), x.astype(np.float64) @ w.T.astype(np.float64), atol=1e-4)


def emulated_dmv(x: np.ndarray, w: np.ndarray, launch) -> np.ndarray:
    M, OUT = x.shape[0], w.shape[0]
    grid, block = dmv.grid(OUT, launch, M)  # as dmv.product launches it
    template = [("T", 0), ("N", dmv.tiles(M)), ("KW", launch.warps), ("U", launch.in_flight)]
    return run(dmv._MMA, dict(x=x, w=w), {"y": (M, OUT)}, template, grid, block, header=QMV_HEADER)[0]


def test_emulated_dense_product_row_is_the_same_bits_in_any_batch():
    """As the 4-bit product: a row alone and inside batches of 2-75 rows, at any place, gives the
    same bits (the batch-invariant mode runs every dense product through it)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((75, 256)).astype(np.float32)
    w = (rng.standard_normal((20, 256)) * 256**-0.5).astype(np.float32)
    launch = dmv.Launch(4, 2)
    alone = {i: emulated_dmv(x[i:i + 1], w, launch)[0] for i in (0, 30, 74)}
    for M in (2, 9, 33, 75):
        places = {0: 0, M - 1: 74, **({M // 2: 30} if M > 2 else {})}  # place in the batch -> row of x
        batch = x[:M].copy()
        batch[list(places)] = x[list(places.values())]
        got = emulated_dmv(batch, w, launch)
        for place, i in places.items():
            assert np.array_equal(got[place], alone[i]), (M, place)


@pytest.mark.parametrize("counts,OUT,IN,launch", [
    ([3, 0, 1, 0, 4], 40, 256, dmv.Launch(2, 2)),  # empty experts among used ones; features past 16
    ([0, 21, 2], 17, 96, dmv.Launch(1, 1)),  # N = 2, 16 rows a pass: 21 rows in two; the first expert empty
    ([9, 30, 1, 0], 33, 512, dmv.Launch(4, 2)),  # N = 4, 32 rows a pass: 30 rows in one, part-filled
    ([1, 1, 1, 1, 1, 1, 1, 1], 20, 64, dmv.Launch(2, 4)),  # a row each; blocks of inputs past a warp's share
])
def test_emulated_experts_product_matches_reference(counts, OUT, IN, launch):
    """The experts' product: rows sorted by expert, a block per expert (its rows found by binary
    search, 8 N at a time) and 16 features, each row times its own expert's map."""
    rng = np.random.default_rng(sum(counts) * OUT + IN)
    E, R = len(counts), sum(counts)
    index = np.repeat(np.arange(E), counts).astype(np.uint32)
    x = rng.standard_normal((R, IN)).astype(np.float32)
    w = (rng.standard_normal((E, OUT, IN)) * IN**-0.5).astype(np.float32)
    threads, block = dmv.grid(OUT, launch)  # as dmv.experts_product launches it
    N = dmv.tiles(max(1, 2 * R // E))
    template = [("T", 0), ("N", N), ("KW", launch.warps), ("U", launch.in_flight)]
    got = run(dmv._MMA_EXPERTS, dict(x=x, w=w, index=index), {"y": (R, OUT)}, template, (threads[0], 1, E), block,
              header=QMV_HEADER)[0]
    want = np.einsum("ri,roi->ro", x.astype(np.float64), w.astype(np.float64)[index])
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_dense_product_limits(monkeypatch):
    monkeypatch.setattr(dmv, "ENABLED", True)
    x, w = mx.zeros((5, 4096), mx.bfloat16), mx.zeros((128, 4096), mx.bfloat16)
    assert dmv.fits(x, w)
    assert not dmv.fits(x[:1], w)  # one row: MLX's matrix-vector kernel
    assert not dmv.fits(mx.zeros((9, 4096), mx.bfloat16), w)  # more: MLX's matrix product
    assert not dmv.fits(x.astype(mx.float32), w.astype(mx.float32))  # bf16 and fp16 only
    assert not dmv.fits(mx.zeros((5, 4104), mx.bfloat16), mx.zeros((128, 4104), mx.bfloat16))  # blocks of 32 inputs
    monkeypatch.setattr(dmv, "ENABLED", False)
    assert not dmv.fits(x, w)  # turned off ($MLXFUN_DENSE_KERNEL=0 at import)


@pytest.mark.parametrize("setting,enabled,rows", [(None, True, 8), ("1", True, 8), ("0", False, 0), ("16", True, 16)])
def test_dense_product_is_on_unless_turned_off(setting, enabled, rows):
    env = {k: v for k, v in os.environ.items() if k != dmv.ENV}
    if setting is not None:
        env[dmv.ENV] = setting
    code = "from mlxfun.kernels import dmv; print(dmv.ENABLED, dmv.MAX_ROWS)"
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"{enabled} {rows}"


@pytest.mark.parametrize("setting", ["33", "yes", "-1"])
def test_dense_product_setting_is_checked(setting):
    with pytest.raises(ValueError, match="MLXFUN_DENSE_KERNEL"):
        dmv.max_rows(setting)


def test_dense_product_takes_more_rows_where_set(monkeypatch):
    monkeypatch.setattr(dmv, "ENABLED", True)
    w = mx.zeros((128, 4096), mx.bfloat16)
    assert not dmv.fits(mx.zeros((16, 4096), mx.bfloat16), w)
    monkeypatch.setattr(dmv, "MAX_ROWS", 32)
    assert dmv.fits(mx.zeros((16, 4096), mx.bfloat16), w) and not dmv.fits(mx.zeros((33, 4096), mx.bfloat16), w)


def test_dense_product_launch_for_shapes():
    assert dmv.launch_for(28672, 4096) == dmv.Launch(8, 2)  # timed: the 8B gate/up map
    assert dmv.launch_for(4096, 14336) == dmv.Launch(16, 1)  # the 8B down map
    # Other shapes: warps enough for about 4096 in the grid, each with at least 8 blocks of inputs.
    assert dmv.launch_for(32000, 5120) == dmv.Launch(2, 2)  # 2000 blocks of 16 features
    assert dmv.launch_for(5120, 5120) == dmv.Launch(8, 2)  # 320 blocks
    assert dmv.launch_for(1536, 576) == dmv.Launch(2, 2)  # 18 blocks of inputs: 2 warps of 8 or more
    assert dmv.launch_for(100_000, 4096) == dmv.Launch(1, 2)


def tiny_dense_config():
    """Untied, so the output head is a map of its own."""
    from mlxfun.model.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, tie_word_embeddings=False)


def test_dense_product_runs_in_few_row_steps_only(monkeypatch):
    """Enabled and with kernels available (a stand-in here), dense maps of 2-8 rows in a `fast`
    pass (a verify pass, a small decode step) run the few-row product; one row, more rows, and
    passes that are not `fast` run MLX's."""
    from mlxfun.bench import main as bench
    from mlxfun.model import llama

    config = tiny_dense_config()
    params = bench.random_params(config, mx.bfloat16)
    calls = []
    monkeypatch.setattr(dmv, "ENABLED", True)
    monkeypatch.setattr(kernels, "available", lambda x: True)
    monkeypatch.setattr(dmv, "product", lambda x, w: calls.append(x.shape[0]) or x @ w.T)
    monkeypatch.setattr(kernels, "attention_fits", lambda *a: False)  # attention: MLX ops here
    maps = 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    for B, T, fast, want in ((1, 5, True, [5] * maps), (4, 1, True, [4] * maps), (1, 1, True, []),
                             (3, 3, True, []), (1, 5, False, [])):
        calls.clear()
        tokens = mx.arange(B * T).reshape(B, T) % config.vocab_size
        h, _ = llama.hidden(config, params, tokens, mx.broadcast_to(mx.arange(T), (B, T)), fast=fast)
        llama.logits(config, params, h, fast=fast)
        assert calls == want, (B, T, fast)


def test_kernels_run_in_steps_only(monkeypatch):
    """With kernels available (stand-ins here), the decoder uses them only when asked (`fast`, as
    mlxfun.engine.step asks): by default a one-token cached pass is MLX ops and differentiable."""
    from mlxfun.bench import main as bench
    from mlxfun.model import cache as kv
    from mlxfun.model import llama, weights

    config = tiny_dense_config()
    params = weights.quantize(config, bench.random_params(config, mx.float32), bits=4, group_size=32)
    calls = []

    def stand_in(name, real):
        return lambda *a: calls.append(name) or real(*a)

    monkeypatch.setattr(kernels, "available", lambda x: True)
    monkeypatch.setattr(qmv, "product", stand_in("qmv", lambda x, w, s, b, gs, bits: mx.quantized_matmul(
        x, w, s, b, group_size=gs, bits=bits)))
    monkeypatch.setattr(kernels, "decode_attention", stand_in("attention", lambda qk, k, v, t, m, h, cap, inv: (
        llama.grouped_attention(qk[:, :h], kv.gather(k, t, m.shape[-1] // t.shape[1]),
                                kv.gather(v, t, m.shape[-1] // t.shape[1]), m, k.shape[-1]**-0.5, cap)
        .reshape(qk.shape[0], -1))))
    tokens, positions = mx.array([[5], [9]]), mx.array([[0], [0]])
    cache = kv.empty(config, 2, 8, mx.float32)
    plain = llama.logits(config, params, llama.hidden(config, params, tokens, positions, None, cache)[0])
    assert calls == []
    h = llama.hidden(config, params, tokens, positions, None, cache, fast=True)[0]
    fast = llama.logits(config, params, h, fast=True)
    assert calls.count("attention") == config.num_layers and calls.count("qmv") == 4 * config.num_layers + 1
    np.testing.assert_allclose(np.array(fast), np.array(plain), rtol=1e-5, atol=1e-5)

    # Every batch size: 129 rows x 2 key heads are 258 blocks, past the limit the kernel once had.
    for batch in (33, 129):
        calls.clear()
        wide = kv.empty(config, batch, 8, mx.float32)
        ids, at = mx.arange(batch)[:, None] % config.vocab_size, mx.zeros((batch, 1), mx.int32)
        llama.hidden(config, params, ids, at, None, wide, fast=True)
        assert calls.count("attention") == config.num_layers

    calls.clear()

    def loss(norm):
        h, _ = llama.hidden(config, params._replace(norm=norm), tokens, positions, None, cache)
        return llama.logits(config, params, h).sum()

    grad = mx.grad(loss)(params.norm)
    assert calls == [] and np.all(np.isfinite(np.array(grad))) and np.any(np.array(grad))


def test_compact_drops_comments_and_indentation_only():
    src = "    const int a = 1;  // why\n\n    #pragma unroll\n    for (int i = 0; i < 4; ++i) a += i;\n    // gone\n"
    assert kernels.compact(src) == "const int a = 1;\n#pragma unroll\nfor (int i = 0; i < 4; ++i) a += i;"
    assert "//" not in qmv._MMA + qmv.MMA_HEADER + kernels._ATTENTION + dmv._MMA  # what MLX hashes per launch


def test_first_token_runs_mlx_products_at_any_group_size(monkeypatch):
    """A prefill group's first token goes through MLX's products, never the few-row kernels: group
    sizes vary between admissions, and each new row count would build a kernel anew (seconds on
    an H200). The decode steps, whose row count is the engine's, still ask for the kernels."""
    from helpers import tiny_config, tiny_model

    from mlxfun.engine import sampling, step
    from mlxfun.model import llama

    asked = []

    def refuse(*args):
        raise AssertionError("a few-row kernel ran")

    monkeypatch.setattr(kernels, "available", lambda dtype: asked.append(dtype) or True)
    monkeypatch.setattr(dmv, "fits", lambda rows, w: True)
    monkeypatch.setattr(dmv, "product", refuse)
    model = tiny_model(tiny_config())
    h = mx.random.normal((5, model.config.hidden_size))
    out = step.first_token(model.config, step.Mode(), model.params, h, sampling.make_settings(5),
                           mx.zeros((5,), mx.int32), None)
    assert out.tokens.tolist() == mx.argmax(llama.logits(model.config, model.params, h), axis=-1).tolist() and not asked
    with pytest.raises(AssertionError, match="few-row kernel"):
        llama.logits(model.config, model.params, h, fast=True)  # the decode steps' products do ask
