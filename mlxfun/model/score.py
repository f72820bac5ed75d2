"""Per-token log-likelihoods of texts (`score`) and the perplexity of a long text (`perplexity`)."""

from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from mlxfun.errors import InputError, check_positive_int
from mlxfun.model import llama
from mlxfun.model.llama import Params
from mlxfun.model.load import Model

# (rows, tokens per row) -> the weights a forward pass of that shape multiplies by. The engine's
# strategy makes this choice (a dense copy of 4-bit weights, or not); model/ only takes it.
Weights = Callable[[int, int], Params]


def token_logprobs(config, params, tokens: mx.array) -> mx.array:
    """tokens (B, T) -> (B, T - 1): log p(tokens[:, t + 1] | tokens[:, :t + 1]). A pure function."""
    positions = mx.broadcast_to(mx.arange(tokens.shape[1], dtype=mx.int32), tokens.shape)
    logits, _ = llama.forward(config, params, tokens[:, :-1], positions[:, :-1])
    logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    return mx.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def score(model: Model, texts: str | list[str], weights: Weights | None = None) -> list[mx.array]:
    """For each text, the log-probability of each token given those before it (len(tokens) - 1).
    `weights` picks the weights once for the longest text (default: the model's as loaded)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    encoded = [_checked_ids(model, text) for text in texts]
    params = pick(model, weights, 1, max((len(ids) for ids in encoded), default=2) - 1)
    return [token_logprobs(model.config, params, mx.array([ids]))[0] for ids in encoded]


def _checked_ids(model: Model, text: str) -> list[int]:
    ids = model.tokenizer.encode(text)
    if len(ids) < 2:
        raise InputError(f"cannot score {text!r}: it has fewer than two tokens")
    if len(ids) > model.config.max_position_embeddings:
        raise InputError(f"text of {len(ids)} tokens exceeds the context of {model.config.max_position_embeddings}")
    return ids


def pick(model: Model, weights: Weights | None, rows: int, length: int) -> Params:
    """The weights for forward passes of up to `rows` x `length` tokens."""
    return model.params if weights is None else weights(rows, length)


class Perplexity(NamedTuple):
    perplexity: float  # exp(mean negative log-likelihood per scored token)
    stderr: float  # its standard error (delta method over the per-token losses)
    tokens: int  # tokens scored
    windows: int
    seconds: float  # time of the forward passes
    peak_memory_gb: float


def perplexity(model: Model, text: str, sequence_length: int = 512, batch_size: int = 4,
               weights: Weights | None = None) -> Perplexity:
    """Perplexity of `text`, as mlx-lm measures it: its tokens cut into windows of `sequence_length`,
    each scored on its own (every token but a window's first is predicted), `batch_size` windows
    at a time. `weights` picks the weights once, for the largest batch (default: the model's)."""
    check_positive_int("sequence_length", sequence_length)
    check_positive_int("batch_size", batch_size)
    if sequence_length < 2 or sequence_length > model.config.max_position_embeddings:
        raise InputError(f"sequence_length must be in [2, {model.config.max_position_embeddings}] (the model's "
                         f"context), got {sequence_length}")
    ids = model.tokenizer.encode(text)
    windows = [ids[i:i + sequence_length] for i in range(0, len(ids), sequence_length)]
    windows = [w for w in windows if len(w) >= 2]  # a last single token has nothing to predict it from
    if not windows:
        raise InputError(f"cannot score a text of {len(ids)} token(s): it needs at least two")
    losses, seconds = [], 0.0
    mx.reset_peak_memory()
    params = pick(model, weights, min(batch_size, len(windows)), len(windows[0]) - 1)
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        if len(batch[-1]) != len(batch[0]):  # the short last window goes alone
            batch, tail = batch[:-1], [batch[-1]]
        else:
            tail = []
        for group in (batch, tail):
            if group:
                t0 = time.perf_counter()
                logp = token_logprobs(model.config, params, mx.array(group))  # (B, T - 1)
                mx.eval(logp)
                seconds += time.perf_counter() - t0
                losses.append(-np.array(logp, dtype=np.float64).reshape(-1))
    nll = np.concatenate(losses)
    ppl = float(np.exp(nll.mean()))
    return Perplexity(ppl, ppl * float(nll.std()) / math.sqrt(len(nll)), len(nll), len(windows), seconds,
                      mx.get_peak_memory() / 1e9)
