"""One rank of the distributed tests: `mlx.launch -n N -- python -m dist_worker SUITE OUT [FOLDERS...]`.

Each rank runs the suite's cases on its group and writes what it computed to OUT/rank<r>.json (and
.npy logits); tests/test_distributed.py compares them with one process.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from helpers import VARIANTS, left_pad, run_engine, tiny_config, tiny_model

import mlxfun
from mlxfun.engine.options import GenerationConfig, requests
from mlxfun.engine.step import make_steps
from mlxfun.errors import MlxfunError
from mlxfun.model import llama
from mlxfun.parallel import distributed
from mlxfun.parallel.replicated import ReplicatedEngine
from mlxfun.parallel.shard import shard, sharded_load

# Six prompts of mixed lengths (tiny models' word-level ids).
TINY_PROMPTS = [[5, 9, 2], [7] * 11, [1, 2, 3, 4, 5, 6, 7, 8], [40], [3, 30, 33, 36, 60, 66], list(range(10, 24))]
# Three prompts of 5, 1 and 13 tokens: padding in the logits' batch, and few tokens (three float32
# ranks share this machine's cores with the suite). "def fib(n):" holds the largest logit (35.5) of
# the six prompts this test used to take, so the relative error keeps its scale.
REAL_PROMPTS = ["def fib(n):", "Hi", "Once upon a time, in a small village by the sea,"]
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=[11, 12, 13, 14, 15, 16], max_tokens=[5, 8, 3, 6, 4, 7])


def logits(model, prompts) -> np.ndarray:
    """Logits (B, T, V) of a left-padded batch, no cache."""
    tokens, positions = left_pad(prompts)
    out, _ = llama.forward(model.config, model.params, tokens, positions)
    return np.array(out.astype(mx.float32))


def result_dict(r) -> dict:
    return {"ids": r.token_ids, "texts": r.texts, "finish": r.finish_reasons, "seeds": r.seeds,
            "logprobs": r.logprobs, "top": r.top_logprobs}


def traces(model) -> int:
    """Times the sharded decode step is traced over 24 tokens of 6 prompts."""
    traced, made = [], {}

    def steps(config, mode):
        return made.setdefault(mode, make_steps(config, mode, on_trace=lambda: traced.append(1)))

    run_engine(model, TINY_PROMPTS, steps=steps, max_tokens=24, ignore_eos=True)
    return len(traced)


def replicated(model, group) -> dict:
    """Rank 0 submits (one request cancelled at once) from a client thread while every rank serves."""
    engine = ReplicatedEngine(model, group, rows=2)
    stop, done, records = threading.Event(), [], {}
    ids: list[int] = []

    def client():  # as an HTTP handler would: builds its requests, then submits them
        reqs = requests(model, TINY_PROMPTS, GenerationConfig(**SAMPLED))
        for r in reqs:
            ids.append(engine.submit(r))
            time.sleep(0.01)
        engine.cancel(engine.submit(reqs[0]))
        while len(done) < len(TINY_PROMPTS) + 1:
            time.sleep(0.01)
        stop.set()

    thread = threading.Thread(target=client, daemon=True) if group.rank() == 0 else None
    if thread:
        thread.start()
    events = 0
    for e in engine.serve(stop):
        events += 1
        if group.rank() == 0 and e.finish_reason is not None:
            done.append(e.index)
            records[e.index] = engine.take(e.index)
    if thread:
        thread.join()
    out = {"events": events, "left": len(engine.engine.requests)}
    if group.rank() == 0:
        out.update(ids=[records[i].row.token_ids for i in ids], cancelled=records[max(records)].finish_reason)
    return out


def errors(group) -> dict:
    out = {}
    try:
        shard(tiny_model(tiny_config(num_heads=3, num_kv_heads=1, head_dim=16)), group)
    except MlxfunError as e:
        out["heads"] = str(e)
    try:  # rank 1 asks for other prompts than rank 0
        mlxfun.generate(tiny_model(), [[1, 2, 3 + group.rank()]], max_tokens=2, group=group)
    except MlxfunError as e:
        out["prompts"] = str(e)
    return out


def tiny_suite(group, out: Path, folders: list[str]) -> dict:
    res: dict = {}
    r = group.rank()
    for name in ("tied", "untied", "bias", "qk_norm"):
        model = tiny_model(tiny_config(**VARIANTS[name]))
        np.save(out / f"logits-{name}-{r}.npy", logits(shard(model, group), TINY_PROMPTS))
    q4 = shard(tiny_model(quant=(4, 32)), group)
    np.save(out / f"logits-q4-{r}.npy", logits(q4, TINY_PROMPTS))
    f32 = shard(tiny_model(), group)
    res["kv_heads"] = f32.config.num_kv_heads
    res["greedy"] = mlxfun.generate(f32, TINY_PROMPTS, max_tokens=8).token_ids
    res["greedy_q4"] = mlxfun.generate(q4, TINY_PROMPTS, max_tokens=8).token_ids
    res["continuous"] = mlxfun.generate(f32, TINY_PROMPTS, max_tokens=8, batch_size=2).token_ids
    res["sampled"] = result_dict(mlxfun.generate(f32, TINY_PROMPTS, **SAMPLED))
    res["unseeded"] = result_dict(mlxfun.generate(f32, TINY_PROMPTS, temperature=1.0, max_tokens=6))
    res["traces"] = traces(f32)
    res["replicated"] = replicated(f32, group)
    whole = tiny_model()
    res["dp"] = result_dict(mlxfun.generate(whole, TINY_PROMPTS, **SAMPLED, logprobs=2, group=group))
    res["dp_continuous"] = result_dict(mlxfun.generate(whole, TINY_PROMPTS, max_tokens=8, batch_size=2, group=group))
    res["dp_one_prompt"] = mlxfun.generate(whole, TINY_PROMPTS[:1], max_tokens=8, group=group).token_ids
    res["share"] = distributed.share(requests(whole, TINY_PROMPTS, GenerationConfig(**SAMPLED)), group)
    for folder in folders:
        res[f"loaded-{Path(folder).name}"] = mlxfun.generate(sharded_load(folder, group), TINY_PROMPTS,
                                                             max_tokens=8).token_ids
    res["errors"] = errors(group)
    return res


def real_suite(group, out: Path, folders: list[str]) -> dict:
    f32 = sharded_load(None, group, dtype="float32")
    np.save(out / f"logits-real-{group.rank()}.npy", logits(f32, [f32.tokenizer.encode(p) for p in REAL_PROMPTS]))
    return {"greedy": mlxfun.generate(f32, REAL_PROMPTS, max_tokens=3).token_ids}


def compose_suite(group, out: Path, folders: list[str]) -> dict:
    """2 tensor groups of 2 ranks, each serving half the prompts (needs a backend that splits groups: MPI)."""
    tensor, data = distributed.groups(group, 2)
    model = shard(tiny_model(), tensor)
    return {"tensor": [tensor.rank(), tensor.size()], "data": [data.rank(), data.size()],
            "sampled": result_dict(mlxfun.generate(model, TINY_PROMPTS, **SAMPLED, group=data)),
            "greedy": mlxfun.generate(model, TINY_PROMPTS, max_tokens=8, batch_size=2, group=data).token_ids}


def main() -> None:
    suite, out, folders = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    group = mx.distributed.init(strict=True)
    res = {"tiny": tiny_suite, "real": real_suite, "compose": compose_suite}[suite](group, out, folders)
    (out / f"rank{group.rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
