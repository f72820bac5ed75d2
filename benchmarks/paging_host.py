"""The host's block bookkeeping per decode step (diagnostic, issue 14): B rows of a context that
start mid-block, each step checking every row and ensuring a block for the rows that enter one,
as `Engine._prepare_step` does. Run it at two commits to compare (`git stash`).

Run: python benchmarks/paging_host.py [--rows 128] [--contexts 16,1024] [--steps 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlxfun import bench
from mlxfun import blocks as blk
from mlxfun.cache import BLOCK
from mlxfun.paging import Pages


def step_ms(rows: int, context: int, steps: int) -> float:
    pages = Pages(rows, blk.Pool(8, BLOCK), None, max_blocks=1 << 20)
    pos = [context + r % BLOCK for r in range(rows)]  # rows enter blocks on different steps
    for r in range(rows):
        pages.ensure(r, 0, pos[r])
    t = time.perf_counter()
    for _ in range(steps):
        for r in range(rows):
            if pos[r] // BLOCK not in pages.held[r]:
                pages.ensure(r, pos[r], pos[r] + 1)
            pos[r] += 1
    return (time.perf_counter() - t) / steps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--contexts", default="16,1024")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = {}
    for context in [int(c) for c in args.contexts.split(",")]:
        out[context] = min(step_ms(args.rows, context, args.steps) for _ in range(args.repeats))
        print(f"{args.rows} rows from {context:6d} tokens: {out[context]:.3f} ms a step (best of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "ms_per_step": out},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
