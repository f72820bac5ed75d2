"""Speculative decoding's hook into the engine: when a round verifies drafts instead of decoding
one token, and how its verdict reaches the rows.

The engine asks `wants_round` at each step; when it says yes, `round` runs the step: admission,
then a verify round queued one ahead (`verify_ahead`) with a device drafter, or a synchronous one
(`verify`) with a host drafter. Otherwise the engine decodes plainly and tells this hook
(`decoded`, `after_plain_round`) so the policy can compare the two modes' measured rates. The
verification itself is array code in `speculative.py`; drafters are in `speculative.py` and
`drafting.py`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from mlxfun.engine.events import Event
from mlxfun.errors import InputError
from mlxfun.features import speculative
from mlxfun.features.drafting import DraftModel
from mlxfun.features.speculative import Verdict
from mlxfun.model.load import Model, load

if TYPE_CHECKING:
    from mlxfun.engine.core import Engine


class Speculation:
    def __init__(self, drafter: speculative.Drafter, k: int, policy: speculative.Policy):
        self.drafter, self.k, self.policy = drafter, k, policy
        self.last_decode: float | None = None
        self.streak = 0  # decode steps since the last verify round
        self.pipelined = False  # verify rounds are queued one ahead (`verify_ahead`)
        self.last_round: float | None = None  # when the last pipelined round was handed out

    @property
    def spill(self) -> int:
        """Positions a verify round queued near a request's end may write past it (`round_end`)."""
        return 2 * (self.k + 1)

    def round_end(self, engine: Engine, row: int) -> int:
        """The end of the positions a verify round queued now may write for `row`, while the round
        before may still be in flight (`verify_ahead`)."""
        return engine.scheduler.pos[row] + self.spill

    # ---- the engine's questions ----

    def wants_round(self, engine: Engine) -> bool:
        """Whether this round verifies drafts: some row is live or waiting, no live row has
        penalties (its counts would change inside a verified run) or a constraint (its mask
        would depend on the drafts), and the policy says it pays."""
        live = engine.scheduler.live_records()
        if not live and not engine.scheduler.pending and engine.inbox.empty():
            return False
        if not self.policy.enabled or any(r.mode.penalties or r.mode.masked for r in live):
            return False
        return self.policy.choose(engine.scheduler.ahead(), self.drafter.least(self.k),
                                  lambda: self.feed_steps(engine), speculative.headroom(len(live), self.k))

    def feed_steps(self, engine: Engine) -> float:
        """Decode steps the drafter's catch-up before its next round is expected to take: the
        tokens it lacks, each priced at its cost times the engine's prefill time per token
        (admissions made while nothing decoded), in timed decode steps. 0 where either is unknown."""
        rate, stats = self.policy.rate[False], engine.stats
        if not self.drafter.cost or not rate or not stats.timed_prompt_tokens:
            return 0.0
        return self.drafter.cost * self.drafter.lacking(engine) * stats.prompt_time / stats.timed_prompt_tokens * rate

    def decoded(self, now: float) -> None:
        """A plain decode step was queued at `now`: steady steps time the plain mode."""
        if self.last_decode is not None:
            self.streak += 1
            if self.streak >= 2:  # steady: the step before this one has been waited for
                self.policy.record(False, 1.0, now - self.last_decode)
        self.last_decode = now

    def leave_pipeline(self, engine: Engine) -> list[Event]:
        """Before a plain round: a pipelined round still in flight is handed out, so the host's
        positions are exact again before decoding."""
        events = engine.collect() if self.pipelined else []
        self.pipelined = False
        return events

    def after_plain_round(self, engine: Engine) -> None:
        if self.policy.enabled:
            self.policy.shadow(self.drafter.shadow(engine, self.k))

    # ---- a speculative round ----

    def round(self, engine: Engine) -> list[Event]:
        t0 = time.perf_counter()
        events = engine.admit()
        if self.drafter.device and engine.scheduler.pages.ring is None:
            if not self.pipelined:  # a run of pipelined rounds starts: the drafter catches up
                events += engine.collect()
                self.drafter.catch_up(engine, engine.scheduler.live_rows())
                self.pipelined, self.last_round = True, None
            queued = self.verify_ahead(engine) if engine.scheduler.needs_decode() else None
            events += engine.collect(keep=queued)
        else:
            events += engine.collect()
            if engine.scheduler.live_count():
                events += self.verify(engine, t0)
        self.last_decode, self.streak = None, 0
        return events

    def verify(self, engine: Engine, t0: float | None = None) -> list[Event]:
        """One verify round for the live rows (nothing in flight): each drafts up to k, one forward
        pass checks them all, and each row takes the tokens it accepted and one more. Where no row
        has a draft, a decode step instead (not timed as a verify round: the policy measures rounds
        that verify something)."""
        live = engine.scheduler.live_rows()
        drafts, valid, q = self.drafter.propose(engine, live, self.k)  # (B, k), (B, k), (B, k, V) or None
        proposed = np.array(valid).sum(axis=1).tolist()
        if not any(proposed):  # nothing to verify (prompt lookup found no n-gram): a decode step costs less
            engine.decode()
            return engine.collect()
        engine.scheduler.blocks_through(live, [engine.scheduler.pos[r] + self.k + 1 for r in live])
        engine.sync()
        out = self._queue(engine, live, drafts, valid, q)
        mx.eval(out, engine.runner.state)
        events, kept = self.take(engine, out, list(engine.scheduler.owner), proposed)
        if t0 is not None and kept:
            self.policy.record(True, kept, time.perf_counter() - t0, most=self.k + 1)
        return events

    def verify_ahead(self, engine: Engine) -> Verdict:
        """Queue a verify round whose drafts come from the device state (a device drafter) and
        leave it in flight: the next `collect` hands out the round before while this one runs.
        The host's positions lag the device by that round (at most k + 1 tokens), so blocks are
        allocated up to `round_end`."""
        live = engine.scheduler.live_rows()
        engine.scheduler.blocks_through(live, [self.round_end(engine, r) for r in live])  # (no ring here)
        engine.sync()
        drafts, valid, q = self.drafter.draft(engine, engine.runner.state, self.k)
        out = self._queue(engine, live, drafts, valid, q)
        engine.in_flight(out)
        return out

    def _queue(self, engine: Engine, live: list[int], drafts, valid, q) -> Verdict:
        """Queue the verify step for the live rows (the device state caught up: `Engine.sync`)."""
        out = engine.runner.verify(engine.roster().steps, drafts, valid, q)  # the live rows' mode, kept while they stay
        engine.stats.steps += 1
        engine.stats.verify_rounds += 1
        engine.stats.busy_row_steps += len(live)
        return out

    def handed_out(self, engine: Engine, out: Verdict, owners: list, pipelined: bool) -> list[Event]:
        """A pipelined round's verdict handed out by `collect` (`pipelined`: while the next round is
        in flight). Its time runs from the round before handed out to this one (a run's last
        round, handed out at once after, is not timed)."""
        events, kept = self.take(engine, out, owners)
        now = time.perf_counter() if pipelined else None
        if kept:
            self.policy.record(True, kept, None if now is None or self.last_round is None else now - self.last_round,
                               most=self.k + 1, least=self.drafter.least(self.k))
        self.last_round = now
        return events

    def take(self, engine: Engine, out: Verdict, owners: list, proposed: list[int] | None = None
             ) -> tuple[list[Event], float]:
        """Hand out a verify round's accepted tokens, in order: `owners[i]` is the request that
        row i held when it was queued; `proposed[i]`: drafts row i had (None: k, within
        max_tokens). A row that ends inside its run (EOS, a stop string, max_tokens) keeps the
        tokens up to there. -> (events, tokens per row the round gave)."""
        packed = out.packed.tolist()  # one read: (B, k + 2) count, then tokens (`step.verify_step`)
        tokens, counts = [row[1:] for row in packed], [row[0] for row in packed]
        logprob = None if out.logprob is None else out.logprob.tolist()
        top = None if out.top_ids is None else (out.top_ids.tolist(), out.top_logprobs.tolist())
        now = time.perf_counter()
        sched, stats, context = engine.scheduler, engine.stats, engine.config.max_position_embeddings
        events, rows, given = [], 0, 0
        row_of = {o: r for r, o in enumerate(sched.owner) if o is not None}  # rows may have moved since
        for i, rid in enumerate(owners):
            record = sched.requests.get(rid) if rid is not None else None
            if record is None or record.finish_reason is not None:
                continue  # ended (or cancelled) while this round was in flight
            r = row_of[rid]
            drafts = max(0, min(self.k, sched.remaining(r) - 1)) if proposed is None else proposed[i]
            stats.drafted += drafts
            stats.accepted += min(counts[i] - 1, drafts)
            rows, given = rows + 1, given + counts[i]
            sched.pos[r] += counts[i]  # KV now holds every verified position the row keeps
            self.drafter.verified(engine, r, counts[i])
            if record.first_token_time is not None:
                stats.itl.append(now - record.last_token_time)
            record.last_token_time = now
            for j in range(counts[i]):
                before = len(record.row.text.tokens)
                event = record.row.accept(rid, tokens[i][j], record.request.eos, context,
                                          None if logprob is None else logprob[i][j],
                                          None if top is None else (top[0][i][j], top[1][i][j]))
                stats.generation_tokens += len(record.row.text.tokens) - before
                events.append(event)
                if event.finish_reason is not None:
                    stats.requests += 1
                    engine.release(r, record)
                    break
        return events, given / rows if rows else 0.0


def drafter_for(draft, engine: Engine) -> speculative.Drafter | None:
    """The drafter for a `draft` option: None, "prompt-lookup", a draft Model (or what
    `mlxfun.load` loads one from: a path or repo id), or a Drafter."""
    if draft is None or isinstance(draft, speculative.Drafter):
        return draft
    if isinstance(draft, str) and draft == "prompt-lookup":
        return speculative.LookupDrafter()
    if isinstance(draft, (str, Path)):
        draft = load(draft)
    if isinstance(draft, Model):
        return DraftModel(draft, engine)
    raise InputError(f"draft_model must be a Model, a path or 'prompt-lookup', got {draft!r:.60}")
