"""Constrained against free decode steps, variants alternating in one process (one process
against another moves a step's time 20-30% on the H200's host, more than the effect measured).

B rows of a random-weight shape with a real tokenizer; a constrained run gives every row
`bench_structured`'s JSON schema, sampled at temperature 0.7 (seeded); variants of the engine's
constrained step's masks read in place as the engine does (`mapped.HostArray`) or copied to a
fresh array each step. Split variants take the grammar away to tell the split step's own cost
from the masks': every row goes through the constrained step with all-ones masks, mapped or
copied each step. A mask's upload alone: benchmarks/mapped_masks.py. Pool variants fill the masks
through llguidance pools other than the engine's one (`structured._executor`): a new pool per step
(what the engine did before 2026-12-04), or one of 2, 8 or 12 threads. Family variants compile
the schema with another `structured.MATCHER_FAMILIES` (independent start matchers the rows are
spread over; 1 as before 2026-12-04), with the pool's threads to match.
Each variant runs once to warm up, then `--repeats` times in turn; reported: median ms per
decode step (admission excluded) and its ratio to the first variant's median (free, by default).

Run: python benchmarks/structured_ab.py --shape 1B --tokenizer .tok --batch 32 [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from structured_costs import add_rows, random_model  # benchmarks/ is on the path: these scripts run from there

from mlxfun import bench, structured
from mlxfun import engine as engine_mod
from mlxfun.engine import Engine
from mlxfun.load import Model

# name -> (rows: "free", "schema" or "split" (every row through the constrained step, all-ones
# masks, no grammar), the masks: "engine" (`Engine._mask_buffer`: read in place,
# `mapped.HostArray`) or "copied" (a fresh `mx.array` each step))
VARIANTS = {
    "free": ("free", "engine"),
    "split step, masks mapped": ("split", "engine"),
    "split step, masks copied": ("split", "copied"),
    "schema": ("schema", "engine"),
    "schema, masks copied": ("schema", "copied"),
    "schema, a new llguidance pool per step": ("schema", "newpool"),  # as before 2026-12-04
    "schema, 2 llguidance threads": ("schema", "pool2"),
    "schema, 8 llguidance threads": ("schema", "pool8"),
    "schema, 12 llguidance threads": ("schema", "pool12"),  # llguidance's default on a 16-core host
    "schema, 1 matcher family": ("schema", "fam1"),  # as before 2026-12-04
    "schema, 8 families, 8 threads": ("schema", "fam8"),
    "schema, 12 families, 12 threads": ("schema", "fam12"),
}


class Everything:
    """A row's stand-in constraint, and matcher, that allows every token."""

    is_finished = False

    def matcher(self, eos) -> Everything:
        return self

    def advance(self, token: int) -> None:
        pass


class VariantEngine(Engine):
    """The engine with a variant's rows and upload: `split`, every row through the constrained
    step with all-ones masks and no grammar; `upload` as in VARIANTS."""

    def __init__(self, model: Model, rows: int, split: bool, upload: str):
        super().__init__(model, rows)
        self.split, self.upload = split, upload

    def submit(self, request):
        return super().submit(dataclasses.replace(request, constraint=Everything()) if self.split else request)

    def _first_token(self, params, h, records):
        if not self.split:
            return super()._first_token(params, h, records)
        matchers = [r.matcher for r in records]
        for r in records:  # all-ones masks for the first token too (fill_masks' free rows)
            r.matcher = None
        try:
            return super()._first_token(params, h, records)
        finally:
            for r, m in zip(records, matchers):
                r.matcher = m

    def _read_and_mask(self, ready, owners, out):
        if not self.split:
            return super()._read_and_mask(ready, owners, out)
        values = [engine_mod.host_values(step_out) for step_out, _ in ready]
        for (_, step_owners), (tokens, _, _) in zip(ready, values):
            self._match(step_owners, tokens)
        out[:] = 0xFFFFFFFF
        return values

    def _mask_buffer(self, mapped=True):
        return super()._mask_buffer(mapped and self.upload != "copied")


