//! `y = x · Wᵀ` with `W` kept in its GGML block format, for the CPU backend: here the blocks of
//! 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL); the super-blocks of 256 (Q2_K … Q6_K, IQ4_XS) in
//! [`kquant`], against activations quantized per 256. A weight may mix both (its parts).
//!
//! The scheme is llama.cpp's; the code is ours. Each row of `x` is quantized to 8 bits per
//! block of 32 values (a scale `d = max|x| / 127`, 32 i8 `q`, and `d·Σq`). A weight row is
//! walked one block `j` at a time, decoded in registers into 32 small integers `v`, a scale and
//! a minimum, so that `w = scale·v + min` exactly as the reference dequantizer computes it. For
//! one output element:
//!
//! ```text
//!   acc[16], block j adds to lanes 8·(j mod 2) .. +8, lane l of those summing 4 values:
//!     acc[8·(j mod 2) + l] = fma(Σ v·q over its 4 values, scale·d, acc[..])
//!   (an odd count of blocks ends with one fma(0, 0, ·) on the odd lanes)
//!   mins (types with one): macc[j mod 8] = fma(min_j, d·Σq_j, macc[..]), padded to 8 likewise
//!   y = reduce8(acc[0..8] + acc[8..16]) + reduce8(macc)
//! ```
//!
//! The integer dot `Σ v·q` is exact on every path: AVX2 `maddubs` with the sign trick (|v| ≤ 128
//! and |q| ≤ 127 never saturate its i16 pairs), AVX-512 VNNI `dpbusd` on `q + 128` (unsigned)
//! minus `128·Σv`.
//!
//! NOTE: every path computes every output element with exactly the operations above, in that
//! order: the AVX-512 path with two blocks per 16-lane register, AVX2 with an even and an
//! odd 8-lane accumulator, the portable path lane by lane. So the paths agree to the bit, and a
//! row's result does not depend on the other rows of the batch (batch invariance, as in
//! matmul.rs).
//!
//! Tiles: one weight row against up to MR rows of `x` (8 with AVX-512, 4 otherwise), the
//! accumulators in registers. Weight rows are split into slabs of SLAB rows for the threads; a
//! slab stays in L2 while every tile of `x` passes over it. The row is decoded once per tile,
//! except with more than one tile, where the slab is decoded once into [`Decoded`] and every
//! tile of 4 rows reads the values from there with the AVX2 kernel.

use super::simd::{PREFETCH_BYTES, prefetch_lines, reduce8};
use crate::quant::{IQ4_LEVELS, QuantTensor};
pub use codes::Path;
use codes::*;
use half::f16;
use rayon::prelude::*;

mod codes;
mod kquant;

/// Weight rows per parallel task.
const SLAB: usize = 32;
/// The path chosen once per process.
pub fn path() -> Path {
    static PATH: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
    *PATH.get_or_init(Path::detect)
}

/// Rows of `x` quantized per block of 32, padded (with zeros) to an even count of blocks:
/// `q` and `u = q + 128` `[m, kp]`, the scales `d` `[m, nbp]` and the same repeated over 8
/// lanes `d8` `[m, 8·nbp]`, and `s = d·Σq` `[m, nm]` (padded to a multiple of 8).
pub struct QuantizedRows {
    q: Vec<i8>,
    u: Vec<u8>,
    d: Vec<f32>,
    d8: Vec<f32>,
    s: Vec<f32>,
    /// Sub-blocks, padded counts, values per padded row.
    nb: usize,
    nbp: usize,
    nm: usize,
    kp: usize,
}

/// Quantizes `m` rows of `k` values (`k` a multiple of 32), each row on its own.
pub fn quantize_rows(x: &[f32], m: usize, k: usize) -> QuantizedRows {
    quantize_rows_on(path(), x, m, k)
}

