"""KV memory that follows the live tokens, and prefixes computed once: within a batch, across
requests, and saved to disk. Reuse never changes a token."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_engine, tiny_config, tiny_model

import mlxfun
from mlxfun.engine.blocks import Pool, chain
from mlxfun.engine.core import Engine
from mlxfun.generate import generate
from mlxfun.model import cache as kv

BS = kv.BLOCK


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(tiny_config(max_position_embeddings=8192))


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 97) for _ in range(n)]


# ---- the block bookkeeping, without a model ----


def test_pool_counts_references_and_caches_released_prefixes():
    pool = Pool(8, 4, max_cached=3)
    a = [pool.allocate() for _ in range(3)]
    assert sorted(a) == [1, 2, 3] and pool.used == 3 and pool.available() == 4
    tokens = list(range(12))
    pool.register(tokens, a)
    assert pool.cached == 3 and pool.match(tokens, 3) == a and pool.used == 3  # one more reference each
    pool.release(a[::-1])  # the first row
    assert pool.used == 3 and pool.available() == 4  # still held by the matcher
    pool.release(a[::-1])
    assert pool.used == 0 and pool.available() == 7 and pool.cached == 3  # idle, cached, evictable
    assert pool.match(tokens[:8] + [99, 98, 97, 96], 3) == a[:2]  # the prefix up to where tokens differ
    assert pool.hits == 3 + 2 and pool.lookups == 3 + 3
    pool.release(a[:2][::-1])
    assert pool.match([5] + tokens[1:], 3) == []  # a different first block: nothing
    # An allocation takes a free block before it evicts a cached one; evicting takes the deepest first.
    got = [pool.allocate() for _ in range(5)]
    assert pool.cached == 2 and a[2] in got and pool.match(tokens, 3) == a[:2]


def test_pool_budget_keeps_the_most_recently_released_and_compaction_renumbers():
    pool = Pool(10, 2, max_cached=2)
    rows = [[pool.allocate(), pool.allocate()] for _ in range(3)]
    for i, blocks in enumerate(rows):
        pool.register([i, i, i, i], blocks)
    for blocks in rows:
        pool.release(blocks[::-1])
    assert pool.cached == 2 and pool.match([2, 2, 2, 2], 2) == rows[2]  # the last released survive
    keep = pool.compaction()
    assert keep.tolist() == [0] + sorted(rows[2])
    new = pool.renumber(keep, 4)
    assert pool.size == 4 and pool.used == 2 and pool.match([2, 2, 2, 2], 2) == [int(new[b]) for b in rows[2]]


def test_chain_keys_depend_on_the_whole_prefix():
    a = chain([1, 2, 3, 4, 5, 6], 2)
    b = chain([9, 2, 3, 4, 5, 6], 2)
    assert [t for _, t in a] == [(1, 2), (3, 4), (5, 6)]
    assert all(x[0] != y[0] for x, y in zip(a, b))  # same blocks after a different start: other keys


def test_chain_extends_a_known_prefix_chain():
    """A request's prompt chain, computed once, continues into its generated tokens (and NumPy
    ids give the same keys as Python ints)."""
    import numpy as np
    tokens = [(7 * i) % 50 + 1 for i in range(45)]
    prompt = chain(tokens[:21], 4)  # 5 full blocks; the sixth is completed by later tokens
    assert chain(tokens, 4, prompt) == chain(tokens, 4) == chain(np.array(tokens), 4)
    assert chain(tokens[:13], 4, prompt) == chain(tokens[:13], 4)  # a shorter text uses what it covers


# ---- reuse equals recomputation ----


def compare(model, prompts, *, rows=None, **options):
    """(outputs with the prefix cache, engine), asserting they equal outputs without it."""
    with_cache, engine = run_engine(model, prompts, rows=rows, ignore_eos=True, **options)
    without, _ = run_engine(model, prompts, rows=rows, ignore_eos=True, prefix_cache=False, **options)
    assert with_cache.token_ids == without.token_ids
    if options.get("logprobs") is not None:
        assert np.allclose(np.concatenate(with_cache.logprobs), np.concatenate(without.logprobs), atol=1e-5)
    return with_cache, engine


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.9, seed=[3, 4, 5, 6])])
def test_prompts_sharing_a_prefix_in_one_batch_compute_it_once(tiny, sampling):
    system = words(40, 1)  # two full blocks and 8 tokens
    prompts = [system + words(n, 10 + n) for n in (3, 9, 25, 1)]
    out, engine = compare(tiny, prompts, max_tokens=12, logprobs=0, **sampling)
    # The first prompt computes the prefix; the others reuse its two full blocks.
    assert engine.stats.cached_tokens == 3 * 2 * BS
    assert engine.stats.admissions == 1


def test_later_requests_reuse_earlier_prefixes_and_turns(tiny):
    """A conversation's next turn (the previous prompt and answer, then more) reuses the blocks
    of both; a prefix ending inside a block reuses its full blocks; a prompt that is exactly a
    cached prefix recomputes its last block only (its last token gives the first output)."""
    engine = Engine(tiny, rows=2)
    first = words(37, 2)
    a = engine.add(first, max_tokens=30, ignore_eos=True)
    list(engine.events())
    answer = engine.take(a).row.token_ids
    turn = first + answer + words(20, 3)
    b = engine.add(turn, max_tokens=10, ignore_eos=True)
    c = engine.add(first[:32], max_tokens=5, ignore_eos=True)  # exactly two cached blocks
    list(engine.events())
    rb, rc = engine.take(b), engine.take(c)
    # turn: 37 + 30 = 67 positions had KV; 4 full blocks of them are cached.
    assert rb.cached_tokens == 4 * BS and rc.cached_tokens == 1 * BS
    assert rb.row.token_ids == generate(tiny, [turn], max_tokens=10, ignore_eos=True).token_ids[0]
    assert rc.row.token_ids == generate(tiny, [first[:32]], max_tokens=5, ignore_eos=True).token_ids[0]


def test_rings_that_wrap_reuse_prefixes_exactly(tiny):
    """max_kv_size bounds every row to a ring; prompts longer than it share a prefix."""
    system = words(70, 4)
    prompts = [system + words(n, 20 + n) for n in (5, 18, 2)]
    _, engine = compare(tiny, prompts, max_tokens=40, max_kv_size=24, prefill_step=16)
    assert engine.stats.cached_tokens > 0 and engine.stats.max_capacity == kv.ring_columns(24, BS, 4) * BS


def test_eviction_under_a_tiny_budget_changes_no_token(tiny):
    """One row, so requests run one after another and later ones find earlier prefixes cached (or
    evicted): the tokens are the same with no cache, a budget of two blocks, and the default."""
    prompts = [words(40, 5) + words(n, 30 + n) for n in (4, 8)] + [words(50, 6) + words(n, 40 + n) for n in (2, 6)]
    alone = [generate(tiny, [p], max_tokens=6, ignore_eos=True, prefix_cache=False).token_ids[0] for p in prompts]
    two_blocks = 2 * BS * kv.slot_bytes(tiny.config, mx.float32)
    for budget, most in ((0, 0), (two_blocks, 2), (None, 99)):
        engine = Engine(tiny, rows=1, prefix_cache_bytes=budget)
        ids = [engine.add(p, max_tokens=6, ignore_eos=True) for p in prompts]
        list(engine.events())
        assert [engine.take(i).row.token_ids for i in ids] == alone
        assert engine.scheduler.pool.cached <= most and (engine.stats.cached_tokens > 0) == (budget != 0)


# ---- memory follows the live tokens ----


def test_one_long_request_among_short_ones_holds_only_its_own_blocks(tiny):
    """8 rows, a 4,000-token request among 127 short ones: peak KV memory stays within 1.5x of
    what the live tokens need (rows x the longest row would be 8x)."""
    rng = random.Random(7)
    prompts = [words(rng.randrange(4, 40), 100 + i) for i in range(127)]
    prompts.insert(3, words(4000, 99))
    max_tokens = [rng.randrange(4, 24) for _ in prompts]
    engine = Engine(tiny, rows=8, prefix_cache=False)
    ids = [engine.add(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    peak_live = peak_pool = 0
    while not engine.idle:
        for e in engine.step():
            if e.finish_reason is not None:
                engine.take(e.index)
        live = sum(max(p, 0) for p in engine.scheduler.pos)  # positions each live row holds KV for
        peak_live = max(peak_live, live * engine.slot_bytes)
        peak_pool = max(peak_pool, engine.stats.kv_bytes)
    old_layout = 8 * (4000 + max(max_tokens)) * engine.slot_bytes
    print(f"peak KV pool {peak_pool / 1e6:.2f} MB for {peak_live / 1e6:.2f} MB of live tokens "
          f"({peak_pool / peak_live:.2f}x); rows x longest would hold {old_layout / 1e6:.2f} MB")
    assert peak_pool <= 1.5 * peak_live
    assert len(ids) == 128 and engine.stats.requests == 128


# ---- persistent prompt caches ----


def test_prompt_cache_round_trip_and_reuse(tiny, tmp_path):
    system = words(50, 8)
    prompts = [system + words(n, 50 + n) for n in (3, 11)]
    pc = mlxfun.cache_prompt(tiny, system)
    path = pc.save(tmp_path / "system.safetensors")
    loaded = mlxfun.load_prompt_cache(path, tiny)
    assert loaded.tokens == tuple(system) and all(np.array_equal(np.array(a), np.array(b))
                                                  for a, b in zip(loaded.keys, pc.keys))
    with_pc, engine = run_engine(tiny, prompts, max_tokens=8, ignore_eos=True, prompt_cache=loaded)
    plain = generate(tiny, prompts, max_tokens=8, ignore_eos=True, prefix_cache=False)
    assert with_pc.token_ids == plain.token_ids
    assert engine.stats.cached_tokens == 2 * (50 // BS) * BS  # every prompt skipped the cached blocks
    other = tiny_model(tiny_config(max_position_embeddings=8192), seed=5)
    with pytest.raises(mlxfun.ModelError, match="another model or dtype"):
        mlxfun.load_prompt_cache(path, other)
    with pytest.raises(mlxfun.InputError, match="another model or dtype"):
        generate(other, prompts, max_tokens=2, prompt_cache=loaded)
    with pytest.raises(mlxfun.ModelError, match="no such prompt cache"):
        mlxfun.load_prompt_cache(tmp_path / "nope.safetensors", tiny)


def test_real_model_reuse_equals_recomputation(model_f32):
    """float32, greedy and seeded sampling: a shared chat system prompt, reused within the batch."""
    system = {"role": "system", "content": "You are a concise assistant who answers in one short sentence."}
    prompts = [[system, {"role": "user", "content": q}] for q in ("What is 2+2?", "Name a color.", "Hi!")]
    for options in (dict(), dict(temperature=0.8, seed=11)):
        out, engine = compare(model_f32, prompts, max_tokens=6, **options)
        assert engine.stats.cached_tokens >= 2 * BS


def test_cache_prompt_command_and_prompt_cache_file(tmp_path):
    """`mlxfun cache-prompt` saves a system prompt's KV; `generate --prompt-cache-file` reuses it
    (the summary counts the reused tokens) and answers as without it."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import tiny_chat_model

    folder = mlxfun.save(tiny_chat_model(tiny_config(max_position_embeddings=1024), seed=4), tmp_path / "tiny")
    system = " ".join(f"w{i}" for i in range(10, 50))  # 40 words: two whole blocks once templated
    root = Path(__file__).resolve().parents[1]

    def mlxfun_cli(*args):
        run = subprocess.run([sys.executable, "-m", "mlxfun", *args, "--model", str(folder)], capture_output=True,
                             text=True, timeout=120, cwd=root)
        assert run.returncode == 0, run.stderr
        return run.stdout

    cache = tmp_path / "system.safetensors"
    assert "cached 41 tokens (32 reusable" in mlxfun_cli("cache-prompt", "--system-prompt", system, "-o", str(cache))
    common = ["generate", "--system-prompt", system, "-p", "w5 w6", "-m", "6", "--ignore-eos", "--verbose"]
    plain = mlxfun_cli(*common, "--no-prefix-cache")
    reused = mlxfun_cli(*common, "--prompt-cache-file", str(cache))
    assert "(32 reused)" in reused and "(0 reused)" in plain
    assert reused.split("=" * 10)[0] == plain.split("=" * 10)[0]  # the same text


def test_prompt_speed_counts_computed_tokens_and_shows_reused_apart():
    """A prompt found in the prefix cache is reused, not computed: the prompt rate divides computed
    tokens by their time, and the summary shows the reused ones apart."""
    model = tiny_model(tiny_config(max_position_embeddings=512))
    engine = Engine(model, 2)
    prompt = [(7 * j) % 90 + 1 for j in range(80)]
    engine.add(prompt, max_tokens=2, ignore_eos=True)
    for _ in engine.events():
        pass
    engine.add(prompt, max_tokens=2, ignore_eos=True)
    for _ in engine.events():
        pass
    s = engine.stats
    assert s.prompt_tokens == 160 and s.cached_tokens == 64 and s.timed_prompt_tokens == 96
    assert s.prompt_tps == s.timed_prompt_tokens / s.prompt_time
    assert s.admissions == 2 and s.admission_seconds >= s.prompt_time > 0  # idle admissions: both timed whole
    assert s.summary().startswith(f"Prompt: 160 tokens (64 reused), {s.prompt_tps:.1f} tokens/s computed\n")
