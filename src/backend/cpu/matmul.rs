//! `y = x · Wᵀ` for the CPU backend.
//!
//! NOTE: why not a GEMM crate. Two properties matter more here than peak FLOPs:
//! 1. Batch invariance: a row's result must not depend on how many other rows are in the batch,
//!    or on where the row sits in it. Every output element is computed by exactly the same
//!    sequence of operations — 8 lane-wise accumulators over `k` in order, one fixed horizontal
//!    reduction, then the scalar tail — whatever the tile it falls in. So a prompt decodes to the
//!    same tokens alone and inside any batch, and after preemption.
//! 2. Skinny shapes: decode batches have 1–64 rows while weights have thousands. A GEMM that packs
//!    its operands re-packs the whole weight matrix every step; here the weights stream from
//!    memory once per step, in slabs that stay in cache while every row of `x` passes over them.
//!
//! Tiles are MR rows of `x` by NR rows of `W` (3 × 4 with AVX2: 12 accumulators, 3 x vectors
//! and 1 w vector fill the 16 ymm registers).

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
    assert!(x.len() >= m * k && out.len() >= m * n);
    if let Weights::Quant(q) = w {
        return super::qmatmul::qmatmul(x, m, k, n, out, q);
    }
    let avx2 = has_avx2_fma();
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(SLAB))
        .into_par_iter()
        .for_each_init(Vec::new, |buf: &mut Vec<f32>, slab| {
            let j0 = slab * SLAB;
            let nj = SLAB.min(n - j0);
            let rows = j0 * k..(j0 + nj) * k;
            let o = out_ptr;
            // NOTE: half weights stay half in memory. A few rows of x widen them in the
            // kernel's loads (each weight is used once or twice); more rows widen each slab
            // once into a buffer. Both give the same bits: the widening is exact.
            if m <= 4 {
                // SAFETY: this task alone writes columns j0 .. j0 + nj of `out`.
                match w {
                    Weights::F16(w) => {
                        return unsafe { slab_kernel(avx2, x, m, k, &w[rows], nj, o.0.add(j0), n) };
                    }
                    Weights::BF16(w) => {
                        return unsafe { slab_kernel(avx2, x, m, k, &w[rows], nj, o.0.add(j0), n) };
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
            unsafe { slab_kernel(avx2, x, m, k, w, nj, o.0.add(j0), n) };
        });
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("fma") && has!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
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
    avx2: bool,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[T],
    nj: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(3);
        let mut j = 0;
        while j < nj {
            let nr = if nj - j >= 4 { 4 } else { 1 };
            let xs = &x[i * k..(i + mr) * k];
            let ws = &w[j * k..(j + nr) * k];
            // SAFETY: out rows i .. i + mr, columns j .. j + nr are inside the caller's range.
            unsafe {
                let o = out.add(i * ldo + j);
                match (mr, nr) {
                    (3, 4) => tile::<T, 3, 4>(avx2, xs, ws, k, o, ldo),
                    (2, 4) => tile::<T, 2, 4>(avx2, xs, ws, k, o, ldo),
                    (1, 4) => tile::<T, 1, 4>(avx2, xs, ws, k, o, ldo),
                    (3, _) => tile::<T, 3, 1>(avx2, xs, ws, k, o, ldo),
                    (2, _) => tile::<T, 2, 1>(avx2, xs, ws, k, o, ldo),
                    _ => tile::<T, 1, 1>(avx2, xs, ws, k, o, ldo),
                }
            }
            j += nr;
        }
        i += mr;
    }
}

#[inline(always)]
unsafe fn tile<T: Elem, const MR: usize, const NR: usize>(
    avx2: bool,
    x: &[f32],
    w: &[T],
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut r = [[0f32; NR]; MR];
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2 and FMA were detected at run time.
        unsafe { tile_avx2::<T, MR, NR>(x, w, k, &mut r) };
    } else {
        tile_portable::<T, MR, NR>(x, w, k, &mut r);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = avx2;
        tile_portable::<T, MR, NR>(x, w, k, &mut r);
    }
    for (a, row) in r.iter().enumerate() {
        for (b, v) in row.iter().enumerate() {
            // SAFETY: within the tile, as promised by the caller.
            unsafe { *out.add(a * ldo + b) = *v };
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
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let k8 = k / 8 * 8;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut kk = 0;
    while kk < k8 {
        // SAFETY: kk + 8 <= k, and x / w hold MR / NR rows of k floats.
        unsafe {
            let mut xv = [_mm256_setzero_ps(); MR];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(xp.add(a * k + kk));
            }
            for b in 0..NR {
                let wv = T::load8(wp.add(b * k + kk));
                for a in 0..MR {
                    acc[a][b] = _mm256_fmadd_ps(xv[a], wv, acc[a][b]);
                }
            }
        }
        kk += 8;
    }
    for a in 0..MR {
        for b in 0..NR {
            // The order of `reduce8`: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
            let v = acc[a][b];
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
            for t in k8..k {
                s += x[a * k + t] * w[b * k + t].f32();
            }
            r[a][b] = s;
        }
    }
}

#[allow(clippy::needless_range_loop)]
fn tile_portable<T: Elem, const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[T],
    k: usize,
    r: &mut [[f32; NR]; MR],
) {
    let mut acc = [[[0f32; 8]; NR]; MR];
    let k8 = k / 8 * 8;
    for kk in (0..k8).step_by(8) {
        for a in 0..MR {
            let xv = &x[a * k + kk..a * k + kk + 8];
            for b in 0..NR {
                let wv = &w[b * k + kk..b * k + kk + 8];
                for l in 0..8 {
                    acc[a][b][l] += xv[l] * wv[l].f32();
                }
            }
        }
    }
    for a in 0..MR {
        for b in 0..NR {
            let mut s = reduce8(&acc[a][b]);
            for t in k8..k {
                s += x[a * k + t] * w[b * k + t].f32();
            }
            r[a][b] = s;
        }
    }
}

/// One fixed pairwise order for the 8 lanes.
#[inline(always)]
fn reduce8(l: &[f32; 8]) -> f32 {
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

    /// A row gives bit-identical results whatever the number of rows around it and its place.
    #[test]
    fn rows_are_batch_invariant() {
        let (k, n) = (203, 131);
        let w = rand(n * k, 1);
        let x = rand(17 * k, 2);
        let all = mm(&x, &w, 17, k, n);
        for i in [0, 1, 5, 16] {
            let one = mm(&x[i * k..(i + 1) * k], &w, 1, k, n);
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
        }
        let two = mm(&x[4 * k..6 * k], &w, 2, k, n);
        assert_eq!(two, all[4 * n..6 * n]);
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
