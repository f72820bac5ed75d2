"""CUDA kernels for the decode step, where MLX 0.32 has none or a slow one (the 4-bit product is
in `mlxfun.kernels.qmv`), and what they share.

`decode_attention`: masked attention of one query per row over the cache in one pass (scores,
mask, softmax and the weighted sum; MLX's fused kernel takes no mask, so MLX ops take five
kernels and a dozen graph nodes per layer). It reads the keys through the row's block table, so
nothing is gathered first. One block per (row, key head) serves every query head of its group,
so each key is read once. Off CUDA, `llama` runs MLX ops instead.
"""

from __future__ import annotations

import mlx.core as mx


def compact(source: str) -> str:
    """CUDA source without comments and indentation. MLX hashes a custom kernel's whole source at
    every launch (to find its compiled module), so the source's length is host time per node."""
    lines = (line.split("//")[0].strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line)


_ATTENTION = compact(r"""
    // CAP2: a soft-cap on the scores (Gemma 2: cap * tanh(score / cap)), in the base-2 units the
    // softmax runs in, defined by `attention_source`; 0 for none.
    #ifndef CAP2
    #define CAP2 0.f
    #endif
    // One block of NW warps per (row b, key head kh, part p of the keys); the G query heads of
    // the group share each key read. A warp takes KPW keys at once (LPK lanes per key, PER
    // elements per lane, 16-byte loads), U rounds of them per iteration so loads overlap.
    constexpr int LPK = D / PER, KPW = 32 / LPK, U = 2;
    // Keys and values are a pool of blocks (N * BS, K, D); row b's s-th slot is in block
    // table[b][s / BS], so rows that share a prefix read the same blocks.
    const int K = keys_shape[1], W = table_shape[1], S = W * BS, HK = qk_shape[1], H = HK - K;
    const int P = gridDim.y / K;  // a runtime value: one compiled kernel serves every cache size
    const int b = blockIdx.z, kh = blockIdx.y / P, p = blockIdx.y % P;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % LPK, grp = lane / LPK;
    const T* qp = qk + ((int64_t)b * HK + kh * G) * D;
    const T* kp = keys + kh * D;
    const T* vp = values + kh * D;
    const int32_t* tp = table + (int64_t)b * W;
    const bool* mp = mask + (int64_t)b * S;
    // CHUNK > 0 (batch-invariant launches): parts of CHUNK keys each, whatever S, so a row's keys
    // split the same way in any batch (parts past its keys see none and merge as nothing).
    #ifndef CHUNK
    #define CHUNK 0
    #endif
    const int chunk = CHUNK > 0 ? CHUNK : (S + P - 1) / P, first = p * chunk, end = min(S, first + chunk);

    const float scale = rsqrtf((float)D) * 1.44269504088896341f;  // softmax in base 2
    float q[G][PER], o[G][PER], m[G], l[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        auto qv = unsafe_load_vector<PER>(qp + g * D, sub);
        #pragma unroll
        for (int i = 0; i < PER; ++i) { q[g][i] = scale * static_cast<float>(qv[i]); o[g][i] = 0.f; }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (int r0 = 0; first + r0 * NW * KPW < end; r0 += U) {
        AlignedVector<T, PER> kv[U], vv[U];  // every slot loads: a hidden one slot 0
        bool seen[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = first + ((r0 + u) * NW + warp) * KPW + grp;
            // The mask and the table are read at once, then the key and value: two loads deep, as
            // over a contiguous cache. A hidden slot reads slot 0 (cached), with no branch that
            // would hold the table's load back until the mask's arrived.
            const int32_t block = s < end ? tp[s / BS] : 0;
            seen[u] = s < end && mp[s];
            const int64_t at = seen[u] ? ((int64_t)block * BS + s % BS) * K * D : 0;
            kv[u] = unsafe_load_vector<PER>(kp + at, sub);
            vv[u] = unsafe_load_vector<PER>(vp + at, sub);
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                float score = 0.f;
                #pragma unroll
                for (int i = 0; i < PER; ++i) score += q[g][i] * static_cast<float>(kv[u][i]);
                #pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) score += __shfl_xor_sync(0xffffffff, score, off);
                if (CAP2 > 0.f) score = CAP2 * tanhf(score / CAP2);
                if (seen[u]) {
                    const float m_new = fmaxf(m[g], score);
                    const float f = exp2f(m[g] - m_new), e = exp2f(score - m_new);
                    l[g] = l[g] * f + e;
                    #pragma unroll
                    for (int i = 0; i < PER; ++i) o[g][i] = o[g][i] * f + e * static_cast<float>(vv[u][i]);
                    m[g] = m_new;
                }
            }
        }
    }

    // Merge the warp's key groups (lanes LPK apart), then the warps, one query head at a time.
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        #pragma unroll
        for (int off = LPK; off < 32; off <<= 1) {
            const float m_o = __shfl_xor_sync(0xffffffff, m[g], off), l_o = __shfl_xor_sync(0xffffffff, l[g], off);
            const float m_new = fmaxf(m[g], m_o);
            const float fa = m[g] == -INFINITY ? 0.f : exp2f(m[g] - m_new);
            const float fb = m_o == -INFINITY ? 0.f : exp2f(m_o - m_new);
            l[g] = l[g] * fa + l_o * fb;
            #pragma unroll
            for (int i = 0; i < PER; ++i) o[g][i] = o[g][i] * fa + __shfl_xor_sync(0xffffffff, o[g][i], off) * fb;
            m[g] = m_new;
        }
    }
    __shared__ float wm[G][NW], wl[G][NW], part[NW][D];
    if (lane == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g) { wm[g][warp] = m[g]; wl[g][warp] = l[g]; }
    }
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float top = -INFINITY;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, wm[g][w]);
        const float f = m[g] == -INFINITY ? 0.f : exp2f(m[g] - top);  // 0 for a warp that saw no key
        if (grp == 0) {
            #pragma unroll
            for (int i = 0; i < PER; ++i) part[warp][sub * PER + i] = o[g][i] * f;
        }
        __syncthreads();
        for (int d = threadIdx.x; d < D; d += NW * 32) {
            float acc = 0.f, sum = 0.f;
            for (int w = 0; w < NW; ++w) {
                acc += part[w][d];
                sum += wm[g][w] == -INFINITY ? 0.f : wl[g][w] * exp2f(wm[g][w] - top);
            }
""")

