"""Batched generation: every prompt's output equals its output alone, whatever the padding."""

from __future__ import annotations

import random

import pytest
from helpers import tiny_config, tiny_model
from real_prompts import REAL_TOKENS, alone

import mlxfun
from mlxfun.engine.prefill import plan_groups
from mlxfun.generate import generate, stream_generate


@pytest.fixture(scope="module")
def alone_q4(model_q4):
    return alone(model_q4)


def test_real_prompts_span_lengths(alone_q4):
    lengths = sorted(len(p) for p in alone_q4[0])
    assert lengths[0] == 1 and lengths[-1] >= 100, lengths


def test_real_batch_equals_alone_q4(alone_q4, model_q4):
    """4-bit weights; float32 in test_generate_f32.py (its own file, so the two run in parallel)."""
    prompts, each = alone_q4
    batched = generate(model_q4, prompts, max_tokens=REAL_TOKENS)
    for i, (b, a) in enumerate(zip(batched.token_ids, each)):
        assert b == a, f"q4: prompt {i} differs in a batch"
    assert all(len(a) > 0 for a in each)


def test_real_shuffled_and_sub_batches(model_q4, alone_q4):
    """One dtype suffices for reordering; both run the full batch above."""
    model, (prompts, each) = model_q4, alone_q4
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    sub = order[:4]  # shuffled (1 token to ~110 among them): new neighbours, row positions and padding
    out = generate(model, [prompts[i] for i in sub], max_tokens=REAL_TOKENS).token_ids
    for i, ids in zip(sub, out):
        assert ids == each[i], f"prompt {i} depends on its neighbours"
    assert sorted(sub) != sub


def test_tiny_batch_equals_alone_across_chunks_and_buckets():
    """Heavy left padding, a prompt longer than the prefill chunk, and decoding across a cache bucket."""
    model = tiny_model(tiny_config(vocab_size=97, max_position_embeddings=1024))
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (1, 2, 7, 40, 130, 250)]
    kw = dict(max_tokens=20, prefill_step=32, ignore_eos=True)
    batched = generate(model, prompts, **kw).token_ids
    for p, b in zip(prompts, batched):
        assert b == generate(model, [p], **kw).token_ids[0]
    assert len(batched[-1]) == 20  # 250 + 20 crosses the 256-slot bucket


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_batch_equals_alone_in_16_bits_on_the_cpu(dtype):
    """On the CPU (MLX's bundled BLAS, as the suite runs) batched == alone holds bit for bit in 16-bit
    weights too, as the README says: tokens and log-probs, batched and reversed."""
    import mlx.core as mx

    from mlxfun.model.load import Model
    from mlxfun.model.weights import cast

    tiny = tiny_model(tiny_config(vocab_size=97, max_position_embeddings=512), seed=3)
    model = Model(tiny.config, cast(tiny.config, tiny.params, getattr(mx, dtype)), tiny.tokenizer, "tiny")
    assert model.params.norm.dtype == getattr(mx, dtype)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (1, 5, 33, 90)]
    kw = dict(max_tokens=12, ignore_eos=True, logprobs=0)
    batched, reverse = generate(model, prompts, **kw), generate(model, prompts[::-1], **kw)
    for i, p in enumerate(prompts):
        one = generate(model, [p], **kw)
        assert batched.token_ids[i] == one.token_ids[0] == reverse.token_ids[-1 - i]
        assert batched.logprobs[i] == one.logprobs[0] == reverse.logprobs[-1 - i]


def test_prefill_groups_bound_padding():
    lengths = [300, 110, 75, 55, 3, 1, 120, 290]
    groups = plan_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 1.3 * sum(lengths[i] for i in g)
    assert any(0 in g and 7 in g for g in groups)  # similar lengths share a group
    assert not any(0 in g and 5 in g for g in groups)  # 300 and 1 tokens never share padding



def test_rows_finish_on_their_own(model_q4):
    """A chat row ends early on the end-of-turn token; a raw row runs to max_tokens."""
    prompts = [[{"role": "user", "content": "Hi"}], "The history of the Roman Empire"]
    out = generate(model_q4, prompts, max_tokens=[40, 12])
    assert out.finish_reasons == ["stop", "length"]
    assert len(out.token_ids[1]) == 12
    assert 0 < len(out.token_ids[0]) < 40
    assert not any(t in model_q4.tokenizer.eos_token_ids for t in out.token_ids[0])
    for p, ids, m in zip(prompts, out.token_ids, [40, 12]):
        assert generate(model_q4, [p], max_tokens=m).token_ids[0] == ids
    assert "<|im_end|>" not in out.texts[0] and out.texts[0].strip()


def test_stop_string_across_token_boundaries(model_q4):
    full = generate(model_q4, "The capital of France is", max_tokens=10)
    text = full.texts[0]
    assert text.startswith(" Paris.\n\n")
    # "s.\n\nTh" spans " Paris", ".", "\n\n" and "The": the text ends just before it.
    out = generate(model_q4, "The capital of France is", max_tokens=10, stop=["zzz", "s.\n\nTh"])
    assert out.texts[0] == " Pari"
    assert out.finish_reasons == ["stop"]
    # Tokens up to the one that completed the stop string are kept.
    assert out.token_ids[0] == full.token_ids[0][: len(out.token_ids[0])]
    assert model_q4.tokenizer.decode(out.token_ids[0]).startswith(" Paris.\n\nThe")


def test_stream_equals_generate(model_q4):
    prompts = ["The capital of France is", "日本の首都は", "def add(a, b):"]
    kw = dict(max_tokens=10, stop=["\n\n"])
    result = generate(model_q4, prompts, **kw)
    texts, reasons = ["", "", ""], [None] * 3
    for e in stream_generate(model_q4, prompts, **kw):
        assert reasons[e.index] is None, "a finished row emitted more"
        texts[e.index] += e.text
        reasons[e.index] = e.finish_reason
    assert texts == result.texts
    assert reasons == result.finish_reasons


def test_single_string_gives_lists(model_q4):
    out = generate(model_q4, "Hello", max_tokens=3)
    assert len(out.texts) == len(out.token_ids) == len(out.finish_reasons) == 1
    assert out.stats.prompt_tokens == len(model_q4.tokenizer.encode("Hello"))
    assert out.stats.generation_tokens == 3 and out.stats.generation_tps > 0


def test_per_prompt_lists_are_checked():
    model = tiny_model()
    with pytest.raises(mlxfun.InputError, match="max_tokens has 3 values for 2 prompts"):
        generate(model, [[1, 2], [3]], max_tokens=[1, 2, 3])
    with pytest.raises(mlxfun.InputError, match="stop has 1 values for 2 prompts"):
        generate(model, [[1, 2], [3]], stop=[["a"]])
    with pytest.raises(mlxfun.InputError, match="max_tokens"):
        generate(model, [[1, 2]], max_tokens=0)


def test_prompt_longer_than_context_is_refused_before_work():
    model = tiny_model(tiny_config(max_position_embeddings=64))
    with pytest.raises(mlxfun.InputError, match="prompt 1 has 64 tokens; the model's context is 64"):
        generate(model, [[1, 2], [5] * 64])
    with pytest.raises(mlxfun.InputError, match="outside"):
        generate(model, [[1, 2, 500]])


def test_generation_stops_at_the_context_limit():
    model = tiny_model(tiny_config(max_position_embeddings=40))
    out = generate(model, [[3] * 30, [4] * 5], max_tokens=100, ignore_eos=True)
    assert [len(t) for t in out.token_ids] == [10, 35]
    assert out.finish_reasons == ["length", "length"]
