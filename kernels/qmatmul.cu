// Weights kept in GGML's blocks: of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against activations
// quantized to 8 bits per block of 32, and super-blocks of 256 (Q2_K .. Q6_K, IQ4_XS) against
// activations quantized per 256; integer dot products (dp4a) in both:
//   - quantize_x32_f32: x[m, k] to xq (i8, four to a word), xd = max|x| / 127 and xs = xd·Σq per
//     block, as the CPU backend quantizes them (the same rounding, the same bits);
//     quantize_x256_f32: the same per 256, in the super-block kernels' lane-major order, with
//     each lane's record (the sums of q over its two groups of 16, and the scale) instead;
//   - qmatvec_<type>: the `rows` columns of y[m, ldy] from y (the host offsets y and b to a
//     part's first row) = x · Wᵀ (+ b), up to QM_ROWS rows of x per launch row (grid.y
//     covers the rest);
//   - embedding_<type>: rows of the table dequantized as the reference dequantizer does.
//
// Blocks of 32: the host stores each block's fields in planes (gpu/qmatmul.rs): the packed
// values (16 bytes a block, 32 for Q8_0), the fifth bits (one word a block, Q5_*), the scales
// and the minimums (f16 bits), so that every load is aligned. Super-blocks are padded to a
// multiple of 16 bytes, with the words of their values in lane-major order (k_word below), so
// that each lane loads its share 16 or 8 bytes at a time.
//
// NOTE: the arithmetic is the CPU's (backend/cpu/qmatmul.rs and qmatmul/kquant.rs), operation
// for operation, so both backends give the same bits and a row's result never depends on the
// other rows. Blocks of 32:
//   16 lanes per weight row; lane 8h + l sums values 4l .. 4l+3 of the blocks j ≡ h (mod 2), in
//   order: acc = fma(Σ v·q, scale·xd, acc) (one dp4a, exact). Then y = reduce8(acc[l] + acc[8+l])
//   with reduce8's tree ((0+4)+(2+6))+((1+5)+(3+7)) made of xor-shuffles 8, 4, 2, 1 (float
//   addition commutes), and for types with a minimum + reduce8(macc), lane g < 8 holding
//   macc = fma(min_j, xs_j, macc) over j ≡ g (mod 8).
// Super-blocks: 8 lanes per weight row; lane l sums values 4l .. 4l+3 of each 32 of a
// super-block in integers, Σ sc_g·(v·q) less off·(sc_2l·bs_2l + sc_2l+1·bs_2l+1), then
// acc = fma(I, d·xd, acc) and, with a minimum, acc = fma(mn_2l·bs_2l + mn_2l+1·bs_2l+1,
// -(dmin·xd), acc); y = reduce8(acc) (xor-shuffles 4, 2, 1).
#include "common.cuh"

#define QM_THREADS 256
#define QM_ROWS 8  // rows of x per launch row
#define QLANES 16  // lanes per weight row

#define QT_Q4_0 0
#define QT_Q4_1 1
#define QT_Q5_0 2
#define QT_Q5_1 3
#define QT_Q8_0 4
#define QT_IQ4_NL 5
#define QT_Q2_K 6
#define QT_Q3_K 7
#define QT_Q4_K 8
#define QT_Q5_K 9
#define QT_Q6_K 10
#define QT_IQ4_XS 11
#define KLANES 8  // lanes per weight row of a super-block kernel

