"""Hugging Face repo ids resolve through a (fake, local, offline) Hugging Face cache."""

from __future__ import annotations

import huggingface_hub.constants
import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_config, tiny_model

import mlxfun
from mlxfun.model import llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty offline cache; huggingface_hub reads its settings at import, so patch those too."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_repo_id_from_cache(hub_cache):
    model = tiny_model(tiny_config(), seed=41)
    repo = hub_cache / "models--org--name"
    mlxfun.save(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)

    loaded = mlxfun.load("org/name")
    assert loaded.config == model.config
    ids = [4, 8, 15, 16, 23, 42]
    tokens, positions = mx.array([ids]), mx.arange(len(ids))[None]
    expected, _ = llama.forward(model.config, model.params, tokens, positions)
    actual, _ = llama.forward(loaded.config, loaded.params, tokens, positions)
    assert np.array_equal(np.array(actual), np.array(expected))
    assert loaded.tokenizer.encode("w4 w8") == [4, 8]


def test_unknown_repo_id(hub_cache):
    with pytest.raises(mlxfun.ModelError, match="org/missing"):
        mlxfun.load("org/missing")
