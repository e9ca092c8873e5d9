//! The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS: super-blocks of 256 weights against
//! activations quantized per 256, with every scale applied to integers.
//!
//! A super-block's weights are `w = d·sc_g·(v - off) - dmin·mn_g` for its 16 groups `g` of 16
//! values: `v` small integers (0..63; IQ4_XS's levels -127..113), `sc_g` and `mn_g` small
//! integers, `d` and
//! `dmin` halves, `off` 32 for Q6_K, 4 for Q3_K and 0 for the others; the types with a
//! minimum (Q2_K, Q4_K, Q5_K) have no offset and the others no minimum. A row of `x` is
//! quantized per 256 values (`d_x = max|x| / 127`, 256 i8 `q`, and the sums `bs_g` of `q` over
//! each group of 16), so one super-block against one row of `x` is
//!
//! ```text
//!   Σ w·x = d·d_x·Σ_g sc_g·(Σ_{e∈g} v·q - off·bs_g)  -  dmin·d_x·Σ_g mn_g·bs_g
//! ```
//!
//! with both sums exact in 32-bit integers. They are kept in 8 lanes, lane `l` taking values
//! `4l .. 4l + 4` of each 32-value vector of the super-block and groups `2l`, `2l + 1` of the
//! offset and minimum sums (the lanes of AVX2's `maddubs` + `madd`). Then per super-block and
//! lane, in f32: `acc[l] = fma(I_l, d·d_x, acc[l])` and, with a minimum,
//! `acc[l] = fma(M_l, -(dmin·d_x), acc[l])`; the result is `reduce8(acc)`.
//!
//! NOTE: the integers are exact on every path, and the float operations are these, in this
//! order, everywhere; so the paths agree to the bit and a row's result does not depend on the
//! other rows of the batch. Integer sums: `maddubs` pairs are at most 2·127·127 (no i16
//! saturation; IQ4_XS's signed levels go in as |v| against q with v's sign), a lane at most
//! 8·4·63·127·128 < 2³¹.
//!
//! NOTE: llama.cpp's Q8_K does the same (256 activations per scale): against blocks of 32
//! activations with a float scale each, a K-quant row spent a float multiply-add per 32
//! values; here it spends two per 256.

use super::super::simd::reduce8;
use super::codes::*;
use crate::quant::IQ4_LEVELS;
use half::f16;
use rayon::prelude::*;

/// Rows of `x` quantized per 256 values: `q` `[m, k]`, the scales `d` `[m, k / 256]`, and the
/// sums of `q` per 16 values `bs` `[m, k / 16]`.
pub(super) struct Rows256 {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) bs: Vec<i16>,
    k: usize,
}

/// Quantizes `m` rows of `k` values (`k` a multiple of 256), each row on its own. `simd` asks
/// for the same code compiled with AVX2 (the same bits: it is the same IEEE arithmetic).
pub(super) fn quantize_rows256(simd: bool, x: &[f32], m: usize, k: usize) -> Rows256 {
    debug_assert!(k.is_multiple_of(256) && x.len() >= m * k);
    let mut r = Rows256 {
        q: vec![0; m * k],
        d: vec![0.0; m * k / 256],
        bs: vec![0; m * k / 16],
        k,
    };
    if m == 0 || k == 0 {
        return r;
    }
    type Row<'a> = ((&'a [f32], &'a mut [i8]), (&'a mut [f32], &'a mut [i16]));
    let row = |((x, q), (d, bs)): Row<'_>| {
        let blocks = x.chunks_exact(256).zip(q.chunks_exact_mut(256));
        for ((x, q), (d, bs)) in blocks.zip(d.iter_mut().zip(bs.chunks_exact_mut(16))) {
            let (x, q, bs) = (
                x.try_into().expect("256"),
                q.try_into().expect("256"),
                bs.try_into().expect("16"),
            );
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the caller asks for it only where AVX2 is available.
                *d = unsafe { quantize_sb_avx2(x, q, bs) };
                continue;
            }
            let _ = simd;
            *d = quantize_sb(x, q, bs);
        }
    };
    let rows = x[..m * k].par_chunks(k).zip(r.q.par_chunks_mut(k));
    let sums = r.d.par_chunks_mut(k / 256).zip(r.bs.par_chunks_mut(k / 16));
    if m >= 8 {
        rows.zip(sums).for_each(row);
    } else {
        // NOTE: a handful of rows is quicker on this thread than handed to the pool.
        let rows = x[..m * k].chunks(k).zip(r.q.chunks_mut(k));
        let sums = r.d.chunks_mut(k / 256).zip(r.bs.chunks_mut(k / 16));
        rows.zip(sums).for_each(row);
    }
    r
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_sb_avx2(x: &[f32; 256], q: &mut [i8; 256], bs: &mut [i16; 16]) -> f32 {
    quantize_sb(x, q, bs)
}

