"""An Engine's options checked before any work: each bad one raises InputError naming it, and
batch-invariant decoding refuses the models it cannot serve yet."""

from __future__ import annotations

import mlx.core as mx

from mlxfun.errors import InputError, check_bool, check_positive_int
from mlxfun.kernels import attention as kernels
from mlxfun.model import llama, weights
from mlxfun.model.config import ModelConfig


def check_invariant(config: ModelConfig, params) -> None:
    """batch_invariant covers full-attention models with dense MLPs: a ring's prefill chunks may
    overwrite keys their own queries read, and experts are gathered per batch. Where mlxfun's CUDA
    kernels run (bf16 / fp16 on CUDA), attention must be the one-token kernel's: MLX's ops over a
    row's gathered keys sum over the batch's table width."""
    if config.max_window is not None or any(w is not None for w in config.layer_windows):
        raise InputError("batch_invariant does not support windowed attention or max_kv_size (a ring) yet")
    if config.num_experts:
        raise InputError("batch_invariant does not support mixture-of-experts models yet")
    dtype = weights.compute_dtype(params)
    if kernels.available(dtype) and dtype != mx.float32 and not llama.step_attention_kernel(config, params):
        raise InputError(f"batch_invariant: mlxfun's attention kernel does not serve this model's heads "
                         f"(head_dim {config.head_dim}, {config.num_heads // config.num_kv_heads} query heads per "
                         "key head), so its attention would follow the batch")


def check_options(rows, prefill_step, block_size, max_kv_size, admit_min, pad_multiple, kv_memory, prefix_cache,
                  prefix_cache_bytes, num_draft_tokens) -> None:
    """Raise InputError naming the first of the Engine's options that is out of range."""
    for name, value in (("rows", rows), ("prefill_step", prefill_step), ("block_size", block_size)):
        check_positive_int(name, value)
    for name, value in (("max_kv_size", max_kv_size), ("admit_min", admit_min), ("pad_multiple", pad_multiple),
                        ("kv_memory", kv_memory)):
        check_positive_int(name, value, allow_none=True)
    check_bool("prefix_cache", prefix_cache)
    check_positive_int("num_draft_tokens", num_draft_tokens)
    if num_draft_tokens >= block_size:
        raise InputError(f"num_draft_tokens must be below the block size {block_size}, got {num_draft_tokens}")
    if prefix_cache_bytes is not None and (isinstance(prefix_cache_bytes, bool) or
                                           not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0):
        raise InputError(f"prefix_cache_bytes must be a non-negative integer, got {prefix_cache_bytes!r}")
