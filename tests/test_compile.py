"""The decode step is compiled once per (batch size, cache-capacity bucket), never per token, and
compiling it changes nothing in its output."""

from __future__ import annotations

import re
from functools import partial

import mlx.core as mx
from helpers import run_engine, tiny_config, tiny_model

from mlxfun.engine.step import (
    Steps,
    decode_step,
    forward_step,
    make_steps,
    mixed_step,
    prefill_chunk,
    sample_step,
    verify_step,
)
from mlxfun.engine.strategy import QUANTIZED
from mlxfun.model import cache as kv


def counting_steps():
    """A steps factory for the engine (fresh compiled steps per mode) and its trace count."""
    traces, made = [0], {}

    def count():
        traces[0] += 1

    def steps(config, mode) -> Steps:
        return made.setdefault(mode, make_steps(config, mode, on_trace=count))

    return steps, traces


def uncompiled_steps(config, mode) -> Steps:
    return Steps(partial(decode_step, config, mode), partial(prefill_chunk, config), partial(verify_step, config, mode),
                 partial(forward_step, config), partial(sample_step, mode), partial(mixed_step, config, mode))


def run(model, prompts, steps, **options):
    return run_engine(model, prompts, steps=steps, ignore_eos=True, **options)[0]


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    return [[(5 * i + 3 * j) % (vocab - 1) + 1 for j in range(n)] for i, n in enumerate(lengths)]


def test_decode_traced_once_over_64_tokens():
    model = tiny_model()
    prompts = prompts_of([7, 3, 12, 1], model.config.vocab_size)
    steps, traces = counting_steps()
    result = run(model, prompts, steps, max_tokens=64)
    assert all(len(ids) == 64 for ids in result.token_ids)
    assert traces[0] == 1


def test_retrace_once_per_capacity_bucket():
    model = tiny_model(tiny_config(max_position_embeddings=1024))
    block = kv.bucket(1)
    # The prompt fills all but 3 slots of the first bucket: the next 20 tokens cross into the second.
    prompts = prompts_of([block - 3, block - 10], model.config.vocab_size)
    steps, traces = counting_steps()
    run(model, prompts, steps, max_tokens=20)
    assert traces[0] == 2
    # The same steps at the same batch size and buckets: nothing new to trace.
    run(model, prompts, steps, max_tokens=20)
    assert traces[0] == 2


def test_admission_sizes_the_pool_once():
    # 16 rows of 10 + 200 tokens hold 224 blocks of 16: the pool would pass 1 + 64, 96, 128, 192 and
    # 256 blocks growing on demand (a trace each); admission reserves them at once (the scratch
    # block beside them).
    model = tiny_model(tiny_config(max_position_embeddings=1024))
    steps, traces = counting_steps()
    result, engine = run_engine(model, prompts_of([10] * 16, model.config.vocab_size), steps=steps,
                                ignore_eos=True, max_tokens=200)
    assert all(len(ids) == 200 for ids in result.token_ids)
    assert engine.stats.peak_kv_bytes == (1 + 256) * engine.block_bytes
    assert traces[0] == 1


def test_a_batch_that_needs_a_power_of_two_blocks_gets_no_more():
    """The scratch block is beside the pool's grid: 16 rows of 10 + 22 tokens need 32 blocks and
    get a pool of 1 + 32, not 1 + 48 (on the CPU, whose grid starts at 16 blocks), 64 rows need 128
    and get 1 + 128, not 192."""
    model = tiny_model(tiny_config(max_position_embeddings=1024))
    for rows, blocks in ((16, 33), (64, 129)):
        _, engine = run_engine(model, prompts_of([10] * rows, model.config.vocab_size), ignore_eos=True,
                               max_tokens=22)
        assert engine.stats.peak_kv_bytes == blocks * engine.block_bytes


def test_new_batch_size_traces_once_more():
    model = tiny_model()
    steps, traces = counting_steps()
    run(model, prompts_of([4, 6], model.config.vocab_size), steps, max_tokens=8)
    run(model, prompts_of([5, 2], model.config.vocab_size), steps, max_tokens=8)
    assert traces[0] == 1
    run(model, prompts_of([4, 6, 3], model.config.vocab_size), steps, max_tokens=8)
    assert traces[0] == 2


def test_compiled_equals_uncompiled():
    model = tiny_model()
    prompts = prompts_of([9, 2, 15], model.config.vocab_size)
    options = dict(max_tokens=16, logprobs=3)
    compiled = run(model, prompts, counting_steps()[0], **options)
    plain = run(model, prompts, uncompiled_steps, **options)
    assert compiled.token_ids == plain.token_ids
    for a, b in zip(compiled.logprobs, plain.logprobs):
        assert mx.allclose(mx.array(a), mx.array(b), atol=1e-4).item()


def test_compiled_equals_uncompiled_quantized():
    model = tiny_model(quant=(4, 32))
    prompts = prompts_of([6, 11], model.config.vocab_size)
    compiled = run(model, prompts, counting_steps()[0], max_tokens=12)
    plain = run(model, prompts, uncompiled_steps, max_tokens=12)
    assert compiled.token_ids == plain.token_ids


