"""A progress line on stderr for long batch jobs (no dependency on tqdm)."""

from __future__ import annotations

import sys
import time

from mlxfun.events import Event


class Progress:
    def __init__(self, prompts: int, max_tokens: int, enabled: bool):
        self.prompts, self.enabled = prompts, enabled
        self.done = self.tokens = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, event: Event) -> None:
        self.tokens += 1
        self.done += event.finish_reason is not None
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.2 or self.done == self.prompts):
            self._last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            sys.stderr.write(f"\r{self.done}/{self.prompts} prompts done, {self.tokens} tokens, {rate:.1f} tokens/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
