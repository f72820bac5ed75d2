"""Which part of a mixture-of-experts layer fails or costs what on this device (diagnostic):
MLX's gathered products alone, then `llama.moe` and a 2-layer Qwen3-MoE prefill at growing sizes."""
import dataclasses
import time
import traceback

import mlx.core as mx

from mlxfun.bench import models as bench
from mlxfun.model import llama, weights


def timed(label, f):
    try:
        mx.eval(f())
        t = time.perf_counter()
        for _ in range(5):
            mx.eval(f())
        print(f"{label}: ok {(time.perf_counter() - t) / 5 * 1e3:.3f} ms", flush=True)
    except Exception as e:
        print(f"{label}: FAIL {str(e)[:160]}", flush=True)
        traceback.print_exc(limit=3)


S = bench.SHAPES["qwen3-30B-A3B-24L"]
c = dataclasses.replace(S, num_layers=2, layer_windows=S.layer_windows[:2], local_layers=S.local_layers[:2],
                        moe_layers=S.moe_layers[:2], layer_sinks=S.layer_sinks[:2])
p = bench.random_params(c, mx.bfloat16)
for quant in (False, True):
    params = weights.quantize(c, p, 4, 64) if quant else p
    mx.eval(params)
    x_ = params.layers[0].experts
    for N in (1, 8, 128, 1024):
        x = mx.random.normal((N, c.hidden_size)).astype(mx.bfloat16)
        timed(f"moe q4={quant} N={N}", lambda: llama.moe(c, x_, x))
        scores = llama.linear(x_.router, x).astype(mx.float32)
        timed(f"router N={N}", lambda: mx.argpartition(-mx.softmax(scores, axis=-1, precise=True), kth=7, axis=-1))
    for T in (16, 128):
        tok = mx.random.randint(0, 1000, (1, T))
        timed(f"forward q4={quant} T={T}", lambda: llama.forward(c, params, tok, mx.arange(T)[None])[0])
