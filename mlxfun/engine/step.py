"""The compiled steps of generation: chunked prefill and the one-token decode step.

`decode` is one `mx.compile`d function (decoder, sampling and cache update together). Everything
that varies per token (block tables, positions, step counters, sampling settings) is an array
argument, so it traces once per (batch size, table width, pool size) and never per token.

With structured output the step is split in two compiled halves, `forward` (decoder and cache
update -> logits) and `sample` (logits and a token mask -> tokens): the mask of step k+1 depends
on token k, so the host queues forward k+1 (its input, token k, stays on the device), reads token
k, computes mask k+1 while the device runs the forward pass, then queues sample k+1. A CPU
server splits every step so (`Runner.split`): `forward` is the same for every mode (`FORWARD`'s
compiles once per shape), so each mode adds only its sampling half. `verify` checks k drafted
tokens per row at once (speculative decoding).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

import mlx.core as mx

from mlxfun.engine import sampling
from mlxfun.features import speculative
from mlxfun.model import llama
from mlxfun.model.cache import KVCache
from mlxfun.model.config import ModelConfig
from mlxfun.model.llama import Params


class Mode(NamedTuple):
    """What a decode step computes; each distinct Mode is its own compiled function."""

    sample: bool = False  # False: greedy argmax for every row
    penalties: bool = False  # track per-row token counts for repetition/presence/frequency penalties
    search: sampling.Search = sampling.Search.ALL  # the threshold searches (top-k, top-p) some sampled row uses
    top_logprobs: int = -1  # -1: no logprobs; 0: the chosen token's; n: and the n most likely
    masked: bool = False  # some row is constrained: sampling applies a (B, V/32) token bitmask (split step)


# The forward half of a split step (`forward_step`) computes the same for every mode: the Steps of
# this one serve them all, so it compiles once per shape, not once per mode.
FORWARD = Mode()


class DecodeState(NamedTuple):
    """Everything a decode step reads and writes, as arrays."""

    cache: KVCache
    tokens: mx.array  # (B,) int32: the last token of each row
    positions: mx.array  # (B,) int32: the position of `tokens`; -1 for a row without a request
    steps: mx.array  # (B,) int32: tokens generated so far per row (the sampler's counter)
    counts: mx.array | None  # (B, V) int32: each row's generated-token counts (penalties only)


class Chunk(NamedTuple):
    """Prompt tokens that ride along a decode step (`mixed_step`), P of them, padding included, so
    a step's shapes stay fixed whatever the admitted prompts."""

    tokens: mx.array  # (P,) int32
    positions: mx.array  # (P,) int32: each token's position in its row; -1 for padding
    rows: mx.array  # (P,) int32: the row whose blocks each token is written to and reads
    source: mx.array  # (B,) int32: where each row's next token comes from: itself (r), or B + the
    # index of its prompt's last token in the chunk (a row admitted by it)
    ends: mx.array  # (B,) bool: the row's prompt ends in this chunk (its first token is sampled here)
    lengths: mx.array  # (B,) int32: such a row's prompt length (its next position)


class StepOut(NamedTuple):
    tokens: mx.array  # (B,) int32
    logprob: mx.array | None  # (B,) float32
    top_ids: mx.array | None  # (B, n) int32
    top_logprobs: mx.array | None  # (B, n) float32


def reading(out: StepOut) -> StepOut:
    """New handles of a step's outputs, for another thread to read: the same memory (no kernel),
    but MLX arrays of their own, which no later step takes as input. (MLX arrays are not thread-safe:
    an evaluation that takes an array as input updates it, as a read does.)"""
    return StepOut(*(None if a is None else mx.stop_gradient(a) for a in out))


def choose(mode: Mode, logits: mx.array, settings: sampling.Settings, steps: mx.array,
           counts: mx.array | None, mask: mx.array | None = None) -> StepOut:
    """logits (B, V), mask (B, W) uint32 or None -> the next token per row, with logprobs when the
    mode asks for them. Logprobs are the model's, before the mask (as before penalties)."""
    logits = logits.astype(mx.float32)
    if mode.sample:
        tokens = sampling.sample(logits, settings, steps, counts, search=mode.search, mask=mask)
    else:
        tokens = sampling.greedy(logits if mask is None else sampling.apply_mask(logits, mask))
    if mode.top_logprobs < 0:
        return StepOut(tokens, None, None, None)
    logp = sampling.logprobs(logits)  # (B, V)
    chosen = sampling.chosen_logprob(logp, tokens)
    if mode.top_logprobs == 0:
        return StepOut(tokens, chosen, None, None)
    ids, values = sampling.top_logprobs(logp, mode.top_logprobs)
    return StepOut(tokens, chosen, ids, values)


