"""Decoding through the KV cache (chunk by chunk, token by token) equals one full forward pass."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from helpers import VARIANTS, rel_error, tiny_config, tiny_params
from mlx.utils import tree_flatten
from test_reference import random_tokens, reference_forward

from mlxfun.model import cache as kv
from mlxfun.model import llama

CHUNKINGS = {
    "whole": [12],
    "prompt_then_tokens": [5] + [1] * 7,
    "threes": [3, 3, 3, 3],
    "uneven": [2, 5, 1, 4],
    "tokens": [1] * 12,
}


def decode_in_chunks(config, params, tokens: np.ndarray, chunks: list[int], capacity: int, start=None,
                     block_size: int = kv.BLOCK):
    """Feed tokens (B, T) through a fresh cache chunk by chunk; logits (B, T, V) and the final cache.
    `start` (B,) is each row's first position (negative for left padding); default 0."""
    B, T = tokens.shape
    assert sum(chunks) == T
    start = np.zeros(B, np.int64) if start is None else np.asarray(start)
    cache = kv.empty(config, B, capacity, mx.float32, block_size)
    out, t = [], 0
    for n in chunks:
        positions = mx.array(start[:, None] + np.arange(t, t + n)[None], dtype=mx.int32)
        logits, cache = llama.forward(config, params, mx.array(tokens[:, t:t + n]), positions, cache=cache)
        out.append(np.array(logits))
        t += n
    pinned = kv.pinned_slots(config.sinks, kv.block_size(cache))
    held = np.array(kv.gather_positions(cache.positions, cache.table, pinned))  # (B, slots)
    assert (held.max(axis=1) == start + T - 1).all()  # each row's newest position, at its own slot
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("variant", ["tied", "bias", "qk_norm", "llama3_rope", "gqa4", "q4"])
def test_cached_decode_equals_full_forward(variant, chunking):
    config = tiny_config(**VARIANTS.get(variant, {}))
    params, _ = tiny_params(config, seed=2, quant=(4, 32) if variant == "q4" else None)
    tokens = random_tokens(config, (2, 12))
    full, _ = llama.forward(config, params, mx.array(tokens), mx.broadcast_to(mx.arange(12), (2, 12)))
    cached, _ = decode_in_chunks(config, params, tokens, CHUNKINGS[chunking], capacity=16)
    assert rel_error(cached, np.array(full)) < 1e-4


def test_left_padded_prompts_then_decode():
    """A left-padded batch prefilled at once, then decoded token by token: each row's logits equal
    the NumPy reference on that row alone."""
    config = tiny_config(**VARIANTS["qk_norm"])
    params, w = tiny_params(config, seed=4)
    lengths, prompt_len, steps = [7, 3], 7, 4
    rows = [random_tokens(config, (n + steps,), seed=20 + n) for n in lengths]
    tokens = np.stack([np.concatenate([np.full(prompt_len - n, 5), r]) for r, n in zip(rows, lengths, strict=True)])
    start = np.array([n - prompt_len for n in lengths])  # first position: -4 for the padded row
    logits, _ = decode_in_chunks(config, params, tokens, [prompt_len] + [1] * steps, capacity=16, start=start)
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        expected = reference_forward(config, w, row[None], np.arange(len(row))[None])[0]
        assert rel_error(logits[b, prompt_len - n:], expected) < 1e-4


@pytest.mark.parametrize("chunks", [[6] + [1] * 8, [1] * 14, [3] * 4 + [1, 1]])
def test_sliding_window_linear_cache(chunks):
    """Layer 0 sees the last 4 positions, layer 1 everything; the cache holds all 14 tokens."""
    config = tiny_config(layer_windows=(4, None))
    params, w = tiny_params(config, seed=6)
    tokens = random_tokens(config, (2, 14))
    expected = reference_forward(config, w, tokens, np.broadcast_to(np.arange(14), (2, 14)))
    logits, _ = decode_in_chunks(config, params, tokens, chunks, capacity=16)
    assert rel_error(logits, expected) < 1e-4


@pytest.mark.parametrize("chunks", [[4] + [1] * 10, [1] * 14, [2] * 7, [4, 4, 2, 2, 1, 1]])
def test_sliding_window_ring_cache(chunks):
    """Every layer has window 4, so a ring of 4 slots suffices: it wraps around three times."""
    config = tiny_config(layer_windows=(4, 3))
    assert config.max_window == 4
    params, w = tiny_params(config, seed=7)
    tokens = random_tokens(config, (2, 14))
    expected = reference_forward(config, w, tokens, np.broadcast_to(np.arange(14), (2, 14)))
    logits, cache = decode_in_chunks(config, params, tokens, chunks, capacity=config.max_window)
    assert rel_error(logits, expected) < 1e-4
    assert sorted(np.array(kv.gather_positions(cache.positions, cache.table))[0].tolist()) == [10, 11, 12, 13]


