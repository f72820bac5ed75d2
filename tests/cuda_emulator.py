"""Runs CUDA kernel sources on the CPU, for tests on machines without a GPU.

Each kernel body is wrapped as MLX's `mx.fast.cuda_kernel` wraps it (the same signature: inputs,
their `_shape` arrays where the source uses them, outputs, template constants), compiled as C++
with g++, and run block by block, each CUDA thread a fiber (ucontext) of one OS thread switched
at barriers: `__syncthreads` is a block barrier, `__shfl_xor_sync` exchanges through memory between
two warp barriers, `__shared__` is a static. float32 only: it checks indexing, partitioning and
merging, not speed or bf16 rounding (benchmarks/kernels_check.py does those on a GPU).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PRELUDE = r"""
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#define __global__
#define __grid_constant__
#define __shared__ static
using std::min;
using Shape = std::array<int32_t, 10>;
struct dim3 { int x, y, z; };
// A block's CUDA threads are fibers on one OS thread (ucontext), switched at barriers: a fiber
// waits at __syncthreads until every live fiber of the block is there, and at a warp barrier
// until every fiber of its warp is. Warps are released one at a time, so one runs ahead of the
// others up to the next block barrier: a missing __syncthreads shows as a wrong result.
enum Wait { RUNNING, AT_BLOCK, AT_WARP, DONE };
struct Fiber { ucontext_t ctx; dim3 tid; Wait wait; };
std::vector<Fiber> fibers;
std::vector<std::vector<char>> stacks;
ucontext_t scheduler;
int current_fiber;
dim3 blockIdx, blockDim, gridDim;
#define threadIdx (fibers[current_fiber].tid)
inline void yield_at(Wait w) {
    fibers[current_fiber].wait = w;
    swapcontext(&fibers[current_fiber].ctx, &scheduler);
}
inline void __syncthreads() { yield_at(AT_BLOCK); }
inline void warp_sync() { yield_at(AT_WARP); }
float exchange[1024];
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int t = threadIdx.x;
    exchange[t] = v;
    warp_sync();
    const float r = exchange[(t & ~31) | ((t & 31) ^ off)];
    warp_sync();
    return r;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// Blocks run one after another, so a block's atomics and fences see every earlier block's writes.
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }
inline void __threadfence() {}
template <typename T> T __ldcg(const T* p) { return *p; }
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
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
// cp.async: a thread's copies are queued in groups and land only when it waits for them
// (cp_async_wait), so that reading a stage before its wait, or before the barrier after
// everyone's wait, reads stale data.
struct Copy { void* dst; const void* src; size_t bytes; };
std::vector<std::vector<Copy>> copy_groups[1024];
std::vector<Copy> copy_open[1024];
size_t dynamic_smem = 0;  // the launch's dynamic shared memory, in the GPU's bytes
std::function<void()>* fiber_body;
void fiber_entry() { (*fiber_body)(); fibers[current_fiber].wait = DONE; }
template <typename F> void launch(F f, dim3 grid, int threads) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    std::function<void()> body = f;
    fiber_body = &body;
    fibers.resize(threads);
    stacks.resize(threads);
    for (auto& st : stacks) st.resize(1 << 18);
    for (int z = 0; z < grid.z; ++z) for (int y = 0; y < grid.y; ++y) for (int x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        for (int t = 0; t < threads; ++t) { copy_groups[t].clear(); copy_open[t].clear(); }
        for (int t = 0; t < threads; ++t) {
            Fiber& fb = fibers[t];
            fb.tid = {t, 0, 0};
            fb.wait = RUNNING;
            getcontext(&fb.ctx);
            fb.ctx.uc_stack.ss_sp = stacks[t].data();
            fb.ctx.uc_stack.ss_size = stacks[t].size();
            fb.ctx.uc_link = &scheduler;
            makecontext(&fb.ctx, fiber_entry, 0);
        }
        for (;;) {  // run every runnable fiber to its next barrier (or its end), then release barriers
            bool live = false;
            for (int t = 0; t < threads; ++t) {
                if (fibers[t].wait != RUNNING) continue;
                current_fiber = t;
                swapcontext(&scheduler, &fibers[t].ctx);
            }
            bool all_block = true;
            for (int t = 0; t < threads; ++t) {
                if (fibers[t].wait != DONE) live = true;
                if (fibers[t].wait != DONE && fibers[t].wait != AT_BLOCK) all_block = false;
            }
            if (!live) break;
            bool released = false;
            if (all_block) {
                for (auto& fb : fibers) if (fb.wait == AT_BLOCK) { fb.wait = RUNNING; released = true; }
            } else {
                for (int w = 0; w * 32 < threads; ++w) {
                    const int end = min(threads, 32 * w + 32);
                    bool all = true, any = false;  // lanes that have ended count as arrived
                    for (int t = 32 * w; t < end; ++t) {
                        all &= fibers[t].wait == AT_WARP || fibers[t].wait == DONE;
                        any |= fibers[t].wait == AT_WARP;
                    }
                    if (all && any) {  // one warp at a time: warps drift apart as far as barriers let them
                        for (int t = 32 * w; t < end; ++t) if (fibers[t].wait == AT_WARP) fibers[t].wait = RUNNING;
                        released = true;
                        break;
                    }
                }
            }
            if (!released) { fprintf(stderr, "emulator: deadlock at a barrier\n"); abort(); }
        }
    }
}
"""

# CPU versions of `qmv.MMA_HEADER`: the same names and semantics in float32 (no bf16
# rounding). qmv_mma exchanges the warp's fragments through memory and computes each lane's share
# of c with the m16n8k16 fragment layouts of the PTX ISA: A register r of lane (g, t) holds row
# g + 8 (r & 1), columns 2 t + 8 (r >> 1) + {0, 1}; B register r holds rows 2 t + 8 r + {0, 1},
# column g; c[i] is row g + 8 (i >> 1), column 2 t + (i & 1).
QMV_HEADER = r"""
struct Pair { float lo, hi; };
template <typename T> Pair qmv_pack(T lo, T hi) { return {lo, hi}; }
template <typename T, int BITS> Pair qmv_dequant(uint32_t word, int p, Pair scale, Pair bias) {
    const uint32_t mask = (1u << BITS) - 1;
    return {float((word >> (BITS * p)) & mask) * scale.lo + bias.lo,
            float((word >> (BITS * p + 16)) & mask) * scale.hi + bias.hi};
}
Pair mma_a[1024][4], mma_b[1024][2];
inline float half_of(Pair p, int h) { return h ? p.hi : p.lo; }
template <typename T> void qmv_mma(float* c, const Pair* a, const Pair* b) {
    const int me = threadIdx.x, base = me & ~31, lane = me & 31, g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 4; ++r) mma_a[me][r] = a[r];
    for (int r = 0; r < 2; ++r) mma_b[me][r] = b[r];
    warp_sync();
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float sum = 0.f;
        for (int k = 0; k < 16; ++k) {
            const int a_lane = base + (row % 8) * 4 + (k % 8) / 2, a_reg = (row >= 8) + 2 * (k >= 8);
            const int b_lane = base + col * 4 + (k % 8) / 2, b_reg = k >= 8;
            sum += half_of(mma_a[a_lane][a_reg], k & 1) * half_of(mma_b[b_lane][b_reg], k & 1);
        }
        c[i] += sum;
    }
    warp_sync();
}
"""

# CPU versions of what `qmm.QMM_HEADER` adds: ldmatrix through the warp's exchanged row addresses,
# cp.async as deferred copies (16 bytes on the GPU: 8 values of T, which is float here, or 4 words),
# and the dynamic shared memory as a static buffer, checked against the launch's size.
QMM_HEADER = QMV_HEADER + r"""
#define QMM_SMEM(name, bytes) alignas(16) static unsigned char name[1 << 22]; \
    if ((size_t)(bytes) > dynamic_smem) { \
        fprintf(stderr, "emulator: %zu bytes of shared memory, launched with %zu\n", (size_t)(bytes), dynamic_smem); \
        abort(); \
    }
