//! What the families' cases share: fresh random inputs, the error measure, values as a
//! backend stores them, RMSNorm in f64.

use crate::tensor::DType;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

pub(super) fn rand_vec(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (r.next_u32() as f64 / u32::MAX as f64 * 2.0 - 1.0) as f32)
        .collect()
}

pub(super) fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    let mut worst = 0f64;
    for (g, w) in got.iter().zip(want) {
        let d = (*g as f64 - w).abs();
        if d.is_nan() {
            return f64::INFINITY;
        }
        worst = worst.max(d);
    }
    worst / scale
}

/// A weight as the backend stores it in `dtype`.
pub(super) fn rounded(dtype: DType, v: &[f32]) -> Vec<f64> {
    v.iter()
        .map(|&x| match dtype {
            DType::F32 => x as f64,
            DType::F16 => half::f16::from_f32(x).to_f64(),
            DType::BF16 => half::bf16::from_f32(x).to_f64(),
            DType::F8E4M3 => crate::tensor::e4m3_to_f32(crate::tensor::f32_to_e4m3(x)) as f64,
        })
        .collect()
}

pub(super) fn rms_f64(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(x, w)| x * inv * *w as f64).collect()
}