def test_a_compiled_prefill_equals_the_plain_one():
    """`make_steps(compile_prefill=1 << 30)` (every chunk compiled) gives the same tokens and logprobs as
    the plain prefill: first chunks of fresh rows, later chunks (prefill_step 8), rows reusing a
    cached prefix (their first chunk reads the pool), and rings whose chunks wrap (max_kv_size)."""
    model = tiny_model()
    shared = prompts_of([20], model.config.vocab_size)[0]
    prompts = [shared + [3, 4], prompts_of([2], model.config.vocab_size)[0], shared[:17] + [9, 9, 9, 9, 9]]
    made: dict = {}

    def compiled(config, mode) -> Steps:  # per config: max_kv_size makes another
        return made.setdefault((config, mode), make_steps(config, mode, compile_prefill=1 << 30))

    for options in (dict(prefill_step=8), dict(prefill_step=8, max_kv_size=12)):
        a = run(model, prompts, compiled, max_tokens=10, logprobs=2, **options)
        b = run(model, prompts, uncompiled_steps, max_tokens=10, logprobs=2, **options)
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert mx.allclose(mx.array(x), mx.array(y), atol=1e-4).item()


def graph_nodes(outputs, tmp_path) -> list[str]:
    """The primitive of every node of the graph behind `outputs` (lazy arrays, a tree)."""
    from mlx.utils import tree_flatten
    arrays = [a for _, a in tree_flatten(outputs, is_leaf=lambda x: x is None) if isinstance(a, mx.array)]
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *arrays)
    return re.findall(r'label ="?([A-Za-z_]+)', path.read_text())


def first_decode(engine):
    """Two prompts (5 and 9 tokens) admitted -> the engine's compiled decode step and its arguments."""
    for p in prompts_of([5, 9], engine.config.vocab_size):
        engine.add(p, max_tokens=6, ignore_eos=True)
    engine.admit()
    mx.eval(engine.runner.state)
    return engine.next_decode()


def test_decode_products_read_transposed_views_without_a_node_each(tmp_path):
    """The engine's steps read dense weights through `weight_t`, a transposed view sharing their
    memory: a decode step's graph has one transpose node fewer per product (4 per layer and the
    tied output head), the same tokens, and no weight is copied."""
    from mlxfun.engine.core import Engine
    from mlxfun.model import weights
    model = tiny_model()
    engine = Engine(model, rows=2)
    assert engine.runner.params is model.params  # the engine's weights are the model's
    views = engine.runner.step_params
    def maps(params) -> list:  # every linear map, the embedding first
        found = []
        weights.map_linears(model.config, params, lambda p, n: found.append(p) or p)
        return found

    assert len(maps(views)) == 4 * model.config.num_layers + 1
    for plain, view in zip(maps(engine.runner.params), maps(views)):
        assert plain.weight_t is None and view.weight is plain.weight
        assert view.weight_t.shape == plain.weight.shape[::-1] and mx.array_equal(view.weight_t, plain.weight.T).item()
    before = mx.get_active_memory()
    assert weights.with_transposed(model.config, model.params) is not model.params
    assert mx.get_active_memory() - before < 1024  # views: no copy of the 4-layer model's weights
    fn, args = first_decode(engine)
    with_views = graph_nodes(fn(*args), tmp_path)
    without = graph_nodes(fn(engine.runner.params, *args[1:]), tmp_path)
    products = 4 * model.config.num_layers + 1  # the output head is the tied embedding
    assert without.count("Transpose") - with_views.count("Transpose") == products
    assert len(without) - len(with_views) == products
    a, _ = fn(*args)
    b, _ = fn(engine.runner.params, *args[1:])
    assert a.tokens.tolist() == b.tokens.tolist()
    quantized = tiny_model(quant=(4, 32))  # every map quantized: nothing to view
    assert Engine(quantized, rows=2, strategy=QUANTIZED).runner.step_params is quantized.params


def test_decode_bookkeeping_fuses_and_reads_the_table_width_at_run_time(tmp_path, monkeypatch):
    """A decode step's mask (slots holding their own positions, causal, padding seeing all) is one
    fused kernel, with no reduction for queries that see nothing; and the table's width and slot
    count reach kernels as inputs (`scalars.dynamic`: a Slice of a two-element constant), not as
    one-element constants, which `mx.compile` writes into a kernel's source: on CUDA each new
    width would build new kernels (the first step at 32 columns took 9 s on an H200)."""
    from mlxfun.engine.core import Engine
    from mlxfun.model.scalars import dynamic
    x = mx.arange(10)
    baked = graph_nodes(mx.compile(lambda x: (x % 7,))(x), tmp_path)
    read = graph_nodes(mx.compile(lambda x: (x % dynamic(7),))(x), tmp_path)
    assert "Slice" not in baked and read.count("Slice") == 1 and mx.array_equal(x % dynamic(7), x % 7).item()
    model = tiny_model()
    engine = Engine(model, rows=2)
    fn, args = first_decode(engine)
    nodes = graph_nodes(fn(*args), tmp_path)
    mask = [n for n in nodes if n.startswith("Compiled") and all(k in n for k in ("LessEqual", "Remainder", "Equal"))]
    assert len(mask) == 1 and "Or" not in nodes and not any("LogicalNot" in n for n in nodes)
    from mlxfun.engine import step
    from mlxfun.model import cache, masks
    monkeypatch.setattr(cache, "dynamic", lambda n, dtype=mx.int32: n)  # plain Python ints: constants
    monkeypatch.setattr(masks, "dynamic", lambda n, dtype=mx.int32: n)
    fresh = step.make_steps(model.config, engine.roster().mode).decode  # traced again
    assert nodes.count("Slice") - graph_nodes(fresh(*args), tmp_path).count("Slice") == 2  # width and slot count
