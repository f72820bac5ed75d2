"""The host side of an admission: chunk arrays, grouping and slot lookup against the plain per-row
constructions their vectorized forms replaced, and when prefill waves need prompt digests."""

from __future__ import annotations

import random

import numpy as np
from helpers import tiny_model

from mlxfun.engine import blocks as blk
from mlxfun.engine.core import Engine
from mlxfun.engine.paging import Pages
from mlxfun.engine.prefill import chunk_arrays, group_tokens, plan_groups


def naive_chunk(tokens, starts, offset, size):
    ids = np.zeros((len(tokens), size), np.int32)
    positions = np.full((len(tokens), size), -1, np.int32)
    last, ends = np.zeros(len(tokens), np.int32), np.zeros(len(tokens), bool)
    for i, (t, s) in enumerate(zip(tokens, starts)):
        part = t[offset:offset + size]
        ids[i, :len(part)] = part
        positions[i, :len(part)] = np.arange(s + offset, s + offset + len(part))
        if part and offset + len(part) == len(t):
            last[i], ends[i] = len(part) - 1, True
    return ids, positions, last, ends


def test_chunk_arrays_equal_per_row_construction():
    rng = random.Random(0)
    tokens = [[rng.randrange(1, 500) for _ in range(n)] for n in (1, 7, 16, 33, 40, 0, 64)]
    starts = [0, 16, 0, 32, 48, 0, 16]
    for offset, size in [(0, 64), (0, 16), (16, 16), (32, 32), (48, 16)]:
        got = chunk_arrays(tokens, starts, offset, size)
        for g, w in zip(got, naive_chunk(tokens, starts, offset, size)):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)


def test_plan_groups_equals_quadratic_rule():
    def quadratic(lengths):
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups = []
        for i in order:
            g = groups[-1] if groups else []
            if g and (len(g) + 1) * lengths[g[0]] <= 1.3 * (sum(lengths[j] for j in g) + lengths[i]) \
                    and (len(g) + 1) * lengths[g[0]] <= 8192:
                g.append(i)
            else:
                groups.append([i])
        return groups

    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randrange(1, 600) for _ in range(rng.randrange(1, 40))]
        assert plan_groups(lengths) == quadratic(lengths)


def test_groups_hold_a_bounded_chunk():
    """A chunk holds at most GROUP_TOKENS tokens at the 8B's width, in inverse proportion to the
    width (an admission's peak memory follows it): 128 prompts of 128 tokens go in two groups of
    64; rows of prompts longer than a chunk count a chunk's tokens each; one row alone may hold
    more."""
    from mlxfun.engine.prefill import GROUP_TOKENS

    assert GROUP_TOKENS == 8192
    assert [len(g) for g in plan_groups([128] * 128)] == [64, 64]
    assert [len(g) for g in plan_groups([128] * 100)] == [64, 36]
    assert [len(g) for g in plan_groups([2000] * 20, chunk=512)] == [16, 4]
    assert plan_groups([10_000, 9_999]) == [[0], [1]]
    assert [len(g) for g in plan_groups([128] * 128, limit=16384)] == [128]
    # In inverse proportion to the width: the 8B shape (4,096) as above, the 1B (2,048) twice that.
    assert [group_tokens(w) for w in (4096, 2048, 8192)] == [8192, 16384, 4096]


