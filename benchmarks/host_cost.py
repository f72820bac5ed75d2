"""What one graph node costs the host and the device: compiled chains of N view nodes (reshapes),
N small kernels (RMSNorm), N one-row products with a 4096 x 4096 weight that stays in L2 (bf16
matmul, MLX's 4-bit product, mlxfun's `qmv.product`), and N trivial `mx.fast.cuda_kernel`s (a
copy; also with an 8 KB longer source, and with 4 inputs), timed as host time (call +
mx.async_eval) and total time per node.
Run: python benchmarks/host_cost.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

from mlxfun import kernels, qmv

N = 512


def views(x):
    for i in range(N):
        x = x.reshape(64, -1) if i % 2 == 0 else x.reshape(1, -1)
    return x + 1


def norms(x, w):
    for _ in range(N):
        x = mx.fast.rms_norm(x, w, 1e-5)
    return x


def matmuls(x, w):
    for _ in range(N):
        x = x @ w.T
    return x


def mlx_q4(x, w, scales, biases):
    for _ in range(N):
        x = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=4)
    return x


def qmvs(x, w, scales, biases):
    for _ in range(N):
        x = qmv.product(x, w, scales, biases, 64)
    return x


_COPY = "const int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[1]) y[i] = x[i];"


def copies(x, padding: int = 0, inputs: int = 1):
    """N copy kernels; `padding` bytes of comment lengthen the source (MLX hashes the whole source
    at every launch), `inputs` - 1 unused extra inputs (x again)."""
    names = ["x"] + [f"u{i}" for i in range(1, inputs)]
    kernel = mx.fast.cuda_kernel(name=f"mlxfun_copy_{padding}_{inputs}", input_names=names, output_names=["y"],
                                 source=_COPY + "\n//" + "x" * padding)
    for _ in range(N):
        x = kernel(inputs=[x] * inputs, grid=(x.shape[1], 1, 1), threadgroup=(256, 1, 1),
                   output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
    return x


def timed(f, *args) -> dict:
    for _ in range(3):
        mx.eval(f(*args))
    host, total = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        y = f(*args)
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        host.append(t1 - t0)
        total.append(t2 - t0)
    med = statistics.median
    return dict(host_us_per_node=1e6 * med(host) / N, total_us_per_node=1e6 * med(total) / N)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    w = mx.ones((4096,), mx.bfloat16)
    res = {"device": str(mx.default_device()), "nodes": N,
           "view": timed(mx.compile(views), x), "rms_norm": timed(mx.compile(norms), x, w)}
    if kernels.available(x.dtype):
        dense = (mx.random.normal((4096, 4096)) / 64).astype(mx.bfloat16)
        q = mx.quantize(dense, group_size=64, bits=4)
        res.update(matmul=timed(mx.compile(matmuls), x, dense), mlx_q4=timed(mx.compile(mlx_q4), x, *q),
                   qmv=timed(mx.compile(qmvs), x, *q), cuda_kernel_copy=timed(mx.compile(copies), x),
                   cuda_kernel_copy_8kb_source=timed(mx.compile(lambda x: copies(x, padding=8192)), x),
                   cuda_kernel_copy_4_inputs=timed(mx.compile(lambda x: copies(x, inputs=4)), x))
    print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
