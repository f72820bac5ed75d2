"""Chunked prefill of a group of rows into the KV pool, grouped by length so padding costs little.

Each row continues from its own start position: 0, or the end of the cached prefix it was given.
Chunks are right-padded (padding has position -1: written to the scratch block, seen by no one),
so a row's tokens sit at the same places as they would alone. A row's blocks are allocated just
before the chunk that writes them; a ring row attends over its blocks before the chunk followed
by the chunk itself (`wraps`), then drops the blocks no later query can see. Blocks are handed
out lowest first, so rows of equal length (a static batch's, or one long prompt's full chunks)
usually fill one run of slots: on the CPU their chunk is written by slice updates
(`cache.write_run`, `slice_writes`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlxfun.engine.blocks import Chain
from mlxfun.engine.paging import Pages
from mlxfun.engine.step import Steps
from mlxfun.model import cache as kv
from mlxfun.model.cache import KVCache
from mlxfun.model.llama import Params

# A group may hold this much more padded work than real tokens before a new group starts.
MAX_PADDING_RATIO = 1.3


def pad_multiple() -> int:
    """What chunk lengths are rounded up to on this device. On a GPU every new attention shape
    costs a cuDNN graph build (admitting 256 prompts took 145 ms per admission unrounded, 21 ms
    rounded to 32, on an H200); on the CPU every padded token costs compute instead."""
    return 32 if mx.default_device() == mx.gpu else 1


def slice_writes() -> bool:
    """Whether a chunk whose slots form one run is written by slice updates (`cache.write_run`)
    rather than a scatter: on the CPU, where the slice update is 3.5x faster. On CUDA, MLX's slice
    update at an array offset launches a thread per element of the whole destination, not of the
    update (MLX 0.32, `copy_general_dynamic`), so each admission's writes cost about 1.5 ms per GB
    of KV pool: on an H100, 6.5 ms at 4 GB and 23.6 ms at 16 GB against 0.43 ms for the scatter at
    both (`benchmarks/pool_writes.py`, a probe since removed), and a server's admissions stalled 130 ms at 60 GB."""
    return mx.default_device() == mx.cpu


# A group's chunk holds at most this many tokens, padding included (unless one row's chunk alone
# is more), at a hidden size of 4,096, and in inverse proportion at other widths (`group_tokens`).
# An admission's peak memory follows its largest chunk: 128 prompts of 128 tokens as one chunk of
# the 8B took 23.1 GB beside the weights on an H200 (the decoder's activations 11.8 GB, the pool
# 4.3 GB, the keys and values its writes wait on 7.0 GB), where round 1 peaked 9.4 GB lower.
# (The writes waited for the last layer; each layer now waits for its own: `llama.attention`.)
GROUP_TOKENS = 8192


# A first chunk of at most this many tokens (padding included) launches its first layers
# (`llama.LAUNCH_LAYERS`) before the host builds the rest of its graph. The host builds the 1B's
# 16 layers in about 1.6 ms while the device waits: 32 prompts of 128 tokens read 1.03x and 1.06x
# faster with it on H200s (two runs, each alternating, medians of 6). A larger chunk keeps the
# device busy long enough that it gained nothing (128 x 128 tokens: 1.00x), and the first layers'
# keys and values, which wait for the final launch to be written, raised its peak from 12.61 to
# 13.45 GB.
EARLY_LAUNCH_TOKENS = 4096


