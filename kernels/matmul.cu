// Our own matrix products, y[m, n] = x[m, k] · W[n, k]ᵀ (+ b[n]), f32 activations, weights in
// f32, f16 or bf16, f32 accumulation:
//   - matvec_<dtype>_<M>: M ≤ 8 rows (decode). Memory-bound: each weight row is streamed once
//     with 16-byte loads, one warp per weight row, while the M rows of x (a few KiB) stay in
//     L1/L2. Needs k to be a multiple of 8 (16-bit weights) or 4 (f32) — checked on the host.
//     matvec_gated_<dtype>_<M>: the same for the gated MLP's gate and up rows, their
//     activation's product out.
//   - gemm_<dtype>: any shape, 64 × 64 output tiles through shared memory. The GEMM of the HIP
//     backend, and the CUDA backend's fallback when cuBLAS is not used.
#include "common.cuh"

#define MATVEC_THREADS 256

// acc[r][m] += x[m, k0 .. k0 + VEC] · (the VEC weights of weight row r, in raw[r]), for every
// row m of x and each of R weight rows (each vector of x loaded once for all R).
template <typename W, int M, int R>
__device__ __forceinline__ void matvec_chunk(const uint4* raw, const float* __restrict__ x, u32 k, u32 k0,
                                             float (*acc)[M]) {
    constexpr int VEC = 16 / sizeof(W);
    float wv[R][VEC];
#pragma unroll
    for (int r = 0; r < R; ++r) unpack16(raw[r], wv[r], (const W*)0);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * k + k0);
#pragma unroll
        for (int v = 0; v < VEC / 4; ++v) {
            const float4 xv = __ldg(xp + v);
#pragma unroll
            for (int r = 0; r < R; ++r)
                acc[r][m] += xv.x * wv[r][4 * v] + xv.y * wv[r][4 * v + 1] + xv.z * wv[r][4 * v + 2] +
                             xv.w * wv[r][4 * v + 3];
        }
    }
}

// Weight loads in flight per lane: U independent 16-byte loads are issued before the first is
// used (a loop with an exit test per load, as `#pragma unroll` makes of a loop of unknown trip
// count, waits on each in turn). With 8 warps per block and 2 blocks per SM on a 2048-row
// matrix, 4 loads give 32 KiB in flight per SM; with 5 or more rows of x, whose loads are in
// flight too, 2 (4 would spill).

// acc[r][m] = x[m] · (weight row r) over all k, in every lane: R weight rows streamed together,
// U 16-byte loads of each in flight per lane, summed over the warp.
template <typename W, int M, int R, int U>
__device__ __forceinline__ void matvec_rows(const W* const* wr, const float* __restrict__ x, u32 k, u32 lane,
                                            float (*acc)[M]) {
    constexpr int VEC = 16 / sizeof(W);  // weights per 16-byte load
    constexpr u32 STEP = PG_WARP_SIZE * VEC;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    u32 k0 = lane * VEC;
    for (; k0 + (U - 1) * STEP < k; k0 += U * STEP) {
        uint4 raw[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) raw[u][r] = __ldg(reinterpret_cast<const uint4*>(wr[r] + k0 + u * STEP));
#pragma unroll
        for (int u = 0; u < U; ++u) matvec_chunk<W, M, R>(raw[u], x, k, k0 + u * STEP, acc);
    }
#pragma unroll 1
    for (; k0 < k; k0 += STEP) {
        uint4 raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r] = __ldg(reinterpret_cast<const uint4*>(wr[r] + k0));
        matvec_chunk<W, M, R>(raw, x, k, k0, acc);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
}

template <typename W, int M>
__device__ __forceinline__ void matvec_impl(const float* __restrict__ x, const W* __restrict__ w,
                                            const float* __restrict__ bias, float* __restrict__ y, u32 n, u32 k) {
    const u32 row = blockIdx.x * (blockDim.x / PG_WARP_SIZE) + threadIdx.x / PG_WARP_SIZE;
    const u32 lane = threadIdx.x % PG_WARP_SIZE;
    if (row >= n) return;
    const W* wr[1] = {w + (u64)row * k};
    float acc[1][M];
    matvec_rows<W, M, 1, (M > 4 ? 2 : 4)>(wr, x, k, lane, acc);
    if (lane == 0) {
        const float b = bias ? bias[row] : 0.0f;
#pragma unroll
        for (int m = 0; m < M; ++m) y[(u64)m * n + row] = acc[0][m] + b;
    }
}

