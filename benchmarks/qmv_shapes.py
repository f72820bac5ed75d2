"""The tensor-core quantized product's block shapes (N tiles of 8 rows x F groups of 16 features)
timed against each other and against bf16 products, per map and row count (issue 53).

For every map of the 1B and 8B shapes, 4-bit (and 8-bit on two maps), and M rows: each shape's
microseconds per product (chained, as `kernels_check.timed`), its largest error against the
dequantized product in float32, MLX's bf16 product with a dense map of the same shape, and a
dense map dequantized per product (what `llama.linear` does for prompts), and the tiled product
(`qmm`: quantized, and dense as the batch-invariant mode could use it). The summary gives the
shape with the least total time over the maps at each M, beside `qmv.block_shape`'s pick.

Run: python benchmarks/qmv_shapes.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
from kernels_check import timed  # a sibling script

from mlxfun.kernels import qmm, qmv

MAPS = {"8B": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
        "1B": ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))}
EIGHT_BIT = ((28672, 4096), (2048, 8192))
SHAPES = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1))
SPILLS = {(8, 2, 4), (8, 1, 8)}  # (bits, N, F) ptxas spills


def quantized_map(OUT: int, IN: int, bits: int) -> tuple[tuple, mx.array]:
    """A random (OUT, IN) map quantized (w, scales, biases; groups of 64) and its dequantized bf16 map."""
    w = (mx.random.normal((OUT, IN)) * IN**-0.5).astype(mx.bfloat16)
    q = mx.quantize(w, group_size=64, bits=bits)
    dense = mx.dequantize(*q, group_size=64, bits=bits).astype(mx.bfloat16)
    mx.eval(q, dense)
    return q, dense


def rel_err(got: mx.array, want: mx.array) -> float:
    return mx.abs(got.astype(mx.float32) - want).max().item() / mx.abs(want).max().item()


def row_case(q: tuple, dense: mx.array, bits: int, M: int, calls: int,
             targets: tuple[int, ...] = (), tiles: tuple[qmm.Tile, ...] = ()) -> tuple[list, mx.array, dict]:
    """`calls` inputs of M rows, the float32 product of the first, and what every row count
    measures: bf16, a per-product dequantized map and the tiled product (time, error; and its
    time with its inputs split toward each of `targets` blocks, `qmm.splits`, and with each of
    `tiles` instead of `qmm.tile`'s: time and error)."""
    xs = [mx.random.normal((M, dense.shape[1])).astype(mx.bfloat16) for _ in range(calls)]
    mx.eval(xs)
    want = xs[0].astype(mx.float32) @ dense.astype(mx.float32).T
    r = dict(OUT=dense.shape[0], IN=dense.shape[1], bits=bits, M=M, dense_us=timed(lambda x: x @ dense.T, xs),
             dequant_us=timed(lambda x: x @ mx.dequantize(*q, group_size=64, bits=bits).astype(x.dtype).T, xs),
             tiled_us=timed(lambda x: qmm.product(x, *q, 64, bits=bits), xs),
             tiled_err=rel_err(qmm.product(xs[0], *q, 64, bits=bits), want))
    r["tiled_targets"] = {n: round(timed(lambda x, n=n: qmm.product(x, *q, 64, bits=bits, target=n), xs), 2)
                          for n in targets}
    r["tiled_tiles"] = {tile_name(t): dict(us=round(timed(lambda x, t=t: qmm.product(x, *q, 64, bits=bits, shape=t),
                                                          xs), 2),
                                           err=rel_err(qmm.product(xs[0], *q, 64, bits=bits, shape=t), want))
                        for t in tiles}
    return xs, want, r


def tile_name(t: qmm.Tile) -> str:
    return f"{t.rows}x{t.features}x{t.per_warp}"


def parse_tiles(text: str) -> tuple[qmm.Tile, ...]:
    """'64x128x1,32x256x2' -> tiles (rows x features x groups of 16 features a warp)."""
    return tuple(qmm.Tile(*map(int, part.split("x"))) for part in text.split(",") if part)


def one_map(OUT: int, IN: int, bits: int, rows: list[int], calls: int, pick_only: bool,
            targets: tuple[int, ...], tiles: tuple[qmm.Tile, ...] = ()) -> list[dict]:
    q, dense = quantized_map(OUT, IN, bits)
    out = []
    for M in rows:
        xs, want, r = row_case(q, dense, bits, M, calls, targets, tiles)
        r.update(pick=list(qmv.block_shape(M)), shapes={})
        # dense, as the batch-invariant mode runs it (splits by the map alone)
        r["tiled_dense_err"] = rel_err(qmm.dense(xs[0], dense, invariant=True), want)
        r["tiled_dense_us"] = timed(lambda x: qmm.dense(x, dense, invariant=True), xs)
        for shape in [tuple(r["pick"])] if pick_only else SHAPES:
            if (bits, *shape) in SPILLS or (shape[0] > 1 and 8 * shape[0] > 2 * max(M, 8)):
                continue  # no tiles past twice the rows
            err = rel_err(qmv.mma(xs[0], *q, 64, bits=bits, shape=shape), want)
            us = timed(lambda x, s=shape: qmv.mma(x, *q, 64, bits=bits, shape=s), xs)
            r["shapes"][f"{shape[0]}x{shape[1]}"] = dict(us=round(us, 2), rel_err=err, ok=err < 2e-2)
        best = min(r["shapes"], key=lambda k: r["shapes"][k]["us"])
        r["best"] = best
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k != "shapes"}
                         | {"best_us": r["shapes"][best]["us"],
                            "pick_us": r["shapes"].get("{}x{}".format(*r["pick"]), {}).get("us"),
                            "f1_us": r["shapes"].get(f"{qmv.tiles(M)}x1", {}).get("us"),
                            "bad": [k for k, v in r["shapes"].items() if not v["ok"]]}), flush=True)
        out.append(r)
    return out


