"""Constrained against free decode steps, variants alternating in one process (one process
against another moves a step's time 20-30% on the H200's host, more than the effect measured).

B rows of a random-weight shape with a real tokenizer; a constrained run gives every row
`bench_structured`'s JSON schema, sampled at temperature 0.7 (seeded); variants of the engine's
constrained step: the mask worker's head start (`engine.HEAD_START`, seconds) and the
interpreter's switch interval (how soon a thread waiting for the GIL makes the holder drop it).
Each variant runs once to warm up, then `--repeats` times in turn; reported: median ms per
decode step (admission excluded) and its ratio to the free runs' median.

Run: python benchmarks/structured_ab.py --shape 1B --tokenizer .tok --batch 32 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from structured_costs import add_rows, random_model  # benchmarks/ is on the path: these scripts run from there

from mlxfun import bench
from mlxfun import engine as engine_mod
from mlxfun.engine import Engine
from mlxfun.load import Model

# name -> (constrained, head start s, switch interval s or None: the interpreter's default)
VARIANTS = {
    "free": (False, engine_mod.HEAD_START, None),
    "schema, head start 1 ms": (True, 0.001, None),
    "schema, no head start": (True, 0.0, None),
    "schema, no head start, switch 0.2 ms": (True, 0.0, 0.0002),
}


def run(model: Model, batch: int, gen_tokens: int, constrained: bool, prompt: list[int]) -> dict:
    """One engine run; -> ms per decode step after the admission, steps, tokens."""
    engine = Engine(model, batch)
    add_rows(engine, batch, gen_tokens, constrained, prompt)
    start = None
    for _ in engine.events():
        if start is None and engine.stats.steps >= 1:  # the admission and first step are behind
            start = (time.perf_counter(), engine.stats.steps)
    t, s = start
    steps = engine.stats.steps - s
    return {"step_ms": (time.perf_counter() - t) * 1e3 / max(1, steps), "steps": steps,
            "tokens": engine.stats.generation_tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder (byte-level BPE)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (CPU smoke runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, prompt = random_model(args.shape, Path(args.tokenizer), args.layers)
    default_switch = sys.getswitchinterval()
    found: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    try:
        for repeat in range(args.repeats + 1):  # the first pass warms every variant up
            for name, (constrained, head, switch) in VARIANTS.items():
                engine_mod.HEAD_START = head
                sys.setswitchinterval(switch or default_switch)
                r = run(model, args.batch, args.gen_tokens, constrained, prompt)
                if repeat:
                    found[name].append(r)
                print(json.dumps({"repeat": repeat, "variant": name, **{k: round(v, 3) for k, v in r.items()}}),
                      flush=True)
    finally:
        sys.setswitchinterval(default_switch)
    free = statistics.median(r["step_ms"] for r in found["free"])
    rows = []
    print(f"{'variant':<40} {'ms/step (median)':>17} {'runs':>24} {'ratio':>7}")
    for name, runs in found.items():
        ms = [r["step_ms"] for r in runs]
        med = statistics.median(ms)
        rows.append({"variant": name, "step_ms_median": med, "step_ms": ms, "ratio": med / free})
        print(f"{name:<40} {med:>17.3f} {' '.join(f'{m:.2f}' for m in ms):>24} {med / free:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "batch": args.batch,
                                               "gen_tokens": args.gen_tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
