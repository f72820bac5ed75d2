"""The families beyond Llama's own (Gemma 2 / 3, Phi-3, Mixtral, Qwen3-MoE) against the float64
NumPy reference of tests/family_reference.py, written from Hugging Face's modeling files; and
through the engine: batched == alone (through window boundaries), folders in both expert layouts,
quantized experts, `mlxfun.save`, and tensor-parallel shards of experts."""

from __future__ import annotations

import dataclasses

import family_reference as ref
import mlx.core as mx
import numpy as np
import pytest
from helpers import rel_error, tiny_tokenizer

import mlxfun
from mlxfun.engine import strategy
from mlxfun.model import config as cfg
from mlxfun.model import llama, moe, weights
from mlxfun.model import tokenizer as tok
from mlxfun.model.load import Model
from mlxfun.parallel import shard


def build(raw: dict, w: dict) -> tuple[cfg.ModelConfig, llama.Params]:
    config = cfg.from_hf(raw)
    return config, weights.build_params(config, {k: mx.array(v) for k, v in w.items()})


def padded_rows(vocab: int, lengths: list[int], seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of these lengths left-padded to the longest: tokens and positions (B, T), padding at -1..."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    tokens = rng.integers(1, vocab, (len(lengths), T)).astype(np.int32)
    positions = np.stack([np.arange(T) - (T - n) for n in lengths]).astype(np.int32)
    return tokens, positions


def logits(config, params, tokens, positions) -> np.ndarray:
    out, _ = llama.forward(config, params, mx.array(tokens), mx.array(positions))
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("family", ref.FAMILIES)
def test_forward_matches_the_float64_reference(family):
    raw = ref.tiny_config(family)
    w = ref.random_weights(raw, seed=3)
    config, params = build(raw, w)
    tokens, positions = padded_rows(raw["vocab_size"], [40, 23, 5])
    expected = ref.reference_logits(raw, w, tokens, positions, longrope="per_token")
    actual = logits(config, params, tokens, positions)
    real = positions >= 0
    assert rel_error(actual[real], expected[real]) < 1e-4
    # Each row alone is the same (left padding hides nothing and adds nothing).
    alone = logits(config, params, tokens[2:, -5:], positions[2:, -5:])
    assert rel_error(alone[0], actual[2, -5:]) < 1e-5


def test_phi3_longrope_equals_hugging_face_within_the_original_context():
    """Below `original_max_position_embeddings` (16 here) mlxfun's per-token rule is Hugging Face's
    (short factors); past it, Hugging Face rotates a whole sequence with the long ones."""
    raw = ref.tiny_config("phi3", partial_rotary_factor=0.5)
    w = ref.random_weights(raw, seed=4)
    config, params = build(raw, w)
    assert config.rotary_dim == 8 and config.rope_scaling.kind == "longrope"
    short, _ = padded_rows(96, [16])
    pos16 = np.arange(16)[None].astype(np.int32)
    assert rel_error(logits(config, params, short, pos16), ref.reference_logits(raw, w, short, pos16, "hf")) < 1e-4
    long, pos40 = padded_rows(96, [40])
    ours = logits(config, params, long, pos40)
    assert rel_error(ours, ref.reference_logits(raw, w, long, pos40, "per_token")) < 1e-4
    assert rel_error(ours, ref.reference_logits(raw, w, long, pos40, "hf")) > 1e-3  # the rules do differ there


def test_gemma_features_change_the_answer():
    """The tiny configs exercise what makes Gemma Gemma: dropping the soft-caps or the windows, or
    the 1 + w norm scale, changes the logits (so the comparison above can tell them apart)."""
    raw = ref.tiny_config("gemma2")
    w = ref.random_weights(raw, seed=5)
    config, params = build(raw, w)
    tokens, positions = padded_rows(96, [30])
    base = logits(config, params, tokens, positions)
    for change in (dict(attn_softcap=None), dict(final_softcap=None),
                   dict(layer_windows=(None,) * config.num_layers, layer_sinks=(0,) * config.num_layers)):
        assert rel_error(logits(dataclasses.replace(config, **change), params, tokens, positions), base) > 1e-3


def model_for(family: str, seed: int = 0, **overrides) -> Model:
    raw = ref.tiny_config(family, **overrides)
    config, params = build(raw, ref.random_weights(raw, seed=seed))
    return Model(config, params, tiny_tokenizer(config.vocab_size), family)


@pytest.mark.parametrize("family", ref.FAMILIES)
def test_batched_and_continuous_equal_alone(family):
    """Greedy tokens through the engine, prompts of 3-30 tokens and 16 generated: past the tiny
    windows (4-8), alone, in one batch, reversed, and two rows refilled as prompts finish."""
    model = model_for(family)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 96, n).tolist() for n in (3, 30, 11, 19)]
    alone = [mlxfun.generate(model, p, max_tokens=16, ignore_eos=True).token_ids[0] for p in prompts]
    assert mlxfun.generate(model, prompts, max_tokens=16, ignore_eos=True).token_ids == alone
    assert mlxfun.generate(model, prompts[::-1], max_tokens=16, ignore_eos=True).token_ids == alone[::-1]
    assert mlxfun.generate(model, prompts, max_tokens=16, ignore_eos=True, batch_size=2,
                           prefill_step=8).token_ids == alone
    # and the engine's tokens are the reference's greedy choice at the first step
    raw = ref.tiny_config(family)
    w = ref.random_weights(raw, seed=0)
    first = [int(ref.reference_logits(raw, w, np.array([p]), np.arange(len(p))[None], "per_token")[0, -1].argmax())
             for p in prompts]
    assert [a[0] for a in alone] == first


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_stacked_and_per_expert_folders_load_alike(tmp_path, family):
    raw = ref.tiny_config(family)
    w = ref.random_weights(raw, seed=2)
    stacked = ref.stack_experts_mlx(raw, w)
    assert set(stacked) != set(w)
    for name, tensors in (("hf", w), ("mlx", stacked)):
        ref.write_hf_folder(tmp_path / name, raw, tensors)
        tok.save_folder(tiny_tokenizer(raw["vocab_size"]), tmp_path / name)
    a, b = mlxfun.load(tmp_path / "hf"), mlxfun.load(tmp_path / "mlx")
    tokens, positions = padded_rows(96, [12])
    assert np.array_equal(logits(a.config, a.params, tokens, positions), logits(b.config, b.params, tokens, positions))


