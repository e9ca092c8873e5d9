// Row reductions: RMSNorm (alone, and fused with the residual add that precedes it), LayerNorm,
// and the RMSNorm or LayerNorm of q and k (per head or all of each).
// One block per row; blockDim.x is a multiple of PG_WARP_SIZE (at most 1024).
#include "common.cuh"

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, u32 dim, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// x[r, :] += y[r, :]; out[r, :] = rms_norm(x[r, :]) * w. The residual stream is read once and
// written once instead of twice each.
extern "C" __global__ void add_rms_norm_f32(float* x, const float* y, const float* w, float* out, u32 dim,
                                            float eps) {
    __shared__ float scratch[32];
    float* xr = x + (u64)blockIdx.x * dim;
    const float* yr = y + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + yr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    // NOTE: each thread reads back only the elements it wrote itself.
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// LayerNorm with bias: out[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b; the mean first,
// then the variance of x - mean (as PyTorch computes it).
extern "C" __global__ void layer_norm_f32(const float* x, const float* w, const float* b, float* out, u32 dim,
                                          float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, scratch) / (float)dim;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = xr[i] - mean;
        ss += d * d;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) o[i] = (xr[i] - mean) * inv * w[i] + b[i];
}

// RMSNorm of the q and k parts of fused QKV rows ([q: H x D | k: Hkv x D | v: Hkv x D]), in place,
// in spans: q_spans spans of q_span values (each head: Qwen3, Gemma 3; all of q: OLMo 2) scaled by
// qw, then spans of k_span values of k scaled by kw. grid = (rows, q spans + k spans).
// own_weights: span i is scaled by row i of qw / kw (StableLM's and Cohere's per-head norms);
// center: a LayerNorm without bias (the mean subtracted first, then the variance of x - mean, as
// PyTorch computes it), else RMSNorm.
extern "C" __global__ void qk_norm_f32(float* qkv, const float* qw, const float* kw, u32 q_spans, u32 q_span,
                                       u32 k_span, u32 row_len, float eps, u32 own_weights, u32 center) {
    __shared__ float scratch[32];
    const u32 s = blockIdx.y;
    const bool is_q = s < q_spans;
    const u32 n = is_q ? q_span : k_span;
    const u32 i_span = is_q ? s : s - q_spans;
    const u64 start = is_q ? (u64)s * q_span : (u64)q_spans * q_span + (u64)i_span * k_span;
    float* x = qkv + (u64)blockIdx.x * row_len + start;
    const float* w = (is_q ? qw : kw) + (own_weights ? (u64)i_span * n : 0);
    float mean = 0.0f;
    if (center) {
        float sum = 0.0f;
        for (u32 i = threadIdx.x; i < n; i += blockDim.x) sum += x[i];
        mean = block_sum(sum, scratch) / (float)n;
    }
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i] - mean;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    // NOTE: each thread rewrites only the elements it read itself.
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) x[i] = (x[i] - mean) * inv * w[i];
}
