"""`mlxfun bench --tensor-parallel / --data-parallel` under `mlx.launch`: per-rank and aggregate tok/s.

Every rank builds the same weights (a random `--shape`, or `--model` read as its slices), runs
static batches of random prompts with EOS ignored, and reports its own engine's throughput; rank 0
prints the table and writes the JSON. The aggregate counts each distinct token once (tensor-parallel
ranks generate the same tokens) over the slowest rank's time. The same command without `mlx.launch`
gives the one-rank figures. `all-reduce ms/step` is the time of one decode step's all_sums alone
(2 per layer, of (B, E) in the activation dtype), chained in one evaluation.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from mlxfun.bench.models import DTYPES, QUANT, SHAPES, machine, random_params, random_prompts, word_tokenizer
from mlxfun.engine.options import GenerationConfig
from mlxfun.generate import stream_generate
from mlxfun.model import weights
from mlxfun.model.load import Model, load
from mlxfun.parallel import distributed
from mlxfun.parallel.shard import shard, sharded_load


@dataclass
class DistRow:
    weights: str
    batch: int
    ranks: int
    tensor: int  # ranks per tensor group
    rank_gen_tps: list[float]  # each rank's own engine: tokens it generated / its time
    gen_tps: float  # distinct tokens / the slowest rank's time
    prompt_tps: float
    allreduce_ms: float | None  # one decode step's all_sums alone


def build(args, name: str, tensor_group) -> Model:
    """The weights variant `name`, this rank's shard of it in a tensor group."""

    if args.shape is None:
        model = load(args.model, dtype=None if name in QUANT else name) if tensor_group is None else \
            sharded_load(args.model, tensor_group, dtype=None if name in QUANT else name)
        return model
    config = SHAPES[args.shape]
    params = random_params(config, DTYPES[args.base_dtype])  # the same seed on every rank
    if name in QUANT:
        params = weights.quantize(config, params, bits=QUANT[name], group_size=64)
    elif DTYPES[name] != DTYPES[args.base_dtype]:
        params = weights.cast(config, params, DTYPES[name])
    model = Model(config, params, word_tokenizer(config.vocab_size), f"random {args.shape}")
    return model if tensor_group is None else shard(model, tensor_group)


def allreduce_ms(model: Model, batch: int, repeats: int = 5) -> float | None:
    """ms of 2 * layers all_sums of (batch, E), as a decode step makes them."""
    group = model.config.tensor_group
    if group is None or group.size() == 1:
        return None
    x = mx.ones((batch, model.config.hidden_size), model.params.norm.dtype)

    def chain():
        y = x
        for _ in range(2 * model.config.num_layers):
            y = mx.distributed.all_sum(y, group=group) * 0.5
        return y

    mx.eval(chain())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(chain())
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def run(model: Model, prompts: list[list[int]], tokens: int, data_group, world):
    """One static batch -> (every rank's stats, the gathered result's stats)."""
    job = stream_generate(model, prompts, GenerationConfig(max_tokens=tokens, ignore_eos=True, group=data_group))
    for _ in job:
        pass
    mine = job.engine.stats
    return distributed.rank_stats(mine, world), job.result().stats


def main(args) -> int:

    world = mx.distributed.init()
    n = world.size()
    tensor = 1 if args.tensor_parallel is None else args.tensor_parallel or n
    tensor_group, data_group = distributed.groups(world, tensor if n > 1 else 1)
    lead = world.rank() == 0
    info = machine() | {"ranks": n, "tensor": tensor if n > 1 else 1}
    if lead:
        print(json.dumps(info), flush=True)
    rows = []
    for name in args.dtypes:
        model = build(args, name, tensor_group)
        mx.eval(model.params)
        for B in args.batch_sizes:
            prompts = random_prompts(model.config.vocab_size, B, args.prompt_tokens)
            run(model, prompts, args.warmup_tokens, data_group, world)  # compiles this batch's steps
            per_rank, total = run(model, prompts, args.gen_tokens, data_group, world)
            # `total` counts each distinct token once: a data group's gather sums one rank per tensor group.
            gen_time = max(s.generation_time for s in per_rank)
            prompt_time = max(s.prompt_time for s in per_rank)
            row = DistRow(name, B, n, info["tensor"], [round(s.generation_tps, 2) for s in per_rank],
                          total.generation_tokens / gen_time if gen_time else 0.0,
                          total.prompt_tokens / prompt_time if prompt_time else 0.0, allreduce_ms(model, B))
            rows.append(row)
            if lead:
                print(f"  {name:9s} batch {B:4d}: aggregate {row.gen_tps:9.1f} tok/s, per rank {row.rank_gen_tps}"
                      + (f", all-reduce {row.allreduce_ms:.2f} ms/step" if row.allreduce_ms else ""), flush=True)
        model = None
    if lead:
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args),
                                                   "rows": [asdict(r) for r in rows]}, indent=2, default=str))
            print(f"results written to {args.json}")
    return 0


def table(rows: list[DistRow]) -> str:
    head = (f"{'weights':10s} {'batch':>5s} {'ranks':>5s} {'tensor':>6s} {'gen tok/s':>10s} {'prompt tok/s':>12s} "
            f"{'all-reduce ms/step':>18s}  per-rank gen tok/s")
    lines = [head, "-" * len(head)]
    for r in rows:
        ar = f"{r.allreduce_ms:18.2f}" if r.allreduce_ms is not None else f"{'-':>18s}"
        lines.append(f"{r.weights:10s} {r.batch:5d} {r.ranks:5d} {r.tensor:6d} {r.gen_tps:10.1f} {r.prompt_tps:12.1f} "
                     f"{ar}  {r.rank_gen_tps}")
    return "\n".join(lines)
