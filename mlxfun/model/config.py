"""Model configuration: a frozen dataclass, closed over by compiled functions (never an argument)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlxfun.errors import ModelError

# Hugging Face `model_type`s that share the Llama decoder (optionally with bias / q-k norm / windows).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of a Hugging Face config: `linear` or `llama3`."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    model_type: str = "llama"
    # Tensor parallelism (mlxfun.shard): the mx.distributed group whose ranks each hold a slice of every
    # layer; head counts and intermediate_size above are then this rank's. Compiled steps close over the
    # config, so the group reaches their all_sums as a constant (a group cannot be an array argument).
    tensor_group: Any = None

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ModelError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def with_max_kv_size(self, max_kv_size: int | None) -> ModelConfig:
        """The same model with every layer's window capped at `max_kv_size` (a bounded cache)."""
        if max_kv_size is None:
            return self
        if max_kv_size < 1:
            raise ModelError(f"max_kv_size must be positive, got {max_kv_size}")
        windows = tuple(max_kv_size if w is None else min(w, max_kv_size) for w in self.layer_windows)
        return dataclasses.replace(self, layer_windows=windows)

    @property
    def max_window(self) -> int | None:
        """The widest window if every layer has one (then the cache can be a bounded ring), else None."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)


def _rope_scaling(raw: dict | None) -> RopeScaling | None:
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
    raise ModelError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def _windows(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3"):
        # Qwen2 applies the window only with use_sliding_window, to layers from max_window_layers on.
        if not raw.get("use_sliding_window", False) or not window:
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(None if i < first else int(window) for i in range(num_layers))
    return (int(window) if window else None,) * num_layers


def from_hf(raw: dict) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict."""
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
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_traditional=bool(raw.get("rope_traditional", False)),  # mlx-lm's key; HF has none
            rope_scaling=_rope_scaling(raw.get("rope_scaling")),
            rope_freq_factors=tuple(float(f) for f in raw["rope_freq_factors"]) if raw.get("rope_freq_factors")
            else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type != "llama")),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            layer_windows=_windows(raw, layers),
            model_type=model_type,
        )
    except KeyError as e:
        raise ModelError(f"config.json lacks required field {e.args[0]!r}") from None


def to_hf(config: ModelConfig) -> dict:
    """The Hugging Face `config.json` dict for a ModelConfig (inverse of `from_hf`)."""
    raw = {
        "model_type": config.model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[config.model_type]],
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
    windows = set(config.layer_windows)
    if windows != {None}:
        if config.model_type in ("qwen2", "qwen3"):
            first = next(i for i, w in enumerate(config.layer_windows) if w is not None)
            raw.update(use_sliding_window=True, sliding_window=max(w for w in windows if w), max_window_layers=first)
        elif len(windows) == 1:
            raw["sliding_window"] = windows.pop()
        else:
            raise ModelError("per-layer windows can only be written for qwen2/qwen3 configs")
    return raw
