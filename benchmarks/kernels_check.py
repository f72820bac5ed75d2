"""mlxfun's CUDA kernels (`mlxfun.kernels.attention`) against MLX ops, on random inputs (CUDA only).

decode_attention (reading a shuffled paged pool through its block table) vs `llama.grouped_attention`
over the gathered keys in exact float32 (on the CPU) on the same rounded inputs, under masks with
left padding, holes (ring slots) and a single visible key; qmv against a float32 product with
the dequantized weights (1 to 4096 rows on tensor cores), and dmv (the few-row dense product, whatever
$MLXFUN_DENSE_KERNEL says) against a float32 product (relative to the largest output).
Run: python benchmarks/kernels_check.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from mlxfun.kernels import attention as kernels
from mlxfun.kernels import dmv, qmv
from mlxfun.model import cache as kv
from mlxfun.model import llama


def attention_case(B: int, H: int, K: int, D: int, S: int, dtype: mx.Dtype, seed: int,
                   softcap: float | None = None) -> dict:
    """The kernel reads keys and values through a shuffled block table (the paged layout)."""
    mx.random.seed(seed)
    bs = kv.BLOCK
    W = -(-S // bs)
    S = W * bs
    qk = mx.random.normal((B, H + K, 1, D)).astype(dtype)
    keys = mx.random.normal(((1 + B * W) * bs, K, 1, D)).astype(dtype)  # block 0: scratch, never in a table
    values = mx.random.normal(((1 + B * W) * bs, K, 1, D)).astype(dtype)
    table = (1 + mx.random.permutation(B * W)).astype(mx.int32).reshape(B, W)
    visible = mx.random.uniform(shape=(B, 1, S)) < 0.7
    visible = visible & (mx.arange(S) >= mx.arange(B)[:, None, None] * 7)  # left padding, per row
    last = mx.arange(S) == S - 1
    visible = visible | last  # the current token's slot is always visible
    visible = mx.where(mx.arange(B)[:, None, None] == 0, last, visible)  # row 0: that key only
    got = kernels.decode_attention(qk, keys, values, table, visible, H, softcap).astype(mx.float32)
    with mx.stream(mx.cpu):  # exact float32 (CUDA matmuls may use TF32)
        f32 = [a.astype(mx.float32) for a in (qk, keys, values)]
        want = llama.grouped_attention(f32[0][:, :H], kv.gather(f32[1], table, bs), kv.gather(f32[2], table, bs),
                                       visible, D**-0.5, softcap)  # (B, H, 1, D)
        want = want.reshape(B, H * D)
        err = mx.abs(got - want).max().item()
    tol = {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    out = dict(kernel="decode_attention", B=B, H=H, K=K, D=D, S=S, dtype=str(dtype), softcap=softcap, max_err=err,
               ok=err < tol)
    print(json.dumps(out), flush=True)
    return out


def qmv_case(M: int, OUT: int, IN: int, group_size: int, per_warp: int | None, dtype: mx.Dtype,
             bits: int = 4) -> dict:
    """per_warp None: the tensor-core product (`qmv.mma`)."""
    mx.random.seed(M * OUT + IN)
    w = (mx.random.normal((OUT, IN)) * IN**-0.5).astype(dtype)
    q = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.random.normal((M, IN)).astype(dtype)
    if per_warp is None:
        got = qmv.mma(x, *q, group_size, bits=bits).astype(mx.float32)
    else:
        got = qmv.simt(x, *q, group_size, per_warp).astype(mx.float32)
    with mx.stream(mx.cpu):
        f32 = mx.dequantize(*q, group_size=group_size, bits=bits).astype(mx.float32)
        want = x.astype(mx.float32) @ f32.T
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    out = dict(kernel="qmv", M=M, OUT=OUT, IN=IN, group_size=group_size, bits=bits, per_warp=per_warp,
               dtype=str(dtype), rel_err=err, ok=err < tol)
    print(json.dumps(out), flush=True)
    return out


def dmv_case(M: int, OUT: int, IN: int, launch: dmv.Launch, dtype: mx.Dtype) -> dict:
    mx.random.seed(M * OUT + IN)
    w = (mx.random.normal((OUT, IN)) * IN**-0.5).astype(dtype)
    x = mx.random.normal((M, IN)).astype(dtype)
    got = dmv.product(x, w, launch).astype(mx.float32)
    with mx.stream(mx.cpu):
        want = x.astype(mx.float32) @ w.astype(mx.float32).T
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    tol = {mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    out = dict(kernel="dmv", M=M, OUT=OUT, IN=IN, launch=list(launch), dtype=str(dtype), rel_err=err, ok=err < tol)
    print(json.dumps(out), flush=True)
    return out


def experts_case(tokens: int, k: int, E: int, OUT: int, IN: int, dtype: mx.Dtype) -> dict:
    """dmv.experts_product on `tokens` x k routes drawn from E experts, sorted, against each row
    times its expert's map in float32 on the CPU."""
    mx.random.seed(tokens * E + OUT)
    w = (mx.random.normal((E, OUT, IN)) * IN**-0.5).astype(dtype)
    index = mx.sort(mx.random.randint(0, E, (tokens * k,)).astype(mx.uint32))
    x = mx.random.normal((tokens * k, IN)).astype(dtype)
    got = np.array(dmv.experts_product(x, w, index).astype(mx.float32))
    xs, ws, idx = np.array(x.astype(mx.float32)), np.array(w.astype(mx.float32)), np.array(index)
    want = np.zeros_like(got)
    for e in np.unique(idx):  # each expert's rows times its map, in float32 on the host
        want[idx == e] = xs[idx == e] @ ws[e].T
    err = float(np.abs(got - want).max() / np.abs(want).max())
    tol = {mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    out = dict(kernel="experts", routes=tokens * k, E=E, OUT=OUT, IN=IN, dtype=str(dtype), rel_err=err, ok=err < tol)
    print(json.dumps(out), flush=True)
    return out


def _after(x: mx.array, y: mx.array) -> mx.array:
    """x, made to wait for y (one small fused kernel)."""
    return x + y[:, :1] * 0


def timed(fn, xs: list) -> float:
    """Microseconds per call of fn over xs, each waiting for the one before (as a decoder's products
    do), all queued, then waited for. Independent products may run side by side on the GPU: timed
    so, a launch of few blocks looked fast (4096 x 14336 on 256 warps) and was slow in the decoder."""
    def chain(batch):
        y = None
        for x in batch:
            y = fn(x if y is None else _after(x, y))
        return y

    mx.eval(chain(xs[:3]))
    t = time.perf_counter()
    mx.eval(chain(xs))
    return (time.perf_counter() - t) / len(xs) * 1e6


def dmv_timing(M: int, OUT: int, IN: int, launches: list, calls: int = 50) -> dict:
    """Microseconds per product of M bf16 rows with an (OUT, IN) weight: MLX's matmul, and dmv at
    each launch, `calls` products queued, then waited for (each reads the weight: 8B maps are
    larger than L2)."""
    w = (mx.random.normal((OUT, IN)) * IN**-0.5).astype(mx.bfloat16)
    xs = [mx.random.normal((M, IN)).astype(mx.bfloat16) for _ in range(calls)]
    mx.eval(w, xs)
    out = dict(M=M, OUT=OUT, IN=IN, matmul_us=timed(lambda x: x @ w.T, xs), dmv_us={})
    for launch in launches:
        out["dmv_us"][",".join(map(str, launch))] = timed(lambda x: dmv.product(x, w, launch), xs)
    best = min(out["dmv_us"], key=out["dmv_us"].get)
    out["best"], out["best_us"] = best, out["dmv_us"][best]
    out["GB_s_best"] = OUT * IN * 2 / out["best_us"] / 1e3
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items() if k != "dmv_us"}),
          flush=True)
    return out


