"""The engine on a thread of its own, for the HTTP server (no HTTP here).

One thread owns the engine and MLX's decode loop (`Engine.rounds`). The event loop submits and
cancels through the engine's thread-safe inbox (`Bridge.submit`, `Bridge.cancel`). Each step's
events reach the event loop in one `call_soon_threadsafe` (one wake-up per step, not per token),
which puts each in its HTTP request's asyncio queue; a request's closing event carries its
`Outcome`, its Record being released (`Engine.take`) on the engine thread. The engine never waits
for the HTTP side. `mlxfun serve` runs this Bridge in a process of its own (`engine_process`),
whose `deliver` sends each step's items down a pipe instead.

Before it takes requests the engine compiles every step it may run (`warmup.warm_up`), so none
compiles on the request path; until then `ready` is False (/health answers 503).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, NamedTuple

import mlx.core as mx

from mlxfun.engine.core import Engine
from mlxfun.engine.events import Event
from mlxfun.engine.options import Request
from mlxfun.engine.records import Record
from mlxfun.engine.warmup import Warmup, warm_up
from mlxfun.errors import MlxfunError

log = logging.getLogger("mlxfun.serve")

# Seconds over which /metrics reports generated tokens/s.
RATE_WINDOW = 10.0


class Busy(MlxfunError):
    """The queue is full: the client should retry later (HTTP 429)."""


class NotReady(Busy):
    """The engine is still compiling its steps (HTTP 503, as /health answers meanwhile)."""


class EngineFailed(RuntimeError):
    """The engine raised while a request was in it; the request ends with this error (HTTP 500)."""


def name_os_thread(name: str) -> None:
    """Show the calling thread as `name` (15 bytes) where the OS lists threads (/proc, top -H,
    profilers), so a server's CPU can be read by thread; Linux only, else nothing."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
        except (OSError, AttributeError):
            pass


class Outcome(NamedTuple):
    """What a finished request's answer needs of its Record (the Record itself is released on the
    engine's side; this crosses threads and processes)."""

    token_ids: list[int]
    logprobs: list[float]  # the chosen tokens' (empty unless asked)
    top: list | None  # per token, (id, logprob) pairs; None unless top logprobs were asked
    text: str
    finish_reason: str
    cached_tokens: int  # prompt tokens the prefix cache held


def outcome(record: Record) -> Outcome:
    """A closed request's generated ids and, when asked, their logprobs and top logprobs (trimmed to the ids)."""
    row = record.row
    ids = row.token_ids
    return Outcome(list(ids), list(row.logprobs[: len(ids)]), list(row.top[: len(ids)]) if row.top_n > 0 else None,
                   row.text.final_text, record.finish_reason, record.cached_tokens)


