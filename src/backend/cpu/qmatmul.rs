//! `y = x · Wᵀ` with `W` kept in its GGML block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
//! Q5_K, Q6_K), for the CPU backend.
//!
//! The scheme is llama.cpp's; the code is ours. Each row of `x` is quantized to 8 bits per
//! block of 32 values (a scale `d = max|x| / 127`, 32 i8 `q`, and `d·Σq`). A weight row is
//! walked 32 values at a time; each 32-value sub-block is decoded in registers into 32 small
//! integers `v`, a scale per 16 values and a minimum, so that `w = scale·v + min` exactly as
//! the reference dequantizer computes it; then
//!
//! ```text
//!   y += (scale · d) · Σ v·q        8 lanes of 4 products each, f32 FMA per lane
//!      + min · (d·Σq)                 one scalar FMA, types with a minimum only
//! ```
//!
//! The integer dot `Σ v·q` is exact: AVX2 `maddubs` (|v| ≤ 128 and |q| ≤ 127 never saturate
//! its i16 pairs) or VNNI `dpbusd`; signed `v` go through the sign trick (`|v|` times `q` with
//! `v`'s sign).
//!
//! NOTE: every path computes every output element with the same f32 operations in the same
//! order — the lanes' FMAs block after block, one fixed reduction of the 8 lanes, then the
//! minimum's sum — and the integer sums are exact. So the paths agree to the bit, and a row's
//! result does not depend on the other rows of the batch (batch invariance, as in matmul.rs).
//!
//! Tiles: one weight row against MR rows of `x`: the row is decoded once per tile, the MR
//! accumulators stay in registers. Weight rows are split into slabs of SLAB rows for the
//! threads; a slab stays in L2 while every tile of `x` passes over it.

use crate::quant::{GgmlType, QuantTensor};
use half::f16;
use rayon::prelude::*;

/// Weight rows per parallel task.
const SLAB: usize = 32;
/// Rows of `x` per tile.
const MR: usize = 4;

/// A kernel implementation; [`Path::detect`] picks the best the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Plain Rust: the reference for the others, and the path on non-x86 CPUs.
    Portable,
    /// AVX2 + FMA + F16C (`maddubs` integer dots).
    Avx2,
    /// AVX-512 VNNI on 256-bit vectors (`dpbusd` integer dots).
    Vnni,
}

impl Path {
    /// The fastest path this CPU runs.
    pub fn detect() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if Path::Avx2.available() && has!("avx512vnni") && has!("avx512vl") {
                return Path::Vnni;
            }
            if Path::Avx2.available() {
                return Path::Avx2;
            }
        }
        Path::Portable
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                use std::arch::is_x86_feature_detected as has;
                has!("avx2") && has!("fma") && has!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Vnni => {
                use std::arch::is_x86_feature_detected as has;
                Path::Avx2.available() && has!("avx512vnni") && has!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Portable => "portable",
            Path::Avx2 => "avx2",
            Path::Vnni => "avx512-vnni",
        }
    }
}

/// The path chosen once per process.
pub fn path() -> Path {
    static PATH: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
    *PATH.get_or_init(Path::detect)
}

// Type codes for the const-generic kernels.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;
const Q4_K: u8 = 5;
const Q5_K: u8 = 6;
const Q6_K: u8 = 7;

fn code(ty: GgmlType) -> Option<u8> {
    Some(match ty {
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        GgmlType::Q5_0 => Q5_0,
        GgmlType::Q5_1 => Q5_1,
        GgmlType::Q8_0 => Q8_0,
        GgmlType::Q4_K => Q4_K,
        GgmlType::Q5_K => Q5_K,
        GgmlType::Q6_K => Q6_K,
        _ => return None,
    })
}

/// Bytes of one block of the type.
const fn block_bytes(t: u8) -> usize {
    match t {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        Q8_0 => 34,
        Q4_K => 144,
        Q5_K => 176,
        _ => 210,
    }
}

