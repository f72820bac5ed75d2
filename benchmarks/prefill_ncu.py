"""One static-batch prefill of a random-weight shape, for Nsight Compute (CUDA only, diagnostic):
the GPU time of every kernel of B prompts of T tokens made into a cache, with their first token;
or (`--decode`) of one decode step after it; or (`--verify K`) of one verify step of K drafts
after it (this checkout only).

It runs the prefill once to warm up, then a marker kernel, then the prefill that is measured, so
`summarize` can keep the kernels after the marker. It runs this checkout's scheduler
(`Engine.admit`), or round 1's static batch (`generate.Batch.prefill`) when the mlxfun on the path
has no `Engine.admit` (PYTHONPATH=.old).

Run:  ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file new.csv \
          python benchmarks/prefill_ncu.py --batch 128
      python benchmarks/prefill_ncu.py --summarize new.csv [old.csv] --json out.json
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import defaultdict
from pathlib import Path

MARKER = "mlxfun_prefill_marker"
UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}  # -> microseconds


def run(shape: str, batch: int, tokens: int, decode: bool, verify: int = 0) -> None:
    import mlx.core as mx

    from mlxfun import bench
    from mlxfun import engine as eng
    from mlxfun.load import Model

    config = bench.SHAPES[shape]
    model = Model(config, bench.random_params(config, mx.bfloat16), bench.word_tokenizer(config.vocab_size), shape)
    prompts = bench.random_prompts(config.vocab_size, batch, tokens)
    print("mlxfun from", bench.__file__, flush=True)

    if hasattr(eng.Engine, "admit"):
        def prefill():
            engine = eng.Engine(model, batch, prefix_cache=False)
            for p in prompts:
                engine.add(p, max_tokens=8, ignore_eos=True)
            engine.admit()  # evaluates: nothing else is decoding
            if verify:
                from mlxfun.step import Mode

                for r in range(batch):
                    engine.pages.ensure(r, engine.pos[r], engine.pos[r] + verify + 1)
                engine._sync()
                drafts, valid = mx.zeros((batch, verify), mx.int32), mx.ones((batch, verify), mx.bool_)
                fn = engine.steps(engine.config, Mode()).verify
                args = (engine.params, engine.state._replace(counts=None), drafts, valid, None, engine._settings)
                return lambda: mx.eval(fn(*args))
            step, args = engine.next_decode()
            return lambda: mx.eval(step(*args))
    else:
        import importlib
        gen = importlib.import_module("mlxfun.generate")  # the package's `generate` is the function

        def prefill():
            b = gen.Batch(model, prompts, gen.make_config(batch, max_tokens=8))
            out, state = b.prefill()
            mx.eval(out, state)
            state = b._grow(state, b.end)
            return lambda: mx.eval(b.steps.decode(b.model.params, state, b.gen.settings))

    step = prefill()
    if decode or verify:
        for _ in range(3):
            step()  # traced, warm
    mx.synchronize()
    marker = mx.fast.cuda_kernel(name=MARKER, input_names=["x"], output_names=["y"],
                                 source="y[threadIdx.x] = x[threadIdx.x];")
    x = mx.zeros((32,), mx.float32)
    mx.eval(marker(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                   output_dtypes=[mx.float32])[0])
    mx.synchronize()
    step() if decode or verify else prefill()
    mx.synchronize()


def kernels_after_marker(path: str) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds) of the launches after the marker, from ncu's CSV log."""
    text = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith('"ID"'))
    out, seen = [], False
    for row in csv.DictReader(text[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        if MARKER in name:
            seen, out = True, []
            continue
        if seen:
            scale = UNITS[row["Metric Unit"]]
            out.append((name, float(row["Metric Value"].replace(",", "")) * scale))
    return out


def family(name: str) -> str:
    """A kernel's name without template arguments and launch shapes: what kind of work it is."""
    name = re.sub(r"<.*", "", name.split("(")[0]).strip()
    return name[:80]


def summarize(paths: list[str]) -> dict:
    result = {}
    for path in paths:
        launches = kernels_after_marker(path)
        by = defaultdict(lambda: [0, 0.0])
        for name, us in launches:
            by[family(name)][0] += 1
            by[family(name)][1] += us
        result[path] = {"kernels": len(launches), "total_ms": sum(us for _, us in launches) / 1e3,
                        "families": sorted(([k, n, round(us / 1e3, 3)] for k, (n, us) in by.items()),
                                           key=lambda r: -r[2]),
                        "launches": [[name[:120], round(us, 2)] for name, us in launches]}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode", action="store_true", help="one decode step after the prefill instead")
    p.add_argument("--verify", type=int, default=0,
                   help="one verify step of this many drafts after the prefill instead")
    p.add_argument("--summarize", nargs="+", default=None, help="ncu CSV logs to summarize instead of running")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.summarize is None:
        run(args.shape, args.batch, args.prompt_tokens, args.decode, args.verify)
        return 0
    result = summarize(args.summarize)
    if args.json:  # first: a reader that stops early (`| head`) ends the printing below
        Path(args.json).write_text(json.dumps(result, indent=2))
    for path, r in result.items():
        print(f"{path}: {r['kernels']} kernels, {r['total_ms']:.2f} ms")
        for name, n, ms in r["families"][:25]:
            print(f"  {ms:9.3f} ms {n:5d}x  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
