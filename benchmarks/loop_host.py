"""The host's own time per decode step of the generation loop, this code's engine against round 1's
static batch (diagnostic, issue 14): both run B rows of a tiny random model with a stand-in decode
step that returns arrays already computed (the same tokens every step), so a step's time is the
loop's Python and MLX calls alone. On an H200 a 1B decode step at 128 rows is host-bound (`mlxfun
profile`: about 4 ms to launch, 1 ms more on the device), so this time adds to every step.

Run: python benchmarks/loop_host.py --batch 128 [--steps 200] [--repeats 5] [--real] [--json PATH]
(--old: a folder holding round 1's mlxfun/, as rounds_ab.py; --shape 1B: that shape's full model,
random weights, in place of the tiny one; --phases: this code's time per engine method too, and
both codes' step calls and async_eval; --idle: with the device idle before each async_eval)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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

from mlxfun import bench
from mlxfun import engine as scheduler
from mlxfun.engine import Engine

# The engine's parts of a round, timed by `--phases` (nested: decode holds _prepare_step, the step's
# call and async_eval; collect holds _take, which waits for the step before).
PHASES = ("admit", "_needs_decode", "decode", "_prepare_step", "step call", "async_eval", "collect", "_take",
          "_fit_cache")
SHARED = ("step call", "async_eval")  # round 1's phases: the same calls


class Spent(collections.Counter):
    """ns spent per phase, and (`calls`) each call's ns of the shared phases, in order."""

    def __init__(self):
        super().__init__()
        self.calls = collections.defaultdict(list)

    def clear(self):
        super().clear()
        self.calls.clear()


def timed(name, fn, spent: Spent):
    """`fn`, adding the time (ns) of each call to `spent[name]`."""
    def run(*args, **keywords):
        t = time.perf_counter_ns()
        try:
            return fn(*args, **keywords)
        finally:
            took = time.perf_counter_ns() - t
            spent[name] += took
            if name in SHARED:
                spent.calls[name].append(took)
    return run


def spread(calls: list[int]) -> str:
    """A phase's calls (ns): median, 90th percentile and the slowest five with their step numbers."""
    ms = sorted(calls)
    top = sorted(range(len(calls)), key=lambda i: -calls[i])[:5]
    return (f"median {ms[len(ms) // 2] / 1e6:.3f}, p90 {ms[len(ms) * 9 // 10] / 1e6:.3f} ms, slowest "
            + ", ".join(f"#{i} {calls[i] / 1e6:.2f}" for i in top))


def timing_phases(spent: collections.Counter, idle: bool = False) -> None:
    """Wrap the engine's methods in `PHASES`, and mx.async_eval (both codes call it through mx).
    `idle`: each async_eval waits for the device to finish first, untimed (no step in flight)."""
    for name in PHASES:
        if hasattr(scheduler.Engine, name):
            setattr(scheduler.Engine, name, timed(name, getattr(scheduler.Engine, name), spent))
    launch = timed("async_eval", mx.async_eval, spent)

    def waited(*arrays):
        mx.synchronize()
        return launch(*arrays)
    mx.async_eval = waited if idle else launch


def timed_steps(steps_for, spent: collections.Counter | None):
    """`steps_for` with its decode step's calls timed into `spent` (as it is when None)."""
    if spent is None:
        return steps_for
    return lambda config, mode: (lambda s: s._replace(decode=timed("step call", s.decode, spent)))(
        steps_for(config, mode))


def frozen(steps_for):
    """`steps_for` (config, mode) -> Steps whose decode step returns its first outputs again."""
    made = {}

    def make(config, mode):
        if (config, mode) in made:
            return made[(config, mode)]
        steps = steps_for(config, mode)
        first = {}

        def decode(params, state, settings):
            if "out" not in first:
                first["out"], first["state"] = steps.decode(params, state, settings)
                mx.eval(first["out"], first["state"])
            # A new tuple each step: the engine tells the step it just queued from those before by identity.
            return first["out"]._replace(), state._replace(tokens=first["state"].tokens, positions=state.positions + 1,
                                                steps=state.steps + 1)
        made[(config, mode)] = steps._replace(decode=decode)
        return made[(config, mode)]
    return make


