//! Every type on every path against dequantize-then-f64, on random blocks.

use super::*;
use crate::quant::GgmlType;
use crate::quant::dequantize;

const TYPES: [GgmlType; 12] = GgmlType::WITH_KERNELS;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `rows` rows of `k` values of `ty`: random bytes, with the f16 scales and minimums set to
/// random finite values of a realistic size.
fn random_weight(ty: GgmlType, rows: usize, k: usize, rng: &mut Rng) -> QuantTensor {
    let (block, bytes) = ty.block_layout();
    let nblocks = rows * k / block;
    let mut data: Vec<u8> = (0..nblocks * bytes).map(|_| rng.next() as u8).collect();
    let halves: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[0],
        GgmlType::IQ4_XS => &[0],
        GgmlType::Q6_K => &[208],
        GgmlType::Q3_K => &[108],
        GgmlType::Q2_K => &[80, 82],
        _ => &[0, 2],
    };
    for b in data.chunks_exact_mut(bytes) {
        for &at in halves {
            let v = f16::from_f32(rng.f32() * 0.05);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    QuantTensor::new(ty, rows, k, data).unwrap()
}

fn random_x(m: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    (0..m * k).map(|_| rng.f32() * 2.0).collect()
}

fn available_paths() -> Vec<Path> {
    [Path::Portable, Path::Avx2, Path::Avx512]
        .into_iter()
        .filter(|p| p.available())
        .collect()
}

fn run_on(p: Path, x: &[f32], m: usize, w: &QuantTensor) -> Vec<f32> {
    let n = w.rows();
    let mut out = vec![f32::NAN; m * n];
    qmatmul_on(p, x, m, w.k, n, &mut out, w);
    out
}

/// x as the kernel for `ty` sees it: quantized per block of 32 (per 256 for the K-quants) and
/// dequantized.
fn x_as_quantized(ty: GgmlType, x: &[f32], m: usize, k: usize) -> Vec<f64> {
    if ty.block_layout().0 == 256 {
        let q = kquant::quantize_rows256(false, x, m, k);
        return (0..m * k)
            .map(|i| q.q[i] as f64 * q.d[i / 256] as f64)
            .collect();
    }
    let q = quantize_rows(x, m, k);
    (0..m * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            q.q[r * q.kp + c] as f64 * q.d[r * q.nbp + c / 32] as f64
        })
        .collect()
}

/// The kernel against the f64 product of the dequantized weight with x quantized as the
/// kernel quantizes it (only f32 rounding left: tight), and with x itself (the activation
/// quantization's error: loose).
fn check(ty: GgmlType, p: Path, m: usize, k: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed);
    let w = random_weight(ty, n, k, &mut rng);
    let x = random_x(m, k, &mut rng);
    let got = run_on(p, &x, m, &w);
    let wd = w.dequantize().unwrap();
    let xq = x_as_quantized(ty, &x, m, k);
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut of_q, mut mag) = (0f64, 0f64, 0f64);
            for t in 0..k {
                let wv = wd[j * k + t] as f64;
                exact += wv * x[i * k + t] as f64;
                of_q += wv * xq[i * k + t];
                mag += (wv * x[i * k + t] as f64).abs();
            }
            let g = got[i * n + j] as f64;
            assert!(
                (g - of_q).abs() <= 1e-5 * mag + 1e-6,
                "{ty} {} m={m} k={k} ({i},{j}): got {g}, f64 of the quantized x {of_q} (Σ|wx| {mag})",
                p.name()
            );
            assert!(
                (g - exact).abs() <= 2e-2 * mag + 1e-6,
                "{ty} {} ({i},{j}): got {g}, exact {exact} (Σ|wx| {mag})",
                p.name()
            );
        }
    }
}

#[test]
fn every_type_on_every_path_matches_dequantize_then_f64() {
    for p in available_paths() {
        for (s, ty) in TYPES.into_iter().enumerate() {
            let k = if ty.block_layout().0 == 256 { 512 } else { 96 };
            check(ty, p, 7, k, 37, 1 + s as u64);
            check(ty, p, 1, k, 5, 100 + s as u64);
        }
    }
}

/// The dequantized values are what ggml's reference dequantizer gives (the decode in the
/// kernels follows the block layouts, which this pins against the independent one).
#[test]
fn dequantize_reference_agrees_with_a_tensor_of_one_block_type() {
    let mut rng = Rng(7);
    for ty in TYPES {
        let k = ty.block_layout().0;
        let w = random_weight(ty, 3, k, &mut rng);
        let d = dequantize(ty, &w.parts[0].data, 3 * k).unwrap();
        assert_eq!(d, w.dequantize().unwrap());
    }
}

