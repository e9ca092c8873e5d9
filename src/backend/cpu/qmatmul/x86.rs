//! x86-64: the quantized blocks decoded in registers (AVX2, AVX-512), as the portable path
//! decodes them, and the integer dots.

use super::codes::{IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1};
use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_at(b: *const u8, i: usize) -> f32 {
    _mm256_cvtss_f32(f16x8(b, i))
}

/// The half at byte `i`, in all 8 lanes.
///
/// NOTE: a scale must come from a broadcast whose lanes are all used: loading only lane 0
/// (`_mm_cvtsi32_si128`), LLVM inserted the half with `vpinsrw` into whatever register was
/// free, often an accumulator, so that each block's scale waited for the previous block's
/// FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x8(b: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller's block holds bytes i and i + 1 (x86 is little-endian).
    let bits = unsafe { (b.add(i) as *const u16).read_unaligned() };
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

/// 16 bytes of nibble pairs: the 16 low nibbles, then the 16 high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's block holds 16 bytes at p.
    let b = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let m = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(b), m),
        _mm_and_si128(b, m),
    )
}

/// IQ4's non-uniform levels of 32 nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn levels(nib: __m256i) -> __m256i {
    // SAFETY: 16 bytes of the table.
    let t = unsafe { _mm_loadu_si128(crate::quant::IQ4_LEVELS.as_ptr() as *const __m128i) };
    _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), nib)
}

/// Byte `e` is 16 where bit `e` of `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit16(qh: u32) -> __m256i {
    let q = _mm256_set1_epi32(qh as i32);
    let shuf = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(q, shuf), mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn u32_at(b: *const u8) -> u32 {
    // SAFETY: the caller's block holds 4 bytes at b.
    unsafe { (b as *const u32).read_unaligned() }
}

/// [`super::decode`] in registers: values, the scale in 8 lanes, the minimum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode<const T: u8>(b: *const u8) -> (__m256i, __m256, f32) {
    // SAFETY (all loads): `b` is a whole block of type T, whose layout the offsets follow.
    unsafe {
        match T {
            Q4_0 => {
                let v = _mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8));
                (v, f16x8(b, 0), 0.0)
            }
            Q4_1 => (nibbles(b.add(4)), f16x8(b, 0), f16_at(b, 2)),
            IQ4_NL => (levels(nibbles(b.add(2))), f16x8(b, 0), 0.0),
            Q5_0 => {
                let u = _mm256_or_si256(nibbles(b.add(6)), bit16(u32_at(b.add(2))));
                let v = _mm256_sub_epi8(u, _mm256_set1_epi8(16));
                (v, f16x8(b, 0), 0.0)
            }
            Q5_1 => {
                let u = _mm256_or_si256(nibbles(b.add(8)), bit16(u32_at(b.add(4))));
                (u, f16x8(b, 0), f16_at(b, 2))
            }
            _ => {
                let v = _mm256_loadu_si256(b.add(2) as *const __m256i);
                (v, f16x8(b, 0), 0.0)
            }
        }
    }
}

/// [`super::quantize_block`] with 8-lane vectors: the same maximum, division, products,
/// rounding (ties to even) and clamp, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_block(
    x: &[f32; 32],
    q: &mut [i8; 32],
    u: &mut [u8; 32],
) -> (f32, i32) {
    // SAFETY (loads and stores): x, q and u hold 32 values each.
    unsafe {
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let a = v.map(|v| _mm256_and_ps(v, abs));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<1>(h, h)));
        let scale = amax / 127.0;
        let inv = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let i = v.map(|v| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(v, inv),
            );
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)));
        // packs works within 128-bit lanes: the permute puts the 4-value groups back in
        // order.
        let b = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
        let b = _mm256_xor_si256(b, _mm256_set1_epi8(-128));
        _mm256_storeu_si256(u.as_mut_ptr() as *mut __m256i, b);
        (scale, sum)
    }
}

pub(super) use super::super::simd::hsum8 as hsum;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_avx2(u: __m256i, q: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1))
}
