"""Run `mlxfun.bench` with the few-row dense product on and `dmv.TUNED` replaced by the
launches that `kernels_check.py --time-dmv` timed fastest, to measure a tuning before writing it
into `mlxfun.dmv`.

Run:  python benchmarks/dmv_tuned.py TIMINGS.json -- <mlxfun.bench arguments>
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from mlxfun import bench, dmv


def tuned(timings: list[dict]) -> dict:
    """kernels_check's timings -> `dmv.TUNED`'s layout: (OUT, IN) -> the launch with the least
    time summed over the row counts timed (one launch serves every row count: the tensor cores
    take 8 rows at once)."""
    totals: dict = defaultdict(lambda: defaultdict(float))
    for t in timings:
        for launch, us in t["dmv_us"].items():
            totals[(t["OUT"], t["IN"])][launch] += us
    return {shape: tuple(map(int, min(by, key=by.get).split(","))) for shape, by in totals.items()}


def main(argv: list[str]) -> int:
    path, rest = argv[0], argv[argv.index("--") + 1:]
    dmv.ENABLED = True
    dmv.TUNED = tuned(json.load(open(path))["dmv_timings"])
    print("TUNED =", dmv.TUNED, flush=True)
    return bench.main(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
