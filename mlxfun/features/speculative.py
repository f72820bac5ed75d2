"""Speculative decoding inside the batch: every row drafts k tokens, one forward pass verifies all
rows' k + 1 positions, and each row keeps what it accepted.

`accept` is the array code of verification. A greedy row keeps drafts while they equal the
target's argmax and then takes the argmax where they stop (the correction, or after k accepted
drafts the bonus token): exactly the tokens greedy decoding gives. A sampled row uses standard
speculative rejection sampling: draft d_i is kept with probability min(1, p(d_i) / q(d_i)), and at
the first rejection a token is drawn from max(0, p - q), renormalised (after k kept drafts, from
p): the target distribution p, whatever the drafts. Its randomness is a counter-based hash of
(seed, the index of the token being decided), so a seeded row is the same alone or in any batch.

Rejected positions' KV stays in the cache at positions beyond the row's own, hidden by causality
(masks come from slot positions) and overwritten as the row advances: nothing is recomputed.

Drafters: `PromptLookup` proposes on the host from n-grams of the row's own prompt and output
(each round waits for the verdict before it); `DraftModel` (in `mlxfun.features.drafting`) proposes on
the device from a smaller model with the same tokenizer, so the engine queues each round before
it reads the one before (`Drafter.device`).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from mlxfun.engine import sampling
from mlxfun.kernels.mapped import HostArray

# Salt for the acceptance draws, so they never coincide with the token draws of the same step.
ACCEPT_SALT = 0x2545F491


class Verdict(NamedTuple):
    tokens: mx.array  # (B, k + 1) int32: the row's new tokens are the first `count`
    count: mx.array  # (B,) int32: accepted drafts + 1
    logprob: mx.array | None  # (B, k + 1) float32
    top_ids: mx.array | None  # (B, k + 1, n) int32
    top_logprobs: mx.array | None  # (B, k + 1, n) float32
    # (B, k + 2) int32: count, then tokens, as one array, so the host reads both in one transfer
    # (on CUDA each read of a device array is a copy to host memory of its own); `step.verify_step` sets it.
    packed: mx.array | None = None


def accepted(ok: mx.array) -> mx.array:
    """ok (B, k) bool -> (B,) int32: how many drafts are kept (the run of True from the start)."""
    return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1).astype(mx.int32)


def greedy_verdict(logits: mx.array, drafts: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
    """logits (B, k + 1, V), drafts (B, k), valid (B, k) -> (tokens (B, k + 1), count (B,))."""
    target = sampling.greedy(logits)  # (B, k + 1)
    count = accepted((drafts == target[:, :-1]) & valid) + 1  # (B,)
    return target, count


def sampled_verdict(logits: mx.array, drafts: mx.array, valid: mx.array, draft_probs: mx.array | None,
                    settings: sampling.Settings, steps: mx.array, search: sampling.Search) -> tuple[mx.array, mx.array]:
    """Rejection sampling for every row (temperature-0 rows are handled by `greedy_verdict`).
    draft_probs (B, k, V) is q; None: deterministic drafts (q is one-hot on the draft)."""
    B, K1, V = logits.shape
    k = K1 - 1
    rows = sampling.Settings(*(mx.repeat(f, K1) for f in settings))  # one row of settings per position
    p = mx.softmax(sampling.filter_logits(logits.reshape(B * K1, V).astype(mx.float32), rows, search=search),
                   axis=-1).reshape(B, K1, V)  # (B, k + 1, V) the target distribution
    hot = (mx.arange(V)[None, None, :] == drafts[:, :, None]) & valid[:, :, None]  # (B, k, V)
    q = hot.astype(mx.float32) if draft_probs is None else mx.where(valid[:, :, None], draft_probs, 0.0)
    p_d = mx.take_along_axis(p[:, :k], drafts[:, :, None], axis=-1)[..., 0]  # (B, k)
    q_d = mx.take_along_axis(q, drafts[:, :, None], axis=-1)[..., 0]  # (B, k)
    index = steps[:, None] + mx.arange(k)[None, :]  # (B, k): the token index each draft would take
    seed = mx.broadcast_to((settings.seed ^ ACCEPT_SALT)[:, None], index.shape)
    u = sampling.uniform(seed.reshape(-1), index.reshape(-1), 1).reshape(B, k)  # (B, k)
    count = accepted(valid & (u * q_d < p_d)) + 1  # (B,)
    residual = mx.concatenate([mx.maximum(p[:, :k] - q, 0.0), p[:, k:]], axis=1)  # (B, k + 1, V)
    at = mx.take_along_axis(residual, (count - 1)[:, None, None], axis=1)[:, 0]  # (B, V)
    noise = sampling.gumbel(settings.seed, steps + count - 1, V)  # (B, V)
    token = sampling.greedy(mx.log(at) + noise)  # (B,) -inf where the residual is 0
    place = mx.arange(K1)[None, :]
    padded = mx.concatenate([drafts, mx.zeros((B, 1), mx.int32)], axis=1)
    return mx.where(place < (count - 1)[:, None], padded, token[:, None]), count


def verdict(sample: bool, search: sampling.Search, top_logprobs: int, logits: mx.array, drafts: mx.array,
            valid: mx.array, draft_probs: mx.array | None, settings: sampling.Settings, steps: mx.array) -> Verdict:
    """logits (B, k + 1, V) of the target at each verified position -> each row's new tokens."""
    logits = logits.astype(mx.float32)
    tokens, count = greedy_verdict(logits, drafts, valid)
    if sample:
        s_tokens, s_count = sampled_verdict(logits, drafts, valid, draft_probs, settings, steps, search)
        hot = (settings.temperature > 0)[:, None]
        tokens, count = mx.where(hot, s_tokens, tokens), mx.where(hot[:, 0], s_count, count)
    if top_logprobs < 0:
        return Verdict(tokens, count, None, None, None)
    B, K1, V = logits.shape
    logp = sampling.logprobs(logits.reshape(B * K1, V))  # (B (k + 1), V)
    chosen = sampling.chosen_logprob(logp, tokens.reshape(-1)).reshape(B, K1)
    if top_logprobs == 0:
        return Verdict(tokens, count, chosen, None, None)
    ids, values = sampling.top_logprobs(logp, top_logprobs)
    return Verdict(tokens, count, chosen, ids.reshape(B, K1, -1), values.reshape(B, K1, -1))


