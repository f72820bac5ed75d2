"""A layer of experts (Mixtral, Qwen3-MoE): each token routed to its best experts inside the
batch, their maps applied by gathered products (MLX's `gather_mm` / `gather_qmm`, or on CUDA for
dense experts in decode steps `dmv.experts_product`), and their outputs summed with the router's
probabilities. `llama.mlp` runs it for the layers that have experts."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from mlxfun.kernels import attention as kernels
from mlxfun.kernels import dmv
from mlxfun.model import linear as maps
from mlxfun.model.config import ModelConfig
from mlxfun.model.linear import Linear


class Experts(NamedTuple):
    """A mixture-of-experts MLP (`config.moe_layers`): n experts of width I, stacked."""

    router: Linear  # E -> n
    gate_up: Linear  # stacked (n, 2 * I, E): each expert's gate then up rows
    down: Linear  # stacked (n, E, I)


# Routed (token, expert) pairs from which a layer of experts sorts them by expert first: a batch
# then reads each expert's weights once for all its tokens (`mx.gather_mm`'s sorted form), as
# mlx-lm's SwitchGLU does at the same size.
SORT_ROUTES = 64
# Sorted routes through one gathered product at most: MLX's CUDA 4-bit product (`qmm_sm80`) puts
# one route per block along the grid's z, which CUDA caps at 65,535, so a prefill chunk of more
# than 8,191 tokens at 8 experts each failed to launch ("cuGraphAddKernelNode ... invalid
# argument"). Each slice of the sorted routes is still sorted.
MAX_ROUTES = 65535
# Routes (token, expert) up to which dense experts run mlxfun's product on CUDA (`layer(fast=True)`):
# decode steps of 2 to 128 tokens at 8 experts each. A block reads an expert's map once for all
# its rows, where MLX's grouped product took 22 ms a step at 8 tokens of a Qwen3-30B-A3B shape
# (bf16, 24 layers, H100), 5x its one-token step. Prompts keep MLX's grouped product, and so does
# a single token, for which it was the faster (6 layers: 871 tok/s against the kernel's 801).
KERNEL_ROUTES = 1024
KERNEL_MIN_TOKENS = 2


def layer(config: ModelConfig, experts: Experts, x: mx.array, fast: bool = False) -> mx.array:
    """x (..., E) -> (..., E): each token through its `experts_per_tok` best experts (a softmax
    over the router's scores, in float32, as Mixtral and Qwen3-MoE route), their outputs summed
    with those probabilities (renormalised over the chosen when `norm_topk_prob`). `fast`: on
    CUDA, dense experts of KERNEL_MIN_TOKENS tokens to KERNEL_ROUTES routes run mlxfun's product
    (`dmv.experts_product`)."""
    E, k = x.shape[-1], config.experts_per_tok
    flat = x.reshape(-1, E)  # (N, E)
    probs = mx.softmax(maps.linear(experts.router, flat).astype(mx.float32), axis=-1, precise=True)  # (N, n)
    chosen = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # (N, k)
    weight = mx.take_along_axis(probs, chosen, axis=-1)  # (N, k)
    if config.norm_topk_prob:
        weight = weight / weight.sum(axis=-1, keepdims=True)
    N = flat.shape[0]
    kernel = fast and KERNEL_MIN_TOKENS <= N and N * k <= KERNEL_ROUTES and isinstance(experts.down, maps.Dense) \
        and kernels.available(x.dtype) and dmv.experts_fit(flat, experts.gate_up.weight)
    if N * k >= SORT_ROUTES or kernel:
        routes = chosen.flatten()  # (N k,)
        order = mx.argsort(routes)
        rows, index = flat[order // k], routes[order]  # (N k, E), (N k,): grouped by expert
        if kernel:
            y = expert_mlp(config, experts, rows, index, True, kernel=True)  # (N k, E)
        elif N * k <= MAX_ROUTES:  # nearly always: one product, no slicing or copying
            y = expert_mlp(config, experts, rows[:, None], index, True)  # (N k, 1, E)
        else:
            y = mx.concatenate([expert_mlp(config, experts, rows[s:s + MAX_ROUTES, None], index[s:s + MAX_ROUTES],
                                           True) for s in range(0, N * k, MAX_ROUTES)])
        y = y[mx.argsort(order)]  # back in route order
    else:
        y = expert_mlp(config, experts, flat[:, None, None], chosen, False)  # (N, k, 1, E)
    y = y.reshape(N, k, E)
    return (y * weight[..., None].astype(y.dtype)).sum(axis=1).reshape(x.shape)


def expert_mlp(config: ModelConfig, experts: Experts, x: mx.array, index: mx.array, grouped: bool,
               kernel: bool = False) -> mx.array:
    """x (..., 1, E) through the experts `index` names (broadcast against x's batch dims) ->
    (..., 1, E). `grouped`: the index is sorted. `kernel`: x (R, E) rows sorted by expert, through
    mlxfun's product (dense experts on CUDA) -> (R, E)."""
    gate, up = mx.split(expert_product(experts.gate_up, x, index, grouped, kernel), 2, axis=-1)
    return expert_product(experts.down, maps.activation(config, gate) * up, index, grouped, kernel)


def expert_product(p: Linear, x: mx.array, index: mx.array, grouped: bool, kernel: bool = False) -> mx.array:
    """x (..., 1, in) times the stacked maps `index` picks (n, out, in) -> (..., 1, out); with
    `kernel`, x (R, in) sorted by expert -> (R, out)."""
    if kernel:
        return dmv.experts_product(x, p.weight, index)
    if isinstance(p, maps.Quantized):
        group_size, bits = maps.quant_shape(p, x.shape[-1])
        return mx.gather_qmm(x, p.weight, p.scales, p.biases, rhs_indices=index, transpose=True,
                             group_size=group_size, bits=bits, sorted_indices=grouped)
    w = p.weight.swapaxes(-1, -2) if p.weight_t is None else p.weight_t  # (n, in, out)
    return mx.gather_mm(x, w, rhs_indices=index, sorted_indices=grouped)
