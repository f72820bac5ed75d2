"""The scheduler under load: many threads adding and cancelling, thousands of requests in one
process, memory budgets, and every boundary checked before any work."""

from __future__ import annotations

import json
import pickle
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import admission_peak, admit_measured, tiny_config, tiny_model

import mlxfun
from mlxfun.engine import prefill, sampling, step
from mlxfun.engine.core import Engine
from mlxfun.engine.paging import pool_size
from mlxfun.engine.records import WINDOW
from mlxfun.generate import generate
from mlxfun.model import cache as kv
from mlxfun.model import llama, weights


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(tiny_config(max_position_embeddings=1024))


@pytest.mark.parametrize("server", [False, True], ids=["offline", "server"])
def test_eight_threads_add_and_cancel_against_a_running_engine(tiny, server):
    """8 threads submit 400 requests (greedy and seeded sampled) to an engine that one thread runs,
    and cancel some at random. Each request ends exactly once; the others equal their output alone.
    `server`: a server's engine (fixed shapes) whose short prompts ride along decode steps, as on a
    GPU: cancellations land on rows admitted that way too (200 requests: it runs slower on the CPU,
    where every row of its fixed width decodes)."""
    rng = random.Random(0)
    kinds = [([rng.randrange(1, 97) for _ in range(rng.choice([1, 3, 8, 20, 45]))], rng.randrange(1, 24),
              rng.choice([0.0, 0.0, 0.8]), rng.randrange(1000)) for _ in range(24)]
    alone = [generate(tiny, [p], max_tokens=m, temperature=t, seed=s, ignore_eos=True).token_ids[0]
             for p, m, t, s in kinds]
    engine = Engine(tiny, rows=6, fixed_shapes=True, kv_memory=1 << 24, mixed_tokens=64) if server \
        else Engine(tiny, rows=6)
    stop = threading.Event()
    tokens, closing, closed_at = defaultdict(list), {}, {}

    def run_engine():
        for e in engine.serve(stop):
            if e.token >= 0 and e.finish_reason != "stop":
                tokens[e.index].append(e.token)
            if e.finish_reason is not None:
                assert e.index not in closing, "a second closing event"
                closing[e.index] = e.finish_reason
                closed_at[e.index] = engine.stats.steps
                engine.take(e.index)

    submitted, cancelled, lock = {}, {}, threading.Lock()
    per_client = 25 if server else 50

    def client(seed: int):
        r = random.Random(seed)
        mine = []
        for _ in range(per_client):
            k = r.randrange(len(kinds))
            p, m, t, s = kinds[k]
            rid = engine.add(p, max_tokens=m, settings=sampling.make_settings(1, temperature=t, seed=s),
                             ignore_eos=True)
            mine.append(rid)
            with lock:
                submitted[rid] = k
            if r.random() < 0.25:
                time.sleep(r.random() * 0.01)
                victim = r.choice(mine)
                steps = engine.stats.steps
                engine.cancel(victim)
                with lock:
                    cancelled.setdefault(victim, steps)

    runner = threading.Thread(target=run_engine)
    runner.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=300)
    stop.set()
    runner.join(timeout=300)
    assert not runner.is_alive() and len(submitted) == 8 * per_client
    assert sorted(closing) == sorted(submitted)  # every request ended, exactly once
    assert not engine.requests and not engine.scheduler.pending and engine.idle
    n_cancelled = 0
    for rid, k in submitted.items():
        if closing[rid] == "cancelled":
            n_cancelled += 1
            assert rid in cancelled
            assert tokens[rid] == alone[k][: len(tokens[rid])]  # right up to where it stopped
            assert closed_at[rid] - cancelled[rid] <= 2  # left its row within a step of the cancel
        else:
            assert closing[rid] == "length" and tokens[rid] == alone[k], rid
    assert n_cancelled > 20  # the test exercised cancellation (some victims had finished already)
    assert (engine.stats.carried > 0) == server


