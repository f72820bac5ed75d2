"""Where the decode step's device time goes: the step timed with one part changed at a time.

Diagnostic only (it patches functions at trace time, so its outputs are not meaningful):
  baseline      the decode step as it is
  no-kernels    without the fused CUDA attention (`mlxfun.kernels`): MLX ops only
  warps-4 / warps-16   that kernel with this many warps per block at every batch size
  sdpa-masked   attention through mx.fast.scaled_dot_product_attention with the mask (MLX's
                fallback on CUDA and the CPU) instead of `llama.grouped_attention`
  sdpa-no-mask  the fused kernel without a mask (wrong output: the bound a fused masked kernel could reach)
  no-attention  attention output replaced by the queries (no SDPA, no mask)
  small-head    the LM head on 1024 vocabulary rows only
  no-cache-write  keys and values not written into the cache
  matmuls-only  only the linear maps of every layer and the head, independent of each other
  matmuls-chained  the same, each fed by the previous one (their serial time: the step's floor)
Each is timed as a chain of steps queued with mx.async_eval (device throughput), and the
baseline also step by step: Python call, async_eval, wait.
Run: python benchmarks/ablate.py --shape 8B --batch-sizes 1,32,128 [--dtype q4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager

import mlx.core as mx

from mlxfun import bench, kernels, llama
from mlxfun.engine import Engine, mode_for
from mlxfun.llama import Dense
from mlxfun.step import make_steps
from mlxfun.strategy import QUANTIZED


@contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def chain_ms(step, params, state, settings, n: int) -> float:
    for _ in range(3):  # trace, compile, warm
        out, state = step(params, state, settings)
        mx.eval(out, state)
    t = time.perf_counter()
    for _ in range(n):
        out, state = step(params, state, settings)
        mx.async_eval(out, state)
    mx.eval(out, state)
    return 1e3 * (time.perf_counter() - t) / n


def split_ms(step, params, state, settings, n: int) -> dict:
    calls, asyncs, waits = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out, new = step(params, state, settings)
        state = None
        t1 = time.perf_counter()
        mx.async_eval(out, new)
        t2 = time.perf_counter()
        mx.eval(out, new)
        t3 = time.perf_counter()
        state = new
        calls.append(t1 - t0)
        asyncs.append(t2 - t1)
        waits.append(t3 - t2)
    med = statistics.median
    return dict(call_ms=1e3 * med(calls), async_eval_ms=1e3 * med(asyncs), wait_ms=1e3 * med(waits))


def compiled_ms(fn, *args) -> float:
    """ms per call of `fn` compiled, 10 calls queued back to back after 3 warm-ups."""
    f = mx.compile(fn)
    for _ in range(3):
        mx.eval(f(*args))
    t = time.perf_counter()
    for _ in range(10):
        y = f(*args)
        mx.async_eval(y)
    mx.eval(y)
    return 1e3 * (time.perf_counter() - t) / 10


def matmuls_only(config, params, B):
    """ms of the step's linear maps alone (every layer and the head), independent of each other."""
    E, HD, I = config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size
    dtype = params.norm.dtype
    xs = {n: mx.random.normal((B, n)).astype(dtype) for n in {E, HD, I}}  # (B, n): as in a step

    def fn(params, xs):
        outs = []
        for ly in params.layers:
            for p, n_in in ((ly.qkv, E), (ly.o, HD), (ly.gate_up, E), (ly.down, I)):
                outs.append(llama.linear(p, xs[n_in], fast=True)[..., :1])
        outs.append(llama.logits(params, xs[E], fast=True)[..., :1])
        return mx.concatenate(outs, axis=-1)

    return compiled_ms(fn, params, xs)


def matmuls_chained(config, params, B):
    """ms of the step's linear maps in their real order, each fed by the previous one's output
    (slices only between them): the floor that the matmul kernels set for a step."""
    E, HD, I = config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size
    x0 = mx.random.normal((B, E)).astype(params.norm.dtype)

    def fn(params, x):
        for ly in params.layers:
            x = llama.linear(ly.o, llama.linear(ly.qkv, x, fast=True)[..., :HD], fast=True)
            x = llama.linear(ly.down, llama.linear(ly.gate_up, x, fast=True)[..., :I], fast=True)
        return llama.logits(params, x, fast=True)

    return compiled_ms(fn, params, x0)


