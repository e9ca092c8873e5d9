//! `y = x · Wᵀ` for the CPU backend, with dense weights (f32, f16, bf16) packed in panels.
//!
//! NOTE: why not a GEMM crate. Two properties matter more here than peak FLOPs:
//! 1. Batch invariance: a row's result must not depend on how many other rows are in the batch,
//!    or on where the row sits in it. Every output element is computed by exactly the same
//!    sequence of operations whatever the tile it falls in and on every path (portable, AVX2,
//!    AVX-512): `k` is cut in blocks of `KC`; within a block the products are accumulated one
//!    after another with fused multiply-adds from 0, and the blocks' sums are added in order
//!    (`y = ((s₀ + s₁) + s₂) …`). So a prompt decodes to the same tokens alone and inside any
//!    batch, and after preemption.
//! 2. Skinny shapes: decode batches have 1–64 rows while weights have thousands, and the weights
//!    stream from memory once per step. They are packed once, at upload, so no step re-packs
//!    them.
//!
//! The layout: `W [n, k]` is cut in panels of 16 output columns, each stored k-major
//! (`panel[kk][c] = W[16p + c][kk]`, the last panel padded with zeros):
//!
//! ```text
//!   W rows 0..16 ─▶ panel 0: [k0: w0 w1 … w15][k1: w0 … w15] …      x row i: x[i][k0] x[i][k1] …
//!   W rows 16..32 ▶ panel 1: …                                        broadcast, one FMA per panel half
//! ```
//!
//! So the 16 columns of a panel sit in the lanes of one AVX-512 register (two AVX2 ones) and a
//! tile of MR rows × NP panels keeps MR·NP·16 accumulators in registers while `x[i][kk]` is
//! broadcast: 12 FMAs for 8 loads with AVX2's 6 × 1 tile (the old lane-split dot products
//! needed 10 loads for 12 FMAs and a reduction per element). Within a task the block of the
//! panel (KC × 16 values, 16 KiB in f32) stays in L1 while every row tile passes over it.

use super::simd::{PREFETCH_BYTES, prefetch_lines};
use crate::quant::QuantTensor;
use half::{bf16, f16};
use rayon::prelude::*;

/// Output columns per panel.
pub const PANEL: usize = 16;
/// Values of `k` per block: one panel block (16 KiB in f32) stays in L1 with the x rows of a
/// tile (6 × 1 KiB).
const KC: usize = 256;
/// Rows of `x` per task when there are many: their block of x (128 KiB) stays in L2 while
/// the task's panels pass over it.
const MC: usize = 128;
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// A weight matrix `[n, k]` in panels (see the module's note), in its storage type.
#[derive(Debug, Clone)]
pub struct Packed<T> {
    pub n: usize,
    pub k: usize,
    /// `[n.div_ceil(16), k, 16]`.
    data: Vec<T>,
}

impl<T: Elem> Packed<T> {
    /// Packs row-major `w [n, k]`.
    pub fn pack(w: &[T], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "packing a {n}x{k} matrix");
        let panels = n.div_ceil(PANEL);
        let mut data = vec![T::ZERO; panels * k * PANEL];
        data.par_chunks_mut(k * PANEL)
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL.min(n - p * PANEL) {
                    let row = &w[(p * PANEL + c) * k..(p * PANEL + c + 1) * k];
                    for (kk, &v) in row.iter().enumerate() {
                        panel[kk * PANEL + c] = v;
                    }
                }
            });
        Packed { n, k, data }
    }

    /// Row `j` of `W`, widened to f32.
    pub fn row_into(&self, j: usize, out: &mut [f32]) {
        let (p, c) = (j / PANEL, j % PANEL);
        let panel = &self.data[p * self.k * PANEL..(p + 1) * self.k * PANEL];
        for (kk, o) in out[..self.k].iter_mut().enumerate() {
            *o = panel[kk * PANEL + c].f32();
        }
    }

    /// `W` row-major, widened to f32.
    pub fn unpack(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.n * self.k];
        for (j, row) in out.chunks_mut(self.k.max(1)).enumerate().take(self.n) {
            self.row_into(j, row);
        }
        out
    }

    pub fn numel(&self) -> usize {
        self.n * self.k
    }

    fn panel_block(&self, p: usize, k0: usize, kc: usize) -> &[T] {
        let start = (p * self.k + k0) * PANEL;
        &self.data[start..start + kc * PANEL]
    }
}

