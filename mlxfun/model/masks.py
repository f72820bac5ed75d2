"""Boolean attention masks from positions, as pure functions.

A query at position q sees a key at position k when k >= 0 (not padding, not an empty slot),
k <= q (causal) and, in a windowed layer, q - k < W. Shapes: q_pos (B, T), k_pos (B, S) -> (B, T, S).
"""

from __future__ import annotations

import mlx.core as mx

from mlxfun.model.scalars import dynamic


def causal(q_pos: mx.array, k_pos: mx.array, slotted: bool = False) -> mx.array:
    """(B, T, S): visible keys, hiding padding and empty slots (negative positions). `slotted`:
    k_pos are what a row's S cache slots hold (`cache.held_positions`), and a slot counts only if
    the position it holds is its own (`own_slots`). One expression, so that compilation makes the
    whole mask one kernel."""
    k = k_pos[:, None, :]
    visible = (k >= 0) & (k <= q_pos[:, :, None])
    return visible & own_slots(k) if slotted else visible


def own_slots(held: mx.array) -> mx.array:
    """held (..., S) the positions a row's S cache slots hold -> whether each is its slot's own:
    p mod S names the slot a position belongs to, so what a block's previous owner left is never
    seen (S read at run time: `scalars`). Negative positions are for the caller to hide."""
    S = held.shape[-1]
    return held % dynamic(S, held.dtype) == mx.arange(S, dtype=held.dtype)


def window(q_pos: mx.array, k_pos: mx.array, size: int) -> mx.array:
    """(B, T, S): keys among the last `size` positions up to each query."""
    return (q_pos[:, :, None] - k_pos[:, None, :]) < size


def never_empty(mask: mx.array) -> mx.array:
    """Let a query that sees nothing (a padding token) see everything instead. Its output is
    discarded, but it must stay finite: a NaN would reach real rows through 0 * NaN."""
    return mask | ~mx.any(mask, axis=-1, keepdims=True)


def padding_sees_all(mask: mx.array, q_pos: mx.array) -> mx.array:
    """`never_empty` for a mask made from positions, where every real query sees at least its own
    key: only padding (negative positions) can see nothing. Elementwise, so it joins the mask's
    kernel, where `never_empty` adds a reduction and a second kernel."""
    return mask | (q_pos[:, :, None] < 0)
