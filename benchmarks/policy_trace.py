"""What the measured rule saw and chose, round by round (diagnostic): a random-weight target made
`predictable`, a draft model's cost with the oracle's drafts (`bench_speculative.CostedOracle`),
the rule on. Prints each choice and each recorded round (mode, tokens per row, seconds), and the
host time of the engine's phases around them (`--phases`: collect, the drafter's catch-up and
round, the verify and decode steps queued), to see what a switch between the modes costs.

Run: python benchmarks/policy_trace.py --shape 8B --draft-shape 1B --batch-sizes 8,32 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlxfun import bench, drafting, speculative
from mlxfun import bench_speculative as bs
from mlxfun.engine import Engine
from mlxfun.load import Model

PHASES = ((Engine, "collect"), (Engine, "decode"), (Engine, "verify_ahead"), (Engine, "_fit_cache"),
          (Engine, "admit"), (drafting.DraftModel, "catch_up"), (drafting.DraftModel, "draft"),
          (drafting.DraftModel, "_feed"))


class Traced(speculative.Policy):
    """The engine's default policy, every choice and record logged with its time."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[tuple] = []
        self.t0 = time.perf_counter()

    def choose(self, ahead=None, least=1.0) -> bool:
        c = super().choose(ahead, least)
        self.log.append(("choose", c, round(1e3 * (time.perf_counter() - self.t0), 2)))
        return c

    def record(self, speculating, tokens_per_row, seconds, most=None, least=1.0):
        self.log.append(("record", speculating, round(tokens_per_row, 2),
                         None if seconds is None else round(1e3 * seconds, 3)))
        super().record(speculating, tokens_per_row, seconds, most, least)


def timed_phases(log: list, t0: float) -> list:
    """Wrap PHASES so each call logs ("phase", name, start ms, ms); -> what to restore."""
    saved = []
    for owner, name in PHASES:
        f = getattr(owner, name)
        saved.append((owner, name, f))

        def wrapped(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                log.append(("phase", _n, round(1e3 * (t - t0), 2), round(1e3 * (time.perf_counter() - t), 3)))
        setattr(owner, name, wrapped)
    return saved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8B")
    p.add_argument("--draft-shape", default="1B")
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--alpha", type=float, default=0.7)
    p.add_argument("--phases", action="store_true", help="log the engine's phases too")
    p.add_argument("--warm-rule", action="store_true", help="run the rule once before the traced run")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    target = bs.predictable(bench.random_model(bench.SHAPES[args.shape]))
    config = bench.SHAPES[args.draft_shape]
    draft = Model(config, bench.random_params(config, target.params.norm.dtype, seed=1), target.tokenizer, "draft")
    found = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = bench.random_prompts(target.config.vocab_size, B, 128)
        bs._run(target, prompts, args.gen_tokens)
        cont: dict = {}
        _, plain = bs._run(target, prompts, args.gen_tokens, ids_out=cont)

        def make(engine):
            return bs.CostedOracle(draft, engine, cont, args.alpha)

        bs._run(target, prompts, args.gen_tokens, draft=make, policy=speculative.Always())
        if args.warm_rule:  # the rule's own path once (a catch-up's shapes, a decode at wider tables)
            rule = speculative.Policy(enabled=speculative.may_pay(B, 4))
            bs._run(target, prompts, args.gen_tokens, draft=make, policy=rule)
        policy = Traced(enabled=speculative.may_pay(B, 4))
        saved = timed_phases(policy.log, policy.t0) if args.phases else []
        try:
            engine, tps = bs._run(target, prompts, args.gen_tokens, draft=make, policy=policy)
        finally:
            for owner, name, f in saved:
                setattr(owner, name, f)
        print(f"B={B}: plain {plain:.1f} tok/s, rule on {tps:.1f} ({tps / plain:.2f}x), "
              f"{engine.stats.verify_rounds} of {engine.stats.steps} rounds verified; {policy}")
        for entry in policy.log:
            print("  ", *entry)
        found.append(dict(batch=B, plain=plain, rule_on=tps, log=policy.log))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