def group_tokens(hidden_size: int) -> int:
    """Tokens a group's chunk may hold for a model `hidden_size` wide: activations grow with the
    width. The 1B shape (2,048) takes 16,384: 128 prompts of 128 tokens in one group read 6% faster
    than in two on an H200 and peaked no higher (12.61 GB against 12.76)."""
    return max(1, GROUP_TOKENS * 4096 // hidden_size)


def plan_groups(lengths: list[int], chunk: int | None = None, limit: int = GROUP_TOKENS) -> list[list[int]]:
    """Row indices grouped longest first, each group's padded size within MAX_PADDING_RATIO of its
    tokens, and its chunks (of at most `chunk` tokens per row) within `limit` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    total = 0  # the last group's tokens
    for i in order:
        g = groups[-1] if groups else None
        # The group's first row is its longest.
        longest = lengths[g[0]] if g else 0
        if (g and (len(g) + 1) * longest <= MAX_PADDING_RATIO * (total + lengths[i])
                and (len(g) + 1) * min(longest, chunk or longest) <= limit):
            g.append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def chunk_arrays(tokens: list[list[int]], starts: list[int], offset: int, size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens [offset, offset + size) of each row's `tokens`, right-padded -> tokens (G, T),
    positions (G, T) (start + index, -1 on padding), the index of each row's last real token in
    the chunk (G,) (0 if none) and whether the row's last token is in it (G,)."""
    lengths = np.array([len(t) for t in tokens])
    count = np.clip(lengths - offset, 0, size)  # (G,) each row's tokens in this chunk
    real = np.arange(size)[None] < count[:, None]  # (G, T)
    ids = np.zeros(real.shape, np.int32)
    # One conversion for every row (row-major order is the mask's order).
    ids[real] = np.fromiter(itertools.chain.from_iterable(t[offset:offset + size] for t in tokens), np.int32,
                            count=int(count.sum()))
    positions = np.where(real, np.array(starts)[:, None] + offset + np.arange(size)[None], -1).astype(np.int32)
    ends = (count > 0) & (offset + count == lengths)
    return ids, positions, np.where(ends, count - 1, 0).astype(np.int32), ends


def prefill_rows(steps: Steps, params: Params, cache: KVCache, pages: Pages, rows: list[int],
                 prompts: list[list[int]], starts: list[int], chunk: int, multiple: int = 1,
                 chains: Sequence[Callable[[], Chain]] | None = None,
                 before_launch: Callable[[], None] | None = None,
                 settle: Callable[[KVCache], None] | None = None, busy: bool = False) -> tuple[mx.array, KVCache]:
    """Each row's prompt from its start (the end of its cached prefix) on, in chunks of at most
    `chunk` tokens (the group's longest rounded up to `multiple`) -> (the hidden state of each
    row's last token (G, E), cache with the table `cache.table`), queued, not evaluated. `pages`
    allocates each chunk's blocks (the device pool grows to match), and the prefix cache learns
    each full block once its chunk is queued (`chains`: each prompt's `blocks.chain`, computed
    then, while the device runs the chunk). `before_launch` runs once, after the first chunk's
    host work and graph and before its launch (the engine waits there for the group before).
    `settle(cache)` runs before each chunk is queued (`Runner.settle`: a large pool is written only
    once the write queued before has run). `busy`: a decode step is in flight, so a chunk that waits
    for it (`settle`) builds its whole graph first, while the device runs that step, rather than
    launching its first layers early, which would wait for the step anyway."""
    tokens = [p[s:] for p, s in zip(prompts, starts)]
    longest = max(len(t) for t in tokens)
    length = -(-longest // multiple) * multiple
    ring = pages.ring is not None
    runs = slice_writes()
    table = cache.table
    h = None
    for offset in range(0, length, chunk):
        size = min(chunk, length - offset)
        ids, positions, last, ends = chunk_arrays(tokens, starts, offset, size)
        # One token writes no slot it sees (the block it may displace is out of its window).
        wraps = ring and size > 1
        before = pages.table[rows] if wraps else None  # a ring chunk attends over the blocks held before it
        counts = (positions >= 0).sum(axis=1)
        for r, n, s in zip(rows, counts.tolist(), starts):
            if n:
                pages.ensure(r, s + offset, s + offset + n)
        slots = pages.slots(rows, positions)
        # One run of slots (equal rows, consecutive blocks): slice updates where they are cheap.
        start = kv.run_start(slots) if runs else None
        # A first chunk of rows without a cached prefix sees only itself: no keys are read from the pool.
        fresh = offset == 0 and not any(starts)
        # The device pool holds every block the chunk writes or reads (a first admission's pool starts
        # at the prompts' size, `Engine.admit`; otherwise it is the host's pool already).
        if max(int(slots.max()) // pages.bs, int(pages.table[rows].max())) >= cache.positions.shape[0]:
            cache = ensure_pool(cache, pages.pool.size)
        # A first chunk with nothing to wait for starts its first layers while the host builds the rest.
        early = offset == 0 and before_launch is None and ids.size <= EARLY_LAUNCH_TOKENS \
            and not (busy and settle is not None)
        if settle is not None and early:
            settle(cache)
        launch = mx.async_eval if early else None
        out, cache = steps.prefill(params, mx.array(ids), mx.array(positions), cache._replace(
            table=mx.array(before if wraps else pages.table[rows])), mx.array(slots), mx.array(last), wraps, fresh,
            None if start is None else mx.array([start], mx.int32), launch)
        h = out if h is None else mx.where(mx.array(ends)[:, None], out, h)
        if before_launch is not None:
            before_launch()
            before_launch = None
        if settle is not None and not early:
            settle(cache)
        # Bounds the graph per chunk; the device starts while the host goes on. `h` waits for every
        # layer's writes (`llama.hidden`), in layer order. The pools themselves are not passed: an
        # evaluation in flight holds what it was given, so the step after it (a decode step queued
        # meanwhile) found them referenced and copied the whole pool (a 386 MB pool: 0.5 s a step).
        mx.async_eval(h)
        for i, (r, n, s) in enumerate(zip(rows, counts.tolist(), starts)):
            if n:
                end = s + offset + n
                pages.pool.register(prompts[i][:end], pages.blocks(r, end // pages.bs),
                                    known=chains[i]() if chains is not None else ())
                pages.drop_behind(r, end)
    return h, cache._replace(table=table)


def ensure_pool(cache: KVCache, blocks: int) -> KVCache:
    """The device pool grown to the host's block count."""
    return kv.with_blocks(cache, blocks)
