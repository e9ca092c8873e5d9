// The paged KV cache write ("reshape and cache"): each row's k and v heads go to its slot;
// and the same fused with RoPE (below).
//
//   slot = block * block_size + offset
//   cache[block, g, offset, :] = head g of the row's k (or v)      cache: [blocks, Hkv, bs, D]
//
// One thread per (row, kv head, element): consecutive threads write consecutive addresses.
#include "common.cuh"

// The cache's element type: f32, or bf16/f16/fp8 rounded to nearest even (fp8 saturated).
__device__ __forceinline__ void store_kv(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_kv(fp8_t* p, float v) { p->x = (unsigned char)f32_to_fp8_bits(v); }
__device__ __forceinline__ void store_kv(bf16_t* p, float v) { p->x = f32_to_bf16_bits(v); }
__device__ __forceinline__ void store_kv(f16_t* p, float v) { p->x = f32_to_f16_bits(v); }

template <typename KV>
__device__ __forceinline__ void write_kv(const float* __restrict__ qkv, const u32* __restrict__ slot_mapping,
                                         KV* __restrict__ k_cache, KV* __restrict__ v_cache, u32 rows,
                                         u32 num_kv_heads, u32 head_dim, u32 block_size, u32 row_len, u32 q_len) {
    const u32 kv_len = num_kv_heads * head_dim;
    const u64 n = (u64)rows * kv_len;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const u32 e = idx % kv_len;  // g * D + i
        const u64 t = idx / kv_len;
        const u64 slot = slot_mapping[t];
        const u64 block = slot / block_size, off = slot % block_size;
        const u32 g = e / head_dim, i = e % head_dim;
        const u64 dst = ((block * num_kv_heads + g) * block_size + off) * head_dim + i;
        const float* row = qkv + t * row_len + q_len;
        store_kv(k_cache + dst, row[e]);
        store_kv(v_cache + dst, row[kv_len + e]);
    }
}

#define WRITE_KV(DT, KV)                                                                                      \
    extern "C" __global__ void write_kv_##DT(const float* qkv, const u32* slot_mapping, KV* k_cache,          \
                                             KV* v_cache, u32 rows, u32 num_kv_heads, u32 head_dim,          \
                                             u32 block_size, u32 row_len, u32 q_len) {                       \
        write_kv<KV>(qkv, slot_mapping, k_cache, v_cache, rows, num_kv_heads, head_dim, block_size, row_len, \
                     q_len);                                                                                  \
    }
WRITE_KV(f32, float)
WRITE_KV(bf16, bf16_t)
WRITE_KV(f16, f16_t)
WRITE_KV(fp8, fp8_t)

// RoPE and the cache write in one pass (`rope_write_kv_<kv>`): rotate-half RoPE in place on the
// q and k heads of each row (as rope.cu), and the rotated k and the v heads written at the
// row's slot (as write_kv above). One thread per (row, head, pair i < D/2), heads in the
// row's order q | k | v: a q pair is rotated; a k pair is rotated, kept in the row and stored;
// a v "pair" (elements i and i + D/2) is stored.
template <typename KV>
__device__ __forceinline__ void rope_write_kv(float* __restrict__ qkv, const u32* __restrict__ positions,
                                              const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                              const u32* __restrict__ slot_mapping, KV* __restrict__ k_cache,
                                              KV* __restrict__ v_cache, u32 rows, u32 num_heads, u32 num_kv_heads,
                                              u32 head_dim, u32 block_size) {
    const u32 half = head_dim / 2;
    const u32 heads = num_heads + 2 * num_kv_heads;
    const u64 row_len = (u64)heads * head_dim;
    const u64 n = (u64)rows * heads * half;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const u32 i = idx % half;
        const u64 th = idx / half;
        const u32 h = th % heads;
        const u64 t = th / heads;
        float* x = qkv + t * row_len + (u64)h * head_dim;
        float a = x[i], b = x[i + half];
        if (h < num_heads + num_kv_heads) {
            const u64 p = positions[t];
            const float c = cos_t[p * half + i], s = sin_t[p * half + i];
            const float ra = a * c - b * s, rb = b * c + a * s;
            x[i] = ra;
            x[i + half] = rb;
            a = ra;
            b = rb;
            if (h < num_heads) continue;
        }
        const bool is_k = h < num_heads + num_kv_heads;
        const u32 g = h - num_heads - (is_k ? 0 : num_kv_heads);
        const u64 slot = slot_mapping[t];
        const u64 block = slot / block_size, off = slot % block_size;
        KV* dst = (is_k ? k_cache : v_cache) + ((block * num_kv_heads + g) * block_size + off) * head_dim;
        store_kv(dst + i, a);
        store_kv(dst + i + half, b);
    }
}

#define ROPE_WRITE_KV(DT, KV)                                                                                     \
    extern "C" __global__ void rope_write_kv_##DT(float* qkv, const u32* positions, const float* cos_t,          \
                                                  const float* sin_t, const u32* slot_mapping, KV* k_cache,      \
                                                  KV* v_cache, u32 rows, u32 num_heads, u32 num_kv_heads,        \
                                                  u32 head_dim, u32 block_size) {                                \
        rope_write_kv<KV>(qkv, positions, cos_t, sin_t, slot_mapping, k_cache, v_cache, rows, num_heads,         \
                          num_kv_heads, head_dim, block_size);                                                   \
    }
ROPE_WRITE_KV(f32, float)
ROPE_WRITE_KV(bf16, bf16_t)
ROPE_WRITE_KV(f16, f16_t)
ROPE_WRITE_KV(fp8, fp8_t)
