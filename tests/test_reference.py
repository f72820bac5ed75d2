"""`llama.forward` against a plain NumPy float64 decoder written here, independent of mlxfun."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import VARIANTS, rel_error, tiny_config, tiny_params

from mlxfun.model import llama

# ---------------------------------------------------------------- the NumPy reference (float64)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_frequencies(config) -> np.ndarray:
    """(D/2,) angular frequency of each rotated pair, after `rope_scaling` (as in HF transformers)."""
    d = config.head_dim
    inv = config.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    s = config.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    assert s.kind == "llama3"
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def apply_rope(x: np.ndarray, positions: np.ndarray, config) -> np.ndarray:
    """x (B, T, H, D) rotated by angle position * freq; pairs are (i, i + D/2), or (2i, 2i + 1) if traditional."""
    angles = positions[:, :, None].astype(np.float64) * inv_frequencies(config)  # (B, T, D/2)
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]  # (B, T, 1, D/2)
    if config.rope_traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference_forward(config, w: dict[str, np.ndarray], tokens, positions, windows=None) -> np.ndarray:
    """tokens, positions (B, T) -> logits (B, T, V). A key is visible when its position is >= 0, <= the
    query's, and (in a layer with window W) within the last W positions or among the layer's sinks
    (`config.layer_sinks`: the first positions). Padding queries are garbage."""
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    B, T = tokens.shape
    H, K, D, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    windows = windows or config.layer_windows
    q_pos, k_pos = positions[:, :, None], positions[:, None, :]
    h = w["model.embed_tokens.weight"][tokens]  # (B, T, E)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if config.attention_bias:
            q, k, v = (y + w[p + f"self_attn.{n}_proj.bias"] for y, n in zip((q, k, v), "qkv", strict=True))
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
        if config.qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = apply_rope(q, positions, config), apply_rope(k, positions, config)
        visible = (k_pos >= 0) & (k_pos <= q_pos)  # (B, T, T)
        if windows[i] is not None:
            visible &= (q_pos - k_pos < windows[i]) | (k_pos < config.layer_sinks[i])
        visible |= ~visible.any(-1, keepdims=True)  # padding queries: anything finite
        group = H // K  # query head j reads key/value head j // group
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # (B, T, H, D)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        scores = np.where(visible[:, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, H * D)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return h @ head.T


# ---------------------------------------------------------------- tests

QUANT = {"dense": None, "q4g32": (4, 32), "q8g64": (8, 64)}


def random_tokens(config, shape, seed=1):
    return np.random.default_rng(seed).integers(0, config.vocab_size, shape).astype(np.int32)


def run(config, params, tokens, positions):
    logits, _ = llama.forward(config, params, mx.array(tokens), mx.array(positions, dtype=mx.int32))
    return np.array(logits.astype(mx.float32))


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_numpy(variant, quant):
    config = tiny_config(**VARIANTS[variant])
    params, ref_weights = tiny_params(config, seed=hash(variant) % 1000, quant=QUANT[quant])
    assert (params.lm_head is None) == config.tie_word_embeddings
    tokens = random_tokens(config, (2, 11))
    positions = np.broadcast_to(np.arange(11), (2, 11)) + np.array([[0], [5]])  # row 1 starts at position 5
    expected = reference_forward(config, ref_weights, tokens, positions)
    actual = run(config, params, tokens, positions)
    assert actual.shape == (2, 11, config.vocab_size)
    assert rel_error(actual, expected) < 1e-4


def test_rope_variants_disagree():
    """The rope settings matter on these tiny configs, so the comparisons above can tell them apart."""
    base = tiny_config()
    _, w = tiny_params(base)
    tokens, positions = random_tokens(base, (1, 12)), np.arange(12)[None]
    logits = reference_forward(base, w, tokens, positions)
    for change in ("llama3_rope", "linear_rope", "traditional_rope"):
        other = tiny_config(**{k: v for k, v in VARIANTS[change].items() if k.startswith("rope_")})
        assert rel_error(reference_forward(other, w, tokens, positions), logits) > 1e-2, change


def test_mixed_precision_quantization():
    """Per-matrix bits and group sizes (mlx-community's mixed recipes); q/k/v of unequal precision."""
    config = tiny_config(**VARIANTS["bias"])
    overrides = {"model.layers.0.self_attn.v_proj": (8, 32), "model.layers.1.mlp.down_proj": (8, 64),
                 "model.layers.1.mlp.up_proj": (6, 64), "model.embed_tokens": (8, 64)}
    params, w = tiny_params(config, seed=4, quant=(4, 64), overrides=overrides)
    tokens, positions = random_tokens(config, (2, 8)), np.broadcast_to(np.arange(8), (2, 8))
    assert rel_error(run(config, params, tokens, positions), reference_forward(config, w, tokens, positions)) < 1e-4


@pytest.mark.parametrize("variant", ["tied", "qk_norm", "bias", "llama3_rope", "gqa4", "window"])
@pytest.mark.parametrize("quant", ["dense", "q4g32"])
def test_left_padded_batch_equals_rows_alone(variant, quant):
    """Rows of lengths 9, 5 and 1, left-padded with negative positions: each row's real tokens get
    the logits of that row alone."""
    config = tiny_config(**{**VARIANTS, "window": {"layer_windows": (3, None)}}[variant])
    params, w = tiny_params(config, seed=3, quant=QUANT[quant])
    lengths, T = [9, 5, 1], 9
    rows = [random_tokens(config, (1, n), seed=10 + n) for n in lengths]
    tokens = np.stack([np.pad(r[0], (T - len(r[0]), 0), constant_values=7) for r in rows])
    positions = np.stack([np.arange(T) - (T - n) for n in lengths])  # e.g. [-4 .. -1, 0 .. 4]
    batch = run(config, params, tokens, positions)
    assert np.isfinite(batch).all()
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        alone = run(config, params, row, np.arange(n)[None])
        assert rel_error(batch[b, T - n:], alone[0]) < 1e-4
        assert rel_error(alone[0], reference_forward(config, w, row, np.arange(n)[None])[0]) < 1e-4


def test_window_matches_numpy():
    config = tiny_config(layer_windows=(3, None))
    params, w = tiny_params(config, seed=5)
    tokens = random_tokens(config, (2, 10))
    positions = np.broadcast_to(np.arange(10), (2, 10))
    expected = reference_forward(config, w, tokens, positions)
    assert rel_error(run(config, params, tokens, positions), expected) < 1e-4
    # and the window changes the answer
    assert rel_error(reference_forward(config, w, tokens, positions, windows=(None, None)), expected) > 1e-2
