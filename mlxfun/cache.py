"""The KV cache as an immutable value: preallocated buffers plus array-valued cursors.

Every row writes the same slot, `cursor % capacity`; each slot records the position it holds
(negative: empty or padding), so masks come from positions alone and the buffer may be a ring.
The host keeps `cursor + T <= capacity` for a linear cache (growing it in buckets) and never lets
a chunk cross the ring's end; a ring is a cache whose capacity is the model's attention window.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from mlxfun.config import ModelConfig


class KVCache(NamedTuple):
    keys: tuple[mx.array, ...]  # per layer (B, Hkv, C, D)
    values: tuple[mx.array, ...]  # per layer (B, Hkv, C, D)
    positions: mx.array  # (B, C) int32: position held by each slot, < 0 for empty or padding
    cursor: mx.array  # () int32: tokens written so far; the next write starts at cursor % C


def empty(config: ModelConfig, batch: int, capacity: int, dtype: mx.Dtype) -> KVCache:
    shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    return KVCache(
        keys=tuple(mx.zeros(shape, dtype) for _ in range(config.num_layers)),
        values=tuple(mx.zeros(shape, dtype) for _ in range(config.num_layers)),
        positions=mx.full((batch, capacity), -1, mx.int32),
        cursor=mx.array(0, mx.int32),
    )


def capacity(cache: KVCache) -> int:
    return cache.positions.shape[1]


def next_slot(cache: KVCache) -> mx.array:
    """() int32: the slot the next write starts at."""
    return cache.cursor % cache.positions.shape[1]


def write(buf: mx.array, new: mx.array, slot: mx.array) -> mx.array:
    """buf (B, H, C, D) with new (B, H, T, D) written at slots [slot, slot + T)."""
    return mx.slice_update(buf, new, slot[None], axes=(2,))


def write_positions(positions: mx.array, new: mx.array, slot: mx.array) -> mx.array:
    """positions (B, C) with new (B, T) written at slots [slot, slot + T)."""
    return mx.slice_update(positions, new, slot[None], axes=(1,))


def advance(cache: KVCache, keys: tuple, values: tuple, new_positions: mx.array, slot: mx.array) -> KVCache:
    """The cache after a step wrote `keys`/`values` for tokens at `new_positions` (B, T)."""
    return KVCache(keys, values, write_positions(cache.positions, new_positions, slot),
                   cache.cursor + new_positions.shape[1])


def grow(cache: KVCache, new_capacity: int) -> KVCache:
    """A linear (never wrapped) cache with room for `new_capacity` slots; contents unchanged."""
    extra = new_capacity - capacity(cache)
    if extra <= 0:
        return cache
    pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
    return KVCache(
        keys=tuple(mx.pad(k, pad) for k in cache.keys),
        values=tuple(mx.pad(v, pad) for v in cache.values),
        positions=mx.pad(cache.positions, [(0, 0), (0, extra)], constant_values=-1),
        cursor=cache.cursor,
    )


def bucket(length: int, block: int = 256) -> int:
    """Capacity for `length` tokens: the next multiple of `block`, so attention cost follows
    the real context and a compiled step retraces once per bucket, not per token."""
    return max(block, -(-length // block) * block)