/// The weight matrix `[n, k]`, in its storage type.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a Packed<f32>),
    F16(&'a Packed<f16>),
    BF16(&'a Packed<bf16>),
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
    let path = if path.available() {
        path
    } else {
        Path::Portable
    };
    dense_or_quant(path, x, (m, k, n), out, w, true)
}

/// [`matmul`] on the calling thread alone: for the many small products of one op (LoRA's
/// factors, a few rows per adapter), each already on its own worker. The same bits, since how
/// the work is cut changes no result; quantized weights still go to `qmatmul`.
pub fn matmul_serial(x: &[f32], m: usize, k: usize, n: usize, out: &mut [f32], w: Weights<'_>) {
    dense_or_quant(Path::detect(), x, (m, k, n), out, w, false)
}

fn dense_or_quant(
    path: Path,
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    w: Weights<'_>,
    parallel: bool,
) {
    assert!(x.len() >= m * k && out.len() >= m * n);
    match w {
        Weights::Quant(q) => super::qmatmul::qmatmul(x, m, k, n, out, q),
        Weights::F32(w) => packed_matmul(path, x, m, k, n, out, w, parallel),
        Weights::F16(w) => packed_matmul(path, x, m, k, n, out, w, parallel),
        Weights::BF16(w) => packed_matmul(path, x, m, k, n, out, w, parallel),
    }
}

/// `parallel`: the work cut in tasks for rayon, else one task on this thread.
#[allow(clippy::too_many_arguments)]
fn packed_matmul<T: Elem>(
    path: Path,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    w: &Packed<T>,
    parallel: bool,
) {
    assert!(
        w.n == n && w.k == k,
        "matmul: weight is {}x{}, expected {n}x{k}",
        w.n,
        w.k
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].iter_mut().for_each(|o| *o = 0.0);
        return;
    }
    let panels = n.div_ceil(PANEL);
    if !parallel {
        // SAFETY: `out` holds m × n values, all this call's.
        unsafe { task(path, x, k, n, 0..m, 0..panels, w, out.as_mut_ptr()) };
        return;
    }
    // NOTE: how the work is cut changes no result (see the module's note): a few rows are
    // cut by panel pairs only, so that the hidden size's 36 panels split evenly over 2 or 3
    // threads; many rows also by blocks of MC rows, with 8 panels a task to reuse each block.
    let (row_block, group) = if m <= MC { (m, 2) } else { (MC, 8) };
    let groups = panels.div_ceil(group);
    let tasks = m.div_ceil(row_block) * groups;
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..tasks).into_par_iter().for_each(|t| {
        let (rb, g) = (t / groups, t % groups);
        let rows = rb * row_block..(m).min((rb + 1) * row_block);
        let ps = g * group..panels.min((g + 1) * group);
        let o = out_ptr;
        // SAFETY: this task alone writes rows `rows`, columns of panels `ps` of `out`.
        unsafe { task(path, x, k, n, rows, ps, w, o.0) };
    });
}

