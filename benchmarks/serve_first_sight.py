"""What a server's engine pays the first time it meets an admission's shape (diagnostic): a
fixed-shape engine after its warm-up (as `mlxfun serve` makes it), some rows decoding, then G new
requests of T prompt tokens admitted; the slowest engine round until they finish, the first time
that (G, T) is met and again with other prompts of the same shape. Greedy and seeded (T 0.8,
top-p 0.9) requests. The server's inter-token stalls after its warm-up are this, if anything.

Run: python benchmarks/serve_first_sight.py [--shape 1B] [--rows 32] [--json F]
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

SHAPES = [(g, t) for g in (1, 2, 3, 5, 8, 13) for t in (40, 100, 200)]


def slowest_round(engine: Engine, prompts: list[list[int]], seeded: bool) -> float:
    """Admit the prompts (2 tokens each) into the busy engine; the slowest round until they end, s."""
    settings = sampling.make_settings(1, temperature=0.8, top_p=0.9, seed=1) if seeded else None
    ids = [engine.add(p, max_tokens=2, ignore_eos=True, settings=settings) for p in prompts]
    worst = 0.0
    while any(i not in engine.requests or engine.requests[i].finish_reason is None for i in ids):
        t = time.perf_counter()
        engine.step()
        worst = max(worst, time.perf_counter() - t)
    for i in ids:
        engine.take(i)
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--busy", type=int, default=8, help="rows kept decoding meanwhile")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    engine = Engine(model, args.rows, fixed_shapes=True)
    t = time.perf_counter()
    w = warm_up(engine)
    print(f"warm-up: {w.variants} steps, widths {w.widths}, {time.perf_counter() - t:.1f} s", flush=True)
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(1, model.config.vocab_size) for _ in range(n)]

    for _ in range(args.busy):
        engine.add(prompt(64), max_tokens=100_000, ignore_eos=True)
    for _ in range(5):
        engine.step()
    runs = []
    for seeded in (False, True):
        for g, n in SHAPES:
            first = slowest_round(engine, [prompt(n) for _ in range(g)], seeded)
            again = slowest_round(engine, [prompt(n) for _ in range(g)], seeded)
            runs.append({"seeded": seeded, "rows": g, "tokens": n, "first_ms": 1e3 * first, "again_ms": 1e3 * again})
            print(f"{'seeded' if seeded else 'greedy'} G={g:2d} T={n:3d}: slowest round first {1e3 * first:7.1f} ms, "
                  f"again {1e3 * again:6.1f} ms", flush=True)
    traces = engine.step_cache.traces if engine.step_cache is not None else None
    print(f"traces after warm-up: {traces}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": runs,
                                               "warmup_s": w.seconds, "traces": traces}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
