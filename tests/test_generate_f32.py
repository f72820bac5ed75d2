"""Batched greedy generation equals each prompt alone, token for token, in float32 on the real model."""

from __future__ import annotations

from real_prompts import REAL_TOKENS, alone

from mlxfun.generate import generate


def test_real_batch_equals_alone_f32(model_f32):
    prompts, each = alone(model_f32)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 1 and lengths[-1] >= 100, lengths  # padding from none to ~110 tokens
    batched = generate(model_f32, prompts, max_tokens=REAL_TOKENS)
    for i, (b, a) in enumerate(zip(batched.token_ids, each)):
        assert b == a, f"float32: prompt {i} differs in a batch"
    assert all(len(a) > 0 for a in each)
