"""Products in pieces of one fixed row count: a way to batch invariance with MLX's own matmul.

cuBLAS picks its kernel, and with it how each output's sum is split and ordered, by the shape of
the product. A row's bits then depend on how many rows share its product, which is why the
batch-invariant mode runs `dmv` at every row count (`llama.linear(..., invariant=True)`). But a
product of exactly N rows always has the same shape: rows padded to a multiple of N and cut into
pieces of N, each its own matmul, give a row the same bits alone or in any batch, at cuBLAS's
speed for N rows (a decode step of up to N rows is one product; a prompt of T tokens, T / N).
`dmv` reads W once per 32 rows, so at 128 rows the mode ran at 0.45x the default's speed (1B,
H100); in pieces of 128 it reads W once per step.

A trial, not yet measured on a GPU: `MLXFUN_INVARIANT_PIECES=N` (read once, at import) makes the
batch-invariant products run in pieces of N rows.
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "MLXFUN_INVARIANT_PIECES"


def pieces_setting(setting: str) -> int | None:
    """$MLXFUN_INVARIANT_PIECES -> the rows of a piece (None: unset, the mode's `dmv` products)."""
    setting = setting.strip()
    if not setting:
        return None
    if not setting.isdigit() or not 1 <= int(setting) <= 4096:
        raise ValueError(f"{ENV}={setting!r}: expected the rows of a piece, 1 to 4096, or unset")
    return int(setting)


ROWS = pieces_setting(os.environ.get(ENV, ""))


def piece(rows: mx.array, w_t: mx.array) -> mx.array:
    """One piece: (n, in) @ (in, out)."""
    return rows @ w_t


def product(rows: mx.array, w_t: mx.array, n: int) -> mx.array:
    """rows (M, in) @ w_t (in, out) -> (M, out) as ceil(M / n) products of exactly n rows (the
    last padded with zeros, its padding dropped)."""
    M = rows.shape[0]
    padded = -(-M // n) * n
    if padded != M:
        rows = mx.concatenate([rows, mx.zeros((padded - M, rows.shape[1]), rows.dtype)])
    out = [piece(rows[i:i + n], w_t) for i in range(0, padded, n)]  # (n, out) each: one shape, one kernel
    y = out[0] if len(out) == 1 else mx.concatenate(out)
    return y if padded == M else y[:M]
