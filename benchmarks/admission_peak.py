"""Where a static batch's peak memory is reached, this code against round 1 (diagnostic, issue 14):
B prompts of T tokens of a random-weight model admitted (this code's `Engine.admit`, round 1's
`Batch.prefill`), evaluated; reported: the peak beyond the weights, the KV cache held right after
it, and their difference (activations and everything else). Then both whole runs' peaks.

Round 1's cache held the prompts only and grew at the first decode step, when the prompts'
activations were gone. This code made its pool for every token its rows may hold (prompt and
`--gen-tokens`) before the prompts ran, until a first admission's pool became the prompts' blocks,
grown to the reservation by the first decode step (2026-12-05).

Run: python benchmarks/admission_peak.py --old .old [--shape 1B] [--width 256] [--batch 128] [--json F]
(--width scales the shape down, same layers and vocabulary split, so the CPU can run it.)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from rounds_ab import import_round1, round1_model, round1_module  # benchmarks/ is on the path

from mlxfun import bench
from mlxfun.engine import Engine


def nbytes(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


def fresh() -> None:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, default=Path(".old"))
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--width", type=int, default=0, help="hidden size to scale the shape to (0: as it is)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    if args.width:
        scale = config.hidden_size // args.width
        config = dataclasses.replace(config, hidden_size=args.width,
                                     intermediate_size=config.intermediate_size // scale,
                                     num_heads=max(1, config.num_heads // scale),
                                     num_kv_heads=max(1, config.num_kv_heads // scale),
                                     vocab_size=config.vocab_size // scale)
    model = bench.random_model(config, mx.bfloat16)
    round1 = import_round1(args.old)
    model1 = round1_model(round1, model)
    generate1 = round1_module("generate")
    prompts = bench.random_prompts(config.vocab_size, args.batch, args.prompt_tokens)
    weights = mx.get_active_memory()
    mb = 1e-6
    rows = {}
    for _ in range(2):  # the second pass is reported: the first compiles
        fresh()
        engine = Engine(model, args.batch)
        for prompt in prompts:
            engine.add(prompt, max_tokens=args.gen_tokens, ignore_eos=True)
        engine.admit()
        mx.synchronize()
        kv = nbytes(engine.state.cache)
        rows["this code"] = dict(peak_mb=(mx.get_peak_memory() - weights) * mb, kv_mb=kv * mb)
        del engine
        fresh()
        batch = generate1.Batch(model1, prompts, generate1.make_config(args.batch, max_tokens=args.gen_tokens,
                                                                       ignore_eos=True))
        out, state = batch.prefill()
        mx.eval(out, state)
        kv = nbytes(state.cache)
        rows["round 1"] = dict(peak_mb=(mx.get_peak_memory() - weights) * mb, kv_mb=kv * mb)
        del batch, out, state
    for name, run_batch, m in (("this code", bench.run_batch, model), ("round 1", round1[0].run_batch, model1)):
        fresh()
        run_batch(m, prompts, args.gen_tokens, None)
        rows[name]["run_peak_mb"] = (mx.get_peak_memory() - weights) * mb
    print(f"{args.shape} (hidden {config.hidden_size}), {args.batch} prompts of {args.prompt_tokens} tokens, "
          f"{args.gen_tokens} generated; MB beyond the weights ({weights * mb:.0f} MB)")
    print(f"{'':10s} {'admission peak':>15s} {'KV after it':>12s} {'the rest':>9s} {'whole run peak':>15s}")
    for name, r in rows.items():
        r["rest_mb"] = r["peak_mb"] - r["kv_mb"]
        print(f"{name:10s} {r['peak_mb']:15.1f} {r['kv_mb']:12.1f} {r['rest_mb']:9.1f} {r['run_peak_mb']:15.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)},
                                               "weights_mb": weights * mb, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
