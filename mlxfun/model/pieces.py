"""Products in pieces of one fixed row count: the batch-invariant mode's products, on MLX's own matmul.

cuBLAS picks its kernel, and with it how each output's sum is split and ordered, by the shape of
the product, so a row's bits depend on how many rows share its product. A product of exactly N
rows always has the same shape: rows padded to a multiple of N and cut into pieces of N, each its
own matmul, give a row the same bits alone or in any batch, at cuBLAS's speed for N rows (a
decode step of up to N rows is one product; a prompt of T tokens, T / N).

In pieces of 128 (the default) the mode held 12 of 12 prompts bit for bit in bf16 and fp16 (H100,
benchmarks/results/h100/2026-12-07-pieces-invariant-e2e.json) and decoded at 0.59x / 0.67x /
0.81x / 0.98x the default's speed at batch 1 / 8 / 32 / 128 on a 1B, 0.76x / 0.83x / 0.89x /
1.02x on an 8B, against 0.85x / 0.98x / 0.89x / 0.45x (1B) for `dmv` at every row count, which
reads W once per 32 rows; prompts 0.34-1.15x the default's speed against `dmv`'s 0.17-0.27x.
`MLXFUN_INVARIANT_PIECES` (read once, at import) sets N, and 0 makes the mode run `dmv`, the faster
at a few rows. A row's bits depend on N: compare runs made with the same one.
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "MLXFUN_INVARIANT_PIECES"
DEFAULT_ROWS = 128


def pieces_setting(setting: str) -> int | None:
    """$MLXFUN_INVARIANT_PIECES -> the rows of a piece (unset: DEFAULT_ROWS; 0 -> None: the mode's
    products run `dmv`)."""
    setting = setting.strip()
    if not setting:
        return DEFAULT_ROWS
    if not setting.isdigit() or int(setting) > 4096:
        raise ValueError(f"{ENV}={setting!r}: expected the rows of a piece, 1 to 4096, 0 for dmv, or unset")
    return int(setting) or None


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
