"""The KV cache as an immutable value: preallocated buffers plus array-valued cursors.

Every row writes the same slot, `cursor % capacity`; each slot records the position it holds
(negative: empty or padding), so masks come from positions alone and the buffer may be a ring.
The host never lets a chunk cross the buffer's end and grows the buffer (in buckets) before a row
would overwrite a slot it still sees; a bounded cache is a ring as wide as the attention window.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from mlxfun.config import ModelConfig
from mlxfun.errors import InputError


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
    if new.shape[2] == 1:
        # A one-token scatter: on CUDA a slice_update at an array-valued start copies the whole
        # buffer every step (measured 12 of 30 ms per step, 8B at batch 128); a scatter does not.
        return mx.put_along_axis(buf, mx.broadcast_to(slot.reshape(1, 1, 1, 1), new.shape), new, axis=2)
    return mx.slice_update(buf, new, slot[None], axes=(2,))


def write_positions(positions: mx.array, new: mx.array, slot: mx.array) -> mx.array:
    """positions (B, C) with new (B, T) written at slots [slot, slot + T)."""
    if new.shape[1] == 1:
        return mx.put_along_axis(positions, mx.broadcast_to(slot.reshape(1, 1), new.shape), new, axis=1)
    return mx.slice_update(positions, new, slot[None], axes=(1,))


def key_positions(cache: KVCache, new: mx.array, written: mx.array, wraps: bool = True) -> mx.array:
    """Positions of the keys a step attends over, for new tokens at positions new (B, T) whose
    write gives slot positions `written` (B, C): those for one token or a chunk that cannot
    overwrite a slot it sees (`wraps` False), else the slots before the write then the chunk (B, C + T)."""
    if new.shape[1] == 1 or not wraps:
        return written
    return mx.concatenate([cache.positions, new], axis=1)


def advance(cache: KVCache, keys: tuple, values: tuple, written: mx.array, count: int) -> KVCache:
    """The cache after a step wrote `keys`/`values` and slot positions `written` (B, C) for `count` tokens."""
    return KVCache(keys, values, written, cache.cursor + count)


def resize(cache: KVCache, new_capacity: int, cursor: int | None = None) -> KVCache:
    """The cache with `new_capacity` slots holding its newest min(old, new) slots. The buffer is
    first unrolled (oldest slot first) so each row's data stays contiguous and ends at the new
    cursor, min(old, new). `cursor`: the host's copy of the cursor (None reads it: a sync)."""
    old = capacity(cache)
    keep = min(old, new_capacity)
    shift = -((int(cache.cursor) if cursor is None else cursor) % old)

    def fit(a: mx.array, axis: int) -> mx.array:
        a = mx.roll(a, shift, axis=axis)  # newest slot last
        a = a[(slice(None),) * axis + (slice(old - keep, None),)]
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, new_capacity - keep)
        return mx.pad(a, pad, constant_values=-1 if a.dtype == mx.int32 else 0) if new_capacity > keep else a

    return KVCache(tuple(fit(k, 2) for k in cache.keys), tuple(fit(v, 2) for v in cache.values),
                   fit(cache.positions, 1), mx.array(keep, mx.int32))


def grow(cache: KVCache, new_capacity: int) -> KVCache:
    """The cache with room for `new_capacity` slots, every row's data kept (see `resize`)."""
    return cache if new_capacity <= capacity(cache) else resize(cache, new_capacity)


def slot_bytes(config: ModelConfig, dtype: mx.Dtype) -> int:
    """Bytes one slot of one row takes: keys and values of every layer, and its position."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.size + 4


def check_write(cache: KVCache, tokens: int) -> None:
    """Raise InputError unless `tokens` new tokens fit the buffer from the next slot on (a chunk
    never crosses the buffer's end). Host-side; skipped while tracing (the cursor has no value)."""
    C = capacity(cache)
    cursor = host_int(cache.cursor)
    start = None if cursor is None else cursor % C
    if tokens > C or (start is not None and start + tokens > C):
        at = "" if start is None else f" at slot {start}"
        raise InputError(f"a chunk of {tokens} tokens{at} does not fit a cache of {C} slots: write at most "
                         f"{C - (start or 0)} tokens now, or grow the cache first (cache.grow)")


def host_int(a: mx.array) -> int | None:
    """The value of a scalar array, or None while `mx.compile` traces (arrays have no value then)."""
    try:
        return int(a.item())
    except ValueError as e:
        if "function transformations" in str(e):
            return None
        raise


def place_rows(cache: KVCache, cursor: int, rows: list[int], fresh: KVCache, fresh_cursor: int) -> KVCache:
    """`cache` (at cursor `cursor`) with rows `rows` replaced by the rows of `fresh` (at
    `fresh_cursor`), aligned at their cursors: fresh's newest token lands where cache's newest
    token is. The rest of those rows is emptied; other rows are untouched. Only the placed slots
    are written, with a scatter, so admitting a row never copies the whole cache. Host-side
    cursors; at most `capacity(cache)` of fresh's newest tokens are kept."""
    C, F = capacity(cache), capacity(fresh)
    n = min(F, fresh_cursor, C)
    ts = range(fresh_cursor - n, fresh_cursor)  # stream indices of the tokens kept
    src = [t % F for t in ts]
    dst = mx.array([(cursor - fresh_cursor + t) % C for t in ts], dtype=mx.int32)  # (n,)
    take = slice(None) if src == list(range(F)) else mx.array(src, dtype=mx.int32)
    r = mx.array(rows, dtype=mx.int32)
    index = (r[:, None, None], mx.arange(cache.keys[0].shape[1])[None, :, None], dst[None, None, :])
    positions = updated(mx.full((len(rows), C), -1, mx.int32), (slice(None), dst), fresh.positions[:, take])
    return KVCache(tuple(updated(a, index, b[:, :, take]) for a, b in zip(cache.keys, fresh.keys)),
                   tuple(updated(a, index, b[:, :, take]) for a, b in zip(cache.values, fresh.values)),
                   updated(cache.positions, r, positions), cache.cursor)


def updated(a: mx.array, index, values: mx.array) -> mx.array:
    """`a` with `a[index] = values` (a scatter); `a` itself is left as it was."""
    out = mx.array(a)  # a new handle on the same data, so the assignment rebinds only `out`
    out[index] = values.astype(a.dtype)
    return out


def bucket(length: int, block: int = 256) -> int:
    """Capacity for `length` tokens: the next multiple of `block`, so attention cost follows
    the real context and a compiled step retraces once per bucket, not per token."""
    return max(block, -(-length // block) * block)


def capacity_for(length: int, window: int | None) -> int:
    """Slots for `length` tokens per row: a bucket, or the attention window when that is smaller
    (a ring of the window's width then holds everything a query sees)."""
    return bucket(length) if window is None else min(bucket(length), window)
