"""Run mlxfun's CUDA kernel sources on the CPU, for machines without a GPU.

Each kernel body is wrapped as MLX's `mx.fast.cuda_kernel` wraps it (same signature: inputs, their
`_shape` arrays where the source uses them, outputs, template constants), compiled as C++ with g++,
and run block by block with one OS thread per CUDA thread: `__syncthreads` is a block barrier,
`__shfl_xor_sync` exchanges through memory between two warp barriers, `__shared__` is a static.
float32 only. It checks indexing, partitioning and merging against NumPy float64 references; it
says nothing about speed or about bf16 rounding (benchmarks/kernels_check.py does, on a GPU).
Run: python benchmarks/kernels_emulate.py [--json PATH]   (needs g++ with C++20)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxfun import kernels

PRELUDE = r"""
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
#define __global__
#define __grid_constant__
#define __shared__ static
using std::min;
using Shape = std::array<int32_t, 10>;
struct dim3 { int x, y, z; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float exchange[1024];
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int t = threadIdx.x, w = t / 32;
    exchange[t] = v;
    warp_barriers[w]->arrive_and_wait();
    const float r = exchange[(t & ~31) | ((t & 31) ^ off)];
    warp_barriers[w]->arrive_and_wait();
    return r;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
struct uint4 { uint32_t x, y, z, w; };
template <typename T, int N> struct AlignedVector {
    T val[N];
    T& operator[](int i) { return val[i]; }
    T operator[](int i) const { return val[i]; }
};
template <int N, typename T> AlignedVector<T, N> unsafe_load_vector(const T* p, uint32_t off) {
    AlignedVector<T, N> v;
    for (int i = 0; i < N; ++i) v[i] = p[off * N + i];
    return v;
}
template <typename F> void launch(F f, dim3 grid, int threads) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    for (int z = 0; z < grid.z; ++z) for (int y = 0; y < grid.y; ++y) for (int x = 0; x < grid.x; ++x) {
        std::barrier<> bar(threads);
        block_barrier = &bar;
        warp_barriers.clear();
        for (int w = 0; w < threads / 32; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
            ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; blockIdx = {x, y, z}; f(); });
        for (auto& t : ts) t.join();
    }
}
"""

CTYPES = {np.dtype(np.float32): "float", np.dtype(np.bool_): "bool", np.dtype(np.uint32): "uint32_t"}


def run(source: str, inputs: dict[str, np.ndarray], outputs: dict[str, tuple], template: list,
        grid: tuple[int, int, int], threads: int) -> list[np.ndarray]:
    """The kernel body `source` over `inputs`, MLX's grid convention (grid in threads along x)."""
    params, args = [], []
    for i, (name, a) in enumerate(inputs.items()):
        params.append(f"const {CTYPES[a.dtype]}* {name}")
        args.append(f"({CTYPES[a.dtype]}*)p[{i}]")
        if name + "_shape" in source:
            params.append(f"const Shape {name}_shape")
            args.append("Shape{" + ", ".join(map(str, a.shape)) + "}")
    for j, name in enumerate(outputs):
        params.append(f"float* {name}")
        args.append(f"(float*)p[{len(inputs) + j}]")
    consts = "".join(f"  using {k} = float;\n" if k == "T" else f"  constexpr int {k} = {v};\n" for k, v in template)
    code = (PRELUDE + "void kernel(" + ", ".join(params) + ") {\n" + consts + source + "\n}\n"
            'extern "C" void run(void** p) { launch([&] { kernel(' + ", ".join(args) + "); }, dim3{"
            + f"{-(-grid[0] // threads)}, {grid[1]}, {grid[2]}" + "}, " + f"{min(threads, grid[0])}); }}\n")
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "k.cpp", Path(tmp) / "k.so"
        src.write_text(code)
        subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)],
                       check=True)
        outs = [np.zeros(shape, np.float32) for shape in outputs.values()]
        arrays = [np.ascontiguousarray(a) for a in inputs.values()] + outs
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        ctypes.CDLL(str(lib)).run(ptrs)
    return outs


