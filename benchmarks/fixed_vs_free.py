"""A server's fixed-shape engine against the offline one on the same work, in one process
(diagnostic): 256 requests of 128 prompt and 128 generated tokens through 32 rows, greedy and
seeded (T 0.8, top-p 0.9), all queued at once (no HTTP, no arrivals). What the fixed shapes cost
(every row decoded, the ladder's table widths, a sampled step's penalties and searches, one pool
for life) apart from what serving adds.

Run: python benchmarks/fixed_vs_free.py [--shape 1B] [--requests 256] [--rows 32] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from mlxfun.bench import models as bench
from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.engine.warmup import warm_up


def run(engine: Engine, prompts, gen: int, seeded: bool) -> dict:
    for i, p in enumerate(prompts):
        settings = sampling.make_settings(1, temperature=0.8, top_p=0.9, seed=i) if seeded else None
        engine.add(p, max_tokens=gen, ignore_eos=True, settings=settings)
    steps0, busy0 = engine.stats.steps, engine.stats.busy_row_steps
    t = time.perf_counter()
    for _ in engine.events():
        pass
    wall = time.perf_counter() - t
    for rid in list(engine.requests):
        engine.take(rid)
    steps = engine.stats.steps - steps0
    return {"tok_s": len(prompts) * gen / wall, "wall_s": wall, "steps": steps, "ms_per_step": 1e3 * wall / steps,
            "row_occupancy": (engine.stats.busy_row_steps - busy0) / (steps * engine.rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    rng = random.Random(0)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]
    engines = {"free": Engine(model, args.rows), "fixed": Engine(model, args.rows, fixed_shapes=True)}
    t = time.perf_counter()
    warm_up(engines["fixed"])
    print(f"fixed warm-up {time.perf_counter() - t:.1f} s", flush=True)
    for name, engine in engines.items():  # each engine's own warm-up pass on other prompts
        for seeded in (False, True):
            run(engine, [[rng.randrange(1, model.config.vocab_size) for _ in range(args.prompt_tokens)]
                         for _ in range(args.rows)],
                8, seeded)
    out = []
    for rep in range(2):
        for name in (("free", "fixed") if rep == 0 else ("fixed", "free")):
            for seeded in (False, True):
                r = {"engine": name, "mode": "seeded" if seeded else "greedy", "rep": rep,
                     **run(engines[name], prompts, args.gen_tokens, seeded)}
                out.append(r)
                print(f"{name:5s} {r['mode']:6s} rep {rep}: {r['tok_s']:8.1f} tok/s, {r['ms_per_step']:.2f} ms/step, "
                      f"rows {100 * r['row_occupancy']:.0f}% full", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
