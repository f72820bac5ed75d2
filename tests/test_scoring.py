"""`score` and `perplexity` pick weights as `generate` does (mlxfun.engine.strategy): a dense copy of
4-bit weights where the strategy says so, with the quantized path's scores up to rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_model

import mlxfun
from mlxfun import scoring
from mlxfun.engine import strategy
from mlxfun.engine.strategy import QUANTIZED, WeightStrategy, params_for_scoring
from mlxfun.model import score as scores
from mlxfun.model.llama import Dense, Quantized

DENSE = WeightStrategy(dense_from=1)
# generate's prefill rule alone: a dense copy for prefill chunks of 16 prompt tokens or more.
PROMPTS_DENSE = WeightStrategy(dense_from=None, prompt_dense_from=16, prompt_dense_min_weights=0)
TEXT = " ".join(f"w{(i * 7) % 90 + 1}" for i in range(40))


def kind(params) -> type:
    return type(params.layers[0].gate_up)


def test_scoring_weights_follow_the_batch_and_prompt_rules():
    model = tiny_model(quant=(4, 32))
    config, params = model.config, model.params
    assert kind(params_for_scoring(config, params, 1, 8, DENSE)) is Dense
    assert params_for_scoring(config, params, 4, 512, QUANTIZED) is params
    assert params_for_scoring(config, params, 1, 15, PROMPTS_DENSE) is params  # 15 prompt tokens: below 16
    assert kind(params_for_scoring(config, params, 2, 8, PROMPTS_DENSE)) is Dense  # 2 rows x 8 tokens


@pytest.fixture
def seen(monkeypatch) -> list[type]:
    """The kind of weights each forward pass of score/perplexity receives."""
    kinds, forward = [], scores.token_logprobs

    def observed(config, params, tokens):
        kinds.append(kind(params))
        return forward(config, params, tokens)

    monkeypatch.setattr(scores, "token_logprobs", observed)
    return kinds


@pytest.mark.parametrize("rule, dense", [(DENSE, True), (PROMPTS_DENSE, True), (QUANTIZED, False)])
def test_perplexity_runs_the_weights_the_strategy_picks(seen, rule, dense):
    model = tiny_model(quant=(4, 32))
    got = scoring.perplexity(model, TEXT, sequence_length=10, batch_size=2, strategy=rule)
    want = scores.perplexity(model, TEXT, sequence_length=10, batch_size=2)  # the 4-bit product
    assert got.windows == 4 and len(seen) == 4  # two batches of two windows, each run
    assert seen[:2] == [Dense if dense else Quantized] * 2 and set(seen[2:]) == {Quantized}
    assert got.perplexity == pytest.approx(want.perplexity, rel=1e-5) and got.tokens == want.tokens == 36


def test_score_runs_the_weights_the_strategy_picks(seen):
    model = tiny_model(quant=(4, 32))
    (dense,) = scoring.score(model, TEXT, strategy=DENSE)
    (quantized,) = scores.score(model, TEXT)
    assert seen == [Dense, Quantized]
    assert dense.shape == quantized.shape == (39,)
    np.testing.assert_allclose(np.array(dense), np.array(quantized), atol=1e-4)
    assert not mx.array_equal(dense, mx.zeros_like(dense)).item()


def test_public_score_and_perplexity_use_the_default_strategy(seen, monkeypatch):
    monkeypatch.setattr(strategy, "default_strategy", lambda: DENSE)  # as on a CPU with a system BLAS
    model = tiny_model(quant=(4, 32))
    mlxfun.score(model, TEXT)
    scoring.perplexity(model, TEXT, sequence_length=64)
    assert seen == [Dense, Dense]