# The maps of the 8B and 1B shapes (qkv, o, gate_up, down, lm_head), (OUT, IN).
MAPS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
        (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048))
LAUNCHES = [dmv.Launch(w, u) for w in (1, 2, 4, 8, 16) for u in (1, 2)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--time-dmv", action="store_true",
                   help="also time dmv (at each launch) against MLX's matmul at --rows rows")
    p.add_argument("--rows", default="2,5,8", help="--time-dmv at these row counts")
    p.add_argument("--only", choices=("attention", "qmv", "dmv", "experts"), default=None, help="check one kernel only")
    args = p.parse_args(argv)
    results = []
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        for B, H, K, D, S in ((1, 32, 8, 128, 256), (3, 32, 8, 128, 512), (5, 32, 8, 64, 96), (2, 9, 3, 64, 40),
                              (4, 8, 8, 32, 33), (2, 16, 2, 128, 1024), (32, 32, 8, 128, 64), (1, 16, 16, 256, 7),
                              (3, 8, 2, 32, 70), (128, 32, 8, 64, 256), (128, 32, 8, 128, 300)):
            if args.only not in (None, "attention") or not kernels.attention_fits(D, H // K, dtype):
                continue
            results.append(attention_case(B, H, K, D, S, dtype, seed=B * S))
        for B, H, K, D, S in ((3, 16, 8, 256, 512), (64, 8, 4, 256, 300)):  # Gemma 2's heads and soft-cap
            if args.only in (None, "attention") and kernels.attention_fits(D, H // K, dtype):
                results.append(attention_case(B, H, K, D, S, dtype, seed=B * S, softcap=1.0))
        for M, OUT, IN, gs, R in ((1, 6144, 4096, 64, 4), (3, 100, 14336, 64, 2), (8, 4096, 576, 32, 4),
                                  (5, 33, 256, 128, 1), (2, 1026, 4096, 64, 4)):
            if args.only in (None, "qmv"):
                results.append(qmv_case(M, OUT, IN, gs, R, dtype))
        if dtype != mx.float32 and args.only in (None, "qmv"):  # tensor cores: bf16 and fp16 inputs
            for M, OUT, IN, gs in ((1, 6144, 4096, 64), (8, 4096, 14336, 64), (3, 1000, 576, 32), (5, 40, 2048, 128),
                                   (9, 2048, 2048, 64), (33, 14336, 4096, 64), (127, 4096, 14336, 128),
                                   (128, 1536, 576, 32), (200, 2048, 8192, 64), (256, 6144, 4096, 64),
                                   (1000, 576, 1536, 32), (4096, 4096, 4096, 64)):
                results.append(qmv_case(M, OUT, IN, gs, None, dtype))
            for M, OUT, IN, gs in ((1, 6144, 4096, 64), (7, 40, 2048, 128), (33, 4096, 14336, 32),
                                   (300, 2048, 8192, 64)):
                results.append(qmv_case(M, OUT, IN, gs, None, dtype, bits=8))
        if dtype != mx.float32 and args.only in (None, "dmv"):
            for M, OUT, IN, launch in ((5, 6144, 4096, None), (8, 28672, 4096, dmv.Launch(2, 4)),
                                       (2, 4096, 14336, dmv.Launch(16, 1)), (3, 1001, 576, dmv.Launch(1, 1)),
                                       (5, 128256, 4096, dmv.Launch(1, 2)), (7, 2048, 8192, None),
                                       (4, 40, 96, dmv.Launch(8, 4)), (13, 4096, 4096, None),
                                       (32, 2048, 8192, dmv.Launch(8, 2)), (300, 2048, 2048, None),
                                       (1000, 576, 1536, None)):
                results.append(dmv_case(M, OUT, IN, launch or dmv.launch_for(OUT, IN), dtype))
        if dtype != mx.float32 and args.only in (None, "experts"):  # Qwen3-30B-A3B's maps, a Mixtral-like
            for tokens, k, E, OUT, IN in ((1, 8, 128, 1536, 2048), (8, 8, 128, 2048, 768), (32, 8, 128, 1536, 2048),
                                          (128, 8, 128, 2048, 768), (5, 2, 8, 1024, 4096), (3, 2, 4, 40, 96)):
                results.append(experts_case(tokens, k, E, OUT, IN, dtype))
    ok = all(r["ok"] for r in results)
    print("KERNELS", "OK" if ok else "FAILED", flush=True)
    rows = [int(m) for m in args.rows.split(",")]
    timings = [dmv_timing(M, OUT, IN, LAUNCHES) for OUT, IN in MAPS for M in rows] if args.time_dmv else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "results": results, "ok": ok, "dmv_timings": timings},
                      f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
