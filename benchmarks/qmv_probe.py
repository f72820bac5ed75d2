"""Where `qmv.mma`'s time goes (CUDA only, diagnostic): an 8B step's 4-bit weights read by
probe kernels that do no arithmetic, in the same compiled chain as `qmv_rows.py`.

  stream     each thread reads 16-byte words of a whole weight, grid-stride: the bandwidth a
             simple custom kernel reaches (the floor for any 4-bit product)
  qmv-loads  qmv.mma's launch and load pattern (blocks of 16 features, 16 warps splitting the
             inputs, each lane its uint4 of two features, the scales and biases), then only an
             XOR of what it loaded: its loads without dequantization, mma or the block's sum
  qmv        qmv.mma itself, one row
If qmv-loads is close to qmv, the loads' pattern or latency bounds the kernel; if it is close to
stream, the arithmetic and the block-wide sum do.
Run: python benchmarks/qmv_probe.py [--shape 8B] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import qmv_rows

from mlxfun import bench, kernels, qmv

_STREAM = kernels.compact(r"""
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const int64_t n = (int64_t)w_shape[0] * w_shape[1] / 4;
    uint32_t acc = __float_as_uint(static_cast<float>(x[0]));
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = wv[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) y[blockIdx.x] = static_cast<T>(1.f);  // never in practice: keeps the loads alive
    if (threadIdx.x == 0) y[blockIdx.x] = static_cast<T>(0.f);
""")

_QMV_LOADS = kernels.compact(r"""
    constexpr int KW = 16;
    const int IN = w_shape[1] * 8, OUT = w_shape[0], groups = IN / 64, blocks = (IN + 127) / 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int f0 = blockIdx.x * 16;
    const int64_t fa = min(f0 + g, OUT - 1), fb = min(f0 + g + 8, OUT - 1);
    const uint4* wa = reinterpret_cast<const uint4*>(w + fa * (IN / 8));
    const uint4* wb = reinterpret_cast<const uint4*>(w + fb * (IN / 8));
    uint32_t acc = __float_as_uint(static_cast<float>(x[0]));
    for (int b = warp; b < blocks; b += KW) {
        const int k = b * 128 + 32 * t;
        if (k < IN) {
            const uint4 qa = wa[k / 32], qb = wb[k / 32];
            acc ^= qa.x ^ qa.y ^ qa.z ^ qa.w ^ qb.x ^ qb.y ^ qb.z ^ qb.w;
            acc ^= __float_as_uint(static_cast<float>(scales[fa * groups + k / 64])) ^
                   __float_as_uint(static_cast<float>(scales[fb * groups + k / 64])) ^
                   __float_as_uint(static_cast<float>(biases[fa * groups + k / 64])) ^
                   __float_as_uint(static_cast<float>(biases[fb * groups + k / 64]));
        }
    }
    if (acc == 0x12345678u) y[blockIdx.x] = static_cast<T>(1.f);
    if (threadIdx.x == 0) y[blockIdx.x] = static_cast<T>(0.f);
""")


def probe(name: str):
    """fn(x (1, in) bf16, quantize()'s triple) -> a small array, after reading the weight (and,
    for "qmv", computing x W^T)."""
    if name == "qmv":
        return lambda x, q: qmv.mma(x, *q, qmv_rows.GROUP)
    source, names = {"stream": (_STREAM, ["x", "w"]),
                     "qmv-loads": (_QMV_LOADS, ["x", "w", "scales", "biases"])}[name]
    kernel = mx.fast.cuda_kernel(name="mlxfun_probe_" + name.replace("-", "_"), input_names=names,
                                 output_names=["y"], source=source)

    def run(x, q):
        out = q[0].shape[0]
        blocks, threads = (264, 1024) if name == "stream" else (-(-out // 16), 512)
        return kernel(inputs=[x, *q[:len(names) - 1]], template=[("T", mx.bfloat16)],
                      grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(1, blocks)], output_dtypes=[mx.bfloat16])[0]

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8B", choices=sorted(bench.SHAPES))
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not kernels.available(mx.bfloat16):
        print("qmv_probe: CUDA only", file=sys.stderr)
        return 2
    layers, head = qmv_rows.random_layers(args.shape, mx.bfloat16)
    quantized = [[mx.quantize(w, group_size=qmv_rows.GROUP, bits=4) for w in ws] for ws in layers]
    quantized_head = mx.quantize(head, group_size=qmv_rows.GROUP, bits=4)
    del layers, head
    mx.eval(quantized, quantized_head)
    gb = (sum(a.nbytes for ws in quantized for q in ws for a in q) + sum(a.nbytes for a in quantized_head)) / 1e9
    results = []
    for name in ("stream", "qmv-loads", "qmv"):
        fn = probe(name)

        def step(xs):
            y = mx.zeros((1, 1), mx.bfloat16)
            for q in [q for ws in quantized for q in ws] + [quantized_head]:
                y = fn(xs[q[0].shape[1] * 8] + y[:, :1], q)  # each fed by the one before, as in a step
            return y

        widths = {q[0].shape[1] * 8 for ws in quantized for q in ws}
        xs = {n: mx.random.normal((1, n)).astype(mx.bfloat16) for n in widths}
        ms = qmv_rows.timed_ms(mx.compile(step), xs, args.repeats)
        results.append(dict(probe=name, step_ms=ms, weight_gb=gb, tb_per_s=gb / ms))
        print(json.dumps(results[-1]), flush=True)
    qmv_rows.save(args.json, args.shape, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
