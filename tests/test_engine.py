"""Continuous batching: more prompts than rows, rows refilled as they finish."""

from __future__ import annotations

import random
from collections import Counter

import mlx.core as mx
import pytest
from helpers import tiny_config, tiny_model

import mlxfun
from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.engine.kv_budget import fixed_pool_blocks
from mlxfun.engine.options import GenerationConfig, requests
from mlxfun.generate import generate
from mlxfun.model.load import Model
from mlxfun.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(tiny_config(max_position_embeddings=1024))


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.choice([1, 2, 5, 17, 60, 140, 300]))] for _ in range(n)]
    max_tokens = [rng.randrange(1, 40) for _ in range(n)]
    return prompts, max_tokens


def with_eos(model, token: int):
    """The model with `token` as its end-of-text token, so rows also finish early."""
    tk = Tokenizer(model.tokenizer.backend, eos_token_ids={token}, bos_token_id=None, add_bos=False,
                   chat_template=None)
    return Model(model.config, model.params, tk, "tiny-eos")


def test_hundred_prompts_through_eight_rows_equal_alone(tiny):
    prompts, max_tokens = workload(100)
    probe = generate(tiny, prompts[:10], max_tokens=20).token_ids
    model = with_eos(tiny, Counter(t for ids in probe for t in ids).most_common(3)[-1][0])
    out = generate(model, prompts, max_tokens=max_tokens, batch_size=8)
    alone = [generate(model, [p], max_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    assert out.token_ids == alone
    assert any(r == "stop" for r in out.finish_reasons) and any(r == "length" for r in out.finish_reasons)
    stats = out.stats
    assert stats.rows == 8 and 0.5 < stats.occupancy <= 1.0
    assert len(stats.ttft) == 100 and all(t >= 0 for t in stats.ttft)
    assert stats.generation_tokens == sum(len(t) for t in out.token_ids)  # closing EOS tokens not counted
    assert f"Requests: 100, prompts {sum(map(len, prompts))} tokens ({stats.cached_tokens} reused), generated " \
        f"{stats.generation_tokens}" \
        in stats.summary() and stats.generation_tps > 0 and stats.admissions >= 100 // 8


def test_rounds_are_timed_and_the_plain_ones_are_those_far_from_admissions(tiny):
    engine = Engine(tiny, rows=2, admit_min=1)
    for prompt, n in (([1, 2, 3], 6), ([4, 5], 12), ([6, 7, 8, 9], 3)):
        engine.add(prompt, max_tokens=n, ignore_eos=True)
    admitted = []  # per round: did it admit?
    while not engine.idle:
        before = engine.stats.admissions
        engine.step()
        admitted.append(engine.stats.admissions > before)
    s = engine.stats
    plain = sum(not a and not (i and admitted[i - 1]) for i, a in enumerate(admitted))
    assert s.rounds == len(admitted) and s.plain_rounds == plain and 0 < plain < len(admitted)
    assert 0 < s.plain_round_seconds < s.round_seconds
    assert s.plain_round_ms == pytest.approx(1e3 * s.plain_round_seconds / plain)
    assert s.admission_overhead_seconds == pytest.approx(s.round_seconds - len(admitted) * s.plain_round_ms / 1e3)
    engine.reset_stats()
    assert engine.stats.rounds == engine.stats.plain_rounds == 0 and engine.stats.admission_overhead_seconds == 0


def test_sampled_outputs_equal_alone_with_seeds(tiny):
    prompts, max_tokens = workload(20, seed=1)
    seeds = list(range(100, 120))
    kw = dict(temperature=0.9, top_p=0.9, seed=seeds, ignore_eos=True)
    out = generate(tiny, prompts, max_tokens=max_tokens, batch_size=3, **kw)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        alone = generate(tiny, [p], max_tokens=m, temperature=0.9, top_p=0.9, seed=seeds[i], ignore_eos=True)
        assert out.token_ids[i] == alone.token_ids[0]
    assert out.seeds == seeds


def test_add_while_running_and_cancel(tiny):
    engine = Engine(tiny, rows=2)
    a = engine.add([5, 6, 7], max_tokens=30, ignore_eos=True)
    b = engine.add([8, 9], max_tokens=30, ignore_eos=True)
    c = engine.add([10], max_tokens=30, ignore_eos=True)
    late = None
    seen = {a: 0, b: 0, c: 0}  # generated tokens
    after_cancel = []
    closing = {}
    for event in engine.events():
        seen[event.index] = seen.get(event.index, 0) + (event.token >= 0)
        if event.finish_reason is not None:
            assert event.index not in closing, "a second closing event"
            closing[event.index] = event.finish_reason
        if late is not None and event.index in (b, c) and event.token >= 0:
            after_cancel.append(event)
        if event.index == a and seen[a] == 5:
            engine.cancel(b)  # running
            engine.cancel(c)  # still queued
            late = engine.add([11, 12, 13, 14], max_tokens=6, ignore_eos=True)
    assert engine.requests[a].finish_reason == "length" and seen[a] == 30
    assert engine.requests[b].finish_reason == "cancelled" and 4 <= seen[b] <= 5 and not after_cancel
    assert engine.requests[c].finish_reason == "cancelled" and seen[c] == 0
    assert closing == {a: "length", b: "cancelled", c: "cancelled", late: "length"}
    assert engine.requests[late].finish_reason == "length"
    assert engine.requests[late].text.tokens == generate(tiny, [[11, 12, 13, 14]], max_tokens=6,
                                                          ignore_eos=True).token_ids[0]


@pytest.mark.parametrize("shrink", [True, False])
def test_rows_follow_the_live_requests(tiny, shrink):
    """With shrink_rows (the CPU's default) the state holds only the live rows, growing when a
    request arrives mid-run; tokens equal each prompt alone either way."""
    engine = Engine(tiny, rows=4, shrink_rows=shrink)
    prompts, max_tokens = [[3] * 5, [4] * 6, [5] * 7, [6] * 8], [3, 12, 6, 20]
    ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    widths, late = [], None
    for event in engine.events():
        widths.append(engine.runner.state.tokens.shape[0] if engine.runner.state is not None else 0)
        if event.index == ids[3] and len(engine.requests[ids[3]].text.tokens) == 14:
            late = engine.add([7] * 9, max_tokens=4, ignore_eos=True)
    if shrink:
        assert widths[0] == 4 and min(widths[1:-1]) == 1 and 2 in widths[widths.index(1):]
    else:
        assert set(widths[:-1]) == {4}
    for rid, p, m in zip(ids + [late], prompts + [[7] * 9], max_tokens + [4]):
        assert engine.take(rid).row.token_ids == generate(tiny, [p], max_tokens=m, ignore_eos=True).token_ids[0]


def test_a_servers_rows_follow_the_live_requests_in_powers_of_two_on_the_cpu(tiny):
    """A fixed-shape engine (a server's) on the CPU holds 1, 2, 4 or 8 rows for its live requests,
    not always all 8 (each row costs its share of a step there), and every width is one of the
    few its warm-up runs; tokens equal each prompt alone."""
    engine = Engine(tiny, rows=8, fixed_shapes=True, kv_memory=20_000_000)
    assert engine.scheduler.widths() == [1, 2, 4, 8]
    assert [engine.scheduler.width(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 8]
    prompts, max_tokens = [[3] * 5, [4] * 6, [5] * 7], [3, 12, 24]
    ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    widths = []
    for _ in engine.events():
        widths.append(engine.runner.state.tokens.shape[0])
    assert widths[0] == 4 and 2 in widths and widths[-1] == 1 and set(widths) == {1, 2, 4}
    for rid, p, m in zip(ids, prompts, max_tokens):
        assert engine.take(rid).row.token_ids == generate(tiny, [p], max_tokens=m, ignore_eos=True).token_ids[0]
    assert Engine(tiny, rows=8, fixed_shapes=True, kv_memory=20_000_000, shrink_rows=False).scheduler.widths() == [8]


def test_rows_vacated_before_an_idle_engine_drops_its_state_are_not_written_in_the_next(tiny):
    """16 rows finish in one step, the idle engine drops its state, and 8 requests then get a state
    of 8 rows (shrink_rows). The 16 rows' pending "position -1" marks once reached the first decode
    step of the new state: a scatter into rows 8-15 of its 8-row arrays, past their end (heap
    corruption that crashed `mlxfun serve`). Each request's tokens equal the prompt alone."""
    engine = Engine(tiny, rows=16, shrink_rows=True)
    first = [engine.add([3 + i] * (2 + i % 8), max_tokens=2, ignore_eos=True) for i in range(16)]
    list(engine.events())
    assert engine.runner.state is None and len(engine.scheduler.owner) == 1  # dropped when idle
    second = [engine.add([40 + i] * (3 + i), max_tokens=3, ignore_eos=True) for i in range(8)]
    widths = [engine.runner.state.tokens.shape[0] for _ in engine.events() if engine.runner.state is not None]
    assert widths[0] == 8
    for rid, p, m in [(r, [3 + i] * (2 + i % 8), 2) for i, r in enumerate(first)] + \
            [(r, [40 + i] * (3 + i), 3) for i, r in enumerate(second)]:
        assert engine.take(rid).row.token_ids == generate(tiny, [p], max_tokens=m, ignore_eos=True).token_ids[0]


def test_engine_grows_its_ring_without_losing_rows(tiny):
    """A long request admitted next to short ones forces the cache to grow (and unroll)."""
    prompts = [[3] * 10, [4] * 200, [5] * 30, [6] * 250]
    max_tokens = [70, 60, 40, 30]
    out = generate(tiny, prompts, max_tokens=max_tokens, batch_size=2, ignore_eos=True)
    for p, m, ids in zip(prompts, max_tokens, out.token_ids):
        assert ids == generate(tiny, [p], max_tokens=m, ignore_eos=True).token_ids[0]


def test_engine_with_a_bounded_ring(tiny):
    """max_kv_size with more prompts than rows: a ring of 8 slots shared by refilled rows."""
    prompts, max_tokens = workload(10, seed=4)
    out = generate(tiny, prompts, max_tokens=max_tokens, max_kv_size=8, batch_size=3, ignore_eos=True)
    for p, m, ids in zip(prompts, max_tokens, out.token_ids):
        assert ids == generate(tiny, [p], max_tokens=m, max_kv_size=8, ignore_eos=True).token_ids[0]


def test_real_model_engine_equals_alone(model_q4):
    prompts = ["The capital of France is", "Hi", "def add(a, b):", "日本の首都は", "List three fruits:"]
    max_tokens = [8, 4, 10, 6, 12]
    out = generate(model_q4, prompts, max_tokens=max_tokens, batch_size=2)
    for p, m, ids in zip(prompts, max_tokens, out.token_ids):
        assert ids == generate(model_q4, p, max_tokens=m).token_ids[0]


def test_bad_rows():
    with pytest.raises(mlxfun.InputError, match="rows"):
        Engine(tiny_model(), rows=0)
    with pytest.raises(mlxfun.InputError, match="batch_size"):
        generate(tiny_model(), [[1], [2]], batch_size=0)
    assert sampling.make_settings(1).temperature.shape == (1,)


@pytest.mark.parametrize("admit_min,pad_multiple", [(3, 32), (8, 7), (1, 1)])
def test_gpu_admission_settings_keep_outputs_equal_alone(tiny, admit_min, pad_multiple):
    """Admitting in groups and rounding prompt lengths up (the GPU defaults, run here on the CPU)
    change shapes and timing, never the tokens."""
    prompts, max_tokens = workload(30, seed=3)
    engine = Engine(tiny, rows=5, admit_min=admit_min, pad_multiple=pad_multiple)
    ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    list(engine.events())
    alone = generate(tiny, prompts, max_tokens=max_tokens, ignore_eos=True).token_ids
    assert [engine.requests[i].row.token_ids for i in ids] == alone
    # With admit_min > 1 requests wait for free rows while others decode: fewer, larger admissions.
    assert engine.stats.admissions <= (len(prompts) if admit_min == 1 else len(prompts) // 2)


def test_a_queue_refilled_one_request_at_a_time_waits_admit_wait_rounds_for_more(tiny):
    """A server's clients send their next request as the last ends: its queue fits the free rows
    one request at a time. With admit_wait a request so queued waits at most that many rounds for
    more free rows (admit_min) before it is admitted; without, it is admitted at once. Tokens equal
    each prompt's alone either way, and the wait admits the same requests in fewer admissions."""
    prompts, max_tokens = workload(24, seed=5)
    alone = generate(tiny, prompts, max_tokens=max_tokens, ignore_eos=True).token_ids
    admissions, waits = {}, {}
    for wait in (0, 3):
        engine = Engine(tiny, rows=6, admit_min=4, admit_wait=wait)
        ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts[:6], max_tokens[:6])]
        queued_at, waited, n = {}, [], 6
        for rnd in range(10_000):
            for e in engine.step():
                if e.index in queued_at and e.token >= 0:
                    waited.append(rnd - queued_at.pop(e.index))
                if e.finish_reason is not None and n < len(prompts):  # a closed loop: one in, one out
                    ids.append(engine.add(prompts[n], max_tokens=max_tokens[n], ignore_eos=True))
                    queued_at[ids[-1]] = rnd
                    n += 1
            if engine.idle and n == len(prompts):
                break
        assert [engine.requests[i].row.token_ids for i in ids] == alone
        admissions[wait], waits[wait] = engine.stats.admissions, waited
    assert max(waits[0]) <= 1  # admitted in the round after it was queued (its token comes a round later)
    assert max(waits[3]) <= 3 + 1 and max(waits[3]) >= 2  # some waited, none past admit_wait
    assert admissions[3] < admissions[0], admissions
    with pytest.raises(mlxfun.InputError, match="admit_wait must be a non-negative integer"):
        Engine(tiny, rows=2, admit_wait=-1)


@pytest.mark.parametrize("mixed", [80, 600])  # 600: chunks of 128, 256, 512 and 600 tokens
def test_prompts_that_ride_along_decode_steps_equal_alone(tiny, mixed):
    """A server's engine on a GPU admits short prompts inside its decode steps (`mixed_tokens`):
    B + P one-token rows through one pass, each prompt token reading its row's blocks. Under a
    closed loop (one in as one finishes) with seeded sampling, penalties, logprobs and prompts that
    share a cached prefix, every request's tokens and logprobs equal its run alone, and most
    admissions rode along. A row refilled within a step of its release still holds its last
    request's position on the device: the step must not decode it into the new row's blocks (which
    here include shared prefix blocks, so a stray write would change later requests)."""
    prompts, max_tokens = workload(24, seed=5)
    head = list(range(3, 43))  # 40 tokens: two cached blocks of 16 for every other prompt
    prompts = [head + p[:20] if i % 2 else p for i, p in enumerate(prompts)]
    options = [dict(temperature=0.9, top_p=0.9, seed=100 + i, repetition_penalty=1.3 if i % 3 == 0 else 1.0)
               for i in range(len(prompts))]
    alone = [generate(tiny, [p], max_tokens=m, ignore_eos=True, logprobs=2, **o)
             for p, m, o in zip(prompts, max_tokens, options)]
    engine = Engine(tiny, rows=6, fixed_shapes=True, kv_memory=1 << 24, mixed_tokens=mixed)

    def add(n: int) -> int:
        o = options[n]
        settings = sampling.make_settings(1, temperature=o["temperature"], top_p=o["top_p"], seed=o["seed"],
                                          repetition_penalty=o["repetition_penalty"])
        return engine.add(prompts[n], max_tokens=max_tokens[n], ignore_eos=True, settings=settings, logprobs=2)

    ids = [add(n) for n in range(6)]
    while not engine.idle or len(ids) < len(prompts):
        for e in engine.step():
            if e.finish_reason is not None and len(ids) < len(prompts):
                ids.append(add(len(ids)))
    rows = [engine.take(i).row for i in ids]
    assert [r.token_ids for r in rows] == [a.token_ids[0] for a in alone]
    n = [len(r.token_ids) for r in rows]
    assert [r.logprobs[:k] for r, k in zip(rows, n)] == [a.logprobs[0] for a in alone]
    assert [r.top[:k] for r, k in zip(rows, n)] == [a.top_logprobs[0] for a in alone]
    stats = engine.stats
    assert stats.cached_tokens >= 32 * 6 and stats.carried >= stats.admissions - 2 >= 10, (stats.carried,
                                                                                       stats.admissions)
    with pytest.raises(mlxfun.InputError, match="mixed_tokens must be a non-negative integer"):
        Engine(tiny, rows=2, mixed_tokens=-1)
    with pytest.raises(mlxfun.InputError, match="mixed_tokens must be at most 8192"):
        Engine(tiny, rows=2, mixed_tokens=8193)


def test_a_cpu_server_decodes_in_two_halves_and_samples_in_the_lightest_mode_its_rows_allow(tiny):
    """A CPU server's step is split (`Runner.split`): one forward half for every mode, then the
    mode's sampling half. Rows with top-p alone sample as an offline run does (no top-k search, no
    penalties: each search is 32 passes over the logits there); a row with top-k or a penalty
    brings the full mode. Tokens equal each request alone either way."""
    from mlxfun.engine.step import FORWARD, Mode

    engine = Engine(tiny, rows=4, fixed_shapes=True, kv_memory=1 << 24)
    assert engine.runner.split and engine.step_cache is not None
    options = [dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=1.0, seed=2),
               dict(temperature=0.7, top_k=5, presence_penalty=0.5, seed=3)]

    def run(chosen):
        ids = [engine.add([5 + i, 6, 7, 8], max_tokens=6, ignore_eos=True,
                          settings=sampling.make_settings(1, **options[i])) for i in chosen]
        while not engine.idle:
            engine.step()
        return [engine.take(i).row.token_ids for i in ids]

    light = Mode(sample=True, penalties=False, search=sampling.Search.TOP_P)
    assert run([0, 1]) == [generate(tiny, [[5 + i, 6, 7, 8]], max_tokens=6, ignore_eos=True, **options[i]).token_ids[0]
                           for i in (0, 1)]
    assert {mode for _, mode in engine.step_cache._made} == {FORWARD, light}
    full = Mode(sample=True, penalties=True, search=sampling.Search.ALL)
    assert run([0, 2]) == [generate(tiny, [[5 + i, 6, 7, 8]], max_tokens=6, ignore_eos=True, **options[i]).token_ids[0]
                           for i in (0, 2)]
    assert {mode for _, mode in engine.step_cache._made} == {FORWARD, light, full}


def test_a_warmed_up_ring_server_traces_nothing_on_the_request_path(tiny):
    """A bounded cache's rows read a ring's columns whatever they hold, not the ladder's widths:
    the warm-up compiles the steps at that width (it compiled the ladder's, and the first request
    traced its step). Tokens equal each request alone under the same ring."""
    from mlxfun.engine.warmup import warm_up

    engine = Engine(tiny, rows=4, fixed_shapes=True, kv_memory=1 << 24, max_kv_size=8)
    warm = warm_up(engine)
    assert warm.widths == (engine.scheduler.pages.ring * engine.scheduler.pool.block_size,)
    traces = engine.step_cache.traces
    options = [dict(), dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.0, seed=4),
               dict(temperature=0.7, top_k=4, frequency_penalty=0.3, seed=5)]
    prompts = [[3, 4, 5, 6], [7, 8, 9], list(range(10, 40)), [15, 16]]
    ids = [engine.add(p, max_tokens=20, ignore_eos=True, settings=sampling.make_settings(1, **o))
           for p, o in zip(prompts, options)]
    while not engine.idle:
        engine.step()
    assert engine.step_cache.traces == traces
    assert [engine.take(i).row.token_ids for i in ids] == [
        generate(tiny, [p], max_tokens=20, ignore_eos=True, max_kv_size=8, **o).token_ids[0]
        for p, o in zip(prompts, options)]


