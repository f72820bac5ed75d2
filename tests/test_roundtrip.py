"""Write Hugging Face folders with mlxfun.save and load them back: same config, ids and logits."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import VARIANTS, rel_error, tiny_config, tiny_model
from test_real_model import ROUND_TRIP_TEXTS

import mlxfun
from mlxfun.model import config as cfg
from mlxfun.model import llama, weights
from mlxfun.model.llama import Dense, Quantized
from mlxfun.model.load import Model

PROMPT = "Paris is the capital"


def logits_of(model: Model, ids: list[int]) -> np.ndarray:
    logits, _ = llama.forward(model.config, model.params, mx.array([ids]), mx.arange(len(ids))[None])
    return np.array(logits)


@pytest.fixture(scope="module")
def gguf_logits(model_q4, model_f32):
    ids = model_q4.tokenizer.encode(PROMPT)
    return ids, {"f32": logits_of(model_f32, ids), "q4": logits_of(model_q4, ids)}


@pytest.mark.parametrize("kind,shard_bytes", [("f32", None), ("f32", 200_000_000), ("q4", None), ("q4", 20_000_000)])
def test_real_model_round_trip(request, tmp_path, gguf_logits, kind, shard_bytes):
    model = request.getfixturevalue("model_f32" if kind == "f32" else "model_q4")
    folder = mlxfun.save(model, tmp_path / "model", shard_bytes=shard_bytes)
    raw = json.loads((folder / "config.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if shard_bytes is None:
        assert shards == ["model.safetensors"]
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    if kind == "q4":
        assert raw["quantization"] == {"group_size": 32, "bits": 4}
    else:
        assert "quantization" not in raw

    loaded = mlxfun.load(folder)
    assert loaded.config == model.config
    assert type(loaded.params.layers[3].gate_up) is type(model.params.layers[3].gate_up)
    ids, expected = gguf_logits
    assert rel_error(logits_of(loaded, ids), expected[kind]) < 1e-5
    for text in ROUND_TRIP_TEXTS:
        assert loaded.tokenizer.encode(text) == model.tokenizer.encode(text)
    assert loaded.tokenizer.eos_token_ids == model.tokenizer.eos_token_ids
    assert loaded.tokenizer.chat_template == model.tokenizer.chat_template
    assert loaded.tokenizer.bos_token_id == model.tokenizer.bos_token_id


@pytest.mark.parametrize("quant", [None, (8, 64), (4, 32)])
@pytest.mark.parametrize("variant", ["tied", "untied", "bias", "qk_norm", "llama3_rope", "traditional_rope"])
def test_tiny_round_trip(tmp_path, variant, quant):
    model = tiny_model(tiny_config(**VARIANTS[variant]), seed=21)
    if quant is not None:
        bits, group_size = quant
        model = Model(model.config, weights.quantize(model.config, model.params, bits=bits, group_size=group_size),
                      model.tokenizer)
    folder = mlxfun.save(model, tmp_path / "tiny")
    raw = json.loads((folder / "config.json").read_text())
    if quant is not None:
        assert raw["quantization"] == {"group_size": quant[1], "bits": quant[0]}
    loaded = mlxfun.load(folder)
    assert loaded.config == model.config
    layer = loaded.params.layers[1]
    assert isinstance(layer.qkv, Quantized if quant else Dense)
    if quant:
        assert llama.quant_shape(layer.down, model.config.intermediate_size) == (quant[1], quant[0])
        assert isinstance(loaded.params.embed, Quantized)
    ids = loaded.tokenizer.encode("w5 w17 w3 w96 w1")
    assert ids == [5, 17, 3, 96, 1]
    assert np.array_equal(logits_of(loaded, ids), logits_of(model, ids))


def test_quantized_dequantized_load(tmp_path):
    """dtype="float32" on an 8-bit folder dequantizes every matrix; logits agree with the quantized ones."""
    model = tiny_model(tiny_config(), seed=22)
    quantized = Model(model.config, weights.quantize(model.config, model.params, bits=8, group_size=64),
                      model.tokenizer)
    folder = mlxfun.save(quantized, tmp_path / "q8")
    dense = mlxfun.load(folder, dtype="float32")
    assert all(isinstance(layer.qkv, Dense) and layer.qkv.weight.dtype == mx.float32 for layer in dense.params.layers)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert rel_error(logits_of(dense, ids), logits_of(quantized, ids)) < 1e-5
    # 8-bit quantization keeps the model close to the original float32 one.
    assert rel_error(logits_of(dense, ids), logits_of(model, ids)) < 2e-2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_folder(tmp_path, dtype):
    model = tiny_model(tiny_config(), seed=23)
    half = Model(model.config, weights.cast(model.config, model.params, getattr(mx, dtype)), model.tokenizer)
    folder = mlxfun.save(half, tmp_path / dtype)
    assert mlxfun.load(folder, dtype=dtype).params.layers[0].o.weight.dtype == getattr(mx, dtype)
    loaded = mlxfun.load(folder, dtype="float32")
    assert loaded.params.layers[0].o.weight.dtype == mx.float32
    ids = [3, 1, 4, 1, 5]
    assert rel_error(logits_of(loaded, ids), logits_of(model, ids)) < 5e-2


@pytest.mark.parametrize("variant", [*VARIANTS, "windows"])
def test_config_round_trip(variant):
    overrides = {"layer_windows": (None, 8), "model_type": "qwen2"} if variant == "windows" else VARIANTS[variant]
    config = tiny_config(**overrides)
    assert cfg.from_hf(json.loads(json.dumps(cfg.to_hf(config)))) == config
