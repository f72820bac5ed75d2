"""`python -m mlxfun.bench`: generation throughput by batch size, beside mlx-lm when it is installed.

Each configuration (weights, batch size) is warmed up once (compiling its steps), then timed with
fixed prompt and generation lengths and EOS ignored. `--shape` builds random-weight Llama shapes in
memory, so large models can be measured without downloads. mlx-lm is never a dependency: with
`--mlx-lm` and mlx-lm importable, the same weights are saved with `mlxfun.save`, loaded with
`mlx_lm.load` and run through `mlx_lm.batch_generate` in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx

from mlxfun.bench import speculative as bench_speculative
from mlxfun.bench import structured as bench_structured
from mlxfun.bench import workloads
from mlxfun.bench.models import (
    DTYPES,
    QUANT,
    SHAPES,
    machine,
    mlx_lm_available,
    on_gpu,
    random_params,
    random_prompts,
    word_tokenizer,
)
from mlxfun.engine import strategy as strat
from mlxfun.engine.core import Engine
from mlxfun.model import llama, weights
from mlxfun.model.llama import Quantized
from mlxfun.model.load import Model, load, save
from mlxfun.parallel import distributed

INTERRUPTED = 130  # the shell's code for SIGINT, as the other commands exit on Ctrl-C


@dataclass
class Row:
    weights: str
    batch: int
    prompt_tps: float
    gen_tps: float
    peak_gb: float
    setup_s: float = 0.0  # Engine construction: the dense copy of quantized weights, when the strategy makes one
    dense_copy: bool = False
    mlx_lm_prompt_tps: float | None = None
    mlx_lm_gen_tps: float | None = None
    mlx_lm_peak_gb: float | None = None
    mlx_lm_error: str | None = None  # mlx-lm failed at this batch (and was not run at larger ones)

    @property
    def ratio(self) -> float | None:
        return self.gen_tps / self.mlx_lm_gen_tps if self.mlx_lm_gen_tps else None


def variants(args) -> list[tuple[str, Callable[[], Model]]]:
    """(name, builder of the Model) per requested weights variant; built one at a time to bound memory."""
    out = []
    for name in args.dtypes:
        if args.shape is None:
            def build(name=name):
                model = load(args.model)
                if name in QUANT:  # a quantized checkpoint keeps its own weights (Q4_1 for the default model)
                    if strat.quantized(model.params):
                        return model
                    params = weights.quantize(model.config, model.params, bits=QUANT[name], group_size=64)
                else:
                    params = weights.cast(model.config, model.params, DTYPES[name])
                return Model(model.config, params, model.tokenizer, model.source)
        else:
            def build(name=name):
                config = SHAPES[args.shape]
                params = random_params(config, DTYPES[args.base_dtype])
                if name in QUANT:
                    params = weights.quantize(config, params, bits=QUANT[name], group_size=64)
                    mx.eval(params)
                elif DTYPES[name] != DTYPES[args.base_dtype]:
                    params = weights.cast(config, params, DTYPES[name])
                return Model(config, params, word_tokenizer(config.vocab_size), f"random {args.shape}")
        out.append((name, build))
        if args.batch_invariant:  # the same weights decoded batch-invariantly (`ModelConfig.batch_invariant`)
            def invariant(build=build):
                model = build()
                return dataclasses.replace(model, config=model.config.with_batch_invariant(True))
            out.append((f"{name}+inv", invariant))
    return out


def run_batch(model: Model, prompts: list[list[int]], max_tokens: int, strategy: strat.WeightStrategy | None):
    """One static batch (an engine of one row per prompt) -> (stats, setup seconds, dense copy made)."""
    t0 = time.perf_counter()
    engine = Engine(model, len(prompts), strategy=strategy)
    setup = time.perf_counter() - t0
    for p in prompts:
        engine.add(p, max_tokens=max_tokens, ignore_eos=True)
    for _ in engine.events():
        pass
    return engine.stats, setup, engine.runner.params is not model.params


def bench_ours(model: Model, name: str, args, strategy, rows: list[Row]) -> list[Row]:
    """Measure each batch size, appending each row to `rows` as soon as it is measured (so a Ctrl-C
    keeps those); -> this variant's rows."""
    first = len(rows)
    for B in args.batch_sizes:
        prompts = random_prompts(model.config.vocab_size, B, args.prompt_tokens)
        run_batch(model, prompts, args.warmup_tokens, strategy)  # compile for this batch size
        best = None
        for _ in range(args.repeats):
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
            stats, setup, dense = run_batch(model, prompts, args.gen_tokens, strategy)
            row = Row(name, B, stats.prompt_tps, stats.generation_tps, stats.peak_memory_gb, setup, dense)
            best = row if best is None or row.gen_tps > best.gen_tps else best
        rows.append(best)
        print(f"  mlxfun {name:9s} batch {B:4d}: gen {best.gen_tps:9.1f} tok/s", flush=True)
    return rows[first:]