/// 256 activations to 8 bits: `q = round(x / d)` (ties to even) with `d = max|x| / 127`, and
/// the sums of each 16; returns `d`.
#[inline(always)]
fn quantize_sb(x: &[f32; 256], q: &mut [i8; 256], bs: &mut [i16; 16]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    for (s, g) in bs.iter_mut().zip(q.chunks_exact(16)) {
        *s = g.iter().map(|&v| v as i16).sum();
    }
    scale
}

/// `off` of the type (see the module's note).
const fn offset(t: u8) -> i32 {
    match t {
        Q6_K => 32,
        Q3_K => 4,
        _ => 0,
    }
}

/// Whether the values are signed (IQ4_XS's levels); the others' are never negative.
const fn signed(t: u8) -> bool {
    t == IQ4_XS
}

/// One weight row (`row`: its super-blocks) against the rows `i .. i + mr` of `x`, into
/// `r[..mr]`, on path `p` (available: the caller checked).
pub(super) fn run(p: Path, t: u8, mr: usize, row: &[u8], x: &Rows256, i: usize, r: &mut [f32; MR]) {
    macro_rules! by_type {
        ($f:ident, $mr:literal) => {
            match t {
                Q2_K => $f::<Q2_K, $mr>(row, x, i, r),
                Q3_K => $f::<Q3_K, $mr>(row, x, i, r),
                Q4_K => $f::<Q4_K, $mr>(row, x, i, r),
                Q5_K => $f::<Q5_K, $mr>(row, x, i, r),
                IQ4_XS => $f::<IQ4_XS, $mr>(row, x, i, r),
                _ => $f::<Q6_K, $mr>(row, x, i, r),
            }
        };
    }
    macro_rules! rows {
        ($f:ident, $($mr:literal)*) => {
            match mr {
                $($mr => by_type!($f, $mr),)*
                _ => by_type!($f, 1),
            }
        };
    }
    match p {
        Path::Portable => rows!(row_portable, 4 3 2),
        // SAFETY: the path is available, so the CPU has the features the kernels take.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { rows!(row_avx2, 4 3 2) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { rows!(row_vnni, 8 7 6 5 4 3 2) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => rows!(row_portable, 4 3 2),
    }
}

// ---------------------------------------------------------------------------------------------
// Portable: the reference for the others.

