// Paged attention over block tables. Three kernels, by what a step holds:
//   - paged_attention_<kv>: the general one (SIMT, any head size, any warp width): prefill
//     chunks (many rows, causal inside the chunk, after a cached prefix) and mixed steps
//     (prefill chunks and decode rows together), over any cache type;
//   - paged_attention_prefill_<kv>_d<D> (below): the same steps on tensor cores, for bf16 and
//     f16 caches where the device has them; the general kernel keeps the rest;
//   - paged_attention_decode_<kv>_d<D> (below): steps of decode rows only.
// Grouped-query: the `rep = H / Hkv` query heads of one kv head share each K/V tile that a
// block loads. <kv> is the cache's type (f32, bf16, f16).
//
// The general kernel widens K and V to f32 as it loads them. One block = (a tile of up to q_tile consecutive query rows of one sequence) × (one kv head)
// × (one partition of the context). The block walks its partition in tiles of k_tile keys
// with an online softmax (running max m, running sum l, unnormalised accumulator):
//
//   grid.x = query tile    grid.y = sequence    grid.z = kv_head * num_splits + split
//
//   keys 0 ............................................ ctx-1
//        |-- split 0 --|-- split 1 --|-- split 2 --|--...
//         [k_tile][k_tile] ...  (K tile → scores → softmax update → V tile → acc)
//
// Row r of a sequence with nq new rows and context ctx sits at position ctx - nq + r and sees
// keys 0 ..= that position (causal), or only the last `window` of them (window > 0); scores are
// soft-capped as cap * tanh(score / cap) when softcap > 0. With one split the block writes the normalised output;
// with several (long contexts and few blocks, e.g. decode of one sequence) each block writes
// (m, l, acc) for its partition and attention_reduce_f32 merges them.
//
// Shared memory (floats), R = q_tile * rep rows:
//   q_s [R][D] | acc_s [R][D] | kv_s [k_tile][D + 1] | p_s [R][k_tile] | m_s, l_s, c_s [R]
// kv_s rows are padded by one float so that threads reading one column of different keys hit
// different banks.
#include "common.cuh"

// ALiBi's slope of this rank's query head h (alibi_scale 0: no ALiBi): head g = h0 + h of the
// model has 2^(l0 (g + 1)) below p (the largest power of two not above the heads), else
// 2^(l0 / 2 (2 (g - p) + 1)), times alibi_scale (Alibi in src/backend/mod.rs). The bias
// slope * (key - query position) is added to the scaled, soft-capped score.
#define PG_ALIBI_PARAMS float alibi_scale, float alibi_l0, u32 alibi_p, u32 alibi_h0
#define PG_ALIBI_ARGS alibi_scale, alibi_l0, alibi_p, alibi_h0
__device__ __forceinline__ float alibi_slope(PG_ALIBI_PARAMS, u32 h) {
    const u32 g = alibi_h0 + h;
    const float e = g < alibi_p ? alibi_l0 * (float)(g + 1) : 0.5f * alibi_l0 * (float)(2 * (g - alibi_p) + 1);
    return alibi_scale * exp2f(e);
}

#define PA_THREADS 128

// X(DT, KV, D) for each head size of the models we run: the decode and tensor-core kernels'
// instances (DECODE_HEAD_DIMS in src/backend/gpu/kernels.rs).
#define PG_HEAD_DIMS(X, DT, KV) \
    X(DT, KV, 16)               \
    X(DT, KV, 32)               \
    X(DT, KV, 64)               \
    X(DT, KV, 80)               \
    X(DT, KV, 96)               \
    X(DT, KV, 128)              \
    X(DT, KV, 256)

// Keys kt0 .. kt0 + nk of kv head g into kv_s[key][D + 1], 16 bytes a load, as f32.
template <typename KV>
__device__ __forceinline__ void load_kv_tile(const KV* __restrict__ cache, const u32* __restrict__ table, float* kv_s,
                                             u32 kt0, u32 nk, u32 D, u32 g, u32 num_kv_heads, u32 block_size) {
    constexpr u32 EPL = 16 / sizeof(KV);
    // NOTE: an fp8 row of D % 16 == 8 values starts 8 bytes past a 16-byte boundary every other
    // key: such rows are read in 8-byte loads (the host checks D % 8 for every cache type).
    if (sizeof(KV) == 1 && D % 16 != 0) {
        const u32 cpr = D / 8;
        for (u32 e = threadIdx.x; e < nk * cpr; e += blockDim.x) {
            const u32 jj = e / cpr, c = e % cpr, key = kt0 + jj;
            const u64 blk = table[key / block_size];
            const uint2 w = __ldg(reinterpret_cast<const uint2*>(
                cache + ((blk * num_kv_heads + g) * block_size + key % block_size) * D + c * 8));
            float v[16];
            unpack16(make_uint4(w.x, w.y, 0, 0), v, (const KV*)0);
#pragma unroll
            for (u32 x = 0; x < 8; ++x) kv_s[jj * (D + 1) + c * 8 + x] = v[x];
        }
        return;
    }
    const u32 cpr = D / EPL;  // chunks per row
    for (u32 e = threadIdx.x; e < nk * cpr; e += blockDim.x) {
        const u32 jj = e / cpr, c = e % cpr, key = kt0 + jj;
        const u64 blk = table[key / block_size];
        float v[EPL];
        unpack16(__ldg(reinterpret_cast<const uint4*>(cache + ((blk * num_kv_heads + g) * block_size + key % block_size) * D +
                                                        c * EPL)),
                 v, (const KV*)0);
#pragma unroll
        for (u32 x = 0; x < EPL; ++x) kv_s[jj * (D + 1) + c * EPL + x] = v[x];
    }
}