def bench_mlx_lm(folder: Path, vocab_size: int, name: str, rows: list[Row], args) -> None:
    """mlx-lm's batch_generate on the same prompts, filling in each row's mlx-lm columns."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    tokenizer.eos_token_ids = set()  # ignore EOS, as mlxfun's runs do
    for i, row in enumerate(rows):
        prompts = random_prompts(vocab_size, row.batch, args.prompt_tokens)
        # Every row in one batch: mlx-lm's defaults would decode at most 32 and prefill 8 at a time.
        options = dict(completion_batch_size=row.batch, prefill_batch_size=row.batch)
        try:
            mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=args.warmup_tokens, **options)
            for _ in range(args.repeats):  # the best of the repeats, as for mlxfun
                gc.collect()
                mx.clear_cache()
                mx.reset_peak_memory()
                stats = mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=args.gen_tokens, **options).stats
                if row.mlx_lm_gen_tps is None or stats.generation_tps > row.mlx_lm_gen_tps:
                    row.mlx_lm_prompt_tps = stats.prompt_tokens / stats.prompt_time if stats.prompt_time else 0.0
                    row.mlx_lm_gen_tps = stats.generation_tps
                    row.mlx_lm_peak_gb = mx.get_peak_memory() / 1e9
        except Exception as e:  # mlx-lm's failure is a result too; mlxfun's rows are kept and written
            row.mlx_lm_gen_tps = None
            for later in rows[i:]:
                later.mlx_lm_error = f"{type(e).__name__}: {e}"[:300]
            print(f"  mlx-lm {name:9s} batch {row.batch:4d}: failed ({row.mlx_lm_error}); not run at larger batches",
                  flush=True)
            return
        print(f"  mlx-lm {name:9s} batch {row.batch:4d}: gen {row.mlx_lm_gen_tps:9.1f} tok/s "
              f"(ratio {row.ratio:.2f})", flush=True)


def matmul_bench(sizes: list[tuple[int, int]], rows: list[int], dtype: mx.Dtype, bits: int = 4,
                 group_size: int = 64, repeats: int = 5, per_eval: int = 20) -> list[dict]:
    """Per (out, in) weight and M rows: ms of a quantized matmul, dequantize-then-matmul, and dense.
    `per_eval` products share one evaluation, so a GPU's launch and sync latency is amortized."""

    def timed(fn, xs) -> float:
        mx.eval([fn(x) for x in xs])
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval([fn(x) for x in xs])
            ts.append(time.perf_counter() - t)
        return 1e3 * sorted(ts)[len(ts) // 2] / len(xs)

    out = []
    for n_out, n_in in sizes:
        w = (mx.random.normal((n_out, n_in)) * n_in**-0.5).astype(dtype)
        q = mx.quantize(w, group_size=group_size, bits=bits)
        mx.eval(w, q)
        for M in rows:
            xs = [mx.random.normal((M, n_in)).astype(dtype) for _ in range(per_eval if on_gpu() else 1)]
            mx.eval(xs)
            # The step's path (qmv.product on CUDA up to 8 rows).
            qmm = timed(lambda x: llama.linear(Quantized(*q), x, fast=True), xs)
            deq = timed(lambda x: x @ mx.dequantize(*q, group_size=group_size, bits=bits).T, xs)
            dense = timed(lambda x: x @ w.T, xs)
            out.append(dict(weight=f"{n_out}x{n_in}", M=M, dtype=str(dtype), quantized_ms=qmm,
                            dequantize_matmul_ms=deq, dense_ms=dense))
            print(f"  matmul {n_out}x{n_in} M={M:4d}: q{bits} {qmm:8.3f} ms  dequantize+matmul {deq:8.3f} ms  "
                  f"dense {dense:8.3f} ms", flush=True)
    return out


def table(rows: list[Row]) -> str:
    side = any(r.mlx_lm_gen_tps is not None for r in rows)
    head = f"{'weights':10s} {'batch':>5s} {'prompt tok/s':>12s} {'gen tok/s':>10s} {'ms/step':>8s} {'peak GB':>8s}"
    if side:
        head += f" {'mlx-lm gen':>10s} {'ratio':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = 1e3 * r.batch / r.gen_tps if r.gen_tps else float("nan")
        name = r.weights + ("*" if r.dense_copy else "")
        line = f"{name:10s} {r.batch:5d} {r.prompt_tps:12.1f} {r.gen_tps:10.1f} {ms:8.2f} {r.peak_gb:8.3f}"
        if side:
            line += (f" {r.mlx_lm_gen_tps:10.1f} {r.ratio:6.2f}" if r.mlx_lm_gen_tps else
                     f" {'failed' if r.mlx_lm_error else '-':>10s} {'-':>6s}")
        lines.append(line)
    if any(r.dense_copy for r in rows):
        lines.append("* quantized weights run as a dense copy at this batch size (mlxfun.engine.strategy)")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.weights for r in rows):
        sel = [r for r in rows if r.weights == name]
        line, = ax.plot([r.batch for r in sel], [r.gen_tps for r in sel], "o-", label=f"mlxfun {name}")
        if any(r.mlx_lm_gen_tps for r in sel):
            ax.plot([r.batch for r in sel if r.mlx_lm_gen_tps], [r.mlx_lm_gen_tps for r in sel if r.mlx_lm_gen_tps],
                    "s--", color=line.get_color(), label=f"mlx-lm {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# Defaults where they differ: (GPU, CPU). The CPU's finish in about a minute with the default model on
# 2 cores (53 s measured: a prompt of 128 tokens at 8 rows alone took minutes there).
GPU_CPU = {"batch_sizes": ("1,2,4,8,16,32,64,128", "1,4"), "prompt_tokens": (128, 16), "gen_tokens": (128, 16)}


def device_default(name: str, gpu: bool):
    return GPU_CPU[name][0 if gpu else 1]


def both(name: str) -> str:
    gpu, cpu = GPU_CPU[name]
    return f"(default: {gpu} on a GPU, {cpu} on the CPU)"


def parse_args(argv):
    from mlxfun.cli.main import HelpFormatter  # shows each flag's default

    gpu = on_gpu()
    p = argparse.ArgumentParser(prog="mlxfun bench", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file, Hugging Face folder or repo id (default: SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="random-weight Llama shape instead of --model (default: none, the --model)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated " + both("batch_sizes"))
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens per row " + both("prompt_tokens"))
    p.add_argument("--gen-tokens", type=int, default=None, help="generated tokens per row " + both("gen_tokens"))
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration; the best is kept "
                                                          "(use 2-3 on a shared, noisy machine); with --speculative "
                                                          "or --structured, the two kinds of run alternate and "
                                                          "medians are kept")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens of the untimed run that compiles each config (default: on a GPU as many as the "
                        "timed run, so it meets the same pool and table sizes and traces nothing; on the CPU 4)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also measure each weights variant decoded batch-invariantly (NAME+inv rows)")
    p.add_argument("--dtypes", default=None,
                   help="weights variants among float32, bfloat16, float16, q4, q8 "
                        "(default: bfloat16,q4 on a GPU, float32,q4 on the CPU)")
    p.add_argument("--base-dtype", default=None, help="dtype of random weights before quantizing "
                                                      "(default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--strategy", choices=("auto", "quantized", "dense"), default="auto",
                   help="quantized weights at large batch: as the backend's strategy picks, always the quantized "
                        "kernel, or always a dense copy")
    p.add_argument("--mlx-lm", action="store_true", help="run mlx-lm's batch_generate side by side when importable")
    p.add_argument("--matmul", action="store_true", help="also time 4-bit vs dequantize+matmul vs dense matmuls")
    p.add_argument("--ring", action="store_true",
                   help="instead: peak memory of 512- and 4096-token generations, unbounded vs max_kv_size=256")
    p.add_argument("--continuous", type=int, default=None, metavar="ROWS",
                   help="instead: prompts with max_tokens 16..256, static batches vs continuous batching in ROWS rows "
                        "(default: none)")
    p.add_argument("--prompts", type=int, default=256, help="prompts of the --continuous and --prefix workloads")
    p.add_argument("--prefix", action="store_true",
                   help="instead: prompts sharing a long prefix, without and with the prefix cache (CPU: the default "
                        "model, 8 questions after one 300-token system prompt; --shape: --prompts random prompts)")
    p.add_argument("--shared-tokens", type=int, default=None, help="the --prefix workload's shared prefix "
                                                                     "(default: 300 on the CPU, 2000 for --shape)")
    p.add_argument("--rows", type=int, default=32, help="rows of the --prefix workload's engine (--shape)")
    p.add_argument("--speculative", action="store_true",
                   help="instead: speculative decoding against plain decoding (oracle drafter at --alphas x --ks, "
                        "and real drafters)")
    p.add_argument("--alphas", default="0.5,0.7,0.9", help="oracle acceptance rates")
    p.add_argument("--ks", default="2,4,6", help="draft lengths for the oracle")
    p.add_argument("--rule-only", action="store_true",
                   help="with --speculative: only the real drafters, the measured rule on (no oracle, none forced)")
    p.add_argument("--draft-shape", choices=sorted(SHAPES), default=None,
                   help="a random-weight draft model for --shape, e.g. 1B for 8B (default: none)")
    p.add_argument("--structured", action="store_true",
                   help="instead: a batch with a JSON schema on every row against the same batch unconstrained, "
                        "and the host's mask time per step")
    p.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer folder for --shape (structured output needs a byte-level one; "
                        "the vocabulary becomes its size; default: a word-level one)")
    p.add_argument("--json", default=None, help="write results here (default: none)")
    p.add_argument("--plot", default=None,
                   help="write a PNG of generation tokens/s against batch size here (default: none)")
    distributed.add_flags(p)  # under mlx.launch: mlxfun.bench.distributed
    args = p.parse_args(argv)
    for name in GPU_CPU:
        if getattr(args, name) is None:
            setattr(args, name, device_default(name, gpu))
    try:
        args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if args.warmup_tokens is None:
        # A run of fewer tokens reserves a smaller pool: the timed run would trace its step again.
        args.warmup_tokens = args.gen_tokens if gpu else 4
    args.dtypes = (args.dtypes or ("bfloat16,q4" if gpu else "float32,q4")).split(",")
    args.base_dtype = args.base_dtype or ("bfloat16" if gpu else "float32")
    for d in args.dtypes:
        if d not in DTYPES and d not in QUANT:
            p.error(f"unknown dtype {d!r}")
    return args


def measure(args, strategy, side: bool, rows: list[Row]) -> None:
    """Every weights variant at every batch size, appended to `rows` as measured."""
    for name, build in variants(args):
        t = time.perf_counter()
        model = build()
        print(f"{name}: built in {time.perf_counter() - t:.1f} s", flush=True)
        these = bench_ours(model, name, args, strategy, rows)
        if side:
            with tempfile.TemporaryDirectory(prefix="mlxfun-bench-") as tmp:
                save(model, tmp)
                vocab_size = model.config.vocab_size
                model = None
                gc.collect()
                mx.clear_cache()
                bench_mlx_lm(Path(tmp), vocab_size, name, these, args)
        model = None
        gc.collect()
        mx.clear_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.structured:
        return bench_structured.main_engine(args)
    if args.ring or args.continuous:
        return workloads.main(args)
    if args.prefix:
        return workloads.main_prefix(args)
    if args.speculative:
        return bench_speculative.main(args)
    if args.tensor_parallel is not None or args.data_parallel:
        from mlxfun.bench import distributed as bench_distributed

        return bench_distributed.main(args)
    strategy = {"auto": None, "quantized": strat.QUANTIZED, "dense": strat.WeightStrategy(dense_from=1)}[args.strategy]
    side = args.mlx_lm and mlx_lm_available()
    if args.mlx_lm and not side:
        print("mlx-lm is not importable: running mlxfun alone")
    info = machine()
    print(json.dumps(info))
    result = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "rows": [], "matmul": []}
    rows: list[Row] = []
    try:
        if args.matmul:
            sizes = [(1536, 576)] + ([(14336, 4096)] if on_gpu() else [])
            # Prompt-sized rows too: where dequantize-then-matmul overtakes the 4-bit product (prefill).
            counts = [1, 8, 32, 128] + ([512, 1024] if on_gpu() else [])
            result["matmul"] = matmul_bench(sizes, counts, DTYPES[args.base_dtype])
        measure(args, strategy, side, rows)
    except KeyboardInterrupt:  # Ctrl-C: stop here, keep (print and write) the rows already measured
        result["interrupted"] = True
        print(f"\nmlxfun bench: interrupted: {len(rows)} row(s) measured", file=sys.stderr, flush=True)
    print()
    print(table(rows))
    result["rows"] = [asdict(r) | {"ratio": r.ratio} for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"results written to {args.json}")
    if result.get("interrupted"):
        return INTERRUPTED
    if args.plot:
        plot(rows, args.plot, f"{args.shape or Path(args.model or 'SmolLM2-135M').name} on {info['device']}, "
                              f"prompt {args.prompt_tokens}, generate {args.gen_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