def test_two_thousand_requests_keep_memory_and_records_flat(tiny):
    """A long request early grows the cache; it shrinks back once that request leaves. After a
    warm-up, active memory and the engine's records stay flat while 2,000 requests pass."""
    rng = random.Random(1)
    engine = Engine(tiny, rows=8)
    queue = [([rng.randrange(1, 97) for _ in range(900)], 12)]  # the long one, early
    queue += [([rng.randrange(1, 97) for _ in range(rng.randrange(1, 60))], rng.randrange(1, 8))
              for _ in range(1999)]
    queue.reverse()
    done, capacities = 0, []
    # Per window of 250 requests: active memory after each step (its median: a step's arrays in
    # flight come and go with timing, a leak moves them all), and the largest record count.
    memory, records = defaultdict(list), defaultdict(int)
    while done < 2000:
        while queue and 2000 - len(queue) - done < 12:  # 12 requests in the engine at a time
            p, m = queue.pop()
            engine.add(p, max_tokens=m, ignore_eos=True)
        for e in engine.step():
            if e.finish_reason is not None:
                assert len(engine.take(e.index).row.text.tokens) >= 1
                done += 1
        window = done // 250
        memory[window].append(mx.get_active_memory())
        held = len(engine.requests) + len(engine.scheduler.pending) + len(engine._inflight)
        records[window] = max(records[window], held)
        capacities.append(engine.stats.capacity)
    assert max(capacities) >= 1024 and capacities[-1] <= 256  # grew for the long request, then shrank
    memory = [statistics.median(memory[w]) for w in range(2, 8)]  # after a warm-up of 500 requests
    records = [records[w] for w in range(2, 8)]
    print(f"median active memory per 250 requests after 500: {memory}; records: {records}")
    assert max(memory) <= 1.1 * min(memory)
    assert max(records) <= 1.1 * min(records)
    assert len(engine.stats.ttft) == min(WINDOW, 2000) and len(engine.stats.itl) == WINDOW
    assert engine.stats.requests == 2000


def test_a_pool_compacts_only_to_a_smaller_size(tiny, monkeypatch):
    """Compaction copies every layer's KV, so it runs only when the pool gets smaller: a pool at
    its least size, its rows holding a few blocks, is never compacted (it was, to the same size,
    at every step), while one grown for a long request shrinks once that request has left."""
    copies = []
    take_blocks = kv.take_blocks
    monkeypatch.setattr(kv, "take_blocks", lambda cache, keep: copies.append(keep.size) or take_blocks(cache, keep))
    engine = Engine(tiny, rows=1)
    engine.add([3] * 5, max_tokens=40, ignore_eos=True)  # 3 blocks of the least pool (17 on the CPU)
    for _ in engine.events():
        assert engine.scheduler.pool.size == 1 + engine.scheduler.pages.least
    assert engine.stats.generation_tokens == 40 and copies == []
    engine = Engine(tiny, rows=2, prefix_cache=False)  # (cached prompt blocks would keep the pool's size)
    long = engine.add([4] * 900, max_tokens=4, ignore_eos=True)  # 57 blocks: the pool grows past 65
    short = engine.add([5] * 5, max_tokens=200, ignore_eos=True)  # 13 blocks
    sizes = []
    for e in engine.events():
        sizes.append(engine.scheduler.pool.size)
    grown = sizes.index(max(sizes))
    least = engine.scheduler.pages.least
    assert max(sizes) > 65 and pool_size(2 * 13, 10**6, least) in sizes[grown:] and len(copies) == 1
    assert engine.take(short).row.token_ids == generate(tiny, [[5] * 5], max_tokens=200, ignore_eos=True).token_ids[0]
    assert engine.take(long).row.finish_reason == "length"


def pool_sizes_seen(kinds: list):
    """Steps that record the device pool's blocks each prefill chunk and decode step is given."""
    made = {}

    def steps(config, mode):
        if mode not in made:
            s = step.make_steps(config, mode)

            def prefill(params, tokens, positions, cache, *rest):
                kinds.append(("prefill", cache.positions.shape[0]))
                return s.prefill(params, tokens, positions, cache, *rest)

            def decode(params, state, settings):
                kinds.append(("decode", state.cache.positions.shape[0]))
                return s.decode(params, state, settings)

            made[mode] = s._replace(prefill=prefill, decode=decode)
        return made[mode]

    return steps


