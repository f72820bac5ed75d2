"""Structured output's hook into the engine: each constrained row's matcher follows its tokens,
and the masks of the tokens each row may take next are computed while the device runs.

A masked decode step (`Engine` when some live row is constrained) hands the steps in flight to
the mask worker, a thread of its own: it reads their tokens, advances the constrained rows'
matchers by them and fills the next step's masks (llguidance, without the GIL), while the engine
thread queues the forward pass. The sampling half then takes the masks. The worker reads handles
of its own (`step.reading`): an MLX array is not safe to touch from two threads, and the engine
thread's next evaluation takes the same tokens as input.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from mlxfun.engine.events import Event
from mlxfun.engine.records import Record
from mlxfun.engine.rows import host_values
from mlxfun.engine.step import StepOut, reading
from mlxfun.features import structured
from mlxfun.kernels.mapped import HostArray


class Constraints:
    """The constrained rows' matchers and masks, for an engine over a vocabulary of `vocab_size`."""

    def __init__(self, vocab_size: int):
        self.words = structured.words(vocab_size)
        self._masks: HostArray | None = None  # (rows, V/32) uint32: the constrained rows' allowed tokens
        self._worker: ThreadPoolExecutor | None = None

    def start(self, ready: list[tuple[StepOut, list]], owners: list, requests: dict[int, Record]) -> Future:
        """Hand the steps in flight (`ready`: each step's output and the requests its rows held)
        to the worker, which advances the matchers by their tokens and fills the masks for rows
        `owners` -> a future of each step's host values (`rows.host_values`)."""
        reads = [reading(out) for out, _ in ready]
        mx.async_eval(reads)  # scheduled here: the worker thread has no stream
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mlxfun-masks")
        return self._worker.submit(self._read_and_mask, reads, [o for _, o in ready], list(owners), requests,
                                   self._buffer(len(owners)))

    def device(self) -> mx.array:
        """The masks the last `start` filled, as the device reads them (in place on a GPU)."""
        return self._masks.device()

    def advance(self, record: Record, event: Event, matched: bool = False) -> Event:
        """A constrained row's matcher takes its new token (unless `matched`: it has); once nothing
        but EOS can follow, the row ends ("stop", as EOS would end it a step later)."""
        if record.matcher is None or event.finish_reason is not None:
            return event
        if not matched:
            match_one(record, event.token)
        done = record.error is not None or record.complete  # (while masks are computed, matchers are not read)
        if not done:
            return event
        record.row.finish_reason = "stop"
        return event._replace(text=event.text + record.row.text.flush(), finish_reason="stop")

    def _read_and_mask(self, reads: list[StepOut], step_owners: list, owners: list, requests: dict[int, Record],
                       out: np.ndarray) -> list:
        """On the worker: the steps read (waiting for the device without the GIL), the constrained
        rows' matchers advanced by their tokens, and out (B, W) <- the masks of the rows `owners`
        hold for the next token. -> each step's host values."""
        values = [host_values(r) for r in reads]
        for who, (tokens, _, _) in zip(step_owners, values):
            for rid, token in zip(who, tokens):
                record = requests.get(rid) if rid is not None else None
                if record is not None:
                    match_one(record, token)
        structured.fill_masks([_mask_matcher(requests.get(o) if o is not None else None) for o in owners], out)
        return values

    def _buffer(self, rows: int) -> np.ndarray:
        """The host side of the masks' array (`mapped.HostArray`: on a GPU the device reads it in
        place); the worker fills it after reading the tokens of the step that read it last."""
        if self._masks is None or self._masks.host.shape[0] != rows:
            self._masks = HostArray((rows, self.words), np.uint32, 0xFFFFFFFF)
        return self._masks.host


def match_one(record: Record, token: int) -> None:
    """A live constrained row's matcher takes its token; an EOS is never taken (the row ends on it)."""
    if record.matcher is None or record.finish_reason is not None or record.error or token in record.request.eos:
        return
    try:
        record.matcher.advance(token)
        record.complete = record.matcher.is_finished
    except RuntimeError as e:  # the grammar engine failed (a resource limit): the row ends, saying why
        record.error = str(e)


def _mask_matcher(record: Record | None) -> structured.Matcher | None:
    """The matcher whose mask a row's next token needs; None (no mask) for a free row and a row
    that ends now (its matcher failed, or nothing but EOS may follow)."""
    if record is None or record.matcher is None or record.finish_reason is not None or record.error:
        return None
    return None if record.complete else record.matcher
