"""Progress of a long job on stderr (no dependency on tqdm).

On a terminal, one live line redrawn at most 10 times a second. Elsewhere (a log file, a pipe, CI),
plain lines that each make sense alone: one per twentieth of the job and at least one every
`interval` seconds, so a log shows that the job is alive and when it will end.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR = 24  # characters of the terminal bar
# No ETA until this many requests finished in this run: the first ones finish after a shared
# prefill, and an ETA from them was far off (22 min shown for 4 real).
ETA_AFTER = 3
# Each new estimate of the end moves the shown one this share of the way, so one fast or slow
# request does not make the ETA jump.
ETA_SMOOTHING = 0.3


class Progress:
    """Requests done out of `total` (of which `done` were finished before this run), tokens, speed and ETA."""

    def __init__(self, total: int, done: int = 0, *, stream: TextIO | None = None, tty: bool | None = None,
                 interval: float = 30.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.done, self.start_done = total, done, done
        self.tokens = 0
        self.interval = interval
        self.start = self._last = time.perf_counter()
        self._every = max(1, (total - done) // 20)  # plain lines: one per this many requests
        self._next = done + self._every
        self._drawn = False
        self._shown = -1  # `done` in the last plain line
        self._end: float | None = None  # the smoothed estimate of when the job ends (perf_counter time)

    def update(self, tokens: int, finished: int = 0) -> None:
        """`tokens` generated so far in this run; `finished` more requests done."""
        self.tokens = tokens
        self.done += finished
        if finished:
            self._estimate_end()
        self._maybe_show(line_due=finished > 0 and self.done >= self._next)

    def line(self) -> str:
        """'12/40 done (30%), 1534 tokens, 45.1 tok/s, ETA 0:01:02'."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        if self.done >= self.total:
            eta = _clock(0)
        else:
            eta = _clock(max(self._end - now, 0.0)) if self._end is not None else "?"
        pct = 100 * self.done // max(self.total, 1)
        return (f"{self.done}/{self.total} done ({pct}%), {self.tokens} tokens, {self.tokens / elapsed:.1f} tok/s, "
                f"ETA {eta}")

    def _estimate_end(self) -> None:
        """Move the estimated end toward this run's average rate's, once ETA_AFTER requests are done."""
        new = self.done - self.start_done
        if new < ETA_AFTER:
            return
        now = time.perf_counter()
        end = now + (now - self.start) / new * (self.total - self.done)
        self._end = end if self._end is None else self._end + ETA_SMOOTHING * (end - self._end)

    def clear(self) -> None:
        """Erase the live line (before other output goes to the terminal)."""
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        """The final state: the bar left on its own line, or a last plain line."""
        if self.tty:
            self._draw()
            self.stream.write("\n")
        elif self._shown != self.done:
            self.stream.write(f"progress: {self.line()}\n")
        self.stream.flush()

    def _maybe_show(self, line_due: bool = False) -> None:
        now = time.perf_counter()
        if self.tty and now - self._last >= 0.1:
            self._last = now
            self._draw()
        elif not self.tty and (line_due or now - self._last >= self.interval):
            self._last = now
            while self._next <= self.done:
                self._next += self._every
            self._shown = self.done
            self.stream.write(f"progress: {self.line()}\n")
            self.stream.flush()

    def _draw(self) -> None:
        filled = BAR * self.done // max(self.total, 1)
        self.stream.write(f"\r\x1b[K[{'#' * filled}{'.' * (BAR - filled)}] {self.line()}")
        self.stream.flush()
        self._drawn = True


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
