"""batch_invariant: a row's tokens and logprobs are the same bits whatever else is in its batch.

On CUDA the mode routes every product and attention through mlxfun's kernels whose sums follow
the model's shapes alone (checked bit for bit on the CPU emulator in test_kernels.py, end to end
on a GPU by benchmarks/invariant_e2e.py). Here: the options, the routing, and what holds on the CPU, where
MLX's products already keep a row's bits in bf16 (the mode changes nothing there).
"""

from __future__ import annotations

import argparse
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_config, tiny_model

from mlxfun import Engine, generate
from mlxfun.cli.main import generate_parser, generation_config
from mlxfun.engine import step
from mlxfun.errors import InputError
from mlxfun.kernels import attention as kernels
from mlxfun.kernels import dmv
from mlxfun.model import llama, weights


@pytest.fixture(scope="module")
def bf16_model():
    m = tiny_model(tiny_config(hidden_size=128, intermediate_size=256, num_layers=2), seed=1)
    return dataclasses.replace(m, params=weights.cast(m.config, m.params, mx.bfloat16))


def outputs(result, i):
    return result.token_ids[i], result.logprobs[i]


def test_cpu_bf16_rows_are_the_same_bits_in_any_batch(bf16_model):
    """bf16 on the CPU, with the mode: a row alone, in a batch, reversed, continuous (2 rows for 6
    prompts), in other prefill chunks, behind a cached prefix and through speculative verify
    rounds (prompt lookup) gives the same tokens and logprobs, bit for bit."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, bf16_model.config.vocab_size, 24).tolist()
    prompts = [rng.integers(3, bf16_model.config.vocab_size, n).tolist() for n in (3, 17, 40, 9)]
    prompts += [shared + [5, 6], shared + [7]]  # the second hits the first's cached prefix when batched
    options = dict(max_tokens=10, ignore_eos=True, logprobs=0, batch_invariant=True)
    alone = [outputs(generate(bf16_model, [p], **options), 0) for p in prompts]
    runs = {"batched": (prompts, {}), "reversed": (prompts[::-1], {}), "continuous": (prompts, {"batch_size": 2}),
            "chunks of 8": (prompts, {"prefill_step": 8}), "speculative": (prompts, {"draft_model": "prompt-lookup"})}
    for name, (order, extra) in runs.items():
        result = generate(bf16_model, order, **options, **extra)
        for i, p in enumerate(order):
            assert outputs(result, i) == alone[prompts.index(p)], (name, i)
    assert len({tuple(a[0]) for a in alone}) == len(prompts)  # distinct outputs: the rows are not trivially equal


def test_batch_invariant_options_are_checked(bf16_model):
    with pytest.raises(InputError, match="batch_invariant"):
        generate(bf16_model, [[3, 4]], max_tokens=2, batch_invariant="yes")
    with pytest.raises(InputError, match="max_kv_size"):
        Engine(bf16_model, 2, max_kv_size=64, batch_invariant=True)
    windowed = tiny_model(tiny_config(layer_windows=(8, None)), seed=2)
    with pytest.raises(InputError, match="windowed"):
        Engine(windowed, 2, batch_invariant=True)
    assert Engine(bf16_model, 2, batch_invariant=True).config.batch_invariant
    assert not Engine(bf16_model, 2).config.batch_invariant


def test_batch_invariant_needs_the_attention_kernel_where_kernels_run(monkeypatch, bf16_model):
    """Where mlxfun's kernels run (stood in here), heads the one-token attention kernel does not
    serve are refused: MLX's attention over gathered keys sums over the batch's table width."""
    monkeypatch.setattr(kernels, "available", lambda dtype: True)
    monkeypatch.setattr(llama, "step_attention_kernel", lambda config, params: False)
    with pytest.raises(InputError, match="head_dim"):
        Engine(bf16_model, 2, batch_invariant=True)
    monkeypatch.setattr(llama, "step_attention_kernel", lambda config, params: True)
    assert Engine(bf16_model, 2, batch_invariant=True).config.batch_invariant


def test_cli_flag_sets_the_option():
    parser = argparse.ArgumentParser()
    generate_parser(parser)
    assert generation_config(parser.parse_args(["--prompt", "hi", "--batch-invariant"])).batch_invariant
    assert not generation_config(parser.parse_args(["--prompt", "hi"])).batch_invariant


def test_invariant_products_take_the_kernels_at_every_row_count(monkeypatch):
    """The structure the mode rests on with MLXFUN_INVARIANT_PIECES=0: a bf16 product of any rows
    (prompts included) runs dmv, a quantized one on its map dequantized (the same dense map
    whatever the batch), never MLX's matmul, whose kernel follows the row count; without the mode,
    prompts keep MLX's products. (In pieces, the default, see the test below.)"""
    from mlxfun.model import pieces

    calls = []
    monkeypatch.setattr(pieces, "ROWS", None)
    monkeypatch.setattr(kernels, "available", lambda dtype: True)
    monkeypatch.setattr(dmv, "product", lambda x, w, launch=None: calls.append((x.shape[0], w)) or x @ w.T)
    w = mx.random.normal((64, 128)).astype(mx.bfloat16)
    dense, quant = llama.Dense(w), llama.Quantized(*mx.quantize(w, group_size=64, bits=4))
    for rows in (1, 9, 300):
        x = mx.random.normal((rows, 128)).astype(mx.bfloat16)
        llama.linear(dense, x, fast=True, invariant=True)
        llama.linear(quant, x, fast=True, invariant=True)
    assert [n for n, _ in calls] == [1, 1, 9, 9, 300, 300]
    assert all(wd is w for _, wd in calls[::2])
    deq = mx.dequantize(quant.weight, quant.scales, quant.biases, group_size=64, bits=4)
    assert all(wq.dtype == mx.bfloat16 and mx.array_equal(wq, deq).item() for _, wq in calls[1::2])
    calls.clear()
    llama.linear(dense, mx.zeros((300, 128), mx.bfloat16), fast=True)
    assert calls == []
    llama.linear(dense, mx.zeros((3, 128), mx.bfloat16), invariant=True)  # first tokens' logits ask no `fast`
    assert [n for n, _ in calls] == [3]


