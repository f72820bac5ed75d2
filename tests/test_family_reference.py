"""Checks of tests/family_reference.py itself: a second, loop-by-loop implementation agrees with it, and the
behaviours the modeling files specify (windows, soft-caps, layer kinds, longrope, routing) visibly take effect."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from family_reference import (
    FAMILIES,
    layer_windows,
    random_weights,
    reference_logits,
    router_margin,
    stack_experts_mlx,
    tiny_config,
    write_hf_folder,
)

# ---------------------------------------------------------------- a naive implementation: row, token, head loops


def naive_is_sliding(config: dict, i: int) -> bool:
    family = config["model_type"]
    if family in ("gemma2", "gemma3_text") and config.get("layer_types"):
        return config["layer_types"][i] == "sliding_attention"
    if family == "gemma2":
        return i % 2 == 0
    if family == "gemma3_text":
        return (i + 1) % config.get("sliding_window_pattern", 6) != 0
    return True


def naive_rotation(config: dict, i: int, position: int, long: bool) -> tuple[list[float], list[float], int]:
    """(cos, sin, rotary_dim) of one token in layer i, cos and sin already scaled by the attention factor."""
    family = config["model_type"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = int(head_dim * config.get("partial_rotary_factor", 1.0))
    local = family == "gemma3_text" and naive_is_sliding(config, i)
    theta = config["rope_local_base_freq"] if local else config["rope_theta"]
    scaling = None if local else config.get("rope_scaling")
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    scale, cos, sin = 1.0, [], []
    if kind in ("longrope", "su"):
        original = config["original_max_position_embeddings"]
        scale = math.sqrt(1 + math.log(config["max_position_embeddings"] / original) / math.log(original))
    for n in range(rotary // 2):
        freq = 1.0 / theta ** (2 * n / rotary)
        if kind == "linear":
            freq /= scaling["factor"]
        elif kind in ("longrope", "su"):
            freq /= scaling["long_factor" if long else "short_factor"][n]
        cos.append(math.cos(position * freq) * scale)
        sin.append(math.sin(position * freq) * scale)
    return cos, sin, rotary


def naive_rotate(x: np.ndarray, cos: list[float], sin: list[float]) -> np.ndarray:
    y = x.copy()
    half = len(cos)
    for n in range(half):
        a, b = x[n], x[n + half]
        y[n], y[n + half] = a * cos[n] - b * sin[n], b * cos[n] + a * sin[n]
    return y


def naive_norm(x: np.ndarray, w: np.ndarray, eps: float, gemma: bool) -> np.ndarray:
    y = x / math.sqrt(float(np.mean(x**2)) + eps)
    return y * (w + 1.0) if gemma else y * w


def naive_act(x: np.ndarray, gemma: bool) -> np.ndarray:
    if gemma:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x / (1 + np.exp(-x))


def naive_mlp(config: dict, w: dict, i: int, x: np.ndarray) -> np.ndarray:
    family, gemma = config["model_type"], config["model_type"].startswith("gemma")
    if family == "phi3":
        both = w[f"model.layers.{i}.mlp.gate_up_proj.weight"] @ x
        half = len(both) // 2
        return w[f"model.layers.{i}.mlp.down_proj.weight"] @ (naive_act(both[:half], False) * both[half:])
    if family == "mixtral":
        p, n_experts, renorm = f"model.layers.{i}.block_sparse_moe.", config["num_local_experts"], True
        names = ["w1", "w3", "w2"]
    elif family == "qwen3_moe" and i not in config["mlp_only_layers"] and (i + 1) % config["decoder_sparse_step"] == 0:
        p, n_experts, renorm = f"model.layers.{i}.mlp.", config["num_experts"], config["norm_topk_prob"]
        names = ["gate_proj", "up_proj", "down_proj"]
    else:
        p = f"model.layers.{i}.mlp."
        gate, up, down = (w[p + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        return down @ (naive_act(gate @ x, gemma) * (up @ x))
    logits = w[p + "gate.weight"] @ x
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    best = sorted(range(n_experts), key=lambda e: -probs[e])[: config["num_experts_per_tok"]]
    total = sum(probs[e] for e in best) if renorm else 1.0
    out = np.zeros_like(x)
    for e in best:
        gate, up, down = (w[p + f"experts.{e}.{n}.weight"] for n in names)
        out += probs[e] / total * (down @ (naive_act(gate @ x, False) * (up @ x)))
    return out


def naive_attention(config: dict, w: dict, i: int, xs: list, positions: list, longs: list) -> list:
    family, gemma = config["model_type"], config["model_type"].startswith("gemma")
    H, K = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or config["hidden_size"] // H
    eps, p = config["rms_norm_eps"], f"model.layers.{i}.self_attn."
    window = config.get("sliding_window") if naive_is_sliding(config, i) else None
    qs, ks, vs = [], [], []
    for x, pos, long in zip(xs, positions, longs, strict=True):
        if family == "phi3":
            qkv = w[p + "qkv_proj.weight"] @ x
            q, k, v = qkv[: H * D], qkv[H * D: (H + K) * D], qkv[(H + K) * D:]
        else:
            q, k, v = (w[p + f"{n}_proj.weight"] @ x for n in "qkv")
        q, k, v = list(q.reshape(H, D)), list(k.reshape(K, D)), list(v.reshape(K, D))
        if family in ("gemma3_text", "qwen3_moe"):
            q = [naive_norm(h, w[p + "q_norm.weight"], eps, gemma) for h in q]
            k = [naive_norm(h, w[p + "k_norm.weight"], eps, gemma) for h in k]
        cos, sin, _ = naive_rotation(config, i, pos, long)
        qs.append([naive_rotate(h, cos, sin) for h in q])
        ks.append([naive_rotate(h, cos, sin) for h in k])
        vs.append(v)
    scale = config["query_pre_attn_scalar"] ** -0.5 if gemma else D**-0.5
    cap = config.get("attn_logit_softcapping") if family == "gemma2" else None
    outs = []
    for t, qpos in enumerate(positions):
        keys = [s for s, kpos in enumerate(positions) if 0 <= kpos <= qpos and (window is None or qpos - kpos < window)]
        keys = keys or list(range(len(positions)))
        heads = []
        for j in range(H):
            kv = j // (H // K)
            scores = [float(qs[t][j] @ ks[s][kv]) * scale for s in keys]
            if cap:
                scores = [cap * math.tanh(s / cap) for s in scores]
            top = max(scores)
            e = [math.exp(s - top) for s in scores]
            heads.append(sum(ei / sum(e) * vs[s][kv] for ei, s in zip(e, keys, strict=True)))
        outs.append(w[p + "o_proj.weight"] @ np.concatenate(heads))
    return outs


def naive_row(config: dict, w: dict, tokens, positions, longs) -> np.ndarray:
    family, gemma = config["model_type"], config["model_type"].startswith("gemma")
    eps = config["rms_norm_eps"]
    embed = w["model.embed_tokens.weight"]
    hs = [embed[t] * (math.sqrt(config["hidden_size"]) if gemma else 1.0) for t in tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        xs = [naive_norm(h, w[p + "input_layernorm.weight"], eps, gemma) for h in hs]
        attended = naive_attention(config, w, i, xs, list(positions), longs)
        if gemma:
            hs = [h + naive_norm(a, w[p + "post_attention_layernorm.weight"], eps, True) for h, a in zip(hs, attended)]
            fed = [naive_mlp(config, w, i, naive_norm(h, w[p + "pre_feedforward_layernorm.weight"], eps, True))
                   for h in hs]
            hs = [h + naive_norm(f, w[p + "post_feedforward_layernorm.weight"], eps, True) for h, f in zip(hs, fed)]
        else:
            hs = [h + a for h, a in zip(hs, attended)]
            hs = [h + naive_mlp(config, w, i, naive_norm(h, w[p + "post_attention_layernorm.weight"], eps, False))
                  for h in hs]
    head = w.get("lm_head.weight", embed) if family in ("phi3", "mixtral", "qwen3_moe") else embed
    logits = np.stack([head @ naive_norm(h, w["model.norm.weight"], eps, gemma) for h in hs])
    cap = config.get("final_logit_softcapping") if gemma else None
    return cap * np.tanh(logits / cap) if cap else logits


def naive_logits(config: dict, weights: dict, tokens, positions, rule: str = "hf") -> np.ndarray:
    w = {name: value.astype(np.float64) for name, value in weights.items()}
    original = config.get("original_max_position_embeddings", 10**9)
    rows = []
    for b in range(len(tokens)):
        if rule == "per_token":
            longs = [pos >= original for pos in positions[b]]
        elif rule == "hf":
            longs = [max(positions[b]) >= original] * len(positions[b])
        else:
            longs = [int(np.max(positions)) >= original] * len(positions[b])
        rows.append(naive_row(config, w, tokens[b], positions[b], longs))
    return np.stack(rows)


# ---------------------------------------------------------------- helpers


def prompt(n: int, seed: int = 0, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 96, (1, n))
    return tokens, np.arange(start, start + n)[None]


def left_padded(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A batch of random rows, left-padded (token 0, position -1) to the longest."""
    T = max(lengths)
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), T), dtype=np.int64)
    positions = np.full((len(lengths), T), -1, dtype=np.int64)
    for b, n in enumerate(lengths):
        tokens[b, T - n:] = rng.integers(0, 96, n)
        positions[b, T - n:] = np.arange(n)
    return tokens, positions


