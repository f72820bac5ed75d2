"""batch_invariant end to end on a GPU (issue 54): a row's tokens and logprobs, bit for bit, alone
against batched, reversed, continuous (3 rows), behind a cached prefix and in other prefill chunks,
with the mode off and on. A random model of SmolLM2-135M's shape (30 layers, 9 heads, 3 KV heads of
64) in bf16 and fp16, and with its weights in 4-bit, on 12 prompts of 1-110 tokens, 24 greedy tokens
each; each way's generation time beside.

Run: python benchmarks/invariant_e2e.py [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import mlx.core as mx
import numpy as np

from mlxfun.bench import models as bench
from mlxfun.generate import generate
from mlxfun.model import weights


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 40).tolist()
    out = [rng.integers(3, vocab, n).tolist() for n in (1, 5, 17, 33, 64, 110, 9, 80, 2, 47)]
    return out + [shared + [7, 8, 9], shared + [10]]  # the last two share a 40-token prefix


def outputs(result, i):
    return result.token_ids[i], result.logprobs[i]


def check(model, name: str, invariant: bool, tokens: int) -> dict:
    prompts = prompts_for(model.config.vocab_size)
    options = dict(max_tokens=tokens, ignore_eos=True, logprobs=0, batch_invariant=invariant)
    t = time.perf_counter()
    alone = [outputs(generate(model, [p], **options), 0) for p in prompts]
    alone_s = time.perf_counter() - t
    ways = {"batched": (prompts, {}), "reversed": (prompts[::-1], {}),
            "continuous 3 rows": (prompts, {"batch_size": 3}), "prefill chunks of 16": (prompts, {"prefill_step": 16})}
    out = dict(model=name, invariant=invariant, prompts=len(prompts), alone_s=round(alone_s, 2), ways={})
    for way, (order, extra) in ways.items():
        t = time.perf_counter()
        result = generate(model, order, **options, **extra)
        seconds = time.perf_counter() - t
        same_tokens = sum(result.token_ids[i] == alone[prompts.index(p)][0] for i, p in enumerate(order))
        same_bits = sum(outputs(result, i) == alone[prompts.index(p)] for i, p in enumerate(order))
        out["ways"][way] = dict(same_tokens=same_tokens, same_bits=same_bits, seconds=round(seconds, 3))
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--models", default="bf16,fp16,q4", help="among bf16, fp16, q4 (4-bit weights, bf16 activations)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    base = bench.random_model(bench.SHAPES["135M"], mx.bfloat16)
    models = {"bf16": base, "fp16": dataclasses.replace(base, params=weights.cast(base.config, base.params,
                                                                                   mx.float16))}
    quantized = weights.quantize(base.config, base.params, 4, 64)
    models["q4"] = dataclasses.replace(base, params=quantized)
    rows = []
    for name, model in models.items():
        if name not in args.models.split(","):
            continue
        for invariant in (False, True):
            try:
                rows.append(check(model, name, invariant, args.tokens))
            except Exception as e:  # one failure must not hide the other rows
                rows.append(dict(model=name, invariant=invariant, error=f"{type(e).__name__}: {e}"))
                print(json.dumps(rows[-1]), flush=True)
    held = all(w["same_bits"] == r["prompts"] for r in rows if r.get("invariant") and "ways" in r
               for w in r["ways"].values())
    print("INVARIANT", "HELD" if held else "BROKEN", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(mx.default_device()), "rows": rows, "held": held}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
