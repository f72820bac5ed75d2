"""A float64 NumPy forward pass for five Hugging Face decoder families, independent of mlxfun.

Written from transformers' modeling and configuration files (the specification), not from mlxfun's decoder:
Gemma 2 (`gemma2`), Gemma 3 text (`gemma3_text`), Phi-3/Phi-4 (`phi3`), Mixtral (`mixtral`) and Qwen3-MoE
(`qwen3_moe`). Also tiny configs in Hugging Face's config.json form, random weights under Hugging Face's tensor
names, a writer for a Hugging Face model folder, and mlx-lm's stacked-experts layout.

Conventions of `reference_logits`: tokens and positions are int (B, T); a negative position is left padding.
A key is visible to a query of the same row when its position is >= 0, <= the query's, and, in a layer with
window W, q - k < W (HF's `sliding_window_overlay`: kv_idx > q_idx - W, so W keys including the query itself).
A query that sees nothing (padding) sees everything, so its garbage output is finite.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

FAMILIES = ("gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe")
GEMMA = ("gemma2", "gemma3_text")
MOE = ("mixtral", "qwen3_moe")
LONGROPE_RULES = ("hf", "hf_batch", "per_token")

# The config classes' defaults for keys a config.json may leave out.
TIED_BY_DEFAULT = {"gemma2": True, "gemma3_text": True, "phi3": False, "mixtral": False, "qwen3_moe": False}
ROPE_THETA_DEFAULT = {"gemma2": 10_000.0, "gemma3_text": 1_000_000.0, "phi3": 10_000.0, "mixtral": 1_000_000.0,
                      "qwen3_moe": 10_000.0}
HEAD_DIM_DEFAULT = {"gemma2": 256, "gemma3_text": 256}  # the others: hidden_size // num_attention_heads

# ---------------------------------------------------------------- tiny configs (Hugging Face config.json form)


def _common(model_type: str, architecture: str, layers: int, hidden: int) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": 96,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA: query head j reads key/value head j // 2
        "max_position_embeddings": 128,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def _gemma2() -> dict:
    # Layers 0 and 2 slide (no layer_types: HF's fallback, even layers sliding); head_dim 16 != 48 / 4.
    return _common("gemma2", "Gemma2ForCausalLM", 4, 48) | {
        "intermediate_size": 96,
        "head_dim": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",  # what Gemma reads; hidden_act is what checkpoints also carry
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": 24,  # scale 24 ** -0.5, not head_dim ** -0.5
        "sliding_window": 6,
        "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 8.0,
        "cache_implementation": "hybrid",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


def _gemma3_text() -> dict:
    # sliding_window_pattern 3 over 5 layers: layer 2 global, 0, 1, 3, 4 local (locals after a global too).
    return _common("gemma3_text", "Gemma3ForCausalLM", 5, 48) | {
        "intermediate_size": 96,
        "head_dim": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,  # global layers, with rope_scaling
        "rope_local_base_freq": 10_000.0,  # local layers, never scaled
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": 20,
        "sliding_window": 4,
        "sliding_window_pattern": 3,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "cache_implementation": "hybrid",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


def _phi3() -> dict:
    # head_dim is hidden / heads = 16 (Phi-3 has no head_dim key); rope_scaling is filled in by tiny_config,
    # after the overrides, because its factor lists' length depends on partial_rotary_factor.
    return _common("phi3", "Phi3ForCausalLM", 3, 64) | {
        "intermediate_size": 96,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 1.0,
        "original_max_position_embeddings": 16,
        "max_position_embeddings": 64,  # longrope factor 64 / 16 = 4: attention factor sqrt(1 + ln 4 / ln 16)
        "sliding_window": 8,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "tie_word_embeddings": False,
    }


def _mixtral() -> dict:
    return _common("mixtral", "MixtralForCausalLM", 2, 48) | {
        "intermediate_size": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
    }


def _qwen3_moe() -> dict:
    # Layer 1 is dense (mlp_only_layers); head_dim 16 != 48 / 4, as in Qwen3-30B-A3B (128 != 2048 / 32).
    return _common("qwen3_moe", "Qwen3MoeForCausalLM", 3, 48) | {
        "intermediate_size": 80,  # the dense layer's MLP
        "moe_intermediate_size": 32,  # each expert's
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    }


_BASES = {"gemma2": _gemma2, "gemma3_text": _gemma3_text, "phi3": _phi3, "mixtral": _mixtral,
          "qwen3_moe": _qwen3_moe}


def _phi3_longrope(config: dict) -> dict:
    """Phi-3's rope_scaling, as its 128k checkpoints write it: one short and one long factor per rotated pair."""
    pairs = _rotary_dim(config) // 2
    j = np.arange(pairs) / max(pairs - 1, 1)
    short = 1.0 + 0.25 * j**2  # near 1: the pretrained frequencies, slightly stretched at the low end
    long = np.exp(np.log(8.0) * j)  # 1 .. 8
    return {"type": "longrope", "short_factor": [round(float(x), 4) for x in short],
            "long_factor": [round(float(x), 4) for x in long]}


