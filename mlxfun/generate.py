"""Batched generation: every prompt answered exactly as if it ran alone.

Prompts are left-padded to a common length; padding gets negative positions, so the masks hide
it from every query at prefill and at each decode step, and each row's positions start at 0 at
its first real token. The host loop only schedules: it pipelines the compiled decode step with
`mx.async_eval` and checks stops one step behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from mlxfun import cache as kv
from mlxfun import sampling
from mlxfun.detok import RowText
from mlxfun.errors import InputError
from mlxfun.events import Event, Stats
from mlxfun.load import Model
from mlxfun.prefill import pad_multiple as prefill_pad_multiple
from mlxfun.prefill import padded_length, prefill
from mlxfun.rows import GenerationResult, Row, host_values, result
from mlxfun.step import DecodeState, Mode, StepOut, Steps, compiled_steps
from mlxfun.strategy import WeightStrategy, params_for_batch, params_for_prompts

Prompt = str | Sequence[int] | Sequence[dict]


@dataclass(frozen=True)
class GenerationConfig:
    """Per-call options of `generate`, validated and expanded to one entry per row."""

    max_tokens: tuple[int, ...]
    stop: tuple[tuple[str, ...], ...]
    settings: sampling.Settings
    mode: Mode
    prefill_step: int = 512
    max_kv_size: int | None = None
    seeds: tuple[int, ...] = field(default=())
    ignore_eos: bool = False


def _stops(stop, n: int) -> tuple[tuple[str, ...], ...]:
    if stop is None or isinstance(stop, str):
        return ((stop,) if stop else (),) * n
    if all(isinstance(s, str) for s in stop):
        return (tuple(stop),) * n  # one list of stop strings for every row
    rows = sampling.per_row("stop", list(stop), n)
    return tuple(((s,) if isinstance(s, str) else tuple(s or ())) for s in rows)


def encode_prompts(model: Model, prompts, chat: bool) -> list[list[int]]:
    """Token ids for each prompt: text, a token-id list, or (chat) a message list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]
    if not prompts:
        raise InputError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = model.tokenizer.encode_chat([{"role": "user", "content": p}]) if chat else model.tokenizer.encode(p)
        elif p and isinstance(p[0], dict):
            ids = model.tokenizer.encode_chat(list(p))
        else:
            ids = [int(t) for t in p]
            if any(t < 0 or t >= model.config.vocab_size for t in ids):
                raise InputError(f"prompt {i} has token ids outside [0, {model.config.vocab_size})")
        if not ids:
            raise InputError(f"prompt {i} is empty")
        out.append(ids)
    return out


def check_context(model: Model, prompts: list[list[int]]) -> None:
    limit = model.config.max_position_embeddings
    for i, ids in enumerate(prompts):
        if len(ids) >= limit:
            raise InputError(f"prompt {i} has {len(ids)} tokens; the model's context is {limit} "
                             "(at least one position must be left to generate)")