// Four signed bytes of a times those of b, plus c. The portable form where dp4a is missing.
#if defined(PG_HIP) || defined(PG_EMU)
__device__ __forceinline__ int pg_dp4a(int a, int b, int c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
#else
__device__ __forceinline__ int pg_dp4a(int a, int b, int c) { return __dp4a(a, b, c); }
#endif

// IQ4_NL's 16 levels as signed bytes, four to a word (no table in memory).
__device__ __forceinline__ int iq4_level(u32 nib) {
    const u32 w = nib < 8 ? (nib < 4 ? 0xBFAD9881u : 0xF6EADDCFu) : (nib < 12 ? 0x26190D01u : 0x71594535u);
    return (int)(signed char)(w >> (8 * (nib & 3u)));
}

template <int T>
__device__ __forceinline__ constexpr bool has_min() {
    return T == QT_Q4_1 || T == QT_Q5_1 || T == QT_Q2_K || T == QT_Q4_K || T == QT_Q5_K;
}
template <int T>
__device__ __forceinline__ constexpr u32 qs_words() {
    return T == QT_Q8_0 ? 8 : 4;
}
// What is subtracted from every value (Q4_0: 8, Q5_0: 16), so that v = stored - offset.
template <int T>
__device__ __forceinline__ constexpr int value_offset() {
    return T == QT_Q4_0 ? 8 : T == QT_Q5_0 ? 16 : T == QT_Q6_K ? 32 : T == QT_Q3_K ? 4 : 0;
}

// Four IQ4 nibbles (one a byte) to their levels.
__device__ __forceinline__ u32 iq4_levels4(u32 v) {
    u32 r = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) r |= ((u32)iq4_level((v >> (8 * i)) & 0xFu) & 0xFFu) << (8 * i);
    return r;
}

// The CPU's reduce8 ((0+4)+(2+6))+((1+5)+(3+7)) over lanes 8g .. 8g+7 (float addition
// commutes, so each lane's partner order does not matter); every lane gets the sum.
__device__ __forceinline__ float reduce8(float v) {
    v = v + PG_SHFL_XOR(v, 4);
    v = v + PG_SHFL_XOR(v, 2);
    return v + PG_SHFL_XOR(v, 1);
}

// out[t, e] = value(r, e) for the ids t in this part, r = ids[t] - row0 < rows.
template <class F>
__device__ __forceinline__ void embedding_rows(const u32* ids, float* out, u32 n, u32 dim, u32 row0, u32 rows,
                                               F value) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)n * dim; i += (u64)gridDim.x * blockDim.x) {
        const u32 t = (u32)(i / dim), e = (u32)(i % dim), id = ids[t];
        if (id >= row0 && id - row0 < rows) out[i] = value(id - row0, e);
    }
}

// Values 4l .. 4l+3 of block b as stored (before the offset), four bytes in a word.
template <int T>
__device__ __forceinline__ int load4(const u32* __restrict__ qs, const u32* __restrict__ qh, u64 b, u32 l) {
    if (T == QT_Q8_0) return (int)__ldg(qs + b * 8 + l);
    // Values j and j + 16 share byte j: the low nibbles are values 0..15.
    u32 v = (__ldg(qs + b * 4 + (l & 3u)) >> (4 * (l >> 2))) & 0x0F0F0F0Fu;
    if (T == QT_Q5_0 || T == QT_Q5_1) {
        const u32 h = (__ldg(qh + b) >> (4 * l)) & 0xFu;  // value e's fifth bit is bit e
        v |= ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
    }
    if (T == QT_IQ4_NL) v = iq4_levels4(v);
    return (int)v;
}

// The scale of n activations (max|x| / 127) and, in inv, its inverse (0 for a block of zeros).
__device__ __forceinline__ float block_scale(const float* p, int n, float& inv) {
    float amax = 0.0f;
#pragma unroll 8
    for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(p[i]));
    const float scale = __fdiv_rn(amax, 127.0f);
    inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    return scale;
}

// Four activations to 8 bits, q = round(x·inv) (ties to even) within ±127, packed in a word;
// their sum is added to `sum`.
__device__ __forceinline__ u32 quantize4(const float* p, float inv, int& sum) {
    u32 word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = (int)fminf(fmaxf(rintf(__fmul_rn(p[i], inv)), -127.0f), 127.0f);
        sum += q;
        word |= ((u32)q & 0xFFu) << (8 * i);
    }
    return word;
}

extern "C" __global__ void __launch_bounds__(QM_THREADS)
    quantize_x32_f32(const float* __restrict__ x, u32* __restrict__ xq, float* __restrict__ xd,
                     float* __restrict__ xs, u32 blocks) {
    // NOTE: grid-stride, as every kernel launched through `elementwise` (its grid is capped).
    for (u32 b = blockIdx.x * blockDim.x + threadIdx.x; b < blocks; b += gridDim.x * blockDim.x) {
        const float* p = x + (u64)b * 32;
        float inv;
        const float scale = block_scale(p, 32, inv);
        int sum = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) xq[(u64)b * 8 + w] = quantize4(p + 4 * w, inv, sum);
        xd[b] = scale;
        xs[b] = __fmul_rn(scale, (float)sum);
    }
}

