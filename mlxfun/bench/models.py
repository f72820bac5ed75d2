"""What the benchmarks run on: random-weight Llama shapes, their prompts, and the machine.

`--shape` builds a model in memory with random weights (Hugging Face names through
`weights.build_params`) and a word-level tokenizer over its vocabulary, so large shapes can be
measured without downloads.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import subprocess

import mlx.core as mx
import numpy as np

from mlxfun.kernels import blas
from mlxfun.model.config import ModelConfig, RopeScaling, from_hf
from mlxfun.model.llama import Dense, Experts, Layer, Params
from mlxfun.model.load import Model
from mlxfun.model.tokenizer import Tokenizer

LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {
    "135M": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                        num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192),
    # SmolLM2-135M's size with 8 heads and 2 KV heads, so 2 tensor-parallel ranks divide them
    # (SmolLM2's 9 and 3 need 3 ranks) and 4-bit groups of 64 stay whole.
    "135M-tp": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=8,
                           num_kv_heads=2, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192),
    "1B": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=RopeScaling("llama3", 32.0, **LLAMA3_ROPE)),
    "8B": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=RopeScaling("llama3", 8.0, **LLAMA3_ROPE), tie_word_embeddings=False),
    # Gemma 3 4B's text model: 5 local layers (window 1,024) to 1 global, head size 256.
    "gemma3-4B": from_hf({"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
                          "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
                          "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                          "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                          "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                          "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh"}),
    # Qwen3-30B-A3B with 24 of its 48 layers (a benchmark machine's disk holds the bf16 folder that
    # mlx-lm loads): 128 experts of 768, 8 per token.
    "qwen3-30B-A3B-24L": from_hf({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                                  "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 32,
                                  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                                  "rope_theta": 1_000_000.0, "max_position_embeddings": 40960,
                                  "tie_word_embeddings": False}),
}
# The same with 6 layers: quick A/B runs of the experts' products.
SHAPES["qwen3-30B-A3B-6L"] = dataclasses.replace(SHAPES["qwen3-30B-A3B-24L"], num_layers=6, layer_windows=(),
                                                 local_layers=(), moe_layers=(True,) * 6, layer_sinks=())
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
QUANT = {"q4": 4, "q8": 8}


def on_gpu() -> bool:
    return mx.default_device() != mx.cpu


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer covering every id ("t0 t1 ..."), for random-weight shapes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token_ids={0}, bos_token_id=None, add_bos=False, chat_template=None)


def random_params(config: ModelConfig, dtype: mx.Dtype, seed: int = 0) -> Params:
    """Random weights for any family the decoder runs (fused q/k/v and gate/up, stacked experts),
    evaluated layer by layer so a large shape never holds more than one layer's temporaries."""
    mx.random.seed(seed)
    E, I, D, H, K = (config.hidden_size, config.intermediate_size, config.head_dim, config.num_heads,
                     config.num_kv_heads)
    M, n = config.moe_intermediate_size, config.num_experts

    def mat(*shape):
        return Dense((mx.random.normal(shape) * shape[-1] ** -0.5).astype(dtype))

    def norm(size):
        return mx.ones((size,), dtype)

    embed = mat(config.vocab_size, E)
    lm_head = None if config.tie_word_embeddings else mat(config.vocab_size, E)
    mx.eval(embed, lm_head)
    layers = []
    for i in range(config.num_layers):
        experts = Experts(mat(n, E), mat(n, 2 * M, E), mat(n, E, M)) if config.moe_layers[i] else None
        sandwich = config.sandwich_norms
        layer = Layer(attn_norm=norm(E), qkv=mat((H + 2 * K) * D, E), o=mat(E, H * D), mlp_norm=norm(E),
                      gate_up=None if experts else mat(2 * I, E), down=None if experts else mat(E, I),
                      q_norm=norm(D) if config.qk_norm else None, k_norm=norm(D) if config.qk_norm else None,
                      attn_post_norm=norm(E) if sandwich else None, mlp_post_norm=norm(E) if sandwich else None,
                      experts=experts)
        mx.eval(layer)
        layers.append(layer)
    return Params(embed, tuple(layers), norm(E), lm_head)


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed + batch)
    return rng.integers(1, vocab_size, size=(batch, length)).tolist()


# A small wide model for the workload benchmarks on the CPU, where SmolLM2 runs ~10 tokens/s.
WORKLOAD_SHAPE = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=8,
                             num_kv_heads=8, head_dim=64, max_position_embeddings=8192)


def random_model(config: ModelConfig, dtype: mx.Dtype | None = None) -> Model:
    """Random weights of a shape, with a word tokenizer over its vocabulary; bf16 on a GPU and
    float32 on the CPU unless `dtype` says."""
    dtype = dtype or (mx.bfloat16 if on_gpu() else mx.float32)
    return Model(config, random_params(config, dtype), word_tokenizer(config.vocab_size), "random")


def workload_model(args) -> Model:
    if args.shape or on_gpu():
        return random_model(SHAPES[args.shape or "1B"], DTYPES[args.base_dtype])
    return random_model(WORKLOAD_SHAPE, mx.float32)


def mlx_lm_available() -> bool:
    """Whether mlx-lm is installed, found without importing it: it and what it imports (transformers)
    stay out of the process until mlxfun's own rows are measured."""
    return importlib.util.find_spec("mlx_lm") is not None


def mlx_lm_version() -> str:
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "mlx": mx.__version__,
            "device": str(mx.default_device()), "blas": blas.LOADED or "bundled"}
    if on_gpu():
        info["device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v))
                               for k, v in mx.device_info().items()}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["gpu"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    if mlx_lm_available():
        info["mlx_lm"] = mlx_lm_version()
    return info
