// Rotate-half (NeoX/HF) rotary embedding, in place on the q and k heads of fused QKV rows:
//
//   row = [ q: H × D | k: Hkv × D | v: Hkv × D ]       (v is left alone)
//   (a, b) = (x[i], x[i + D/2])  →  (a cos − b sin, b cos + a sin),   i < D/2
//
// cos and sin are [max_positions, D/2] tables computed on the host in f64. One thread per pair.
#include "common.cuh"

extern "C" __global__ void rope_f32(float* qkv, const u32* positions, const float* cos_t, const float* sin_t,
                                    u32 rows, u32 heads, u32 head_dim, u32 row_len) {
    const u32 half = head_dim / 2;
    const u64 n = (u64)rows * heads * half;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const u32 i = idx % half;
        const u64 th = idx / half;
        const u32 h = th % heads;
        const u64 t = th / heads;
        const u64 p = positions[t];
        float* x = qkv + t * row_len + (u64)h * head_dim;
        const float c = cos_t[p * half + i], s = sin_t[p * half + i];
        const float a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}
