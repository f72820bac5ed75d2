"""Round 1's static batches against this code's, alternating in one process (issue 14: "old and new
side by side in one run"). One process against another moved a run 20-30% on the H200's host,
more than the gap measured, so both versions run here on the same weights (one copy, shared).

Round 1's package (a folder holding `mlxfun/`, e.g. `.old` from `git archive bb0fcea mlxfun`) is
copied to a temporary folder as `mlxfun_r1`, its imports and its CUDA kernels' names renamed, so
both import side by side. Each version's own `bench.run_batch` runs each batch: once to warm up,
then `--repeats` times in turn, the order swapped every repeat (ABBA). Reported: medians of prompt
and generated tok/s and of peak GB (weights included, the same for both), and their ratios.

Run: python benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 1,8,32,128 [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from mlxfun import bench

R1 = "mlxfun_r1"


def import_round1(folder: Path, into: Path | None = None):
    """Round 1's package from `folder`/mlxfun, importable beside this one as `mlxfun_r1` (copied into
    `into`, a new temporary folder by default) -> its (bench, llama, load) modules."""
    into = into or Path(tempfile.mkdtemp())
    target = into / R1
    shutil.copytree(folder / "mlxfun", target)
    for path in target.glob("*.py"):
        text = path.read_text()
        text = re.sub(r"\b(from|import) mlxfun\b", rf"\1 {R1}", text)
        text = text.replace('import_module(f"mlxfun.', f'import_module(f"{R1}.')
        text = text.replace('name="mlxfun_', f'name="{R1}_')  # MLX keys compiled CUDA kernels by name
        path.write_text(text)
    sys.path.insert(0, str(into))
    return round1_module("bench"), round1_module("llama"), round1_module("load")


def round1_module(name: str):
    """One of round 1's modules (after `import_round1`), e.g. "generate"."""
    return importlib.import_module(f"{R1}.{name}")


