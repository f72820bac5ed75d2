"""The weights strategy (mlxfun.engine.strategy) changes speed only: a dense copy of quantized weights at
large batch gives the quantized kernel's results up to rounding, and batched still equals alone."""

from __future__ import annotations

import mlx.core as mx
from helpers import run_engine, tiny_model

from mlxfun.engine.strategy import (
    QUANTIZED,
    WeightStrategy,
    dense_bytes,
    device_memory,
    params_for_batch,
    params_for_prompts,
)
from mlxfun.model.llama import Dense, Quantized

DENSE = WeightStrategy(dense_from=1)


def run(model, prompts, strategy):
    return run_engine(model, prompts, strategy=strategy, max_tokens=12, ignore_eos=True, logprobs=0)[0]


PROMPTS = [[3, 14, 15, 92], [65], [35, 89, 79, 32, 38, 46, 26], [43, 38]]


def test_dense_copy_from_threshold():
    model = tiny_model(quant=(4, 32))
    config, params = model.config, model.params
    strategy = WeightStrategy(dense_from=4)
    assert params_for_batch(config, params, 3, strategy) is params
    dense = params_for_batch(config, params, 4, strategy)
    assert isinstance(dense.layers[0].qkv, Dense) and isinstance(dense.embed, Dense)
    assert dense.layers[0].qkv.weight.dtype == params.layers[0].qkv.scales.dtype
    assert params_for_batch(config, params, 64, QUANTIZED) is params


def test_kernel_rows_keep_quantized_weights_then_copy():
    """Where mlxfun's product serves the model's bits, batches of up to `kernel_rows` rows keep
    the quantized weights (no copy), and larger ones copy as before; other bits copy from
    `dense_from` (the GPU's strategy: the product up to 32 rows, slower than bf16 past that)."""
    model = tiny_model(quant=(4, 32))
    config, params = model.config, model.params
    served = WeightStrategy(dense_from=2, kernel_bits=(4,), kernel_rows=6)
    assert params_for_batch(config, params, 2, served) is params
    assert params_for_batch(config, params, 6, served) is params
    assert isinstance(params_for_batch(config, params, 7, served).layers[0].qkv, Dense)
    other_bits = WeightStrategy(dense_from=2, kernel_bits=(8,), kernel_rows=6)
    assert isinstance(params_for_batch(config, params, 2, other_bits).layers[0].qkv, Dense)
    # prompts: no whole copy where the product serves the model, whatever the rows
    prompts = WeightStrategy(dense_from=None, prompt_dense_from=10, prompt_dense_min_weights=0, kernel_bits=(4,),
                             kernel_rows=6)
    assert params_for_prompts(config, params, [40, 40], 64, prompts) is params


def test_dense_copy_only_when_memory_allows():
    model = tiny_model(quant=(4, 32))
    assert dense_bytes(model.config, model.params) > 0
    tight = WeightStrategy(dense_from=1, memory_fraction=0.0)
    assert params_for_batch(model.config, model.params, 8, tight) is model.params


def test_dense_params_untouched():
    model = tiny_model()
    assert params_for_batch(model.config, model.params, 64, DENSE) is model.params


def test_dense_copy_holds_the_dequantized_weights():
    model = tiny_model(quant=(4, 32))
    q = model.params.layers[0].gate_up
    assert isinstance(q, Quantized)
    dense = params_for_batch(model.config, model.params, 1, DENSE).layers[0].gate_up
    expected = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    assert mx.array_equal(dense.weight, expected).item()


def test_strategy_keeps_greedy_output():
    model = tiny_model(quant=(4, 32))
    quantized = run(model, PROMPTS, QUANTIZED)
    dense = run(model, PROMPTS, DENSE)
    assert dense.token_ids == quantized.token_ids
    for a, b in zip(dense.logprobs, quantized.logprobs):
        assert mx.allclose(mx.array(a), mx.array(b), atol=1e-3).item()


def test_batched_equals_alone_with_each_strategy():
    model = tiny_model(quant=(4, 32))
    for strategy in (QUANTIZED, DENSE):
        batched = run(model, PROMPTS, strategy)
        for prompt, ids in zip(PROMPTS, batched.token_ids):
            assert run(model, [prompt], strategy).token_ids[0] == ids