def test_max_kv_size_is_a_window_and_sinks():
    """A ring of 5 with its row's first 4 positions (attention sinks), in a cache of one sink
    block and a ring of two blocks of 5 slots, which wraps twice in 24 tokens."""
    config = tiny_config().with_max_kv_size(5)
    params, w = tiny_params(config, seed=8)
    tokens = random_tokens(config, (1, 24))
    expected = reference_forward(config, w, tokens, np.arange(24)[None])
    assert rel_error(expected, reference_forward(config, w, tokens, np.arange(24)[None], windows=(None, None))) > 1e-2
    logits, _ = decode_in_chunks(config, params, tokens, [5] + [1] * 7 + [3] * 4, capacity=15, block_size=5)
    assert rel_error(logits, expected) < 1e-4


def test_grow_keeps_contents():
    config = tiny_config()
    params, _ = tiny_params(config, seed=9)
    tokens = random_tokens(config, (2, 10))
    full, _ = llama.forward(config, params, mx.array(tokens), mx.broadcast_to(mx.arange(10), (2, 10)))
    cache = kv.empty(config, 2, 6, mx.float32)
    positions = mx.broadcast_to(mx.arange(6), (2, 6))
    first, cache = llama.forward(config, params, mx.array(tokens[:, :6]), positions, cache=cache)
    cache = kv.grow(cache, 12)
    assert kv.capacity(cache) == 12
    rest, _ = llama.forward(config, params, mx.array(tokens[:, 6:]), positions[:, :4] + 6, cache=cache)
    assert rel_error(np.concatenate([np.array(first), np.array(rest)], axis=1), np.array(full)) < 1e-4


def test_rows_sharing_prefix_blocks_equal_full_forward():
    """Row b reads row a's first two blocks (a shared prefix) and writes only blocks of its own:
    both rows' logits equal a full forward pass of their tokens, and a's blocks stay as they were."""
    config = tiny_config()
    params, w = tiny_params(config, seed=11)
    prefix, a_rest, b_rest = (random_tokens(config, (n,), seed=s) for n, s in ((8, 1), (4, 2), (4, 3)))
    keys, values, positions = kv.pool(config, 5, 4, mx.float32)  # scratch + 4 blocks of 4 slots
    a = kv.KVCache(keys, values, positions, mx.array([[1, 2, 3]], mx.int32))
    a_tokens = np.concatenate([prefix, a_rest])[None]
    a_logits, a = llama.forward(config, params, mx.array(a_tokens), mx.arange(12)[None], cache=a)
    before = [np.array(a.keys[0]).reshape(5, 4, -1), np.array(a.positions)]  # (blocks, slots, K * D)
    b = a._replace(table=mx.array([[1, 2, 4]], mx.int32))
    b_logits, b = llama.forward(config, params, mx.array(b_rest[None]), mx.arange(8, 12)[None], cache=b)
    b_tokens = np.concatenate([prefix, b_rest])[None]
    assert rel_error(a_logits, reference_forward(config, w, a_tokens, np.arange(12)[None])) < 1e-4
    assert rel_error(b_logits, reference_forward(config, w, b_tokens, np.arange(12)[None])[:, 8:]) < 1e-4
    after = [np.array(b.keys[0]).reshape(5, 4, -1), np.array(b.positions)]
    for block in (1, 2, 3):
        assert np.array_equal(after[0][block], before[0][block]) and np.array_equal(after[1][block], before[1][block])
    assert np.array(b.positions)[4].tolist() == [8, 9, 10, 11]


def test_padding_is_written_to_the_scratch_block_unseen():
    """Left padding (negative positions) lands in block 0 with position -1; no row's keys include it."""
    config = tiny_config()
    params, _ = tiny_params(config, seed=12)
    cache = kv.empty(config, 2, 8, mx.float32)
    tokens = mx.array([[7, 7, 5, 6], [1, 2, 3, 4]])
    positions = mx.array([[-2, -1, 0, 1], [0, 1, 2, 3]])
    _, cache = llama.forward(config, params, tokens, positions, cache=cache)
    assert (np.array(cache.positions)[0] == -1).all()
    held = np.array(kv.gather_positions(cache.positions, cache.table))
    assert sorted(held[0][held[0] >= 0].tolist()) == [0, 1] and sorted(held[1][held[1] >= 0].tolist()) == [0, 1, 2, 3]
    assert kv.slots(cache.table, positions, kv.block_size(cache)).tolist() == [[0, 0, 8, 9], [16, 17, 18, 19]]


