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
from mlxfun import sampling
from mlxfun.detok import RowText
from mlxfun.errors import InputError
from mlxfun.events import Event, Stats
from mlxfun.load import Model
from mlxfun.prefill import plan_groups, prefill_group
from mlxfun.rows import Row, host_values
from mlxfun.step import DecodeState, Mode, StepOut, compiled_steps


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
    steps: int = 0
    busy_row_steps: int = 0  # sum over decode steps of the rows holding a live request
    rows: int = 0
    ttft: dict[int, float] = field(default_factory=dict)  # request id -> seconds to first token

    @property
    def occupancy(self) -> float:
        return self.busy_row_steps / (self.steps * self.rows) if self.steps else 0.0


class Engine:
    """`rows` requests decode at once; `add` queues more, `events()` runs them all.

    Request ids are the integers `add` returns; results are in `requests[id]`.
    """

    def __init__(self, model: Model, rows: int = 8, *, prefill_step: int = 512, ignore_eos: bool = False,
                 max_kv_size: int | None = None):
        if rows < 1:
            raise InputError(f"rows must be positive, got {rows}")
        # With max_kv_size every query sees at most that many positions, so the ring stops there.
        self.model, self.config, self.rows = model, model.config.with_max_kv_size(max_kv_size), rows
        self.prefill_step, self.ignore_eos = prefill_step, ignore_eos
        self.requests: dict[int, Request] = {}
        self.pending: deque[int] = deque()
        self.owner: list[int | None] = [None] * rows  # request id per row
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
        """Run until every request has finished, yielding an Event (index = request id) per token."""
        t0 = time.perf_counter()
        queued: tuple[StepOut, list] | None = None  # a decode step in flight and the owners it ran for
        while self.pending or any(o is not None for o in self.owner) or queued:
            yield from self._admit()
            next_queued = None
            if any(o is not None for o in self.owner):
                self._make_room()
                mode = self._mode()
                out, state = compiled_steps(self.config, mode).decode(
                    self.model.params, self._state_for(mode), self._row_settings)
                # Steps without penalties neither read nor update the counts: keep them.
                self.state = state if mode.penalties else state._replace(counts=self.state.counts)
                mx.async_eval(out, self.state)
                self.cursor += 1
                self.stats.steps += 1
                self.stats.busy_row_steps += sum(o is not None for o in self.owner)
                next_queued = (out, list(self.owner))
            if queued is not None:
                yield from self._take(*queued)
            queued = next_queued
        self.stats.generation_time = time.perf_counter() - t0 - self.stats.prompt_time
        self.stats.generation_tokens = sum(len(r.text.tokens) for r in self.requests.values())
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    def _free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is None]

    def _admit(self) -> Iterator[Event]:
        """Prefill queued requests into free rows (grouped by length) and emit their first tokens."""
        free = self._free_rows()
        if not free or not self.pending:
            return
        t0 = time.perf_counter()
        rids = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        reqs = [self.requests[i] for i in rids]
        longest = max(len(r.prompt) for r in reqs)
        if self.state is None:
            self.cursor = longest
            self.state = self._empty_state(self._capacity(longest + 1))
        else:
            self._make_room(extra=longest + 1)
        cap = kv.capacity(self.state.cache)
        params, dtype = self.model.params, self.model.params.norm.dtype
        for group in plan_groups([len(r.prompt) for r in reqs]):
            rows = [free.pop(0) for _ in group]
            greqs = [reqs[i] for i in group]
            mode = Mode(sample=True, sort=any(r.mode.sort for r in greqs),
                        top_logprobs=max(r.mode.top_logprobs for r in greqs))
            steps = compiled_steps(self.config, mode)
            h, cache = prefill_group(self.config, steps, params, [r.prompt for r in greqs], self.cursor, cap,
                                     self.prefill_step, dtype)
            settings = _stack([r.settings for r in greqs])
            zeros = mx.zeros((len(group),), mx.int32)
            out = steps.first(params, h, settings, zeros, None)
            for row, req in zip(rows, greqs):
                self.owner[row] = req.id
            self._merge(rows, cache, out.tokens, [len(r.prompt) for r in greqs])
            yield from self._take(out, [r.id for r in greqs])
        self.stats.prompt_time += time.perf_counter() - t0

    def _merge(self, rows: list[int], cache: kv.KVCache, first: mx.array, lengths: list[int]) -> None:
        s = self.state
        fresh = sampling.update_counts(mx.zeros((len(rows), s.counts.shape[1]), mx.int32), first)
        self.state = DecodeState(
            kv.replace_rows(s.cache, rows, cache),
            tokens=_put(s.tokens, rows, first),
            positions=_put(s.positions, rows, mx.array(lengths, mx.int32)),
            steps=_put(s.steps, rows, mx.ones((len(rows),), mx.int32)),
            counts=_put(s.counts, rows, fresh),
        )
        self._row_settings = _stack([self.requests[o].settings if o is not None else _IDLE for o in self.owner])
        mx.eval(self.state, self._row_settings)

    def _empty_state(self, capacity: int) -> DecodeState:
        B = self.rows
        cache = kv.empty(self.config, B, capacity, self.model.params.norm.dtype)._replace(
            cursor=mx.array(self.cursor, mx.int32))
        zeros = mx.zeros((B,), mx.int32)
        counts = mx.zeros((B, self.config.vocab_size), mx.int32)
        return DecodeState(cache, zeros, zeros, zeros, counts)

    def _make_room(self, extra: int = 1) -> None:
        """Grow the ring before any live row would overwrite a slot it still sees."""
        need = extra
        for row, rid in enumerate(self.owner):
            if rid is not None:
                req = self.requests[rid]
                need = max(need, len(req.prompt) + len(req.text.tokens) + 1)
        cap = kv.capacity(self.state.cache)
        if self._capacity(need) > cap:
            cache = kv.grow(self.state.cache, self._capacity(need))
            self.cursor = int(cache.cursor)
            self.state = self.state._replace(cache=cache)

    def _capacity(self, need: int) -> int:
        """Slots for `need` tokens per row: a bucket, at most the attention window."""
        window = self.config.max_window
        return kv.bucket(need) if window is None else min(kv.bucket(need), window)

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


def _put(a: mx.array, rows: list[int], values: mx.array) -> mx.array:
    """a (B, ...) with rows `rows` replaced by `values` (len(rows), ...)."""
    return mx.concatenate([a, values.astype(a.dtype)])[kv.row_index(a.shape[0], rows)]


# Settings for a row that holds no request (its tokens are discarded).
_IDLE = sampling.make_settings(1, seed=0)


def _stack(settings: list[sampling.Settings]) -> sampling.Settings:
    return sampling.Settings(*(mx.concatenate(fields) for fields in zip(*settings)))