// The rows and keys of one prefill block (the general and the tensor-core kernel): a tile of
// up to q_tile query rows of sequence blockIdx.y, kv head g, and the keys k_begin .. k_end of
// context partition `split`; row r of the tile sees base_keys + r keys. False: nothing to do.
struct PrefillBlock {
    u32 s, q0, nq, tile0, rows_here, split, g, rep, base_keys, k_begin, k_end, nr;
};
__device__ __forceinline__ bool prefill_block(PrefillBlock& b, const u32* __restrict__ query_start,
                                              const u32* __restrict__ seq_lens, u32 num_heads, u32 num_kv_heads,
                                              u32 q_tile, u32 part_size, u32 num_splits) {
    b.s = blockIdx.y;
    b.q0 = query_start[b.s];
    b.nq = query_start[b.s + 1] - b.q0;
    b.tile0 = blockIdx.x * q_tile;
    if (b.tile0 >= b.nq) return false;
    b.rows_here = min(q_tile, b.nq - b.tile0);
    b.split = blockIdx.z % num_splits;
    b.g = blockIdx.z / num_splits;
    b.rep = num_heads / num_kv_heads;
    b.base_keys = seq_lens[b.s] - (b.nq - 1 - b.tile0);
    const u32 kmax = b.base_keys + b.rows_here - 1;  // the last row's keys
    b.k_begin = b.split * part_size;
    if (b.k_begin >= kmax) return false;
    b.k_end = min(kmax, b.k_begin + part_size);
    b.nr = b.rows_here * b.rep;
    return true;
}

template <typename KV>
__device__ __forceinline__ void paged_attention(const float* __restrict__ qkv, const KV* __restrict__ k_cache,
                                                const KV* __restrict__ v_cache, const u32* __restrict__ query_start,
                                                const u32* __restrict__ seq_lens, const u32* __restrict__ block_tables,
                                                float* __restrict__ out, float* __restrict__ part_acc,
                                                float* __restrict__ part_ml, u32 max_blocks, u32 num_heads,
                                                u32 num_kv_heads, u32 head_dim, u32 block_size, u32 row_len,
                                                float scale, u32 window, float softcap, u32 q_tile, u32 k_tile,
                                                u32 part_size, u32 num_splits, PG_ALIBI_PARAMS) {
    // NOTE: K and V rows are read in 16-byte chunks (load_kv_tile), q rows in chunks of 4
    // floats: the host checks that head_dim is a multiple of 8.
    PG_DYNAMIC_SHARED(float, smem);
    PrefillBlock pb;
    if (!prefill_block(pb, query_start, seq_lens, num_heads, num_kv_heads, q_tile, part_size, num_splits)) return;
    const u32 s = pb.s, q0 = pb.q0, tile0 = pb.tile0, split = pb.split, g = pb.g, rep = pb.rep;
    const u32 base_keys = pb.base_keys, k_begin = pb.k_begin, k_end = pb.k_end, nr = pb.nr;
    const u32 D = head_dim, KT = k_tile;
    const u32 R = q_tile * rep;

    float* q_s = smem;
    float* acc_s = q_s + R * D;
    float* kv_s = acc_s + R * D;
    float* p_s = kv_s + KT * (D + 1);
    float* m_s = p_s + R * KT;
    float* l_s = m_s + R;
    float* c_s = l_s + R;
    const u32* table = block_tables + (u64)s * max_blocks;
    const u32 warp = threadIdx.x / PG_WARP_SIZE, lane = threadIdx.x % PG_WARP_SIZE;
    const u32 nwarps = blockDim.x / PG_WARP_SIZE;

    // local row lr = r * rep + j  ↔  query row q0 + tile0 + r, query head g * rep + j
    for (u32 e = threadIdx.x; e < nr * D / 4; e += blockDim.x) {
        const u32 lr = e / (D / 4), i = e % (D / 4) * 4, r = lr / rep, j = lr % rep;
        const float4 v =
            __ldg(reinterpret_cast<const float4*>(qkv + (u64)(q0 + tile0 + r) * row_len + (u64)(g * rep + j) * D + i));
        float* q = q_s + lr * D + i;
        q[0] = v.x;
        q[1] = v.y;
        q[2] = v.z;
        q[3] = v.w;
    }
    for (u32 e = threadIdx.x; e < nr * D; e += blockDim.x) acc_s[e] = 0.0f;
    for (u32 lr = threadIdx.x; lr < nr; lr += blockDim.x) {
        m_s[lr] = PG_NEG_INF;
        l_s[lr] = 0.0f;
    }
    // NOTE: the final write reads other threads' m_s, l_s and acc_s even when the walk below
    // has no tile (a partition wholly before the window), so this barrier is needed.
    __syncthreads();

    // NOTE: with a sliding window the tile's first row sees the earliest keys; tiles before its
    // window are skipped (a partition left with no key keeps m = -inf, l = 0, which the reduce
    // weighs as zero).
    const u32 k_first = (window > 0 && base_keys > window) ? base_keys - window : 0;
    for (u32 kt0 = max(k_begin, k_first); kt0 < k_end; kt0 += KT) {
        const u32 nk = min(KT, k_end - kt0);
        load_kv_tile(k_cache, table, kv_s, kt0, nk, D, g, num_kv_heads, block_size);
        __syncthreads();
        // scores (masked keys: -inf)
        for (u32 e = threadIdx.x; e < nr * KT; e += blockDim.x) {
            const u32 lr = e / KT, jj = e % KT, key = kt0 + jj;
            float sc = PG_NEG_INF;
            const u32 row_keys = base_keys + lr / rep;
            if (jj < nk && key < row_keys && (window == 0 || key + window >= row_keys)) {
                const float* q = q_s + lr * D;
                const float* k = kv_s + jj * (D + 1);
                float dot = 0.0f;
                for (u32 i = 0; i < D; ++i) dot += q[i] * k[i];
                sc = dot * scale;
                if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
                if (alibi_scale != 0.0f)
                    sc += alibi_slope(PG_ALIBI_ARGS, g * rep + lr % rep) * ((float)key - (float)(row_keys - 1));
            }
            p_s[e] = sc;
        }
        __syncthreads();
        // V tile into kv_s, and the online softmax update of each row, side by side
        load_kv_tile(v_cache, table, kv_s, kt0, nk, D, g, num_kv_heads, block_size);
        for (u32 lr = warp; lr < nr; lr += nwarps) {
            float mx = PG_NEG_INF;
            for (u32 jj = lane; jj < KT; jj += PG_WARP_SIZE) mx = fmaxf(mx, p_s[lr * KT + jj]);
            mx = warp_max(mx);
            const float m_old = m_s[lr];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (u32 jj = lane; jj < KT; jj += PG_WARP_SIZE) {
                const float p = m_new == PG_NEG_INF ? 0.0f : expf(p_s[lr * KT + jj] - m_new);
                p_s[lr * KT + jj] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float corr = m_new == PG_NEG_INF ? 1.0f : expf(m_old - m_new);
                l_s[lr] = l_s[lr] * corr + sum;
                m_s[lr] = m_new;
                c_s[lr] = corr;
            }
        }
        __syncthreads();
        for (u32 e = threadIdx.x; e < nr * D; e += blockDim.x) {
            const u32 lr = e / D, i = e % D;
            const float* p = p_s + lr * KT;
            float a = acc_s[e] * c_s[lr];
            for (u32 jj = 0; jj < nk; ++jj) a += p[jj] * kv_s[jj * (D + 1) + i];
            acc_s[e] = a;
        }
        __syncthreads();
    }

    for (u32 e = threadIdx.x; e < nr * D; e += blockDim.x) {
        const u32 lr = e / D, i = e % D, r = lr / rep, j = lr % rep;
        const u64 t = q0 + tile0 + r;
        const u32 h = g * rep + j;
        if (num_splits == 1) {
            out[(t * num_heads + h) * D + i] = acc_s[e] / l_s[lr];
        } else if (k_begin < base_keys + r) {  // rows with no key in this partition write nothing
            const u64 pi = (t * num_heads + h) * num_splits + split;
            part_acc[pi * D + i] = acc_s[e];
            if (i == 0) {
                part_ml[pi * 2] = m_s[lr];
                part_ml[pi * 2 + 1] = l_s[lr];
            }
        }
    }
}

