"""Model configuration: a frozen dataclass, closed over by compiled functions (never an argument)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mlxfun.errors import ModelError

# Hugging Face `model_type`s the decoder runs: the Llama family (optionally with bias / q-k norm /
# windows) and those whose differences are flags of the same decoder (`mlxfun.model.families`).
# A ring of `max_kv_size` keeps each row's first positions visible to every query (attention sinks,
# as StreamingLLM and mlx-lm's rotating cache keep them): without them the text falls apart once
# the ring wraps (a count ran "... 9, 1, 2, 2, 2" past a 32-token ring).
SINK_TOKENS = 4

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                         "qwen3_moe")


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of a Hugging Face config: `linear`, `llama3` or `longrope` (Phi-3's, also `su`)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope: per-pair divisors of the frequencies below `original_max_position_embeddings` (short)
    # and from it on (long), and the factor that scales the rotated dims (HF's `attention_factor`).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: RopeScaling | None = None
    # Per-pair divisors of the RoPE frequencies, as llama.cpp stores llama3 scaling (`rope_freqs`).
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    # One entry per layer: the attention window W (a query sees the last W positions) or None (all).
    layer_windows: tuple[int | None, ...] = ()
    # One entry per layer: how many of a row's first positions every query sees beside its window
    # (SINK_TOKENS where `with_max_kv_size` imposed the window, else 0).
    layer_sinks: tuple[int, ...] = ()
    model_type: str = "llama"
    # Gemma 2 / 3 (`families.gemma`): embeddings times sqrt(hidden_size); norms after attention and
    # the MLP as well as before (`sandwich_norms`); the MLP's activation; attention scaled by
    # query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; scores and logits soft-capped
    # (cap * tanh(x / cap)); and the layers of the model's sliding kind (`local_layers`) rotated
    # with their own base, unscaled (Gemma 3). Gemma's norm weights are offsets from 1 in its
    # checkpoints: the loader folds the 1 in (`weights.build_params`).
    embed_scale: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float | None = None
    local_layers: tuple[bool, ...] = ()
    # Phi-3 / Phi-4: RoPE rotates the first `rotary_dim` dims of each head (None: all).
    rotary_dim: int | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): the layers whose MLP is `num_experts` experts of
    # `moe_intermediate_size`, each token routed to `experts_per_tok` of them (weights renormalised
    # to sum to 1 if `norm_topk_prob`); other layers keep the dense MLP of `intermediate_size`.
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # Tensor parallelism (mlxfun.shard): the mx.distributed group whose ranks each hold a slice of every
    # layer; head counts and intermediate_size above are then this rank's. Compiled steps close over the
    # config, so the group reaches their all_sums as a constant (a group cannot be an array argument).
    tensor_group: Any = None
    # Batch-invariant decoding (`with_batch_invariant`): on CUDA every product and attention reduces
    # in an order fixed by the model's shapes alone, so a row's results are the same bits whatever
    # else is in its batch.
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("layer_windows", "local_layers", "moe_layers"):
            default = None if name == "layer_windows" else False
            if not getattr(self, name):
                object.__setattr__(self, name, (default,) * self.num_layers)
            if len(getattr(self, name)) != self.num_layers:
                raise ModelError(f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")
        if not self.layer_sinks:
            object.__setattr__(self, "layer_sinks", (0,) * self.num_layers)
        if len(self.layer_sinks) != self.num_layers:
            raise ModelError(f"layer_sinks has {len(self.layer_sinks)} entries for {self.num_layers} layers")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ModelError(f"unsupported hidden_act {self.hidden_act!r} (supported: silu, gelu_tanh)")
        if any(self.moe_layers) and not 0 < self.experts_per_tok <= self.num_experts:
            raise ModelError(f"experts_per_tok={self.experts_per_tok} must be in 1..num_experts={self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def with_max_kv_size(self, max_kv_size: int | None) -> ModelConfig:
        """The same model with every layer's window capped at `max_kv_size` (a bounded cache, a ring).
        A layer whose window it imposes (none, or a wider one) also sees the row's first
        SINK_TOKENS positions, whatever `max_kv_size` (any positive size: the ring keeps the
        last `max_kv_size` positions and the sinks); a window of the model's own that is no
        wider keeps its exact semantics."""
        if max_kv_size is None:
            return self
        if max_kv_size < 1:
            raise ModelError(f"max_kv_size must be positive, got {max_kv_size}")
        windows = tuple(max_kv_size if w is None else min(w, max_kv_size) for w in self.layer_windows)
        sinks = tuple(SINK_TOKENS if w is None or w > max_kv_size else s
                      for w, s in zip(self.layer_windows, self.layer_sinks))
        return dataclasses.replace(self, layer_windows=windows, layer_sinks=sinks)

    def with_batch_invariant(self, on: bool) -> ModelConfig:
        """The same model decoded batch-invariantly (`batch_invariant`) or not."""
        return self if on == self.batch_invariant else dataclasses.replace(self, batch_invariant=on)

    @property
    def sinks(self) -> int:
        """The most first positions of a row some layer keeps visible (0: no attention sinks)."""
        return max(self.layer_sinks, default=0)

    @property
    def attention_scale(self) -> float:
        """What query-key products are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_window(self) -> int | None:
        """The widest window if every layer has one (then the cache can be a bounded ring), else None."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)


def _rope_scaling(raw: dict | None, config: dict | None = None, rotary_dim: int = 0) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    if config is not None and (kind in ("longrope", "su") or kind == "yarn" and config.get("model_type") == "phi3"):
        return _longrope(raw, config, rotary_dim)
    raise ModelError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope)")


def _longrope(raw: dict, config: dict, rotary_dim: int) -> RopeScaling:
    """Phi-3's scaling, as Hugging Face's `_compute_longrope_parameters` reads it."""
    original = int(config.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])
    factor = float(config["max_position_embeddings"]) / original
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = tuple(float(f) for f in raw["short_factor"]), tuple(float(f) for f in raw["long_factor"])
    if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
        raise ModelError(f"rope_scaling short_factor/long_factor have {len(short)}/{len(long)} entries, "
                         f"expected {rotary_dim // 2} (half the rotated dims)")
    return RopeScaling("longrope", factor, original_max_position_embeddings=original, short_factor=short,
                       long_factor=long, attention_factor=float(attention))


def _windows(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen2 applies the window only with use_sliding_window, to layers from max_window_layers on.
        if not raw.get("use_sliding_window", False) or not window:
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(None if i < first else int(window) for i in range(num_layers))
    if raw.get("model_type") in GEMMA:
        return tuple(int(window) if local else None for local in _gemma_local(raw, num_layers))
    return (int(window) if window else None,) * num_layers


GEMMA = ("gemma2", "gemma3_text")


def _gemma_local(raw: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers are of the sliding kind: `layer_types` where given, else Gemma 2's alternation
    (even layers) or Gemma 3's pattern (every `sliding_window_pattern`-th layer is global)."""
    if raw.get("layer_types"):
        types = raw["layer_types"]
        if len(types) != num_layers:
            raise ModelError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(t == "sliding_attention" for t in types)
    if raw["model_type"] == "gemma2":
        return tuple(i % 2 == 0 for i in range(num_layers))
    pattern = int(raw.get("sliding_window_pattern", 6))
    return tuple((i + 1) % pattern != 0 for i in range(num_layers))


