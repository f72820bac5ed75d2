"""Run `mlxfun.bench` with the few-row dense product on, each shape at the launch that
`kernels_check.py --time-dmv` timed fastest (the nearest timed row count), to measure a launch
rule before writing it into `mlxfun.dmv.launch_for`.

Run:  python benchmarks/dmv_tuned.py TIMINGS.json -- <mlxfun.bench arguments>
"""

from __future__ import annotations

import json
import sys

from mlxfun import bench, dmv


def rule(timings: list[dict]):
    best = {(t["M"], t["OUT"], t["IN"]): dmv.Launch(*map(int, t["best"].split(","))) for t in timings}

    def launch_for(rows: int, out_features: int, in_features: int) -> dmv.Launch:
        timed = [m for m, o, i in best if (o, i) == (out_features, in_features)]
        if not timed:
            return dmv.Launch()
        m = min(timed, key=lambda m: abs(m - rows))
        return best[m, out_features, in_features]
    return launch_for


def main(argv: list[str]) -> int:
    path, rest = argv[0], argv[argv.index("--") + 1:]
    dmv.ENABLED = True
    dmv.launch_for = rule(json.load(open(path))["dmv_timings"])
    return bench.main(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