/// A super-block decoded: the scale `d`, the minimum's scale `dmin`, per group of 16 the scale
/// and the minimum, and the 256 values.
struct Decoded {
    d: f32,
    dmin: f32,
    sc: [i16; 16],
    mn: [i16; 16],
    v: [i8; 256],
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The super-block `b` of type `t`, as ggml's layouts store it.
fn decode(t: u8, b: &[u8]) -> Decoded {
    let mut s = Decoded {
        d: 0.0,
        dmin: 0.0,
        sc: [0; 16],
        mn: [0; 16],
        v: [0; 256],
    };
    match t {
        Q2_K => {
            (s.d, s.dmin) = (f16_at(b, 80), f16_at(b, 82));
            for ((sc, mn), &byte) in s.sc.iter_mut().zip(&mut s.mn).zip(&b[..16]) {
                (*sc, *mn) = ((byte & 0x0F) as i16, (byte >> 4) as i16);
            }
            for (e, v) in s.v.iter_mut().enumerate() {
                let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
                *v = ((b[16 + 32 * h + l] >> (2 * j)) & 3) as i8;
            }
        }
        Q3_K => {
            s.d = f16_at(b, 108);
            let sc = &b[96..108];
            for g in 0..16 {
                let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
                let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                s.sc[g] = (low | (high << 4)) as i16 - 32;
            }
            for (e, v) in s.v.iter_mut().enumerate() {
                let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
                let low = (b[32 + 32 * h + l] >> (2 * j)) & 3;
                // v - 4 is the value: the high bit set means no -4.
                *v = (low | (((b[l] >> (e / 32)) & 1) << 2)) as i8;
            }
        }
        IQ4_XS => {
            s.d = f16_at(b, 0);
            let high = u16::from_le_bytes([b[2], b[3]]);
            for j in 0..8 {
                let low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
                let sc = (low | ((((high >> (2 * j)) & 3) as u8) << 4)) as i16 - 32;
                (s.sc[2 * j], s.sc[2 * j + 1]) = (sc, sc);
                for l in 0..16 {
                    let q = b[8 + 16 * j + l];
                    s.v[32 * j + l] = IQ4_LEVELS[(q & 0x0F) as usize];
                    s.v[32 * j + l + 16] = IQ4_LEVELS[(q >> 4) as usize];
                }
            }
        }
        Q4_K | Q5_K => {
            (s.d, s.dmin) = (f16_at(b, 0), f16_at(b, 2));
            let qs = if t == Q4_K { &b[16..144] } else { &b[48..176] };
            for j in 0..8 {
                let (sc, mn) = k_scale_min(j, &b[4..16]);
                (s.sc[2 * j], s.sc[2 * j + 1]) = (sc as i16, sc as i16);
                (s.mn[2 * j], s.mn[2 * j + 1]) = (mn as i16, mn as i16);
                for l in 0..32 {
                    let mut v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
                    if t == Q5_K {
                        v |= ((b[16 + l] >> j) & 1) << 4;
                    }
                    s.v[32 * j + l] = v as i8;
                }
            }
        }
        _ => {
            s.d = f16_at(b, 208);
            for g in 0..16 {
                s.sc[g] = b[192 + g] as i8 as i16;
            }
            for (e, v) in s.v.iter_mut().enumerate() {
                let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
                let low = (b[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0x0F;
                let high = (b[128 + 32 * h + l] >> (2 * j)) & 3;
                *v = (low | (high << 4)) as i8;
            }
        }
    }
    s
}

#[allow(clippy::needless_range_loop)]
fn row_portable<const T: u8, const R: usize>(row: &[u8], x: &Rows256, i: usize, r: &mut [f32; MR]) {
    let (k, nsb) = (x.k, x.k / 256);
    let bytes = row.len() / nsb;
    let mut acc = [[0f32; 8]; R];
    for sb in 0..nsb {
        let s = decode(T, &row[sb * bytes..][..bytes]);
        for a in 0..R {
            let q = &x.q[(i + a) * k + 256 * sb..][..256];
            let bs = &x.bs[(i + a) * k / 16 + 16 * sb..][..16];
            let dx = x.d[(i + a) * nsb + sb];
            for l in 0..8 {
                let mut il = 0i32;
                for vv in 0..8 {
                    for e in 32 * vv + 4 * l..32 * vv + 4 * l + 4 {
                        il += s.sc[e / 16] as i32 * (s.v[e] as i32 * q[e] as i32);
                    }
                }
                let pair = |c: &[i16; 16]| {
                    c[2 * l] as i32 * bs[2 * l] as i32 + c[2 * l + 1] as i32 * bs[2 * l + 1] as i32
                };
                il -= offset(T) * pair(&s.sc);
                acc[a][l] = (il as f32).mul_add(s.d * dx, acc[a][l]);
                if has_min(T) {
                    acc[a][l] = (pair(&s.mn) as f32).mul_add(-(s.dmin * dx), acc[a][l]);
                }
            }
        }
    }
    for a in 0..R {
        r[a] = reduce8(&acc[a]);
    }
}

// ---------------------------------------------------------------------------------------------
// x86-64: the same in registers.

#[cfg(target_arch = "x86_64")]
use x86::{row_avx2, row_vnni};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::codes::*;
    use super::super::x86::{f16_at, hsum, levels};
    use super::{MR, Rows256, offset, signed};
    use std::arch::x86_64::*;

    /// A super-block's header: `d`, `dmin`, and the 16 groups' scales and minimums as i16.
    struct Head {
        d: f32,
        dmin: f32,
        sc: __m256i,
        mn: __m256i,
    }

    #[inline(always)]
    unsafe fn u32_at(b: *const u8, i: usize) -> u32 {
        // SAFETY: the caller's block holds bytes i .. i + 4.
        unsafe { (b.add(i) as *const u32).read_unaligned() }
    }

    /// The header of the super-block at `b` (a whole block of type T).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn head<const T: u8>(b: *const u8) -> Head {
        // SAFETY (all loads): `b` is a whole block of type T, whose layout the offsets follow.
        unsafe {
            let zero = _mm256_setzero_si256();
            let nib = _mm_set1_epi8(0x0F);
            match T {
                Q2_K => {
                    let s = _mm_loadu_si128(b as *const __m128i);
                    Head {
                        d: f16_at(b, 80),
                        dmin: f16_at(b, 82),
                        sc: _mm256_cvtepu8_epi16(_mm_and_si128(s, nib)),
                        mn: _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(s), nib)),
                    }
                }
                Q3_K => {
                    // Groups 4i .. 4i + 4 take their low 4 bits from word i % 2 (shifted by
                    // 4 for i >= 2) and their high 2 from word 2 shifted by 2i.
                    let (w0, w1, w2) = (u32_at(b, 96), u32_at(b, 100), u32_at(b, 104));
                    let (m4, m2) = (0x0F0F_0F0Fu32, 0x0303_0303u32);
                    let g = |low: u32, i: u32| (low & m4) | (((w2 >> (2 * i)) & m2) << 4);
                    let lo = (g(w0, 0) as u64) | ((g(w1, 1) as u64) << 32);
                    let hi = (g(w0 >> 4, 2) as u64) | ((g(w1 >> 4, 3) as u64) << 32);
                    let s = _mm_set_epi64x(hi as i64, lo as i64);
                    let sc = _mm256_sub_epi16(_mm256_cvtepu8_epi16(s), _mm256_set1_epi16(32));
                    Head {
                        d: f16_at(b, 108),
                        dmin: 0.0,
                        sc,
                        mn: zero,
                    }
                }
                Q4_K | Q5_K => {
                    // The 6-bit (scale, min) pairs of `k_scale_min` from the 12 bytes
                    // s[0..12] at b + 4, as bytes [sc0..sc7, mn0..mn7]: sc_j = s[j] & 63 and
                    // mn_j = s[4 + j] & 63 for j < 4; sc_{4+j} = (s[8 + j] & 15) |
                    // (s[j] >> 6) << 4 and mn_{4+j} = (s[8 + j] >> 4) | (s[4 + j] >> 6) << 4.
                    let x = _mm_loadu_si128(b as *const __m128i);
                    let z = -1;
                    let low = _mm_shuffle_epi8(
                        x,
                        _mm_setr_epi8(4, 5, 6, 7, z, z, z, z, 8, 9, 10, 11, z, z, z, z),
                    );
                    let top = _mm_shuffle_epi8(
                        x,
                        _mm_setr_epi8(z, z, z, z, 4, 5, 6, 7, z, z, z, z, 8, 9, 10, 11),
                    );
                    let nib = _mm_shuffle_epi8(
                        x,
                        _mm_setr_epi8(z, z, z, z, 12, 13, 14, 15, z, z, z, z, z, z, z, z),
                    );
                    let nib_hi = _mm_shuffle_epi8(
                        x,
                        _mm_setr_epi8(z, z, z, z, z, z, z, z, z, z, z, z, 12, 13, 14, 15),
                    );
                    let s = _mm_or_si128(
                        _mm_or_si128(
                            _mm_and_si128(low, _mm_set1_epi8(63)),
                            _mm_and_si128(_mm_srli_epi16::<2>(top), _mm_set1_epi8(0x30)),
                        ),
                        _mm_or_si128(
                            _mm_and_si128(nib, _mm_set1_epi8(0x0F)),
                            _mm_and_si128(_mm_srli_epi16::<4>(nib_hi), _mm_set1_epi8(0x0F)),
                        ),
                    );
                    // one per 32 values: each twice, one per group of 16
                    Head {
                        d: f16_at(b, 0),
                        dmin: f16_at(b, 2),
                        sc: _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s)),
                        mn: _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s, s)),
                    }
                }
                IQ4_XS => {
                    // Scale j: nibble j of the u32 at 4, and bits 2j, 2j + 1 of the u16 at 2
                    // above it, spread to byte j.
                    let high = (b.add(2) as *const u16).read_unaligned() as u64;
                    let high = (high | (high << 24)) & 0x0000_00FF_0000_00FF;
                    let high = (high | (high << 12)) & 0x000F_000F_000F_000F;
                    let high = (high | (high << 6)) & 0x0303_0303_0303_0303;
                    let low = u32_at(b, 4) as u64;
                    let low = (low | (low << 16)) & 0x0000_FFFF_0000_FFFF;
                    let low = (low | (low << 8)) & 0x00FF_00FF_00FF_00FF;
                    let low = (low | (low << 4)) & 0x0F0F_0F0F_0F0F_0F0F;
                    let s = _mm_cvtsi64_si128((low | (high << 4)) as i64);
                    let sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s));
                    Head {
                        d: f16_at(b, 0),
                        dmin: 0.0,
                        sc: _mm256_sub_epi16(sc, _mm256_set1_epi16(32)),
                        mn: zero,
                    }
                }
                _ => Head {
                    d: f16_at(b, 208),
                    dmin: 0.0,
                    sc: _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i)),
                    mn: zero,
                },
            }
        }
    }

    /// Values `64c .. 64c + 64` of the super-block at `b`: two vectors of 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair<const T: u8>(b: *const u8, c: usize) -> (__m256i, __m256i) {
        // SAFETY (every load): `b` is a whole block of type T, whose layout the offsets
        // follow.
        macro_rules! load {
            ($at:expr) => {
                unsafe { _mm256_loadu_si256(b.add($at) as *const __m256i) }
            };
        }
        macro_rules! shr {
            ($v:expr, $n:expr) => {
                _mm256_srl_epi16($v, _mm_cvtsi32_si128(($n) as i32))
            };
        }
        match T {
            Q2_K | Q3_K => {
                let at = if T == Q2_K { 16 } else { 32 };
                let x = load!(at + 32 * (c / 2));
                let j = 2 * (c % 2);
                let v0 = _mm256_and_si256(shr!(x, 2 * j), _mm256_set1_epi8(3));
                let v1 = _mm256_and_si256(shr!(x, 2 * j + 2), _mm256_set1_epi8(3));
                if T == Q2_K {
                    return (v0, v1);
                }
                // The high bit of values 32·j' .. of half h is bit 4h + j' of hmask.
                let hb = shr!(load!(0), 4 * (c / 2) + j);
                let h0 = _mm256_and_si256(_mm256_slli_epi16::<2>(hb), _mm256_set1_epi8(4));
                let h1 = _mm256_and_si256(_mm256_slli_epi16::<1>(hb), _mm256_set1_epi8(4));
                (_mm256_or_si256(v0, h0), _mm256_or_si256(v1, h1))
            }
            IQ4_XS => {
                // Sub-block j's 16 bytes: its low nibbles, then its high ones.
                let x = load!(8 + 32 * c);
                let lo = _mm256_and_si256(x, _mm256_set1_epi8(0x0F));
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), _mm256_set1_epi8(0x0F));
                let v0 = _mm256_permute2x128_si256::<0x20>(lo, hi);
                let v1 = _mm256_permute2x128_si256::<0x31>(lo, hi);
                (levels(v0), levels(v1))
            }
            Q4_K | Q5_K => {
                let at = if T == Q4_K { 16 } else { 48 };
                let x = load!(at + 32 * c);
                let v0 = _mm256_and_si256(x, _mm256_set1_epi8(0x0F));
                let v1 = _mm256_and_si256(_mm256_srli_epi16::<4>(x), _mm256_set1_epi8(0x0F));
                if T == Q4_K {
                    return (v0, v1);
                }
                let hb = shr!(load!(16), 2 * c);
                let h0 = _mm256_and_si256(_mm256_slli_epi16::<4>(hb), _mm256_set1_epi8(0x10));
                let h1 = _mm256_and_si256(_mm256_slli_epi16::<3>(hb), _mm256_set1_epi8(0x10));
                (_mm256_or_si256(v0, h0), _mm256_or_si256(v1, h1))
            }
            _ => {
                let h = c / 2;
                let (l0, l1) = (load!(64 * h), load!(64 * h + 32));
                let qh = load!(128 + 32 * h);
                let (m, nib) = (_mm256_set1_epi8(0x30), _mm256_set1_epi8(0x0F));
                if c.is_multiple_of(2) {
                    let v0 = _mm256_or_si256(
                        _mm256_and_si256(l0, nib),
                        _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m),
                    );
                    let v1 = _mm256_or_si256(
                        _mm256_and_si256(l1, nib),
                        _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m),
                    );
                    (v0, v1)
                } else {
                    let v0 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l0), nib),
                        _mm256_and_si256(qh, m),
                    );
                    let v1 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), nib),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m),
                    );
                    (v0, v1)
                }
            }
        }
    }

    /// Shuffle controls: vector `vv` (4 · 2 groups of scales per 128-bit broadcast) takes group
    /// `2vv` in its low half and `2vv + 1` in its high half.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ctrl(vv: usize) -> __m256i {
        let (a, b) = ((4 * vv) as i8, (4 * vv + 2) as i8);
        _mm256_setr_epi8(
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
        )
    }

    /// The kernel, once per instruction set: `$dot(acc, p, s)` adds the i16 pairs of `p`
    /// times `s` to the 8 i32 lanes of `acc`.
    macro_rules! kernel {
        ($name:ident, $features:literal, |$acc:ident, $p:ident, $s:ident| $dot:expr) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const T: u8, const R: usize>(
                row: &[u8],
                x: &Rows256,
                i: usize,
                r: &mut [f32; MR],
            ) {
                let (k, nsb) = (x.k, x.k / 256);
                let bytes = row.len() / nsb;
                let ctrls = [ctrl(0), ctrl(1), ctrl(2), ctrl(3)];
                let mut acc = [_mm256_setzero_ps(); R];
                for sb in 0..nsb {
                    // SAFETY: super-block sb lies in the row; rows i .. i + R of x hold k
                    // values, k / 16 sums and k / 256 scales each.
                    unsafe {
                        let b = row.as_ptr().add(sb * bytes);
                        let h = head::<T>(b);
                        let lo = _mm256_permute2x128_si256::<0x00>(h.sc, h.sc);
                        let hi = _mm256_permute2x128_si256::<0x11>(h.sc, h.sc);
                        // NOTE: two sums per row (even and odd vectors), added at the end: one
                        // chain of 8 dependent dpwssd per super-block bounded batch-1 decode.
                        let mut isum = [[_mm256_setzero_si256(); 2]; R];
                        for c in 0..4 {
                            let (v0, v1) = pair::<T>(b, c);
                            let g = if c < 2 { lo } else { hi };
                            let s0 = _mm256_shuffle_epi8(g, ctrls[(2 * c) % 4]);
                            let s1 = _mm256_shuffle_epi8(g, ctrls[(2 * c + 1) % 4]);
                            for (a, isum) in isum.iter_mut().enumerate() {
                                let q = x.q.as_ptr().add((i + a) * k + 256 * sb + 64 * c);
                                let q0 = _mm256_loadu_si256(q as *const __m256i);
                                let q1 = _mm256_loadu_si256(q.add(32) as *const __m256i);
                                let (p0, p1) = if signed(T) {
                                    let (u0, u1) = (_mm256_abs_epi8(v0), _mm256_abs_epi8(v1));
                                    let (q0, q1) =
                                        (_mm256_sign_epi8(q0, v0), _mm256_sign_epi8(q1, v1));
                                    (_mm256_maddubs_epi16(u0, q0), _mm256_maddubs_epi16(u1, q1))
                                } else {
                                    (_mm256_maddubs_epi16(v0, q0), _mm256_maddubs_epi16(v1, q1))
                                };
                                let ($acc, $p, $s) = (isum[0], p0, s0);
                                isum[0] = $dot;
                                let ($acc, $p, $s) = (isum[1], p1, s1);
                                isum[1] = $dot;
                            }
                        }
                        for (a, acc) in acc.iter_mut().enumerate() {
                            let bs = x.bs.as_ptr().add((i + a) * k / 16 + 16 * sb);
                            let bs = _mm256_loadu_si256(bs as *const __m256i);
                            let mut l = _mm256_add_epi32(isum[a][0], isum[a][1]);
                            if offset(T) == 32 {
                                let o = _mm256_madd_epi16(h.sc, bs);
                                l = _mm256_sub_epi32(l, _mm256_slli_epi32::<5>(o));
                            } else if offset(T) == 4 {
                                let o = _mm256_madd_epi16(h.sc, bs);
                                l = _mm256_sub_epi32(l, _mm256_slli_epi32::<2>(o));
                            }
                            let dx = *x.d.as_ptr().add((i + a) * nsb + sb);
                            let f = _mm256_set1_ps(h.d * dx);
                            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), f, *acc);
                            if has_min(T) {
                                let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(h.mn, bs));
                                *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(-(h.dmin * dx)), *acc);
                            }
                        }
                    }
                }
                for (a, acc) in acc.iter().enumerate() {
                    r[a] = hsum(*acc);
                }
            }
        };
    }

    kernel!(row_avx2, "avx2,fma,f16c", |acc, p, s| _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(p, s)
    ));
    kernel!(
        row_vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        |acc, p, s| _mm256_dpwssd_epi32(acc, p, s)
    );
}
