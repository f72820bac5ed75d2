"""`python -m mlxfun.bench.main --speculative`: speculative decoding against plain decoding, by batch size.

- oracle: the verify side alone. A drafter that costs nothing proposes the target's own greedy
  continuation (from a run without speculation), each drafted token replaced by a random one with
  probability 1 - alpha; speculation is forced on, so the figure is verification and bookkeeping.
- real drafters, end to end, with the engine's measured rule deciding: prompt lookup, or a draft
  model (`--draft-shape` for random-weight shapes, or the default model's 4-bit weights for its
  float32 copy).
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxfun.bench.models import DTYPES, SHAPES, machine, random_params, random_prompts, workload_model
from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.features import speculative
from mlxfun.features.drafting import DraftModel
from mlxfun.model import weights
from mlxfun.model.llama import Dense
from mlxfun.model.load import Model, load


class Oracle(speculative.Drafter):
    """Drafts the target's known continuation, each token replaced by a random one with
    probability 1 - alpha (a drafter of acceptance rate about alpha that costs nothing)."""

    def __init__(self, continuations: dict[int, list[int]], alpha: float, vocab: int, seed: int = 0):
        self.continuations, self.alpha, self.vocab = continuations, alpha, vocab
        self.rng = random.Random(seed)

    def propose(self, engine: Engine, rows: list[int], k: int):
        B = len(engine.scheduler.owner)
        drafts, valid = np.zeros((B, k), np.int32), np.zeros((B, k), bool)
        for r in rows:
            record = engine.requests[engine.scheduler.owner[r]]
            done = len(record.row.text.tokens)
            future = self.continuations[record.id][done:done + k]
            d = [t if self.rng.random() < self.alpha else self.rng.randrange(self.vocab) for t in future]
            drafts[r, :len(d)], valid[r, :len(d)] = d, True
        return mx.array(drafts), mx.array(valid), None


class DeviceOracle(speculative.Drafter):
    """The oracle as a device drafter: the same drafts (at the same acceptance rate), computed
    from the device state, so the engine pipelines its rounds (`Engine.verify_ahead`) as it would
    with a draft model. Its randomness is a hash of (seed, token index, draft slot)."""

    device = True

    def __init__(self, continuations: dict[int, list[int]], alpha: float, vocab: int, seed: int = 0):
        width = max(len(c) for c in continuations.values()) + 1
        table = np.zeros((max(continuations) + 1, width), np.int32)  # request id -> its continuation
        for i, c in continuations.items():
            table[i, :len(c)] = c
        self.table, self.alpha, self.vocab, self.seed = mx.array(table), mx.array(alpha, mx.float32), vocab, seed
        self.rows: tuple[list, mx.array] | None = None  # the owners and their continuations, (B, L)

    def draft(self, engine: Engine, state, k: int):
        if self.rows is None or self.rows[0] != engine.scheduler.owner:
            owners = list(engine.scheduler.owner)
            self.rows = owners, self.table[mx.array([o if o is not None else 0 for o in owners], mx.int32)]
        # One compiled call: each op costs the host a launch, and a pipelined round is host-bound.
        return (*_oracle_drafts(self.rows[1], state.steps, state.positions, self.alpha, self.vocab, self.seed, k),
                None)


class CostedOracle(DraftModel):
    """A draft model's cost with the oracle's acceptance: each round runs the draft model as a
    real drafter would (its prompts' prefill, k + 1 one-token steps), and proposes the oracle's
    drafts instead of its own (a random-weight draft model's drafts are never kept). The issue's
    "1B-shaped random drafter for the 8B target, with acceptance taken from the oracle runs"."""

    def __init__(self, model: Model, engine: Engine, continuations: dict[int, list[int]], alpha: float):
        super().__init__(model, engine)
        self.oracle = DeviceOracle(continuations, alpha, engine.config.vocab_size)

    def draft(self, engine: Engine, state, k: int):
        own, valid, _ = super().draft(engine, state, k)
        drafts, _, _ = self.oracle.draft(engine, state, k)
        # The oracle's drafts, made to depend on the draft model's so that its round runs (own >= 0).
        return mx.where(own >= 0, drafts, own), valid, None


@mx.compile
def _oracle_drafts(cont: mx.array, steps: mx.array, positions: mx.array, alpha: mx.array, vocab: int, seed: int,
                   k: int) -> tuple[mx.array, mx.array]:
    """cont (B, L) each row's continuation, steps (B,) its tokens so far -> drafts (B, k) (the
    continuation, each token kept with probability alpha, else a random one), valid (B, k)."""
    B = cont.shape[0]
    index = steps[:, None] + mx.arange(k)[None, :]  # (B, k): the token index each draft takes
    truth = mx.take_along_axis(cont, mx.minimum(index, cont.shape[1] - 1), axis=1)  # (B, k)
    # A stream per (row, draft slot): rows keep drafts independently (one stream per slot made every
    # row keep the same drafts, and a round's mean over rows as noisy as one row's).
    slot = (mx.arange(B, dtype=mx.uint32)[:, None] * 64 + mx.arange(k, dtype=mx.uint32)[None, :]).reshape(-1)
    keep = sampling.uniform(slot + seed * (1 << 20), index.reshape(-1), 1).reshape(B, k) < alpha
    other = sampling.uniform(slot + seed * (1 << 20) + 32, index.reshape(-1), 1).reshape(B, k) * vocab
    drafts = mx.where(keep, truth, mx.minimum(other.astype(mx.int32), vocab - 1))
    return drafts, mx.broadcast_to((positions >= 0)[:, None], (B, k))


def predictable(model: Model, scale: float = 100.0) -> Model:
    """The same shapes and cost, with weights whose greedy continuation survives rounding: the
    token embedding dominates the residual stream (scaled up; every layer reads it normalised),
    and the output head is the unscaled embedding, so each step predicts its input token by a
    wide margin. Random weights give nearly uniform logits instead: a verify pass over k + 1
    positions rounds differently from one-token steps and flips their argmax, and the oracle's
    drafts were rejected whatever alpha said (acceptance 0.02 at alpha 0.7, 8B bf16 on an H200).
    Dense weights only (the benchmark's random shapes)."""
    p = model.params
    if not isinstance(p.embed, Dense) or not isinstance(p.lm_head, (Dense, type(None))):
        raise ValueError("predictable() takes a model with dense embeddings")
    head = p.embed if p.lm_head is None or p.lm_head.weight.shape == p.embed.weight.shape else p.lm_head
    params = p._replace(embed=Dense(p.embed.weight * scale, p.embed.bias), lm_head=head)
    return Model(model.config, params, model.tokenizer, model.source)


@dataclass
class SpecRow:
    drafter: str
    batch: int
    k: int
    alpha: float | None
    plain_tps: float
    spec_tps: float
    acceptance: float  # drafts kept / drafts proposed
    tokens_per_round: float  # tokens a row took per verify round
    verify_rounds: int
    steps: int

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps if self.plain_tps else 0.0


def _run(model: Model, prompts: list[list[int]], max_tokens: int, draft=None, k: int = 4, policy=None,
         ids_out: dict | None = None):
    """`draft`: what `Engine` takes, or a function of the engine that makes its drafter."""
    engine = Engine(model, len(prompts), draft=None if callable(draft) else draft, num_draft_tokens=k,
                    policy=policy)
    if callable(draft):
        engine.speculation.drafter = draft(engine)
    ids = [engine.add(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    for _ in engine.events():
        pass
    rows = [engine.take(i).row for i in ids]
    if ids_out is not None:
        ids_out.update({i: r.token_ids for i, r in zip(ids, rows)})
    # Generation alone: the prompts' prefill (seconds of the whole run on a CPU's reference BLAS)
    # is the same with and without speculation, and would dilute the ratio.
    return engine, sum(len(r.token_ids) for r in rows) / engine.stats.generation_time


def paired(model: Model, prompts: list[list[int]], max_tokens: int, repeats: int, draft, k: int,
           policy: Callable[[], speculative.Policy | None]) -> tuple[float, float, Engine]:
    """Plain runs and runs with `draft` (a fresh `policy()` each) alternating, `repeats` of each ->
    the median tok/s of each, and the last speculative run's engine (its counts). One run against
    the next moves an 8B step at batch 32 by up to 30% on the lent H200's host, more than the
    floor measured (0.97x): a single pair could not tell it."""
    plain, spec, engine = [], [], None
    for _ in range(repeats):
        plain.append(_run(model, prompts, max_tokens)[1])
        engine, tps = _run(model, prompts, max_tokens, draft=draft, k=k, policy=policy())
        spec.append(tps)
    return statistics.median(plain), statistics.median(spec), engine


def oracle(model: Model, prompts: list[list[int]], max_tokens: int, alphas: list[float], ks: list[int]
           ) -> list[SpecRow]:
    """Plain decoding, then the oracle drafter at each (alpha, k), speculation forced on. Random
    weights are made `predictable` first, so a draft of the greedy continuation is accepted."""
    model = predictable(model)
    # Warm-ups run the measured length: a row's table widens in buckets as it grows and each width
    # traces the steps anew (8B on an H200, 256 tokens: 20.7 tok/s when warmed at 4 tokens).
    _run(model, prompts, max_tokens)
    continuation: dict[int, list[int]] = {}
    _, plain = _run(model, prompts, max_tokens, ids_out=continuation)
    out = []
    for k in ks:
        # Compile the verify step of this k at this batch size (a first trace costs seconds on a GPU),
        # with the drafter as measured: warmed with a stand-in (other continuations, vocabulary and
        # alpha), the first measured run of the device oracle took 0.16x plain (8B, H200).
        for kind in (DeviceOracle, Oracle):
            _run(model, prompts, max_tokens, draft=kind(continuation, alphas[0], model.config.vocab_size),
                 k=k, policy=speculative.Always())
        for alpha in alphas:
            # Device drafts (rounds pipelined, as with a draft model), then host drafts (synchronous
            # rounds, as with prompt lookup). Request ids restart at 0 in each engine, so the
            # continuations are found by id.
            for name, kind in (("oracle", DeviceOracle), ("oracle-host", Oracle)):
                drafter = kind(continuation, alpha, model.config.vocab_size)
                engine, tps = _run(model, prompts, max_tokens, draft=drafter, k=k, policy=speculative.Always())
                out.append(_row(name, len(prompts), k, alpha, plain, tps, engine))
                print(f"  {name:11s} B={len(prompts):4d} k={k} alpha={alpha}: {tps:9.1f} tok/s vs {plain:9.1f} "
                      f"({tps / plain:.2f}x), {out[-1].tokens_per_round:.2f} tokens per round", flush=True)
    return out


def end_to_end(model: Model, prompts: list[list[int]], max_tokens: int, name: str, draft, k: int,
               forced: bool = False, repeats: int = 1) -> SpecRow:
    """Plain decoding against a real drafter (the measured rule on, unless `forced`), `repeats`
    runs of each alternating (`paired`)."""
    _run(model, prompts, max_tokens)  # compile both steps at this batch size and length (see `oracle`)
    _run(model, prompts, max_tokens, draft=draft, k=k, policy=speculative.Always())
    if not forced:  # the rule's path once: its switches trace shapes forced rounds never reach
        _run(model, prompts, max_tokens, draft=draft, k=k)
    plain, tps, engine = paired(model, prompts, max_tokens, repeats, draft, k,
                                speculative.Always if forced else lambda: None)
    row = _row(name + (" (forced)" if forced else ""), len(prompts), k, None, plain, tps, engine)
    print(f"  {row.drafter} B={len(prompts):4d} k={k}: {tps:9.1f} tok/s vs {plain:9.1f} ({row.speedup:.2f}x), "
          f"acceptance {row.acceptance:.2f}, {row.verify_rounds} of {row.steps} rounds verified", flush=True)
    return row


def costed(model: Model, prompts: list[list[int]], max_tokens: int, draft: Model, alphas: list[float], k: int,
           repeats: int = 1, modes: tuple[bool, ...] = (False, True)) -> list[SpecRow]:
    """A draft model's cost with the oracle's acceptance (`CostedOracle`), the measured rule on
    and forced (`modes`: forced or not), against plain decoding of the same `predictable` target (`repeats` runs of each
    alternating, `paired`)."""
    model = predictable(model)
    _run(model, prompts, max_tokens)
    continuation: dict[int, list[int]] = {}
    _run(model, prompts, max_tokens, ids_out=continuation)
    out = []
    for alpha in alphas:
        def make(engine, alpha=alpha):
            return CostedOracle(draft, engine, continuation, alpha)

        _run(model, prompts, max_tokens, draft=make, k=k, policy=speculative.Always())  # compile the round
        # The rule's path once: a catch-up after plain steps, a decode step at the table width rounds
        # reached: shapes forced rounds never trace (H200: 30-60 ms each).
        _run(model, prompts, max_tokens, draft=make, k=k)
        for forced in modes:
            base, tps, engine = paired(model, prompts, max_tokens, repeats, make, k,
                                       speculative.Always if forced else lambda: None)
            out.append(_row("draft cost, oracle drafts" + (" (forced)" if forced else ""), len(prompts), k, alpha,
                            base, tps, engine))
            r = out[-1]
            print(f"  {r.drafter} B={len(prompts):4d} k={k} alpha={alpha}: {tps:9.1f} tok/s vs {base:9.1f} "
                  f"({r.speedup:.2f}x), {r.tokens_per_round:.2f} tokens per round, "
                  f"{r.verify_rounds} of {r.steps} rounds verified", flush=True)
    return out


def _row(name, batch, k, alpha, plain, tps, engine) -> SpecRow:
    s = engine.stats
    return SpecRow(name, batch, k, alpha, plain, tps, s.accepted / s.drafted if s.drafted else 0.0,
                   s.generation_tokens / s.busy_row_steps if s.busy_row_steps else 0.0, s.verify_rounds, s.steps)


def table(rows: list[SpecRow]) -> str:
    head = (f"{'drafter':26s} {'batch':>5s} {'k':>2s} {'alpha':>5s} {'plain tok/s':>11s} {'spec tok/s':>10s} "
            f"{'speedup':>7s} {'accept':>6s} {'tok/round':>9s} {'verified':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        alpha = f"{r.alpha:.1f}" if r.alpha is not None else "-"
        lines.append(f"{r.drafter:26s} {r.batch:5d} {r.k:2d} {alpha:>5s} {r.plain_tps:11.1f} {r.spec_tps:10.1f} "
                     f"{r.speedup:7.2f} {r.acceptance:6.2f} {r.tokens_per_round:9.2f} "
                     f"{r.verify_rounds:4d}/{r.steps:<4d}")
    return "\n".join(lines)


def main(args) -> int:
    from mlxfun.bench import workloads as bw

    info = machine()
    print(json.dumps(info))
    alphas = [float(a) for a in args.alphas.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    rows = []
    if args.shape is None:  # the default model: float32 target, its own 4-bit weights as the draft
        q4 = load(args.model)
        model = Model(q4.config, weights.cast(q4.config, q4.params, mx.float32), q4.tokenizer, q4.source)
        draft = q4
        tasks = {name: model.tokenizer.encode_chat([{"role": "user", "content": text}])
                 for name, text in bw.TASKS.items()}  # real text for prompt lookup: editing and summarising
    else:
        model = workload_model(args)
        draft = None
        if args.draft_shape:
            config = SHAPES[args.draft_shape]
            draft = Model(config, random_params(config, DTYPES[args.base_dtype], seed=1), model.tokenizer, "draft")
        tasks = {}
    modes = (False,) if args.rule_only else (False, True)  # forced: speculation on every round
    for B in args.batch_sizes:
        prompts = random_prompts(model.config.vocab_size, B, args.prompt_tokens)
        if not args.rule_only:
            rows += oracle(model, prompts, args.gen_tokens, alphas, ks)
        if draft is not None:
            for forced in modes:
                rows.append(end_to_end(model, prompts, args.gen_tokens, "draft model", draft, 4, forced,
                                          args.repeats))
            if args.shape is not None:  # a random draft model's drafts are never kept: its cost, the oracle's drafts
                rows += costed(model, prompts, args.gen_tokens, draft, alphas, 4, args.repeats, modes)
        for name, prompt in tasks.items():
            for forced in modes:
                rows.append(end_to_end(model, [prompt] * B, args.gen_tokens, f"lookup, {name}", "prompt-lookup", 4,
                                          forced, args.repeats))
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": [asdict(r) | {"speedup": r.speedup}
                                                                         for r in rows]}, indent=2))
        print(f"results written to {args.json}")
    return 0