# P == 1: the block saw every key; write the output.
_WHOLE = compact(r"""
            out[((int64_t)b * H + kh * G + g) * D + d] = static_cast<T>(acc / sum);
        }
        __syncthreads();
    }
""")

# P > 1: write this part's unnormalised output, running max and sum for `_MERGE`.
_PART = compact(r"""
            const int64_t at = (((int64_t)b * K + kh) * P + p) * G + g;
            po[at * D + d] = acc;
            if (d == 0) { pm[at] = top; pl[at] = sum; }
        }
        __syncthreads();
    }
""")

# One block per (row, query head), one thread per element of the head: the parts' softmaxes merged.
_MERGE = compact(r"""
    const int b = blockIdx.z, h = blockIdx.y, d = threadIdx.x, H = gridDim.y, P = pm_shape[2];
    const int64_t row = (((int64_t)b * (H / G) + h / G) * P) * G + h % G;  // part 0 of (B, K, P, G)
    float top = -INFINITY;
    for (int i = 0; i < P; ++i) top = fmaxf(top, pm[row + i * G]);
    float acc = 0.f, sum = 0.f;
    for (int i = 0; i < P; ++i) {
        const float mi = pm[row + i * G];
        const float f = mi == -INFINITY ? 0.f : exp2f(mi - top);
        acc += po[(row + i * G) * D + d] * f;
        sum += pl[row + i * G] * f;
    }
    out[((int64_t)b * H + h) * D + d] = static_cast<T>(acc / sum);
""")

_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def attention_source(softcap: float | None, chunk: int = 0) -> str:
    """The decode-attention kernel's body for scores soft-capped at `softcap` (None: uncapped), in
    parts of `chunk` keys (0: the launch's parts share the keys). The kernel's scores are in base 2
    (q carries log2(e)), so the cap is too."""
    source = _ATTENTION if not chunk else f"#define CHUNK {chunk}\n" + _ATTENTION
    if not softcap:
        return source
    return f"#define CAP2 {float(softcap) * 1.4426950408889634:.9g}f\n" + source


def _name(base: str, softcap: float | None, chunk: int = 0) -> str:
    """A kernel's name per cap and chunk: MLX finds a compiled module by its name."""
    name = base if not chunk else f"{base}_chunk{chunk}"
    return name if not softcap else f"{name}_cap{float(softcap):g}".replace(".", "p").replace("-", "m")


def available(dtype: mx.Dtype) -> bool:
    """Whether the kernels can run for activations of `dtype`: CUDA is the default device."""
    return dtype in _DTYPES and mx.default_device() == mx.gpu and mx.cuda.is_available()


def serves_attention(head_dim: int, group: int, dtype: mx.Dtype) -> bool:
    """Whether one-token attention runs `decode_attention` here: CUDA, and a layout it fits."""
    return available(dtype) and attention_fits(head_dim, group, dtype)


