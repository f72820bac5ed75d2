"""The compiled steps of generation: chunked prefill and the one-token decode step.

`decode` is one `mx.compile`d function (decoder, sampling and cache update together). Everything
that varies per token (block tables, positions, step counters, sampling settings) is an array
argument, so it traces once per (batch size, table width, pool size) and never per token.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

import mlx.core as mx

from mlxfun import llama, sampling, speculative
from mlxfun.cache import KVCache
from mlxfun.config import ModelConfig
from mlxfun.llama import Params


class Mode(NamedTuple):
    """What a decode step computes; each distinct Mode is its own compiled function."""

    sample: bool = False  # False: greedy argmax for every row
    penalties: bool = False  # track per-row token counts for repetition/presence/frequency penalties
    sort: bool = True  # some sampled row uses top-k or top-p (a sort over the vocabulary)
    top_logprobs: int = -1  # -1: no logprobs; 0: the chosen token's; n: and the n most likely


class DecodeState(NamedTuple):
    """Everything a decode step reads and writes, as arrays."""

    cache: KVCache
    tokens: mx.array  # (B,) int32: the last token of each row
    positions: mx.array  # (B,) int32: the position of `tokens`; -1 for a row without a request
    steps: mx.array  # (B,) int32: tokens generated so far per row (the sampler's counter)
    counts: mx.array | None  # (B, V) int32: each row's generated-token counts (penalties only)


class StepOut(NamedTuple):
    tokens: mx.array  # (B,) int32
    logprob: mx.array | None  # (B,) float32
    top_ids: mx.array | None  # (B, n) int32
    top_logprobs: mx.array | None  # (B, n) float32


def choose(mode: Mode, logits: mx.array, settings: sampling.Settings, steps: mx.array,
           counts: mx.array | None) -> StepOut:
    """logits (B, V) -> the next token per row, with logprobs when the mode asks for them."""
    logits = logits.astype(mx.float32)
    tokens = sampling.sample(logits, settings, steps, counts, sort=mode.sort) if mode.sample \
        else sampling.greedy(logits)
    if mode.top_logprobs < 0:
        return StepOut(tokens, None, None, None)
    logp = sampling.logprobs(logits)  # (B, V)
    chosen = sampling.chosen_logprob(logp, tokens)
    if mode.top_logprobs == 0:
        return StepOut(tokens, chosen, None, None)
    ids, values = sampling.top_logprobs(logp, mode.top_logprobs)
    return StepOut(tokens, chosen, ids, values)


def decode_step(config: ModelConfig, mode: Mode, params: Params, state: DecodeState,
                settings: sampling.Settings) -> tuple[StepOut, DecodeState]:
    """One token for every row: decoder, sampling and cache update."""
    h, cache = llama.hidden(config, params, state.tokens[:, None], state.positions[:, None], None, state.cache,
                            fast=True, check=False)  # (B, 1, E)
    out = choose(mode, llama.logits(params, h[:, -1], fast=True), settings, state.steps, state.counts)
    counts = None if state.counts is None else sampling.update_counts(state.counts, out.tokens)
    # Rows without a request stay at -1: their writes go to the scratch block.
    positions = mx.where(state.positions >= 0, state.positions + 1, state.positions)
    return out, DecodeState(cache, out.tokens, positions, state.steps + 1, counts)


def prefill_chunk(config: ModelConfig, params: Params, tokens: mx.array, positions: mx.array,
                  cache: KVCache, slots: mx.array, last: mx.array, wraps: bool = True) -> tuple[mx.array, KVCache]:
    """tokens (B, T) into the cache at `slots` (B, T) -> (hidden state at index last[b] of each
    row (B, E), cache). `wraps`: whether the chunk may overwrite slots its queries see (see
    `llama.hidden`)."""
    h, cache = llama.hidden(config, params, tokens, positions, None, cache, slots=slots, wraps=wraps, fast=True,
                            check=False)  # (B, T, E)
    return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0], cache


def verify_step(config: ModelConfig, mode: Mode, params: Params, state: DecodeState, drafts: mx.array,
                valid: mx.array, draft_probs: mx.array | None, settings: sampling.Settings
                ) -> tuple[speculative.Verdict, DecodeState]:
    """Each row's last token and k drafts (B, k) (`valid` (B, k): a draft is there) through the
    decoder at once -> the tokens each row keeps (`speculative.verdict`) and the state after
    them. The KV of rejected drafts stays at positions beyond the row's: unseen, then overwritten.
    No penalties (a row's counts would change inside the verified run)."""
    k = drafts.shape[1]
    live = state.positions >= 0  # (B,)
    tokens = mx.concatenate([state.tokens[:, None], mx.where(valid, drafts, 0)], axis=1)  # (B, k + 1)
    positions = mx.where(live[:, None], state.positions[:, None] + mx.arange(k + 1)[None], -1)  # (B, k + 1)
    h, cache = llama.hidden(config, params, tokens, positions, None, state.cache, wraps=False, fast=True,
                            check=False)  # (B, k + 1, E)
    out = speculative.verdict(mode.sample, mode.sort, mode.top_logprobs, llama.logits(params, h, fast=True), drafts,
                              valid, draft_probs, settings, state.steps)
    last = mx.take_along_axis(out.tokens, (out.count - 1)[:, None], axis=1)[:, 0]  # (B,)
    new_positions = mx.where(live, state.positions + out.count, state.positions)
    return out, DecodeState(cache, last, new_positions, state.steps + out.count, state.counts)


def first_token(config: ModelConfig, mode: Mode, params: Params, h: mx.array, settings: sampling.Settings,
                steps: mx.array, counts: mx.array | None) -> StepOut:
    """h (B, E): the last prompt position's hidden state -> the first generated token."""
    return choose(mode, llama.logits(params, h, fast=True), settings, steps, counts)


class Steps(NamedTuple):
    """The functions a generation loop calls; `compiled_steps` caches them per config and mode."""

    decode: Callable  # compiled: (params, state, settings) -> (StepOut, state)
    prefill: Callable  # (params, tokens, positions, cache, slots, last, wraps) -> (hidden states at last, cache)
    verify: Callable  # compiled: (params, state, drafts, valid, draft_probs, settings) -> (Verdict, state)


def make_steps(config: ModelConfig, mode: Mode, on_trace: Callable[[], None] | None = None) -> Steps:
    """Fresh compiled steps. `on_trace` runs each time the decode step is traced (profiling, tests)."""

    def decode(params, state, settings):
        if on_trace is not None:
            on_trace()
        return decode_step(config, mode, params, state, settings)

    def prefill(params, tokens, positions, cache, slots, last, wraps=True):
        return prefill_chunk(config, params, tokens, positions, cache, slots, last, wraps)

    def verify(params, state, drafts, valid, draft_probs, settings):
        return verify_step(config, mode, params, state, drafts, valid, draft_probs, settings)

    return Steps(mx.compile(decode), prefill, mx.compile(verify))


@lru_cache(maxsize=32)
def compiled_steps(config: ModelConfig, mode: Mode) -> Steps:
    return make_steps(config, mode)