def differ(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def model(family: str, **overrides) -> tuple[dict, dict]:
    config = tiny_config(family, **overrides)
    return config, random_weights(config)


VARIANTS = [
    ("gemma2", {}, "hf"),
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]}, "hf"),
    ("gemma3_text", {}, "hf"),
    ("gemma3_text", {"final_logit_softcapping": 6.0, "rope_scaling": None}, "hf"),
    ("phi3", {}, "hf"),
    ("phi3", {}, "per_token"),
    ("phi3", {}, "hf_batch"),
    ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": None}, "per_token"),
    ("mixtral", {}, "hf"),
    ("mixtral", {"sliding_window": 5, "num_local_experts": 5, "num_experts_per_tok": 3}, "hf"),
    ("qwen3_moe", {}, "hf"),
    ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2}, "hf"),
]

# ---------------------------------------------------------------- the two implementations agree


@pytest.mark.parametrize("family, overrides, rule", VARIANTS)
def test_reference_matches_the_naive_loops(family, overrides, rule):
    config, weights = model(family, **overrides)
    tokens, positions = left_padded([7, 19])  # crosses the windows, and phi3's original_max (16) in one row only
    expected = naive_logits(config, weights, tokens, positions, rule)
    actual = reference_logits(config, weights, tokens, positions, longrope=rule)
    real = positions >= 0
    assert actual.shape == (2, 19, 96) and actual.dtype == np.float64
    np.testing.assert_allclose(actual[real], expected[real], rtol=1e-9, atol=1e-9)
    assert np.isfinite(actual).all()  # padding rows too