template <int T>
__device__ __forceinline__ void qmatvec_impl(const u32* __restrict__ xq, const float* __restrict__ xd,
                                             const float* __restrict__ xs, u32 m, u32 nb,
                                             const u32* __restrict__ qs, const u32* __restrict__ qh,
                                             const u16* __restrict__ wd, const u16* __restrict__ wm,
                                             const float* __restrict__ bias, float* __restrict__ y, u32 rows,
                                             u32 ldy) {
    const u32 lane = threadIdx.x % QLANES, h = lane / 8, l = lane % 8;
    const u32 row = blockIdx.x * (blockDim.x / QLANES) + threadIdx.x / QLANES;
    const bool live = row < rows;
    const u32 m0 = blockIdx.y * QM_ROWS;
    const u32 mr = min(m - m0, (u32)QM_ROWS);
    float acc[QM_ROWS], macc[QM_ROWS];
#pragma unroll
    for (int a = 0; a < QM_ROWS; ++a) acc[a] = macc[a] = 0.0f;
    if (live) {
        for (u32 j = h; j < nb; j += 2) {
            const u64 b = (u64)row * nb + j;
            const int v = load4<T>(qs, qh, b, l);
            const float scale = f16_bits_to_f32(__ldg(wd + b));
#pragma unroll
            for (int a = 0; a < QM_ROWS; ++a) {
                if ((u32)a < mr) {
                    const u64 xb = (u64)(m0 + a) * nb + j;
                    const int q = (int)__ldg(xq + xb * 8 + l);
                    int isum = pg_dp4a(v, q, 0);
                    if (value_offset<T>() != 0) isum -= value_offset<T>() * pg_dp4a(0x01010101, q, 0);
                    acc[a] = fmaf((float)isum, __fmul_rn(scale, __ldg(xd + xb)), acc[a]);
                }
            }
        }
        if (has_min<T>() && h == 0) {
            for (u32 j = l; j < nb; j += 8) {
                const float mn = f16_bits_to_f32(__ldg(wm + (u64)row * nb + j));
#pragma unroll
                for (int a = 0; a < QM_ROWS; ++a)
                    if ((u32)a < mr) macc[a] = fmaf(mn, __ldg(xs + (u64)(m0 + a) * nb + j), macc[a]);
            }
        }
    }
    // Every lane takes part in the shuffles (rows past the end included).
#pragma unroll
    for (int a = 0; a < QM_ROWS; ++a) {
        if ((u32)a >= mr) break;  // the same for the whole block
        float f = reduce8(acc[a] + PG_SHFL_XOR(acc[a], 8));
        if (has_min<T>()) {
            f = f + reduce8(macc[a]);
        }
        if (live && lane == 0) y[(u64)(m0 + a) * ldy + row] = bias ? f + bias[row] : f;
    }
}

// Value c of block b, as the reference dequantizer computes it (the same products and sums).
template <int T>
__device__ __forceinline__ float dequant_value(const u32* __restrict__ qs, const u32* __restrict__ qh,
                                               const u16* __restrict__ wd, const u16* __restrict__ wm, u64 b,
                                               u32 c) {
    const float d = f16_bits_to_f32(wd[b]);
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(qs + b * qs_words<T>());
    if (T == QT_Q8_0) return __fmul_rn((float)(signed char)bytes[c], d);
    u32 v = c < 16 ? bytes[c] & 0xFu : bytes[c - 16] >> 4;
    if (T == QT_IQ4_NL) return __fmul_rn(d, (float)iq4_level(v));
    if (T == QT_Q5_0 || T == QT_Q5_1) v |= ((qh[b] >> c) & 1u) << 4;
    if (has_min<T>()) return __fadd_rn(__fmul_rn(d, (float)v), f16_bits_to_f32(wm[b]));
    return __fmul_rn(d, (float)((int)v - value_offset<T>()));
}

// out[t, e] = table[ids[t], e] for the ids in this part (row0 .. row0 + rows).
template <int T>
__device__ __forceinline__ void embedding_q_impl(const u32* qs, const u32* qh, const u16* wd, const u16* wm,
                                                 const u32* ids, float* out, u32 n, u32 dim, u32 row0,
                                                 u32 rows) {
    embedding_rows(ids, out, n, dim, row0, rows, [&](u32 r, u32 e) {
        return dequant_value<T>(qs, qh, wd, wm, (u64)r * (dim / 32) + e / 32, e % 32);
    });
}


