"""`mapped.HostArray`: the host writes `host` and the device reads `device()`. On the CPU (as on a
GPU with the pages mapped) it is one array written in place; asked for copies, `device()` is a
copy of what the host wrote, as `mx.array` makes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxfun.kernels.mapped import HostArray


def test_in_place_the_device_reads_what_the_host_wrote_last():
    buffer = HostArray((3, 5), np.uint32, 0xFFFFFFFF)
    assert buffer.mapped and buffer.device() is buffer.device()  # one array, never copied
    assert buffer.host.shape == (3, 5) and buffer.host.dtype == np.uint32 and (buffer.host == 0xFFFFFFFF).all()
    for step in range(3):  # as the engine: write, queue a read, wait for it, write again
        buffer.host[1] = np.arange(5, dtype=np.uint32) + step
        total = mx.sum(buffer.device() & 0xFF)
        assert total.item() == 2 * 5 * 0xFF + sum(range(5)) + 5 * step


def test_asked_for_copies_the_device_array_keeps_what_it_had():
    buffer = HostArray((3, 5), np.uint32, 0xFFFFFFFF, mapped=False)
    assert not buffer.mapped
    buffer.host[1] = np.arange(5, dtype=np.uint32)
    first = buffer.device()
    buffer.host[1] = 7  # written after: the array taken before keeps what it had
    assert first.dtype == mx.uint32 and first.tolist()[1] == [0, 1, 2, 3, 4]
    assert buffer.device().tolist()[1] == [7] * 5


def test_each_dtype_is_kept_in_place():
    for dtype, mx_dtype in ((np.bool_, mx.bool_), (np.int32, mx.int32), (np.uint32, mx.uint32)):
        buffer = HostArray((2, 3), dtype, 0)
        buffer.host[0, 1] = 1
        assert buffer.device().dtype == mx_dtype and buffer.device().tolist() == [[0, 1, 0], [0, 0, 0]]
