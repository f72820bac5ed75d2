"""Tiny random models for tests: configs, Hugging Face-named tensors, word-level and byte-level tokenizers."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlxfun.model import weights
from mlxfun.model.config import ModelConfig, RopeScaling
from mlxfun.model.load import Model
from mlxfun.model.tokenizer import Tokenizer

# Every input width is 64 or 128, so all variants quantize with group sizes 32 and 64.
TINY = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512}

# Wavelengths 2*pi/freq of a 16-wide head span 6 to 2000, so original_max_position_embeddings=64
# puts pairs in all three llama3 bands (kept, smoothed, divided by the factor).
LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64)

VARIANTS = {
    "tied": {},
    "untied": {"tie_word_embeddings": False},
    "bias": {"attention_bias": True, "model_type": "qwen2"},
    "qk_norm": {"qk_norm": True, "model_type": "qwen3"},
    "llama3_rope": {"rope_scaling": LLAMA3, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "linear_rope": {"rope_scaling": RopeScaling("linear", 4.0)},
    "traditional_rope": {"rope_traditional": True},
    "mha": {"num_heads": 4, "num_kv_heads": 4},
    "gqa4": {"num_heads": 8, "num_kv_heads": 2, "head_dim": 8},
    "mqa": {"num_heads": 4, "num_kv_heads": 1},
    "head_dim_32": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32},  # 4 * 32 != hidden 64
}


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def random_hf_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 tensors with Hugging Face names, scaled so attention is far from uniform."""
    rng = np.random.default_rng(seed)
    E, I, D, H, K = (config.hidden_size, config.intermediate_size, config.head_dim, config.num_heads,
                     config.num_kv_heads)

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(size):
        return (1.0 + 0.2 * rng.standard_normal(size)).astype(np.float32)

    t = {"model.embed_tokens.weight": (0.3 * rng.standard_normal((config.vocab_size, E))).astype(np.float32),
         "model.norm.weight": norm(E)}
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = mat(config.vocab_size, E, 2.0)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(E)
        t[f"{p}.post_attention_layernorm.weight"] = norm(E)
        t[f"{p}.self_attn.q_proj.weight"] = mat(H * D, E, 2.0)
        t[f"{p}.self_attn.k_proj.weight"] = mat(K * D, E, 2.0)
        t[f"{p}.self_attn.v_proj.weight"] = mat(K * D, E)
        t[f"{p}.self_attn.o_proj.weight"] = mat(E, H * D)
        t[f"{p}.mlp.gate_proj.weight"] = mat(I, E)
        t[f"{p}.mlp.up_proj.weight"] = mat(I, E)
        t[f"{p}.mlp.down_proj.weight"] = mat(E, I)
        if config.attention_bias:
            for n, rows in (("q", H * D), ("k", K * D), ("v", K * D)):
                t[f"{p}.self_attn.{n}_proj.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
        if config.qk_norm:
            t[f"{p}.self_attn.q_norm.weight"] = norm(D)
            t[f"{p}.self_attn.k_norm.weight"] = norm(D)
    return t


def quantize_tensors(tensors: dict[str, mx.array], bits: int, group_size: int,
                     overrides: dict[str, tuple[int, int]] | None = None) -> dict[str, mx.array]:
    """The MLX (mlx-community) layout: every matrix becomes `weight` (uint32) + `scales` + `biases`;
    `overrides` maps a matrix's name stem to its own (bits, group_size), as mixed-precision models do."""
    out = {}
    for name, value in tensors.items():
        stem = name.removesuffix(".weight")
        if value.ndim == 2:
            b, g = (overrides or {}).get(stem, (bits, group_size))
            out[name], out[f"{stem}.scales"], out[f"{stem}.biases"] = mx.quantize(value, group_size=g, bits=b)
        else:
            out[name] = value
    return out


def dequantize_tensors(tensors: dict[str, mx.array], bits: int, group_size: int,
                       overrides: dict[str, tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
    """float64 NumPy copies, quantized matrices dequantized by MLX (what the decoder multiplies by)."""
    out = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" in tensors:
            b, g = (overrides or {}).get(stem, (bits, group_size))
            value = mx.dequantize(value, tensors[f"{stem}.scales"], tensors[f"{stem}.biases"], group_size=g, bits=b)
        out[name] = np.array(value, dtype=np.float64)
    return out


def tiny_checkpoint(config: ModelConfig, seed: int = 0, quant: tuple[int, int] | None = None, overrides=None):
    """(mx tensors as a checkpoint holds them, float64 NumPy weights the decoder should compute with)."""
    tensors = {k: mx.array(v) for k, v in random_hf_tensors(config, seed).items()}
    if quant is not None:
        tensors = quantize_tensors(tensors, *quant, overrides)
        return tensors, dequantize_tensors(tensors, *quant, overrides)
    return tensors, {k: np.array(v, dtype=np.float64) for k, v in tensors.items()}


def tiny_params(config: ModelConfig, seed: int = 0, quant: tuple[int, int] | None = None, overrides=None):
    """(Params built through `weights.build_params`, float64 reference weights)."""
    tensors, ref = tiny_checkpoint(config, seed, quant, overrides)
    return weights.build_params(config, dict(tensors)), ref


def tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """Word-level: "w0 w1 ..." <-> ids; id 0 is the end-of-text token."""
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token_ids={0}, bos_token_id=None, add_bos=False, chat_template=None)


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE over printable ASCII, 97 tokens as `tiny_config` has: id 0 is the end of text,
    1 is the space, then "!" to "~" one token each, and 96 the merge "ab" (structured output needs
    a tokenizer whose tokens are bytes)."""
    vocab = {"<|endoftext|>": 0, "\u0120": 1, **{chr(b): i + 2 for i, b in enumerate(range(33, 127))}, "ab": 96}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return Tokenizer(backend, eos_token_ids={0}, bos_token_id=None, add_bos=False, chat_template=None)


def tiny_model(config: ModelConfig | None = None, seed: int = 0, quant: tuple[int, int] | None = None) -> Model:
    config = config or tiny_config()
    params, _ = tiny_params(config, seed, quant)
    return Model(config, params, tiny_tokenizer(config.vocab_size), "tiny")


def replace(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, **changes)


def rel_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


def run_engine(model: Model, prompts, *, rows: int | None = None, steps=None, strategy=None, pad_multiple=None,
               **options):
    """Prompts through one `Engine` (a static batch unless `rows` is fewer), as `generate` runs
    them but with the scheduler's own knobs -> (GenerationResult, engine)."""
    from mlxfun.engine import sampling
    from mlxfun.engine.core import Engine
    from mlxfun.engine.options import GenerationConfig, requests
    from mlxfun.engine.rows import result
    from mlxfun.engine.step import compiled_steps

    reqs = requests(model, prompts, GenerationConfig(**options))
    engine = Engine(model, rows or len(reqs), steps=steps or compiled_steps, strategy=strategy,
                    pad_multiple=pad_multiple, prefill_step=options.get("prefill_step", 512),
                    max_kv_size=options.get("max_kv_size"), prefix_cache=options.get("prefix_cache", True))
    if options.get("prompt_cache") is not None:
        engine.add_prompt_cache(options["prompt_cache"])
    ids = [engine.submit(r) for r in reqs]
    for _ in engine.events():
        pass
    seeds = [s for r in reqs for s in sampling.seeds(r.settings)]
    return result([engine.take(i).row for i in ids], engine.stats, seeds, max(r.logprobs for r in reqs)), engine


# Roles as vocabulary words, so the word-level tokenizer encodes a templated conversation.
TINY_TEMPLATE = ("{% for m in messages %}{{ {'system': 'w1', 'user': 'w2', 'assistant': 'w3'}[m['role']] }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}")


def tiny_chat_model(config: ModelConfig | None = None, seed: int = 0) -> Model:
    """A tiny model whose tokenizer has a chat template: [user "w5 w6"] -> "w2 w5 w6 w3" (4 tokens)."""
    model = tiny_model(config, seed)
    t = model.tokenizer
    return dataclasses.replace(model, tokenizer=Tokenizer(t.backend, eos_token_ids=set(t.eos_token_ids),
                                                          bos_token_id=None, add_bos=False,
                                                          chat_template=TINY_TEMPLATE))


def left_pad(prompts: list[list[int]]) -> tuple[mx.array, mx.array]:
    """-> tokens (B, L) and positions (B, L) of prompts left-padded to the longest: 0 at each row's
    first real token, negative on padding (which every mask hides)."""
    L = max(len(p) for p in prompts)
    tokens = [[0] * (L - len(p)) + list(p) for p in prompts]
    positions = [list(range(len(p) - L, len(p))) for p in prompts]
    return mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32)


def full_byte_tokenizer(added: tuple[str, ...] = (), chat_template: str | None = None) -> Tokenizer:
    """Byte-level BPE with every byte (newlines too): id 0 is the end of text, 1 to 256 the bytes in
    order, then `added` tokens (as a model's <tool_call> or [TOOL_CALLS]), 257 + len(added) in all."""
    from mlxfun.serve.openai_api import _BYTES

    vocab = {"<|endoftext|>": 0, **{c: b + 1 for c, b in _BYTES.items()}}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return Tokenizer(backend, eos_token_ids={0}, bos_token_id=None, add_bos=False, chat_template=chat_template)


def admission_peak(model: Model, prompts: list[list[int]], max_tokens: int = 3000):
    """A static admission of `prompts` (each reserving `max_tokens`: a large pool), evaluated ->
    (peak bytes above the memory active before it, the pool's bytes, the engine)."""
    from mlxfun.engine.core import Engine

    engine = Engine(model, len(prompts), shrink_rows=False)
    for p in prompts:
        engine.add(p, max_tokens=max_tokens, ignore_eos=True)
    # The pool made at the reservation before the admission, as an engine that earlier requests
    # grew holds it (a first admission's own pool holds only the prompts: `Engine.admit`), so a
    # copy of it would show in the peak.
    engine.scheduler.pages.reserve(sum(-(-(len(p) + max_tokens) // engine.scheduler.pool.block_size) for p in prompts))
    engine.ensure_state()
    mx.eval(engine.runner.state)
    return (*admit_measured(engine), engine)


def admit_measured(engine) -> tuple[int, int]:
    """`engine.admit()`, evaluated (nothing else decodes) -> (peak bytes above the memory active
    before it, the device pool's bytes after it)."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    engine.admit()
    mx.synchronize()
    pool = sum(a.nbytes for a in engine.runner.state.cache.keys + engine.runner.state.cache.values)
    return mx.get_peak_memory() - base, pool