Target = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class Bridge:
    """`submit` requests from the event loop; read (Event, Outcome | None) items from the returned
    asyncio queue: the Outcome comes with each request's closing event. An engine error ends every
    request in flight with an `EngineFailed` item and a fresh engine takes over.

    `deliver` takes each step's [(target, item)] (by default a target is (loop, queue): one call
    into each event loop); `on_ready(bool)` hears when requests start and stop being taken (the
    engine process forwards both to the server's process)."""

    def __init__(self, make_engine: Callable[[], Engine], max_queued: int, warm: bool = True,
                 deliver: Callable[[list[tuple[Any, tuple]]], None] | None = None,
                 on_ready: Callable[[bool], None] | None = None):
        self._make_engine = make_engine
        self.max_queued = max_queued
        self.warm = warm  # compile every step before taking requests (the engine must have fixed shapes)
        self._deliver = deliver or to_loops
        self._on_ready = on_ready or (lambda ready: None)
        self.warmup: Warmup | None = None  # the last warm-up's cost
        self.engine: Engine | None = None  # None while a failed engine is replaced
        self.rows = 0  # the engine's rows, the same for every engine it makes (set once it has one)
        self._warm = threading.Event()  # set once the engine takes requests
        self._cut = False
        self._lock = threading.Lock()  # guards _targets and the engine swap after a failure
        self._targets: dict[int, Any] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._samples: deque[tuple[float, int]] = deque(maxlen=256)  # (time, generated tokens so far)
        self._thread = threading.Thread(target=self._run, name="mlxfun-engine", daemon=True)

    # ---- the event loop's side ----

    def start(self) -> None:
        """Build the engine on its thread (so every MLX array it makes lives there) and run it."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def model(self):
        return self.engine.model

    @property
    def ready(self) -> bool:
        """Alive and warmed up: requests are taken."""
        return self.alive and self._warm.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._warm.wait(timeout)

    async def submit(self, requests: list[Request]) -> tuple[list[int], asyncio.Queue]:
        """Queue the requests together (all or none); their items share one asyncio queue.
        Raises Busy when the rows and the queue are full, InputError when one could never fit."""
        q = asyncio.Queue()
        return self.submit_to(requests, (asyncio.get_running_loop(), q)), q

    def submit_to(self, requests: list[Request], target) -> list[int]:
        """`submit`, delivering the requests' items to `target` (what `deliver` takes)."""
        with self._lock:
            if not self.alive:
                raise Busy("the server is shutting down")
            if not self._warm.is_set():
                raise NotReady("the server is warming up (compiling its steps); /health answers 200 once it is ready")
            if len(self._targets) + len(requests) > self.rows + self.max_queued:
                raise Busy(f"{len(self._targets)} requests in flight; the server takes {self.rows} rows "
                           f"and {self.max_queued} queued")
            ids = []
            try:
                for r in requests:
                    ids.append(self.engine.submit(r))
                    self._targets[ids[-1]] = target
            except Exception:
                for rid in ids:
                    self._targets.pop(rid, None)
                    self.engine.cancel(rid)
                raise
        return ids

    def cancel(self, rid: int) -> None:
        """Free the request's row within one decode step (its closing event still arrives, unread)."""
        with self._lock:
            if self._targets.pop(rid, None) is not None:
                self.engine.cancel(rid)

    def reset_stats(self) -> None:
        """The engine's counters start again (after the server's own first requests)."""
        if self.engine is not None:
            self.engine.reset_stats()
            self._samples.clear()

    @property
    def cut_off(self) -> bool:
        """Whether `cut` has ended the requests that were running."""
        return self._cut

    def cut(self) -> None:
        """End every request in flight (a shutdown's grace period is over): each gets its closing
        event, "cancelled", so its HTTP request can still answer its client."""
        with self._lock:
            self._cut = True
            self._stop.set()
            for rid in list(self._targets):
                self.engine.cancel(rid)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every request still in flight, let the engine thread finish, and wait for it."""
        with self._lock:
            self._stop.set()
            for rid in list(self._targets):
                self.engine.cancel(rid)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def tokens_per_second(self) -> float:
        """Generated tokens/s over the last RATE_WINDOW seconds."""
        engine = self.engine
        if engine is None or not self._samples:
            return 0.0
        now, total = time.perf_counter(), engine.stats.generation_tokens
        samples = self._samples.copy()  # atomic, unlike iterating a deque the engine thread appends to
        then = next((s for s in reversed(samples) if s[0] <= now - RATE_WINDOW), samples[0])
        # Never below 0: a sample taken just before the counters started again (`reset_stats`).
        return max(0.0, (total - then[1]) / (now - then[0])) if now > then[0] else 0.0

    async def metrics(self) -> str | None:
        return self.metrics_now()

    def metrics_now(self) -> str | None:
        """/metrics' text; None while a failed engine is replaced (its counters went with it)."""
        engine = self.engine
        return None if engine is None else metrics_text(engine, self.tokens_per_second())

    # ---- the engine thread ----

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        try:
            self._serve()
        finally:
            # MLX leaves a thread's streams to the interpreter's teardown, which aborted the server
            # now and then at exit ("terminate called without an active exception"): free them here.
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self.engine = self._make_engine()
            self.rows = self.engine.rows
        except BaseException as e:  # reported by start()
            self._start_error = e
            return
        finally:
            self._ready.set()
        self._warm_up()
        while True:
            try:
                for events in self.engine.rounds(self._stop):
                    self._dispatch(events)
                return
            except Exception as e:  # a bug or a device error: no request may wait forever for it
                failure = e
                # Logged as text: a log handler that kept the traceback would keep the failed engine.
                log.error("the engine failed; requests in flight end with an error, a fresh engine starts\n%s",
                          "".join(traceback.format_exception(e)).rstrip())
            self._fail_all(failure)

    def _warms(self) -> bool:
        return self.warm and self.engine.fixed and not self._stop.is_set()

    def _warm_up(self) -> None:
        if self._warms():
            self.warmup = warm_up(self.engine)
            w = self.warmup
            parts = ", ".join(f"{n} tokens {s:.1f} s" for n, s in zip(w.widths, w.width_seconds))
            prompts = (f"; prompts of {w.prompt_lengths[0]}-{w.prompt_lengths[-1]} tokens {w.prompt_seconds:.1f} s"
                       if w.prompt_lengths else "")
            carrying = (f" and {w.carrying} that carry prompts (chunks of "
                        f"{'/'.join(map(str, w.chunk_sizes))} tokens)" if w.carrying else "")
            rows = f"{w.rows[0]}-{w.rows[-1]} rows, " if len(w.rows) > 1 else ""
            print(f"mlxfun serve: compiled {w.variants} decode steps{carrying} ({rows}table widths {w.widths[0]}-"
                  f"{w.widths[-1]} tokens) and ran a request in {w.seconds:.1f} s ({parts}; first tokens and a request "
                  f"{w.rest_seconds:.1f} s{prompts})", file=sys.stderr, flush=True)
        self._warm.set()
        self._on_ready(True)

    def _dispatch(self, events: list[Event]) -> None:
        """One step's events to their requests' queues: one call into each event loop."""
        engine = self.engine
        outcomes = [outcome(engine.take(e.index)) if e.finish_reason is not None else None for e in events]
        sends = []
        with self._lock:
            for event, done in zip(events, outcomes):
                target = self._targets.get(event.index) if done is None else self._targets.pop(event.index, None)
                if target is not None:
                    sends.append((target, (event, done)))
        self._deliver(sends)
        now = time.perf_counter()
        if not self._samples or now - self._samples[-1][0] >= 0.25:
            self._samples.append((now, engine.stats.generation_tokens))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            targets, self._targets = self._targets, {}
            self._warm.clear()  # new requests wait (503) until the fresh engine is made and warm
            self.engine = None
            self._samples.clear()  # the fresh engine counts its tokens from 0
        self._on_ready(False)
        failed = (EngineFailed(f"the engine failed: {type(error).__name__}: {error}"), None)
        self._deliver([(target, failed) for target in dict.fromkeys(targets.values())])  # one per request's queue
        # The failed engine, its KV pool (most of a GPU's memory, in a server) included, is freed
        # before the fresh one allocates its own: its traceback's frames hold it too. (A fresh engine
        # made beside it ran out of memory building its first CUDA graph, on an H100.)
        error.__traceback__ = None
        gc.collect()
        mx.clear_cache()
        engine = self._make_engine()
        with self._lock:
            self.engine = engine
        self._warm_up()


