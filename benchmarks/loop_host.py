"""The host's own time per decode step of the generation loop, this code's engine against round 1's
static batch (diagnostic, issue 14): both run B rows of a tiny random model with a stand-in decode
step that returns arrays already computed (the same tokens every step), so a step's time is the
loop's Python and MLX calls alone. On an H200 a 1B decode step at 128 rows is host-bound (`mlxfun
profile`: about 4 ms to launch, 1 ms more on the device), so this time adds to every step.

Run: python benchmarks/loop_host.py --batch 128 [--steps 200] [--repeats 5] [--real] [--json PATH]
(--old: a folder holding round 1's mlxfun/, as rounds_ab.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from rounds_ab import import_round1, round1_model  # benchmarks/ is on the path: these scripts run from there

from mlxfun import bench
from mlxfun.engine import Engine


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


def ours(model, prompts, max_tokens: int, real: bool = False) -> float:
    from mlxfun.step import compiled_steps
    engine = Engine(model, len(prompts), steps=compiled_steps if real else frozen(compiled_steps))
    for p in prompts:
        engine.add(p, max_tokens=max_tokens, ignore_eos=True)
    engine.admit()
    mx.eval(engine.state)
    t = time.perf_counter()
    for _ in engine.events():
        pass
    return (time.perf_counter() - t) / max_tokens


def round1(gen1, step1, model, prompts, max_tokens: int, real: bool = False) -> float:
    config = gen1.make_config(len(prompts), max_tokens=max_tokens, ignore_eos=True)
    steps = step1.compiled_steps if real else frozen(step1.compiled_steps)
    batch = gen1.Batch(model, prompts, config, steps=steps(model.config, config.mode))
    t = None
    for _ in batch.events():
        if t is None:
            t = time.perf_counter()  # after the prefill
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
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import importlib
    old_code = import_round1(args.old, Path(tempfile.mkdtemp()))
    gen1, step1 = importlib.import_module("mlxfun_r1.generate"), importlib.import_module("mlxfun_r1.step")
    config = dataclasses.replace(bench.SHAPES["1B"], hidden_size=64, intermediate_size=128, num_heads=4,
                                 num_kv_heads=2, vocab_size=512, num_layers=args.layers,
                                 layer_windows=(None,) * args.layers)
    new = bench.random_model(config, mx.float32)
    old = round1_model(old_code, new)
    prompts = bench.random_prompts(512, args.batch, 16)
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
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)},
                                               "ms_per_step": seen}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
