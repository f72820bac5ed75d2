"""Grammar engines for structured output, side by side on SmolLM2's tokenizer (49152 tokens):
compile time and per-token host time (mask + advance) of llguidance (mlxfun's choice) and
outlines-core, when importable, driven by the tokens of valid documents for one JSON schema.
xgrammar is not measured: its wheel requires torch, transformers and triton.

    python benchmarks/structured_engines.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from mlxfun import structured
from mlxfun.bench_structured import FORMAT, SCHEMA, documents
from mlxfun.load import load


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def per_token(fill, advance, ids: list[int]) -> list[float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        advance(t)
        times.append(time.perf_counter() - t0)
    return times


def run_llguidance(tok, vocab, texts):
    t0 = time.perf_counter()
    structured.constraint(tok, vocab, FORMAT)  # the tokenizer's trie, then the schema
    first = time.perf_counter() - t0
    schema2 = {**FORMAT, "json_schema": {"name": "other", "schema": {**SCHEMA, "title": "x"}}}
    t0 = time.perf_counter()
    c = structured.constraint(tok, vocab, schema2)  # a new schema, the trie cached
    compile_s = time.perf_counter() - t0
    times = []
    row = np.zeros(structured.words(vocab), np.uint32)
    for text in texts:
        m = c.matcher(tok.eos_token_ids)
        times += per_token(lambda: m.fill_mask(row), m.advance, tok.encode(text, add_special_tokens=False))
    return {"engine": "llguidance", "setup_s": first - compile_s, "compile_s": compile_s, "times": times}


def run_outlines(tok, vocab, texts):
    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    t0 = time.perf_counter()
    decode, eos, vmap = byte_decoder(), min(tok.eos_token_ids), {}
    for i in range(vocab):
        if i not in tok.eos_token_ids:
            s = tok.token(i)
            key = bytes(decode[ch] for ch in s) if all(ch in decode for ch in s) else s.encode()
            vmap.setdefault(key, []).append(i)
    vocabulary = oc.Vocabulary(eos, vmap)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"( )?")  # json.dumps's single spaces
    index = oc.Index(regex, vocabulary)
    compile_s = time.perf_counter() - t0
    mask = np.zeros((1, structured.words(vocab)), np.int32)
    times = []
    for text in texts:
        guide = oc.Guide(index)
        times += per_token(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize), guide.advance,
                           tok.encode(text, add_special_tokens=False))
    return {"engine": "outlines-core", "setup_s": setup, "compile_s": compile_s, "times": times}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = load()
    tok, vocab = model.tokenizer, model.config.vocab_size
    texts = documents(16)
    rows = [r for r in (run_llguidance(tok, vocab, texts), run_outlines(tok, vocab, texts)) if r is not None]
    print(f"{'engine':>14} {'setup s':>8} {'compile ms':>11} {'us/token p50':>13} {'mean':>7} {'p99':>7} {'max':>7}")
    for r in rows:
        t = np.array(r.pop("times")) * 1e6
        r.update(p50_us=float(np.median(t)), mean_us=float(t.mean()), p99_us=float(np.percentile(t, 99)),
                 max_us=float(t.max()), tokens=len(t))
        print(f"{r['engine']:>14} {r['setup_s']:>8.2f} {r['compile_s'] * 1e3:>11.1f} {r['p50_us']:>13.1f} "
              f"{r['mean_us']:>7.1f} {r['p99_us']:>7.1f} {r['max_us']:>7.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
