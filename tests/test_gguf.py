"""Tiny GGUF files written the way llama.cpp's converter writes them (q/k rows permuted)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import VARIANTS, rel_error, tiny_config, tiny_params
from test_reference import random_tokens, reference_forward

import mlxfun
from mlxfun.model import llama
from mlxfun.model.config import RopeScaling
from mlxfun.model.load import default_compute_dtype

GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# 3 control tokens, ASCII 33..124 as themselves, the byte-level space and one merge.
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *map(chr, range(33, 125)), "Ġ", "Ġa"]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split RoPE rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_tensors(config, hf: dict[str, np.ndarray]) -> dict[str, mx.array]:
    out = {}
    for name, value in hf.items():
        stem, _, kind = name.rpartition(".")
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            if rest == "self_attn.q_proj":
                value = llama_cpp_permute(value, config.num_heads)
            elif rest == "self_attn.k_proj":
                value = llama_cpp_permute(value, config.num_kv_heads)
            out[f"blk.{i}.{GGUF_LAYER[rest]}.{kind}"] = mx.array(value.astype(np.float32))
        else:
            out[f"{GGUF_TOP[stem]}.{kind}"] = mx.array(value.astype(np.float32))
    return out


def write_gguf(path: Path, config, hf: dict[str, np.ndarray], edit=None, **meta_overrides) -> Path:
    """A GGUF file as llama.cpp writes it; `edit(tensors)` may change the tensors first."""
    def u32(v):
        return mx.array(v, dtype=mx.uint32)

    meta = {
        "general.architecture": "llama",
        "general.file_type": u32(0),
        "llama.embedding_length": u32(config.hidden_size),
        "llama.feed_forward_length": u32(config.intermediate_size),
        "llama.block_count": u32(config.num_layers),
        "llama.attention.head_count": u32(config.num_heads),
        "llama.attention.head_count_kv": u32(config.num_kv_heads),
        "llama.attention.key_length": u32(config.head_dim),
        "llama.rope.freq_base": mx.array(config.rope_theta, dtype=mx.float32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config.rms_norm_eps, dtype=mx.float32),
        "llama.context_length": u32(config.max_position_embeddings),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": ["Ġ a"],
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (len(TOKENS) - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
        **meta_overrides,
    }
    tensors = to_gguf_tensors(config, hf)
    if edit is not None:
        edit(tensors)
    mx.save_gguf(str(path), tensors, {k: v for k, v in meta.items() if v is not None})
    return path


@pytest.mark.parametrize("variant", ["tied", "untied", "gqa4", "mqa", "head_dim_32"])
def test_tiny_gguf_matches_numpy(tmp_path, variant):
    config = tiny_config(**VARIANTS[variant], max_position_embeddings=256)
    _, w = tiny_params(config, seed=31)
    model = mlxfun.load(write_gguf(tmp_path / "tiny.gguf", config, w))
    assert model.config == config
    tokens = random_tokens(config, (1, 10))
    logits, _ = llama.forward(config, model.params, mx.array(tokens), mx.arange(10)[None])
    assert rel_error(np.array(logits), reference_forward(config, w, tokens, np.arange(10)[None])) < 1e-4


def test_tiny_gguf_tokenizer(tmp_path):
    config = tiny_config()
    _, w = tiny_params(config)
    tok = mlxfun.load(write_gguf(tmp_path / "tiny.gguf", config, w)).tokenizer
    ids = tok.encode("<|im_start|>a a!<|im_end|>")
    assert ids == [1, TOKENS.index("a"), TOKENS.index("Ġa"), TOKENS.index("!"), 2]
    assert tok.decode(ids) == "<|im_start|>a a!<|im_end|>"
    assert tok.encode("42") == [TOKENS.index("4"), TOKENS.index("2")]
    assert tok.eos_token_ids == {0, 2} and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [1, TOKENS.index("h"), TOKENS.index("i"), 2]


def test_llama3_gguf_rope_freq_factors(tmp_path):
    """llama.cpp stores llama3 RoPE scaling as per-pair frequency divisors (`rope_freqs.weight`)."""
    config = tiny_config(**VARIANTS["llama3_rope"], max_position_embeddings=256)
    _, w = tiny_params(config, seed=5)
    scaled = 1.0 / np.array(llama.rotations(config)[0].periods)  # llama3-scaled inverse frequencies
    plain = config.rope_theta ** (-2 * np.arange(config.head_dim // 2) / config.head_dim)
    plain_config = tiny_config(**{**VARIANTS["llama3_rope"], "rope_scaling": None}, max_position_embeddings=256)

    def add_factors(tensors):
        tensors["rope_freqs.weight"] = mx.array((plain / scaled).astype(np.float32))

    model = mlxfun.load(write_gguf(tmp_path / "l3.gguf", plain_config, w, edit=add_factors))
    assert model.config.rope_freq_factors is not None and max(model.config.rope_freq_factors) > 7.9
    tokens = random_tokens(config, (1, 40))
    positions = np.arange(40)[None]
    logits, _ = llama.forward(model.config, model.params, mx.array(tokens), mx.array(positions))
    assert rel_error(np.array(logits), reference_forward(config, w, tokens, positions)) < 1e-4
    assert rel_error(np.array(logits), reference_forward(plain_config, w, tokens, positions)) > 1e-2


def test_gguf_rope_scaling_and_sliding_window_metadata(tmp_path):
    """llama.cpp's `rope.scaling.*` and `attention.sliding_window` keys reach the config, and the
    logits follow them (the NumPy reference with the same scaling and window)."""
    config = tiny_config(rope_scaling=RopeScaling("linear", 4.0), layer_windows=(6, 6), max_position_embeddings=256)
    _, w = tiny_params(config, seed=7)
    path = write_gguf(tmp_path / "scaled.gguf", config, w, **{
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": mx.array(4.0, dtype=mx.float32),
        "llama.attention.sliding_window": mx.array(6, dtype=mx.uint32)})
    model = mlxfun.load(path)
    assert model.config.rope_scaling == RopeScaling("linear", 4.0) and model.config.layer_windows == (6, 6)
    tokens = random_tokens(config, (1, 20))
    positions = np.arange(20)[None]
    logits, _ = llama.forward(model.config, model.params, mx.array(tokens), mx.array(positions))
    assert rel_error(np.array(logits), reference_forward(config, w, tokens, positions)) < 1e-4
    none = write_gguf(tmp_path / "none.gguf", config, w, **{"llama.rope.scaling.type": "none"})
    assert mlxfun.load(none).config.rope_scaling is None
    yarn = write_gguf(tmp_path / "yarn.gguf", config, w, **{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(mlxfun.ModelError, match="'yarn'"):
        mlxfun.load(yarn)


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"])
def test_gguf_without_tokenizer_tables(tmp_path, key):
    config = tiny_config()
    _, w = tiny_params(config)
    with pytest.raises(mlxfun.ModelError, match=key):
        mlxfun.load(write_gguf(tmp_path / "notok.gguf", config, w, **{key: None}))


def test_gguf_half_precision_computes_in_bfloat16_on_a_gpu():
    """GGUF scales are float16, whose range overflows on models with large activations: on a GPU
    they compute in bfloat16; on the CPU in float32; a safetensors checkpoint keeps its dtype."""
    assert default_compute_dtype(mx.float16, mx.gpu, gguf_file=True) == mx.bfloat16
    assert default_compute_dtype(mx.float16, mx.gpu, gguf_file=False) is None
    assert default_compute_dtype(mx.float32, mx.gpu, gguf_file=True) is None
    assert default_compute_dtype(mx.float16, mx.cpu, gguf_file=True) == mx.float32
    assert default_compute_dtype(mx.bfloat16, mx.cpu, gguf_file=False) == mx.float32
    assert default_compute_dtype(mx.float32, mx.cpu, gguf_file=True) is None


def test_real_gguf_scales_follow_the_compute_dtype(model_q4):
    q = model_q4.params.layers[0].qkv
    assert isinstance(q, llama.Quantized) and q.scales.dtype == mx.float32  # this CPU computes in float32