/// Rows `rows` of x against panels `ps`; writes their part of `out [m, n]`.
///
/// # Safety
/// `out` holds `m × n` values and no other thread writes this part of it.
#[allow(clippy::too_many_arguments)]
unsafe fn task<T: Elem>(
    path: Path,
    x: &[f32],
    k: usize,
    n: usize,
    rows: std::ops::Range<usize>,
    ps: std::ops::Range<usize>,
    w: &Packed<T>,
    out: *mut f32,
) {
    let m = rows.len();
    // (MR, NP): rows of x by panels per tile.
    let (mr_max, np_max) = match (path, m) {
        (_, 1) | (_, 2) => (m, 2),
        (Path::Avx512, _) => (6, 2),
        _ => (6, 1),
    };
    let mut scratch = [0f32; 6 * 2 * PANEL];
    // NOTE: where many row tiles pass over a block of f16/bf16 panels, it is widened once
    // into `wide` and the tiles run the f32 kernel on it, instead of each tile widening every
    // value again (prefill in f16 ran at 0.6x its f32 speed). A widening pass costs about
    // what three tiles' conversions do (a load, a conversion and a store per 16 values, where
    // a tile folds the conversion into its load), so it waits for five tiles. Widening is
    // exact and the FMAs are the same, so the bits do not change.
    let widen = T::NARROW && m > 4 * mr_max;
    let mut wide = vec![0f32; if widen { 2 * KC * PANEL } else { 0 }];
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        let first = k0 == 0;
        let mut p = ps.start;
        while p < ps.end {
            let np = np_max.min(ps.end - p);
            let blocks = [w.panel_block(p, k0, kc), w.panel_block(p + np - 1, k0, kc)];
            if widen {
                let (first, rest) = wide.split_at_mut(kc * PANEL);
                T::widen(blocks[0], first);
                if np == 2 {
                    T::widen(blocks[1], &mut rest[..kc * PANEL]);
                }
            }
            let wide_blocks: [&[f32]; 2] = if widen {
                [
                    &wide[..kc * PANEL],
                    &wide[(np - 1) * kc * PANEL..np * kc * PANEL],
                ]
            } else {
                [&[], &[]]
            };
            // NOTE: a group with the padded last panel writes through `scratch`, and only
            // its real columns reach `out`.
            let full = (p + np) * PANEL <= n;
            let mut i = rows.start;
            while i < rows.end {
                let mr = mr_max.min(rows.end - i);
                let xs = &x[i * k + k0..];
                let (dst, ldd, into_out) = if full {
                    // SAFETY: row i, column p·16 is inside `out`.
                    (unsafe { out.add(i * n + p * PANEL) }, n, first)
                } else {
                    (scratch.as_mut_ptr(), 2 * PANEL, true)
                };
                macro_rules! go {
                    ($mr:literal, $np:literal) => {
                        // SAFETY: dst holds mr rows of stride ldd with np panels each.
                        unsafe {
                            let prefetch = i == rows.start;
                            if widen {
                                tile::<f32, $mr, $np>(
                                    path,
                                    xs,
                                    k,
                                    kc,
                                    &wide_blocks,
                                    dst,
                                    ldd,
                                    into_out,
                                    prefetch,
                                )
                            } else {
                                tile::<T, $mr, $np>(
                                    path, xs, k, kc, &blocks, dst, ldd, into_out, prefetch,
                                )
                            }
                        }
                    };
                }
                match (mr, np) {
                    (1, 1) => go!(1, 1),
                    (1, _) => go!(1, 2),
                    (2, 1) => go!(2, 1),
                    (2, _) => go!(2, 2),
                    (3, 1) => go!(3, 1),
                    (3, _) => go!(3, 2),
                    (4, 1) => go!(4, 1),
                    (4, _) => go!(4, 2),
                    (5, 1) => go!(5, 1),
                    (5, _) => go!(5, 2),
                    (_, 1) => go!(6, 1),
                    _ => go!(6, 2),
                }
                if !full {
                    let (j0, cols) = (p * PANEL, n - p * PANEL);
                    for a in 0..mr {
                        let src = &scratch[a * 2 * PANEL..a * 2 * PANEL + cols];
                        // SAFETY: row i + a, columns j0 .. n are this task's.
                        let o = unsafe {
                            std::slice::from_raw_parts_mut(out.add((i + a) * n + j0), cols)
                        };
                        if first {
                            o.copy_from_slice(src);
                        } else {
                            o.iter_mut().zip(src).for_each(|(o, s)| *o += s);
                        }
                    }
                }
                i += mr;
            }
            p += np;
        }
    }
}

