"""`python -m mlxfun.bench.profile`: where a generation's time goes, by batch size.

For each batch size one generation runs step by step, synchronously, on freshly compiled steps:
- traces: how many times the decode step was traced (once per cache-capacity bucket);
- first step: wall time of the first decode step (trace, graph compile, kernel builds, run);
- compile: first step minus the steady step (the one-off cost of compiling);
- steady step: median wall time of the later steps, split into host time (the Python call of the
  compiled step plus `mx.async_eval`: building and queuing the graph) and device time (the wait
  for the result after queuing); "call" is the call's share of host time (flattening the inputs,
  replaying the traced graph), the rest is MLX encoding the step's nodes for the device;
- held-state step: the same step while the caller still holds the previous state, as a loop that
  keeps it alive does: the cache buffers cannot then be updated in place, so every step copies them;
- matmuls: the time of the step's linear maps alone at this batch size (the step's kernels);
- pipelined step: per-step time of the real generation loop (`Engine.events`, with `mx.async_eval`
  pipelining), over the same prompts;
- graph nodes: the primitives in one decode step's graph (compiled), by kind. Each costs the host
  time to encode (on an H200 host ~3 us per kernel node, ~1 us per view: benchmarks/host_cost.py).
  On the CPU fast ops (RMSNorm, RoPE) appear decomposed.

`profile_generation` returns one `BatchProfile`; `profile` runs several batch sizes into a `Report`.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxfun.bench import main as bench
from mlxfun.engine.core import Engine
from mlxfun.engine.step import Steps, make_steps
from mlxfun.engine.strategy import QUANTIZED, WeightStrategy
from mlxfun.model import llama
from mlxfun.model.load import Model, load


@dataclass
class BatchProfile:
    batch: int
    steps: int  # decode steps timed
    traces: int
    first_step_s: float
    first_step_host_s: float
    compile_s: float
    steady_step_s: float
    steady_host_s: float
    steady_device_s: float
    steady_call_s: float = 0.0  # the Python call of the compiled step, part of steady_host_s
    held_state_step_s: float | None = None
    matmul_s: float | None = None
    pipelined_step_s: float | None = None
    prefill_s: float = 0.0
    graph_nodes: dict[str, int] = field(default_factory=dict)  # primitive kind -> count in one step

    @property
    def tokens_per_s(self) -> float:
        step = self.pipelined_step_s or self.steady_step_s
        return self.batch / step if step else 0.0


@dataclass
class Report:
    model: str
    device: str
    prompt_tokens: int
    max_tokens: int
    batches: list[BatchProfile] = field(default_factory=list)

    def table(self) -> str:
        head = (f"{'batch':>5s} {'traces':>6s} {'first ms':>9s} {'compile ms':>10s} {'step ms':>8s} {'call ms':>8s} "
                f"{'host ms':>8s} {'device ms':>9s} {'held ms':>8s} {'matmul ms':>9s} {'piped ms':>9s} {'tok/s':>8s} "
                f"{'nodes':>6s}")
        lines = [f"{self.model} on {self.device}: prompt {self.prompt_tokens}, {self.max_tokens} tokens", head,
                 "-" * len(head)]

        def ms(v):
            return f"{1e3 * v:.2f}" if v is not None else "-"

        for b in self.batches:
            lines.append(f"{b.batch:5d} {b.traces:6d} {ms(b.first_step_s):>9s} {ms(b.compile_s):>10s} "
                         f"{ms(b.steady_step_s):>8s} {ms(b.steady_call_s):>8s} {ms(b.steady_host_s):>8s} "
                         f"{ms(b.steady_device_s):>9s} {ms(b.held_state_step_s):>8s} {ms(b.matmul_s):>9s} "
                         f"{ms(b.pipelined_step_s):>9s} "
                         f"{b.tokens_per_s:8.1f} {sum(b.graph_nodes.values()):6d}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self) | {"batches": [asdict(b) | {"tokens_per_s": b.tokens_per_s} for b in self.batches]}


def graph_nodes(outputs) -> dict[str, int]:
    """Primitives in the (not yet evaluated) graph behind `outputs`, by kind, most frequent first."""
    arrays = [a for _, a in tree_flatten(outputs) if isinstance(a, mx.array)]
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        kinds = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    return dict(collections.Counter(k.split()[0] for k in kinds).most_common())


def _median_time(fn, repeats: int = 5) -> float:
    mx.eval(fn())
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def matmul_time(model: Model, params: llama.Params, batch: int) -> float:
    """Seconds per decode step spent in the linear maps alone, at `batch` rows."""
    c = model.config
    layer = params.layers[0]
    dtype = params.norm.dtype
    total = 0.0
    maps = [(layer.qkv, c.hidden_size), (layer.o, c.num_heads * c.head_dim)]
    if layer.gate_up is not None:  # (a layer of experts: its products are not timed here)
        maps += [(layer.gate_up, c.hidden_size), (layer.down, c.intermediate_size)]
    for p, n_in in maps:
        x = mx.random.normal((batch, n_in)).astype(dtype)  # (B, in), as in a step
        total += _median_time(lambda: llama.linear(p, x, fast=True)) * c.num_layers
    x = mx.random.normal((batch, c.hidden_size)).astype(dtype)
    return total + _median_time(lambda: llama.logits(c, params, x, fast=True))


def profile_generation(model: Model, prompts: list[list[int]], max_tokens: int, *, held_state: bool = True,
                       matmuls: bool = True, pipelined: bool = True,
                       strategy: WeightStrategy | None = None) -> BatchProfile:
    """Profile one greedy generation of `max_tokens` tokens per prompt (EOS ignored), driving the
    scheduler (`mlxfun.engine.core.Engine`) one round at a time, synchronously."""
    B = len(prompts)
    traces, calls = [0], []
    made: dict = {}

    def count():
        traces[0] += 1

    def steps(config, mode) -> Steps:
        """Fresh compiled steps (one per mode), their calls timed."""
        if mode not in made:
            fresh = make_steps(config, mode, on_trace=count)

            def decode(*args):
                t = time.perf_counter()
                out = fresh.decode(*args)
                calls.append(time.perf_counter() - t)
                return out

            made[mode] = fresh._replace(decode=decode)
        return made[mode]

    engine = Engine(model, B, strategy=strategy, steps=steps)
    for p in prompts:
        engine.add(p, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    engine.admit()  # evaluated before it returns: no row is decoding
    prefill_s = time.perf_counter() - t
    records = []  # (held, host, device, call)
    nodes = {}
    for i in range(max_tokens - 1):
        hold = held_state and i % 2 == 1 and i > 1  # every other step, after the first two
        if i == 1:  # compiled by now: count the nodes of an extra, untimed call
            fn, args = engine.next_decode()
            nodes = graph_nodes(fn(*args))
            calls.clear()
        kept = engine.runner.state if hold else None  # else the step's graph owns the cache: written in place
        t0 = time.perf_counter()
        out = engine.decode()
        t1 = time.perf_counter()
        mx.eval(out, engine.runner.state)
        t2 = time.perf_counter()
        del kept
        engine.collect(keep=out)
        records.append((hold, t1 - t0, t2 - t1, calls.pop()))
    engine.collect()
    first = records[0]
    steady = [r for r in records[1:] if not r[0]] or records[:1]
    held = [r[1] + r[2] for r in records if r[0]]
    step_s = statistics.median(r[1] + r[2] for r in steady)
    profile = BatchProfile(
        batch=B, steps=len(records), traces=traces[0], first_step_s=first[1] + first[2], first_step_host_s=first[1],
        compile_s=max(0.0, first[1] + first[2] - step_s), steady_step_s=step_s,
        steady_host_s=statistics.median(r[1] for r in steady), steady_device_s=statistics.median(r[2] for r in steady),
        steady_call_s=statistics.median(r[3] for r in steady),
        held_state_step_s=statistics.median(held) if held else None, prefill_s=prefill_s, graph_nodes=nodes)
    if matmuls:
        profile.matmul_s = matmul_time(model, engine.runner.params, B)
    if pipelined:
        run = Engine(model, B, strategy=strategy, steps=steps)
        for p in prompts:
            run.add(p, max_tokens=max_tokens, ignore_eos=True)
        for _ in run.events():
            pass
        profile.pipelined_step_s = run.stats.generation_time / max(1, max_tokens)
    return profile


def profile(model: Model, batch_sizes: list[int], prompt_tokens: int, max_tokens: int, **options) -> Report:
    """One `profile_generation` per batch size, over random prompts of `prompt_tokens` tokens."""
    report = Report(model.source, str(mx.default_device()), prompt_tokens, max_tokens)
    for B in batch_sizes:
        prompts = bench.random_prompts(model.config.vocab_size, B, prompt_tokens)
        report.batches.append(profile_generation(model, prompts, max_tokens, **options))
        print(report.table().splitlines()[-1], flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mlxfun profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file, Hugging Face folder or repo id (default: SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default=None, help="random-weight Llama shape")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16, q4 or q8 (default: as loaded for "
                                                 "--model; bfloat16 on a GPU, float32 on the CPU for --shape)")
    p.add_argument("--batch-sizes", default="1,8,32,128" if bench.on_gpu() else "1,4")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64 if bench.on_gpu() else 16)
    p.add_argument("--strategy", choices=("auto", "quantized", "dense"), default="auto")
    p.add_argument("--no-matmuls", action="store_true", help="skip timing the linear maps alone")
    p.add_argument("--no-pipelined", action="store_true", help="skip the pipelined generation run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    base = "bfloat16" if bench.on_gpu() else "float32"
    if args.shape is None and args.dtype is None:
        model, label = load(args.model), "as loaded"
    else:
        label = args.dtype or base
        options = argparse.Namespace(model=args.model, shape=args.shape, base_dtype=base, dtypes=[label])
        model = bench.variants(options)[0][1]()
    strategy = {"auto": None, "quantized": QUANTIZED,
                "dense": WeightStrategy(dense_from=1)}[args.strategy]
    report = profile(model, [int(b) for b in args.batch_sizes.split(",")], args.prompt_tokens, args.max_tokens,
                     matmuls=not args.no_matmuls, pipelined=not args.no_pipelined, strategy=strategy)
    report.model = f"{report.model} ({label})"
    print()
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
