"""A fixed-shape engine's warm-up: every compiled step it may take, traced and run once at start.

A server's engine (`Engine(fixed_shapes=True)`) keeps its step shapes few: one KV pool size for
its life, all its rows, the table widths of `paging.ladder` and the modes of
`records.fixed_modes`. `warm_up` runs each (width, mode) decode step on the idle rows (positions
-1: their writes go to the scratch block, their tokens are dropped), each mode's first-token
sampling, one short request end to end, and on a GPU a one-row prompt of each chunk length a
prompt can take, so that nothing compiles on the request path (a 1B step traces in about a second
on an H200; MLX's CUDA backend builds a kernel the first time it meets it, 26 s for the
full-vocabulary sort; each new prefill shape costs cuBLAS and cuDNN plans).
"""

from __future__ import annotations

import importlib.util
import time
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
import numpy as np

from mlxfun.engine import sampling
from mlxfun.engine.records import fixed_modes
from mlxfun.engine.riding import idle_chunk
from mlxfun.engine.step import FORWARD, Chunk, first_token
from mlxfun.features import structured

if TYPE_CHECKING:
    from mlxfun.engine.core import Engine


class Warmup(NamedTuple):
    variants: int  # (row count, table width, mode) decode steps compiled and run
    widths: tuple[int, ...]  # the table widths, in tokens
    seconds: float
    width_seconds: tuple[float, ...] = ()  # each width's steps (all modes), in `widths` order
    rest_seconds: float = 0.0  # first-token sampling per mode and the request run end to end
    prompt_lengths: tuple[int, ...] = ()  # the one-row prompts prefilled (GPU: each chunk length)
    prompt_seconds: float = 0.0  # their time
    carrying: int = 0  # (row count, table width, mode, chunk length) steps that carry prompts, compiled and run
    chunk_sizes: tuple[int, ...] = ()  # their chunk lengths (`riding.chunk_sizes`)
    rows: tuple[int, ...] = ()  # the state's row counts (all rows; on the CPU each power of two up to them)


def masks_available() -> bool:
    """Whether structured output (the llguidance extra) can constrain a row."""
    return importlib.util.find_spec("llguidance") is not None


def warm_up(engine: Engine) -> Warmup:
    """Compile and run every decode step a fixed-shape, idle engine may take: each (row count,
    table width, mode). Speculative verify rounds are not among them: with a draft model they
    compile when first used."""
    if not engine.fixed or not engine.idle:
        raise RuntimeError("warm_up takes an idle engine made with fixed_shapes=True")
    t0 = time.perf_counter()
    sched, runner = engine.scheduler, engine.runner
    sched.pages.reserve(sched.max_blocks)  # the one pool size
    engine.ensure_state()
    engine.sync()
    runner.restack([None] * len(sched.owner))
    idle_width = runner.state.cache.table.shape[1]  # an idle state's table: zeros, every row on the scratch block
    modes = fixed_modes(masks_available(), runner.split)
    # A ring's table is its ring's columns whatever the rows hold (`Pages.fit_width`), not the ladder's.
    widths = [sched.pages.ring] if sched.pages.ring is not None else sched.pages.widths or [sched.pages.width]
    per_width = [0.0] * len(widths)
    row_widths = sched.widths()
    for rows in row_widths:  # all rows on a GPU; on the CPU, each power of two the rows shrink to
        engine._set_width(rows)  # idle: `rows` empty rows, their settings restacked
        everything = mx.full((rows, structured.words(engine.config.vocab_size)), 0xFFFFFFFF, mx.uint32)
        chunks = [idle_chunk(rows, n) for n in engine.chunk_sizes]
        for i, width in enumerate(widths):
            t = time.perf_counter()
            runner.state = runner.state._replace(cache=runner.state.cache._replace(table=mx.zeros((rows, width),
                                                                                                   mx.int32)))
            for mode in modes:
                steps = runner.steps_for(mode)
                if (i or rows != row_widths[0]) and mx.default_device() == mx.cpu:
                    # Traced only: MLX's CPU kernels of the first shape serve every shape, and a step
                    # over a wide table costs seconds there (its keys are gathered).
                    _trace(runner, steps, mode, everything, chunks)
                    continue
                if mode.masked:
                    out = runner.sample(steps, runner.forward(), everything, mode.penalties)
                else:
                    out = runner.decode(steps, mode.penalties)
                mx.eval(out, runner.state)
                for chunk in [] if mode.masked else chunks:  # masked steps carry no prompts
                    mx.eval(runner.decode(steps, mode.penalties, chunk), runner.state)
            per_width[i] += time.perf_counter() - t
    t = time.perf_counter()
    table = mx.zeros((row_widths[-1], idle_width), mx.int32)  # the state now holds the last row count
    runner.state = runner.state._replace(cache=runner.state.cache._replace(table=table))
    _first_tokens(engine, modes)
    # One request end to end: its prefill, first token and decode steps, through the real path.
    engine.add([1, 2, 3], max_tokens=3, ignore_eos=True)
    engine.add([1, 2, 3], max_tokens=3, ignore_eos=True, settings=sampling.make_settings(1, temperature=1.0,
                                                                                           top_p=0.9, seed=0))
    _run(engine)
    rest = time.perf_counter() - t
    t = time.perf_counter()
    lengths = _prompt_lengths(engine)
    prompts = time.perf_counter() - t
    engine.reset_stats()  # the counters start with the first real request
    bs = sched.pool.block_size
    carrying = len(row_widths) * len(widths) * sum(not m.masked for m in modes) * len(engine.chunk_sizes)
    return Warmup(len(row_widths) * len(widths) * len(modes), tuple(w * bs for w in widths),
                  time.perf_counter() - t0, tuple(per_width), rest, lengths, prompts, carrying, engine.chunk_sizes,
                  tuple(row_widths))


