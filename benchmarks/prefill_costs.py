"""Where a static batch's prefill time goes: an admission whole, and its parts timed apart.

For B prompts of T tokens of a random-weight shape, each timed synchronously (median of 5):
- admit: `Engine.admit` whole (pool, tables, chunk arrays, the decoder over the chunk, first tokens);
- forward: the decoder over the chunk without a cache (`llama.hidden`), the same tokens;
- writes: the per-layer KV writes into a pool of the admission's size (`cache.write`, K and V), and
  the same writes with one index per token (`out[slots] = rows`) instead of one per element;
- attention: each layer's attention over the chunk alone (`llama.grouped_attention` or MLX's
  fused kernel, as `llama.attention` chooses), the same shapes;
- matmuls: the step's linear maps at B * T rows (`profile.matmul_time`).

Run: python benchmarks/prefill_costs.py --shape 1B --batch-sizes 8,32,128 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from step_costs import median_ms  # benchmarks/ is on the path: these scripts run from there

from mlxfun import bench, llama
from mlxfun import cache as kv
from mlxfun.engine import Engine
from mlxfun.load import Model
from mlxfun.profile import matmul_time


def costs(model: Model, batch: int, tokens: int) -> dict:
    config, params = model.config, model.params
    prompts = bench.random_prompts(config.vocab_size, batch, tokens)
    out = {"batch": batch, "tokens": tokens}
    total = []
    for _ in range(4):
        engine = Engine(model, batch, prefix_cache=False)
        for p in prompts:
            engine.add(p, max_tokens=8, ignore_eos=True)
        mx.synchronize()
        t = time.perf_counter()
        engine.admit()  # evaluates at its end: nothing else is decoding
        total.append(time.perf_counter() - t)
    out["admit_ms"] = statistics.median(total[1:]) * 1e3
    out["prompt_tok_s"] = batch * tokens / statistics.median(total[1:])
    ids = mx.array(prompts)
    positions = mx.broadcast_to(mx.arange(tokens)[None], (batch, tokens))

    def forward():
        h, _ = llama.hidden(config, params, ids, positions, None, None, fast=True)
        mx.eval(h)

    out["forward_ms"] = median_ms(forward)
    K, D, H = config.num_kv_heads, config.head_dim, config.num_heads
    blocks = batch * -(-tokens // kv.BLOCK) + 1
    pool = mx.zeros((blocks * kv.BLOCK, K, 1, D), engine.dtype)
    new = mx.random.normal((batch, K, tokens, D)).astype(engine.dtype)
    slots = (mx.arange(batch * tokens, dtype=mx.int32) + kv.BLOCK).reshape(batch, tokens)
    mx.eval(pool, new, slots)

    def writes():
        mx.eval([kv.write(pool, new, slots) for _ in range(2 * config.num_layers)])

    out["writes_ms"] = median_ms(writes)
    rows = new.transpose(0, 2, 1, 3).reshape(batch * tokens, K, D)
    flat = slots.reshape(-1)
    mx.eval(rows, flat)

    def by_row():  # the alternative: one index per token, a (K, D) slice each (functional: on a new array object)
        out = mx.array(pool)
        out[flat] = rows
        return out

    def writes_by_row():
        mx.eval([by_row() for _ in range(2 * config.num_layers)])

    out["writes_by_row_ms"] = median_ms(writes_by_row)
    q = mx.random.normal((batch, H, tokens, D)).astype(engine.dtype)
    mask = mx.broadcast_to(mx.tril(mx.ones((tokens, tokens), mx.bool_))[None], (batch, tokens, tokens))
    mx.eval(q, mask)
    limit = llama.grouped_max_scores(engine.dtype)
    grouped = not llama.fused_masked_attention() and batch * H * tokens * tokens <= limit

    def attention():
        outs = []
        for _ in range(config.num_layers):
            if grouped:
                outs.append(llama.grouped_attention(q, new, new, mask, D**-0.5))
            else:
                outs.append(mx.fast.scaled_dot_product_attention(q, new, new, scale=D**-0.5, mask=mask[:, None]))
        mx.eval(outs)

    out["attention_ms"], out["attention"] = median_ms(attention), "grouped" if grouped else "sdpa"
    out["matmuls_ms"] = matmul_time(model, params, batch * tokens) * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--batch-sizes", default="8,32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (CPU smoke runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    if args.layers:
        import dataclasses
        config = dataclasses.replace(config, num_layers=args.layers, layer_windows=None)
    model = bench.random_model(config)
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        rows.append(costs(model, B, args.prompt_tokens))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
