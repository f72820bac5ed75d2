"""The CUDA decode-attention kernel's dispatch rules (pure Python; the kernel itself is checked
against MLX ops on a GPU by benchmarks/kernels_check.py)."""

import mlx.core as mx

from mlxfun import kernels


def test_layout_limits():
    # 8B / 1B shapes in bfloat16: a key's 16 or 8 lanes divide a warp.
    assert kernels.attention_fits(1, 8, 128, 4, mx.bfloat16)
    assert kernels.attention_fits(1, 8, 64, 4, mx.bfloat16)
    # 96 / 8 = 12 lanes per key do not divide a warp; 16 query heads x 8 elements exceed the registers.
    assert not kernels.attention_fits(1, 8, 96, 4, mx.bfloat16)
    assert not kernels.attention_fits(1, 2, 128, 16, mx.bfloat16)


def test_batch_limit_follows_blocks():
    assert kernels.attention_fits(32, 8, 128, 4, mx.bfloat16)  # 256 blocks
    assert not kernels.attention_fits(33, 8, 128, 4, mx.bfloat16)
    assert kernels.attention_fits(128, 2, 128, 4, mx.bfloat16)


def test_keys_split_into_parts_of_at_most_four_rounds():
    assert kernels.parts_for(8, 256, 64) == 1  # 8B at batch 1, a 256-slot cache: one block per key head
    assert kernels.parts_for(8, 257, 64) == 2
    assert kernels.parts_for(8, 4096, 64) == 16
    assert kernels.parts_for(256, 1024, 32) == 8  # capped at 2048 blocks
    assert kernels.parts_for(256, 100_000, 32) == 8
    assert kernels.parts_for(4096, 1024, 32) == 1
