"""`generate` and `stream_generate`: many prompts at once, each answered exactly as if it ran alone.

A call is one job on the scheduler (`mlxfun.engine.core`): one row per prompt, all admitted at once (a
static batch), or `batch_size` rows refilled as prompts finish (continuous batching). Prompts are
left-padded; padding gets negative positions, so the masks hide it from every query at prefill
and at each decode step, and each row's positions start at 0 at its first real token.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Callable, Iterator, Sequence

from mlxfun.engine import sampling
from mlxfun.engine.core import engine_for
from mlxfun.engine.events import Event
from mlxfun.engine.options import GenerationConfig, Request, requests, ring_overflow
from mlxfun.engine.rows import GenerationResult, result
from mlxfun.errors import InputError
from mlxfun.model.load import Model
from mlxfun.parallel import distributed

Prompt = str | Sequence[int] | Sequence[dict]


class Job:
    """One call's requests on an engine of their own. Iterate it for an `Event` per generated
    token (index = the prompt's), then call `result()`."""

    def __init__(self, model: Model, reqs: list[Request], config: GenerationConfig):
        # Several ranks (mlxfun.parallel.distributed): the same seeds on each; with a data group, this rank's share.
        reqs = distributed.agree(reqs, model.config.tensor_group, config.group)
        self.group, self.total, self.top_n = config.group, len(reqs), max(r.logprobs for r in reqs)
        self.indices = distributed.share(reqs, config.group)
        reqs = [reqs[i] for i in self.indices]
        rows = max(1, len(reqs) if config.batch_size is None else min(config.batch_size, len(reqs)))
        self.engine = engine_for(model, rows, config, kv_memory=distributed.kv_memory(model.config.tensor_group))
        self.requests = reqs
        self.ids = [self.engine.submit(r) for r in reqs]
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self) -> Iterator[Event]:
        index = {rid: self.indices[i] for i, rid in enumerate(self.ids)}
        if all(rid == i for rid, i in index.items()):  # a fresh engine numbers them as the prompts
            yield from self.engine.events()
            return
        for e in self.engine.events():
            yield e._replace(index=index[e.index])

    def result(self) -> GenerationResult:
        """The whole result, in prompt order (after the events have run)."""
        if self._result is None:
            if not all(self.engine.requests[i].finish_reason for i in self.ids):
                raise InputError("the job has not finished: iterate its events first")
            rows = [self.engine.take(i).row for i in self.ids]
            seeds = [s for r in self.requests for s in sampling.seeds(r.settings)]
            self._result = result(rows, self.engine.stats, seeds, self.top_n)
            if self.group is not None:  # a collective: every rank of the group calls result()
                self._result = distributed.gather(self._result, self.indices, self.group, self.total, self.top_n)
        return self._result


def stream_generate(model: Model, prompts: Prompt | list[Prompt], config: GenerationConfig | None = None,
                    **options) -> Job:
    """Like `generate`, but returns the job: iterate it for an `Event` per generated token of each
    prompt as it is produced, then call `.result()` for the whole `GenerationResult`."""
    config = GenerationConfig.make(config, options)
    reqs = requests(model, prompts, config)
    overflow = ring_overflow(reqs, config.max_kv_size)
    if overflow is not None:
        warnings.warn(f"max_kv_size={overflow}", stacklevel=2)
    return Job(model, reqs, config)


def generate(model: Model, prompts: Prompt | list[Prompt], config: GenerationConfig | None = None, *,
             on_event: Callable[[Event], None] | None = None, **options) -> GenerationResult:
    """Generate for one prompt or many, batched; each prompt's output equals its output alone.

    `prompts`: a str, token ids (a list or a 1-D array), message lists for the chat template, or a
    list of these. Options are `GenerationConfig`'s fields, as keywords or as `config` (keywords
    win): per-prompt options take one value for all prompts or a list with one value per prompt.
    `logprobs`: None for none, 0 for the chosen tokens' log-probabilities, n for the n most likely
    too. `batch_size`: decode at most this many rows at once, refilling rows as prompts finish.
    `max_kv_size`: bound the cache to a ring of that many tokens (each query then sees at most
    that many, and its row's first 4: attention sinks). `on_event`: called with each Event (e.g.
    for a progress bar). Every option is checked before any work starts.
    """
    job = stream_generate(model, prompts, config, **options)
    for event in job:
        if on_event is not None:
            on_event(event)
    return job.result()


def _with_options(fn: Callable) -> Callable:
    """Show GenerationConfig's fields as keyword parameters of `fn` (help(), IDEs, `inspect`)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(GenerationConfig)]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


generate = _with_options(generate)
stream_generate = _with_options(stream_generate)
