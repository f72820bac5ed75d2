"""Attention sinks in a `max_kv_size` ring: each row's first SINK_TOKENS positions stay visible to
every query (their blocks are never dropped), beside the last `max_kv_size` positions; a model's
own sliding windows keep their exact semantics."""

from __future__ import annotations

import random
import re

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_engine, tiny_config, tiny_model, tiny_params
from test_cache import decode_in_chunks
from test_reference import random_tokens

from mlxfun.engine.blocks import Pool
from mlxfun.engine.paging import Pages
from mlxfun.generate import generate
from mlxfun.model import cache as kv
from mlxfun.model import llama, masks
from mlxfun.model.config import SINK_TOKENS

# Most prompts here are longer than their rings on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:max_kv_size=8 is shorter than")


def bits(mask: mx.array) -> list[str]:
    """(T, S) bool -> one string of 0/1 per query."""
    return ["".join("1" if v else "0" for v in row) for row in np.array(mask).tolist()]


def test_max_kv_size_gives_sinks_only_to_the_windows_it_imposes():
    config = tiny_config(num_layers=4, layer_windows=(None, 16, 4, 8)).with_max_kv_size(8)
    assert config.layer_windows == (8, 8, 4, 8)
    assert config.layer_sinks == (SINK_TOKENS, SINK_TOKENS, 0, 0) and config.sinks == SINK_TOKENS == 4
    assert config.with_max_kv_size(6).layer_sinks == (4, 4, 0, 4)  # 8 > 6: now imposed
    assert config.with_max_kv_size(None) is config and hash(config) == hash(tiny_config(
        num_layers=4, layer_windows=(None, 16, 4, 8)).with_max_kv_size(8))
    assert tiny_config(layer_windows=(4, 4)).sinks == 0  # a model's own windows: no sinks


def test_ring_masks_keep_the_first_positions():
    """Layer 0's window is the model's own (2: no sinks); layer 1's is max_kv_size's (3, and sinks
    0-3): causal & (q - k < 3 or k < 4)."""
    config = tiny_config(layer_windows=(2, None)).with_max_kv_size(3)
    q = mx.arange(10, dtype=mx.int32)[None]
    m = llama.layer_masks(config, q, q, None)
    assert set(m) == {(2, 0), (3, 4)}
    assert bits(m[2, 0][0]) == ["1000000000", "1100000000", "0110000000", "0011000000", "0001100000",
                                "0000110000", "0000011000", "0000001100", "0000000110", "0000000011"]
    assert bits(m[3, 4][0]) == ["1000000000", "1100000000", "1110000000", "1111000000", "1111100000",
                                "1111110000", "1111111000", "1111011100", "1111001110", "1111000111"]
    # A left-padded row: positions from 0 after two padding tokens, which see everything.
    padded = mx.array([[-2, -1, 0, 1, 2, 3, 4, 5, 6, 7]], mx.int32)
    assert bits(llama.layer_masks(config, padded, padded, None)[3, 4][0]) == [
        "1111111111", "1111111111", "0010000000", "0011000000", "0011100000", "0011110000", "0011111000",
        "0011111100", "0011111110", "0011110111"]
    assert bits(masks.window(q, q, 3, 4)[0])[9] == "1111000111"  # before causality