def ours(model, prompts, max_tokens: int, real: bool = False, spent: collections.Counter | None = None) -> float:
    from mlxfun.step import compiled_steps
    engine = Engine(model, len(prompts), steps=timed_steps(compiled_steps if real else frozen(compiled_steps), spent))
    for p in prompts:
        engine.add(p, max_tokens=max_tokens, ignore_eos=True)
    engine.admit()
    mx.eval(engine.state)
    t = None
    for _ in engine.events():
        if t is None:  # from the first token on, as round 1 is timed (its first step queued already)
            t = time.perf_counter()
            if spent is not None:
                spent.clear()  # the phases of the decode loop only
    return (time.perf_counter() - t) / max_tokens


def round1(gen1, step1, model, prompts, max_tokens: int, real: bool = False,
           spent: collections.Counter | None = None) -> float:
    config = gen1.make_config(len(prompts), max_tokens=max_tokens, ignore_eos=True)
    steps = timed_steps(step1.compiled_steps if real else frozen(step1.compiled_steps), spent)
    batch = gen1.Batch(model, prompts, config, steps=steps(model.config, config.mode))
    t = None
    for _ in batch.events():
        if t is None:
            t = time.perf_counter()  # after the prefill
            if spent is not None:
                spent.clear()
    return (time.perf_counter() - t) / max_tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, default=Path(".old"))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=2, help="the tiny model's layers (the 1B has 16)")
    p.add_argument("--real", action="store_true",
                   help="the tiny model's own compiled steps, not stand-ins: the step's call and its (tiny) work too")
    p.add_argument("--shape", default="tiny", choices=["tiny", *sorted(bench.SHAPES)],
                   help="tiny: the 1B's layout at a toy width (--layers); else that shape in full (a GPU)")
    p.add_argument("--idle", action="store_true",
                   help="with --phases: the device idle before each async_eval (as step_nodes.py times it)")
    p.add_argument("--phases", action="store_true",
                   help="also time this code's engine by method, and both codes' step calls and async_eval")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    old_code = import_round1(args.old)
    gen1, step1 = round1_module("generate"), round1_module("step")
    if args.shape == "tiny":
        config = dataclasses.replace(bench.SHAPES["1B"], hidden_size=64, intermediate_size=128, num_heads=4,
                                     num_kv_heads=2, vocab_size=512, num_layers=args.layers,
                                     layer_windows=(None,) * args.layers)
    else:
        config = bench.SHAPES[args.shape]
    new = bench.random_model(config, mx.float32 if args.shape == "tiny" else mx.bfloat16)
    old = round1_model(old_code, new)
    prompts = bench.random_prompts(config.vocab_size, args.batch, 16)
    runs = {"round 1": lambda: round1(gen1, step1, old, prompts, args.steps, args.real),
            "this code": lambda: ours(new, prompts, args.steps, args.real)}
    seen = {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for rep in range(args.repeats):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            seen[name].append(runs[name]() * 1e3)
    for name, v in seen.items():
        print(f"{name:10s} {statistics.median(v):7.3f} ms a step ({args.batch} rows; runs {[round(x, 3) for x in v]})")
    phases = {}
    if args.phases:  # once more, phases timed (the wrappers cost a little each)
        spent, runs, calls = Spent(), {"round 1": [], "this code": []}, {}
        timing_phases(spent, args.idle)
        for _ in range(args.repeats):
            round1(gen1, step1, old, prompts, args.steps, args.real, spent)
            runs["round 1"].append({name: spent[name] / 1e6 / args.steps for name in SHARED})
            calls["round 1"] = dict(spent.calls)
            ours(new, prompts, args.steps, args.real, spent)
            runs["this code"].append({name: spent[name] / 1e6 / args.steps for name in PHASES})
            calls["this code"] = dict(spent.calls)
        for code, seen_runs in runs.items():
            phases[code] = {name: statistics.median(r[name] for r in seen_runs) for name in seen_runs[0]}
            print(f"{code} by phase, ms a step: " + ", ".join(f"{k} {v:.3f}" for k, v in phases[code].items()))
            for name in SHARED:  # the last run's calls
                print(f"  {name}: {spread(calls[code][name])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)},
                                               "ms_per_step": seen, "phases_ms": phases,
                                               "last_run_calls_ns": calls}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
