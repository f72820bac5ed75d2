"""What generation hands out: per-token events and timing stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Event(NamedTuple):
    """One generated token of one row (a streaming event)."""

    index: int  # the prompt's index (an Engine's request id)
    token: int  # -1 on the closing event of a row that ended without a new token
    text: str  # the newly final text (may be empty: a character or stop string still pending)
    finish_reason: str | None  # "stop" or "length" on the row's last event, else None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    peak_memory_gb: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time if self.generation_time else 0.0

    def summary(self) -> str:
        return (f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s\n"
                f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tokens/s\n"
                f"Peak memory: {self.peak_memory_gb:.3f} GB")
