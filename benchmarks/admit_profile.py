"""Where a static batch's admission spends host time (diagnostic): cProfile over repeated
admissions of B prompts of T tokens of a random-weight shape, after warm-up, sorted by own time.
Each admission ends evaluated, so time waiting for the device counts where the evaluation is called.

It runs this checkout's scheduler (`Engine.admit`), or round 1's static batch
(`generate.Batch.prefill`) when the mlxfun on the path has no `Engine.admit` (PYTHONPATH=.old).

Run: python benchmarks/admit_profile.py --shape 1B --batch 1 [--repeats 20] [--lines 30]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import pstats
import statistics
import time

PHASES = [("mlxfun.engine", "Engine", ["_prefill", "_first_token", "_merge", "_restack", "_empty_state", "_waves",
                                         "_admissible", "_drain"]),
          ("mlxfun.prefill", None, ["prefill_rows", "prefill_group", "chunk_arrays", "ensure_pool"]),
          ("mlxfun.step", None, ["prefill_chunk"]),
          ("mlx.core", None, ["eval", "async_eval"])]


def phases(mx, admission, repeats: int) -> dict[str, float]:
    """Host seconds in each of PHASES (where it exists) over `repeats` admissions (nested
    phases count in each: prefill_chunk is graph building, async_eval the launch)."""
    spent: dict[str, float] = {}
    undo = []

    def wrap(owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        setattr(owner, attr, timed)
        undo.append((owner, attr, inner))

    for module, cls, attrs in PHASES:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        for attr in attrs:
            if hasattr(owner, attr):
                wrap(owner, attr, f"{module.split('.')[-1]}.{attr}")
    try:
        for _ in range(repeats):
            admission()
    finally:
        for owner, attr, inner in reversed(undo):
            setattr(owner, attr, inner)
    return spent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--lines", type=int, default=30)
    p.add_argument("--clear-cache", action="store_true",
                   help="empty MLX's buffer cache before each admission (as `mlxfun bench` does before each run)")
    args = p.parse_args(argv)

    import mlx.core as mx

    from mlxfun import bench
    from mlxfun import engine as eng
    from mlxfun.load import Model

    config = bench.SHAPES[args.shape]
    dtype = mx.bfloat16 if bench.on_gpu() else mx.float32
    model = Model(config, bench.random_params(config, dtype), bench.word_tokenizer(config.vocab_size), args.shape)
    prompts = bench.random_prompts(config.vocab_size, args.batch, args.prompt_tokens)

    def fresh():
        if args.clear_cache:
            gc.collect()
            mx.clear_cache()

    if hasattr(eng.Engine, "admit"):
        def admission():
            fresh()
            engine = eng.Engine(model, args.batch)
            for prompt in prompts:
                engine.add(prompt, max_tokens=8, ignore_eos=True)
            t = time.perf_counter()
            engine.admit()  # evaluates: nothing else is decoding
            return time.perf_counter() - t
    else:
        gen = importlib.import_module("mlxfun.generate")  # the package's `generate` is the function

        def admission():
            fresh()
            batch = gen.Batch(model, prompts, gen.make_config(args.batch, max_tokens=8))
            t = time.perf_counter()
            mx.eval(batch.prefill())
            return time.perf_counter() - t

    for _ in range(3):
        admission()
    mx.synchronize()
    times = [admission() for _ in range(args.repeats)]
    print(f"{bench.__file__}: batch {args.batch}, admission {statistics.median(times) * 1e3:.2f} ms (median)")
    spent = phases(mx, admission, args.repeats)
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {seconds / args.repeats * 1e3:8.3f} ms per admission")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.repeats):
        admission()
    profile.disable()
    for key in ("tottime", "cumulative"):  # MLX's calls count in their callers' own time
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.lines)
        print(f"-- by {key}, {args.repeats} admissions")
        print(out.getvalue().split("\n", 5)[-1].strip("\n"))  # past the header
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