def test_a_first_admission_holds_its_prompts_kv_and_its_first_step_the_reservation(tiny):
    """A static batch's pool is made for its prompts' blocks and grows to what its rows may hold
    (their prompts and every token they may generate) at the first decode step, once the prompts'
    activations are freed: made at the reservation before the prompts ran, the pool of the 1B's
    128 x 128-token batch took its generated tokens' KV (0.54 GB) above round 1's peak. The KV
    written before the growth is read after it: every row equals its output alone."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randrange(60, 200))] for _ in range(8)]
    seen = []
    engine = Engine(tiny, rows=8, shrink_rows=False, steps=pool_sizes_seen(seen))
    ids = [engine.add(p, max_tokens=120, ignore_eos=True) for p in prompts]
    list(engine.events())
    prompt_blocks = sum(-(-len(p) // kv.BLOCK) for p in prompts)
    reserved = sum(-(-(len(p) + 120) // kv.BLOCK) for p in prompts)
    least = engine.scheduler.pages.least
    assert {n for kind, n in seen if kind == "prefill"} == {pool_size(1 + prompt_blocks, 10**6, least)}
    assert {n for kind, n in seen if kind == "decode"} == {pool_size(reserved, 10**6, least)}
    assert pool_size(1 + prompt_blocks, 10**6, least) < pool_size(reserved, 10**6, least)
    alone = [generate(tiny, [p], max_tokens=120, ignore_eos=True).token_ids[0] for p in prompts]
    assert [engine.take(i).row.token_ids for i in ids] == alone


def test_an_admission_before_the_first_decode_step_grows_the_pool_it_writes(tiny):
    """Until a first decode step grows it, the device pool holds only the first admission's
    prompts. A second admission before that step (the engine busy: `admit` called twice) takes
    blocks past it, so its prefill grows the pool first: written past its end, MLX's scatter
    corrupted memory and the process died. So the engine runs in a subprocess; its requests must
    equal their outputs alone."""
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "tests")
        from helpers import tiny_config, tiny_model
        from mlxfun.engine.core import Engine
        engine = Engine(tiny_model(tiny_config(max_position_embeddings=1024)), rows=3, shrink_rows=False)
        first = [engine.add([3 + i] * 10, max_tokens=1000, ignore_eos=True) for i in range(2)]  # 128 blocks reserved
        engine.admit()
        before = engine.runner.state.cache.positions.shape[0]
        pool = engine.scheduler.pool
        assert before == 1 + engine.scheduler.pages.least < pool.size, (before, pool.size)
        late = engine.add([(7 * j) % 96 + 1 for j in range(1000)], max_tokens=8, ignore_eos=True)  # 63 blocks
        engine.admit()
        highest = max(engine.scheduler.pages.held[engine.scheduler.owner.index(late)].values())
        after = engine.runner.state.cache.positions.shape[0]
        list(engine.events())
        print(json.dumps({"before": before, "highest": highest, "after": after,
                          "tokens": [engine.take(rid).row.token_ids for rid in first + [late]]}))
    """)
    root = Path(__file__).resolve().parent.parent  # this checkout's mlxfun, not an installed one
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["highest"] >= got["before"] and got["after"] > got["highest"]  # its blocks lie past the first pool
    late = [(7 * j) % 96 + 1 for j in range(1000)]
    assert got["tokens"] == [generate(tiny, [[3 + i] * 10], max_tokens=1000, ignore_eos=True).token_ids[0]
                             for i in range(2)] + [generate(tiny, [late], max_tokens=8, ignore_eos=True).token_ids[0]]


def test_memory_budget_refuses_what_never_fits_and_delays_what_fits_alone(tiny):
    block = kv.BLOCK * kv.slot_bytes(tiny.config, mx.float32)
    engine = Engine(tiny, rows=2, kv_memory=40 * block)  # 40 blocks of 16 slots
    with pytest.raises(mlxfun.InputError, match=r"needs 0.37 MB of KV cache; 0.33 MB are available"):
        engine.add([1] * 10, max_tokens=700)  # 710 slots: 45 blocks
    a = engine.add([3] * 10, max_tokens=450, ignore_eos=True)  # 29 blocks: fits alone
    b = engine.add([4] * 450, max_tokens=10, ignore_eos=True)  # 29 blocks: fits alone, not beside a
    order = [(e.index, e.finish_reason) for e in engine.events()]
    first_b = next(i for i, (rid, _) in enumerate(order) if rid == b)
    assert (a, "length") in order[:first_b]  # b waited for a to leave
    assert engine.stats.peak_kv_used_bytes <= 40 * block
    assert engine.take(b).row.token_ids == generate(tiny, [[4] * 450], max_tokens=10, ignore_eos=True).token_ids[0]
    assert engine.take(a).row.token_ids == generate(tiny, [[3] * 10], max_tokens=450, ignore_eos=True).token_ids[0]


def test_static_batch_that_does_not_fit_runs_in_waves(tiny, monkeypatch):
    """generate() admits what fits the budget and queues the rest: outputs still equal alone."""
    block = kv.BLOCK * kv.slot_bytes(tiny.config, mx.float32)
    limit = lambda: int((mx.get_active_memory() + 45.5 * block) / 0.75)  # noqa: E731
    monkeypatch.setattr("mlxfun.engine.kv_budget.memory_limit", limit)
    # 20, 20, 20 and 17 blocks: two at a time fit 45 blocks.
    prompts, max_tokens = [[5] * 300, [6] * 290, [7] * 10, [8] * 12], [20, 30, 300, 250]
    out = generate(tiny, prompts, max_tokens=max_tokens, ignore_eos=True)
    assert out.stats.admissions >= 2 and out.stats.peak_kv_used_bytes <= 45 * block
    for p, m, ids in zip(prompts, max_tokens, out.token_ids):
        assert ids == generate(tiny, [p], max_tokens=m, ignore_eos=True).token_ids[0]


