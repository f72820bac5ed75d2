"""Chunked prefill of many prompts into one cache, grouped by length so padding costs little.

Every prompt of a group ends at the same cache cursor `end` (its last token in slot (end - 1) % capacity),
so after prefill all rows decode in lockstep. Rows of similar length are prefilled together,
each group left-padded only to its own longest prompt.
"""

from __future__ import annotations

import mlx.core as mx

from mlxfun import cache as kv
from mlxfun.cache import KVCache
from mlxfun.config import ModelConfig
from mlxfun.llama import Params
from mlxfun.step import Steps

# A group may hold this much more padded work than real tokens before a new group starts.
MAX_PADDING_RATIO = 1.3


def pad_multiple() -> int:
    """What prompt lengths are rounded up to on this device. On a GPU every new attention shape
    costs a cuDNN graph build (admitting 256 prompts took 145 ms per admission unrounded, 21 ms
    rounded to 32, on an H200); on the CPU every padded token costs compute instead."""
    return 32 if mx.default_device() == mx.gpu else 1


def padded_length(prompts: list[list[int]], multiple: int) -> int:
    return -(-max(len(p) for p in prompts) // multiple) * multiple


def left_pad(prompts: list[list[int]], multiple: int = 1) -> tuple[mx.array, mx.array]:
    """-> tokens (B, L) and positions (B, L): 0 at each row's first real token, negative on padding.
    L is the longest prompt rounded up to `multiple` (fewer distinct shapes to build kernels for)."""
    L = padded_length(prompts, multiple)
    tokens = [[0] * (L - len(p)) + p for p in prompts]
    positions = [list(range(len(p) - L, len(p))) for p in prompts]
    return mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32)


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


def prefill_group(config: ModelConfig, steps: Steps, params: Params, prompts: list[list[int]], end: int,
                  capacity: int, chunk: int, dtype: mx.Dtype, multiple: int = 1) -> tuple[mx.array, KVCache]:
    """Prompts (left-padded to a multiple of `multiple`) into a fresh cache of `capacity` slots
    ending at cursor `end`. -> (last hidden state per row (g, E), cache), queued, not evaluated.
    A chunk never crosses the ring's end."""
    tokens, positions = left_pad(prompts, multiple)
    G, L = tokens.shape
    cache = kv.empty(config, G, capacity, dtype)._replace(cursor=mx.array(end - L, mx.int32))
    start, h = 0, None
    while start < L:
        cursor = end - L + start
        size = min(chunk, L - start, capacity - cursor % capacity)
        # Until the fresh cache is full every slot a chunk writes is empty: attend after writing.
        wraps = start + size > capacity
        h, cache = steps.prefill(params, tokens[:, start:start + size], positions[:, start:start + size], cache,
                                 wraps)
        mx.async_eval(h, cache)  # bounds the graph per chunk without waiting for the device
        start += size
    return h, cache


def concat_rows(caches: list[KVCache]) -> KVCache:
    """Caches with the same capacity and cursor, stacked along the batch axis."""
    if len(caches) == 1:
        return caches[0]
    return KVCache(
        keys=tuple(mx.concatenate(ks) for ks in zip(*(c.keys for c in caches))),
        values=tuple(mx.concatenate(vs) for vs in zip(*(c.values for c in caches))),
        positions=mx.concatenate([c.positions for c in caches]),
        cursor=caches[0].cursor,
    )
