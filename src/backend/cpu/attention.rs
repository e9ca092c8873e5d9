//! Paged attention on the CPU: one task per (row, kv head), the `rep` query heads of that kv
//! head together, so its K and V rows are fetched once for the group.
//!
//! One canonical order of operations, whatever the path (portable, AVX2, AVX-512): a score is
//! a dot product in 16 lanes of fused multiply-adds (lane `l` sums elements `l`, `l + 16`, …),
//! reduced as `reduce8(lanes 0..8 + lanes 8..16)`, the tail (`d mod 16`) added one by one;
//! softmax's exponentials are [`exp_approx`] and their sum is taken in 16 lanes likewise; each
//! output element is `0 + p₀·v₀ + p₁·v₁ + …` in key order with fused multiply-adds. The AVX2
//! path holds the 16 lanes in two registers, AVX-512 in one. So every path gives the same
//! bits, and a row's result does not depend on the other rows of the step.
//!
//! NOTE: on x86 without FMA the portable `mul_add` is a library call: slow, but such CPUs
//! predate AVX2 (which has its own path), and ARM has the instruction.

use super::exp::exp_approx;
#[cfg(target_arch = "x86_64")]
use super::exp::{exp8, exp16};
use super::matmul::{Elem, Path};
use super::simd::{self, reduce8};
use crate::backend::{AttentionOptions, BatchInput};

/// A thread's buffers for its attention tasks: where each key's row starts in the cache, and
/// the scores (`[rep, n_keys]`).
#[derive(Default)]
pub(super) struct Scratch {
    rows: Vec<usize>,
    scores: Vec<f32>,
}

/// A step's attention, whatever the cache's element type.
#[derive(Clone, Copy)]
pub(super) struct AttnArgs<'a> {
    pub row_seq: &'a [usize],
    pub b: &'a BatchInput,
    pub opts: AttentionOptions,
    pub qkv: &'a [f32],
    pub scale: f32,
    pub softcap: f32,
    pub d: usize,
    pub hkv: usize,
    pub rep: usize,
    pub bs: usize,
    pub stride: usize,
}

/// One attention task: the `rep` query heads of one kv head for one row, over a cache of `T`
/// (f32, or f16/bf16 widened exactly as they are loaded).
pub(super) struct AttnTask<'a, T> {
    pub args: AttnArgs<'a>,
    pub kc: &'a [T],
    pub vc: &'a [T],
}

// Path codes for the const-generic body.
const PORTABLE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

/// Keys per block of the SIMD p·v loops: their V rows (256 bytes each at head size 64) stay in
/// L1 while every head of the group passes over them.
const PV_KEYS: usize = 32;