// The gated MLP's first half for decode rows: y[m, i] = act(x[m] · w[i]) · (x[m] · w[ffn + i])
// (w: [2 ffn, k], the gate rows then the up rows), so the gate and up projections never go
// through memory. One warp per output i streams both rows, their loads interleaved: U loads of
// each in flight, half matvec_impl's U for the same total. Each product sums in matvec_impl's
// order.
template <typename W, int M>
__device__ __forceinline__ void matvec_gated_impl(const float* __restrict__ x, const W* __restrict__ w,
                                                  float* __restrict__ y, u32 ffn, u32 k, u32 act) {
    const u32 row = blockIdx.x * (blockDim.x / PG_WARP_SIZE) + threadIdx.x / PG_WARP_SIZE;
    const u32 lane = threadIdx.x % PG_WARP_SIZE;
    if (row >= ffn) return;
    const W* wr[2] = {w + (u64)row * k, w + (u64)(ffn + row) * k};  // gate, up
    float acc[2][M];
    matvec_rows<W, M, 2, (M > 4 ? 1 : 2)>(wr, x, k, lane, acc);
    // Lane m finishes row m: one activation per lane, none live across another's call.
    float gm = 0.0f, um = 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (lane == (u32)m) {
            gm = acc[0][m];
            um = acc[1][m];
        }
    }
    if (lane < (u32)M) y[(u64)lane * ffn + row] = activate(gm, act) * um;
}

#define MATVEC(DT, W, M)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                          \
        matvec_##DT##_##M(const float* x, const W* w, const float* bias, float* y, u32 n, u32 k) {        \
        matvec_impl<W, M>(x, w, bias, y, n, k);                                                           \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS)                                          \
        matvec_gated_##DT##_##M(const float* x, const W* w, float* y, u32 ffn, u32 k, u32 act) {          \
        matvec_gated_impl<W, M>(x, w, y, ffn, k, act);                                                    \
    }
#define MATVEC_ALL_M(DT, W) \
    MATVEC(DT, W, 1)        \
    MATVEC(DT, W, 2)        \
    MATVEC(DT, W, 3)        \
    MATVEC(DT, W, 4)        \
    MATVEC(DT, W, 5)        \
    MATVEC(DT, W, 6)        \
    MATVEC(DT, W, 7)        \
    MATVEC(DT, W, 8)
MATVEC_ALL_M(f32, float)
MATVEC_ALL_M(f16, f16_t)
MATVEC_ALL_M(bf16, bf16_t)

// ---- tiled GEMM ------------------------------------------------------------------------------
//
//   block: 256 threads, a 64 (rows of x) × 64 (rows of W) tile of y, k in steps of 16;
//   thread (ty, tx) = (tid / 16, tid % 16) owns y[m0 + 4 ty .. +4, n0 + 4 tx .. +4].
#define GT 64
#define GK 16

template <typename W>
__device__ __forceinline__ void gemm_impl(const float* __restrict__ x, const W* __restrict__ w,
                                          const float* __restrict__ bias, float* __restrict__ y, u32 m, u32 n,
                                          u32 k) {
    __shared__ float xs[GK][GT + 4];
    __shared__ float ws[GK][GT + 4];
    const u32 tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const u32 m0 = blockIdx.y * GT, n0 = blockIdx.x * GT;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (u32 k0 = 0; k0 < k; k0 += GK) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 e = tid + 256 * q, r = e / GK, c = e % GK;
            const u32 gm = m0 + r, gn = n0 + r, gk = k0 + c;
            xs[c][r] = (gm < m && gk < k) ? x[(u64)gm * k + gk] : 0.0f;
            ws[c][r] = (gn < n && gk < k) ? to_f32(w[(u64)gn * k + gk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 gm = m0 + ty * 4 + i;
        if (gm >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 gn = n0 + tx * 4 + j;
            if (gn < n) y[(u64)gm * n + gn] = acc[i][j] + (bias ? bias[gn] : 0.0f);
        }
    }
}

#define GEMM(DT, W)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                       \
        gemm_##DT(const float* x, const W* w, const float* bias, float* y, u32 m, u32 n, u32 k) {           \
        gemm_impl<W>(x, w, bias, y, m, n, k);                                                               \
    }
GEMM(f32, float)
GEMM(f16, f16_t)
GEMM(bf16, bf16_t)
