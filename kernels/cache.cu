// The paged KV cache write ("reshape and cache"): each row's k and v heads go to its slot.
//
//   slot = block * block_size + offset
//   cache[block, g, offset, :] = head g of the row's k (or v)      cache: [blocks, Hkv, bs, D]
//
// One thread per (row, kv head, element): consecutive threads write consecutive addresses.
#include "common.cuh"

// The cache's element type: f32, or bf16/f16 rounded to nearest even.
__device__ __forceinline__ void store_kv(float* p, float v) { *p = v; }
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
