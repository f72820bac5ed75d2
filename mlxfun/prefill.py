"""Chunked prefill of a group of rows into the KV pool, grouped by length so padding costs little.

Each row continues from its own start position: 0, or the end of the cached prefix it was given.
Chunks are right-padded (padding has position -1: written to the scratch block, seen by no one),
so a row's tokens sit at the same places as they would alone. A row's blocks are allocated just
before the chunk that writes them; a ring row attends over its blocks before the chunk followed
by the chunk itself (`wraps`), then drops the blocks no later query can see.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxfun import cache as kv
from mlxfun.cache import KVCache
from mlxfun.llama import Params
from mlxfun.paging import Pages
from mlxfun.step import Steps

# A group may hold this much more padded work than real tokens before a new group starts.
MAX_PADDING_RATIO = 1.3


def pad_multiple() -> int:
    """What chunk lengths are rounded up to on this device. On a GPU every new attention shape
    costs a cuDNN graph build (admitting 256 prompts took 145 ms per admission unrounded, 21 ms
    rounded to 32, on an H200); on the CPU every padded token costs compute instead."""
    return 32 if mx.default_device() == mx.gpu else 1


def plan_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped longest first, each group's padded size within MAX_PADDING_RATIO of its tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else []
        padded = (len(g) + 1) * lengths[g[0]] if g else 0  # the group's first row is its longest
        if g and padded <= MAX_PADDING_RATIO * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


def chunk_arrays(tokens: list[list[int]], starts: list[int], offset: int, size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens [offset, offset + size) of each row's `tokens`, right-padded -> tokens (G, T),
    positions (G, T) (start + index, -1 on padding), the index of each row's last real token in
    the chunk (G,) (0 if none) and whether the row's last token is in it (G,)."""
    G = len(tokens)
    ids = np.zeros((G, size), np.int32)
    positions = np.full((G, size), -1, np.int32)
    last, ends = np.zeros(G, np.int32), np.zeros(G, bool)
    for i, (t, s) in enumerate(zip(tokens, starts)):
        part = t[offset:offset + size]
        ids[i, :len(part)] = part
        positions[i, :len(part)] = np.arange(s + offset, s + offset + len(part))
        if part and offset + len(part) == len(t):
            last[i], ends[i] = len(part) - 1, True
    return ids, positions, last, ends


def prefill_rows(steps: Steps, params: Params, cache: KVCache, pages: Pages, rows: list[int],
                 prompts: list[list[int]], starts: list[int], chunk: int, multiple: int = 1,
                 chains: list | None = None) -> tuple[mx.array, KVCache]:
    """Each row's prompt from its start (the end of its cached prefix) on, in chunks of at most
    `chunk` tokens (the group's longest rounded up to `multiple`) -> (the hidden state of each
    row's last token (G, E), cache with the table `cache.table`), queued, not evaluated. `pages`
    allocates each chunk's blocks (the device pool grows to match), and the prefix cache learns
    each full block as soon as it is written (`chains`: each prompt's `blocks.chain`, if known)."""
    tokens = [p[s:] for p, s in zip(prompts, starts)]
    longest = max(len(t) for t in tokens)
    length = -(-longest // multiple) * multiple
    ring = pages.ring is not None
    table = cache.table
    h = None
    for offset in range(0, length, chunk):
        size = min(chunk, length - offset)
        ids, positions, last, ends = chunk_arrays(tokens, starts, offset, size)
        before = pages.table[rows].copy()  # a ring chunk attends over the blocks held before it
        for r, p in zip(rows, positions):
            real = p[p >= 0]
            if real.size:
                pages.ensure(r, int(real[0]), int(real[-1]) + 1)
        slots = np.stack([pages.slots(r, p) for r, p in zip(rows, positions)])
        # One token writes no slot it sees (the block it may displace is out of its window).
        wraps = ring and size > 1
        # A first chunk of rows without a cached prefix sees only itself: no keys are read from the pool.
        fresh = offset == 0 and not any(starts)
        cache = ensure_pool(cache, pages.pool.size)
        out, cache = steps.prefill(params, mx.array(ids), mx.array(positions), cache._replace(
            table=mx.array(before if wraps else pages.table[rows])), mx.array(slots), mx.array(last), wraps, fresh)
        h = out if h is None else mx.where(mx.array(ends)[:, None], out, h)
        for r, prompt, p, known in zip(rows, prompts, positions, chains or [()] * len(rows)):
            real = p[p >= 0]
            if real.size:
                end = int(real[-1]) + 1
                pages.pool.register(prompt[:end], pages.blocks(r, end // pages.bs), known=known)
                pages.drop_behind(r, end)
        mx.async_eval(h, cache)  # bounds the graph per chunk without waiting for the device
    return h, cache._replace(table=table)


def ensure_pool(cache: KVCache, blocks: int) -> KVCache:
    """The device pool grown to the host's block count."""
    return kv.with_blocks(cache, blocks)