/// 32-value sub-blocks per block.
const fn subs(t: u8) -> usize {
    if t >= Q4_K { 8 } else { 1 }
}

/// Whether the decoded values are never negative (and the type has a minimum): they go to
/// the integer dot as they are, without the sign trick.
const fn unsigned(t: u8) -> bool {
    matches!(t, Q4_1 | Q5_1 | Q4_K | Q5_K)
}

/// Rows of `x` quantized per block of 32: `q` `[m, k]`, `d` and `s = d·Σq` `[m, k/32]`.
pub struct QuantizedRows {
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

/// Quantizes `m` rows of `k` values (`k` a multiple of 32), each row on its own.
pub fn quantize_rows(x: &[f32], m: usize, k: usize) -> QuantizedRows {
    debug_assert!(k.is_multiple_of(32) && x.len() >= m * k);
    let nb = k / 32;
    let mut r = QuantizedRows {
        q: vec![0; m * k],
        d: vec![0.0; m * nb],
        s: vec![0.0; m * nb],
    };
    let row = |(((x, q), d), s): (((&[f32], &mut [i8]), &mut [f32]), &mut [f32])| {
        for b in 0..nb {
            let xs = &x[32 * b..32 * b + 32];
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (o, &v) in q[32 * b..32 * b + 32].iter_mut().zip(xs) {
                let qv = (v * inv).round().clamp(-127.0, 127.0) as i32;
                *o = qv as i8;
                sum += qv;
            }
            d[b] = scale;
            s[b] = scale * sum as f32;
        }
    };
    let k1 = k.max(1);
    let nb1 = nb.max(1);
    if m >= 8 {
        x[..m * k]
            .par_chunks(k1)
            .zip(r.q.par_chunks_mut(k1))
            .zip(r.d.par_chunks_mut(nb1))
            .zip(r.s.par_chunks_mut(nb1))
            .for_each(row);
    } else {
        x[..m * k]
            .chunks(k1)
            .zip(r.q.chunks_mut(k1))
            .zip(r.d.chunks_mut(nb1))
            .zip(r.s.chunks_mut(nb1))
            .for_each(row);
    }
    r
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` on the detected path.
pub fn qmatmul(x: &[f32], m: usize, k: usize, n: usize, out: &mut [f32], w: &QuantTensor) {
    qmatmul_on(path(), x, m, k, n, out, w)
}

/// The same on a given path (tests force each one); falls back to the portable path where the
/// CPU lacks it.
pub fn qmatmul_on(
    p: Path,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    w: &QuantTensor,
) {
    assert!(x.len() >= m * k && out.len() >= m * n);
    assert!(w.k == k && w.rows() == n && k.is_multiple_of(32));
    let p = if p.available() { p } else { Path::Portable };
    let xq = quantize_rows(x, m, k);
    // (part, first output column, first row in the part, rows)
    let mut tasks = Vec::new();
    let mut col = 0;
    for (pi, part) in w.parts.iter().enumerate() {
        for r in (0..part.rows).step_by(SLAB) {
            tasks.push((pi, col + r, r, SLAB.min(part.rows - r)));
        }
        col += part.rows;
    }
    let out_ptr = SendPtr(out.as_mut_ptr());
    tasks.into_par_iter().for_each(|(pi, j0, r0, nj)| {
        let part = &w.parts[pi];
        let t = code(part.ty).expect("QuantTensor holds kernel types only");
        let rb = part.data.len() / part.rows;
        let nb = k / 32;
        let o = out_ptr;
        let mut i = 0;
        while i < m {
            let mr = MR.min(m - i);
            let tile = Tile {
                q: &xq.q[i * k..(i + mr) * k],
                d: &xq.d[i * nb..(i + mr) * nb],
                s: &xq.s[i * nb..(i + mr) * nb],
                k,
            };
            for jj in 0..nj {
                let row = &part.data[(r0 + jj) * rb..(r0 + jj + 1) * rb];
                let mut r = [0f32; MR];
                run(p, t, mr, row, tile, &mut r);
                for (a, v) in r[..mr].iter().enumerate() {
                    // SAFETY: this task alone writes columns j0 .. j0 + nj of `out` (m rows of
                    // stride n), and i + a < m.
                    unsafe { *o.0.add((i + a) * n + j0 + jj) = *v };
                }
            }
            i += mr;
        }
    });
}

/// MR (or fewer) quantized rows of `x`.
#[derive(Clone, Copy)]
struct Tile<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    k: usize,
}

/// One weight row against the tile's `mr` rows, into `r[..mr]`.
fn run(p: Path, t: u8, mr: usize, row: &[u8], x: Tile<'_>, r: &mut [f32; MR]) {
    macro_rules! by_type {
        ($f:ident, $mr:literal) => {
            match t {
                Q4_0 => $f::<Q4_0, $mr>(row, x, r),
                Q4_1 => $f::<Q4_1, $mr>(row, x, r),
                Q5_0 => $f::<Q5_0, $mr>(row, x, r),
                Q5_1 => $f::<Q5_1, $mr>(row, x, r),
                Q8_0 => $f::<Q8_0, $mr>(row, x, r),
                Q4_K => $f::<Q4_K, $mr>(row, x, r),
                Q5_K => $f::<Q5_K, $mr>(row, x, r),
                _ => $f::<Q6_K, $mr>(row, x, r),
            }
        };
    }
    macro_rules! by_rows {
        ($f:ident) => {
            match mr {
                4 => by_type!($f, 4),
                3 => by_type!($f, 3),
                2 => by_type!($f, 2),
                _ => by_type!($f, 1),
            }
        };
    }
    match p {
        Path::Portable => by_rows!(row_portable),
        // SAFETY: the path is available (checked by the caller), so the CPU has the features
        // the kernels are compiled for.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { by_rows!(row_avx2) },
        #[cfg(target_arch = "x86_64")]
        Path::Vnni => unsafe { by_rows!(row_vnni) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => by_rows!(row_portable),
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding one 32-value sub-block, portable.

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q4_K / Q5_K: the 6-bit (scale, min) of sub-block `j` from the 12 packed bytes.
#[inline(always)]
fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Sub-block `s` of the block `b`: values `v`, the scale of each half, and the minimum, with
/// `w = scale·v + min` as the reference dequantizer computes it.
#[inline(always)]
fn decode(t: u8, b: &[u8], s: usize) -> ([i8; 32], [f32; 2], f32) {
    let mut v = [0i8; 32];
    // The 32 nibbles of 16 bytes: low ones first.
    let nib = |v: &mut [i8; 32], qs: &[u8]| {
        for j in 0..16 {
            v[j] = (qs[j] & 0x0F) as i8;
            v[j + 16] = (qs[j] >> 4) as i8;
        }
    };
    // Value e's fifth bit is bit e of qh.
    let high = |v: &mut [i8; 32], qh: u32| {
        for (e, x) in v.iter_mut().enumerate() {
            *x |= (((qh >> e) & 1) as i8) << 4;
        }
    };
    let sub = |v: &mut [i8; 32], off: i8| v.iter_mut().for_each(|x| *x -= off);
    match t {
        Q4_0 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[2..18]);
            sub(&mut v, 8);
            (v, [d, d], 0.0)
        }
        Q4_1 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[4..20]);
            (v, [d, d], f16_at(b, 2))
        }
        Q5_0 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[6..22]);
            high(&mut v, u32::from_le_bytes([b[2], b[3], b[4], b[5]]));
            sub(&mut v, 16);
            (v, [d, d], 0.0)
        }
        Q5_1 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[8..24]);
            high(&mut v, u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
            (v, [d, d], f16_at(b, 2))
        }
        Q8_0 => {
            let d = f16_at(b, 0);
            for (x, &q) in v.iter_mut().zip(&b[2..34]) {
                *x = q as i8;
            }
            (v, [d, d], 0.0)
        }
        Q4_K | Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, mn) = k_scale_min(s, &b[4..16]);
            let (c, shift) = (s / 2, 4 * (s % 2));
            let qs = if t == Q4_K { &b[16..144] } else { &b[48..176] };
            for (l, x) in v.iter_mut().enumerate() {
                let mut q = (qs[c * 32 + l] >> shift) & 0x0F;
                if t == Q5_K {
                    q |= ((b[16 + l] >> s) & 1) << 4;
                }
                *x = q as i8;
            }
            let a = d * sc as f32;
            (v, [a, a], -(dmin * mn as f32))
        }
        _ => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            let (h, lshift, hshift) = (s / 4, 4 * ((s % 4) / 2), 2 * (s % 4));
            for (l, x) in v.iter_mut().enumerate() {
                let low = (ql[h * 64 + 32 * (s % 2) + l] >> lshift) & 0x0F;
                let hi = (qh[h * 32 + l] >> hshift) & 3;
                *x = (low | (hi << 4)) as i8 - 32;
            }
            let lo = d * (sc[2 * s] as i8) as f32;
            let hi = d * (sc[2 * s + 1] as i8) as f32;
            (v, [lo, hi], 0.0)
        }
    }
}

/// One fixed pairwise order for the 8 lanes (the SIMD reductions follow it).
#[inline(always)]
fn reduce8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

#[allow(clippy::needless_range_loop)]
fn row_portable<const T: u8, const R: usize>(row: &[u8], x: Tile<'_>, r: &mut [f32; MR]) {
    let nb = x.k / 32;
    let mut acc = [[0f32; 8]; R];
    let mut macc = [0f32; R];
    for (blk, b) in row.chunks_exact(block_bytes(T)).enumerate() {
        for s in 0..subs(T) {
            let j = blk * subs(T) + s;
            let (v, scale, min) = decode(T, b, s);
            for a in 0..R {
                let q = &x.q[a * x.k + 32 * j..a * x.k + 32 * j + 32];
                let dx = x.d[a * nb + j];
                for l in 0..8 {
                    let isum: i32 = (4 * l..4 * l + 4).map(|e| v[e] as i32 * q[e] as i32).sum();
                    let f = scale[l / 4] * dx;
                    acc[a][l] = (isum as f32).mul_add(f, acc[a][l]);
                }
                if unsigned(T) {
                    macc[a] = min.mul_add(x.s[a * nb + j], macc[a]);
                }
            }
        }
    }
    for a in 0..R {
        r[a] = reduce8(&acc[a]) + macc[a];
    }
}

// ---------------------------------------------------------------------------------------------
// x86-64: the same decode in registers, and the kernel with two integer dots.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16_at(b: *const u8, i: usize) -> f32 {
        // SAFETY: the caller's block holds bytes i and i + 1.
        let bits = unsafe { u16::from_le_bytes([*b.add(i), *b.add(i + 1)]) };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
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

    /// Byte `e` is 16 where bit `e` of `qh` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bit16(qh: u32) -> __m256i {
        let q = _mm256_set1_epi32(qh as i32);
        let shuf = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
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

    /// [`super::decode`] in registers: values, the 8 lanes' scales, the minimum.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn decode<const T: u8>(b: *const u8, s: usize) -> (__m256i, __m256, f32) {
        // SAFETY (all loads): `b` is a whole block of type T, whose layout the offsets follow.
        unsafe {
            match T {
                Q4_0 => {
                    let v = _mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8));
                    (v, _mm256_set1_ps(f16_at(b, 0)), 0.0)
                }
                Q4_1 => (
                    nibbles(b.add(4)),
                    _mm256_set1_ps(f16_at(b, 0)),
                    f16_at(b, 2),
                ),
                Q5_0 => {
                    let u = _mm256_or_si256(nibbles(b.add(6)), bit16(u32_at(b.add(2))));
                    let v = _mm256_sub_epi8(u, _mm256_set1_epi8(16));
                    (v, _mm256_set1_ps(f16_at(b, 0)), 0.0)
                }
                Q5_1 => {
                    let u = _mm256_or_si256(nibbles(b.add(8)), bit16(u32_at(b.add(4))));
                    (u, _mm256_set1_ps(f16_at(b, 0)), f16_at(b, 2))
                }
                Q8_0 => {
                    let v = _mm256_loadu_si256(b.add(2) as *const __m256i);
                    (v, _mm256_set1_ps(f16_at(b, 0)), 0.0)
                }
                Q4_K | Q5_K => {
                    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                    let q = std::slice::from_raw_parts(b.add(4), 12);
                    let (sc, mn) = k_scale_min(s, q);
                    let qs = if T == Q4_K { b.add(16) } else { b.add(48) };
                    let bytes = _mm256_loadu_si256(qs.add(32 * (s / 2)) as *const __m256i);
                    let bytes = if s % 2 == 0 {
                        bytes
                    } else {
                        _mm256_srli_epi16::<4>(bytes)
                    };
                    let mut u = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
                    if T == Q5_K {
                        let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
                        let bit = _mm256_set1_epi8(1 << s);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                    let a = d * sc as f32;
                    (u, _mm256_set1_ps(a), -(dmin * mn as f32))
                }
                _ => {
                    let d = f16_at(b, 208);
                    let h = s / 4;
                    let low = _mm256_loadu_si256(b.add(h * 64 + 32 * (s % 2)) as *const __m256i);
                    let low = _mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * ((s % 4) / 2) as i32));
                    let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
                    let hi = _mm256_loadu_si256(b.add(128 + h * 32) as *const __m256i);
                    let hi = _mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * (s % 4) as i32));
                    let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(hi, _mm256_set1_epi8(3)));
                    let v = _mm256_sub_epi8(_mm256_or_si256(low, hi), _mm256_set1_epi8(32));
                    let sc = b.add(192 + 2 * s);
                    let lo = d * (*sc as i8) as f32;
                    let hi = d * (*sc.add(1) as i8) as f32;
                    (v, _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)), 0.0)
                }
            }
        }
    }

    /// The 8 lanes summed in [`super::reduce8`]'s order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn hsum(v: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_avx2(u: __m256i, q: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub(super) fn dot_vnni(u: __m256i, q: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q)
    }
}

/// The kernel, compiled once per path with its integer dot.
macro_rules! row_kernel {
    ($name:ident, $features:literal, $dot:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const T: u8, const R: usize>(row: &[u8], x: Tile<'_>, r: &mut [f32; MR]) {
            use std::arch::x86_64::*;
            let nb = x.k / 32;
            let mut acc = [_mm256_setzero_ps(); R];
            let mut macc = [0f32; R];
            let (qp, dp, sp) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
            for (blk, b) in row.chunks_exact(block_bytes(T)).enumerate() {
                for s in 0..subs(T) {
                    let j = blk * subs(T) + s;
                    // SAFETY: `b` is one block of type T; the tile holds R rows of k values
                    // and nb scales, and j < nb.
                    unsafe {
                        let (v, scale, min) = x86::decode::<T>(b.as_ptr(), s);
                        let u = if unsigned(T) { v } else { _mm256_abs_epi8(v) };
                        for a in 0..R {
                            let q = _mm256_loadu_si256(qp.add(a * x.k + 32 * j) as *const __m256i);
                            let q = if unsigned(T) {
                                q
                            } else {
                                _mm256_sign_epi8(q, v)
                            };
                            let isum = x86::$dot(u, q);
                            let f = _mm256_mul_ps(scale, _mm256_set1_ps(*dp.add(a * nb + j)));
                            acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, acc[a]);
                            if unsigned(T) {
                                macc[a] = min.mul_add(*sp.add(a * nb + j), macc[a]);
                            }
                        }
                    }
                }
            }
            for a in 0..R {
                r[a] = x86::hsum(acc[a]) + macc[a];
            }
        }
    };
}

row_kernel!(row_avx2, "avx2,fma,f16c", dot_avx2);
row_kernel!(row_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", dot_vnni);

#[cfg(test)]
mod tests;