def attention(B: int, H: int, K: int, D: int, S: int, seed: int) -> dict:
    """decode_attention's launch as `kernels.decode_attention` makes it, against float64 NumPy."""
    rng = np.random.default_rng(seed)
    qk = rng.standard_normal((B, H + K, 1, D)).astype(np.float32)
    keys = rng.standard_normal((B, K, S, D)).astype(np.float32)
    values = rng.standard_normal((B, K, S, D)).astype(np.float32)
    mask = (rng.random((B, 1, S)) < 0.6) & (np.arange(S) >= 5 * np.arange(B)[:, None, None])
    mask[:, :, S - 1] = True
    G, per = H // K, kernels._lane_split(D, mx.float32)
    warps = kernels.warps_per_block(B * K, G * per)
    P = kernels.parts_for(B * K, S, warps * (32 * per // D) * 2)
    template = [("T", 0), ("D", D), ("G", G), ("PER", per), ("NW", warps)]
    grid = (32 * warps, K * P, B)
    ins = dict(qk=qk, keys=keys, values=values, mask=mask)
    if P == 1:
        (got,) = run(kernels._ATTENTION + kernels._WHOLE, ins, {"out": (B, 1, H * D)}, template, grid, 32 * warps)
    else:
        po, pm, pl = run(kernels._ATTENTION + kernels._PART, ins,
                         {"po": (B, K, P, G, D), "pm": (B, K, P, G), "pl": (B, K, P, G)}, template, grid, 32 * warps)
        (got,) = run(kernels._MERGE, dict(po=po, pm=pm, pl=pl), {"out": (B, 1, H * D)},
                     [("T", 0), ("D", D), ("G", G)], (D, H, B), D)
    q = qk[:, :H, 0].astype(np.float64).reshape(B, K, G, D)
    scores = np.einsum("bkgd,bksd->bkgs", q, keys.astype(np.float64)) / np.sqrt(D)
    scores = np.where(mask[:, :, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bkgs,bksd->bkgd", probs, values.astype(np.float64)).reshape(B, 1, H * D)
    err = float(np.abs(got - want).max())
    out = dict(kernel="decode_attention", B=B, H=H, K=K, D=D, S=S, parts=P, warps=warps, max_err=err, ok=err < 1e-5)
    print(json.dumps(out), flush=True)
    return out


def qmv(M: int, OUT: int, IN: int, group_size: int, seed: int) -> dict:
    if not hasattr(kernels, "_QMV"):
        return {}
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((OUT, IN)).astype(np.float32) * IN**-0.5)
    q, scales, biases = (np.array(a) for a in mx.quantize(w, group_size=group_size, bits=4))
    x = rng.standard_normal((M, IN)).astype(np.float32)
    warps = 4
    (got,) = run(kernels._QMV, dict(x=x, w=q.view(np.uint32), scales=scales, biases=biases), {"y": (M, OUT)},
                 [("T", 0), ("GS", group_size), ("M", M)], (32 * warps * -(-OUT // warps), 1, 1), 32 * warps)
    deq = np.array(mx.dequantize(mx.array(q), mx.array(scales), mx.array(biases), group_size=group_size, bits=4))
    want = x.astype(np.float64) @ deq.astype(np.float64).T
    err = float(np.abs(got - want).max() / np.abs(want).max())
    out = dict(kernel="qmv", M=M, OUT=OUT, IN=IN, group_size=group_size, rel_err=err, ok=err < 1e-5)
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = [
        attention(1, 8, 2, 128, 40, seed=1),  # one part
        attention(2, 8, 2, 64, 300, seed=2),  # parts of one row's keys, merged
        attention(3, 6, 3, 32, 77, seed=3),  # 8 lanes per key, 4 keys per warp at once
        attention(64, 4, 4, 64, 96, seed=4),  # 256 blocks: 4 warps each, and 2 parts
    ]
    results += [r for r in (qmv(1, 70, 256, 64, 5), qmv(3, 33, 576, 32, 6), qmv(8, 40, 512, 128, 7)) if r]
    ok = all(r["ok"] for r in results)
    print("EMULATED KERNELS", "OK" if ok else "FAILED", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
