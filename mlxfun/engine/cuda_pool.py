"""The CUDA memory pool under MLX's allocator, told to keep what it frees and grown once at start.

MLX allocates device memory with `cudaMallocAsync` from the device's default pool, and keeps
freed buffers in a cache of its own that reuses a buffer only for a size within 32 KB of it. Each
new activation size is therefore a new allocation, and the pool maps fresh memory for it when it
holds none unused. With the default release threshold (0) the pool hands unused memory back at
every synchronization, so a server meets that mapping again and again. A server's engine keeps
the pool's freed memory (release threshold: all of it) and reserves headroom once at start,
after its KV pool, so that the allocations of later admissions come from memory already mapped.

This talks to the CUDA driver (`libcuda.so.1`, which any CUDA process has) through ctypes;
elsewhere (the CPU, Metal, no driver) every function does nothing and says so.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import mlx.core as mx

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