// ---- super-blocks of 256 ---------------------------------------------------------------------

// Per super-block b: xq[b, l, vv] (word 8l + vv) holds values 32 vv + 4l .. +3, the words
// lane l of qmatvec_k reads; xr[b, l] is that lane's record {Σq of group 2l, of group 2l+1,
// the scale's bits, 0}. So each lane's share of x is two 16-byte loads and one.
extern "C" __global__ void __launch_bounds__(QM_THREADS)
    quantize_x256_f32(const float* __restrict__ x, u32* __restrict__ xq, int* __restrict__ xr, u32 blocks) {
    for (u32 b = blockIdx.x * blockDim.x + threadIdx.x; b < blocks; b += gridDim.x * blockDim.x) {
        const float* p = x + (u64)b * 256;
        float inv;
        const float scale = block_scale(p, 256, inv);
        for (u32 g = 0; g < 16; ++g) {
            int sum = 0;
            // values 16g + 4w: vector vv = g / 2, lane 4 (g % 2) + w
#pragma unroll
            for (u32 w = 0; w < 4; ++w)
                xq[(u64)b * 64 + 8 * (4 * (g % 2) + w) + g / 2] = quantize4(p + 16 * g + 4 * w, inv, sum);
            xr[(u64)b * 32 + 4 * (g / 2) + g % 2] = sum;
        }
#pragma unroll
        for (u32 l = 0; l < 8; ++l) {
            xr[(u64)b * 32 + 4 * l + 2] = (int)__float_as_uint(scale);
            xr[(u64)b * 32 + 4 * l + 3] = 0;
        }
    }
}

__device__ __forceinline__ float f16_at(const unsigned char* b, u32 i) { return f16_bits_to_f32(b[i] | (b[i + 1] << 8)); }

// The scale and the minimum of group g (16 values) of a super-block, as small integers.
template <int T>
__device__ __forceinline__ void k_group(const unsigned char* b, u32 g, int& sc, int& mn) {
    mn = 0;
    if (T == QT_Q2_K) {
        sc = b[g] & 0xF;
        mn = b[g] >> 4;
    } else if (T == QT_Q3_K) {
        const u32 low = (b[96 + g % 8] >> (4 * (g / 8))) & 0xFu, high = (b[104 + g % 4] >> (2 * (g / 4))) & 3u;
        sc = (int)(low | (high << 4)) - 32;
    } else if (T == QT_Q4_K || T == QT_Q5_K) {
        const u32 j = g / 2;
        const unsigned char* s = b + 4;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    } else if (T == QT_Q6_K) {
        sc = (signed char)b[192 + g];
    } else {  // IQ4_XS
        const u32 j = g / 2;
        const u32 low = (b[132 + j / 2] >> (4 * (j % 2))) & 0xFu, high = ((b[130] | (b[131] << 8)) >> (2 * j)) & 3u;
        sc = (int)(low | (high << 4)) - 32;
    }
}

// The super-block's d and dmin.
template <int T>
__device__ __forceinline__ void k_scales(const unsigned char* b, float& d, float& dmin) {
    dmin = 0.0f;
    if (T == QT_Q2_K) {
        d = f16_at(b, 80);
        dmin = f16_at(b, 82);
    } else if (T == QT_Q3_K) {
        d = f16_at(b, 108);
    } else if (T == QT_Q4_K || T == QT_Q5_K) {
        d = f16_at(b, 0);
        dmin = f16_at(b, 2);
    } else if (T == QT_Q6_K) {
        d = f16_at(b, 208);
    } else {
        d = f16_at(b, 128);  // IQ4_XS: the header after the values
    }
}

