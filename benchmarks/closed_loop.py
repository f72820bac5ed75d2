"""A server's engine under a closed loop, without HTTP: where served throughput goes.

`rows` requests run at once; each one that finishes is replaced by a new one at once (as
`serve_load.py`'s clients do), with generation lengths spread so that rows finish at different
steps and admissions come a few requests at a time. The engine is the server's (fixed shapes,
warmed up first). Each engine round is timed and reported by kind: rounds that admitted, the round
after them, and the rest. Each `--runs` entry is KV_GB:SETTLE[:prewarm]: a KV pool of KV_GB (0:
the server's default, most of a GPU), when a pool write waits for the one queued before it
(`Runner.settle`): `default` (a server's pool from 1 GB on, and always on the CPU), `never` (every
write queued behind the one in flight) or `always`; and with `prewarm`, 1..rows prompts admitted
once each before the loop (is a stall the first sight of a prefill shape?).

Run: python benchmarks/closed_loop.py --shape 1B --rows 32 --runs 0:default,0:default:prewarm,0.5:default
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from mlxfun.bench import models as bench
from mlxfun.engine.core import Engine
from mlxfun.engine.options import GenerationConfig, requests
from mlxfun.engine.warmup import warm_up


def closed_loop(model, rows: int, total: int, prompt: int, gen: int, kv_memory: int | None, settle: str,
                prewarm: bool = False, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    engine = Engine(model, rows, fixed_shapes=True, kv_memory=kv_memory)
    if settle != "default":
        engine.runner.settle_bytes = None if settle == "never" else 0
    warm = warm_up(engine)
    setup = time.perf_counter() - t

    def submit() -> None:
        ids = rng.integers(1, model.config.vocab_size, prompt).tolist()
        config = GenerationConfig(max_tokens=int(rng.integers(gen // 2, 3 * gen // 2)), ignore_eos=True)
        engine.submit(requests(model, [ids], config)[0])

    if prewarm:  # every admission of 1..rows prompts of this length once: each prefill shape seen
        for g in range(1, rows + 1):
            for _ in range(g):
                ids = rng.integers(1, model.config.vocab_size, prompt).tolist()
                engine.submit(requests(model, [ids], GenerationConfig(max_tokens=1, ignore_eos=True))[0])
            while not engine.idle:
                for e in engine.step():
                    if e.finish_reason is not None:
                        engine.take(e.index)
        mx.synchronize()
    for _ in range(rows):
        submit()
    sent, done, tokens, rounds = rows, 0, 0, []
    t0 = time.perf_counter()
    while done < total:
        admissions = engine.stats.admissions
        t = time.perf_counter()
        events = engine.step()
        rounds.append((time.perf_counter() - t, engine.stats.admissions > admissions))
        for e in events:
            tokens += e.token >= 0
            if e.finish_reason is not None:
                engine.take(e.index)
                done += 1
                if sent < total:
                    submit()
                    sent += 1
    seconds = time.perf_counter() - t0
    admit = [r for r, a in rounds if a]
    after = [rounds[i + 1][0] for i, (_, a) in enumerate(rounds[:-1]) if a]
    plain = [r for i, (r, a) in enumerate(rounds) if not a and not (i and rounds[i - 1][1])]
    ms = lambda xs: round(1e3 * float(np.median(xs)), 2) if xs else None  # noqa: E731
    out = dict(kv_gb=round(engine.kv_memory / 1e9, 2), pool_blocks=engine.scheduler.max_blocks, settle=settle,
               prewarm=prewarm,
               tok_s=tokens / seconds, seconds=seconds, rounds=len(rounds), admissions=len(admit),
               admit_ms=ms(admit), after_admit_ms=ms(after), plain_ms=ms(plain),
               stall_s=sum(admit) + sum(after) - (len(admit) + len(after)) * (ms(plain) or 0) / 1e3,
               slowest_ms=sorted((round(1e3 * r) for r, _ in rounds), reverse=True)[:8],
               setup_s=setup, warmup_s=warm.seconds if warm else None)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128, help="mean generated tokens (spread over 0.5-1.5x)")
    p.add_argument("--runs", default="0:default,0:default:prewarm,0.5:default",
                   help="KV_GB:SETTLE[:prewarm] per run, comma-separated (KV_GB 0: the server's default; "
                        "prewarm: admit 1..rows prompts once each before the loop, so that every prefill shape "
                        "of the loop has been seen)")
    p.add_argument("--cache-limit", type=float, default=None,
                   help="GB of freed buffers MLX keeps for reuse (mx.set_cache_limit; default: MLX's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    if args.cache_limit is not None:
        mx.set_cache_limit(int(args.cache_limit * 1e9))
    runs = []
    for run in args.runs.split(","):
        gb, settle, *extra = run.split(":")
        try:
            r = closed_loop(model, args.rows, args.requests, args.prompt_tokens, args.gen_tokens,
                            int(float(gb) * 1e9) or None, settle, prewarm=extra == ["prewarm"])
        except RuntimeError as e:  # a device out of memory, say: the other runs still count
            r = dict(kv=gb, settle=settle, error=f"{type(e).__name__}: {e}")
        runs.append(r)
        print(json.dumps(r), flush=True)
        mx.clear_cache()  # the last run's engine is gone: its pool goes back before the next is sized
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(mx.default_device()), "args": vars(args), "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
