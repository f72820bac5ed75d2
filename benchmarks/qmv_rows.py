"""mlxfun's 4-bit product (`kernels.qmv`) against MLX's 4-bit product and a dense bf16 copy, per
number of rows M, at the linear maps of a Llama shape (CUDA only).

Each product runs over `--copies` distinct weights, launched together and timed together, so the
weights come from memory (not the 50 MB L2) and launches overlap as in a decode step. The
"step" columns add one layer's maps times the number of layers plus the LM head: the serial
matmul time of a decode step, which sets the batch size below which qmv should serve 4-bit
weights (`strategy.GPU`) and how many output features a warp takes (`kernels.QMV_FEATURES_PER_WARP`).
Run: python benchmarks/qmv_rows.py --shape 8B [--rows 1,2,4,8] [--per-warp 1,2,4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from mlxfun import bench, kernels


def linear_shapes(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, out, in, count per step) of a decode step's linear maps."""
    c = bench.SHAPES[shape]
    H, K, D, E, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
    L = c.num_layers
    return [("qkv", (H + 2 * K) * D, E, L), ("o", E, H * D, L), ("gate_up", 2 * inter, E, L),
            ("down", E, inter, L), ("head", c.vocab_size, E, 1)]


def timed_ms(fn, weights, x, repeats: int) -> float:
    """Median ms of one product, `fn(x, w)` over all `weights` per evaluation."""
    mx.eval([fn(x, w) for w in weights])
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval([fn(x, w) for w in weights])
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2] / len(weights)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8B", choices=sorted(bench.SHAPES))
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--per-warp", default="1,2,4")
    p.add_argument("--copies", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",")]
    per_warp = [int(v) for v in args.per_warp.split(",")]
    dtype, gs = mx.bfloat16, 64
    if not kernels.available(mx.zeros((1,), dtype)):
        print("qmv_rows: CUDA only", file=sys.stderr)
        return 2
    results = []
    for name, n_out, n_in, count in linear_shapes(args.shape):
        copies = max(2, args.copies if name != "head" else 4)
        dense = [(mx.random.normal((n_out, n_in)) * n_in**-0.5).astype(dtype) for _ in range(copies)]
        quant = [mx.quantize(w, group_size=gs, bits=4) for w in dense]
        mx.eval(dense, quant)
        for M in rows:
            x = mx.random.normal((M, n_in)).astype(dtype)
            row = dict(map=name, out=n_out, inp=n_in, count=count, M=M,
                       dense_ms=timed_ms(lambda x, w: x @ w.T, dense, x, args.repeats),
                       mlx_q4_ms=timed_ms(lambda x, q: mx.quantized_matmul(x, *q, transpose=True, group_size=gs,
                                                                          bits=4), quant, x, args.repeats))
            for R in per_warp:
                row[f"qmv{R}_ms"] = timed_ms(lambda x, q: kernels.qmv(x, *q, gs, per_warp=R), quant, x, args.repeats)
            results.append(row)
            print(json.dumps(row), flush=True)
        del dense, quant
        mx.clear_cache()
    cols = ["dense_ms", "mlx_q4_ms"] + [f"qmv{R}_ms" for R in per_warp]
    print(f"\nserial matmul ms per decode step ({args.shape}, bf16, 4-bit group {gs}):")
    print("   M " + "".join(f"{c[:-3]:>10s}" for c in cols))
    step = []
    for M in rows:
        total = {c: sum(r[c] * r["count"] for r in results if r["M"] == M) for c in cols}
        step.append(dict(M=M, **total))
        print(f"{M:4d} " + "".join(f"{total[c]:10.3f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": bench.machine(), "shape": args.shape, "products": results, "step": step}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
