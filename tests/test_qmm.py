"""The tiled tensor-core product (`mlxfun.kernels.qmm`) through the CUDA emulator: 4-bit, 8-bit and
dense weights against float64 references, tiles past the rows and features, several steps of
inputs (more than the ring's stages), and a row's bits the same in any batch. (Nothing calls it by
default.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cuda_emulator import QMM_HEADER, run
from test_kernels import quantized_case

from mlxfun.kernels import qmm

SMALL = qmm.Tile(16, 32, 1)  # 2 warps: an emulated block is one OS thread per CUDA thread


def emulated(inputs: dict, bits: int, group_size: int, shape: qmm.Tile, split: int = 1) -> np.ndarray:
    M, OUT = inputs["x"].shape[0], inputs["w"].shape[0]
    threads, block = qmm.grid(OUT, M, shape, split)  # as qmm launches it
    source = qmm.SOURCES[bits == 16, split > 1]
    template = qmm.template(0, bits, group_size, shape)
    outputs = {"y": (M, OUT)}
    if split > 1:  # partial sums and a counter per tile, as qmm launches it (zeroed)
        outputs |= {"part": (split, M, OUT), "count": (-(-M // shape.rows) * -(-OUT // shape.features),)}
    return run(source, inputs, outputs, template, threads, block, header=QMM_HEADER,
               output_dtypes={"count": np.int32}, shared_memory=qmm.shared_bytes(bits, shape))[0]


@pytest.mark.parametrize("M,OUT,IN,group_size,bits,shape", [
    (5, 40, 128, 64, 4, SMALL),  # rows and features past the tile; two steps of 64 inputs
    (20, 33, 192, 32, 4, SMALL),  # two block rows, the second part-filled; groups of 32
    (9, 70, 256, 128, 4, qmm.Tile(16, 64, 2)),  # a warp of two feature groups; groups of 128 span two steps
    (3, 50, 128, 64, 8, SMALL),  # 8-bit: 4 values a word
    (17, 24, 64, 32, 8, qmm.Tile(32, 32, 2)),  # one warp for the block's 32 features, 4 row tiles
])
def test_emulated_qmm_matches_reference(M, OUT, IN, group_size, bits, shape):
    inputs, want = quantized_case(M, OUT, IN, group_size, seed=M * OUT + IN + bits, bits=bits)
    np.testing.assert_allclose(emulated(inputs, bits, group_size, shape), want, atol=1e-5)


@pytest.mark.parametrize("M,OUT,IN,shape", [(5, 40, 128, SMALL), (20, 33, 192, qmm.Tile(16, 64, 2))])
def test_emulated_dense_tiled_matches_reference(M, OUT, IN, shape):
    rng = np.random.default_rng(M + OUT)
    x = rng.standard_normal((M, IN)).astype(np.float32)
    w = (rng.standard_normal((OUT, IN)) * IN**-0.5).astype(np.float32)
    got = emulated(dict(x=x, w=w), 16, 32, shape)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), atol=1e-5)


@pytest.mark.parametrize("M,OUT,IN,bits,split", [(5, 40, 256, 4, 2), (20, 33, 512, 4, 4), (3, 50, 256, 16, 4),
                                                 (9, 24, 256, 8, 2)])
def test_emulated_split_inputs_match_reference(M, OUT, IN, bits, split):
    """The inputs in S splits: each block's partial sums, then the last block of a tile adds them
    (several tiles along both axes, rows and features past the tiles, 4-, 8-bit and dense)."""
    if bits == 16:
        rng = np.random.default_rng(M + OUT + IN)
        x = rng.standard_normal((M, IN)).astype(np.float32)
        w = (rng.standard_normal((OUT, IN)) * IN**-0.5).astype(np.float32)
        inputs, want = dict(x=x, w=w), x.astype(np.float64) @ w.T.astype(np.float64)
    else:
        inputs, want = quantized_case(M, OUT, IN, 64, seed=M * OUT + IN + split, bits=bits)
    np.testing.assert_allclose(emulated(inputs, bits, 64, SMALL, split), want, atol=1e-5)


def test_splits_follow_the_map_and_the_blocks():
    """Splits bring a launch toward 264 blocks, each of at least 4 steps of 64 inputs: the 1B's
    2,048 x 2,048 map (16 blocks of features) 8 splits of 256 inputs; an 8B MLP map with as many
    blocks as wanted, none; more row blocks, fewer splits (the invariant mode asks with one)."""
    assert qmm.splits(2048, 2048, 1) == 8
    assert qmm.splits(4096, 14336, 1) == 8  # 32 blocks x 8; 224 steps of 64, 28 a split
    assert qmm.splits(28672, 4096, 1) == 1  # 224 blocks already
    assert qmm.splits(2048, 2048, 8) == 2 and qmm.splits(2048, 2048, 32) == 1
    assert qmm.splits(2048, 192, 1) == 1  # 3 steps: no split of 4


def test_emulated_qmm_row_is_the_same_bits_in_any_batch():
    """A row alone and inside batches of 2-40 rows, at any place and in any tile shape, gives the
    same bits: each output's sum runs over the inputs in a fixed order (steps of 64, four mma each),
    at one split as at three (the splits follow the map alone in the invariant mode)."""
    inputs, _ = quantized_case(40, 20, 192, 64, seed=11)
    x = inputs["x"]
    alone = np.concatenate([emulated({**inputs, "x": x[i:i + 1]}, 4, 64, SMALL) for i in (0, 17, 39)])
    for M, shape in ((2, SMALL), (17, qmm.Tile(16, 64, 2)), (40, qmm.Tile(32, 32, 2))):
        places = {0: 0, M - 1: 2, **({M // 2: 1} if M > 2 else {})}  # place in the batch -> row of `alone`
        batch = x[:M].copy()
        batch[list(places)] = x[[(0, 17, 39)[i] for i in places.values()]]
        got = emulated({**inputs, "x": batch}, 4, 64, shape)
        for place, i in places.items():
            assert np.array_equal(got[place], alone[i]), (M, place)
    alone = np.concatenate([emulated({**inputs, "x": x[i:i + 1]}, 4, 64, SMALL, 3) for i in (0, 39)])
    got = emulated(inputs, 4, 64, qmm.Tile(32, 32, 2), 3)
    assert np.array_equal(got[[0, 39]], alone)


def test_qmm_tiles_and_limits():
    """Tiles of 16, 32 or 64 rows (ldmatrix reads rows 16 at a time), 128 features in 4 warps of two
    groups of 16; a ring of stages within an H100's 227 KB of shared memory a block; grids of a
    block per 128 features and per tile of rows; inputs in whole steps of 64."""
    assert [qmm.tile(m).rows for m in (1, 16, 17, 32, 33, 64, 65, 4096)] == [16, 16, 32, 32, 64, 64, 64, 64]
    assert all(qmm.tile(m)[1:] == (128, 2) and qmm.tile(m).threads == 128 for m in (1, 64, 4096))
    # stage: x (BM x 64 x 2 bytes) and W (4-bit: 128 rows of 8 + 4 words; 8-bit: 16 + 4; dense: 64 values)
    assert qmm.shared_bytes(4, qmm.tile(64)) == qmm.STAGES * (64 * 128 + 128 * 12 * 4)
    assert qmm.shared_bytes(8, qmm.tile(16)) == qmm.STAGES * (16 * 128 + 128 * 20 * 4)
    assert max(qmm.shared_bytes(bits, qmm.tile(64)) for bits in (4, 8, 16)) <= 227 * 1024
    assert qmm.grid(300, 130, qmm.tile(130)) == ((3 * 128, 3, 1), 128)
    assert qmm.fits(4096, 4096, 64, 4, mx.bfloat16) and qmm.fits(1, 576, 32, 8, mx.float16)
    assert qmm.fits(7, 2048, 0, 16, mx.bfloat16)
    assert not qmm.fits(8, 4096, 64, 4, mx.float32)  # tensor cores: bf16 / fp16 only
    assert not qmm.fits(8, 4100, 64, 4, mx.bfloat16)  # not whole steps of 64
    assert not qmm.fits(8, 576, 128, 4, mx.bfloat16)  # not whole groups
    assert not qmm.fits(8, 4096, 64, 3, mx.bfloat16)


def test_tiled_settings():
    """The two settings a benchmark tries the tiled product with, read once at import."""
    assert qmm.tiled_from("") is None and qmm.tiled_from("33") == 33
    from mlxfun.kernels.settings import switch

    assert not switch(qmm.INVARIANT_ENV, "") and not switch(qmm.INVARIANT_ENV, "0") and switch(qmm.INVARIANT_ENV, "1")
    for bad in ("0", "x", "-4"):
        with pytest.raises(ValueError, match="MLXFUN_TILED_FROM"):
            qmm.tiled_from(bad)
    with pytest.raises(ValueError, match="MLXFUN_INVARIANT_TILED"):
        switch(qmm.INVARIANT_ENV, "yes")
    assert qmm.FROM_ROWS is None and not qmm.INVARIANT  # off unless set: nothing calls it by default


def test_tiled_settings_route_products(monkeypatch):
    """MLXFUN_TILED_FROM: quantized products of that many rows or more run `qmm.product` (fewer keep
    `qmv`); MLXFUN_INVARIANT_TILED: the batch-invariant products run it at every row count, dense
    maps through `qmm.dense` and quantized ones as they are (no dequantized copy)."""
    from mlxfun.kernels import attention as kernels
    from mlxfun.kernels import qmv
    from mlxfun.model import llama

    calls = []
    monkeypatch.setattr(kernels, "available", lambda dtype: True)
    monkeypatch.setattr(qmm, "product", lambda x, w, s, b, gs, bits=4, invariant=False: calls.append(
        ("qmm", x.shape[0], bits, invariant)) or mx.zeros((x.shape[0], w.shape[0]), x.dtype))
    monkeypatch.setattr(qmm, "dense", lambda x, w, invariant=False: calls.append(("dense", x.shape[0], invariant))
                        or x @ w.T)
    monkeypatch.setattr(qmv, "product", lambda x, w, s, b, gs, bits=4: calls.append(("qmv", x.shape[0], bits))
                        or mx.zeros((x.shape[0], w.shape[0]), x.dtype))
    w = mx.random.normal((64, 128)).astype(mx.bfloat16)
    dense, quant = llama.Dense(w), llama.Quantized(*mx.quantize(w, group_size=64, bits=4))
    monkeypatch.setattr(qmm, "FROM_ROWS", 16)
    for rows in (8, 16, 300):
        llama.linear(quant, mx.zeros((rows, 128), mx.bfloat16), fast=True)
    assert calls == [("qmv", 8, 4), ("qmm", 16, 4, False), ("qmm", 300, 4, False)]
    calls.clear()
    monkeypatch.setattr(qmm, "FROM_ROWS", None)
    monkeypatch.setattr(qmm, "INVARIANT", True)
    for rows in (1, 9, 300):
        x = mx.zeros((rows, 128), mx.bfloat16)
        llama.linear(dense, x, invariant=True)
        llama.linear(quant, x, invariant=True)
    assert calls == [c for rows in (1, 9, 300) for c in (("dense", rows, True), ("qmm", rows, 4, True))]


def test_emulator_catches_a_missing_barrier():
    """Without the barrier that starts a step, a warp multiplies a stage whose other copies have not
    landed (the emulator lands a thread's cp.async copies only when it waits for them, and lets one
    warp run ahead to the next block barrier), so the result is wrong."""
    inputs, want = quantized_case(20, 64, 256, 64, seed=5)
    barrier = "cp_async_wait<STAGES - 2>();\n__syncthreads();"
    source = qmm.SOURCES[False, False]
    assert source.count(barrier) == 1
    shape = qmm.Tile(16, 64, 1)  # 4 warps
    threads, block = qmm.grid(64, 20, shape)
    got = run(source.replace(barrier, "cp_async_wait<STAGES - 2>();"), inputs, {"y": (20, 64)},
              qmm.template(0, 4, 64, shape), threads, block, header=QMM_HEADER,
              shared_memory=qmm.shared_bytes(4, shape))[0]
    assert np.allclose(emulated(inputs, 4, 64, shape), want, atol=1e-5)
    assert not np.allclose(got, want, atol=1e-3)


def test_emulator_catches_a_read_before_the_wait():
    """Waiting for one group fewer than the ring needs (the step's own copies still in flight) is
    wrong on the GPU; the emulator's copies land only when waited for, so it shows."""
    inputs, want = quantized_case(20, 64, 512, 64, seed=6)
    source = qmm.SOURCES[False, False]
    shape = qmm.Tile(16, 64, 1)
    threads, block = qmm.grid(64, 20, shape)
    got = run(source.replace("cp_async_wait<STAGES - 2>();", "cp_async_wait<STAGES - 1>();"), inputs,
              {"y": (20, 64)}, qmm.template(0, 4, 64, shape), threads, block, header=QMM_HEADER,
              shared_memory=qmm.shared_bytes(4, shape))[0]
    assert not np.allclose(got, want, atol=1e-3)
