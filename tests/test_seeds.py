"""Sampling through generate on the real model: per-row seeds, per-row settings, logprobs."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

import mlxfun
from mlxfun.generate import generate
from mlxfun.model import llama

PROMPT = "Once upon a time"
NEIGHBOURS = ["The capital of France is", "def add(a, b):", "Hi", "日本の首都は", "1, 2, 3,",
              "List three colors:", "Water boils at"]


def test_same_seed_same_tokens_alone_and_in_any_batch(model_q4):
    kw = dict(max_tokens=8, temperature=1.0, top_p=0.95, ignore_eos=True)
    alone = generate(model_q4, PROMPT, seed=7, **kw).token_ids[0]
    batch = generate(model_q4, [PROMPT, *NEIGHBOURS], seed=[7, 1, 2, 3, 4, 5, 6, 8], **kw)
    assert batch.token_ids[0] == alone
    moved = generate(model_q4, [*NEIGHBOURS[:5], PROMPT], seed=[9, 9, 9, 9, 9, 7],
                     temperature=[0.3, 0.5, 0.7, 0.9, 1.1, 1.0], **{k: v for k, v in kw.items() if k != "temperature"})
    assert moved.token_ids[5] == alone
    others = {tuple(generate(model_q4, PROMPT, seed=s, **kw).token_ids[0]) for s in (1, 2, 3)}
    assert len(others | {tuple(alone)}) >= 3  # different seeds give different samples


def test_unseeded_runs_report_their_seeds(model_q4):
    kw = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    first = generate(model_q4, [PROMPT, "Hi"], **kw)
    assert len(first.seeds) == 2 and first.seeds[0] != first.seeds[1]
    again = generate(model_q4, [PROMPT, "Hi"], seed=first.seeds, **kw)
    assert again.token_ids == first.token_ids


def test_greedy_row_inside_a_sampled_batch(model_q4):
    greedy = generate(model_q4, PROMPT, max_tokens=6).token_ids[0]
    mixed = generate(model_q4, [PROMPT, "Hi"], max_tokens=6, temperature=[0.0, 1.0], seed=3, ignore_eos=True)
    assert mixed.token_ids[0] == greedy


def test_logprobs_match_the_decoder(model_f32):
    prompt = model_f32.tokenizer.encode("The capital of France is")
    out = generate(model_f32, [prompt], max_tokens=4, logprobs=3)
    ids, lps, tops = out.token_ids[0], out.logprobs[0], out.top_logprobs[0]
    assert len(lps) == len(tops) == len(ids) == 4
    seq = prompt + ids
    logits, _ = llama.forward(model_f32.config, model_f32.params, mx.array([seq]),
                              mx.arange(len(seq))[None])
    logp = logits[0].astype(mx.float32) - mx.logsumexp(logits[0].astype(mx.float32), axis=-1, keepdims=True)
    for t, (token, lp, top) in enumerate(zip(ids, lps, tops)):
        expected = logp[len(prompt) - 1 + t]
        assert math.isclose(lp, expected[token].item(), abs_tol=1e-3)
        assert top[0][0] == token  # greedy: the chosen token is the most likely
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]


def test_bad_sampling_values_are_named():
    model = mlxfun.load()
    for kw, name in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(min_p=1.5), "min_p"), (dict(top_k=-2), "top_k"),
                     (dict(temperature=[0.5, 0.5, 0.5]), "temperature")]:
        with pytest.raises(mlxfun.InputError, match=name):
            generate(model, ["a", "b"], max_tokens=2, **kw)
