"""The Llama-family decoder as pure functions over NamedTuple parameter trees.

`forward(config, params, tokens, positions, mask, cache) -> (logits, cache)` computes logits for
`tokens (B, T)` at `positions (B, T)`. A negative position marks left padding: its keys are
never visible. Positions must be consecutive along T within a row (RoPE starts from the first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from mlxfun.errors import InputError
from mlxfun.kernels import attention as kernels
from mlxfun.model import cache as kv
from mlxfun.model import masks, moe
from mlxfun.model.config import ModelConfig
from mlxfun.model.linear import Dense as Dense
from mlxfun.model.linear import Linear as Linear
from mlxfun.model.linear import Quantized as Quantized
from mlxfun.model.linear import activation as activation
from mlxfun.model.linear import dequantize as dequantize
from mlxfun.model.linear import gelu_tanh as gelu_tanh
from mlxfun.model.linear import linear as linear
from mlxfun.model.linear import quant_shape as quant_shape
from mlxfun.model.linear import silu as silu
from mlxfun.model.moe import Experts as Experts


class Layer(NamedTuple):
    attn_norm: mx.array  # (E,)
    qkv: Linear  # E -> (H + 2 * Hkv) * D, q/k/v fused at load time
    o: Linear  # H * D -> E
    mlp_norm: mx.array  # (E,)
    gate_up: Linear | None  # E -> 2 * I, gate then up (None in a layer of experts)
    down: Linear | None  # I -> E
    q_norm: mx.array | None = None  # (D,) Qwen3, Gemma 3
    k_norm: mx.array | None = None  # (D,)
    attn_post_norm: mx.array | None = None  # (E,) on attention's output (Gemma's sandwich norms)
    mlp_post_norm: mx.array | None = None  # (E,) on the MLP's output
    experts: Experts | None = None  # in place of gate_up / down


class Params(NamedTuple):
    embed: Linear  # (V, E) table, used as lm_head when tied
    layers: tuple[Layer, ...]
    norm: mx.array  # (E,)
    lm_head: Linear | None = None  # (V, E); None when tied to `embed`


def embed(p: Linear, tokens: mx.array, hidden_size: int) -> mx.array:
    """tokens (...) -> (..., E): rows of the table, dequantized if needed."""
    if isinstance(p, Quantized):
        group_size, bits = quant_shape(p, hidden_size)
        return mx.dequantize(p.weight[tokens], p.scales[tokens], p.biases[tokens],
                             group_size=group_size, bits=bits)
    return p.weight[tokens]


class Rotation(NamedTuple):
    """How one kind of layer rotates its queries and keys (`rotations`), made once per pass: its
    tables rebuilt by each of 16 layers cost a prefill chunk 0.3 ms of host time on this project's
    CPU."""

    dims: int  # the first `dims` of each head rotate (Phi's partial rotary), pairs (i, i + dims / 2)
    base: float | None  # mx.fast.rope's base, where no periods are given
    scale: float  # position scale (linear scaling)
    periods: mx.array | None  # (dims / 2,) per-pair periods (1 / frequency), or None
    long_periods: mx.array | None = None  # longrope: periods from position `switch` on
    switch: int = 0
    gain: mx.array | None = None  # (D,) longrope's attention factor on the rotated dims


def _periods(config: ModelConfig) -> list[float] | None:
    """Per-pair periods for llama3 scaling or explicit frequency factors; None where mx.fast.rope's
    base suffices."""
    d = config.head_dim
    inv = [config.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    if config.rope_freq_factors is not None:
        return [f / i for f, i in zip(config.rope_freq_factors, inv)]
    s = config.rope_scaling
    if s is None or s.kind != "llama3":
        return None
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return [1.0 / f for f in out]


def rotations(config: ModelConfig) -> tuple[Rotation, Rotation]:
    """(the rotation of most layers, that of `config.local_layers`). Gemma 3's local layers use
    their own base, unscaled; longrope (Phi-3) uses its short factors below its original context
    and its long ones from there on, chosen per token: a key keeps the rotation it was written
    with, so a row's tokens never depend on how long it or its neighbours grow (Hugging Face
    picks one set per sequence, by its length; the two agree on any sequence within the
    original context)."""
    dims = config.rotary_dim or config.head_dim
    s = config.rope_scaling
    if s is not None and s.kind == "longrope":
        base = [config.rope_theta ** (2 * i / dims) for i in range(dims // 2)]
        gain = [s.attention_factor] * dims + [1.0] * (config.head_dim - dims)
        main = Rotation(dims, None, 1.0, mx.array([f * b for f, b in zip(s.short_factor, base)], dtype=mx.float32),
                        mx.array([f * b for f, b in zip(s.long_factor, base)], dtype=mx.float32),
                        s.original_max_position_embeddings,
                        None if s.attention_factor == 1.0 else mx.array(gain, dtype=mx.float32))
    else:
        periods = _periods(config)
        main = Rotation(dims, None if periods is not None else config.rope_theta,
                        1.0 / s.factor if s is not None and s.kind == "linear" else 1.0,
                        None if periods is None else mx.array(periods, dtype=mx.float32))
    local = main if config.local_rope_theta is None else Rotation(dims, config.local_rope_theta, 1.0, None)
    return main, local


def rope(config: ModelConfig, x: mx.array, offset: mx.array, rot: Rotation) -> mx.array:
    """x (B, H, T, D) rotated for positions offset[b] + t; offset (B,) int32; rot: `rotations`."""

    def turn(periods):
        return mx.fast.rope(x, rot.dims, traditional=config.rope_traditional, base=rot.base if periods is None
                            else None, scale=rot.scale, offset=offset, freqs=periods)

    if rot.gain is not None:
        x = x * rot.gain.astype(x.dtype)  # rotation is linear: scaling before is scaling after
    if rot.long_periods is None:
        return turn(rot.periods)
    pos = offset[:, None] + mx.arange(x.shape[2], dtype=offset.dtype)  # (B, T)
    return mx.where((pos >= rot.switch)[:, None, :, None], turn(rot.long_periods), turn(rot.periods))


class LayerCache(NamedTuple):
    """One layer's view of the cache in a forward pass (see `hidden`)."""

    keys: mx.array  # (N * bs, K, 1, D) the pool before this pass's write
    values: mx.array  # (N * bs, K, 1, D)
    table: mx.array  # (B, W) each row's blocks
    block_size: int
    slots: mx.array  # (B, T) where this pass's tokens are written
    wraps: bool  # the write may overwrite slots the chunk's own queries see
    fresh: bool = False  # the rows hold nothing before this chunk: it attends over itself alone
    run: mx.array | None = None  # (1,): `slots` are the run [run, run + B * T) (`kv.write_run`)


