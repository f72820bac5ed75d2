"""Generation across the ranks of an `mx.distributed` group, through MLX's collectives only.

Every rank runs the same program on the same prompts (SPMD, as `mlx.launch` starts it):
- data parallel (`GenerationConfig.group`): each rank generates a share of the prompts,
  balanced by prompt length and max_tokens (`share`), and `gather` hands every rank the whole
  result in prompt order;
- tensor parallel (`mlxfun.shard`): the ranks of the model's `tensor_group` run every prompt
  together, each on its slice of the layers. Their requests must agree to the seed (`agree`).
- both: `groups` splits a world of tensor x data ranks; each tensor group serves one share.

Host values (prompts, results) travel as bytes in uint8 arrays through `all_gather`, the one
collective every backend has (MLX's NCCL backend has no send/recv).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxfun.engine.events import Stats
from mlxfun.engine.kv_budget import kv_budget
from mlxfun.engine.options import Request
from mlxfun.engine.rows import GenerationResult
from mlxfun.engine.strategy import default_strategy
from mlxfun.errors import InputError


def groups(world, tensor: int):
    """(tensor group, data group) for a world of tensor x data ranks: ranks [k * tensor, (k + 1) *
    tensor) form tensor group k, and the ranks at the same place of each tensor group form a data
    group. A group of one rank is None."""
    n = world.size()
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1 or n % tensor:
        raise InputError(f"the tensor-parallel size must divide the {n} ranks, got {tensor!r}")
    if tensor == n or n == 1:
        return (world if n > 1 else None), None
    if tensor == 1:
        return None, world
    try:
        return world.split(world.rank() // tensor), world.split(world.rank() % tensor)
    except RuntimeError as e:
        raise InputError(f"tensor and data parallelism together need subgroups, which this backend cannot make "
                         f"({e}); MLX's MPI backend can (mlx.launch --backend mpi)") from None


# ---- bytes through collectives ----


def exchange(data: bytes, group) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (two all_gathers: lengths, then padded bytes)."""
    sizes = mx.distributed.all_gather(mx.array([len(data)], mx.int32), group=group).tolist()
    width = max(1, max(sizes))
    padded = mx.array(list(data) + [0] * (width - len(data)), mx.uint8)
    rows = memoryview(bytes(mx.distributed.all_gather(padded, group=group))).cast("B")
    return [bytes(rows[i * width: i * width + size]) for i, size in enumerate(sizes)]


def broadcast(data: bytes, group) -> bytes:
    """Rank 0's `data` on every rank (the others pass b""): an all_gather of the sizes, then one of
    the bytes only when rank 0 has any."""
    sizes = mx.distributed.all_gather(mx.array([len(data)], mx.int32), group=group).tolist()
    if sizes[0] == 0:
        return b""
    mine = list(data) if group.rank() == 0 else [0] * sizes[0]
    return bytes(mx.distributed.all_gather(mx.array(mine, mx.uint8), group=group)[:sizes[0]])


def exchange_json(value, group) -> list:
    return [json.loads(b) for b in exchange(json.dumps(value).encode(), group)]


# ---- requests ----


def digest(reqs: Sequence[Request]) -> str:
    """A fingerprint of what the requests ask for (everything but the seeds)."""
    h = hashlib.sha256()
    for r in reqs:
        s = r.settings
        fields = [list(r.prompt), r.max_tokens, list(r.stop), r.logprobs, sorted(r.eos),
                  [float(f.item()) for f in (s.temperature, s.top_p, s.min_p, s.repetition_penalty,
                                             s.presence_penalty, s.frequency_penalty)], int(s.top_k.item())]
        h.update(json.dumps(fields).encode())
    return h.hexdigest()


def agree(reqs: list[Request], *groups_) -> list[Request]:
    """The requests with rank 0's seeds, so that ranks that run the same prompts sample the same
    tokens (a seed left None is drawn on each rank). Raises InputError on every rank if the ranks'
    prompts or options differ. Groups that are None are skipped."""
    for group in groups_:
        if group is None or group.size() == 1:
            continue
        mine = {"digest": digest(reqs), "seeds": [int(r.settings.seed.item()) for r in reqs]}
        everyone = exchange_json(mine, group)
        if any(e["digest"] != mine["digest"] for e in everyone):
            differ = [i for i, e in enumerate(everyone) if e["digest"] != everyone[0]["digest"]]
            raise InputError(f"ranks {differ} of the group were given other prompts or options than rank 0: every "
                             "rank must call generate with the same prompts and options")
        reqs = [dataclasses.replace(r, settings=r.settings._replace(seed=np.array([s], np.uint32)))
                for r, s in zip(reqs, everyone[0]["seeds"])]
    return reqs


