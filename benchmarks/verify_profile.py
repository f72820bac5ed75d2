"""Where a verify round's wall time goes on the host (diagnostic): plain decoding, then the oracle
drafter with device drafts (pipelined rounds) and host drafts (synchronous rounds), each engine
method timed per call. Prints ms per round for each.

Run:  python benchmarks/verify_profile.py --shape 8B --tokens 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from mlxfun import bench, speculative
from mlxfun import bench_speculative as bs
from mlxfun.engine import Engine

PHASES = ("admit", "decode", "verify_ahead", "verify", "collect", "_fit_cache", "_sync", "_take_verified", "_take")


def timed(engine: Engine, totals: dict) -> None:
    """Wrap the engine's phases, and a device drafter's `draft` (on the instances), to add their
    wall time to `totals`."""
    targets = [(engine, name) for name in PHASES]
    if engine.drafter is not None and engine.drafter.device:
        targets.append((engine.drafter, "draft"))
    for obj, name in targets:
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_name][0] += 1
                totals[_name][1] += time.perf_counter() - t0
        setattr(obj, name, wrapper)


def run(model, prompts, tokens, draft=None, k=4) -> dict:
    engine = Engine(model, len(prompts), draft=draft, num_draft_tokens=k, policy=speculative.Always())
    totals: dict = defaultdict(lambda: [0, 0.0])
    timed(engine, totals)
    for p in prompts:
        engine.add(p, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in engine.events():
        pass
    wall = time.perf_counter() - t0
    rounds = engine.stats.steps
    return {"wall_s": wall, "rounds": rounds, "ms_per_round": 1e3 * wall / rounds,
            "tokens_per_s": engine.stats.generation_tokens / wall,
            "phases_ms_per_round": {n: round(1e3 * t / rounds, 3) for n, (c, t) in totals.items()},
            "calls": {n: c for n, (c, t) in totals.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8B")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--alpha", type=float, default=0.7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    model = bs.predictable(bench.random_model(config, mx.bfloat16))
    prompts = bench.random_prompts(config.vocab_size, args.batch, 128)
    out = {}
    cont: dict = {}
    bs._run(model, prompts, args.tokens)  # warm: every table width this length reaches
    bs._run(model, prompts, args.tokens, ids_out=cont)
    dummy = {i: [0] * (args.tokens + 8) for i in range(len(prompts))}
    for kind in (bs.DeviceOracle, bs.Oracle):
        bs._run(model, prompts, args.tokens, draft=kind(dummy, 1.0, 2), policy=speculative.Always())
    for name, draft in (("plain", None), ("oracle-device", bs.DeviceOracle(cont, args.alpha, config.vocab_size)),
                        ("oracle-host", bs.Oracle(cont, args.alpha, config.vocab_size))):
        out[name] = run(model, prompts, args.tokens, draft)
        r = out[name]
        phases = sorted(r["phases_ms_per_round"].items(), key=lambda x: -x[1])
        print(f"{name:14s} {r['tokens_per_s']:8.1f} tok/s, {r['ms_per_round']:6.2f} ms/round ({r['rounds']} rounds): "
              + ", ".join(f"{n} {v:.2f}" for n, v in phases), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