def test_engine_runs_quantized_weights_as_a_dense_copy():
    """The Engine picks its weights once for its row count, like a static batch, with the same tokens."""
    from mlxfun.engine.core import Engine

    model = tiny_model(quant=(4, 32))
    engine = Engine(model, rows=2, strategy=DENSE)
    assert isinstance(engine.runner.params.layers[0].qkv, Dense)
    assert Engine(model, rows=2, strategy=QUANTIZED).runner.params is model.params
    ids = [engine.add(p, max_tokens=12, ignore_eos=True) for p in PROMPTS]
    list(engine.events())
    assert [engine.requests[i].row.token_ids for i in ids] == run(model, PROMPTS, DENSE).token_ids


PROMPT_DENSE = WeightStrategy(dense_from=None, prompt_dense_from=10, prompt_dense_min_weights=0)


def test_prompt_copy_from_threshold_for_large_maps_when_memory_allows():
    model = tiny_model(quant=(4, 32))
    config, params = model.config, model.params
    assert params_for_prompts(config, params, [5, 4], 512, PROMPT_DENSE) is params
    assert params_for_prompts(config, params, [30], 9, PROMPT_DENSE) is params  # one chunk: 9 tokens
    dense = params_for_prompts(config, params, [6, 4], 512, PROMPT_DENSE)
    assert isinstance(dense.layers[0].gate_up, Dense) and isinstance(dense.embed, Dense)
    small_maps = WeightStrategy(dense_from=None, prompt_dense_from=10,
                                prompt_dense_min_weights=config.hidden_size * config.intermediate_size + 1)
    assert params_for_prompts(config, params, [10], 512, small_maps) is params
    tight = WeightStrategy(dense_from=None, prompt_dense_from=10, prompt_dense_min_weights=0, memory_fraction=0.0)
    assert params_for_prompts(config, params, [10], 512, tight) is params
    assert params_for_prompts(config, params, [10**6], 512, QUANTIZED) is params  # off unless the strategy asks
    plain = tiny_model()
    assert params_for_prompts(plain.config, plain.params, [10**6], 512, PROMPT_DENSE) is plain.params


def test_long_prompts_prefill_on_a_copy_and_decode_on_the_quantized_weights(monkeypatch):
    """One copy per prefill whose chunks hold enough prompt tokens (PROMPTS: 14, a batch of the
    first alone: 4, too few); decode steps read the 4-bit weights; the tokens are the quantized
    run's."""
    from mlxfun.engine import strategy as strat

    model = tiny_model(quant=(4, 32))
    copies = []
    real = strat.weights.cast
    monkeypatch.setattr(strat.weights, "cast", lambda *a: copies.append(1) or real(*a))
    out, engine = run_engine(model, PROMPTS, strategy=PROMPT_DENSE, max_tokens=12, ignore_eos=True, logprobs=0)
    assert len(copies) == 1 and engine.runner.params is model.params
    assert isinstance(engine.runner.params.layers[0].qkv, Quantized)
    assert out.token_ids == run(model, PROMPTS, QUANTIZED).token_ids
    copies.clear()
    run(model, PROMPTS[:1], PROMPT_DENSE)
    assert copies == []


def test_engine_admissions_of_long_prompts_prefill_on_a_copy(monkeypatch):
    from mlxfun.engine import strategy as strat
    from mlxfun.engine.core import Engine

    model = tiny_model(quant=(4, 32))
    copies = []
    real = strat.weights.cast
    monkeypatch.setattr(strat.weights, "cast", lambda *a: copies.append(1) or real(*a))
    engine = Engine(model, rows=4, strategy=PROMPT_DENSE)
    assert engine.runner.params is model.params
    ids = [engine.add(p, max_tokens=12, ignore_eos=True) for p in PROMPTS]
    list(engine.events())
    assert copies == [1]  # one admission of all four prompts, 14 tokens
    assert [engine.requests[i].row.token_ids for i in ids] == run(model, PROMPTS, QUANTIZED).token_ids


def test_device_memory_reads_metal_and_cuda_names():
    """A CUDA GPU reports total_memory (an H200's, as MLX 0.32.4 gave it); without it the copy's
    memory check would fall back to the host's RAM."""
    assert device_memory({"memory_size": 68719476736}) == 68719476736  # Metal
    assert device_memory({"total_memory": 150754820096, "free_memory": 149557477376}) == 150754820096
    assert device_memory({"device_name": "cpu"}) is None
