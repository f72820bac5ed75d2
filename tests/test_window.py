"""Sliding windows and the bounded (ring) cache, through generate, with heavy left padding."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from helpers import run_engine, tiny_config, tiny_model

from mlxfun.generate import generate
from mlxfun.model import cache as kv
from mlxfun.model import config as cfg
from mlxfun.model import llama


def greedy_by_full_forward(model, config, prompt: list[int], n: int) -> list[int]:
    """The slow straightforward path: recompute the whole sequence (no cache) for every token."""
    tokens = list(prompt)
    for _ in range(n):
        x = mx.array([tokens], dtype=mx.int32)
        logits, _ = llama.forward(config, model.params, x, mx.arange(len(tokens), dtype=mx.int32)[None])
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return tokens[len(prompt):]


def prompts_around(window: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = (1, 3, window - 1, window, window + 1, 3 * window + 2)  # shorter, equal and longer than W
    return [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("prefill_step", [4, 512])
def test_windowed_model_matches_full_attention_with_window_mask(prefill_step):
    """Every layer has window 8: the cache is a ring of 8 slots that wraps many times."""
    model = tiny_model(tiny_config(layer_windows=(8, 8)))
    assert model.config.max_window == 8
    prompts = prompts_around(8)
    out = generate(model, prompts, max_tokens=20, prefill_step=prefill_step, ignore_eos=True).token_ids
    for p, ids in zip(prompts, out):
        assert ids == greedy_by_full_forward(model, model.config, p, 20)


def test_ring_cache_is_bounded_by_the_window():
    """Every layer has window 8: each row holds a ring of blocks that covers its window (and the
    block being filled), however long it runs."""
    model = tiny_model(tiny_config(layer_windows=(8, 8)))
    for n in (20, 200):
        _, engine = run_engine(model, prompts_around(8), max_tokens=n, ignore_eos=True)
        assert engine.stats.max_capacity == kv.ring_columns(8) * kv.BLOCK == 32
        assert engine.stats.peak_kv_used_bytes <= 6 * (kv.ring_columns(8) + 1) * engine.block_bytes


def test_mixed_windows_use_a_linear_cache():
    """Qwen2-style: only some layers are windowed, so the cache cannot be a ring of W."""
    model = tiny_model(tiny_config(layer_windows=(None, 6)))
    assert model.config.max_window is None
    prompts = prompts_around(6, seed=1)
    out = generate(model, prompts, max_tokens=12, ignore_eos=True).token_ids
    for p, ids in zip(prompts, out):
        assert ids == greedy_by_full_forward(model, model.config, p, 12)


def test_max_kv_size_bounds_any_model():
    model = tiny_model()
    prompts = prompts_around(8, seed=2)
    ring = generate(model, prompts, max_tokens=16, max_kv_size=8, ignore_eos=True).token_ids
    windowed = model.config.with_max_kv_size(8)
    for p, ids in zip(prompts, ring):
        assert ids == greedy_by_full_forward(model, windowed, p, 16)
    # Batched equals alone while the ring wraps.
    for p, ids in zip(prompts, ring):
        assert generate(model, [p], max_tokens=16, max_kv_size=8, ignore_eos=True).token_ids[0] == ids


def test_max_kv_size_at_least_the_sequence_changes_nothing():
    model = tiny_model()
    prompts = prompts_around(8, seed=3)
    full = generate(model, prompts, max_tokens=10, ignore_eos=True).token_ids
    longest = max(len(p) for p in prompts) + 10
    assert generate(model, prompts, max_tokens=10, max_kv_size=longest, ignore_eos=True).token_ids == full
    assert generate(model, prompts, max_tokens=10, max_kv_size=8, ignore_eos=True).token_ids != full


def test_real_model_ring_batched_equals_alone(model_q4):
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
               "def fibonacci(n):\n    "]
    out = generate(model_q4, prompts, max_tokens=24, max_kv_size=16)
    for p, ids in zip(prompts, out.token_ids):
        assert generate(model_q4, p, max_tokens=24, max_kv_size=16).token_ids[0] == ids
    assert max(len(model_q4.tokenizer.encode(p)) for p in prompts) + 24 > 2 * 16  # the ring wrapped


def test_qwen2_window_layers_from_config():
    raw = dict(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=32,
               max_window_layers=2)
    assert cfg.from_hf(raw).layer_windows == (None, None, 32, 32)
    assert cfg.from_hf({**raw, "use_sliding_window": False}).layer_windows == (None,) * 4
    mistral = {**raw, "model_type": "mistral", "sliding_window": 16}
    assert cfg.from_hf(mistral).layer_windows == (16,) * 4
    assert cfg.from_hf(cfg.to_hf(cfg.from_hf(raw))).layer_windows == (None, None, 32, 32)


def test_a_prompt_longer_than_the_ring_is_warned_of(tmp_path):
    """A prompt alone longer than --max-kv-size and the 4 sinks loses part of itself: generate()
    warns, naming the prompt and its length; a prompt that fits the ring and its sinks is not
    warned of."""
    import warnings

    model = tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, [[5] * 10, [6] * 37], max_tokens=2, max_kv_size=32)
        generate(model, [[5] * 36], max_tokens=2, max_kv_size=32)
    messages = [str(w.message) for w in caught]
    assert messages == ["max_kv_size=32 is shorter than prompt 1 (37 tokens) (0-based): each token sees only the "
                        "first 4 and the last 32, so the answer cannot see all of the prompt"]
