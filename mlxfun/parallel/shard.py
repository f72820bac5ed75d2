"""Tensor parallelism: each rank of an `mx.distributed` group holds a slice of every layer.

As mlx-lm's `shard` (Megatron's scheme): q/k/v and gate/up are split by their outputs, so each rank
computes its own heads and its share of the MLP's hidden units, and o and down by their inputs, so
each rank's product is a partial sum that `llama.reduce` all-sums: two all_sums of (B, T, E) per
layer. Embeddings, norms and the output map are replicated, so every rank computes the same full
logits and samples the same tokens from the same per-row seeds: no logits move between ranks.

q/k/v are fused into `qkv` rows [q heads | k heads | v heads] and gate/up into `gate_up` rows
[gate | up], so a rank takes its slice of each part. A quantized map is split along its rows or
along whole quantization groups of its inputs, never inside a group. The sharded config carries
this rank's head counts and intermediate size (the cache then holds only this rank's KV heads)
and the group (`ModelConfig.tensor_group`), which the compiled steps close over.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxfun.errors import ModelError
from mlxfun.model import config as cfg
from mlxfun.model import tokenizer as tok
from mlxfun.model import weights
from mlxfun.model.config import ModelConfig
from mlxfun.model.llama import Dense, Layer, Linear, Params, Quantized
from mlxfun.model.load import Model, in_dtype, load, parse_dtype, resolve, weight_files


def check(config: ModelConfig, group) -> None:
    """Raise ModelError unless `config` can be split evenly across `group`'s ranks."""
    if not isinstance(group, mx.distributed.Group):
        raise ModelError(f"group must be an mx.distributed.Group (mx.distributed.init()), got {type(group).__name__}")
    if config.tensor_group is not None:
        raise ModelError(f"the model is already sharded across {config.tensor_group.size()} ranks: shard the "
                         "unsharded model once (mlxfun.shard) or load with mlxfun.sharded_load")
    n = group.size()
    for name, size in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                       ("MLP hidden units (intermediate_size)", config.intermediate_size),
                       ("experts' hidden units (moe_intermediate_size)", config.moe_intermediate_size)):
        if size % n:
            raise ModelError(f"a tensor-parallel group of {n} ranks does not divide the model's {size} {name}; "
                             f"use a group size that divides {config.num_heads} heads, {config.num_kv_heads} KV "
                             f"heads and {config.intermediate_size} hidden units")


