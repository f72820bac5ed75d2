"""Decoding through the KV cache (chunk by chunk, token by token) equals one full forward pass."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import VARIANTS, rel_error, tiny_config, tiny_params
from test_reference import random_tokens, reference_forward

from mlxfun import cache as kv
from mlxfun import llama

CHUNKINGS = {
    "whole": [12],
    "prompt_then_tokens": [5] + [1] * 7,
    "threes": [3, 3, 3, 3],
    "uneven": [2, 5, 1, 4],
    "tokens": [1] * 12,
}


def decode_in_chunks(config, params, tokens: np.ndarray, chunks: list[int], capacity: int, start=None):
    """Feed tokens (B, T) through a fresh cache chunk by chunk; logits (B, T, V) and the final cache.
    `start` (B,) is each row's first position (negative for left padding); default 0."""
    B, T = tokens.shape
    assert sum(chunks) == T
    start = np.zeros(B, np.int64) if start is None else np.asarray(start)
    cache = kv.empty(config, B, capacity, mx.float32)
    out, t = [], 0
    for n in chunks:
        positions = mx.array(start[:, None] + np.arange(t, t + n)[None], dtype=mx.int32)
        logits, cache = llama.forward(config, params, mx.array(tokens[:, t:t + n]), positions, cache=cache)
        out.append(np.array(logits))
        t += n
    assert int(cache.cursor.item()) == T
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
    assert sorted(np.array(cache.positions)[0].tolist()) == [10, 11, 12, 13]


def test_max_kv_size_is_a_window():
    config = tiny_config().with_max_kv_size(5)
    params, w = tiny_params(config, seed=8)
    tokens = random_tokens(config, (1, 12))
    expected = reference_forward(config, w, tokens, np.arange(12)[None], windows=(5, 5))
    logits, _ = decode_in_chunks(config, params, tokens, [5] + [1] * 7, capacity=5)
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


@pytest.mark.parametrize("fresh_capacity,fresh_cursor", [(4, 4), (3, 7), (5, 5)])
def test_place_rows_aligns_cursors_and_touches_only_its_rows(fresh_capacity, fresh_cursor):
    """Row r of the result holds fresh's newest tokens ending at the cache's cursor (wrapping the
    ring), emptied elsewhere; other rows and the input cache are unchanged."""
    config = tiny_config(num_layers=1)
    rng = np.random.default_rng(0)
    B, C, K, D = 4, 6, config.num_kv_heads, config.head_dim
    cache = kv.KVCache((mx.array(rng.standard_normal((B, K, C, D)), mx.float32),),
                       (mx.array(rng.standard_normal((B, K, C, D)), mx.float32),),
                       mx.array(rng.integers(0, 50, (B, C)), mx.int32), mx.array(9, mx.int32))
    before = [np.array(a) for a in (cache.keys[0], cache.values[0], cache.positions)]
    F = fresh_capacity
    fresh = kv.KVCache((mx.array(rng.standard_normal((2, K, F, D)), mx.float32),),
                       (mx.array(rng.standard_normal((2, K, F, D)), mx.float32),),
                       mx.array(rng.integers(-3, 50, (2, F)), mx.int32), mx.array(fresh_cursor, mx.int32))
    out = kv.place_rows(cache, 9, [3, 1], fresh, fresh_cursor)
    keys, values, positions = (np.array(a) for a in (out.keys[0], out.values[0], out.positions))
    fk, fv, fp = (np.array(a) for a in (fresh.keys[0], fresh.values[0], fresh.positions))
    for j, row in enumerate([3, 1]):
        expected = np.full(C, -1)
        for t in range(fresh_cursor - min(F, fresh_cursor), fresh_cursor):  # stream index in fresh
            slot = (9 - fresh_cursor + t) % C
            assert np.array_equal(keys[row, :, slot], fk[j, :, t % F])
            assert np.array_equal(values[row, :, slot], fv[j, :, t % F])
            expected[slot] = fp[j, t % F]
        assert np.array_equal(positions[row], expected)
    for row in (0, 2):
        assert np.array_equal(keys[row], before[0][row]) and np.array_equal(positions[row], before[2][row])
    assert all(np.array_equal(np.array(a), b) for a, b in zip((cache.keys[0], cache.values[0], cache.positions),
                                                               before))
