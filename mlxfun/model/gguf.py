"""A bounds-checked walk over a GGUF file's layout, run before `mx.load` reads it.

MLX's GGUF parser trusts the file: a corrupt header or tensor table can crash the process
(a segmentation fault, not an exception). This walk reads the same structure with every length
checked, and names tensors whose type mlxfun cannot use, so the loader can raise ModelError instead.
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from mlxfun.errors import ModelError

# ggml tensor types mlxfun reads -> (name, values per block, bytes per block). mx.load returns
# Q4_0 / Q4_1 / Q8_0 as MLX-quantized weight/scales/biases triples.
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16"}
# Metadata value types -> struct format (8: string, 9: array are variable-sized).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def check(path: Path) -> None:
    """Raise ModelError unless `path` is a structurally sound GGUF whose tensors mlxfun can read."""
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path} is not a GGUF file: {size} bytes")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            _walk(path, buf, size)
        except struct.error:  # a read past the end of the file
            raise ModelError(f"{path} is truncated or corrupt: its GGUF layout runs past the end of the file "
                             "(an incomplete download?)") from None


def _walk(path: Path, buf, size: int) -> None:
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    if version not in (2, 3):
        raise ModelError(f"{path}: unsupported GGUF version {version} (mlxfun reads versions 2 and 3)")
    if n_tensors > size // 24 or n_kv > size // 12:
        raise ModelError(f"{path} is truncated or corrupt: {size} bytes cannot hold the {n_tensors} tensors and "
                         f"{n_kv} metadata entries it announces")
    pos, alignment = 24, 32

    def string(pos: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > size:
            raise struct.error
        return bytes(buf[pos + 8: pos + 8 + n]), pos + 8 + n

    def value(kind: int, pos: int, key: bytes) -> int:
        if kind in _SCALARS:
            return pos + struct.calcsize(_SCALARS[kind])
        if kind == 8:
            return string(pos)[1]
        if kind != 9:
            raise ModelError(f"{path} is corrupt: metadata {key.decode(errors='replace')!r} has type {kind}")
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALARS:
            return pos + count * struct.calcsize(_SCALARS[item])
        if item != 8:
            raise ModelError(f"{path} is corrupt: metadata {key.decode(errors='replace')!r} is an array of type {item}")
        if count > size:
            raise struct.error
        for _ in range(count):  # strings: skip each by its length
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            if pos > size:
                raise struct.error
        return pos

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        if key == b"general.alignment" and kind == 4:
            alignment = max(1, struct.unpack_from("<I", buf, pos + 4)[0])
        pos = value(kind, pos + 4, key)

    extents = []
    for _ in range(n_tensors):
        raw_name, pos = string(pos)
        name = raw_name.decode(errors="replace")
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= n_dims <= 4:
            raise ModelError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
        *dims, kind, offset = struct.unpack_from(f"<{n_dims}QIQ", buf, pos + 4)
        pos += 4 + 8 * n_dims + 12
        if kind not in TENSOR_TYPES:
            supported = ", ".join(t[0] for t in TENSOR_TYPES.values())
            raise ModelError(f"{path}: tensor {name!r} has GGUF type {OTHER_TYPES.get(kind, kind)}, "
                             f"which mlxfun cannot read (supported: {supported})")
        type_name, block, block_bytes = TENSOR_TYPES[kind]
        if dims[0] % block:
            raise ModelError(f"{path} is corrupt: tensor {name!r} of type {type_name} has rows of {dims[0]}")
        extents.append((name, offset, math.prod(dims) // block * block_bytes))
    data_start = -(-pos // alignment) * alignment
    for name, offset, nbytes in extents:
        if data_start + offset + nbytes > size:
            raise ModelError(f"{path} is truncated: tensor {name!r} runs past the end of the file "
                             "(an incomplete download?)")