#[test]
fn paths_agree_to_the_bit() {
    let paths = available_paths();
    for (s, ty) in TYPES.into_iter().enumerate() {
        let k = if ty.block_layout().0 == 256 { 768 } else { 160 };
        let mut rng = Rng(40 + s as u64);
        let w = random_weight(ty, 45, k, &mut rng);
        // 29 rows: AVX-512 tiles of 8, 8, 8 and 5; AVX2 ones of 4 and 1
        let x = random_x(29, k, &mut rng);
        let first = run_on(paths[0], &x, 29, &w);
        for &p in &paths[1..] {
            assert_eq!(run_on(p, &x, 29, &w), first, "{ty} on {}", p.name());
        }
    }
}

#[test]
fn rows_are_batch_invariant() {
    for p in available_paths() {
        for (s, ty) in TYPES.into_iter().enumerate() {
            let k = if ty.block_layout().0 == 256 { 256 } else { 64 };
            let mut rng = Rng(70 + s as u64);
            let w = random_weight(ty, 33, k, &mut rng);
            let x = random_x(27, k, &mut rng);
            let all = run_on(p, &x, 27, &w);
            for i in [0, 3, 4, 10, 17, 26] {
                let one = run_on(p, &x[i * k..(i + 1) * k], 1, &w);
                assert_eq!(one, all[i * 33..(i + 1) * 33], "{ty} {} row {i}", p.name());
            }
            let some = run_on(p, &x[5 * k..8 * k], 3, &w);
            assert_eq!(some, all[5 * 33..8 * 33], "{ty} {} rows 5..8", p.name());
        }
    }
}

/// A fused weight with parts of three types gives each part's rows their own products.
#[test]
fn stacked_parts_of_several_types() {
    let mut rng = Rng(99);
    let k = 256;
    let parts = [
        GgmlType::Q5_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
    ];
    let ws: Vec<QuantTensor> = parts
        .iter()
        .map(|&t| random_weight(t, 9, k, &mut rng))
        .collect();
    let stacked = QuantTensor::stack(ws.clone()).unwrap();
    assert_eq!(stacked.parts.len(), 3, "the two Q5_0 parts merge");
    assert_eq!(stacked.rows(), 36);
    let x = random_x(5, k, &mut rng);
    for p in available_paths() {
        let all = run_on(p, &x, 5, &stacked);
        for (pi, w) in ws.iter().enumerate() {
            let one = run_on(p, &x, 5, w);
            for i in 0..5 {
                assert_eq!(
                    one[i * 9..(i + 1) * 9],
                    all[i * 36 + pi * 9..i * 36 + pi * 9 + 9]
                );
            }
        }
    }
}

#[test]
fn activation_quantization_round_trips_within_half_a_step() {
    let mut rng = Rng(5);
    let (m, k) = (3, 96);
    let x = random_x(m, k, &mut rng);
    let q = quantize_rows(&x, m, k);
    assert_eq!((q.nb, q.nbp, q.nm, q.kp), (3, 4, 8, 128));
    for (i, &v) in x.iter().enumerate() {
        let (r, c) = (i / k, i % k);
        let d = q.d[r * q.nbp + c / 32];
        let qv = q.q[r * q.kp + c];
        assert!((qv as f32 * d - v).abs() <= 0.5 * d * 1.0001);
        assert_eq!(q.u[r * q.kp + c] as i32, qv as i32 + 128);
        assert_eq!(q.d8[r * 8 * q.nbp + 8 * (c / 32) + c % 8], d);
    }
    for r in 0..m {
        for b in 0..q.nm {
            let want = if b < q.nb {
                let row = &q.q[r * q.kp + 32 * b..r * q.kp + 32 * b + 32];
                q.d[r * q.nbp + b] * row.iter().map(|&v| v as i32).sum::<i32>() as f32
            } else {
                0.0
            };
            assert_eq!(q.s[r * q.nm + b], want);
        }
        // The padding: a zero scale, q = 0 (u = 128).
        assert_eq!(q.d[r * q.nbp + 3], 0.0);
        assert!(q.u[r * q.kp + 96..(r + 1) * q.kp].iter().all(|&u| u == 128));
    }
}

