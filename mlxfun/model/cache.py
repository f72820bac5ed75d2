"""The KV cache as an immutable value: a pool of fixed-size blocks and a block table per row.

`keys[i]` / `values[i]` (N * bs, Hkv, 1, D) hold N blocks of bs slots for layer i, slot by slot
(block n is rows n * bs ... n * bs + bs - 1, so a write is one scatter along the first axis; a
slot is shaped (Hkv, 1, D) as a one-token step computes its keys, so that write has no reshape
around it: a decode step is host-bound on a GPU, and each graph node costs; a chunk whose slots
are one run, equal rows in consecutive blocks, is one slice update instead), and
`positions` (N, bs) the position each slot holds (< 0: empty). `table` (B, W) lists each row's
blocks: the positions [j * bs, (j + 1) * bs) of row b live in block `table[b, j % W]`, so where a
row is meant to outrun W * bs slots (windowed layers, `max_kv_size`) its columns are reused as a ring.
A ring of `max_kv_size` keeps its row's first blocks, which hold the attention sinks
(`config.SINK_TOKENS`), in its first columns for good: its other columns take the later blocks
in turn (`pinned_slots`, `masks.ring_index`).

A token's slot follows from its position (`slots`), so there is no cursor, and rows advance at
their own pace. Block 0 is scratch: padding tokens (negative positions) are written there with
their positions, and columns without a block of their own point to it, so it is never visible. Masks
come from the positions of the slots a row reads (`held_positions`), so padding, causality,
windows and blocks shared between rows (a common prefix) are one formula. A freshly allocated
block is not cleared: a slot counts only if the position it holds maps to that slot, so what a
previous owner left is never seen. A row reads its keys through its table: gathered here, or by
the CUDA decode kernel directly.

Who owns which block is the host's business (`mlxfun.engine.blocks`); `empty` gives each row blocks of
its own, which is what a single forward pass or a research loop needs.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlxfun.errors import InputError
from mlxfun.model.config import ModelConfig
from mlxfun.model.masks import own_slots, ring_index
from mlxfun.model.scalars import dynamic

BLOCK = 16  # slots per block in the scheduler's pool


class KVCache(NamedTuple):
    keys: tuple[mx.array, ...]  # per layer (N * bs, Hkv, 1, D): a pool of N blocks of bs slots
    values: tuple[mx.array, ...]  # per layer (N * bs, Hkv, 1, D)
    positions: mx.array  # (N, bs) int32: position held by each slot, < 0 for empty or scratch
    table: mx.array  # (B, W) int32: row b's j-th block of positions is table[b, j % W]


def pool(config: ModelConfig, blocks: int, block_size: int, dtype: mx.Dtype
         ) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...], mx.array]:
    """Empty pool arrays: (keys, values, positions) of `blocks` blocks (block 0: scratch)."""
    shape = (blocks * block_size, config.num_kv_heads, 1, config.head_dim)
    return (tuple(mx.zeros(shape, dtype) for _ in range(config.num_layers)),
            tuple(mx.zeros(shape, dtype) for _ in range(config.num_layers)),
            mx.full((blocks, block_size), -1, mx.int32))


def empty(config: ModelConfig, batch: int, capacity: int, dtype: mx.Dtype, block_size: int = BLOCK) -> KVCache:
    """A cache of `capacity` slots per row (rounded up to whole blocks of min(block_size,
    capacity)), each row with blocks of its own."""
    bs = min(block_size, capacity)
    W = -(-capacity // bs)
    keys, values, positions = pool(config, 1 + batch * W, bs, dtype)
    return KVCache(keys, values, positions, 1 + mx.arange(batch * W, dtype=mx.int32).reshape(batch, W))


def block_size(cache: KVCache) -> int:
    return cache.positions.shape[1]


def capacity(cache: KVCache) -> int:
    """Slots each row reads: its table's width in slots."""
    return cache.table.shape[1] * cache.positions.shape[1]


