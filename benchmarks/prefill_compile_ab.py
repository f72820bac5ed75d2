"""Admissions with the prefill chunk compiled against the plain one, alternating in one process
(diagnostic, issue 14): a static admission of B prompts of T tokens of a random-weight shape, timed
to its end (evaluated), median over repeats; and whether both give the same first tokens (4 per row).

One process against another moves a step's time 20-30% on the lent H200's host, more than the
host time compiling saves, so the variants alternate admission by admission.

Run: python benchmarks/prefill_compile_ab.py --shape 1B --batch-sizes 1,8,32,128 [--repeats 10] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from mlxfun.bench import models as bench
from mlxfun.engine import step
from mlxfun.engine.core import Engine
from mlxfun.model.load import Model


@lru_cache(maxsize=None)
def compiled_prefill(config, mode) -> step.Steps:
    return step.make_steps(config, mode, compile_prefill=1 << 30)


@lru_cache(maxsize=None)
def plain_prefill(config, mode) -> step.Steps:
    return step.make_steps(config, mode, compile_prefill=0)


VARIANTS = {"plain": plain_prefill, "compiled": compiled_prefill}


def admission(model: Model, prompts: list[list[int]], steps, rows: int | None = None, max_tokens: int = 8) -> float:
    """One static admission's seconds, to its end (in an engine of `rows` rows, one per prompt by default)."""
    engine = Engine(model, rows or len(prompts), steps=steps)
    for prompt in prompts:
        engine.add(prompt, max_tokens=max_tokens, ignore_eos=True)
    mx.synchronize()
    t = time.perf_counter()
    engine.admit()
    mx.synchronize()
    return time.perf_counter() - t


def tokens(model: Model, prompts: list[list[int]], steps) -> list[list[int]]:
    """Each row's first 4 tokens."""
    engine = Engine(model, len(prompts), steps=steps)
    ids = [engine.add(prompt, max_tokens=4, ignore_eos=True) for prompt in prompts]
    list(engine.events())
    return [engine.take(i).row.token_ids for i in ids]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    dtype = mx.bfloat16 if bench.on_gpu() else mx.float32
    model = Model(config, bench.random_params(config, dtype), bench.word_tokenizer(config.vocab_size), args.shape)
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = bench.random_prompts(config.vocab_size, B, args.prompt_tokens)
        first = {name: tokens(model, prompts, f) for name, f in VARIANTS.items()}
        for f in VARIANTS.values():
            admission(model, prompts, f)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.repeats):
            for name, f in VARIANTS.items():
                times[name].append(admission(model, prompts, f))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        same = first["plain"] == first["compiled"]
        rows.append({"batch": B, "prompt_tokens": args.prompt_tokens, "ms": med,
                     "runs_ms": {n: [round(1e3 * x, 3) for x in t] for n, t in times.items()},
                     "plain_over_compiled": med["plain"] / med["compiled"], "same_first_tokens": same})
        print(f"B={B:4d}: plain {med['plain']:8.2f} ms, compiled {med['compiled']:8.2f} ms "
              f"({med['plain'] / med['compiled']:.2f}x faster compiled); same first tokens: {same}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