def forward_step(config: ModelConfig, params: Params, state: DecodeState) -> tuple[mx.array, DecodeState]:
    """The decoder half of a decode step: logits (B, V) and the state with its cache and positions
    advanced (tokens, steps and counts are `sample_step`'s)."""
    h, cache = llama.hidden(config, params, state.tokens[:, None], state.positions[:, None], None, state.cache,
                            fast=True, check=False)  # (B, 1, E)
    # Rows without a request stay at -1: their writes go to the scratch block.
    positions = mx.where(state.positions >= 0, state.positions + 1, state.positions)
    return llama.logits(config, params, h[:, -1], fast=True), state._replace(cache=cache, positions=positions)


def sample_step(mode: Mode, logits: mx.array, mask: mx.array | None, state: DecodeState,
                settings: sampling.Settings) -> tuple[StepOut, DecodeState]:
    """The sampling half: logits (B, V) and mask (B, W) uint32 (all ones for a free row; read only
    when `mode.masked`) -> the tokens, and the state with tokens, steps and counts updated."""
    out = choose(mode, logits, settings, state.steps, state.counts, mask if mode.masked else None)
    counts = None if state.counts is None else sampling.update_counts(state.counts, out.tokens)
    return out, state._replace(tokens=out.tokens, steps=state.steps + 1, counts=counts)


def decode_step(config: ModelConfig, mode: Mode, params: Params, state: DecodeState,
                settings: sampling.Settings) -> tuple[StepOut, DecodeState]:
    """One token for every row: decoder, sampling and cache update (one compiled function)."""
    logits, state = forward_step(config, params, state)
    return sample_step(mode, logits, None, state, settings)


def mixed_step(config: ModelConfig, mode: Mode, params: Params, state: DecodeState, settings: sampling.Settings,
               chunk: Chunk) -> tuple[StepOut, DecodeState]:
    """A decode step for every row with a chunk of prompt tokens riding along: B + P one-token rows
    through one pass of the decoder (each prompt token reads its row's blocks through the one-token
    attention, after every token's keys are written, so it sees its cached prefix and the chunk's
    earlier tokens), then each row's next token: a decoding row's from its own token, an admitted
    row's from its prompt's last. A row admitted by the chunk decodes nothing (its decode slot
    writes to the scratch block) and starts its step counter and counts from zero.

    On a GPU the decode step is launch-bound (a 1B step of 32 rows reads its weights in a third of
    its time): a few hundred prompt tokens add little to it, where a prefill of its own costs the
    host a graph and the device its launches, and a server admits a few prompts at a time."""
    table, ends = state.cache.table, chunk.ends
    # An admitted row may still hold its last request's position (refilled within a step of its
    # release): its decode slot must write to the scratch block, not into its new blocks.
    decoding = mx.where(ends, -1, state.positions)  # (B,)
    tokens = mx.concatenate([state.tokens, chunk.tokens])[:, None]  # (B + P, 1)
    positions = mx.concatenate([decoding, chunk.positions])[:, None]  # (B + P, 1)
    cache = state.cache._replace(table=mx.concatenate([table, table[chunk.rows]]))  # (B + P, W)
    h, cache = llama.hidden(config, params, tokens, positions, None, cache, fast=True, check=False)  # (B + P, 1, E)
    logits = llama.logits(config, params, h[:, 0][chunk.source], fast=True)  # (B, V)
    positions = mx.where(ends, chunk.lengths, mx.where(decoding >= 0, decoding + 1, decoding))
    counts = None if state.counts is None else mx.where(ends[:, None], 0, state.counts)
    state = DecodeState(cache._replace(table=table), state.tokens, positions, mx.where(ends, 0, state.steps), counts)
    return sample_step(mode, logits, None, state, settings)