@pytest.mark.parametrize("family", ref.FAMILIES)
def test_save_and_load_round_trip(tmp_path, family):
    model = model_for(family, seed=6)
    loaded = mlxfun.load(mlxfun.save(model, tmp_path / family))
    assert loaded.config == model.config
    tokens, positions = padded_rows(96, [20])
    assert rel_error(logits(loaded.config, loaded.params, tokens, positions),
                     logits(model.config, model.params, tokens, positions)) < 1e-6


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_quantized_experts_equal_their_dequantized_copy(family):
    """4-bit experts run `mx.gather_qmm`, sorted by expert from 64 routes on; a dense copy of the
    same values runs `mx.gather_mm`: the same answer to rounding. A batch's dense copy
    (`strategy.dense_copy`) leaves the experts quantized."""
    model = model_for(family, seed=8, hidden_size=64, intermediate_size=64)
    q = weights.quantize(model.config, model.params, bits=4, group_size=32)
    dense = weights.cast(model.config, q, mx.float32)
    for lengths in ([3], [40, 30]):  # 6 routes (unsorted), 140 (sorted)
        tokens, positions = padded_rows(96, lengths)
        assert rel_error(logits(model.config, q, tokens, positions),
                         logits(model.config, dense, tokens, positions)) < 1e-4
    copy = strategy.dense_copy(model.config, q)
    first = next(i for i, m in enumerate(model.config.moe_layers) if m)
    assert isinstance(copy.layers[first].experts.down, llama.Quantized)
    assert isinstance(copy.layers[first].qkv, llama.Dense)
    maps = [copy.embed, copy.lm_head] + [x for layer in copy.layers
                                         for x in (layer.qkv, layer.o, layer.gate_up, layer.down) if x is not None]
    assert strategy.dense_bytes(model.config, q) == sum(p.weight.size * 4 for p in maps if p is not None)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("quantized", [False, True])