#define PAGED_ATTENTION(DT, KV)                                                                                  \
    extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attention_##DT(                              \
        const float* qkv, const KV* k_cache, const KV* v_cache, const u32* query_start, const u32* seq_lens,    \
        const u32* block_tables, float* out, float* part_acc, float* part_ml, u32 max_blocks, u32 num_heads,   \
        u32 num_kv_heads, u32 head_dim, u32 block_size, u32 row_len, float scale, u32 window, float softcap,   \
        u32 q_tile, u32 k_tile, u32 part_size, u32 num_splits, PG_ALIBI_PARAMS) {                               \
        paged_attention<KV>(qkv, k_cache, v_cache, query_start, seq_lens, block_tables, out, part_acc, part_ml,  \
                            max_blocks, num_heads, num_kv_heads, head_dim, block_size, row_len, scale, window,    \
                            softcap, q_tile, k_tile, part_size, num_splits, PG_ALIBI_ARGS);                       \
    }
PAGED_ATTENTION(f32, float)
PAGED_ATTENTION(bf16, bf16_t)
PAGED_ATTENTION(f16, f16_t)
PAGED_ATTENTION(fp8, fp8_t)

// ---- prefill on tensor cores ----------------------------------------------------------------
//
// `paged_attention_prefill_<kv>_d<D>`, kv bf16, f16 or fp8: the block and grid of the kernel above
// (query tile × sequence × kv head and partition, the same causal and window masks, the same
// partial results for attention_reduce_f32), with FlashAttention-2's inner loop on mma.sync.
// The block's R = q_tile * rep local rows (lr = r * rep + j, as above) are cut in slices of 16,
// one per warp; per tile of KT keys:
//
//   K tile  → k_s [KT][D + 8]    16-byte loads, kept as the cache's 16-bit type (fp8: f16)
//   V tile  → vt_s[D][KT + 8]    transposed: P·V's B operand is two keys of one dimension
//   S = Q·Kᵀ      D/16 MMAs per 8 keys, in registers; masked, scaled, soft-capped
//   softmax       online, in registers: a row's values sit in the 4 lanes of a quad
//   O += P·V      P re-packed from S's accumulators as the A operand (no trip through shared
//                 memory); O is D/8 accumulator tiles per warp, rescaled by exp(m_old - m_new)
//
// Q is rounded to the MMA's type once (q_s [16 * warps][D + 8]), P before each P·V; scores,
// the softmax and O stay f32. Rows are padded by 8 values so that the 8 rows a fragment reads at
// once fall in different banks.
//
// NOTE: an f32 cache keeps the kernel above: tensor cores would round its Q, K, P and V to 16
// bits, and the f32 path is the one that reproduces the reference exactly.
#if defined(PG_TENSOR_CORES)
// Keys per tile: S and O must fit in registers with Q and K in shared memory (MMA_KT in
// src/backend/gpu/plan.rs).
#define MMA_KT(D) ((D) <= 64 ? 64 : (D) <= 128 ? 32 : 16)

