"""Static batches of mixed prompts, round 1 against this code and variants of its prefill, in one
process (issue 14: static mixed batches read 0.78-0.96x round 1 in separate processes).

The workload is `mlxfun bench --continuous`'s static half: 256 prompts of 8-128 tokens, each with
16-256 tokens to generate, as 8 consecutive static batches of 32. Each variant warms up as the bench
does (one batch of 4 tokens), then runs the workload once cold (its first sight of most chunk
shapes and pool sizes: the traces a one-off job pays) and `--repeats` times warm, in ABBA order.
The variants of this code:
- `this code`: as shipped (prefill chunks of up to `step.PREFILL_COMPILED_TOKENS` compiled);
- `plain`: no prefill chunk compiled;
- `after1`: a chunk shape compiled from its second sight on (branch `prefill-compile-after`);
- `pow2`: pools on a grid of 64 x 2^k blocks only (shipped: 64 x 2^k and 96 x 2^k). Each pool
  size the decode step meets traces it again: the workload's batches reserve 385 or 513 blocks,
  and with their two table widths the shipped grid traced the step 4 times there, this one 2
  (this CPU, GPU sizes forced); round 1 traced it once.
Variants other than `this code` have compiled steps of their own, so none rides on another's traces.

Run: python benchmarks/static_mixed_ab.py --shape 1B --old .old [--repeats 3] [--cold-order ours] [--json F]
     (on the CPU: --tiny, a 2-layer model 64 wide, and the GPU's rounding to 32 tokens)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from rounds_ab import import_round1, round1_model, round1_module  # beside this script

from mlxfun import bench, bench_workloads, engine, paging, prefill, step
from mlxfun.config import ModelConfig

TINY = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                   num_kv_heads=2, head_dim=32, max_position_embeddings=8192)


def after_sights(config, mode):
    """Steps whose prefill compiles a chunk shape from its second sight on (plain the first time)."""
    base = step.make_steps(config, mode, compile_prefill=step.PREFILL_COMPILED_TOKENS)
    plain = step.make_steps(config, mode, compile_prefill=0)
    seen: set = set()

    def prefill_(params, tokens, positions, cache, slots, last, wraps=True, fresh=False, run=None, launch=None):
        key = (tokens.shape, cache.table.shape, cache.keys[0].shape, wraps, fresh, run is None)
        first = key not in seen and tokens.size <= step.PREFILL_COMPILED_TOKENS
        seen.add(key)
        return (plain if first else base).prefill(params, tokens, positions, cache, slots, last, wraps, fresh, run,
                                                  launch)

    return base._replace(prefill=prefill_)


def cached(build):
    """`build(config, mode)` made once per (config, mode), as `step.compiled_steps` is."""
    made: dict = {}

    def steps(config, mode):
        if (config, mode) not in made:
            made[(config, mode)] = build(config, mode)
        return made[(config, mode)]
    return steps


def pow2_pool(blocks: int, max_blocks: int, least: int = paging.MIN_BLOCKS) -> int:
    size = least
    while size < blocks - 1:
        size *= 2
    return min(1 + size, max_blocks)


@contextlib.contextmanager
def pool_grid(size):
    """Pools sized by `size` (as `paging.pool_size`) meanwhile."""
    shipped = paging.pool_size
    paging.pool_size = engine.pool_size = size
    try:
        yield
    finally:
        paging.pool_size = engine.pool_size = shipped


@contextlib.contextmanager
def engine_steps(steps):
    """Engines made meanwhile take their compiled steps from `steps(config, mode)`."""
    defaults = engine.Engine.__init__.__kwdefaults__
    shipped = defaults["steps"]
    defaults["steps"] = steps
    try:
        yield
    finally:
        defaults["steps"] = shipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model 64 wide (CPU check of the script)")
    p.add_argument("--old", type=Path, default=Path(".old"), help="a folder holding round 1's mlxfun/")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="plain,after1,pow2")
    p.add_argument("--cold-order", choices=("round1", "ours"), default="round1",
                   help="which code runs its cold pass first (a process drifts: alternate it across processes)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1 (the table is of warm medians)")
    if args.tiny:
        prefill.pad_multiple = lambda: 32  # the GPU's chunk lengths

    tmp = Path(tempfile.mkdtemp())
    old_code = import_round1(args.old, tmp)
    if args.tiny:
        round1_module("prefill").pad_multiple = lambda: 32
    new = bench.random_model(TINY if args.tiny else bench.SHAPES[args.shape])
    old = round1_model(old_code, new)
    prompts, limits = bench_workloads.mixed_workload(new.config.vocab_size, args.prompts, 16, 256)
    old_workloads, old_generate = round1_module("bench_workloads"), round1_module("generate").generate

    compiled = step.PREFILL_COMPILED_TOKENS if bench.on_gpu() else 0  # as `step.compiled_steps` chooses
    steps = {"this code": step.compiled_steps,
             "plain": cached(lambda config, mode: step.make_steps(config, mode)),
             "after1": cached(after_sights),
             "pow2": cached(lambda config, mode: step.make_steps(config, mode, compile_prefill=compiled))}
    grids = {"pow2": pow2_pool}

    def ours(name):
        def run(warmup: bool):
            """The workload's static pass -> seconds; or, with `warmup`, the bench's warm-up batch."""
            with engine_steps(steps[name]), pool_grid(grids.get(name, paging.pool_size)):
                if warmup:
                    bench_workloads.generate(new, prompts[:args.rows], max_tokens=4, ignore_eos=True)
                    return 0.0
                return bench_workloads.static_batches(new, prompts, limits, args.rows)
        return run

    def round1(warmup: bool):
        if warmup:
            old_generate(old, prompts[:args.rows], max_tokens=4, ignore_eos=True)
            return 0.0
        return old_workloads.static_batches(old, prompts, limits, args.rows)

    runs = {"round 1": round1, "this code": ours("this code")}
    for v in [v for v in args.variants.split(",") if v]:
        runs[v] = ours(v)
    for run in runs.values():
        run(True)
    cold = {}
    order = list(runs) if args.cold_order == "round1" else list(runs)[1:] + ["round 1"]
    for name in order:
        run = runs[name]
        mx.synchronize()
        cold[name] = run(False)
        print(f"cold {name:10s} {cold[name]:6.2f} s", flush=True)
    warm: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(args.repeats):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            warm[name].append(runs[name](False))
            print(f"warm {name:10s} {warm[name][-1]:6.2f} s ({time.perf_counter() - t0:.1f})", flush=True)
    print(f"{'version':10s} {'cold s':>7s} {'warm s (median)':>16s} {'cold/r1':>8s} {'warm r1/x':>9s}")
    med = {name: statistics.median(w) for name, w in warm.items()}
    for name in runs:
        print(f"{name:10s} {cold[name]:7.2f} {med[name]:16.2f} {cold[name] / cold['round 1']:7.2f}x "
              f"{med['round 1'] / med[name]:8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)},
                                               "cold_s": cold, "warm_s": warm, "warm_median_s": med}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