def _run(engine: Engine) -> None:
    """Run the queued requests to their ends and drop them."""
    for _ in engine.events():
        pass
    for rid in list(engine.requests):
        engine.take(rid)


def _prompt_lengths(engine: Engine) -> tuple[int, ...]:
    """Prefill a one-row prompt of every chunk length a prompt can take where lengths are rounded
    (a GPU: multiples of `pad_multiple` up to the chunk), one at a time: a server's first request of
    each length then meets no new shape (on an H100 a 1B's first admission of a new chunk shape took
    12-30 ms more than its repeats; all 16 lengths took 0.3 s here). On the CPU lengths are not
    rounded and every length would be a shape of its own."""
    multiple = engine.runner.pad_multiple
    chunk = min(engine.runner.prefill_step, engine.config.max_position_embeddings - 1)
    if multiple <= 1:
        return ()
    lengths = tuple(range(multiple, chunk + 1, multiple))
    for n in lengths:
        # Random tokens: no prompt is a prefix-cache hit on another (which would shorten its chunk).
        ids = np.random.default_rng(n).integers(1, engine.config.vocab_size, n).tolist()
        engine.add(ids, max_tokens=1, ignore_eos=True)
        _run(engine)
    return lengths


def _trace(runner, steps, mode, everything: mx.array, chunks: list[Chunk]) -> None:
    """Trace a step on the state's shapes; nothing runs (its lazy outputs are dropped). A split
    step (`Runner.split`, or masked) traces the shared forward half and the mode's sampling half."""
    state = runner.input_state(mode.penalties)
    if mode.masked or runner.split:
        logits, after = runner.steps_for(FORWARD).forward(runner.step_params, runner.input_state(False))
        steps.sample(logits, everything if mode.masked else None, after._replace(counts=state.counts),
                     runner.settings)
    else:
        steps.decode(runner.step_params, state, runner.settings)
    for chunk in [] if mode.masked else chunks:
        steps.mixed(runner.step_params, state, runner.settings, chunk)


def _first_tokens(engine: Engine, modes) -> None:
    """Each mode's first-token sampling (not compiled: MLX builds its kernels at first use)."""
    runner, config = engine.runner, engine.config
    h = mx.zeros((1, config.hidden_size), runner.dtype)
    settings = sampling.make_settings(1, temperature=1.0, top_p=0.9, top_k=5, seed=0)
    for mode in modes:
        mask = mx.full((1, structured.words(config.vocab_size)), 0xFFFFFFFF, mx.uint32) if mode.masked else None
        mx.eval(first_token(config, mode._replace(penalties=False), runner.params, h, settings,
                            mx.zeros((1,), mx.int32), None, mask))