def _moe_layers(raw: dict, num_layers: int) -> tuple[bool, ...]:
    if raw["model_type"] == "mixtral":
        return (True,) * num_layers
    if raw["model_type"] == "qwen3_moe":
        dense, step = set(raw.get("mlp_only_layers") or ()), int(raw.get("decoder_sparse_step", 1))
        return tuple(i not in dense and int(raw.get("num_experts", 0)) > 0 and (i + 1) % step == 0
                     for i in range(num_layers))
    return (False,) * num_layers


# Keys a multimodal Gemma 3 checkpoint's `text_config` may leave to Gemma3TextConfig's defaults.
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                        "rope_local_base_freq": 10_000.0, "sliding_window": 4096, "sliding_window_pattern": 6,
                        "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
                        "hidden_activation": "gelu_pytorch_tanh"}


# The defaults of Hugging Face's config classes where a checkpoint's config.json may leave a key out.
FAMILY_DEFAULTS = {
    "gemma2": {"head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": GEMMA3_TEXT_DEFAULTS,
    "mixtral": {"rope_theta": 1_000_000.0},
}


def text_config(raw: dict) -> dict:
    """The language model's config with its family's defaults: a multimodal Gemma 3's `text_config`."""
    if raw.get("model_type") == "gemma3" and isinstance(raw.get("text_config"), dict):
        raw = {**raw["text_config"], "model_type": "gemma3_text"}
    return {**FAMILY_DEFAULTS.get(raw.get("model_type"), {}), **raw}


def from_hf(raw: dict) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict."""
    raw = text_config(raw)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures")
        raise ModelError(
            f"unsupported model_type {model_type!r} (architectures {archs}); "
            f"mlxfun supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rotary = int(head_dim * float(raw.get("partial_rotary_factor", 1.0)))
        gemma = model_type in GEMMA
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelError(f"unsupported activation {act!r} (supported: silu, gelu_pytorch_tanh)")
        moe = model_type in ("mixtral", "qwen3_moe")
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_traditional=bool(raw.get("rope_traditional", False)),  # mlx-lm's key; HF has none
            rope_scaling=_rope_scaling(raw.get("rope_scaling"), raw, rotary),
            rope_freq_factors=tuple(float(f) for f in raw["rope_freq_factors"]) if raw.get("rope_freq_factors")
            else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type not in (
                "llama", "phi3", "mixtral", "qwen3_moe"))),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            layer_windows=_windows(raw, layers),
            model_type=model_type,
            embed_scale=gemma,
            sandwich_norms=gemma,
            hidden_act="silu" if act == "silu" else "gelu_tanh",
            query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if gemma else None,
            # (Gemma 3's attention never soft-caps, whatever its config says.)
            attn_softcap=float(raw["attn_logit_softcapping"]) if model_type == "gemma2" and
            raw.get("attn_logit_softcapping") else None,
            final_softcap=float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None,
            local_rope_theta=float(raw.get("rope_local_base_freq", 10000.0)) if model_type == "gemma3_text" else None,
            local_layers=_gemma_local(raw, layers) if gemma else (),
            rotary_dim=rotary if rotary != head_dim else None,
            num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0) if moe else 0,
            experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]) if moe else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", model_type == "mixtral")) if moe else True,
            moe_layers=_moe_layers(raw, layers),
        )
    except KeyError as e:
        raise ModelError(f"config.json lacks required field {e.args[0]!r}") from None


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _family_fields(config: ModelConfig) -> dict:
    """The config.json keys of a family beyond the Llama ones (their Hugging Face names)."""
    raw: dict = {}
    if config.model_type in GEMMA:
        scalar = config.query_pre_attn_scalar
        raw.update(query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,  # Transformers wants an int
                   hidden_activation="gelu_pytorch_tanh",
                   attn_logit_softcapping=config.attn_softcap, final_logit_softcapping=config.final_softcap,
                   layer_types=["sliding_attention" if local else "full_attention" for local in config.local_layers])
    if config.model_type == "gemma3_text":
        raw["rope_local_base_freq"] = config.local_rope_theta
    if config.rotary_dim is not None:
        raw["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    if config.model_type == "mixtral":
        raw.update(num_local_experts=config.num_experts, num_experts_per_tok=config.experts_per_tok)
    if config.model_type == "qwen3_moe":
        raw.update(num_experts=config.num_experts, num_experts_per_tok=config.experts_per_tok,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(config.moe_layers) if not m])
    return raw


def to_hf(config: ModelConfig) -> dict:
    """The Hugging Face `config.json` dict for a ModelConfig (inverse of `from_hf`)."""
    raw = {
        "model_type": config.model_type,
        "architectures": [ARCHITECTURES[config.model_type]],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "max_position_embeddings": config.max_position_embeddings,
    }
    if config.rope_traditional:
        raw["rope_traditional"] = True
    if config.rope_freq_factors is not None:
        raw["rope_freq_factors"] = list(config.rope_freq_factors)  # mlxfun's own key: GGUF llama3 scaling
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            raw["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                       original_max_position_embeddings=s.original_max_position_embeddings)
        if s.kind == "longrope":
            raw["rope_scaling"] = {"type": "longrope", "short_factor": list(s.short_factor),
                                   "long_factor": list(s.long_factor), "attention_factor": s.attention_factor}
            raw["original_max_position_embeddings"] = s.original_max_position_embeddings
    raw.update(_family_fields(config))
    windows = set(config.layer_windows)
    if config.model_type in GEMMA:
        local = [w for w, is_local in zip(config.layer_windows, config.local_layers) if is_local]
        if set(w for w, is_local in zip(config.layer_windows, config.local_layers) if not is_local) - {None} or \
                len(set(local)) > 1 or None in local:
            raise ModelError("a Gemma config's windows must be its local layers' one window")
        raw["sliding_window"] = local[0] if local else 4096
    elif windows != {None}:
        if config.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            first = next(i for i, w in enumerate(config.layer_windows) if w is not None)
            raw.update(use_sliding_window=True, sliding_window=max(w for w in windows if w), max_window_layers=first)
        elif len(windows) == 1:
            raw["sliding_window"] = windows.pop()
        else:
            raise ModelError("per-layer windows can only be written for qwen2/qwen3 configs")
    return raw
