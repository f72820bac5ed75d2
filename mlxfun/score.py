"""Per-token log-likelihoods of texts: perplexity in one line, for research and tests."""

from __future__ import annotations

import mlx.core as mx

from mlxfun import llama
from mlxfun.errors import InputError
from mlxfun.load import Model


def token_logprobs(config, params, tokens: mx.array) -> mx.array:
    """tokens (B, T) -> (B, T - 1): log p(tokens[:, t + 1] | tokens[:, :t + 1]). A pure function."""
    positions = mx.broadcast_to(mx.arange(tokens.shape[1], dtype=mx.int32), tokens.shape)
    logits, _ = llama.forward(config, params, tokens[:, :-1], positions[:, :-1])
    logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    return mx.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def score(model: Model, texts: str | list[str]) -> list[mx.array]:
    """For each text, the log-probability of each token given those before it (len(tokens) - 1)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    out = []
    for text in texts:
        ids = model.tokenizer.encode(text)
        if len(ids) < 2:
            raise InputError(f"cannot score {text!r}: it has fewer than two tokens")
        if len(ids) > model.config.max_position_embeddings:
            raise InputError(f"text of {len(ids)} tokens exceeds the context of "
                             f"{model.config.max_position_embeddings}")
        out.append(token_logprobs(model.config, model.params, mx.array([ids]))[0])
    return out