def test_a_server_engine_process_limits_mlx_to_its_share_of_the_device(tiny, tmp_path, monkeypatch):
    """A server's engine process sets MLX's memory limit to what MLX holds plus what the device has
    free, less `UNCOUNTED_BYTES`, so that beside other processes on one GPU MLX trims its cache of
    freed buffers before the device runs out. The CPU reports no free memory: no limit there."""
    from mlxfun.engine import kv_budget
    from mlxfun.engine.options import GenerationConfig
    from mlxfun.serve import engine_process

    assert kv_budget.process_memory_limit() is None
    free = 6 << 30
    monkeypatch.setattr(kv_budget, "free_memory", lambda: free)
    held = mx.get_active_memory() + mx.get_cache_memory()
    assert kv_budget.process_memory_limit() == held + free - kv_budget.UNCOUNTED_BYTES
    limits = []
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.append(n) or 0)
    mlxfun.save(tiny, tmp_path / "m")
    spec = engine_process.EngineSpec(str(tmp_path / "m"), None, 2, GenerationConfig(), 1 << 20)
    engine = spec.maker()()
    assert len(limits) == 1  # set once, after the weights are loaded and before the pool is made
    assert free - kv_budget.UNCOUNTED_BYTES < limits[0] <= free - kv_budget.UNCOUNTED_BYTES + \
        mx.get_active_memory() + mx.get_cache_memory()
    assert engine.fixed  # the server's engine: fixed shapes


class StuckPipe:
    """A pipe whose reader does not read until `go` is set; ("closed", ...) messages find it closed.
    Only an `Outbox`'s thread may write to it."""

    def __init__(self):
        self.go, self.got = threading.Event(), []

    def send(self, m):
        assert threading.current_thread() is not threading.main_thread(), "written on the caller's thread"
        self.go.wait()
        if m[0] == "closed":
            raise OSError("the pipe is closed")
        self.got.append(m)


def test_the_engine_process_queues_its_messages_and_never_waits_for_the_pipe():
    """The engine process' messages go through its `Outbox`: queued at once while the pipe is full
    (the server's process slow to read), then written in the order they were queued; a message
    the pipe refuses is dropped rather than raising in the engine process, and one that does not
    pickle goes without what does not pickle."""
    from mlxfun.serve.engine_process import Outbox
    from mlxfun.serve.serving import EngineFailed

    pipe = StuckPipe()
    outbox = Outbox(pipe)
    t = time.perf_counter()
    for i in range(1000):
        outbox.put(("items", i))
    queued = time.perf_counter() - t
    assert pipe.got == [] and queued < 5.0  # nothing written, and the puts returned (with the reader stuck)
    pipe.go.set()
    outbox.put(("closed",))
    outbox.put(("items", 1000))
    outbox.close()
    assert pipe.got == [("items", i) for i in range(1001)]

    # An item that does not pickle fails its own submission only; the step's other items still go.
    class Pickling(StuckPipe):
        def send(self, m):
            self.got.append(pickle.loads(pickle.dumps(m)))

    pipe = Pickling()
    outbox = Outbox(pipe)
    outbox.put(("items", [(7, ("event", None)), (8, ("event", lambda: 0)), (9, ("done", "outcome"))]))
    outbox.put(("items", [(7, ("next", None))]))
    outbox.close()
    (first, items), second = pipe.got
    assert first == "items" and items[0] == (7, ("event", None)) and items[2] == (9, ("done", "outcome"))
    assert items[1][0] == 8 and isinstance(items[1][1][0], EngineFailed) and items[1][1][1] is None
    assert "could not be sent" in str(items[1][1][0])
    assert second == ("items", [(7, ("next", None))])


def test_the_servers_process_queues_its_messages_to_the_engine_and_never_waits_for_the_pipe():
    """The server's event loop hands its messages to an `Outbox` of its own: a submission returns
    at once while the engine process is slow to read (a full pipe), messages go in order, and one
    the pipe refuses (the engine process gone) resolves its waiting answer with the failure value."""
    import asyncio

    from mlxfun.engine.options import GenerationConfig
    from mlxfun.serve.engine_process import EngineProcess, EngineSpec, Outbox

    ep = EngineProcess(EngineSpec(None, None, 2, GenerationConfig(), None), max_queued=4)
    pipe = StuckPipe()
    ep._outbox = Outbox(pipe, "mlxfun-writer", ep._unsent)
    t = time.perf_counter()
    for i in range(1000):
        ep._send(("cancel", i))
    assert pipe.got == [] and time.perf_counter() - t < 5.0  # queued, with the reader stuck

    async def refused():
        answer = asyncio.get_running_loop().create_future()
        ep._waiting[7] = (asyncio.get_running_loop(), answer, "the engine process died")
        ep._send(("closed", 7), 7)
        pipe.go.set()
        return await asyncio.wait_for(answer, 10)

    assert asyncio.run(refused()) == "the engine process died" and 7 not in ep._waiting
    ep._send(("cancel", 1000))
    ep._outbox.close()
    assert pipe.got == [("cancel", i) for i in range(1001)]

    async def after_close():  # a fresh process' outbox replaced this one: a late message still gets its answer
        answer = asyncio.get_running_loop().create_future()
        ep._waiting[8] = (asyncio.get_running_loop(), answer, "the engine process died")
        ep._send(("submit", 8, []), 8)
        return await asyncio.wait_for(answer, 10)

    assert asyncio.run(after_close()) == "the engine process died" and pipe.got[-1] == ("cancel", 1000)


