"""Tensor- and data-parallel generation against one process.

In-process: the splitting of every map (partial products add up to the whole), the balanced split
of prompts, loading slices from safetensors, and the errors. Then ranks on MLX's ring backend over
127.0.0.1, started with `mlx.launch` on free ports and bounded in time: 2 ranks on tiny models, 3
on the real model (its 9 heads and 3 KV heads need a group size that divides them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dist_worker import REAL_PROMPTS, SAMPLED, TINY_PROMPTS, logits
from helpers import VARIANTS, rel_error, tiny_config, tiny_model

import mlxfun
from mlxfun.cli.main import main
from mlxfun.errors import ModelError
from mlxfun.model import llama
from mlxfun.parallel import distributed
from mlxfun.parallel.shard import by_inputs, by_outputs, read_slices, shard, shard_params, sharded_load

ROOT = Path(__file__).resolve().parent.parent


# ---- in one process ----


@pytest.mark.parametrize("quant", [None, (4, 32), (8, 64)])
def test_partial_products_add_up(quant):
    """Each rank's slice of qkv / gate_up is its rows of each fused part; o / down's partial sums
    over the ranks give the whole product (quantization groups kept whole)."""
    config = tiny_config(num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)
    params = tiny_model(config, quant=quant).params
    layer, n = params.layers[0], 2
    H, K, D, I = 4, 2, 32, 256
    x = mx.random.normal((3, config.hidden_size))
    whole = llama.linear(layer.qkv, x)  # (3, (H + 2K) D)
    parts = [llama.linear(by_outputs(layer.qkv, [H * D, K * D, K * D], n, r), x) for r in range(n)]
    q, k, v = np.split(np.array(whole), [H * D, (H + K) * D], axis=1)
    for r, p in enumerate(parts):
        q_r, k_r, v_r = np.split(np.array(p), [H * D // n, (H + K) * D // n], axis=1)
        np.testing.assert_array_equal(q_r, q[:, r * H * D // n:(r + 1) * H * D // n])
        np.testing.assert_array_equal(k_r, k[:, r * K * D // n:(r + 1) * K * D // n])
        np.testing.assert_array_equal(v_r, v[:, r * K * D // n:(r + 1) * K * D // n])
    h = mx.random.normal((3, I))
    down = sum(llama.linear(by_inputs(layer.down, I, n, r), h[:, r * I // n:(r + 1) * I // n]) for r in range(n))
    np.testing.assert_allclose(np.array(down), np.array(llama.linear(layer.down, h)), rtol=1e-5, atol=1e-5)
    gate_up = [np.array(llama.linear(by_outputs(layer.gate_up, [I, I], n, r), x)) for r in range(n)]
    g, u = np.split(np.array(llama.linear(layer.gate_up, x)), 2, axis=1)
    np.testing.assert_array_equal(np.concatenate([p[:, :I // n] for p in gate_up], 1), g)
    np.testing.assert_array_equal(np.concatenate([p[:, I // n:] for p in gate_up], 1), u)


def test_quantization_groups_never_cut():
    model = tiny_model(tiny_config(num_heads=4, num_kv_heads=2, head_dim=16), quant=(4, 64))  # o: 64 inputs, 1 group
    with pytest.raises(ModelError, match="o_proj: its rows of 1 quantization groups cannot be split across 2 ranks"):
        shard_params(model.config, model.params, 2, 0)


def test_errors_name_the_problem():
    group = mx.distributed.init()  # one process: a group of one
    sharded = shard(tiny_model(), group)
    with pytest.raises(ModelError, match="already sharded across 1 ranks"):
        shard(sharded, group)
    with pytest.raises(ModelError, match="must be an mx.distributed.Group"):
        shard(tiny_model(), 2)
    with pytest.raises(ModelError, match="sharded across ranks"):
        mlxfun.save(sharded, "/nonexistent")
    with pytest.raises(mlxfun.InputError, match="group must be an mx.distributed.Group"):
        mlxfun.generate(tiny_model(), "w1", group="all")
    with pytest.raises(mlxfun.InputError, match="tensor-parallel size must divide the 1 ranks"):
        distributed.groups(group, 2)


def test_assign_balances_cost_and_is_deterministic():
    costs = [100, 5, 60, 40, 7, 30, 30, 1]
    shares = distributed.assign(costs, 3)
    assert sorted(i for s in shares for i in s) == list(range(8))
    loads = [sum(costs[i] for i in s) for s in shares]
    assert loads == [100, 90, 83] and all(s == sorted(s) for s in shares)  # the 100 alone: as even as can be
    assert distributed.assign(costs, 3) == shares
    assert distributed.assign([3, 3], 4) == [[0], [1], [], []]


@pytest.mark.parametrize("quant", [None, (4, 32)])
def test_read_slices_reads_each_ranks_slice(tmp_path, quant):
    """Slices read from safetensors equal the slices of the loaded model, so `sharded_load` builds
    the same params as `shard`; one rank's group loads the whole model."""
    model = tiny_model(quant=quant)
    folder = mlxfun.save(model, tmp_path / "m")
    config = model.config
    for r in range(2):
        tensors = read_slices(folder / "model.safetensors", 2, r)
        local = shard_params(config, model.params, 2, r)
        assert tensors["model.layers.1.self_attn.q_proj.weight"].shape[0] == config.num_heads * config.head_dim // 2
        for name, a in [("qkv", local.layers[1].qkv), ("o", local.layers[1].o), ("down", local.layers[0].down)]:
            hf = {"qkv": "self_attn.{}_proj", "o": "self_attn.o_proj", "down": "mlp.down_proj"}[name]
            if name == "qkv":
                got = mx.concatenate([tensors[f"model.layers.1.{hf.format(p)}.weight"] for p in "qkv"])
            else:
                got = tensors[f"model.layers.{1 if name == 'o' else 0}.{hf}.weight"]
            np.testing.assert_array_equal(np.array(got), np.array(a.weight))
    loaded = sharded_load(folder, mx.distributed.init())
    assert loaded.config.tensor_group is not None
    assert mlxfun.generate(loaded, TINY_PROMPTS, max_tokens=5).token_ids == \
        mlxfun.generate(model, TINY_PROMPTS, max_tokens=5).token_ids