// Where the upload moves the words of a super-block (gpu/qmatmul.rs, `lane_major`): each
// lane's words of the values, next to each other, so that it loads them 16 (or 8) bytes at a
// time. Word `w` as the file stores it is at word k_word<T>(w); the header stays in place,
// but IQ4_XS's, which moves after the values.
//   Q2_K  qs    4 + 8h + l       -> 4 + 2l + h
//   Q3_K  qs    8 + 8h + l       -> 8 + 2l + h      (hmask, word l, stays)
//   Q4_K  qs    4 + 8c + l       -> 4 + 4l + c
//   Q5_K  qs    12 + 8c + l      -> 12 + 4l + c     (qh, word 4 + l, stays)
//   Q6_K  ql    16h + 8p + l     -> 4l + 2h + p;    qh 32 + 8h + l -> 32 + 2l + h
//   IQ4_XS qs   2 + 4vv + w      -> 8w + vv;        header bytes 0..8 -> 128..136
template <int T>
__device__ __forceinline__ u32 k_word(u32 w) {
    if (T == QT_Q2_K && w >= 4 && w < 20) return 4 + 2 * ((w - 4) % 8) + (w - 4) / 8;
    if (T == QT_Q3_K && w >= 8 && w < 24) return 8 + 2 * ((w - 8) % 8) + (w - 8) / 8;
    if (T == QT_Q4_K && w >= 4 && w < 36) return 4 + 4 * ((w - 4) % 8) + (w - 4) / 8;
    if (T == QT_Q5_K && w >= 12 && w < 44) return 12 + 4 * ((w - 12) % 8) + (w - 12) / 8;
    if (T == QT_Q6_K && w < 32) return 4 * (w % 8) + w / 8;
    if (T == QT_Q6_K && w >= 32 && w < 48) return 32 + 2 * ((w - 32) % 8) + (w - 32) / 8;
    if (T == QT_IQ4_XS) return w < 2 ? 32 + w : 8 * ((w - 2) % 4) + (w - 2) / 4;
    return w;
}

