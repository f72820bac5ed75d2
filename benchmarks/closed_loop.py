"""A server's engine under a closed loop, without HTTP: where served throughput goes.

`rows` requests run at once; each one that finishes is replaced by a new one at once (as
`serve_load.py`'s clients do), with generation lengths spread so that rows finish at different
steps and admissions come a few requests at a time. The engine is the server's (fixed shapes,
warmed up first). Each engine round is timed and reported by kind: rounds that admitted, the round
after them, and the rest. Each `--runs` entry is
KV_GB:SETTLE[:prewarm][:keep][:phases][:slices][:waitfirst][:waitN][:compiled][:mixedN]: a KV pool of KV_GB
(0: the server's default), when a pool write waits for the one queued before it (`Runner.settle`):
`default` (a server's pool from 1 GB on, and always on the CPU), `never` (every write queued behind
the one in flight) or `always`; and with `prewarm`, 1..rows prompts admitted once each before the
loop (is a stall the first sight of a prefill shape?); with `keep`, CUDA's
memory pool keeps the memory it frees (`alloc_probe.keep_freed`). Each of the slowest rounds is
reported with the memory it queued, CUDA's pool's mapped memory and MLX's buffer cache then.
With `phases`, the engine's parts run one at a time (each after a device synchronization, timed to
another): where an admission's time goes, at the cost of the pipelining. With `waitN` (say
`wait0`), the engine's `admit_wait` is N rounds (default: the server's). With `compiled`, prefill
chunks of up to 2,048 tokens run compiled (as offline engines' do on a GPU; a server's do not, as
each new chunk shape would trace on the request path): with `prewarm`, the upside. With `slices`, a chunk
whose slots form one run is written by slice updates on any device (`prefill.slice_writes`); with
`waitfirst`, an admission beside a decode step waits for it before building its graph (`busy`). With
`mixedN`, prompts of up to N tokens in all ride along a decode step (`Engine(mixed_tokens=N)`; `mixed0`:
every admission a prefill of its own, as before; default: the server's).

Run: python benchmarks/closed_loop.py --shape 1B --rows 32 --runs 0:default,0:default:prewarm,0.5:default
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import mlx.core as mx
import numpy as np
from alloc_probe import keep_freed, stats  # a sibling script: the CUDA pool's own figures

from mlxfun.bench import models as bench
from mlxfun.engine import prefill
from mlxfun.engine.core import Engine
from mlxfun.engine.options import GenerationConfig, requests
from mlxfun.engine.step import PREFILL_COMPILED_TOKENS
from mlxfun.engine.warmup import warm_up

PHASES = (("runner", "settle"), ("runner", "prefill"), ("runner", "first_tokens"), ("runner", "decode"),
          ("engine", "sync"), ("engine", "collect"), ("engine", "_fit_cache"))


def time_phases(engine: Engine) -> dict[str, list[float]]:
    """Each of PHASES' methods run alone, after a synchronization, and synchronized after: its
    seconds per call, by name ("wait": the synchronizations before them)."""
    times: dict[str, list[float]] = {"wait": []}
    for owner, name in PHASES:
        obj = engine if owner == "engine" else engine.runner
        method, times[name] = getattr(obj, name), []

        def timed(*args, _method=method, _name=name, **kwargs):
            t = time.perf_counter()
            mx.synchronize()
            t1 = time.perf_counter()
            out = _method(*args, **kwargs)
            mx.synchronize()
            times["wait"].append(t1 - t)
            times[_name].append(time.perf_counter() - t1)
            return out
        setattr(obj, name, timed)
    return times


def closed_loop(model, rows: int, total: int, prompt: int, gen: int, kv_memory: int | None, settle: str,
                prewarm: bool = False, keep: bool = False, phases: bool = False, warmup: bool = True,
                seed: int = 0, admit_wait: int | None = None, compiled: bool = False,
                mixed: int | None = None) -> dict:
    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    engine = Engine(model, rows, fixed_shapes=True, kv_memory=kv_memory, admit_wait=admit_wait, mixed_tokens=mixed)
    if compiled:  # before any step is made: the engine's StepCache makes them with this bound
        engine.step_cache.compile_prefill = PREFILL_COMPILED_TOKENS
    if settle != "default":
        engine.runner.settle_bytes = None if settle == "never" else 0
    warm = warm_up(engine) if warmup else None
    setup = time.perf_counter() - t
    kept = keep and keep_freed(4 << 30)  # the CUDA pool keeps what it frees, 4 GB of it mapped ahead

    submitted: dict[int, float] = {}  # request id -> when it was submitted
    ttft: list[float] = []  # seconds from submission to its first token's event

    def submit() -> None:
        ids = rng.integers(1, model.config.vocab_size, prompt).tolist()
        config = GenerationConfig(max_tokens=int(rng.integers(gen // 2, 3 * gen // 2)), ignore_eos=True)
        submitted[engine.submit(requests(model, [ids], config)[0])] = time.perf_counter()

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
    submitted.clear()  # the first wave is admitted at once, as a fresh server's
    sent, done, tokens, rounds = rows, 0, 0, []
    times = time_phases(engine) if phases else None
    t0 = time.perf_counter()
    held = mx.get_active_memory()
    while done < total:
        admissions, prompted = engine.stats.admissions, engine.stats.prompt_tokens
        mx.reset_peak_memory()
        t = time.perf_counter()
        events = engine.step()
        # Peak memory queued by the round above the memory held before it: a round that copies the
        # pool (an extra reference to it) shows the copy here.
        pool = stats()  # what CUDA's pool has mapped, beside MLX's view: pressure shows here
        rounds.append((time.perf_counter() - t, engine.stats.admissions > admissions,
                       (mx.get_peak_memory() - held) / 1e9, pool.reserved / 1e9 if pool else 0.0,
                       mx.get_cache_memory() / 1e9, (engine.stats.prompt_tokens - prompted) // prompt))
        now = time.perf_counter()
        for e in events:
            tokens += e.token >= 0
            if e.token >= 0 and e.index in submitted:
                ttft.append(now - submitted.pop(e.index))
            if e.finish_reason is not None:
                engine.take(e.index)
                done += 1
                if sent < total:
                    submit()
                    sent += 1
    seconds = time.perf_counter() - t0
    admit = [r[0] for r in rounds if r[1]]
    after = [rounds[i + 1][0] for i, r in enumerate(rounds[:-1]) if r[1]]
    plain = [r[0] for i, r in enumerate(rounds) if not r[1] and not (i and rounds[i - 1][1])]
    slowest = sorted(range(len(rounds)), key=lambda i: -rounds[i][0])[:8]

    def kind(i: int) -> str:
        return "admit" if rounds[i][1] else "after" if i and rounds[i - 1][1] else "plain"

    ms = lambda xs: round(1e3 * float(np.median(xs)), 2) if xs else None  # noqa: E731
    out = dict(kv_gb=round(engine.kv_memory / 1e9, 2), pool_blocks=engine.scheduler.max_blocks, settle=settle,
               prewarm=prewarm, keep=keep, admit_wait=engine.scheduler.admit_wait, compiled=compiled,
               mixed_tokens=engine.mixed_tokens, carried=engine.stats.carried,
               # a replacement request's time to its first token, from its submission (ms)
               ttft_ms=[ms(ttft), round(1e3 * float(np.percentile(ttft, 99)), 2) if ttft else None],
               tok_s=tokens / seconds, seconds=seconds, rounds=len(rounds), admissions=len(admit),
               admit_ms=ms(admit), after_admit_ms=ms(after), plain_ms=ms(plain),
               stall_s=sum(admit) + sum(after) - (len(admit) + len(after)) * (ms(plain) or 0) / 1e3,
               slowest_ms=[round(1e3 * rounds[i][0]) for i in slowest],
               # each slow round: admitted?, GB queued above the held memory; and the most any round queued
               slowest_kind=[kind(i) for i in slowest],
               slowest_peak_gb=[round(rounds[i][2], 2) for i in slowest],
               slowest_reserved_gb=[round(rounds[i][3], 2) for i in slowest],
               slowest_cache_gb=[round(rounds[i][4], 2) for i in slowest],
               slowest_admitted=[rounds[i][5] for i in slowest],
               # median ms of the admitting rounds by the number of prompts they admitted: [count, ms]
               admit_ms_by_prompts={g: [sum(1 for r in rounds if r[5] == g), ms([r[0] for r in rounds if r[5] == g])]
                                    for g in sorted({r[5] for r in rounds if r[1]})},
               max_peak_gb=round(max(r[2] for r in rounds), 2), held_gb=round(held / 1e9, 2),
               reserved_gb=[round(min(r[3] for r in rounds), 2), round(max(r[3] for r in rounds), 2)],
               cache_gb=[round(min(r[4] for r in rounds), 2), round(max(r[4] for r in rounds), 2)], kept=kept,
               setup_s=setup, warmup_s=warm.seconds if warm else None)
    if times is not None:  # per phase: calls, median, total and largest ms
        out["phases"] = {k: [len(v), ms(v), round(1e3 * sum(v), 1), round(1e3 * max(v, default=0), 1)]
                         for k, v in times.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128, help="mean generated tokens (spread over 0.5-1.5x)")
    p.add_argument("--runs", default="0:default,0:default:prewarm,0.5:default",
                   help="KV_GB:SETTLE[:prewarm][:keep][:phases][:slices][:waitfirst][:waitN] per run, comma-separated "
                        "(KV_GB 0: the server's default; prewarm: admit 1..rows prompts once each before the loop, so "
                        "that every prefill shape of the loop has been seen; phases: the engine's parts timed one at "
                        "a time; slices: runs of slots written by slice updates on any device; waitfirst: admissions "
                        "wait for the step in flight before building their graphs; waitN: the engine's admit_wait, N "
                        "rounds; compiled: prefill chunks compiled, as offline engines' on a GPU; mixedN: prompts of "
                        "up to N tokens in all ride along a decode step, 0: never)")
    p.add_argument("--cache-limit", type=float, default=None,
                   help="GB of freed buffers MLX keeps for reuse (mx.set_cache_limit; default: MLX's)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the server's warm-up (each run's first rounds then compile what they meet)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    if args.cache_limit is not None:
        mx.set_cache_limit(int(args.cache_limit * 1e9))
    runs, slice_writes, prefill_rows = [], prefill.slice_writes, prefill.prefill_rows
    for run in args.runs.split(","):
        gb, settle, *extra = run.split(":")
        # slices: a run of slots written by slice updates on any device (their cost on CUDA grows with the pool)
        prefill.slice_writes = (lambda: True) if "slices" in extra else slice_writes
        # waitfirst: an admission beside a decode step waits for it before building its graph
        prefill.prefill_rows = (lambda *a, **k: prefill_rows(*a, **{**k, "busy": False})) if "waitfirst" in extra \
            else prefill_rows
        try:
            r = closed_loop(model, args.rows, args.requests, args.prompt_tokens, args.gen_tokens,
                            int(float(gb) * 1e9) or None, settle, prewarm="prewarm" in extra, keep="keep" in extra,
                            phases="phases" in extra, warmup=not args.no_warmup,
                            admit_wait=next((int(x[4:]) for x in extra if x[4:].isdigit() and x.startswith("wait")),
                                            None), compiled="compiled" in extra,
                            mixed=next((int(x[5:]) for x in extra if x.startswith("mixed") and x[5:].isdigit()), None))
        except RuntimeError as e:  # a device out of memory, say: the other runs still count
            r = dict(kv=gb, settle=settle, error=f"{type(e).__name__}: {e}", active_gb=mx.get_active_memory() / 1e9,
                     peak_gb=mx.get_peak_memory() / 1e9, cache_gb=mx.get_cache_memory() / 1e9)
        runs.append(r)
        print(json.dumps(r), flush=True)
        gc.collect()  # the engine's reference cycles, so that its pool is freed
        mx.clear_cache()  # the last run's engine is gone: its pool goes back before the next is sized
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(mx.default_device()), "args": vars(args), "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
