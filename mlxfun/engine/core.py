"""The engine: a fixed number of rows decoding together, each refilled with the next request.

One engine serves static and continuous batches (a static batch is an engine with one row per
prompt that admits them all at once). It ties three parts together, each with a narrow job:
- the scheduler (`scheduler.py`, host data only) decides which request holds which row and which
  KV blocks each row holds;
- the runner (`runner.py`) owns the device state and queues the compiled steps;
- features hook in where they change a step: structured output's masks (`features.constraints`),
  speculative rounds (`features.speculation`) and the prefix cache (in the scheduler's pool).

A step (`step`) is: take new messages, admit queued requests into free rows (on a GPU server, short
prompts ride along the decode step instead of a prefill of their own: `riding.py`), queue a decode
step, then hand out the tokens of the step before (read one step behind, so the device never
waits for the host).

Threads. One thread runs the engine: it calls `events`, `serve` or `step` (and `admit`,
`decode`, `collect`, `take`, and reads `requests`). Any thread may call `submit`, `add` and
`cancel`: they only put a message in a thread-safe inbox, which the engine thread drains at the
start of each step, so a cancelled request leaves its row within one step. `stats` may be read
from any thread (a snapshot that may be one step old).

Fixed shapes (`fixed_shapes=True`, a server's engine): one KV pool size for the engine's life,
every row decoded, the table widths of `paging.ladder` and the modes of `records.fixed_modes`,
so `warmup.warm_up` compiles every step at start and none on the request path.

Memory. Every request gets exactly one closing event (its finish reason: "stop", "length" or
"cancelled"); its record then waits in `requests` until `take` releases it. The pool grows as rows
need blocks and is compacted when long requests have left; the prefix cache keeps at most
`prefix_cache_bytes` of blocks no row uses. A request whose KV could never fit the memory budget
is refused by `submit`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from functools import partial
from typing import Callable, Iterator, NamedTuple, Sequence

import mlx.core as mx

from mlxfun.engine import prefill, riding, sampling
from mlxfun.engine.blocks import Pool
from mlxfun.engine.checks import check_invariant, check_options
from mlxfun.engine.detok import RowText
from mlxfun.engine.events import Event
from mlxfun.engine.inbox import Inbox
from mlxfun.engine.kv_budget import fixed_pool_blocks, kv_budget, settle_bytes
from mlxfun.engine.options import GenerationConfig, Request, make_request
from mlxfun.engine.outputs import hand_out
from mlxfun.engine.paging import MIN_BLOCKS, MIN_BLOCKS_CPU, Pages, ladder, pool_size
from mlxfun.engine.records import EngineStats, Record, fixed_mode, mode_for, request_mode
from mlxfun.engine.riding import Admitted, chunk_sizes, default_mixed_tokens
from mlxfun.engine.rows import Row
from mlxfun.engine.runner import Runner
from mlxfun.engine.scheduler import Scheduler, default_admit_wait
from mlxfun.engine.step import Mode, StepCache, StepOut, Steps, compiled_steps
from mlxfun.engine.strategy import WeightStrategy, default_strategy
from mlxfun.errors import InputError, check_bool, check_non_negative_int
from mlxfun.features import speculative
from mlxfun.features.constraints import Constraints
from mlxfun.features.speculation import Speculation, drafter_for
from mlxfun.features.speculative import Verdict
from mlxfun.model import cache as kv
from mlxfun.model.config import ModelConfig
from mlxfun.model.load import Model


class Roster(NamedTuple):
    """The rows' owners and what follows from them, made again only when the owners change (a 1B
    decode step is host-bound on an H200: the loop's own Python adds to every step)."""

    owners: tuple  # request id per row, None for an empty row
    live: list[int]  # rows holding a request
    mode: Mode  # `mode_for` their requests
    steps: Steps  # the compiled steps for that mode