def test_chunk_lengths_pad_a_lone_prompt_little_at_any_budget():
    from mlxfun.engine.riding import chunk_sizes

    assert chunk_sizes(0) == () and chunk_sizes(64) == (64,) and chunk_sizes(256) == (64, 128, 256)
    assert chunk_sizes(512) == (128, 256, 512)  # the GPU server's default
    # Past 512 (a burst's prompts in one step): every power of two from 128, so one prompt still pads to 128.
    assert chunk_sizes(2048) == (128, 256, 512, 1024, 2048) and chunk_sizes(1000) == (128, 256, 512, 1000)


def test_a_queue_that_fits_one_chunk_rides_along_and_a_burst_prefills_on_its_own(tiny):
    """Riding costs a decode step its prompts' tokens, a few a step; a burst (many rows ending at
    once) is cheaper in one prefill of its own. So a queue rides along only when all of it that
    fits the free rows fits one chunk."""
    engine = Engine(tiny, rows=8, fixed_shapes=True, kv_memory=1 << 24, mixed_tokens=64, admit_min=1)
    prompts = [[(3 * i + j) % 90 + 1 for j in range(20)] for i in range(9)]
    ids = [engine.add(p, max_tokens=12, ignore_eos=True) for p in prompts[:2]]
    engine.step()
    engine.step()
    assert (engine.stats.admissions, engine.stats.carried) == (1, 0)  # nothing decoded: a prefill
    ids += [engine.add(p, max_tokens=12, ignore_eos=True) for p in prompts[2:4]]  # 40 tokens: one chunk
    engine.step()
    assert (engine.stats.admissions, engine.stats.carried) == (2, 1)
    ids += [engine.add(p, max_tokens=12, ignore_eos=True) for p in prompts[4:9]]  # 100 tokens: a burst
    engine.step()
    assert (engine.stats.admissions, engine.stats.carried, engine.scheduler.live_count()) == (3, 1, 8)
    for _ in engine.events():
        pass
    alone = generate(tiny, prompts, max_tokens=12, ignore_eos=True).token_ids
    assert [engine.requests[i].row.token_ids for i in ids] == alone


