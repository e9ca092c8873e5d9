// Elementwise and row-copy kernels: residual add, SiLU·up, embedding lookup, row gather, the
// weighted row scatter-add of MoE experts, bias add, and the f32 → f16/bf16 casts that feed
// cuBLAS when weights are half precision.
// One thread per output element, grid-stride loops.
#include "common.cuh"

// x[i] += y[i]
extern "C" __global__ void add_assign_f32(float* x, const float* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] += y[i];
}

// out[r, i] = act(gu[r, i]) * gu[r, ffn + i]          gu: [rows, 2 ffn]   out: [rows, ffn]
extern "C" __global__ void gated_act_f32(const float* gu, float* out, u32 rows, u32 ffn, u32 act) {
    const u64 n = (u64)rows * ffn;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / ffn, c = i % ffn;
        out[i] = activate(gu[r * 2 * ffn + c], act) * gu[r * 2 * ffn + ffn + c];
    }
}

// x[i] = act(x[i]) for i < n
extern "C" __global__ void act_f32(float* x, u32 n, u32 act) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = activate(x[i], act);
}

// x[i] *= s for i < n
extern "C" __global__ void scale_f32(float* x, u32 n, float s) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] *= s;
}

// x[i] = cap * tanh(x[i] / cap) for i < n
extern "C" __global__ void softcap_f32(float* x, u32 n, float cap) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// x[i] = min(max(x[i], -limit), limit) for i < n
extern "C" __global__ void clamp_f32(float* x, u32 n, float limit) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = fminf(fmaxf(x[i], -limit), limit);
}

// out[i, :] = x[rows[i], :]     (rows checked on the host)
extern "C" __global__ void gather_rows_f32(const float* x, const u32* rows, float* out, u32 nrows, u32 dim) {
    const u64 n = (u64)nrows * dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / dim, c = i % dim;
        out[i] = x[(u64)rows[r] * dim + c];
    }
}

// out[rows[i], :] += w[i] * y[i, :]     (rows checked on the host: in range, distinct, so no
// two threads add to one element)
extern "C" __global__ void scatter_add_rows_f32(const float* y, const u32* rows, const float* w, float* out,
                                                u32 nrows, u32 dim) {
    const u64 n = (u64)nrows * dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / dim, c = i % dim;
        out[(u64)rows[r] * dim + c] += w[r] * y[i];
    }
}

// y[r, j] += b[j]
extern "C" __global__ void add_bias_f32(float* y, const float* b, u32 rows, u32 n) {
    const u64 total = (u64)rows * n;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x)
        y[i] += b[i % n];
}

extern "C" __global__ void cast_f32_bf16(const float* x, u16* out, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = f32_to_bf16_bits(x[i]);
}

extern "C" __global__ void cast_f32_f16(const float* x, u16* out, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = f32_to_f16_bits(x[i]);
}

// out[t, :] = table[ids[t], :]      table: [vocab, dim] in the weight dtype (ids checked on the host)
#define EMBEDDING(NAME, W)                                                                      \
    extern "C" __global__ void NAME(const W* table, const u32* ids, float* out, u32 n, u32 dim) { \
        const u64 total = (u64)n * dim;                                                          \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;                      \
             i += (u64)gridDim.x * blockDim.x) {                                                 \
            const u64 t = i / dim, c = i % dim;                                                  \
            out[i] = to_f32(table[(u64)ids[t] * dim + c]);                                       \
        }                                                                                        \
    }
EMBEDDING(embedding_f32, float)
EMBEDDING(embedding_f16, f16_t)
EMBEDDING(embedding_bf16, bf16_t)