def test_ring_index_pins_the_first_items():
    count = mx.array([5])
    assert masks.ring_index(mx.arange(12), count).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert masks.ring_index(mx.arange(12), count, 1).tolist() == [0, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    assert masks.ring_index(mx.arange(12), count, 2).tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 2, 3, 4, 2]
    pool = Pool(64, 4)
    pages = Pages(1, pool, 8, 64, sinks=4)  # ring_columns(8, 4, 4) = 2 + 1 + 1
    assert pages.ring == kv.ring_columns(8, 4, 4) == 4 and pages.pinned == 1
    assert [pages.column(j) for j in range(9)] == [0, 1, 2, 3, 1, 2, 3, 1, 2]
    table = mx.array([[7, 8, 9, 10]], mx.int32)
    positions = mx.arange(40, dtype=mx.int32)[None]
    device = np.array(kv.slots(table, positions, 4, kv.pinned_slots(4, 4)))[0]
    host = [int(table[0, pages.column(p // 4)].item()) * 4 + p % 4 for p in range(40)]
    assert device.tolist() == host


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_a_rings_blocks_stay_bounded_and_keep_the_sinks(block_size):
    """A row decoding 300 positions through a ring of 8 with sinks holds at most the ring's columns,
    and always the blocks of its first 4 positions, in its first columns."""
    pool = Pool(1, block_size)
    pages = Pages(1, pool, 8, 1000, least=16, sinks=4)
    sink_blocks = -(-4 // block_size)
    assert pages.ring == -(-8 // block_size) + 1 + sink_blocks
    sinks: dict[int, int] = {}  # logical block -> the block first given to it
    for p in range(300):
        pages.ensure(0, p, p + 1)
        pages.drop_behind(0, p)
        held = pages.held[0]
        for j in range(min(sink_blocks, p // block_size + 1)):
            assert held[j] == sinks.setdefault(j, held[j]) == pages.table[0, j]
        assert len(held) <= pages.ring and pool.used == len(held)
        window = range(max(0, p - 7) // block_size, p // block_size + 1)
        assert all(j in held and pages.table[0, pages.column(j)] == held[j] for j in window)


def cached_logits(config, params, tokens, chunks, block_size, start=None):
    """tokens (B, T) through a ring cache chunk by chunk (a chunk that wraps attends over the slots
    before its write followed by itself) -> logits (B, T, V)."""
    capacity = kv.columns_for(tokens.shape[1], config.max_window, block_size, config.sinks) * block_size
    return decode_in_chunks(config, params, tokens, chunks, capacity, start, block_size)[0]


@pytest.mark.parametrize("chunks", [[5] + [1] * 35, [1] * 40, [3] * 12 + [4], [8, 8, 8, 8, 8]])
@pytest.mark.parametrize("block_size", [2, 4])
def test_cached_decode_through_a_ring_with_sinks_equals_the_full_forward(chunks, block_size):
    """max_kv_size=5: the ring wraps many times, and the sinks' block stays; a left-padded row
    (starting at -3) too."""
    config = tiny_config().with_max_kv_size(5)
    params, _ = tiny_params(config, seed=8)
    tokens = random_tokens(config, (2, 40))
    start = np.array([0, -3])
    positions = mx.array(start[:, None] + np.arange(40)[None], dtype=mx.int32)
    full, _ = llama.forward(config, params, mx.array(tokens), positions)
    got = cached_logits(config, params, tokens, chunks, block_size, start)
    real = np.array(positions) >= 0
    np.testing.assert_allclose(got[real], np.array(full)[real], rtol=1e-4, atol=1e-4)
    # Without the sinks the same ring would compute something else.
    plain, _ = llama.forward(tiny_config(layer_windows=(5, 5)), params, mx.array(tokens), positions)
    assert not np.allclose(np.array(plain)[real], got[real], atol=1e-3)


def test_a_cache_with_no_room_beside_the_sinks_is_refused():
    from mlxfun.errors import InputError

    config = tiny_config().with_max_kv_size(5)
    params, _ = tiny_params(config, seed=8)
    cache = kv.empty(config, 1, 4, mx.float32, block_size=4)  # its one block is the sinks'
    with pytest.raises(InputError, match="no ring beside the 4 it keeps for attention sinks"):
        llama.forward(config, params, mx.array([[1, 2]]), mx.array([[0, 1]]), cache=cache)


def greedy_by_full_forward(model, config, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        logits, _ = llama.forward(config, model.params, mx.array([tokens]), mx.arange(len(tokens))[None])
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return tokens[len(prompt):]


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(n)] for n in (1, 3, 7, 8, 9, 26, 40)]


@pytest.mark.parametrize("prefill_step, rows", [(512, None), (4, None), (5, 2), (4, 3)])
@pytest.mark.parametrize("sinks", [True, False])
def test_engine_ring_batched_equals_alone_equals_full_forward(prefill_step, rows, sinks):
    """Through the engine, a ring of 8 (max_kv_size's, with sinks, or the model's own windows,
    without) wraps in prefill chunks (prefill_step 4, 5) and in decode steps; with fewer rows
    than prompts, continuous batching refills rows with blocks other rows held (a chunk read
    before its write must not see what they left). Every row equals its greedy full forward pass
    with the ring's masks, and its output alone."""
    model = tiny_model(None if sinks else tiny_config(layer_windows=(8, 8)))
    max_kv_size = 8 if sinks else None
    batch = prompts(seed=4)
    out, _ = run_engine(model, batch, rows=rows, max_tokens=24, max_kv_size=max_kv_size, ignore_eos=True,
                        prefill_step=prefill_step)
    windowed = model.config.with_max_kv_size(max_kv_size)
    assert windowed.sinks == (4 if sinks else 0)
    for p, ids in zip(batch, out.token_ids):
        assert ids == greedy_by_full_forward(model, windowed, p, 24)
    for p, ids in zip(batch[-2:], out.token_ids[-2:]):
        alone = generate(model, [p], max_tokens=24, max_kv_size=max_kv_size, ignore_eos=True,
                         prefill_step=prefill_step)
        assert alone.token_ids[0] == ids


def test_prefix_cache_with_a_ring_with_sinks():
    """Prompts sharing a 40-token prefix (longer than the ring of 8): the second wave reuses the
    first's cached blocks, the sinks' block among them, and every row equals its full forward."""
    model = tiny_model()
    rng = random.Random(5)
    shared = [rng.randrange(1, 97) for _ in range(40)]
    batch = [shared + [rng.randrange(1, 97) for _ in range(n)] for n in (2, 5, 9)]
    out, engine = run_engine(model, batch, max_tokens=12, max_kv_size=8, ignore_eos=True, prefill_step=16)
    assert engine.stats.cached_tokens > 0
    windowed = model.config.with_max_kv_size(8)
    for p, ids in zip(batch, out.token_ids):
        assert ids == greedy_by_full_forward(model, windowed, p, 12)


def test_ring_with_sinks_memory_is_bounded():
    """However long the rows run, each holds at most the ring's columns: the window's blocks, the
    one being filled and the sinks' block (and, while prefilling, one chunk's)."""
    model = tiny_model()
    batch = prompts(seed=6)
    ring = kv.ring_columns(8, kv.BLOCK, 4)
    assert ring == 3
    for n in (20, 200):
        _, engine = run_engine(model, batch, max_tokens=n, ignore_eos=True, max_kv_size=8)
        assert engine.stats.max_capacity == ring * kv.BLOCK
        assert engine.stats.peak_kv_used_bytes <= len(batch) * (ring + 1) * engine.block_bytes


@pytest.mark.parametrize("ring", [32, 64])
def test_real_model_counts_on_through_a_wrapped_ring(model_q4, ring):
    """SmolLM2 counting, greedy, through rings that wrap within 72 tokens. Without sinks it lost
    the count once the ring wrapped (ring 32: "..., 8, 9, 1, 2, 2, 2, ..."; ring 64: "..., 18, 19,
    19, ..."); with them every number follows the one before (ring 64 writes what it writes with
    no ring; ring 32 skips one number, 19)."""
    prompt = model_q4.tokenizer.encode("Count from 1 to 60, separated by commas: 1, 2, 3,")
    text = generate(model_q4, [prompt], max_tokens=72, max_kv_size=ring).texts[0]
    numbers = [int(n) for n in re.findall(r"(\d+),", text)]  # whole numbers only: the text ends mid-number
    assert len(prompt) + 72 > ring + 16  # the ring wrapped, a block before the end at least
    assert len(numbers) >= 16 and numbers[0] == 4, text
    assert all(b > a for a, b in zip(numbers, numbers[1:])), text


def test_a_chunk_read_before_its_write_sees_no_stale_slot():
    """A ring chunk attends over the slots before its write: a block the row took from another row
    still holds that row's positions, at their own slots, from the chunk's first position on."""
    positions = mx.array([[-1] * 4, [0, 1, 2, 3], [4, 5, 6, 7]], mx.int32)  # block 2: 6, 7 are stale
    positions = kv.write_positions(positions, mx.array([[8, 9]]), mx.array([[4, 5]]))  # the row wrote 4, 5
    table = mx.array([[1, 2]], mx.int32)
    assert kv.gather_positions(positions, table, 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert kv.gather_positions(positions, table, 4, mx.array([[6]])).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]


def test_the_cuda_decode_kernel_reads_a_ring_with_sinks():
    """The decode kernel takes the step's mask and table as they are: over rings that wrapped, with
    their sinks' block in column 0 and stale slots of other owners, it equals MLX's attention over
    the gathered keys (the kernel's source run on the CPU: `cuda_emulator`)."""
    from cuda_emulator import run

    from mlxfun.kernels import attention as kernels

    rng = np.random.default_rng(0)
    B, H, K, D, bs, window = 2, 4, 2, 16, 4, 6
    config = tiny_config(num_heads=H, num_kv_heads=K, head_dim=D).with_max_kv_size(window)
    W, pinned = kv.ring_columns(window, bs, 4), kv.pinned_slots(4, bs)
    N = 1 + B * W + 2
    table = mx.array(rng.permutation(np.arange(1, N))[:B * W].reshape(B, W).astype(np.int32))
    positions = mx.array(rng.integers(-1, 40, size=(N, bs)).astype(np.int32))  # previous owners' positions
    last = np.array([29, 17])
    for t in range(last.max() + 1):  # each row's positions written in turn, as its steps write them
        p = mx.array(np.where(t <= last, t, -1)[:, None].astype(np.int32))
        positions = kv.write_positions(positions, kv.slots(table, p, bs, pinned), p)
    held = kv.held_positions(positions, table)
    q_pos = mx.array(last[:, None].astype(np.int32))
    mask = llama.layer_masks(config, q_pos, held, None, True, pinned)[window, 4]  # (B, 1, S)
    seen = [np.array(held)[b][np.array(mask)[b, 0]].tolist() for b in range(B)]
    assert [sorted(s) for s in seen] == [[0, 1, 2, 3, 24, 25, 26, 27, 28, 29], [0, 1, 2, 3, 12, 13, 14, 15, 16, 17]]
    keys, values = (rng.standard_normal((N * bs, K, 1, D)).astype(np.float32) for _ in range(2))
    keys[:bs] = values[:bs] = np.nan  # the scratch block: a hidden slot's read must never reach the output
    qk = rng.standard_normal((B, H + K, 1, D)).astype(np.float32)
    want = llama.grouped_attention(mx.array(qk[:, :H]), kv.gather(mx.array(keys), table, bs),
                                   kv.gather(mx.array(values), table, bs), mask, D**-0.5)  # (B, H, 1, D)
    per, warps, P = kernels.launch(B, K, W * bs, D, H // K, mx.float32)
    assert P == 1
    got = run(kernels._ATTENTION + kernels._WHOLE,
              dict(qk=qk, keys=keys, values=values, table=np.array(table), mask=np.array(mask)),
              {"out": (B, 1, H * D)}, [("T", 0), ("D", D), ("G", H // K), ("PER", per), ("NW", warps), ("BS", bs)],
              (32 * warps, K, B), 32 * warps)[0]
    np.testing.assert_allclose(got.reshape(B, H * D), np.array(want).reshape(B, H * D), atol=1e-5)