# ---- drafters ----


class Drafter:
    """What the engine asks of a drafter, each call on the engine thread: the next k tokens of
    live rows; hooks when rows are admitted, verified and released.

    A host drafter (`device = False`) implements `propose`, which reads the rows' tokens on the
    host: each round waits for the verdict before it. A device drafter (`device = True`)
    implements `draft`, which proposes from the device state the last round left, as lazy arrays:
    the engine queues round n + 1 before it reads round n's verdict, so the host's work (and the
    launch of the next round) overlaps the device's, as in plain decoding."""

    device = False
    # A lower bound on what one step of drafting costs, in decode steps of the target: 0 for a host
    # drafter (prompt lookup); for a draft model, its step's share of the target's
    # (`drafting.step_cost`). `Policy` judges a round it could not time by it.
    cost = 0.0

    def least(self, k: int) -> float:
        """A verify round's least cost in decode steps of the target: the verify pass, and k + 1
        steps of drafting (a draft model's last step writes the k-th draft's KV)."""
        return 1.0 + (k + 1) * self.cost

    def propose(self, engine, rows: list[int], k: int) -> tuple[mx.array, mx.array, mx.array | None]:
        """-> drafts (B, k) int32, valid (B, k) bool, and the draft distributions (B, k, V) or None
        (drafts that are certain: q is one-hot)."""
        raise NotImplementedError

    def draft(self, engine, state, k: int) -> tuple[mx.array, mx.array, mx.array | None]:
        """Device drafters: `propose` from `state` (a `step.DecodeState`: each row's last token,
        its position, its tokens generated so far), reading nothing on the host."""
        raise NotImplementedError

    def catch_up(self, engine, rows: list[int]) -> None:
        """Device drafters, before a run of pipelined rounds (nothing in flight): bring what they
        keep per row up to the rows' tokens (plain decode steps may have added some)."""

    def admitted(self, engine, rows: list[int]) -> None:
        pass

    def verified(self, engine, row: int, count: int) -> None:
        """A round's verdict for `row`, read on the host: it kept `count` tokens."""

    def released(self, engine, row: int) -> None:
        pass

    def reorder(self, engine, keep: list[int]) -> None:
        """The engine's rows `keep` became its rows 0, 1, ... (`Engine.shrink_rows`)."""

    def lacking(self, engine) -> int:
        """Tokens this drafter must take in before its next round beyond the round's own (a draft
        model's catch-up: the prompts of rows it has not seen, the tokens plain steps added). 0 by
        default."""
        return 0

    def shadow(self, engine, k: int) -> list[int]:
        """After plain decode steps' tokens were handed out: the tokens verify rounds would have
        given (accepted drafts + 1) where that is now known, for drafters that can tell at no cost
        (the policy's estimate while speculation is off). None by default."""
        return []


