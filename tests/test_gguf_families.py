"""GGUF files of Gemma 2 / 3, Phi-3, Mixtral and Qwen3-MoE, written as llama.cpp's `convert_hf_to_gguf.py`
writes them from the tiny Hugging Face models of tests/family_reference.py, against its float64 reference.

What the converter changes is applied here as it applies it: names (gguf-py `tensor_mapping.py`), Gemma's norms
stored as 1 + w (`Gemma2Model` / `Gemma3Model.modify_tensors`), Mixtral's q/k rows permuted and its experts
stacked (`LlamaModel`), Qwen3-MoE's experts stacked (`Qwen2MoeModel`), Phi-3's longrope factors as tensors
and its attention factor computed (`Phi3MiniModel`), and only the metadata keys each class writes. What a
file cannot say, llama.cpp assumes (Gemma's query scale, Gemma 3's window pattern): the tiny configs here
are those the assumption holds for. The writer below writes GGUF v3 itself, so experts can be Q4_0 / Q4_1 /
Q8_0 as llama-quantize leaves them.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import family_reference as ref
import mlx.core as mx
import numpy as np
import pytest
from helpers import rel_error
from test_gguf import llama_cpp_permute

import mlxfun
from mlxfun.model import config as cfg
from mlxfun.model import gguf, llama

ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "mixtral": "llama", "qwen3_moe": "qwen3moe"}
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *map(chr, range(33, 124)), "Ġ", "Ġa"]  # 96, the vocab
TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": TOKENS,
             "tokenizer.ggml.merges": ["Ġ a"], "tokenizer.ggml.token_type": np.array([3, 3, 3] + [1] * 93, np.int32),
             "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
# HF names within a layer -> llama.cpp's (tensor_mapping.py); post_attention_layernorm is Gemma's post-attention
# norm but the others' pre-MLP norm.
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp"}
EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
           "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


# ---------------------------------------------------------------- what convert_hf_to_gguf.py writes


def gguf_tiny_config(family: str, **overrides) -> dict:
    """A tiny config a GGUF can carry: Gemma's query scale is head_dim ** -0.5 and Gemma 3's every 6th layer
    global, as llama.cpp assumes for all but the 27B models (the converter stores neither)."""
    if family in ref.GEMMA:
        overrides = {"query_pre_attn_scalar": 16, **overrides}
    if family == "gemma3_text":
        overrides = {"num_hidden_layers": 6, "sliding_window_pattern": 6, **overrides}
    return ref.tiny_config(family, **overrides)


def convert(raw: dict, w: dict[str, np.ndarray], fuse_gate_up_exps: bool = False) -> tuple[dict, dict]:
    """(metadata, tensors) of the GGUF llama.cpp's converter writes for a Hugging Face model."""
    family, arch = raw["model_type"], ARCH[raw["model_type"]]
    H, K, E = raw["num_attention_heads"], raw["num_key_value_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim") or E // H
    meta = {"general.architecture": arch, "general.file_type": 0, **TOKENIZER}

    def put(key, value):
        meta[f"{arch}.{key}"] = value

    # TextModel.set_gguf_parameters (Gemma2Model writes the same without rope.freq_base)
    put("block_count", raw["num_hidden_layers"])
    put("context_length", raw["max_position_embeddings"])
    put("embedding_length", E)
    put("feed_forward_length", raw["intermediate_size"])
    put("attention.head_count", H)
    put("attention.head_count_kv", K)
    put("attention.layer_norm_rms_epsilon", float(raw["rms_norm_eps"]))
    if family != "gemma2":
        put("rope.freq_base", float(raw["rope_theta"]))
    if "head_dim" in raw:
        put("attention.key_length", head_dim)
        put("attention.value_length", head_dim)
    if (n := raw.get("num_local_experts") or raw.get("num_experts")) is not None:
        put("expert_count", n)
        put("expert_used_count", raw["num_experts_per_tok"])
    if family == "gemma2":
        put("attn_logit_softcapping", float(raw["attn_logit_softcapping"]))
        put("final_logit_softcapping", float(raw["final_logit_softcapping"]))
        put("attention.sliding_window", raw["sliding_window"])
    if family == "gemma3_text":
        put("rope.scaling.type", "linear")
        put("rope.scaling.factor", float(raw["rope_scaling"]["factor"]))
        put("rope.freq_base_swa", float(raw["rope_local_base_freq"]))
        put("attention.sliding_window", raw["sliding_window"])
    if family == "phi3":
        put("rope.scaling.original_context_length", raw["original_max_position_embeddings"])
        put("rope.dimension_count", int(raw.get("partial_rotary_factor", 1.0) * E) // H)
        put("attention.sliding_window", raw.get("sliding_window") or 0)
        original = raw["original_max_position_embeddings"]
        scale = raw["max_position_embeddings"] / original
        put("rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original)))
    if family == "mixtral":
        put("vocab_size", raw["vocab_size"])
        put("rope.dimension_count", head_dim)
    if family == "qwen3_moe":
        put("expert_feed_forward_length", raw["moe_intermediate_size"])

    tensors = {}
    for name, value in ref.stack_experts_mlx(raw, w).items():
        if family in ref.GEMMA and name.endswith("norm.weight"):
            value = value + 1  # the converter stores Gemma's norms as the scale they apply
        if family == "mixtral" and name.endswith("self_attn.q_proj.weight"):
            value = llama_cpp_permute(value, H)
        if family == "mixtral" and name.endswith("self_attn.k_proj.weight"):
            value = llama_cpp_permute(value, K)
        tensors[gguf_name(family, name)] = value
    if fuse_gate_up_exps:  # --fuse-gate-up-exps: torch.cat([gate, up], dim=1)
        for gate in [n for n in tensors if ".ffn_gate_exps." in n]:
            up = gate.replace("ffn_gate_exps", "ffn_up_exps")
            tensors[gate.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate(
                [tensors.pop(gate), tensors.pop(up)], axis=1)
    if family == "phi3":
        tensors["rope_factors_long.weight"] = np.array(raw["rope_scaling"]["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(raw["rope_scaling"]["short_factor"], np.float32)
    return meta, tensors


def gguf_name(family: str, hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, i, rest = stem.split(".", 3)
    if ".switch_mlp." in rest:
        part = EXPERTS[rest.rsplit(".", 1)[1]]
    elif rest == "post_attention_layernorm":
        part = "post_attention_norm" if family in ref.GEMMA else "ffn_norm"
    else:
        part = LAYER[rest]
    return f"blk.{i}.{part}.{kind}"


# ---------------------------------------------------------------- a GGUF v3 writer (gguf-py's layout)

GGML = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def quantize(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    """ggml's blocks of 32 along the last axis (gguf-py quants.py), and the values they decode to."""
    b = x.astype(np.float32).reshape(-1, 32)
    if kind == "Q8_0":
        d = (np.abs(b).max(axis=1, keepdims=True) / 127).astype(np.float16)
        q = np.round(b / np.where(d == 0, 1, d.astype(np.float32))).astype(np.int8)
        raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
        return raw.tobytes(), (q * d.astype(np.float32)).reshape(x.shape)
    if kind == "Q4_0":
        peak = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
        d = (peak / -8).astype(np.float16)
        q = np.clip(np.round(b / np.where(d == 0, 1, d.astype(np.float32))) + 8, 0, 15).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        return (np.concatenate([d.view(np.uint8), packed], axis=1).tobytes(),
                ((q.astype(np.float32) - 8) * d.astype(np.float32)).reshape(x.shape))
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)  # Q4_1
    d, m = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
    q = np.round((b - m.astype(np.float32)) / np.where(d == 0, 1, d.astype(np.float32)))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return (np.concatenate([d.view(np.uint8), m.view(np.uint8), packed], axis=1).tobytes(),
            (q * d.astype(np.float32) + m.astype(np.float32)).reshape(x.shape))


def write_gguf(path, meta: dict, tensors: dict[str, np.ndarray], quant: dict[str, str] | None = None):
    """GGUF v3 at `path`: metadata (str, int -> u32, float -> f32, bool, lists of str, int32 arrays), then
    tensors, their dims reversed (ggml's ne0 is the last numpy axis), F32 or as `quant` names them."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    def value(v) -> bytes:
        if isinstance(v, str):
            return struct.pack("<I", 8) + string(v)
        if isinstance(v, bool):
            return struct.pack("<IB", 7, v)
        if isinstance(v, int):
            return struct.pack("<II", 4, v)
        if isinstance(v, float):
            return struct.pack("<If", 6, v)
        if isinstance(v, list):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(string(s) for s in v)
        return struct.pack("<IIQ", 9, 5, len(v)) + v.astype("<i4").tobytes()

    blobs, infos, offset = [], [], 0
    for name, x in tensors.items():
        kind = (quant or {}).get(name, "F32")
        data = x.astype("<f4").tobytes() if kind == "F32" else quantize(x, kind)[0]
        infos.append(string(name) + struct.pack(f"<I{x.ndim}QIQ", x.ndim, *x.shape[::-1], GGML[kind], offset))
        blobs.append(data + bytes(-len(data) % 32))
        offset += len(blobs[-1])
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    head += b"".join(string(k) + value(v) for k, v in meta.items()) + b"".join(infos)
    path.write_bytes(head + bytes(-len(head) % 32) + b"".join(blobs))
    return path


# ---------------------------------------------------------------- tests


def tokens_and_positions(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Two rows of 24 tokens: past every tiny window (4-8) and Phi-3's original context (16)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 96, (2, 24)).astype(np.int32), np.tile(np.arange(24, dtype=np.int32), (2, 1))


def logits(model: mlxfun.Model, tokens, positions) -> np.ndarray:
    out, _ = llama.forward(model.config, model.params, mx.array(tokens), mx.array(positions))
    return np.array(out.astype(mx.float32))


CASES = {
    "gemma2": ("gemma2", {}),
    "gemma3_text": ("gemma3_text", {}),
    "phi3": ("phi3", {}),
    "phi3_partial_rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),  # layer 1 dense (mlp_only_layers), as Hugging Face allows
}


@pytest.mark.parametrize("case", [*CASES, "mixtral_fused_gate_up"])
def test_converted_gguf_matches_the_float64_reference(tmp_path, case):
    family, overrides = CASES.get(case, ("mixtral", {}))
    raw = gguf_tiny_config(family, **overrides)
    w = ref.random_weights(raw, seed=3)
    meta, tensors = convert(raw, w, fuse_gate_up_exps=case == "mixtral_fused_gate_up")
    model = mlxfun.load(write_gguf(tmp_path / "m.gguf", meta, tensors))
    expected = cfg.from_hf(raw)
    assert dataclasses.replace(model.config, rope_scaling=None) == dataclasses.replace(expected, rope_scaling=None)
    if family == "phi3":  # the factors travel as float32
        got, want = model.config.rope_scaling, expected.rope_scaling
        assert (got.kind, got.factor, got.original_max_position_embeddings) == (
            want.kind, want.factor, want.original_max_position_embeddings)
        assert np.allclose(got.short_factor, want.short_factor) and np.allclose(got.long_factor, want.long_factor)
        assert got.attention_factor == pytest.approx(want.attention_factor, rel=1e-6)
    else:
        assert model.config.rope_scaling == expected.rope_scaling
    tokens, positions = tokens_and_positions()
    assert rel_error(logits(model, tokens, positions),
                     ref.reference_logits(raw, w, tokens, positions, longrope="per_token")) < 1e-4


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_quantized_experts_load_quantized(tmp_path, family, kind):
    """llama-quantize's 3-D experts: `mx.load` returns each as a stacked (n, out, in) MLX-quantized triple,
    which stays quantized; the logits are the reference's on the weights the blocks decode to."""
    raw = gguf_tiny_config(family, hidden_size=64)  # rows of whole 32-blocks
    meta, tensors = convert(raw, ref.random_weights(raw, seed=4))
    quant = {n: kind for n in tensors if "_exps." in n}
    model = mlxfun.load(write_gguf(tmp_path / "q.gguf", meta, tensors, quant))
    experts = [layer.experts for layer in model.params.layers if layer.experts is not None]
    assert experts and all(isinstance(x.gate_up, llama.Quantized) and isinstance(x.down, llama.Quantized)
                           for x in experts)
    # The same file with the decoded experts stored as F32: the Hugging Face weights are those.
    decoded = {n: quantize(x, quant[n])[1] if n in quant else x for n, x in tensors.items()}
    dense = mlxfun.load(write_gguf(tmp_path / "d.gguf", meta, decoded))
    tokens, positions = tokens_and_positions(seed=2)
    assert rel_error(logits(model, tokens, positions), logits(dense, tokens, positions)) < 1e-4


def config_of(arch: str, layers: int = 4, **keys) -> cfg.ModelConfig:
    meta = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 2, f"{arch}.attention.head_count_kv": 1, f"{arch}.attention.key_length": 16,
            f"{arch}.feed_forward_length": 96, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    meta.update({f"{arch}.{k}": v for k, v in keys.items()})
    return gguf.config(meta, {"token_embd.weight": mx.zeros((8, 64))})


def test_what_llama_cpp_assumes_where_the_converter_writes_nothing():
    """src/llama-model.cpp: Gemma's query scale is head_dim ** -0.5 except in the 27B models (46 / 62 layers),
    n_embd / n_head; Gemma 2 slides every even layer with window 4096 and caps at 50 / 30 unless stored;
    Gemma 3 makes every 6th layer global when it stores a window, and none slides without one."""
    g2 = config_of("gemma2")
    assert g2.query_pre_attn_scalar == 16 and g2.layer_windows == (4096, None, 4096, None)
    assert (g2.attn_softcap, g2.final_softcap, g2.local_rope_theta) == (50.0, 30.0, None)
    assert config_of("gemma2", layers=46).query_pre_attn_scalar == 64 // 2
    g3 = config_of("gemma3", layers=8, **{"attention.sliding_window": 512})
    assert g3.layer_windows == (512,) * 5 + (None, 512, 512) and g3.local_layers == (True,) * 5 + (False, True, True)
    assert (g3.attn_softcap, g3.final_softcap, g3.local_rope_theta, g3.query_pre_attn_scalar) == (None, None, 1e4, 16)
    assert config_of("gemma3", layers=62).query_pre_attn_scalar == 32
    assert config_of("gemma3").layer_windows == (None,) * 4 and not any(config_of("gemma3").local_layers)
    assert config_of("phi3", **{"attention.sliding_window": 0}).layer_windows == (None,) * 4


@pytest.mark.parametrize(("arch", "keys", "named"), [
    ("falcon", {}, "general.architecture"),
    ("gemma2", {"attention.layer_norm_rms_epsilon": None}, "gemma2.attention.layer_norm_rms_epsilon"),
    ("qwen3moe", {"expert_count": 8}, "qwen3moe.expert_used_count"),
    ("qwen3moe", {"expert_count": 8, "expert_used_count": 2, "expert_gating_func": 2}, "qwen3moe.expert_gating_func"),
    ("qwen3moe", {"expert_count": 8, "expert_used_count": 2, "expert_shared_count": 1}, "qwen3moe.expert_shared_count"),
    ("phi3", {"rope.scaling.type": "yarn"}, "phi3.rope.scaling.type"),
])
def test_unsupported_or_missing_metadata_is_named(arch, keys, named):
    tensors = {"token_embd.weight": mx.zeros((8, 64)), "blk.0.ffn_gate_inp.weight": mx.zeros((8, 64))}
    meta = {"general.architecture": arch, f"{arch}.block_count": 1, f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 2, f"{arch}.feed_forward_length": 96,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, **{f"{arch}.{k}": v for k, v in keys.items()}}
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(mlxfun.ModelError, match=named.replace(".", r"\.")):
        gguf.config(meta, tensors if arch == "qwen3moe" else {"token_embd.weight": tensors["token_embd.weight"]})


def test_unsupported_architecture_file_names_it(tmp_path):
    raw = gguf_tiny_config("mixtral")
    meta, tensors = convert(raw, ref.random_weights(raw))
    meta = {k.replace("llama.", "falcon."): v for k, v in meta.items()} | {"general.architecture": "falcon"}
    with pytest.raises(mlxfun.ModelError, match="'falcon'.*general.architecture"):
        mlxfun.load(write_gguf(tmp_path / "f.gguf", meta, tensors))
