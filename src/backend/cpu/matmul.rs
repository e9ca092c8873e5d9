//! `y = x · Wᵀ` for the CPU backend.
//!
//! NOTE: why not a GEMM crate. Two properties matter more here than peak FLOPs:
//! 1. Batch invariance: a row's result must not depend on how many other rows are in the batch,
//!    or on where the row sits in it. Every output element is computed by exactly the same
//!    sequence of operations — 16 lane-wise FMA accumulators over `k` in order (lane `l` takes
//!    `k ≡ l mod 16`), one fixed reduction (lanes `l` and `l + 8` added, then the 8 pairwise),
//!    then the scalar tail — whatever the tile it falls in, and on every path (AVX-512 holds the
//!    16 lanes in one register, AVX2 in two, the portable path in an array). So a prompt decodes
//!    to the same tokens alone and inside any batch, and after preemption.
//! 2. Skinny shapes: decode batches have 1–64 rows while weights have thousands. A GEMM that packs
//!    its operands re-packs the whole weight matrix every step; here the weights stream from
//!    memory once per step, in slabs that stay in cache while every row of `x` passes over them.
//!
//! Tiles are MR rows of `x` by NR rows of `W`: 4 × 4 with AVX-512 (16 accumulators of the 32
//! zmm registers), 3 × 2 with AVX2 (12 ymm accumulators of 16).