class Batch:
    """A static batch: prefill all prompts, then decode until every row has finished."""

    def __init__(self, model: Model, prompts: list[list[int]], gen: GenerationConfig, steps: Steps | None = None,
                 strategy: WeightStrategy | None = None, pad_multiple: int | None = None):
        # Many rows run quantized weights faster as a dense copy (mlxfun.strategy; None: the backend's default).
        params = params_for_batch(model.config, model.params, len(prompts), strategy)
        self.model = model if params is model.params else Model(model.config, params, model.tokenizer, model.source)
        self.strategy = strategy
        self.config = model.config.with_max_kv_size(gen.max_kv_size)
        self.prompts = prompts
        self.gen = gen
        self.steps = steps or compiled_steps(self.config, gen.mode)
        self.stats = Stats(prompt_tokens=sum(len(p) for p in prompts))
        self.rows = [Row(len(p), m, RowText(model.tokenizer, s), gen.mode.top_logprobs)
                     for p, m, s in zip(prompts, gen.max_tokens, gen.stop)]
        self.limit = self.config.max_position_embeddings
        self.window = self.config.max_window  # a ring of this many slots bounds the cache
        self.multiple = pad_multiple or prefill_pad_multiple()  # prompt lengths rounded up on a GPU
        self.end = padded_length(prompts, self.multiple)  # the cache cursor after prefill

    def prefill(self) -> tuple[StepOut, DecodeState]:
        B = len(self.prompts)
        # Long prompts may run a dense copy of quantized weights, dropped with this frame (mlxfun.strategy).
        params = params_for_prompts(self.config, self.model.params, [len(p) for p in self.prompts],
                                    self.gen.prefill_step, self.strategy)
        # The prompts fill the cache exactly; the first decode step grows it to a bucket. Attending
        # over empty slots made prefill 15% slower (SmolLM2, 128-token prompts in a 256-slot cache).
        width = self.end if self.window is None else min(self.end, self.window)
        h, cache = prefill(self.config, self.steps, params, self.prompts, width,
                           self.gen.prefill_step, params.norm.dtype, self.multiple)
        counts = mx.zeros((B, self.config.vocab_size), mx.int32) if self.gen.mode.penalties else None
        steps0 = mx.zeros((B,), mx.int32)
        out = self.steps.first(params, h, self.gen.settings, steps0, counts)
        if counts is not None:
            counts = sampling.update_counts(counts, out.tokens)
        positions = mx.array([len(p) for p in self.prompts], dtype=mx.int32)
        state = DecodeState(cache, out.tokens, positions, steps0 + 1, counts)
        return out, state

    def _grow(self, state: DecodeState, written: int) -> DecodeState:
        """Room for the next token: grow a linear cache by a bucket when full."""
        cap = kv.capacity(state.cache)
        if written < cap or (self.window is not None and cap == self.window):
            return state
        return state._replace(cache=kv.grow(state.cache, kv.capacity_for(written + 1, self.window)))

    def events(self) -> Iterator[Event]:
        """Run the batch, yielding one event per generated token of each live row."""
        t0 = time.perf_counter()
        out, state = self.prefill()
        mx.eval(out, state)
        t1 = time.perf_counter()
        self.stats.prompt_time = t1 - t0
        written = self.end  # slots used: the padded prompt length
        params, settings = self.model.params, self.gen.settings
        while True:
            # Queue the next step before reading this one, so the device never waits on the host.
            # Rebinding `state` drops the old one, so the step may update the cache in place.
            queued = not self._last_step()
            if queued:
                state = self._grow(state, written)
                next_out, state = self.steps.decode(params, state, settings)
                mx.async_eval(next_out, state)
                written += 1
            yield from self._take(out)
            if self._done():
                break
            out = next_out
        self.stats.generation_time = time.perf_counter() - t1
        self.state = state  # the last state, for inspection
        self.stats.generation_tokens = sum(len(r.text.tokens) for r in self.rows)
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def _done(self) -> bool:
        return all(r.finish_reason is not None for r in self.rows)

    def _last_step(self) -> bool:
        """Whether every row ends with the token being handed out (by its length limits)."""
        return all(r.finish_reason is not None or len(r.text.tokens) + 1 >= min(r.max_tokens, self.limit - r.prompt_len)
                   for r in self.rows)

    def _take(self, out: StepOut) -> Iterator[Event]:
        """Hand out one step's tokens on the host; rows finish on EOS, stop strings and limits."""
        tokens, logprob, top = host_values(out)
        eos = () if self.gen.ignore_eos else self.model.tokenizer.eos_token_ids
        for b, row in enumerate(self.rows):
            if row.finish_reason is None:
                yield row.accept(b, tokens[b], eos, self.limit, None if logprob is None else logprob[b],
                                 None if top is None else top[b])

    def result(self) -> GenerationResult:
        return result(self.rows, self.stats, self.gen.seeds, self.gen.mode.top_logprobs)


def make_config(n: int, *, max_tokens=256, temperature=0.0, top_p=1.0, min_p=0.0, top_k=0,
                repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None,
                stop=None, logprobs: int | None = None, prefill_step: int = 512,
                max_kv_size: int | None = None, ignore_eos: bool = False) -> GenerationConfig:
    """Validate every option and expand it to n rows."""
    max_tokens = sampling.per_row("max_tokens", max_tokens, n)
    if any(not isinstance(m, int) or m < 1 for m in max_tokens):
        raise InputError(f"max_tokens must be positive integers, got {max_tokens}")
    if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
        raise InputError(f"logprobs must be None or a non-negative integer, got {logprobs!r}")
    if prefill_step < 1:
        raise InputError(f"prefill_step must be positive, got {prefill_step}")
    if max_kv_size is not None and max_kv_size < 1:
        raise InputError(f"max_kv_size must be positive, got {max_kv_size}")
    settings = sampling.make_settings(
        n, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed)
    mode = Mode(sample=not sampling.all_greedy(settings), penalties=sampling.needs_counts(settings),
                sort=sampling.needs_sort(settings), top_logprobs=-1 if logprobs is None else logprobs)
    return GenerationConfig(tuple(max_tokens), _stops(stop, n), settings, mode, prefill_step, max_kv_size,
                            tuple(sampling.seeds(settings)), ignore_eos)


def _row_settings(settings: sampling.Settings, i: int) -> sampling.Settings:
    return sampling.Settings(*(f[i:i + 1] for f in settings))