// The MMA's input type for a cache type: a 16-bit cache its own; fp8 widened to f16 as the
// tiles are loaded (exactly: every E4M3 value is an f16 one), so Q and P are rounded to f16.
template <typename C>
struct MmaInput {
    typedef C T;
};
template <>
struct MmaInput<fp8_t> {
    typedef f16_t T;
};

template <typename C, u32 D>
__device__ __forceinline__ void paged_attention_mma(const float* __restrict__ qkv, const C* __restrict__ k_cache,
                                                    const C* __restrict__ v_cache, const u32* __restrict__ query_start,
                                                    const u32* __restrict__ seq_lens,
                                                    const u32* __restrict__ block_tables, float* __restrict__ out,
                                                    float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                    u32 max_blocks, u32 num_heads, u32 num_kv_heads, u32 block_size,
                                                    u32 row_len, float scale, u32 window, float softcap, u32 q_tile,
                                                    u32 part_size, u32 num_splits, PG_ALIBI_PARAMS) {
    constexpr u32 KT = MMA_KT(D), DP = D + 8, KP = KT + 8;
    constexpr u32 NT = KT / 8, ND = D / 8;  // accumulator tiles of S and of O
    constexpr u32 EPC = 16 / sizeof(C);     // cache elements per 16-byte chunk
    constexpr u32 CPR = D / EPC;            // chunks per K or V row
    typedef typename MmaInput<C>::T T;
    PG_DYNAMIC_SHARED(uint4, mma_smem);
    PrefillBlock pb;
    if (!prefill_block(pb, query_start, seq_lens, num_heads, num_kv_heads, q_tile, part_size, num_splits)) return;
    const u32 s = pb.s, q0 = pb.q0, tile0 = pb.tile0, split = pb.split, g = pb.g, rep = pb.rep;
    const u32 base_keys = pb.base_keys, k_begin = pb.k_begin, k_end = pb.k_end, nr = pb.nr;
    const u32 warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 qd = lane / 4, qt = lane % 4;  // the fragment's row (and row + 8) and column pair
    u16* q_s = reinterpret_cast<u16*>(mma_smem);
    u16* k_s = q_s + 16 * warps * DP;
    u16* vt_s = k_s + KT * DP;
    const u32* table = block_tables + (u64)s * max_blocks;
    const T* tag = nullptr;

    // Q, rounded; rows past the tile's are zero
    for (u32 e = threadIdx.x; e < 16 * warps * (D / 4); e += blockDim.x) {
        const u32 lr = e / (D / 4), i = e % (D / 4) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (lr < nr) {
            const u32 r = lr / rep, j = lr % rep;
            v = __ldg(reinterpret_cast<const float4*>(qkv + (u64)(q0 + tile0 + r) * row_len + (u64)(g * rep + j) * D + i));
        }
        *reinterpret_cast<uint2*>(q_s + lr * DP + i) = make_uint2(pack2(v.x, v.y, tag), pack2(v.z, v.w, tag));
    }

    // this lane's two rows: the warp's slice, rows qd and qd + 8; a row past the tile sees no key
    u32 row_keys[2];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 lr = warp * 16 + qd + 8 * h;
        row_keys[h] = lr < nr ? base_keys + lr / rep : 0;
    }
    const bool active = warp * 16 < nr;  // the same for every lane of a warp
    float o[ND][4];
