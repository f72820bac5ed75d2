"""Does a decode step's time follow the KV pool's size? (diagnostic, issue 14): B rows of a
random-weight shape decode the same steps with a small and a large reservation (`max_tokens`, so
the pool is sized for it), alternating; reported per reservation: ms per step over `--steps` steps
after `--warm` (medians of `--repeats`), the pool's size, and the peak above the memory active
when timing began. A step that wrote the pool in place costs the same at any size; one that copied
a pool buffer would take longer, and peak one buffer higher, at the larger. `--both`: each
reservation also with every step waiting for the one before it before it is queued (the engine
queues a step while the one before still runs; on the CPU that copied the pool).

Run: python benchmarks/decode_reserve.py --shape 1B --batch 128 --max-tokens 64,2048 [--both] [--json PATH]
(on the CPU: --layers 2 --hidden 64 --batch 32 --steps 8)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlxfun import bench
from mlxfun.engine import Engine


def waiting(engine: Engine) -> None:
    """Each decode step of `engine` waits for the one before it to finish before it is queued."""
    queue = engine.decode

    def decode():
        mx.eval(engine.state)
        return queue()
    engine.decode = decode


def timed_steps(model, prompts: list[list[int]], max_tokens: int, warm: int, steps: int, wait: bool = False) -> dict:
    engine = Engine(model, len(prompts))
    if wait:
        waiting(engine)
    for p in prompts:
        engine.add(p, max_tokens=max_tokens, ignore_eos=True)
    B, seen = len(prompts), 0
    for _ in engine.events():
        seen += 1
        if seen == B * warm:
            mx.synchronize()
            gc.collect()
            mx.reset_peak_memory()
            base, t = mx.get_active_memory(), time.perf_counter()
        if seen == B * (warm + steps):
            mx.synchronize()
            dt = time.perf_counter() - t
            break
    pool = sum(a.nbytes for a in engine.state.cache.keys + engine.state.cache.values)
    return {"ms_per_step": dt / steps * 1e3, "pool_gb": pool / 1e9,
            "peak_above_gb": (mx.get_peak_memory() - base) / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--layers", type=int, default=None, help="a narrowed shape on the CPU: this many layers")
    p.add_argument("--hidden", type=int, default=None, help="and this hidden size (twice it as the MLP's)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", default="64,2048")
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--both", action="store_true", help="also with each step waiting for the one before")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    if args.layers or args.hidden:
        layers = args.layers or config.num_layers
        hidden = args.hidden or config.hidden_size
        config = dataclasses.replace(config, num_layers=layers, layer_windows=(None,) * layers, hidden_size=hidden,
                                     intermediate_size=2 * hidden)
    model = bench.random_model(config)
    prompts = bench.random_prompts(config.vocab_size, args.batch, args.prompt_tokens)
    waits = (False, True) if args.both else (False,)
    variants = [(int(n), wait) for n in args.max_tokens.split(",") for wait in waits]
    runs: dict[str, list[dict]] = {}
    timed_steps(model, prompts, variants[0][0], args.warm, 2)  # compile
    for rep in range(args.repeats):
        for n, wait in (variants if rep % 2 == 0 else variants[::-1]):
            runs.setdefault(f"{n} {'waits' if wait else 'queued'}", []).append(
                timed_steps(model, prompts, n, args.warm, args.steps, wait))
    print(f"{'max_tokens, step':>18s} {'pool GB':>8s} {'ms/step':>8s} {'peak above GB':>14s}  "
          f"(medians of {args.repeats})")
    for name, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{name:>18s} {med['pool_gb']:8.3f} {med['ms_per_step']:8.3f} {med['peak_above_gb']:14.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
