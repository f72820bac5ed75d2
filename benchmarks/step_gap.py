"""Why a server's decode step is slower than an offline engine's: steady decode rounds (every row
busy, no admission) timed for engines that differ in one thing at a time.

Each `--variants` entry is KIND[:MODE][:KV_GB][:never|:always][:nowarm][:limit][:neighbour]:
- KIND `offline` (an `Engine` as `generate` makes it) or `server` (fixed shapes, warmed up, as
  `mlxfun serve` makes it);
- MODE `greedy` (default) or `seeded` (temperature 0.8, top-p 0.9, a seed per row: a server runs
  it with penalties and the top-k search as well, `records.fixed_mode`);
- KV_GB: the server's KV pool (default: its own budget, most of the device);
- `never`: no pool write waits for the one before (`Runner.settle`; a server's waits from 1 GB);
  `always`: every one does (an offline engine's steps then run one after another, as a server's);
- `nowarm`: a server's engine without its warm-up (the untimed first pass compiles what the rounds run).
- `limit`: MLX's memory limit set as a server's engine process sets it (`process_memory_limit`);
- `neighbour`: beside another process that builds small MLX arrays on the CPU device 200 times a
  second, as a server's HTTP process built each request's settings before they moved to NumPy (a
  CUDA context of its own on the same GPU).

Every variant runs `--rows` requests of `--prompt-tokens` random tokens, admitted first, then
times `--rounds` rounds of `Engine.step` (each queues a step and hands out the one before), twice,
and keeps the second pass (the first compiles an offline engine's steps). The rounds' ms each and
the memory queued above what was held before them (a copy of the pool shows there) are reported.

Run: python benchmarks/step_gap.py --shape 1B --rows 32 --variants offline,server,server:greedy:1
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np

from mlxfun.bench import models as bench
from mlxfun.engine.core import Engine
from mlxfun.engine.kv_budget import process_memory_limit
from mlxfun.engine.options import GenerationConfig, requests
from mlxfun.engine.warmup import warm_up

SEEDED = dict(temperature=0.8, top_p=0.9)

# What a server's HTTP process did per request before its settings moved to NumPy, 200 times a second.
NEIGHBOUR = """
import time, numpy as np, mlx.core as mx
mx.set_default_device(mx.cpu)
while True:
    s = [mx.array([0.8], mx.float32) for _ in range(7)] + [mx.array([1], mx.uint32)]
    mx.eval([a[0:1] for a in s]); [np.array(a) for a in s]; time.sleep(0.005)
"""


def steady(model, rows: int, prompt: int, rounds: int, kind: str, mode: str, kv_gb: float, never: bool,
           warm: bool = True, always: bool = False) -> dict:
    server = kind == "server"
    engine = Engine(model, rows, fixed_shapes=server, kv_memory=int(kv_gb * 1e9) or None)
    if never:
        engine.runner.settle_bytes = None
    if always:
        engine.runner.settle_bytes = 0
    if server and warm:
        warm_up(engine)
    rng = np.random.default_rng(0)
    passes = []
    for _ in range(2):
        ids = [rng.integers(1, model.config.vocab_size, prompt).tolist() for _ in range(rows)]
        config = GenerationConfig(max_tokens=2 * rounds + 8, ignore_eos=True,
                                  **({**SEEDED, "seed": list(range(rows))} if mode == "seeded" else {}))
        rids = [engine.submit(r) for r in requests(model, ids, config)]
        while engine.scheduler.pending or engine.scheduler.live_count() < rows:
            engine.step()
        for _ in range(4):  # the admission's rounds behind
            engine.step()
        mx.synchronize()
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        times = []
        t0 = time.perf_counter()
        for _ in range(rounds):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        mx.synchronize()
        seconds = time.perf_counter() - t0
        passes.append(dict(ms_per_round=1e3 * seconds / rounds, median_round_ms=1e3 * float(np.median(times)),
                           max_round_ms=1e3 * max(times), queued_gb=(mx.get_peak_memory() - held) / 1e9,
                           step_mode=str(engine.roster().mode)))
        for rid in rids:
            engine.cancel(rid)
        for _ in engine.events():
            pass
        for rid in list(engine.requests):
            engine.take(rid)
    return dict(kind=kind, mode=mode, kv_gb=round(engine.kv_memory / 1e9, 2), settle_bytes=engine.runner.settle_bytes,
                **passes[-1], first_pass_ms=passes[0]["ms_per_round"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1B")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--variants", default="offline,server,offline:seeded,server:seeded,server:greedy:1,"
                                         "server:greedy:0:never")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    mx.eval(model.params)
    runs = []
    default_limit = mx.get_memory_limit()
    for variant in args.variants.split(","):
        kind, *rest = variant.split(":")
        mode = rest[0] if rest else "greedy"
        kv_gb = float(rest[1]) if len(rest) > 1 else 0.0
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if "neighbour" in rest else None
        limit = process_memory_limit() if "limit" in rest else None  # None off CUDA
        if limit is not None:
            mx.set_memory_limit(limit)
        try:
            r = steady(model, args.rows, args.prompt_tokens, args.rounds, kind, mode, kv_gb, "never" in rest,
                       "nowarm" not in rest, "always" in rest)
        except RuntimeError as e:  # out of memory, say: the other variants still count
            r = dict(variant=variant, error=f"{type(e).__name__}: {e}")
        finally:
            mx.set_memory_limit(default_limit)
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        r["variant"] = variant
        runs.append(r)
        print(json.dumps(r), flush=True)
        gc.collect()
        mx.clear_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": bench.machine(), "args": vars(args), "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
