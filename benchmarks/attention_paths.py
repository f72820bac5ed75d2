"""A prefill chunk's attention by path (diagnostic, issue 14): `llama.grouped_attention` (two batched
products and a masked softmax) against MLX's `scaled_dot_product_attention` (cuDNN on CUDA) under a
causal mask, per chunk shape. `llama.attention` picks by score count (`GROUPED_MAX_SCORES`): cuDNN
builds a graph for each new shape, so its first call is timed apart from the steady ones.

Reported per shape: scores (B H T S), the first call's ms (building included), then medians of
`--repeats` steady calls, each path's 16 (or `--layers`) attentions chained as a chunk's layers are,
and their peak memory above the inputs; the ratio grouped / sdpa_bias. Paths: `grouped`; `sdpa`
with the bool mask (MLX makes it additive after broadcasting it over the query heads: (B, H, T, S)
per call); `sdpa_bias` with the mask made additive first (`llama.additive_mask`, (B, 1, T, S)).

Run: python benchmarks/attention_paths.py [--heads 32 --kv-heads 8 --head-dim 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlxfun.model import masks
from mlxfun.model.llama import additive_mask, grouped_attention


def sdpa(q, k, v, mask, scale):
    """A bool mask: MLX's CUDA backend makes it additive after broadcasting it over the query heads."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[:, None])


def sdpa_bias(q, k, v, mask, scale):
    """The mask made additive (B, 1, T, S) before the call: broadcast over the heads as a view."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=additive_mask(mask, q.dtype))


PATHS = {"grouped": grouped_attention, "sdpa": sdpa, "sdpa_bias": sdpa_bias}


def chained(fn, q, k, v, mask, layers: int) -> mx.array:
    """`layers` attentions, each query the output before it (so none is skipped or overlapped)."""
    x = q
    for _ in range(layers):
        x = fn(x, k, v, mask, q.shape[-1] ** -0.5)
    return x


def timed(fn, args, layers: int) -> tuple[float, float]:
    """-> (ms, peak MB above the memory active before)."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    mx.eval(chained(fn, *args, layers))
    return (time.perf_counter() - t) * 1e3, (mx.get_peak_memory() - base) / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="32x128,64x128,128x128,128x256,32x512,8x2048,2x4096",
                   help="rows x tokens of fresh chunks (S = T: a first chunk attends over itself)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    H, K, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    print(f"{'B x T':>10s} {'scores':>12s} {'path':9s} {'first ms':>9s} {'ms':>8s} {'peak MB':>9s}  "
          f"(per {args.layers} layers)")
    for shape in args.shapes.split(","):
        B, T = (int(n) for n in shape.split("x"))
        q = mx.random.normal((B, H, T, D)).astype(mx.bfloat16)
        k = mx.random.normal((B, K, T, D)).astype(mx.bfloat16)
        v = mx.random.normal((B, K, T, D)).astype(mx.bfloat16)
        pos = mx.broadcast_to(mx.arange(T, dtype=mx.int32), (B, T))
        mask = masks.causal(pos, pos)
        mx.eval(q, k, v, mask)
        row = {"B": B, "T": T, "scores": B * H * T * T}
        # The first call of each path at this shape (cuDNN builds its graph here), before any other.
        for name, fn in PATHS.items():
            row[f"{name}_first_ms"] = timed(fn, (q, k, v, mask), 1)[0]
        times = {name: [] for name in PATHS}
        peaks = {name: [] for name in PATHS}
        for rep in range(args.repeats):
            for name in (list(PATHS) if rep % 2 == 0 else list(PATHS)[::-1]):
                ms, peak = timed(PATHS[name], (q, k, v, mask), args.layers)
                times[name].append(ms)
                peaks[name].append(peak)
        got = {name: fn(q, k, v, mask, D**-0.5).astype(mx.float32) for name, fn in PATHS.items()}
        for name in PATHS:
            row[f"{name}_ms"] = statistics.median(times[name])
            row[f"{name}_peak_mb"] = statistics.median(peaks[name])
            row[f"{name}_max_abs_diff"] = mx.abs(got[name] - got["grouped"]).max().item()
            print(f"{shape:>10s} {row['scores']:12d} {name:9s} {row[f'{name}_first_ms']:9.2f} "
                  f"{row[f'{name}_ms']:8.2f} {row[f'{name}_peak_mb']:9.1f}  "
                  f"(max |diff| {row[f'{name}_max_abs_diff']:.3g})",
                  flush=True)
        row["grouped_over_sdpa"] = row["grouped_ms"] / row["sdpa_bias_ms"]
        print(f"{shape:>10s} {'':12s} grouped/sdpa_bias {row['grouped_over_sdpa']:.2f}", flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
