"""Which blocks each row of the scheduler holds: the host's side of the block tables.

Row r holds a block per logical block j of its positions (j * bs ... (j + 1) * bs - 1), in
`held[r]`; the device table puts block j in column j % W. A linear row's table is as wide as its
longest live row needs (in buckets, so the compiled step retraces per bucket), so a column is a
logical block. A ring row (every layer windowed, or `max_kv_size`) keeps `ring_columns(window)`
columns: each new block displaces the one W columns behind it, which no query can see any more.
A ring of `max_kv_size` also keeps, in its first columns, the blocks that hold its row's attention
sinks (`sinks` first positions, visible to every query): its ring is the columns after them.
Blocks come from a `blocks.Pool`, which grows (up to `max_blocks`) when none is free; the engine
sizes the device pool to match. Pure bookkeeping over integers: no arrays but the host table.
"""

from __future__ import annotations

import numpy as np

from mlxfun.engine.blocks import Pool
from mlxfun.model import cache as kv

# The least pool, in blocks beside the scratch block. Each new pool size retraces the compiled
# step: about a second on an H200, where 64 blocks are a sliver of its memory (33 MB of the 1B's
# KV). On the CPU a retrace costs about a step (SmolLM2: 0.1 s), and 64 blocks of SmolLM2's float32
# KV (48 MB) put its 4-bit batch-1 bench 1.29x round 1's peak; 16 blocks are round 1's growth step.
MIN_BLOCKS = 64
MIN_BLOCKS_CPU = 16


def pool_size(blocks: int, max_blocks: int, least: int = MIN_BLOCKS) -> int:
    """The pool size for at least `blocks` blocks, scratch block 0 included: 1 + least * 2^k or
    1 + 1.5 * least * 2^k (steps of 1.5x and 1.33x in the blocks rows can hold; `least` a power of
    two), or `max_blocks` when that is smaller. The scratch block sits beside the grid: a batch
    whose rows need 2^k blocks in all (128 rows of 256 tokens) fits a pool of 2^k + 1, not of
    1.5 * 2^k (2.1 GB more for the 8B)."""
    size = least
    while size < blocks - 1:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(1 + size, max_blocks)


def ladder(context: int, block_size: int, factor: int = 4) -> list[int]:
    """Table widths (columns) for a fixed-shape engine: the first bucket, then `factor` times
    wider up to the context. Few widths, so a server compiles each at start; a row's attention
    reads at most `factor` times the slots it needs."""
    widths = [kv.columns_for(1, None, block_size)]
    full = kv.columns_for(context, None, block_size)
    while widths[-1] < full:
        widths.append(min(widths[-1] * factor, full))
    return widths


