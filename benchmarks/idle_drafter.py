"""What a draft model costs while the rule keeps speculation off (diagnostic, issue 20): plain
decoding without a drafter, with a draft model and the rule disabled, and with the rule on (which
at batch 32 and 512 tokens no longer measures), runs alternating ABC then CBA, medians and each run.

Run: python benchmarks/idle_drafter.py --shape 8B --draft-shape 1B --batch 32 --gen-tokens 512 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlxfun import bench, speculative
from mlxfun.bench_speculative import _run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8B")
    p.add_argument("--draft-shape", default="1B")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--skip-off", action="store_true", help="leave out the drafter with the rule disabled")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = bench.random_model(bench.SHAPES[args.shape])
    draft = bench.random_model(bench.SHAPES[args.draft_shape])
    prompts = bench.random_prompts(model.config.vocab_size, args.batch, args.prompt_tokens)
    variants = {
        "no drafter": lambda: _run(model, prompts, args.gen_tokens),
        "drafter, rule off": lambda: _run(model, prompts, args.gen_tokens, draft=draft,
                                          policy=speculative.Policy(enabled=False)),
        "drafter, rule on": lambda: _run(model, prompts, args.gen_tokens, draft=draft),
    }
    if args.skip_off:
        del variants["drafter, rule off"]
    for run in variants.values():  # compile
        run()
    seen: dict[str, list[float]] = {name: [] for name in variants}
    verified = []
    for rep in range(args.repeats):
        for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            engine, tps = variants[name]()
            seen[name].append(tps)
            if name == "drafter, rule on":
                verified.append(engine.stats.verify_rounds)
            print(f"  {name:18s} {tps:8.1f} tok/s, {engine.stats.verify_rounds} verify rounds", flush=True)
    base = statistics.median(seen["no drafter"])
    for name, runs in seen.items():
        med = statistics.median(runs)
        print(f"{name:18s} median {med:8.1f} tok/s ({med / base:.3f}x)  runs {' '.join(f'{t:.0f}' for t in runs)}")
    print(f"verify rounds with the rule on: {verified}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": seen,
                                               "verified": verified}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