def test_static_batch_with_rounded_shapes_equals_alone(tiny):
    """Chunk lengths rounded up to 32 (the GPU's default, here on the CPU): every prefill chunk
    the static batch runs is a multiple of 32 long, and the tokens are each prompt's alone."""
    from mlxfun.engine.step import compiled_steps

    prompts, max_tokens = workload(9, seed=4)
    shapes = []

    def steps(config, mode):
        real = compiled_steps(config, mode)
        return real._replace(prefill=lambda params, tokens, *rest: shapes.append(tokens.shape) or
                             real.prefill(params, tokens, *rest))

    engine = Engine(tiny, rows=len(prompts), pad_multiple=32, steps=steps)
    ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    engine.admit()  # every prompt at once: a static batch
    assert not engine.scheduler.pending and sum(s[0] for s in shapes) >= len(prompts)
    assert shapes and all(T % 32 == 0 for _, T in shapes), shapes
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == \
        generate(tiny, prompts, max_tokens=max_tokens, ignore_eos=True).token_ids


def test_rounded_prompts_wider_than_the_ring(tiny):
    """Prompts padded past a ring of 8 slots (GPU rounding on the CPU): the fresh cache is itself a
    ring, and only its newest slots are placed; outputs still equal each prompt alone."""
    prompts, max_tokens = workload(12, seed=5)
    engine = Engine(tiny, rows=3, max_kv_size=8, admit_min=2, pad_multiple=32)
    ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    list(engine.events())
    for p, m, i in zip(prompts, max_tokens, ids):
        assert engine.requests[i].row.token_ids == \
            generate(tiny, [p], max_tokens=m, max_kv_size=8, ignore_eos=True).token_ids[0]


