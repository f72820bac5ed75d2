"""Arrays the host writes and the device reads in place: structured output's token masks.

MLX's CUDA arrays live in managed memory, so a kernel that reads an array the host has just
written first migrates its pages to the device: on an H200, 0.16 ms for one row's mask (6 KB)
and 0.6 ms for 32 rows', against 0.05 ms for the same read of a device-resident array
(7fbc90b:benchmarks/README.md, twelfth session). A constrained decode step uploads fresh masks every
step, and its sampling waits for them. A `HostArray` is one MLX array whose pages are advised to
stay on the host and to be mapped for the device (cudaMemAdvise), written in place through a
NumPy view: the device reads it over the link, without migrating anything. On the CPU the array's
memory is the host's: it is written in place the same way, which saves the copy, and lets the
CPU tests run the protocol the GPU runs.

Writing into an MLX array is outside MLX's model (arrays are immutable), so the owner must write
`host` only while nothing queued reads it: the engine fills a step's masks after reading the
tokens of the step that read the last ones. Where mapping is not available (a GPU without a CUDA
runtime to call: written in place unadvised, 32 rows' masks cost more than a copy), `device()`
returns a fresh copy of `host`, as `mx.array` does.
"""

from __future__ import annotations

import ctypes
import weakref
from functools import lru_cache

import mlx.core as mx
import numpy as np

# cudaMemoryAdvise values (each unset is its set + 1), and cudaMemLocationType's (CUDA 13 takes a
# location, CUDA 12 a device).
_PREFERRED_LOCATION, _ACCESSED_BY = 3, 5
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_CPU_DEVICE_ID = -1


class HostArray:
    """A (shape) array: the host writes `host` (NumPy), the device reads `device()`."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, fill: int, mapped: bool = True):
        """`mapped=False`: always copies (measurements)."""
        self.array: mx.array | None = None
        if mapped:
            array = mx.array(np.full(shape, fill, dtype))  # (mx.full(.., 0, dtype=mx.bool_) gives int32)
            mx.eval(array)
            view = np.asarray(array)
            gpu = mx.default_device() == mx.gpu
            if view.flags.writeable and view.flags.c_contiguous and (not gpu or _advise(view.ctypes.data, view.nbytes)):
                self.array, self.host = array, view
                if gpu:  # its memory returns to MLX's buffer cache with the array: migratable again by then
                    weakref.finalize(self, _advise, view.ctypes.data, view.nbytes, False)
        if self.array is None:
            self.host = np.full(shape, fill, dtype)

    @property
    def mapped(self) -> bool:
        return self.array is not None

    def device(self) -> mx.array:
        """The array as the device reads it now: itself where mapped, else a copy of `host`."""
        return self.array if self.array is not None else mx.array(self.host)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def _advise(ptr: int, size: int, keep: bool = True) -> bool:
    """Keep [ptr, ptr + size) on the host, mapped for device 0 (`keep`; else undo it); False where
    that fails."""
    runtime = _mem_advise()
    if runtime is None:
        return False
    f, where, by = runtime
    undo = 0 if keep else 1
    return f(ptr, size, _PREFERRED_LOCATION + undo, where) == 0 and f(ptr, size, _ACCESSED_BY + undo, by) == 0


@lru_cache(maxsize=1)
def _mem_advise():
    """(cudaMemAdvise, the host's location, device 0's) from the CUDA runtime MLX loaded (else the
    system's), or None."""
    names = []
    try:
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    for name in names + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int()
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            return None
        f = lib.cudaMemAdvise
        if version.value >= 13000:
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Location]
            return f, _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, 0)
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        return f, _CPU_DEVICE_ID, 0
    return None
