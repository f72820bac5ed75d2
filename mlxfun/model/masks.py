"""Boolean attention masks from positions, as pure functions.

A query at position q sees a key at position k when k >= 0 (not padding, not an empty slot),
k <= q (causal) and, in a windowed layer, q - k < W, or k < sinks in a ring that `max_kv_size` made
(its row's first positions stay visible: attention sinks). Shapes: q_pos (B, T), k_pos (B, S) -> (B, T, S).
"""

from __future__ import annotations

import mlx.core as mx

from mlxfun.model.scalars import dynamic


def causal(q_pos: mx.array, k_pos: mx.array, slotted: bool = False, pinned: int = 0) -> mx.array:
    """(B, T, S): visible keys, hiding padding and empty slots (negative positions). `slotted`:
    k_pos are what a row's S cache slots hold (`cache.held_positions`), and a slot counts only if
    the position it holds is its own (`own_slots`, with the row's first `pinned` slots kept out
    of the ring). One expression, so that compilation makes the whole mask one kernel."""
    k = k_pos[:, None, :]
    visible = (k >= 0) & (k <= q_pos[:, :, None])
    return visible & own_slots(k, pinned) if slotted else visible


def own_slots(held: mx.array, pinned: int = 0) -> mx.array:
    """held (..., S) the positions a row's S cache slots hold -> whether each is its slot's own
    (`ring_index` of the position among S slots names it), so what a block's previous owner left
    is never seen (S read at run time: `scalars`). Negative positions are for the caller to hide."""
    S = held.shape[-1]
    return ring_index(held, dynamic(S, held.dtype), pinned) == mx.arange(S, dtype=held.dtype)


def ring_index(i: mx.array, count: mx.array, pinned: int = 0) -> mx.array:
    """Where item i (>= 0) of a row goes among its `count` places when the first `pinned` items
    keep theirs and the rest take the others in turn (a ring): i mod count without pinned items.
    A block table's column of logical block i, or a row's slot of position i. `count` an array:
    read at run time (`scalars`)."""
    if not pinned:
        return i % count
    return mx.where(i < pinned, i, pinned + (i - pinned) % mx.maximum(count - pinned, 1))


def window(q_pos: mx.array, k_pos: mx.array, size: int, sinks: int = 0) -> mx.array:
    """(B, T, S): keys among the last `size` positions up to each query, or among the row's first
    `sinks` positions (a `max_kv_size` ring keeps them visible to every query)."""
    near = (q_pos[:, :, None] - k_pos[:, None, :]) < size
    return near | (k_pos[:, None, :] < sinks) if sinks else near


def never_empty(mask: mx.array) -> mx.array:
    """Let a query that sees nothing (a padding token) see everything instead. Its output is
    discarded, but it must stay finite: a NaN would reach real rows through 0 * NaN."""
    return mask | ~mx.any(mask, axis=-1, keepdims=True)


def padding_sees_all(mask: mx.array, q_pos: mx.array) -> mx.array:
    """`never_empty` for a mask made from positions, where every real query sees at least its own
    key: only padding (negative positions) can see nothing. Elementwise, so it joins the mask's
    kernel, where `never_empty` adds a reduction and a second kernel."""
    return mask | (q_pos[:, :, None] < 0)
