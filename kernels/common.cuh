// Shared by every kernel file. The same sources build three ways:
//   - NVRTC at run time, for the device's own architecture (sm_XY), cached on disk;
//   - nvcc, where a toolkit is present (`nvcc -arch=sm_90 -cubin kernels/attention.cu`);
//   - hipRTC at run time, with hip_compat.h placed before this header (PG_HIP defined).
// NVRTC and hipRTC are given the sources with this header inlined, and no system header is
// needed: the half-precision conversions below are our own, so no cuda_fp16.h is required.
//
// Conventions: activations are f32; weights are f32, f16 or bf16 (stored as raw 16-bit words);
// the KV cache is f32, bf16, f16 or fp8 (E4M3, raw bytes); index buffers are u32. Every kernel
// is `extern "C"` so that it is looked up by its plain name; dtype variants are stamped out by
// macros, never copied by hand.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// Lanes per warp (32 on NVIDIA; 64 or 32 on AMD): the host passes -DPG_WARP_SIZE=N.
#ifndef PG_WARP_SIZE
#define PG_WARP_SIZE 32
#endif

#ifndef PG_HIP
#define PG_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

// Dynamic shared memory (the launch's size): `PG_DYNAMIC_SHARED(float, smem);`.
#ifndef PG_DYNAMIC_SHARED
#define PG_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

#define PG_NEG_INF (__int_as_float(0xff800000))

// Storage types of weights. Plain structs, so that overloads pick the conversion.
struct bf16_t {
    u16 x;
};
struct f16_t {
    u16 x;
};
struct fp8_t {  // FP8 E4M3: 4 exponent bits (bias 7), 3 mantissa bits, no infinities
    unsigned char x;
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16_t v) { return __uint_as_float(((u32)v.x) << 16); }
__device__ __forceinline__ float bf16_bits_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

// NOTE: PTX's conversions; HIP (hip_compat.h) and the emulator (emu.h) bring their own.
#if !defined(PG_HIP) && !defined(PG_EMU)
__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif
__device__ __forceinline__ float to_f32(f16_t v) { return f16_bits_to_f32(v.x); }

// FP8 E4M3 widened exactly: the exponent and mantissa moved into f32's fields make
// 2^(e - 127)(1 + m/8) (subnormals 2^-126 · m/8), and 2^120 scales them to 2^(e - 7)(1 + m/8).
// 0x7f and 0xff are NaN.
__device__ __forceinline__ float fp8_bits_to_f32(u32 b) {
    const float v = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 0x1p120f;
    return (b & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : v;
}
__device__ __forceinline__ float to_f32(fp8_t v) { return fp8_bits_to_f32(v.x); }

// f32 to FP8 E4M3: round to nearest even, saturate to ±448 (CUDA's __NV_SATFINITE, as vLLM's
// fp8 cache), NaN to 0x7f. The same bits as f32_to_e4m3 in src/tensor.rs.
__device__ __forceinline__ u32 f32_to_fp8_bits(float f) {
    const u32 x = __float_as_uint(f);
    const u32 sign = (x >> 24) & 0x80u;
    const float a = fabsf(f);
    if (a != a) return 0x7fu;
    if (a >= 448.0f) return sign | 0x7eu;
    const int exp = (int)((x >> 23) & 0xffu) - 127;
    if (exp < -6) return sign | (u32)rintf(a * 512.0f);  // subnormals: multiples of 2^-9
    u32 e = (u32)(exp + 7), q = (x & 0x7fffffu) >> 20;
    const u32 rest = x & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) {
        if (++q == 8) {
            q = 0;
            ++e;
        }
    }
    if (e > 15 || (e == 15 && q == 7)) return sign | 0x7eu;  // rounded past 448
    return sign | (e << 3) | q;
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// Sixteen fp8 values, eight 16-bit values or four f32 from one 16-byte word; the pointer type
// picks the format.
__device__ __forceinline__ void unpack16(uint4 raw, float* out, const fp8_t*) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int b = 0; b < 4; ++b) out[4 * q + b] = fp8_bits_to_f32((w[q] >> (8 * b)) & 0xffu);
}
__device__ __forceinline__ void unpack16(uint4 raw, float* out, const bf16_t*) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        out[2 * q] = __uint_as_float(w[q] << 16);
        out[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack16(uint4 raw, float* out, const f16_t*) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        out[2 * q] = f16_bits_to_f32(w[q] & 0xffffu);
        out[2 * q + 1] = f16_bits_to_f32(w[q] >> 16);
    }
}
__device__ __forceinline__ void unpack16(uint4 raw, float* out, const float*) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}