def prefill_chunk(config: ModelConfig, params: Params, tokens: mx.array, positions: mx.array,
                  cache: KVCache, slots: mx.array, last: mx.array, wraps: bool = True, fresh: bool = False,
                  run: mx.array | None = None, launch: Callable[[list[mx.array]], None] | None = None
                  ) -> tuple[mx.array, KVCache]:
    """tokens (B, T) into the cache at `slots` (B, T) -> (hidden state at index last[b] of each
    row (B, E), cache). `wraps`: whether the chunk may overwrite slots its queries see; `fresh`:
    the rows hold nothing before it; `run`: the slots are one run from there (written by slice
    updates); `launch`: starts the first layers early (see `llama.hidden`)."""
    if config.batch_invariant and llama.step_attention_kernel(config, params):
        # Each token as a row of its own, through the one-token kernels whose sums do not depend on
        # the batch: a token's hidden state is then the same bits in any chunk, as in a decode step.
        h, cache = verify_hidden(config, params, tokens, positions, cache, flatten=True)  # (B, T, E)
    else:
        h, cache = llama.hidden(config, params, tokens, positions, None, cache, slots=slots, run=run, wraps=wraps,
                                fresh=fresh, fast=True, check=False, launch=launch)  # (B, T, E)
    return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0], cache


def verify_hidden(config: ModelConfig, params: Params, tokens: mx.array, positions: mx.array, cache: KVCache,
                  flatten: bool) -> tuple[mx.array, KVCache]:
    """tokens (B, T) at positions (B, T) through the decoder -> (hidden states (B, T, E), cache).
    `flatten`: each position goes through as a row of its own (B T rows of one token, each reading
    its row's blocks), so that attention runs the one-token kernel, which reads the blocks in
    place; T > 1 gathers them first (8B bf16, batch 1, k = 4 on an H200: 866 kernels and 6.8 ms
    of GPU time, against 534 and 5.6 ms for a decode step). Every position's keys are written
    before any query reads and masks come from slot positions, so each sees its causal prefix."""
    if not flatten:
        return llama.hidden(config, params, tokens, positions, None, cache, wraps=False, fast=True, check=False)
    B, T = tokens.shape
    rows = cache._replace(table=mx.repeat(cache.table, T, axis=0))  # (B T, W)
    h, new = llama.hidden(config, params, tokens.reshape(B * T, 1), positions.reshape(B * T, 1), None, rows,
                          fast=True, check=False)  # (B T, 1, E)
    return h.reshape(B, T, -1), new._replace(table=cache.table)


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
    h, cache = verify_hidden(config, params, tokens, positions, state.cache,
                             llama.step_attention_kernel(config, params))  # (B, k + 1, E)
    out = speculative.verdict(mode.sample, mode.search, mode.top_logprobs, llama.logits(config, params, h, fast=True),
                              drafts, valid, draft_probs, settings, state.steps)
    last = mx.take_along_axis(out.tokens, (out.count - 1)[:, None], axis=1)[:, 0]  # (B,)
    new_positions = mx.where(live, state.positions + out.count, state.positions)
    packed = mx.concatenate([out.count[:, None], out.tokens], axis=1)  # (B, k + 2)
    return out._replace(packed=packed), DecodeState(cache, last, new_positions, state.steps + out.count, state.counts)


def first_token(config: ModelConfig, mode: Mode, params: Params, h: mx.array, settings: sampling.Settings,
                steps: mx.array, counts: mx.array | None, mask: mx.array | None = None) -> StepOut:
    """h (B, E): the last prompt position's hidden state -> the first generated token. MLX's
    products, not mlxfun's few-row kernels: B is a prefill group's size, which varies from one
    admission to the next, and those kernels are built for their row count (NVRTC, about 2 s per new
    count on an H200: a static batch of mixed prompts paid it for each new group size)."""
    return choose(mode, llama.logits(config, params, h), settings, steps, counts, mask)


class Steps(NamedTuple):
    """The functions a generation loop calls; `compiled_steps` caches them per config and mode."""

    decode: Callable  # compiled: (params, state, settings) -> (StepOut, state)
    # (params, tokens, positions, cache, slots, last, wraps, fresh, run, launch) -> (hidden states at last, cache)
    prefill: Callable
    verify: Callable  # compiled: (params, state, drafts, valid, draft_probs, settings) -> (Verdict, state)
    forward: Callable  # compiled: (params, state) -> (logits, state), the split step's first half
    sample: Callable  # compiled: (logits, mask, state, settings) -> (StepOut, state)
    mixed: Callable  # compiled: (params, state, settings, chunk) -> (StepOut, state)


