"""What the benchmarks run on: random-weight Llama shapes, their prompts, and the machine.

`--shape` builds a model in memory with random weights (Hugging Face names through
`weights.build_params`) and a word-level tokenizer over its vocabulary, so large shapes can be
measured without downloads.
"""

from __future__ import annotations

import os
import platform
import subprocess

import mlx.core as mx
import numpy as np

from mlxfun.kernels import blas
from mlxfun.model import weights
from mlxfun.model.config import ModelConfig, RopeScaling
from mlxfun.model.llama import Params
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
}
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
    """Random weights with Hugging Face names through `weights.build_params`, evaluated layer by layer."""
    mx.random.seed(seed)
    E, I, D, H, K = (config.hidden_size, config.intermediate_size, config.head_dim, config.num_heads,
                     config.num_kv_heads)

    def mat(rows, cols):
        return (mx.random.normal((rows, cols)) * cols**-0.5).astype(dtype)

    def norm(size):
        return mx.ones((size,), dtype)

    tensors = {"model.embed_tokens.weight": mat(config.vocab_size, E), "model.norm.weight": norm(E)}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = mat(config.vocab_size, E)
    mx.eval(tensors)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        layer = {f"{p}.input_layernorm.weight": norm(E), f"{p}.post_attention_layernorm.weight": norm(E),
                 f"{p}.self_attn.q_proj.weight": mat(H * D, E), f"{p}.self_attn.k_proj.weight": mat(K * D, E),
                 f"{p}.self_attn.v_proj.weight": mat(K * D, E), f"{p}.self_attn.o_proj.weight": mat(E, H * D),
                 f"{p}.mlp.gate_proj.weight": mat(I, E), f"{p}.mlp.up_proj.weight": mat(I, E),
                 f"{p}.mlp.down_proj.weight": mat(E, I)}
        mx.eval(layer)
        tensors.update(layer)
    params = weights.build_params(config, tensors)
    del tensors
    for layer in params.layers:  # fuse (qkv, gate_up) one layer at a time, freeing the parts
        mx.eval(layer)
    mx.eval(params)
    return params


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
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        return False
    return True


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
        import mlx_lm

        info["mlx_lm"] = getattr(mlx_lm, "__version__", "?")
    return info