use crate::quant::QuantTensor;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Weight rows per parallel task: 64 rows × k floats stay in L2 while every x row passes.
const SLAB: usize = 64;

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// The weight matrix `[n, k]`, in its storage type.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    /// Rows in GGML block formats: `qmatmul`.
    Quant(&'a QuantTensor),
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`.
pub fn matmul(x: &[f32], m: usize, k: usize, n: usize, out: &mut [f32], w: Weights<'_>) {
    matmul_on(Path::detect(), x, m, k, n, out, w)
}

/// The same on a given path (tests force each one); the portable path where the CPU lacks it.
/// Quantized weights go to `qmatmul` on its own detected path.
pub fn matmul_on(
    path: Path,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    w: Weights<'_>,
) {
    assert!(x.len() >= m * k && out.len() >= m * n);
    if let Weights::Quant(q) = w {
        return super::qmatmul::qmatmul(x, m, k, n, out, q);
    }
    let path = if path.available() {
        path
    } else {
        Path::Portable
    };
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(SLAB))
        .into_par_iter()
        .for_each_init(Vec::new, |buf: &mut Vec<f32>, slab| {
            let j0 = slab * SLAB;
            let nj = SLAB.min(n - j0);
            let rows = j0 * k..(j0 + nj) * k;
            let o = out_ptr;
            // NOTE: half weights stay half in memory. Up to 16 rows of x widen them in the
            // kernel's loads (each weight is used once or twice); more rows widen each slab
            // once into a buffer. Both give the same bits: the widening is exact.
            if m <= 16 {
                // SAFETY: this task alone writes columns j0 .. j0 + nj of `out`.
                match w {
                    Weights::F16(w) => {
                        return unsafe { slab_kernel(path, x, m, k, &w[rows], nj, o.0.add(j0), n) };
                    }
                    Weights::BF16(w) => {
                        return unsafe { slab_kernel(path, x, m, k, &w[rows], nj, o.0.add(j0), n) };
                    }
                    _ => {}
                }
            }
            let w: &[f32] = match w {
                Weights::F32(w) => &w[rows],
                // NOTE: `half` converts slices with F16C where the CPU has it (one instruction
                // per 8 values); value by value it would be a software conversion each.
                Weights::F16(w) => {
                    buf.resize(rows.len(), 0.0);
                    w[rows].convert_to_f32_slice(buf);
                    buf
                }
                Weights::BF16(w) => {
                    buf.resize(rows.len(), 0.0);
                    w[rows].convert_to_f32_slice(buf);
                    buf
                }
                Weights::Quant(_) => unreachable!("handled above"),
            };
            // SAFETY: this task alone writes columns j0 .. j0 + nj of `out` (m rows of stride n).
            unsafe { slab_kernel(path, x, m, k, w, nj, o.0.add(j0), n) };
        });
}

/// The f32 kernels' implementations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Portable,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512F (+ the AVX2 set).
    Avx512,
}

impl Path {
    /// The fastest path this CPU runs (once per process).
    pub fn detect() -> Path {
        static PATH: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
        *PATH.get_or_init(|| {
            [Path::Avx512, Path::Avx2]
                .into_iter()
                .find(|p| p.available())
                .unwrap_or(Path::Portable)
        })
    }

    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            match self {
                Path::Portable => true,
                Path::Avx2 => avx2,
                Path::Avx512 => avx2 && has!("avx512f") && has!("avx512dq"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Path::Portable
        }
    }

    /// (MR, NR): rows of x and of w per tile.
    fn tile(self) -> (usize, usize) {
        match self {
            Path::Avx512 => (4, 4),
            Path::Avx2 => (3, 2),
            Path::Portable => (3, 4),
        }
    }
}

/// A weight element the kernels load: f32, or f16/bf16 widened (exactly) as they are loaded.
trait Elem: Copy + Sync {
    fn f32(self) -> f32;
    /// 8 values from `p`, widened.
    ///
    /// # Safety
    /// `p` points at 8 values; the CPU has AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Elem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: as the caller promises.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises. A bf16 is the top half of an f32.
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }
}

/// All m rows of x against `nj` rows of w; writes `out[i * ldo + j]`.
#[allow(clippy::too_many_arguments)]
unsafe fn slab_kernel<T: Elem>(
    path: Path,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[T],
    nj: usize,
    out: *mut f32,
    ldo: usize,
) {
    let (mr_max, nr_max) = path.tile();
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(mr_max);
        let mut j = 0;
        while j < nj {
            let nr = if nj - j >= nr_max { nr_max } else { 1 };
            let xs = &x[i * k..(i + mr) * k];
            let ws = &w[j * k..(j + nr) * k];
            // SAFETY: out rows i .. i + mr, columns j .. j + nr are inside the caller's range.
            unsafe {
                let o = out.add(i * ldo + j);
                macro_rules! by_nr {
                    ($mr:literal) => {
                        match nr {
                            4 => tile::<T, $mr, 4>(path, xs, ws, k, o, ldo),
                            2 => tile::<T, $mr, 2>(path, xs, ws, k, o, ldo),
                            _ => tile::<T, $mr, 1>(path, xs, ws, k, o, ldo),
                        }
                    };
                }
                match mr {
                    4 => by_nr!(4),
                    3 => by_nr!(3),
                    2 => by_nr!(2),
                    _ => by_nr!(1),
                }
            }
            j += nr;
        }
        i += mr;
    }
}

#[inline(always)]
unsafe fn tile<T: Elem, const MR: usize, const NR: usize>(
    path: Path,
    x: &[f32],
    w: &[T],
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut r = [[0f32; NR]; MR];
    match path {
        // SAFETY: the path was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { tile_avx512::<T, MR, NR>(x, w, k, &mut r) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { tile_avx2::<T, MR, NR>(x, w, k, &mut r) },
        _ => tile_portable::<T, MR, NR>(x, w, k, &mut r),
    }
    for (a, row) in r.iter().enumerate() {
        for (b, v) in row.iter().enumerate() {
            // SAFETY: within the tile, as promised by the caller.
            unsafe { *out.add(a * ldo + b) = *v };
        }
    }
}

/// The scalar tail after the 16-lane part: `k16 .. k`, in order.
#[inline(always)]
fn tail<T: Elem>(x: &[f32], w: &[T], k16: usize, k: usize, mut s: f32) -> f32 {
    for t in k16..k {
        s += x[t] * w[t].f32();
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx512<T: Elem, const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[T],
    k: usize,
    r: &mut [[f32; NR]; MR],
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    let k16 = k / 16 * 16;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut kk = 0;
    while kk < k16 {
        // SAFETY: kk + 16 <= k, and x / w hold MR / NR rows of k values.
        unsafe {
            let mut xv = [_mm512_setzero_ps(); MR];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(xp.add(a * k + kk));
            }
            for b in 0..NR {
                let p = wp.add(b * k + kk);
                let lo = T::load8(p);
                let hi = T::load8(p.add(8));
                let wv = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(lo), hi);
                for a in 0..MR {
                    acc[a][b] = _mm512_fmadd_ps(xv[a], wv, acc[a][b]);
                }
            }
        }
        kk += 16;
    }
    for a in 0..MR {
        for b in 0..NR {
            let v = acc[a][b];
            let v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
            let s = hsum8(v8);
            r[a][b] = tail(&x[a * k..(a + 1) * k], &w[b * k..(b + 1) * k], k16, k, s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx2<T: Elem, const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[T],
    k: usize,
    r: &mut [[f32; NR]; MR],
) {
    use std::arch::x86_64::*;
    // Lanes 0..8 and 8..16 of the canonical 16.
    let mut lo = [[_mm256_setzero_ps(); NR]; MR];
    let mut hi = [[_mm256_setzero_ps(); NR]; MR];
    let k16 = k / 16 * 16;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut kk = 0;
    while kk < k16 {
        // SAFETY: kk + 16 <= k, and x / w hold MR / NR rows of k values.
        unsafe {
            for (acc, off) in [(&mut lo, 0), (&mut hi, 8)] {
                let mut xv = [_mm256_setzero_ps(); MR];
                for (a, v) in xv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(xp.add(a * k + kk + off));
                }
                for b in 0..NR {
                    let wv = T::load8(wp.add(b * k + kk + off));
                    for a in 0..MR {
                        acc[a][b] = _mm256_fmadd_ps(xv[a], wv, acc[a][b]);
                    }
                }
            }
        }
        kk += 16;
    }
    for a in 0..MR {
        for b in 0..NR {
            let s = hsum8(_mm256_add_ps(lo[a][b], hi[a][b]));
            r[a][b] = tail(&x[a * k..(a + 1) * k], &w[b * k..(b + 1) * k], k16, k, s);
        }
    }
}

/// The 8 lanes summed in [`reduce8`]'s order.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum8(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
}

#[allow(clippy::needless_range_loop)]
fn tile_portable<T: Elem, const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[T],
    k: usize,
    r: &mut [[f32; NR]; MR],
) {
    let mut acc = [[[0f32; 16]; NR]; MR];
    let k16 = k / 16 * 16;
    for kk in (0..k16).step_by(16) {
        for a in 0..MR {
            let xv = &x[a * k + kk..a * k + kk + 16];
            for b in 0..NR {
                let wv = &w[b * k + kk..b * k + kk + 16];
                for l in 0..16 {
                    acc[a][b][l] = xv[l].mul_add(wv[l].f32(), acc[a][b][l]);
                }
            }
        }
    }
    for a in 0..MR {
        for b in 0..NR {
            let folded: [f32; 8] = std::array::from_fn(|l| acc[a][b][l] + acc[a][b][8 + l]);
            let s = reduce8(&folded);
            r[a][b] = tail(&x[a * k..(a + 1) * k], &w[b * k..(b + 1) * k], k16, k, s);
        }
    }
}

/// One fixed pairwise order for the 8 lanes (the SIMD reductions, here and in qmatmul.rs,
/// follow it).
#[inline(always)]
pub(super) fn reduce8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn mm(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        matmul(x, m, k, n, &mut out, Weights::F32(w));
        out
    }

    /// A row gives bit-identical results whatever the number of rows around it and its place,
    /// on every path.
    #[test]
    fn rows_are_batch_invariant() {
        let (k, n) = (203, 131);
        let w = rand(n * k, 1);
        let x = rand(17 * k, 2);
        for p in paths() {
            let mm = |x: &[f32], m: usize| {
                let mut out = vec![0.0; m * n];
                matmul_on(p, x, m, k, n, &mut out, Weights::F32(&w));
                out
            };
            let all = mm(&x, 17);
            for i in [0, 1, 5, 16] {
                let one = mm(&x[i * k..(i + 1) * k], 1);
                assert_eq!(one, all[i * n..(i + 1) * n], "{p:?} row {i}");
            }
            let two = mm(&x[4 * k..6 * k], 2);
            assert_eq!(two, all[4 * n..6 * n], "{p:?}");
        }
    }

    /// Half weights: a few rows widen them in the loads, more rows through a buffer; a row
    /// gives the same bits either way, and the products are those of the widened values.
    #[test]
    fn half_weights_are_batch_invariant_across_both_widenings() {
        let (k, n) = (203, 131);
        let wf = rand(n * k, 5);
        let x = rand(9 * k, 6);
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened_h: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
        let widened_b: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        for (w, widened) in [
            (Weights::F16(&wh), &widened_h),
            (Weights::BF16(&wb), &widened_b),
        ] {
            let mut all = vec![0.0; 9 * n];
            matmul(&x, 9, k, n, &mut all, w);
            assert_eq!(all, mm(&x, widened, 9, k, n));
            for i in [0, 4, 8] {
                let mut one = vec![0.0; n];
                matmul(&x[i * k..(i + 1) * k], 1, k, n, &mut one, w);
                assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
            }
        }
    }

    fn paths() -> Vec<Path> {
        [Path::Portable, Path::Avx2, Path::Avx512]
            .into_iter()
            .filter(|p| p.available())
            .collect()
    }

    /// Every path computes the same canonical sequence: the same bits, for every weight type,
    /// with and without a tail past the last 16 values, in every tile shape.
    #[test]
    fn paths_agree_to_the_bit() {
        for (m, k, n) in [(7, 203, 37), (5, 64, 9), (1, 15, 6)] {
            let x = rand(m * k, 11);
            let wf = rand(n * k, 12);
            let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
            for w in [Weights::F32(&wf), Weights::F16(&wh), Weights::BF16(&wb)] {
                let run = |p| {
                    let mut out = vec![f32::NAN; m * n];
                    matmul_on(p, &x, m, k, n, &mut out, w);
                    out
                };
                let first = run(Path::Portable);
                for p in paths() {
                    assert_eq!(run(p), first, "{p:?} m={m} k={k} n={n}");
                }
            }
        }
    }

    #[test]
    fn portable_and_simd_agree_closely() {
        let (m, k, n) = (5, 77, 9);
        let x = rand(m * k, 3);
        let w = rand(n * k, 4);
        let got = mm(&x, &w, m, k, n);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
                assert!((got[i * n + j] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
            }
        }
    }
}
