"""Checkpoint tensors <-> parameter trees: the one place that knows checkpoint names.

Both checkpoint kinds are first brought to Hugging Face names (`model.layers.3.self_attn.q_proj.weight`,
with `.scales`/`.biases` beside a quantized `.weight`), then `build_params` assembles `Params`.
"""

from __future__ import annotations

import re

import mlx.core as mx

from mlxfun.errors import ModelError
from mlxfun.model.config import GEMMA, ModelConfig
from mlxfun.model.llama import Dense, Experts, Layer, Linear, Params, Quantized, dequantize, quant_shape

# llama.cpp's tensor names (gguf-py/gguf/constants.py) -> Hugging Face's, within a layer. Gemma's
# pre-MLP norm is its `ffn_norm` (other families': post_attention_layernorm), Phi-3's fused gate/up
# its `ffn_up`; experts are stacked (n, out, in), under mlx-lm's `switch_mlp` names.
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_exps": "{moe}.switch_mlp.gate_proj",
    "ffn_up_exps": "{moe}.switch_mlp.up_proj",
    "ffn_down_exps": "{moe}.switch_mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors some checkpoints carry that the decoder recomputes, or (a multimodal Gemma 3's) that
# only its image path uses.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|^(vision_tower|multi_modal_projector)\.")


def _unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs back to half-split)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf(config: ModelConfig, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Rename GGUF tensors to Hugging Face names, undoing what llama.cpp's converter changed: a
    `llama`'s (Mixtral's too) q/k rows permuted for interleaved RoPE (weight, scales, biases alike),
    Gemma's norms stored as 1 + w (build_params adds the 1), and experts' gate and up fused into one
    `ffn_gate_up_exps` (gate first) when converted with --fuse-gate-up-exps."""
    out = {}
    for name, value in tensors.items():
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] == "ffn_gate_up_exps":
            moe = f"model.layers.{parts[1]}.{_moe_block(config)}.switch_mlp"
            out[f"{moe}.gate_proj.{kind}"], out[f"{moe}.up_proj.{kind}"] = mx.split(value, 2, axis=1)
            continue
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER:
            hf = f"model.layers.{parts[1]}.{_gguf_layer_name(config, parts[2])}"
            if parts[2] in ("attn_q", "attn_k") and config.model_type in ("llama", "mixtral"):
                heads = config.num_heads if parts[2] == "attn_q" else config.num_kv_heads
                value = _unpermute_rows(value, heads)
        elif stem in _GGUF_TOP:
            hf = _GGUF_TOP[stem]
        else:
            raise ModelError(f"unexpected GGUF tensor {name!r}")
        out[f"{hf}.{kind}"] = _unnorm(value, config) if stem.endswith("norm") else value
    return out


def _moe_block(config: ModelConfig) -> str:
    """Where a layer's experts and router live in Hugging Face and mlx-lm names (GGUF, load, save)."""
    return "block_sparse_moe" if config.model_type == "mixtral" else "mlp"


def _gguf_layer_name(config: ModelConfig, part: str) -> str:
    if part == "ffn_norm" and config.model_type in GEMMA:
        return "pre_feedforward_layernorm"
    if part == "ffn_up" and config.model_type == "phi3":
        return "mlp.gate_up_proj"
    return _GGUF_LAYER[part].format(moe=_moe_block(config))


def _linear(t: dict, name: str, out_features: int, in_features: int, bias: bool, stack: tuple[int, ...] = ()) -> Linear:
    """The map `name` (out, in), or `stack` of them stacked in front (a layer's experts (n, out, in))."""
    weight = _take(t, f"{name}.weight")
    b = _take(t, f"{name}.bias") if bias else None
    if f"{name}.scales" in t:
        q = Quantized(weight, _take(t, f"{name}.scales"), _take(t, f"{name}.biases"), b)
        group_size, bits = quant_shape(q, in_features)
        ok = (weight.ndim == q.scales.ndim == 2 + len(stack) and q.biases.shape == q.scales.shape
              and weight.shape[:-1] == q.scales.shape[:-1] == (*stack, out_features) and bits in (2, 3, 4, 5, 6, 8)
              and group_size in (32, 64, 128) and group_size * q.scales.shape[-1] == in_features
              and weight.shape[-1] * 32 == in_features * bits)
        if not ok:
            raise ModelError(f"{name}: quantized shapes {weight.shape}/{q.scales.shape}/{q.biases.shape} "
                             f"(weight/scales/biases) do not fit a {(*stack, out_features, in_features)} matrix")
        return q
    if weight.shape != (*stack, out_features, in_features):
        raise ModelError(f"{name}.weight has shape {weight.shape}, expected {(*stack, out_features, in_features)}")
    return Dense(weight, b)


