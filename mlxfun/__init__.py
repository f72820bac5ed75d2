"""mlxfun: batched text generation for Llama-family models, in pure functional MLX."""

# isort: off
from mlxfun.kernels import blas  # noqa: F401  (first: loads $MLXFUN_BLAS, if set, before anything imports MLX)
# isort: on
from mlxfun.engine.core import Engine
from mlxfun.engine.events import Event
from mlxfun.engine.options import GenerationConfig
from mlxfun.engine.rows import GenerationResult
from mlxfun.errors import InputError, MlxfunError, ModelError
from mlxfun.features.prompt_cache import PromptCache, cache_prompt, load_prompt_cache
from mlxfun.generate import generate, stream_generate
from mlxfun.model.load import Model, load, save
from mlxfun.parallel.shard import shard, sharded_load
from mlxfun.scoring import score

__all__ = ["Engine", "Event", "GenerationConfig", "GenerationResult", "InputError", "MlxfunError", "Model",
           "ModelError", "PromptCache", "cache_prompt", "generate", "load", "load_prompt_cache", "save", "score",
           "shard", "sharded_load", "stream_generate"]
