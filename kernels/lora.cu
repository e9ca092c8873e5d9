// LoRA's batched update of one projection (Punica's BGMV/SGMV shape): every adapter of a step
// and every row of each in two launches, whatever the number of adapters.
//   shrink: mid[e, j] = x[row(e), :] · A_g[j, :]                 A_g: [rank_g, k]
//   expand: out[row(e), c] += w(e) · Σ_j mid[e, j] · B_g[c, j]    B_g: [n, rank_g]
// where entry e is the i-th row of group g (an adapter), e = start[g] + i. A row's sums run in
// one fixed order set by k and the rank alone, so its result does not depend on the other rows
// or adapters of the step (batch invariance).
#include "common.cuh"

// Groups per launch (the host splits more into several launches).
#define LORA_GROUPS 16
// Threads per block of the shrink (one block per entry, a warp per output in turn).
#define LORA_SHRINK_THREADS 128
// Output columns per block of the expand.
#define LORA_EXPAND_THREADS 256

// The groups of one launch, passed by value: 81 words (648 bytes, well inside the 4 KiB of
// kernel parameters), laid out by the host as `LoraGroups::words` in gpu/mod.rs.
struct LoraGroups {
    u64 a[LORA_GROUPS];     // A_g, of the launch's weight type
    u64 b[LORA_GROUPS];     // B_g
    u64 rows[LORA_GROUPS];  // [m_g] u32: the rows of x and out
    u64 w[LORA_GROUPS];     // [m_g] f32: each row's weight on the update
    u32 start[LORA_GROUPS + 1];  // entries of group g: start[g] .. start[g + 1]
    u32 rank[LORA_GROUPS];
};

// The group of entry e (groups are few: a scan).
__device__ __forceinline__ u32 lora_group(const LoraGroups& g, u32 e) {
    u32 i = 0;
    while (e >= g.start[i + 1]) ++i;
    return i;
}

// grid: (entries)   block: LORA_SHRINK_THREADS   mid: [entries, max_rank]
#define LORA_SHRINK(DT, W)                                                                         \
    extern "C" __global__ void __launch_bounds__(LORA_SHRINK_THREADS)                                \
        lora_shrink_##DT(const float* __restrict__ x, float* __restrict__ mid, u32 k, u32 max_rank, LoraGroups g) { \
        const u32 e = blockIdx.x, gi = lora_group(g, e);                                             \
        const u32 row = ((const u32*)g.rows[gi])[e - g.start[gi]];                                   \
        const W* a = (const W*)g.a[gi];                                                              \
        const float* xr = x + (u64)row * k;                                                          \
        const u32 lane = threadIdx.x % PG_WARP_SIZE, warp = threadIdx.x / PG_WARP_SIZE;              \
        const u32 warps = blockDim.x / PG_WARP_SIZE;                                                 \
        for (u32 j = warp; j < g.rank[gi]; j += warps) {                                             \
            const W* aj = a + (u64)j * k;                                                            \
            float s = 0.0f;                                                                          \
            for (u32 l = lane; l < k; l += PG_WARP_SIZE) s += xr[l] * to_f32(aj[l]);                 \
            s = warp_sum(s);                                                                         \
            if (lane == 0) mid[(u64)e * max_rank + j] = s;                                           \
        }                                                                                            \
    }
LORA_SHRINK(f32, float)
LORA_SHRINK(f16, f16_t)
LORA_SHRINK(bf16, bf16_t)

// grid: (entries, ceil(n / LORA_EXPAND_THREADS))   block: LORA_EXPAND_THREADS
#define LORA_EXPAND(DT, W)                                                                         \
    extern "C" __global__ void __launch_bounds__(LORA_EXPAND_THREADS)                                \
        lora_expand_##DT(const float* __restrict__ mid, float* __restrict__ out, u32 n, u32 max_rank, LoraGroups g) { \
        const u32 e = blockIdx.x, gi = lora_group(g, e), i = e - g.start[gi];                        \
        const u32 c = blockIdx.y * blockDim.x + threadIdx.x;                                         \
        if (c >= n) return;                                                                          \
        const u32 row = ((const u32*)g.rows[gi])[i], rank = g.rank[gi];                              \
        const W* bc = (const W*)g.b[gi] + (u64)c * rank;                                             \
        const float* m = mid + (u64)e * max_rank;                                                    \
        float s = 0.0f;                                                                              \
        for (u32 j = 0; j < rank; ++j) s += m[j] * to_f32(bc[j]);                                    \
        out[(u64)row * n + c] += ((const float*)g.w[gi])[i] * s;                                     \
    }
LORA_EXPAND(f32, float)
LORA_EXPAND(f16, f16_t)
LORA_EXPAND(bf16, bf16_t)
