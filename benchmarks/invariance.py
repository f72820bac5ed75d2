"""Batch invariance of MLX's products, the question under a bf16 batch-invariant mode (issue 54).

For each dtype (bfloat16, float16, 4-bit) and layer shape, a row multiplied alone is compared bit
for bit with the same row inside batches of 2-257 rows, two ways:
- plain: `x @ w.T` (or `mx.quantized_matmul`) at the batch's own row count, as the engine runs today;
- fixed: every product at one row count (`--fixed`, default 128): rows padded up to it, or cut in
  slices of it, so the library picks one kernel and one reduction order whatever the batch.
For 4- and 8-bit (`q4`, `q8`) also:
- mlxfun: `qmv.mma`, mlxfun's tensor-core quantized product at any row count (issue 53), whose sums
  have one order whatever the rows;
- dequantized: `x @ dequantize(w).T`, the dense copy of one map made for the product (prompts);
- dmv (bf16, fp16): mlxfun's dense product at the batch's own row count (batch_invariant's).
Then each way's time per product at 1-512 rows, for the cost.

Run: python benchmarks/invariance.py [--fixed 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from mlxfun.kernels import dmv, qmv

SHAPES = {"SmolLM2 MLP in (1536 x 576)": (1536, 576), "1B attention (2048 x 2048)": (2048, 2048),
          "1B MLP out (2048 x 8192)": (2048, 8192), "8B MLP in (14336 x 4096)": (14336, 4096)}
BATCHES = (2, 3, 8, 9, 16, 31, 32, 33, 64, 127, 128, 129, 256, 257)
TIMED = (1, 8, 32, 128, 256, 512)


def product(kind: str, w):
    """y = x @ w.T for a dense (N, K) weight or an affine 4-bit one."""
    if kind in ("q4", "q8"):
        wq, scales, biases = w
        return lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=int(kind[1]))
    return lambda x: x @ w.T


def fixed(f, m: int):
    """f at exactly m rows: padded with zeros up to m, or in slices of m."""
    def g(x):
        n = x.shape[0]
        pad = -n % m
        if pad:
            x = mx.concatenate([x, mx.zeros((pad, x.shape[1]), x.dtype)])
        return mx.concatenate([f(x[i:i + m]) for i in range(0, x.shape[0], m)])[:n]
    return g


def weights(kind: str, n: int, k: int, key):
    dtype = mx.float16 if kind == "float16" else mx.bfloat16
    w = (mx.random.normal((n, k), key=key) * k ** -0.5).astype(dtype)
    if kind in ("q4", "q8"):
        return mx.quantize(w, group_size=64, bits=int(kind[1])), dtype
    return w, dtype


def invariance(f, x) -> dict[int, int]:
    """Per batch size, how many of its rows differ (any bit) from the same row alone."""
    alone = mx.concatenate([f(x[i:i + 1]) for i in range(x.shape[0])])
    mx.eval(alone)
    out = {}
    for b in BATCHES:
        got = f(x[:b])
        out[b] = int(mx.sum(mx.any(got != alone[:b], axis=1)).item())
    return out


def timing(f, x, reps: int = 20) -> dict[int, float]:
    out = {}
    for m in TIMED:
        xm = x[:m]
        mx.eval(f(xm))
        t = time.perf_counter()
        for _ in range(reps):
            y = f(xm)
            mx.eval(y)
        out[m] = 1e6 * (time.perf_counter() - t) / reps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fixed", type=int, default=128, help="the one row count of the fixed way (default 128)")
    p.add_argument("--kinds", default="bfloat16,float16,q4")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    key = mx.random.key(0)
    for kind in args.kinds.split(","):
        for name, (n, k) in SHAPES.items():
            key, kw, kx = mx.random.split(key, 3)
            w, dtype = weights(kind, n, k, kw)
            x = mx.random.normal((max(*BATCHES, *TIMED), k), key=kx).astype(dtype)
            plain = product(kind, w)
            ways = {"plain": plain, f"fixed {args.fixed}": fixed(plain, args.fixed)}
            if kind not in ("q4", "q8"):
                ways["dmv"] = lambda x, w=w: dmv.product(x, w)
            if kind in ("q4", "q8"):
                bits = int(kind[1])
                ways["mlxfun"] = lambda x, w=w, b=bits: qmv.mma(x, *w, 64, bits=b)
                ways["dequantized"] = lambda x, w=w, b=bits: x @ mx.dequantize(*w, group_size=64, bits=b).T
            for way, f in ways.items():
                row = dict(kind=kind, shape=name, way=way, differing_rows=invariance(f, x), us=timing(f, x))
                rows.append(row)
                bad = {b: d for b, d in row["differing_rows"].items() if d}
                print(f"{kind:8s} {name:30s} {way:10s} rows differing from alone: {bad or 'none'}; "
                      f"us per product at {'/'.join(map(str, TIMED))} rows: "
                      f"{' / '.join(f'{v:.0f}' for v in row['us'].values())}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(mx.default_device()), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
