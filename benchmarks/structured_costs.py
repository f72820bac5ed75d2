"""Where a constrained decode step's time goes, against a free one: host phases and device parts.

B rows of a random-weight shape with a real tokenizer (a Hugging Face folder), every row with
`bench_structured`'s JSON schema (sampled at temperature 0.7, seeded) or none:
- device parts, synchronous (evaluated per call, median): the fused decode step, the split step's
  forward half and sampling half, and each call's host launch alone (queued, not waited for);
- the engine run whole, ms per step, and per step the host time spent in each engine phase
  (wrapped methods; time in a phase includes its waits for the device), with the engine thread's
  wait for the masks (`wait`) and the worker's llguidance fill (`fill_masks`); for those and the
  worker's whole turn, the median and 90th percentile of one call (`call_ms`), where a slow
  grammar step shows.

Run: python benchmarks/structured_costs.py --shape 1B --tokenizer .tok --batch 32 [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from step_costs import median_ms  # benchmarks/ is on the path: these scripts run from there

from mlxfun import bench, bench_structured, sampling, structured
from mlxfun import engine as engine_mod
from mlxfun import tokenizer as tok
from mlxfun.engine import Engine
from mlxfun.load import Model

PHASES = ("admit", "_prepare_step", "decode", "collect", "masked_decode", "_read_and_mask", "_match", "_take",
          "_fit_cache")  # _read_and_mask runs on the mask worker, beside masked_decode


def device_parts(engine: Engine) -> dict:
    """The steps of a decoding engine timed synchronously, and their launches alone."""
    mode, state = engine._prepare_step()
    steps = engine.steps(engine.config, mode)
    params, settings = engine.params, engine._settings
    masks = mx.array(np.full((len(engine.owner), structured.words(engine.config.vocab_size)), 0xFFFFFFFF, np.uint32))
    logits, _ = steps.forward(params, state)
    mx.eval(logits)
    out = {}
    out["decode_ms"] = median_ms(lambda: mx.eval(steps.decode(params, state, settings)))
    out["forward_ms"] = median_ms(lambda: mx.eval(steps.forward(params, state)))
    out["sample_ms"] = median_ms(lambda: mx.eval(steps.sample(logits, masks, state, settings)))
    for name, call in (("decode", lambda: steps.decode(params, state, settings)),
                       ("forward", lambda: steps.forward(params, state)),
                       ("sample", lambda: steps.sample(logits, masks, state, settings))):
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            r = call()
            mx.async_eval(r)
            ts.append(time.perf_counter() - t)
            mx.eval(r)
        out[f"{name}_launch_ms"] = statistics.median(ts) * 1e3
    return out


class _TimedJob:
    """A mask worker's future whose `result` (the engine thread's wait) is timed."""

    def __init__(self, job, times, calls):
        self._job, self._times, self._calls = job, times, calls

    def result(self):
        t = time.perf_counter()
        try:
            return self._job.result()
        finally:
            dt = time.perf_counter() - t
            self._times["wait"] += dt
            self._calls["wait"].append(dt)


class _TimedPool:
    def __init__(self, pool, times, calls):
        self._pool, self._times, self._calls = pool, times, calls

    def submit(self, *a):
        return _TimedJob(self._pool.submit(*a), self._times, self._calls)


def run(model: Model, batch: int, gen_tokens: int, constrained: bool, prompt: list[int]) -> dict:
    engine = Engine(model, batch)
    add_rows(engine, batch, gen_tokens, constrained, prompt)
    times: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, list[float]] = collections.defaultdict(list)
    saved = {}
    for name in PHASES:
        f = getattr(Engine, name)
        saved[name] = f

        def timed(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                dt = time.perf_counter() - t
                times[_n] += dt
                calls[_n].append(dt)
        setattr(Engine, name, timed)
    pool = Engine._mask_pool
    Engine._mask_pool = lambda self: _TimedPool(pool(self), times, calls)
    fill = structured.fill_masks

    def timed_fill(*a):
        t = time.perf_counter()
        try:
            return fill(*a)
        finally:
            dt = time.perf_counter() - t
            times["fill_masks"] += dt
            calls["fill_masks"].append(dt)
    structured.fill_masks = timed_fill
    values = engine_mod.host_values

    def read(out):
        t = time.perf_counter()
        try:
            return values(out)
        finally:
            times["host_values"] += time.perf_counter() - t
    engine_mod.host_values = read
    try:
        t0 = time.perf_counter()
        first = None
        for _ in engine.events():
            if first is None and engine.stats.steps > 1:
                first = (time.perf_counter(), engine.stats.steps, dict(times))
        total = time.perf_counter() - t0
    finally:
        for name, f in saved.items():
            setattr(Engine, name, f)
        Engine._mask_pool = pool
        structured.fill_masks = fill
        engine_mod.host_values = values
    t1, s1, before = first
    steps = engine.stats.steps - s1  # after admission: decoding steps only
    phases = {k: (v - before.get(k, 0.0)) * 1e3 / steps for k, v in times.items()}
    spread = {f"{k}_p50_p90": [round(float(np.percentile(v, q)) * 1e3, 3) for q in (50, 90)]
              for k, v in calls.items() if k in ("wait", "fill_masks", "_read_and_mask", "masked_decode", "decode")}
    return {"constrained": constrained, "total_s": total, "steps": engine.stats.steps,
            "tokens": engine.stats.generation_tokens, "step_ms": (time.perf_counter() - t1) * 1e3 / steps,
            "phase_ms_per_step": phases, "call_ms": spread}


def random_model(shape: str, tokenizer: Path, layers: int | None = None) -> tuple[Model, list[int]]:
    """A random-weight `shape` with a real tokenizer (a Hugging Face folder; `layers`: fewer, for
    CPU smoke runs), bf16 on a GPU; and the prompt the constrained runs answer."""
    tokenizer = tok.from_folder(tokenizer, {})
    config = dataclasses.replace(bench.SHAPES[shape], vocab_size=tokenizer.vocab_size)
    if layers:
        config = dataclasses.replace(config, num_layers=layers, layer_windows=None)
    dtype = mx.bfloat16 if bench.on_gpu() else mx.float32
    model = Model(config, bench.random_params(config, dtype), tokenizer, f"random {shape}")
    ask = "Describe a person as a JSON object with name, age, email, role, tags, score, address."
    return model, tokenizer.encode(ask)


def add_rows(engine: Engine, batch: int, gen_tokens: int, constrained: bool, prompt: list[int]) -> None:
    """`batch` requests of `prompt`, sampled (seeded per row), each with the JSON schema or none."""
    for i in range(batch):
        engine.add(prompt, max_tokens=gen_tokens, ignore_eos=True,
                   response_format=bench_structured.FORMAT if constrained else None,
                   settings=sampling.make_settings(1, temperature=0.7, seed=i))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder (byte-level BPE)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (CPU smoke runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, prompt = random_model(args.shape, Path(args.tokenizer), args.layers)
    rows = []
    for constrained in (False, True, False, True):  # the first of each compiles
        rows.append(run(model, args.batch, args.gen_tokens, constrained, prompt))
        r = rows[-1]
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else
                              {a: round(b, 3) if isinstance(b, float) else b for a, b in v.items()}
                              if isinstance(v, dict) else v) for k, v in r.items()}), flush=True)
    engine = Engine(model, args.batch)
    for _ in range(args.batch):
        engine.add(prompt, max_tokens=96, ignore_eos=True)  # a small pool: the held state's copy is small
    engine.admit()
    parts = device_parts(engine)
    print(json.dumps({k: round(v, 3) for k, v in parts.items()}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "batch": args.batch,
                                               "runs": rows[2:], "device": parts}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
