"""Where a static batch's generation loop spends its host time: cProfile of `Engine.events()` for
one batch (random-weight shape, EOS ignored), after two unprofiled runs that compile and warm up.

    python benchmarks/host_profile.py --shape 1B --batch 128 --gen-tokens 128 [--label NAME]

Run it with another tree's package first on the path (`gpu.sh ab-profile`) to compare two codes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import mlx.core as mx

try:
    from mlxfun.bench.models import SHAPES, random_model
    from mlxfun.engine.core import Engine
except ImportError:  # the package before its layout in folders (commit 7fbc90b)
    from mlxfun.bench import SHAPES, random_model
    from mlxfun.engine import Engine


def run(model, rows: int, tokens: int, prompt: int) -> tuple[float, float]:
    """-> (seconds of the events loop, generated tok/s)."""
    engine = Engine(model, rows)
    for i in range(rows):
        engine.add([(i * 7 + j) % 20000 + 1 for j in range(prompt)], max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in engine.events():
        pass
    return time.perf_counter() - t0, engine.stats.generation_tps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="135M")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--label", default="")
    p.add_argument("--top", type=int, default=15, help="functions listed, by time spent in them")
    args = p.parse_args()
    model = random_model(SHAPES[args.shape], mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32)
    for _ in range(2):
        seconds, tps = run(model, args.batch, args.gen_tokens, args.prompt_tokens)
        print(f"{args.label} plain: {seconds:.3f} s, {tps:.1f} tok/s")
    profile = cProfile.Profile()
    profile.enable()
    seconds, tps = run(model, args.batch, args.gen_tokens, args.prompt_tokens)
    profile.disable()
    print(f"{args.label} profiled: {seconds:.3f} s, {tps:.1f} tok/s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
