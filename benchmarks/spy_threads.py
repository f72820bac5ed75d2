"""Where one thread's time went, from py-spy's raw stacks (`py-spy record --threads --idle -f raw`,
as `gpu.sh serve-load` with SERVE_SPY=1 records a whole load run): the share of the matching
samples under each function (inclusive) and in each line (leaf). `--thread` picks threads by name
(say mlxfun-engine, the engine's thread in its process); `--within` keeps stacks through a
function (say Bridge._serve or offline_run) and `--without` drops others (say warm_up). Each
sample is 1 / rate seconds: compare the shares of one run's phases, not two runs' seconds.

Run: python benchmarks/spy_threads.py RAW.txt --thread mlxfun-engine --within Bridge._serve --without warm_up
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def parse(path: str):
    """-> [(thread label, [frames as "function (file:line)"], samples)]."""
    out = []
    for line in open(path, errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        parts = stack.split(";")
        k = next((i for i, p in enumerate(parts) if p.startswith("thread (")), None)
        if k is None:
            continue
        out.append((parts[k], parts[k + 1:], int(n)))
    return out


def function(frame: str) -> str:
    return re.sub(r" \(.*\)$", "", frame)


def report(stacks, thread: str, within: list[str], without: list[str], top: int) -> str:
    inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
    for label, frames, n in stacks:
        names = [function(f) for f in frames]
        if thread not in label or not all(w in names for w in within) or any(w in names for w in without):
            continue
        total += n
        leaf[frames[-1] if frames else "(no Python frame)"] += n
        for name in dict.fromkeys(names):
            inclusive[name] += n
    if not total:
        return "no samples match"
    lines = [f"{total} samples", "-- under each function"]
    lines += [f"{100 * n / total:6.1f}%  {name}" for name, n in inclusive.most_common(top)]
    lines += ["-- in each line"]
    lines += [f"{100 * n / total:6.1f}%  {name}" for name, n in leaf.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy's raw output (-f raw)")
    p.add_argument("--thread", default="", help="threads whose label contains this (default: all)")
    p.add_argument("--within", action="append", default=[], help="keep stacks through this function (repeatable)")
    p.add_argument("--without", action="append", default=[], help="drop stacks through this function (repeatable)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--threads", action="store_true", help="list the threads and their samples instead")
    args = p.parse_args(argv)
    stacks = parse(args.raw)
    if args.threads:
        counts = collections.Counter()
        for label, _, n in stacks:
            counts[label] += n
        print("\n".join(f"{n:8d}  {label}" for label, n in counts.most_common()))
        return 0
    print(report(stacks, args.thread, args.within, args.without, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
