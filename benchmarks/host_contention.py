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
from serve_load import make_prompts  # a sibling script: the same prompts as a load run

import mlxfun
from mlxfun.bench.models import SHAPES, machine, random_params, word_tokenizer
from mlxfun.model.load import Model


def spin(cores: list[int] | None) -> None:
    """JSON in and out without pause, on `cores` if given."""
    if cores:
        os.sched_setaffinity(0, cores)
    doc = {"id": "cmpl-1", "choices": [{"index": 0, "text": " word" * 8, "logprobs": None}], "model": "m" * 20}
    while True:
        json.loads(json.dumps(doc))


def offline(model, prompts: list[str], rows: int, gen: int) -> dict:
    mlxfun.generate(model, prompts[:rows], max_tokens=4, batch_size=rows)  # warm
    t = time.perf_counter()
    out = mlxfun.generate(model, prompts, max_tokens=gen, batch_size=rows, ignore_eos=True)
    seconds = time.perf_counter() - t
    tokens = sum(len(ids) for ids in out.token_ids)
    return dict(tok_s=tokens / seconds, ms_per_step=1e3 * seconds / max(out.stats.steps, 1), steps=out.stats.steps)


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
    config = SHAPES[args.shape]
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model = Model(config, random_params(config, dtype), word_tokenizer(config.vocab_size), f"random {args.shape}")
    mx.eval(model.params)
    prompts = make_prompts(model, args.prompts, 128)
    cores = sorted(os.sched_getaffinity(0))
    mine, others = cores[:2], cores[2:] or cores  # MLX's own threads (CUDA's event handler) beside the engine's
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
            r = dict(run=run, busy=len(procs), **offline(model, prompts, args.rows, args.gen_tokens))
        finally:
            os.sched_setaffinity(0, cores)
            for q in procs:
                q.terminate()
                q.join()
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "args": vars(args), "runs": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