/// One tile: `s[a][16b + c] = Σ_{kk < kc} x[a][kk] · panel_b[kk][c]`, one FMA after another,
/// stored at `dst[a · ldd + 16b + c]` (`store`) or added to it. `x` holds MR rows of stride
/// `ldx`; `blocks` the first and the last of the NP panel blocks (NP ≤ 2). With `prefetch`,
/// it asks for the panels' values `PREFETCH_BYTES` ahead as it goes.
///
/// # Safety
/// `dst` holds MR rows of stride `ldd` with NP · 16 values each.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<T: Elem, const MR: usize, const NP: usize>(
    path: Path,
    x: &[f32],
    ldx: usize,
    kc: usize,
    blocks: &[&[T]; 2],
    dst: *mut f32,
    ldd: usize,
    store: bool,
    prefetch: bool,
) {
    assert!(MR <= 6 && NP <= 2 && x.len() >= (MR - 1) * ldx + kc);
    assert!(blocks.iter().all(|b| b.len() == kc * PANEL));
    let d = Dst {
        p: dst,
        ld: ldd,
        store,
        prefetch,
    };
    match path {
        // SAFETY: the path was detected on this CPU; the sizes were checked above, dst's by
        // the caller.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { tile_avx512::<T, MR, NP>(x, ldx, kc, blocks, d) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { tile_avx2::<T, MR, NP>(x, ldx, kc, blocks, d) },
        _ => unsafe { tile_portable::<T, MR, NP>(x, ldx, kc, blocks, d) },
    }
}