impl<T: Elem> AttnTask<'_, T> {
    /// Task `task` (row `task / hkv`, kv head `task mod hkv`) into `o` (`[rep, d]`), on path
    /// `p` (the portable one where the CPU lacks it).
    pub(super) fn run_on(&self, p: Path, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        match p {
            // SAFETY: the CPU has the path's features (checked here).
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 if p.available() => unsafe { self.run_avx512(scratch, task, o) },
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 if p.available() => unsafe { self.run_avx2(scratch, task, o) },
            _ => self.run::<PORTABLE>(scratch, task, o),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        self.run::<AVX2>(scratch, task, o)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
    unsafe fn run_avx512(&self, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        self.run::<AVX512>(scratch, task, o)
    }

    #[inline(always)]
    fn run<const P: u8>(&self, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        let (kc, vc) = (self.kc, self.vc);
        let AttnArgs {
            row_seq,
            b,
            opts,
            qkv,
            scale,
            softcap,
            d,
            hkv,
            rep,
            bs,
            stride,
        } = self.args;
        let (t, g) = (task / hkv, task % hkv);
        let s = row_seq[t];
        let q_end = b.query_start[s + 1] as usize;
        let ctx = b.seq_lens[s] as usize;
        // the last row of the sequence sits at position ctx - 1; with a sliding window
        // the row sees keys k0 .. k0 + n_keys only
        let end = ctx - (q_end - 1 - t);
        let k0 = opts.first_key(end);
        let n_keys = end - k0;
        // Where each key's row starts in the cache, in key order: block by block, so that no
        // key costs a division by the block size.
        let table = &b.block_tables[s * b.max_blocks..(s + 1) * b.max_blocks];
        let rows = &mut scratch.rows;
        rows.clear();
        for (bi, &blk) in table
            .iter()
            .enumerate()
            .take(end.div_ceil(bs))
            .skip(k0 / bs)
        {
            let base = (blk as usize * hkv + g) * bs;
            let (lo, hi) = (k0.max(bi * bs), end.min((bi + 1) * bs));
            rows.extend((lo - bi * bs..hi - bi * bs).map(|off| (base + off) * d));
        }
        let rows = &rows[..];
        let q0 = t * stride + g * rep * d;
        let qs = &qkv[q0..q0 + rep * d];
        let nk = n_keys.max(1);
        let scores = &mut scratch.scores;
        scores.clear();
        scores.resize(rep * nk, 0.0);
        match P {
            // SAFETY: the CPU has the path's features (run_on).
            #[cfg(target_arch = "x86_64")]
            AVX512 => unsafe { x86::qk_avx512(qs, kc, vc, rows, d, nk, scores) },
            #[cfg(target_arch = "x86_64")]
            AVX2 => unsafe { x86::qk_avx2(qs, kc, vc, rows, d, nk, scores) },
            _ => {
                for (q, row) in qs.chunks_exact(d).zip(scores.chunks_exact_mut(nk)) {
                    for (sc, &at) in row.iter_mut().zip(rows) {
                        *sc = dot16(q, &kc[at..at + d]);
                    }
                }
            }
        }
        for (r, row) in scores.chunks_mut(nk).enumerate() {
            let row = &mut row[..n_keys];
            let mut max = match P {
                // SAFETY: the CPU has AVX2 (run_on).
                #[cfg(target_arch = "x86_64")]
                AVX2 | AVX512 if softcap <= 0.0 => unsafe { x86::scale_max_avx2(row, scale) },
                _ => scale_max(row, scale, softcap),
            };
            if let Some(a) = opts.alibi {
                // key k0 + j of the row at position end - 1
                let slope = a.slope(g * rep + r);
                for (j, sc) in row.iter_mut().enumerate() {
                    *sc = slope.mul_add((k0 + j) as f32 - (end - 1) as f32, *sc);
                }
                max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            }
            let sum = match P {
                // SAFETY: the CPU has the path's features (run_on).
                #[cfg(target_arch = "x86_64")]
                AVX512 => unsafe { x86::exp_sum_avx512(row, max) },
                #[cfg(target_arch = "x86_64")]
                AVX2 => unsafe { x86::exp_sum_avx2(row, max) },
                _ => exp_sum(row, max),
            };
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|p| *p *= inv);
        }
        // p·v: 64 columns at a time in registers, over blocks of keys whose V rows stay in L1
        // while every head passes over them (a head's partial sums wait in `o` between
        // blocks); the columns past the last 64 on the portable loop.
        let c_simd = if P == PORTABLE { 0 } else { d / 64 * 64 };
        #[cfg(target_arch = "x86_64")]
        for k0 in (0..n_keys).step_by(PV_KEYS) {
            let k1 = (k0 + PV_KEYS).min(n_keys);
            for c0 in (0..c_simd).step_by(64) {
                // SAFETY: the CPU has the path's features (run_on); c0 + 64 <= d.
                unsafe {
                    if P == AVX512 {
                        x86::pv64_avx512(scores, nk, k0..k1, vc, rows, c0, d, o, k0 == 0)
                    } else {
                        for (r, o) in o.chunks_exact_mut(d).enumerate().take(rep) {
                            let p = &scores[r * nk + k0..r * nk + k1];
                            let o = &mut o[c0..c0 + 64];
                            x86::pv64_avx2(p, vc, &rows[k0..k1], c0, o, k0 == 0);
                        }
                    }
                }
            }
        }
        for (r, o) in o.chunks_exact_mut(d).enumerate().take(rep) {
            let p = &scores[r * nk..r * nk + n_keys];
            let rest = &mut o[c_simd..];
            rest.fill(0.0);
            for (&pj, &at) in p.iter().zip(rows) {
                for (a, v) in rest.iter_mut().zip(&vc[at + c_simd..at + d]) {
                    *a = pj.mul_add(v.f32(), *a);
                }
            }
        }
    }
}

