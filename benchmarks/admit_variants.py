"""Where an admission's peak memory goes beyond the decoder's own (diagnostic, issue 14): one static
admission of B prompts of T tokens, with each length group's peak, under variants that each remove
one suspect. Every variant runs in a fresh process, so its peak is its own.

    python benchmarks/admit_variants.py --shape 8B --batch 128 [--variants base,nowrite,...] [--json PATH]

Variants:
  base       the admission as it ships
  forward    the decoder alone over one group's rows (no cache, not compiled): the reference peak
  nocompile  mx.disable_compile(): the prefill chunk runs op by op
  evalpool   the empty pool evaluated before the first group (not a lazy zeros inside the first graph)
  nowrite    kv.write returns the pool unwritten (what the pool writes hold)
  ops20      MLX_MAX_OPS_PER_BUFFER=20: smaller CUDA graphs, so fewer temporaries wait on each
  group4096  prefill groups of 4,096 tokens (`prefill.group_tokens`)
  flat, handle, wide  the chunk write of benchmarks/chunk_write.py's variant of that name
  nodepends  mx.depends made a no-op: a first chunk's writes no longer ordered before the next layer

On the CPU, narrow the shape: --layers 16 --hidden 1024 --batch 16 (heads of the shape's size), and
--bf16 for a GPU's dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = ["base", "forward", "nocompile", "evalpool", "nowrite", "ops20", "group4096", "flat", "handle", "wide",
            "nodepends"]


def run_variant(args) -> dict:
    import mlx.core as mx

    from mlxfun import bench, llama, prefill
    from mlxfun import cache as kv
    from mlxfun.engine import Engine

    narrow = {"num_layers": args.layers} if args.layers else {}  # fewer and narrower: a short check on the CPU
    shape = bench.SHAPES[args.shape]
    if args.hidden:
        heads = args.hidden // shape.head_dim
        narrow.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_heads=heads,
                      num_kv_heads=min(shape.num_kv_heads, heads))
    config = dataclasses.replace(shape, vocab_size=512, layer_windows=None, **narrow)
    model = bench.random_model(config, mx.bfloat16 if args.bf16 else None)
    mx.eval(model.params)
    prompts = bench.random_prompts(config.vocab_size, args.batch, args.prompt_tokens)
    v = args.variant
    if v == "nocompile":
        mx.disable_compile()
    if v == "group4096":
        prefill.group_tokens = lambda hidden_size: 4096
    if v == "nowrite":
        kv.write = lambda buf, new, slots: buf
    if v == "nodepends":
        mx.depends = lambda inputs, dependencies: inputs
    if v in ("flat", "handle", "wide"):
        import chunk_write  # beside this script

        one_token, chunk = kv.write, chunk_write.VARIANTS[v]
        kv.write = lambda buf, new, slots: (one_token if new.shape[2] == 1 else chunk)(buf, new, slots)
    groups: list[dict] = []
    if v == "evalpool":
        empty = Engine._empty_state

        def evaluated(self):
            state = empty(self)
            mx.eval(state)
            return state
        Engine._empty_state = evaluated
    first = Engine._first_token

    def reporting(self, params, h, records):
        mx.eval(h, self.state)
        groups.append({"rows": len(records), "active_gb": round((mx.get_active_memory() - base) / 1e9, 3),
                       "peak_gb": round((mx.get_peak_memory() - base) / 1e9, 3)})
        mx.reset_peak_memory()
        return first(self, params, h, records)
    Engine._first_token = reporting
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    row = {"variant": v, "weights_gb": round(base / 1e9, 3)}
    if v == "forward":
        rows = max(1, min(len(prompts), prefill.group_tokens(config.hidden_size) // args.prompt_tokens))
        ids = mx.array(prompts[:rows])
        positions = mx.broadcast_to(mx.arange(args.prompt_tokens)[None], ids.shape)
        h, _ = llama.hidden(config, model.params, ids, positions)
        mx.eval(h[:, -1])
        row.update(rows=rows, peak_gb=round((mx.get_peak_memory() - base) / 1e9, 3))
        return row
    engine = Engine(model, args.batch, shrink_rows=False)
    for prompt in prompts:
        engine.add(prompt, max_tokens=args.max_tokens, ignore_eos=True)
    engine.admit()
    mx.eval(engine.state)
    row.update(pool_gb=round(engine.pool.size * engine.block_bytes / 1e9, 3), groups=groups,
               peak_gb=round(max(g["peak_gb"] for g in groups), 3))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8B")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (twice it the MLP's)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights on the CPU too (a GPU's default)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child's one variant
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    rows = []
    for v in args.variants.split(","):
        env = {**os.environ, **({"MLX_MAX_OPS_PER_BUFFER": "20"} if v == "ops20" else {})}
        cmd = [sys.executable, __file__, "--shape", args.shape, "--batch", str(args.batch), "--prompt-tokens",
               str(args.prompt_tokens), "--max-tokens", str(args.max_tokens), "--variant", v,
               *(["--layers", str(args.layers)] if args.layers else []),
               *(["--hidden", str(args.hidden)] if args.hidden else []), *(["--bf16"] if args.bf16 else [])]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode:
            print(f"{v}: failed\n{run.stderr[-1500:]}", flush=True)
            continue
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        from mlxfun import bench
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
