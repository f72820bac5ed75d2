"""Prompts that ride along a decode step (`step.mixed_step`): how many, in chunks of what length,
and how a chunk is laid out from the prompts it admits.

A server's clients send their next request as the last one ends, so on a GPU its requests arrive one
or two at a time. Their prompts' tokens join the next decode step as one-token rows, so an
admission costs that step the prompts' share of work rather than a prefill of its own (a graph,
its launches, and a wait for both on a server's large pool).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlxfun.engine.records import Record
from mlxfun.engine.scheduler import Scheduler
from mlxfun.engine.step import Chunk
from mlxfun.errors import InputError, check_non_negative_int

# A GPU server's decode step carries up to this many prompt tokens of the requests it admits.
MIXED_TOKENS = 512
# At most this many: each chunk length compiles at start, and a step's activations grow with it.
MAX_MIXED_TOKENS = 8192


def check_mixed_tokens(name: str, value: int | None) -> None:
    """Raise InputError unless `value` (None: the default) is a whole number of prompt tokens a
    decode step may carry: 0 (none) to MAX_MIXED_TOKENS."""
    if value is None:
        return
    check_non_negative_int(name, value)
    if value > MAX_MIXED_TOKENS:
        raise InputError(f"{name} must be at most {MAX_MIXED_TOKENS} (each chunk length compiles at start; longer "
                         f"prompts prefill on their own), got {value}")


def chunk_sizes(mixed_tokens: int) -> tuple[int, ...]:
    """The lengths a decode step's chunk of prompts is padded to (each compiles its own step): a
    quarter, a half and all of `mixed_tokens` (one length below 256); past 512, every power of two
    from 128 up to it, then itself (a burst's many prompts ride in one step, a lone prompt still pads
    little). Every padded token costs the step its share: on an H100, 1B, 32 rows, a closed loop of
    128-token prompts ran 7,959 tok/s with chunks of 128, 6,864 and 6,565 with 256 and 5,559 with
    512 (one lease); two such prompts together take 256."""
    if not mixed_tokens:
        return ()
    if mixed_tokens > 512:
        powers = tuple(1 << k for k in range(7, mixed_tokens.bit_length()) if 1 << k < mixed_tokens)
        return powers + (mixed_tokens,)
    return (mixed_tokens // 4, mixed_tokens // 2, mixed_tokens) if mixed_tokens >= 256 else (mixed_tokens,)


def default_mixed_tokens(on_gpu: bool, fixed_shapes: bool) -> int:
    """A GPU server's engine admits short prompts inside its decode steps: a step is launch-bound
    there, so a few hundred more tokens add little to it, where an admission of its own costs a
    prefill graph and its launches. On the CPU every token costs the same either way, and an
    offline run admits its prompts in large waves, which a prefill of their own serves better."""
    return MIXED_TOKENS if on_gpu and fixed_shapes else 0


class Admitted(NamedTuple):
    """Requests admitted to ride along the next decode step, and the chunk that carries them."""

    chunk: Chunk
    rows: list[int]
    records: list[Record]


def layout(width: int, rows: list[int], prompts: list[list[int]], starts: list[int],
           sizes: tuple[int, ...]) -> Chunk:
    """The chunk admitting prompts[i][starts[i]:] into rows[i] of a `width`-row step (the tokens
    before starts[i] cached), padded to the least of `sizes` that holds them: each row's first
    token comes from its prompt's last."""
    tokens, positions, owners = [], [], []
    source = np.arange(width, dtype=np.int32)  # (B,) a decoding row's next token is its own
    ends, lengths = np.zeros(width, bool), np.zeros(width, np.int32)
    for row, prompt, start in zip(rows, prompts, starts):
        n = len(prompt)
        tokens += prompt[start:]
        positions += range(start, n)
        owners += [row] * (n - start)
        source[row], ends[row], lengths[row] = width + len(tokens) - 1, True, n
    pad = next(p for p in sizes if p >= len(tokens)) - len(tokens)
    return Chunk(mx.array(tokens + [0] * pad, mx.int32), mx.array(positions + [-1] * pad, mx.int32),
                 mx.array(owners + [0] * pad, mx.int32), mx.array(source), mx.array(ends), mx.array(lengths))


def place(scheduler: Scheduler, records: list[Record], free: list[int], sizes: tuple[int, ...]) -> Admitted:
    """The requests placed in free rows (taken from `free`) after their cached prefixes, with
    blocks for their prompts; their remaining tokens make the next decode step's chunk (`layout`)."""
    prefixes = [scheduler.cached_prefix(r) for r in records]
    rows = [free.pop(0) for _ in records]
    scheduler.place(rows, records, prefixes)
    for row, r in zip(rows, records):
        scheduler.pages.ensure(row, r.cached_tokens, len(r.prompt))
    chunk = layout(len(scheduler.owner), rows, [r.prompt for r in records], [r.cached_tokens for r in records], sizes)
    return Admitted(chunk, rows, records)


def idle_chunk(rows: int, tokens: int) -> Chunk:
    """A chunk of `tokens` padding tokens that admits no row (their writes go to the scratch
    block): a server's warm-up compiles each chunk length with it."""
    return Chunk(mx.zeros((tokens,), mx.int32), mx.full((tokens,), -1, mx.int32), mx.zeros((tokens,), mx.int32),
                 mx.arange(rows, dtype=mx.int32), mx.zeros((rows,), mx.bool_), mx.zeros((rows,), mx.int32))


def fits(scheduler: Scheduler, records: list[Record], mixed_tokens: int, masked: bool) -> bool:
    """Whether these admitted requests' prompts can ride along the next decode step: they fit
    its chunk once their cached prefixes are known, none resumes after a preemption (its sampler
    goes on from its tokens), none is constrained and no live row is (`masked`: a masked step is
    split in two), and they need one prefill wave."""
    if not mixed_tokens or masked or any(r.matcher is not None or r.row.text.tokens for r in records):
        return False
    if len(scheduler.waves(records)) > 1:
        return False
    return sum(scheduler.uncached(r) for r in records) <= mixed_tokens


def register(scheduler: Scheduler, admitted: Admitted) -> None:
    """The prefix cache learns each admitted prompt's full blocks, once the step computing them is
    queued."""
    bs = scheduler.pool.block_size
    for row, r in zip(admitted.rows, admitted.records):
        scheduler.pool.register(r.prompt, scheduler.pages.blocks(row, len(r.prompt) // bs),
                                known=r.prompt_chain(bs) if scheduler.pool.max_cached > 0 else ())