def tiled_only(OUT: int, IN: int, bits: int, rows: list[int], calls: int, targets: tuple[int, ...],
               tiles: tuple[qmm.Tile, ...] = ()) -> list[dict]:
    """Prompt-sized row counts, where `qmv` does not run: the tiled product against bf16 and a
    per-product dequantized map, with its error."""
    q, dense = quantized_map(OUT, IN, bits)
    out = []
    for M in rows:
        r = row_case(q, dense, bits, M, calls, targets, tiles)[2]
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        out.append(r)
    return out


def summary(results: list[dict]) -> list[dict]:
    """Per (bits, M): total microseconds over the maps of each shape, the least, and the pick's."""
    rows = []
    for bits in sorted({r["bits"] for r in results}):
        for M in sorted({r["M"] for r in results}):
            rs = [r for r in results if r["bits"] == bits and r["M"] == M]
            common = set.intersection(*(set(r["shapes"]) for r in rs)) if rs else set()
            totals = {s: sum(r["shapes"][s]["us"] for r in rs) for s in common}
            if not totals:
                continue
            best = min(totals, key=totals.get)
            pick = "{}x{}".format(*rs[0]["pick"])
            rows.append(dict(bits=bits, M=M, best=best, best_us=round(totals[best], 1), pick=pick,
                             pick_us=round(totals.get(pick, float("nan")), 1),
                             dense_us=round(sum(r["dense_us"] for r in rs), 1),
                             tiled_us=round(sum(r["tiled_us"] for r in rs), 1),
                             **{f"tiled_{n}_us": round(sum(r["tiled_targets"][n] for r in rs), 1)
                                for n in rs[0]["tiled_targets"]},
                             **{f"tile_{n}_us": round(sum(r["tiled_tiles"][n]["us"] for r in rs), 1)
                                for n in rs[0]["tiled_tiles"]},
                             tiled_dense_us=round(sum(r["tiled_dense_us"] for r in rs), 1),
                             tiled_ok=all(r["tiled_err"] < 2e-2 and r["tiled_dense_err"] < 2e-2 and
                                          all(v["err"] < 2e-2 for v in r["tiled_tiles"].values()) for r in rs),
                             dequant_us=round(sum(r["dequant_us"] for r in rs), 1)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="8B,1B")
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--tiled-rows", default="1024,4096", help="prompt-sized rows: the tiled product alone")
    p.add_argument("--shapes", choices=("all", "pick"), default="all",
                   help="the product's block shapes: all of them, or qmv.block_shape's pick alone")
    p.add_argument("--targets", default="", help="blocks the tiled product's splits aim for, beside the default "
                   f"{qmm.TARGET_BLOCKS} (comma-separated)")
    p.add_argument("--tiles", default="", help="tiled-product tiles to time beside qmm.tile's, as ROWSxFEATURESxFW "
                   "(comma-separated, e.g. 64x128x1,64x256x2)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    targets = tuple(int(n) for n in args.targets.split(",") if n)
    tiles = parse_tiles(args.tiles)
    results = []
    for model in args.models.split(","):
        for OUT, IN in MAPS[model]:
            for bits in (4, 8) if (OUT, IN) in EIGHT_BIT else (4,):
                results += [dict(r, model=model) for r in one_map(OUT, IN, bits, rows, args.calls,
                                                                  args.shapes == "pick", targets, tiles)]
    prompts = [dict(r, model=model) for model in args.models.split(",") for OUT, IN in MAPS[model]
               for r in tiled_only(OUT, IN, 4, [int(m) for m in args.tiled_rows.split(",") if m], 10, targets, tiles)]
    table = summary(results)
    print(f"{'bits':>4} {'M':>5} {'best':>5} {'us':>8} {'pick':>5} {'us':>8} {'bf16':>8} {'deq+bf16':>9} "
          f"{'tiled':>8} {'tiled16':>8} ok " + " ".join(f"{'t' + str(n):>8}" for n in targets)
          + " ".join(f"{tile_name(t):>10}" for t in tiles))
    for r in table:
        print(f"{r['bits']:>4} {r['M']:>5} {r['best']:>5} {r['best_us']:>8} {r['pick']:>5} {r['pick_us']:>8} "
              f"{r['dense_us']:>8} {r['dequant_us']:>9} {r['tiled_us']:>8} {r['tiled_dense_us']:>8} {r['tiled_ok']} "
              + " ".join(f"{r[f'tiled_{n}_us']:>8}" for n in targets)
              + " ".join(f"{r[f'tile_{tile_name(t)}_us']:>10}" for t in tiles))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(mx.default_device()), "results": results, "summary": table, "prompts": prompts},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
