"""Each model family against mlx-lm's implementation of it, outside the test suite: tiny random
Hugging Face folders (one tensor per expert), float32 log-probabilities of the same tokens from
`mlxfun` and from mlx-lm's model classes, and greedy tokens.

Run where mlx-lm is installed (it is never a dependency): python benchmarks/mlx_lm_crosscheck.py
[--families gemma2,phi3] [--aligned] [--json PATH]. The test suite checks every family against its
own float64 NumPy reference instead (tests/family_reference.py).

Two differences are mlx-lm's, by design (0.32.2): its Gemma 2 ignores `sliding_window` (every
layer global), and its Phi-3 rotates every position with longrope's long factors, where Hugging
Face (and mlxfun, below the original context) uses the short ones. `--aligned` removes both from
the tiny configs (a window longer than the prompt; long factors equal to the short), so that what
remains to differ is the arithmetic.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

from mlxfun.model import config as cfg
from mlxfun.model import llama
from mlxfun.model.load import load

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)
FAMILIES = {
    "gemma2": dict(model_type="gemma2", query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(model_type="gemma3_text", query_pre_attn_scalar=16, sliding_window=8,
                        sliding_window_pattern=2, rope_local_base_freq=100.0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, hidden_activation="gelu_pytorch_tanh"),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, original_max_position_embeddings=64,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                               "long_factor": [2.0, 3.0, 4.0, 5.0]}),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1),
}


def hf_tensors(raw: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors under Hugging Face's names for the family of `raw`."""
    rng = np.random.default_rng(seed)
    c = cfg.from_hf(raw)
    E, H, K, D, I, M = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, \
        c.moe_intermediate_size
    offset = 0.0 if c.model_type in cfg.GEMMA else 1.0  # Gemma's norm weights are offsets from 1

    def mat(*shape):
        return rng.normal(size=shape) / np.sqrt(shape[-1])

    def nrm(n):
        return rng.normal(size=n) * 0.2 + offset

    w = {"model.embed_tokens.weight": rng.normal(size=(c.vocab_size, E)), "model.norm.weight": nrm(E)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, E)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = nrm(E), nrm(E)
        if c.sandwich_norms:
            w[p + "pre_feedforward_layernorm.weight"], w[p + "post_feedforward_layernorm.weight"] = nrm(E), nrm(E)
        if c.model_type == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = mat((H + 2 * K) * D, E)
        else:
            for n, rows in (("q", H * D), ("k", K * D), ("v", K * D)):
                w[p + f"self_attn.{n}_proj.weight"] = mat(rows, E)
        w[p + "self_attn.o_proj.weight"] = mat(E, H * D)
        if c.qk_norm:
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = nrm(D), nrm(D)
        if c.moe_layers[i] and c.model_type == "mixtral":
            w[p + "block_sparse_moe.gate.weight"] = mat(c.num_experts, E) * 4
            for j in range(c.num_experts):
                for n, shape in (("w1", (M, E)), ("w3", (M, E)), ("w2", (E, M))):
                    w[p + f"block_sparse_moe.experts.{j}.{n}.weight"] = mat(*shape)
        elif c.moe_layers[i]:
            w[p + "mlp.gate.weight"] = mat(c.num_experts, E) * 4
            for j in range(c.num_experts):
                for n, shape in (("gate", (M, E)), ("up", (M, E)), ("down", (E, M))):
                    w[p + f"mlp.experts.{j}.{n}_proj.weight"] = mat(*shape)
        elif c.model_type == "phi3":
            w[p + "mlp.gate_up_proj.weight"], w[p + "mlp.down_proj.weight"] = mat(2 * I, E), mat(E, I)
        else:
            for n, shape in (("gate", (I, E)), ("up", (I, E)), ("down", (E, I))):
                w[p + f"mlp.{n}_proj.weight"] = mat(*shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_folder(folder: Path, raw: dict, tensors: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(raw["vocab_size"])}
    tokenizer = {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "added_tokens": [], "normalizer": None,
                 "post_processor": None, "decoder": None, "truncation": None, "padding": None}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))


def mlx_lm_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    """mlx-lm's float32 logits for tokens (1, T), its model class loaded from the folder by hand
    (its `load` wants a tokenizer package this check does not need)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.set_dtype(mx.float32)
    return np.array(model(mx.array(tokens)).astype(mx.float32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--length", type=int, default=40, help="tokens per prompt (crosses the tiny windows)")
    p.add_argument("--aligned", action="store_true", help="configs where mlx-lm's two known differences vanish")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.aligned:
        FAMILIES["gemma2"]["sliding_window"] = args.length + 1
        FAMILIES["phi3"]["rope_scaling"]["long_factor"] = FAMILIES["phi3"]["rope_scaling"]["short_factor"]
    importlib.import_module("mlx_lm")
    out = {}
    for family in args.families.split(","):
        raw = {**BASE, **FAMILIES[family]}
        raw["tie_word_embeddings"] = cfg.from_hf(raw).tie_word_embeddings  # some of mlx-lm's configs require it
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / family
            write_folder(folder, raw, hf_tensors(raw))
            model = load(folder, dtype="float32")
            tokens = np.random.default_rng(1).integers(1, raw["vocab_size"], (1, args.length)).astype(np.int32)
            positions = mx.arange(args.length, dtype=mx.int32)[None]
            ours = np.array(llama.forward(model.config, model.params, mx.array(tokens), positions)[0])
            theirs = mlx_lm_logits(folder, tokens)
        lp = [x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
              for x in (ours.astype(np.float64), theirs.astype(np.float64))]
        err = float(np.abs(lp[0] - lp[1]).max())
        greedy = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
        out[family] = {"max_logprob_error": err, "argmax_agreement": greedy, "aligned": args.aligned}
        print(f"{family:12s} max |log-prob difference| {err:.2e}   argmax agreement {greedy:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
