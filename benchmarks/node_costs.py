"""The host's cost of one graph node by kind (diagnostic, issue 14): a decode step of the 1B at
batch 1 is host-bound on an H200 (`loop_host.py --phases`: its `mx.async_eval` takes about 1.1 ms),
so which nodes a step is made of sets its speed. `host_cost.py` times compiled chains of views,
norms, products and custom kernels (call and launch); this script adds the kinds a decode step's
cache and mask bookkeeping is made of (gathers, scatters, slices, fused elementwise kernels), as
eager chains of N dependent nodes on small arrays, timed as `mx.async_eval` alone (building and
launching the work), per node, the device idle before each run. A reshape, an add and an
untransposed product are there to compare with host_cost.py's figures.

Run: python benchmarks/node_costs.py [--nodes 200] [--repeats 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlxfun import bench

fused = mx.compile(lambda x: (mx.maximum(x, 0) // 2) % 7)  # one compiled elementwise kernel a call


def chains(n: int) -> dict:
    """kind -> a function building a chain of n such nodes (lazy) and returning its last array."""
    ints = mx.arange(64, dtype=mx.int32)
    table = mx.arange(64, dtype=mx.int32)[::-1] + 0
    pool = mx.zeros((4096, 8, 64), mx.bfloat16)
    new = mx.ones((1, 8, 64), mx.bfloat16)
    w = mx.ones((64, 64), mx.bfloat16)
    mx.eval(ints, table, pool, new, w)

    def repeat(step, x):
        def build():
            y = x
            for i in range(n):
                y = step(y, i)
            return y
        return build

    return {
        "reshape (a view)": repeat(lambda y, i: y.reshape(8, 8) if i % 2 == 0 else y.reshape(64), ints),
        "slice (a view)": repeat(lambda y, i: y[1:], mx.arange(n + 8, dtype=mx.int32)),
        "add (a kernel)": repeat(lambda y, i: y + 1, ints),
        "compiled elementwise": repeat(lambda y, i: fused(y), ints),
        "take (gather)": repeat(lambda y, i: table[y], ints),
        "take_along_axis": repeat(lambda y, i: mx.take_along_axis(table[None], y[None], axis=1)[0], ints),
        "put_along_axis (KV write)": repeat(
            lambda y, i: mx.put_along_axis(y, mx.broadcast_to(mx.array([[[i]]]), (1, 8, 64)), new, axis=0), pool),
        "matmul 1x64x64": repeat(lambda y, i: y @ w, mx.ones((1, 64), mx.bfloat16)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = {}
    for kind, build in chains(args.nodes).items():
        mx.eval(build())  # warm: kernels built, buffers cached
        seen = []
        for _ in range(args.repeats):
            y = build()
            t = time.perf_counter()
            mx.async_eval(y)
            seen.append((time.perf_counter() - t) * 1e6 / args.nodes)
            mx.eval(y)
        out[kind] = statistics.median(seen)
        print(f"{kind:28s} {out[kind]:6.2f} us a node (host, median of {args.repeats})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "us_per_node": out},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