def _vector(t: dict, name: str, size: int) -> mx.array:
    v = _take(t, name)
    if v.shape != (size,):
        raise ModelError(f"{name} has shape {v.shape}, expected {(size,)}")
    return v


def _take(t: dict, name: str) -> mx.array:
    if name not in t:
        raise ModelError(f"checkpoint lacks tensor {name!r}")
    return t.pop(name)


def _fuse(parts: list[Linear], in_features: int, axis: int = 0, join=mx.concatenate) -> Linear:
    """Concatenate linear maps along their outputs (q/k/v, gate/up) into one matmul (`axis`: the
    outputs' axis; `join=mx.stack` stacks them along a new one instead: experts)."""
    bias = None if parts[0].bias is None else join([p.bias for p in parts])
    if all(isinstance(p, Quantized) for p in parts) and len({quant_shape(p, in_features) for p in parts}) == 1:
        return Quantized(*(join([getattr(p, f) for p in parts], axis=axis) for f in ("weight", "scales", "biases")),
                         bias)
    weights = [dequantize(p, in_features) if isinstance(p, Quantized) else p.weight for p in parts]
    return Dense(join(weights, axis=axis), bias)


def from_checkpoint(config: ModelConfig, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """A checkpoint's tensors under the names `build_params` reads: a multimodal Gemma 3's language
    model as a text model's."""
    if not any(k.startswith("language_model.") for k in tensors):
        return tensors
    return {k.removeprefix("language_model."): v for k, v in tensors.items()}


def _norm(t: dict, name: str, size: int, config: ModelConfig) -> mx.array:
    """A norm's weight as the decoder multiplies by it: Gemma stores w for a scale of 1 + w."""
    v = _vector(t, name, size)
    return (v.astype(mx.float32) + 1).astype(v.dtype) if config.model_type in GEMMA else v


def _unnorm(v: mx.array, config: ModelConfig) -> mx.array:
    """A Gemma norm as a scale of 1 + w (the decoder's folded weight, a GGUF's) -> w, as Hugging Face
    stores it; other families' as they are."""
    return (v.astype(mx.float32) - 1).astype(v.dtype) if config.model_type in GEMMA else v


def _experts(t: dict, p: str, config: ModelConfig) -> Experts:
    """A layer's experts, from one tensor per expert (Hugging Face) or stacked (mlx-lm's `switch_mlp`)."""
    E, I, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
    block = f"{p}.{_moe_block(config)}"
    names = {"gate": "w1", "up": "w3", "down": "w2"} if config.model_type == "mixtral" else \
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    shapes = {"gate": (I, E), "up": (I, E), "down": (E, I)}
    if f"{block}.switch_mlp.gate_proj.weight" in t:
        parts = {k: _linear(t, f"{block}.switch_mlp.{k}_proj", *shapes[k], False, (n,)) for k in shapes}
    else:
        parts = {k: _fuse([_linear(t, f"{block}.experts.{j}.{names[k]}", *shapes[k], False) for j in range(n)],
                          shapes[k][1], join=mx.stack) for k in shapes}
    return Experts(router=_linear(t, f"{block}.gate", n, E, False),
                   gate_up=_fuse([parts["gate"], parts["up"]], E, axis=1), down=parts["down"])


def build_params(config: ModelConfig, tensors: dict[str, mx.array]) -> Params:
    """Assemble Params from Hugging Face-named tensors; every tensor must be used exactly once."""
    t = {k: v for k, v in from_checkpoint(config, tensors).items() if not _IGNORED.match(k)}
    E, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    H, K = config.num_heads, config.num_kv_heads
    sandwich = config.sandwich_norms
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        if f"{p}.self_attn.qkv_proj.weight" in t:  # Phi-3's fused q/k/v
            qkv = _linear(t, f"{p}.self_attn.qkv_proj", (H + 2 * K) * D, E, config.attention_bias)
        else:
            qkv = _fuse([_linear(t, f"{p}.self_attn.{n}_proj", rows, E, config.attention_bias)
                         for n, rows in (("q", H * D), ("k", K * D), ("v", K * D))], E)
        experts = gate_up = down = None
        if config.moe_layers[i]:
            experts = _experts(t, p, config)
        elif f"{p}.mlp.gate_up_proj.weight" in t:  # Phi-3's fused gate/up
            gate_up = _linear(t, f"{p}.mlp.gate_up_proj", 2 * I, E, False)
            down = _linear(t, f"{p}.mlp.down_proj", E, I, False)
        else:
            gate_up = _fuse([_linear(t, f"{p}.mlp.{n}_proj", I, E, False) for n in ("gate", "up")], E)
            down = _linear(t, f"{p}.mlp.down_proj", E, I, False)
        layers.append(Layer(
            attn_norm=_norm(t, f"{p}.input_layernorm.weight", E, config),
            qkv=qkv,
            o=_linear(t, f"{p}.self_attn.o_proj", E, H * D, False),
            mlp_norm=_norm(t, f"{p}.{'pre_feedforward' if sandwich else 'post_attention'}_layernorm.weight", E, config),
            gate_up=gate_up,
            down=down,
            q_norm=_norm(t, f"{p}.self_attn.q_norm.weight", D, config) if config.qk_norm else None,
            k_norm=_norm(t, f"{p}.self_attn.k_norm.weight", D, config) if config.qk_norm else None,
            attn_post_norm=_norm(t, f"{p}.post_attention_layernorm.weight", E, config) if sandwich else None,
            mlp_post_norm=_norm(t, f"{p}.post_feedforward_layernorm.weight", E, config) if sandwich else None,
            experts=experts,
        ))
    embed = _linear(t, "model.embed_tokens", config.vocab_size, E, False)
    lm_head = None
    if "lm_head.weight" in t or not config.tie_word_embeddings:
        lm_head = _linear(t, "lm_head", config.vocab_size, E, False)
    params = Params(embed, tuple(layers), _norm(t, "model.norm.weight", E, config), lm_head)
    if t:
        names = sorted(t)
        raise ModelError(f"unexpected tensors in checkpoint: {', '.join(names[:8])}"
                         + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
    return params


def _split(p: Linear, sizes: list[int], axis: int = 0) -> list[Linear]:
    cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    bias = [None] * len(sizes) if p.bias is None else mx.split(p.bias, cuts, axis=axis)
    if isinstance(p, Quantized):
        w, s, b = (mx.split(getattr(p, f), cuts, axis=axis) for f in ("weight", "scales", "biases"))
        return [Quantized(*args) for args in zip(w, s, b, bias)]
    return [Dense(w, b) for w, b in zip(mx.split(p.weight, cuts, axis=axis), bias)]


def _put(out: dict, name: str, p: Linear) -> None:
    out[f"{name}.weight"] = p.weight
    if isinstance(p, Quantized):
        out[f"{name}.scales"], out[f"{name}.biases"] = p.scales, p.biases
    if p.bias is not None:
        out[f"{name}.bias"] = p.bias


def params_to_hf(config: ModelConfig, params: Params) -> dict[str, mx.array]:
    """Checkpoint-named tensors for Params (inverse of `build_params`): Hugging Face's names, with
    Phi-3's maps fused as its checkpoints have them and experts stacked as mlx-lm's `switch_mlp`
    (which mlx-lm and `build_params` both load)."""
    H, K, D, I = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    phi = config.model_type == "phi3"
    out = {}
    for i, layer in enumerate(params.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = _unnorm(layer.attn_norm, config)
        mlp_norm = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
        out[f"{p}.{mlp_norm}.weight"] = _unnorm(layer.mlp_norm, config)
        if config.sandwich_norms:
            out[f"{p}.post_attention_layernorm.weight"] = _unnorm(layer.attn_post_norm, config)
            out[f"{p}.post_feedforward_layernorm.weight"] = _unnorm(layer.mlp_post_norm, config)
        if phi:
            _put(out, f"{p}.self_attn.qkv_proj", layer.qkv)
        else:
            for n, part in zip("qkv", _split(layer.qkv, [H * D, K * D, K * D])):
                _put(out, f"{p}.self_attn.{n}_proj", part)
        _put(out, f"{p}.self_attn.o_proj", layer.o)
        if layer.experts is not None:
            block = f"{p}.{_moe_block(config)}"
            _put(out, f"{block}.gate", layer.experts.router)
            M = config.moe_intermediate_size
            for n, part in zip(("gate", "up"), _split(layer.experts.gate_up, [M, M], axis=1)):
                _put(out, f"{block}.switch_mlp.{n}_proj", part)
            _put(out, f"{block}.switch_mlp.down_proj", layer.experts.down)
        elif phi:
            _put(out, f"{p}.mlp.gate_up_proj", layer.gate_up)
            _put(out, f"{p}.mlp.down_proj", layer.down)
        else:
            for n, part in zip(("gate", "up"), _split(layer.gate_up, [I, I])):
                _put(out, f"{p}.mlp.{n}_proj", part)
            _put(out, f"{p}.mlp.down_proj", layer.down)
        if layer.q_norm is not None:
            out[f"{p}.self_attn.q_norm.weight"] = _unnorm(layer.q_norm, config)
            out[f"{p}.self_attn.k_norm.weight"] = _unnorm(layer.k_norm, config)
    _put(out, "model.embed_tokens", params.embed)
    out["model.norm.weight"] = _unnorm(params.norm, config)
    if params.lm_head is not None:
        _put(out, "lm_head", params.lm_head)
    return out


def map_linears(config: ModelConfig, params: Params, fn) -> Params:
    """Params with `fn(linear, in_features) -> Linear` applied to every linear map and the embedding
    (a layer's experts included: stacked maps (n, out, in))."""
    E = config.hidden_size

    def experts(x: Experts | None) -> Experts | None:
        if x is None:
            return None
        return Experts(fn(x.router, E), fn(x.gate_up, E), fn(x.down, config.moe_intermediate_size))

    layers = tuple(layer._replace(
        qkv=fn(layer.qkv, E), o=fn(layer.o, config.num_heads * config.head_dim),
        gate_up=None if layer.gate_up is None else fn(layer.gate_up, E),
        down=None if layer.down is None else fn(layer.down, config.intermediate_size),
        experts=experts(layer.experts),
    ) for layer in params.layers)
    lm_head = None if params.lm_head is None else fn(params.lm_head, E)
    return params._replace(embed=fn(params.embed, E), layers=layers, lm_head=lm_head)


def with_transposed(config: ModelConfig, params: Params) -> Params:
    """Params whose dense maps carry `weight_t`, their weight transposed: a view evaluated here,
    sharing the weight's memory, so that products read it without a transpose node in the graph
    (`llama.linear`). Params without dense maps come back as they are."""
    viewed = []

    def view(p: Linear, in_features: int) -> Linear:
        if not isinstance(p, Dense) or p.weight_t is not None:
            return p
        viewed.append(p)
        return p._replace(weight_t=p.weight.swapaxes(-1, -2))

    out = map_linears(config, params, view)
    if not viewed:
        return params
    mx.eval(out)
    return out


def compute_dtype(params: Params) -> mx.Dtype:
    """The activation dtype: that of the embedding table (its scales when quantized)."""
    e = params.embed
    return e.scales.dtype if isinstance(e, Quantized) else e.weight.dtype


def cast(config: ModelConfig, params: Params, dtype: mx.Dtype | None) -> Params:
    """Params in `dtype` (quantized maps dequantized); None keeps the weights and aligns the
    norms and biases with the activation dtype."""
    if dtype is not None:
        def dense(p: Linear, in_features: int) -> Linear:
            if isinstance(p, Quantized):
                # Dequantize in float32: in the scales' own float16 every weight would be rounded.
                p = p._replace(scales=p.scales.astype(mx.float32), biases=p.biases.astype(mx.float32))
            w = dequantize(p, in_features) if isinstance(p, Quantized) else p.weight
            return Dense(w.astype(dtype), None if p.bias is None else p.bias.astype(dtype))

        params = map_linears(config, params, dense)
    target = dtype or compute_dtype(params)

    def vec(v):
        return None if v is None else v.astype(target)

    def small(p: Linear, in_features: int) -> Linear:
        return p._replace(bias=vec(p.bias))

    params = map_linears(config, params, small)
    layers = tuple(layer._replace(attn_norm=vec(layer.attn_norm), mlp_norm=vec(layer.mlp_norm),
                                  q_norm=vec(layer.q_norm), k_norm=vec(layer.k_norm),
                                  attn_post_norm=vec(layer.attn_post_norm), mlp_post_norm=vec(layer.mlp_post_norm))
                   for layer in params.layers)
    return params._replace(layers=layers, norm=vec(params.norm))


def quantize(config: ModelConfig, params: Params, bits: int = 4, group_size: int = 64) -> Params:
    """Params with every dense linear map (and the embedding) affine-quantized by MLX; routers of
    experts stay as they are (a few rows that decide where each token goes)."""
    def q(p: Linear, in_features: int) -> Linear:
        if isinstance(p, Quantized):
            return p
        w, s, b = mx.quantize(p.weight, group_size=group_size, bits=bits)
        return Quantized(w, s, b, p.bias)

    out = map_linears(config, params, q)
    layers = tuple(new._replace(experts=new.experts._replace(router=old.experts.router)) if old.experts else new
                   for new, old in zip(out.layers, params.layers))
    return out._replace(layers=layers)
