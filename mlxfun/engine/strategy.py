"""Which weights a batch multiplies by: the quantized kernels, or a dense copy of the weights.

A dense matmul reads the weights once for all rows, while MLX's quantized matmul stops scaling
with the number of rows (measurements in 7fbc90b:benchmarks/README.md). So a batch of at least `dense_from`
rows runs on a dense copy of quantized weights, made once per batch in the activation dtype, when
it fits in memory; and a prefill of at least `prompt_dense_from` prompt tokens per chunk runs on
a dense copy made for it and dropped after (`params_for_prompts`), while the batch decodes on the
quantized weights. The choice changes speed only: the copy holds exactly the dequantized values,
so results differ from the quantized kernels by rounding alone. A threshold of 1 also keeps a
prompt alone and in a batch on the same kernels, so batched still equals alone bit for bit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from mlxfun.kernels import blas, qmm, qmv
from mlxfun.model import weights
from mlxfun.model.config import ModelConfig
from mlxfun.model.llama import Params, Quantized, quant_shape


@dataclass(frozen=True)
class WeightStrategy:
    dense_from: int | None  # batch size from which quantized weights run as a dense copy; None: never
    memory_fraction: float = 0.75  # the copy plus memory in use must fit in this share of the device's
    prompt_dense_from: int | None = None  # prompt tokens per prefill chunk from which prefill runs a dense copy
    prompt_dense_min_weights: int = 1 << 22  # ... for models whose MLP maps (E x I) have at least this many weights
    # Models whose quantized maps all have these bits (and a layout `qmv` takes) run mlxfun's
    # product at batches of up to `kernel_rows` rows, with no dense copy, and prompts without a whole
    # copy (`llama.linear`: the product, or one map dequantized at a time). Empty: the thresholds
    # above decide for every model.
    kernel_bits: tuple[int, ...] = ()
    kernel_rows: int = 0


# Measured (7fbc90b:benchmarks/README.md). On an H200 (MLX 0.32.4, CUDA) MLX's 4-bit kernels run slower
# than bf16 at every batch size (8B: 118 vs 152 tok/s at batch 1, 1166 vs 2668 at 32), so batches
# past the rows mlxfun's product takes run a dense copy. Up to that, decode steps run mlxfun's
# 4-bit product (`qmv.product`): 8B 4-bit 269 tok/s against the copy's 203 at batch 1, 1760 vs
# 1230 at 8, with 5 GB of peak memory instead of 34 (1B: 510 vs 554 at batch 1, 3815 vs 2716 at 8).
# Prompts then run MLX's 4-bit product, which costs about 1 us per row on an 8B-sized map (14336 x
# 4096: 0.51 ms at 512 rows against 0.23 to dequantize and multiply densely; 0.14 vs 0.18 at 128).
# Dequantized before the products, 8B prefill ran 13.3K prompt tok/s instead of 7.1K (one
# 512-token prompt) and 29.8K instead of 8.3K (8 of them), so prefill chunks of 512 prompt tokens
# or more run a dense copy made for them. Small maps gain nothing (1536 x 576: 0.016 vs 0.020 ms
# at 512 rows), hence `prompt_dense_min_weights`.
# On the CPU with MLX's bundled reference BLAS a float32 matmul costs about what
# a 4-bit one does per row (0.62 vs 0.71 ms at M=1, 19.6 vs 21.0 at M=32 for 1536x576), so the copy
# (0.8 s and 540 MB for SmolLM2) buys little there: the CPU keeps the quantized kernels.
# mlxfun's product runs bf16 / fp16 rows on tensor cores (the weights dequantized in registers). Per
# product on an H100 (benchmarks/results/h100/2026-12-06-qmv-shapes.json, 4-bit, the 1B and 8B
# maps summed, chained) it takes 0.90x bf16's time at 8 rows, 0.87x at 16, 1.12x at 32, 1.9x at 128: so
# decode batches of up to 32 rows keep the 4-bit weights, and larger ones run a dense copy where it
# fits (8B 4-bit at batch 128: 3,840 tok/s on the product against 10,662 for bf16).
# With MLXFUN_TILED_FROM set (a benchmark's trial of `qmm`, the tiled product), no batch copies.
GPU = WeightStrategy(dense_from=qmv.SIMT_ROWS + 1, prompt_dense_from=512, kernel_bits=(4, 8),
                     kernel_rows=32 if qmm.FROM_ROWS is None else 1 << 30)
CPU = WeightStrategy(dense_from=None)
# With a system BLAS (mlxfun.kernels.blas) float32 products run 2.6x faster at one row and 10-20x from 8,
# while the 4-bit kernels stay as they were: the copy wins at every batch size.
CPU_BLAS = WeightStrategy(dense_from=1)
QUANTIZED = WeightStrategy(dense_from=None)  # always the quantized kernels


def default_strategy() -> WeightStrategy:
    if mx.default_device() != mx.cpu:
        return GPU
    return CPU_BLAS if blas.LOADED else CPU


def quantized(params: Params) -> bool:
    return isinstance(params.layers[0].qkv, Quantized)


def kernel_serves(config: ModelConfig, params: Params, strategy: WeightStrategy) -> bool:
    """Whether the strategy's quantized kernels take every quantized map of the layers (experts
    aside) at any batch, with no dense copy. (An embedding or head of other bits runs MLX's product.)"""
    if not strategy.kernel_bits:
        return False
    E, I, HD = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim
    for layer in params.layers:
        for p, in_features in ((layer.qkv, E), (layer.o, HD), (layer.gate_up, E), (layer.down, I)):
            if isinstance(p, Quantized):
                group_size, bits = quant_shape(p, in_features)
                if bits not in strategy.kernel_bits or not qmv.fits(1, in_features, group_size, bits):
                    return False
    return True


def dense_bytes(config: ModelConfig, params: Params) -> int:
    """Bytes of a dense copy (`dense_copy`) of the quantized maps, in the activation dtype."""
    size = weights.compute_dtype(params).size
    total = 0

    def count(p, in_features: int):
        nonlocal total
        if isinstance(p, Quantized):
            total += math.prod(p.weight.shape[:-1]) * in_features * size
        return p

    weights.map_linears(config, without_experts(params), count)
    return total


def without_experts(params: Params) -> Params:
    return params._replace(layers=tuple(layer._replace(experts=None) for layer in params.layers))


def dense_copy(config: ModelConfig, params: Params) -> Params:
    """Quantized maps dequantized to the activation dtype, except a mixture's experts: a batch
    reads only the experts its tokens chose (`mx.gather_qmm`), and their dense copy would be
    most of the model (a Qwen3-30B-A3B's 4-bit weights of 17 GB against 57 GB of bf16 experts)."""
    dense = weights.cast(config, params, weights.compute_dtype(params))
    return dense._replace(layers=tuple(d._replace(experts=q.experts) for d, q in zip(dense.layers, params.layers)))


def memory_limit() -> int:
    """Bytes of memory the device has (the machine's RAM on the CPU)."""
    size = device_memory(mx.device_info()) if mx.default_device() != mx.cpu else None
    return size or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory() -> int | None:
    """Bytes the GPU has free now, other processes' use counted (CUDA reports it; else None)."""
    if mx.default_device() == mx.cpu:
        return None
    free = mx.device_info().get("free_memory")
    return int(free) if free else None


def device_memory(info: dict) -> int | None:
    """A GPU's memory from `mx.device_info()`: Metal names it memory_size, CUDA total_memory."""
    size = info.get("memory_size") or info.get("total_memory")
    return int(size) if size else None


def dense_fits(config: ModelConfig, params: Params, strategy: WeightStrategy) -> bool:
    """Whether a dense copy of quantized `params` fits beside the memory in use now."""
    need = mx.get_active_memory() + dense_bytes(config, params)
    return need <= strategy.memory_fraction * memory_limit()


def use_dense(config: ModelConfig, params: Params, batch: int, strategy: WeightStrategy) -> bool:
    if strategy.dense_from is None or batch < strategy.dense_from or not quantized(params) or \
            (batch <= strategy.kernel_rows and kernel_serves(config, params, strategy)):
        return False
    return dense_fits(config, params, strategy)


def params_for_batch(config: ModelConfig, params: Params, batch: int, strategy: WeightStrategy | None = None
                     ) -> Params:
    """`params`, or a dense copy of them (evaluated now) when the strategy picks it for `batch` rows."""
    strategy = strategy or default_strategy()
    if not use_dense(config, params, batch, strategy):
        return params
    dense = dense_copy(config, params)
    mx.eval(dense)
    return dense


def params_for_prompts(config: ModelConfig, params: Params, lengths: list[int], chunk: int,
                       strategy: WeightStrategy | None = None) -> Params:
    """`params`, or a dense copy of them for prefilling prompts of these lengths in chunks of
    `chunk` tokens, when the strategy picks it for the prompt tokens of one round of chunks. The
    copy is lazy: the first chunk computes it, and it lives as long as the caller holds it (drop it
    after prefill: decode steps of few rows read 4-bit weights)."""
    strategy = strategy or default_strategy()
    tokens = sum(min(n, chunk) for n in lengths)
    width = max(config.intermediate_size, config.moe_intermediate_size)
    if strategy.prompt_dense_from is None or tokens < strategy.prompt_dense_from or not quantized(params) or \
            config.hidden_size * width < strategy.prompt_dense_min_weights or \
            kernel_serves(config, params, strategy) or not dense_fits(config, params, strategy):
        return params
    return dense_copy(config, params)


def params_for_scoring(config: ModelConfig, params: Params, rows: int, length: int,
                       strategy: WeightStrategy | None = None) -> Params:
    """The weights a forward pass over `rows` sequences of `length` tokens (scoring, perplexity)
    multiplies by: a dense copy (evaluated now) where `generate` would use one for that many rows,
    or for a prefill of those prompts in one chunk; else `params`."""
    strategy = strategy or default_strategy()
    chosen = params_for_batch(config, params, rows, strategy)
    if chosen is params:
        chosen = params_for_prompts(config, params, [length] * rows, length, strategy)
        mx.eval(chosen)
    return chosen


def scoring_weights(config: ModelConfig, params: Params, strategy: WeightStrategy | None = None
                    ) -> Callable[[int, int], Params]:
    """`params_for_scoring` bound to a model, as `mlxfun.model.score` takes it (model/ cannot see the strategy)."""
    return lambda rows, length: params_for_scoring(config, params, rows, length, strategy)
