"""The scheduler: a fixed number of rows decoding together, each refilled with the next request.

One engine serves static and continuous batches: a static batch is an engine with one row per
prompt that admits them all at once. Each row holds blocks of a shared KV pool (`cache`,
`paging`): new requests are prefilled (grouped by length, so padding costs little) into blocks of
their own, starting after the longest prefix already cached (`blocks`: full blocks keyed by their
tokens, refcounted, evicted least recently used first), while the rows that keep decoding never
wait for the slowest. Each row advances at its own position, so a request sees exactly what it
would see alone, and KV memory follows the tokens the live rows hold.

Threads. One thread runs the engine: it calls `events`, `serve` or `step` (and `admit`,
`decode`, `collect`, `take`, and reads `requests`). Any thread may call `submit`, `add` and
`cancel`: they only put a message in a thread-safe inbox, which the engine thread drains at the
start of each step, so a cancelled request leaves its row within one step. `stats` may be read
from any thread (a snapshot that may be one step old). With structured output, the engine's mask
worker reads each step's tokens (through MLX arrays of its own, `step.reading`: no MLX array is
touched by two threads) and advances the constrained rows' matchers while the engine thread
queues the next forward pass; the engine thread waits for it before touching the records.

Memory. Every request gets exactly one closing event (its finish reason: "stop", "length" or
"cancelled"); its record then waits in `requests` until `take` releases it. Statistics keep
counts and bounded windows. The pool grows as rows need blocks and is compacted when long
requests have left; the prefix cache keeps at most `prefix_cache_bytes` of blocks no row uses.
Each admitted request reserves the blocks it may come to need, so a request whose KV could never
fit the memory budget is refused by `submit`, and one that fits alone but not beside the live
rows waits for them.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from mlxfun import cache as kv
from mlxfun import prefill, sampling, speculative, structured, weights
from mlxfun.blocks import Pool, chain
from mlxfun.config import ModelConfig
from mlxfun.detok import RowText
from mlxfun.errors import InputError
from mlxfun.events import Event, Stats
from mlxfun.load import Model
from mlxfun.mapped import HostArray
from mlxfun.options import GenerationConfig, Request, check_bool, check_positive_int, make_request
from mlxfun.paging import MIN_BLOCKS, MIN_BLOCKS_CPU, Pages, pool_size
from mlxfun.rows import Row, host_values
from mlxfun.speculative import Verdict
from mlxfun.step import DecodeState, Mode, StepOut, Steps, compiled_steps, first_token, reading
from mlxfun.strategy import WeightStrategy, default_strategy, memory_limit, params_for_batch, params_for_prompts

# Recent samples kept for latency percentiles.
WINDOW = 1024


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
    matcher: structured.Matcher | None = None  # the row's place in its constraint (structured output)
    error: str | None = None  # why a constrained row had to end early (an error of the grammar engine)
    complete: bool = False  # nothing but EOS may follow in its constraint (as of the last token matched)
    keys: list | None = None  # its prompt's block keys (`blocks.chain`), once a prefix cache needs them

    def prompt_chain(self, block_size: int) -> list:
        """The prompt's `blocks.chain`, computed once (admission looks it up several times)."""
        if self.keys is None:
            self.keys = chain(self.request.prompt, block_size)
        return self.keys

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
    capacity: int = 0  # slots a row's table spans now
    max_capacity: int = 0
    kv_bytes: int = 0  # bytes of the KV pool now (0 when dropped)
    kv_used_bytes: int = 0  # bytes of the blocks live rows hold
    peak_kv_bytes: int = 0
    peak_kv_used_bytes: int = 0
    verify_rounds: int = 0  # speculative rounds (counted in `steps` too)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens kept
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    cached_blocks: int = 0  # blocks the prefix cache holds (used by rows or not)
    prefix_hits: int = 0  # prompt blocks found in the prefix cache
    ttft: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # recent times to first token, s
    itl: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # recent gaps between a row's tokens, s
    timed_prompt_tokens: int = 0  # the prompt tokens of the admissions `prompt_time` counts

    @property
    def occupancy(self) -> float:
        return self.busy_row_steps / (self.steps * self.rows) if self.steps else 0.0

    def summary(self) -> str:
        ttft = sorted(self.ttft)
        median = ttft[len(ttft) // 2] if ttft else 0.0
        return (f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s\n"
                f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tokens/s\n"
                f"Requests: {self.requests}, prompts {self.prompt_tokens} tokens ({self.cached_tokens} reused), "
                f"generated {self.generation_tokens} tokens; rows busy {self.occupancy:.0%} of {self.steps} steps, "
                f"{self.admissions} admissions; "
                f"median time to first token {median:.3f} s\n"
                f"Peak memory: {self.peak_memory_gb:.3f} GB")


class Roster(NamedTuple):
    """The rows' owners and what follows from them, made again only when the owners change (a 1B
    decode step is host-bound on an H200: the loop's own Python adds to every step)."""

    owners: tuple  # request id per row, None for an empty row
    live: list[int]  # rows holding a request
    mode: Mode  # `mode_for` their requests
    steps: Steps  # the compiled steps for that mode


def mode_for(requests: Sequence[Record]) -> Mode:
    """The least a step must compute for these requests (each Mode compiles once)."""
    return Mode(sample=any(r.mode.sample for r in requests), penalties=any(r.mode.penalties for r in requests),
                sort=any(r.mode.sort for r in requests), top_logprobs=max(r.mode.top_logprobs for r in requests),
                masked=any(r.mode.masked for r in requests))


def request_mode(request: Request) -> Mode:
    s = request.settings
    return Mode(sample=not sampling.all_greedy(s), penalties=sampling.needs_counts(s), sort=sampling.needs_sort(s),
                top_logprobs=request.logprobs, masked=request.constraint is not None)


class Engine:
    """`rows` requests decode at once; `submit` / `add` queue more, `events()` runs them all.

    Request ids are the integers `submit` returns; a finished request's record is in
    `requests[id]` until `take(id)` releases it."""

    def __init__(self, model: Model, rows: int = 8, *, prefill_step: int = 512, max_kv_size: int | None = None,
                 admit_min: int | None = None, pad_multiple: int | None = None,
                 strategy: WeightStrategy | None = None, kv_memory: int | None = None, prefix_cache: bool = True,
                 prefix_cache_bytes: int | None = None, block_size: int = kv.BLOCK, draft=None,
                 num_draft_tokens: int = 4, policy: speculative.Policy | None = None,
                 shrink_rows: bool | None = None, steps: Callable[[ModelConfig, Mode], Steps] = compiled_steps):
        for name, value in (("rows", rows), ("prefill_step", prefill_step), ("block_size", block_size)):
            check_positive_int(name, value)
        for name, value in (("max_kv_size", max_kv_size), ("admit_min", admit_min), ("pad_multiple", pad_multiple),
                            ("kv_memory", kv_memory)):
            check_positive_int(name, value, allow_none=True)
        check_bool("prefix_cache", prefix_cache)
        check_positive_int("num_draft_tokens", num_draft_tokens)
        if num_draft_tokens >= block_size:
            raise InputError(f"num_draft_tokens must be below the block size {block_size}, got {num_draft_tokens}")
        if prefix_cache_bytes is not None and (isinstance(prefix_cache_bytes, bool) or
                                               not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0):
            raise InputError(f"prefix_cache_bytes must be a non-negative integer, got {prefix_cache_bytes!r}")
        # With max_kv_size every query sees at most that many positions: rows become rings.
        self.model, self.config, self.rows = model, model.config.with_max_kv_size(max_kv_size), rows
        self.prefill_step = prefill_step
        self.strategy = strategy or default_strategy()
        # Quantized weights may run as a dense copy for this many rows (mlxfun.strategy).
        self.params = params_for_batch(model.config, model.params, rows, self.strategy)
        mx.eval(self.params)  # here, on the constructing thread: the engine thread may be another
        self.dtype = self.params.norm.dtype
        # What the steps read: the same weights, dense ones also as transposed views (no copy), so a
        # product is one graph node (a 1B decode step is host-bound on an H200: 65 nodes fewer).
        self.step_params = weights.with_transposed(self.config, self.params)
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
        # Chunk lengths rounded up on a GPU, so attention kernels are built for few shapes.
        self.pad_multiple = pad_multiple or prefill.pad_multiple()
        # Bytes the cache may take: a share of the device's memory beside what is in use now (weights).
        self.kv_memory = kv_memory or max(0, int(self.strategy.memory_fraction * memory_limit())
                                          - mx.get_active_memory())
        self.slot_bytes = kv.slot_bytes(self.config, self.dtype)
        self.block_bytes = block_size * self.slot_bytes
        self.max_blocks = max(2, self.kv_memory // self.block_bytes)
        cached = (self.kv_memory // 8 if prefix_cache_bytes is None else prefix_cache_bytes) // self.block_bytes
        self.pool = Pool(1, block_size, cached if prefix_cache else 0)
        self.pages = Pages(rows, self.pool, self.config.max_window, self.max_blocks,
                           MIN_BLOCKS if on_gpu else MIN_BLOCKS_CPU)
        self.requests: dict[int, Record] = {}
        self.stats = EngineStats(rows=rows)
        # Engine-thread state.
        self.pending: deque[int] = deque()
        # Per row of the state (as many as `_width` gives for the live requests):
        self.owner: list[int | None] = [None] * self._width(0)  # request id
        self.pos = [-1] * len(self.owner)  # the position its next decode step feeds (-1: no request)
        self.need = [0] * len(self.owner)  # blocks reserved for its request
        self.state: DecodeState | None = None
        self._settings: sampling.Settings | None = None  # per-row settings of the live rows
        self._inflight: list[tuple[StepOut, Sequence]] = []  # outputs queued, not yet handed out
        self._vacated: list[int] = []  # rows released since the last step: their positions go to -1
        self._roster_of: Roster | None = None  # `_roster`
        self._masks: HostArray | None = None  # (rows, V/32) uint32: the constrained rows' allowed tokens
        self._masker: ThreadPoolExecutor | None = None  # computes them while the engine thread queues the forward pass
        # Speculative decoding: a drafter (`speculative.PromptLookup`, `drafting.DraftModel`) and
        # the measured rule that turns it on and off.
        self.drafter, self.num_draft_tokens = drafter_for(draft, self), num_draft_tokens
        self.policy = policy or speculative.Policy(enabled=speculative.may_pay(rows, num_draft_tokens))
        self._last_decode: float | None = None
        self._streak = 0  # decode steps since the last verify round
        self._pipelined = False  # verify rounds are queued one ahead (`verify_ahead`)
        self._last_round: float | None = None  # when the last pipelined round was handed out
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
        self.check(request)
        with self._id_lock:
            rid = next(self._ids)
        record = Record(rid, request, request_mode(request),
                        Row(len(request.prompt), request.max_tokens, RowText(self.model.tokenizer, request.stop),
                            request.logprobs), submitted=time.perf_counter(),
                        matcher=None if request.constraint is None else request.constraint.matcher(request.eos))
        self._inbox.put(("submit", record))
        self._wake.set()
        return rid

    def check(self, request: Request) -> None:
        """Raise InputError, as `submit` does, unless this engine can take `request`."""
        if not isinstance(request, Request):
            raise InputError(f"submit takes an mlxfun Request, got {type(request).__name__}")
        need = self._blocks_needed(request)
        if need > self.max_blocks:
            raise InputError(f"a prompt of {len(request.prompt)} tokens with max_tokens={request.max_tokens} needs "
                             f"{_size(need * self.block_bytes)} of KV cache; {_size(self.kv_memory)} are available "
                             "(lower max_tokens, or bound the cache with max_kv_size)")

    def add(self, prompt, *, max_tokens: int = 256, stop: Sequence[str] = (), settings: sampling.Settings | None = None,
            logprobs: int | None = None, ignore_eos: bool = False, response_format: dict | None = None) -> int:
        """Queue a prompt (text or token ids) with one row's sampling `settings`; returns its id."""
        return self.submit(make_request(self.model, prompt, max_tokens=max_tokens, settings=settings, stop=stop,
                                        logprobs=logprobs, ignore_eos=ignore_eos, response_format=response_format))

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
        the device never waits for the host). With a drafter, and when the policy says it pays,
        a round is a verify round instead, several tokens per row: queued one round ahead too
        (`verify_ahead`) with a device drafter, else synchronous (`verify`)."""
        if self.drafter is not None and self._speculate():
            t0 = time.perf_counter()
            events = self.admit()
            if self.drafter.device and self.pages.ring is None:
                if not self._pipelined:  # a run of pipelined rounds starts: the drafter catches up
                    events += self.collect()
                    self.drafter.catch_up(self, [r for r, o in enumerate(self.owner) if o is not None])
                    self._pipelined, self._last_round = True, None
                queued = self.verify_ahead() if self._needs_decode() else None
                events += self.collect(keep=queued)
            else:
                events += self.collect()
                if self._live():
                    events += self.verify(t0)
            self._last_decode, self._streak = None, 0
        else:
            events = self.collect() if self._pipelined else []  # `pos` exact again before decoding
            self._pipelined = False
            events += self.admit()
            needs = self._needs_decode()
            if needs and self._roster().mode.masked:
                events += self.masked_decode()
            else:
                queued = self.decode() if needs else None
                events += self.collect(keep=queued)
            if self.drafter is not None and self.policy.enabled:
                self.policy.shadow(self.drafter.shadow(self, self.num_draft_tokens))
        self._fit_cache()
        return events

    def add_prompt_cache(self, cache) -> None:
        """Make a `prompt_cache.PromptCache`'s full blocks part of the prefix cache, pinned for the
        engine's life, so every prompt that starts with its tokens skips them."""
        from mlxfun.prompt_cache import PromptCache, identity, load_prompt_cache

        if isinstance(cache, (str, Path)):
            cache = load_prompt_cache(cache, self.model)
        if not isinstance(cache, PromptCache):
            raise InputError(f"prompt_cache must be an mlxfun PromptCache (mlxfun.cache_prompt), got "
                             f"{type(cache).__name__}")
        if cache.identity != identity(self.model):
            raise InputError("this prompt cache was made for another model or dtype")
        bs = self.pool.block_size
        m = len(cache.tokens) // bs
        if m == 0:
            return
        self.pages.prepare(m)
        blocks = [self.pool.allocate() for _ in range(m)]  # their one reference: the pin
        if self.state is None:
            self.state = self._empty_state()
        c = prefill.ensure_pool(self.state.cache, self.pool.size)
        index = mx.array(blocks, mx.int32)
        slots = kv.block_slots(index, bs)

        def put(pool: mx.array, new: mx.array) -> mx.array:  # new (T, K, D)
            return kv.updated(pool, slots, new[:m * bs, :, None])

        self.state = self.state._replace(cache=c._replace(
            keys=tuple(put(p, k) for p, k in zip(c.keys, cache.keys)),
            values=tuple(put(p, v) for p, v in zip(c.values, cache.values)),
            positions=kv.updated(c.positions, index, mx.arange(m * bs, dtype=mx.int32).reshape(m, bs))))
        self.pool.register(cache.tokens, blocks, always=True)

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
        events = self._drain() if not self._inbox.empty() else []  # (a message put after this waits a step)
        if not self.pending:
            return events
        room = self.rows - self._live()
        if not room:
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
        width = self._width(self._live() + len(records))
        if self.state is None:
            self._resize_rows(width)
        else:
            self._set_width(width)
        free = self._free_rows()
        # The pool grows once for what the rows may hold (each new size retraces the step).
        self.pages.reserve(self._outstanding() + sum(self._blocks_needed(r.request) for r in records))
        if self.state is None:
            # A first state's device pool holds the prompts' blocks; the first decode step grows it
            # to the reservation (`_sync`: one copy of the prompts' KV), after the prompts'
            # activations are freed, so the peak holds one or the other. Made at the reservation,
            # the 1B's 128 x 128-token batch peaked its generated tokens' KV (0.54 GB) above round 1.
            bs = self.pool.block_size
            prompts = sum(-(-len(r.request.prompt) // bs) for r in records)
            self.state = self._empty_state(min(pool_size(1 + prompts, self.max_blocks, self.pages.least),
                                               self.pool.size))
        # Long prompts may run a dense copy of quantized weights, dropped after admission (mlxfun.strategy).
        params = params_for_prompts(self.config, self.step_params, [len(r.request.prompt) for r in records],
                                    self.prefill_step, self.strategy)
        outs = []
        for wave in self._waves(records):
            if outs and not busy:
                mx.eval([o[0] for o in outs], self.state)
            outs += self._prefill(params, wave, free, wait=not busy)
        self._inflight += outs
        self._restack()
        self.stats.prompt_tokens += sum(len(r.request.prompt) for r in records)
        if not busy:
            mx.eval([o[0] for o in outs], self.state)
            self.stats.prompt_time += time.perf_counter() - t0
            self.stats.timed_prompt_tokens += sum(len(r.request.prompt) - r.cached_tokens for r in records)
        return events

    def _prepare_step(self) -> tuple[Roster, DecodeState]:
        """Blocks for each live row's next position (a ring drops the one it displaces), the
        device state caught up; -> the rows' roster and the step's input state (no counts
        without penalties)."""
        roster = self._roster()
        live = roster.live
        # One growth for every row entering a new block (if the pool must grow at all: admission
        # reserved the blocks), rather than a growth per row. Not one per live row: a pool that
        # its rows fill exactly (2^k + 1 blocks) grew by half for the last steps of every row.
        bs, pos, held = self.pool.block_size, self.pos, self.pages.held
        entering = [r for r in live if pos[r] // bs not in held[r]]  # the others hold their next slot
        if entering:
            self.pages.prepare(len(entering))
            for r in entering:
                self.pages.ensure(r, pos[r], pos[r] + 1)
        if self.pages.ring is not None:
            for r in live:
                self.pages.drop_behind(r, pos[r])
        self._sync()
        return roster, self.state if roster.mode.penalties else self.state._replace(counts=None)

    def _roster(self) -> Roster:
        owners = tuple(self.owner)
        if self._roster_of is None or self._roster_of.owners != owners:
            live = [r for r, o in enumerate(owners) if o is not None]
            mode = mode_for([self.requests[owners[r]] for r in live])
            self._roster_of = Roster(owners, live, mode, self.steps(self.config, mode))
        return self._roster_of

    def _advanced(self, state: DecodeState, live: list[int]) -> None:
        """The state after a step queued for the `live` rows (counts kept where the step had none)."""
        self.state = state if state.counts is not None else state._replace(counts=self.state.counts)
        pos = self.pos
        for r in live:
            pos[r] += 1

    def next_decode(self) -> tuple[Callable, tuple]:
        """The compiled decode step for the live rows and its arguments, not run (profiling)."""
        roster, state = self._prepare_step()
        return roster.steps.decode, (self.step_params, state, self._settings)

    def decode(self) -> StepOut:
        """Queue one decode step for every row (rows without a live request decode idly)."""
        fn, args = self.next_decode()
        out, state = fn(*args)
        del args  # with no reference left to the old state, the step writes the KV pool in place
        roster = self._roster_of  # as `next_decode` left it
        live = roster.live
        self._advanced(state, live)
        mx.async_eval(out, self.state)
        now = time.perf_counter()
        if self.drafter is not None and self._last_decode is not None:
            self._streak += 1
            if self._streak >= 2:  # steady: the step before this one has been waited for
                self.policy.record(False, 1.0, now - self._last_decode)
        self._last_decode = now
        self.stats.steps += 1
        self.stats.busy_row_steps += len(live)
        self._inflight.append((out, roster.owners))
        return out

    def masked_decode(self) -> list[Event]:
        """A decode step when some live row is constrained (structured output). The mask worker
        reads the tokens in flight, advances the constrained rows' matchers by them and computes
        the next masks (llguidance, without the GIL), while this thread queues the forward pass
        (it needs only the tokens already on the device): the host's two longest parts overlap.
        Then the sampling half is queued with the masks, and the tokens read are handed out while
        the device runs it."""
        roster, state = self._prepare_step()
        mode, steps = roster.mode, roster.steps
        ready, self._inflight = self._inflight, []
        # The worker reads handles of its own (`reading`): an MLX array is not safe to touch from two
        # threads, and this thread's next evaluation takes the tokens as input (it drops their
        # signalled event, which the worker's read also does). With the same handles, 5 of 8 runs
        # of 40 constrained batches crashed or hung on this 2-core CPU.
        reads = [reading(step_out) for step_out, _ in ready]
        mx.async_eval(reads)  # scheduled here: the worker thread has no stream
        owners = list(self.owner)
        job = self._mask_pool().submit(self._read_and_mask, reads, [o for _, o in ready], owners, self._mask_buffer())
        # The forward pass is queued at once. MLX holds the GIL while it encodes the graph, so the
        # worker reads and matches the tokens after that; letting it go first (up to 1 ms) left
        # the device idle meanwhile: 1.16-1.22x a free step against 1.07-1.12x (1B and 8B, batch 32,
        # H200; benchmarks/README.md, twelfth session).
        logits, state = steps.forward(self.step_params, state)
        self._advanced(state, roster.live)  # the old state unreferenced: the pool is written in place
        mx.async_eval(logits, self.state)
        values = job.result()  # the masks are in `_masks`
        out, state = steps.sample(logits, self._masks.device(), self.state if mode.penalties else
                                  self.state._replace(counts=None), self._settings)
        self.state = state if state.counts is not None else state._replace(counts=self.state.counts)
        mx.async_eval(out, self.state)
        self.stats.steps += 1
        self.stats.busy_row_steps += sum(o is not None for o in owners)
        self._inflight.append((out, owners))
        events = []
        for (step_out, step_owners), v in zip(ready, values):
            events += self._take(step_out, step_owners, v, matched=True)
        self._count_rows()
        return events

    def _read_and_mask(self, reads: list[StepOut], step_owners: list, owners: list, out: np.ndarray) -> list:
        """On the mask worker (`masked_decode`): the steps in flight read (`reads`, waiting for the
        device without the GIL), the constrained rows' matchers advanced by their tokens, and out
        (B, W) <- the masks of the rows `owners` hold for the next token. -> each step's host values."""
        values = [host_values(r) for r in reads]
        for who, (tokens, _, _) in zip(step_owners, values):
            self._match(who, tokens)
        structured.fill_masks([self._mask_matcher(o) for o in owners], out)
        return values

    def _match(self, owners: list, tokens: list[int]) -> None:
        """Constrained rows' matchers take their new tokens (before the tokens are handed out, so
        the next masks can be computed meanwhile)."""
        for rid, token in zip(owners, tokens):
            record = self.requests.get(rid) if rid is not None else None
            if record is not None:
                self._match_one(record, token)

    @staticmethod
    def _match_one(record: Record, token: int) -> None:
        """A live constrained row's matcher takes its token; an EOS is never taken (the row ends on it)."""
        if record.matcher is None or record.finish_reason is not None or record.error or token in record.request.eos:
            return
        try:
            record.matcher.advance(token)
            record.complete = record.matcher.is_finished
        except RuntimeError as e:  # the grammar engine failed (a resource limit): the row ends, saying why
            record.error = str(e)

    def _mask_matcher(self, rid: int | None) -> structured.Matcher | None:
        """The matcher whose mask a row's next token needs; None (no mask) for a free row and a row
        that ends now (its matcher failed, or nothing but EOS may follow)."""
        record = self.requests.get(rid) if rid is not None else None
        if record is None or record.matcher is None or record.finish_reason is not None or record.error:
            return None
        return None if record.complete else record.matcher

    def _mask_pool(self) -> ThreadPoolExecutor:
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="mlxfun-masks")
        return self._masker

    def _mask_buffer(self, mapped: bool = True) -> np.ndarray:
        """The host side of the masks' array (`mapped.HostArray`: on a GPU the device reads it in
        place); the worker fills it after reading the tokens of the step that read it last."""
        if self._masks is None or self._masks.host.shape[0] != len(self.owner):
            self._masks = HostArray((len(self.owner), structured.words(self.config.vocab_size)), np.uint32,
                                    0xFFFFFFFF, mapped)
        return self._masks.host

    def verify(self, t0: float | None = None) -> list[Event]:
        """One verify round for the live rows (nothing in flight): each drafts up to
        `num_draft_tokens`, one forward pass checks them all, and each row takes the tokens it
        accepted and one more. Where no row has a draft, a decode step instead (not timed as a
        verify round: the policy measures rounds that verify something)."""
        live = [r for r, o in enumerate(self.owner) if o is not None]
        k = self.num_draft_tokens
        drafts, valid, q = self.drafter.propose(self, live, k)  # (B, k), (B, k), (B, k, V) or None
        proposed = np.array(valid).sum(axis=1).tolist()
        if not any(proposed):  # nothing to verify (prompt lookup found no n-gram): a decode step costs less
            self.decode()
            return self.collect()
        for r in live:  # blocks for every position the round may write
            self.pages.ensure(r, self.pos[r], self.pos[r] + k + 1)
            self.pages.drop_behind(r, self.pos[r])
        self._sync()
        out = self._queue_verify(live, drafts, valid, q)
        mx.eval(out, self.state)
        events, kept = self._take_verified(out, list(self.owner), proposed)
        if t0 is not None and kept:
            self.policy.record(True, kept, time.perf_counter() - t0, most=k + 1)
        return events

    def verify_ahead(self) -> Verdict:
        """Queue a verify round whose drafts come from the device state (a device drafter) and
        leave it in flight: the next `collect` hands out the round before while this one runs.
        The host's `pos` lags the device by that round (at most k + 1 tokens), so blocks are
        allocated up to `round_end`."""
        live = [r for r, o in enumerate(self.owner) if o is not None]
        for r in live:
            self.pages.ensure(r, self.pos[r], self.round_end(r))
        self._sync()
        drafts, valid, q = self.drafter.draft(self, self.state, self.num_draft_tokens)
        out = self._queue_verify(live, drafts, valid, q)
        self._inflight.append((out, list(self.owner)))
        return out

    def round_end(self, row: int) -> int:
        """The end of the positions a verify round queued now may write for `row`, while the round
        before may still be in flight (`verify_ahead`)."""
        return self.pos[row] + 2 * (self.num_draft_tokens + 1)

    def _queue_verify(self, live: list[int], drafts: mx.array, valid: mx.array, q: mx.array | None) -> Verdict:
        """Queue the verify step for the live rows (the device state caught up: `_sync`)."""
        steps = self._roster().steps  # the live rows' mode, kept while they stay
        out, state = steps.verify(self.step_params, self.state._replace(counts=None), drafts, valid, q, self._settings)
        self.state = state._replace(counts=self.state.counts)
        mx.async_eval(out, self.state)
        self.stats.steps += 1
        self.stats.verify_rounds += 1
        self.stats.busy_row_steps += len(live)
        return out

    def collect(self, keep: StepOut | None = None) -> list[Event]:
        """Hand out the tokens of every output in flight except `keep` (the step just queued)."""
        events = []
        ready = [item for item in self._inflight if item[0] is not keep]
        self._inflight = [item for item in self._inflight if item[0] is keep]
        for out, owners in ready:
            if isinstance(out, Verdict):
                taken, kept = self._take_verified(out, owners)
                events += taken
                # A pipelined round's time: from the round before handed out to this one, while the
                # next is in flight (a run's last round, handed out at once after, is not timed).
                now = time.perf_counter() if keep is not None else None
                if kept:
                    self.policy.record(True, kept, None if now is None or self._last_round is None else
                                       now - self._last_round, most=self.num_draft_tokens + 1,
                                       least=self.drafter.least(self.num_draft_tokens))
                self._last_round = now
            else:
                events += self._take(out, owners)
        self._count_rows()
        return events

    def _count_rows(self) -> None:
        self.stats.running, self.stats.queued = self._live(), len(self.pending) + self._inbox.qsize()

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
                continue
            record = self.requests.get(item)
            if record is None:  # unknown, or already taken
                self._cancelling.discard(item)
            if record is None or record.finish_reason is not None:
                continue
            record.row.finish_reason = "cancelled"
            if item in self.pending:
                self.pending.remove(item)
            if item in self.owner:
                self._release(self.owner.index(item), record)
            self.stats.requests += 1
            events.append(Event(item, -1, "", "cancelled"))

    def _speculate(self) -> bool:
        """Whether this round verifies drafts: some row is live or waiting, no live row has
        penalties (its counts would change inside a verified run) or a constraint (its mask
        would depend on the drafts), and the policy says it pays."""
        live = [self.requests[o] for o in self.owner if o is not None]
        if not live and not self.pending and self._inbox.empty():
            return False
        if not self.policy.enabled or any(r.mode.penalties or r.mode.masked for r in live):
            return False
        k = self.num_draft_tokens
        return self.policy.choose(self._ahead(), self.drafter.least(k), self._feed_steps,
                                  speculative.headroom(len(live), k))

    def _feed_steps(self) -> float:
        """Decode steps the drafter's catch-up before its next round is expected to take: the
        tokens it lacks, each priced at its cost times this engine's prefill time per token
        (admissions made while nothing decoded), in timed decode steps. 0 where either is unknown."""
        rate, stats = self.policy.rate[False], self.stats
        if not self.drafter.cost or not rate or not stats.timed_prompt_tokens:
            return 0.0
        return self.drafter.cost * self.drafter.lacking(self) * stats.prompt_time / stats.timed_prompt_tokens * rate

    def _ahead(self) -> int:
        """The most tokens a live or queued request may still generate: the decode steps left, at
        most (0 while requests are still in the inbox, unread)."""
        live = [self.remaining(r) for r, o in enumerate(self.owner) if o is not None]
        return max(live + [self._limit(self.requests[rid].request) for rid in self.pending], default=0)

    def _take_verified(self, out: Verdict, owners: list, proposed: list[int] | None = None
                       ) -> tuple[list[Event], float]:
        """Hand out a verify round's accepted tokens, in order: `owners[i]` is the request that
        row i held when it was queued; `proposed[i]`: drafts row i had (None: k, within
        max_tokens). A row that ends inside its run (EOS, a stop string, max_tokens) keeps the
        tokens up to there. -> (events, tokens per row the round gave)."""
        packed = out.packed.tolist()  # one read: (B, k + 2) count, then tokens (`step.verify_step`)
        tokens, counts = [row[1:] for row in packed], [row[0] for row in packed]
        logprob = None if out.logprob is None else out.logprob.tolist()
        top = None if out.top_ids is None else (out.top_ids.tolist(), out.top_logprobs.tolist())
        now = time.perf_counter()
        events, rows, given = [], 0, 0
        k = self.num_draft_tokens
        row_of = {o: r for r, o in enumerate(self.owner) if o is not None}  # rows may have moved since
        for i, rid in enumerate(owners):
            record = self.requests.get(rid) if rid is not None else None
            if record is None or record.finish_reason is not None:
                continue  # ended (or cancelled) while this round was in flight
            r = row_of[rid]
            drafts = max(0, min(k, self.remaining(r) - 1)) if proposed is None else proposed[i]
            self.stats.drafted += drafts
            self.stats.accepted += min(counts[i] - 1, drafts)
            rows, given = rows + 1, given + counts[i]
            self.pos[r] += counts[i]  # KV now holds every verified position the row keeps
            self.drafter.verified(self, r, counts[i])
            if record.first_token_time is not None:
                self.stats.itl.append(now - record.last_token_time)
            record.last_token_time = now
            for j in range(counts[i]):
                before = len(record.row.text.tokens)
                event = record.row.accept(rid, tokens[i][j], record.request.eos, self.config.max_position_embeddings,
                                          None if logprob is None else logprob[i][j],
                                          None if top is None else (top[0][i][j], top[1][i][j]))
                self.stats.generation_tokens += len(record.row.text.tokens) - before
                events.append(event)
                if event.finish_reason is not None:
                    self.stats.requests += 1
                    self._release(r, record)
                    break
        return events, given / rows if rows else 0.0

    def _advance(self, record: Record, event: Event, matched: bool = False) -> Event:
        """A constrained row's matcher takes its new token (unless `matched`: it has); once nothing
        but EOS can follow, the row ends ("stop", as EOS would end it a step later)."""
        if record.matcher is None or event.finish_reason is not None:
            return event
        if not matched:
            self._match_one(record, event.token)
        done = record.error is not None or record.complete  # (while masks are computed, matchers are not read)
        if not done:
            return event
        record.row.finish_reason = "stop"
        return event._replace(text=event.text + record.row.text.flush(), finish_reason="stop")

    def _live(self) -> int:
        return len(self.owner) - self.owner.count(None)

    def _width(self, live: int) -> int:
        """Rows the state holds for `live` requests: every row, or only the live ones (shrink_rows)."""
        return max(1, min(live, self.rows)) if self.shrink_rows else self.rows

    def _resize_rows(self, width: int) -> None:
        """The host's per-row lists at `width` rows, every row empty (no state yet)."""
        self.owner, self.pos, self.need = [None] * width, [-1] * width, [0] * width
        self._vacated = []  # rows of a state that is gone: a new state's rows start at -1

    def _set_width(self, width: int) -> None:
        """Hold `width` rows: the live ones (in order), then empty ones. Steps already queued keep
        their own row -> request map (`_inflight`), so their tokens still reach the right requests;
        the KV stays where it is (the rows' blocks move with them)."""
        if width == len(self.owner):
            return
        keep = [r for r, o in enumerate(self.owner) if o is not None]
        empty = width - len(keep)
        self.owner = [self.owner[r] for r in keep] + [None] * empty
        self.pos = [self.pos[r] for r in keep] + [-1] * empty
        self.need = [self.need[r] for r in keep] + [0] * empty
        self.pages.reorder(keep)
        if self.drafter is not None:
            self.drafter.reorder(self, keep)
        self._vacated = []  # the new empty rows start at -1 below
        s = self.state
        self.state = s._replace(tokens=_rows(s.tokens, keep, width, 0), positions=_rows(s.positions, keep, width, -1),
                                steps=_rows(s.steps, keep, width, 0), counts=_rows(s.counts, keep, width, 0))
        self._restack()

    def _restack(self) -> None:
        """The per-row sampling settings of the rows as they are now."""
        self._settings = _stack([self.requests[o].request.settings if o is not None else _IDLE for o in self.owner])

    def remaining(self, row: int) -> int:
        """Tokens the request in `row` may still generate (max_tokens, within the context)."""
        record = self.requests[self.owner[row]]
        return self._limit(record.request) - len(record.row.text.tokens)

    def _free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is None]

    def _limit(self, request: Request) -> int:
        """Tokens the request may generate: max_tokens, within the model's context."""
        return min(request.max_tokens, self.config.max_position_embeddings - len(request.prompt))

    def _needs_decode(self) -> bool:
        """Whether some live row may still need a token after the one in flight (every live row
        has exactly one in flight here: its first token, or the last step's)."""
        return any(len(self.requests[o].row.text.tokens) + 1 < self._limit(self.requests[o].request)
                   for o in self.owner if o is not None)

    def _blocks_needed(self, request: Request) -> int:
        """Blocks a request may hold at once: its prompt and every token it may generate (a ring:
        its window, and one prefill chunk's blocks); with a drafter, the positions a verify round
        queued near the end may write past them (`round_end`)."""
        spill = 0 if self.drafter is None else 2 * (self.num_draft_tokens + 1)
        return self.pages.blocks_for(len(request.prompt) + self._limit(request) + spill,
                                     min(self.prefill_step, len(request.prompt)))

    def _admissible(self, free: int) -> list[Record]:
        """Queued requests to admit now, in order: at most `free`, while the blocks the live rows
        hold or have reserved and theirs fit the memory budget."""
        live = [r for r, o in enumerate(self.owner) if o is not None]
        committed = self.pool.used + self._outstanding()
        out = []
        for rid in list(self.pending)[:free]:
            record = self.requests[rid]
            need = self._blocks_needed(record.request)
            if (out or live) and committed + need > self.max_blocks:
                break  # the first request alone was checked by submit
            committed += need
            out.append(record)
        for record in out:
            self.pending.remove(record.id)
        return out

    def _outstanding(self) -> int:
        """Blocks the live rows have reserved and do not hold yet."""
        return sum(max(0, self.need[r] - len(self.pages.held[r])) for r, o in enumerate(self.owner) if o is not None)

    def _waves(self, records: list[Record]) -> list[list[Record]]:
        """Requests in prefill rounds: one that shares an uncached prefix with an earlier one
        waits for it (a second round), then finds that prefix cached: computed once."""
        if self.pool.max_cached <= 0:
            return [records]
        bs = self.pool.block_size
        if not self.pool.nodes:  # nothing cached: rows share a prefix only if their first blocks are equal
            firsts = [tuple(r.request.prompt[:bs]) for r in records if len(r.request.prompt) > bs]
            if len(set(firsts)) == len(firsts):
                return [records]  # no digests needed yet
        first, second, seen = [], [], set()
        for r in records:
            prompt = r.request.prompt
            limit = (len(prompt) - 1) // self.pool.block_size
            known = r.prompt_chain(self.pool.block_size)
            keys = [k for k, _ in known[:limit]]
            cached = len(self.pool.peek(prompt, limit, known))
            if cached < len(keys) and keys[cached] in seen:
                second.append(r)
            else:
                first.append(r)
                seen.update(keys[cached:])
        return [w for w in (first, second) if w]

    def _prefill(self, params, records: list[Record], free: list[int], wait: bool = False
                 ) -> list[tuple[StepOut, list]]:
        """Prefill requests into free rows, each after the longest prefix the cache holds (at
        least its last prompt token is computed: its hidden state gives the first token).
        `wait`: evaluate each length group before the next is launched (nothing decodes
        meanwhile), so the peak holds one group's activations; the next group's host work (its
        blocks, chunks and graph) is done while the device runs the one before."""
        starts = []
        for r in records:
            prompt = r.request.prompt
            blocks = self.pool.match(prompt, (len(prompt) - 1) // self.pool.block_size,
                                     r.prompt_chain(self.pool.block_size) if self.pool.nodes else ())
            r.cached_tokens = len(blocks) * self.pool.block_size
            self.stats.cached_tokens += r.cached_tokens
            starts.append((r, blocks))
        outs = []
        lengths = [len(r.request.prompt) - r.cached_tokens for r, _ in starts]
        for n, group in enumerate(prefill.plan_groups(lengths, self.prefill_step,
                                                      prefill.group_tokens(self.config.hidden_size))):
            # Waited for after this group's host work: on an H200 that work left the device idle
            # 3.9 ms before the second group of 128 prompts of the 1B shape (of 96 ms in all).
            previous = partial(mx.eval, outs[-1][0]) if n and wait else None
            rows = [free.pop(0) for _ in group]
            chosen = [starts[i] for i in group]
            for row, (r, blocks) in zip(rows, chosen):
                if row in self._vacated:  # refilled before its position went to -1
                    self._vacated.remove(row)
                self.owner[row], self.pos[row] = r.id, len(r.request.prompt)
                self.need[row] = self._blocks_needed(r.request)
                self.pages.attach(row, blocks)
            if self.drafter is not None:
                self.drafter.admitted(self, rows)
            chains = [partial(r.prompt_chain, self.pool.block_size) for r, _ in chosen] \
                if self.pool.max_cached > 0 else None
            h, cache = prefill.prefill_rows(self.steps(self.config, Mode()), params, self._detach_cache(), self.pages,
                                            rows, [r.request.prompt for r, _ in chosen],
                                            [r.cached_tokens for r, _ in chosen], self.prefill_step,
                                            self.pad_multiple, chains, previous)
            self.state = self.state._replace(cache=cache)
            # No local reference to the pool may outlive this group: the next group's writes
            # would then copy the whole pool rather than write it in place.
            del cache
            out = self._first_token(params, h, [r for r, _ in chosen])
            self._merge(rows, out.tokens, [len(r.request.prompt) for r, _ in chosen])
            outs.append((out, [r.id for r, _ in chosen]))
        return outs

    def _detach_cache(self) -> kv.KVCache:
        """The state's cache, which the state then no longer holds: a write into an array that
        nothing else references happens in place, where any other reference (an old state kept
        while the step runs) makes MLX copy the whole pool first (a 134 MB pool: 74 ms per write
        on this CPU against 0.07)."""
        cache = self.state.cache
        self.state = self.state._replace(cache=None)
        return cache

    def _first_token(self, params, h: mx.array, records: list[Record]) -> StepOut:
        """Not compiled: group sizes vary, and each new shape would trace and build kernels again."""
        mode = mode_for(records)._replace(penalties=False)  # nothing generated yet: counts are zero
        settings = _stack([r.request.settings for r in records])
        mask = None
        if mode.masked:
            words = structured.words(self.config.vocab_size)
            mask = mx.array(structured.fill_masks([r.matcher for r in records], np.ones((len(records), words),
                                                                                           np.uint32)))
        return first_token(self.config, mode, params, h, settings, mx.zeros((len(records),), mx.int32), None, mask)

    def _empty_state(self, blocks: int | None = None) -> DecodeState:
        """A state of empty rows over a device pool of `blocks` blocks (the host's pool size by default)."""
        keys, values, positions = kv.pool(self.config, blocks or self.pool.size, self.pool.block_size, self.dtype)
        B = len(self.owner)
        return DecodeState(kv.KVCache(keys, values, positions, mx.array(self.pages.table[:B])),
                           tokens=mx.zeros((B,), mx.int32), positions=mx.full((B,), -1, mx.int32),
                           steps=mx.zeros((B,), mx.int32), counts=mx.zeros((B, self.config.vocab_size), mx.int32))

    def _merge(self, rows: list[int], first: mx.array, lengths: list[int]) -> None:
        s = self.state
        _check_rows(rows, s.tokens.shape[0], "admitted")
        r = mx.array(rows, dtype=mx.int32)
        fresh = sampling.update_counts(mx.zeros((len(rows), s.counts.shape[1]), mx.int32), first)
        self.state = s._replace(tokens=kv.updated(s.tokens, r, first),
                                positions=kv.updated(s.positions, r, mx.array(lengths, mx.int32)),
                                steps=kv.updated(s.steps, r, mx.ones((len(rows),), mx.int32)),
                                counts=kv.updated(s.counts, r, fresh))

    def _sync(self) -> None:
        """The device state caught up with the host: pool size, table, vacated rows."""
        s = self.state
        cache, positions = prefill.ensure_pool(s.cache, self.pool.size), s.positions
        if self.pages.dirty:
            cache = cache._replace(table=mx.array(self.pages.table[:len(self.owner)]))
            self.pages.dirty = False
        if self._vacated:
            _check_rows(self._vacated, positions.shape[0], "vacated")
            positions = kv.updated(positions, mx.array(self._vacated, mx.int32), mx.full((len(self._vacated),), -1,
                                                                                        mx.int32))
            self._vacated = []
        if cache is not s.cache or positions is not s.positions:  # most steps: nothing to do
            self.state = s._replace(cache=cache, positions=positions)

    def _release(self, row: int, record: Record) -> None:
        """Free a row: the blocks of every position whose KV it computed go to the prefix cache
        (a ring row's generated blocks are gone already), then back to the pool."""
        if self.pages.ring is None:
            tokens = list(record.request.prompt) + record.row.text.tokens
            valid = min(self.pos[row], len(tokens))
            self.pool.register(tokens[:valid], self.pages.blocks(row, valid // self.pool.block_size),
                               known=record.keys or ())
        self.pages.release(row)
        if self.drafter is not None:
            self.drafter.released(self, row)
        self.owner[row], self.pos[row], self.need[row] = None, -1, 0
        self._vacated.append(row)

    def _fit_cache(self) -> None:
        """Drop the pool when idle and nothing is cached; compact it once long requests have left."""
        live = self._live()
        if self.state is not None and not live and self.pool.cached == 0 and self.idle:
            self.state, self._settings = None, None
            self.pages.remap(self.pool.renumber(self.pool.compaction(), 1))  # only the scratch block is left
            self._resize_rows(self._width(0))
        elif self.state is not None:
            if self.shrink_rows and self._width(live) < len(self.owner):
                self._set_width(self._width(live))
            self.pages.shrink()
            # Blocks held or cached, and reserved (upper bounds first: this runs every step, and
            # compaction() walks the pool).
            held = 1 + self.pool.used + self.pool.cached
            reserved = self._outstanding() if self.pool.size > 1 + self.pages.least and 4 * held <= self.pool.size \
                else None
            keep = self.pool.compaction() if reserved is not None and 4 * (held + reserved) <= self.pool.size else None
            size = None if keep is None else pool_size(2 * (len(keep) + reserved), self.max_blocks, self.pages.least)
            # (A pool at its least size stays: compacting it to that size again copied the KV every step.)
            if keep is not None and 4 * (len(keep) + reserved) <= self.pool.size and size < self.pool.size:
                cache = kv.take_blocks(self.state.cache, mx.array(keep))
                self.pages.remap(self.pool.renumber(keep, size))
                self.state = self.state._replace(cache=prefill.ensure_pool(cache, size))
        self.stats.capacity = self.pages.width * self.pool.block_size if self.state else 0
        self.stats.max_capacity = max(self.stats.max_capacity, self.stats.capacity)
        self.stats.kv_bytes = (self.pool.size if self.state else 0) * self.block_bytes
        self.stats.kv_used_bytes = self.pool.used * self.block_bytes
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, self.stats.kv_bytes)
        self.stats.peak_kv_used_bytes = max(self.stats.peak_kv_used_bytes, self.stats.kv_used_bytes)
        self.stats.cached_blocks, self.stats.prefix_hits = self.pool.cached, self.pool.hits

    def _take(self, out: StepOut, owners: list, values=None, matched: bool = False) -> list[Event]:
        """Hand out one step's tokens: `owners[i]` is the request that row i held when it ran.
        `values`: the step's `host_values`, when read already; `matched`: whether the constrained
        rows' matchers have taken these tokens (`_match`)."""
        tokens, logprob, top = values or host_values(out)
        now = time.perf_counter()
        # Per row of every step: names looked up once (a 1B step at 128 rows is host-bound on an H200).
        events, requests, stats, context = [], self.requests, self.stats, self.config.max_position_embeddings
        generated = 0
        for i, rid in enumerate(owners):
            record = requests.get(rid) if rid is not None else None
            if record is None:
                continue
            row = record.row
            if row.finish_reason is not None:
                continue
            if record.first_token_time is None:
                record.first_token_time = now
                stats.ttft.append(now - record.submitted)
            else:
                stats.itl.append(now - record.last_token_time)
            record.last_token_time = now
            held = row.text.tokens
            before = len(held)
            event = row.accept(rid, tokens[i], record.request.eos, context, None if logprob is None else logprob[i],
                               None if top is None else top[i])
            if record.matcher is not None:
                event = self._advance(record, event, matched)
            generated += len(held) - before  # a closing EOS is not output
            if event.finish_reason is not None:
                stats.requests += 1
                if rid in self.owner:
                    self._release(self.owner.index(rid), record)
            events.append(event)
        stats.generation_tokens += generated
        return events


def drafter_for(draft, engine: Engine) -> speculative.Drafter | None:
    """The drafter for a `draft` option: None, "prompt-lookup", a draft Model (or what
    `mlxfun.load` loads one from: a path or repo id), or a Drafter."""
    from mlxfun.drafting import DraftModel

    if draft is None or isinstance(draft, speculative.Drafter):
        return draft
    if isinstance(draft, str) and draft == "prompt-lookup":
        return speculative.LookupDrafter()
    if isinstance(draft, (str, Path)):
        from mlxfun.load import load

        draft = load(draft)
    if isinstance(draft, Model):
        return DraftModel(draft, engine)
    raise InputError(f"draft_model must be a Model, a path or 'prompt-lookup', got {draft!r:.60}")


def engine_for(model: Model, rows: int, config: GenerationConfig, kv_memory: int | None = None) -> Engine:
    """The engine a GenerationConfig's scheduler options describe (generate, the command line).
    `kv_memory`: the KV budget, when ranks must agree on it (mlxfun.distributed)."""
    engine = Engine(model, rows, prefill_step=config.prefill_step, max_kv_size=config.max_kv_size,
                    prefix_cache=config.prefix_cache, draft=config.draft_model,
                    num_draft_tokens=config.num_draft_tokens, kv_memory=kv_memory)
    if config.prompt_cache is not None:
        engine.add_prompt_cache(config.prompt_cache)
    return engine


# Settings for a row that holds no request (its tokens are discarded).
_IDLE = sampling.make_settings(1, seed=0)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _rows(a: mx.array, keep: list[int], width: int, fill) -> mx.array:
    """a (B, ...) -> (width, ...): rows `keep` of a, then rows of `fill`."""
    kept = a[mx.array(keep, mx.int32)] if keep else a[:0]
    pad = mx.full((width - len(keep), *a.shape[1:]), fill, a.dtype)
    return mx.concatenate([kept, pad]) if width > len(keep) else kept


def _check_rows(rows: list[int], width: int, what: str) -> None:
    """Rows a scatter is about to write, checked on the host: MLX does not bound-check scatter
    indices, so a row past the state would write past the end of its arrays (heap corruption)."""
    if rows and not 0 <= min(rows) <= max(rows) < width:
        raise RuntimeError(f"engine bug: {what} rows {sorted(rows)} outside a state of {width} rows")


def _stack(settings: list[sampling.Settings]) -> sampling.Settings:
    return sampling.Settings(*(mx.concatenate(fields) for fields in zip(*settings)))
