"""Probe (GPU): a host-written mask read by the device, three ways. us per step, medians:
- fresh: `mx.array(host)` each step (managed memory the device then pulls over);
- in place: one MLX array written through a NumPy view of its memory each step;
- mapped: `mapped.HostArray`, its pages advised to stay on the host and be mapped for the device
  (cudaMemAdvise: preferred location the CPU, accessed by device 0), so the device reads them
  over the link instead of migrating them.
Each step writes the rows, then evaluates a reduction over the array and checks its value.

Run: PYTHONPATH=. python benchmarks/mapped_masks.py [--rows 1,32,128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxfun.mapped import HostArray


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,32,128")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    for rows in map(int, args.rows.split(",")):
        W = 1536
        rng = np.random.default_rng(rows)
        host = rng.integers(0, 2 ** 32, (rows, W), dtype=np.uint32)

        def timed(step):
            ts = []
            for i in range(args.steps + 5):
                host[:, 0] = i
                t = time.perf_counter()
                got = step()
                ts.append(time.perf_counter() - t)
                assert got == int((host & 1).sum()), (got, int((host & 1).sum()))
            return statistics.median(ts[5:]) * 1e6

        def fresh():
            return mx.sum(mx.array(host) & 1).item()

        res = {"fresh_us": timed(fresh)}
        arr = mx.zeros((rows, W), mx.uint32)
        mx.eval(arr)
        view = np.asarray(arr)  # the same memory, not advised

        def in_place():
            view[:] = host
            return mx.sum(arr & 1).item()

        res["in_place_us"] = timed(in_place)
        buffer = HostArray((rows, W), np.uint32, 0, mapped=True)
        res["mapped"] = buffer.mapped

        def mapped():
            buffer.host[:] = host
            return mx.sum(buffer.device() & 1).item()

        res["mapped_us"] = timed(mapped)
        print(rows, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