def as_round1(tree, llama1):
    """This code's params tree rebuilt with round 1's NamedTuple classes, same arrays (fields round 1
    lacks, such as `Dense.weight_t`, left out)."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        cls = getattr(llama1, type(tree).__name__)
        return cls(**{f: as_round1(getattr(tree, f), llama1) for f in cls._fields if f in tree._fields})
    if isinstance(tree, tuple):
        return tuple(as_round1(x, llama1) for x in tree)
    return tree


def round1_model(round1, new):
    """`new` (a random-weight Model of this code) as round 1's Model: the same arrays, round 1's
    classes. `round1`: what `import_round1` returns."""
    bench1, llama1, load1 = round1
    base = bench1.SHAPES["1B"]
    fields = {f.name: getattr(new.config, f.name) for f in dataclasses.fields(new.config) if hasattr(base, f.name)}
    if fields["rope_scaling"] is not None:  # round 1's own class
        fields["rope_scaling"] = type(base.rope_scaling)(**dataclasses.asdict(fields["rope_scaling"]))
    return load1.Model(dataclasses.replace(base, **fields), as_round1(new.params, llama1),
                       bench1.word_tokenizer(new.config.vocab_size), "random")


def patched(module: str, name: str, value):
    """This code's run_batch with `mlxfun.<module>.<name>` set to `value` while it runs (built from
    the shipped one when `value` is callable with it: `value(shipped)`)."""

    def run(*a):
        owner = importlib.import_module(f"mlxfun.{module}")
        shipped = getattr(owner, name)
        setattr(owner, name, value(shipped) if callable(value) else value)
        try:
            return bench.run_batch(*a)
        finally:
            setattr(owner, name, shipped)
    return run


def words(shipped):
    """`cache.write` with a chunk's 16-bit keys and values written as uint32 words (`chunk_write.py`'s
    `wide`, what the engine's passes did on 2026-12-04). Chunks over `step.PREFILL_COMPILED_TOKENS`
    only: a compiled chunk keeps the write it was traced with."""
    import chunk_write  # beside this script

    return lambda buf, new, slots: (shipped if new.shape[2] == 1 else chunk_write.wide)(buf, new, slots)


# Variants of this code, each one setting of the shipped code changed while it runs:
# groups of n tokens (`prefill.group_tokens`); no early launch of a first chunk's first layers
# (`llama.LAUNCH_LAYERS`, before 2026-12-04's eighteenth session); every chunk scattered, none
# written as one run (`cache.run_start`, before the nineteenth); attention over more than n scores
# fused (`llama.GROUPED_MAX_SCORES`; chunks over `step.PREFILL_COMPILED_TOKENS` only, as for words).
def grouped(tokens: int):
    return patched("prefill", "group_tokens", lambda shipped: lambda hidden_size: tokens)


def scores(limit: int):
    return patched("llama", "GROUPED_MAX_SCORES", limit)


late = patched("llama", "LAUNCH_LAYERS", 1 << 30)
scatter = patched("cache", "run_start", lambda shipped: lambda slots: None)
as_words = patched("cache", "write", words)


def timed(run_batch, model, prompts, gen_tokens) -> dict:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    stats, _, _ = run_batch(model, prompts, gen_tokens, None)
    return {"prompt_tps": stats.prompt_tps, "gen_tps": stats.generation_tps, "peak_gb": stats.peak_memory_gb}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="1B")
    p.add_argument("--old", type=Path, default=Path(".old"), help="a folder holding round 1's mlxfun/")
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--group-tokens", default="",
                   help="also this code with prefill groups of each of these many tokens (comma-separated)")
    p.add_argument("--words", action="store_true",
                   help="also this code with a chunk's 16-bit KV written as uint32 words")
    p.add_argument("--late", action="store_true",
                   help="also this code with no early launch of a first chunk's first layers")
    p.add_argument("--scatter", action="store_true",
                   help="also this code with every chunk's writes scattered, none a slice update")
    p.add_argument("--max-scores", default="",
                   help="also this code with attention over more than each of these many scores fused")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp())
    old_code = import_round1(args.old, tmp)
    new = bench.random_model(bench.SHAPES[args.shape])
    runs = {"round 1": (old_code[0].run_batch, round1_model(old_code, new)), "this code": (bench.run_batch, new)}
    for n in [int(n) for n in args.group_tokens.split(",") if n]:
        runs[f"group {n}"] = (grouped(n), new)
    if args.words:
        runs["as words"] = (as_words, new)
    if args.late:
        runs["late"] = (late, new)
    if args.scatter:
        runs["scatter"] = (scatter, new)
    for n in [int(n) for n in args.max_scores.split(",") if n]:
        runs[f"scores {n}"] = (scores(n), new)
    out = {"machine": bench.machine(), "args": vars(args) | {"old": str(args.old)}, "batches": []}
    print(f"{'batch':>5s} {'version':10s} {'prompt tok/s':>12s} {'gen tok/s':>10s} {'peak GB':>8s}  (medians)")
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = bench.random_prompts(new.config.vocab_size, B, args.prompt_tokens)
        seen: dict[str, list[dict]] = {name: [] for name in runs}
        for fn, model in runs.values():
            fn(model, prompts, 4, None)  # compile for this batch size
        for rep in range(args.repeats):
            for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):  # ABBA (ABCCBA, ...)
                fn, model = runs[name]
                seen[name].append(timed(fn, model, prompts, args.gen_tokens))
        med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in seen.items()}
        for name in runs:
            m = med[name]
            print(f"{B:5d} {name:10s} {m['prompt_tps']:12.1f} {m['gen_tps']:10.1f} {m['peak_gb']:8.2f}", flush=True)
        ratios = {name: {k: med[name][k] / med["round 1"][k] for k in med["round 1"]} for name in list(runs)[1:]}
        for name, ratio in ratios.items():
            label = "ratio" if name == "this code" else f"ratio {name.split()[-1]}"
            print(f"{B:5d} {label:10s} {ratio['prompt_tps']:11.2f}x {ratio['gen_tps']:9.2f}x "
                  f"{ratio['peak_gb']:7.2f}x", flush=True)
        out["batches"].append({"batch": B, "runs": seen, "medians": med, "ratio": ratios["this code"],
                               "ratios": ratios})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