// Values 32 vv + 4l .. +3 (before the offset), four bytes a word, for vv = 0..7, from the
// super-block at w (the lane-major layout above).
template <int T>
__device__ __forceinline__ void k_values(const u32* __restrict__ w, u32 l, int* v) {
    if (T == QT_Q4_K || T == QT_Q5_K) {
        const uint4 c = __ldg(reinterpret_cast<const uint4*>(w + (T == QT_Q4_K ? 4 : 12) + 4 * l));
        const u32 q[4] = {c.x, c.y, c.z, c.w};
        const u32 hi = T == QT_Q5_K ? __ldg(w + 4 + l) : 0u;
#pragma unroll
        for (u32 vv = 0; vv < 8; ++vv) {
            u32 x = (q[vv / 2] >> (4 * (vv % 2))) & 0x0F0F0F0Fu;
            if (T == QT_Q5_K) x |= ((hi >> vv) & 0x01010101u) << 4;
            v[vv] = (int)x;
        }
    } else if (T == QT_Q6_K) {
        const uint4 c = __ldg(reinterpret_cast<const uint4*>(w + 4 * l));
        const uint2 h2 = __ldg(reinterpret_cast<const uint2*>(w + 32 + 2 * l));
        const u32 q[4] = {c.x, c.y, c.z, c.w}, qh[2] = {h2.x, h2.y};
#pragma unroll
        for (u32 vv = 0; vv < 8; ++vv) {
            const u32 h = vv / 4, j = vv % 4;
            const u32 low = (q[2 * h + j % 2] >> (4 * (j / 2))) & 0x0F0F0F0Fu;
            v[vv] = (int)(low | (((qh[h] >> (2 * j)) & 0x03030303u) << 4));
        }
    } else if (T == QT_Q2_K || T == QT_Q3_K) {
        const uint2 c = __ldg(reinterpret_cast<const uint2*>(w + (T == QT_Q2_K ? 4 : 8) + 2 * l));
        const u32 q[2] = {c.x, c.y};
        const u32 hm = T == QT_Q3_K ? __ldg(w + l) : 0u;
#pragma unroll
        for (u32 vv = 0; vv < 8; ++vv) {
            u32 x = (q[vv / 4] >> (2 * (vv % 4))) & 0x03030303u;
            if (T == QT_Q3_K) x |= ((hm >> vv) & 0x01010101u) << 2;
            v[vv] = (int)x;
        }
    } else {  // IQ4_XS: values j and j + 16 of each 32 share byte j
        const uint4* p = reinterpret_cast<const uint4*>(w + 8 * (l & 3u));
        const uint4 a = __ldg(p), b = __ldg(p + 1);
        const u32 q[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (u32 vv = 0; vv < 8; ++vv) v[vv] = (int)iq4_levels4((q[vv] >> (4 * (l >> 2))) & 0x0F0F0F0Fu);
    }
}

template <int T>
__device__ __forceinline__ void qmatvec_k_impl(const u32* __restrict__ xq, const int* __restrict__ xr, u32 m,
                                               u32 nsb, const u32* __restrict__ w, u32 stride,
                                               const float* __restrict__ bias, float* __restrict__ y, u32 rows,
                                               u32 ldy) {
    const u32 l = threadIdx.x % KLANES;
    const u32 row = blockIdx.x * (blockDim.x / KLANES) + threadIdx.x / KLANES;
    const bool live = row < rows;
    const u32 m0 = blockIdx.y * QM_ROWS;
    const u32 mr = min(m - m0, (u32)QM_ROWS);
    float acc[QM_ROWS];
#pragma unroll
    for (int a = 0; a < QM_ROWS; ++a) acc[a] = 0.0f;
    if (live) {
        for (u32 sb = 0; sb < nsb; ++sb) {
            const u32* sw = w + ((u64)row * nsb + sb) * stride;
            const unsigned char* bb = reinterpret_cast<const unsigned char*>(sw);
            float d, dmin;
            k_scales<T>(bb, d, dmin);
            int v[8], sc[8], mn, sp0, sp1, mp0, mp1;
            k_values<T>(sw, l, v);
#pragma unroll
            for (u32 vv = 0; vv < 8; ++vv) k_group<T>(bb, 2 * vv + l / 4, sc[vv], mn);
            k_group<T>(bb, 2 * l, sp0, mp0);
            k_group<T>(bb, 2 * l + 1, sp1, mp1);
#pragma unroll
            for (int a = 0; a < QM_ROWS; ++a) {
                if ((u32)a < mr) {
                    const u64 xb = (u64)(m0 + a) * nsb + sb;
                    const uint4* xp = reinterpret_cast<const uint4*>(xq + xb * 64 + 8 * l);
                    const uint4 q0 = __ldg(xp), q1 = __ldg(xp + 1);
                    const u32 q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
                    const int4 r = __ldg(reinterpret_cast<const int4*>(xr + xb * 32 + 4 * l));
                    int il = 0;
#pragma unroll
                    for (u32 vv = 0; vv < 8; ++vv) il += sc[vv] * pg_dp4a(v[vv], (int)q[vv], 0);
                    il -= value_offset<T>() * (sp0 * r.x + sp1 * r.y);
                    const float dx = __int_as_float(r.z);
                    acc[a] = fmaf((float)il, __fmul_rn(d, dx), acc[a]);
                    if (has_min<T>()) acc[a] = fmaf((float)(mp0 * r.x + mp1 * r.y), -__fmul_rn(dmin, dx), acc[a]);
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < QM_ROWS; ++a) {
        if ((u32)a >= mr) break;  // the same for the whole block
        const float f = reduce8(acc[a]);
        if (live && l == 0) y[(u64)(m0 + a) * ldy + row] = bias ? f + bias[row] : f;
    }
}

// Byte `i` of the super-block at b as the file stores it, from the lane-major layout.
template <int T>
__device__ __forceinline__ u32 k_byte(const unsigned char* b, u32 i) {
    return b[4 * k_word<T>(i / 4) + i % 4];
}

// Value e of the super-block at b, as the reference dequantizer computes it.
template <int T>
__device__ __forceinline__ float dequant_k_value(const unsigned char* b, u32 e) {
    float d, dmin;
    k_scales<T>(b, d, dmin);
    int sc, mn;
    k_group<T>(b, e / 16, sc, mn);
    const u32 h = e / 128, j = (e % 128) / 32, l = e % 32;
    if (T == QT_Q2_K) {
        const u32 q = (k_byte<T>(b, 16 + 32 * h + l) >> (2 * j)) & 3u;
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)q), __fmul_rn(dmin, (float)mn));
    }
    if (T == QT_Q3_K) {
        const int low = (k_byte<T>(b, 32 + 32 * h + l) >> (2 * j)) & 3;
        const int q = ((k_byte<T>(b, l) >> (e / 32)) & 1) ? low : low - 4;
        return __fmul_rn(__fmul_rn(d, (float)sc), (float)q);
    }
    if (T == QT_Q4_K || T == QT_Q5_K) {
        const u32 c = e / 32;
        u32 q = (k_byte<T>(b, (T == QT_Q4_K ? 16 : 48) + 32 * (c / 2) + l) >> (4 * (c % 2))) & 0xFu;
        if (T == QT_Q5_K) q |= ((k_byte<T>(b, 16 + l) >> c) & 1u) << 4;
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)q), __fmul_rn(dmin, (float)mn));
    }
    if (T == QT_Q6_K) {
        const u32 r = e % 128;
        const u32 low = (k_byte<T>(b, 64 * h + r % 64) >> (4 * (r / 64))) & 0xFu;
        const u32 high = (k_byte<T>(b, 128 + 32 * h + r % 32) >> (2 * (r / 32))) & 3u;
        return __fmul_rn(__fmul_rn(d, (float)sc), (float)((int)(low | (high << 4)) - 32));
    }
    const u32 c = e / 32, i = e % 32;  // IQ4_XS
    const u32 nib = (k_byte<T>(b, 8 + 16 * c + (i % 16)) >> (4 * (i / 16))) & 0xFu;
    return __fmul_rn(__fmul_rn(d, (float)sc), (float)iq4_level(nib));
}

