"""Does a decode step write the KV cache in place while the step before is still running?
(diagnostic, issue 14). A cache write (`mx.put_along_axis`) donates its input buffer only when
nothing else holds it; a step still in flight on the device may hold the one before, and then
each layer's keys and values are copied whole. A copy shows as active memory above weights and
cache between steps. For this code's engine and round 1's static batch (`--old`), B prompts of
128 tokens decode `--steps` tokens; active memory is read after each step is queued.

Run: python benchmarks/pool_copies.py --shape 1B --batch 1,32 [--steps 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from rounds_ab import (  # benchmarks/ is on the path: these scripts run from there
    import_round1,
    round1_model,
    round1_module,
)

from mlxfun import bench
from mlxfun.engine import Engine


def cache_bytes(cache) -> int:
    return sum(a.nbytes for a in (*cache.keys, *cache.values))


def ours(model, prompts, steps: int) -> dict:
    engine = Engine(model, len(prompts))
    for p in prompts:
        engine.add(p, max_tokens=steps, ignore_eos=True)
    engine.admit()
    mx.eval(engine.state)
    seen, cache = [], cache_bytes(engine.state.cache)
    while engine.pending or engine._live():
        engine.step()
        seen.append(mx.get_active_memory())
    return {"cache_mb": cache / 1e6, "active_mb": [s / 1e6 for s in seen]}


def round1(gen1, model, prompts, steps: int) -> dict:
    config = gen1.make_config(len(prompts), max_tokens=steps, ignore_eos=True)
    batch = gen1.Batch(model, prompts, config)
    seen, last = [], -1
    for event in batch.events():
        if event.index <= last or len(prompts) == 1:  # one sample per step: the first row's event
            seen.append(mx.get_active_memory())
        last = event.index
    return {"cache_mb": cache_bytes(batch.state.cache) / 1e6, "active_mb": [s / 1e6 for s in seen]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--old", type=Path, default=Path(".old"))
    p.add_argument("--batch", default="1,32")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    old_code = import_round1(args.old)
    gen1 = round1_module("generate")
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    new = bench.random_model(bench.SHAPES[args.shape], dtype)
    old = round1_model(old_code, new)
    weights = mx.get_active_memory()
    out = {}
    for B in [int(b) for b in args.batch.split(",")]:
        prompts = bench.random_prompts(new.config.vocab_size, B, 128)
        for name, run in (("round 1", lambda: round1(gen1, old, prompts, args.steps)),
                          ("this code", lambda: ours(new, prompts, args.steps))):
            run()  # warm
            r = run()
            steady = r["active_mb"][4:-4]  # past the first steps, before rows end
            excess = (max(steady) - weights / 1e6 - r["cache_mb"]) / r["cache_mb"]
            out[f"{name} {B}"] = r | {"weights_mb": weights / 1e6, "max_excess_in_caches": excess}
            print(f"batch {B:4d} {name:10s} cache {r['cache_mb']:9.1f} MB, active between steps "
                  f"{min(steady):9.1f}-{max(steady):9.1f} MB (weights {weights / 1e6:.1f}): "
                  f"at most {excess:+.2f} caches more", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)},
                                               "runs": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