/// Keys ahead of the one being scored whose K and V rows are asked for.
const AHEAD: usize = 16;

/// Asks for the K and V rows of keys `keys` (those that exist).
/// NOTE: a step's contexts are far larger than the caches, so every key's K and V come from
/// memory, one scattered row each; the scores' loop asks for both ahead, so that V is in
/// cache when p·v comes to it (attention's share of a 64-sequence f16 decode step, 17% -> 10%).
#[inline(always)]
fn prefetch_kv<T>(kc: &[T], vc: &[T], rows: &[usize], keys: std::ops::Range<usize>, d: usize) {
    let bytes = d * std::mem::size_of::<T>();
    for &at in &rows[keys.start.min(rows.len())..keys.end.min(rows.len())] {
        simd::prefetch_lines(kc.as_ptr().wrapping_add(at) as *const u8, bytes);
        simd::prefetch_lines(vc.as_ptr().wrapping_add(at) as *const u8, bytes);
    }
}

/// 16 lanes reduced: `reduce8(lanes 0..8 + lanes 8..16)`.
#[inline(always)]
fn reduce16(l: &[f32; 16]) -> f32 {
    reduce8(&std::array::from_fn(|i| l[i] + l[i + 8]))
}

/// The canonical score: `Σ a·b` in 16 lanes of fused multiply-adds, [`reduce16`], then the
/// tail one by one.
#[inline(always)]
fn dot16<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l].f32(), acc[l]);
        }
    }
    let mut s = reduce16(&acc);
    for (x, y) in ar.iter().zip(br) {
        s = x.mul_add(y.f32(), s);
    }
    s
}

