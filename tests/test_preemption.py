"""A fixed-pool engine (a server's) admits by the blocks a row holds, and when the pool runs out
takes the newest row back and later recomputes it: every request still ends as it would alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import tiny_config, tiny_model

import mlxfun
from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.model import cache as kv

ROWS = 8


@pytest.fixture(scope="module")
def model():
    m = tiny_model(tiny_config(max_position_embeddings=1024), seed=4)
    mx.eval(m.params)
    return m


def options(i: int) -> dict:
    """Greedy, seeded sampled (top-p), and sampled with penalties, in turn."""
    return [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=100 + i),
            dict(temperature=0.8, top_k=20, frequency_penalty=0.7, presence_penalty=0.3, seed=200 + i)][i % 3]


def test_sixteen_long_requests_through_a_small_pool_each_equal_alone(model):
    prompts = [[(7 * i + 3 * j) % 90 + 1 for j in range(12 + 5 * i)] for i in range(16)]
    max_tokens = [150 + 10 * (i % 4) for i in range(16)]
    block_bytes = kv.BLOCK * kv.slot_bytes(model.config, mx.float32)
    budget = 48 * block_bytes  # 8 rows of ~200 tokens would need about 100 blocks
    engine = Engine(model, ROWS, fixed_shapes=True, kv_memory=budget, prefix_cache_bytes=4 * block_bytes)
    ids = []
    for i, p in enumerate(prompts):
        o = options(i)
        settings = sampling.make_settings(1, **{k: v for k, v in o.items()})
        ids.append(engine.add(p, max_tokens=max_tokens[i], settings=settings, ignore_eos=True))
    for _ in engine.events():
        pass
    sched = engine.scheduler
    assert engine.stats.preemptions > 0
    assert sum(engine.requests[i].preemptions for i in ids) == engine.stats.preemptions
    assert sched.pool.size <= budget // block_bytes and engine.stats.peak_kv_bytes <= budget
    for i, rid in enumerate(ids):
        record = engine.take(rid)
        assert record.finish_reason == "length"
        alone = mlxfun.generate(model, [prompts[i]], max_tokens=max_tokens[i], ignore_eos=True, **options(i))
        assert record.row.token_ids == alone.token_ids[0], (i, record.preemptions)


def test_prompts_riding_along_while_rows_are_taken_back_each_equal_alone(model):
    """A server's closed loop (one request in as one ends) through a small pool, with prompts of up
    to 64 tokens riding along decode steps (a GPU server's default): rows are taken back around
    them, never one whose prompt is in the step's chunk, and every request ends as it would alone."""
    prompts = [[(7 * i + 3 * j) % 90 + 1 for j in range(12 + 5 * (i % 11))] for i in range(14)]
    max_tokens = [120 + 10 * (i % 4) for i in range(14)]
    block_bytes = kv.BLOCK * kv.slot_bytes(model.config, mx.float32)
    engine = Engine(model, ROWS, fixed_shapes=True, kv_memory=40 * block_bytes, prefix_cache_bytes=4 * block_bytes,
                    mixed_tokens=64)

    def add(i: int) -> int:
        settings = sampling.make_settings(1, **options(i))
        return engine.add(prompts[i], max_tokens=max_tokens[i], settings=settings, ignore_eos=True)

    ids = [add(i) for i in range(ROWS)]
    while not engine.idle or len(ids) < len(prompts):
        for e in engine.step():
            if e.finish_reason is not None and len(ids) < len(prompts):
                ids.append(add(len(ids)))
    assert engine.stats.preemptions > 0 and engine.stats.carried > 0, (engine.stats.preemptions, engine.stats.carried)
    for i, rid in enumerate(ids):
        record = engine.take(rid)
        alone = mlxfun.generate(model, [prompts[i]], max_tokens=max_tokens[i], ignore_eos=True, **options(i))
        assert record.row.token_ids == alone.token_ids[0], (i, record.preemptions)


def test_a_row_whose_prompt_rides_along_the_step_is_never_taken_back(model, monkeypatch):
    """Admission leaves room for every live row's next block, so a step seldom preempts right after
    it; when one does, the rows whose prompts are in the step's chunk stay (their tokens are queued
    with it), and the newest of the others goes."""
    engine = Engine(model, ROWS, fixed_shapes=True, kv_memory=1 << 24, mixed_tokens=64)
    ids = [engine.add([1 + i, 2, 3], max_tokens=40, ignore_eos=True) for i in range(3)]
    engine.step()
    engine.step()
    ids.append(engine.add([9, 8, 7, 6], max_tokens=40, ignore_eos=True))  # rides along the next step
    sched, asked = engine.scheduler, []
    victims = sched.victims
    rider = 3  # the fourth row: rows are filled lowest first
    assert sched.owner[rider] is None
    engine.admit()
    assert engine._chunk is not None and engine._chunk.rows == [rider] and sched.owner[rider] == ids[3]
    with monkeypatch.context() as m:
        m.setattr(sched.pool, "available", lambda: 0)  # a full pool
        m.setattr(sched, "pos", [16] * len(sched.pos))  # every row enters a new block
        taken = victims(sched.live_rows(), engine._chunk.rows)
        assert rider not in taken and taken[0] == 2  # the newest of the others
        assert victims(sched.live_rows())[0] == rider  # without `keep` it would have been the rider

    def recorded(live, keep=()):
        asked.append(list(keep))
        return []

    monkeypatch.setattr(sched, "victims", recorded)
    engine._prepare_step()
    assert asked == [[rider]]


def test_without_room_requests_wait_rather_than_reserve(model):
    """Admission counts what rows hold: with long max_tokens, all rows start at once (a reserving
    engine would run the requests two at a time here)."""
    block_bytes = kv.BLOCK * kv.slot_bytes(model.config, mx.float32)
    engine = Engine(model, ROWS, fixed_shapes=True, kv_memory=40 * block_bytes, prefix_cache_bytes=0)
    for i in range(ROWS):
        engine.add([i + 1, i + 2, i + 3], max_tokens=300, ignore_eos=True)
    engine.step()
    assert engine.scheduler.live_count() == ROWS
    reserving = Engine(model, ROWS, kv_memory=40 * block_bytes, prefix_cache_bytes=0)
    for i in range(ROWS):
        reserving.add([i + 1, i + 2, i + 3], max_tokens=300, ignore_eos=True)
    reserving.step()
    assert reserving.scheduler.live_count() == 2
