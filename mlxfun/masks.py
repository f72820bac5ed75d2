"""Boolean attention masks from positions, as pure functions.

A query at position q sees a key at position k when k >= 0 (not padding, not an empty slot),
k <= q (causal) and, in a windowed layer, q - k < W. Shapes: q_pos (B, T), k_pos (B, S) -> (B, T, S).
"""

from __future__ import annotations

import mlx.core as mx


def causal(q_pos: mx.array, k_pos: mx.array) -> mx.array:
    """(B, T, S): visible keys, hiding padding and empty slots (negative positions)."""
    k = k_pos[:, None, :]
    return (k >= 0) & (k <= q_pos[:, :, None])


def window(q_pos: mx.array, k_pos: mx.array, size: int) -> mx.array:
    """(B, T, S): keys among the last `size` positions up to each query."""
    return (q_pos[:, :, None] - k_pos[:, None, :]) < size


def never_empty(mask: mx.array) -> mx.array:
    """Let a query that sees nothing (a padding token) see everything instead. Its output is
    discarded, but it must stay finite: a NaN would reach real rows through 0 * NaN."""
    return mask | ~mx.any(mask, axis=-1, keepdims=True)