// act: 0 SiLU, 1 GELU (tanh approximation), 2 GELU (erf).
// NOTE: SiLU divides with __fdividef (within 2 ulp; 0 for a denominator above 2^126, where the
// quotient is below 1e-36): IEEE division's slow path is a call, and around it the matvecs that
// end with the activation spilled registers.
__device__ __forceinline__ float activate(float x, u32 act) {
    if (act == 0) return __fdividef(x, 1.0f + expf(-x));
    if (act == 1) return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
    return 0.5f * x * (1.0f + erff(x * 0.70710678118f));
}

// ---- reductions -----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = PG_WARP_SIZE / 2; m > 0; m >>= 1) v += PG_SHFL_XOR(v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = PG_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, PG_SHFL_XOR(v, m));
    return v;
}

// Sum over the whole block; `scratch` holds at least blockDim.x / PG_WARP_SIZE floats. Every
// thread gets the result. The reduction order is fixed by the launch shape, not the data.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % PG_WARP_SIZE, warp = threadIdx.x / PG_WARP_SIZE;
    const int nwarps = (blockDim.x + PG_WARP_SIZE - 1) / PG_WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by an earlier reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < nwarps; ++w) s += scratch[w];
    return s;
}

// ---- tensor cores ----------------------------------------------------------------------------
//
// PG_TENSOR_CORES is defined by the host (-DPG_TENSOR_CORES=1) where the device has mma.sync
// with 16-bit inputs (sm_80 and later, and the emulator with 32-lane warps); the kernels that
// use it exist only then, and the host launches them only then.
//
// mma_16816(c, a, b): c[16×8] += a[16×16] · b[16×8] over one warp, inputs bf16 or f16 (the tag
// picks), accumulators f32. Lane l holds, with g = l / 4 and t = l % 4 (two 16-bit values per
// word, the lower column or row in the low half):
//   a[0]: A[g][2t, 2t+1]   a[1]: A[g+8][2t, 2t+1]   a[2]: A[g][2t+8, 2t+9]   a[3]: A[g+8][2t+8, 2t+9]
//   b[0]: B[2t, 2t+1][g]   b[1]: B[2t+8, 2t+9][g]
//   c[0], c[1]: C[g][2t, 2t+1]                      c[2], c[3]: C[g+8][2t, 2t+1]
// pack2(lo, hi): two floats rounded (to nearest even) into one word of the tag's type.
#if defined(PG_TENSOR_CORES) && !defined(PG_EMU)
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b, const bf16_t*) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b, const f16_t*) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// NOTE: cvt's first source goes to the upper half.
__device__ __forceinline__ u32 pack2(float lo, float hi, const bf16_t*) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 pack2(float lo, float hi, const f16_t*) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#elif defined(PG_TENSOR_CORES)
// the emulator's mma_16816 is in emu.h
__device__ __forceinline__ u32 pack2(float lo, float hi, const bf16_t*) {
    return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}
__device__ __forceinline__ u32 pack2(float lo, float hi, const f16_t*) {
    return (u32)f32_to_f16_bits(lo) | ((u32)f32_to_f16_bits(hi) << 16);
}
#endif
