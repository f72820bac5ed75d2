"""Where a static batch's generation time goes, step by step, this code against round 1 (diagnostic,
issue 14: the 1B at 32 rows read 0.94-0.96x round 1's generated tokens/s for 32-128 tokens and
1.10x for 512 on an H100; the device time of a decode step was level, 2.39 against 2.50 ms).

Both codes run the same static batch (B prompts of `--prompt-tokens`, `--gen-tokens` each, EOS
ignored), warmed up once at the timed length (so neither meets a new shape while timed), then
`--repeats` times in ABBA order. Each run records when each step's tokens have all been handed
out; per step index the median over repeats is kept. Printed: the time to the first tokens
(admission), the first decode steps one by one, the steady step (median), the last steps, and
the whole generation, for both codes.

Run: python benchmarks/step_timeline.py --shape 1B --old .old --batch 32 [--gen-tokens 128] [--json F]
     (on the CPU: --tiny)
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from rounds_ab import import_round1, round1_model, round1_module  # beside this script
from static_mixed_ab import TINY

from mlxfun import bench
from mlxfun.engine import Engine


def ours(model, prompts, gen_tokens):
    engine = Engine(model, len(prompts))
    for p in prompts:
        engine.add(p, max_tokens=gen_tokens, ignore_eos=True)
    return engine.events()


def round1(model, prompts, gen_tokens):
    generate = round1_module("generate")
    batch = generate.Batch(model, prompts, generate.make_config(len(prompts), max_tokens=gen_tokens, ignore_eos=True))
    return batch.events()


def timeline(events, rows: int) -> list[float]:
    """Seconds from the start to the end of each step (every row's k-th token handed out)."""
    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    t0 = time.perf_counter()
    ends, seen = [], 0
    for event in events:
        if event.token >= 0:
            seen += 1
            if seen % rows == 0:
                ends.append(time.perf_counter() - t0)
    return ends


def summary(ends: list[float], head: int) -> dict:
    steps = [b - a for a, b in zip(ends, ends[1:])]
    return {"first_tokens_ms": 1e3 * ends[0], "decode_ms": [1e3 * s for s in steps[:head]],
            "steady_ms": 1e3 * statistics.median(steps), "last_ms": [1e3 * s for s in steps[-3:]],
            "decode_sum_ms": 1e3 * sum(steps), "total_ms": 1e3 * ends[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model 64 wide (CPU check of the script)")
    p.add_argument("--old", type=Path, default=Path(".old"), help="a folder holding round 1's mlxfun/")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--head", type=int, default=4, help="decode steps shown one by one")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp())
    old_code = import_round1(args.old, tmp)
    new = bench.random_model(TINY if args.tiny else bench.SHAPES[args.shape])
    runs = {"round 1": (round1, round1_model(old_code, new)), "this code": (ours, new)}
    prompts = bench.random_prompts(new.config.vocab_size, args.batch, args.prompt_tokens)
    for fn, model in runs.values():
        timeline(fn(model, prompts, args.gen_tokens), args.batch)  # every shape of the timed runs seen
    seen: dict[str, list[list[float]]] = {name: [] for name in runs}
    for rep in range(args.repeats):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            fn, model = runs[name]
            seen[name].append(timeline(fn(model, prompts, args.gen_tokens), args.batch))
    out = {"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)}, "ends_s": seen, "median": {}}
    for name, runs_ends in seen.items():
        # Per step index, the median over repeats of that step's end, then the summary of those.
        ends = [statistics.median(e[k] for e in runs_ends) for k in range(min(map(len, runs_ends)))]
        s = out["median"][name] = summary(ends, args.head)
        print(f"{name:10s} first tokens {s['first_tokens_ms']:7.1f} ms; decode steps "
              f"{' '.join(f'{x:.2f}' for x in s['decode_ms'])} ... steady {s['steady_ms']:.3f} ... "
              f"{' '.join(f'{x:.2f}' for x in s['last_ms'])} ms; decode {s['decode_sum_ms']:.1f} ms, "
              f"total {s['total_ms']:.1f} ms", flush=True)
    new_, old_ = out["median"]["this code"], out["median"]["round 1"]
    print("this code / round 1: " + ", ".join(f"{label} {new_[k] / old_[k]:.2f}x" for label, k in (
        ("first tokens", "first_tokens_ms"), ("steady step", "steady_ms"), ("decode", "decode_sum_ms"),
        ("total", "total_ms"))))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