# ---- ranks on the ring backend ----


def free_ports(n: int) -> int:
    """A first port p with p .. p + n - 1 free on 127.0.0.1 (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        if start + n > 65535:
            continue
        try:
            socks = []
            for p in range(start, start + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launch(n: int, args: list[str], timeout: float = 240) -> str:
    """`mlx.launch -n n --backend ring` on 127.0.0.1; kills every rank after `timeout` seconds.
    Ports found free can be taken by another process before the ranks bind them (other tests'
    servers, on a shared machine): then it tries again on other ports, at most twice more."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    for attempt in range(3):
        cmd = [str(launcher), "-n", str(n), "--backend", "ring", "--starting-port", str(free_ports(n)), "--",
               sys.executable, *args]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"the ranks ran past {timeout} s:\n{out[-3000:]}") from None
        if "Couldn't bind socket" not in out:
            break
    # mlx.launch may exit 0 when a rank failed: look for a traceback too.
    assert proc.returncode == 0 and "Traceback (most recent call last)" not in out, out[-3000:]
    return out


def ranks(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny suite on 2 ranks, with a float32 and a 4-bit folder to load slices from."""
    tmp = tmp_path_factory.mktemp("dist")
    folders = [mlxfun.save(tiny_model(), tmp / "f32"), mlxfun.save(tiny_model(quant=(4, 32)), tmp / "q4")]
    launch(2, ["-m", "dist_worker", "tiny", str(tmp), *map(str, folders)])
    return tmp, ranks(tmp, 2)


def test_tensor_parallel_logits_match_one_process(tiny_run):
    tmp, _ = tiny_run
    for name in ("tied", "untied", "bias", "qk_norm", "q4"):
        model = tiny_model(quant=(4, 32)) if name == "q4" else tiny_model(tiny_config(**VARIANTS[name]))
        expected = logits(model, TINY_PROMPTS)
        for r in range(2):
            assert rel_error(np.load(tmp / f"logits-{name}-{r}.npy"), expected) <= 1e-5, name  # of max |logit|
        np.testing.assert_array_equal(np.load(tmp / f"logits-{name}-0.npy"), np.load(tmp / f"logits-{name}-1.npy"))


def test_tensor_parallel_generation_matches_one_process(tiny_run):
    _, res = tiny_run
    f32, q4 = tiny_model(), tiny_model(quant=(4, 32))
    greedy = mlxfun.generate(f32, TINY_PROMPTS, max_tokens=8).token_ids
    sampled = mlxfun.generate(f32, TINY_PROMPTS, **SAMPLED)
    for r in res:
        assert r["kv_heads"] == 1  # each rank's cache holds its share of the 2 KV heads
        assert r["greedy"] == greedy and r["continuous"] == greedy
        assert r["greedy_q4"] == mlxfun.generate(q4, TINY_PROMPTS, max_tokens=8).token_ids
        assert r["sampled"]["ids"] == sampled.token_ids and r["sampled"]["seeds"] == sampled.seeds
        assert r["traces"] == 1
        assert r["loaded-f32"] == greedy
        assert r["loaded-q4"] == mlxfun.generate(q4, TINY_PROMPTS, max_tokens=8).token_ids
    # Fresh seeds are drawn on rank 0 and shared: both ranks sample the same tokens.
    assert res[0]["unseeded"] == res[1]["unseeded"]


def test_data_parallel_matches_one_process_in_prompt_order(tiny_run):
    _, res = tiny_run
    model = tiny_model()
    sampled = mlxfun.generate(model, TINY_PROMPTS, **SAMPLED, logprobs=2)
    greedy = mlxfun.generate(model, TINY_PROMPTS, max_tokens=8)
    shares = [r["share"] for r in res]
    assert sorted(shares[0] + shares[1]) == list(range(6)) and shares[0] and shares[1]
    for r in res:
        dp = r["dp"]
        assert dp["ids"] == sampled.token_ids and dp["texts"] == sampled.texts and dp["seeds"] == sampled.seeds
        assert dp["finish"] == sampled.finish_reasons and dp["logprobs"] == sampled.logprobs
        assert [[[list(p) for p in step] for step in row] for row in sampled.top_logprobs] == dp["top"]
        assert r["dp_continuous"]["ids"] == greedy.token_ids
        assert r["dp_one_prompt"] == greedy.token_ids[:1]


def test_replicated_engine_serves_rank0s_requests(tiny_run):
    _, res = tiny_run
    expected = mlxfun.generate(tiny_model(), TINY_PROMPTS, **SAMPLED).token_ids
    assert res[0]["replicated"]["ids"] == expected and res[0]["replicated"]["cancelled"] == "cancelled"
    assert res[0]["replicated"]["events"] == res[1]["replicated"]["events"]  # the same steps on both ranks
    assert res[0]["replicated"]["left"] == 0 and res[1]["replicated"]["left"] == 0


def test_distributed_errors(tiny_run):
    _, res = tiny_run
    for r in res:
        heads = "a tensor-parallel group of 2 ranks does not divide the model's 3 attention heads"
        assert heads in r["errors"]["heads"]
        assert "ranks [1] of the group were given other prompts or options than rank 0" in r["errors"]["prompts"]


def test_real_model_three_ranks(tmp_path, model_f32):
    """SmolLM2-135M (9 heads, 3 KV heads) on 3 ranks in float32: the same greedy tokens as one
    process, and logits within 1e-4 of the largest (the real-model float32 tolerance of
    test_real_model: 30 layers of partial sums added in another order; measured 8.8e-5)."""
    launch(3, ["-m", "dist_worker", "real", str(tmp_path)])
    res = ranks(tmp_path, 3)
    expected = logits(model_f32, [model_f32.tokenizer.encode(p) for p in REAL_PROMPTS])
    for r in range(3):
        assert rel_error(np.load(tmp_path / f"logits-real-{r}.npy"), expected) <= 1e-4
    greedy = mlxfun.generate(model_f32, REAL_PROMPTS, max_tokens=3).token_ids
    assert all(r["greedy"] == greedy for r in res)


def test_command_line_tensor_and_data_parallel(tmp_path, capsys):
    folder = mlxfun.save(tiny_model(), tmp_path / "tiny")
    args = ["generate", "--model", str(folder), "-p", "w1 w2 w3", "-p", "w7 w8", "-p", "w9", "--max-tokens", "5"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    for flag in ("--tensor-parallel", "--data-parallel"):
        out = launch(2, ["-m", "mlxfun", *args, flag])  # stdout and stderr: drop rank 0's progress lines
        out = "".join(line for line in out.splitlines(keepends=True) if not line.startswith("progress: "))
        assert out == expected, flag  # rank 0 alone prints
