"""Host bookkeeping of the KV pool's blocks: which are free, how many rows use each, and which
hold a cached prefix. Pure Python over block ids (the arrays live in `cache.KVCache`), so it is
tested without a model.

A block is in exactly one of three states: free; used (referenced by at least one row); or
cached and unreferenced (kept for reuse, evicted least recently released first). A cached block
is found by the tokens of the whole prefix it ends: its key chains a digest of its parent's key
and its own tokens (vLLM's automatic prefix caching), and the tokens are compared on a match, so
two prefixes never share a key by accident. Only full blocks are cached; a row writes only into
blocks of its own, so a cached block never changes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class Node:
    block: int
    tokens: tuple[int, ...]
    key: bytes


Chain = list[tuple[bytes, tuple[int, ...]]]


def chain(tokens: Sequence[int], block_size: int, known: Chain = ()) -> Chain:
    """(key, tokens) of each full block of `tokens`, each key a digest of its parent's and its
    tokens. `known`: the chain of a prefix of `tokens` (a request's prompt, computed once), reused."""
    n = len(tokens) // block_size
    out = list(known[:n])
    parent, first = (out[-1][0] if out else b""), len(out)
    flat = np.asarray(tokens[first * block_size:n * block_size], np.int64)  # one conversion for every block
    data, ints, step = flat.tobytes(), flat.tolist(), block_size * 8
    for i in range(n - first):
        parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step], digest_size=16).digest()
        out.append((parent, tuple(ints[i * block_size:(i + 1) * block_size])))
    return out


class Pool:
    """The pool's `size` block ids (block 0: scratch, never handed out), with reference counts
    and, when `max_cached` > 0, a prefix cache of at most that many unreferenced blocks."""

    def __init__(self, size: int, block_size: int, max_cached: int = 0):
        self.block_size = block_size
        self.max_cached = max_cached
        self.size = 0
        self.refs: list[int] = []
        self.free: list[int] = []
        self.nodes: dict[bytes, Node] = {}  # prefix key -> cached block
        self.keys: dict[int, bytes] = {}  # cached block -> its key
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no row uses, oldest first
        self.hits = self.lookups = 0  # blocks found / looked up
        self.grow(size)

    # ---- counts ----

    @property
    def used(self) -> int:
        """Blocks some row references."""
        return self.size - 1 - len(self.free) - len(self.idle)

    @property
    def cached(self) -> int:
        return len(self.keys)

    def available(self) -> int:
        """Blocks that an allocation can take without growing the pool: free or evictable."""
        return len(self.free) + len(self.idle)

    # ---- allocation ----

    def grow(self, size: int) -> None:
        new = range(max(self.size, 1), size)
        self.refs += [0] * (size - self.size)
        self.free += reversed(new)  # lowest ids first off the stack
        self.size = max(self.size, size)

    def allocate(self) -> int | None:
        """A block for one row (referenced once), or None when every block is in use."""
        if not self.free and self.idle:
            self._evict(next(iter(self.idle)))
        if not self.free:
            return None
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.idle.pop(block)  # a cached block taken back into use
        self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference fewer on each block (in order: release a row's blocks last first, so
        that its deepest cached blocks are evicted before their parents)."""
        for block in blocks:
            self.refs[block] -= 1
            assert self.refs[block] >= 0, block
            if self.refs[block] == 0:
                if block in self.keys:
                    self.idle[block] = None
                else:
                    self.free.append(block)
        self.trim(self.max_cached)

    def trim(self, max_cached: int) -> None:
        """Evict idle cached blocks beyond `max_cached`, oldest first."""
        while len(self.idle) > max_cached:
            self._evict(next(iter(self.idle)))

    def _evict(self, block: int) -> None:
        del self.idle[block]
        del self.nodes[self.keys.pop(block)]
        self.free.append(block)

    # ---- the prefix cache ----

    def peek(self, tokens: Sequence[int], limit: int, known: Chain = ()) -> list[bytes]:
        """Keys of the cached blocks holding the first full blocks of `tokens` (at most `limit`;
        `known` as for `chain`)."""
        found = []
        if not self.nodes:
            return found
        for key, part in chain(tokens[:limit * self.block_size], self.block_size, known):
            node = self.nodes.get(key)
            if node is None or node.tokens != part:
                break
            found.append(key)
        return found

    def match(self, tokens: Sequence[int], limit: int, known: Chain = ()) -> list[int]:
        """Cached blocks holding the first full blocks of `tokens`, at most `limit` of them, each
        now referenced by the caller."""
        found = [self.nodes[key].block for key in self.peek(tokens, limit, known)]
        for block in found:
            self.ref(block)
        self.lookups += max(0, min(limit, len(tokens) // self.block_size))
        self.hits += len(found)
        return found

    def register(self, tokens: Sequence[int], blocks: Sequence[int], always: bool = False, known: Chain = ()) -> None:
        """Cache the full blocks of `tokens`, held in `blocks` (a row's blocks in order, which it
        still references; 0 where it holds none). A prefix already cached in another block keeps
        that one. Only with a prefix cache (`max_cached` > 0), unless `always`."""
        if self.max_cached <= 0 and not always:
            return
        for (key, part), block in zip(chain(tokens, self.block_size, known), blocks):
            if key in self.nodes or block in self.keys or block == 0:
                continue
            self.nodes[key] = Node(block, part, key)
            self.keys[block] = key

    def pin(self, blocks: Sequence[int]) -> None:
        """Keep blocks from eviction (a reference held by no row, e.g. a loaded prompt cache)."""
        for block in blocks:
            self.ref(block)

    # ---- compaction ----

    def compaction(self) -> np.ndarray:
        """The blocks to keep (scratch first, then every used or cached block, in id order), for
        `renumber` after the device pool has been reduced to them."""
        return np.array([0] + [b for b in range(1, self.size) if self.refs[b] > 0 or b in self.keys], np.int32)

    def renumber(self, keep: np.ndarray, size: int) -> np.ndarray:
        """Renumber after the pool kept blocks `keep` (now 0..len(keep)-1) and was sized to `size`:
        -> the old-to-new map (old ids not kept map to 0)."""
        new = np.zeros(self.size, np.int32)
        new[keep] = np.arange(len(keep), dtype=np.int32)
        self.refs = [self.refs[b] for b in keep] + [0] * (size - len(keep))
        self.keys = {int(new[b]): k for b, k in self.keys.items()}
        for node in self.nodes.values():
            node.block = int(new[node.block])
        self.idle = OrderedDict((int(new[b]), None) for b in self.idle)
        self.size = size
        self.free = list(reversed(range(len(keep), size)))
        return new