def test_slots_of_many_rows_equal_each_row_alone():
    """A linear table's one lookup for every row, against each row's held blocks (and a ring's
    per-row path), with blocks allocated out of order across rows."""
    for window in (None, 40):
        pool = blk.Pool(8, 4)
        pages = Pages(3, pool, window, max_blocks=256)
        pages.ensure(0, 0, 9)
        pages.ensure(1, 0, 3)
        pages.ensure(2, 4, 14)  # a row that starts at a cached prefix's end
        pages.ensure(1, 3, 17)
        positions = np.array([[0, 1, 8, -1, -1], [2, 3, 4, 15, 16], [4, 7, 12, 13, -1]], np.int32)
        slots = pages.slots([0, 1, 2], positions)
        for r, p in enumerate(positions):
            want = [pages.held[r][q // 4] * 4 + q % 4 if q >= 0 else 0 for q in p]
            assert slots[r].tolist() == want, (window, r)
        assert (slots[positions < 0] == 0).all()


def test_waves_skip_digests_only_when_no_prefix_is_shared():
    model = tiny_model()
    bs = 16
    shared = list(range(1, 2 * bs + 1))
    engine = Engine(model, 4)

    def records(prompts):
        ids = [engine.add(p, max_tokens=2) for p in prompts]
        engine._drain()  # requests added from any thread reach the engine's own records here
        return [engine.requests[i] for i in ids]

    shared_rows = records([[5] * 40, [6] * 40, shared + [7, 8], shared + [9]])
    waves = engine.scheduler.waves(shared_rows)
    # The two rows sharing two full blocks: the second waits for the first to cache them.
    assert [[r.id for r in w] for w in waves] == [[r.id for r in shared_rows[:3]], [shared_rows[3].id]]
    distinct = records([[5] * 40, [6] * 40, [7] * 5])
    assert engine.scheduler.waves(distinct) == [distinct]
    assert all(r.keys is None for r in distinct)  # nothing cached, first blocks distinct: no digests


def test_a_static_admission_builds_the_next_group_before_waiting_for_the_last(monkeypatch):
    """With nothing decoding, each length group is evaluated before the next launches (the peak
    holds one group's activations), but the next group's host work and graph come first, while
    the device runs the group before; the outputs are those of the admission unobserved."""
    import mlx.core as mx

    from mlxfun.engine import prefill

    model = tiny_model()
    prompts = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((12, 12, 5, 5))]

    def run():
        engine = Engine(model, 4, prefix_cache=False)
        for p in prompts:
            engine.add(p, max_tokens=3)
        tokens = {}
        for e in engine.events():
            tokens.setdefault(e.index, []).append(e.token)
        return tokens

    plain = run()
    log = []
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a, _real=real, _name=name: (log.append(_name), _real(*a))[1])
    real_rows = prefill.prefill_rows

    def rows(steps, *a, **k):
        built = steps._replace(prefill=lambda *b: (log.append("graph"), steps.prefill(*b))[1])
        return real_rows(built, *a, **k)
    monkeypatch.setattr(prefill, "prefill_rows", rows)
    monkeypatch.setattr(prefill, "group_tokens", lambda hidden: 24)  # two groups: the 12-token prompts, then the 5s
    grouped = run()
    admission = log[:log.index("eval", log.index("graph", log.index("graph") + 1) + 1) + 1]
    assert admission.count("graph") == 2
    second = admission.index("graph", admission.index("graph") + 1)
    assert "async_eval" in admission[:second]  # the first group launched before the second's graph
    assert admission[second:] == ["graph", "eval"]  # built, then waited for the first, then launched
    assert log[len(admission)] == "async_eval"
    assert grouped == plain and all(len(t) == 3 for t in plain.values())


def test_a_first_chunk_starts_its_first_layers_while_the_host_builds_the_rest(tmp_path):
    """`hidden(launch=...)` hands over the hidden state after LAUNCH_LAYERS layers, with none of the
    pool writes in its graph (launched while the caller holds the pool, a write would copy it
    whole); the hidden states and the cache are those of the pass built whole. A chunk whose
    attention reads its writes launches nothing early."""
    import mlx.core as mx
    from helpers import tiny_config
    from mlx.utils import tree_flatten

    from mlxfun.model import cache as kv
    from mlxfun.model import llama

    config = tiny_config(num_layers=4)
    model = tiny_model(config)
    tokens = mx.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 0]])
    positions = mx.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, -1]])
    for fresh, wraps, launches in ((True, False, 1), (False, True, 1), (False, False, 0)):
        whole = llama.hidden(config, model.params, tokens, positions, None, kv.empty(config, 2, 16, mx.float32),
                             wraps=wraps, fresh=fresh)
        launched = []

        def launch(arrays):
            launched.append(arrays)
            mx.export_to_dot(str(tmp_path / "early.dot"), *arrays)
            mx.async_eval(arrays)
        early = llama.hidden(config, model.params, tokens, positions, None, kv.empty(config, 2, 16, mx.float32),
                             wraps=wraps, fresh=fresh, launch=launch)
        assert len(launched) == launches
        if launches:
            graph = (tmp_path / "early.dot").read_text()
            assert len(launched[0]) == 1 and "Scatter" not in graph
            assert graph.count("Rsqrt") == 2 * llama.LAUNCH_LAYERS  # two RMS norms a layer: the first layers only
        for a, b in zip(tree_flatten(whole), tree_flatten(early), strict=True):
            assert mx.array_equal(a[1], b[1]).item()


def admitted(model, prompts):
    """`helpers.admission_peak` with a large pool -> (peak bytes, pool bytes, the first tokens)."""
    from helpers import admission_peak

    peak, pool, engine = admission_peak(model, prompts)
    assert pool >= 8e6
    return peak, pool, engine.runner.state.tokens.tolist()


