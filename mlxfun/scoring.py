"""`score` and `perplexity` with the weights `generate` would use: a dense copy of quantized
weights where the engine's strategy picks one (mlxfun.engine.strategy), else the weights as loaded.
The choice changes speed only (the copy holds the dequantized values; results differ by rounding)."""

from __future__ import annotations

import mlx.core as mx

from mlxfun.engine.strategy import WeightStrategy, scoring_weights
from mlxfun.model import score as scores
from mlxfun.model.load import Model


def score(model: Model, texts: str | list[str], strategy: WeightStrategy | None = None) -> list[mx.array]:
    """For each text, the log-probability of each token given those before it (len(tokens) - 1)."""
    return scores.score(model, texts, scoring_weights(model.config, model.params, strategy))


def perplexity(model: Model, text: str, sequence_length: int = 512, batch_size: int = 4,
               strategy: WeightStrategy | None = None) -> scores.Perplexity:
    """Perplexity of `text` in windows of `sequence_length` tokens (mlxfun.model.score.perplexity)."""
    return scores.perplexity(model, text, sequence_length, batch_size,
                             scoring_weights(model.config, model.params, strategy))
