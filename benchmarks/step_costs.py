"""Where a verify round's and an admission's time goes: the parts timed apart, synchronously.

For a random-weight shape at batch B (prompts of --prompt-tokens):
- decode: the compiled decode step, evaluated each call (device + launch, no pipelining), and
  pipelined: 20 steps queued one after another, timed together;
- forward T=1 / T=k+1: the decoder alone over 1 and k+1 positions (what verifying k drafts adds);
- verify: the compiled verify step (decoder, verdict, state), evaluated each call;
- round: `Engine.verify` whole (drafts from a zero-cost drafter, table, step, reading the verdict,
  handing out tokens), minus nothing;
- admit: `Engine.admit` for B prompts, evaluated. (The recorded H200 runs split it into the host's
  part and the wait after, through the engine's private steps; `admit` is timed whole now.)

Run: python benchmarks/step_costs.py --shape 8B --batch-sizes 1,8 [--k 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxfun import bench, llama, speculative
from mlxfun.engine import Engine
from mlxfun.load import Model


class Zero(speculative.Drafter):
    """Drafts k zeros for every live row, at no cost."""

    def propose(self, engine, rows, k):
        B = len(engine.owner)
        valid = np.zeros((B, k), bool)
        valid[rows] = True
        return mx.zeros((B, k), mx.int32), mx.array(valid), None


def median_ms(fn, repeats: int = 10) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def costs(model: Model, batch: int, prompt_tokens: int, k: int, repeats: int) -> dict:
    prompts = bench.random_prompts(model.config.vocab_size, batch, prompt_tokens)
    out = {"batch": batch, "k": k}
    # Admission of B prompts, evaluated (nothing is decoding, so `admit` waits for the device).
    for attempt in ("warm", "timed"):
        engine = Engine(model, batch, draft=Zero(), num_draft_tokens=k, policy=speculative.Always())
        for p in prompts:
            engine.add(p, max_tokens=96, ignore_eos=True)  # a small pool: no copy is large
        mx.synchronize()
        t0 = time.perf_counter()
        engine.admit()
        total = time.perf_counter() - t0
    out["admit_ms"], out["prefill_tok_s"] = total * 1e3, batch * prompt_tokens / total
    engine.collect()
    steps = engine.steps(engine.config, engine._prepare_step()[0])
    state, settings, params = engine.state._replace(counts=None), engine._settings, engine.params

    def decode():
        o, s = steps.decode(params, state, settings)
        mx.eval(o, s)

    def forward(T):
        tokens = mx.zeros((len(engine.owner), T), mx.int32)
        positions = state.positions[:, None] + mx.arange(T)[None]

        def run():
            h, c = llama.hidden(engine.config, params, tokens, positions, None, state.cache, wraps=False, fast=True,
                                check=False)
            mx.eval(llama.logits(params, h, fast=True), c)
        return run

    drafts = mx.zeros((len(engine.owner), k), mx.int32)
    valid = mx.ones((len(engine.owner), k), mx.bool_)

    def verify():
        o, s = steps.verify(params, state, drafts, valid, None, settings)
        mx.eval(o, s)

    out["decode_ms"] = median_ms(decode, repeats)
    out["forward_1_ms"] = median_ms(forward(1), repeats)
    out[f"forward_{k + 1}_ms"] = median_ms(forward(k + 1), repeats)
    out["verify_ms"] = median_ms(verify, repeats)

    def round_():
        engine.verify()

    out["round_ms"] = median_ms(round_, repeats)

    def pipelined(n: int = 20) -> float:
        """Decode steps queued one after another, each on the last one's state (written in place)."""
        s = state
        mx.eval(steps.decode(params, s, settings))
        t = time.perf_counter()
        for _ in range(n):
            o, s = steps.decode(params, s, settings)
            mx.async_eval(o, s)
        mx.eval(o, s)
        return (time.perf_counter() - t) / n * 1e3

    out["decode_pipelined_ms"] = min(pipelined() for _ in range(3))
    from mlxfun.profile import matmul_time
    out["matmuls_1_ms"] = matmul_time(model, params, batch) * 1e3
    out[f"matmuls_{k + 1}_ms"] = matmul_time(model, params, batch * (k + 1)) * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    model = bench.random_model(config)
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        r = costs(model, B, args.prompt_tokens, args.k, args.repeats)
        rows.append(r)
        print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in r.items()}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