def tiny_config(family: str, **overrides) -> dict:
    """A tiny Hugging Face config.json dict for `family`, with `overrides` applied on top (keys replaced).

    Phi-3's rope_scaling (longrope) is derived after the overrides unless they set it, so that e.g.
    `tiny_config("phi3", partial_rotary_factor=0.5)` has factor lists of the right length."""
    if family not in _BASES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    config = _BASES[family]() | overrides
    if family == "phi3" and "rope_scaling" not in overrides:
        config["rope_scaling"] = _phi3_longrope(config)
    return config


# ---------------------------------------------------------------- reading a config as HF does


def _head_dim(config: dict) -> int:
    # HF: getattr(config, "head_dim", None) or hidden_size // num_attention_heads (Gemma's classes default to 256)
    default = HEAD_DIM_DEFAULT.get(config["model_type"])
    head_dim = config.get("head_dim", default)
    return head_dim or config["hidden_size"] // config["num_attention_heads"]


def _rotary_dim(config: dict) -> int:
    # HF: dim = int(head_dim * partial_rotary_factor); the first `dim` features rotate, the rest pass through.
    return int(_head_dim(config) * config.get("partial_rotary_factor", 1.0))


def _is_sliding(config: dict, i: int) -> bool:
    family = config["model_type"]
    if config.get("layer_types") is not None and family in GEMMA:
        return config["layer_types"][i] == "sliding_attention"
    if family == "gemma2":
        return (i + 1) % 2 != 0  # even layers slide
    if family == "gemma3_text":
        return (i + 1) % config.get("sliding_window_pattern", 6) != 0  # every pattern-th layer is global
    if family == "qwen3_moe" and config.get("use_sliding_window", False):
        # v4 (max_window_layers) and v5 (every layer) of transformers disagree here: not modelled.
        raise NotImplementedError("qwen3_moe with use_sliding_window")
    return True  # phi3, mixtral: one optional window for every layer


def layer_windows(config: dict) -> list[int | None]:
    """Each layer's attention window (keys with q - k < W are visible), or None for full causal attention."""
    window = config.get("sliding_window")
    return [window if _is_sliding(config, i) else None for i in range(config["num_hidden_layers"])]


def _rope_scaling(config: dict, i: int) -> dict | None:
    """Layer i's rope_scaling dict with its type under "rope_type" (legacy "type" read too), or None."""
    family = config["model_type"]
    if family == "gemma3_text" and _is_sliding(config, i):
        return None  # HF builds the local rotary embedding with rope_scaling {"rope_type": "default"}
    scaling = config.get("rope_scaling")
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if family == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config renames the legacy types
    return {**scaling, "rope_type": kind}


def _rope_theta(config: dict, i: int) -> float:
    if config["model_type"] == "gemma3_text" and _is_sliding(config, i):
        return float(config.get("rope_local_base_freq", 10_000.0))
    return float(config.get("rope_theta", ROPE_THETA_DEFAULT[config["model_type"]]))


