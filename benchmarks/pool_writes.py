"""What a KV-pool write costs as the pool grows (diagnostic): one admission's writes (rows x tokens
into every layer's keys and values) timed on pools of several sizes, written in place (nothing
else holds the pool) and with the pool held elsewhere (the copy a held pool costs).

Run: python benchmarks/pool_writes.py --shape 1B --gb 4,32,60 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from mlxfun.bench import models as bench
from mlxfun.model import cache as kv


def timed(fn, reps: int = 5) -> float:
    """Median seconds of fn() evaluated and synchronized."""
    out = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def probe(config, gb: float, rows: int, tokens: int, dtype) -> dict:
    blocks = max(2, int(gb * 1e9) // (kv.slot_bytes(config, dtype) * kv.BLOCK))
    keys, values, positions = kv.pool(config, blocks, kv.BLOCK, dtype)
    pool = [*keys, *values]
    mx.eval(pool, positions)
    new = mx.random.normal((rows, config.num_kv_heads, tokens, config.head_dim)).astype(dtype)
    slots = mx.array((1 + np.arange(rows * tokens)).reshape(rows, tokens) * 7 % (blocks * kv.BLOCK - 1) + 1, mx.int32)
    start = mx.array([kv.BLOCK], mx.int32)
    pos = mx.broadcast_to(mx.arange(tokens, dtype=mx.int32), (rows, tokens))
    mx.eval(new, slots, pos)
    r = dict(gb=round(blocks * kv.BLOCK * kv.slot_bytes(config, dtype) / 1e9, 2), blocks=blocks)

    def in_place(write):
        def run():
            for i in range(len(pool)):
                pool[i] = write(pool[i])
            return pool
        return run

    r["run_ms"] = 1e3 * timed(in_place(lambda b: kv.write_run(b, new, start)))
    r["scatter_ms"] = 1e3 * timed(in_place(lambda b: kv.write(b, new, slots)))
    if gb <= 16:  # every layer also referenced here: each write copies its layer (twice the pool)
        held = [*pool]
        r["held_run_ms"] = 1e3 * timed(lambda: [kv.write_run(b, new, start) for b in held], reps=2)
        held.clear()
    r["positions_ms"] = 1e3 * timed(lambda: kv.write_positions(positions, slots, pos))
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--gb", default="4,32,60")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    results = []
    for gb in map(float, args.gb.split(",")):
        results.append(probe(config, gb, args.rows, args.tokens, mx.bfloat16))
        print(json.dumps(results[-1]), flush=True)
        mx.clear_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(mx.default_device()), "args": vars(args), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