def test_released_records_and_dropped_cache():
    model = tiny_model()
    engine = Engine(model, rows=3)
    ids = [engine.add([i + 1] * (i + 2), max_tokens=5, ignore_eos=True) for i in range(7)]
    list(engine.events())
    assert sorted(engine.requests) == ids and engine.runner.state is None and engine.stats.capacity == 0
    assert engine.stats.max_capacity >= kv.bucket(1)
    for i in ids:
        assert len(engine.take(i).row.token_ids) == 5
    assert not engine.requests
    with pytest.raises(KeyError):
        engine.take(ids[0])


def test_forward_refuses_a_chunk_past_the_end_of_the_cache():
    config = tiny_config()
    model = tiny_model(config)
    cache = kv.empty(config, 1, 8, mx.float32)
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    _, cache = llama.forward(config, model.params, tokens, mx.arange(6)[None], cache=cache)
    with pytest.raises(mlxfun.InputError, match="position 9 does not fit a cache of 8 slots per row"):
        llama.forward(config, model.params, tokens[:, :4], mx.arange(6, 10)[None], cache=cache)
    with pytest.raises(mlxfun.InputError, match="a chunk of 9 tokens"):
        llama.forward(config, model.params, mx.zeros((1, 9), mx.int32), mx.arange(9)[None],
                      cache=kv.empty(config, 1, 8, mx.float32))
    with pytest.raises(mlxfun.InputError, match="2 rows of tokens for a cache of 1 rows"):
        llama.hidden(config, model.params, mx.zeros((2, 1), mx.int32), mx.zeros((2, 1), mx.int32), cache=cache)
    # Two tokens fit, then the grown cache takes the rest: the same logits as one pass.
    first, cache2 = llama.forward(config, model.params, tokens[:, :2], mx.arange(6, 8)[None], cache=cache)
    more, _ = llama.forward(config, model.params, tokens[:, 2:4], mx.arange(8, 10)[None], cache=kv.grow(cache2, 16))
    whole, _ = llama.forward(config, model.params, mx.concatenate([tokens, tokens[:, :4]], axis=1),
                             mx.arange(10)[None])
    assert np.allclose(np.array(mx.concatenate([first, more], axis=1)), np.array(whole[:, 6:]), atol=1e-4)


