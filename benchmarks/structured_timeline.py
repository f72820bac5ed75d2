"""A constrained decode step's two threads on one timeline (diagnostic, issue 21): where the
engine thread and the mask worker spend each step, and which of them a slow step waits for.

B rows of a random-weight shape with a real tokenizer, every row with `bench_structured`'s JSON
schema (temperature 0.7, seeded). Every call below is wrapped to record (thread, name, start, end):
- the engine thread: `masked_decode` (one per step), `_prepare_step`, the compiled `forward` and
  `sample` calls (building the graph), `mx.async_eval` (encoding it), the wait for the worker
  (`wait`) and `_take`;
- the mask worker: its turn (`_read_and_mask`), `host_values` (the tokens read), `_match`,
  `fill_masks`, llguidance's parallel fill inside it (`llguidance`) and `_fix_eos`.
Reported: each phase's mean ms per step over all steps and over the slowest tenth of them, and
the slowest steps one by one. Compare the worker's GIL-holding parts (all but `llguidance`) with
the engine's, and the worker's start with the engine's forward launch.

Run: python benchmarks/structured_timeline.py --shape 1B --tokenizer .tok --batch 32 [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from structured_costs import add_rows, random_model  # benchmarks/ is on the path: these scripts run from there

from mlxfun import bench, structured
from mlxfun import engine as engine_mod
from mlxfun.engine import Engine

Record = tuple[str, str, float, float]  # thread ("E" engine, "W" worker), name, start, end (s)


def wrap(f, name: str, out: list[Record]):
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            who = "W" if threading.current_thread().name.startswith("mlxfun-masks") else "E"
            out.append((who, name, t, time.perf_counter()))
    return timed


class TimedSteps:
    def __init__(self, steps, out):
        self._steps, self.forward, self.sample = steps, wrap(steps.forward, "forward", out), \
            wrap(steps.sample, "sample", out)

    def __getattr__(self, name):
        return getattr(self._steps, name)


class TimedJob:
    def __init__(self, job, out):
        self._job, self.result = job, wrap(job.result, "wait", out)


class TimedPool:
    def __init__(self, pool, out):
        self._pool, self._out = pool, out

    def submit(self, *a):
        return TimedJob(self._pool.submit(*a), self._out)


class TimedExecutor:
    def __init__(self, executor, out):
        self.unsafe_compute_mask_ptr = wrap(executor.unsafe_compute_mask_ptr, "llguidance", out)


def run(model, batch: int, gen_tokens: int, prompt: list[int]) -> list[Record]:
    out: list[Record] = []
    engine = Engine(model, batch)
    add_rows(engine, batch, gen_tokens, True, prompt)
    steps = engine.steps
    engine.steps = lambda config, mode: TimedSteps(steps(config, mode), out)
    pool = engine._mask_pool
    engine._mask_pool = lambda: TimedPool(pool(), out)
    for name in ("masked_decode", "_prepare_step", "_take", "_read_and_mask", "_match"):
        setattr(engine, name, wrap(getattr(engine, name), name, out))
    saved = (mx.async_eval, engine_mod.host_values, structured.fill_masks, structured._fix_eos, structured._executor)
    mx.async_eval = wrap(saved[0], "async_eval", out)
    engine_mod.host_values = wrap(saved[1], "host_values", out)
    structured.fill_masks = wrap(saved[2], "fill_masks", out)
    structured._fix_eos = wrap(saved[3], "_fix_eos", out)
    executor = TimedExecutor(saved[4](), out)
    structured._executor = lambda: executor
    try:
        for _ in engine.events():
            pass
    finally:
        mx.async_eval, engine_mod.host_values, structured.fill_masks, structured._fix_eos, structured._executor = saved
    return out


def per_step(records: list[Record]) -> list[dict]:
    """Each step (from one masked_decode's start to the next's): ms per (thread, phase), summed
    over the calls that start in it."""
    starts = sorted(r[2] for r in records if r[1] == "masked_decode")
    rows = []
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        d: dict[str, float] = collections.defaultdict(float)
        for who, name, t0, t1 in records:
            if a <= t0 < b:
                d[f"{who}.{name}"] += (t1 - t0) * 1e3
        d["step"] = (b - a) * 1e3
        rows.append({"index": i, **d})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder (byte-level BPE)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (CPU smoke runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, prompt = random_model(args.shape, Path(args.tokenizer), args.layers)
    run(model, args.batch, 8, prompt)  # compiles
    steps = per_step(run(model, args.batch, args.gen_tokens, prompt))[1:]  # the first follows the admission
    keys = sorted({k for s in steps for k in s if k not in ("index", "step")})
    slow = sorted(steps, key=lambda s: -s["step"])[:max(1, len(steps) // 10)]
    print(f"{len(steps)} steps; ms per step, mean over all / over the slowest {len(slow)}")
    for k in ["step"] + keys:
        every, slowest = (np.mean([s.get(k, 0.0) for s in group]) for group in (steps, slow))
        print(f"  {k:<18s} {every:7.3f} {slowest:7.3f}")
    print("slowest steps: " + " ".join(k.split(".")[-1][:10] for k in ["step"] + keys))
    for s in slow[:8]:
        print(f"  #{s['index']:<4d} " + " ".join(f"{s.get(k, 0.0):6.2f}" for k in ["step"] + keys))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "batch": args.batch,
                                               "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