def make_steps(config: ModelConfig, mode: Mode, on_trace: Callable[[], None] | None = None,
               compile_prefill: int = 0) -> Steps:
    """Fresh compiled steps. `on_trace` runs each time a compiled step (decode, either half of the
    split one, verify, a compiled prefill chunk) is traced (profiling, tests, a server's count).
    Prefill chunks of at most `compile_prefill` tokens (rows x length) run compiled too, traced per
    chunk shape and pool size (see PREFILL_COMPILED_TOKENS)."""

    def traced():
        if on_trace is not None:
            on_trace()

    def decode(params, state, settings):
        traced()
        return decode_step(config, mode, params, state, settings)

    @mx.compile
    def compiled_prefill(params, tokens, positions, cache, slots, last, wraps=True, fresh=False, run=None):
        traced()
        return prefill_chunk(config, params, tokens, positions, cache, slots, last, wraps, fresh, run)

    def prefill(params, tokens, positions, cache, slots, last, wraps=True, fresh=False, run=None, launch=None):
        # A compiled chunk is one launch already (and a trace has nothing to launch early).
        if tokens.size <= compile_prefill:
            return compiled_prefill(params, tokens, positions, cache, slots, last, wraps, fresh, run)
        return prefill_chunk(config, params, tokens, positions, cache, slots, last, wraps, fresh, run, launch)

    def verify(params, state, drafts, valid, draft_probs, settings):
        traced()
        return verify_step(config, mode, params, state, drafts, valid, draft_probs, settings)

    def forward(params, state):
        traced()
        return forward_step(config, params, state)

    def sample_(logits, mask, state, settings):
        traced()
        return sample_step(mode, logits, mask, state, settings)

    sample_compiled = mx.compile(sample_)

    def mixed(params, state, settings, chunk):
        traced()
        return mixed_step(config, mode, params, state, settings, chunk)

    def sample(logits, mask, state, settings):
        # The cache stays outside: sampling never reads it, and its capacity would retrace the step.
        out, new = sample_compiled(logits, mask, state._replace(cache=None), settings)
        return out, new._replace(cache=state.cache)

    return Steps(mx.compile(decode), prefill, mx.compile(verify), mx.compile(forward), sample, mx.compile(mixed))


# Prefill chunks of at most this many tokens run compiled on a GPU. Their host time (building the
# graph, one launch per unfused op) bounds small admissions there: compiled, an admission of 1-32
# prompts of 128 tokens took 1.16-1.30x less time (1B and 8B on an H200, alternating in one
# process). But a compiled chunk peaks higher (about 18% of an admission's peak on the CPU; 8B at
# batch 128 on the H200: 40.1 GB against 34.3), so larger chunks, which the device bounds, stay
# uncompiled. On the CPU the products bound every chunk, and each new chunk shape would compile.
PREFILL_COMPILED_TOKENS = 2048


@lru_cache(maxsize=32)
def compiled_steps(config: ModelConfig, mode: Mode) -> Steps:
    return make_steps(config, mode, compile_prefill=PREFILL_COMPILED_TOKENS if mx.default_device() == mx.gpu else 0)


class StepCache:
    """Compiled steps of one engine, per (config, mode), counting their traces: a server checks
    that nothing traces after its warm-up (`Engine.warm_up`), and reports the count in /metrics.
    Prefill runs uncompiled by default: its chunk shapes follow the prompts that arrive."""

    def __init__(self, compile_prefill: int = 0):
        self.compile_prefill = compile_prefill
        self.traces = 0
        self._made: dict[tuple[ModelConfig, Mode], Steps] = {}

    def _traced(self) -> None:
        self.traces += 1

    def __call__(self, config: ModelConfig, mode: Mode) -> Steps:
        steps = self._made.get((config, mode))
        if steps is None:
            steps = self._made[config, mode] = make_steps(config, mode, self._traced, self.compile_prefill)
        return steps
