"""The CUDA decode-attention kernel: its dispatch rules, and its source run on the CPU
(`cuda_emulator`: one thread per CUDA thread) against a float64 NumPy reference. Speed and bf16
rounding are checked on a GPU by benchmarks/kernels_check.py."""

import mlx.core as mx
import numpy as np
import pytest
from cuda_emulator import QMV_HEADER, run

from mlxfun import kernels


def test_layout_limits():
    # 8B / 1B shapes in bfloat16: a key's 16 or 8 lanes divide a warp.
    assert kernels.attention_fits(1, 8, 128, 4, mx.bfloat16)
    assert kernels.attention_fits(1, 8, 64, 4, mx.bfloat16)
    # 96 / 8 = 12 lanes per key do not divide a warp; 16 query heads x 8 elements exceed the registers.
    assert not kernels.attention_fits(1, 8, 96, 4, mx.bfloat16)
    assert not kernels.attention_fits(1, 2, 128, 16, mx.bfloat16)


def test_batch_limit_follows_blocks():
    assert kernels.attention_fits(32, 8, 128, 4, mx.bfloat16)  # 256 blocks
    assert not kernels.attention_fits(33, 8, 128, 4, mx.bfloat16)
    assert kernels.attention_fits(128, 2, 128, 4, mx.bfloat16)


def test_keys_split_into_parts_of_at_most_four_rounds():
    assert kernels.parts_for(8, 256, 64) == 1  # 8B at batch 1, a 256-slot cache: one block per key head
    assert kernels.parts_for(8, 257, 64) == 2
    assert kernels.parts_for(8, 4096, 64) == 16
    assert kernels.parts_for(256, 1024, 32) == 8  # capped at 2048 blocks
    assert kernels.parts_for(256, 100_000, 32) == 8
    assert kernels.parts_for(4096, 1024, 32) == 1


def emulated_attention(qk, keys, values, mask, num_heads, source=None):
    """`kernels.decode_attention`'s launches (one kernel, or parts then merge), emulated."""
    B, _, _, D = qk.shape
    K, S = keys.shape[1], keys.shape[2]
    G = num_heads // K
    per, warps, P = kernels.launch(B, K, S, D, G, mx.float32)
    body = source or kernels._ATTENTION
    template = [("T", 0), ("D", D), ("G", G), ("PER", per), ("NW", warps)]
    grid, inputs = (32 * warps, K * P, B), dict(qk=qk, keys=keys, values=values, mask=mask)
    if P == 1:
        return run(body + kernels._WHOLE, inputs, {"out": (B, 1, num_heads * D)}, template, grid, 32 * warps)[0], P
    po, pm, pl = run(body + kernels._PART, inputs, {"po": (B, K, P, G, D), "pm": (B, K, P, G), "pl": (B, K, P, G)},
                     template, grid, 32 * warps)
    out = run(kernels._MERGE, dict(po=po, pm=pm, pl=pl), {"out": (B, 1, num_heads * D)},
              [("T", 0), ("D", D), ("G", G)], (D, num_heads, B), D)[0]
    return out, P


def attention_case(B, H, K, D, S, seed):
    rng = np.random.default_rng(seed)
    qk = rng.standard_normal((B, H + K, 1, D)).astype(np.float32)
    keys, values = (rng.standard_normal((B, K, S, D)).astype(np.float32) for _ in range(2))
    mask = (rng.random((B, 1, S)) < 0.6) & (np.arange(S) >= 5 * np.arange(B)[:, None, None])  # holes, padding
    mask[:, :, S - 1] = True  # the step's own key
    mask[0, :, :S - 1] = False  # row 0 sees that key only
    G = H // K
    q = qk[:, :H, 0].astype(np.float64).reshape(B, K, G, D)
    scores = np.einsum("bkgd,bksd->bkgs", q, keys.astype(np.float64)) / np.sqrt(D)
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


def test_emulator_catches_a_wrong_part_index():
    inputs, want = attention_case(2, 8, 2, 64, 300, seed=600)
    broken = kernels._ATTENTION.replace("p = blockIdx.y % P", "p = 0")
    got, _ = emulated_attention(*inputs, 8, source=broken)
    assert not np.allclose(got, want, atol=1e-3)  # (here NaN: row 0's only key is never read)


def test_qmv_layout_limits():
    assert kernels.qmv_fits(1, 4096, 64, 4)
    assert kernels.qmv_fits(kernels.QMV_MAX_ROWS, 576, 32, 4)
    assert not kernels.qmv_fits(kernels.QMV_MAX_ROWS + 1, 4096, 64, 4)  # more rows: a dense copy wins
    assert not kernels.qmv_fits(1, 4096, 64, 8)  # 4 bits only
    assert not kernels.qmv_fits(1, 4112, 16, 4)  # a 32-value chunk would span groups


@pytest.mark.parametrize("M,OUT,IN,group_size,per_warp", [(1, 70, 256, 64, 4), (3, 33, 576, 32, 2),
                                                          (8, 40, 512, 128, 4), (2, 9, 2048, 64, 1)])
