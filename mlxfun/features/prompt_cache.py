"""Persistent prompt caches: a prompt's KV computed once, saved, and reused by later runs.

`cache_prompt(model, prompt)` runs the prompt through the decoder and keeps its keys and values;
`PromptCache.save(path)` writes them as safetensors with the tokens and the model's identity in
the metadata; `load_prompt_cache(path, model)` reads them back, refusing a file made for another
model or dtype. Given to `generate(..., prompt_cache=...)` (or `Engine.add_prompt_cache`), its
full blocks join the engine's prefix cache, pinned, so every prompt that starts with its tokens
skips them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlxfun.engine.options import encode
from mlxfun.errors import InputError, ModelError
from mlxfun.model import cache as kv
from mlxfun.model import llama, weights
from mlxfun.model.load import Model

FORMAT = "mlxfun-prompt-cache-1"


class PromptCache(NamedTuple):
    tokens: tuple[int, ...]
    keys: tuple[mx.array, ...]  # per layer (T, Hkv, D)
    values: tuple[mx.array, ...]  # per layer (T, Hkv, D)
    identity: str  # `identity(model)` of the model that made it

    def save(self, path: str | Path) -> Path:
        """Write the cache as one safetensors file (tokens and identity in its metadata)."""
        path = Path(path)
        tensors = {f"keys.{i}": k for i, k in enumerate(self.keys)}
        tensors |= {f"values.{i}": v for i, v in enumerate(self.values)}
        mx.save_safetensors(str(path), tensors, metadata={
            "format": FORMAT, "identity": self.identity, "tokens": json.dumps(list(self.tokens))})
        return path


def identity(model: Model) -> str:
    """A fingerprint of what the KV depends on: the config, the compute dtype and the weights
    (a digest of the embedding's first rows and the final norm)."""
    params = model.params
    embed = params.embed.weight[:8] if isinstance(params.embed, llama.Dense) else params.embed.scales[:8]
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    h.update(str(weights.compute_dtype(params)).encode())
    for a in (embed, params.norm):
        h.update(np.array(a.astype(mx.float32)).tobytes())
    return h.hexdigest()[:32]


def cache_prompt(model: Model, prompt, *, chat: bool = False) -> PromptCache:
    """The KV of `prompt` (text, token ids, or messages rendered without a generation prompt)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=False),
                                     add_special_tokens=False)
    else:
        ids = encode(model, prompt, 0, chat)
    if len(ids) >= model.config.max_position_embeddings:
        raise InputError(f"a prompt of {len(ids)} tokens does not fit the model's context of "
                         f"{model.config.max_position_embeddings}")
    config = model.config
    cache = kv.empty(config, 1, len(ids), weights.compute_dtype(model.params), block_size=len(ids))
    _, cache = llama.hidden(config, model.params, mx.array([ids]), mx.arange(len(ids))[None], cache=cache)
    bs = kv.block_size(cache)
    keys = tuple(kv.gather(k, cache.table, bs)[0].transpose(1, 0, 2) for k in cache.keys)  # (T, K, D)
    values = tuple(kv.gather(v, cache.table, bs)[0].transpose(1, 0, 2) for v in cache.values)
    mx.eval(keys, values)
    return PromptCache(tuple(ids), keys, values, identity(model))


def load_prompt_cache(path: str | Path, model: Model) -> PromptCache:
    """A saved PromptCache, checked against `model`."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"no such prompt cache file: {path}")
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ModelError(f"cannot read prompt cache {path}: {e}") from None
    if meta.get("format") != FORMAT:
        raise ModelError(f"{path} is not an mlxfun prompt cache")
    if meta.get("identity") != identity(model):
        raise ModelError(f"{path} was made for another model or dtype than {model.source or 'this one'}; "
                         "make it again with this model (mlxfun.cache_prompt)")
    n = model.config.num_layers
    pc = PromptCache(tuple(json.loads(meta["tokens"])), tuple(tensors[f"keys.{i}"] for i in range(n)),
                     tuple(tensors[f"values.{i}"] for i in range(n)), meta["identity"])
    return pc


def install(engine, cache) -> None:
    """Make a PromptCache's (or a saved one's, by path) full blocks part of `engine`'s prefix cache,
    pinned for the engine's life (`Engine.add_prompt_cache`)."""
    if isinstance(cache, (str, Path)):
        cache = load_prompt_cache(cache, engine.model)
    if not isinstance(cache, PromptCache):
        raise InputError(f"prompt_cache must be an mlxfun PromptCache (mlxfun.cache_prompt), got "
                         f"{type(cache).__name__}")
    if cache.identity != identity(engine.model):
        raise InputError("this prompt cache was made for another model or dtype")
    sched = engine.scheduler
    m = len(cache.tokens) // sched.pool.block_size
    if m == 0:
        return
    sched.pages.prepare(m)
    blocks = [sched.pool.allocate() for _ in range(m)]  # their one reference: the pin
    engine.ensure_state()
    engine.runner.write_blocks(blocks, cache.keys, cache.values, sched.pool.size)
    sched.pool.register(cache.tokens, blocks, always=True)