def pinned_slots(sinks: int, block_size: int) -> int:
    """Slots at the start of a ring row kept out of its ring: the whole blocks that hold its first
    `sinks` positions (`ModelConfig.sinks`)."""
    return -(-sinks // block_size) * block_size


def slots(table: mx.array, positions: mx.array, block_size: int, pinned: int = 0) -> mx.array:
    """table (B, W), positions (B, T) -> (B, T) int32 flat slot of each token in the pool
    (block * bs + offset); 0, in the scratch block, for padding (negative positions). `pinned`:
    the row's first slots that keep their columns (`pinned_slots`)."""
    # Written so that compilation fuses each side of the gather into one kernel (a decode step is
    # host-bound on a GPU: each kernel costs its launch): `positions` itself, not its clamp, past it.
    # The width is read at run time: a new width must not make new kernels (`scalars`).
    if pinned and table.shape[1] * block_size <= pinned:
        raise InputError(f"a cache of {table.shape[1] * block_size} slots per row has no ring beside the {pinned} "
                         f"it keeps for attention sinks: size it by columns_for(length, window, sinks=...)")
    column = ring_index(mx.maximum(positions, 0) // block_size, dynamic(table.shape[1]),
                        pinned // block_size)  # (B, T)
    block = mx.take_along_axis(table, column, axis=1)  # (B, T)
    return mx.where(positions >= 0, block * block_size + positions % block_size, 0)


def write(buf: mx.array, new: mx.array, slots: mx.array) -> mx.array:
    """buf (N * bs, H, 1, D) with new (B, H, T, D) written at flat slots (B, T). (Written as uint32
    words, two 16-bit values a word, the writes alone took 6.6 against 9.9 ms for the 8B's 8,192
    tokens on an H200, but whole admissions read prompts up to 19% slower: 7fbc90b:benchmarks/README.md,
    seventeenth session.)"""
    B, H, T, D = new.shape
    if T == 1:  # (B, H, 1, D): B slots' worth as it is
        index = mx.broadcast_to(slots.reshape(B, 1, 1, 1), new.shape)  # the same for every layer: traced once
        return mx.put_along_axis(buf, index, new, axis=0)
    # A chunk goes token-major, one index per token: on an H200 a third faster than one per
    # element (128 x 128 tokens of the 1B shape: 4.8 against 6.7 ms for the 32 writes). The update
    # is the (B, T, H, 1, D) view of `new`, indexed (B, T): flattening it to (B * T, H, D) copied it.
    out = mx.array(buf)  # a new handle, so the assignment leaves the caller's pool as it was
    out[slots] = mx.expand_dims(new.transpose(0, 2, 1, 3), 3)  # (B, T, H, 1, D)
    return out


def write_run(buf: mx.array, new: mx.array, start: mx.array) -> mx.array:
    """buf (N * bs, H, 1, D) with new (B, H, T, D) written at the run of slots [start, start + B * T)
    in row-major order (start (1,) int32, an array: no retrace per start). A slice update: a copy
    kernel, where a scatter's kernel computes an index per element (on this CPU 3.5x faster than
    `write`; benchmarks/chunk_write.py, a probe since removed)."""
    B, H, T, D = new.shape
    return mx.slice_update(buf, new.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D), start, axes=(0,))


def run_start(slots: np.ndarray) -> int | None:
    """slots (B, T) on the host -> the first slot if they are one run [s, s + B * T) in row-major
    order (no padding: slot 0 is scratch and never part of one), else None."""
    flat = slots.reshape(-1)
    if flat.size == 0 or flat[0] <= 0 or (flat.size > 1 and not (flat[1:] - flat[:-1] == 1).all()):
        return None
    return int(flat[0])


def write_positions(positions: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """positions (N, bs) with new (B, T) written at flat slots (B, T). Padding writes its own
    negative position: every negative position reads as empty."""
    N, bs = positions.shape
    return mx.put_along_axis(positions.reshape(N * bs), slots.reshape(-1), new.reshape(-1), axis=0).reshape(N, bs)


def write_positions_run(positions: mx.array, start: mx.array, new: mx.array) -> mx.array:
    """positions (N, bs) with new (B, T), all real, written at the run [start, start + B * T)."""
    N, bs = positions.shape
    return mx.slice_update(positions.reshape(N * bs), new.reshape(-1), start, axes=(0,)).reshape(N, bs)


def gather(buf: mx.array, table: mx.array, block_size: int) -> mx.array:
    """buf (N * bs, H, 1, D), table (B, W) -> (B, H, W * bs, D): each row's keys (or values)."""
    B, W = table.shape
    H, D = buf.shape[1], buf.shape[-1]
    blocks = buf.reshape(-1, block_size, H, D)  # (N, bs, H, D)
    return blocks[table].reshape(B, W * block_size, H, D).transpose(0, 2, 1, 3)


def held_positions(positions: mx.array, table: mx.array) -> mx.array:
    """positions (N, bs), table (B, W) -> (B, C = W * bs): the position each slot a row reads
    holds, as held (a slot counts only where it is its own: `masks.causal(slotted=True)`)."""
    return positions[table].reshape(table.shape[0], -1)


def gather_positions(positions: mx.array, table: mx.array, pinned: int = 0, until: mx.array | None = None
                     ) -> mx.array:
    """positions (N, bs), table (B, W) -> (B, C = W * bs): the position each slot a row reads
    holds, or -1 where it is empty or holds a position that is not its own (`masks.own_slots`:
    what a block's previous owner left behind is never seen). `until` (B, 1): each row's next
    position (a chunk's first, read before its write): a slot holding that position or a later
    one holds a previous owner's, at a slot the row has not written yet."""
    held = held_positions(positions, table)  # (B, C)
    real = (held >= 0) & own_slots(held, pinned)
    return mx.where(real if until is None else real & (held < until), held, -1)


def slot_bytes(config: ModelConfig, dtype: mx.Dtype) -> int:
    """Bytes one slot takes: keys and values of every layer, and its position."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.size + 4


def check_write(cache: KVCache, positions: mx.array, full_attention: bool) -> None:
    """Raise InputError unless tokens at `positions` (B, T) fit the cache: at most one token per
    slot, and (if some layer attends to everything) every position within the row's slots, which
    would otherwise overwrite keys still seen. Host-side; the position check reads the positions
    (skipped while tracing)."""
    T, C = positions.shape[1], capacity(cache)
    if positions.shape[0] != cache.table.shape[0]:
        raise InputError(f"{positions.shape[0]} rows of tokens for a cache of {cache.table.shape[0]} rows")
    if T > C:
        raise InputError(f"a chunk of {T} tokens does not fit a cache of {C} slots per row")
    top = host_int(positions.max()) if full_attention else None
    if top is not None and top >= C:
        raise InputError(f"position {top} does not fit a cache of {C} slots per row: grow it first "
                         f"(cache.grow), or bound the attention with a window (max_kv_size)")


def host_int(a: mx.array) -> int | None:
    """The value of a scalar array, or None while `mx.compile` traces (arrays have no value then)."""
    try:
        return int(a.item())
    except ValueError as e:
        if "function transformations" in str(e):
            return None
        raise


def grow(cache: KVCache, new_capacity: int) -> KVCache:
    """The cache with room for `new_capacity` slots per row, each row's data kept: new blocks of
    their own are appended to every row's table. Only for rows that have not wrapped around
    their columns (their blocks keep their place)."""
    bs, (B, W) = block_size(cache), cache.table.shape
    extra = -(-new_capacity // bs) - W
    if extra <= 0:
        return cache
    N = cache.positions.shape[0]
    cache = with_blocks(cache, N + B * extra)
    more = N + mx.arange(B * extra, dtype=mx.int32).reshape(B, extra)
    return cache._replace(table=mx.concatenate([cache.table, more], axis=1))


def with_blocks(cache: KVCache, blocks: int) -> KVCache:
    """The pool grown to `blocks` blocks (empty ones appended); the table is unchanged."""
    extra = blocks - cache.positions.shape[0]
    if extra <= 0:
        return cache

    def pad(a: mx.array, rows: int, value) -> mx.array:
        return mx.pad(a, [(0, rows)] + [(0, 0)] * (a.ndim - 1), constant_values=value)

    slots = extra * block_size(cache)
    return KVCache(tuple(pad(k, slots, 0) for k in cache.keys), tuple(pad(v, slots, 0) for v in cache.values),
                   pad(cache.positions, extra, -1), cache.table)


def take_blocks(cache: KVCache, blocks: mx.array) -> KVCache:
    """A pool of the given blocks (B',) in that order (a compaction: block 0 first, kept as
    scratch); the caller renumbers its tables."""
    slots = block_slots(blocks, block_size(cache))
    return KVCache(tuple(k[slots] for k in cache.keys), tuple(v[slots] for v in cache.values),
                   cache.positions[blocks], cache.table)


def block_slots(blocks: mx.array, block_size: int) -> mx.array:
    """blocks (M,) -> the pool rows (slots) they span, in order (M * bs,)."""
    return (blocks[:, None] * block_size + mx.arange(block_size, dtype=mx.int32)).reshape(-1)


def updated(a: mx.array, index, values: mx.array) -> mx.array:
    """`a` with `a[index] = values` (a scatter); `a` itself is left as it was."""
    out = mx.array(a)  # a new handle on the same data, so the assignment rebinds only `out`
    out[index] = values.astype(a.dtype)
    return out


def bucket(length: int, block: int = 256) -> int:
    """Slots for `length` tokens: the next multiple of `block`, so attention cost follows the
    real context and a compiled step retraces once per bucket, not per token."""
    return max(block, -(-length // block) * block)


def ring_columns(window: int, block_size: int = BLOCK, sinks: int = 0) -> int:
    """Columns of a ring row: every position of the window, plus the block being filled, plus
    the blocks that hold its first `sinks` positions (kept: `pinned_slots`)."""
    return -(-window // block_size) + 1 + pinned_slots(sinks, block_size) // block_size


def columns_for(length: int, window: int | None, block_size: int = BLOCK, sinks: int = 0) -> int:
    """Table columns for rows of up to `length` tokens: a bucket, or the ring when smaller."""
    linear = bucket(length) // block_size
    return linear if window is None else min(linear, ring_columns(window, block_size, sinks))
