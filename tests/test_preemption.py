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