# Rows a free drafter drafts for in the shadow while speculation is off (the policy is batch-wide,
# so a few rows estimate it; each shadow round costs the host a lookup).
SHADOW_ROWS = 4


class LookupDrafter(Drafter):
    """Prompt lookup for the engine's rows: drafts from each row's own prompt and output."""

    def __init__(self):
        self.lookup = PromptLookup()
        # request id -> (its token count where its shadow round starts, that round's drafts or None)
        self.rounds: dict[int, tuple[int, list[int] | None]] = {}
        # The drafts and their flags, written in place each round (the round before has been read:
        # a host drafter's rounds are synchronous); on a GPU a fresh upload stalls the device
        # while it migrates the pages (`mapped`).
        self.buffers: tuple[HostArray, HostArray] | None = None

    def shadow(self, engine, k: int) -> list[int]:
        """Verify rounds replayed on the tokens plain steps gave: a round starts where the one
        before ended, drafts from the row's history there, and keeps the drafts that match the
        tokens that followed, plus one. Rounds without a draft are not counted (the engine decodes
        plainly where no row has one). Exact for greedy rows; for sampled rows, a match stands in
        for rejection sampling's acceptance."""
        done = []
        live = [o for o in engine.scheduler.owner if o is not None][:SHADOW_ROWS]
        self.rounds = {rid: v for rid, v in self.rounds.items() if rid in live}
        for rid in live:
            record = engine.requests[rid]
            tokens = record.row.text.tokens
            start, drafts = self.rounds.get(rid, (len(tokens), None))
            while True:
                if drafts is None:
                    if start > len(tokens):
                        break
                    drafts = self.lookup.propose(list(record.request.prompt) + tokens[:start], k)
                    if not drafts:  # no draft here: a plain step, and the next round a token later
                        start, drafts = start + 1, None
                        continue
                if start + len(drafts) > len(tokens) and record.row.finish_reason is None:
                    break  # its outcome is not known yet
                after = tokens[start:start + len(drafts)]
                kept = next((i for i, (d, t) in enumerate(zip(drafts, after)) if d != t), len(after))
                done.append(kept + 1)
                start, drafts = start + kept + 1, None
            self.rounds[rid] = (start, drafts)
        return done

    def propose(self, engine, rows: list[int], k: int):
        B = len(engine.scheduler.owner)
        if self.buffers is None or self.buffers[0].host.shape != (B, k):
            self.buffers = HostArray((B, k), np.int32, 0), HostArray((B, k), np.bool_, 0)
        drafts, valid = self.buffers[0].host, self.buffers[1].host
        drafts[:], valid[:] = 0, False
        for r in rows:
            record = engine.requests[engine.scheduler.owner[r]]
            left = engine.scheduler.remaining(r) - 1  # tokens a draft may add before the row's limit
            if left > 0:
                d = self.lookup.propose(list(record.request.prompt) + record.row.text.tokens, min(k, left))
                drafts[r, :len(d)], valid[r, :len(d)] = d, True
        return self.buffers[0].device(), self.buffers[1].device(), None