_compiled: dict[tuple, structured.Constraint] = {}  # (families, _compile's key) -> constraint, kept across runs


def compile_into(families: int):
    """`structured._compile` with the rows' start matchers compiled `families` times apart, each
    schema once per process (as the engine's cache keeps it, so its lexers stay warm)."""
    compile_ = structured._compile.__wrapped__

    def compiled(*key):
        if (families, key) not in _compiled:
            shipped, structured.MATCHER_FAMILIES = structured.MATCHER_FAMILIES, families
            try:
                _compiled[(families, key)] = compile_(*key)
            finally:
                structured.MATCHER_FAMILIES = shipped
        return _compiled[(families, key)]
    return compiled


def run(model: Model, batch: int, gen_tokens: int, rows: str, upload: str, prompt: list[int]) -> dict:
    """One engine run; -> ms per decode step after the admission, steps, tokens."""
    start, tokens = None, {}
    pool, compile_ = structured._executor, structured._compile
    if upload == "newpool":
        structured._executor = lambda: structured._llguidance().LLExecutor()
    elif upload.startswith(("pool", "fam")):
        n = int(upload[4:] if upload.startswith("pool") else upload[3:])
        threads = structured._llguidance().LLExecutor(max(n, structured.MASK_THREADS) if upload == "fam1" else n)
        structured._executor = lambda: threads
        if upload.startswith("fam"):
            structured._compile = compile_into(n)
    try:
        engine = VariantEngine(model, batch, rows == "split", upload)
        add_rows(engine, batch, gen_tokens, rows == "schema", prompt)
        for event in engine.events():
            tokens.setdefault(event.index, []).append(event.token)
            if start is None and engine.stats.steps >= 1:  # the admission and first step are behind
                start = (time.perf_counter(), engine.stats.steps)
    finally:
        structured._executor, structured._compile = pool, compile_
    t, s = start
    steps = engine.stats.steps - s
    return {"step_ms": (time.perf_counter() - t) * 1e3 / max(1, steps), "steps": steps,
            "tokens": engine.stats.generation_tokens, "output": sorted(tokens.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder (byte-level BPE)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (CPU smoke runs)")
    p.add_argument("--variants", default=None, help="comma-separated indices into VARIANTS (default: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, prompt = random_model(args.shape, Path(args.tokenizer), args.layers)
    names = list(VARIANTS) if args.variants is None else [list(VARIANTS)[int(i)] for i in args.variants.split(",")]
    found: dict[str, list[dict]] = {name: [] for name in names}
    outputs: dict[str, set[str]] = {}
    for repeat in range(args.repeats + 1):  # the first pass warms every variant up
        for name in names:
            r = run(model, args.batch, args.gen_tokens, *VARIANTS[name], prompt)
            if repeat:
                found[name].append(r)
            output = r.pop("output")
            outputs.setdefault("schema" if VARIANTS[name][0] == "schema" else "free", set()).add(repr(output))
            print(json.dumps({"repeat": repeat, "variant": name, **{k: round(v, 3) for k, v in r.items()}}),
                  flush=True)
    # Seeded rows: every run of a kind gives the same tokens (split rows' all-ones masks: the free ones).
    same = {kind: len(found_) == 1 for kind, found_ in outputs.items()}
    print(f"same tokens in every run: {same}")
    free = statistics.median(r["step_ms"] for r in found[names[0]])
    rows = []
    print(f"{'variant':<48} {'ms/step (median)':>17} {'runs':>24} {'ratio':>7}")
    for name, runs in found.items():
        ms = [r["step_ms"] for r in runs]
        med = statistics.median(ms)
        rows.append({"variant": name, "step_ms_median": med, "step_ms": ms, "ratio": med / free})
        print(f"{name:<48} {med:>17.3f} {' '.join(f'{m:.2f}' for m in ms):>24} {med / free:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "shape": args.shape, "batch": args.batch,
                                               "gen_tokens": args.gen_tokens, "same_tokens": same,
                                               "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