#pragma unroll
    for (u32 n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {PG_NEG_INF, PG_NEG_INF}, l[2] = {0.0f, 0.0f};

    const u32 k_first = (window > 0 && base_keys > window) ? base_keys - window : 0;
    for (u32 kt0 = max(k_begin, k_first); kt0 < k_end; kt0 += KT) {
        const u32 nk = min(KT, k_end - kt0);
        // NOTE: no warp reads k_s or vt_s here (the barrier at the loop's end), and the barrier
        // after this load also publishes q_s. Keys past nk are zero, never garbage: P·V
        // multiplies them by p = 0, and 0·NaN is NaN.
        for (u32 e = threadIdx.x; e < KT * CPR; e += blockDim.x) {
            const u32 jj = e / CPR, c = e % CPR;
            uint4 kw = make_uint4(0, 0, 0, 0), vw = make_uint4(0, 0, 0, 0);
            if (jj < nk) {
                const u32 key = kt0 + jj;
                const u64 at = ((u64)table[key / block_size] * num_kv_heads + g) * block_size + key % block_size;
                kw = __ldg(reinterpret_cast<const uint4*>(k_cache + at * D + c * EPC));
                vw = __ldg(reinterpret_cast<const uint4*>(v_cache + at * D + c * EPC));
            }
            if constexpr (sizeof(C) == 2) {
                *reinterpret_cast<uint4*>(k_s + jj * DP + c * 8) = kw;
                const u32 w[4] = {vw.x, vw.y, vw.z, vw.w};
#pragma unroll
                for (u32 x = 0; x < 4; ++x) {
                    vt_s[(c * 8 + 2 * x) * KP + jj] = (u16)(w[x] & 0xffffu);
                    vt_s[(c * 8 + 2 * x + 1) * KP + jj] = (u16)(w[x] >> 16);
                }
            } else {  // 16 fp8 values, widened
                float kf[16], vf[16];
                unpack16(kw, kf, (const C*)0);
                unpack16(vw, vf, (const C*)0);
                uint4* kd = reinterpret_cast<uint4*>(k_s + jj * DP + c * 16);
                kd[0] = make_uint4(pack2(kf[0], kf[1], tag), pack2(kf[2], kf[3], tag), pack2(kf[4], kf[5], tag),
                                   pack2(kf[6], kf[7], tag));
                kd[1] = make_uint4(pack2(kf[8], kf[9], tag), pack2(kf[10], kf[11], tag), pack2(kf[12], kf[13], tag),
                                   pack2(kf[14], kf[15], tag));
#pragma unroll
                for (u32 x = 0; x < 16; x += 2) {
                    const u32 w = pack2(vf[x], vf[x + 1], tag);
                    vt_s[(c * 16 + x) * KP + jj] = (u16)(w & 0xffffu);
                    vt_s[(c * 16 + x + 1) * KP + jj] = (u16)(w >> 16);
                }
            }
        }
        __syncthreads();
        if (active) {
            // S = Q·Kᵀ: sc[n] is the 16 × 8 tile of keys kt0 + 8n ..
            float sc[NT][4];
#pragma unroll
            for (u32 n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
            for (u32 kk = 0; kk < D / 16; ++kk) {
                const u16* qa = q_s + (warp * 16 + qd) * DP + kk * 16 + 2 * qt;
                const u32 a[4] = {*reinterpret_cast<const u32*>(qa), *reinterpret_cast<const u32*>(qa + 8 * DP),
                                  *reinterpret_cast<const u32*>(qa + 8),
                                  *reinterpret_cast<const u32*>(qa + 8 * DP + 8)};
#pragma unroll
                for (u32 n = 0; n < NT; ++n) {
                    const u16* kb = k_s + (n * 8 + qd) * DP + kk * 16 + 2 * qt;
                    const u32 b[2] = {*reinterpret_cast<const u32*>(kb), *reinterpret_cast<const u32*>(kb + 8)};
                    mma_16816(sc[n], a, b, tag);
                }
            }
            // masks, scale, soft cap; each row's maximum over the quad
            float mx[2] = {PG_NEG_INF, PG_NEG_INF};
#pragma unroll
            for (u32 n = 0; n < NT; ++n) {
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 h = i / 2, key = kt0 + n * 8 + 2 * qt + i % 2;
                    float v = sc[n][i] * scale;
                    if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
                    // NOTE: the slope is recomputed here, not kept: at head size 256 two more
                    // live registers spill
                    if (alibi_scale != 0.0f)
                        v += alibi_slope(PG_ALIBI_ARGS, g * rep + (warp * 16 + qd + 8 * h) % rep) *
                             ((float)key - (float)row_keys[h] + 1.0f);
                    const bool seen = key < kt0 + nk && key < row_keys[h] && (window == 0 || key + window >= row_keys[h]);
                    sc[n][i] = seen ? v : PG_NEG_INF;
                    mx[h] = fmaxf(mx[h], sc[n][i]);
                }
            }
            float corr[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], PG_SHFL_XOR(mx[h], 1));
                mx[h] = fmaxf(mx[h], PG_SHFL_XOR(mx[h], 2));
                const float m_new = fmaxf(m[h], mx[h]);
                corr[h] = m_new == PG_NEG_INF ? 1.0f : expf(m[h] - m_new);
                m[h] = m_new;
                l[h] *= corr[h];  // this lane's share of the row's sum; the quad's are added at the end
            }
#pragma unroll
            for (u32 n = 0; n < NT; ++n) {
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 h = i / 2;
                    const float p = m[h] == PG_NEG_INF ? 0.0f : expf(sc[n][i] - m[h]);
                    sc[n][i] = p;
                    l[h] += p;
                }
            }
#pragma unroll
            for (u32 n = 0; n < ND; ++n) {
                o[n][0] *= corr[0];
                o[n][1] *= corr[0];
                o[n][2] *= corr[1];
                o[n][3] *= corr[1];
            }
            // O += P·V over 16 keys at a time: S tiles 2kk and 2kk + 1 are P's A fragment
#pragma unroll
            for (u32 kk = 0; kk < KT / 16; ++kk) {
                const u32 a[4] = {pack2(sc[2 * kk][0], sc[2 * kk][1], tag), pack2(sc[2 * kk][2], sc[2 * kk][3], tag),
                                  pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1], tag),
                                  pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3], tag)};