def run(model, B: int, n: int, strategy, only: list[str] | None = None) -> dict:
    config = model.config
    prompts = bench.random_prompts(config.vocab_size, B, 128)
    engine = Engine(model, B, strategy=strategy)
    for p in prompts:
        engine.add(p, max_tokens=n + 8, ignore_eos=True)
    engine.admit()  # prefilled and evaluated: no row was decoding
    _, (params, state0, settings) = engine.next_decode()
    mode = mode_for(list(engine.requests.values()))
    real_sdpa = mx.fast.scaled_dot_product_attention
    real_linear = llama.linear

    def small_logits(params, h, fast=False):
        p = params.embed if params.lm_head is None else params.lm_head
        return real_linear(Dense(p.weight[:1024]) if isinstance(p, Dense) else p, h, fast)

    def sdpa_no_mask(q, k, v, scale, mask=None):
        return real_sdpa(q, k, v, scale=scale)

    fused = (llama, "fused_masked_attention", lambda: True)
    off = (kernels, "available", lambda x: False)  # the attention variants below replace the kernels' path

    variants = {
        "baseline": [],
        "no-kernels": [off],
        "warps-4": [(kernels, "warps_per_block", lambda blocks, registers: 4)],
        "warps-16": [(kernels, "warps_per_block", lambda blocks, registers: 16)],
        "sdpa-masked": [off, fused],
        "sdpa-no-mask": [off, fused, (mx.fast, "scaled_dot_product_attention", sdpa_no_mask)],
        "no-attention": [off, (llama, "grouped_attention", lambda q, k, v, mask, scale: q),
                         (mx.fast, "scaled_dot_product_attention", lambda q, k, v, scale, mask=None: q)],
        "small-head": [(llama, "logits", small_logits)],
        "no-cache-write": [(llama.kv, "write", lambda buf, new, slot: buf)],
    }
    res = {"batch": B}
    for name, patches in variants.items():
        if only is not None and name != "baseline" and name not in only:
            continue
        steps = make_steps(config, mode)  # fresh: traced under this variant's patches
        state = state0
        with _all(patches):
            res[name] = chain_ms(steps.decode, params, state, settings, n)
            if name == "baseline":
                res |= split_ms(steps.decode, params, state0, settings, n)
        print(f"  B={B:4d} {name:13s} {res[name]:8.2f} ms/step", flush=True)
    if only is None or "matmuls-chained" in only:
        res["matmuls-chained"] = matmuls_chained(config, params, B)
        print(f"  B={B:4d} {'matmuls-chained':13s} {res['matmuls-chained']:8.2f} ms/step", flush=True)
    if only is not None and "matmuls-only" not in only:
        print("  " + json.dumps(res), flush=True)
        return res
    res["matmuls-only"] = matmuls_only(config, params, B)
    print(f"  B={B:4d} {'matmuls-only':13s} {res['matmuls-only']:8.2f} ms/step", flush=True)
    print("  " + json.dumps(res), flush=True)
    return res


@contextmanager
def _all(patches):
    if not patches:
        yield
        return
    obj, name, value = patches[0]
    with patched(obj, name, value), _all(patches[1:]):
        yield


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1B", choices=sorted(bench.SHAPES))
    p.add_argument("--dtype", default=None, help="bfloat16, float32 or q4 (quantized kernels at every batch size)")
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--matmul", action="store_true", help="first, the 4-bit / dequantize / dense matmul crossover")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.matmul:
        mm = bench.matmul_bench([(1536, 576), (14336, 4096)], [1, 8, 32, 128],
                                mx.bfloat16 if bench.on_gpu() else mx.float32)
        if args.json:
            with open(args.json.replace(".json", "-matmul.json"), "w") as f:
                json.dump(mm, f, indent=2)
    base = "bfloat16" if bench.on_gpu() else "float32"
    dtype = args.dtype or base
    model = bench.variants(argparse.Namespace(model=None, shape=args.shape, base_dtype=base, dtypes=[dtype]))[0][1]()
    strategy = QUANTIZED if dtype == "q4" else None
    print(f"{args.shape} {dtype} on {mx.default_device()}")
    only = None if args.variants is None else args.variants.split(",")
    results = [run(model, int(b), args.steps, strategy, only) for b in args.batch_sizes.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "dtype": dtype, "device": str(mx.default_device()), "results": results},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
