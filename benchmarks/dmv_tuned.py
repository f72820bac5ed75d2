"""Run `mlxfun.bench` with the few-row dense product on and `dmv.TUNED` replaced by the launches
that `kernels_check.py --time-dmv` timed fastest, to measure a tuning before writing it into
`mlxfun.dmv`.

Run:  python benchmarks/dmv_tuned.py TIMINGS.json -- <mlxfun.bench arguments>
"""

from __future__ import annotations

import json
import sys

from mlxfun import bench, dmv


def tuned(timings: list[dict]) -> dict:
    """kernels_check's timings -> `dmv.TUNED`'s layout: (OUT, IN) -> the best launch at each of `dmv.TUNED_ROWS`."""
    best = {(t["OUT"], t["IN"], t["M"]): tuple(map(int, t["best"].split(","))) for t in timings}
    shapes = {(o, i) for o, i, _ in best}
    return {s: tuple(best[(*s, m)] for m in dmv.TUNED_ROWS) for s in shapes
            if all((*s, m) in best for m in dmv.TUNED_ROWS)}


def main(argv: list[str]) -> int:
    path, rest = argv[0], argv[argv.index("--") + 1:]
    dmv.ENABLED = True
    dmv.TUNED = tuned(json.load(open(path))["dmv_timings"])
    return bench.main(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
