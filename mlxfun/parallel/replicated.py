"""A scheduler replicated across a tensor-parallel group: the engine side of `mlxfun serve` under
`mlx.launch`.

Every rank of the group holds an `Engine` over its shard of the model (`mlxfun.shard`), and the
engines must take the same steps with the same rows, since each decode step meets in the same
all_sums. Rank 0 alone talks to clients: any of its threads may `submit` and `cancel`, which only
queue a message. Every rank's engine thread runs `serve` (or `step`), and each round starts with
rank 0's new messages broadcast to all ranks (`distributed.broadcast`: an all_gather of their size,
and of their bytes when there are any), which each rank applies in the same order before the
step. The engines then make the same decisions (their KV budget is agreed at construction) and
sample the same tokens (the same seeds and, after the all_sums, the same logits).

The round's broadcast is a host sync: the step queued in the round before finishes before the
next one is queued, so a replicated engine loses the one-step overlap of host and device work.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
from typing import Iterator

import numpy as np

from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.engine.events import Event
from mlxfun.engine.options import Request
from mlxfun.engine.records import Record
from mlxfun.errors import InputError
from mlxfun.model.load import Model
from mlxfun.parallel import distributed

_DTYPES = {"top_k": np.int32, "seed": np.uint32}  # the other Settings fields are float32


def encode(request: Request) -> dict:
    """A Request as JSON-ready values (settings as Python numbers: float32 round-trips exactly)."""
    return {"prompt": list(request.prompt), "max_tokens": request.max_tokens, "stop": list(request.stop),
            "logprobs": request.logprobs, "eos": sorted(request.eos),
            "settings": {f: getattr(request.settings, f).tolist() for f in sampling.Settings._fields}}


def decode(d: dict) -> Request:
    settings = sampling.Settings(*(np.array(d["settings"][f], _DTYPES.get(f, np.float32))
                                   for f in sampling.Settings._fields))
    return Request(tuple(d["prompt"]), d["max_tokens"], settings, tuple(d["stop"]), d["logprobs"],
                   frozenset(d["eos"]))


class ReplicatedEngine:
    """One `Engine` per rank of `group`, stepping in lockstep; rank 0 takes the requests.

    Engine options as `Engine`'s; `kv_memory` defaults to the smallest rank's budget."""

    def __init__(self, model: Model, group, rows: int = 8, *, prefill_step: int = 512,
                 max_kv_size: int | None = None, kv_memory: int | None = None):
        if model.config.tensor_group is None:
            raise InputError("a replicated engine runs a sharded model: mlxfun.shard(model, group) first")
        self.group, self.rank = group, group.rank()
        kv_memory = kv_memory or distributed.kv_memory(group)
        self.engine = Engine(model, rows, prefill_step=prefill_step, max_kv_size=max_kv_size, kv_memory=kv_memory)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # rank 0: messages not yet broadcast
        self._ids = itertools.count()
        self._lock = threading.Lock()  # ids in the order their messages are queued
        self._cancelling: set[int] = set()
        self._wake = threading.Event()

    # ---- rank 0, any thread ----

    def submit(self, request: Request) -> int:
        """Queue a checked Request for every rank; returns its id (the engines' id for it). Build
        the request on the thread that submits it (its settings are read here)."""
        self._only_rank0("submit")
        self.engine.check(request)  # the ranks agree on the KV budget: what fits here fits everywhere
        with self._lock:
            rid = next(self._ids)
            # Host values now: MLX evaluates an array only on the thread that recorded it, and every
            # rank's engine thread rebuilds the request from these.
            self._outbox.put(["submit", rid, encode(request)])
        self._wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        """Stop a request on every rank (see `Engine.cancel`); no event of it follows this call."""
        self._only_rank0("cancel")
        self._cancelling.add(rid)
        self._outbox.put(["cancel", rid, None])
        self._wake.set()

    def _only_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise InputError(f"only rank 0 takes requests: {what} was called on rank {self.rank}")

    # ---- every rank: the engine thread ----

    def sync(self, stop: bool = False) -> bool:
        """Apply rank 0's queued messages on every rank, in order; returns rank 0's `stop`."""
        messages = []
        if self.rank == 0:
            while True:
                try:
                    messages.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
        data = json.dumps({"messages": messages, "stop": stop}).encode() if self.rank == 0 else b""
        received = json.loads(distributed.broadcast(data, self.group))
        for kind, rid, body in received["messages"]:
            if kind == "submit":
                got = self.engine.submit(decode(body))
                if got != rid:
                    raise RuntimeError(f"rank {self.rank}'s engine gave request {rid} the id {got}: the engines of "
                                       "a replicated engine take requests only through it")
            else:
                self.engine.cancel(rid)
        return received["stop"]

    def step(self, stop: bool = False) -> tuple[list[Event], bool]:
        """One round on every rank: `sync`, then one engine step unless the engine is idle.
        -> (this round's events, rank 0's `stop`). Other ranks release finished records themselves."""
        stopping = self.sync(stop)
        events = [] if self.engine.idle else self.engine.step()
        events = [e for e in events if e.finish_reason is not None or e.index not in self._cancelling]
        for e in events:
            if e.finish_reason is not None:
                self._cancelling.discard(e.index)
                if self.rank != 0:
                    self.engine.take(e.index)
        return events, stopping

    def serve(self, stop: threading.Event, poll: float = 0.05) -> Iterator[Event]:
        """Every rank runs this until rank 0's `stop` is set and every request has finished; while
        idle, rank 0 waits up to `poll` seconds for a message and the other ranks wait in the
        broadcast. Yields each Event (on ranks other than 0 too: the same events)."""
        while True:
            if self.rank == 0 and self.engine.idle and self._outbox.empty() and not stop.is_set():
                self._wake.wait(poll)
                self._wake.clear()
            events, stopping = self.step(stop.is_set() if self.rank == 0 else False)
            yield from events
            if stopping and self.engine.idle:
                return

    def take(self, rid: int) -> Record:
        """Rank 0: release a finished request and return its record (see `Engine.take`)."""
        return self.engine.take(rid)