/// The same on a given path (every path gives the same bits; tests force each one).
pub fn quantize_rows_on(p: Path, x: &[f32], m: usize, k: usize) -> QuantizedRows {
    debug_assert!(k.is_multiple_of(32) && x.len() >= m * k);
    let simd = p != Path::Portable && Path::Avx2.available();
    let nb = k / 32;
    let nbp = nb.next_multiple_of(2);
    let nm = nb.next_multiple_of(8);
    let kp = 32 * nbp;
    let mut r = QuantizedRows {
        q: vec![0; m * kp],
        u: vec![128; m * kp],
        d: vec![0.0; m * nbp],
        d8: vec![0.0; m * nbp * 8],
        s: vec![0.0; m * nm],
        nb,
        nbp,
        nm,
        kp,
    };
    if m == 0 || nb == 0 {
        return r;
    }
    type Row<'a> = (
        (
            (((&'a [f32], &'a mut [i8]), &'a mut [u8]), &'a mut [f32]),
            &'a mut [f32],
        ),
        &'a mut [f32],
    );
    let row = |(((((x, q), u), d), d8), s): Row<'_>| {
        for b in 0..nb {
            let xs: &[f32; 32] = x[32 * b..32 * b + 32].try_into().expect("32 values");
            let qb: &mut [i8; 32] = (&mut q[32 * b..32 * b + 32]).try_into().expect("32");
            let ub: &mut [u8; 32] = (&mut u[32 * b..32 * b + 32]).try_into().expect("32");
            #[cfg(target_arch = "x86_64")]
            let (scale, sum) = if simd {
                // SAFETY: AVX2 was detected above.
                unsafe { x86::quantize_block(xs, qb, ub) }
            } else {
                quantize_block(xs, qb, ub)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let (scale, sum) = quantize_block(xs, qb, ub);
            d[b] = scale;
            d8[8 * b..8 * b + 8].fill(scale);
            s[b] = scale * sum as f32;
        }
    };
    let parts = x[..m * k]
        .par_chunks(k)
        .zip(r.q.par_chunks_mut(kp))
        .zip(r.u.par_chunks_mut(kp))
        .zip(r.d.par_chunks_mut(nbp))
        .zip(r.d8.par_chunks_mut(8 * nbp))
        .zip(r.s.par_chunks_mut(nm));
    if m >= 8 {
        parts.for_each(row);
    } else {
        // NOTE: a handful of rows is quicker on this thread than handed to the pool.
        x[..m * k]
            .chunks(k)
            .zip(r.q.chunks_mut(kp))
            .zip(r.u.chunks_mut(kp))
            .zip(r.d.chunks_mut(nbp))
            .zip(r.d8.chunks_mut(8 * nbp))
            .zip(r.s.chunks_mut(nm))
            .for_each(row);
    }
    r
}

/// One block of 32 activations to 8 bits: `q = round(x / d)` (ties to even, as the SIMD
/// rounding instruction does) with `d = max|x| / 127`, `u = q + 128`; returns `d` and `Σq`.
fn quantize_block(x: &[f32; 32], q: &mut [i8; 32], u: &mut [u8; 32]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for ((o, ou), &v) in q.iter_mut().zip(u.iter_mut()).zip(x) {
        let qv = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i32;
        *o = qv as i8;
        *ou = (qv + 128) as u8;
        sum += qv;
    }
    (scale, sum)
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
    let types: Vec<u8> = w
        .parts
        .iter()
        .map(|part| code(part.ty).expect("QuantTensor holds kernel types only"))
        .collect();
    // x quantized per 32 for the blocks of 32, per 256 for the K-quants (only as needed).
    let rows32 = if types.iter().any(|&t| !is_k(t)) {
        m
    } else {
        0
    };
    let xq = quantize_rows_on(p, x, rows32, k);
    let xk = types
        .iter()
        .any(|&t| is_k(t))
        .then(|| kquant::quantize_rows256(p != Path::Portable, x, m, k));
    let tile_rows = if p == Path::Avx512 { MR } else { 4 };
    // NOTE: where x is one tile, each weight row is read once: a few large tasks per thread
    // (fewer hand-offs); otherwise slabs small enough to stay in L2 while the tiles pass.
    let slab = if m <= tile_rows {
        n.div_ceil(4 * rayon::current_num_threads()).max(SLAB)
    } else {
        SLAB
    };
    // (part, first output column, first row in the part, rows)
    let mut tasks = Vec::new();
    let mut col = 0;
    for (pi, part) in w.parts.iter().enumerate() {
        for r in (0..part.rows).step_by(slab) {
            tasks.push((pi, col + r, r, slab.min(part.rows - r)));
        }
        col += part.rows;
    }
    let out_ptr = SendPtr(out.as_mut_ptr());
    let (xq, xk) = (&xq, &xk);
    tasks.into_par_iter().for_each_init(
        // A weight row's minimums, padded with zeros to a multiple of 8; a decoded slab.
        || (vec![0f32; xq.nm], Decoded::default()),
        |(mins, dec), (pi, j0, r0, nj)| {
            let part = &w.parts[pi];
            let t = types[pi];
            let rb = part.data.len() / part.rows;
            let rows = &part.data[r0 * rb..(r0 + nj) * rb];
            // NOTE: with several tiles of x, each slab of blocks of 32 is decoded once into
            // `Decoded` and every tile of 4 rows reads it there with the AVX2 kernel, instead
            // of decoding every weight row once per tile. On AVX-512 only for long rows: a
            // tile of 8 rows of x takes 16 bytes per value of k (`u` and `d8`), past L1 from
            // k = 2048, and at k = 4096 decoding per tile of 8 ran 64 rows at half AVX2's
            // speed; below, its 512-bit dots win. The paths agree to the bit, so the bits do
            // not change. (The K-quants decode a super-block once for the tile's rows and
            // spend most on the dots.)
            let predecode =
                !is_k(t) && m > tile_rows && (p == Path::Avx2 || (p == Path::Avx512 && k >= 2048));
            if predecode {
                dec.decode(t, rows, rb, nj, xq);
            }
            let tile_rows = if predecode { 4 } else { tile_rows };
            let o = out_ptr;
            let mut i = 0;
            while i < m {
                let mr = tile_rows.min(m - i);
                for jj in 0..nj {
                    // NOTE: the first tile streams the weights from memory: ask for them
                    // ahead (see matmul's PREFETCH_BYTES); the others find them in cache.
                    if i == 0 && !predecode {
                        let at = rows.as_ptr().wrapping_add(jj * rb + PREFETCH_BYTES);
                        prefetch_lines(at, rb);
                    }
                    let row = &rows[jj * rb..(jj + 1) * rb];
                    let mut r = [0f32; MR];
                    match xk {
                        Some(xk) if is_k(t) => kquant::run(p, t, mr, row, xk, i, &mut r),
                        _ if predecode => dec.run(t, jj, mr, Tile { x: xq, i }, &mut r),
                        _ => run(p, t, mr, row, Tile { x: xq, i }, mins, &mut r),
                    }
                    for (a, v) in r[..mr].iter().enumerate() {
                        // SAFETY: this task alone writes columns j0 .. j0 + nj of `out` (m
                        // rows of stride n), and i + a < m.
                        unsafe { *o.0.add((i + a) * n + j0 + jj) = *v };
                    }
                }
                i += mr;
            }
        },
    );
}