class Engine:
    """`rows` requests decode at once; `submit` / `add` queue more, `events()` runs them all.

    Request ids are the integers `submit` returns; a finished request's record is in
    `requests[id]` until `take(id)` releases it.

    (About 400 lines, over the project's 300: it is the one place where the scheduler's decisions
    and the runner's steps meet, in the order a step needs them; admission and the two decode
    paths read as sequences here, where split apart they would pass the same parts around.)"""

    def __init__(self, model: Model, rows: int = 8, *, prefill_step: int = 512, max_kv_size: int | None = None,
                 admit_min: int | None = None, admit_wait: int | None = None, pad_multiple: int | None = None,
                 strategy: WeightStrategy | None = None, kv_memory: int | None = None, prefix_cache: bool = True,
                 prefix_cache_bytes: int | None = None, block_size: int = kv.BLOCK, draft=None,
                 num_draft_tokens: int = 4, policy: speculative.Policy | None = None,
                 shrink_rows: bool | None = None, steps: Callable[[ModelConfig, Mode], Steps] = compiled_steps,
                 fixed_shapes: bool = False, batch_invariant: bool = False, mixed_tokens: int | None = None):
        check_options(rows, prefill_step, block_size, max_kv_size, admit_min, pad_multiple, kv_memory,
                      prefix_cache, prefix_cache_bytes, num_draft_tokens)
        check_non_negative_int("admit_wait", admit_wait, allow_none=True)
        riding.check_mixed_tokens("mixed_tokens", mixed_tokens)
        check_bool("batch_invariant", batch_invariant)
        # With max_kv_size every query sees at most that many positions: rows become rings. A model
        # whose config asks for batch invariance keeps it.
        invariant = batch_invariant or model.config.batch_invariant
        self.config = model.config.with_max_kv_size(max_kv_size).with_batch_invariant(invariant)
        self.model, self.rows = model, rows
        if invariant:
            check_invariant(self.config, model.params)
        check_bool("fixed_shapes", fixed_shapes)
        self.fixed = fixed_shapes
        if fixed_shapes and steps is compiled_steps:
            steps = StepCache()
        self.step_cache = steps if isinstance(steps, StepCache) else None  # counts traces
        strategy = strategy or default_strategy()
        on_gpu = mx.default_device() == mx.gpu
        # Chunk lengths rounded up on a GPU, so attention kernels are built for few shapes.
        self.runner = Runner(model, self.config, rows, strategy, steps, block_size, prefill_step,
                             pad_multiple or prefill.pad_multiple(), settle_bytes(fixed_shapes),
                             split=fixed_shapes and not on_gpu)  # a CPU server's steps in two halves
        self.kv_memory = kv_budget(kv_memory, strategy, fixed_shapes)
        self.slot_bytes = kv.slot_bytes(self.config, self.runner.dtype)
        self.block_bytes = block_size * self.slot_bytes
        max_blocks = max(2, self.kv_memory // self.block_bytes)
        cached = (self.kv_memory // 8 if prefix_cache_bytes is None else prefix_cache_bytes) // self.block_bytes
        pool = Pool(1, block_size, cached if prefix_cache else 0)
        context = self.config.max_position_embeddings
        pages = Pages(rows, pool, self.config.max_window, max_blocks, MIN_BLOCKS if on_gpu else MIN_BLOCKS_CPU,
                      ladder(context, block_size) if fixed_shapes else None, self.config.sinks)
        if fixed_shapes:
            # One pool size for the engine's life (each size compiles the steps anew): the budget,
            # or what every row at full context could hold and an eighth more for the prefix cache.
            transient = min(prefill_step, context)
            max_blocks = fixed_pool_blocks(max_blocks, rows * pages.blocks_for(context, transient))
            pages.max_blocks = pages.least = max_blocks
        # On a GPU a prefill of a few prompts costs about what one of many does (kernel launches), so
        # new requests wait until a quarter of the rows are free (H200, 256 prompts through 64 rows of
        # an 8B: 1.45 / 1.32x static batches; at one row 1.08 / 1.12x). On the CPU every token costs,
        # so each free row is refilled at once; and a row costs a step's share of work whether it
        # holds a request or not, so the decoded rows follow the live requests (shrink_rows; a
        # server's in powers of two, each warmed up: SmolLM2 4-bit on 2 cores decodes about 0.17 s
        # a row, so one request at 32 full rows took 32x its time). On a GPU a step costs about
        # the same for 1 row or 32, and every width would compile anew.
        # Prompts of up to this many tokens in all ride along a decode step when admitted beside
        # decoding rows (`step.mixed_step`); 0: every admission is a prefill of its own.
        mixed_tokens = default_mixed_tokens(on_gpu, fixed_shapes) if mixed_tokens is None else mixed_tokens
        if draft is not None or pages.ring is not None:
            mixed_tokens = 0  # verify rounds and rings keep their own admissions
        self.chunk_sizes = chunk_sizes(mixed_tokens)
        self.scheduler = Scheduler(rows, pool, pages, max_blocks=max_blocks,
                                   context=self.config.max_position_embeddings, prefill_step=prefill_step,
                                   admit_min=admit_min or (max(1, rows // 4) if on_gpu else 1),
                                   shrink_rows=not on_gpu if shrink_rows is None else shrink_rows,
                                   row_buckets=fixed_shapes,
                                   spill=0 if draft is None else 2 * (num_draft_tokens + 1),
                                   preempt=fixed_shapes and draft is None,
                                   admit_wait=default_admit_wait(on_gpu, fixed_shapes) if admit_wait is None
                                   else admit_wait, mixed_tokens=mixed_tokens)
        self.stats = EngineStats(rows=rows)
        self.constraints = Constraints(self.config.vocab_size)
        drafter = drafter_for(draft, self)
        self.speculation = None if drafter is None else Speculation(
            drafter, num_draft_tokens,
            policy or speculative.Policy(enabled=speculative.may_pay(rows, num_draft_tokens)))
        # Engine-thread state: outputs queued and not yet handed out, with the requests their rows held.
        self._inflight: list[tuple[StepOut, Sequence]] = []
        self._chunk: Admitted | None = None  # prompts admitted to ride along the next decode step
        self._roster_of: Roster | None = None
        self._admitted_before = False  # the last round admitted (`EngineStats.time_round`)
        self.inbox = Inbox()  # any thread's messages

    @property
    def mixed_tokens(self) -> int:
        """Prompt tokens a decode step may carry in all (`riding`); 0: none."""
        return self.scheduler.mixed_tokens

    @property
    def requests(self) -> dict[int, Record]:
        return self.scheduler.requests

    # ---- any thread ----

    def submit(self, request: Request) -> int:
        """Queue a checked Request (`options.requests` / `make_request`); returns its id. Raises
        InputError, before any work, if its cache could never fit the memory budget."""
        self.check(request)
        # The settings kept in host memory (NumPy; MLX ones are read here, on the calling thread): the
        # engine thread stacks the rows' settings there and copies each field to the device at once.
        request = dataclasses.replace(request, settings=sampling.on_host(request.settings))
        rid = self.inbox.new_id()
        record = Record(rid, request, request_mode(request),
                        Row(len(request.prompt), request.max_tokens, RowText(self.model.tokenizer, request.stop),
                            request.logprobs), submitted=time.perf_counter(),
                        matcher=None if request.constraint is None else request.constraint.matcher(request.eos))
        self.inbox.submit(record)
        return rid

    def check(self, request: Request) -> None:
        """Raise InputError, as `submit` does, unless this engine can take `request`."""
        if not isinstance(request, Request):
            raise InputError(f"submit takes an mlxfun Request, got {type(request).__name__}")
        need = self.scheduler.blocks_needed(request)
        if need > self.scheduler.max_blocks:
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
        self.inbox.cancel(rid)

    def reset_stats(self) -> None:
        """Start the counters (`stats`) again: a server's own first requests are not its clients'.
        Meant for an idle engine: a step in flight meanwhile may count into the counters replaced."""
        self.stats = EngineStats(rows=self.stats.rows)
        self.runner.take_waited()

    # ---- the engine thread: the loop ----

    def events(self) -> Iterator[Event]:
        """Run until every submitted request has finished, yielding each Event as it is produced
        (index = request id)."""
        cancelling = self.inbox.cancelling
        for events in self._rounds():
            for event in events:
                # A token of a request cancelled after its step ran (even by this loop's consumer,
                # between two events of one step) is dropped.
                if event.finish_reason is not None or event.index not in cancelling:
                    yield event

    def serve(self, stop: threading.Event, poll: float = 0.05) -> Iterator[Event]:
        """Run until `stop` is set and every request has finished, waiting for work when idle."""
        for events in self.rounds(stop, poll):
            yield from events

    def rounds(self, stop: threading.Event, poll: float = 0.05) -> Iterator[list[Event]]:
        """`serve`, one list of events per step (a server hands them to its clients at once)."""
        while not (stop.is_set() and self.idle):
            if self.idle:
                t = time.perf_counter()
                self.inbox.wake.wait(poll)
                self.inbox.wake.clear()
                self.stats.idle_seconds += time.perf_counter() - t
                continue
            cancelling = self.inbox.cancelling
            for events in self._rounds():
                # A token of a request cancelled after its step ran is dropped.
                events = [e for e in events if e.finish_reason is not None or e.index not in cancelling]
                if events:
                    yield events

    def _rounds(self) -> Iterator[list[Event]]:
        """Each step's events until every submitted request has finished."""
        t0, prompt0 = time.perf_counter(), self.stats.prompt_time
        while True:
            events = self.step()
            if events:
                yield events
            if self.idle:
                break
        self.stats.generation_time += time.perf_counter() - t0 - (self.stats.prompt_time - prompt0)
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    @property
    def idle(self) -> bool:
        return self.inbox.empty() and not self.scheduler.pending and not self.scheduler.live_count() \
            and not self._inflight

    def step(self) -> list[Event]:
        """One round: admit, queue a decode step (a masked one when a live row is constrained), then
        hand out the round before. When speculation pays, a verify round instead (`Speculation`)."""
        t0, admissions = time.perf_counter(), self.stats.admissions
        spec = self.speculation
        if spec is not None and spec.wants_round(self):
            events = spec.round(self)
        else:
            events = spec.leave_pipeline(self) if spec is not None else []
            events += self.admit()
            needs = self._chunk is not None or self.scheduler.needs_decode()
            if needs and self.roster().mode.masked:
                events += self._masked_decode()
            else:
                queued = self.decode() if needs else None
                events += self.collect(keep=queued)
            if spec is not None:
                spec.after_plain_round(self)
        self._fit_cache()
        admitted = self.stats.admissions > admissions
        self.stats.time_round(time.perf_counter() - t0, admitted, self._admitted_before)
        self._admitted_before = admitted
        return events

    def take(self, rid: int) -> Record:
        """Release a finished request and return its record."""
        record = self.requests[rid]
        if record.finish_reason is None:
            raise InputError(f"request {rid} has not finished")
        self.inbox.cancelling.discard(rid)
        return self.requests.pop(rid)

    def add_prompt_cache(self, cache) -> None:
        """Make a `prompt_cache.PromptCache`'s full blocks part of the prefix cache, pinned for the
        engine's life, so every prompt that starts with its tokens skips them."""
        from mlxfun.features.prompt_cache import install

        install(self, cache)

    # -- the round's parts (public for profiling: admit, then decode and collect per step) --

    def admit(self) -> list[Event]:
        """Drain the inbox (closing events for cancellations), then prefill the requests the
        scheduler admits into free rows, queued on the device (evaluated at once when no row is
        decoding: nothing to overlap). Their first tokens are handed out by the next `collect`."""
        events = self._drain() if not self.inbox.empty() else []  # (a message put after this waits a step)
        sched = self.scheduler
        busy = sched.live_count() > 0
        records = sched.admission()
        if not records:
            return events
        t0 = time.perf_counter()
        self.stats.admissions += 1
        width = sched.width(sched.live_count() + len(records))
        if self.runner.state is None:
            sched.resize_rows(width)
        else:
            self._set_width(width)
        free = sched.free_rows()
        # The pool grows once for what the rows may hold (each new size retraces the step).
        sched.pages.reserve(sched.outstanding() + sum(sched.blocks_needed(r.request) for r in records))
        if self.runner.state is None:
            # A first state's device pool holds the prompts' blocks; the first decode step grows it to
            # the reservation (`sync`), after the prompts' activations are freed, so the peak holds
            # one or the other (made at the reservation, a 1B's 128 x 128-token batch peaked 0.54 GB higher).
            bs = sched.pool.block_size
            prompts = sum(-(-len(r.prompt) // bs) for r in records)
            self._new_state(min(pool_size(1 + prompts, sched.max_blocks, sched.pages.least), sched.pool.size))
        self.stats.prompt_tokens += sum(len(r.prompt) for r in records)
        if busy and riding.fits(sched, records, self.mixed_tokens, self.roster().mode.masked):
            self._chunk = riding.place(sched, records, free, self.chunk_sizes)
            self.stats.cached_tokens += sum(r.cached_tokens for r in records)
            self.stats.carried += 1
            self._restack()
        else:
            self._prefill_waves(records, free, busy, t0)
        self.stats.admission_seconds += time.perf_counter() - t0
        return events

    def _prefill_waves(self, records: list[Record], free: list[int], busy: bool, t0: float) -> None:
        """Prefill the admitted requests (`_prefill`), wave by wave; evaluated at once when no row
        decodes (`busy`: some row does), and then timed as prompt time since `t0`."""
        params = self.runner.prompt_params([len(r.prompt) for r in records])
        outs = []
        for wave in self.scheduler.waves(records):
            if outs and not busy:
                mx.eval([o[0] for o in outs], self.runner.state)
            outs += self._prefill(params, wave, free, wait=not busy)
        self._inflight += outs
        self._restack()
        if not busy:
            mx.eval([o[0] for o in outs], self.runner.state)
            self.stats.prompt_time += time.perf_counter() - t0
            self.stats.timed_prompt_tokens += sum(len(r.prompt) - r.cached_tokens for r in records)

    def _prefill(self, params, records: list[Record], free: list[int], wait: bool = False
                 ) -> list[tuple[StepOut, list]]:
        """Prefill requests into free rows, each after the longest prefix the cache holds, in
        length groups. `wait`: evaluate each group before the next is launched (nothing decodes
        meanwhile), so the peak holds one group's activations; the next group's host work (its
        blocks, chunks and graph) is done while the device runs the one before."""
        sched, bs = self.scheduler, self.scheduler.pool.block_size
        starts = [(r, sched.cached_prefix(r)) for r in records]
        self.stats.cached_tokens += sum(r.cached_tokens for r in records)
        outs = []
        lengths = [len(r.prompt) - r.cached_tokens for r, _ in starts]
        for n, group in enumerate(prefill.plan_groups(lengths, self.runner.prefill_step,
                                                      prefill.group_tokens(self.config.hidden_size))):
            # Waited for after this group's host work: on an H200 that work left the device idle
            # 3.9 ms before the second group of 128 prompts of the 1B shape (of 96 ms in all).
            previous = partial(mx.eval, outs[-1][0]) if n and wait else None
            rows = [free.pop(0) for _ in group]
            chosen = [starts[i][0] for i in group]
            sched.place(rows, chosen, [starts[i][1] for i in group])
            if self.speculation is not None:
                self.speculation.drafter.admitted(self, rows)
            chains = [partial(r.prompt_chain, bs) for r in chosen] if sched.pool.max_cached > 0 else None
            h = self.runner.prefill(params, sched.pages, rows, [r.prompt for r in chosen],
                                    [r.cached_tokens for r in chosen], chains, previous, busy=not wait)
            mode = self._mode(chosen)
            out = self.runner.first_tokens(params, h, rows, mode, [r.request.settings for r in chosen],
                                           [r.matcher for r in chosen] if mode.masked else None,
                                           [len(r.prompt) for r in chosen],
                                           [r.row.text.tokens for r in chosen] if sched.preempt else None)
            outs.append((out, [r.id for r in chosen]))
        return outs

    def next_decode(self) -> tuple[Callable, tuple]:
        """The compiled decode step for the live rows and its arguments, not run (profiling)."""
        roster = self._prepare_step()
        return roster.steps.decode, (self.runner.step_params, self.runner.input_state(roster.mode.penalties),
                                     self.runner.settings)

    def decode(self) -> StepOut:
        """Queue one decode step for every row (rows without a live request decode idly)."""
        roster = self._prepare_step()
        admitted, self._chunk = self._chunk, None
        out = self.runner.decode(roster.steps, roster.mode.penalties, None if admitted is None else admitted.chunk)
        # A row admitted by the step's chunk starts at its prompt's end, where `place` put it.
        self._advanced(roster.live if admitted is None else [r for r in roster.live if r not in admitted.rows])
        if admitted is not None:
            riding.register(self.scheduler, admitted)
        if self.speculation is not None:
            self.speculation.decoded(time.perf_counter())
        self._inflight.append((out, roster.owners))
        return out

    def _masked_decode(self) -> list[Event]:
        """A decode step when some live row is constrained: the mask worker reads the tokens in
        flight and computes the next masks while this thread queues the forward pass (it needs
        only the tokens already on the device); then the sampling half is queued with the masks,
        and the tokens read are handed out while the device runs it."""
        roster = self._prepare_step()
        ready, self._inflight = self._inflight, []
        job = self.constraints.start(ready, roster.owners, self.requests)
        # The forward pass is queued at once. MLX holds the GIL while it encodes the graph, so the
        # worker reads and matches the tokens after that; letting it go first (up to 1 ms) left the
        # device idle meanwhile (1.16-1.22x a free step against 1.07-1.12x, 1B and 8B, batch 32, H200).
        logits = self.runner.forward()
        self._advanced(roster.live)
        values = job.result()  # the masks are filled
        out = self.runner.sample(roster.steps, logits, self.constraints.device(), roster.mode.penalties)
        self._inflight.append((out, roster.owners))
        events = []
        for (step_out, step_owners), v in zip(ready, values):
            events += hand_out(self, step_out, step_owners, v, matched=True)
        self._count_rows()
        return events

    def collect(self, keep: StepOut | None = None) -> list[Event]:
        """Hand out the tokens of every output in flight except `keep` (the step just queued)."""
        events = []
        ready = [item for item in self._inflight if item[0] is not keep]
        self._inflight = [item for item in self._inflight if item[0] is keep]
        for out, owners in ready:
            if isinstance(out, Verdict):
                events += self.speculation.handed_out(self, out, owners, pipelined=keep is not None)
            else:
                events += hand_out(self, out, owners)
        self._count_rows()
        return events

    # ---- for the parts and the features ----

    def roster(self) -> Roster:
        owners = tuple(self.scheduler.owner)
        if self._roster_of is None or self._roster_of.owners != owners:
            live = [r for r, o in enumerate(owners) if o is not None]
            mode = self._mode([self.requests[owners[r]] for r in live])
            self._roster_of = Roster(owners, live, mode, self.runner.steps_for(mode))
        return self._roster_of

    def sync(self) -> None:
        """The device state caught up with the host: pool size, block table, vacated rows."""
        sched = self.scheduler
        table = None
        if sched.pages.dirty:
            table = sched.pages.table[:len(sched.owner)]
            sched.pages.dirty = False
        self.runner.sync(sched.pool.size, table, sched.vacated)
        sched.vacated = []

    def release(self, row: int, record: Record) -> None:
        """Free a row (its blocks to the prefix cache, then to the pool)."""
        self.scheduler.release(row, record)
        if self.speculation is not None:
            self.speculation.drafter.released(self, row)

    def ensure_state(self) -> None:
        """A device state, if there is none yet (the prefix cache is written into its pool)."""
        if self.runner.state is None:
            self._new_state()

    def in_flight(self, out) -> None:
        """An output queued outside `decode`, to be handed out by the next `collect`."""
        self._inflight.append((out, list(self.scheduler.owner)))

    # ---- internals ----

    def _mode(self, records: Sequence[Record]) -> Mode:
        mode = mode_for(records)
        return fixed_mode(mode, self.runner.split) if self.fixed else mode

    def _prepare_step(self) -> Roster:
        """Blocks for each live row's next position (rows preempted for them where the pool is
        full, never one whose prompt rides along this step), the device state caught up -> the
        roster."""
        sched = self.scheduler
        if sched.preempt:
            for row in sched.victims(sched.live_rows(), self._chunk.rows if self._chunk is not None else ()):
                record = self.requests[sched.owner[row]]
                self.release(row, record)
                sched.requeue(record)
                self.stats.preemptions += 1
        roster = self.roster()
        self.scheduler.blocks_for_step(roster.live)
        self.sync()
        return roster

    def _advanced(self, live: list[int]) -> None:
        """A decode step was queued for the `live` rows: each is one position further."""
        pos = self.scheduler.pos
        for r in live:
            pos[r] += 1
        self.stats.steps += 1
        self.stats.busy_row_steps += len(live)

    def _new_state(self, blocks: int | None = None) -> None:
        sched = self.scheduler
        self.runner.state = self.runner.empty_state(len(sched.owner), blocks or sched.pool.size,
                                                    sched.pages.table[:len(sched.owner)])

    def _restack(self) -> None:
        self.runner.restack([self.requests[o].request.settings if o is not None else None
                             for o in self.scheduler.owner])

    def _set_width(self, width: int) -> None:
        """Hold `width` rows: the live ones, then empty ones. Steps already queued keep their own
        row -> request map (`_inflight`), so their tokens still reach the right requests."""
        keep = self.scheduler.set_width(width)
        if keep is None:
            return
        if self.speculation is not None:
            self.speculation.drafter.reorder(self, keep)
        self.runner.set_rows(keep, width)
        self._restack()

    def _count_rows(self) -> None:
        self.stats.device_wait_seconds += self.runner.take_waited()
        self.stats.running = self.scheduler.live_count()
        self.stats.queued = len(self.scheduler.pending) + self.inbox.size()

    def _drain(self) -> list[Event]:
        """The inbox's messages: new requests queued, cancelled ones closed (and their rows freed)."""
        submitted, cancelled = self.inbox.drain()
        for record in submitted:
            self.scheduler.enqueue(record)
        events = []
        for rid in cancelled:
            if rid not in self.requests:  # unknown, or already taken
                self.inbox.cancelling.discard(rid)
            found = self.scheduler.cancel(rid)
            if found is None:
                continue
            record, row = found
            if row is not None:
                self.release(row, record)
            self.stats.requests += 1
            events.append(Event(rid, -1, "", "cancelled"))
        return events

    def _fit_cache(self) -> None:
        """Drop the pool when idle and nothing is cached; compact it once long requests have left."""
        sched, runner = self.scheduler, self.runner
        live = sched.live_count()
        if runner.state is not None and not live and sched.pool.cached == 0 and self.idle and not self.fixed:
            runner.drop()
            sched.forget_pool()
        elif runner.state is not None:
            if sched.shrink_rows and sched.width(live) < len(sched.owner):
                self._set_width(sched.width(live))
            sched.pages.shrink()
            plan = sched.compaction()
            if plan is not None:
                runner.compact(*plan)
        self.stats.record_memory(self.scheduler, self.runner.state is not None, self.block_bytes)


def engine_for(model: Model, rows: int, config: GenerationConfig, kv_memory: int | None = None,
               fixed_shapes: bool = False, admit_wait: int | None = None,
               mixed_tokens: int | None = None) -> Engine:
    """The engine a GenerationConfig's scheduler options describe (generate, the command line).
    `kv_memory`: the KV budget, when ranks must agree on it (mlxfun.parallel.distributed) or a
    server sets it; `fixed_shapes`, `admit_wait`, `mixed_tokens`: a server's engine (see `Engine`)."""
    engine = Engine(model, rows, prefill_step=config.prefill_step, max_kv_size=config.max_kv_size,
                    prefix_cache=config.prefix_cache, draft=config.draft_model,
                    num_draft_tokens=config.num_draft_tokens, kv_memory=kv_memory, fixed_shapes=fixed_shapes,
                    batch_invariant=config.batch_invariant, admit_wait=admit_wait, mixed_tokens=mixed_tokens)
    if config.prompt_cache is not None:
        engine.add_prompt_cache(config.prompt_cache)
    return engine


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
