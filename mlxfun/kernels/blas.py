"""A system BLAS for MLX's CPU backend on Linux, chosen by the environment at import.

MLX's Linux CPU wheel bundles the reference BLAS, whose float32 product costs the same per row at
any batch size. An optimised BLAS loaded into the process before MLX takes over its BLAS calls
(measured with Debian's OpenBLAS on 2 cores: 2.6x at one row, 10-20x at 8 to 128; SmolLM2 4-bit
decodes 1.8-5.3x mlx-lm's speed as a dense copy; 7fbc90b:benchmarks/README.md). It must be loaded before
`mlx.core` is imported, so it is chosen by the environment, not by an argument:

    python -m mlxfun generate ...                          # a system OpenBLAS if there is one
    MLXFUN_BLAS=bundled python -m mlxfun generate ...      # MLX's own: exact across batch sizes
    MLXFUN_BLAS=openblas python ...                        # OpenBLAS, or an error naming where it looked
    MLXFUN_BLAS=/path/to/libopenblas.so.0 python ...

The trade-off: OpenBLAS picks kernels by row count, so a prompt alone and in a batch may differ in
the last bits of their logits (SmolLM2, six prompts: decode log-probs within 1.1e-5, scoring equal),
and a near tie can flip a greedy token; `bundled` keeps batched == alone exact in float32.

A library that cannot be loaded is reported by `check()`, which `load` and every command call
first, so the command line prints one line naming the variable instead of an import traceback.
"""

from __future__ import annotations

import ctypes
import os
import sys

from mlxfun.errors import MlxfunError

ENV = "MLXFUN_BLAS"
# Where Debian and Ubuntu install OpenBLAS (libopenblas0-pthread / -openmp / -serial).
OPENBLAS = tuple(f"/usr/lib/{arch}-linux-gnu/{flavour}/libopenblas.so.0"
                 for arch in ("x86_64", "aarch64") for flavour in ("openblas-pthread", "openblas-openmp",
                                                                   "openblas-serial")) + (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0")


def resolve(spec: str) -> str | None:
    """The library path `spec` names: a path, "openblas" for the first system OpenBLAS found, ""
    (unset) for that OpenBLAS if there is one, or None for MLX's own ("bundled", or nothing found)."""
    if spec == "bundled" or (not spec and not any(os.path.exists(p) for p in OPENBLAS)):
        return None
    if spec in ("", "openblas"):
        for path in OPENBLAS:
            if os.path.exists(path):
                return path
        raise MlxfunError(f"{ENV}=openblas but no OpenBLAS was found (looked in {', '.join(OPENBLAS[:3])}, ...); "
                          "install libopenblas0-pthread or give the library's path")
    if not os.path.isfile(spec):
        raise MlxfunError(f"{ENV}={spec!r}: no such file (give a BLAS shared library's path, or 'openblas')")
    return spec


def load_from_environment() -> str | None:
    """Load the library $MLXFUN_BLAS names (unset: a system OpenBLAS if there is one), globally,
    before MLX. -> its path, or None for MLX's own."""
    spec = os.environ.get(ENV, "").strip()
    path = resolve(spec)
    if path is None:
        return None
    if "mlx.core" in sys.modules and os.path.realpath(path) not in loaded_libraries():
        if not spec:  # nobody asked for it: MLX keeps its own
            return None
        raise MlxfunError(f"{ENV} is set but mlx was imported before mlxfun, too late to change its BLAS: "
                          "import mlxfun first, or preload the library with LD_PRELOAD")
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise MlxfunError(f"{ENV}={spec!r}: cannot load {path}: {e}") from None
    return path


def loaded_libraries() -> set[str]:
    """Real paths of the files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return {os.path.realpath(p) for p in (line.split()[-1] for line in f) if p.startswith("/")}
    except OSError:
        return set()


def _load_or_problem() -> tuple[str | None, MlxfunError | None]:
    try:
        return load_from_environment(), None
    except MlxfunError as e:
        return None, e


def check() -> None:
    """Raise the error met loading $MLXFUN_BLAS at import, if any."""
    if PROBLEM is not None:
        raise PROBLEM


# Set once, at import, from the environment: the BLAS library in use (None for MLX's own), and the
# error that kept the asked-for one from loading.
LOADED, PROBLEM = _load_or_problem()
