"""Does other work on the host slow a launch-bound engine? Offline `generate` (the same load as
`serve_load.py --offline`: N prompts of 128 random words, 128 tokens each, `--rows` at once)
timed alone, beside `--busy` processes that parse and write JSON without pause (as a server's HTTP
process and its clients do), and beside them with this process pinned to two cores they keep off
(`os.sched_setaffinity`). Runs alternate; each is reported with its ms per decode step.

A 1B decode step on an H100 is bound by the host launching it (MLX encoding its graph), so a
server's steps could run slower than offline ones only because the host is shared.

Run: python benchmarks/host_contention.py --shape 1B --rows 32 --busy 6 --runs alone,busy,pinned,alone,busy,pinned
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import mlx.core as mx
from serve_load import make_prompts, offline_run  # a sibling script: a load run's prompts and offline run

from mlxfun.bench.models import SHAPES, machine, random_model


def spin(cores: list[int] | None) -> None:
    """JSON in and out without pause, on `cores` if given."""
    if cores:
        os.sched_setaffinity(0, cores)
    doc = {"id": "cmpl-1", "choices": [{"index": 0, "text": " word" * 8, "logprobs": None}], "model": "m" * 20}
    while True:
        json.loads(json.dumps(doc))


def physical_cores(cores: list[int], n: int) -> list[int]:
    """The logical CPUs of the first `n` physical cores among `cores` (a core's hyperthreads share
    its execution units: the other processes must keep off both)."""
    picked: list[int] = []
    for c in cores:
        if c in picked:
            continue
        try:
            text = open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip()
            siblings = [int(x) for part in text.split(",") for x in _span(part)]
        except OSError:
            siblings = [c]
        picked += [s for s in siblings if s in cores]
        n -= 1
        if not n:
            break
    return picked


def _span(part: str) -> range:
    a, _, b = part.partition("-")
    return range(int(a), int(b or a) + 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1B")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--busy", type=int, default=6, help="JSON-busy processes beside the engine")
    p.add_argument("--runs", default="alone,busy,pinned,alone,busy,pinned")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = random_model(SHAPES[args.shape])
    mx.eval(model.params)
    prompts = make_prompts(model, 2 * args.prompts, 128)  # the second half warms up (`offline_run`)
    load = argparse.Namespace(rows=args.rows, requests=args.prompts, gen_tokens=args.gen_tokens)
    cores = sorted(os.sched_getaffinity(0))
    mine = physical_cores(cores, 2)  # MLX's own threads (CUDA's event handler) beside the engine's
    others = [c for c in cores if c not in mine] or cores
    ctx = multiprocessing.get_context("spawn")
    results = []
    for run in args.runs.split(","):
        procs = []
        if run in ("busy", "pinned"):
            procs = [ctx.Process(target=spin, args=(others if run == "pinned" else None,), daemon=True)
                     for _ in range(args.busy)]
            for q in procs:
                q.start()
            time.sleep(1.0)
        os.sched_setaffinity(0, mine if run == "pinned" else cores)
        try:
            r = dict(run=run, busy=len(procs), **offline_run(model, prompts, args.rows, load, "greedy"))
        finally:
            os.sched_setaffinity(0, cores)
            for q in procs:
                q.terminate()
                q.join()
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "args": vars(args), "engine_cores": mine, "runs": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