def test_an_admission_launched_early_writes_the_kv_pool_in_place(monkeypatch):
    """An admission whose first layers start early still writes the pool in place (its peak holds
    the pool once), and gives the tokens it gives without the early launch."""
    import mlx.core as mx
    from helpers import tiny_config

    from mlxfun.model import llama

    model = tiny_model(tiny_config(num_layers=4, max_position_embeddings=8192))
    prompts = [[(5 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((60, 58, 57))]
    launches = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (launches.append(a), real(*a))[1])
    peak, pool, early = admitted(model, prompts)
    monkeypatch.undo()
    assert any(len(a) == 1 and len(a[0]) == 1 for a in launches)  # the early launch: [hidden state]
    assert peak < 1.25 * pool
    monkeypatch.setattr(llama, "LAUNCH_LAYERS", 99)
    assert admitted(model, prompts)[2] == early


def test_a_table_kept_column_by_column_equals_one_filled_from_scratch():
    """Rows entering new blocks write only those blocks' columns (`Pages._settle(row, new)`); after
    any mix of prompts, decode steps, ring drops, releases, cached prefixes and widenings, the table
    equals one filled from each row's held blocks."""
    rng = random.Random(3)
    for window in (None, 40):
        pool = blk.Pool(8, 4)
        pages = Pages(4, pool, window, max_blocks=4096)
        pos = [0] * 4
        for step in range(600):
            r = rng.randrange(4)
            kind = rng.random()
            if kind < 0.05:
                pages.release(r)
                pos[r] = 0
                if rng.random() < 0.5:  # the next request starts after a cached prefix
                    pages.ensure(r, 0, 8)
                    pos[r] = 8
            elif kind < 0.15:  # a prefill chunk
                n = rng.randrange(1, 30)
                pages.ensure(r, pos[r], pos[r] + n)
                pos[r] += n
            else:  # a decode step
                pages.ensure(r, pos[r], pos[r] + 1)
                pos[r] += 1
            pages.drop_behind(r, pos[r] - 1)
            kept = pages.table.copy()
            for row in range(4):
                pages._fill(row)
            assert (pages.table == kept).all(), (window, step)
        assert max(pos) > 100 and (window is not None or pages.width > 8)  # rows grew; a linear table widened


def test_a_decode_step_does_per_row_work_only_where_rows_change(monkeypatch):
    """A decode step's host work is the loop's own (a 1B step at 128 rows is host-bound on an H200):
    the live rows' mode is made again only when the rows' owners change, and blocks are ensured
    only for rows entering a new block; the tokens are those of the loop doing it every step."""
    from mlxfun.engine import core as eng
    from mlxfun.engine.paging import Pages

    model = tiny_model()
    prompts = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 9, 14, 20))]

    def run():
        engine = Engine(model, 4, prefix_cache=False)
        for p in prompts:
            engine.add(p, max_tokens=40, ignore_eos=True)
        return [e.token for e in engine.events()], engine

    plain, _ = run()
    modes, ensured = [], []
    real_mode, real_ensure = eng.mode_for, Pages.ensure
    monkeypatch.setattr(eng, "mode_for", lambda records: (modes.append(len(records)), real_mode(records))[1])
    monkeypatch.setattr(Pages, "ensure",
                        lambda self, r, s, e: (ensured.append((r, s, e)), real_ensure(self, r, s, e))[1])
    counted, engine = run()
    assert counted == plain
    steps = engine.stats.steps
    assert steps >= 39
    # Modes: the first tokens' (one per admitted group), then one per change of the rows' owners
    # (4 rows finish at the same step: one decode mode for all of it).
    assert len(modes) <= 3
    decode_ensures = [(r, s) for r, s, e in ensured if e == s + 1]
    bs = engine.scheduler.pool.block_size
    # Each row enters a new block at most every bs positions: 4 rows over 40 positions each.
    assert 0 < len(decode_ensures) <= 4 * (-(-40 // bs) + 1)
    assert all(s % bs == 0 for _, s in decode_ensures)


def test_an_admission_of_equal_prompts_writes_its_chunk_as_one_run_in_place(monkeypatch):
    """Prompts of equal length in consecutive blocks fill one run of slots: their chunk's writes
    are slice updates (`cache.write_run`), in place (the peak holds the pool once), and give the
    tokens that scattered writes give. Prompts of mixed lengths (padding) are scattered."""
    from helpers import tiny_config

    from mlxfun.model import cache as kv

    model = tiny_model(tiny_config(num_layers=4, max_position_embeddings=8192))
    runs = []
    real_write, real_start = kv.write_run, kv.run_start
    monkeypatch.setattr(kv, "write_run", lambda *a: (runs.append(a[1].shape), real_write(*a))[1])

    def admit(prompts):
        runs.clear()
        return admitted(model, prompts)

    equal = [[(5 * i + j) % 90 + 3 for j in range(64)] for i in range(3)]
    peak, pool, tokens = admit(equal)
    assert runs and all(shape[0] == 3 and shape[2] == 64 for shape in runs)  # (B, K, T, D): the whole chunk
    assert len(runs) == 2 * 4  # keys and values of each layer
    assert peak < 1.25 * pool
    monkeypatch.setattr(kv, "run_start", lambda slots: None)
    assert admit(equal)[2] == tokens and not runs
    monkeypatch.setattr(kv, "run_start", real_start)
    admit([p[:n] for p, n in zip(equal, (64, 60, 57))])
    assert not runs


def test_where_slice_updates_cost_the_pool_a_run_of_slots_is_scattered_to_the_same_pool(monkeypatch):
    """Equal prompts fill one run of slots. On the CPU their chunk is written by slice updates; where
    those cost a pass over the whole pool (CUDA: `prefill.slice_writes`) by a scatter instead, and
    the pool, its positions and the first tokens are the same bits either way."""
    import mlx.core as mx
    from helpers import tiny_config

    from mlxfun.engine import prefill
    from mlxfun.model import cache as kv

    model = tiny_model(tiny_config(num_layers=2))
    prompts = [[(7 * i + j) % 90 + 3 for j in range(32)] for i in range(3)]  # two blocks each
    runs = []
    real = kv.write_run
    monkeypatch.setattr(kv, "write_run", lambda *a: (runs.append(1), real(*a))[1])

    def admitted(slices: bool):
        monkeypatch.setattr(prefill, "slice_writes", lambda: slices)
        runs.clear()
        engine = Engine(model, len(prompts), shrink_rows=False)
        for p in prompts:
            engine.add(p, max_tokens=4, ignore_eos=True)
        engine.admit()
        state = engine.runner.state
        mx.eval(state)
        return len(runs), state

    assert prefill.slice_writes()  # this suite runs on the CPU
    sliced, a = admitted(True)
    scattered, b = admitted(False)
    assert sliced == 2 * model.config.num_layers and scattered == 0  # keys and values of each layer
    for x, y in zip(a.cache.keys + a.cache.values + (a.cache.positions, a.tokens), b.cache.keys + b.cache.values
                    + (b.cache.positions, b.tokens)):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_an_admission_beside_a_decode_step_builds_its_graph_before_waiting_for_it(monkeypatch):
    """Where pool writes wait for the one queued before (`Runner.settle`), an admission made while
    a decode step is in flight builds its chunk's whole graph first (the device runs that step
    meanwhile), then waits; an idle engine's admission waits first, then launches its first layers
    while it builds the rest. Either way the tokens are those of the requests alone."""
    from helpers import tiny_config

    from mlxfun.engine import step
    from mlxfun.engine.runner import Runner

    model = tiny_model(tiny_config(num_layers=2))
    order = []
    real_chunk, real_settle = step.prefill_chunk, Runner.settle
    monkeypatch.setattr(step, "prefill_chunk", lambda *a, **k: (order.append("graph"), real_chunk(*a, **k))[1])
    monkeypatch.setattr(Runner, "settle",
                        lambda self, cache=None: (order.append("settle"), real_settle(self, cache))[1])
    engine = Engine(model, 2, shrink_rows=False, admit_min=1)
    assert engine.runner.settle_bytes == 0  # the CPU: every pool write waits for the one before
    first = engine.add([5, 6, 7, 8, 9], max_tokens=6, ignore_eos=True)
    engine.step()  # admitted idle, then a decode step queued
    assert order[:2] == ["settle", "graph"]
    order.clear()
    second = engine.add([9, 8, 7], max_tokens=3, ignore_eos=True)
    engine.step()  # admitted while the decode step is in flight
    assert order[:2] == ["graph", "settle"]
    for _ in engine.events():
        pass
    tokens = {rid: engine.take(rid).row.text.tokens for rid in (first, second)}
    for rid, prompt, n in ((first, [5, 6, 7, 8, 9], 6), (second, [9, 8, 7], 3)):
        alone = Engine(model, 2, shrink_rows=False)
        r = alone.add(prompt, max_tokens=n, ignore_eos=True)
        for _ in alone.events():
            pass
        assert alone.take(r).row.text.tokens == tokens[rid]
