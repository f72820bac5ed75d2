"""Which steps of a run stall, and what changed there (diagnostic): one 1B row, a 128-token prompt,
after a warm-up run of 4 tokens; each engine round timed, the slowest printed with the table's
width, the pool's size and the attention kernel's parts at that round.

Run: python benchmarks/stall_probe.py [--shape 1B] [--gen-tokens 256] [--batch 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlxfun.bench import models as bench
from mlxfun.bench.main import run_batch
from mlxfun.engine.core import Engine
from mlxfun.kernels import attention as kernels
from mlxfun.model import cache as kv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    prompts = bench.random_prompts(model.config.vocab_size, args.batch, 128)
    run_batch(model, prompts, args.warmup_tokens, None)
    runs = []
    for run in range(2):
        engine = Engine(model, args.batch)
        for q in prompts:
            engine.add(q, max_tokens=args.gen_tokens, ignore_eos=True)
        rounds = []
        while not engine.idle:
            t = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t
            s, c = engine.runner.state, model.config
            width = pool = parts = None  # the state is dropped once the engine is idle
            if s is not None:
                width, pool = s.cache.table.shape[1], s.cache.positions.shape[0]
                parts = kernels.launch(args.batch, c.num_kv_heads, kv.capacity(s.cache), c.head_dim,
                                       c.num_heads // c.num_kv_heads, engine.runner.dtype)[2]
            rounds.append((took, len(rounds), width, pool, parts))
        total = sum(r[0] for r in rounds)
        print(f"run {run}: {len(rounds)} rounds, {total:.3f} s; slowest (s, round, width, pool, parts):",
              [(round(r[0], 3), *r[1:]) for r in sorted(rounds, reverse=True)[:6]], flush=True)
        runs.append([dict(zip(("s", "round", "width", "pool", "parts"), r)) for r in rounds])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
