"""`mapped.HostArray`: where the device cannot read host memory in place (the CPU here, or no CUDA
runtime), `device()` is a copy of what the host wrote, as `mx.array` makes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxfun.mapped import HostArray


@pytest.mark.parametrize("ask", [None, True])
def test_off_the_gpu_the_device_array_is_a_copy_of_the_host_one(ask):
    buffer = HostArray((3, 5), np.uint32, 0xFFFFFFFF, mapped=ask)
    assert not buffer.mapped  # the CPU backend: nothing to map, whatever was asked
    assert buffer.host.shape == (3, 5) and buffer.host.dtype == np.uint32
    assert (buffer.host == 0xFFFFFFFF).all()
    buffer.host[1] = np.arange(5, dtype=np.uint32)
    first = buffer.device()
    buffer.host[1] = 7  # written after: the array taken before keeps what it had
    assert first.dtype == mx.uint32 and first.tolist()[1] == [0, 1, 2, 3, 4]
    assert buffer.device().tolist()[1] == [7] * 5
