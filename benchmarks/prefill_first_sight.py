"""What an admission costs the first time its chunk shape is met, plain against compiled
(diagnostic, issue 14): static admissions of G prompts of T tokens of a random-weight shape, each
(G, T) new, timed to their end (evaluated), then the same admission again. Compiled, the first
includes the trace; plain, it includes what a new shape costs any prefill (cuDNN graphs, products'
plans). A process runs one variant, so neither warms the other's caches: run it once per variant,
in turn. Static batches of mixed prompts meet most chunk shapes once: 24 in 26 chunks for 256
prompts as 8 batches of 32 (this CPU, with the GPU's rounding to 32 tokens).

Run: python benchmarks/prefill_first_sight.py --variant plain|compiled --shape 1B [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import mlx.core as mx
from prefill_compile_ab import admission  # benchmarks/ is on the path: these scripts run from there

from mlxfun.bench import models as bench
from mlxfun.engine import step
from mlxfun.model.load import Model

# (rows, prompt tokens) met once each; lengths are rounded up to 32 on a GPU, so each is its own shape.
SHAPES = [(g, t) for g in (2, 3, 5, 7, 9, 11, 13, 15) for t in (40, 70, 100)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=["plain", "compiled"], required=True)
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    dtype = mx.bfloat16 if bench.on_gpu() else mx.float32
    model = Model(config, bench.random_params(config, dtype), bench.word_tokenizer(config.vocab_size), args.shape)
    made: dict = {}

    def steps(config, mode) -> step.Steps:
        return made.setdefault(mode, step.make_steps(config, mode, compile_prefill=0 if args.variant == "plain"
                                                     else step.PREFILL_COMPILED_TOKENS))

    rng = random.Random(0)
    rows = max(g for g, _ in SHAPES)
    for _ in range(2):  # warm-up at a shape not measured: weights, kernels, the decode-free paths
        admission(model, [[rng.randrange(1, config.vocab_size) for _ in range(16)]], steps, rows, 64)
    runs = []
    for g, t in SHAPES:
        prompts = [[rng.randrange(1, config.vocab_size) for _ in range(t)] for _ in range(g)]
        first = admission(model, prompts, steps, rows, 64)
        again = admission(model, prompts, steps, rows, 64)
        runs.append({"rows": g, "tokens": t, "first_ms": 1e3 * first, "again_ms": 1e3 * again})
    first = sum(r["first_ms"] for r in runs)
    again = sum(r["again_ms"] for r in runs)
    over = statistics.median(r["first_ms"] - r["again_ms"] for r in runs)
    print(f"{args.variant:8s}: {len(runs)} new shapes, first admissions {first:.0f} ms, the same again {again:.0f} ms; "
          f"a first admission's extra cost, median {over:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "variant": args.variant,
                                               "shape": args.shape, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