def local_config(config: ModelConfig, group) -> ModelConfig:
    """This rank's config: its heads, KV heads and hidden units, and the group to all-sum over."""
    n = group.size()
    return dataclasses.replace(config, num_heads=config.num_heads // n, num_kv_heads=config.num_kv_heads // n,
                               intermediate_size=config.intermediate_size // n,
                               moe_intermediate_size=config.moe_intermediate_size // n, tensor_group=group)


def by_outputs(p: Linear, parts: list[int], n: int, r: int) -> Linear:
    """Rank r's rows of each fused part (sizes `parts`, in order) of a map split by its outputs
    (stacked maps, experts (n, out, in): each one's rows)."""
    starts = [sum(parts[:i]) for i in range(len(parts))]

    def take(a: mx.array | None) -> mx.array | None:
        if a is None:
            return None
        axis = p.weight.ndim - 2  # the outputs' axis
        rows = [mx.take(a, mx.arange(s + r * size // n, s + (r + 1) * size // n), axis=axis)
                for s, size in zip(starts, parts)]
        return mx.contiguous(mx.concatenate(rows, axis=axis) if len(rows) > 1 else rows[0])  # the full map can go

    if isinstance(p, Quantized):
        return Quantized(take(p.weight), take(p.scales), take(p.biases), take(p.bias))
    return Dense(take(p.weight), take(p.bias))


def by_inputs(p: Linear, in_features: int, n: int, r: int, name: str = "map") -> Linear:
    """Rank r's share of the inputs of a map split by its inputs (whole quantization groups). Its
    outputs are partial sums; a bias is added once, on rank 0."""
    def cols(a: mx.array, width: int) -> mx.array:
        return mx.contiguous(a[..., r * width // n: (r + 1) * width // n])

    bias = p.bias if r == 0 else None
    if isinstance(p, Quantized):
        check_groups(name, p.scales.shape[-1], n)
        return Quantized(cols(p.weight, p.weight.shape[-1]), cols(p.scales, p.scales.shape[-1]),
                         cols(p.biases, p.biases.shape[-1]), bias)
    return Dense(cols(p.weight, in_features), bias)


def check_groups(name: str, groups: int, n: int) -> None:
    """A map split by inputs keeps whole quantization groups: n must divide their count per row."""
    if groups % n:
        raise ModelError(f"{name}: its rows of {groups} quantization groups cannot be split across {n} ranks "
                         "without cutting a group; use a group size that divides them")


def shard_params(config: ModelConfig, params: Params, n: int, r: int) -> Params:
    """Rank r of n's slice of every layer (`config`: the unsharded model's)."""
    H, K, D, I = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    M = config.moe_intermediate_size

    def layer(lay: Layer) -> Layer:
        lay = lay._replace(qkv=by_outputs(lay.qkv, [H * D, K * D, K * D], n, r),
                           o=by_inputs(lay.o, H * D, n, r, "o_proj"))
        if lay.experts is not None:  # every expert's hidden units split as an MLP's; the router whole
            x = lay.experts
            return lay._replace(experts=x._replace(gate_up=by_outputs(x.gate_up, [M, M], n, r),
                                                   down=by_inputs(x.down, M, n, r, "experts' down_proj")))
        return lay._replace(gate_up=by_outputs(lay.gate_up, [I, I], n, r),
                            down=by_inputs(lay.down, I, n, r, "down_proj"))

    return params._replace(layers=tuple(layer(lay) for lay in params.layers))


def shard(model: Model, group) -> Model:
    """`model` split across `group` (mx.distributed.Group): this rank's slice of every layer and a
    config with this rank's head counts and the group. Every rank of the group must call it, and
    then run the same generation calls in the same order."""
    check(model.config, group)
    params = shard_params(model.config, model.params, group.size(), group.rank())
    return Model(local_config(model.config, group), params, model.tokenizer, model.source)


# ---- loading only this rank's slices ----

# Tensors split by outputs (rows) and by inputs (columns), by their Hugging Face name.
_ROWS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|scales|biases|bias)$")
_COLS = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|scales|biases)$")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "U32": np.uint32,
           "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16}


def read_slices(path: Path, n: int, r: int) -> dict[str, mx.array]:
    """Rank r of n's slice of every tensor of one .safetensors file, read through a memory map
    so that only those bytes are read: rows of the maps split by outputs, columns of those split
    by inputs, everything else whole. (The safetensors package's `get_slice` cannot return bfloat16.)"""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ModelError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which mlxfun cannot read")
        start, end = info["data_offsets"]
        a = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        axis = 0 if _ROWS.match(name) else 1 if _COLS.match(name) else None
        if axis is not None:
            if name.endswith(".scales") and axis == 1:
                check_groups(name, a.shape[1], n)
            if a.shape[axis] % n:
                raise ModelError(f"{name} has {a.shape[axis]} {'rows' if axis == 0 else 'columns'}, which "
                                 f"{n} ranks cannot share evenly")
            w = a.shape[axis] // n
            a = a[r * w:(r + 1) * w] if axis == 0 else a[:, r * w:(r + 1) * w]
        t = mx.array(np.ascontiguousarray(a))
        out[name] = t.view(mx.bfloat16) if info["dtype"] == "BF16" else t
    return out


def sharded_load(source: str | Path | None, group, *, dtype: str | mx.Dtype | None = None) -> Model:
    """`shard(load(source), group)`, reading only this rank's slices from a Hugging Face folder
    (safetensors), so a model larger than one rank's memory loads. A GGUF file is read whole by
    `mx.load` and then sharded (its rows of 4-bit blocks could be read in slices too; mlxfun does not)."""
    path = resolve(source)
    if path.is_file():
        return evaluated(shard(load(path, dtype=dtype), group))
    if not (path / "config.json").exists():
        raise ModelError(f"{path} is not a model folder: it has no config.json")
    raw = json.loads((path / "config.json").read_text())
    config = cfg.from_hf(raw)
    check(config, group)
    if config.model_type in ("phi3", "mixtral", "qwen3_moe", "gemma3_text"):
        # Fused (Phi-3) or per-expert tensors, or a multimodal checkpoint's names: read whole, then split.
        return evaluated(shard(load(path, dtype=dtype), group))
    dt = parse_dtype(dtype)
    n, r = group.size(), group.rank()
    tensors = {}
    for file in weight_files(path):
        tensors.update(read_slices(file, n, r))
    local = local_config(config, group)
    params = weights.build_params(dataclasses.replace(local, tensor_group=None), tensors)
    del tensors  # the unfused parts now live only in the params' graph, freed layer by layer below
    return evaluated(Model(local, in_dtype(local, params, dt, gguf_file=False), tok.from_folder(path, raw), str(path)))


def evaluated(model: Model) -> Model:
    """The model with its params computed one layer at a time, so the arrays they were made from
    (whole maps, unfused parts) are freed as it goes rather than all held until the end."""
    for layer in model.params.layers:
        mx.eval(layer)
    mx.eval(model.params)
    return model
