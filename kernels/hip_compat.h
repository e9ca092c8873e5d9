// Lets the CUDA sources in kernels/ build with hipRTC (as ggml builds its CUDA sources for
// HIP): placed before common.cuh when the HIP backend compiles a file. Only what the kernels
// use is mapped; everything else (__global__, __shared__, threadIdx, __syncthreads, __ldg,
// expf, __float_as_uint, ...) has the same spelling in HIP.
#pragma once
#define PG_HIP 1

#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif

// HIP's shuffles take no mask; the width is the whole wavefront.
#define PG_SHFL_XOR(v, m) __shfl_xor((v), (m))

// Half precision through clang's _Float16 instead of PTX's cvt instructions.
__device__ __forceinline__ float f16_bits_to_f32(unsigned int bits) {
    unsigned short h = (unsigned short)bits;
    _Float16 v;
    __builtin_memcpy(&v, &h, 2);
    return (float)v;
}
__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    _Float16 v = (_Float16)f;
    unsigned short h;
    __builtin_memcpy(&h, &v, 2);
    return h;
}
