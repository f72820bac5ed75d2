"""Linear maps as pure functions: dense and MLX-quantized weights, their product on each backend
(mlxfun's CUDA kernels where they serve, a batch-invariant product where asked), and the MLP's
activations. The decoder (`llama.py`) and a layer of experts (`moe.py`) both build on them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

from mlxfun.errors import InputError
from mlxfun.kernels import attention as kernels
from mlxfun.kernels import dmv, qmm, qmv
from mlxfun.model import pieces
from mlxfun.model.config import ModelConfig


class Dense(NamedTuple):
    weight: mx.array  # (out, in)
    bias: mx.array | None = None  # (out,)
    # (in, out): `weight.T` evaluated as a view of the same memory (`weights.with_transposed`), so a
    # product has no transpose node: a decode step is host-bound on a GPU, and each node costs the
    # host about 1-1.4 us to replay and launch (a 1B step has 65 products).
    weight_t: mx.array | None = None


class Quantized(NamedTuple):
    """MLX affine quantization; bits and group size follow from the shapes and the input width."""

    weight: mx.array  # (out, in * bits / 32) uint32
    scales: mx.array  # (out, in / group_size)
    biases: mx.array  # (out, in / group_size)
    bias: mx.array | None = None  # (out,)


Linear = Dense | Quantized


def quant_shape(q: Quantized, in_features: int) -> tuple[int, int]:
    """(group_size, bits) of a quantized matrix with `in_features` inputs."""
    return in_features // q.scales.shape[-1], q.weight.shape[-1] * 32 // in_features


def dequantize(q: Quantized, in_features: int) -> mx.array:
    group_size, bits = quant_shape(q, in_features)
    return mx.dequantize(q.weight, q.scales, q.biases, group_size=group_size, bits=bits)


def linear(p: Linear, x: mx.array, fast: bool = False, invariant: bool = False) -> mx.array:
    """x (..., in) -> (..., out). On CUDA, quantized maps multiply more than `qmv.MAX_ROWS` rows
    (prompts, scoring) by a dense copy of this one map, dropped after its product. `fast`: on CUDA,
    quantized weights run mlxfun's product (`qmv.fits`: 4- and 8-bit, up to `qmv.MAX_ROWS` rows),
    and dense weights at 2 to `dmv.MAX_ROWS` rows its few-row product where enabled (`dmv`); they
    have no gradient. `invariant` (`ModelConfig.batch_invariant`): on CUDA, bf16 and fp16 products
    at every row count run MLX's matmul in pieces of one row count (`pieces`), or with
    MLXFUN_INVARIANT_PIECES=0 `dmv`, whose sums do not depend on the rows (quantized maps
    dequantized for them, one map at a time); no gradient with `dmv`. (`qmm`'s settings, a
    benchmark's trial of the tiled product, reroute quantized and invariant products to it.)"""
    # As (rows, in): on CUDA a (B, 1, in) input runs B one-row products (2x slower at B=8).
    rows = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    if invariant and kernels.available(x.dtype) and x.dtype != mx.float32:
        y = _invariant_product(p, rows)
    elif isinstance(p, Quantized):
        group_size, bits = quant_shape(p, x.shape[-1])
        if qmm.FROM_ROWS and rows.shape[0] >= qmm.FROM_ROWS and kernels.available(x.dtype) and \
                qmm.fits(rows.shape[0], x.shape[-1], group_size, bits, x.dtype):
            y = qmm.product(rows, p.weight, p.scales, p.biases, group_size, bits)  # (MLXFUN_TILED_FROM)
        elif fast and kernels.available(x.dtype) and qmv.fits(rows.shape[0], x.shape[-1], group_size, bits, x.dtype):
            y = qmv.product(rows, p.weight, p.scales, p.biases, group_size, bits)
        elif kernels.available(x.dtype) and rows.shape[0] > qmv.MAX_ROWS:
            # MLX's 4-bit product costs about 1 us per row on an 8B map: a transient dense map is cheaper.
            y = rows @ dequantize(p, x.shape[-1]).astype(x.dtype).T
        else:
            y = mx.quantized_matmul(rows, p.weight, p.scales, p.biases, transpose=True,
                                    group_size=group_size, bits=bits)
    elif fast and kernels.available(x.dtype) and dmv.fits(rows, p.weight):
        y = dmv.product(rows, p.weight)
    else:
        y = x @ (p.weight.T if p.weight_t is None else p.weight_t)
    y = y if y.ndim == x.ndim else y.reshape(*x.shape[:-1], -1)  # the kernels' (rows, out) back to x's shape
    return y if p.bias is None else y + p.bias


def _invariant_product(p: Linear, rows: mx.array) -> mx.array:
    """rows (M, in) @ p -> (M, out), the same bits for a row whatever M: in pieces of `pieces.ROWS`
    rows, or by `dmv`. A quantized map is dequantized first (exact, elementwise: the same dense map
    for every batch)."""
    if qmm.INVARIANT:  # (MLXFUN_INVARIANT_TILED) one sum order at every M, quantized maps read as they are
        if isinstance(p, Quantized):
            group_size, bits = quant_shape(p, rows.shape[-1])
            if qmm.fits(rows.shape[0], rows.shape[-1], group_size, bits, rows.dtype):
                return qmm.product(rows, p.weight, p.scales, p.biases, group_size, bits, invariant=True)
        elif p.weight.dtype == rows.dtype and qmm.fits(rows.shape[0], rows.shape[-1], 0, 16, rows.dtype):
            return qmm.dense(rows, p.weight, invariant=True)
    w = dequantize(p, rows.shape[-1]).astype(rows.dtype) if isinstance(p, Quantized) else p.weight
    if pieces.ROWS:  # MLX's matmul on products of one fixed shape (MLXFUN_INVARIANT_PIECES=0: dmv)
        w_t = w.T if isinstance(p, Quantized) or p.weight_t is None else p.weight_t
        return pieces.product(rows, w_t, pieces.ROWS)
    if not dmv.invariant_fits(rows, w):
        raise InputError(f"batch_invariant: no batch-invariant product for {w.dtype} weights over "
                         f"{rows.shape[-1]} inputs with {rows.dtype} activations (bf16 or fp16 on both, "
                         "inputs a multiple of 32)")
    return dmv.product(rows, w)


def activation(config: ModelConfig, gate: mx.array) -> mx.array:
    if config.hidden_act == "gelu_tanh":
        return gelu_tanh(gate)
    return silu(gate)


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU's tanh approximation (PyTorch's `gelu(approximate="tanh")`, Gemma's activation)."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)
