"""A draft model for speculative decoding: a smaller model with the same tokenizer proposes each
row's next k tokens.

It keeps a KV pool of its own whose rows mirror the engine's, filled when the engine admits a
request (the prompt, prefilled) and as rounds go. `draft_pos[r]` counts the positions whose draft
KV is right. A round is one compiled function of k + 1 one-token steps: it feeds the row's last
token and then each draft, so after any verdict (up to k drafts kept and one more token) the draft
KV is right up to the row's new last token, and the next round needs nothing from the host. Only
after plain decode steps does the host feed the tokens it lacks. Drafts are greedy for greedy
rows and sampled with the row's own settings for sampled rows (their distributions q go to the
verification, which keeps the target's distribution exact).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxfun.engine import prefill, sampling
from mlxfun.engine.blocks import Pool
from mlxfun.engine.paging import Pages
from mlxfun.engine.step import Mode, compiled_steps
from mlxfun.errors import InputError
from mlxfun.features.speculative import Drafter
from mlxfun.model import cache as kv
from mlxfun.model import llama
from mlxfun.model.config import ModelConfig
from mlxfun.model.load import Model

# Salt for the draft's own sampling noise (never the target's draws).
DRAFT_SALT = 0x68E31DA4


def draft_round(config: ModelConfig, k: int, sample: bool, search: sampling.Search, params: llama.Params,
                cache: kv.KVCache, tokens: mx.array, positions: mx.array, settings: sampling.Settings, steps: mx.array):
    """tokens (B,) at positions (B,) (-1: no row) -> drafts (B, k), q (B, k, V) or None, cache.
    k + 1 one-token steps, each feeding the last token (the row's, then its drafts); the last
    only writes the k-th draft's KV (a verdict may keep every draft)."""
    drafts, probs = [], []
    live = positions >= 0
    for i in range(k + 1):
        p = mx.where(live, positions + i, -1)
        h, cache = llama.hidden(config, params, tokens[:, None], p[:, None], None, cache, fast=True, check=False)
        if i == k:
            break
        logits = llama.logits(config, params, h[:, -1], fast=True).astype(mx.float32)  # (B, V)
        if sample:
            x = sampling.filter_logits(logits, settings, search=search)  # (B, V)
            seed = settings.seed ^ DRAFT_SALT
            drawn = sampling.greedy(x + sampling.gumbel(seed, steps + i, x.shape[-1]))
            tokens = mx.where(settings.temperature > 0, drawn, sampling.greedy(logits))
            probs.append(mx.softmax(x, axis=-1))
        else:
            tokens = sampling.greedy(logits)
        drafts.append(tokens)
    q = mx.stack(probs, axis=1) if sample else None
    return mx.stack(drafts, axis=1), q, cache


@lru_cache(maxsize=16)
def compiled_round(config: ModelConfig, k: int, sample: bool, search: sampling.Search):
    def run(params, cache, tokens, positions, settings, steps):
        return draft_round(config, k, sample, search, params, cache, tokens, positions, settings, steps)

    return mx.compile(run)


class DraftModel(Drafter):
    """Drafts for an engine's rows from `model` (same tokenizer, usually much smaller), on the
    device: the engine pipelines its rounds."""

    device = True

    def __init__(self, model: Model, engine):
        if model.config.vocab_size != engine.config.vocab_size:
            raise InputError(f"the draft model's vocabulary ({model.config.vocab_size}) differs from the model's "
                             f"({engine.config.vocab_size}): it must share the tokenizer")
        sample = [engine.model.tokenizer.token(i) for i in range(0, engine.config.vocab_size, 997)]
        if sample != [model.tokenizer.token(i) for i in range(0, engine.config.vocab_size, 997)]:
            raise InputError("the draft model's tokenizer differs from the model's: it must share the tokenizer")
        self.model = model
        self.cost = step_cost(model.params, engine.runner.params, mx.default_device() != mx.cpu)
        self.config = model.config.with_max_kv_size(engine.config.max_window) if engine.config.max_window and \
            all(w is not None for w in engine.config.layer_windows) else model.config
        self.dtype = model.params.norm.dtype
        self.pool = Pool(1, engine.scheduler.pool.block_size)
        self.multiple = engine.runner.pad_multiple
        self.pages = Pages(engine.rows, self.pool, self.config.max_window, engine.scheduler.max_blocks,
                           engine.scheduler.pages.least, sinks=self.config.sinks)
        self.cache: kv.KVCache | None = None
        self.draft_pos = [0] * engine.rows  # positions whose draft KV is right, per row

    def _ensure_cache(self) -> None:
        if self.cache is None:
            keys, values, positions = kv.pool(self.config, self.pool.size, self.pool.block_size, self.dtype)
            self.cache = kv.KVCache(keys, values, positions, mx.array(self.pages.table))

    def admitted(self, engine, rows: list[int]) -> None:
        """Nothing fed yet: a row's prompt is prefilled by its first round (`draft`) or catch-up,
        so that while the engine decodes plainly (the rule off) the draft model costs nothing.
        The draft pool takes the engine's size, which admission reserved for every position its
        rows may reach (the draft's rows hold the same positions): grown as rounds went, each
        new size traced the round and the catch-up anew, 35-45 ms of a switch back to
        speculation (8B with a 1B drafter, H200; 7fbc90b:benchmarks/README.md)."""
        for r in rows:
            self.draft_pos[r] = 0
        if self.pool.size < engine.scheduler.pool.size:
            self.pool.grow(engine.scheduler.pool.size)

    def lacking(self, engine) -> int:
        """Tokens the live rows' draft KV lacks before the next round (which feeds each row's last)."""
        total = 0
        for r, rid in enumerate(engine.scheduler.owner):
            if rid is not None:
                record = engine.requests[rid]
                total += max(0, len(record.request.prompt) + len(record.row.text.tokens) - 1 - self.draft_pos[r])
        return total

    def released(self, engine, row: int) -> None:
        self.pages.release(row)
        self.draft_pos[row] = 0

    def _feed(self, rows: list[int], histories: list[list[int]]) -> None:
        """Bring each row's draft KV up to the end of its history (the tokens it lacks)."""
        todo = [(r, h) for r, h in zip(rows, histories) if len(h) > self.draft_pos[r]]
        if not todo:
            return
        rows_, hist = [r for r, _ in todo], [h for _, h in todo]
        starts = [self.draft_pos[r] for r in rows_]
        # Chunks padded as the engine pads its own (32 on a GPU): a catch-up of a few tokens would
        # otherwise run the few-row products, which NVRTC builds per row count (about 2 s each on
        # an H200: 8B with a 1B drafter at batch 1 ran 0.08x plain with the rule on, 0.83x forced).
        _, self.cache = prefill.prefill_rows(compiled_steps(self.config, Mode()), self.model.params,
                                             self._detach()._replace(table=mx.array(self.pages.table[rows_])),
                                             self.pages, rows_, hist, starts, 512, self.multiple)
        for r, h in todo:
            self.draft_pos[r] = len(h)
        self.pages.dirty = True  # the cache came back with those rows' table only

    def _detach(self) -> kv.KVCache:
        """The draft cache, no longer held here: nothing else references its pool, so the prefill
        writes it in place (see `Engine._detach_cache`)."""
        cache, self.cache = self.cache, None
        return cache

    def catch_up(self, engine, rows: list[int]) -> None:
        """Feed the tokens plain decode steps added (all but each row's last: rounds feed it)."""
        self._ensure_cache()
        self._feed(rows, [_history(engine, r)[:-1] for r in rows])

    def propose(self, engine, rows: list[int], k: int) -> tuple[mx.array, mx.array, mx.array | None]:
        """-> drafts (B, k), valid (B, k), q (B, k, V) (or None when every row is greedy)."""
        histories = [_history(engine, r) for r in rows]
        self.catch_up(engine, rows)
        B = len(engine.scheduler.owner)
        positions = np.full(B, -1, np.int32)
        tokens = np.zeros(B, np.int32)
        valid = np.zeros((B, k), bool)
        for r, h in zip(rows, histories):
            positions[r], tokens[r] = len(h) - 1, h[-1]
            valid[r, :max(0, min(k, engine.scheduler.remaining(r) - 1))] = True
            self.pages.ensure(r, len(h) - 1, len(h) + k)
            self.pages.drop_behind(r, len(h) - 1)
        return self._round(engine, rows, k, engine.runner.state._replace(tokens=mx.array(tokens),
                                                                  positions=mx.array(positions)), mx.array(valid))

    def draft(self, engine, state, k: int) -> tuple[mx.array, mx.array, mx.array | None]:
        """From the device state (the engine's `pos` may lag it by one round of at most k + 1
        tokens: blocks are allocated for two rounds)."""
        rows = [r for r, o in enumerate(engine.scheduler.owner) if o is not None]
        self._ensure_cache()
        new = [r for r in rows if self.draft_pos[r] == 0]  # admitted since: their prompts, up to the first token
        self._feed(new, [list(engine.requests[engine.scheduler.owner[r]].request.prompt) for r in new])
        for r in rows:
            self.pages.ensure(r, engine.scheduler.pos[r], engine.speculation.round_end(engine, r))
        valid = mx.broadcast_to((state.positions >= 0)[:, None], (state.positions.shape[0], k))
        return self._round(engine, rows, k, state, valid)

    def _round(self, engine, rows: list[int], k: int, state, valid: mx.array):
        self._ensure_cache()
        B = len(engine.scheduler.owner)
        self.cache = prefill.ensure_pool(self.cache, self.pool.size)
        if self.pages.dirty or self.cache.table.shape[0] != B:
            self.cache = self.cache._replace(table=mx.array(self.pages.table[:B]))
            self.pages.dirty = False
        mode = _mode([engine.requests[engine.scheduler.owner[r]] for r in rows])
        drafts, q, self.cache = compiled_round(self.config, k, mode.sample, mode.search)(
            self.model.params, self.cache, state.tokens, state.positions, engine.runner.settings, state.steps)
        return drafts, valid, q

    def reorder(self, engine, keep: list[int]) -> None:
        self.pages.reorder(keep)
        self.draft_pos = [self.draft_pos[r] for r in keep] + [0] * (len(self.draft_pos) - len(keep))

    def verified(self, engine, row: int, count: int) -> None:
        """The draft KV is right up to the row's new last token (every draft was fed)."""
        self.draft_pos[row] += count


# The share of a target's decode step that is per-layer work independent of the weights' size (the
# host's launch of each layer's kernels) on a GPU. A 1B-shaped draft step cost about a third of an
# 8B target's on an H200 (7fbc90b:benchmarks/README.md, ninth session: launch-bound), where its weight
# bytes are 0.155 of the 8B's and its layers half; with this share the model below gives 0.33.
# Priced by bytes alone, the rule expected a 1B drafter's first measure to lose 4.5 decode steps
# and ran it in 256-token runs at batch 32, where it lost about 8% (eleventh session).
LAUNCH_SHARE = 0.5


def step_cost(draft: llama.Params, target: llama.Params, gpu: bool) -> float:
    """A draft model's decode step in steps of the target's: on a GPU the mean of its layers' and its
    weight bytes' ratios, weighted by LAUNCH_SHARE; on the CPU (its products are the step) the bytes'."""
    weights = _step_bytes(draft) / max(1, _step_bytes(target))
    if not gpu:
        return weights
    return LAUNCH_SHARE * len(draft.layers) / len(target.layers) + (1 - LAUNCH_SHARE) * weights


def _step_bytes(params: llama.Params) -> int:
    """The weight bytes a decode step reads: all but an embedding table of which it reads only
    its rows' entries (one apart from the output head)."""
    def size(tree) -> int:
        return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))

    return size(params) - (size(params.embed) if params.lm_head is not None else 0)


def _mode(records) -> Mode:
    return Mode(sample=any(r.mode.sample for r in records), search=sampling.any_search(r.mode.search for r in records))


def _history(engine, row: int) -> list[int]:
    """The row's prompt and the tokens it has generated (as handed out on the host)."""
    record = engine.requests[engine.scheduler.owner[row]]
    return list(record.request.prompt) + record.row.text.tokens