template <typename E> void cp_async16(E* dst, const E* src) {
    constexpr size_t n = std::is_same_v<E, uint32_t> ? 4 : 8;
    copy_open[threadIdx.x].push_back({dst, src, n * sizeof(E)});
}
inline void cp_async_commit() {
    copy_groups[threadIdx.x].push_back(copy_open[threadIdx.x]);
    copy_open[threadIdx.x].clear();
}
template <int N> void cp_async_wait() {
    auto& groups = copy_groups[threadIdx.x];
    while (groups.size() > N) {
        for (const Copy& c : groups.front()) memcpy(c.dst, c.src, c.bytes);
        groups.erase(groups.begin());
    }
}
const void* ldsm_rows[1024];
template <typename E> void ldsm_x4(Pair* r, const E* row) {
    const int me = threadIdx.x, base = me & ~31, lane = me & 31, g = lane >> 2, t = lane & 3;
    ldsm_rows[me] = row;
    warp_sync();
    for (int m = 0; m < 4; ++m) {
        const E* p = static_cast<const E*>(ldsm_rows[base + 8 * m + g]);
        r[m] = {p[2 * t], p[2 * t + 1]};
    }
    warp_sync();
}
template <typename T, int BITS> Pair qmm_dequant(uint32_t word, int p, Pair scale, Pair bias) {
    const uint32_t mask = (1u << BITS) - 1;
    return {float((word >> (2 * BITS * p)) & mask) * scale.lo + bias.lo,
            float((word >> (2 * BITS * p + BITS)) & mask) * scale.hi + bias.hi};
}
"""

CTYPES = {np.dtype(np.float32): "float", np.dtype(np.bool_): "bool", np.dtype(np.uint32): "uint32_t",
          np.dtype(np.int32): "int32_t"}


# Compiled kernels by their C++ source: shapes and the launch come at run time, so a kernel run at
# several shapes (the batch-invariance checks) is compiled once per process. The prelude (the C++
# library headers and the fibers, half of a compile's time) is precompiled once per process.
_LIBS: dict[str, ctypes.CDLL] = {}
_BUILD = Path(tempfile.mkdtemp(prefix="cuda-emulator-"))
atexit.register(shutil.rmtree, _BUILD, True)
_FLAGS = ["g++", "-std=c++20", "-O1", "-w", "-fPIC", "-pthread"]


def _compiled(code: str) -> ctypes.CDLL:
    """`code` (C++ after `PRELUDE`) compiled and loaded, once per process."""
    lib = _LIBS.get(code)
    if lib is None:
        prelude = _BUILD / "prelude.h"
        if not prelude.exists():
            prelude.write_text(PRELUDE)
            subprocess.run([*_FLAGS, "-x", "c++-header", str(prelude), "-o", str(prelude) + ".gch"], check=True)
        name = hashlib.sha1(code.encode()).hexdigest()
        src, path = _BUILD / f"{name}.cpp", _BUILD / f"{name}.so"
        src.write_text('#include "prelude.h"\n' + code)
        subprocess.run([*_FLAGS, "-shared", str(src), "-o", str(path)], check=True)
        lib = _LIBS[code] = ctypes.CDLL(str(path))
    return lib


def run(source: str, inputs: dict[str, np.ndarray], outputs: dict[str, tuple], template: list,
        grid: tuple[int, int, int], threads: int, header: str = "",
        output_dtypes: dict[str, np.dtype] | None = None, shared_memory: int = 0) -> list[np.ndarray]:
    """The kernel body `source` over `inputs`, MLX's grid convention (grid in threads along x);
    `header` (C++) goes before the kernel, as `mx.fast.cuda_kernel`'s does. Outputs start at zero,
    float32 unless `output_dtypes` names another (int32). `shared_memory`: the launch's dynamic shared
    memory in bytes, as `mx.fast.cuda_kernel` takes it (a kernel asking for more aborts)."""
    types = {name: np.dtype((output_dtypes or {}).get(name, np.float32)) for name in outputs}
    params, args, shapes = [], [], []
    for i, (name, a) in enumerate(inputs.items()):
        params.append(f"const {CTYPES[a.dtype]}* {name}")
        args.append(f"({CTYPES[a.dtype]}*)p[{i}]")
        if name + "_shape" in source:
            params.append(f"const Shape {name}_shape")
            args.append(f"shape_at(s + {10 * len(shapes)})")
            shapes.append(list(a.shape) + [0] * (10 - a.ndim))
    for j, name in enumerate(outputs):
        params.append(f"{CTYPES[types[name]]}* {name}")
        args.append(f"({CTYPES[types[name]]}*)p[{len(inputs) + j}]")
    consts = "".join(f"  using {k} = float;\n" if k == "T" else f"  constexpr int {k} = {v};\n" for k, v in template)
    code = (header + "void kernel(" + ", ".join(params) + ") {\n" + consts + source + "\n}\n"
            "static Shape shape_at(const int32_t* s) { Shape r; std::copy(s, s + 10, r.begin()); return r; }\n"
            'extern "C" void run(void** p, const int32_t* s, int gx, int gy, int gz, int threads, size_t smem) {\n'
            "  dynamic_smem = smem;\n"
            "  launch([&] { kernel(" + ", ".join(args) + "); }, dim3{gx, gy, gz}, threads);\n}\n")
    outs = [np.zeros(shape, types[name]) for name, shape in outputs.items()]
    arrays = [np.ascontiguousarray(a) for a in inputs.values()] + outs
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    dims = np.ascontiguousarray(np.array(shapes or [[0] * 10], np.int32).reshape(-1))
    _compiled(code).run(ptrs, dims.ctypes.data_as(ctypes.c_void_p), -(-grid[0] // threads), grid[1], grid[2],
                        min(threads, grid[0]), ctypes.c_size_t(shared_memory))
    return outs
