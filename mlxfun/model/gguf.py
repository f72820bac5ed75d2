"""GGUF files as llama.cpp writes them: a bounds-checked walk over the layout, and the metadata's meaning.

MLX's GGUF parser trusts the file: a corrupt header or tensor table can crash the process
(a segmentation fault, not an exception). `check` reads the same structure with every length
checked, and names tensors whose type mlxfun cannot use, so the loader can raise ModelError instead.
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md

`config` reads the `{arch}.*` keys llama.cpp's `convert_hf_to_gguf.py` writes, and where a key is
absent assumes what llama.cpp's `src/llama-model.cpp` (`load_hparams`) assumes.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxfun.errors import ModelError
from mlxfun.model.config import GEMMA, ModelConfig, RopeScaling

# ggml tensor types mlxfun reads -> (name, values per block, bytes per block). mx.load returns
# Q4_0 / Q4_1 / Q8_0 as MLX-quantized weight/scales/biases triples.
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16"}
# Metadata value types -> struct format (8: string, 9: array are variable-sized).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def check(path: Path) -> None:
    """Raise ModelError unless `path` is a structurally sound GGUF whose tensors mlxfun can read."""
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path} is not a GGUF file: {size} bytes")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            _walk(path, buf, size)
        except struct.error:  # a read past the end of the file
            raise ModelError(f"{path} is truncated or corrupt: its GGUF layout runs past the end of the file "
                             "(an incomplete download?)") from None


def _walk(path: Path, buf, size: int) -> None:
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    if version not in (2, 3):
        raise ModelError(f"{path}: unsupported GGUF version {version} (mlxfun reads versions 2 and 3)")
    if n_tensors > size // 24 or n_kv > size // 12:
        raise ModelError(f"{path} is truncated or corrupt: {size} bytes cannot hold the {n_tensors} tensors and "
                         f"{n_kv} metadata entries it announces")
    pos, alignment = 24, 32

    def string(pos: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > size:
            raise struct.error
        return bytes(buf[pos + 8: pos + 8 + n]), pos + 8 + n

    def value(kind: int, pos: int, key: bytes) -> int:
        if kind in _SCALARS:
            return pos + struct.calcsize(_SCALARS[kind])
        if kind == 8:
            return string(pos)[1]
        if kind != 9:
            raise ModelError(f"{path} is corrupt: metadata {key.decode(errors='replace')!r} has type {kind}")
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALARS:
            return pos + count * struct.calcsize(_SCALARS[item])
        if item != 8:
            raise ModelError(f"{path} is corrupt: metadata {key.decode(errors='replace')!r} is an array of type {item}")
        if count > size:
            raise struct.error
        for _ in range(count):  # strings: skip each by its length
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            if pos > size:
                raise struct.error
        return pos

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        if key == b"general.alignment" and kind == 4:
            alignment = max(1, struct.unpack_from("<I", buf, pos + 4)[0])
        pos = value(kind, pos + 4, key)

    extents = []
    for _ in range(n_tensors):
        raw_name, pos = string(pos)
        name = raw_name.decode(errors="replace")
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= n_dims <= 4:
            raise ModelError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
        *dims, kind, offset = struct.unpack_from(f"<{n_dims}QIQ", buf, pos + 4)
        pos += 4 + 8 * n_dims + 12
        if kind not in TENSOR_TYPES:
            supported = ", ".join(t[0] for t in TENSOR_TYPES.values())
            raise ModelError(f"{path}: tensor {name!r} has GGUF type {OTHER_TYPES.get(kind, kind)}, "
                             f"which mlxfun cannot read (supported: {supported})")
        type_name, block, block_bytes = TENSOR_TYPES[kind]
        if dims[0] % block:
            raise ModelError(f"{path} is corrupt: tensor {name!r} of type {type_name} has rows of {dims[0]}")
        extents.append((name, offset, math.prod(dims) // block * block_bytes))
    data_start = -(-pos // alignment) * alignment
    for name, offset, nbytes in extents:
        if data_start + offset + nbytes > size:
            raise ModelError(f"{path} is truncated: tensor {name!r} runs past the end of the file "
                             "(an incomplete download?)")


# llama.cpp's architecture names -> the Hugging Face model_type whose decoder runs them (a `llama`
# with experts is Mixtral, which the converter writes as `llama`).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
# Per-pair RoPE frequency divisors the converter stores as tensors: llama3 scaling (`rope_freqs`) and
# Phi-3's longrope (`rope_factors_short` below the original context, `rope_factors_long` from it on).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def meta(metadata: dict, key: str, default=None):
    """A metadata value as a Python scalar; `default` when absent, ModelError naming the key if that is None."""
    v = metadata.get(key, default)
    if v is None:
        raise ModelError(f"GGUF metadata lacks {key!r}")
    if isinstance(v, mx.array) and v.dtype == mx.float32:
        # The shortest decimal of the float32 (1e-05, not 9.999999747378752e-06), as config.json has it.
        return float(str(np.float32(v.item())))
    return v.item() if isinstance(v, mx.array) else v


def config(metadata: dict, tensors: dict[str, mx.array]) -> ModelConfig:
    """The ModelConfig of a GGUF file (`tensors` as `mx.load` returns them: the vocabulary, tied
    embeddings, which layers have experts and the RoPE factor tensors are read off them)."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"unsupported GGUF architecture {arch!r} (general.architecture; "
                         f"supported: {', '.join(ARCHITECTURES)})")

    def m(key, default=None):
        return meta(metadata, f"{arch}.{key}", default)

    if "token_embd.weight" not in tensors:
        raise ModelError("GGUF lacks tensor 'token_embd.weight'")
    hidden, heads, layers = int(m("embedding_length")), int(m("attention.head_count")), int(m("block_count"))
    head_dim = int(m("attention.key_length", hidden // heads))
    if int(m("attention.value_length", head_dim)) != head_dim:
        raise ModelError(f"GGUF {arch}.attention.value_length differs from {arch}.attention.key_length: unsupported")
    rotary = int(m("rope.dimension_count", head_dim))
    moe = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers))
    model_type = "mixtral" if arch == "llama" and any(moe) else ARCHITECTURES[arch]
    if any(moe) and model_type not in ("mixtral", "qwen3_moe"):
        raise ModelError(f"GGUF architecture {arch!r} with experts (blk.N.ffn_gate_inp) is unsupported")
    family = {**_windows(m, arch, model_type, layers), **_experts(m, arch, model_type, moe)}
    if model_type in GEMMA:
        family.update(_gemma(m, arch, hidden, heads, head_dim, layers))
    return ModelConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(m("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(m("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon")),
        rope_theta=float(m("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(m, arch, tensors, rotary),
        rope_freq_factors=_factors(tensors, "rope_freqs.weight", rotary),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        max_position_embeddings=int(m("context_length", 4096)),
        model_type=model_type,
        rotary_dim=None if rotary == head_dim else rotary,
        **family,
    )


def _windows(m, arch: str, model_type: str, layers: int) -> dict:
    """Each layer's window. Gemma 2 alternates sliding (even) and global layers, window 4096 unless
    stored; Gemma 3 makes every 6th layer global when it stores a window (`set_swa_pattern(2 / 6)`:
    neither pattern is stored); elsewhere a stored window (0: none) covers every layer, as Hugging
    Face applies it (llama.cpp currently ignores Phi-3's)."""
    window = int(m("attention.sliding_window", 4096 if arch == "gemma2" else 0)) or None
    if model_type not in GEMMA:
        return {"layer_windows": (window,) * layers}
    period = 2 if arch == "gemma2" else 6  # the last layer of each period is global
    local = tuple(window is not None and i % period != period - 1 for i in range(layers))
    return {"layer_windows": tuple(window if is_local else None for is_local in local), "local_layers": local}


def _gemma(m, arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """What the converter leaves out: the query scale (llama.cpp: (hidden / heads) ** -0.5 for the 27B
    models, by layer count, head_dim ** -0.5 otherwise), the activation, norms and embedding scale."""
    big = layers == (46 if arch == "gemma2" else 62)
    final = float(m("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0))
    return {
        "embed_scale": True,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "query_pre_attn_scalar": float(hidden // heads if big else head_dim),
        "attn_softcap": (float(m("attn_logit_softcapping", 50.0)) or None) if arch == "gemma2" else None,
        "final_softcap": final or None,
        # Gemma 3's sliding layers rotate with their own base (llama.cpp: always 10000, the only one released).
        "local_rope_theta": float(m("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    }


def _experts(m, arch: str, model_type: str, moe: tuple[bool, ...]) -> dict:
    """Mixtral's experts are `feed_forward_length` wide; Qwen3-MoE's `expert_feed_forward_length`
    (llama.cpp's fallback: feed_forward_length / expert_used_count). llama.cpp renormalises the
    chosen experts' weights for both (Qwen3-MoE's norm_topk_prob is not stored)."""
    if not any(moe):
        return {}
    # Shared experts, sigmoid gating (softmax is 1; 0 leaves the default) and scaled weights: not in these families.
    allowed = {"expert_shared_count": (0,), "expert_gating_func": (0, 1), "expert_weights_scale": (0.0, 1.0)}
    for key, ok in allowed.items():
        if m(key, ok[0]) not in ok:
            raise ModelError(f"GGUF {arch}.{key} = {m(key)} is unsupported")
    used, ff = int(m("expert_used_count")), int(m("feed_forward_length"))
    width = ff if model_type == "mixtral" else int(m("expert_feed_forward_length", ff // used))
    return {"num_experts": int(m("expert_count")), "experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": bool(m("expert_weights_norm", True)), "moe_layers": moe}


def _factors(tensors: dict, name: str, rotary: int) -> tuple[float, ...] | None:
    factors = tensors.get(name)
    if factors is None:
        return None
    if factors.shape != (rotary // 2,):
        raise ModelError(f"GGUF tensor {name!r} has shape {factors.shape}, expected ({rotary // 2},)")
    return tuple(factors.astype(mx.float32).tolist())


def _rope_scaling(m, arch: str, tensors: dict, rotary: int) -> RopeScaling | None:
    """llama.cpp's `rope.scaling.*` keys: linear, or Phi-3's longrope (its factors as tensors, its
    attention factor `rope.scaling.attn_factor`, 1 when absent as in llama.cpp)."""
    kind = str(m("rope.scaling.type", "none"))
    short, long = (_factors(tensors, name, rotary) for name in ROPE_TENSORS[1:])
    if kind == "longrope" or short is not None or long is not None:
        if kind not in ("none", "longrope"):
            raise ModelError(f"GGUF {arch}.rope.scaling.type {kind!r} beside rope_factors tensors is unsupported")
        if short is None or long is None:
            raise ModelError(f"GGUF lacks tensor {ROPE_TENSORS[1] if short is None else ROPE_TENSORS[2]!r}")
        original = int(m("rope.scaling.original_context_length"))
        return RopeScaling("longrope", int(m("context_length")) / original, short_factor=short, long_factor=long,
                           original_max_position_embeddings=original,
                           attention_factor=float(m("rope.scaling.attn_factor", 1.0)))
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(m("rope.scaling.factor")))
    raise ModelError(f"unsupported GGUF rope scaling type {kind!r} ({arch}.rope.scaling.type; "
                     "supported: none, linear, longrope)")