// out[t, e] = table[ids[t], e] for the ids in this part (row0 .. row0 + rows).
template <int T>
__device__ __forceinline__ void embedding_k_impl(const u32* w, u32 stride, const u32* ids, float* out, u32 n,
                                                 u32 dim, u32 row0, u32 rows) {
    embedding_rows(ids, out, n, dim, row0, rows, [&](u32 r, u32 e) {
        const u64 sb = (u64)r * (dim / 256) + e / 256;
        return dequant_k_value<T>(reinterpret_cast<const unsigned char*>(w + sb * stride), e % 256);
    });
}

#define QMATMUL(NAME, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(QM_THREADS)                                                  \
        qmatvec_##NAME(const u32* xq, const float* xd, const float* xs, u32 m, u32 nb, const u32* qs,          \
                       const u32* qh, const u16* wd, const u16* wm, const float* bias, float* y, u32 rows,     \
                       u32 ldy) {                                                                              \
        qmatvec_impl<T>(xq, xd, xs, m, nb, qs, qh, wd, wm, bias, y, rows, ldy);                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        embedding_##NAME(const u32* qs, const u32* qh, const u16* wd, const u16* wm, const u32* ids,         \
                         float* out, u32 n, u32 dim, u32 row0, u32 rows) {                                     \
        embedding_q_impl<T>(qs, qh, wd, wm, ids, out, n, dim, row0, rows);                                    \
    }
QMATMUL(q4_0, QT_Q4_0)
QMATMUL(q4_1, QT_Q4_1)
QMATMUL(q5_0, QT_Q5_0)
QMATMUL(q5_1, QT_Q5_1)
QMATMUL(q8_0, QT_Q8_0)
QMATMUL(iq4_nl, QT_IQ4_NL)

#define QMATMUL_K(NAME, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(QM_THREADS)                                                  \
        qmatvec_##NAME(const u32* xq, const int* xr, u32 m, u32 nsb, const u32* w, u32 stride,                \
                       const float* bias, float* y, u32 rows, u32 ldy) {                                      \
        qmatvec_k_impl<T>(xq, xr, m, nsb, w, stride, bias, y, rows, ldy);                                     \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        embedding_##NAME(const u32* w, u32 stride, const u32* ids, float* out, u32 n, u32 dim, u32 row0,     \
                         u32 rows) {                                                                           \
        embedding_k_impl<T>(w, stride, ids, out, n, dim, row0, rows);                                          \
    }
QMATMUL_K(q2_k, QT_Q2_K)
QMATMUL_K(q3_k, QT_Q3_K)
QMATMUL_K(q4_k, QT_Q4_K)
QMATMUL_K(q5_k, QT_Q5_K)
QMATMUL_K(q6_k, QT_Q6_K)
QMATMUL_K(iq4_xs, QT_IQ4_XS)