def to_loops(sends: list[tuple[Target, tuple]]) -> None:
    """Put each item in its target's queue: one call into each event loop, run on its thread."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for (loop, q), item in sends:
        by_loop.setdefault(loop, []).append((q, item))
    for loop, items in by_loop.items():
        def put(items=items) -> None:
            for q, item in items:
                q.put_nowait(item)

        try:
            loop.call_soon_threadsafe(put)
        except RuntimeError:  # the loop has closed: nobody is waiting
            pass


def metrics_text(engine: Engine, tokens_per_second: float) -> str:
    """The engine's counters, gauges and latency percentiles in Prometheus' text format (called
    where the engine runs: the memory is its process')."""
    s = engine.stats
    lines = []

    def family(name: str, kind: str, help_: str) -> str:
        lines.extend([f"# HELP mlxfun_{name} {help_}", f"# TYPE mlxfun_{name} {kind}"])
        return f"mlxfun_{name}"

    for name, kind, help_, value in (
            ("requests_running", "gauge", "Requests holding a row.", s.running),
            ("requests_queued", "gauge", "Requests waiting for a row.", s.queued),
            ("requests_finished_total", "counter", "Requests finished (any reason).", s.requests),
            ("rows", "gauge", "Rows decoded together at most.", s.rows),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", s.prompt_tokens),
            ("generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens),
            ("generation_tokens_per_second", "gauge", f"Tokens generated per second over the last {RATE_WINDOW:g} s.",
             f"{tokens_per_second:.3f}"),
            ("kv_cache_bytes", "gauge", "Bytes of the KV cache now.", s.kv_bytes),
            ("kv_cache_capacity_tokens", "gauge", "KV cache slots per row now.", s.capacity),
            ("preemptions_total", "counter", "Rows taken back to make room in a full KV pool (their requests "
             "resume).", s.preemptions),
            ("step_traces_total", "counter", "Compiled steps traced (none after the warm-up).",
             engine.step_cache.traces if engine.step_cache is not None else 0),
            ("steps_total", "counter", "Decode steps run (all rows at once).", s.steps),
            ("busy_row_steps_total", "counter", "Rows holding a request, summed over decode steps (divided by "
             "steps times rows: how full the rows were).", s.busy_row_steps),
            ("admissions_total", "counter", "Times waiting requests were prefilled into free rows.", s.admissions),
            ("admissions_carried_total", "counter", "Admissions whose prompts rode along a decode step (of "
             "admissions_total).", s.carried),
            ("admission_seconds_total", "counter", "Host seconds spent admitting (prefill graphs built and queued, "
             "kernels built at a chunk shape's first sight, waits while no row decodes).",
             f"{s.admission_seconds:.6f}"),
            ("device_wait_seconds_total", "counter", "Host seconds the engine waited for the device before queuing "
             "a write into its KV pool.", f"{s.device_wait_seconds:.6f}"),
            ("idle_seconds_total", "counter", "Seconds the engine waited with no request running or queued (its "
             "clients' time between requests).", f"{s.idle_seconds:.6f}"),
            ("rounds_total", "counter", "Engine rounds (each queues a step and hands out the one before).", s.rounds),
            ("round_seconds_total", "counter", "Wall seconds of the engine's rounds.", f"{s.round_seconds:.6f}"),
            ("plain_rounds_total", "counter", "Rounds that neither admitted nor followed a round that did (the "
             "steady decode step).", s.plain_rounds),
            ("plain_round_seconds_total", "counter", "Wall seconds of the plain rounds.",
             f"{s.plain_round_seconds:.6f}")):
        lines.append(f"{family(name, kind, help_)} {value}")
    for name, window, help_ in (
            ("time_to_first_token_seconds", s.ttft, "Time to first token over the last requests (a window)."),
            ("inter_token_latency_seconds", s.itl, "Time between a request's tokens over the last tokens (a window).")):
        values = sorted(window.copy())  # deque.copy is atomic; iterating one another thread appends to is not
        full = family(name, "summary", help_)
        for q in (0.5, 0.9, 0.99):
            v = values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
            lines.append(f'{full}{{quantile="{q}"}} {v:.6f}')
        lines += [f"{full}_sum {sum(values):.6f}", f"{full}_count {len(values)}"]
    for name, help_, value in (
            ("memory_active_bytes", "Bytes MLX holds in the engine's process now (the device's memory on a GPU).",
             mx.get_active_memory()),
            ("memory_peak_bytes", "Most bytes MLX held at once in the engine's process.", mx.get_peak_memory())):
        lines.append(f"{family(name, 'gauge', help_)} {value}")
    return "\n".join(lines) + "\n"