def test_routes_beyond_one_launch_go_in_slices(monkeypatch, family, quantized):
    """A gathered product takes at most `moe.MAX_ROUTES` sorted routes (CUDA's grid-z cap of 65,535
    broke a 16,384-token chunk of a Qwen3-MoE shape at 8 experts each): more are cut into slices
    of sorted routes, with the same answer bit for bit. A limit of 7 here: uneven slices, and
    a token's routes split across two."""
    model = model_for(family, seed=9, hidden_size=64, intermediate_size=64)
    params = weights.quantize(model.config, model.params, bits=4, group_size=32) if quantized else model.params
    tokens, positions = padded_rows(96, [40, 30])  # 140 or 160 routes: sorted
    whole = logits(model.config, params, tokens, positions)
    launches = []
    product = moe.expert_product
    monkeypatch.setattr(moe, "expert_product", lambda p, x, index, grouped, kernel=False:
                        launches.append(index.size) or product(p, x, index, grouped, kernel))
    monkeypatch.setattr(moe, "MAX_ROUTES", 7)
    sliced = logits(model.config, params, tokens, positions)
    routes = 80 * model.config.experts_per_tok
    moe_layers = sum(model.config.moe_layers)
    assert launches.count(7) == 2 * moe_layers * (routes // 7) and max(launches) == 7  # gate_up and down
    assert np.array_equal(sliced, whole)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_dense_experts_route_through_the_kernel_when_fast(monkeypatch, family):
    """On CUDA (`fast`), dense experts of 2 tokens to `moe.KERNEL_ROUTES` routes run
    `dmv.experts_product` with the rows sorted by expert (here a stand-in that multiplies each row
    by its expert's map): the layer's output is the plain path's to bf16 rounding. One token, more
    routes, or 4-bit experts keep MLX's gathered products."""
    from mlxfun.kernels import attention as kernels
    from mlxfun.kernels import dmv

    model = model_for(family, seed=10, hidden_size=64, intermediate_size=64)  # inputs in blocks of 32
    config, params = model.config, weights.cast(model.config, model.params, mx.bfloat16)
    layer = next(i for i, m in enumerate(config.moe_layers) if m)
    experts, reference = params.layers[layer].experts, model.params.layers[layer].experts  # bf16, float32
    calls = []

    def stand_in(x, w, index):
        calls.append((x.shape, w.shape, np.array(index)))
        return (x[:, None, :] @ w[index].swapaxes(-1, -2))[:, 0]

    monkeypatch.setattr(kernels, "available", lambda dtype: True)
    monkeypatch.setattr(dmv, "EXPERTS", True)
    monkeypatch.setattr(dmv, "experts_product", stand_in)
    k, E = config.experts_per_tok, config.hidden_size
    for tokens in (1, 2, 5):
        x = mx.array(np.random.default_rng(tokens).normal(size=(tokens, E)).astype(np.float32))
        calls.clear()
        fast = moe.layer(config, experts, x.astype(mx.bfloat16), fast=True).astype(mx.float32)
        want = [] if tokens == 1 else [(tokens * k, E), (tokens * k, config.moe_intermediate_size)]
        assert [c[0] for c in calls] == want
        if tokens == 1:
            continue  # MLX's gathered product, which takes float32 only on the CPU
        plain = moe.layer(config, reference, x)
        assert rel_error(np.array(fast), np.array(plain)) < 2e-2
        assert all(np.all(np.diff(c[2].astype(np.int64)) >= 0) for c in calls)  # sorted by expert
    calls.clear()
    monkeypatch.setattr(moe, "KERNEL_ROUTES", 4 * k)
    moe.layer(config, experts, mx.zeros((5, E), mx.bfloat16), fast=True)
    q = weights.quantize(config, params, bits=4, group_size=32).layers[layer].experts
    moe.layer(config, q, mx.zeros((2, E), mx.bfloat16), fast=True)
    monkeypatch.setattr(moe, "KERNEL_ROUTES", 1024)
    monkeypatch.setattr(dmv, "EXPERTS", False)  # off ($MLXFUN_EXPERTS_KERNEL=0 at import)
    moe.layer(config, experts, mx.zeros((2, E), mx.bfloat16), fast=True)
    assert calls == []
    from mlxfun.kernels.settings import switch

    assert switch(dmv.EXPERTS_ENV, "1", dmv.EXPERTS_DEFAULT) and not switch(dmv.EXPERTS_ENV, "0", dmv.EXPERTS_DEFAULT)
    assert switch(dmv.EXPERTS_ENV, "", dmv.EXPERTS_DEFAULT) == dmv.EXPERTS_DEFAULT
    with pytest.raises(ValueError, match="MLXFUN_EXPERTS_KERNEL"):
        switch(dmv.EXPERTS_ENV, "yes")


def test_shards_of_experts_sum_to_the_whole():
    """Tensor parallelism splits every expert's hidden units across ranks, the router whole: the
    ranks' partial outputs add up to the layer's (what `llama.reduce` all-sums)."""
    model = model_for("qwen3_moe", seed=9)
    config, params = model.config, model.params
    layer = next(i for i, m in enumerate(config.moe_layers) if m)
    x = mx.array(np.random.default_rng(0).normal(size=(5, config.hidden_size)).astype(np.float32))
    whole = moe.layer(config, params.layers[layer].experts, x)
    parts = [moe.layer(dataclasses.replace(config, moe_intermediate_size=config.moe_intermediate_size // 2),
                       shard.shard_params(config, params, 2, r).layers[layer].experts, x) for r in range(2)]
    assert rel_error(np.array(parts[0] + parts[1]), np.array(whole)) < 1e-5
    assert parts[0].shape == whole.shape and rel_error(np.array(parts[0]), np.array(whole)) > 1e-2


def test_unsupported_models_are_named():
    with pytest.raises(mlxfun.ModelError, match="unsupported model_type 'gpt2'.*supports.*gemma2"):
        cfg.from_hf({"model_type": "gpt2", "vocab_size": 10})


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "qwen3_moe", "phi3"])
def test_decode_kernel_serves_normed_capped_and_rescaled_heads(monkeypatch, family):
    """A one-token step on mlxfun's CUDA decode-attention kernel (its source run on the CPU by
    `cuda_emulator`) equals MLX's ops for heads with q/k norms (Gemma 3, Qwen3), a scale other
    than 1 / sqrt(D) (query_pre_attn_scalar 20 with D 16) and Gemma 2's soft-capped scores (a cap
    of 4 here, so it bites): the step hands the kernel its normed, rotated and rescaled queries
    and keys, and the cap."""
    from cuda_emulator import run

    from mlxfun.kernels import attention as kernels
    from mlxfun.model import cache as kv

    calls = []

    def emulated(qk, keys, values, table, mask, H, softcap=None, invariant=False):
        B, _, _, D = qk.shape
        K, bs = keys.shape[1], mask.shape[-1] // table.shape[1]
        per, warps, P = kernels.launch(B, K, mask.shape[-1], D, H // K, mx.float32)
        calls.append(softcap)
        inputs = dict(qk=np.array(qk), keys=np.array(keys), values=np.array(values), table=np.array(table),
                      mask=np.array(mask))
        template = [("T", 0), ("D", D), ("G", H // K), ("PER", per), ("NW", warps), ("BS", bs)]
        assert P == 1
        out = run(kernels.attention_source(softcap) + kernels._WHOLE, inputs, {"out": (B, 1, H * D)}, template,
                  (32 * warps, K, B), 32 * warps)[0]
        return mx.array(out.reshape(B, H * D))

    monkeypatch.setattr(kernels, "serves_attention", lambda D, G, dtype: kernels.attention_fits(D, G, mx.float32))
    monkeypatch.setattr(kernels, "decode_attention", emulated)
    model = model_for(family, seed=10)
    config, params = model.config, model.params
    assert llama.step_attention_kernel(config, params)
    tokens, positions = padded_rows(96, [9, 4])
    cache = kv.empty(config, 2, 32, mx.float32)
    _, cache = llama.hidden(config, params, mx.array(tokens), mx.array(positions), None, cache)
    step, at = mx.array([[5], [7]]), mx.array(positions[:, -1:] + 1)
    plain, _ = llama.hidden(config, params, step, at, None, cache)
    fast, _ = llama.hidden(config, params, step, at, None, cache, fast=True)
    assert calls == [config.attn_softcap] * config.num_layers
    assert rel_error(np.array(fast), np.array(plain)) < 1e-5
    if family in ("gemma2", "gemma3_text"):
        assert config.attention_scale != config.head_dim ** -0.5
    if family == "gemma2":  # the cap bites: without it the kernel's answer is another
        assert config.attn_softcap == 4.0
        monkeypatch.setattr(kernels, "attention_source", lambda softcap, chunk=0: kernels._ATTENTION)
        uncapped, _ = llama.hidden(config, params, step, at, None, cache, fast=True)
        assert rel_error(np.array(uncapped), np.array(plain)) > 1e-3


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "qwen3_moe"])
def test_speculative_rings_and_prefixes_keep_each_answer(family):
    """Every family through the engine's other paths: speculative verify rounds (a draft model,
    and prompt lookup, forced on every round), a `max_kv_size` ring with its sinks on top of the
    model's own windows, and prompts sharing a prefix (the second run's prefixes cached): greedy
    tokens equal each prompt's alone through the same path."""
    from mlxfun.engine.core import Engine
    from mlxfun.features import speculative

    model = model_for(family, seed=11)
    rng = np.random.default_rng(12)
    shared = rng.integers(1, 96, 20).tolist()
    prompts = [shared + rng.integers(1, 96, n).tolist() for n in (3, 9, 14)]
    plain = mlxfun.generate(model, prompts, max_tokens=12, ignore_eos=True).token_ids
    for draft in (model, "prompt-lookup"):
        engine = Engine(model, 2, draft=draft, num_draft_tokens=3, policy=speculative.Always())
        ids = [engine.add(p, max_tokens=12, ignore_eos=True) for p in prompts]
        list(engine.events())
        assert [engine.take(i).row.token_ids for i in ids] == plain, draft
        assert engine.stats.verify_rounds > 0
    ring = mlxfun.generate(model, prompts, max_tokens=12, ignore_eos=True, max_kv_size=12, batch_size=2).token_ids
    assert ring == [mlxfun.generate(model, p, max_tokens=12, ignore_eos=True, max_kv_size=12).token_ids[0]
                    for p in prompts]
    again = mlxfun.generate(model, prompts, max_tokens=12, ignore_eos=True, batch_size=1)
    assert again.token_ids == plain and again.stats.cached_tokens > 0
