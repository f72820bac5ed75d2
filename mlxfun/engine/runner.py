"""The runner: the device side of the engine. It owns the weights the steps read, the decode
state (`step.DecodeState`: the KV pool, each row's token, position, step and counts) and the
rows' sampling settings, and queues the compiled steps on them: prefill chunks, the first token,
decode, a split step's two halves (structured output; a CPU server's every step) and verify rounds.

It decides nothing: the scheduler says which rows hold what, and the engine passes that in
(row indices, block tables, pool sizes). Every step is queued (`mx.async_eval`), not waited for.

In-place writes. A step writes the KV pool in place only when nothing else references the old
pool, so no method keeps a reference to a state it has replaced (an extra reference makes MLX
copy the whole pool first: a 134 MB pool took 74 ms per write on a 2-core CPU against 0.07).
On the CPU, work still in flight is such a reference: it holds its outputs until it has run, and a
write queued behind it copies (a 1 GB pool: 900 ms a step against 0.1 ms). There, and for a
server's large pool on a GPU, a write into the pool waits for the one queued before it (`settle`,
`kv_budget.settle_bytes`).
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import numpy as np

from mlxfun.engine import prefill, sampling
from mlxfun.engine.paging import Pages
from mlxfun.engine.step import FORWARD, Chunk, DecodeState, Mode, StepOut, Steps, first_token
from mlxfun.engine.strategy import WeightStrategy, params_for_batch, params_for_prompts
from mlxfun.features import structured
from mlxfun.features.speculative import Verdict
from mlxfun.model import cache as kv
from mlxfun.model import weights
from mlxfun.model.config import ModelConfig
from mlxfun.model.load import Model

# Settings for a row that holds no request (its tokens are discarded). On the host: importing
# mlxfun makes no MLX array, which on CUDA would open a context in every process that imports it
# (a server's HTTP process among them).
IDLE = sampling.host_settings(1, seed=0)


class Runner:
    def __init__(self, model: Model, config: ModelConfig, rows: int, strategy: WeightStrategy,
                 steps: Callable[[ModelConfig, Mode], Steps], block_size: int, prefill_step: int, pad_multiple: int,
                 settle_bytes: int | None = 0, split: bool = False):
        self.config, self.strategy, self.steps = config, strategy, steps
        # Decode steps in two compiled halves (`step.forward_step`, then the mode's `sample_step`):
        # the forward pass compiles once per shape, not once per mode, so lighter sampled modes cost
        # little to warm up (`records.fixed_mode(light=True)`; a CPU server's: SmolLM2, 32 rows, a 1 GB
        # pool, 5.4 s for 16 modes against 6.6-7.0 s for 8 unsplit). A GPU step keeps one launch:
        # there the host's time per step counts.
        self.split = split
        self.block_size, self.prefill_step, self.pad_multiple = block_size, prefill_step, pad_multiple
        # Quantized weights may run as a dense copy for this many rows (mlxfun.engine.strategy).
        self.params = params_for_batch(model.config, model.params, rows, strategy)
        mx.eval(self.params)  # here, on the constructing thread: the engine thread may be another
        self.dtype = self.params.norm.dtype
        # What the steps read: the same weights, dense ones also as transposed views (no copy), so a
        # product is one graph node (a 1B decode step is host-bound on an H200: 65 nodes fewer).
        self.step_params = weights.with_transposed(config, self.params)
        self.state: DecodeState | None = None
        self.settings: sampling.Settings | None = None  # per-row settings of the state's rows
        # Pools of at least this many bytes are written after the write before has run (None: never).
        self.settle_bytes = settle_bytes
        self.waited = 0.0  # seconds `settle` waited for the device (`take_waited`)

    def steps_for(self, mode: Mode) -> Steps:
        return self.steps(self.config, mode)

    def settle(self, cache: kv.KVCache | None = None) -> None:
        """Before queuing a write into the pool (`cache`'s, else the state's): wait for the write
        queued before it, if the pool is large enough that copying it would cost more."""
        if self.settle_bytes is None:
            return
        if self.settle_bytes and _pool_bytes(cache if cache is not None else self.state.cache) < self.settle_bytes:
            return
        t = time.perf_counter()
        mx.synchronize()
        self.waited += time.perf_counter() - t

    def take_waited(self) -> float:
        """Seconds `settle` waited for the device since the last call: where the host is ahead of
        the device (a step's time less this is host time the device waited for)."""
        waited, self.waited = self.waited, 0.0
        return waited

    # ---- the state ----

    def empty_state(self, rows: int, blocks: int, table: np.ndarray) -> DecodeState:
        """A state of `rows` empty rows over a device pool of `blocks` blocks."""
        keys, values, positions = kv.pool(self.config, blocks, self.block_size, self.dtype)
        return DecodeState(kv.KVCache(keys, values, positions, mx.array(table)),
                           tokens=mx.zeros((rows,), mx.int32), positions=mx.full((rows,), -1, mx.int32),
                           steps=mx.zeros((rows,), mx.int32), counts=mx.zeros((rows, self.config.vocab_size), mx.int32))

    def drop(self) -> None:
        """Free the state (an idle engine with nothing cached)."""
        self.state, self.settings = None, None

    def restack(self, settings: list[sampling.Settings | None]) -> None:
        """The rows' sampling settings (host arrays; None: a row without a request) as one batch."""
        self.settings = _stack([IDLE if s is None else s for s in settings])

    def set_rows(self, keep: list[int], width: int) -> None:
        """Rows `keep` become rows 0, 1, ..., then empty rows up to `width`. Steps already queued
        keep their own arrays; the KV stays where it is (the rows' blocks move with them)."""
        s = self.state
        self.state = s._replace(tokens=_rows(s.tokens, keep, width, 0), positions=_rows(s.positions, keep, width, -1),
                                steps=_rows(s.steps, keep, width, 0), counts=_rows(s.counts, keep, width, 0))

    def sync(self, pool_blocks: int, table: np.ndarray | None, vacated: list[int]) -> None:
        """The state caught up with the host: the device pool at `pool_blocks`, a new block
        `table` (None: unchanged), and the `vacated` rows' positions at -1 (hidden)."""
        s = self.state
        cache, positions = prefill.ensure_pool(s.cache, pool_blocks), s.positions
        if table is not None:
            cache = cache._replace(table=mx.array(table))
        if vacated:
            check_rows(vacated, positions.shape[0], "vacated")
            positions = kv.updated(positions, mx.array(vacated, mx.int32), mx.full((len(vacated),), -1, mx.int32))
        if cache is not s.cache or positions is not s.positions:  # most steps: nothing to do
            self.state = s._replace(cache=cache, positions=positions)

    def compact(self, keep: np.ndarray, blocks: int) -> None:
        """The pool's blocks `keep` renumbered 0, 1, ... in a pool of `blocks` blocks."""
        cache = kv.take_blocks(self.state.cache, mx.array(keep))
        self.state = self.state._replace(cache=prefill.ensure_pool(cache, blocks))

    def write_blocks(self, blocks: list[int], keys: list[mx.array], values: list[mx.array], pool_blocks: int) -> None:
        """Keys and values (T, K, D) per layer written into `blocks` (their first len(blocks) * bs
        positions), positions 0 ... (a prompt cache's blocks), in a pool of `pool_blocks` blocks."""
        m, bs = len(blocks), self.block_size
        c = prefill.ensure_pool(self.state.cache, pool_blocks)
        index = mx.array(blocks, mx.int32)
        slots = kv.block_slots(index, bs)

        def put(pool: mx.array, new: mx.array) -> mx.array:  # new (T, K, D)
            return kv.updated(pool, slots, new[:m * bs, :, None])

        self.state = self.state._replace(cache=c._replace(
            keys=tuple(put(p, k) for p, k in zip(c.keys, keys)),
            values=tuple(put(p, v) for p, v in zip(c.values, values)),
            positions=kv.updated(c.positions, index, mx.arange(m * bs, dtype=mx.int32).reshape(m, bs))))

    def input_state(self, penalties: bool) -> DecodeState:
        """The state a step takes: without counts unless it applies penalties."""
        return self.state if penalties else self.state._replace(counts=None)

    def _advanced(self, state: DecodeState) -> None:
        """The state after a step (counts kept where the step had none)."""
        self.state = state if state.counts is not None else state._replace(counts=self.state.counts)

    # ---- steps ----

    def decode(self, steps: Steps, penalties: bool, chunk: Chunk | None = None) -> StepOut:
        """Queue one decode step for every row (rows without a request decode idly); with `chunk`,
        its prompt tokens ride along (`step.mixed_step`) and the rows it admits get their first
        tokens from the step. A split runner without a chunk queues the two halves."""
        if self.split and chunk is None:
            return self.sample(steps, self.forward(), None, penalties)
        state = self.input_state(penalties)
        out, state = steps.decode(self.step_params, state, self.settings) if chunk is None else \
            steps.mixed(self.step_params, state, self.settings, chunk)
        self._advanced(state)  # the old state unreferenced: the step writes the KV pool in place
        self.settle()
        mx.async_eval(out, self.state)
        return out

    def forward(self) -> mx.array:
        """Queue a decode step's forward pass (a split step's first half; the same for every mode,
        `step.FORWARD`'s, without counts) -> logits."""
        logits, state = self.steps_for(FORWARD).forward(self.step_params, self.input_state(False))
        self._advanced(state)
        self.settle()
        mx.async_eval(logits, self.state)
        return logits

    def sample(self, steps: Steps, logits: mx.array, masks: mx.array | None, penalties: bool) -> StepOut:
        """Queue a split step's second half: each row's token (under its mask, where the mode is masked)."""
        out, state = steps.sample(logits, masks, self.input_state(penalties), self.settings)
        self._advanced(state)
        mx.async_eval(out, self.state)
        return out

    def verify(self, steps: Steps, drafts: mx.array, valid: mx.array, q: mx.array | None) -> Verdict:
        """Queue a verify round: every row's drafts (B, k) checked by one forward pass."""
        out, state = steps.verify(self.step_params, self.state._replace(counts=None), drafts, valid, q, self.settings)
        self.state = state._replace(counts=self.state.counts)
        self.settle()
        mx.async_eval(out, self.state)
        return out

    # ---- admission ----

    def prompt_params(self, lengths: list[int]):
        """The weights a prefill of these prompts multiplies by (long prompts may run a dense copy
        of quantized weights, dropped after admission: mlxfun.engine.strategy)."""
        return params_for_prompts(self.config, self.step_params, lengths, self.prefill_step, self.strategy)

    def prefill(self, params, pages: Pages, rows: list[int], prompts: list[list[int]], starts: list[int],
                chains, previous: Callable[[], None] | None, busy: bool = False) -> mx.array:
        """Queue the prefill of `prompts` (from `starts`, the ends of their cached prefixes) into
        `rows` -> the hidden state of each prompt's last token (G, E). `busy`: a decode step is in
        flight (`prefill.prefill_rows`)."""
        # Passed on as a temporary: no reference to the pool may outlive the call (this frame's
        # included), or the chunks' writes would copy the whole pool rather than write it in place.
        h, cache = prefill.prefill_rows(self.steps(self.config, Mode()), params, self._detach_cache(), pages, rows,
                                        prompts, starts, self.prefill_step, self.pad_multiple, chains, previous,
                                        None if self.settle_bytes is None else self.settle, busy=busy)
        self.state = self.state._replace(cache=cache)
        return h

    def _detach_cache(self):
        """The state's cache, which the state then no longer holds: a write into an array nothing
        else references happens in place."""
        cache = self.state.cache
        self.state = self.state._replace(cache=None)
        return cache

    def first_tokens(self, params, h: mx.array, rows: list[int], mode: Mode, settings: list[sampling.Settings],
                     matchers: list | None, lengths: list[int], generated: list[list[int]] | None = None) -> StepOut:
        """Each admitted row's next token from its last hidden state, merged into the state at
        `rows`. Not compiled: group sizes vary, and each new shape would trace and build kernels
        again. `matchers`: the rows' constraints (structured output), when any row has one.
        `generated`: the tokens each row's request had generated before (a preempted request
        resumes): its sampler's counter and penalty counts go on from them."""
        vocab = self.config.vocab_size
        done = np.array([len(g) for g in generated] if generated else [0] * len(rows), np.int32)  # (G,)
        counts = None
        if generated and any(done):
            counts = mx.array(np.stack([np.bincount(np.asarray(g, np.int64), minlength=vocab)[:vocab]
                                        for g in generated]).astype(np.int32))  # (G, V)
        if counts is None or not mode.penalties:
            mode = mode._replace(penalties=False)  # nothing generated yet: counts are zero
        mask = None
        if matchers is not None:
            mask = mx.array(structured.fill_masks(matchers, np.ones((len(rows), structured.words(vocab)), np.uint32)))
        steps = mx.array(done)
        out = first_token(self.config, mode, params, h, _stack(settings), steps,
                          counts if mode.penalties else None, mask)
        s = self.state
        check_rows(rows, s.tokens.shape[0], "admitted")
        r = mx.array(rows, dtype=mx.int32)
        before = mx.zeros((len(rows), s.counts.shape[1]), mx.int32) if counts is None else counts
        self.state = s._replace(tokens=kv.updated(s.tokens, r, out.tokens),
                                positions=kv.updated(s.positions, r, mx.array(lengths, mx.int32)),
                                steps=kv.updated(s.steps, r, steps + 1),
                                counts=kv.updated(s.counts, r, sampling.update_counts(before, out.tokens)))
        return out


def _pool_bytes(cache: kv.KVCache) -> int:
    return sum(k.nbytes for k in cache.keys) + sum(v.nbytes for v in cache.values)


def _rows(a: mx.array, keep: list[int], width: int, fill) -> mx.array:
    """a (B, ...) -> (width, ...): rows `keep` of a, then rows of `fill`."""
    kept = a[mx.array(keep, mx.int32)] if keep else a[:0]
    pad = mx.full((width - len(keep), *a.shape[1:]), fill, a.dtype)
    return mx.concatenate([kept, pad]) if width > len(keep) else kept


def check_rows(rows: list[int], width: int, what: str) -> None:
    """Rows a scatter is about to write, checked on the host: MLX does not bound-check scatter
    indices, so a row past the state would write past the end of its arrays (heap corruption)."""
    if rows and not 0 <= min(rows) <= max(rows) < width:
        raise RuntimeError(f"engine bug: {what} rows {sorted(rows)} outside a state of {width} rows")


def _stack(settings: list[sampling.Settings]) -> sampling.Settings:
    """Rows' settings (host arrays, one Settings each) -> one batch on the device: stacked on the
    host, then one copy per field. (Concatenated on the device, each row's field was a copy kernel
    of its own: about a thousand launches to restack 128 rows.)"""
    return sampling.on_device(sampling.Settings(*(np.concatenate(fields) for fields in zip(*settings))))
