"""The scheduler: a fixed number of rows decoding together, each refilled with the next request.

One engine serves static and continuous batches: a static batch is an engine with one row per
prompt that admits them all at once. All rows share one cache cursor. New requests are prefilled
(grouped by length, so padding costs little) into a fresh cache that ends at the current cursor
and placed into free rows, so the rows that keep decoding never wait for the slowest. Each row's
data stays contiguous and ends at the cursor; the buffer is a ring that grows (unrolled) before
any live row would lose a slot, and shrinks back when long requests leave, so a request sees
exactly what it would see alone.

Threads. One thread runs the engine: it calls `events`, `serve` or `step` (and `admit`,
`decode`, `collect`, `take`, and reads `requests`). Any thread may call `submit`, `add` and
`cancel`: they only put a message in a thread-safe inbox, which the engine thread drains at the
start of each step, so a cancelled request leaves its row within one step. `stats` may be read
from any thread (a snapshot that may be one step old).

Memory. Every request gets exactly one closing event (its finish reason: "stop", "length" or
"cancelled"); its record then waits in `requests` until `take` releases it. Statistics keep
counts and bounded windows. The cache is dropped when the engine is idle. A request whose cache
could never fit the memory budget is refused by `submit`; one that fits alone but not beside the
live rows waits for them.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from mlxfun import cache as kv
from mlxfun import prefill, sampling
from mlxfun.config import ModelConfig
from mlxfun.detok import RowText
from mlxfun.errors import InputError
from mlxfun.events import Event, Stats
from mlxfun.load import Model
from mlxfun.options import Request, check_positive_int, make_request
from mlxfun.rows import Row, host_values
from mlxfun.step import DecodeState, Mode, StepOut, Steps, compiled_steps, first_token
from mlxfun.strategy import WeightStrategy, default_strategy, memory_limit, params_for_batch, params_for_prompts

# Recent samples kept for latency percentiles.
WINDOW = 1024
# The cursor counts decode steps; a busy engine rebases it (an unroll) long before int32 overflows.
CURSOR_LIMIT = 1 << 30


@dataclass
class Record:
    """A submitted request and, as it runs, its output (`row`). Owned by the engine thread."""

    id: int
    request: Request
    mode: Mode  # what a decode step must compute for this request
    row: Row
    submitted: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV was reused rather than computed

    @property
    def finish_reason(self) -> str | None:
        return self.row.finish_reason

    @property
    def text(self) -> RowText:
        return self.row.text


@dataclass
class EngineStats(Stats):
    """Counts and bounded windows. `prompt_time` is the time of admissions made while no row was
    decoding (they cannot overlap anything); prefills that overlap decoding count as generation."""

    steps: int = 0
    busy_row_steps: int = 0  # sum over decode steps of the rows holding a live request
    rows: int = 0
    admissions: int = 0  # times new requests were prefilled (each one prefill per length group)
    requests: int = 0  # requests finished (any reason)
    queued: int = 0  # waiting for a row, at the last step
    running: int = 0  # holding a row, at the last step
    capacity: int = 0  # cache slots per row now (0 when idle)
    max_capacity: int = 0
    kv_bytes: int = 0  # bytes of the cache now
    ttft: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # recent times to first token, s
    itl: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # recent gaps between a row's tokens, s

    @property
    def occupancy(self) -> float:
        return self.busy_row_steps / (self.steps * self.rows) if self.steps else 0.0

    def summary(self) -> str:
        ttft = sorted(self.ttft)
        median = ttft[len(ttft) // 2] if ttft else 0.0
        return (f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s\n"
                f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tokens/s\n"
                f"Requests: {self.requests}, prompts {self.prompt_tokens} tokens, generated {self.generation_tokens} "
                f"tokens; rows busy {self.occupancy:.0%} of {self.steps} steps, {self.admissions} admissions; "
                f"median time to first token {median:.3f} s\n"
                f"Peak memory: {self.peak_memory_gb:.3f} GB")


def mode_for(requests: Sequence[Record]) -> Mode:
    """The least a step must compute for these requests (each Mode compiles once)."""
    return Mode(sample=any(r.mode.sample for r in requests), penalties=any(r.mode.penalties for r in requests),
                sort=any(r.mode.sort for r in requests), top_logprobs=max(r.mode.top_logprobs for r in requests))


def request_mode(request: Request) -> Mode:
    s = request.settings
    return Mode(sample=not sampling.all_greedy(s), penalties=sampling.needs_counts(s), sort=sampling.needs_sort(s),
                top_logprobs=request.logprobs)


class Engine:
    """`rows` requests decode at once; `submit` / `add` queue more, `events()` runs them all.

    Request ids are the integers `submit` returns; a finished request's record is in
    `requests[id]` until `take(id)` releases it."""

    def __init__(self, model: Model, rows: int = 8, *, prefill_step: int = 512, max_kv_size: int | None = None,
                 admit_min: int | None = None, pad_multiple: int | None = None,
                 strategy: WeightStrategy | None = None, kv_memory: int | None = None,
                 shrink_rows: bool | None = None, steps: Callable[[ModelConfig, Mode], Steps] = compiled_steps):
        check_positive_int("rows", rows)
        check_positive_int("prefill_step", prefill_step)
        check_positive_int("max_kv_size", max_kv_size, allow_none=True)
        check_positive_int("admit_min", admit_min, allow_none=True)
        check_positive_int("pad_multiple", pad_multiple, allow_none=True)
        check_positive_int("kv_memory", kv_memory, allow_none=True)
        # With max_kv_size every query sees at most that many positions, so the ring stops there.
        self.model, self.config, self.rows = model, model.config.with_max_kv_size(max_kv_size), rows
        self.prefill_step = prefill_step
        self.strategy = strategy or default_strategy()
        # Quantized weights may run as a dense copy for this many rows (mlxfun.strategy).
        self.params = params_for_batch(model.config, model.params, rows, self.strategy)
        self.dtype = self.params.norm.dtype
        self.steps = steps
        on_gpu = mx.default_device() == mx.gpu
        # On a GPU a prefill of a few prompts costs about what one of many does (kernel launches),
        # so new requests wait until a quarter of the rows are free (H200, 256 prompts through 64
        # rows of an 8B, two runs: 1.45 / 1.32x static batches; at an eighth 1.28 / 1.32x; at one
        # row 1.08 / 1.12x). On the CPU every token costs, so each free row is refilled at once.
        self.admit_min = admit_min or (max(1, rows // 4) if on_gpu else 1)
        # On the CPU a row costs a step's share of work whether it holds a request or not (SmolLM2:
        # 123 ms per step at batch 1, 805 at 8), so the decoded rows follow the live requests there;
        # on a GPU a step costs about the same for 1 row or 32, and every width would compile anew.
        self.shrink_rows = not on_gpu if shrink_rows is None else shrink_rows
        # Prompt lengths rounded up on a GPU, so attention kernels are built for few shapes.
        self.pad_multiple = pad_multiple or prefill.pad_multiple()
        # Bytes the cache may take: a share of the device's memory beside what is in use now (weights).
        self.kv_memory = kv_memory or max(0, int(self.strategy.memory_fraction * memory_limit())
                                          - mx.get_active_memory())
        self.slot_bytes = kv.slot_bytes(self.config, self.dtype)
        self.requests: dict[int, Record] = {}
        self.stats = EngineStats(rows=rows)
        # Engine-thread state.
        self.pending: deque[int] = deque()
        self.owner: list[int | None] = [None] * rows  # request id per row of the state (its width)
        self.start = [0] * rows  # stream index of each row's first prompt token (see _make_room)
        self.state: DecodeState | None = None
        self.cursor = 0  # host copy of the cache cursor
        self._settings: sampling.Settings | None = None  # per-row settings of the live rows
        self._inflight: list[tuple[StepOut, list]] = []  # outputs queued, not yet handed out
        # Any thread.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self._cancelling: set[int] = set()
        self._wake = threading.Event()  # set by submit and cancel, for `serve`

    # ---- any thread ----

    def submit(self, request: Request) -> int:
        """Queue a checked Request (`options.requests` / `make_request`); returns its id. Raises
        InputError, before any work, if its cache could never fit the memory budget."""
        if not isinstance(request, Request):
            raise InputError(f"submit takes an mlxfun Request, got {type(request).__name__}")
        need = self._kv_bytes(self._extent(len(request.prompt), request.max_tokens))
        if need > self.kv_memory:
            raise InputError(f"a prompt of {len(request.prompt)} tokens with max_tokens={request.max_tokens} needs "
                             f"{_size(need)} of KV cache in {self.rows} rows; {_size(self.kv_memory)} are available "
                             "(lower max_tokens, the rows, or max_kv_size)")
        with self._id_lock:
            rid = next(self._ids)
        record = Record(rid, request, request_mode(request),
                        Row(len(request.prompt), request.max_tokens, RowText(self.model.tokenizer, request.stop),
                            request.logprobs), submitted=time.perf_counter())
        self._inbox.put(("submit", record))
        self._wake.set()
        return rid

    def add(self, prompt, *, max_tokens: int = 256, stop: Sequence[str] = (), settings: sampling.Settings | None = None,
            logprobs: int | None = None, ignore_eos: bool = False) -> int:
        """Queue a prompt (text or token ids) with one row's sampling `settings`; returns its id."""
        return self.submit(make_request(self.model, prompt, max_tokens=max_tokens, settings=settings, stop=stop,
                                        logprobs=logprobs, ignore_eos=ignore_eos))

    def cancel(self, rid: int) -> None:
        """Stop a request: a queued one never starts, a running one leaves its row at the next step.
        Its closing event has finish reason "cancelled"; no event of it follows this call."""
        self._cancelling.add(rid)
        self._inbox.put(("cancel", rid))
        self._wake.set()

    # ---- the engine thread ----

    def events(self) -> Iterator[Event]:
        """Run until every submitted request has finished, yielding each Event as it is produced
        (index = request id)."""
        t0, prompt0 = time.perf_counter(), self.stats.prompt_time
        while True:
            for event in self.step():
                if event.finish_reason is None and event.index in self._cancelling:
                    continue  # cancelled after this step ran
                yield event
            if self.idle:
                break
        self.stats.generation_time += time.perf_counter() - t0 - (self.stats.prompt_time - prompt0)
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    def serve(self, stop: threading.Event, poll: float = 0.05) -> Iterator[Event]:
        """Run until `stop` is set and every request has finished, waiting for work when idle."""
        while not (stop.is_set() and self.idle):
            if self.idle:
                self._wake.wait(poll)
                self._wake.clear()
                continue
            yield from self.events()

    @property
    def idle(self) -> bool:
        return self._inbox.empty() and not self.pending and not self._live() and not self._inflight

    def step(self) -> list[Event]:
        """One round: take new messages, admit queued requests into free rows, queue a decode step
        for the live rows, then hand out the tokens of the round before (read one step behind, so
        the device never waits for the host)."""
        events = self.admit()
        queued = self.decode() if self._needs_decode() else None
        events += self.collect(keep=queued)
        self._fit_cache()
        return events

    def take(self, rid: int) -> Record:
        """Release a finished request and return its record."""
        record = self.requests[rid]
        if record.finish_reason is None:
            raise InputError(f"request {rid} has not finished")
        self._cancelling.discard(rid)
        return self.requests.pop(rid)

    # -- the round's parts (public for profiling: admit, then decode and collect per step) --

    def admit(self) -> list[Event]:
        """Drain the inbox (closing events for cancellations), then prefill queued requests into
        free rows, queued on the device (evaluated at once when no row is decoding: nothing to
        overlap). Their first tokens are handed out by the next `collect`."""
        events = self._drain()
        room = self.rows - self._live()
        if not room or not self.pending:
            return events
        # With requests still decoding, wait until admit_min rows are free (or the queue fits),
        # so that one prefill serves several requests.
        busy = self._live() > 0
        if busy and room < min(self.admit_min, len(self.pending)):
            return events
        records = self._admissible(room)
        if not records:
            return events
        t0 = time.perf_counter()
        self.stats.admissions += 1
        if self.state is None:
            outs = self._first(records)
        else:
            self._set_width(self._width(self._live() + len(records)))
            outs = self._place(records, self._free_rows())
        self._inflight += outs
        self._restack()
        self.stats.prompt_tokens += sum(len(r.request.prompt) for r in records)
        if not busy:
            mx.eval([o[0] for o in outs], self.state)
            self.stats.prompt_time += time.perf_counter() - t0
        return events

    def next_decode(self) -> tuple[Callable, tuple]:
        """The compiled decode step for the live rows and its arguments, not run (profiling)."""
        self._make_room()
        mode = mode_for([self.requests[o] for o in self.owner if o is not None])
        state = self.state if mode.penalties else self.state._replace(counts=None)
        return self.steps(self.config, mode).decode, (self.params, state, self._settings)

    def decode(self) -> StepOut:
        """Queue one decode step for every row (rows without a live request decode idly)."""
        fn, args = self.next_decode()
        out, state = fn(*args)
        # Steps without penalties neither read nor update the counts: keep them.
        self.state = state if state.counts is not None else state._replace(counts=self.state.counts)
        mx.async_eval(out, self.state)
        self.cursor += 1
        self.stats.steps += 1
        self.stats.busy_row_steps += self._live()
        self._inflight.append((out, list(self.owner)))
        return out

    def collect(self, keep: StepOut | None = None) -> list[Event]:
        """Hand out the tokens of every output in flight except `keep` (the step just queued)."""
        events = []
        ready = [item for item in self._inflight if item[0] is not keep]
        self._inflight = [item for item in self._inflight if item[0] is keep]
        for out, owners in ready:
            events += self._take(out, owners)
        self.stats.running, self.stats.queued = self._live(), len(self.pending) + self._inbox.qsize()
        return events

    # ---- internals ----

    def _drain(self) -> list[Event]:
        events = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return events
            if kind == "submit":
                self.requests[item.id] = item
                self.pending.append(item.id)
            else:
                record = self.requests.get(item)
                if record is None:  # unknown, or already taken
                    self._cancelling.discard(item)
                if record is None or record.finish_reason is not None:
                    continue
                record.row.finish_reason = "cancelled"
                if item in self.pending:
                    self.pending.remove(item)
                if item in self.owner:
                    self.owner[self.owner.index(item)] = None
                self.stats.requests += 1
                events.append(Event(item, -1, "", "cancelled"))

    def _live(self) -> int:
        return sum(o is not None for o in self.owner)

    def _free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is None]

    def _limit(self, record: Record) -> int:
        """Tokens the request may generate: max_tokens, within the model's context."""
        return min(record.request.max_tokens, self.config.max_position_embeddings - len(record.request.prompt))

    def _needs_decode(self) -> bool:
        """Whether some live row may still need a token after the one in flight (every live row
        has exactly one in flight here: its first token, or the last step's)."""
        return any(len(self.requests[o].row.text.tokens) + 1 < self._limit(self.requests[o])
                   for o in self.owner if o is not None)

    def _extent(self, prompt: int, max_tokens: int) -> int:
        """Cache slots a row of this request needs at most (ring: at most the window)."""
        limit = min(prompt + max_tokens, self.config.max_position_embeddings)
        return kv.capacity_for(-(-limit // self.pad_multiple) * self.pad_multiple + 1, self.config.max_window)

    def _kv_bytes(self, capacity: int) -> int:
        return self.rows * capacity * self.slot_bytes

    def _admissible(self, free: int) -> list[Record]:
        """Queued requests to admit now, in order: at most `free`, while the cache that the live
        rows and they may reach fits the memory budget."""
        live = [(self.start[r], self.requests[o]) for r, o in enumerate(self.owner) if o is not None]
        # Stream extents [start, end) the live rows may reach; admitted rows start at the cursor.
        lo = min([s for s, _ in live], default=None)
        hi = max([s + len(r.request.prompt) + self._limit(r) for s, r in live], default=0)
        out = []
        for rid in list(self.pending)[:free]:
            record = self.requests[rid]
            n = len(record.request.prompt)
            start = self.cursor if self.state is not None else 0
            lo_, hi_ = min(lo if lo is not None else start, start - n), max(hi, start + self._limit(record))
            if out or live:  # the first request alone was checked by submit
                if self._kv_bytes(kv.capacity_for(hi_ - lo_ + self.pad_multiple, self.config.max_window)) > \
                        self.kv_memory:
                    break
            lo, hi = lo_, hi_
            out.append(record)
        for record in out:
            self.pending.remove(record.id)
        return out

    def _first(self, records: list[Record]) -> list[tuple[StepOut, list]]:
        """Admission into an empty engine: every group prefills into a cache just as wide as the
        padded prompts (attending over empty slots made prefill 15% slower: SmolLM2, 128-token
        prompts in a 256-slot cache), and the groups are stacked as the rows. The first decode
        step grows the cache to a bucket."""
        prompts = [list(r.request.prompt) for r in records]
        end = prefill.padded_length(prompts, self.pad_multiple)
        width = end if self.config.max_window is None else min(end, self.config.max_window)
        params = params_for_prompts(self.config, self.params, [len(p) for p in prompts], self.prefill_step,
                                    self.strategy)
        groups = prefill.plan_groups([len(p) for p in prompts])
        order = [records[i] for g in groups for i in g]  # rows, in the order the groups stack
        caches, outs = [], []
        for group in groups:
            h, cache = prefill.prefill_group(self.config, self._prefill_steps(), params, [prompts[i] for i in group],
                                             end, width, self.prefill_step, self.dtype, self.pad_multiple)
            caches.append(cache)
            outs.append((self._first_token(params, h, [records[i] for i in group]), [records[i].id for i in group]))
        n_rows = self._width(len(order))
        idle = n_rows - len(order)
        self.owner, self.start = [None] * n_rows, [0] * n_rows
        if idle:
            caches.append(kv.empty(self.config, idle, width, self.dtype)._replace(cursor=mx.array(end, mx.int32)))
        self.cursor = end
        for row, r in enumerate(order):
            self.owner[row], self.start[row] = r.id, end - len(r.request.prompt)
        first = mx.concatenate([o.tokens for o, _ in outs] + [mx.zeros((idle,), mx.int32)])
        counts = sampling.update_counts(mx.zeros((n_rows, self.config.vocab_size), mx.int32), first)
        self.state = DecodeState(prefill.concat_rows(caches), first,
                                 positions=mx.array([len(r.request.prompt) for r in order] + [0] * idle, mx.int32),
                                 steps=mx.array([1] * len(order) + [0] * idle, mx.int32), counts=counts)
        return outs

    def _place(self, records: list[Record], free: list[int]) -> list[tuple[StepOut, list]]:
        """Admission beside live rows: each length group prefills into a fresh cache ending at the
        current cursor, whose rows replace the free rows (`kv.place_rows`)."""
        longest = max(len(r.request.prompt) for r in records)
        self._make_room(extra=longest + 1)
        cap = kv.capacity(self.state.cache)
        params = params_for_prompts(self.config, self.params, [len(r.request.prompt) for r in records],
                                    self.prefill_step, self.strategy)
        outs = []
        for group in prefill.plan_groups([len(r.request.prompt) for r in records]):
            rows = [free.pop(0) for _ in group]
            group_records = [records[i] for i in group]
            prompts = [list(r.request.prompt) for r in group_records]
            # A fresh cache just wide enough for the (padded) prompts, placed into the rows after.
            padded = prefill.padded_length(prompts, self.pad_multiple)
            h, cache = prefill.prefill_group(self.config, self._prefill_steps(), params, prompts, padded,
                                             min(padded, cap), self.prefill_step, self.dtype, self.pad_multiple)
            out = self._first_token(params, h, group_records)
            for row, r in zip(rows, group_records):
                self.owner[row], self.start[row] = r.id, self.cursor - len(r.request.prompt)
            self._merge(rows, cache, padded, out.tokens, [len(p) for p in prompts])
            outs.append((out, [r.id for r in group_records]))
        return outs

    def _prefill_steps(self) -> Steps:
        return self.steps(self.config, Mode())

    def _first_token(self, params, h: mx.array, records: list[Record]) -> StepOut:
        """Not compiled: group sizes vary, and each new shape would trace and build kernels again."""
        mode = mode_for(records)._replace(penalties=False)  # nothing generated yet: counts are zero
        settings = _stack([r.request.settings for r in records])
        return first_token(self.config, mode, params, h, settings, mx.zeros((len(records),), mx.int32), None)

    def _merge(self, rows: list[int], cache: kv.KVCache, fresh_cursor: int, first: mx.array,
               lengths: list[int]) -> None:
        s = self.state
        r = mx.array(rows, dtype=mx.int32)
        fresh = sampling.update_counts(mx.zeros((len(rows), s.counts.shape[1]), mx.int32), first)
        self.state = DecodeState(
            kv.place_rows(s.cache, self.cursor, rows, cache, fresh_cursor),
            tokens=kv.updated(s.tokens, r, first),
            positions=kv.updated(s.positions, r, mx.array(lengths, mx.int32)),
            steps=kv.updated(s.steps, r, mx.ones((len(rows),), mx.int32)),
            counts=kv.updated(s.counts, r, fresh),
        )

    def _need(self) -> int:
        """Slots the live rows hold, the next write included: row r holds stream indices
        [start[r], cursor) and the next write is at `cursor`."""
        return max([self.cursor + 1 - self.start[r] for r, o in enumerate(self.owner) if o is not None], default=1)

    def _resize(self, capacity: int) -> None:
        """Unroll the ring into `capacity` slots (kv.resize), moving the host's stream indices along."""
        cache = kv.resize(self.state.cache, capacity, self.cursor)
        cursor = min(kv.capacity(self.state.cache), capacity)
        self.start = [s - self.cursor + cursor for s in self.start]
        self.cursor = cursor
        self.state = self.state._replace(cache=cache)

    def _make_room(self, extra: int = 1) -> None:
        """Grow the ring before any live row would overwrite a slot it still sees."""
        need = kv.capacity_for(max(extra, self._need()), self.config.max_window)
        if need > kv.capacity(self.state.cache):
            self._resize(need)

    def _fit_cache(self) -> None:
        """Drop the cache when idle; shrink it to half or less once long requests have left."""
        if self.state is not None and self.idle:
            self.state, self.cursor, self._settings = None, 0, None
        elif self.state is not None and self._live():
            need = kv.capacity_for(self._need(), self.config.max_window)
            if 2 * need <= kv.capacity(self.state.cache) or self.cursor >= CURSOR_LIMIT:
                self._resize(need)  # unrolling also brings the (int32) cursor back to the capacity
            if self._width(self._live()) < len(self.owner):
                self._set_width(self._width(self._live()))
        cap = 0 if self.state is None else kv.capacity(self.state.cache)
        self.stats.capacity, self.stats.max_capacity = cap, max(self.stats.max_capacity, cap)
        self.stats.kv_bytes = len(self.owner) * cap * self.slot_bytes if cap else 0  # the rows held now

    def _width(self, live: int) -> int:
        """Rows the state holds for `live` requests: every row, or only the live ones (shrink_rows)."""
        return max(1, min(live, self.rows)) if self.shrink_rows else self.rows

    def _set_width(self, width: int) -> None:
        """Hold `width` rows: the live ones (in order), then empty ones. Steps already queued keep
        their own row -> request map (`_inflight`), so their tokens still reach the right requests."""
        if width == len(self.owner):
            return
        keep = [r for r, o in enumerate(self.owner) if o is not None]
        s, c = self.state, self.state.cache
        cache = kv.KVCache(tuple(_rows(k, keep, width, 0) for k in c.keys),
                           tuple(_rows(v, keep, width, 0) for v in c.values), _rows(c.positions, keep, width, -1),
                           c.cursor)
        self.state = DecodeState(cache, _rows(s.tokens, keep, width, 0), _rows(s.positions, keep, width, 0),
                                 _rows(s.steps, keep, width, 0),
                                 None if s.counts is None else _rows(s.counts, keep, width, 0))
        empty = width - len(keep)
        self.owner = [self.owner[r] for r in keep] + [None] * empty
        self.start = [self.start[r] for r in keep] + [0] * empty
        self._restack()

    def _restack(self) -> None:
        """The per-row sampling settings of the rows as they are now."""
        self._settings = _stack([self.requests[o].request.settings if o is not None else _IDLE for o in self.owner])

    def _take(self, out: StepOut, owners: list) -> list[Event]:
        """Hand out one step's tokens: `owners[i]` is the request that row i held when it ran."""
        tokens, logprob, top = host_values(out)
        now = time.perf_counter()
        events = []
        for i, rid in enumerate(owners):
            record = self.requests.get(rid) if rid is not None else None
            if record is None or record.finish_reason is not None:
                continue
            if record.first_token_time is None:
                record.first_token_time = now
                self.stats.ttft.append(now - record.submitted)
            else:
                self.stats.itl.append(now - record.last_token_time)
            record.last_token_time = now
            before = len(record.row.text.tokens)
            event = record.row.accept(rid, tokens[i], record.request.eos, self.config.max_position_embeddings,
                                      None if logprob is None else logprob[i], None if top is None else top[i])
            self.stats.generation_tokens += len(record.row.text.tokens) - before  # a closing EOS is not output
            if event.finish_reason is not None:
                self.stats.requests += 1
                if rid in self.owner:
                    self.owner[self.owner.index(rid)] = None
            events.append(event)
        return events


# Settings for a row that holds no request (its tokens are discarded).
_IDLE = sampling.make_settings(1, seed=0)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _rows(a: mx.array, keep: list[int], width: int, fill) -> mx.array:
    """a (B, ...) -> (width, ...): rows `keep` of a, then rows of `fill`."""
    kept = a[mx.array(keep, mx.int32)] if keep else a[:0]
    pad = mx.full((width - len(keep), *a.shape[1:]), fill, a.dtype)
    return mx.concatenate([kept, pad]) if width > len(keep) else kept


def _stack(settings: list[sampling.Settings]) -> sampling.Settings:
    return sampling.Settings(*(mx.concatenate(fields) for fields in zip(*settings)))
