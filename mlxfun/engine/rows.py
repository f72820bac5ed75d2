"""One prompt's output on the host: its tokens, text, log-probabilities and how it ended.

Shared by the static batch and the continuous-batching engine: each decode step hands every
live row its token, and the row decides whether it has finished (EOS, a stop string, its
`max_tokens`, or the model's context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxfun.engine.detok import RowText
from mlxfun.engine.events import Event, Stats
from mlxfun.engine.step import StepOut


@dataclass
class Row:
    prompt_len: int
    max_tokens: int
    text: RowText
    top_n: int = -1  # -1: no logprobs; 0: the chosen token's; n: and the n most likely
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    def accept(self, index: int, token: int, eos, context: int, lp: float | None, top) -> Event:
        """Take the next token; the Event carries any newly final text and the finish reason."""
        if token in eos:
            self.finish_reason = "stop"
            return Event(index, token, self.text.flush(), "stop")
        piece = self.text.add(token)
        lp = lp if self.top_n >= 0 else None
        tp = tuple(zip(top[0][: self.top_n], top[1][: self.top_n])) if top is not None and self.top_n > 0 else None
        if lp is not None:
            self.logprobs.append(lp)
        if tp is not None:
            self.top.append(tp)
        if self.text.stopped_at is not None:
            self.finish_reason = "stop"
        elif len(self.text.tokens) >= self.max_tokens or self.prompt_len + len(self.text.tokens) >= context:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            piece += self.text.flush()
        return Event(index, token, piece, self.finish_reason, lp, tp)

    @property
    def token_ids(self) -> list[int]:
        """Generated ids, without a closing EOS; a stop string keeps the tokens that completed it."""
        t = self.text
        return t.tokens if t.tokens_at_stop is None else t.tokens[: t.tokens_at_stop]


def host_values(out: StepOut):
    """A step's outputs as Python lists: (tokens, logprobs or None, per-row (top ids, top values) or None)."""
    logprob = None if out.logprob is None else out.logprob.tolist()
    top = None if out.top_ids is None else list(zip(out.top_ids.tolist(), out.top_logprobs.tolist()))
    return out.tokens.tolist(), logprob, top


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]  # generated ids, without the closing EOS
    finish_reasons: list[str]
    stats: Stats
    seeds: list[int]  # each row's sampling seed, to repeat the run
    logprobs: list[list[float]] | None = None  # per row, the chosen tokens' log-probabilities
    top_logprobs: list[list[tuple[tuple[int, float], ...]]] | None = None


def result(rows: list[Row], stats: Stats, seeds: list[int], top_n: int) -> GenerationResult:
    ids = [r.token_ids for r in rows]
    return GenerationResult(
        texts=[r.text.final_text for r in rows],
        token_ids=ids,
        finish_reasons=[r.finish_reason for r in rows],
        stats=stats,
        seeds=list(seeds),
        logprobs=[r.logprobs[: len(i)] for r, i in zip(rows, ids)] if top_n >= 0 else None,
        top_logprobs=[r.top[: len(i)] for r, i in zip(rows, ids)] if top_n > 0 else None,
    )