def _lane_split(head_dim: int, dtype: mx.Dtype) -> int:
    """Elements of a head vector per lane: 16-byte loads, at most 32 lanes per key."""
    return max(16 // dtype.size, head_dim // 32)


def attention_fits(head_dim: int, group: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel serves this step: its layout (a key's lanes divide a warp; the G = H / K
    query heads of a group and their partial outputs fit in registers). At every batch size: the
    alternative gathers each row's blocks into a contiguous copy first (1B on an H200, batch 128:
    810 graph nodes and 10.3 ms per step, against 3.8 ms for round 1's contiguous cache)."""
    per = _lane_split(head_dim, dtype)
    return head_dim % per == 0 and 32 % (head_dim // per) == 0 and group * per <= 64


MAX_BLOCKS = 256


def warps_per_block(blocks: int, registers: int) -> int:
    """Few blocks: many warps each read keys in parallel (if `registers`, the floats each lane
    holds per query head group, allow). More blocks: fewer warps, so blocks share a multiprocessor."""
    return 16 if blocks < MAX_BLOCKS and registers <= 32 else 4


def parts_for(blocks: int, keys: int, keys_per_round: int) -> int:
    """Into how many parts a row's keys are split (each part one block, merged by a second
    kernel): enough that a block takes at most 4 rounds of loads, at most 2048 blocks in all."""
    wanted = -(-keys // (4 * keys_per_round))
    return max(1, min(wanted, 2048 // blocks))


def launch(batch: int, num_kv_heads: int, keys: int, head_dim: int, group: int, dtype: mx.Dtype
           ) -> tuple[int, int, int]:
    """(elements per lane, warps per block, parts per row's keys) of a decode-attention launch."""
    per = _lane_split(head_dim, dtype)
    warps = warps_per_block(batch * num_kv_heads, group * per)
    keys_per_round = warps * (32 * per // head_dim) * 2  # warps x keys per warp at once x rounds in flight
    return per, warps, parts_for(batch * num_kv_heads, keys, keys_per_round)


# Batch-invariant launches: parts of this many keys, blocks of this many warps, whatever the batch.
INVARIANT_CHUNK = 256
INVARIANT_WARPS = 4


def decode_attention(qk: mx.array, keys: mx.array, values: mx.array, table: mx.array, mask: mx.array,
                     num_heads: int, softcap: float | None = None, invariant: bool = False) -> mx.array:
    """qk (B, H + K, 1, D) rotated queries then keys, keys/values (N * bs, K, 1, D) pools after this
    step's write, table (B, W) int32 each row's blocks, mask (B, 1, W * bs) bool -> (B, H * D):
    softmax(q k^T / sqrt(D)) v over the visible keys, the scores soft-capped where `softcap` is
    given (softcap * tanh(score / softcap)). `invariant`: a row's output is the same bits in any
    batch and at any cache width (parts of INVARIANT_CHUNK keys, INVARIANT_WARPS warps, merged
    in order; the launch otherwise follows the batch's size)."""
    B, _, _, D = qk.shape
    S, K = mask.shape[-1], keys.shape[1]
    bs = S // table.shape[1]
    G = num_heads // K
    if invariant:
        chunk = INVARIANT_CHUNK
        per, warps, P = _lane_split(D, qk.dtype), INVARIANT_WARPS, -(-S // chunk)
    else:
        chunk = 0
        per, warps, P = launch(B, K, S, D, G, qk.dtype)
    template = [("T", qk.dtype), ("D", D), ("G", G), ("PER", per), ("NW", warps), ("BS", bs)]
    inputs, names = [qk, keys, values, table, mask], ["qk", "keys", "values", "table", "mask"]
    grid, block = (32 * warps, K * P, B), (32 * warps, 1, 1)
    if P == 1 and not invariant:  # MLX caches each compiled module by name and source
        kernel = mx.fast.cuda_kernel(name=_name("mlxfun_decode_attention", softcap), input_names=names,
                                     output_names=["out"], source=attention_source(softcap) + _WHOLE)
        return kernel(inputs=inputs, template=template, grid=grid, threadgroup=block,
                      output_shapes=[(B, num_heads * D)], output_dtypes=[qk.dtype])[0]
    kernel = mx.fast.cuda_kernel(name=_name("mlxfun_decode_attention_parts", softcap, chunk), input_names=names,
                                 output_names=["po", "pm", "pl"], source=attention_source(softcap, chunk) + _PART)
    po, pm, pl = kernel(inputs=inputs, template=template, grid=grid, threadgroup=block,
                        output_shapes=[(B, K, P, G, D), (B, K, P, G), (B, K, P, G)],
                        output_dtypes=[mx.float32] * 3)
    merge = mx.fast.cuda_kernel(name="mlxfun_decode_attention_merge", input_names=["po", "pm", "pl"],
                                output_names=["out"], source=_MERGE)
    return merge(inputs=[po, pm, pl], template=[("T", qk.dtype), ("D", D), ("G", G)],
                 grid=(D, num_heads, B), threadgroup=(D, 1, 1),
                 output_shapes=[(B, num_heads * D)], output_dtypes=[qk.dtype])[0]