/// A slab of weight rows decoded for the AVX2 kernel, as [`x86::decode`] gives them: per row,
/// each sub-block's 32 values `v` (`[rows, kp]`, zero in the padding), its 8 lanes' scales
/// (`[rows, 8·nbp]`) and the minimums (`[rows, nm]`, zero in the padding).
#[derive(Default)]
struct Decoded {
    v: Vec<i8>,
    scale: Vec<f32>,
    mins: Vec<f32>,
}

impl Decoded {
    /// Decodes `nrows` rows of type `t` (`rows` holds them, `rb` bytes each) for the columns
    /// of `x`.
    fn decode(&mut self, t: u8, rows: &[u8], rb: usize, nrows: usize, x: &QuantizedRows) {
        self.v.clear();
        self.v.resize(nrows * x.kp, 0);
        self.scale.clear();
        self.scale.resize(nrows * 8 * x.nbp, 0.0);
        self.mins.clear();
        self.mins.resize(nrows * x.nm, 0.0);
        #[cfg(target_arch = "x86_64")]
        {
            macro_rules! each {
                ($($c:ident),*) => {
                    match t {
                        // SAFETY: this path runs only where AVX2 is available (qmatmul_on).
                        $($c => unsafe { self.decode_avx2::<$c>(rows, rb, nrows, x) },)*
                        _ => unreachable!("a kernel type code"),
                    }
                };
            }
            each!(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (t, rows, rb);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_avx2<const T: u8>(
        &mut self,
        rows: &[u8],
        rb: usize,
        nrows: usize,
        x: &QuantizedRows,
    ) {
        use std::arch::x86_64::*;
        for r in 0..nrows {
            for j in 0..x.nb {
                // SAFETY: sub-block j < nb lies in row r; the slab's buffers hold nrows rows
                // of kp values, 8 nbp scales and nm minimums.
                unsafe {
                    let b = rows.as_ptr().add(r * rb + j * block_bytes(T));
                    let (v, scale, min) = x86::decode::<T>(b);
                    let vp = self.v.as_mut_ptr().add(r * x.kp + 32 * j);
                    _mm256_storeu_si256(vp as *mut __m256i, v);
                    let sp = self.scale.as_mut_ptr().add(r * 8 * x.nbp + 8 * j);
                    _mm256_storeu_ps(sp, scale);
                    *self.mins.get_unchecked_mut(r * x.nm + j) = min;
                }
            }
        }
    }

    /// Row `jj` of the slab against the tile's `mr` rows, into `r[..mr]`.
    fn run(&mut self, t: u8, jj: usize, mr: usize, x: Tile<'_>, r: &mut [f32; MR]) {
        let xs = x.x;
        let src = Src::Decoded {
            v: &self.v[jj * xs.kp..][..xs.kp],
            scale: &self.scale[jj * 8 * xs.nbp..][..8 * xs.nbp],
        };
        let mins = &mut self.mins[jj * xs.nm..][..xs.nm];
        // NOTE: decoded, the types differ only in whether they have a minimum.
        #[cfg(target_arch = "x86_64")]
        macro_rules! rows4 {
            ($t:ident) => {
                // SAFETY: this path runs only where AVX2 is available (qmatmul_on).
                unsafe {
                    match mr {
                        4 => row_avx2::<$t, 4>(src, x, mins, r),
                        3 => row_avx2::<$t, 3>(src, x, mins, r),
                        2 => row_avx2::<$t, 2>(src, x, mins, r),
                        _ => row_avx2::<$t, 1>(src, x, mins, r),
                    }
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if has_min(t) {
            rows4!(Q4_1)
        } else {
            rows4!(Q8_0)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (t, mr, src, mins, r);
    }
}

/// Where the AVX2 kernel takes a weight row's sub-blocks from: the row's blocks (decoded as
/// it goes, its minimums written out), or a slab decoded before.
#[derive(Clone, Copy)]
enum Src<'a> {
    Blocks(&'a [u8]),
    Decoded { v: &'a [i8], scale: &'a [f32] },
}

/// Rows `i ..` of the quantized `x`.
#[derive(Clone, Copy)]
struct Tile<'a> {
    x: &'a QuantizedRows,
    i: usize,
}

/// One weight row against the tile's `mr` rows, into `r[..mr]`; `mins` is scratch for the
/// row's minimums.
fn run(p: Path, t: u8, mr: usize, row: &[u8], x: Tile<'_>, mins: &mut [f32], r: &mut [f32; MR]) {
    macro_rules! by_type {
        ($f:ident, $mr:literal, $row:expr) => {
            match t {
                Q4_0 => $f::<Q4_0, $mr>($row, x, mins, r),
                Q4_1 => $f::<Q4_1, $mr>($row, x, mins, r),
                Q5_0 => $f::<Q5_0, $mr>($row, x, mins, r),
                Q5_1 => $f::<Q5_1, $mr>($row, x, mins, r),
                IQ4_NL => $f::<IQ4_NL, $mr>($row, x, mins, r),
                _ => $f::<Q8_0, $mr>($row, x, mins, r),
            }
        };
    }
    macro_rules! rows4 {
        ($f:ident, $row:expr) => {
            match mr {
                4 => by_type!($f, 4, $row),
                3 => by_type!($f, 3, $row),
                2 => by_type!($f, 2, $row),
                _ => by_type!($f, 1, $row),
            }
        };
    }
    match p {
        Path::Portable => rows4!(row_portable, row),
        // SAFETY: the path is available (checked by the caller), so the CPU has the features
        // the kernels are compiled for.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { rows4!(row_avx2, Src::Blocks(row)) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe {
            match mr {
                8 => by_type!(row_avx512, 8, row),
                7 => by_type!(row_avx512, 7, row),
                6 => by_type!(row_avx512, 6, row),
                5 => by_type!(row_avx512, 5, row),
                _ => rows4!(row_avx512, row),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        _ => rows4!(row_portable, row),
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding one 32-value sub-block, portable.

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The block `b`: values `v`, the scale, and the minimum, with `w = scale·v + min` as the
/// reference dequantizer computes it.
#[inline(always)]
fn decode(t: u8, b: &[u8]) -> ([i8; 32], f32, f32) {
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
            (v, d, 0.0)
        }
        IQ4_NL => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[2..18]);
            v.iter_mut().for_each(|x| *x = IQ4_LEVELS[*x as usize]);
            (v, d, 0.0)
        }
        Q4_1 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[4..20]);
            (v, d, f16_at(b, 2))
        }
        Q5_0 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[6..22]);
            high(&mut v, u32::from_le_bytes([b[2], b[3], b[4], b[5]]));
            sub(&mut v, 16);
            (v, d, 0.0)
        }
        Q5_1 => {
            let d = f16_at(b, 0);
            nib(&mut v, &b[8..24]);
            high(&mut v, u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
            (v, d, f16_at(b, 2))
        }
        _ => {
            let d = f16_at(b, 0);
            for (x, &q) in v.iter_mut().zip(&b[2..34]) {
                *x = q as i8;
            }
            (v, d, 0.0)
        }
    }
}

#[allow(clippy::needless_range_loop)]
fn row_portable<const T: u8, const R: usize>(
    row: &[u8],
    x: Tile<'_>,
    mins: &mut [f32],
    r: &mut [f32; MR],
) {
    let xs = x.x;
    let mut acc = [[0f32; 16]; R];
    for j in 0..xs.nbp {
        let half = 8 * (j % 2);
        if j < xs.nb {
            let b = &row[j * block_bytes(T)..][..block_bytes(T)];
            let (v, scale, min) = decode(T, b);
            mins[j] = min;
            for a in 0..R {
                let q = &xs.q[(x.i + a) * xs.kp + 32 * j..][..32];
                let dx = xs.d[(x.i + a) * xs.nbp + j];
                for l in 0..8 {
                    let isum: i32 = (4 * l..4 * l + 4).map(|e| v[e] as i32 * q[e] as i32).sum();
                    let f = scale * dx;
                    acc[a][half + l] = (isum as f32).mul_add(f, acc[a][half + l]);
                }
            }
        } else {
            for a in 0..R {
                for l in 0..8 {
                    acc[a][half + l] = 0f32.mul_add(0.0, acc[a][half + l]);
                }
            }
        }
    }
    for a in 0..R {
        let folded: [f32; 8] = std::array::from_fn(|l| acc[a][l] + acc[a][8 + l]);
        let mut y = reduce8(&folded);
        if has_min(T) {
            let mut macc = [0f32; 8];
            for j in 0..xs.nm {
                macc[j % 8] = mins[j].mul_add(xs.s[(x.i + a) * xs.nm + j], macc[j % 8]);
            }
            y += reduce8(&macc);
        }
        r[a] = y;
    }
}

// ---------------------------------------------------------------------------------------------
// x86-64: the same decode in registers, and the kernel with two integer dots.

#[cfg(target_arch = "x86_64")]
mod x86;

/// The minimums' share of rows `x.i + a`: `reduce8` of 8 lanes of FMAs.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mins_dot(mins: &[f32], x: Tile<'_>, a: usize) -> f32 {
    use std::arch::x86_64::*;
    let xs = x.x;
    let s = &xs.s[(x.i + a) * xs.nm..][..xs.nm];
    let mut macc = _mm256_setzero_ps();
    for g in (0..xs.nm).step_by(8) {
        // SAFETY: both hold nm (a multiple of 8) values.
        unsafe {
            let m = _mm256_loadu_ps(mins.as_ptr().add(g));
            macc = _mm256_fmadd_ps(m, _mm256_loadu_ps(s.as_ptr().add(g)), macc);
        }
    }
    x86::hsum(macc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_avx2<const T: u8, const R: usize>(
    row: Src<'_>,
    x: Tile<'_>,
    mins: &mut [f32],
    r: &mut [f32; MR],
) {
    use std::arch::x86_64::*;
    let xs = x.x;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // Sub-block j (values v, lane scales) into the even (h = 0) or odd (h = 1) accumulators.
    // NOTE: macros, not closures: a closure here was not inlined, and its accumulators lived
    // in memory.
    macro_rules! step {
        ($j:expr, $h:literal, $v:expr, $scale:expr) => {{
            let (j, v, scale) = ($j, $v, $scale);
            // NOTE: values of the types with a minimum are never negative; the others go
            // through the sign trick (|v| against q with v's sign).
            let u = if has_min(T) { v } else { _mm256_abs_epi8(v) };
            for (a, acc) in acc.iter_mut().enumerate() {
                // SAFETY: the tile's rows hold kp values and nbp scales, and 32 j + 32 <= kp.
                let (q, dx) = unsafe {
                    let row_q = xs.q.as_ptr().add((x.i + a) * xs.kp + 32 * j);
                    (
                        _mm256_loadu_si256(row_q as *const __m256i),
                        *xs.d.as_ptr().add((x.i + a) * xs.nbp + j),
                    )
                };
                let q = if has_min(T) {
                    q
                } else {
                    _mm256_sign_epi8(q, v)
                };
                let isum = x86::dot_avx2(u, q);
                let f = _mm256_mul_ps(scale, _mm256_set1_ps(dx));
                acc[$h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, acc[$h]);
            }
        }};
    }
    // Every sub-block, two at a time; `$sub` gives sub-block `$j`'s values and scales.
    macro_rules! sweep {
        (|$j:ident| $sub:expr) => {{
            let mut jj = 0;
            while jj + 1 < xs.nb {
                let $j = jj;
                let (v, scale) = $sub;
                step!($j, 0, v, scale);
                let $j = jj + 1;
                let (v, scale) = $sub;
                step!($j, 1, v, scale);
                jj += 2;
            }
            if jj < xs.nb {
                let $j = jj;
                let (v, scale) = $sub;
                step!($j, 0, v, scale);
                let z = _mm256_setzero_ps();
                for acc in acc.iter_mut() {
                    acc[1] = _mm256_fmadd_ps(z, z, acc[1]);
                }
            }
        }};
    }
    match row {
        // SAFETY: j < nb, so its block lies in the row.
        Src::Blocks(row) => sweep!(|j| unsafe {
            let b = row.as_ptr().add(j * block_bytes(T));
            let (v, scale, min) = x86::decode::<T>(b);
            *mins.get_unchecked_mut(j) = min;
            (v, scale)
        }),
        // SAFETY: j < nb, and the slab holds nbp sub-blocks' values and scales.
        Src::Decoded { v, scale } => sweep!(|j| unsafe {
            (
                _mm256_loadu_si256(v.as_ptr().add(32 * j) as *const __m256i),
                _mm256_loadu_ps(scale.as_ptr().add(8 * j)),
            )
        }),
    }
    for (a, acc) in acc.iter().enumerate() {
        let mut y = x86::hsum(_mm256_add_ps(acc[0], acc[1]));
        if has_min(T) {
            // SAFETY: the same features.
            y += unsafe { mins_dot(mins, x, a) };
        }
        r[a] = y;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn row_avx512<const T: u8, const R: usize>(
    row: &[u8],
    x: Tile<'_>,
    mins: &mut [f32],
    r: &mut [f32; MR],
) {
    use std::arch::x86_64::*;
    let xs = x.x;
    let mut acc = [_mm512_setzero_ps(); R];
    let zero = _mm512_setzero_si512();
    // Bytes of 128, the unsigned offset of q.
    let bias = _mm512_set1_epi8(-128);
    let mut jp = 0;
    while jp < xs.nb {
        // SAFETY: sub-blocks jp (and jp + 1 where < nb) lie in the row; the tile's rows hold
        // kp = 32 nbp values and 8 nbp lane scales, and 32 jp + 64 <= kp.
        unsafe {
            let sub = |j: usize| {
                let b = row.as_ptr().add(j * block_bytes(T));
                x86::decode::<T>(b)
            };
            let (v0, s0, m0) = sub(jp);
            mins[jp] = m0;
            let (v1, s1) = if jp + 1 < xs.nb {
                let (v1, s1, m1) = sub(jp + 1);
                mins[jp + 1] = m1;
                (v1, s1)
            } else {
                (_mm256_setzero_si256(), _mm256_setzero_ps())
            };
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v0), v1);
            let scale = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(s0), s1);
            // NOTE: dpbusd multiplies unsigned by signed bytes: (q + 128)·v, less 128·Σv,
            // which starts each row's sum (exact in integers, so the order does not matter).
            let neg_corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, v));
            for (a, acc) in acc.iter_mut().enumerate() {
                let u = xs.u.as_ptr().add((x.i + a) * xs.kp + 32 * jp);
                let u = _mm512_loadu_si512(u as *const __m512i);
                let isum = _mm512_dpbusd_epi32(neg_corr, u, v);
                let d8 = xs.d8.as_ptr().add((x.i + a) * 8 * xs.nbp + 8 * jp);
                let f = _mm512_mul_ps(scale, _mm512_loadu_ps(d8));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), f, *acc);
            }
        }
        jp += 2;
    }
    for (a, acc) in acc.iter().enumerate() {
        let lo = _mm512_castps512_ps256(*acc);
        let hi = _mm512_extractf32x8_ps::<1>(*acc);
        let mut y = x86::hsum(_mm256_add_ps(lo, hi));
        if has_min(T) {
            // SAFETY: the same features.
            y += unsafe { mins_dot(mins, x, a) };
        }
        r[a] = y;
    }
}

#[cfg(test)]
mod tests;
