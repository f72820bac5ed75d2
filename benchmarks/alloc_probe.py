"""Does a new allocation stall beside a large resident pool (diagnostic, CUDA; on an H100 it did
not: 0.08-0.09 ms each, results/h100/2026-12-06-alloc-probe.json)? Each phase times
`--sizes` allocations of sizes MLX's buffer cache has never held (1-30 MB, as a prefill's
activations), each evaluated, synchronized and freed:

- alone: nothing else held;
- pool: beside `--pool-gb` of resident arrays, 2 per layer as a server's KV pool;
- pool-again: the same, new sizes (does the cost repeat?);
- keep: after `keep_freed(--headroom-gb)` (CUDA's pool keeps freed memory, headroom mapped);
- keep-again: new sizes once more.
Each of alone and pool is also measured for what a host array costs on CUDA (MLX puts arrays made on
the host in managed memory): `host` (new sizes: cudaMallocManaged), `host-reuse` (a host array
given a cached device buffer of its size: moved to managed memory by a synchronous copy),
`free-managed` (MLX's cache of managed buffers cleared: cudaFree each) and `sync` (an idle
synchronization).

Run: python benchmarks/alloc_probe.py --pool-gb 60 --json PATH
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from typing import NamedTuple

import mlx.core as mx
import numpy as np

# CUmemPool_attribute (cuda.h)
_RELEASE_THRESHOLD = 4
_RESERVED_MEM_CURRENT = 5
_USED_MEM_CURRENT = 7


class PoolStats(NamedTuple):
    reserved: int  # bytes the pool has mapped
    used: int  # bytes of it allocated


def _pool(device: int = 0):
    """The driver and device `device`'s default memory pool handle, or None without CUDA."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, pool = ctypes.c_int(), ctypes.c_void_p()
    if cuda.cuDeviceGet(ctypes.byref(dev), device) or cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev):
        return None
    return cuda, pool


def stats(device: int = 0) -> PoolStats | None:
    """What the default pool of `device` has mapped and allocated (None without CUDA)."""
    found = _pool(device)
    if found is None:
        return None
    cuda, pool = found
    values = []
    for attribute in (_RESERVED_MEM_CURRENT, _USED_MEM_CURRENT):
        value = ctypes.c_uint64()
        if cuda.cuMemPoolGetAttribute(pool, attribute, ctypes.byref(value)):
            return None
        values.append(value.value)
    return PoolStats(*values)


def keep_freed(headroom: int, device: int = 0) -> bool:
    """Make the default pool of `device` keep the memory it frees, and hold `headroom` bytes mapped
    and unused from now on (a buffer that size allocated and freed). MLX's buffer cache is cleared
    on the way. Returns whether it was done (False without CUDA)."""
    found = _pool(device)
    if found is None:
        return False
    cuda, pool = found
    keep = ctypes.c_uint64(2**64 - 1)
    if cuda.cuMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(keep)):
        return False
    if headroom > 0:
        block = mx.zeros((-(-headroom // 2**20), 2**20), mx.uint8)  # (a 1-D shape is int32: < 2 GB)
        mx.eval(block)
        del block
        mx.synchronize()
        mx.clear_cache()  # back to the pool, which now keeps it mapped
        mx.synchronize()
    return True




def timed_allocations(sizes: list[int]) -> list[float]:
    out = []
    for n in sizes:
        t = time.perf_counter()
        a = mx.zeros((n,), mx.uint8)
        mx.eval(a)
        mx.synchronize()
        out.append(time.perf_counter() - t)
        del a
    return out


def host_array(n: int) -> tuple[mx.array, float]:
    """A host array of n bytes (float32), read by a device op and synchronized -> (it, seconds)."""
    data = np.zeros(n // 4, np.float32)
    t = time.perf_counter()
    a = mx.array(data)
    mx.eval(a + 0)
    mx.synchronize()
    return a, time.perf_counter() - t


def timed_host(sizes: list[int]) -> list[float]:
    """Host arrays of new sizes (kept until the end)."""
    made = [host_array(n) for n in sizes]
    return [seconds for _, seconds in made]


def timed_host_reuse(sizes: list[int]) -> list[float]:
    """Host arrays each given the cached device buffer of a computed array of its size."""
    out = []
    for n in sizes:
        d = mx.zeros((n // 4,), mx.float32) + 1
        mx.eval(d)
        mx.synchronize()
        del d  # its buffer to MLX's cache
        out.append(host_array(n)[1])
    return out


def timed_free_managed(sizes: list[int]) -> list[float]:
    """Managed buffers of new sizes freed to MLX's cache, then the cache cleared: seconds of the clear."""
    mx.synchronize()
    mx.clear_cache()
    arrays = [mx.array(np.zeros(n // 4, np.float32)) for n in sizes]
    mx.eval(arrays)
    mx.synchronize()
    del arrays
    t = time.perf_counter()
    mx.clear_cache()
    mx.synchronize()
    return [(time.perf_counter() - t) / len(sizes)]


def timed_sync(n: int = 48) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        mx.synchronize()
        out.append(time.perf_counter() - t)
    return out


def summary(name: str, seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    pool = stats()
    return dict(phase=name, median_ms=round(float(np.median(ms)), 3), max_ms=round(float(ms.max()), 2),
                total_ms=round(float(ms.sum()), 1), over_10ms=int((ms > 10).sum()),
                reserved_gb=None if pool is None else round(pool.reserved / 1e9, 2),
                used_gb=None if pool is None else round(pool.used / 1e9, 2),
                mlx_active_gb=round(mx.get_active_memory() / 1e9, 2),
                mlx_cache_gb=round(mx.get_cache_memory() / 1e9, 2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool-gb", type=float, default=60.0)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--headroom-gb", type=float, default=4.0)
    p.add_argument("--sizes", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    phase = iter(range(100))

    def sizes() -> list[int]:  # 1-30 MB, every phase its own (7% apart: beyond MLX's 32 KB reuse)
        k = next(phase)
        return [int(2**20 * 1.07 ** (i + 0.5 * k / 5)) // 4096 * 4096 + 4096 * k for i in range(args.sizes)]

    def host_phases(label: str) -> list[dict]:
        return [summary(f"host-{label}", timed_host(sizes())),
                summary(f"host-reuse-{label}", timed_host_reuse(sizes())),
                summary(f"free-managed-{label}", timed_free_managed(sizes())),
                summary(f"sync-{label}", timed_sync())]

    phases = [summary("alone", timed_allocations(sizes())), *host_phases("alone")]
    mx.clear_cache()
    per = int(args.pool_gb * 1e9 / (2 * args.layers))
    pool = [mx.zeros((per,), mx.uint8) for _ in range(2 * args.layers)]
    mx.eval(pool)
    phases.append(summary("pool", timed_allocations(sizes())))
    phases += host_phases("pool")
    phases.append(summary("pool-again", timed_allocations(sizes())))
    t = time.perf_counter()
    kept = keep_freed(int(args.headroom_gb * 1e9))
    keep_s = time.perf_counter() - t
    phases.append(summary("keep", timed_allocations(sizes())))
    phases.append(summary("keep-again", timed_allocations(sizes())))
    for ph in phases:
        print(json.dumps(ph), flush=True)
    result = {"device": str(mx.default_device()), "args": vars(args), "kept": kept, "keep_freed_s": keep_s,
              "phases": phases}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