# ---------------------------------------------------------------- configs and weights


def test_configs_are_json_and_follow_the_brief():
    for family in FAMILIES:
        config = tiny_config(family)
        assert json.loads(json.dumps(config)) == config and config["model_type"] == family
        H, K, E = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
        assert K < H and H % K == 0 and E % H == 0 and 2 <= config["num_hidden_layers"] <= 7
    for family in ("gemma2", "gemma3_text", "qwen3_moe"):
        config = tiny_config(family)
        assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
    assert tiny_config("gemma2", vocab_size=50)["vocab_size"] == 50


def test_phi3_longrope_factor_lists_follow_the_rotary_dim():
    assert len(tiny_config("phi3")["rope_scaling"]["short_factor"]) == 8  # head_dim 16 -> 8 pairs
    half = tiny_config("phi3", partial_rotary_factor=0.5)["rope_scaling"]
    assert len(half["short_factor"]) == len(half["long_factor"]) == 4
    assert tiny_config("phi3", rope_scaling=None)["rope_scaling"] is None


def expected_names(config: dict) -> set[str]:
    family = config["model_type"]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if family in ("phi3", "mixtral", "qwen3_moe"):
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"}
        if family == "phi3":
            names |= {p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"}
        else:
            names |= {p + f"self_attn.{n}_proj.weight" for n in "qkv"}
        if family.startswith("gemma"):
            names |= {p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"}
        if family in ("gemma3_text", "qwen3_moe"):
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        if family == "mixtral":
            names.add(p + "block_sparse_moe.gate.weight")
            names |= {p + f"block_sparse_moe.experts.{e}.{n}.weight" for e in range(4) for n in ("w1", "w2", "w3")}
        elif family == "qwen3_moe" and i != 1:
            names.add(p + "mlp.gate.weight")
            names |= {p + f"mlp.experts.{e}.{n}_proj.weight" for e in range(8) for n in ("gate", "up", "down")}
        elif family != "phi3":
            names |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_have_hf_names_shapes_and_scale(family):
    config, weights = model(family)
    assert set(weights) == expected_names(config)
    assert all(w.dtype == np.float32 for w in weights.values())
    H, K, E = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    D = config.get("head_dim") or E // H
    if family == "phi3":
        assert weights["model.layers.0.self_attn.qkv_proj.weight"].shape == ((H + 2 * K) * D, E)
        assert weights["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * config["intermediate_size"], E)
    else:
        assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (K * D, E)
    norm = weights["model.norm.weight"]
    assert abs(norm.mean() - (0.0 if family.startswith("gemma") else 1.0)) < 0.2
    tokens, positions = prompt(30)
    logits = reference_logits(config, weights, tokens, positions)
    assert 1.0 < logits.std() < 10.0 and np.abs(logits).max() < 40.0
    assert weights is not random_weights(config) and all(
        np.array_equal(w, v) for w, v in zip(weights.values(), random_weights(config).values(), strict=True))


def test_router_margin_is_reported_for_moe_only():
    tokens, positions = prompt(20)
    for family in ("mixtral", "qwen3_moe"):
        assert 0.0 < router_margin(*model(family), tokens, positions) < 1.0
    assert router_margin(*model("gemma2"), tokens, positions) == math.inf
    assert router_margin(*model("qwen3_moe", num_experts_per_tok=8), tokens, positions) == math.inf


# ---------------------------------------------------------------- windows and masks


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "mixtral"])
def test_window_is_q_minus_k_below_w(family):
    """With window W the last of W tokens still sees all of them (q - k = W - 1); the last of W + 1 does not."""
    config, weights = model(family, sliding_window=5)
    unwindowed = config | {"sliding_window": None}
    for n, same in ((5, True), (6, False)):
        tokens, positions = prompt(n)
        a = reference_logits(config, weights, tokens, positions)[0, -1]
        b = reference_logits(unwindowed, weights, tokens, positions)[0, -1]
        assert (differ(a, b) < 1e-12) == same, (n, differ(a, b))


def test_long_prompts_feel_the_default_windows():
    tokens, positions = prompt(40)
    for family in ("gemma2", "gemma3_text", "phi3"):
        config, weights = model(family)
        a = reference_logits(config, weights, tokens, positions)[0, -1]
        assert differ(a, reference_logits(config | {"sliding_window": None}, weights, tokens, positions)[0, -1]) > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_leaves_a_rows_real_logits_alone(family):
    config, weights = model(family)
    tokens, positions = left_padded([9, 24], seed=3)
    batched = reference_logits(config, weights, tokens, positions)
    alone = reference_logits(config, weights, tokens[:1, -9:], positions[:1, -9:])
    np.testing.assert_allclose(batched[0, -9:], alone[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_only_relative_positions_matter_without_longrope(family):
    """A row may start past 0: RoPE depends on q - k only, and the window on positions, not indices."""
    config, weights = model(family, **({"rope_scaling": None} if family == "phi3" else {}))
    tokens, positions = prompt(20)
    a = reference_logits(config, weights, tokens, positions)
    np.testing.assert_allclose(reference_logits(config, weights, tokens, positions + 13), a, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- Gemma


def test_gemma2_softcaps_matter_and_bound_the_logits():
    config, weights = model("gemma2")
    tokens, positions = prompt(30)
    capped = reference_logits(config, weights, tokens, positions)
    assert np.abs(capped).max() < config["final_logit_softcapping"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        assert differ(reference_logits(config | {key: None}, weights, tokens, positions), capped) > 0.5, key


def test_gemma3_applies_the_final_cap_but_not_the_attention_cap():
    """Gemma3Attention never passes attn_logit_softcapping to the attention function; the LM head caps logits."""
    config, weights = model("gemma3_text")
    tokens, positions = prompt(20)
    plain = reference_logits(config, weights, tokens, positions)
    np.testing.assert_array_equal(
        reference_logits(config | {"attn_logit_softcapping": 1.0}, weights, tokens, positions), plain)
    assert np.abs(reference_logits(config | {"final_logit_softcapping": 3.0}, weights, tokens, positions)).max() < 3


def test_gemma_layer_kinds():
    assert layer_windows(tiny_config("gemma2")) == [6, None, 6, None]  # even layers slide
    assert layer_windows(tiny_config("gemma3_text")) == [4, 4, None, 4, 4]  # pattern 3: layer 2 global
    assert layer_windows(tiny_config("gemma3_text", sliding_window_pattern=2)) == [4, None, 4, None, 4]
    kinds = ["full_attention", "sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert layer_windows(tiny_config("gemma3_text", layer_types=kinds)) == [None, 4, None, None, 4]
    assert layer_windows(tiny_config("phi3")) == [8, 8, 8] and layer_windows(tiny_config("mixtral")) == [None] * 2


def test_gemma3_local_layers_use_the_local_base_and_no_scaling():
    tokens, positions = prompt(20)
    for kind, local_knob_matters in (("sliding_attention", True), ("full_attention", False)):
        config, weights = model("gemma3_text", layer_types=[kind] * 5)
        plain = reference_logits(config, weights, tokens, positions)
        knobs = {"rope_local_base_freq": 100.0, "rope_theta": 100.0, "rope_scaling": None}
        for key, value in knobs.items():
            matters = differ(reference_logits(config | {key: value}, weights, tokens, positions), plain) > 1e-6
            assert matters == (local_knob_matters == (key == "rope_local_base_freq")), (kind, key)


# ---------------------------------------------------------------- Phi-3 longrope


def test_phi3_longrope_rules():
    config, weights = model("phi3", sliding_window=None)
    short = prompt(16)  # max position 15: seq_len 16 is not > 16, short factors everywhere under every rule
    hf, per_token = (reference_logits(config, weights, *short, longrope=r) for r in ("hf", "per_token"))
    np.testing.assert_array_equal(hf, per_token)
    long = prompt(17)  # position 16: HF switches the whole row to long factors, per_token only that token
    hf, per_token = (reference_logits(config, weights, *long, longrope=r) for r in ("hf", "per_token"))
    assert differ(hf[0, :16], per_token[0, :16]) > 0.1
    np.testing.assert_allclose(per_token[0, :16], reference_logits(config, weights, *short)[0], rtol=1e-12)
    scaling = config["rope_scaling"]
    never_long = config | {"rope_scaling": scaling | {"long_factor": scaling["short_factor"]}}
    assert differ(per_token[0, 16], reference_logits(never_long, weights, *long, longrope="per_token")[0, 16]) > 0.1


def test_phi3_hf_batch_rule_switches_short_rows_too():
    config, weights = model("phi3")
    tokens, positions = left_padded([9, 24])
    alone = reference_logits(config, weights, tokens[:1, -9:], positions[:1, -9:])[0]
    for rule, same in (("hf", True), ("per_token", True), ("hf_batch", False)):
        batched = reference_logits(config, weights, tokens, positions, longrope=rule)[0, -9:]
        assert (differ(batched, alone) < 1e-12) == same, rule


def test_phi3_attention_factor_and_legacy_type():
    config, weights = model("phi3")
    tokens, positions = prompt(20)
    plain = reference_logits(config, weights, tokens, positions)
    for legacy in ("su", "yarn"):  # Phi3Config renames both to longrope
        renamed = config | {"rope_scaling": config["rope_scaling"] | {"type": legacy}}
        np.testing.assert_array_equal(reference_logits(renamed, weights, tokens, positions), plain)
    # an explicit attention_factor equal to sqrt(1 + ln 4 / ln 16) changes nothing; another value does
    for factor, same in ((math.sqrt(1.5), True), (1.0, False)):
        given = config | {"rope_scaling": config["rope_scaling"] | {"attention_factor": factor}}
        assert (differ(reference_logits(given, weights, tokens, positions), plain) < 1e-9) == same


def test_phi3_partial_rotary_factor_matters():
    config, weights = model("phi3", partial_rotary_factor=0.5)
    tokens, positions = prompt(12)
    full_config = config | {"partial_rotary_factor": 1.0, "rope_scaling": tiny_config("phi3")["rope_scaling"]}
    assert differ(reference_logits(config, weights, tokens, positions),
                  reference_logits(full_config, weights, tokens, positions)) > 0.1


# ---------------------------------------------------------------- MoE routing


def test_qwen3_moe_renormalisation():
    tokens, positions = prompt(15)
    config, weights = model("qwen3_moe", num_experts_per_tok=8)  # all experts: the softmax already sums to 1
    np.testing.assert_allclose(reference_logits(config, weights, tokens, positions),
                               reference_logits(config | {"norm_topk_prob": False}, weights, tokens, positions),
                               rtol=1e-12, atol=1e-12)
    config, weights = model("qwen3_moe")  # top 2 of 8
    assert differ(reference_logits(config, weights, tokens, positions),
                  reference_logits(config | {"norm_topk_prob": False}, weights, tokens, positions)) > 0.1


def clone_expert_0(config: dict, weights: dict) -> dict:
    """Every expert made a copy of expert 0 (the router left as it is)."""
    out = dict(weights)
    for name in weights:
        if ".experts." in name:
            layer, rest = name.split(".experts.")
            out[name] = weights[f"{layer}.experts.0.{rest.split('.', 1)[1]}"]
    return out


@pytest.mark.parametrize("family, renormalised", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_identical_experts_equal_one_expert_iff_renormalised(family, renormalised):
    config, weights = model(family, **({} if family == "mixtral" else {"norm_topk_prob": renormalised}))
    n_key = "num_local_experts" if family == "mixtral" else "num_experts"
    single = config | {n_key: 1, "num_experts_per_tok": 1}
    single_weights = {n: w for n, w in weights.items() if ".experts." not in n or ".experts.0." in n}
    for name in [n for n in single_weights if n.endswith("gate.weight") and "gate_proj" not in n]:
        single_weights[name] = weights[name][:1]  # the one router row
    tokens, positions = prompt(15)
    cloned = reference_logits(config, clone_expert_0(config, weights), tokens, positions)
    one = reference_logits(single, single_weights, tokens, positions)
    assert (differ(cloned, one) < 1e-9) == renormalised


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_permuting_experts_with_their_router_rows_changes_nothing(family):
    config, weights = model(family)
    n = config["num_local_experts" if family == "mixtral" else "num_experts"]
    order = np.random.default_rng(5).permutation(n)
    permuted = dict(weights)
    for name, w in weights.items():
        if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
            permuted[name] = w[order]
        elif ".experts." in name:
            layer, rest = name.split(".experts.")
            e, tail = rest.split(".", 1)
            permuted[f"{layer}.experts.{int(np.argsort(order)[int(e)])}.{tail}"] = w
    tokens, positions = prompt(15)
    np.testing.assert_allclose(reference_logits(config, permuted, tokens, positions),
                               reference_logits(config, weights, tokens, positions), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- files and layouts


def test_write_hf_folder_round_trips(tmp_path):
    from safetensors.numpy import load_file

    config, weights = model("qwen3_moe")
    write_hf_folder(tmp_path / "m", config, weights)
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == config
    loaded = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert set(loaded) == set(weights)
    assert all(loaded[n].dtype == np.float32 and np.array_equal(loaded[n], weights[n]) for n in weights)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_stack_experts_mlx(family):
    config, weights = model(family)
    stacked = stack_experts_mlx(config, weights)
    assert not any(".experts." in n for n in stacked)
    if family == "mixtral":
        p, n = "model.layers.1.block_sparse_moe.", 4
        renames = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    else:
        p, n = "model.layers.2.mlp.", 8
        renames = tuple((k, k) for k in ("gate_proj", "up_proj", "down_proj"))
        assert "model.layers.1.mlp.gate_proj.weight" in stacked  # the dense layer is untouched
    for src, dst in renames:
        block = stacked[f"{p}switch_mlp.{dst}.weight"]
        assert block.shape == (n, *weights[f"{p}experts.0.{src}.weight"].shape)
        assert all(np.array_equal(block[e], weights[f"{p}experts.{e}.{src}.weight"]) for e in range(n))
    assert np.array_equal(stacked[p + "gate.weight"], weights[p + "gate.weight"])
    assert set(stack_experts_mlx(tiny_config("phi3"), {"a": 1})) == {"a"}
