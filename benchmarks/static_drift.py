"""Does a process's static pass of mixed prompts slow down as it repeats? (diagnostic, issue 14:
in `static_mixed_ab.py` this code's first pass was level with round 1's and its later ones 0.79x.)
Runs this code's pass `--passes` times as they come, then with MLX's buffer cache emptied before
each, then round 1's, printing each pass's seconds, each batch's, and the allocator's figures.

Run: python benchmarks/static_drift.py --shape 1B --old ../.old [--json F]   (from benchmarks/)
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
from rounds_ab import import_round1, round1_model, round1_module  # beside this script
from static_mixed_ab import TINY

from mlxfun import bench, bench_workloads, prefill


def timed_pass(generate, model, prompts, limits, rows) -> dict:
    t0 = time.perf_counter()
    batches = []
    for i in range(0, len(prompts), rows):
        t = time.perf_counter()
        generate(model, prompts[i:i + rows], max_tokens=limits[i:i + rows], ignore_eos=True)
        batches.append(round(time.perf_counter() - t, 3))
    return {"s": time.perf_counter() - t0, "batches": batches, "active_gb": mx.get_active_memory() / 1e9,
            "cache_gb": mx.get_cache_memory() / 1e9, "objects": len(gc.get_objects()),
            "threads": threading.active_count()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--old", type=Path, default=Path("../.old"))
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    old_code = import_round1(args.old, tmp)
    if args.tiny:  # the GPU's chunk lengths, in both codes
        prefill.pad_multiple = round1_module("prefill").pad_multiple = lambda: 32
    new = bench.random_model(TINY if args.tiny else bench.SHAPES[args.shape])
    old = round1_model(old_code, new)
    prompts, limits = bench_workloads.mixed_workload(new.config.vocab_size, args.prompts, 16, 256)
    gen_new, gen_old = bench_workloads.generate, round1_module("generate").generate
    gen_new(new, prompts[:args.rows], max_tokens=4, ignore_eos=True)
    gen_old(old, prompts[:args.rows], max_tokens=4, ignore_eos=True)
    out = []
    plan = ([("this code", False)] * args.passes + [("this code", True)] * args.passes
            + [("round 1", False)] * args.passes + [("round 1", True)] * 2 + [("this code", False)] * 2)
    for name, clear in plan:
        if clear:
            gc.collect()
            mx.clear_cache()
        gen, model = (gen_new, new) if name == "this code" else (gen_old, old)
        r = timed_pass(gen, model, prompts, limits, args.rows) | {"code": name, "cleared": clear}
        out.append(r)
        print(f"{name:9s} cleared={clear!s:5s} {r['s']:6.2f} s  batches {r['batches']}  active {r['active_gb']:.2f} GB "
              f"cache {r['cache_gb']:.2f} GB  objects {r['objects']}  threads {r['threads']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "passes": out}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
