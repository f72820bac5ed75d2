"""Batched greedy generation equals each prompt alone, token for token, in float32 on the real model."""

from __future__ import annotations

from real_prompts import REAL_PROMPTS, REAL_TOKENS, alone

from mlxfun.generate import generate

# A third of the prompts (the 4-bit checks in test_generate take all 12, chat ones among them): one
# token, the longest, three scripts. The CPU's reference BLAS prefills about 8 tokens/s in float32.
F32_PROMPTS = [REAL_PROMPTS[i] for i in (0, 4, 8, 11)]


def test_real_batch_equals_alone_f32(model_f32):
    prompts, each = alone(model_f32, F32_PROMPTS)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 1 and lengths[-1] >= 100, lengths  # padding from none to ~110 tokens
    batched = generate(model_f32, prompts, max_tokens=REAL_TOKENS)
    for i, (b, a) in enumerate(zip(batched.token_ids, each)):
        assert b == a, f"float32: prompt {i} differs in a batch"
    assert all(len(a) > 0 for a in each)