def test_overflowing_write_is_an_error_not_a_crash():
    """6 then 4 tokens into 8 slots once dropped two tokens and aborted the process (heap
    corruption); run in a subprocess so that an abort fails this test instead of the suite."""
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import mlx.core as mx
        from helpers import tiny_config, tiny_model
        import mlxfun
        from mlxfun.model import cache as kv, llama
        config = tiny_config()
        model = tiny_model(config)
        cache = kv.empty(config, 1, 8, mx.float32)
        _, cache = llama.forward(config, model.params, mx.array([[1, 2, 3, 4, 5, 6]]), mx.arange(6)[None], cache=cache)
        try:
            llama.forward(config, model.params, mx.array([[1, 2, 3, 4]]), mx.arange(6, 10)[None], cache=cache)
        except mlxfun.InputError as e:
            print("refused:", e)
    """)
    root = Path(__file__).resolve().parent.parent  # this checkout's mlxfun, not an installed one
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: position 9 does not fit a cache of 8 slots per row" in run.stdout


# ---- bad values: clear errors before any work ----


@pytest.fixture
def no_prefill(monkeypatch):
    """Fails the test if any prompt reaches prefill."""
    def forbidden(*args, **kwargs):
        raise AssertionError("prefill ran before the bad value was caught")

    monkeypatch.setattr(prefill, "prefill_rows", forbidden)


@pytest.mark.parametrize("options,message", [
    (dict(logprobs=500), r"logprobs must be None or an integer in \[0, 97\]"),
    (dict(logprobs=True), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(max_tokens=True), "max_tokens must be a positive integer, got True"),
    (dict(max_tokens=2.0), "max_tokens must be a positive integer"),
    (dict(max_tokens=[4, True]), "max_tokens must be a positive integer, got True"),
    (dict(batch_size=True), "batch_size must be a positive integer"),
    (dict(batch_size=0), "batch_size"),
    (dict(prefill_step=0), "prefill_step"),
    (dict(max_kv_size=-4), "max_kv_size"),
    (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    (dict(temperature=[0.5]), "temperature has 1 values for 2 prompts"),
    (dict(seed=True), "seed"),
    (dict(top_k=1.5), "top_k"),
    (dict(stop=[["a"], [3]]), "stop strings must be strings"),
    (dict(temp=0.7), "unknown generation option 'temp' \\(did you mean 'temperature'\\?\\)"),
])
def test_bad_options_are_named_before_prefill(no_prefill, options, message):
    with pytest.raises(mlxfun.InputError, match=message):
        generate(tiny_model(), [[1, 2], [3]], **options)


@pytest.mark.parametrize("prompts,message", [
    (np.array([[1.0, 2.0]]), "token-id arrays must hold integers, got dtype float64"),
    (np.array([True, False]), "must hold integers"),
    (np.zeros((1, 2, 3), np.int32), "must be 1-D .* or 2-D"),
    ([[1, True]], "prompt 0 must be a string, a list of token ids or a list of messages"),
    ([[{"role": "wizard", "content": "hi"}]], "unknown role 'wizard'"),
    ([[1, 2], []], "prompt 1 is empty"),
    (42, "prompts must be a string, token ids, messages or a list of them, got int"),
    ([], "no prompts given"),
])
def test_bad_prompts_are_named_before_prefill(no_prefill, prompts, message):
    with pytest.raises(mlxfun.InputError, match=message):
        generate(tiny_model(), prompts)


def test_numpy_and_mlx_token_arrays_are_prompts():
    model = tiny_model()
    lists = [[5, 6, 7], [8, 9, 10]]
    expected = generate(model, lists, max_tokens=4, ignore_eos=True).token_ids
    assert generate(model, np.array(lists, np.int64), max_tokens=4, ignore_eos=True).token_ids == expected
    assert generate(model, mx.array(lists), max_tokens=4, ignore_eos=True).token_ids == expected
    assert generate(model, [np.array(p, np.int32) for p in lists], max_tokens=4, ignore_eos=True).token_ids == expected
    assert generate(model, np.array(lists[0]), max_tokens=4, ignore_eos=True).token_ids == expected[:1]


def test_engine_add_checks_settings_and_prompt(no_prefill):
    engine = Engine(tiny_model(), rows=2)
    with pytest.raises(mlxfun.InputError, match=r"one row's sampling.Settings .* got \(2,\)"):
        engine.add([1, 2], settings=sampling.make_settings(2))
    with pytest.raises(mlxfun.InputError, match="max_tokens"):
        engine.add([1, 2], max_tokens=True)
    with pytest.raises(mlxfun.InputError, match="outside"):
        engine.add([1, 200])
    with pytest.raises(mlxfun.InputError, match="submit takes an mlxfun Request"):
        engine.submit([1, 2])
    assert engine.idle and not engine.requests


def test_options_keep_mlx_lm_names_and_one_config_value():
    model = tiny_model()
    config = mlxfun.GenerationConfig(max_tokens=3, ignore_eos=True)
    a = generate(model, [[4, 5]], config)
    b = generate(model, [[4, 5]], max_tokens=3, ignore_eos=True)
    c = generate(model, [[4, 5]], config, max_tokens=5)  # keywords win over the config
    assert a.token_ids == b.token_ids and len(c.token_ids[0]) == 5 and c.token_ids[0][:3] == a.token_ids[0]
    import inspect

    params = inspect.signature(mlxfun.generate).parameters
    assert {"max_tokens", "temperature", "top_p", "min_p", "top_k", "seed", "stop", "logprobs",
            "batch_size"} <= set(params)
    assert params["max_tokens"].default == 256


def test_requests_built_on_one_thread_run_on_another(tiny):
    """generate()'s requests (per-row settings sliced from one array) built on the caller's thread
    and run by an engine on another: MLX evaluates arrays on the thread that built them."""
    from mlxfun.engine.options import GenerationConfig, requests

    prompts = [[5, 6, 7], [8, 9]]
    reqs = requests(tiny, prompts, GenerationConfig(max_tokens=6, temperature=0.7, seed=[1, 2], ignore_eos=True))
    engine = Engine(tiny, 2)
    out = {}

    def run():
        ids = [engine.submit(r) for r in reqs]
        list(engine.events())
        out.update({i: engine.take(rid).row.token_ids for i, rid in enumerate(ids)})

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=120)
    expected = generate(tiny, prompts, max_tokens=6, temperature=0.7, seed=[1, 2], ignore_eos=True).token_ids
    assert [out[0], out[1]] == expected


def test_requests_are_built_on_the_host_without_mlx_arrays(tiny):
    """A server's HTTP process builds every request (`options.requests`): it must not touch the
    device, where an MLX array would open a CUDA context beside the engine's. Its settings are NumPy
    arrays, and building them allocates no MLX memory; the engine copies them when it takes them."""
    from mlxfun.engine.options import GenerationConfig, make_request, requests

    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    reqs = requests(tiny, [[5, 6, 7], "a b", [9, 10]],
                    GenerationConfig(max_tokens=4, temperature=[0.0, 0.7, 1.0], top_p=0.9, seed=[1, 2, 3]))
    assert mx.get_active_memory() == held and mx.get_peak_memory() <= held
    for r in reqs:
        assert all(isinstance(f, np.ndarray) and f.shape == (1,) for f in r.settings)
    assert [float(r.settings.temperature[0]) for r in reqs] == [0.0, float(np.float32(0.7)), 1.0]
    assert [int(r.settings.seed[0]) for r in reqs] == [1, 2, 3]
    one = make_request(tiny, [5, 6], settings=sampling.make_settings(1, temperature=0.5, seed=9))
    assert all(isinstance(f, np.ndarray) for f in one.settings) and int(one.settings.seed[0]) == 9
    engine = Engine(tiny, 2)
    rid = engine.submit(reqs[1])
    engine.step()  # taken from the inbox
    # The engine keeps them on the host too, and puts the rows' batch on the device (`Runner.restack`).
    assert all(isinstance(f, np.ndarray) for f in engine.requests[rid].request.settings)
    assert engine.requests[rid].request.settings.seed.tolist() == [2]
    width = len(engine.scheduler.owner)  # the CPU decodes the live rows' power of two
    assert all(isinstance(f, mx.array) and f.shape == (width,) for f in engine.runner.settings)
    assert 2 in engine.runner.settings.seed.tolist()


def test_the_rows_settings_are_stacked_on_the_host_and_copied_once_per_field(tiny, monkeypatch):
    """Restacking 128 rows' settings (each admission does) concatenated each field's 128 pieces on
    the device: a copy kernel per row and field, about a thousand launches. Stacked on the host,
    it is one copy per field, whatever the rows."""
    from mlxfun.engine import runner as runner_module

    engine = Engine(tiny, 128)
    rows = [sampling.host_settings(1, temperature=0.5 + i / 256, top_k=i, seed=i) if i % 3 else None
            for i in range(128)]
    made = []
    monkeypatch.setattr(runner_module.mx, "concatenate", lambda *a, **k: pytest.fail("concatenated on the device"))
    real_array = runner_module.sampling.mx.array
    monkeypatch.setattr(runner_module.sampling.mx, "array", lambda *a, **k: made.append(1) or real_array(*a, **k))
    engine.runner.restack(rows)
    monkeypatch.undo()
    assert len(made) == len(sampling.Settings._fields)
    s = engine.runner.settings
    assert s.seed.tolist() == [i if i % 3 else 0 for i in range(128)]
    assert s.top_k.tolist() == [i if i % 3 else 0 for i in range(128)]
    assert np.allclose(np.array(s.temperature), [0.5 + i / 256 if i % 3 else 0.0 for i in range(128)])


def test_steps_write_the_kv_pool_in_place():
    """A write into an array something else still references makes MLX copy it whole first: a
    decode step that kept the old state alive copied the entire KV pool, every layer, every step
    (571 ms against 56 per step for a 1,536-block pool on this CPU). With the pool 64x what the
    rows hold, the memory decode steps add stays far below one pool (admission: the next test)."""
    model = tiny_model(tiny_config(max_position_embeddings=8192))
    engine = Engine(model, 2, shrink_rows=False)
    for p in ([5, 6, 7], [9, 10, 11, 12]):
        engine.add(p, max_tokens=8000, ignore_eos=True)  # a large reservation: a large pool
    engine.admit()
    engine.decode()  # (grows the pool from the prompts' blocks to the reservation)
    engine.collect()
    mx.eval(engine.runner.state)
    pool = sum(a.nbytes for a in engine.runner.state.cache.keys + engine.runner.state.cache.values)
    assert pool >= 8e6 and engine.scheduler.pool.used <= 2  # the rows hold one block each
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(4):
        engine.decode()
        engine.collect()
    mx.eval(engine.runner.state)
    mx.synchronize()
    assert mx.get_peak_memory() - base < pool // 4


def test_an_admission_in_several_length_groups_writes_the_kv_pool_in_place():
    """Each length group's prefill writes the pool in place: a reference to the pool that outlived
    the group before (a local variable) made every later group copy it whole, one pool more at
    the peak (8B at batch 128 on an H200: 34.3 GB against round 1's 30.4)."""
    model = tiny_model(tiny_config(max_position_embeddings=8192))
    prompts = [list(range(3, 3 + n)) for n in (60, 58, 20, 19, 4, 3)]
    assert len(prefill.plan_groups([len(p) for p in prompts])) == 3
    peak, pool, _ = admission_peak(model, prompts)
    assert pool >= 8e6
    assert peak < 1.25 * pool  # the pool once, and small activations


def test_a_first_chunk_writes_each_layer_before_the_next_runs(tmp_path):
    """A first chunk (`fresh`) attends over itself, so nothing in the pass reads its KV writes;
    left alone, MLX ran them after the last layer, every layer's keys and values (and the
    projections they are views of) alive until then: 5 GB of an 8B admission on an H200, and on
    this CPU 962 against 616 MB above the weights for a 16-layer, 2,048-token admission. So each
    layer's output depends on its writes: they are in the graph of the hidden states themselves."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    tokens = mx.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    positions = mx.broadcast_to(mx.arange(4)[None], (2, 4))
    for fresh in (True, False):  # not fresh: attention reads the written pool
        h, _ = llama.hidden(config, model.params, tokens, positions, None, kv.empty(config, 2, 16, mx.float32),
                            fresh=fresh)
        mx.export_to_dot(str(tmp_path / "h.dot"), h)
        assert (tmp_path / "h.dot").read_text().count("Scatter") == 2 * 3  # keys and values of 3 layers
    h, _ = llama.hidden(config, model.params, tokens, positions)  # no cache: nothing written
    mx.export_to_dot(str(tmp_path / "h.dot"), h)
    assert "Scatter" not in (tmp_path / "h.dot").read_text()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_a_chunk_write_keeps_16_bit_values_in_place(dtype):
    """A chunk's 16-bit keys and values land bit for bit (NaN payloads and subnormals kept), in the
    pool's own buffer; and a fast prefill chunk (the engine's) leaves the same cache and hidden
    states as a plain one."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, size=(2, 4, 8, 16), dtype=np.uint16)
    bits[0, 0, 0, :4] = [0x7FC1, 0xFFFF, 0x7F81, 0x0001]  # NaNs with payloads, a subnormal
    new = mx.array(bits).view(dtype)  # (B, H, T, D)
    slots = mx.array(rng.permutation(1 << 14)[:16].reshape(2, 8).astype(np.int32))
    buf = mx.zeros((1 << 14, 4, 1, 16), dtype)  # 2 MB
    mx.eval(buf, new, slots)
    mx.synchronize()
    base, size = mx.get_active_memory(), buf.nbytes
    mx.reset_peak_memory()
    out = kv.write(buf, new, slots)
    del buf
    mx.eval(out)
    mx.synchronize()
    assert mx.get_peak_memory() - base < size // 4  # the pool written where it is
    held = np.array(out.view(mx.uint16))[np.array(slots)][:, :, :, 0]  # (B, T, H, D)
    assert np.array_equal(held, bits.transpose(0, 2, 1, 3))
    # Through the decoder: a fast prefill chunk leaves the same cache and hidden states as a plain one.
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    params = weights.cast(config, model.params, dtype)
    tokens = mx.array([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    positions = mx.array([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]])
    (h0, c0), (h1, c1) = [llama.hidden(config, params, tokens, positions, None, kv.empty(config, 2, 16, dtype),
                                       fresh=True, fast=fast) for fast in (False, True)]
    assert np.array_equal(np.array(h0.view(mx.uint16)), np.array(h1.view(mx.uint16)))
    for a, b in zip(c0.keys + c0.values, c1.keys + c1.values):
        assert a.dtype == dtype and np.array_equal(np.array(a.view(mx.uint16)), np.array(b.view(mx.uint16)))


def test_a_first_admission_writes_the_pool_it_makes_in_place():
    """A fresh engine's first admission makes its device pool and prefills into it in place: no
    reference to the pool outlives the hand-over to the prefill (a local variable in the runner's
    frame made the first chunk copy the whole pool: SmolLM2's batch-1 peak 25.5 MB above the
    weights against 13.8 MB)."""
    model = tiny_model(tiny_config(num_layers=8, max_position_embeddings=8192))
    engine = Engine(model, 1)
    engine.add([3] * 8, max_tokens=6, ignore_eos=True)
    peak, pool = admit_measured(engine)
    assert peak < 1.5 * pool  # the pool once (2.1x with the copy)