def test_a_fixed_pool_holds_its_budget_or_every_row_at_full_context():
    """A server's engine (fixed shapes) allocates its budget once, but never more than every row at
    full context holds, with an eighth more for the prefix cache."""
    model = tiny_model(tiny_config(max_position_embeddings=1 << 12))
    assert fixed_pool_blocks(10_000, 500) == 2 + 500 + 62  # every row at full context
    assert fixed_pool_blocks(50, 500) == 50  # the budget, where it is smaller
    budget = 1_000_000
    engine = Engine(model, 4, fixed_shapes=True, kv_memory=budget)
    assert engine.scheduler.max_blocks == budget // engine.block_bytes
    engine = Engine(model, 4, fixed_shapes=True, kv_memory=1 << 40)
    bs = engine.scheduler.pool.block_size
    full = 4 * engine.scheduler.pages.blocks_for(1 << 12, min(engine.scheduler.prefill_step, 1 << 12))
    assert full >= 4 * (1 << 12) // bs
    assert engine.scheduler.max_blocks == 2 + full + full // 8


def test_decoding_writes_a_large_pool_in_place():
    """Work in flight holds its outputs, so a step queued behind the one before it would copy each
    layer's KV pool to write it: a server's pool is most of the memory. The runner waits for the
    write before (`Runner.settle`, always on the CPU): no copy is ever made while decoding. (With the
    wait off, this run peaked 151 MB, two layers' pools, above the 300 MB held, in 3 runs of 4.)"""
    model = tiny_model(tiny_config(max_position_embeddings=1 << 17))
    mx.eval(model.params)
    engine = Engine(model, 4, fixed_shapes=True, kv_memory=300_000_000)
    for r in requests(model, [[5, 6, 7, 8], [9, 10], [11], [12, 13, 14]], GenerationConfig(max_tokens=12,
                                                                                             ignore_eos=True)):
        engine.submit(r)
    engine.step()  # admits, and queues the first decode step, which grows the pool to its size
    engine.step()
    mx.synchronize()
    cache = engine.runner.state.cache
    layer = cache.keys[0].nbytes
    assert sum(k.nbytes + v.nbytes for k, v in zip(cache.keys, cache.values)) > 250e6
    del cache  # a reference held here would make every write copy
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    steps = 0
    while not engine.idle:
        for e in engine.step():
            if e.finish_reason is not None:
                engine.take(e.index)
        steps += 1
    assert steps >= 10 and mx.get_peak_memory() - held < layer / 20
