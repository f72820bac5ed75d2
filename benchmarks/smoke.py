"""Correctness smoke test for a new backend (e.g. CUDA): batched greedy equals each prompt alone.

Prompts of different lengths make left padding, so masks have all-False rows (padding queries) and
RoPE gets per-row array offsets. Run: python benchmarks/smoke.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# Float32 means float32 here: CUDA matmuls otherwise round inputs to TF32 (MLX's default there), and
# a near tie then flips between a batch and a row alone because their matmul shapes differ.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx

from mlxfun.bench import models as bench
from mlxfun.engine.core import Engine
from mlxfun.engine.rows import result
from mlxfun.engine.strategy import QUANTIZED, WeightStrategy
from mlxfun.model import weights
from mlxfun.model.config import ModelConfig, RopeScaling
from mlxfun.model.load import Model

CONFIG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                     num_kv_heads=2, head_dim=32, rope_theta=500000.0, max_position_embeddings=2048,
                     rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=256),
                     tie_word_embeddings=False)


def run(model: Model, prompts: list[list[int]], strategy: WeightStrategy | None):
    """A static batch: one engine row per prompt."""
    engine = Engine(model, len(prompts), strategy=strategy)
    ids = [engine.add(p, max_tokens=24, ignore_eos=True, logprobs=0) for p in prompts]
    for _ in engine.events():
        pass
    return result([engine.take(i).row for i in ids], engine.stats, [], 0)


def check(model: Model, name: str, strategy: WeightStrategy | None = None) -> dict:
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 40, 17, 1, 33, 64))]
    batched = run(model, prompts, strategy)
    alone = [run(model, [p], strategy) for p in prompts]
    same = [b == a.token_ids[0] for b, a in zip(batched.token_ids, alone)]
    finite = all(math.isfinite(x) for row in batched.logprobs for x in row)
    gap = max(abs(x - y) for b, a in zip(batched.logprobs, alone) for x, y in zip(b, a.logprobs[0]))
    out = dict(weights=name, rows_equal=sum(same), rows=len(same), finite=finite, max_logprob_gap=gap)
    print(json.dumps(out), flush=True)
    return out | {"tokens": batched.token_ids}


def served(model: Model) -> dict:
    """A server's engine (fixed shapes, warmed up, 3 rows) under a closed loop of 12 prompts: each
    finished request replaced at once, so short prompts ride along decode steps (`mixed_tokens`).
    Tokens and logprobs against each prompt alone."""
    from mlxfun.engine.warmup import warm_up

    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 40, 17, 1, 33, 64) * 2)]
    engine = Engine(model, 3, fixed_shapes=True, kv_memory=64 << 20, mixed_tokens=128)
    warm_up(engine)
    lengths = [6 + 5 * (i % 4) for i in range(len(prompts))]  # rows finish at different steps
    ids = [engine.add(p, max_tokens=n, ignore_eos=True, logprobs=0) for p, n in zip(prompts[:3], lengths)]
    while not engine.idle or len(ids) < len(prompts):
        for e in engine.step():
            if e.finish_reason is not None and len(ids) < len(prompts):
                n = len(ids)
                ids.append(engine.add(prompts[n], max_tokens=lengths[n], ignore_eos=True, logprobs=0))
    rows = [engine.take(i).row for i in ids]
    alone = [run(model, [p], None) for p in prompts]  # 24 tokens each
    same = [r.token_ids == a.token_ids[0][:n] for r, a, n in zip(rows, alone, lengths)]
    gap = max(abs(x - y) for r, a in zip(rows, alone) for x, y in zip(r.logprobs, a.logprobs[0]))
    out = dict(weights="float32 server engine", rows_equal=sum(same), rows=len(same), carried=engine.stats.carried,
               admissions=engine.stats.admissions, max_logprob_gap=gap)
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tok = bench.word_tokenizer(CONFIG.vocab_size)
    f32 = bench.random_params(CONFIG, mx.float32, seed=1)
    results = [check(Model(CONFIG, f32, tok), "float32")]
    results.append(served(Model(CONFIG, f32, tok)))
    bf16 = weights.cast(CONFIG, f32, mx.bfloat16)
    results.append(check(Model(CONFIG, bf16, tok), "bfloat16"))
    q4_bf16 = weights.quantize(CONFIG, bf16, bits=4, group_size=64)  # bf16 activations: qmv on tensor cores
    results.append(check(Model(CONFIG, q4_bf16, tok), "q4 bf16 quantized kernel", QUANTIZED))
    q4 = weights.quantize(CONFIG, f32, bits=4, group_size=64)
    # Compare like with like: the quantized kernel throughout, then the dense copy throughout.
    results.append(check(Model(CONFIG, q4, tok), "q4 quantized kernel", QUANTIZED))
    results.append(check(Model(CONFIG, q4, tok), "q4 dense copy", WeightStrategy(dense_from=1)))
    a, b = results[-2].pop("tokens"), results[-1].pop("tokens")
    agree = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    print(f"q4: tokens equal between the quantized kernel and the dense copy: {agree:.1%}")
    for r in results:
        r.pop("tokens", None)
    results.append({"q4_strategy_token_agreement": agree})
    ok = all(r.get("finite", True) for r in results) and all(r["rows_equal"] == r["rows"] for r in results[:2])
    print("SMOKE", "OK" if ok else "FAILED", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "results": results, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