/// Where a tile's sums go: stored (the first block of k) or added to what is there; and
/// whether the tile asks for its panels' next values ahead (the first tile over a block).
#[derive(Clone, Copy)]
struct Dst {
    p: *mut f32,
    ld: usize,
    store: bool,
    prefetch: bool,
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
    /// The fastest path this CPU runs, within `PAGODA_CPU_ISA` (once per process).
    pub fn detect() -> Path {
        static PATH: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
        *PATH.get_or_init(|| {
            [Path::Avx512, Path::Avx2]
                .into_iter()
                .find(|&p| p.available() && p as u8 <= super::simd::isa_level())
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
}

/// A weight element the kernels load: f32, or f16/bf16 widened (exactly) as they are loaded.
pub trait Elem: Copy + Send + Sync {
    const ZERO: Self;
    /// Whether the values are narrower than f32 (widened as they are loaded).
    const NARROW: bool = true;
    fn f32(self) -> f32;
    /// `dst = src` widened to f32 (exactly).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// The nearest value (ties to even), as a KV cache stores what it is given.
    fn from_f32(x: f32) -> Self;
    /// 8 values from `p`, widened.
    ///
    /// # Safety
    /// `p` points at 8 values; the CPU has AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// 16 values from `p`, widened.
    ///
    /// # Safety
    /// `p` points at 16 values; the CPU has AVX2, FMA, F16C, AVX-512F and AVX-512DQ.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Elem for f32 {
    const ZERO: f32 = 0.0;
    const NARROW: bool = false;
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: as the caller promises.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: as the caller promises.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl Elem for f16 {
    const ZERO: f16 = f16::ZERO;
    fn widen(src: &[f16], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
}

impl Elem for bf16 {
    const ZERO: bf16 = bf16::ZERO;
    fn widen(src: &[bf16], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        }
    }
}

/// Asks for the panel's values `PREFETCH_BYTES` past row `kk` of its block (past the block:
/// the same panel's next block, or the next panel).
#[inline(always)]
fn prefetch<T>(panel: *const T, kk: usize) {
    let at = (panel as *const u8).wrapping_add(kk * PANEL * std::mem::size_of::<T>());
    prefetch_lines(at.wrapping_add(PREFETCH_BYTES), 1);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx2<T: Elem, const MR: usize, const NP: usize>(
    x: &[f32],
    ldx: usize,
    kc: usize,
    blocks: &[&[T]; 2],
    d: Dst,
) {
    use std::arch::x86_64::*;
    // Columns 0..8 and 8..16 of each panel.
    let mut lo = [[_mm256_setzero_ps(); NP]; MR];
    let mut hi = [[_mm256_setzero_ps(); NP]; MR];
    let xp = x.as_ptr();
    let wp = [blocks[0].as_ptr(), blocks[1].as_ptr()];
    for kk in 0..kc {
        // SAFETY: kk < kc; x holds MR rows of stride ldx with kc values, each block kc × 16.
        unsafe {
            let mut wl = [_mm256_setzero_ps(); NP];
            let mut wh = [_mm256_setzero_ps(); NP];
            for b in 0..NP {
                if d.prefetch {
                    prefetch(wp[b], kk);
                }
                wl[b] = T::load8(wp[b].add(kk * PANEL));
                wh[b] = T::load8(wp[b].add(kk * PANEL + 8));
            }
            for a in 0..MR {
                let xv = _mm256_broadcast_ss(&*xp.add(a * ldx + kk));
                for b in 0..NP {
                    lo[a][b] = _mm256_fmadd_ps(xv, wl[b], lo[a][b]);
                    hi[a][b] = _mm256_fmadd_ps(xv, wh[b], hi[a][b]);
                }
            }
        }
    }
    for a in 0..MR {
        for b in 0..NP {
            // SAFETY: the caller promises dst's extent.
            unsafe {
                let p = d.p.add(a * d.ld + b * PANEL);
                for (q, v) in [(p, lo[a][b]), (p.add(8), hi[a][b])] {
                    let v = if d.store {
                        v
                    } else {
                        _mm256_add_ps(_mm256_loadu_ps(q), v)
                    };
                    _mm256_storeu_ps(q, v);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx512<T: Elem, const MR: usize, const NP: usize>(
    x: &[f32],
    ldx: usize,
    kc: usize,
    blocks: &[&[T]; 2],
    d: Dst,
) {
    use std::arch::x86_64::*;
    // One register holds a panel's 16 columns.
    let mut r = [[_mm512_setzero_ps(); NP]; MR];
    let xp = x.as_ptr();
    let wp = [blocks[0].as_ptr(), blocks[1].as_ptr()];
    for kk in 0..kc {
        // SAFETY: as in tile_avx2.
        unsafe {
            let mut wv = [_mm512_setzero_ps(); NP];
            for b in 0..NP {
                if d.prefetch {
                    prefetch(wp[b], kk);
                }
                wv[b] = T::load16(wp[b].add(kk * PANEL));
            }
            for a in 0..MR {
                let xv = _mm512_set1_ps(*xp.add(a * ldx + kk));
                for b in 0..NP {
                    r[a][b] = _mm512_fmadd_ps(xv, wv[b], r[a][b]);
                }
            }
        }
    }
    for a in 0..MR {
        for b in 0..NP {
            // SAFETY: the caller promises dst's extent.
            unsafe {
                let q = d.p.add(a * d.ld + b * PANEL);
                let v = if d.store {
                    r[a][b]
                } else {
                    _mm512_add_ps(_mm512_loadu_ps(q), r[a][b])
                };
                _mm512_storeu_ps(q, v);
            }
        }
    }
}

/// The same sequence, one value at a time (`mul_add` is the fused operation).
///
/// # Safety
/// As [`tile`].
#[allow(clippy::needless_range_loop)]
unsafe fn tile_portable<T: Elem, const MR: usize, const NP: usize>(
    x: &[f32],
    ldx: usize,
    kc: usize,
    blocks: &[&[T]; 2],
    d: Dst,
) {
    for a in 0..MR {
        let xr = &x[a * ldx..a * ldx + kc];
        for b in 0..NP {
            for c in 0..PANEL {
                let mut s = 0f32;
                for (kk, &xv) in xr.iter().enumerate() {
                    s = xv.mul_add(blocks[b][kk * PANEL + c].f32(), s);
                }
                // SAFETY: the caller promises dst's extent.
                unsafe {
                    let q = d.p.add(a * d.ld + b * PANEL + c);
                    *q = if d.store { s } else { *q + s };
                }
            }
        }
    }
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

    fn paths() -> Vec<Path> {
        [Path::Portable, Path::Avx2, Path::Avx512]
            .into_iter()
            .filter(|p| p.available())
            .collect()
    }

    fn run(p: Path, x: &[f32], m: usize, k: usize, n: usize, w: Weights<'_>) -> Vec<f32> {
        let mut out = vec![f32::NAN; m * n];
        matmul_on(p, x, m, k, n, &mut out, w);
        out
    }

    #[test]
    fn packing_keeps_every_value() {
        for (n, k) in [(37, 5), (16, 1), (1, 300), (33, 17)] {
            let w = rand(n * k, 9);
            let p = Packed::pack(&w, n, k);
            assert_eq!(p.unpack(), w, "{n}x{k}");
            let mut row = vec![0.0; k];
            p.row_into(n - 1, &mut row);
            assert_eq!(row, w[(n - 1) * k..]);
        }
    }

    /// Against an f64 reference: every shape class (k within one block and across several,
    /// a last panel that is not full, rows past MC).
    #[test]
    fn products_match_the_f64_reference() {
        for (m, k, n) in [
            (5, 77, 9),
            (1, 600, 40),
            (2, 513, 33),
            (131, 300, 50),
            (7, 1, 3),
        ] {
            let x = rand(m * k, 3);
            let w = rand(n * k, 4);
            let pw = Packed::pack(&w, n, k);
            for p in paths() {
                let got = run(p, &x, m, k, n, Weights::F32(&pw));
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                            .sum();
                        let g = got[i * n + j] as f64;
                        assert!(
                            (g - want).abs() < 2e-6 * (k as f64).sqrt() * (1.0 + want.abs()),
                            "{p:?} {m}x{k}x{n} [{i},{j}]: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A row gives bit-identical results whatever the number of rows around it and its place,
    /// on every path, also past MC rows where the rows are cut in blocks.
    #[test]
    fn rows_are_batch_invariant() {
        let (k, n) = (603, 131);
        let w = Packed::pack(&rand(n * k, 1), n, k);
        let m = MC + 9;
        let x = rand(m * k, 2);
        for p in paths() {
            let all = run(p, &x, m, k, n, Weights::F32(&w));
            for i in [0, 1, 5, 16, MC - 1, MC, m - 1] {
                let one = run(p, &x[i * k..(i + 1) * k], 1, k, n, Weights::F32(&w));
                assert_eq!(one, all[i * n..(i + 1) * n], "{p:?} row {i}");
            }
            for (i, r) in [(4, 2), (3, 7), (10, 17)] {
                let some = run(p, &x[i * k..(i + r) * k], r, k, n, Weights::F32(&w));
                assert_eq!(some, all[i * n..(i + r) * n], "{p:?} rows {i}..{}", i + r);
            }
        }
    }

    /// Half weights: the products are exactly those of the widened values.
    #[test]
    fn half_weights_are_their_widened_values() {
        // 29 rows: five tiles and more, where a panel block is widened once (see `task`)
        let (m, k, n) = (29, 300, 35);
        let wf = rand(n * k, 5);
        let x = rand(m * k, 6);
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened_h = Packed::pack(&wh.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), n, k);
        let widened_b = Packed::pack(&wb.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), n, k);
        let (ph, pb) = (Packed::pack(&wh, n, k), Packed::pack(&wb, n, k));
        for p in paths() {
            for mm in [1, 2, 9, m] {
                let xs = &x[..mm * k];
                assert_eq!(
                    run(p, xs, mm, k, n, Weights::F16(&ph)),
                    run(p, xs, mm, k, n, Weights::F32(&widened_h)),
                    "{p:?} f16 m={mm}"
                );
                assert_eq!(
                    run(p, xs, mm, k, n, Weights::BF16(&pb)),
                    run(p, xs, mm, k, n, Weights::F32(&widened_b)),
                    "{p:?} bf16 m={mm}"
                );
            }
        }
    }

    /// Every path computes the same canonical sequence: the same bits, for every weight type
    /// and every tile shape.
    #[test]
    fn paths_agree_to_the_bit() {
        for (m, k, n) in [
            (7, 203, 37),
            (5, 64, 9),
            (1, 15, 6),
            (2, 700, 20),
            (13, 257, 64),
        ] {
            let x = rand(m * k, 11);
            let wf = rand(n * k, 12);
            let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
            let (pf, ph, pb) = (
                Packed::pack(&wf, n, k),
                Packed::pack(&wh, n, k),
                Packed::pack(&wb, n, k),
            );
            for w in [Weights::F32(&pf), Weights::F16(&ph), Weights::BF16(&pb)] {
                let first = run(Path::Portable, &x, m, k, n, w);
                for p in paths() {
                    assert_eq!(run(p, &x, m, k, n, w), first, "{p:?} m={m} k={k} n={n}");
                }
            }
        }
    }
}
