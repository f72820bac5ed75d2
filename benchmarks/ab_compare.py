"""Ratios of this tree's `mlxfun bench` results to a reference tree's, from the JSON files that
`benchmarks/gpu.sh ab-static ab-continuous` writes (named ab-KIND-SHAPE-{ours,ref}[-N].json).

    python benchmarks/ab_compare.py OUT/ab-*.json [--json ratios.json]

Several runs of one code are reduced by their median. Speeds are ours / ref (above 1: this tree
is faster); peaks are ours / ref (below 1: this tree holds less).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"ab-(?P<kind>static|continuous)-(?P<shape>[^-]+)-(?P<who>ours|ref)")


def load(paths: list[Path]) -> dict:
    """-> {(kind, shape): {who: [result, ...]}}"""
    found: dict = defaultdict(lambda: defaultdict(list))
    for p in paths:
        m = NAME.search(p.name)
        if m:
            found[m["kind"], m["shape"]][m["who"]].append(json.loads(p.read_text()))
    return found


def static_ratios(runs: dict) -> list[dict]:
    def medians(results: list[dict]) -> dict:
        by = defaultdict(lambda: defaultdict(list))
        for r in results:
            for row in r["rows"]:
                for key in ("prompt_tps", "gen_tps", "peak_gb"):
                    by[row["weights"], row["batch"]][key].append(row[key])
        return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in by.items()}

    ours, ref = medians(runs["ours"]), medians(runs["ref"])
    return [dict(weights=w, batch=b, runs=(len(runs["ours"]), len(runs["ref"])),
                 gen_tps=ours[w, b]["gen_tps"], ref_gen_tps=ref[w, b]["gen_tps"],
                 gen=ours[w, b]["gen_tps"] / ref[w, b]["gen_tps"],
                 prompt=ours[w, b]["prompt_tps"] / ref[w, b]["prompt_tps"],
                 peak=ours[w, b]["peak_gb"] / ref[w, b]["peak_gb"])
            for w, b in sorted(ours) if (w, b) in ref]


def continuous_ratios(runs: dict) -> list[dict]:
    def med(who: str, key: str) -> float:
        return statistics.median(r["result"][key] for r in runs[who])

    return [dict(runs=(len(runs["ours"]), len(runs["ref"])), continuous_s=med("ours", "continuous_s"),
                 ref_continuous_s=med("ref", "continuous_s"),
                 continuous=med("ref", "continuous_s") / med("ours", "continuous_s"),
                 static=med("ref", "static_s") / med("ours", "static_s"))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--json", type=Path, default=None, help="write the ratios here")
    args = p.parse_args(argv)
    out = {}
    for (kind, shape), runs in sorted(load(args.files).items()):
        if not runs["ours"] or not runs["ref"]:
            continue
        rows = static_ratios(runs) if kind == "static" else continuous_ratios(runs)
        out[f"{kind}-{shape}"] = rows
        print(f"{kind} {shape} (runs ours/ref: {rows[0]['runs']})")
        for r in rows:
            if kind == "static":
                print(f"  {r['weights']:>9} batch {r['batch']:4d}: generated {r['gen']:.3f}x "
                      f"({r['gen_tps']:.1f} vs {r['ref_gen_tps']:.1f} tok/s), prompt {r['prompt']:.3f}x, "
                      f"peak {r['peak']:.3f}x")
            else:
                print(f"  continuous {r['continuous']:.3f}x ({r['continuous_s']:.2f} vs {r['ref_continuous_s']:.2f} s),"
                      f" static batches {r['static']:.3f}x (speed, ours / ref)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
