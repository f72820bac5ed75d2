"""`python -m mlxfun.bench.structured`: the host's share of structured output, per decode step.

Every step of a constrained batch, the host advances each row's matcher by the token it took and
computes the next (B, V/32) masks (`structured.fill_masks`), then hands them to the device. This
measures that time for B rows of a JSON schema, the rows driven by the tokens of valid documents
(what a model that follows the schema would sample), with the masks filled in parallel (llguidance's
threads) and row by row. The engine overlaps it with the forward pass, so it costs throughput only
where it exceeds a step's device time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxfun.bench.models import DTYPES, SHAPES, machine, random_params, word_tokenizer
from mlxfun.engine import sampling
from mlxfun.features import structured
from mlxfun.model.load import Model, load
from mlxfun.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.(com|org)$"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "role", "tags", "score", "address"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def documents(n: int) -> list[str]:
    """n different documents valid for SCHEMA, as the constraint writes JSON (json.dumps)."""
    first = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Ken", "Margaret"]
    last = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Thompson", "Hamilton"]
    cities = ["London", "New York", "Zurich", "Paris", "Boston", "Berlin"]
    out = []
    for i in range(n):
        f, s = first[i % len(first)], last[(3 * i + 1) % len(last)]
        out.append(json.dumps({
            "name": f"{f} {s}", "age": 20 + (7 * i) % 60, "email": f"{f.lower()}.{s.lower()}@example.org",
            "role": ["admin", "editor", "viewer", "guest"][i % 4], "tags": ["math", "code", "logic"][: 1 + i % 3],
            "score": round(12.5 + (13.7 * i) % 80, 2),
            "address": {"street": f"{10 + i} Main Street", "city": cities[i % len(cities)], "zip": f"{10000 + 37 * i}"},
        }))
    return out


@dataclass
class MaskTiming:
    rows: int
    steps: int  # steps timed (the longest document's tokens)
    parallel: bool  # masks filled by llguidance's thread pool (fill_masks), else row by row
    step_ms_mean: float  # advance every row, fill the (B, W) masks, copy them to an mx.array
    step_ms_p50: float
    step_ms_p99: float
    row_token_us: float  # mean per row and token


def mask_time(tokenizer: Tokenizer, vocab_size: int, response_format: dict, texts: list[str], rows: int,
              parallel: bool = True) -> MaskTiming:
    """Host time per decode step for `rows` rows constrained by `response_format`, row i taking the
    tokens of texts[i % len(texts)] (each must satisfy the constraint); a row that has finished
    its text stays in the batch as a free row."""
    c = structured.constraint(tokenizer, vocab_size, response_format)
    streams = [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(rows)]
    matchers: list[structured.Matcher | None] = [c.matcher(tokenizer.eos_token_ids) for _ in range(rows)]
    out = np.zeros((rows, structured.words(vocab_size)), np.uint32)
    times, row_tokens = [], 0
    for step in range(max(len(s) for s in streams) + 1):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            if m is not None and step > 0:
                m.advance(streams[i][step - 1])
                if step == len(streams[i]):
                    matchers[i] = None
        if parallel:
            structured.fill_masks(matchers, out)
        else:
            for i, m in enumerate(matchers):
                if m is None:
                    out[i] = 0xFFFFFFFF
                else:
                    m.fill_mask(out[i])
        mask = mx.array(out)
        times.append(time.perf_counter() - t0)
        row_tokens += sum(m is not None for m in matchers)
        mx.eval(mask)
    t = np.array(times)
    return MaskTiming(rows, len(t), parallel, float(t.mean() * 1e3), float(np.median(t) * 1e3),
                      float(np.percentile(t, 99) * 1e3), float(t.sum() / max(row_tokens, 1) * 1e6))


def main_engine(args) -> int:
    """Generated tokens/s and decode-step time of B rows with bench_structured's JSON schema on
    every row, against the same rows free (EOS ignored; a constrained row ends with its document).
    Free and constrained runs alternate, a warm-up pair first, then `--repeats` pairs (one process
    against another, or one run against the next, moved a step 20-30% on the H200's host);
    reported: medians of tok/s over the whole run (the admission included) and of ms per decode
    step after the admission and first step."""
    from mlxfun.engine.core import Engine
    from mlxfun.model import tokenizer as tok

    info = machine()
    print(json.dumps(info))
    if args.shape is None:
        model = load(args.model)
    else:
        folder = Path(args.tokenizer) if args.tokenizer else None
        tokenizer = tok.from_folder(folder, {}) if folder else word_tokenizer(SHAPES[args.shape].vocab_size)
        config = dataclasses.replace(SHAPES[args.shape], vocab_size=tokenizer.vocab_size)
        model = Model(config, random_params(config, DTYPES[args.base_dtype]), tokenizer, f"random {args.shape}")
    ask = "Describe a person as a JSON object with name, age, email, role, tags, score and address."
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": ask}]) if model.tokenizer.chat_template \
        else model.tokenizer.encode(ask)
    rows = []
    for B in args.batch_sizes:
        found: dict[bool, list[dict]] = {False: [], True: []}
        for repeat in range(1 + args.repeats):  # the first pair compiles
            for constrained in (False, True):
                engine = Engine(model, B)
                for i in range(B):
                    engine.add(prompt, max_tokens=args.gen_tokens, ignore_eos=True,
                               response_format=FORMAT if constrained else None,
                               settings=sampling.make_settings(1, temperature=0.7, seed=i))
                t0, decoding = time.perf_counter(), None
                for _ in engine.events():
                    if decoding is None and engine.stats.steps >= 1:  # the admission and first step are behind
                        decoding = (time.perf_counter(), engine.stats.steps)
                end, s = time.perf_counter(), engine.stats
                steps = s.steps - decoding[1] if decoding else 0
                if repeat:
                    found[constrained].append(dict(
                        tps=s.generation_tokens / (end - t0), tokens=s.generation_tokens, steps=s.steps,
                        step_ms=1e3 * (end - decoding[0]) / steps if steps else float("nan")))
        med = {c: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for c, runs in found.items()}
        mask = mask_time(model.tokenizer, model.config.vocab_size, FORMAT, documents(32), B)
        rows.append(dict(batch=B, free=med[False], constrained=med[True], runs=found,
                         mask_ms_per_step=mask.step_ms_mean, tps_ratio=med[False]["tps"] / med[True]["tps"],
                         step_ratio=med[True]["step_ms"] / med[False]["step_ms"]))
        print(f"  B={B:4d}: free {med[False]['tps']:9.1f} tok/s ({med[False]['step_ms']:.2f} ms/step), "
              f"schema {med[True]['tps']:9.1f} tok/s ({med[True]['step_ms']:.2f} ms/step); slower by "
              f"{rows[-1]['tps_ratio']:.3f}x in tok/s, {rows[-1]['step_ratio']:.3f}x per step; host masks "
              f"{mask.step_ms_mean:.2f} ms/step (medians of {args.repeats})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
        print(f"results written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from mlxfun.model.load import load

    p = argparse.ArgumentParser(prog="python -m mlxfun.bench.structured", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="model whose tokenizer is used (default: SmolLM2-135M)")
    p.add_argument("--rows", default="1,8,32", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the fastest is kept")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    model = load(args.model) if args.model else load()
    tok, vocab = model.tokenizer, model.config.vocab_size
    t0 = time.perf_counter()
    structured.constraint(tok, vocab, FORMAT)
    compile_s = time.perf_counter() - t0  # the tokenizer's trie (once per tokenizer) and the schema
    texts = documents(32)
    results = []
    print(f"{'rows':>5} {'fill':>9} {'steps':>6} {'ms/step':>8} {'p50':>7} {'p99':>7} {'us/row/token':>13}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for parallel in (True, False):
            best = min((mask_time(tok, vocab, FORMAT, texts, rows, parallel) for _ in range(args.repeats)),
                       key=lambda r: r.step_ms_mean)
            results.append(best)
            print(f"{rows:>5} {'parallel' if parallel else 'per row':>9} {best.steps:>6} {best.step_ms_mean:>8.3f} "
                  f"{best.step_ms_p50:>7.3f} {best.step_ms_p99:>7.3f} {best.row_token_us:>13.1f}")
    print(f"first compile (tokenizer trie + schema): {compile_s * 1e3:.0f} ms")
    if args.json:
        info = {"machine": platform.machine(), "processor": platform.processor(), "device": str(mx.default_device()),
                "vocab_size": vocab, "compile_s": compile_s, "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
