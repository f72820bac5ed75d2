"""mlxfun: batched text generation for Llama-family models, in pure functional MLX."""

from mlxfun import blas  # noqa: F401  (first: loads $MLXFUN_BLAS, if set, before anything imports MLX)
from mlxfun.errors import InputError, MlxfunError, ModelError
from mlxfun.events import Event
from mlxfun.generate import generate, stream_generate
from mlxfun.load import Model, load, save
from mlxfun.options import GenerationConfig
from mlxfun.prompt_cache import PromptCache, cache_prompt, load_prompt_cache
from mlxfun.rows import GenerationResult
from mlxfun.score import score
from mlxfun.shard import shard, sharded_load

__all__ = ["Event", "GenerationConfig", "GenerationResult", "InputError", "MlxfunError", "Model", "ModelError",
           "PromptCache", "cache_prompt", "generate", "load", "load_prompt_cache", "save", "score", "shard",
           "sharded_load", "stream_generate"]
