"""Continuous batching: a fixed number of rows, each refilled with the next request as it finishes.

All rows share one cache cursor. A new request is prefilled on its own (grouped with other new
ones) into a fresh cache of the same capacity ending at the current cursor, then replaces its
row wholesale, so the rows that keep decoding never wait for the slowest. Each row's data stays
contiguous and ends at the cursor; the buffer is a ring that grows (unrolled) before any live
row would lose a slot, so a request sees exactly what it would see alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from mlxfun import cache as kv
from mlxfun import prefill, sampling
from mlxfun.detok import RowText
from mlxfun.errors import InputError
from mlxfun.events import Event, Stats
from mlxfun.load import Model
from mlxfun.rows import Row, host_values
from mlxfun.step import DecodeState, Mode, StepOut, compiled_steps, first_token
from mlxfun.strategy import WeightStrategy, params_for_batch, params_for_prompts


@dataclass
class Request:
    """One prompt, its sampling settings and, as it runs, its output (`row`)."""

    id: int
    prompt: list[int]
    settings: sampling.Settings  # one row
    mode: Mode  # what a decode step must compute for this request
    row: Row
    submitted: float = 0.0
    first_token_time: float | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.row.finish_reason

    @property
    def text(self) -> RowText:
        return self.row.text


@dataclass
class EngineStats(Stats):
    """Prefills and decode steps interleave on the device, so the engine reports one rate:
    `generation_time` is the whole run, and `prompt_time` only the host's time admitting."""

    steps: int = 0
    busy_row_steps: int = 0  # sum over decode steps of the rows holding a live request
    rows: int = 0
    admissions: int = 0  # times new requests were prefilled (each one prefill per length group)
    ttft: dict[int, float] = field(default_factory=dict)  # request id -> seconds to first token

    @property
    def occupancy(self) -> float:
        return self.busy_row_steps / (self.steps * self.rows) if self.steps else 0.0

    def summary(self) -> str:
        ttft = sorted(self.ttft.values())
        median = ttft[len(ttft) // 2] if ttft else 0.0
        return (f"Requests: {len(ttft)}, prompts {self.prompt_tokens} tokens, generated {self.generation_tokens} "
                f"tokens in {self.generation_time:.2f} s ({self.generation_tps:.1f} tokens/s, prefills included)\n"
                f"Rows busy {self.occupancy:.0%} of {self.steps} steps, {self.admissions} admissions; "
                f"median time to first token {median:.3f} s\n"
                f"Peak memory: {self.peak_memory_gb:.3f} GB")


class Engine:
    """`rows` requests decode at once; `add` queues more, `events()` runs them all.

    Request ids are the integers `add` returns; results are in `requests[id]`.
    """

    def __init__(self, model: Model, rows: int = 8, *, prefill_step: int = 512, ignore_eos: bool = False,
                 max_kv_size: int | None = None, admit_min: int | None = None, pad_multiple: int | None = None,
                 strategy: WeightStrategy | None = None):
        if rows < 1:
            raise InputError(f"rows must be positive, got {rows}")
        for name, value in (("admit_min", admit_min), ("pad_multiple", pad_multiple)):
            if value is not None and value < 1:
                raise InputError(f"{name} must be positive, got {value}")
        # With max_kv_size every query sees at most that many positions, so the ring stops there.
        self.model, self.config, self.rows = model, model.config.with_max_kv_size(max_kv_size), rows
        self.prefill_step, self.ignore_eos = prefill_step, ignore_eos
        # Quantized weights may run as a dense copy for this many rows (mlxfun.strategy).
        self.params = params_for_batch(model.config, model.params, rows, strategy)
        self.strategy = strategy
        on_gpu = mx.default_device() == mx.gpu
        # On a GPU a prefill of a few prompts costs about what one of many does (kernel launches),
        # so new requests wait until a quarter of the rows are free (H200, 256 prompts through 64
        # rows of an 8B, two runs: 1.45 / 1.32x static batches; at an eighth 1.28 / 1.32x; at one
        # row 1.08 / 1.12x). On the CPU every token costs, so each free row is refilled at once.
        self.admit_min = admit_min or (max(1, rows // 4) if on_gpu else 1)
        # Prompt lengths rounded up on a GPU, so attention kernels are built for few shapes.
        self.pad_multiple = pad_multiple or prefill.pad_multiple()
        self.requests: dict[int, Request] = {}
        self.pending: deque[int] = deque()
        self.owner: list[int | None] = [None] * rows  # request id per row
        self.start = [0] * rows  # stream index of each row's first prompt token (see _make_room)
        self.state: DecodeState | None = None
        self.cursor = 0  # host copy of the cache cursor
        self.stats = EngineStats(rows=rows)
        self._next_id = 0
        self._row_settings: sampling.Settings | None = None

    def add(self, prompt: list[int], *, max_tokens: int = 256, stop: tuple[str, ...] = (),
            settings: sampling.Settings | None = None, top_logprobs: int = -1) -> int:
        """Queue a tokenized prompt; returns its request id."""
        limit = self.config.max_position_embeddings
        if not prompt:
            raise InputError("empty prompt")
        if len(prompt) >= limit:
            raise InputError(f"prompt of {len(prompt)} tokens exceeds the model's context of {limit}")
        if max_tokens < 1:
            raise InputError(f"max_tokens must be positive, got {max_tokens}")
        rid = self._next_id
        self._next_id += 1
        settings = settings if settings is not None else sampling.make_settings(1)
        penalties = sampling.needs_counts(settings)
        mode = Mode(sample=not sampling.all_greedy(settings), penalties=penalties,
                    sort=sampling.needs_sort(settings), top_logprobs=top_logprobs)
        row = Row(len(prompt), max_tokens, RowText(self.model.tokenizer, tuple(stop)), top_logprobs)
        self.requests[rid] = Request(rid, list(prompt), settings, mode, row, submitted=time.perf_counter())
        self.pending.append(rid)
        self.stats.prompt_tokens += len(prompt)
        return rid

    def cancel(self, rid: int) -> None:
        """Stop a request: queued ones never start, running ones end with reason "cancelled"."""
        req = self.requests[rid]
        if req.row.finish_reason is None:
            req.row.finish_reason = "cancelled"
        if rid in self.pending:
            self.pending.remove(rid)
        if rid in self.owner:
            self.owner[self.owner.index(rid)] = None

    # ---- the loop ----

    def events(self) -> Iterator[Event]:
        """Run until every request has finished, yielding an Event (index = request id) per token.

        Nothing here waits for the device except reading tokens one step behind: new requests are
        prefilled and merged in the queue between two decode steps, and their first tokens are
        read after the next decode step is queued."""
        t0 = time.perf_counter()
        queued: list[tuple[StepOut, list]] = []  # outputs in flight, with the owners of their rows
        while self.pending or self._live() or queued:
            admitted = self._admit()
            next_queued = []
            if self._live():
                self._make_room()
                mode = self._mode()
                out, state = compiled_steps(self.config, mode).decode(
                    self.params, self._state_for(mode), self._row_settings)
                # Steps without penalties neither read nor update the counts: keep them.
                self.state = state if mode.penalties else state._replace(counts=self.state.counts)
                mx.async_eval(out, self.state)
                self.cursor += 1
                self.stats.steps += 1
                self.stats.busy_row_steps += self._live()
                next_queued = [(out, list(self.owner))]
            # The previous step's tokens, then the admitted requests' first ones (their next
            # tokens come from the step just queued).
            for out, owners in queued + admitted:
                yield from self._take(out, owners)
            queued = next_queued
        self.stats.generation_time = time.perf_counter() - t0
        self.stats.generation_tokens = sum(len(r.text.tokens) for r in self.requests.values())
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    def _live(self) -> int:
        return sum(o is not None for o in self.owner)

    def _free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is None]

    def _admit(self) -> list[tuple[StepOut, list]]:
        """Prefill queued requests into free rows (grouped by length) and merge them into the
        state, all queued on the device. -> each group's first-token output with its request ids.

        With requests still decoding, it waits until `admit_min` rows are free (or the queue
        fits), so that one prefill serves several requests."""
        free = self._free_rows()
        if not free or not self.pending:
            return []
        if self._live() and len(free) < min(self.admit_min, len(self.pending)):
            return []
        t0 = time.perf_counter()
        self.stats.admissions += 1
        rids = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        reqs = [self.requests[i] for i in rids]
        longest = max(len(r.prompt) for r in reqs)
        if self.state is None:
            self.cursor = longest
            self.state = self._empty_state(kv.capacity_for(longest + 1, self.config.max_window))
        else:
            self._make_room(extra=longest + 1)
        cap = kv.capacity(self.state.cache)
        # Long prompts may run a dense copy of quantized weights, dropped after admission (mlxfun.strategy).
        params = params_for_prompts(self.config, self.params, [len(r.prompt) for r in reqs], self.prefill_step,
                                    self.strategy)
        dtype = params.norm.dtype
        admitted = []
        for group in prefill.plan_groups([len(r.prompt) for r in reqs]):
            rows = [free.pop(0) for _ in group]
            greqs = [reqs[i] for i in group]
            prompts = [r.prompt for r in greqs]
            mode = Mode(sample=True, sort=any(r.mode.sort for r in greqs),
                        top_logprobs=max(r.mode.top_logprobs for r in greqs))
            # A fresh cache just wide enough for the (padded) prompts, placed into the rows after.
            padded = prefill.padded_length(prompts, self.pad_multiple)
            width = min(padded, cap)
            steps = compiled_steps(self.config, mode)
            h, cache = prefill.prefill_group(self.config, steps, params, prompts, padded, width, self.prefill_step,
                                             dtype, self.pad_multiple)
            settings = _stack([r.settings for r in greqs])
            # Not compiled: group sizes vary, and each new shape would trace and build kernels again.
            out = first_token(self.config, mode, params, h, settings, mx.zeros((len(group),), mx.int32), None)
            for row, req in zip(rows, greqs):
                self.owner[row] = req.id
                self.start[row] = self.cursor - len(req.prompt)
            self._merge(rows, cache, padded, out.tokens, [len(p) for p in prompts])
            admitted.append((out, [r.id for r in greqs]))
        self._row_settings = _stack([self.requests[o].settings if o is not None else _IDLE for o in self.owner])
        self.stats.prompt_time += time.perf_counter() - t0
        return admitted

    def _merge(self, rows: list[int], cache: kv.KVCache, fresh_cursor: int, first: mx.array,
               lengths: list[int]) -> None:
        s = self.state
        r = mx.array(rows, dtype=mx.int32)
        counts = s.counts
        if counts is not None:
            fresh = sampling.update_counts(mx.zeros((len(rows), counts.shape[1]), mx.int32), first)
            counts = kv.updated(counts, r, fresh)
        self.state = DecodeState(
            kv.place_rows(s.cache, self.cursor, rows, cache, fresh_cursor),
            tokens=kv.updated(s.tokens, r, first),
            positions=kv.updated(s.positions, r, mx.array(lengths, mx.int32)),
            steps=kv.updated(s.steps, r, mx.ones((len(rows),), mx.int32)),
            counts=counts,
        )

    def _empty_state(self, capacity: int) -> DecodeState:
        B = self.rows
        cache = kv.empty(self.config, B, capacity, self.model.params.norm.dtype)._replace(
            cursor=mx.array(self.cursor, mx.int32))
        zeros = mx.zeros((B,), mx.int32)
        counts = mx.zeros((B, self.config.vocab_size), mx.int32)
        return DecodeState(cache, zeros, zeros, zeros, counts)

    def _make_room(self, extra: int = 1) -> None:
        """Grow the ring before any live row would overwrite a slot it still sees: the next write
        is at stream index `cursor`, and row r holds indices [start[r], cursor)."""
        live = [self.start[r] for r, o in enumerate(self.owner) if o is not None]
        need = max([extra] + [self.cursor + 1 - s for s in live])
        cap = kv.capacity(self.state.cache)
        if kv.capacity_for(need, self.config.max_window) > cap:
            cache = kv.grow(self.state.cache, kv.capacity_for(need, self.config.max_window))
            self.start = [s - self.cursor + int(cache.cursor) for s in self.start]
            self.cursor = int(cache.cursor)
            self.state = self.state._replace(cache=cache)

    def _mode(self) -> Mode:
        """The least a step must compute for the live requests (each Mode compiles once)."""
        live = [self.requests[o].mode for o in self.owner if o is not None]
        return Mode(sample=any(m.sample for m in live), penalties=any(m.penalties for m in live),
                    sort=any(m.sort for m in live), top_logprobs=max(m.top_logprobs for m in live))

    def _state_for(self, mode: Mode) -> DecodeState:
        return self.state if mode.penalties else self.state._replace(counts=None)


    def _take(self, out: StepOut, owners: list) -> Iterator[Event]:
        """Hand out one step's tokens: `owners[i]` is the request that row i held when it ran."""
        tokens, logprob, top = host_values(out)
        eos = () if self.ignore_eos else self.model.tokenizer.eos_token_ids
        now = time.perf_counter()
        for i, rid in enumerate(owners):
            if rid is None or self.requests[rid].finish_reason is not None:
                continue
            req = self.requests[rid]
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.ttft[rid] = now - req.submitted
            event = req.row.accept(rid, tokens[i], eos, self.config.max_position_embeddings,
                                   None if logprob is None else logprob[i], None if top is None else top[i])
            if event.finish_reason is not None and rid in self.owner:
                self.owner[self.owner.index(rid)] = None
            yield event


# Settings for a row that holds no request (its tokens are discarded).
_IDLE = sampling.make_settings(1, seed=0)


def _stack(settings: list[sampling.Settings]) -> sampling.Settings:
    return sampling.Settings(*(mx.concatenate(fields) for fields in zip(*settings)))
