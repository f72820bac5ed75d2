"""Tensor parallel equals one device: greedy tokens and logprobs of the smoke prompts, float32.

Run under mlx.launch (NCCL on a GPU machine; see benchmarks/distributed_gpu.sh):
    mlx.launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 --env MLX_ENABLE_TF32=0 -- \
        python benchmarks/dist_smoke.py --json OUT.json
Every rank builds the smoke model of benchmarks/smoke.py; rank 0 also runs it whole, alone, first.
Then every rank runs its shard, and rank 0 compares. Exit status 1 on any difference of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # float32 products in float32 on CUDA (see smoke.py)

import mlx.core as mx
from smoke import CONFIG

import mlxfun
from mlxfun.bench import models as bench
from mlxfun.model.load import Model
from mlxfun.parallel.shard import shard

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 40, 17, 1, 33, 64))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    group = mx.distributed.init()
    model = Model(CONFIG, bench.random_params(CONFIG, mx.float32, seed=1), bench.word_tokenizer(CONFIG.vocab_size))
    options = dict(max_tokens=24, ignore_eos=True, logprobs=0)
    alone = mlxfun.generate(model, PROMPTS, **options) if group.rank() == 0 else None
    sharded = mlxfun.generate(shard(model, group), PROMPTS, **options)
    if group.rank() != 0:
        return 0
    same = [a == b for a, b in zip(alone.token_ids, sharded.token_ids)]
    gap = max(abs(x - y) for a, b in zip(alone.logprobs, sharded.logprobs) for x, y in zip(a, b))
    out = dict(device=str(mx.default_device()), ranks=group.size(), rows_equal=sum(same), rows=len(same),
               max_logprob_gap=gap, tf32=os.environ.get("MLX_ENABLE_TF32"))
    print(json.dumps(out))
    print("DIST SMOKE", "OK" if all(same) else "FAILED", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
