"""What a sampling step costs with top-k 50 and top-p 0.9: `mlxfun.engine.sampling.sample` (a
threshold search, no sort) against the sort it replaced (`--ref DIR`: a tree whose
`mlxfun/sampling.py` or `mlxfun/engine/sampling.py` still sorts, e.g. commit 7fbc90b in .ab/ref),
compiled, at a vocabulary of 128,256 and 1 to 128 rows. Also the first call of each (on CUDA,
MLX builds a sort's kernels when it first meets them) and whether both keep the same tokens.

    python benchmarks/sampling_search.py [--ref .ab/ref] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import mlx.core as mx

from mlxfun.engine import sampling


def load_ref(root: str):
    for rel in ("mlxfun/engine/sampling.py", "mlxfun/sampling.py"):
        path = Path(root) / rel
        if path.exists():
            spec = importlib.util.spec_from_file_location("ref_sampling", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"no sampling module under {root}")


def timed(fn, *args, n: int = 20) -> tuple[float, float, mx.array]:
    """-> (first call s, mean later call s, output)."""
    t = time.perf_counter()
    out = fn(*args)
    mx.eval(out)
    first = time.perf_counter() - t
    for _ in range(3):
        mx.eval(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(fn(*args))
    return first, (time.perf_counter() - t) / n, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default=None, help="a tree whose sampling still sorts")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ref = load_ref(args.ref) if args.ref else None
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (mx.random.normal((rows, args.vocab), key=mx.random.key(rows)) * 4).astype(mx.bfloat16)
        new_settings = sampling.make_settings(rows, temperature=0.8, top_p=0.9, top_k=50, seed=list(range(rows)))
        step = mx.zeros((rows,), mx.int32)
        new = mx.compile(lambda x, s, t: sampling.sample(x, s, t, search=sampling.Search.ALL))
        first, each, tokens = timed(new, logits, new_settings, step)
        row = dict(rows=rows, vocab=args.vocab, search_first_s=first, search_ms=each * 1e3)
        if ref is not None:
            ref_settings = ref.make_settings(rows, temperature=0.8, top_p=0.9, top_k=50, seed=list(range(rows)))
            old = mx.compile(lambda x, s, t: ref.sample(x, s, t, sort=True))
            first, each, ref_tokens = timed(old, logits, ref_settings, step)
            row.update(sort_first_s=first, sort_ms=each * 1e3, same_tokens=bool(mx.all(tokens == ref_tokens).item()))
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
