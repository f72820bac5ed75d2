"""What an admission holds at its peak (diagnostic): MLX's peak memory over one static admission of
B prompts of T tokens, beside the KV pool it reserves and the peak of the decoder alone over the
same tokens (no cache). What is left beyond the two is what the admission keeps alive besides.

Run: python benchmarks/admit_memory.py --shape 8B --layers 4 --hidden 1024 --batch 32 [--json PATH]
(a narrowed shape on the CPU: the 8B's heads and head size, fewer layers, a smaller hidden size)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from pathlib import Path

import mlx.core as mx

from mlxfun import bench, llama, prefill
from mlxfun.engine import Engine


def peak_of(fn) -> float:
    """MB of peak memory above what was active before `fn` ran."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    fn()
    return (mx.get_peak_memory() - base) / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8B", choices=sorted(bench.SHAPES))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (and twice it as the MLP's)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--grouped-max-scores", type=int, default=None,
                   help="llama.GROUPED_MAX_SCORES while it runs (chunks over it: MLX's fused attention on a GPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.grouped_max_scores is not None:
        llama.GROUPED_MAX_SCORES = args.grouped_max_scores
    config = bench.SHAPES[args.shape]
    changes = {"vocab_size": 512, "layer_windows": None}
    if args.layers:
        changes["num_layers"] = args.layers
    if args.hidden:
        changes.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_heads=args.hidden // config.head_dim,
                       num_kv_heads=min(config.num_kv_heads, args.hidden // config.head_dim))
    config = dataclasses.replace(config, **changes)
    model = bench.random_model(config)
    prompts = bench.random_prompts(config.vocab_size, args.batch, args.prompt_tokens)
    pool = {}

    def admit():
        engine = Engine(model, args.batch, shrink_rows=False)
        for prompt in prompts:
            engine.add(prompt, max_tokens=args.max_tokens, ignore_eos=True)
        engine.admit()  # evaluates: nothing else is decoding
        pool["mb"] = engine.pool.size * engine.block_bytes / 1e6

    def forward(rows=len(prompts)):
        ids = mx.array(prompts[:rows])
        positions = mx.broadcast_to(mx.arange(args.prompt_tokens)[None], ids.shape)
        h, _ = llama.hidden(config, model.params, ids, positions)
        mx.eval(h[:, -1])

    # An admission prefills groups of at most prefill.group_tokens tokens, one after the other.
    group = max(1, min(len(prompts), prefill.group_tokens(config.hidden_size) // args.prompt_tokens))
    row = {"batch": args.batch, "tokens": args.prompt_tokens, "admit_peak_mb": peak_of(admit),
           "pool_mb": pool["mb"], "forward_peak_mb": peak_of(forward), "group_rows": group,
           "group_forward_peak_mb": peak_of(lambda: forward(group))}
    row["beyond_mb"] = row["admit_peak_mb"] - row["pool_mb"] - row["forward_peak_mb"]
    row["beyond_group_mb"] = row["admit_peak_mb"] - row["pool_mb"] - row["group_forward_peak_mb"]
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape,
                                               "config": dataclasses.asdict(config), "row": row}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
