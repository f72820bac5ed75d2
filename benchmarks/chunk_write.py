"""A prefill chunk's KV writes into the pool, by layout of the update (diagnostic, issue 14): ms and
peak memory of writing T tokens of B rows into each of 2 x `layers` pool buffers (N * bs, K, D),
chained as an admission does (each buffer's old version dropped, so the write can be in place).

  flat:  the update transposed to (B * T, K, D) (a copy), one index per token (`cache.write` until 2026-12-04)
  view:  the update as the strided view (B, T, K, D), indices (B, T): no copy of the update (`cache.write`)
  handle: view, written through a new handle on the pool (`astype` to its own dtype) rather than a copy node
  wide:  handle, with the pool and the update seen as uint32 words (2 bf16 per thread of the scatter;
         `cache.write` in the engine's passes from 2026-12-04 until whole admissions measured 3-10% slower)
  run:   the slots one run [s, s + B * T) in row-major order (`cache.write_run`): the update
         transposed to (B * T, K, D) (a copy) and written by a slice update at an array-valued start
(complex64 words, 4 bf16 per thread, were 2.5x faster than bf16 on the CPU, but MLX's CUDA scatter
takes no complex64.)

Run: python benchmarks/chunk_write.py [--rows 64] [--tokens 128] [--layers 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx


def flat(buf, new, slots):
    B, K, T, D = new.shape
    out = mx.array(buf)
    out[slots.reshape(-1)] = new.transpose(0, 2, 1, 3).reshape(B * T, K, D)
    return out


def view(buf, new, slots):
    out = mx.array(buf)
    out[slots] = new.transpose(0, 2, 1, 3)
    return out


def handle(buf, new, slots):
    out = buf.astype(buf.dtype)  # a new handle on the same array: no copy node before the scatter
    out[slots] = new.transpose(0, 2, 1, 3)
    return out


def wide(buf, new, slots):
    """The slots' bytes as uint32 words (2 bf16 each; CUDA scatters take no uint64): half the threads."""
    out = buf.view(mx.uint32)
    out[slots] = new.transpose(0, 2, 1, 3).view(mx.uint32)
    return out.view(buf.dtype)


def run_(buf, new, slots):
    B, K, T, D = new.shape
    start = slots.reshape(-1)[:1]  # (1,) the run's first slot, an array: no retrace per start
    return mx.slice_update(buf, new.transpose(0, 2, 1, 3).reshape(B * T, K, D), start, axes=(0,))


VARIANTS = {"flat": flat, "view": view, "handle": handle, "wide": wide, "run": run_}


def run(fn, args, repeats: int) -> dict:
    pools = [mx.zeros((args.slots, args.kv_heads, args.head_dim), mx.bfloat16) for _ in range(2 * args.layers)]
    mx.eval(pools)
    n = args.rows * args.tokens
    slots = (args.slots // 3 + mx.arange(n) if args.contiguous or fn is run_ else mx.random.permutation(args.slots)[:n])
    slots = slots.reshape(args.rows, args.tokens)
    slots = slots.astype(mx.int32)
    times, peaks = [], []
    for i in range(repeats + 1):
        news = [mx.random.normal((args.rows, args.kv_heads, args.tokens, args.head_dim)).astype(mx.bfloat16)
                for _ in pools]
        mx.eval(news, slots)
        gc.collect()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t0 = time.perf_counter()
        pools = [fn(p, n, slots) for p, n in zip(pools, news)]
        del news
        mx.eval(pools)
        if i:  # the first traces and builds kernels
            times.append((time.perf_counter() - t0) * 1e3)
            peaks.append((mx.get_peak_memory() - base) / 1e6)
    return {"ms": statistics.median(times), "peak_above_mb": statistics.median(peaks),
            "pool_mb": sum(p.nbytes for p in pools) / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--slots", type=int, default=24576)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--contiguous", action="store_true", help="every variant writes one run of slots (as `run` must)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    a = mx.random.normal((9, 2, 3, 4)).astype(mx.bfloat16)
    s = mx.random.permutation(40)[:9 * 3].reshape(9, 3).astype(mx.int32)
    pool = mx.zeros((40, 2, 4), mx.bfloat16)
    for name, fn in VARIANTS.items():
        if fn is run_:
            c = (5 + mx.arange(27)).reshape(9, 3).astype(mx.int32)
            assert mx.array_equal(flat(pool, a, c), fn(pool, a, c)).item()
            continue
        assert mx.array_equal(flat(pool, a, s), fn(pool, a, s)).item()
        assert not pool.any().item()  # the caller's pool left as it was
    rows = {}
    for name in args.variants.split(",") * 2:  # each twice, alternating
        r = run(VARIANTS[name], args, args.repeats)
        rows.setdefault(name, []).append(r)
        print(f"{name:5s} {r['ms']:8.2f} ms  peak above the inputs {r['peak_above_mb']:8.1f} MB "
              f"(pool {r['pool_mb']:.0f} MB)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
