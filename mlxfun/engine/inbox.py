"""The engine's inbox: how any thread reaches the engine thread.

`submit` and `cancel` may be called from any thread; they only put a message here, which the
engine thread drains at the start of each step (`Engine.admit`), so no engine state is shared
between threads.
"""

from __future__ import annotations

import itertools
import queue
import threading

from mlxfun.engine.records import Record


class Inbox:
    def __init__(self):
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self.cancelling: set[int] = set()  # ids cancelled whose closing event has not been taken
        self.wake = threading.Event()  # set by every message, for an engine waiting for work

    def new_id(self) -> int:
        with self._id_lock:
            return next(self._ids)

    def submit(self, record: Record) -> None:
        self._messages.put(("submit", record))
        self.wake.set()

    def cancel(self, rid: int) -> None:
        self.cancelling.add(rid)
        self._messages.put(("cancel", rid))
        self.wake.set()

    def empty(self) -> bool:
        return self._messages.empty()

    def size(self) -> int:
        return self._messages.qsize()

    def drain(self) -> tuple[list[Record], list[int]]:
        """On the engine thread: the messages so far -> (records submitted, ids to cancel), in order
        within each kind (a request submitted and cancelled in one drain is queued, then cancelled)."""
        submitted, cancelled = [], []
        while True:
            try:
                kind, item = self._messages.get_nowait()
            except queue.Empty:
                return submitted, cancelled
            (submitted if kind == "submit" else cancelled).append(item)