/// Every path quantizes activations to the same bits, ties included (they round to even: a
/// block whose maximum is 127 has the scale 1, so 2.5 and -3.5 are exact ties), and a block of
/// zeros has a zero scale.
#[test]
fn activation_quantization_is_the_same_on_every_path() {
    let mut rng = Rng(11);
    let (m, k) = (9, 160);
    let mut x = random_x(m, k, &mut rng);
    let ties = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 126.5];
    x[..8].copy_from_slice(&ties);
    x[32..64].fill(0.0);
    let want = quantize_rows_on(Path::Portable, &x, m, k);
    assert_eq!(&want.q[..8], &[127, 2, -4, 0, 0, 2, -126, 126]);
    assert_eq!((want.d[0], want.d[1]), (1.0, 0.0));
    for p in available_paths() {
        let got = quantize_rows_on(p, &x, m, k);
        assert_eq!(got.q, want.q, "{p:?}");
        assert_eq!(got.u, want.u, "{p:?}");
        assert_eq!(got.d, want.d, "{p:?}");
        assert_eq!(got.d8, want.d8, "{p:?}");
        assert_eq!(got.s, want.s, "{p:?}");
    }
}

/// Per 256 too, every path quantizes to the same bits (ties to even, a zero block's scale 0),
/// and the sums per 16 are those of the values.
#[test]
fn activation_quantization_per_256_is_the_same_on_every_path() {
    let mut rng = Rng(12);
    let (m, k) = (3, 512);
    let mut x = random_x(m, k, &mut rng);
    let ties = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 126.5];
    x[..8].copy_from_slice(&ties);
    x[256..512].fill(0.0);
    let want = kquant::quantize_rows256(false, &x, m, k);
    assert_eq!(&want.q[..8], &[127, 2, -4, 0, 0, 2, -126, 126]);
    assert_eq!((want.d[0], want.d[1]), (1.0, 0.0));
    for (g, &s) in want.bs.iter().enumerate() {
        let sum: i32 = want.q[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum();
        assert_eq!(s as i32, sum);
    }
    for (i, &v) in x.iter().enumerate() {
        let d = want.d[i / 256];
        assert!((want.q[i] as f32 * d - v).abs() <= 0.5 * d * 1.0001);
    }
    if Path::Avx2.available() {
        let got = kquant::quantize_rows256(true, &x, m, k);
        assert_eq!((got.q, got.d, got.bs), (want.q, want.d, want.bs));
    }
}

/// Tensor-parallel shards of a block-format weight (rows, block-aligned columns, a zero row)
/// hold exactly the values of the same slices of the dequantized weight, parts of several
/// types included; columns that would split blocks give `None`.
#[test]
fn shards_of_quantized_weights_are_slices_of_their_values() {
    use crate::models::Weight;
    use crate::tensor::HostTensor;
    let mut rng = Rng(0x5eed_0f5a_4d11);
    let k = 512;
    for (i, &ty) in TYPES.iter().enumerate() {
        let other = TYPES[(i + 3) % TYPES.len()];
        let w = QuantTensor::stack(vec![
            random_weight(ty, 5, k, &mut rng),
            random_weight(other, 4, k, &mut rng),
        ])
        .unwrap();
        let dense = HostTensor::new(vec![9, k], w.dequantize().unwrap());
        let rows = w.slice_rows(3..7).unwrap();
        assert_eq!(rows.parts.len(), 2, "{ty}: both types in rows 3..7");
        assert_eq!(
            rows.dequantize().unwrap(),
            dense.select_rows(&[3..5, 5..7]).unwrap().data,
            "{ty}"
        );
        let cols = w.slice_cols(256..512).unwrap().unwrap();
        assert_eq!(
            cols.dequantize().unwrap(),
            dense.slice_cols(256..512).unwrap().data,
            "{ty}"
        );
        let small_blocks = ty.block_layout().0 == 32 && other.block_layout().0 == 32;
        assert_eq!(
            w.slice_cols(32..64).unwrap().is_some(),
            small_blocks,
            "{ty}"
        );
        let (t, _) = Weight::Quant(w.clone())
            .select_rows(&[1..2, 6..9])
            .unwrap()
            .with_zero_row()
            .unwrap()
            .into_dense()
            .unwrap();
        let mut want = dense.select_rows(&[1..2, 6..9]).unwrap().data;
        want.extend(std::iter::repeat_n(0.0, k));
        assert_eq!((t.shape, t.data), (vec![5, k], want), "{ty}");
        // columns splitting K-quant blocks: kept in f32 with the same values
        let (t, stored) = Weight::Quant(w)
            .slice_cols(96..160)
            .unwrap()
            .into_dense()
            .unwrap();
        assert_eq!(t.data, dense.slice_cols(96..160).unwrap().data, "{ty}");
        assert_eq!(stored, crate::tensor::DType::F32);
    }
    assert!(
        random_weight(GgmlType::Q4_1, 2, 64, &mut rng)
            .slice_rows(1..3)
            .is_err()
    );
}
