"""The linear maps of a decode step with 4-bit weights, per number of rows M, by product (CUDA only):
mlxfun's tensor-core 4-bit product (`qmv.mma`, "mma"; "mma8x2": 8 warps per block, 2
loads in flight), its CUDA-core one (`qmv.simt`, "simt"), MLX's `quantized_matmul`
("mlx_q4"), and a dense bf16 copy ("dense").

Each is timed as the decode step runs them: one compiled function over every layer's maps (qkv,
o, gate_up, down; distinct weights per layer, so they come from memory, not the 50 MB L2), each
fed by the one before, then the LM head. This is the serial matmul time of a step, which sets the
batch size below which 4-bit weights stay 4-bit (`strategy.GPU`).
Run: python benchmarks/qmv_rows.py --shape 8B [--rows 1,2,4,8] [--products dense,mma,mma4x4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from mlxfun import bench, kernels, qmv

GROUP = 64


def product(name: str, group_size: int):
    """fn(x (M, in), weight) -> (M, out); weight is a dense array or quantize()'s triple.
    "mma" is `qmv.mma` as launched; "mma<warps>x<in_flight>" a variant of its launch."""
    if name.startswith("mma") and name != "mma":
        warps, in_flight = map(int, name[3:].split("x"))
        return lambda x, q: qmv.mma(x, *q, group_size, warps=warps, in_flight=in_flight)
    return {
        "dense": lambda x, w: x @ w.T,
        "mlx_q4": lambda x, q: mx.quantized_matmul(x, *q, transpose=True, group_size=group_size, bits=4),
        "simt": lambda x, q: qmv.simt(x, *q, group_size),
        "mma": lambda x, q: qmv.mma(x, *q, group_size),
    }[name]


def random_layers(shape: str, dtype: mx.Dtype) -> tuple[list[list[mx.array]], mx.array]:
    """Per layer (qkv, o, gate_up, down) weights (out, in), and the LM head."""
    c = bench.SHAPES[shape]
    E, inter, HD = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    sizes = [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, E), (E, HD), (2 * inter, E), (E, inter)]

    def weight(n_out, n_in):
        w = (mx.random.normal((n_out, n_in)) * n_in**-0.5).astype(dtype)
        mx.eval(w)
        return w

    return [[weight(*s) for s in sizes] for _ in range(c.num_layers)], weight(c.vocab_size, E)


def chain(fn, layers, head, hidden: int, inner: int):
    """x (M, E) -> logits: every layer's maps in order, each fed by a slice of the previous output."""

    def step(x):
        for qkv, o, gate_up, down in layers:
            h = fn(x, qkv)[:, :hidden]
            h = fn(h, o)
            h = fn(h, gate_up)[:, :inner]
            x = fn(h, down)
        return fn(x, head)

    return mx.compile(step)


def timed_ms(step, x, repeats: int) -> float:
    for _ in range(2):  # trace, compile, warm
        mx.eval(step(x))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(step(x))
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8B", choices=sorted(bench.SHAPES))
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--products", default="dense,mlx_q4,simt,mma")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",")]
    names = args.products.split(",")
    dtype = mx.bfloat16
    if not kernels.available(dtype):
        print("qmv_rows: CUDA only", file=sys.stderr)
        return 2
    c = bench.SHAPES[args.shape]
    layers, head = random_layers(args.shape, dtype)
    weight_bytes = {"dense": sum(w.nbytes for ws in layers for w in ws) + head.nbytes}
    quantized = [[mx.quantize(w, group_size=GROUP, bits=4) for w in ws] for ws in layers], \
        mx.quantize(head, group_size=GROUP, bits=4)
    mx.eval(quantized)
    weight_bytes["q4"] = (sum(a.nbytes for ws in quantized[0] for q in ws for a in q)
                          + sum(a.nbytes for a in quantized[1]))
    results = []
    for name in names:
        fn = product(name, GROUP)
        ws, hd = (layers, head) if name == "dense" else quantized
        step = chain(fn, ws, hd, c.num_heads * c.head_dim, c.intermediate_size)
        for M in rows:
            ms = timed_ms(step, mx.random.normal((M, c.hidden_size)).astype(dtype), args.repeats)
            gb = weight_bytes["dense" if name == "dense" else "q4"] / 1e9
            results.append(dict(product=name, M=M, step_ms=ms, weight_gb=gb, tb_per_s=gb / ms))
            print(json.dumps(results[-1]), flush=True)
    print(f"\nserial matmul ms per decode step ({args.shape}, bf16 activations, 4-bit group {GROUP}):")
    print("   M " + "".join(f"{n:>18s}" for n in names))
    for M in rows:
        print(f"{M:4d} " + "".join(f"{r['step_ms']:18.3f}" for n in names for r in results
                                   if r["product"] == n and r["M"] == M))
    save(args.json, args.shape, results)
    return 0


def save(path: str | None, shape: str, results: list[dict]) -> None:
    """The results, with the machine they came from, as JSON at `path` (if given)."""
    if path:
        with open(path, "w") as f:
            json.dump({"machine": bench.machine(), "shape": shape, "results": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