def test_invariant_prefill_runs_each_token_as_a_row(monkeypatch, bf16_model):
    """With the mode and the one-token kernel, a prefill chunk goes through `verify_hidden`'s
    flattened path (each token a row of one), so a token's state does not depend on its chunk."""
    seen = []
    monkeypatch.setattr(llama, "step_attention_kernel", lambda config, params: True)
    monkeypatch.setattr(step, "verify_hidden", lambda *a, flatten: seen.append(flatten) or (_ for _ in ()).throw(
        RuntimeError("stop")))
    config = bf16_model.config.with_batch_invariant(True)
    with pytest.raises(RuntimeError, match="stop"):
        step.prefill_chunk(config, bf16_model.params, mx.zeros((2, 4), mx.int32), mx.zeros((2, 4), mx.int32),
                           None, None, mx.zeros((2,), mx.int32))
    assert seen == [True]



def test_invariant_products_in_pieces_have_one_shape(monkeypatch):
    """MLXFUN_INVARIANT_PIECES=N (128 unset): the mode's products run MLX's matmul on pieces of exactly N rows
    (zeros padding the last), dense and quantized maps (dequantized) alike, never dmv: every
    product one shape, so one cuBLAS kernel, whatever the rows. A row's bits are the same alone
    and in any batch, and the product is the plain one to bf16 rounding."""
    from mlxfun.model import pieces

    shapes, dmv_calls = [], []
    monkeypatch.setattr(kernels, "available", lambda dtype: True)
    monkeypatch.setattr(dmv, "product", lambda x, w, launch=None: dmv_calls.append(x.shape) or x @ w.T)
    monkeypatch.setattr(pieces, "ROWS", 8)
    monkeypatch.setattr(pieces, "piece", lambda rows, w_t: shapes.append(rows.shape) or rows @ w_t)
    w = mx.random.normal((64, 128)).astype(mx.bfloat16)
    dense, quant = llama.Dense(w), llama.Quantized(*mx.quantize(w, group_size=64, bits=4))
    deq = mx.dequantize(quant.weight, quant.scales, quant.biases, group_size=64, bits=4).astype(mx.bfloat16)
    x = mx.random.normal((21, 128)).astype(mx.bfloat16)
    for p, wd in ((dense, w), (quant, deq)):
        alone = llama.linear(p, x[3:4], fast=True, invariant=True)
        for rows in (8, 21):
            got = llama.linear(p, x[:rows], fast=True, invariant=True)
            assert got.shape == (rows, 64) and mx.array_equal(got[3], alone[0]).item()
            want = x[:rows].astype(mx.float32) @ wd.astype(mx.float32).T
            assert (mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()).item() < 1e-2
    assert set(shapes) == {(8, 128)} and len(shapes) == 2 * (1 + 1 + 3) and dmv_calls == []
    for bad in ("x", "-1", "5000"):
        with pytest.raises(ValueError, match="MLXFUN_INVARIANT_PIECES"):
            pieces.pieces_setting(bad)
    assert pieces.pieces_setting("") == pieces.DEFAULT_ROWS == 128 and pieces.pieces_setting("64") == 64
    assert pieces.pieces_setting("0") is None  # dmv at every row count