def assign(costs: Sequence[int], n: int) -> list[list[int]]:
    """Indices of the items per rank: the costliest first, each to the least loaded rank (ties to
    the lowest rank), each rank's list in index order. Deterministic, so every rank agrees."""
    loads = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        loads[r] += costs[i]
        out[r].append(i)
    return [sorted(o) for o in out]


def cost(r: Request) -> int:
    """A request's work: its prompt's tokens plus the tokens it may generate."""
    return len(r.prompt) + r.max_tokens


def share(reqs: Sequence[Request], group) -> list[int]:
    """The indices of the requests this rank of the data group runs (all of them without a group)."""
    if group is None:
        return list(range(len(reqs)))
    return assign([cost(r) for r in reqs], group.size())[group.rank()]


def kv_memory(group) -> int | None:
    """The KV budget every rank of a tensor group uses (the smallest rank's), so their schedulers
    admit the same requests at the same steps; None without a group (the engine's own)."""
    if group is None or group.size() == 1:
        return None
    mine = kv_budget(None, default_strategy(), fixed_shapes=False)
    mib = mx.distributed.all_min(mx.array([mine >> 20], mx.int32), group=group).item()  # int32 in MiB
    return max(1, mib << 20)


# ---- results ----


def _rows(result: GenerationResult, indices: list[int]) -> list[dict]:
    return [{"index": i, "text": result.texts[j], "ids": result.token_ids[j], "finish": result.finish_reasons[j],
             "seed": result.seeds[j], "logprobs": None if result.logprobs is None else result.logprobs[j],
             "top": None if result.top_logprobs is None else result.top_logprobs[j]} for j, i in enumerate(indices)]


def _stats(s: Stats) -> list:
    return [s.prompt_tokens, s.prompt_time, s.generation_tokens, s.generation_time, s.peak_memory_gb]


def gather(result: GenerationResult, indices: list[int], group, total: int, top_n: int) -> GenerationResult:
    """The whole result, in prompt order, on every rank, from each rank's result for its prompts
    (`indices`). Its stats add the tokens and take the longest time: the group's throughput."""
    everyone = exchange_json({"rows": _rows(result, indices), "stats": _stats(result.stats)}, group)
    rows = sorted((row for e in everyone for row in e["rows"]), key=lambda row: row["index"])
    if [row["index"] for row in rows] != list(range(total)):
        raise InputError("the ranks' shares do not cover the prompts once each")
    per_rank = [e["stats"] for e in everyone]
    stats = Stats(prompt_tokens=sum(s[0] for s in per_rank), prompt_time=max(s[1] for s in per_rank),
                  generation_tokens=sum(s[2] for s in per_rank), generation_time=max(s[3] for s in per_rank),
                  peak_memory_gb=max(s[4] for s in per_rank))
    return GenerationResult(
        texts=[row["text"] for row in rows], token_ids=[row["ids"] for row in rows],
        finish_reasons=[row["finish"] for row in rows], stats=stats, seeds=[row["seed"] for row in rows],
        logprobs=[row["logprobs"] for row in rows] if top_n >= 0 else None,
        top_logprobs=[[tuple(tuple(p) for p in step) for step in row["top"]] for row in rows] if top_n > 0 else None)


def rank_stats(stats: Stats, group) -> list[Stats]:
    """Every rank's stats, in rank order, on every rank (for per-rank throughput)."""
    return [Stats(*s) for s in exchange_json(_stats(stats), group)]


# ---- the command line: `mlx.launch -n N -- python -m mlxfun generate --tensor-parallel ...` ----


def add_flags(p) -> None:
    g = p.add_argument_group("several devices (under mlx.launch)")
    g.add_argument("--tensor-parallel", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="split the model across N ranks (default: all), each loading only its slices")
    g.add_argument("--data-parallel", action="store_true",
                   help="split the prompts across the ranks (with --tensor-parallel N: across the tensor groups)")


def setup(args, config):
    """(model, config, whether this rank prints) for the flags of `add_flags`: the model loaded
    whole or as this rank's shard, and the config with the data-parallel group."""
    from mlxfun.model.load import load
    from mlxfun.parallel.shard import sharded_load

    if args.tensor_parallel is None and not args.data_parallel:
        return load(args.model, dtype=args.dtype), config, True
    world = mx.distributed.init()
    n = world.size()
    tensor = 1 if args.tensor_parallel is None else args.tensor_parallel or n
    if not args.data_parallel and tensor != n:
        raise InputError(f"--tensor-parallel {tensor} with {n} ranks leaves ranks idle: add --data-parallel, or "
                         "give no number (all ranks)")
    tensor_group, data_group = groups(world, tensor)
    model = load(args.model, dtype=args.dtype) if tensor_group is None else \
        sharded_load(args.model, tensor_group, dtype=args.dtype)
    return model, dataclasses.replace(config, group=data_group), world.rank() == 0