class Pages:
    def __init__(self, rows: int, pool: Pool, window: int | None, max_blocks: int, least: int = MIN_BLOCKS,
                 widths: list[int] | None = None, sinks: int = 0):
        self.pool, self.bs, self.window, self.max_blocks = pool, pool.block_size, window, max_blocks
        self.least = least  # the least pool's blocks (`pool_size`)
        self.widths = widths  # the table widths allowed (`ladder`); None: every bucket
        self.ring = None if window is None else kv.ring_columns(window, self.bs, sinks)
        # A ring row's first logical blocks, kept in its first columns for good (`kv.pinned_slots`).
        self.pinned = 0 if window is None else kv.pinned_slots(sinks, self.bs) // self.bs
        self.held: list[dict[int, int]] = [{} for _ in range(rows)]
        self.table = np.zeros((rows, self.ring or kv.columns_for(1, None, self.bs)), np.int32)
        self.dirty = True  # the device table is out of date
        self.released = False  # a row gave its blocks back since the last `shrink`

    # ---- sizes ----

    def blocks_for(self, positions: int, transient: int = 0) -> int:
        """Blocks a row of `positions` positions may hold at once; `transient`: prompt tokens one
        prefill chunk writes (a ring row holds that chunk's blocks too, until it is queued)."""
        linear = -(-positions // self.bs)
        return linear if self.ring is None else min(linear, self.ring + -(-transient // self.bs) + 1)

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def fit_width(self) -> None:
        """Size the table to what the rows hold: a linear table to the bucket of the furthest
        logical block any row holds (it shrinks when long rows have left)."""
        if self.ring is not None:
            return
        last = max((max(h) for h in self.held if h), default=0)
        width = kv.columns_for((last + 1) * self.bs, None, self.bs)
        if self.widths is not None:
            width = next((w for w in self.widths if w >= width), width)
        if width != self.width:
            self.table = np.zeros((len(self.held), width), np.int32)
            for r in range(len(self.held)):
                self._fill(r)
            self.dirty = True

    def shrink(self) -> None:
        """`fit_width` once rows have given blocks back (only then can the table narrow)."""
        if self.released:
            self.released = False
            self.fit_width()

    # ---- rows ----

    def attach(self, row: int, blocks: list[int]) -> None:
        """Give an empty row cached blocks (already referenced) as its logical blocks 0, 1, ..."""
        assert not self.held[row]
        self.held[row] = dict(enumerate(blocks))
        self._settle(row)

    def ensure(self, row: int, start: int, end: int) -> None:
        """Blocks for positions [start, end) of a row, allocated where it holds none."""
        held = self.held[row]
        if start // self.bs == (end - 1) // self.bs and start // self.bs in held:
            return  # a decode step inside a block the row holds: every step of every row comes here
        missing = [j for j in range(start // self.bs, -(-end // self.bs)) if j not in held]
        if missing:  # else the table row is as it was: no per-step rewrite, no upload
            self.prepare(len(missing))
            after = not held or missing[0] > max(held)  # past every block the row holds: a decode step's
            for j in missing:
                held[j] = self.pool.allocate()
            self._settle(row, missing if after else None)

    def drop_behind(self, row: int, position: int) -> None:
        """A ring row releases the blocks a query at `position` can no longer see (never its
        pinned blocks: they hold its sinks)."""
        if self.ring is None:
            return
        first = position // self.bs - (self.ring - self.pinned) + 1
        old = sorted(j for j in self.held[row] if self.pinned <= j < first)
        if old:
            self.pool.release([self.held[row].pop(j) for j in reversed(old)])
            self._settle(row)

    def release(self, row: int) -> None:
        """A row gives back every block it holds (deepest first: cached leaves evict first)."""
        held = self.held[row]
        self.pool.release([held[j] for j in sorted(held, reverse=True)])
        self.held[row] = {}
        self.table[row] = 0
        self.dirty = self.released = True

    def slots(self, rows: list[int], positions: np.ndarray) -> np.ndarray:
        """positions (G, T) of `rows` -> (G, T) flat pool slots (0, the scratch slot, for negative
        positions). A linear table holds logical block j in column j: one lookup for every row."""
        if self.ring is None:
            logical = np.minimum(np.maximum(positions, 0) // self.bs, self.width - 1)
            blocks = np.take_along_axis(self.table[rows], logical, axis=1)
        else:  # a ring's columns hold only its latest blocks: a chunk may hold more
            blocks = np.stack([self._row_blocks(r, p) for r, p in zip(rows, positions)])
        real = positions >= 0
        assert (blocks[real] > 0).all(), "a position without a block (ensure it first)"
        return np.where(real, blocks * self.bs + positions % self.bs, 0).astype(np.int32)

    def _row_blocks(self, row: int, positions: np.ndarray) -> np.ndarray:
        """positions (T,) -> the block each is in (0 for negative positions or none held)."""
        logical = np.maximum(positions, 0) // self.bs
        lookup = np.zeros(int(logical.max(initial=0)) + 1, np.int32)  # logical block -> block (0: none)
        for j, block in self.held[row].items():
            if j < len(lookup):
                lookup[j] = block
        return lookup[logical]

    def blocks(self, row: int, count: int) -> list[int]:
        """A row's blocks for logical blocks 0 .. count-1 (0 where it no longer holds one)."""
        return [self.held[row].get(j, 0) for j in range(count)]

    def prepare(self, blocks: int) -> None:
        """Make `blocks` allocations possible without growing the pool: grow it (up to
        `max_blocks`) to the next size of `pool_size`'s grid. Every new pool size retraces the
        compiled step (about a second on an H200), so sizes are few and the same across engines."""
        if self.pool.available() >= blocks:
            return
        size = pool_size(self.pool.size + blocks - self.pool.available(), self.max_blocks, self.least)
        if size - self.pool.size + self.pool.available() < blocks:
            raise MemoryError(f"the KV pool is full ({self.pool.size} blocks)")  # reservations prevent this
        self.pool.grow(size)

    def reserve(self, blocks: int) -> None:
        """Grow the pool at once for `blocks` more allocations where the budget allows (an
        admission reserves what its rows may need: one size, not a growth per decode step)."""
        self.prepare(min(blocks, self.max_blocks - self.pool.size + self.pool.available()))

    # ---- internals ----

    def _settle(self, row: int, new: list[int] | None = None) -> None:
        """The row's table columns from what it holds (a linear table widens when it must). `new`:
        blocks just added past every other block of the row, ascending: only their columns change
        (at 128 rows each step has about 8 rows entering a block; refilling a row is a loop over
        all it holds)."""
        held = self.held[row]
        if self.ring is None and held and (new[-1] if new else max(held)) >= self.width:
            self.fit_width()
            self._fill(row)
        elif new is None:
            self._fill(row)
        else:
            columns = self.table[row]  # a view of the row
            for j in new:
                columns[self.column(j)] = held[j]
        self.dirty = True

    def column(self, j: int) -> int:
        """The table column of logical block j: j itself in a linear table; in a ring, its pinned
        blocks first, then the others in turn (`masks.ring_index`, as the device computes it)."""
        if j < self.pinned:
            return j
        return self.pinned + (j - self.pinned) % (self.width - self.pinned)

    def _fill(self, row: int) -> None:
        self.table[row] = 0
        for j in sorted(self.held[row]):
            self.table[row, self.column(j)] = self.held[row][j]

    def reorder(self, keep: list[int]) -> None:
        """Rows `keep` become rows 0, 1, ... (the engine's rows followed its live requests); the
        rest hold nothing."""
        rows = len(self.held)
        self.held = [self.held[r] for r in keep] + [{} for _ in range(rows - len(keep))]
        self.table = np.concatenate([self.table[keep], np.zeros((rows - len(keep), self.width), np.int32)])
        self.dirty = True

    def remap(self, new: np.ndarray) -> None:
        """Block ids renumbered by a compaction (`Pool.renumber`'s map)."""
        self.held = [{j: int(new[b]) for j, b in h.items()} for h in self.held]
        self.table = new[self.table]
        self.dirty = True
