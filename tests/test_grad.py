"""The decoder is a pure function: mx.grad of the mean log-likelihood matches finite differences."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import VARIANTS, rel_error, tiny_config, tiny_params
from test_reference import random_tokens, reference_forward

from mlxfun.model.llama import Dense
from mlxfun.model.score import token_logprobs


def test_token_logprobs_match_numpy():
    config = tiny_config()
    params, w = tiny_params(config, seed=12)
    tokens = random_tokens(config, (2, 9))
    logits = reference_forward(config, w, tokens[:, :-1], np.broadcast_to(np.arange(8), (2, 8)))
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    actual = token_logprobs(config, params, mx.array(tokens))
    assert actual.shape == (2, 8)
    assert rel_error(np.array(actual), expected) < 1e-4


@pytest.mark.parametrize("variant", ["tied", "qk_norm", "llama3_rope"])
@pytest.mark.parametrize("field", ["o", "qkv", "gate_up"])
def test_grad_matches_finite_differences(variant, field):
    config = tiny_config(**VARIANTS[variant])
    params, _ = tiny_params(config, seed=11)
    tokens = mx.array(random_tokens(config, (2, 10)))

    def loss(weight: mx.array) -> mx.array:
        layer = params.layers[0]._replace(**{field: Dense(weight, getattr(params.layers[0], field).bias)})
        return token_logprobs(config, params._replace(layers=(layer, *params.layers[1:])), tokens).mean()

    w0 = getattr(params.layers[0], field).weight
    grad = np.array(mx.grad(loss)(w0))
    assert grad.shape == w0.shape and np.isfinite(grad).all()
    # The three steepest coordinates and three arbitrary ones; float32 central differences.
    flat = np.argsort(-np.abs(grad).ravel())[:3].tolist() + [7, grad.size // 2, grad.size - 3]
    eps = 1e-2
    for i in flat:
        r, c = divmod(i, grad.shape[1])
        step = mx.zeros_like(w0)
        step[r, c] = eps
        fd = (loss(w0 + step).item() - loss(w0 - step).item()) / (2 * eps)
        assert abs(fd - grad[r, c]) <= 1e-2 * max(abs(grad[r, c]), 0.05 * np.abs(grad).max()), (r, c, fd, grad[r, c])