def attention(config: ModelConfig, layer: Layer, x: mx.array, offset: mx.array, rot: Rotation,
              mask: mx.array, bias: mx.array, cache: LayerCache | None, fast: bool = False
              ) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
    """x (B, T, E), or (B, E) for one token per row, offset (B,) and rot (`rope`), mask (B, T, S)
    and bias, the same mask as `additive_mask` makes it (for MLX's fused kernel off Metal; `hidden`
    makes both once per pass) -> (output shaped as x, this layer's pools after the write, or None
    without a cache).

    Keys are the T new tokens without a cache. With one, the new keys are written at their slots
    and a row's keys are read through its table: after the write (S = W * bs), unless the chunk
    `wraps` (it may overwrite ring slots its earlier queries still see): then the slots before the
    write followed by the chunk (S = W * bs + T). `fast`: mlxfun's CUDA kernels may run (see
    `hidden`); attention is one kernel in a one-token step, reading the pools through the table.
    A (B, E) x takes fewer graph nodes (no flatten/unflatten around each product, no transposes):
    decode steps are host-bound on a GPU, and each node costs the host about 1-3 us."""
    B, T = x.shape[0], 1 if x.ndim == 2 else x.shape[1]
    H, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    inv = config.batch_invariant
    qkv = linear(layer.qkv, x, fast, inv)
    if x.ndim == 2:
        qkv = qkv.reshape(B, H + 2 * K, 1, D)
    else:
        qkv = qkv.reshape(B, T, H + 2 * K, D).transpose(0, 2, 1, 3)  # (B, H + 2K, T, D)
    v = qkv[:, H + K:]  # (B, K, T, D)
    if layer.q_norm is None:
        qk = rope(config, qkv[:, :H + K], offset, rot)  # queries and keys rotated by one kernel
        q, k = qk[:, :H], qk[:, H:]  # (B, H, T, D), (B, K, T, D)
    else:
        q = rope(config, mx.fast.rms_norm(qkv[:, :H], layer.q_norm, config.rms_norm_eps), offset, rot)
        k = rope(config, mx.fast.rms_norm(qkv[:, H:H + K], layer.k_norm, config.rms_norm_eps), offset, rot)
    scale, cap = config.attention_scale, config.attn_softcap

    written, out = None, None
    if cache is None:
        keys, values = k, v
    else:
        if cache.run is not None:  # (N * bs, K, 1, D) each
            written = (kv.write_run(cache.keys, k, cache.run), kv.write_run(cache.values, v, cache.run))
        else:
            written = (kv.write(cache.keys, k, cache.slots), kv.write(cache.values, v, cache.slots))
        if fast and x.ndim == 2 and kernels.serves_attention(D, H // K, x.dtype):
            # The kernel scales by 1 / sqrt(D): another scale (Gemma's query_pre_attn_scalar) goes on q.
            if scale != D ** -0.5:
                q = q * (scale * D ** 0.5)
            if layer.q_norm is not None or scale != D ** -0.5:
                qk = mx.concatenate([q, k], axis=1)  # (B, H + K, 1, D)
            out = kernels.decode_attention(qk, *written, cache.table, mask, H, cap, inv)  # (B, H * D)
            return reduce(config, linear(layer.o, out, fast, inv)), written
        if cache.fresh:
            keys, values = k, v  # (B, K, T, D): nothing to read from the pool
        elif (T == 1 or not cache.wraps) and mx.default_device() == mx.cpu:
            out = paged_attention(q, *written, cache.table, cache.block_size, mask, scale, cap)  # (B, H, T, D)
        elif T == 1 or not cache.wraps:
            keys, values = (kv.gather(w, cache.table, cache.block_size) for w in written)  # (B, K, S, D)
        else:
            keys = mx.concatenate([kv.gather(cache.keys, cache.table, cache.block_size), k], axis=2)  # (B, K, S + T, D)
            values = mx.concatenate([kv.gather(cache.values, cache.table, cache.block_size), v], axis=2)
    if out is None and (cap is not None or not fused_masked_attention() and (
            T == 1 or B * H * T * keys.shape[2] <= grouped_max_scores(q.dtype))):
        out = grouped_attention(q, keys, values, mask, scale, cap)  # MLX's fused kernels have no soft-cap
    elif out is None:
        # Metal's kernels take a bool mask as it is.
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale,
                                                   mask=mask[:, None] if fused_masked_attention() else bias)
    out = out.reshape(B, H * D) if x.ndim == 2 else out.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    return reduce(config, linear(layer.o, out, fast, inv)), written