#pragma unroll
                for (u32 n = 0; n < ND; ++n) {
                    const u16* vb = vt_s + (n * 8 + qd) * KP + kk * 16 + 2 * qt;
                    const u32 b[2] = {*reinterpret_cast<const u32*>(vb), *reinterpret_cast<const u32*>(vb + 8)};
                    mma_16816(o[n], a, b, tag);
                }
            }
        }
        __syncthreads();
    }
    if (!active) return;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        l[h] += PG_SHFL_XOR(l[h], 1);
        l[h] += PG_SHFL_XOR(l[h], 2);
    }
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 lr = warp * 16 + qd + 8 * h;
        if (lr >= nr) continue;
        const u32 r = lr / rep, j = lr % rep;
        const u64 t = q0 + tile0 + r;
        const u32 head = g * rep + j;
        if (num_splits == 1) {
            const float inv = 1.0f / l[h];
#pragma unroll
            for (u32 n = 0; n < ND; ++n)
                *reinterpret_cast<float2*>(out + (t * num_heads + head) * D + n * 8 + 2 * qt) =
                    make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        } else if (k_begin < base_keys + r) {  // rows with no key in this partition write nothing
            const u64 pi = (t * num_heads + head) * num_splits + split;
#pragma unroll
            for (u32 n = 0; n < ND; ++n)
                *reinterpret_cast<float2*>(part_acc + pi * D + n * 8 + 2 * qt) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
            if (qt == 0) {
                part_ml[pi * 2] = m[h];
                part_ml[pi * 2 + 1] = l[h];
            }
        }
    }
}

#define PAGED_ATTENTION_MMA(DT, KV, D)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) paged_attention_prefill_##DT##_d##D(                         \
        const float* qkv, const KV* k_cache, const KV* v_cache, const u32* query_start, const u32* seq_lens,       \
        const u32* block_tables, float* out, float* part_acc, float* part_ml, u32 max_blocks, u32 num_heads,      \
        u32 num_kv_heads, u32 block_size, u32 row_len, float scale, u32 window, float softcap, u32 q_tile,        \
        u32 part_size, u32 num_splits, PG_ALIBI_PARAMS) {                                                          \
        paged_attention_mma<KV, D>(qkv, k_cache, v_cache, query_start, seq_lens, block_tables, out, part_acc,     \
                                   part_ml, max_blocks, num_heads, num_kv_heads, block_size, row_len, scale,      \
                                   window, softcap, q_tile, part_size, num_splits, PG_ALIBI_ARGS);                \
    }
PG_HEAD_DIMS(PAGED_ATTENTION_MMA, bf16, bf16_t)
PG_HEAD_DIMS(PAGED_ATTENTION_MMA, f16, f16_t)
PG_HEAD_DIMS(PAGED_ATTENTION_MMA, fp8, fp8_t)
#endif  // PG_TENSOR_CORES

// ---- decode: one query row per sequence ------------------------------------------------------
//
// Flash-decoding over the paged cache. One block = (sequence, kv head, partition of the
// context); the `rep` query heads of the kv head share every K and V load. K and V rows are
// read 16 bytes per lane; the block table is read once per key, with a shift and a mask (block
// sizes are powers of two here), never a division per element. Head size and KV type are
// template parameters (D / EPL chunks of 16 bytes per row).
//
//   grid = (num_seqs, num_kv_heads, num_splits)      block = DEC_THREADS
//
//   1. scores: a warp takes KPW keys at a time, TPK lanes per key, each lane CH chunks of the
//      key's row; the lanes' partial dots are summed with shuffles:
//        s_s[j][key] = q_j·k · scale (soft-capped; keys before the window are skipped)
//   2. softmax, one warp per query head j: m_j, l_j, and s_s[j][:] = exp(s - m_j)
//   3. values: G groups of C lanes (one chunk each); group γ takes keys γ, γ+G, ... and keeps
//      acc[j][EPL] in registers; where a warp holds several whole groups (C divides the warp)
//      their sums are added with shuffles first, then the warps' (or groups') sums in order
//      through shared memory.
// With one partition the block writes the normalised output; with several it writes (m, l,
// acc) of its partition for attention_reduce_f32, as the prefill kernel does.
//
// Shared memory (floats): s_s [rep][part_size] | red [RG][rep][D] | m_s, l_s [rep], RG = warps
// or groups
// (decode_shared_bytes in src/backend/gpu/mod.rs computes the same).

#define DEC_THREADS 128
#define DEC_WARPS (DEC_THREADS / PG_WARP_SIZE)
#define DEC_MAX_REP 8

__host__ __device__ constexpr int pg_pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pg_pow2_at_least((n + 1) / 2); }