class PromptLookup:
    """Drafts from the row itself: the tokens that followed the latest earlier occurrence of its
    last n tokens (n from `max_ngram` down to `min_ngram`), as in prompt-lookup decoding. Free to
    run; it pays off where output repeats its input (summaries, edits, code)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `history` (the row's prompt and output so far)."""
        seq = np.asarray(history, np.int32)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # every n-gram before the last
            hits = np.flatnonzero(np.all(windows == seq[-n:], axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start:start + k].tolist()
        return []


# Rounds of one try of the other mode. The engine times a round from the one before it: a
# pipelined verify round from the previous round's hand-out, a decode step from the step before
# once two have run. A try's third round is the first timed in both modes; a shorter try gave the
# policy nothing to compare.
TRY_ROUNDS = 3
# Timed rounds of each mode the rates are taken from (the latest; `Policy._add`), and the timed
# decode steps measured before the first comparison. On an H200 one decode
# step's time right after verify rounds ran up to 1.8x the steady one (8B, batch 32: 12.3 ms
# against 7): a rule that compared one such step with one verify round chose to speculate and
# lost 0.5-0.7x (7fbc90b:benchmarks/README.md, the rule's trace). Decode steps cost nothing to measure
# beyond not speculating meanwhile.
WINDOW = 8
MIN_DECODES = 3
# With a drafter that costs device time (a draft model), speculation must beat decoding by this
# much more before the rule turns it back on: each return drains the pipeline and feeds the draft
# model the plain tokens (15-35 ms on an H200 at batch 32, 2-5 decode steps of an 8B target),
# and near break-even the measured rates differ by more than their gap, so the rule went back
# and forth five times in 64 tokens (7fbc90b:benchmarks/README.md, tenth session).
ENTER = 1.1
# A costly drafter's measuring costs device time: each of its rounds takes at least `least` decode
# steps (`Drafter.least`), and a switch to it and back drains the pipeline and feeds the draft model
# the plain tokens. So its first measure, and each later try, runs only where its expected loss is at
# most BUDGET of the decode steps it is spread over (the work ahead; and the interval to the next
# try): an 8B target with a 1B drafter on an H200 lost 10-30% of a 64-token run to measuring alone,
# its first rounds 35-50 ms each at batch 32 against 8 ms a decode step (7fbc90b:benchmarks/README.md,
# tenth session). A free drafter (prompt lookup) measures at no cost and is never held back.
BUDGET = 0.03
# The first measure also pays the draft model's catch-up: the prompts it has not seen (8B with a 1B
# drafter at batch 32, prompts of 128 tokens: about 5 decode steps, unpriced before, where the rule
# expected 8.6 steps for the rest; the runs lost 2.6-3.5% at 512 tokens against a 3% budget). It is
# priced from the engine's measured prefill time, in decode steps' time, so a costly drafter's
# first measure waits for MIN_DECODES timed decode steps (plain decoding is what it is judged against).
# And what speculation can win shrinks as rows x (k + 1) nears COMPUTE_ROWS (`may_pay`), so the budget
# shrinks with it (`headroom`): measuring may cost what the measure can win back, not 3% everywhere.
COMPUTE_ROWS = 256
# Rounds the first measure of speculation takes: the untimed first, a warm-up, a timed one, and the
# one queued behind it; and the decode steps of a switch there and back, beyond its rounds (a drain
# and a catch-up: 2-5 steps of an 8B target at batch 32).
FIRST_ROUNDS = 4
SWITCH_STEPS = 2.0


class Policy:
    """When speculation pays, measured as the engine runs: the tokens per row per second of decode
    steps and of verify rounds, each over its latest WINDOW timed rounds. It speculates while
    verify rounds beat decode steps by `margin`, and tries the other mode for TRY_ROUNDS rounds once
    every `interval`, the interval doubling (up to `longest`) each time that try loses. Verifying
    k + 1 positions costs about one decode step while the step is bound by reading the weights
    (small batches on a GPU), and about k + 1 where it is bound by compute (large batches; the CPU's
    reference BLAS at any batch). While off, a drafter that can replay its rounds on the plain
    tokens (prompt lookup: `shadow`) keeps the speculating estimate current between tries. A
    costly drafter measures only where it can afford to (`budget`, see BUDGET; None: always): its
    expected loss, with the catch-up its drafter needs first (`feed`), within the batch's share of
    the budget (`headroom`) of the steps ahead."""

    def __init__(self, margin: float = 1.03, interval: int = 32, longest: int = 4096, enabled: bool = True,
                 budget: float | None = BUDGET):
        self.margin, self.base, self.longest, self.budget = margin, interval, longest, budget
        self.enabled = enabled  # False: never speculate (where it was measured never to pay)
        self.rate: dict[bool, float | None] = {True: None, False: None}  # speculating -> tokens/row/s
        self.seen: dict[bool, deque] = {m: deque(maxlen=WINDOW) for m in (True, False)}  # (tokens, seconds)
        self.rounds: deque = deque(maxlen=WINDOW)  # timed verify rounds' seconds
        self.warm = {True: False, False: False}
        self.interval, self.countdown = interval, interval
        self.current = True  # start by measuring speculation
        self.most: int | None = None  # the tokens per row a verify round gives at best (k + 1)
        self.bound = False  # rate[True] is `_kept_nothing`'s bound, not a measure
        self.trying = 0  # rounds left of the try under way
        self.costly = False  # the drafter's rounds cost device time (`least` > 1): switching back costs
        self.started = False  # the first measure of speculation has begun

    @property
    def round_seconds(self) -> float | None:
        """A verify round's time (the mean of the latest timed rounds)."""
        return sum(self.rounds) / len(self.rounds) if self.rounds else None

    def _add(self, speculating: bool, tokens: float, seconds: float) -> None:
        """One more timed round of a mode. Verify rounds' rate: the window's tokens over its
        seconds (their tokens vary). Decode steps' rate: the median step's (each gives one token;
        the steps right after a switch ran up to 2x a steady one, 8B at batch 32 on an H200)."""
        seen = self.seen[speculating]
        seen.append((tokens, seconds))
        if speculating:
            self.rate[True] = sum(t for t, _ in seen) / sum(s for _, s in seen)
        else:
            self.rate[False] = statistics.median(t / s for t, s in seen)

    def _best(self) -> bool:
        """Whether speculating is the better mode now (with ENTER's hysteresis for a costly drafter)."""
        need = self.margin * (ENTER if self.costly and not self.current else 1.0)
        return self.rate[True] > need * self.rate[False]

    def shadow(self, tokens: list[int]) -> None:
        """Rounds replayed while decoding plainly (`Drafter.shadow`): the tokens each would have
        given. With a verify round's measured time they say what speculating would do now, so a
        drafter whose drafts start to match (a summary that begins to quote) turns speculation
        back on at once, without waiting for a try. Used while not speculating, so the replayed
        rounds update the speculating rate the next choice compares."""
        if not tokens or self.round_seconds is None or self.rate[True] is None:
            return
        for t in tokens:
            self._add(True, t, self.round_seconds)

    def _kept_nothing(self, tokens_per_row: float, least: float) -> None:
        """A verify round whose time is unknown (a pipelined run's first). A round takes at least
        `least` decode steps' time (one for the verify pass, plus the drafter's steps at their
        lowest cost: `Drafter.least`), so one that gave no more tokens per row than that (by
        `margin`) lost, whatever it cost. Then speculation stops at once instead of after two
        timed rounds (the first is a warm-up), each of which costs a draft model a few decode
        steps (7fbc90b:benchmarks/README.md, 8B with a 1B drafter). Before any measure, the speculating
        rate becomes 0 (a bound the next timed round replaces) and the next try comes after
        twice the base interval; in a try of speculation, the try ends and counts as lost."""
        if tokens_per_row > self.margin * least:
            return
        if self.rate[True] is None:
            self.rate[True], self.bound, self.warm[True] = 0.0, True, True
            self.current, self.interval = False, min(self.longest, 2 * self.base)
            self.countdown = self.interval
        elif self.trying and not self.current:  # a try of speculation (decoding is the better mode)
            self.trying, self.interval = 0, min(self.longest, 2 * self.interval)
            self.countdown = self.interval

    def expected_loss(self, least: float, rounds: int) -> float:
        """Decode steps that `rounds` verify rounds and a switch there and back are expected to lose
        against decoding (a drafter whose round costs at least `least` steps): from the measured
        rates where they exist, else a round costing `least` steps and giving 1 token per row."""
        if self.rate[True] and self.rate[False] and self.round_seconds and not self.bound:
            steps = self.round_seconds * self.rate[False]  # a verify round, in decode steps
            per_round = max(0.0, steps - self.rate[True] * self.round_seconds)
        else:
            per_round = least - 1.0
        return rounds * per_round + SWITCH_STEPS

    def priced(self, least: float, span: int | None) -> bool:
        """Whether measuring is held to the budget: a costly drafter (`least` over a decode step),
        a budget, and a known span of steps to spread its loss over."""
        return least > 1.0 and self.budget is not None and span is not None

    def affords(self, loss: float, span: int | None, least: float, share: float = 1.0) -> bool:
        """Whether measuring that loses `loss` decode steps may run, spread over `span` steps, with
        `share` of the budget (`headroom`)."""
        return not self.priced(least, span) or loss <= share * self.budget * span

    def choose(self, ahead: int | None = None, least: float = 1.0, feed: Callable[[], float] = lambda: 0.0,
               share: float = 1.0) -> bool:
        """Whether the next round speculates. `ahead`: the decode steps the live and queued rows may
        still take (None: unknown); `least`: a verify round's least cost in decode steps
        (`Drafter.least`); `feed`: -> the decode steps the drafter's catch-up before its next round
        takes (`Drafter.lacking`, priced by the engine once decode steps are timed), called only
        where a measure is priced, not every step; `share`: the part of the budget the batch may
        spend (`headroom`)."""
        if not self.enabled:
            return False
        if self.rate[True] is None:  # measure speculation first, where it can afford to
            if not self.started:
                if self.priced(least, ahead) and len(self.seen[False]) < MIN_DECODES:
                    return False  # a costly drafter's measure is priced in decode steps' time: time some first
                self.started = self.affords(self.expected_loss(least, FIRST_ROUNDS) + feed(), ahead, least, share)
            return self.started
        if len(self.seen[False]) < MIN_DECODES:
            return False
        best = self._best()
        if self.trying:
            self.trying -= 1
            return not best
        self.countdown -= 1
        if self.countdown <= 0:  # a try of the other mode, to keep its estimate fresh
            self.countdown = self.interval
            span = self.interval if ahead is None else min(ahead, self.interval)
            if not best and not self.affords(self.expected_loss(least, TRY_ROUNDS) + feed(), span, least, share):
                # Too dear for the steps around it: skipped, as if lost (tries grow apart).
                self.interval = min(self.longest, 2 * self.interval)
                return best
            self.trying = TRY_ROUNDS - 1
            return not best
        return best

    def record(self, speculating: bool, tokens_per_row: float, seconds: float | None, most: int | None = None,
               least: float = 1.0) -> None:
        """A round's tokens per row and time (None: unknown); `most`: the tokens per row a verify
        round can give at best (k + 1); `least`: the decode steps' time a verify round takes at
        least (see `_kept_nothing`)."""
        if seconds is None or seconds <= 0:  # a round whose time is unknown (a pipelined run's first)
            if speculating:
                self._kept_nothing(tokens_per_row, least)
            return
        if not self.warm[speculating]:  # a mode's first round traces and compiles: not its speed
            self.warm[speculating] = True
            return
        if speculating and self.bound:  # the first timed round replaces the bound `_kept_nothing` set
            self.rate[True], self.bound = None, False
        if speculating:
            self.rounds.append(seconds)
            self.most = most if most is not None else self.most
            self.costly = least > 1
        self._add(speculating, tokens_per_row, seconds)
        if self.rate[True] is not None and len(self.seen[False]) >= MIN_DECODES:
            best = self._best()
            if self.most is not None and self.most / self.round_seconds <= self.margin * self.rate[False]:
                # Slower than plain decoding even with every draft kept (a draft model whose steps
                # cost more than the target's): try again only rarely.
                if self.interval != self.longest:
                    self.countdown = self.longest
                self.current, self.interval = False, self.longest
                return
            if best != self.current:
                self.current, self.interval = best, self.base  # the better mode changed: try again soon
            elif speculating != best:
                self.interval = min(self.longest, 2 * self.interval)  # a try that lost: try less often

    def __repr__(self) -> str:
        return f"Policy(rate={self.rate}, interval={self.interval})"

    @property
    def speedup(self) -> float | None:
        """Measured verify-round rate over decode-step rate."""
        if self.rate[True] is None or self.rate[False] is None:
            return None
        return self.rate[True] / self.rate[False]


def headroom(rows: int, k: int) -> float:
    """The share of BUDGET a costly drafter's measures may spend with `rows` live rows: what
    verification can win falls from about k + 1 tokens per step's time at one row (bound by
    reading the weights) to nothing where rows x (k + 1) positions reach COMPUTE_ROWS (bound by
    compute), so the budget falls with it."""
    return max(0.0, 1.0 - rows * (k + 1) / COMPUTE_ROWS)


def may_pay(rows: int, k: int) -> bool:
    """Whether verification can beat decoding here at all, before measuring (probing costs rounds).
    On the CPU with MLX's bundled reference BLAS every verified position costs what a decode step
    does (products are row by row: 7fbc90b:benchmarks/README.md), so k + 1 positions cost k + 1 steps and
    speculation never pays. Elsewhere a step reading the weights once serves a few rows almost for
    free; past about 256 rows x positions it is bound by compute, and verifying costs ~k + 1 steps."""
    if mx.default_device() == mx.cpu:
        from mlxfun.kernels import blas

        return bool(blas.LOADED)
    return rows * (k + 1) <= COMPUTE_ROWS


class Always(Policy):
    """Speculate every round (measurements, tests)."""

    def choose(self, ahead: int | None = None, least: float = 1.0, feed: Callable[[], float] = lambda: 0.0,
               share: float = 1.0) -> bool:
        return True