@pytest.mark.parametrize("T", [1, 3])
def test_paged_attention_equals_attention_over_gathered_rows(T):
    """`llama.paged_attention` (the CPU's path: keys taken from the pool straight into the layout
    the products read) equals `grouped_attention` over each row's gathered blocks, rows sharing
    blocks, under a random mask."""
    from mlxfun.model.llama import grouped_attention, paged_attention

    rng = np.random.default_rng(3)
    B, H, K, D, bs, N, W = 3, 6, 2, 8, 4, 9, 3
    keys = mx.array(rng.normal(size=(N * bs, K, D)).astype(np.float32))
    values = mx.array(rng.normal(size=(N * bs, K, D)).astype(np.float32))
    table = mx.array([[1, 2, 3], [4, 2, 0], [8, 7, 6]], mx.int32)  # row 1 shares block 2 with row 0
    q = mx.array(rng.normal(size=(B, H, T, D)).astype(np.float32))
    mask = mx.array(rng.random(size=(B, T, W * bs)) < 0.6)
    got = paged_attention(q, keys, values, table, bs, mask, D**-0.5)
    want = grouped_attention(q, kv.gather(keys, table, bs), kv.gather(values, table, bs), mask, D**-0.5)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    # Against the definition, row by row in NumPy.
    k, v, t = np.array(keys), np.array(values), np.array(table)
    for b in range(B):
        slots = (t[b][:, None] * bs + np.arange(bs)).reshape(-1)
        for h in range(H):
            s = np.array(q[b, h]) @ k[slots, h // (H // K)].T * D**-0.5  # (T, S)
            s = np.where(np.array(mask[b]), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(np.array(got[b, h]), p @ v[slots, h // (H // K)], rtol=1e-4, atol=1e-5)


def test_run_start_names_only_one_row_major_run_of_real_slots():
    """`kv.run_start`: the first slot where a chunk's slots are [s, s + B T) in row-major order;
    None where a row has padding (slot 0), where rows leave a gap, overlap or come in another order."""
    run = (40 + np.arange(12)).reshape(3, 4)
    assert kv.run_start(run) == 40
    assert kv.run_start(run[:1, :1]) == 40
    gap = run.copy()
    gap[1] += 1
    padded = run.copy()
    padded[2, 3] = 0
    swapped = run[[1, 0, 2]]
    for slots in (gap, padded, swapped, run.T, np.zeros((2, 3), np.int32), np.zeros((0, 4), np.int32)):
        assert kv.run_start(slots) is None


@pytest.mark.parametrize("table,start", [([[1, 4], [2, 5], [3, 6]], 0), ([[1, 2]], 5)])
def test_a_run_of_slots_writes_what_the_scatter_writes(table, start):
    """`llama.hidden(run=...)` (slice updates) gives the hidden states and the cache, keys, values
    and positions, that the same chunk written slot by slot gives, in a pool holding another row:
    3 rows of 4 tokens in consecutive blocks, and one token."""
    config = tiny_config()
    params, _ = tiny_params(config, seed=4)
    bs = 4
    cache = kv.empty(config, 4, 16, mx.float32, block_size=bs)  # blocks 1-16; the other row holds 13-16
    _, cache = llama.forward(config, params, mx.array(random_tokens(config, (1, 6))),
                             mx.array(np.arange(6)[None], mx.int32), cache=cache._replace(table=cache.table[3:]))
    table = mx.array(table, mx.int32)
    B, T = table.shape[0], 4 if start == 0 else 1
    tokens = mx.array(np.random.default_rng(2).integers(0, config.vocab_size, size=(B, T)), mx.int32)
    positions = mx.array(np.broadcast_to(start + np.arange(T), (B, T)), mx.int32)
    cache = cache._replace(table=table)
    slots = kv.slots(table, positions, bs)
    first = kv.run_start(np.array(slots))
    assert first == (4 if start == 0 else 9)
    want = llama.hidden(config, params, tokens, positions, None, cache, slots=slots, wraps=False)
    got = llama.hidden(config, params, tokens, positions, None, cache, slots=slots, wraps=False,
                       run=mx.array([first], mx.int32))
    for (_, a), (_, b) in zip(tree_flatten(got), tree_flatten(want)):
        assert mx.array_equal(a, b).item()
    assert not mx.array_equal(got[1].keys[0], cache.keys[0]).item()  # it did write
    assert np.array(got[1].positions)[13:].max() == 5  # the other row's positions are kept


@pytest.mark.parametrize("variant", ["tied", "gqa4"])
def test_fused_attention_with_an_additive_mask_equals_grouped(monkeypatch, variant):
    """Chunks over the score limit run MLX's fused attention, given the mask made additive once per
    pass (`llama.additive_mask`); it gives the logits `grouped_attention` gives, padding, a cached
    prefix and windows included."""
    config = tiny_config(**VARIANTS[variant])
    config = dataclasses.replace(config, layer_windows=(5,) + (None,) * (config.num_layers - 1))
    params, _ = tiny_params(config, seed=8)
    tokens = random_tokens(config, (2, 9))
    start = np.array([-3, 0])  # row 0 left-padded

    def run():
        logits, _ = decode_in_chunks(config, params, tokens, [6, 3], capacity=16, start=start)
        return logits

    grouped = run()
    monkeypatch.setattr(llama, "WIDE_GROUPED_MAX_SCORES", 0)
    monkeypatch.setattr(llama, "GROUPED_MAX_SCORES", 0)
    calls = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda *a, **k: (calls.append(k["mask"].dtype), real(*a, **k))[1])
    fused = run()
    assert calls and set(calls) == {mx.float32}  # every chunk fused, each given the additive mask
    np.testing.assert_allclose(fused, grouped, rtol=1e-4, atol=1e-4)
    assert rel_error(fused[1], grouped[1]) < 1e-5
    # float32 keeps the wide limit everywhere (batched == alone is checked in float32), as does the CPU.
    assert llama.grouped_max_scores(mx.float32) == 0 and llama.WIDE_GROUPED_MAX_SCORES == 0
    monkeypatch.undo()
    assert llama.grouped_max_scores(mx.float32) == llama.WIDE_GROUPED_MAX_SCORES == 1 << 26
    assert llama.grouped_max_scores(mx.bfloat16) == (1 << 26 if mx.default_device() == mx.cpu else 1 << 24)
    m = llama.additive_mask(mx.array([[[True, False]]]), mx.float32)
    assert m.shape == (1, 1, 1, 2) and m.tolist() == [[[[0.0, -np.inf]]]]


def test_slotted_masks_equal_the_gathered_positions_masks():
    """`masks.causal(slotted=True)` over what the slots hold, with padding seeing everything,
    equals the mask over `gather_positions` (own positions, -1 elsewhere) made never empty, for
    every real query (its own key written first, as a pass writes before it reads): over pools
    holding stale positions of other owners, negative padding positions, ring rows past their
    width, windows, and rings that keep their first block for attention sinks (`pinned`).
    Padding queries see every key."""
    from mlxfun.model import masks
    rng = np.random.default_rng(0)
    for trial in range(40):
        B, W, bs, T = int(rng.integers(1, 5)), int(rng.integers(2, 5)), 4, int(rng.integers(1, 4))
        N = 1 + B * W + 3
        S = W * bs
        pinned = bs * int(rng.integers(0, 2))  # a ring with sinks (4: one block of 4), or without
        positions = mx.array(rng.integers(-7, 3 * S, size=(N, bs)).astype(np.int32))  # stale and padding
        table = mx.array(rng.permutation(np.arange(1, N))[:B * W].reshape(B, W).astype(np.int32))
        q = rng.integers(-3, 3 * S, size=(B, 1)) + np.arange(T)[None]
        q = np.where(rng.random((B, 1)) < 0.25, -1 - np.arange(T)[None], q)  # some rows all padding
        q = mx.array(q.astype(np.int32))
        # As a pass does: each token's position written at its slot before any query reads.
        positions = kv.write_positions(positions, kv.slots(table, q, bs, pinned), q)
        held = kv.held_positions(positions, table)
        for window in (None, int(rng.integers(1, S + 1))):
            config = tiny_config(num_layers=1, layer_windows=(window,), layer_sinks=(pinned,))
            new = llama.layer_masks(config, q, held, None, True, pinned)[window, pinned]
            key = kv.gather_positions(positions, table, pinned)
            old = masks.causal(q, key)
            old = masks.never_empty(old if window is None else old & masks.window(q, key, window, pinned))
            real = np.array(q) >= 0  # (B, T)
            assert np.array_equal(np.array(new)[real], np.array(old)[real]), trial
            assert np.array(new)[~real].all()


def test_a_one_token_write_has_no_reshape_of_its_keys(tmp_path):
    """A decode step writes each layer's (B, K, 1, D) keys into the (N * bs, K, 1, D) pool as they
    are: the scatter's only view is of the slots (shared by every layer), none of the keys."""
    import re
    buf = mx.zeros((64, 2, 1, 8))
    new = mx.random.normal((3, 2, 1, 8))
    slots = mx.array([[5], [17], [0]], mx.int32)
    mx.eval(buf, new, slots)
    out = kv.write(buf, new, slots)
    path = tmp_path / "write.dot"
    mx.export_to_dot(str(path), out)
    nodes = re.findall(r'label ="?([A-Za-z_]+)', path.read_text())
    assert sorted(nodes) == ["Broadcast", "Reshape", "ScatterAxis"]  # the slots' reshape and broadcast
    got = np.array(out)
    assert np.array_equal(got[[5, 17, 0]], np.array(new)) and not got[np.setdiff1d(np.arange(64), [5, 17, 0])].any()