# Off Metal, attention up to this many scores runs as `grouped_attention`: on CUDA a one-token step
# has no fused masked kernel (MLX 0.32 falls back to matmuls that copy every key once per query
# head), and cuDNN builds a graph per new prefill shape (42-63 ms each on an H200), which small
# prefills of varied sizes, as continuous batching admits them (32 rows x 128 tokens: 2^24 scores),
# would pay again and again. Above it the fused kernel, given an additive mask, is 2.2-5.5x faster
# (1B's heads, 16 layers: 64 x 128 tokens 2.1 against 6.6 ms, 128 x 128 3.3 against 11.8, 8 x 2,048
# 20 against 109; benchmarks/attention_paths.py, a probe since removed), so a shape repeated a few
# times repays its build.
# cuDNN serves 16-bit types only: float32 would run MLX's unfused fallback, no faster, and a batch
# whose chunk crossed the limit would attend by other arithmetic than its rows alone (greedy
# batched == alone is checked in float32). So float32, and the CPU, where both paths took the same
# time (1 x 1,536 tokens of SmolLM2's heads) and the fused one peaked 13% higher, keep 2^26.
GROUPED_MAX_SCORES = 1 << 24
WIDE_GROUPED_MAX_SCORES = 1 << 26


def grouped_max_scores(dtype: mx.Dtype) -> int:
    """Scores up to which attention over `dtype` runs as `grouped_attention` here (off Metal)."""
    fused = mx.default_device() != mx.cpu and dtype in (mx.float16, mx.bfloat16)
    return GROUPED_MAX_SCORES if fused else WIDE_GROUPED_MAX_SCORES


