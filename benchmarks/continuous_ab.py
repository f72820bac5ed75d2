"""Continuous batching, variants side by side: the `--continuous` workload (prompts of 8-128
tokens, `max_tokens` drawn from 16-256, EOS ignored) as static batches and through the Engine
with different admission settings, in one process.

  admit_min   free rows an admission waits for while others decode (Engine default: rows // 4 on
              a GPU, 1 on the CPU)
  pad         prompt lengths rounded up to this multiple (default: 32 on a GPU, 1 on the CPU)

Run: python benchmarks/continuous_ab.py [--shape 1B] [--rows 32] [--prompts 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from mlxfun import bench
from mlxfun.bench_workloads import mixed_workload, static_batches
from mlxfun.engine import Engine
from mlxfun.generate import generate


def run_engine(model, prompts, limits, rows, admit_min, pad):
    engine = Engine(model, rows, admit_min=admit_min, pad_multiple=pad)
    for p, m in zip(prompts, limits):
        engine.add(p, max_tokens=m, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in engine.events():
        pass
    s = engine.stats
    return dict(seconds=time.perf_counter() - t0, occupancy=s.occupancy, admissions=s.admissions, steps=s.steps,
                admit_host_s=s.prompt_time, admit_min=engine.admit_min, pad=engine.pad_multiple)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default=None, choices=sorted(bench.SHAPES))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.base_dtype = "bfloat16" if bench.on_gpu() else "float32"
    model = bench.workload_model(args)
    prompts, limits = mixed_workload(model.config.vocab_size, args.prompts, 16, 256)
    tokens = sum(limits)
    rows = args.rows
    # Warm every path once (compiles the decode steps for the capacities the workload reaches).
    generate(model, prompts[:rows], max_tokens=limits[:rows], ignore_eos=True)
    run_engine(model, prompts[:2 * rows], limits[:2 * rows], rows, None, None)
    results = {}
    results["static"] = dict(seconds=static_batches(model, prompts, limits, rows))
    print(f"static: {results['static']['seconds']:.2f} s", flush=True)
    variants = [(None, None), (1, None), (max(1, rows // 8), None), (max(1, rows // 2), None), (None, 1)]
    for admit_min, pad in variants:
        name = f"engine admit_min={admit_min} pad={pad}"
        results[name] = run_engine(model, prompts, limits, rows, admit_min, pad)
        print(name, json.dumps(results[name]), flush=True)
    print(f"\n{args.prompts} prompts, {tokens} tokens, {rows} rows, {mx.default_device()}")
    print(f"{'variant':38s} {'s':>7} {'tok/s':>8} {'vs static':>9} {'occ':>5} {'admits':>6} {'admit host s':>12}")
    for name, r in results.items():
        print(f"{name:38s} {r['seconds']:7.2f} {tokens / r['seconds']:8.1f} "
              f"{results['static']['seconds'] / r['seconds']:9.2f} {r.get('occupancy', 1):5.0%} "
              f"{r.get('admissions', 0):6d} {r.get('admit_host_s', 0):12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": bench.machine(), "prompts": args.prompts, "tokens": tokens, "rows": rows,
                       "results": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
