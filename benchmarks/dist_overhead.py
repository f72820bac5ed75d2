"""Where a tensor-parallel step's time goes on one machine: run under `mlx.launch -n 2 --backend ring`.

One-token forward passes (uncompiled, batch 1) of the 135M-tp shape, wall and CPU ms per pass, on
each rank: its shard with the all_sums, its shard without them (wrong results, the same compute),
and rank 0 with the whole model while rank 1 waits in a collective.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import mlx.core as mx

from mlxfun import bench, llama
from mlxfun.load import Model
from mlxfun.shard import shard

TOKENS, POSITIONS = mx.array([[5]]), mx.array([[3]])


def timed(config, params, n: int = 10) -> dict:
    mx.eval(llama.forward(config, params, TOKENS, POSITIONS)[0])
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        mx.eval(llama.forward(config, params, TOKENS, POSITIONS)[0])
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return {"wall_ms": round(wall / n * 1e3, 1), "cpu_ms": round(cpu / n * 1e3, 1)}


def main() -> None:
    group = mx.distributed.init()
    config = bench.SHAPES["135M-tp"]
    model = Model(config, bench.random_params(config, mx.float32), bench.word_tokenizer(config.vocab_size))
    sharded = shard(model, group)
    out = {"rank": group.rank(), "whole_model_peer_waiting": timed(model.config, model.params) if group.rank() == 0
           else None, "shard_all_sum": timed(sharded.config, sharded.params),
           "shard_no_all_sum": timed(dataclasses.replace(sharded.config, tensor_group=None), sharded.params)}
    print(json.dumps(out), flush=True)
    if len(sys.argv) > 1 and group.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
