"""Two mlxfun trees in ONE process, alternating (A B B A ...): a static batch per run, generated
tok/s, host time of the engine's decode call per step, and a fixed pure-Python calibration timed
just before each run. Process-level effects (CPU placement, frequency, threads, allocator state)
then hit both trees alike: a gap that stays is the code's; one that vanishes was the process's.

    python benchmarks/ab_inprocess.py --ours . --ref .ab/ref --shape 1B --rows 128 --rounds 3

(On the CPU, `--tiny` keeps 16 layers at toy widths: compute small, the graph of full depth.)
Each tree's modules are swapped into sys.modules before each of its runs, so imports made inside
functions resolve to the same tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time

import mlx.core as mx


def purge() -> None:
    for name in [m for m in sys.modules if m == "mlxfun" or m.startswith("mlxfun.")]:
        del sys.modules[name]


class Tree:
    def __init__(self, label: str, path: str, args):
        self.label, self.path = label, path
        purge()
        sys.path.insert(0, path)
        try:
            models = importlib.import_module("mlxfun.bench.models")
            self.Engine = importlib.import_module("mlxfun.engine.core").Engine
        except ImportError:  # commit 7fbc90b's flat package
            purge()
            models = importlib.import_module("mlxfun.bench")
            self.Engine = importlib.import_module("mlxfun.engine").Engine
        self.file = sys.modules["mlxfun"].__file__
        config = models.SHAPES[args.shape]
        if args.tiny:
            config = dataclasses.replace(config, vocab_size=512, hidden_size=64, intermediate_size=64, num_heads=1,
                                         num_kv_heads=1)
        if args.layers:
            config = dataclasses.replace(config, num_layers=args.layers, layer_windows=())
        self.vocab = config.vocab_size
        dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        self.model = models.random_model(config, dtype)
        self.modules = {k: v for k, v in sys.modules.items() if k == "mlxfun" or k.startswith("mlxfun.")}
        sys.path.remove(path)

    def activate(self) -> None:
        purge()
        sys.modules.update(self.modules)
        sys.path.insert(0, self.path)

    def deactivate(self) -> None:
        sys.path.remove(self.path)


def calibration(n: int = 300_000) -> float:
    """Seconds of a fixed pure-Python workload (dict, list, str, len), the host's speed now."""
    t0 = time.perf_counter()
    d, acc = {}, []
    for i in range(n):
        d[i & 1023] = len(str(i))
        acc.append(d.get(i & 511, 0))
    return time.perf_counter() - t0


def run(tree: Tree, rows: int, prompt: int, tokens: int) -> dict:
    engine = tree.Engine(tree.model, rows)
    for i in range(rows):
        engine.add([(i * 7 + j) % (tree.vocab - 1) + 1 for j in range(prompt)], max_tokens=tokens, ignore_eos=True)
    calls = []
    decode = engine.decode

    def timed():
        t0 = time.perf_counter()
        out = decode()
        calls.append(time.perf_counter() - t0)
        return out
    engine.decode = timed
    t0 = time.perf_counter()
    for _ in engine.events():
        pass
    return {"seconds": time.perf_counter() - t0, "tps": engine.stats.generation_tps,
            "decode_ms_median": 1e3 * statistics.median(calls), "decode_ms_sum": 1e3 * sum(calls), "steps": len(calls)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ours", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--shape", default="1B")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args()
    trees = {"ours": Tree("ours", args.ours, args), "ref": Tree("ref", args.ref, args)}
    for t in trees.values():
        print(t.label, t.file, flush=True)
    results = {k: [] for k in trees}
    order = []
    for r in range(args.rounds):
        order += ["ours", "ref"] if r % 2 == 0 else ["ref", "ours"]
    for label in ["ours", "ref"] + order:  # one warm-up run each (compile, kernels), then measured
        t = trees[label]
        t.activate()
        cal = calibration()
        res = run(t, args.rows, args.prompt_tokens, args.gen_tokens)
        t.deactivate()
        res["calibration_s"] = cal
        results[label].append(res)
        print(label, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
    summary = {}
    for label, rs in results.items():
        rs = rs[1:]  # the warm-up run dropped
        summary[label] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    summary["ratio_tps_ours_over_ref"] = summary["ours"]["tps"] / summary["ref"]["tps"]
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