def fused_masked_attention() -> bool:
    """Whether MLX has fused kernels for attention under a mask at every query length (Metal)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def additive_mask(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """mask (B, T, S) bool -> (B, 1, T, S) `dtype`: 0 where visible, -inf where not. MLX's CUDA
    attention takes no bool mask: given one, it broadcasts it over the query heads and then makes
    it additive, (B, H, T, S) per call (128 x 128 tokens of the 1B: 134 MB a layer)."""
    return mx.where(mask[:, None], mx.array(0, dtype), mx.array(-mx.inf, dtype))


def grouped_attention(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float,
                      cap: float | None = None) -> mx.array:
    """q (B, H, T, D), keys/values (B, K, S, D), mask (B, T, S) bool -> (B, H, T, D); scores
    soft-capped at `cap` (cap * tanh(s / cap), Gemma 2) if given.

    The H / K query heads that share a key head form one matrix, so each key is read once per
    key head, never copied per query head."""
    B, H, T, D = q.shape
    K, S = keys.shape[1], keys.shape[2]
    G = H // K
    scores = (q.reshape(B, K, G * T, D) @ keys.swapaxes(-1, -2)).reshape(B, K, G, T, S)
    # Scaling here rather than q lets compilation fuse it with the mask: one kernel fewer.
    scores = scores * scale if cap is None else mx.tanh(scores * (scale / cap)) * cap
    scores = mx.where(mask[:, None, None], scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, K, G * T, S)
    return (probs @ values).reshape(B, H, T, D)


def paged_attention(q: mx.array, keys: mx.array, values: mx.array, table: mx.array, block_size: int,
                    mask: mx.array, scale: float, cap: float | None = None) -> mx.array:
    """q (B, H, T, D), keys/values pools (N * bs, K, 1, D), table (B, W), mask (B, T, S = W * bs) bool
    -> (B, H, T, D): `grouped_attention` over each row's slots, read through its table.

    Each row's keys are taken from the pool straight into the (B, K, S, D) layout the products
    read, one index per (row, key head, slot): one copy, where gathering the blocks and then
    transposing them made two."""
    B, H, T, D = q.shape
    K, W = keys.shape[1], table.shape[1]
    slot = (table[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32)).reshape(B, 1, W * block_size)
    index = slot * K + mx.arange(K, dtype=mx.int32)[None, :, None]  # (B, K, S): rows of the pool's (N bs K, D) view
    return grouped_attention(q, keys.reshape(-1, D)[index], values.reshape(-1, D)[index], mask, scale, cap)


def layer_masks(config: ModelConfig, positions: mx.array, key_pos: mx.array, mask: mx.array | None,
                slotted: bool = False, pinned: int = 0) -> dict[tuple[int | None, int], mx.array]:
    """One (B, T, S) mask per distinct (layer window, sinks) (`config.layer_sinks`: a ring of
    `max_kv_size` keeps the row's first positions visible), built once per forward pass.
    `slotted`: key_pos are what the row's slots hold; `pinned`: their ring's kept slots
    (`masks.causal`)."""
    base = masks.causal(positions, key_pos, slotted, pinned) if mask is None else mask
    windowed = {(w, n): base if w is None else base & masks.window(positions, key_pos, w, n)
                for w, n in set(zip(config.layer_windows, config.layer_sinks))}
    # A given mask may hide every key from a real query; one made from positions never does.
    if mask is None:
        return {w: masks.padding_sees_all(m, positions) for w, m in windowed.items()}
    return {w: masks.never_empty(m) for w, m in windowed.items()}


def mlp(config: ModelConfig, layer: Layer, x: mx.array, fast: bool = False) -> mx.array:
    """x (..., E) -> (..., E): the gated MLP, or the layer's experts."""
    if layer.experts is not None:
        return reduce(config, moe.layer(config, layer.experts, x, fast))
    gate, up = mx.split(linear(layer.gate_up, x, fast, config.batch_invariant), 2, axis=-1)  # (B, T, I) each
    return reduce(config, linear(layer.down, activation(config, gate) * up, fast, config.batch_invariant))


def reduce(config: ModelConfig, x: mx.array) -> mx.array:
    """The output of a map split by its inputs across the tensor group (o, down: `mlxfun.shard`):
    each rank holds a partial sum, so every rank adds them all. Without a group, x itself."""
    return x if config.tensor_group is None else mx.distributed.all_sum(x, group=config.tensor_group)


# `hidden(launch=...)` hands over the graph after this many layers. Building a layer's graph takes
# the host about 0.1 ms (16 layers of the 1B: 1.64 ms on this project's CPU), where the 1B's layer
# over 4,096 prompt tokens keeps an H200 busy about 1.7 ms (27 ms for 16): two layers launched
# first keep the device ahead of the host building the rest.
LAUNCH_LAYERS = 2


def hidden(config: ModelConfig, params: Params, tokens: mx.array, positions: mx.array,
           mask: mx.array | None = None, cache: kv.KVCache | None = None, *, slots: mx.array | None = None,
           run: mx.array | None = None, wraps: bool = True, fresh: bool = False, fast: bool = False, check: bool = True,
           launch: Callable[[list[mx.array]], None] | None = None):
    """tokens (B, T), positions (B, T) -> (final hidden states (B, T, E), new cache or None).

    With a cache, each token's keys and values are written at the slot its position maps to through
    the row's table (`cache.slots`; `slots` (B, T) overrides it), and the row reads its keys through
    the table. `run` (1,) promises that those slots are the run [run, run + B * T) in row-major
    order, every position real (`kv.run_start` checks it on the host): the writes are then slice
    updates (`kv.write_run`), a copy rather than a scatter. `mask` (B, T, S) is the padding/causal
    visibility over those keys (see `attention` for their order); None derives it from positions
    (`masks.causal`). Layer windows are applied on top. `wraps=False` promises that the write
    overwrites no slot the chunk's own queries see (no ring wraps within it), so it attends after
    writing (S = W * bs) instead of over the slots before the write followed by the chunk (S = W *
    bs + T). `fresh` promises that the rows hold no keys before this chunk (a prompt's first chunk):
    it attends over itself alone (S = T), reading nothing from the pool, and still writes it.
    `fast`: on CUDA, run mlxfun's kernels where they apply (`kernels`: one-token attention; `qmv`:
    few-row 4-bit products). They have no gradients: the decode and prefill steps of `mlxfun.engine.step`
    set it, and everything else (scoring, `mx.grad`) runs MLX ops, the same math. `check`: raise
    InputError, before any work, if the tokens do not fit the cache (`cache.check_write`; it reads
    the positions, so the scheduler, which knows them on the host, turns it off). `launch` is called
    once, after the first LAUNCH_LAYERS layers, with [their hidden state]: a caller whose device is
    idle starts it (`mx.async_eval`) while the host builds the rest of the graph. Their writes wait
    for the caller's launch of the whole (where nothing else holds the pool: written in place). Only
    where attention reads no write (`fresh`, or a chunk that `wraps`), and not while tracing (a
    compiled function has nothing to launch).
    """
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise InputError(f"tokens and positions must both be (B, T), got {tokens.shape} and {positions.shape}")
    if cache is not None and check:
        kv.check_write(cache, positions, full_attention=config.max_window is None)
    step = cache is not None and tokens.shape[1] == 1  # one token per row: (B, E) activations
    h = embed(params.embed, tokens[:, 0] if step else tokens, config.hidden_size)
    slotted = False  # key_pos are what the rows' slots hold, their own or not (the masks check)
    pinned = 0  # a ring's first slots, kept for its attention sinks (`kv.pinned_slots`)
    if cache is None:
        key_pos = positions  # (B, T)
    else:
        bs = kv.block_size(cache)
        pinned = kv.pinned_slots(config.sinks, bs)
        slots = kv.slots(cache.table, positions, bs, pinned) if slots is None else slots  # (B, T)
        held = (kv.write_positions(cache.positions, slots, positions) if run is None
                else kv.write_positions_run(cache.positions, run, positions))  # (N, bs)
        if fresh:
            key_pos = positions  # (B, T)
        elif tokens.shape[1] == 1 or not wraps:
            key_pos, slotted = kv.held_positions(held, cache.table), True  # (B, S)
        else:
            before = kv.gather_positions(cache.positions, cache.table, pinned, positions[:, :1])  # (B, S)
            key_pos = mx.concatenate([before, positions], axis=1)
    layer_mask = layer_masks(config, positions, key_pos, mask, slotted, pinned)
    if config.embed_scale:
        h = h * mx.array(math.sqrt(config.hidden_size), h.dtype)  # in the activation dtype, as Gemma rounds it
    # Additive forms for MLX's fused attention, built once per pass (lazily: unused, never run).
    layer_bias = {w: additive_mask(m, h.dtype) for w, m in layer_mask.items()}
    unread = cache is not None and (fresh or (wraps and tokens.shape[1] > 1))  # attention reads no write
    # Else the first layers' output needs their writes (or nothing is left to build after them).
    launch = launch if unread and len(params.layers) > LAUNCH_LAYERS else None
    offset, (rot, local_rot) = positions[:, 0], rotations(config)  # (B,) RoPE starts here in each row
    new_keys, new_values = [], []
    for i, layer in enumerate(params.layers):
        layer_cache = None if cache is None else LayerCache(cache.keys[i], cache.values[i], cache.table, bs, slots,
                                                            wraps, fresh, run)
        w = config.layer_windows[i], config.layer_sinks[i]
        a, written = attention(config, layer, mx.fast.rms_norm(h, layer.attn_norm, config.rms_norm_eps),
                               offset, local_rot if config.local_layers[i] else rot, layer_mask[w], layer_bias[w],
                               layer_cache, fast)
        if unread and (launch is None or i >= LAUNCH_LAYERS):
            # Nothing read the writes, so MLX would run them after the last layer, every layer's
            # keys and values (and the projections they are views of) alive until then: 5 GB of
            # an 8B admission of 8,192 tokens on an H200. The layer's output waits for them. (Not
            # the layers launched early: their writes wait for the final launch, as every write
            # did before, once the caller has let go of the pool. A write launched while the
            # caller holds it is not in place: a 2-layer model whose writes all went out that way
            # peaked at 2.2 pools on this CPU, against 1.2.)
            a = mx.depends(a, list(written))
        h = h + (a if layer.attn_post_norm is None else mx.fast.rms_norm(a, layer.attn_post_norm, config.rms_norm_eps))
        m = mlp(config, layer, mx.fast.rms_norm(h, layer.mlp_norm, config.rms_norm_eps), fast)
        h = h + (m if layer.mlp_post_norm is None else mx.fast.rms_norm(m, layer.mlp_post_norm, config.rms_norm_eps))
        if written is not None:
            new_keys.append(written[0])
            new_values.append(written[1])
        if launch is not None and i + 1 == LAUNCH_LAYERS:
            launch([h])
    h = mx.fast.rms_norm(h, params.norm, config.rms_norm_eps)
    h = h[:, None] if step else h  # (B, T, E)
    if cache is None:
        return h, None
    return h, kv.KVCache(tuple(new_keys), tuple(new_values), held, cache.table)


def step_attention_kernel(config: ModelConfig, params: Params) -> bool:
    """Whether a one-token step's attention runs mlxfun's kernel (`attention`, with `fast`): CUDA,
    and a head layout the kernel serves."""
    group = config.num_heads // config.num_kv_heads
    return bool(params.layers) and kernels.serves_attention(config.head_dim, group, params.norm.dtype)


def logits(config: ModelConfig, params: Params, h: mx.array, fast: bool = False) -> mx.array:
    """h (..., E) -> logits (..., V), soft-capped where the model caps them (Gemma 2)."""
    out = linear(params.embed if params.lm_head is None else params.lm_head, h, fast, config.batch_invariant)
    cap = config.final_softcap
    return out if cap is None else mx.tanh(out / cap) * cap


def forward(config: ModelConfig, params: Params, tokens: mx.array, positions: mx.array,
            mask: mx.array | None = None, cache: kv.KVCache | None = None):
    """tokens (B, T), positions (B, T) -> (logits (B, T, V), new cache or None)."""
    h, cache = hidden(config, params, tokens, positions, mask, cache)
    return logits(config, params, h), cache
