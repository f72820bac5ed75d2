"""A static admission's host timeline, this code against round 1 (diagnostic, issue 14): where the
host is while the device runs a prefill, and where the device must be waiting for it.

For B prompts of T tokens of a random-weight shape, each code's own `bench.run_batch` with one
generated token runs 1 + `--repeats` times (the first compiles); in each, every `mx.async_eval` and
`mx.eval` (both codes call MLX's) and the admission's phases are recorded with their start and end:
this code's `Engine.admit`, `Pages.reserve`, `_empty_state`, `prefill.prefill_rows`, `_first_token`,
`_merge`, `_restack`; round 1's `Batch.prefill` (the graph built and launched) and the evaluation
after it. Reported per code (medians): the admission's wall time, the host's time before the
first launch, the time spent waiting in `mx.eval` (the device behind the host), and one run's
timeline (ms from the admission's start).

Run: python benchmarks/admit_timeline.py --shape 1B --old .old --batch-sizes 32,128 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from rounds_ab import (  # benchmarks/ is on the path: these scripts run from there
    import_round1,
    round1_model,
    round1_module,
)

from mlxfun import bench, prefill
from mlxfun.engine import Engine
from mlxfun.paging import Pages

Record = tuple[str, float, float]


def wrap(owner, name: str, label: str, out: list[Record]):
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            out.append((label, t, time.perf_counter()))
    setattr(owner, name, timed)
    return lambda: setattr(owner, name, f)


def admission(records: list[Record], start: str) -> dict:
    """The admission's window (from `start`'s call to the end of the last eval before the next
    `start` or the end), its phases relative to its start."""
    t0 = min(t for n, t, _ in records if n == start)
    first_eval_after = [r for r in records if r[0] == "eval" and r[1] >= t0]
    end = first_eval_after[0][2] if start == "Batch.prefill" else \
        max(e for n, _, e in records if n == "Engine.admit")
    inside = sorted((r for r in records if t0 <= r[1] <= end), key=lambda r: r[1])
    launches = [r for r in inside if r[0] == "async_eval"]
    waits = [r for r in inside if r[0] == "eval"]
    return {"wall_ms": (end - t0) * 1e3,
            "host_before_launch_ms": ((launches[0][1] if launches else end) - t0) * 1e3,
            "launches": len(launches), "eval_wait_ms": sum(e - s for _, s, e in waits) * 1e3,
            "timeline": [(n, round((s - t0) * 1e3, 2), round((e - t0) * 1e3, 2)) for n, s, e in inside]}


def run_new(model, prompts) -> dict:
    out: list[Record] = []
    undo = [wrap(mx, "async_eval", "async_eval", out), wrap(mx, "eval", "eval", out),
            wrap(Engine, "admit", "Engine.admit", out), wrap(Pages, "reserve", "Pages.reserve", out),
            wrap(Engine, "_empty_state", "_empty_state", out), wrap(prefill, "prefill_rows", "prefill_rows", out),
            wrap(Engine, "_first_token", "_first_token", out), wrap(Engine, "_merge", "_merge", out),
            wrap(Engine, "_restack", "_restack", out)]
    try:
        bench.run_batch(model, prompts, 1, None)
    finally:
        for u in undo:
            u()
    return admission(out, "Engine.admit")


def run_old(bench1, generate1, model, prompts) -> dict:
    out: list[Record] = []
    undo = [wrap(mx, "async_eval", "async_eval", out), wrap(mx, "eval", "eval", out),
            wrap(generate1.Batch, "prefill", "Batch.prefill", out)]
    try:
        bench1.run_batch(model, prompts, 1, None)
    finally:
        for u in undo:
            u()
    return admission(out, "Batch.prefill")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--old", type=Path, default=Path(".old"), help="a folder holding round 1's mlxfun/")
    p.add_argument("--batch-sizes", default="32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    old_code = import_round1(args.old)
    generate1 = round1_module("generate")
    new = bench.random_model(bench.SHAPES[args.shape])
    old = round1_model(old_code, new)
    out = {"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)}, "batches": []}
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = bench.random_prompts(new.config.vocab_size, B, args.prompt_tokens)
        runs = {"round 1": [], "this code": []}
        for rep in range(args.repeats + 1):
            for name in (["round 1", "this code"] if rep % 2 else ["this code", "round 1"]):
                r = run_old(old_code[0], generate1, old, prompts) if name == "round 1" else run_new(new, prompts)
                if rep:
                    runs[name].append(r)
        print(f"batch {B}: {'code':10s} {'wall ms':>8s} {'host before launch':>19s} {'launches':>9s} "
              f"{'eval wait ms':>13s}  (medians)")
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("wall_ms", "host_before_launch_ms", "launches",
                                                                      "eval_wait_ms")}
            print(f"batch {B}: {name:10s} {med['wall_ms']:8.2f} {med['host_before_launch_ms']:19.2f} "
                  f"{med['launches']:9.0f} {med['eval_wait_ms']:13.2f}")
            for n, s, e in rs[-1]["timeline"]:
                print(f"      {n:<14s} {s:8.2f} {e:8.2f}")
        out["batches"].append({"batch": B, "runs": runs})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
