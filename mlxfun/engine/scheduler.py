"""The scheduler: which request holds which row, which wait, and the KV blocks each row holds.

Plain Python over host data (no MLX): the queue, admission (by the memory budget, in prefill
waves that compute a shared prefix once), cancellation, the rows' positions and widths, and the
bookkeeping of the paged KV pool (`blocks.Pool`, `paging.Pages`). The engine asks it what to run
and tells it what ran; the runner (`runner.py`) does the device side of the same decisions.

Each admitted request reserves the blocks it may come to need (`blocks_needed`), so a request
admitted never waits for memory; one that fits alone but not beside the live rows waits for them.
With `preempt` (a server's fixed pool) a request is admitted by the blocks its prompt holds, not
by what it might come to hold; when a step finds the pool full, the newest row is taken back
(`preempt`): its blocks go to the prefix cache and the pool, and its request waits at the head of
the queue to resume from its prompt and the tokens it generated (as vLLM recomputes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from mlxfun.engine.blocks import Pool
from mlxfun.engine.options import Request
from mlxfun.engine.paging import Pages, pool_size
from mlxfun.engine.records import Record

# Rounds a server's queue that fits its free rows may wait for more (a GPU's fixed-shape engine).
ADMIT_WAIT = 8


def default_admit_wait(on_gpu: bool, fixed_shapes: bool) -> int:
    """A server's clients send their next request as the last one ends, so its queue is refilled
    one request at a time. On a GPU an admission's cost hardly depends on its prompts (1B, 32 rows,
    H100: 9.6 ms for one, 11.2 for three), so waiting a few decode steps for more finished rows buys
    back more than the rows idle meanwhile. On the CPU every prompt token costs: no wait. An offline
    run queues everything at once: only its last requests could wait."""
    return ADMIT_WAIT if on_gpu and fixed_shapes else 0


class Scheduler:
    """`rows` rows of requests over one KV pool of at most `max_blocks` blocks.

    Per row of the state (as many as `width` gives for the live requests): `owner` (request id or
    None), `pos` (the position its next decode step feeds; -1: no request) and `need` (blocks
    reserved for its request). `spill`: positions a verify round queued near a request's end may
    write past it (speculative decoding)."""

    def __init__(self, rows: int, pool: Pool, pages: Pages, *, max_blocks: int, context: int, prefill_step: int,
                 admit_min: int, shrink_rows: bool, spill: int = 0, preempt: bool = False, admit_wait: int = 0,
                 mixed_tokens: int = 0, row_buckets: bool = False):
        self.rows, self.pool, self.pages, self.max_blocks = rows, pool, pages, max_blocks
        self.context, self.prefill_step = context, prefill_step
        self.admit_min, self.shrink_rows = admit_min, shrink_rows
        self.row_buckets = row_buckets  # shrunk widths are powers of two (and `rows`): few step shapes
        self.admit_wait = admit_wait
        self.mixed_tokens = mixed_tokens  # prompt tokens a decode step may carry (`step.mixed_step`)
        self.held = 0  # rounds in a row a queue that fit its free rows was held back for more of them
        self.spill = spill
        self.preempt = preempt
        self.admitted = 0  # admissions so far: `since[row]` orders the rows, newest last
        self.since: list[int] = []
        self.requests: dict[int, Record] = {}
        self.pending: deque[int] = deque()
        self.owner: list[int | None] = [None] * self.width(0)
        self.pos = [-1] * len(self.owner)
        self.need = [0] * len(self.owner)
        self.since = [0] * len(self.owner)
        self.vacated: list[int] = []  # rows released since the last step: their device positions go to -1

    # ---- rows ----

    def width(self, live: int) -> int:
        """Rows the state holds for `live` requests: every row, or (shrink_rows) only the live ones,
        rounded up to a power of two with `row_buckets`."""
        if not self.shrink_rows:
            return self.rows
        live = max(1, min(live, self.rows))
        return min(self.rows, 1 << (live - 1).bit_length()) if self.row_buckets else live

    def widths(self) -> list[int]:
        """Every width `width` may give, ascending: the row counts a warm-up runs."""
        return sorted({self.width(n) for n in range(self.rows + 1)})

    def live_count(self) -> int:
        return len(self.owner) - self.owner.count(None)

    def live_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is not None]

    def free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is None]

    def live_records(self) -> list[Record]:
        return [self.requests[o] for o in self.owner if o is not None]

    def resize_rows(self, width: int) -> None:
        """The per-row lists at `width` rows, every row empty (no state yet)."""
        self.owner, self.pos, self.need, self.since = [None] * width, [-1] * width, [0] * width, [0] * width
        self.vacated = []  # rows of a state that is gone: a new state's rows start at -1

    def set_width(self, width: int) -> list[int] | None:
        """Hold `width` rows: the live ones (in order), then empty ones. -> the rows kept, in their
        new order (None: the width is unchanged). The blocks move with their rows."""
        if width == len(self.owner):
            return None
        keep = self.live_rows()
        empty = width - len(keep)
        self.owner = [self.owner[r] for r in keep] + [None] * empty
        self.pos = [self.pos[r] for r in keep] + [-1] * empty
        self.need = [self.need[r] for r in keep] + [0] * empty
        self.since = [self.since[r] for r in keep] + [0] * empty
        self.pages.reorder(keep)
        self.vacated = []  # the new empty rows start at -1 on the device
        return keep

    # ---- what requests may do ----

    def limit(self, request: Request) -> int:
        """Tokens the request may generate: max_tokens, within the model's context."""
        return min(request.max_tokens, self.context - len(request.prompt))

    def remaining(self, row: int) -> int:
        """Tokens the request in `row` may still generate (max_tokens, within the context)."""
        record = self.requests[self.owner[row]]
        return self.limit(record.request) - len(record.row.text.tokens)

    def needs_decode(self) -> bool:
        """Whether some live row may still need a token after the one in flight (every live row
        has exactly one in flight here: its first token, or the last step's)."""
        return any(len(self.requests[o].row.text.tokens) + 1 < self.limit(self.requests[o].request)
                   for o in self.owner if o is not None)

    def ahead(self) -> int:
        """The most tokens a live or queued request may still generate: the decode steps left, at most."""
        live = [self.remaining(r) for r, o in enumerate(self.owner) if o is not None]
        return max(live + [self.limit(self.requests[rid].request) for rid in self.pending], default=0)

    def blocks_needed(self, request: Request) -> int:
        """Blocks a request may hold at once: its prompt and every token it may generate (a ring:
        its window, and one prefill chunk's blocks), and the positions a verify round may spill."""
        return self.pages.blocks_for(len(request.prompt) + self.limit(request) + self.spill,
                                     min(self.prefill_step, len(request.prompt)))

    def outstanding(self) -> int:
        """Blocks the live rows have reserved and do not hold yet."""
        held = self.pages.held
        return sum(max(0, self.need[r] - len(held[r])) for r, o in enumerate(self.owner) if o is not None)

    # ---- the queue ----

    def enqueue(self, record: Record) -> None:
        self.requests[record.id] = record
        self.pending.append(record.id)

    def cancel(self, rid: int) -> tuple[Record, int | None] | None:
        """Mark a request cancelled and take it off the queue. -> its record and the row it holds
        (the caller releases it), or None where it is unknown or has finished already."""
        record = self.requests.get(rid)
        if record is None or record.finish_reason is not None:
            return None
        record.row.finish_reason = "cancelled"
        if rid in self.pending:
            self.pending.remove(rid)
        return record, self.owner.index(rid) if rid in self.owner else None

    def admission(self) -> list[Record]:
        """Queued requests to admit now, taken off the queue: into free rows, while the blocks the
        live rows hold or have reserved and theirs fit the memory budget. With rows still
        decoding, none until `admit_min` rows are free, so that one prefill serves several
        requests; a queue that fits the free rows waits at most `admit_wait` rounds for more
        (a server's queue, refilled one request at a time, would otherwise be admitted one by one)."""
        if not self.pending:
            return []
        room = self.rows - self.live_count()
        if not room:
            return []
        # Only a preempted request can end while queued (its last token was in flight): not every
        # step's walk of a long queue for the others.
        if self.preempt:
            for rid in [rid for rid in self.pending if self.requests[rid].finish_reason is not None]:
                self.pending.remove(rid)
            if not self.pending:
                return []
        # A queue whose prompts fit one decode step's chunk rides along it at once: an admission of
        # its own would cost the launches that `admit_min` and `admit_wait` spread over several
        # requests. A longer queue (a burst: 128 clients' rows ending together) prefills on its own,
        # in one admission, rather than a few prompts a step while the other rows wait.
        if self.live_count() and self.mixed_tokens:
            riders = self._riding(room)
            if riders and len(riders) == min(room, len(self.pending)):
                return self._take(riders)
        fits = len(self.pending) <= room
        if self.live_count() and room < self.admit_min and not (fits and self.held >= self.admit_wait):
            self.held += fits
            return []
        committed = self.pool.used + self.outstanding()
        out = []
        for rid in list(self.pending)[:room]:
            record = self.requests[rid]
            if self.preempt:  # the prompt's blocks, and room for each row's next step
                need = self.pages.blocks_for(len(record.prompt))
                if committed + need + self.live_count() + len(out) + 1 > self.max_blocks - 1:
                    break
                committed += need
            else:
                need = self.blocks_needed(record.request)
                if (out or self.live_count()) and committed + need > self.max_blocks:
                    break  # the first request alone was checked by submit
                committed += need
            out.append(record)
        return self._take(out)

    def _riding(self, room: int) -> list[Record]:
        """The queue's first requests whose uncached prompts fit one decode step's chunk together,
        within the free rows and the blocks (a server's fixed pool: by what their prompts hold)."""
        out, tokens = [], 0
        committed = self.pool.used + self.outstanding()
        for rid in list(self.pending)[:room]:
            record = self.requests[rid]
            tokens += self.uncached(record)
            need = self.pages.blocks_for(len(record.prompt)) if self.preempt else self.blocks_needed(record.request)
            reserve = self.live_count() + len(out) + 1 if self.preempt else 0
            if tokens > self.mixed_tokens or committed + need + reserve > self.max_blocks - 1:
                break
            committed += need
            out.append(record)
        return out

    def _take(self, records: list[Record]) -> list[Record]:
        """Admitted: off the queue."""
        self.held = 0
        for record in records:
            self.pending.remove(record.id)
        return records

    def uncached(self, record: Record) -> int:
        """Prompt tokens an admission would compute: those after the longest prefix the cache holds
        (at least the last: its hidden state gives the first token)."""
        prompt, bs = record.prompt, self.pool.block_size
        known = record.prompt_chain(bs) if self.pool.nodes else ()
        return len(prompt) - bs * len(self.pool.peek(prompt, (len(prompt) - 1) // bs, known))

    def waves(self, records: list[Record]) -> list[list[Record]]:
        """Requests in prefill rounds: one that shares an uncached prefix with an earlier one
        waits for it (a second round), then finds that prefix cached: computed once."""
        if self.pool.max_cached <= 0:
            return [records]
        bs = self.pool.block_size
        if not self.pool.nodes:  # nothing cached: rows share a prefix only if their first blocks are equal
            firsts = [tuple(r.prompt[:bs]) for r in records if len(r.prompt) > bs]
            if len(set(firsts)) == len(firsts):
                return [records]  # no digests needed yet
        first, second, seen = [], [], set()
        for r in records:
            prompt = r.prompt
            limit = (len(prompt) - 1) // bs
            known = r.prompt_chain(bs)
            keys = [k for k, _ in known[:limit]]
            cached = len(self.pool.peek(prompt, limit, known))
            if cached < len(keys) and keys[cached] in seen:
                second.append(r)
            else:
                first.append(r)
                seen.update(keys[cached:])
        return [w for w in (first, second) if w]

    def cached_prefix(self, record: Record) -> list[int]:
        """The blocks of the longest prefix of the request's prompt the cache holds (at least its
        last prompt token is left to compute: its hidden state gives the first token); sets
        `record.cached_tokens`."""
        prompt, bs = record.prompt, self.pool.block_size
        blocks = self.pool.match(prompt, (len(prompt) - 1) // bs, record.prompt_chain(bs) if self.pool.nodes else ())
        record.cached_tokens = len(blocks) * bs
        return blocks

    def place(self, rows: list[int], records: list[Record], blocks: list[list[int]]) -> None:
        """Requests take free rows, each holding its cached prefix's blocks."""
        for row, r, held in zip(rows, records, blocks):
            if row in self.vacated:  # refilled before its position went to -1
                self.vacated.remove(row)
            self.owner[row], self.pos[row] = r.id, len(r.prompt)
            self.need[row] = 0 if self.preempt else self.blocks_needed(r.request)
            self.admitted += 1
            self.since[row] = self.admitted
            self.pages.attach(row, held)

    def release(self, row: int, record: Record) -> None:
        """Free a row: the blocks of every position whose KV it computed go to the prefix cache
        (a ring row's generated blocks are gone already), then back to the pool."""
        if self.pages.ring is None:
            tokens = list(record.request.prompt) + record.row.text.tokens
            valid = min(self.pos[row], len(tokens))
            self.pool.register(tokens[:valid], self.pages.blocks(row, valid // self.pool.block_size),
                               known=record.keys or ())
        self.pages.release(row)
        self.owner[row], self.pos[row], self.need[row] = None, -1, 0
        self.vacated.append(row)

    def victims(self, live: list[int], keep: Sequence[int] = ()) -> list[int]:
        """Rows to take back, newest first, so that every other live row gets the block its next
        step enters (a fixed pool, `preempt`); the oldest row always stays, and so do the rows in
        `keep` (prompts riding along the step: their tokens are in its chunk already)."""
        bs, pos, held = self.pool.block_size, self.pos, self.pages.held
        entering = {r for r in live if pos[r] // bs not in held[r]}
        free, out = self.pool.available(), []
        for r in [r for r in sorted(live, key=lambda r: self.since[r], reverse=True)[:-1] if r not in keep]:
            if len(entering) <= free:
                break
            out.append(r)
            entering.discard(r)
            free += sum(1 for b in held[r].values() if self.pool.refs[b] == 1)  # blocks only it holds
        return out

    def requeue(self, record: Record) -> None:
        """A preempted request (its row released) waits at the head of the queue to resume."""
        record.preemptions += 1
        record.keys = None  # its prompt now ends with its tokens so far
        self.pending.appendleft(record.id)

    # ---- blocks for the next step ----

    def blocks_for_step(self, live: list[int]) -> None:
        """Blocks for each live row's next position (a ring drops the one it displaces). One
        growth for every row entering a new block (if the pool must grow at all: admission
        reserved the blocks), rather than a growth per row. Not one per live row: a pool that its
        rows fill exactly (2^k + 1 blocks) grew by half for the last steps of every row."""
        bs, pos, held = self.pool.block_size, self.pos, self.pages.held
        entering = [r for r in live if pos[r] // bs not in held[r]]  # the others hold their next slot
        if entering:
            self.pages.prepare(len(entering))
            for r in entering:
                self.pages.ensure(r, pos[r], pos[r] + 1)
        if self.pages.ring is not None:
            for r in live:
                self.pages.drop_behind(r, pos[r])

    def blocks_through(self, live: list[int], ends: list[int]) -> None:
        """Blocks for every position up to `ends[i]` of row `live[i]` (a verify round)."""
        for r, end in zip(live, ends):
            self.pages.ensure(r, self.pos[r], end)
            self.pages.drop_behind(r, self.pos[r])

    def compaction(self) -> tuple[np.ndarray, int] | None:
        """Whether the pool should be compacted now that long requests have left: -> (blocks to
        keep, the new pool size), or None. A pool at its least size stays (compacting it to that
        size again copied the KV every step)."""
        pool = self.pool
        # Upper bounds first: this runs every step, and compaction() walks the pool.
        held = 1 + pool.used + pool.cached
        if not (pool.size > 1 + self.pages.least and 4 * held <= pool.size):
            return None
        reserved = self.outstanding()
        if 4 * (held + reserved) > pool.size:
            return None
        keep = pool.compaction()
        size = pool_size(2 * (len(keep) + reserved), self.max_blocks, self.pages.least)
        if 4 * (len(keep) + reserved) <= pool.size and size < pool.size:
            self.pages.remap(pool.renumber(keep, size))
            return keep, size
        return None

    def forget_pool(self) -> None:
        """The device pool was dropped: only the scratch block is left."""
        self.pages.remap(self.pool.renumber(self.pool.compaction(), 1))
        self.resize_rows(self.width(0))