class EngineJob:
    """`generate` over more prompts than rows: an Engine of `rows` rows, results in prompt order."""

    def __init__(self, model: Model, prompts: list[list[int]], gen: GenerationConfig, rows: int):
        from mlxfun.engine import Engine

        self.gen = gen
        self.engine = Engine(model, rows, prefill_step=gen.prefill_step, ignore_eos=gen.ignore_eos,
                             max_kv_size=gen.max_kv_size)
        self.ids = [self.engine.add(p, max_tokens=m, stop=s, settings=_row_settings(gen.settings, i),
                                    top_logprobs=gen.mode.top_logprobs)
                    for i, (p, m, s) in enumerate(zip(prompts, gen.max_tokens, gen.stop))]

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self) -> Iterator[Event]:
        index = {rid: i for i, rid in enumerate(self.ids)}
        for e in self.engine.events():
            yield e._replace(index=index[e.index])

    def result(self) -> GenerationResult:
        rows = [self.engine.requests[i].row for i in self.ids]
        return result(rows, self.engine.stats, self.gen.seeds, self.gen.mode.top_logprobs)


def start(model: Model, prompts, gen_options: dict, *, chat: bool = False, batch_size: int | None = None):
    """A job (`.events()`, then `.result()`) for prompts: one static batch, or an Engine of
    `batch_size` rows when there are more prompts than that."""
    ids = encode_prompts(model, prompts, chat)
    gen = make_config(len(ids), **gen_options)
    check_context(model, ids)
    if batch_size is not None and batch_size < 1:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    if batch_size is not None and batch_size < len(ids):
        return EngineJob(model, ids, gen, batch_size)
    return Batch(model, ids, gen)


def stream_generate(model: Model, prompts: Prompt | list[Prompt], *, max_tokens: int | list[int] = 256,
                    temperature: float | list[float] = 0.0, top_p: float | list[float] = 1.0,
                    min_p: float | list[float] = 0.0, top_k: int | list[int] = 0,
                    repetition_penalty: float | list[float] = 1.0, presence_penalty: float | list[float] = 0.0,
                    frequency_penalty: float | list[float] = 0.0, seed: int | list[int] | None = None,
                    stop: str | list[str] | list[list[str]] | None = None, chat: bool = False,
                    logprobs: int | None = None, prefill_step: int = 512, max_kv_size: int | None = None,
                    ignore_eos: bool = False, batch_size: int | None = None) -> Batch | EngineJob:
    """Like `generate`, but returns the job: iterate it for an `Event` per generated token of each
    prompt as it is produced, then call `.result()` for the whole `GenerationResult`."""
    options = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                   repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty, seed=seed, stop=stop, logprobs=logprobs,
                   prefill_step=prefill_step, max_kv_size=max_kv_size, ignore_eos=ignore_eos)
    return start(model, prompts, options, chat=chat, batch_size=batch_size)


def generate(model: Model, prompts: Prompt | list[Prompt], *, max_tokens: int | list[int] = 256,
             temperature: float | list[float] = 0.0, top_p: float | list[float] = 1.0,
             min_p: float | list[float] = 0.0, top_k: int | list[int] = 0,
             repetition_penalty: float | list[float] = 1.0, presence_penalty: float | list[float] = 0.0,
             frequency_penalty: float | list[float] = 0.0, seed: int | list[int] | None = None,
             stop: str | list[str] | list[list[str]] | None = None, chat: bool = False,
             logprobs: int | None = None, prefill_step: int = 512, max_kv_size: int | None = None,
             ignore_eos: bool = False, batch_size: int | None = None,
             on_event: Callable[[Event], None] | None = None) -> GenerationResult:
    """Generate for one prompt or many, batched; each prompt's output equals its output alone.

    `prompts`: a str, a list of str, token-id lists, or (chat) message lists. Per-row options take
    one value for all prompts or a list with one value per prompt. `logprobs`: None for none, 0
    for the chosen tokens' log-probabilities, n for the n most likely too. `batch_size`: decode at
    most this many rows at once, refilling rows as prompts finish. `max_kv_size`: bound the cache
    to a ring of that many tokens (each query then sees at most that many). `on_event`: called
    with each Event (e.g. for a progress bar).
    """
    job = stream_generate(model, prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          min_p=min_p, top_k=top_k, repetition_penalty=repetition_penalty,
                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed,
                          stop=stop, chat=chat, logprobs=logprobs, prefill_step=prefill_step,
                          max_kv_size=max_kv_size, ignore_eos=ignore_eos, batch_size=batch_size)
    for event in job:
        if on_event is not None:
            on_event(event)
    return job.result()
