"""The engine in a process of its own, for the HTTP server (no HTTP here).

In one process the event loop's work per streamed token (JSON, SSE writes, a task wake-up) and the
engine's host work per step take turns on one GIL, and a decode step waits for the event loop: on
an H100 a 32-row server decoded at half the engine's offline rate. As vLLM and SGLang do, the
server's process keeps HTTP, templates and tokenizing, and a child process runs the engine (the
`Bridge`, unchanged, on its own thread) with a GIL of its own.

They talk over one pipe (`multiprocessing.Pipe`), in order:
- server -> engine: ("submit", token, requests), ("cancel", id), ("metrics", token), ("cut",), ("stop", s);
- engine -> server: ("started", rows, model without weights) or ("error", text), ("ready", bool),
  ("ack", token, ids, error), ("items", [(token, item)]) once per step, ("metrics", token, text).

A submission's ack goes out before any of its items: both are queued under one lock in the engine
process, and one thread, the `Outbox`, writes them in order. The engine thread never writes to the
pipe, so it never waits for the server's process to read; the server's event loop likewise queues
its messages for an `Outbox` of its own. When the engine process dies (a crash,
the OOM killer), every request in it ends with an `EngineFailed` item and a fresh process takes
over, as a fresh engine does after an exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from typing import Callable, NamedTuple

import mlx.core as mx

from mlxfun.engine import sampling
from mlxfun.engine.core import Engine, engine_for
from mlxfun.engine.kv_budget import process_memory_limit
from mlxfun.engine.options import GenerationConfig, Request
from mlxfun.errors import InputError, MlxfunError
from mlxfun.features import structured
from mlxfun.model.load import Model, load
from mlxfun.serve.serving import Bridge, Busy, EngineFailed, NotReady, name_os_thread, to_loops

log = logging.getLogger("mlxfun.serve")


class EngineSpec(NamedTuple):
    """What the engine process builds its engine from (picklable: it crosses to the child)."""

    model: str | None  # a GGUF file or model folder; None: the default model
    dtype: str | None
    rows: int
    defaults: GenerationConfig  # the command's generation flags (prefix cache, prompt cache, draft model)
    kv_memory: int | None  # bytes of KV pool; None: the engine's budget
    admit_wait: int | None = None  # rounds a queue that fits waits for more free rows; None: the engine's default
    mixed_tokens: int | None = None  # prompt tokens a decode step may carry; None: the engine's default

    def maker(self) -> Callable[[], Engine]:
        """Makes the engine (again after a failure), loading the model once."""
        loaded: list[Model] = []

        def make() -> Engine:
            if not loaded:
                loaded.append(load(self.model, dtype=self.dtype))
                mx.eval(loaded[0].params)
            # The process owns its share of the device: MLX trims its cache before the device runs out.
            limit = process_memory_limit()
            if limit is not None:
                mx.set_memory_limit(limit)
            return engine_for(loaded[0], self.rows, self.defaults, self.kv_memory, fixed_shapes=True,
                              admit_wait=self.admit_wait, mixed_tokens=self.mixed_tokens)

        return make


# ---- requests across the pipe ----


class Wired(NamedTuple):
    request: Request  # settings as NumPy arrays, no compiled constraint
    constraint: tuple[str, str, str] | None  # (kind, label, payload): compiled again where the engine runs


def wire(r: Request) -> Wired:
    settings = sampling.on_host(r.settings)
    source = None if r.constraint is None else r.constraint.source
    return Wired(dataclasses.replace(r, settings=settings, constraint=None), source)


def unwire(w: Wired, model: Model) -> Request:
    if w.constraint is None:
        return w.request
    return dataclasses.replace(w.request, constraint=structured.compiled(model.tokenizer, model.config.vocab_size,
                                                                         w.constraint))


# ---- the engine's process ----


class Outbox:
    """Messages written to a pipe in order by a thread of their own, so that the thread that sends
    them never waits for the other side to read (a full pipe): the engine thread's steps' items,
    and the server's event loop's submissions (at 128 requests at once, writing them on the loop
    blocked it 0.3 ms a request on the CPU while the engine process was slow to read).
    `failed(conn, message, token, error)` runs on that thread when a message cannot be written;
    by default (the engine process') a closed pipe drops it and anything else is salvaged."""

    def __init__(self, conn, name: str = "mlxfun-outbox",
                 failed: Callable[[object, tuple, int | None, Exception], None] | None = None):
        self._conn, self._failed = conn, failed or _salvage
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # a message put after `close` fails rather than waiting forever
        self._closed = False
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def put(self, message, token: int | None = None) -> None:
        """Queue `message`; `token` is handed to `failed` should it not be written."""
        with self._lock:
            if not self._closed:
                self._queue.put((message, token))
                return
        self._failed(self._conn, message, token, OSError("the pipe was closed"))

    def _write(self) -> None:
        while (item := self._queue.get()) is not None:
            message, token = item
            try:
                self._conn.send(message)
            except Exception as e:
                self._failed(self._conn, message, token, e)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop (waiting up to `timeout` s)."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)


def _salvage(conn, message: tuple, token: int | None, error: Exception) -> None:
    """The engine process' `Outbox.failed`: the server's process gone (nobody reads the message),
    or something in it does not pickle (a bug): then only its submissions fail."""
    if isinstance(error, OSError):
        return
    log.error("the engine process could not send a message to the server", exc_info=error)
    try:
        conn.send(salvaged(message, error))
    except Exception:
        pass


def salvaged(message: tuple, error: Exception) -> tuple:
    """A message that failed to pickle, with what does not pickle replaced: a step's item by an
    `EngineFailed` item (its submission's requests end with a server error, the others' items go),
    an ack's error by its text."""
    failed = f"the engine's answer could not be sent: {type(error).__name__}: {error}"
    if message[0] == "items":
        return ("items", [(token, item if _pickles(item) else (EngineFailed(failed), None))
                          for token, item in message[1]])
    if message[0] == "ack":
        _, token, ids, err = message
        return ("ack", token, ids, err if _pickles(err) else MlxfunError(f"{type(err).__name__}: {err}"))
    return message


def _pickles(x) -> bool:
    try:
        pickle.dumps(x)
        return True
    except Exception:
        return False


def engine_main(spec: EngineSpec, conn, max_queued: int, warm: bool) -> None:
    """The child: the Bridge on its engine thread, this thread reading the server's messages."""
    name_os_thread("mlxfun-engproc")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group: the server decides
    outbox = Outbox(conn)
    lock = threading.Lock()  # an ack queued before its requests' items

    def send(message) -> None:
        with lock:
            outbox.put(message)

    bridge = Bridge(spec.maker(), max_queued, warm, deliver=lambda sends: send(("items", sends)),
                    on_ready=lambda ready: send(("ready", ready)))
    try:
        bridge.start()
    except BaseException as e:  # the model or a flag: the server prints it and exits
        send(("error", f"{type(e).__name__}: {e}" if not isinstance(e, MlxfunError) else str(e)))
        outbox.close()
        return
    model = bridge.engine.model
    send(("started", bridge.rows, Model(model.config, None, model.tokenizer, model.source)))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server's process is gone
                break
            kind = message[0]
            if kind == "submit":
                _, token, wired = message
                with lock:
                    try:
                        ids, error = bridge.submit_to([unwire(w, model) for w in wired], token), None
                    except (Busy, InputError) as e:
                        ids, error = None, e
                    outbox.put(("ack", token, ids, error))
            elif kind == "cancel":
                bridge.cancel(message[1])
            elif kind == "metrics":
                send(("metrics", message[1], bridge.metrics_now()))
            elif kind == "cut":
                bridge.cut()
            elif kind == "reset_stats":
                bridge.reset_stats()
            elif kind == "stop":
                bridge.stop(message[1])
                break
    finally:
        bridge.stop()
        outbox.close()
        conn.close()


# ---- the server's side ----


class EngineProcess:
    """The server's handle on the engine process, with the Bridge's interface (what the HTTP
    layer uses): `submit` -> (ids, asyncio queue of (Event, Outcome | None) items), `cancel`,
    `ready`, `metrics`, `cut`, `stop`. `model` has the config and tokenizer, not the weights."""

    def __init__(self, spec: EngineSpec, max_queued: int, warm: bool = True):
        self.spec, self.max_queued, self.warm = spec, max_queued, warm
        self.model: Model | None = None
        self.rows = 0
        self.pid: int | None = None
        self._ctx = multiprocessing.get_context("spawn")  # no copy of this process' threads or MLX state
        self._outbox: Outbox | None = None  # writes to the current engine process' pipe
        self._proc = None
        self._lock = threading.Lock()  # the tables below
        self._queues: dict[int, list] = {}  # token -> [target, requests still open]
        self._open: dict[int, int] = {}  # request id -> its submission's token
        # token -> (loop, future, the answer should the process die first)
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, object]] = {}
        self._abandoned: set[int] = set()  # submissions whose caller left before the ack
        self._tokens = itertools.count()
        self._started = threading.Event()
        self._warm = threading.Event()
        self._start_error: str | None = None
        self._stopping = False
        self._cut = False

    # ---- lifetime ----

    def start(self) -> None:
        """Start the engine process and wait until it has made its engine (not for its warm-up)."""
        self._spawn()
        self._started.wait()
        if self._start_error is not None:
            raise MlxfunError(self._start_error)

    def _spawn(self) -> None:
        self._started.clear()
        self._start_error = None
        ours, theirs = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=engine_main, args=(self.spec, theirs, self.max_queued, self.warm),
                                       name="mlxfun-engine", daemon=True)
        self._proc.start()
        theirs.close()
        if self._outbox is not None:
            self._outbox.close(0)  # what it still holds fails on the old pipe (`_unsent`)
        self._outbox, self.pid = Outbox(ours, "mlxfun-writer", self._unsent), self._proc.pid
        threading.Thread(target=self._read, args=(ours, self._proc), name="mlxfun-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._stopping

    @property
    def ready(self) -> bool:
        return self.alive and self._warm.is_set()

    @property
    def cut_off(self) -> bool:
        return self._cut

    def cut(self) -> None:
        self._cut = True
        self._send(("cut",))

    def reset_stats(self) -> None:
        self._send(("reset_stats",))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what runs, let the engine process finish, and wait for it."""
        if self._proc is None or self._stopping:
            return
        self._stopping = True
        self._send(("stop", timeout))
        self._proc.join(timeout + 10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    # ---- requests ----

    async def submit(self, requests: list[Request]) -> tuple[list[int], asyncio.Queue]:
        """As `Bridge.submit`: all or none, Busy when full, InputError when one could never fit."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        answer = loop.create_future()
        with self._lock:
            if not self.alive:
                raise Busy("the server is shutting down")
            if not self._warm.is_set():
                raise NotReady("the server is warming up (compiling its steps); /health answers 200 once it is ready")
            held = sum(n for _, n in self._queues.values())
            if held + len(requests) > self.rows + self.max_queued:
                raise Busy(f"{held} requests in flight; the server takes {self.rows} rows and {self.max_queued} queued")
            token = next(self._tokens)
            self._queues[token] = [(loop, q), len(requests)]
            self._waiting[token] = (loop, answer, (None, NotReady("the engine process died; a fresh one is starting")))
        self._send(("submit", token, [wire(r) for r in requests]), token)
        try:
            ids, error = await answer
        except asyncio.CancelledError:  # the client left: its requests are cancelled once their ids come
            with self._lock:
                self._abandoned.add(token)
            raise
        if error is not None:
            raise error
        return ids, q

    def cancel(self, rid: int) -> None:
        with self._lock:
            token = self._open.pop(rid, None)
            if token is None:
                return
            self._close(token)
        self._send(("cancel", rid))

    async def metrics(self) -> str | None:
        """/metrics' text; None while no engine runs (a fresh process still loads its model)."""
        if not self._started.is_set() or self._start_error is not None:
            return None
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        with self._lock:
            token = next(self._tokens)
            self._waiting[token] = (loop, answer, None)
        self._send(("metrics", token), token)
        return await answer

    def _send(self, message, token: int | None = None) -> None:
        """Queue for the engine process (the event loop never waits for it to read); when it is
        gone, the answer awaited under `token` is its failure value (the reader ends the requests
        it held)."""
        self._outbox.put(message, token)

    def _unsent(self, conn, message, token: int | None, error: Exception) -> None:
        """`Outbox.failed`, on the writer's thread: a message the engine process did not get."""
        if not isinstance(error, (OSError, ValueError)):  # not a closed pipe: something does not pickle
            log.error("a message to the engine process could not be sent", exc_info=error)
        with self._lock:
            waiting = self._waiting.pop(token, None)
        if waiting is not None:
            _resolve(waiting, waiting[2])

    def _close(self, token: int) -> None:
        """One request of a submission is done (under _lock)."""
        entry = self._queues.get(token)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._queues[token]

    # ---- the reader thread: the engine process' messages ----

    def _read(self, conn, proc) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "items":
                self._items(message[1])
            elif kind == "ack":
                _, token, ids, error = message
                with self._lock:
                    abandoned = token in self._abandoned
                    self._abandoned.discard(token)
                    if ids is not None and not abandoned:
                        self._open.update((rid, token) for rid in ids)
                    else:
                        self._queues.pop(token, None)
                    waiting = self._waiting.pop(token, None)
                if abandoned and ids is not None:
                    for rid in ids:
                        self._send(("cancel", rid))
                if waiting is not None:
                    _resolve(waiting, (ids, error))
            elif kind == "metrics":
                with self._lock:
                    waiting = self._waiting.pop(message[1], None)
                if waiting is not None:
                    _resolve(waiting, message[2])
            elif kind == "ready":
                (self._warm.set if message[1] else self._warm.clear)()
            elif kind == "started":
                _, self.rows, self.model = message
                self._started.set()
            elif kind == "error":
                self._start_error = message[1]
                self._started.set()
                log.error("the engine process could not start: %s", message[1])
        proc.join()
        self._gone(proc.exitcode)

    def _items(self, sends: list) -> None:
        """One step's items to their requests' queues: one call into each event loop."""
        out = []
        with self._lock:
            for token, item in sends:
                entry = self._queues.get(token)
                if entry is None:
                    continue
                event, outcome = item
                if isinstance(event, EngineFailed):
                    del self._queues[token]
                    for rid in [r for r, t in self._open.items() if t == token]:
                        del self._open[rid]
                elif outcome is not None:
                    if self._open.pop(event.index, None) is None:
                        continue  # cancelled here: nobody reads it
                    self._close(token)
                elif event.index not in self._open:
                    continue
                out.append((entry[0], item))
        to_loops(out)

    def _gone(self, exitcode: int | None) -> None:
        """The engine process has ended: on purpose, or it died and a fresh one takes over."""
        self._warm.clear()
        with self._lock:
            queues, self._queues, self._open = self._queues, {}, {}
            waiting, self._waiting = self._waiting, {}
        if self._start_error is not None or not self._started.is_set():  # it could not make its engine
            self._start_error = self._start_error or f"the engine process exited with code {exitcode}"
            self._started.set()
            return
        failed = (EngineFailed(f"the engine process died (exit code {exitcode})"), None)
        to_loops([(target, failed) for target, _ in queues.values()])
        for w in waiting.values():
            _resolve(w, w[2])
        if self._stopping:
            return
        log.error("the engine process died (exit code %s); requests in flight end with an error, a fresh one starts",
                  exitcode)
        self._spawn()


def _resolve(waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future, object], value) -> None:
    loop, future, _ = waiting

    def set_() -> None:
        if not future.done():
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(set_)
    except RuntimeError:  # the loop has closed
        pass