def test_emulated_qmv_matches_reference(M, OUT, IN, group_size, per_warp):
    """Every nibble position (the upper three are shifted before the mantissa trick), features
    past the end of a warp's share (OUT not a multiple), chunks past the end of a lane's loop."""
    rng = np.random.default_rng(M * OUT)
    w = mx.array(rng.standard_normal((OUT, IN)).astype(np.float32) * IN**-0.5)
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=4)
    x = rng.standard_normal((M, IN)).astype(np.float32)
    grid, block = kernels.qmv_grid(OUT, per_warp)  # as kernels.qmv launches it
    (got,) = run(kernels._QMV, dict(x=x, w=np.array(q), scales=np.array(scales), biases=np.array(biases)),
                 {"y": (M, OUT)}, [("T", 0), ("GS", group_size), ("M", M), ("R", per_warp)], (grid, 1, 1), block)
    deq = np.array(mx.dequantize(q, scales, biases, group_size=group_size, bits=4)).astype(np.float64)
    np.testing.assert_allclose(got, x.astype(np.float64) @ deq.T, atol=1e-5)


@pytest.mark.parametrize("M,OUT,IN,group_size,warps,in_flight", [(1, 40, 256, 64, 8, 4), (3, 16, 1152, 32, 8, 2),
                                                                 (8, 37, 576, 64, 4, 4), (5, 24, 4096, 128, 8, 4),
                                                                 (2, 17, 2048, 64, 4, 1)])
def test_emulated_qmv_mma_matches_reference(M, OUT, IN, group_size, warps, in_flight):
    """The tensor-core product through PTX's fragment layouts: every nibble pair, features past
    OUT (not a multiple of 16), rows past M, inputs not a multiple of 128 (576, 1152) and a
    block's warps sharing the inputs (4096 = 32 blocks of 128: one round of 8 warps x 4)."""
    rng = np.random.default_rng(M * OUT + IN)
    w = mx.array(rng.standard_normal((OUT, IN)).astype(np.float32) * IN**-0.5)
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=4)
    x = rng.standard_normal((M, IN)).astype(np.float32)
    grid, block = kernels.qmv_mma_grid(OUT, warps)  # as kernels.qmv_mma launches it
    template = [("T", 0), ("GS", group_size), ("M", M), ("KW", warps), ("U", in_flight)]
    (got,) = run(kernels._QMV_MMA, dict(x=x, w=np.array(q), scales=np.array(scales), biases=np.array(biases)),
                 {"y": (M, OUT)}, template, (grid, 1, 1), block, header=QMV_HEADER)
    deq = np.array(mx.dequantize(q, scales, biases, group_size=group_size, bits=4)).astype(np.float64)
    np.testing.assert_allclose(got, x.astype(np.float64) @ deq.T, atol=1e-5)


def test_reference_vjp_runs_the_kernel_forward_and_the_reference_backward():
    """A stand-in kernel that doubles the reference: outputs are the kernel's, vector-Jacobian
    products the reference's (also under mx.compile), and integer and bool inputs get zeros."""
    rng = np.random.default_rng(0)
    w, x, cot = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((4, 3), (2, 4), (2, 3)))
    ids, keep = mx.array([[1, 2, 3]], dtype=mx.uint32), mx.array([[True, False, True]])

    def reference(x, w, ids, keep):
        return mx.where(keep, x @ w, 0.0) * ids.astype(mx.float32)

    fn = kernels.with_reference_vjp(lambda *a: 2 * reference(*a), reference)
    out, got = mx.compile(lambda *a: mx.vjp(fn, list(a), [cot]))(x, w, ids, keep)
    np.testing.assert_allclose(np.array(out[0]), 2 * np.array(reference(x, w, ids, keep)))
    want = mx.vjp(lambda x, w: reference(x, w, ids, keep), [x, w], [cot])[1]
    for g, r in zip(got[:2], want):
        np.testing.assert_allclose(np.array(g), np.array(r), rtol=1e-6)
    assert np.any(np.array(want[0])) and not np.any(np.array(got[2])) and not np.any(np.array(got[3]))


def test_kernel_paths_differentiate_like_mlx_ops(monkeypatch):
    """The decoder's CUDA-only paths (4-bit product, one-token attention), switched on here with
    stand-ins for the kernels: their vector-Jacobian products are those of the MLX ops they replace."""
    from mlxfun import llama

    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((24, 64)).astype(np.float32))
    q = llama.Quantized(*mx.quantize(w, group_size=32, bits=4))
    x, cot = mx.array(rng.standard_normal((1, 3, 64)).astype(np.float32)), mx.array(rng.standard_normal((1, 3, 24)))

    def product(x, scales):
        return llama.linear(q._replace(scales=scales), x)

    want = mx.vjp(product, [x, q.scales], [cot])[1]
    monkeypatch.setattr(kernels, "available", lambda a: True)
    monkeypatch.setattr(kernels, "qmv", lambda x, w, s, b, gs: mx.zeros((x.shape[0], w.shape[0])))
    out, got = mx.vjp(product, [x, q.scales], [cot])
    assert not np.any(np.array(out[0]))  # the stand-in ran forward
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)

    B, H, K, S, D = 2, 4, 2, 6, 8
    qk = mx.array(rng.standard_normal((B, H + K, 1, D)).astype(np.float32))
    keys, values = (mx.array(rng.standard_normal((B, K, S, D)).astype(np.float32)) for _ in range(2))
    mask = mx.array(np.arange(S)[None, None, :] >= np.array([0, 2])[:, None, None])  # row 1: left padding
    cot = mx.array(rng.standard_normal((B, H * D)).astype(np.float32))
    want = mx.vjp(lambda qk, k, v: llama.grouped_attention(qk[:, :H], k, v, mask, D**-0.5)
                  .reshape(B, H * D), [qk, keys, values], [cot])[1]
    monkeypatch.setattr(kernels, "decode_attention", lambda qk, k, v, m, h: mx.zeros((B, h * D)))
    got = mx.vjp(lambda qk, k, v: llama.fused_decode_attention(qk, k, v, mask, H), [qk, keys, values], [cot])[1]
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