/// `row[j] = row[j]·scale` (then the soft cap `c·tanh(row[j] / c)` where `c > 0`); returns
/// the largest.
fn scale_max(row: &mut [f32], scale: f32, softcap: f32) -> f32 {
    for sc in row.iter_mut() {
        *sc *= scale;
        if softcap > 0.0 {
            *sc = softcap * (*sc / softcap).tanh();
        }
    }
    row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// `row[j] = exp(row[j] - max)` ([`exp_approx`]); returns their sum, taken in 16 lanes,
/// [`reduce16`], then the tail one by one.
fn exp_sum(row: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *x = exp_approx(*x - max);
            *a += *x;
        }
    }
    let mut s = reduce16(&acc);
    for x in chunks.into_remainder() {
        *x = exp_approx(*x - max);
        s += *x;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// The 16-lane sums of four dot products (each its lanes 0..8 and 8..16 in two registers)
    /// reduced as [`reduce16`] does, with shared shuffles: `[a₀, a₁, a₂, a₃]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce16x4(lo: [__m256; 4], hi: [__m256; 4]) -> [f32; 4] {
        let a: [__m256; 4] = std::array::from_fn(|u| _mm256_add_ps(lo[u], hi[u]));
        // Lanes l + (l + 4) of a[0] | a[1], and of a[2] | a[3].
        let t01 = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a[0], a[1]),
            _mm256_permute2f128_ps::<0x31>(a[0], a[1]),
        );
        let t23 = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a[2], a[3]),
            _mm256_permute2f128_ps::<0x31>(a[2], a[3]),
        );
        // Per 128-bit half: (t₀ + t₂, t'₀ + t'₂, t₁ + t₃, t'₁ + t'₃) for a[0] and a[2] (low
        // half), a[1] and a[3] (high half); then (t₀ + t₂) + (t₁ + t₃) in lanes 0 and 1.
        let x = _mm256_add_ps(_mm256_unpacklo_ps(t01, t23), _mm256_unpackhi_ps(t01, t23));
        let y = _mm256_add_ps(x, _mm256_permute_ps::<0b01_00_11_10>(x));
        let mut l = [0f32; 8];
        // SAFETY: l holds 8 values.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), y) };
        [l[0], l[4], l[1], l[5]]
    }

    /// Keys `j .. j + 4`'s tails added to their sums, into `out[..4]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn finish4<T: Elem>(sums: [f32; 4], q: &[f32], k: &[&[T]; 4], from: usize, out: &mut [f32]) {
        for ((o, s), k) in out.iter_mut().zip(sums).zip(k) {
            *o = q[from..]
                .iter()
                .zip(&k[from..])
                .fold(s, |s, (x, y)| x.mul_add(y.f32(), s));
        }
    }

    /// `out[r·nk + j] = dot16(q_r, k_j)` for the `qs.len() / d` query heads and the keys whose
    /// rows start at `rows[j]`: four keys at a time, for every head while the four K rows sit
    /// in L1 (each load of q serves four keys); the last few keys one by one.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn qk_avx2<T: Elem>(
        qs: &[f32],
        kc: &[T],
        vc: &[T],
        rows: &[usize],
        d: usize,
        nk: usize,
        out: &mut [f32],
    ) {
        let d16 = d / 16 * 16;
        let n = rows.len().min(nk);
        prefetch_kv(kc, vc, rows, 0..AHEAD, d);
        let mut j = 0;
        while j + 4 <= n {
            prefetch_kv(kc, vc, rows, j + AHEAD..j + AHEAD + 4, d);
            let k: [&[T]; 4] = std::array::from_fn(|u| &kc[rows[j + u]..rows[j + u] + d]);
            for (q, out) in qs.chunks_exact(d).zip(out.chunks_exact_mut(nk)) {
                let mut lo = [_mm256_setzero_ps(); 4];
                let mut hi = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                while i < d16 {
                    // SAFETY: i + 16 <= d16 <= d, the length of q and of every k.
                    unsafe {
                        let x0 = _mm256_loadu_ps(q.as_ptr().add(i));
                        let x1 = _mm256_loadu_ps(q.as_ptr().add(i + 8));
                        for u in 0..4 {
                            let y0 = T::load8(k[u].as_ptr().add(i));
                            let y1 = T::load8(k[u].as_ptr().add(i + 8));
                            lo[u] = _mm256_fmadd_ps(x0, y0, lo[u]);
                            hi[u] = _mm256_fmadd_ps(x1, y1, hi[u]);
                        }
                    }
                    i += 16;
                }
                finish4(reduce16x4(lo, hi), q, &k, d16, &mut out[j..j + 4]);
            }
            j += 4;
        }
        for (q, out) in qs.chunks_exact(d).zip(out.chunks_exact_mut(nk)) {
            for (sc, &at) in out[j..n].iter_mut().zip(&rows[j..n]) {
                *sc = dot16(q, &kc[at..at + d]);
            }
        }
    }

    /// [`qk_avx2`] with one 16-lane register per sum, four keys against two heads at a time
    /// (eight sums side by side).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
    pub(super) fn qk_avx512<T: Elem>(
        qs: &[f32],
        kc: &[T],
        vc: &[T],
        rows: &[usize],
        d: usize,
        nk: usize,
        out: &mut [f32],
    ) {
        let d16 = d / 16 * 16;
        let n = rows.len().min(nk);
        let heads = qs.len() / d;
        let halves = |a: [__m512; 4]| {
            (
                a.map(|v| _mm512_castps512_ps256(v)),
                a.map(|v| _mm512_extractf32x8_ps::<1>(v)),
            )
        };
        prefetch_kv(kc, vc, rows, 0..AHEAD, d);
        let mut j = 0;
        while j + 4 <= n {
            prefetch_kv(kc, vc, rows, j + AHEAD..j + AHEAD + 4, d);
            let k: [&[T]; 4] = std::array::from_fn(|u| &kc[rows[j + u]..rows[j + u] + d]);
            let mut h = 0;
            while h < heads {
                let two = h + 1 < heads;
                let q0 = &qs[h * d..(h + 1) * d];
                let q1 = if two {
                    &qs[(h + 1) * d..(h + 2) * d]
                } else {
                    q0
                };
                let mut a0 = [_mm512_setzero_ps(); 4];
                let mut a1 = [_mm512_setzero_ps(); 4];
                let mut i = 0;
                while i < d16 {
                    // SAFETY: i + 16 <= d16 <= d, the length of each q and k.
                    unsafe {
                        let x0 = _mm512_loadu_ps(q0.as_ptr().add(i));
                        let x1 = _mm512_loadu_ps(q1.as_ptr().add(i));
                        for u in 0..4 {
                            let y = T::load16(k[u].as_ptr().add(i));
                            a0[u] = _mm512_fmadd_ps(x0, y, a0[u]);
                            if two {
                                a1[u] = _mm512_fmadd_ps(x1, y, a1[u]);
                            }
                        }
                    }
                    i += 16;
                }
                let (lo, hi) = halves(a0);
                let out0 = &mut out[h * nk + j..h * nk + j + 4];
                finish4(reduce16x4(lo, hi), q0, &k, d16, out0);
                if two {
                    let (lo, hi) = halves(a1);
                    let out1 = &mut out[(h + 1) * nk + j..(h + 1) * nk + j + 4];
                    finish4(reduce16x4(lo, hi), q1, &k, d16, out1);
                }
                h += if two { 2 } else { 1 };
            }
            j += 4;
        }
        for (q, out) in qs.chunks_exact(d).zip(out.chunks_exact_mut(nk)) {
            for (sc, &at) in out[j..n].iter_mut().zip(&rows[j..n]) {
                *sc = dot16(q, &kc[at..at + d]);
            }
        }
    }

    /// [`scale_max`] without a soft cap, eight lanes at a time: the same products, and the
    /// maximum does not depend on the order it is taken in.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn scale_max_avx2(row: &mut [f32], scale: f32) -> f32 {
        let sc = _mm256_set1_ps(scale);
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut chunks = row.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: c holds 8 values.
            unsafe {
                let x = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), sc);
                _mm256_storeu_ps(c.as_mut_ptr(), x);
                m = _mm256_max_ps(m, x);
            }
        }
        let mut l = [0f32; 8];
        // SAFETY: l holds 8 values.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), m) };
        let mut max = l.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        for x in chunks.into_remainder() {
            *x *= scale;
            max = max.max(*x);
        }
        max
    }

    /// [`exp_sum`] with two 8-lane registers for the 16 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn exp_sum_avx2(row: &mut [f32], max: f32) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let m = _mm256_set1_ps(max);
        let mut chunks = row.chunks_exact_mut(16);
        for c in &mut chunks {
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: c holds 16 values.
                unsafe {
                    let p = c.as_mut_ptr().add(8 * h);
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                    _mm256_storeu_ps(p, e);
                    *acc = _mm256_add_ps(*acc, e);
                }
            }
        }
        let mut s = simd::hsum8(_mm256_add_ps(acc[0], acc[1]));
        for x in chunks.into_remainder() {
            *x = exp_approx(*x - max);
            s += *x;
        }
        s
    }

    /// [`exp_sum`] with one 16-lane register.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
    pub(super) fn exp_sum_avx512(row: &mut [f32], max: f32) -> f32 {
        let mut acc = _mm512_setzero_ps();
        let m = _mm512_set1_ps(max);
        let mut chunks = row.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: c holds 16 values.
            unsafe {
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
                _mm512_storeu_ps(c.as_mut_ptr(), e);
                acc = _mm512_add_ps(acc, e);
            }
        }
        let lo = _mm512_castps512_ps256(acc);
        let mut s = simd::hsum8(_mm256_add_ps(lo, _mm512_extractf32x8_ps::<1>(acc)));
        for x in chunks.into_remainder() {
            *x = exp_approx(*x - max);
            s += *x;
        }
        s
    }

    /// `o[..64] (+)= Σ_j p[j] · v_j[c0 .. c0 + 64]` over the keys in order (`rows[j]`: where
    /// key j's row starts), in eight registers; from zero when `first`, else on from `o`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn pv64_avx2<T: Elem>(
        p: &[f32],
        vc: &[T],
        rows: &[usize],
        c0: usize,
        o: &mut [f32],
        first: bool,
    ) {
        let mut acc = [_mm256_setzero_ps(); 8];
        if !first {
            for (u, acc) in acc.iter_mut().enumerate() {
                // SAFETY: o holds 64 values.
                *acc = unsafe { _mm256_loadu_ps(o.as_ptr().add(8 * u)) };
            }
        }
        for (&pj, &at) in p.iter().zip(rows) {
            let v = &vc[at + c0..at + c0 + 64];
            let pj = _mm256_set1_ps(pj);
            for (u, acc) in acc.iter_mut().enumerate() {
                // SAFETY: v holds 64 values.
                let x = unsafe { T::load8(v.as_ptr().add(8 * u)) };
                *acc = _mm256_fmadd_ps(pj, x, *acc);
            }
        }
        for (u, acc) in acc.iter().enumerate() {
            // SAFETY: o holds 64 values.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * u), *acc) };
        }
    }

    /// Columns `c0 .. c0 + 64` of every head's output (`o`: `[heads, d]`) over keys `keys`
    /// (scores `p`: `[heads, nk]`), two heads at a time so that each V load serves both (eight
    /// sums in flight); from zero when `first`, else on from `o`.
    // NOTE: indices, not iterators: the two heads' registers are used in lockstep.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
    pub(super) fn pv64_avx512<T: Elem>(
        p: &[f32],
        nk: usize,
        keys: std::ops::Range<usize>,
        vc: &[T],
        rows: &[usize],
        c0: usize,
        d: usize,
        o: &mut [f32],
        first: bool,
    ) {
        let heads = o.len() / d;
        let mut h = 0;
        while h < heads {
            let two = h + 1 < heads;
            let (o0, o1) = (h * d + c0, (h + 1) * d + c0);
            let mut acc = [[_mm512_setzero_ps(); 4]; 2];
            if !first {
                for u in 0..4 {
                    // SAFETY: o holds `heads` rows of d >= c0 + 64 values.
                    unsafe {
                        acc[0][u] = _mm512_loadu_ps(o.as_ptr().add(o0 + 16 * u));
                        if two {
                            acc[1][u] = _mm512_loadu_ps(o.as_ptr().add(o1 + 16 * u));
                        }
                    }
                }
            }
            let p0 = &p[h * nk + keys.start..h * nk + keys.end];
            let p1 = if two {
                &p[(h + 1) * nk + keys.start..(h + 1) * nk + keys.end]
            } else {
                p0
            };
            for ((&a, &b), &at) in p0.iter().zip(p1).zip(&rows[keys.clone()]) {
                let v = &vc[at + c0..at + c0 + 64];
                let (a, b) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
                for u in 0..4 {
                    // SAFETY: v holds 64 values.
                    let x = unsafe { T::load16(v.as_ptr().add(16 * u)) };
                    acc[0][u] = _mm512_fmadd_ps(a, x, acc[0][u]);
                    if two {
                        acc[1][u] = _mm512_fmadd_ps(b, x, acc[1][u]);
                    }
                }
            }
            for u in 0..4 {
                // SAFETY: as above.
                unsafe {
                    _mm512_storeu_ps(o.as_mut_ptr().add(o0 + 16 * u), acc[0][u]);
                    if two {
                        _mm512_storeu_ps(o.as_mut_ptr().add(o1 + 16 * u), acc[1][u]);
                    }
                }
            }
            h += if two { 2 } else { 1 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn paths() -> Vec<Path> {
        [Path::Avx2, Path::Avx512]
            .into_iter()
            .filter(|p| p.available())
            .collect()
    }

    /// `exp_approx` against f64's `exp` over the range softmax uses (and a little past 0),
    /// and its clamps; every SIMD path's `exp_sum` gives the portable bits.
    #[test]
    fn exp_approx_is_within_2_5e_7_and_the_same_on_every_path() {
        let xs: Vec<f32> = (0..20_000)
            .map(|i| -87.0 + 90.0 * i as f32 / 20_000.0)
            .chain([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.33])
            .collect();
        for &x in &xs {
            let (got, want) = (exp_approx(x), (x as f64).exp());
            assert!(
                ((got as f64 - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, not {want}"
            );
        }
        assert_eq!(exp_approx(-1e4), exp_approx(-87.336_55));
        assert!(exp_approx(-1e4) > 0.0 && exp_approx(-1e4) < 1.2e-38);
        assert!(exp_approx(1e4).is_finite());
        let mut want = xs.clone();
        let s = exp_sum(&mut want, 0.5);
        for p in paths() {
            let mut got = xs.clone();
            // SAFETY: the path is available.
            let t = unsafe {
                match p {
                    Path::Avx512 => x86::exp_sum_avx512(&mut got, 0.5),
                    _ => x86::exp_sum_avx2(&mut got, 0.5),
                }
            };
            assert_eq!((&got, t), (&want, s), "{p:?}");
        }
    }

    /// Every SIMD path gives the portable loops' bits: head sizes below, at and past the 16-
    /// and 64-column parts (with tails), prefill and decode rows, more keys than a p·v block,
    /// odd and even counts of heads per kv head, a window and a soft cap; over f32, f16 and
    /// bf16 caches.
    #[test]
    fn attention_on_every_path_matches_the_portable_loops_to_the_bit() {
        let mut seed = 0x5eed_a77e_u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let (hkv, bs, num_blocks) = (2, 4, 16);
        // sequence 0: 9 keys, its last 5 rows in the batch; sequence 1: 45 keys (more than
        // one block of PV_KEYS), one row
        let b = BatchInput {
            query_start: vec![0, 5, 6],
            seq_lens: vec![9, 45],
            block_tables: vec![
                3, 1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15,
            ],
            max_blocks: 12,
            ..Default::default()
        };
        let row_seq = [0, 0, 0, 0, 0, 1];
        for (d, rep) in [
            (8, 3),
            (16, 2),
            (24, 1),
            (64, 3),
            (80, 4),
            (128, 3),
            (136, 2),
        ] {
            let stride = (rep + 2) * hkv * d;
            let qkv: Vec<f32> = (0..6 * stride).map(|_| rnd()).collect();
            let kc: Vec<f32> = (0..num_blocks * hkv * bs * d).map(|_| rnd()).collect();
            let vc: Vec<f32> = (0..num_blocks * hkv * bs * d).map(|_| rnd()).collect();
            for (window, softcap) in [(None, 0.0), (Some(7), 1.5)] {
                let args = AttnArgs {
                    row_seq: &row_seq,
                    b: &b,
                    opts: AttentionOptions {
                        scale: 0.3,
                        sliding_window: window,
                        logit_softcap: None,
                        alibi: None,
                    },
                    qkv: &qkv,
                    scale: 0.3,
                    softcap,
                    d,
                    hkv,
                    rep,
                    bs,
                    stride,
                };
                let what = format!("d={d} window {window:?}");
                let f32_cache = same_on_every_path(
                    &AttnTask {
                        args,
                        kc: &kc,
                        vc: &vc,
                    },
                    &what,
                );
                let f16_cache = half_cache(args, &kc, &vc, f16::from_f32, &what);
                assert_ne!(f16_cache, f32_cache, "{what}: the f16 cache rounds");
                half_cache(args, &kc, &vc, bf16::from_f32, &what);
            }
        }
    }

    /// Every task's output over K and V rounded to `T`, after checking that it is the same on
    /// every path and the same as over an f32 cache holding the rounded values (a half cache is
    /// widened exactly).
    fn half_cache<T: Elem>(
        args: AttnArgs,
        kc: &[f32],
        vc: &[f32],
        round: impl Fn(f32) -> T,
        what: &str,
    ) -> Vec<Vec<f32>> {
        let (kh, vh): (Vec<T>, Vec<T>) = (
            kc.iter().map(|&x| round(x)).collect(),
            vc.iter().map(|&x| round(x)).collect(),
        );
        let widen = |c: &[T]| c.iter().map(|x| x.f32()).collect::<Vec<_>>();
        let (kw, vw) = (widen(&kh), widen(&vh));
        let half = same_on_every_path(
            &AttnTask {
                args,
                kc: &kh,
                vc: &vh,
            },
            what,
        );
        let widened = same_on_every_path(
            &AttnTask {
                args,
                kc: &kw,
                vc: &vw,
            },
            what,
        );
        assert_eq!(half, widened, "{what}");
        half
    }

    /// Every task's output on the portable path, after checking that every SIMD path gives
    /// the same bits.
    fn same_on_every_path<T: Elem>(task: &AttnTask<T>, what: &str) -> Vec<Vec<f32>> {
        let (rep, d) = (task.args.rep, task.args.d);
        (0..task.args.row_seq.len() * task.args.hkv)
            .map(|t| {
                let mut want = vec![f32::NAN; rep * d];
                task.run_on(Path::Portable, &mut Scratch::default(), t, &mut want);
                assert!(want.iter().all(|v| v.is_finite()), "{what} task {t}");
                for p in paths() {
                    let mut got = vec![f32::NAN; rep * d];
                    task.run_on(p, &mut Scratch::default(), t, &mut got);
                    assert_eq!(got, want, "{p:?} {what} task {t}");
                }
                want
            })
            .collect()
    }
}