template <typename KV, int D>
__device__ __forceinline__ void paged_attention_decode(const float* __restrict__ qkv, const KV* __restrict__ k_cache,
                                                       const KV* __restrict__ v_cache, const u32* __restrict__ query_start,
                                                       const u32* __restrict__ seq_lens,
                                                       const u32* __restrict__ block_tables, float* __restrict__ out,
                                                       float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                       u32 max_blocks, u32 num_heads, u32 num_kv_heads, u32 block_shift,
                                                       u32 row_len, float scale, u32 window, float softcap,
                                                       u32 part_size, u32 num_splits, PG_ALIBI_PARAMS) {
    constexpr int EPL = 16 / sizeof(KV);  // elements per 16-byte load
    constexpr int C = D / EPL;            // chunks per row
    constexpr int TPK = pg_pow2_at_least(C) < PG_WARP_SIZE ? pg_pow2_at_least(C) : PG_WARP_SIZE;
    constexpr int CH = (C + TPK - 1) / TPK;  // chunks per lane in the scores
    constexpr int KPW = PG_WARP_SIZE / TPK;  // keys per warp step
    constexpr u32 G = DEC_THREADS / C;       // value groups
    // several whole groups per warp: summed in the warp, one partial sum per warp
    constexpr bool WARP_SUM = C < PG_WARP_SIZE && PG_WARP_SIZE % C == 0;
    constexpr u32 RG = WARP_SUM ? DEC_WARPS : G;  // partial sums in shared memory
    static_assert(D % EPL == 0 && C <= DEC_THREADS, "head size");
    PG_DYNAMIC_SHARED(float, smem);

    const u32 s = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
    const u32 ctx = seq_lens[s];
    const u32 k_begin = split * part_size;
    if (k_begin >= ctx) return;  // the reduce reads only the partitions that hold keys
    const u32 rep = num_heads / num_kv_heads;
    const u32 t = query_start[s];
    const u32 k_lo = (window > 0 && ctx > window) ? ctx - window : 0;
    // NOTE: k0 >= k1 (a partition wholly before the window) leaves m = -inf, l = 0, which the
    // reduce weighs as zero.
    const u32 k0 = max(k_begin, k_lo), k1 = min(ctx, k_begin + part_size);
    float* s_s = smem;
    float* red = s_s + rep * part_size;
    float* m_s = red + RG * rep * D;
    float* l_s = m_s + rep;
    const u32* table = block_tables + (u64)s * max_blocks;
    const u32 warp = threadIdx.x / PG_WARP_SIZE, lane = threadIdx.x % PG_WARP_SIZE;
    const u32 bmask = (1u << block_shift) - 1;
    // the row of `key` for kv head g: ((block * Hkv + g) * block_size + offset) * D
    auto row_of = [&](u32 key) -> u64 {
        const u64 phys = table[key >> block_shift];
        return ((((phys * num_kv_heads + g) << block_shift) | (key & bmask))) * D;
    };

    // 1. scores
    {
        const u32 sub = lane % TPK, kk = lane / TPK;
        float q[DEC_MAX_REP][CH][EPL];
        const float* qrow = qkv + (u64)t * row_len + (u64)g * rep * D;
#pragma unroll
        for (int j = 0; j < DEC_MAX_REP; ++j)
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                const u32 chunk = sub + c * TPK;
#pragma unroll
                for (int e4 = 0; e4 < EPL / 4; ++e4) {
                    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (j < rep && chunk < C) v = __ldg(reinterpret_cast<const float4*>(qrow + j * D + chunk * EPL) + e4);
                    q[j][c][4 * e4] = v.x * scale;
                    q[j][c][4 * e4 + 1] = v.y * scale;
                    q[j][c][4 * e4 + 2] = v.z * scale;
                    q[j][c][4 * e4 + 3] = v.w * scale;
                }
            }
#pragma unroll 2
        for (u32 kb = k0 + warp * KPW; kb < k1; kb += DEC_WARPS * KPW) {
            const u32 key = kb + kk;
            const bool valid = key < k1;
            float dot[DEC_MAX_REP];
#pragma unroll
            for (int j = 0; j < DEC_MAX_REP; ++j) dot[j] = 0.0f;
            if (valid) {
                const KV* krow = k_cache + row_of(key);
#pragma unroll
                for (int c = 0; c < CH; ++c) {
                    const u32 chunk = sub + c * TPK;
                    if (chunk < C) {
                        float kv[EPL];
                        unpack16(__ldg(reinterpret_cast<const uint4*>(krow + chunk * EPL)), kv, (const KV*)0);
#pragma unroll
                        for (int j = 0; j < DEC_MAX_REP; ++j)
#pragma unroll
                            for (int e = 0; e < EPL; ++e) dot[j] += q[j][c][e] * kv[e];
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < DEC_MAX_REP; ++j) {
                if (j < rep) {  // rep is the same in the whole block
#pragma unroll
                    for (int m = TPK / 2; m > 0; m >>= 1) dot[j] += PG_SHFL_XOR(dot[j], m);
                }
            }
            if (valid && sub == 0) {
#pragma unroll
                for (int j = 0; j < DEC_MAX_REP; ++j) {
                    if (j < rep) {  // NOTE: unrolled, so that dot[] stays in registers
                        float sc = dot[j];
                        if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
                        if (alibi_scale != 0.0f)
                            sc += alibi_slope(PG_ALIBI_ARGS, g * rep + j) * ((float)key - (float)(ctx - 1));
                        s_s[j * part_size + key - k_begin] = sc;
                    }
                }
            }
        }
    }
    __syncthreads();

    // 2. softmax of each head over the partition
    for (u32 j = warp; j < rep; j += DEC_WARPS) {
        float* sj = s_s + j * part_size - k_begin;
        float mx = PG_NEG_INF;
        for (u32 key = k0 + lane; key < k1; key += PG_WARP_SIZE) mx = fmaxf(mx, sj[key]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (u32 key = k0 + lane; key < k1; key += PG_WARP_SIZE) {
            const float p = expf(sj[key] - mx);
            sj[key] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            m_s[j] = mx;
            l_s[j] = sum;
        }
    }
    __syncthreads();

    // 3. values
    const u32 grp = threadIdx.x / C, chunk = threadIdx.x % C;
    if (grp < G) {
        float acc[DEC_MAX_REP][EPL];
#pragma unroll
        for (int j = 0; j < DEC_MAX_REP; ++j)
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[j][e] = 0.0f;
#pragma unroll 4
        for (u32 key = k0 + grp; key < k1; key += G) {
            float v[EPL];
            unpack16(__ldg(reinterpret_cast<const uint4*>(v_cache + row_of(key) + chunk * EPL)), v, (const KV*)0);
#pragma unroll
            for (int j = 0; j < DEC_MAX_REP; ++j) {
                if (j < rep) {
                    const float p = s_s[j * part_size + key - k_begin];
#pragma unroll
                    for (int e = 0; e < EPL; ++e) acc[j][e] += p * v[e];
                }
            }
        }
        if constexpr (WARP_SUM) {
            // NOTE: every thread is in a group here (C divides DEC_THREADS), so every lane
            // takes part in the shuffles; lanes of one chunk are C apart.
#pragma unroll
            for (int j = 0; j < DEC_MAX_REP; ++j)
                if (j < rep)
#pragma unroll
                    for (int e = 0; e < EPL; ++e)
#pragma unroll
                        for (u32 m = C; m < PG_WARP_SIZE; m <<= 1) acc[j][e] += PG_SHFL_XOR(acc[j][e], m);
        }
        const u32 slot = WARP_SUM ? threadIdx.x / PG_WARP_SIZE : grp;
        if (!WARP_SUM || threadIdx.x % PG_WARP_SIZE < C) {
#pragma unroll
            for (int j = 0; j < DEC_MAX_REP; ++j)
                if (j < rep)
#pragma unroll
                    for (int e = 0; e < EPL; ++e) red[(slot * rep + j) * D + chunk * EPL + e] = acc[j][e];
        }
    }
    __syncthreads();
    for (u32 x = threadIdx.x; x < rep * D; x += DEC_THREADS) {
        const u32 j = x / D, i = x % D;
        float a = 0.0f;
        for (u32 gg = 0; gg < RG; ++gg) a += red[(gg * rep + j) * D + i];
        const u64 h = g * rep + j;
        if (num_splits == 1) {
            out[((u64)t * num_heads + h) * D + i] = a / l_s[j];
        } else {
            const u64 pi = ((u64)t * num_heads + h) * num_splits + split;
            part_acc[pi * D + i] = a;
            if (i == 0) {
                part_ml[pi * 2] = m_s[j];
                part_ml[pi * 2 + 1] = l_s[j];
            }
        }
    }
}

#define PAGED_ATTENTION_DECODE(DT, KV, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) paged_attention_decode_##DT##_d##D( \
        const float* qkv, const KV* k_cache, const KV* v_cache, const u32* query_start, const u32* seq_lens,    \
        const u32* block_tables, float* out, float* part_acc, float* part_ml, u32 max_blocks, u32 num_heads,   \
        u32 num_kv_heads, u32 block_shift, u32 row_len, float scale, u32 window, float softcap, u32 part_size, \
        u32 num_splits, PG_ALIBI_PARAMS) {                                                                       \
        paged_attention_decode<KV, D>(qkv, k_cache, v_cache, query_start, seq_lens, block_tables, out, part_acc, \
                                      part_ml, max_blocks, num_heads, num_kv_heads, block_shift, row_len, scale,  \
                                      window, softcap, part_size, num_splits, PG_ALIBI_ARGS);                     \
    }
PG_HEAD_DIMS(PAGED_ATTENTION_DECODE, f32, float)
PG_HEAD_DIMS(PAGED_ATTENTION_DECODE, bf16, bf16_t)
PG_HEAD_DIMS(PAGED_ATTENTION_DECODE, f16, f16_t)
PG_HEAD_DIMS(PAGED_ATTENTION_DECODE, fp8, fp8_t)

// Merges the partitions of each (row, head): out = Σ acc_p e^(m_p − M) / Σ l_p e^(m_p − M).
// grid = (T, H); a row uses the first ceil(n_keys / part_size) partitions.
extern "C" __global__ void attention_reduce_f32(const float* part_acc, const float* part_ml, const u32* query_start,
                                                const u32* seq_lens, float* out, u32 num_seqs, u32 num_heads,
                                                u32 head_dim, u32 part_size, u32 num_splits) {
    const u32 t = blockIdx.x, h = blockIdx.y;
    // the sequence of row t: the last s with query_start[s] <= t
    u32 lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const u32 mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const u32 n_keys = seq_lens[lo] - (query_start[lo + 1] - 1 - t);
    const u32 ns = min(num_splits, (n_keys + part_size - 1) / part_size);
    const u64 base = ((u64)t * num_heads + h) * num_splits;
    float mx = PG_NEG_INF;
    for (u32 p = 0; p < ns; ++p) mx = fmaxf(mx, part_ml[(base + p) * 2]);
    float l = 0.0f;
    for (u32 p = 0; p < ns; ++p) l += part_ml[(base + p) * 2 + 1] * expf(part_ml[(base + p) * 2] - mx);
    const float inv = 1.0f / l;
    for (u32 i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float a = 0.0f;
        for (u32 p = 0; p < ns; ++p) a += part_acc[(base + p) * head_dim + i] * expf(part_ml[(base + p) * 2] - mx);
        out[((u64)t * num_heads + h) * head_dim + i] = a * inv;
    }
}