def _longrope_constants(config: dict, scaling: dict, rotary_dim: int) -> tuple[int, float]:
    """(original_max_position_embeddings, attention factor) as `_compute_longrope_parameters` computes them."""
    original = config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    original = original or config["max_position_embeddings"]
    # transformers v5 takes `factor` from rope_scaling when given; v4 always used max / original when the config
    # has original_max_position_embeddings. The tiny configs give no factor, so both agree on them.
    factor = scaling.get("factor") or config["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        if len(scaling[name]) != rotary_dim // 2:
            raise ValueError(f"{name} has {len(scaling[name])} entries, rotary_dim / 2 is {rotary_dim // 2}")
    return original, attention


def _uses_long(positions: np.ndarray, original: int, rule: str) -> np.ndarray:
    """(B, T) bool: which tokens rotate with long_factor."""
    if rule == "per_token":  # a cached key keeps its rotation: a token is long iff its own position is
        return positions >= original
    if rule == "hf":  # HF's seq_len = max(position_ids) + 1 > original, for each row as if run alone
        return np.broadcast_to(positions.max(axis=1, keepdims=True) + 1 > original, positions.shape)
    if rule == "hf_batch":  # HF literally: torch.max over the whole batch's position_ids
        return np.full(positions.shape, positions.max() + 1 > original)
    raise ValueError(f"longrope rule {rule!r}; one of {LONGROPE_RULES}")


def _cos_sin(config: dict, i: int, positions: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Layer i's (B, T, R/2) cos and sin, R the rotary dim, already times the attention factor (HF scales both)."""
    rotary_dim = _rotary_dim(config)
    scaling = _rope_scaling(config, i)
    kind = "default" if scaling is None else scaling["rope_type"]
    wavelength = _rope_theta(config, i) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # (R/2,)
    pos = positions[..., None].astype(np.float64)  # (B, T, 1)
    attention = 1.0
    if kind == "default":
        angles = pos / wavelength
    elif kind == "linear":
        angles = pos / (wavelength * scaling["factor"])
    elif kind == "longrope":
        original, attention = _longrope_constants(config, scaling, rotary_dim)
        long = _uses_long(positions, original, rule)[..., None]  # (B, T, 1)
        ext = np.where(long, np.asarray(scaling["long_factor"], np.float64),
                       np.asarray(scaling["short_factor"], np.float64))  # (B, T, R/2)
        angles = pos / (ext * wavelength)
    else:
        raise NotImplementedError(f"rope_type {kind!r}")
    return np.cos(angles) * attention, np.sin(angles) * attention


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (B, T, N, D): features [0, R) rotate in half-split pairs (i, i + R/2); features [R, D) pass through."""
    half = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]  # (B, T, 1, R/2)
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


# ---------------------------------------------------------------- the forward pass (float64)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, gemma: bool) -> np.ndarray:
    # Gemma stores the scale minus one: x * (1 + w) (HF computes that product in float32 before casting back).
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * (1.0 + w) if gemma else y * w


def _act(name: str, x: np.ndarray) -> np.ndarray:
    if name in ("silu", "swish"):
        return x / (1.0 + np.exp(-x))
    if name in ("gelu_pytorch_tanh", "gelu_new"):  # GELU, tanh approximation
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise NotImplementedError(f"activation {name!r}")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _visible(positions: np.ndarray, window: int | None) -> np.ndarray:
    """(B, T, T) bool [b, query, key]."""
    q, k = positions[:, :, None], positions[:, None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= q - k < window
    return visible | ~visible.any(axis=-1, keepdims=True)  # padding queries: anything finite


class _Model:
    """The config as the modeling code reads it, and the float64 weights."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        self.config = config
        self.family = config["model_type"]
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model_type {self.family!r}")
        if config.get("use_bidirectional_attention"):
            raise NotImplementedError("use_bidirectional_attention")
        self.gemma = self.family in GEMMA
        self.H, self.K = config["num_attention_heads"], config["num_key_value_heads"]
        self.D, self.eps = _head_dim(config), config["rms_norm_eps"]
        self.windows = layer_windows(config)
        self.tied = config.get("tie_word_embeddings", TIED_BY_DEFAULT[self.family])
        self.w = {name: np.asarray(value, dtype=np.float64) for name, value in weights.items()}
        if self.gemma:
            self.act = config.get("hidden_activation") or "gelu_pytorch_tanh"
            self.scale = config.get("query_pre_attn_scalar", 256) ** -0.5
        else:
            self.act = config.get("hidden_act", "silu")
            self.scale = self.D**-0.5
        # Gemma 3's attention ignores attn_logit_softcapping (its forward does not pass softcap); Gemma 2 applies it.
        self.attn_cap = config.get("attn_logit_softcapping", 50.0) if self.family == "gemma2" else None
        self.final_cap = config.get("final_logit_softcapping", 30.0 if self.family == "gemma2" else None)
        if not self.gemma:
            self.final_cap = None

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return _rms_norm(x, self.w[name], self.eps, self.gemma)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def is_moe_layer(self, i: int) -> bool:
        c = self.config
        if self.family == "mixtral":
            return True
        if self.family == "qwen3_moe":
            sparse = c.get("num_experts", 0) > 0 and (i + 1) % c.get("decoder_sparse_step", 1) == 0
            return i not in (c.get("mlp_only_layers") or []) and sparse
        return False


def _qkv(m: _Model, p: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (B, T, E) -> q (B, T, H, D), k and v (B, T, K, D)."""
    B, T, _ = x.shape
    H, K, D = m.H, m.K, m.D
    if m.family == "phi3":  # one qkv_proj: rows [0, HD) are q, then KD rows of k, then KD rows of v
        qkv = m.linear(x, p + "self_attn.qkv_proj")
        q, k, v = qkv[..., :H * D], qkv[..., H * D:(H + K) * D], qkv[..., (H + K) * D:]
    else:
        q, k, v = (m.linear(x, p + f"self_attn.{n}_proj") for n in "qkv")
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
    if m.family in ("gemma3_text", "qwen3_moe"):  # per-head RMSNorm of q and k, before RoPE
        q, k = m.norm(q, p + "self_attn.q_norm.weight"), m.norm(k, p + "self_attn.k_norm.weight")
    return q, k, v


def _attention(m: _Model, i: int, x: np.ndarray, positions: np.ndarray, rule: str) -> np.ndarray:
    """Layer i's self-attention, x (B, T, E) -> (B, T, E) (after o_proj)."""
    p = f"model.layers.{i}."
    B, T, _ = x.shape
    q, k, v = _qkv(m, p, x)
    cos, sin = _cos_sin(m.config, i, positions, rule)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    group = m.H // m.K
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # (B, T, H, D): head j reads j // group
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * m.scale  # (B, H, T, T)
    if m.attn_cap is not None:
        scores = np.tanh(scores / m.attn_cap) * m.attn_cap
    scores = np.where(_visible(positions, m.windows[i])[:, None], scores, -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", _softmax(scores), v).reshape(B, T, m.H * m.D)
    return m.linear(out, p + "self_attn.o_proj")


def _swiglu(m: _Model, x: np.ndarray, gate: str, up: str, down: str) -> np.ndarray:
    return (_act(m.act, x @ m.w[gate].T) * (x @ m.w[up].T)) @ m.w[down].T


def _moe(m: _Model, i: int, x: np.ndarray, real: np.ndarray, stats: dict | None) -> np.ndarray:
    """x (N, E) -> (N, E): softmax over all experts, the top k, renormalised (always for Mixtral, for Qwen3-MoE only
    with norm_topk_prob), and the chosen experts' SwiGLU outputs summed with those weights."""
    c = m.config
    if m.family == "mixtral":
        p, n, renorm = f"model.layers.{i}.block_sparse_moe.", c["num_local_experts"], True
        names = ("w1", "w3", "w2")  # gate, up, down
    else:
        p, n, renorm = f"model.layers.{i}.mlp.", c["num_experts"], c.get("norm_topk_prob", False)
        names = ("gate_proj", "up_proj", "down_proj")
    top_k = c["num_experts_per_tok"]
    probs = _softmax(x @ m.w[p + "gate.weight"].T)  # (N, n)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (N, k)
    weights = np.take_along_axis(probs, chosen, axis=-1)  # (N, k)
    if renorm:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if stats is not None and top_k < n and real.any():
        ranked = -np.sort(-probs[real], axis=-1)  # (N real, n), descending
        gap = float((ranked[:, top_k - 1] - ranked[:, top_k]).min())
        stats["router_margin"] = min(stats.get("router_margin", math.inf), gap)
    out = np.zeros_like(x)
    for e in range(n):
        share = (weights * (chosen == e)).sum(axis=-1)  # (N,): 0 where expert e is not chosen
        if share.any():
            g, u, d = (f"{p}experts.{e}.{name}.weight" for name in names)
            out += share[:, None] * _swiglu(m, x, g, u, d)
    return out


def _mlp(m: _Model, i: int, x: np.ndarray, real: np.ndarray, stats: dict | None) -> np.ndarray:
    """Layer i's feed-forward, x (B, T, E) -> (B, T, E)."""
    p = f"model.layers.{i}.mlp."
    if m.is_moe_layer(i):
        B, T, E = x.shape
        return _moe(m, i, x.reshape(B * T, E), real.reshape(B * T), stats).reshape(B, T, E)
    if m.family == "phi3":  # one gate_up_proj: the first intermediate_size rows are the gate, the rest up
        gate, up = np.split(x @ m.w[p + "gate_up_proj.weight"].T, 2, axis=-1)
        return (_act(m.act, gate) * up) @ m.w[p + "down_proj.weight"].T
    return _swiglu(m, x, p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")


def _layer(m: _Model, i: int, h: np.ndarray, positions: np.ndarray, rule: str, stats: dict | None) -> np.ndarray:
    p = f"model.layers.{i}."
    real = positions >= 0
    attended = _attention(m, i, m.norm(h, p + "input_layernorm.weight"), positions, rule)
    if m.gemma:  # Gemma's post_attention_layernorm normalises the attention OUTPUT; its MLP has its own pre/post norms
        h = h + m.norm(attended, p + "post_attention_layernorm.weight")
        fed = _mlp(m, i, m.norm(h, p + "pre_feedforward_layernorm.weight"), real, stats)
        return h + m.norm(fed, p + "post_feedforward_layernorm.weight")
    h = h + attended  # elsewhere post_attention_layernorm is the pre-MLP norm
    return h + _mlp(m, i, m.norm(h, p + "post_attention_layernorm.weight"), real, stats)


def _forward(config: dict, weights, tokens, positions, longrope: str, stats: dict | None) -> np.ndarray:
    m = _Model(config, weights)
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    if tokens.ndim != 2 or tokens.shape != positions.shape:
        raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must be the same (B, T)")
    if longrope not in LONGROPE_RULES:
        raise ValueError(f"longrope rule {longrope!r}; one of {LONGROPE_RULES}")
    embed = m.w["model.embed_tokens.weight"]
    h = embed[tokens]  # (B, T, E)
    if m.gemma:
        h = h * math.sqrt(config["hidden_size"])  # HF casts this normalizer to the weights' dtype first
    for i in range(config["num_hidden_layers"]):
        h = _layer(m, i, h, positions, longrope, stats)
    h = m.norm(h, "model.norm.weight")
    logits = h @ (embed if m.tied else m.w["lm_head.weight"]).T  # (B, T, V)
    if m.final_cap is not None:
        logits = np.tanh(logits / m.final_cap) * m.final_cap
    return logits


def reference_logits(config: dict, weights: dict[str, np.ndarray], tokens, positions, longrope="hf") -> np.ndarray:
    """tokens, positions int (B, T) -> logits (B, T, V) float64.

    Negative positions are left padding: never keys; their own rows of logits are finite garbage. Only the tokens
    given are keys (a row starting at position p > 0 has no keys before p). `longrope` picks Phi-3's short or long
    factors: "hf" long for every token of a row iff that row's max position + 1 > original_max_position_embeddings
    (HF on that row alone); "hf_batch" the same over the whole batch (what HF does to a padded batch: torch.max
    over all of position_ids); "per_token" long iff the token's own position >= original_max_position_embeddings.
    """
    return _forward(config, weights, tokens, positions, longrope, None)


def router_margin(config: dict, weights: dict[str, np.ndarray], tokens, positions, longrope="hf") -> float:
    """The smallest gap, over MoE layers and real tokens, between the k-th and (k+1)-th router probabilities
    (inf without MoE or with top_k = n_experts): a float32 implementation may choose other experts where it is tiny."""
    stats: dict = {}
    _forward(config, weights, tokens, positions, longrope, stats)
    return stats.get("router_margin", math.inf)


# ---------------------------------------------------------------- random weights


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 arrays under Hugging Face's tensor names (one tensor per expert), scaled so that logits are O(1)-O(10),
    attention scores reach the soft-caps and router probabilities differ clearly. Norm weights are offsets around 0
    for Gemma (applied as 1 + w) and around 1 otherwise. No lm_head.weight when the embeddings are tied."""
    m = _Model(config, {})
    rng = np.random.default_rng(seed)
    E, H, K, D, V = config["hidden_size"], m.H, m.K, m.D, config["vocab_size"]

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return rng.normal(0.0, gain / math.sqrt(cols), (rows, cols))

    def norm(size: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, size) if m.gemma else 1.0 + rng.normal(0.0, 0.2, size)

    # Gemma scales embeddings by sqrt(E) and (when tied) reads logits off the same matrix, hence the smaller std.
    w = {"model.embed_tokens.weight": rng.normal(0.0, 0.5 if m.gemma else 1.0, (V, E))}
    qk_gain = 2.0  # scores of a few units: soft-caps, windows and positions all visibly matter
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(E)
        w[p + "post_attention_layernorm.weight"] = norm(E)
        if m.gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(E)
            w[p + "post_feedforward_layernorm.weight"] = norm(E)
        if m.family == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [mat(H * D, E, qk_gain), mat(K * D, E, qk_gain), mat(K * D, E)])
        else:
            w[p + "self_attn.q_proj.weight"] = mat(H * D, E, qk_gain)
            w[p + "self_attn.k_proj.weight"] = mat(K * D, E, qk_gain)
            w[p + "self_attn.v_proj.weight"] = mat(K * D, E)
        w[p + "self_attn.o_proj.weight"] = mat(E, H * D)
        if config.get("attention_bias") and m.family in ("gemma2", "gemma3_text", "qwen3_moe"):
            for n, size in (("q", H * D), ("k", K * D), ("v", K * D), ("o", E)):
                w[p + f"self_attn.{n}_proj.bias"] = rng.normal(0.0, 0.1, size)
        if m.family in ("gemma3_text", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
        w |= _random_mlp(m, i, rng, mat)
    w["model.norm.weight"] = norm(E)
    if not m.tied:
        w["lm_head.weight"] = mat(V, E, 3.0)  # logits of std ~3, like the tied Gemma head
    return {name: value.astype(np.float32) for name, value in w.items()}


def _random_mlp(m: _Model, i: int, rng: np.random.Generator, mat) -> dict[str, np.ndarray]:
    c, E = m.config, m.config["hidden_size"]
    if m.family == "mixtral":
        p, F = f"model.layers.{i}.block_sparse_moe.", c["intermediate_size"]
        out = {p + "gate.weight": mat(c["num_local_experts"], E, 3.0)}
        for e in range(c["num_local_experts"]):
            out |= {p + f"experts.{e}.w1.weight": mat(F, E), p + f"experts.{e}.w3.weight": mat(F, E),
                    p + f"experts.{e}.w2.weight": mat(E, F)}
        return out
    p = f"model.layers.{i}.mlp."
    if m.is_moe_layer(i):
        F = c["moe_intermediate_size"]
        out = {p + "gate.weight": mat(c["num_experts"], E, 3.0)}
        for e in range(c["num_experts"]):
            q = p + f"experts.{e}."
            out |= {q + "gate_proj.weight": mat(F, E), q + "up_proj.weight": mat(F, E),
                    q + "down_proj.weight": mat(E, F)}
        return out
    F = c["intermediate_size"]
    if m.family == "phi3":
        return {p + "gate_up_proj.weight": mat(2 * F, E), p + "down_proj.weight": mat(E, F)}
    return {p + "gate_proj.weight": mat(F, E), p + "up_proj.weight": mat(F, E), p + "down_proj.weight": mat(E, F)}


# ---------------------------------------------------------------- files and other layouts


def write_hf_folder(path, config: dict, weights: dict[str, np.ndarray]) -> None:
    """A Hugging Face model folder: config.json and model.safetensors (float32)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in weights.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def stack_experts_mlx(config: dict, weights) -> dict[str, np.ndarray]:
    """The same weights in mlx-lm's layout (its `sanitize`): each MoE layer's per-expert matrices stacked into one
    (n_experts, out, in) tensor. Mixtral: block_sparse_moe.switch_mlp.{gate_proj <- w1, up_proj <- w3,
    down_proj <- w2}.weight; Qwen3-MoE: mlp.switch_mlp.{gate,up,down}_proj.weight. Other tensors (and other
    families' weights) are returned unchanged."""
    out = dict(weights)
    family = config["model_type"]
    if family not in MOE:
        return out
    m = _Model(config, {})
    for i in range(config["num_hidden_layers"]):
        if not m.is_moe_layer(i):
            continue
        if family == "mixtral":
            p, n = f"model.layers.{i}.block_sparse_moe.", config["num_local_experts"]
            renames = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
        else:
            p, n = f"model.layers.{i}.mlp.", config["num_experts"]
            renames = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj"))
        for src, dst in renames:
            out[f"{p}switch_mlp.{dst}.weight"] = np.stack([out.pop(f"{p}experts.{e}.{src}.weight") for e in range(n)])
    return out
