"""Where a verify round's wall time goes (diagnostic, GPU). First rounds read nothing on the host
(`device_loop`): plain decode steps, oracle verify rounds with device drafts and, with
`--draft-shape`, a random draft model's rounds, each queued back to back (the device's time where
it is the slower) and one at a time on an idle device (the host's launch cost alone); `--dmv-ab`
runs them with mlxfun's few-row product off, on, off, on. Then whole engine runs, each engine
method timed per call: plain decoding, the oracle with device drafts (pipelined rounds) and with
host drafts (synchronous rounds). Prints ms per round for each.

Run:  python benchmarks/verify_profile.py --shape 8B --tokens 128 [--loops-only --dmv-ab --draft-shape 1B]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from mlxfun import bench, dmv, speculative, step
from mlxfun import bench_speculative as bs
from mlxfun.engine import Engine

PHASES = ("admit", "decode", "verify_ahead", "verify", "collect", "_fit_cache", "_sync", "_take_verified", "_take")


def timed(engine: Engine, totals: dict) -> None:
    """Wrap the engine's phases, and a device drafter's `draft` (on the instances), to add their
    wall time to `totals`. Handing out a step's tokens first waits for the device: that wait is
    its own phase ("wait"), so "_take" and "_take_verified" are host work alone."""
    for name in ("_take", "_take_verified"):
        fn = getattr(engine, name)

        def waited(out, *a, _fn=fn, **k):
            t0 = time.perf_counter()
            mx.eval(out)
            totals["wait"][0] += 1
            totals["wait"][1] += time.perf_counter() - t0
            return _fn(out, *a, **k)
        setattr(engine, name, waited)
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


def device_loop(model, prompts, rounds: int, draft=None, k: int = 4) -> dict:
    """Verify rounds with a device drafter, else decode steps, read nothing on the host: half of
    `rounds` queued back to back (ms per round to queue them, and until the last is done: the
    device's time where it is the slower), then one at a time on an idle device (ms to queue
    each: the host's launch cost alone)."""
    rounds = max(rounds, 2)
    engine = Engine(model, len(prompts), draft=draft, num_draft_tokens=k, policy=speculative.Always())
    for p in prompts:
        engine.add(p, max_tokens=rounds * (k + 1) + 8, ignore_eos=True)
    engine.admit()
    engine.collect()
    live = [r for r, o in enumerate(engine.owner) if o is not None]
    for r in live:
        engine.pages.ensure(r, engine.pos[r], engine.pos[r] + rounds * (k + 1) + 2)
    engine._sync()
    mx.eval(engine.state)
    t0 = time.perf_counter()
    alone = 0.0  # one round queued on an idle device, then waited for: the host's launch cost alone
    for i in range(rounds):
        t1 = time.perf_counter()
        engine.verify_ahead() if draft is not None else engine.decode()
        if i >= rounds // 2:
            alone += time.perf_counter() - t1
            mx.eval([o for o, _ in engine._inflight], engine.state)
        if i == rounds // 2 - 1:
            queued = time.perf_counter() - t0
            mx.eval([o for o, _ in engine._inflight], engine.state)
            done = time.perf_counter() - t0
    half = rounds // 2
    return {"rounds": half, "queue_ms_per_round": 1e3 * queued / half, "ms_per_round": 1e3 * done / half,
            "launch_ms_per_round": 1e3 * alone / (rounds - half)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8B")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--alpha", type=float, default=0.7)
    p.add_argument("--dmv-ab", action="store_true", help="the loops with mlxfun.dmv off, on, off, on")
    p.add_argument("--draft-shape", default=None, help="also loop rounds of a random draft model of this shape")
    p.add_argument("--loops-only", action="store_true", help="only the back-to-back and one-at-a-time rounds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = bench.SHAPES[args.shape]
    model = bs.predictable(bench.random_model(config, mx.bfloat16))
    prompts = bench.random_prompts(config.vocab_size, args.batch, 128)
    out: dict = {}
    cont: dict = {i: [0] * (args.tokens + 8) for i in range(len(prompts))}
    if not args.loops_only:  # warm: every table width this length reaches; the continuations
        bs._run(model, prompts, args.tokens)
        bs._run(model, prompts, args.tokens, ids_out=cont)
        for kind in (bs.DeviceOracle, bs.Oracle):
            bs._run(model, prompts, args.tokens, draft=kind(cont, 1.0, 2), policy=speculative.Always())
    loops = [("plain", lambda: None), ("oracle-device", lambda: bs.DeviceOracle(cont, args.alpha, config.vocab_size))]
    if args.draft_shape:
        drafter = bench.random_model(bench.SHAPES[args.draft_shape], mx.bfloat16)
        loops.append((f"draft-{args.draft_shape}", lambda: drafter))
    for dense in ((False, True, False, True) if args.dmv_ab else (dmv.ENABLED,)):
        dmv.ENABLED = dense  # read when a step is traced: fresh steps for each setting
        step.compiled_steps.cache_clear()
        for name, make in loops:
            for _ in range(2):  # the first traces at this table width
                r = device_loop(model, prompts, args.tokens // 5, make())
            key = f"loop-{name}" + (f"-dmv{int(dense)}" if args.dmv_ab else "")
            out.setdefault(key, []).append(r)
            print(f"loop {key:20s} queued {r['queue_ms_per_round']:6.2f} ms/round, done {r['ms_per_round']:6.2f} "
                  f"ms/round, launch alone {r['launch_ms_per_round']:6.2f} ms", flush=True)
    engines = (("plain", None), ("oracle-device", bs.DeviceOracle(cont, args.alpha, config.vocab_size)),
               ("oracle-host", bs.Oracle(cont, args.alpha, config.vocab_size)))
    for name, draft in engines[:0 if args.loops_only else 3]:
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
