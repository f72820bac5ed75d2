"""mlxfun: batched text generation for Llama-family models, in pure functional MLX."""

from mlxfun.errors import InputError, MlxfunError, ModelError
from mlxfun.load import Model, load, save
from mlxfun.score import score

__all__ = ["InputError", "MlxfunError", "Model", "ModelError", "load", "save", "score"]
