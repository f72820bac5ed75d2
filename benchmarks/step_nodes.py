"""One decode step, this code's engine against round 1's static batch (diagnostic, issue 14): the
nodes of each compiled step's graph by primitive, and the host's time to call it and launch it
(`mx.async_eval`) beside the whole step (the call, the launch and the wait), medians over repeats.
At batch 1 a 1B step is host-bound on an H200, so the host's share is what the two differ in.

Run: python benchmarks/step_nodes.py --shape 1B --old .old --batch 1 [--repeats 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from rounds_ab import (  # benchmarks/ is on the path: these scripts run from there
    import_round1,
    round1_model,
    round1_module,
)

from mlxfun import bench
from mlxfun.engine import Engine


def node_counts(outputs, path: str) -> collections.Counter:
    arrays = [a for _, a in tree_flatten(outputs, is_leaf=lambda x: x is None) if isinstance(a, mx.array)]
    mx.export_to_dot(path, *arrays)
    return collections.Counter(re.findall(r'label ="?([A-Za-z_]+)', Path(path).read_text()))


def timed(fn, args, repeats: int) -> dict:
    host, whole = [], []
    for _ in range(repeats + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn(*args)
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        whole.append((t2 - t0) * 1e3)
    return {"host_ms": statistics.median(host[3:]), "step_ms": statistics.median(whole[3:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--old", type=Path, default=Path(".old"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    old_code = import_round1(args.old)
    gen1 = round1_module("generate")
    new = bench.random_model(bench.SHAPES[args.shape])
    old = round1_model(old_code, new)
    prompts = bench.random_prompts(new.config.vocab_size, args.batch, 128)

    engine = Engine(new, args.batch)
    for q in prompts:
        engine.add(q, max_tokens=128, ignore_eos=True)
    engine.admit()
    mx.eval(engine.state)
    fn, ours = engine.next_decode()

    batch = gen1.Batch(old, prompts, gen1.make_config(args.batch, max_tokens=128, ignore_eos=True))
    _, state = batch.prefill()
    mx.eval(state)
    # The prompts fill round 1's cache exactly, so its first step grows it: evaluated here, or its
    # pads and rolls would count as the step's nodes (its loop grows the cache once per 256 slots).
    state = batch._grow(state, batch.end)
    mx.eval(state)
    theirs = (batch.model.params, state, batch.gen.settings)

    found = {}
    for name, (step, step_args) in {"round 1": (batch.steps.decode, theirs), "this code": (fn, ours)}.items():
        counts = node_counts(step(*step_args), f"/tmp/step-nodes-{name.replace(' ', '-')}.dot")
        found[name] = {"nodes": sum(counts.values()), "by_primitive": dict(counts.most_common())}
    for rep in range(2):  # alternating, twice
        for name, (step, step_args) in {"round 1": (batch.steps.decode, theirs), "this code": (fn, ours)}.items():
            found[name].setdefault("times", []).append(timed(step, step_args, args.repeats))
    for name, f in found.items():
        t = f["times"]
        print(f"{name:10s} {f['nodes']:5d} nodes; host {[round(x['host_ms'], 3) for x in t]} ms, "
              f"step {[round(x['step_ms'], 3) for x in t]} ms")
    a, b = (collections.Counter(found[n]["by_primitive"]) for n in ("round 1", "this code"))
    print("nodes only this code has more of:", dict((b - a).most_common()))
    print("nodes only round 1 has more of:", dict((a - b).most_common()))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)},
                                               "steps": found}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
