//! Matrix products: `matmul` (with and without a bias, every weight type, decode rows and
//! batches, odd sizes) and the gated MLP's `matmul_gated_act`.

use super::util::{rand_vec, rounded};
use crate::backend::{Activation, Backend};
use crate::tensor::{DType, HostTensor};
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

pub(super) struct Matmul {
    pub(super) dtype: DType,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) b: Option<Vec<f32>>,
}

impl Matmul {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Matmul {
            dtype,
            m,
            k,
            n,
            x,
            w,
            b,
        } = self;
        let xb = be.upload_f32(x)?;
        let wb = be.upload_weight(&HostTensor::new(vec![*n, *k], w.clone()), *dtype)?;
        let bb = b.as_ref().map(|b| be.upload_f32(b)).transpose()?;
        let mut out = be.alloc_f32(m * n)?;
        be.matmul(&xb, &wb, bb.as_ref(), *m, *k, *n, &mut out)?;
        be.download_f32(&out)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Matmul {
            dtype,
            m,
            k,
            n,
            x,
            w,
            b,
        } = self;
        let w = rounded(*dtype, w);
        let mut out = Vec::with_capacity(m * n);
        for i in 0..*m {
            for j in 0..*n {
                let dot: f64 = (0..*k).map(|l| x[i * k + l] as f64 * w[j * k + l]).sum();
                out.push(dot + b.as_ref().map_or(0.0, |b| b[j] as f64));
            }
        }
        out
    }
}

/// The gated MLP's gate and up projections with the activation's product
/// (`matmul_gated_act`), under each activation.
pub(super) struct GatedMatmul {
    pub(super) dtype: DType,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) ffn: usize,
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
}

impl GatedMatmul {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let GatedMatmul {
            dtype,
            m,
            k,
            ffn,
            x,
            w,
        } = self;
        let xb = be.upload_f32(x)?;
        let wb = be.upload_weight(&HostTensor::new(vec![2 * ffn, *k], w.clone()), *dtype)?;
        let mut v = Vec::new();
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            let mut gu = be.alloc_f32(m * 2 * ffn)?;
            let mut out = be.alloc_f32(m * ffn)?;
            be.matmul_gated_act(&xb, &wb, *m, *k, *ffn, act, &mut gu, &mut out)?;
            v.extend(be.download_f32(&out)?);
        }
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let GatedMatmul {
            dtype,
            m,
            k,
            ffn,
            x,
            w,
        } = self;
        let w = rounded(*dtype, w);
        let dot = |i: usize, j: usize| -> f64 {
            (0..*k).map(|l| x[i * k + l] as f64 * w[j * k + l]).sum()
        };
        let mut out = Vec::with_capacity(3 * m * ffn);
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            for i in 0..*m {
                out.extend((0..*ffn).map(|j| act.apply_f64(dot(i, j)) * dot(i, ffn + j)));
            }
        }
        out
    }
}

/// The tolerance of a product of `m` rows by `dtype` weights over `k`.
// NOTE: half weights with a decode-sized batch go through the GEMV kernels, which keep x in
// f32; elsewhere a vendor GEMM may round x to the weights' type first.
fn matmul_tolerance(dtype: DType, m: usize, k: usize) -> f64 {
    if dtype == DType::F32 || (m <= 8 && k.is_multiple_of(8)) {
        1e-5
    } else {
        1e-2
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<Matmul> + From<GatedMatmul>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    // matmul: decode rows (matvec), larger batches (vendor GEMM or our tiled kernel), odd k
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(m, k, n, bias) in &[
            (1, 576, 1536, false),
            (3, 2048, 512, true),
            (8, 1024, 384, false),
            (17, 576, 192, true),
            (130, 256, 320, false),
            (5, 130, 33, true),
        ] {
            let tol = matmul_tolerance(dtype, m, k);
            out.push((
                "matmul".into(),
                format!(
                    "{} {m}x{k}x{n}{}",
                    dtype.name(),
                    if bias { " +bias" } else { "" }
                ),
                tol,
                C::from(Matmul {
                    dtype,
                    m,
                    k,
                    n,
                    x: rand_vec(r, m * k),
                    w: rand_vec(r, n * k),
                    b: bias.then(|| rand_vec(r, n)),
                }),
            ));
        }
    }
    // the gated MLP's first half: decode rows (fused on a GPU), an odd k, a prefill batch
    for dtype in [DType::F32, DType::BF16] {
        for &(m, k, ffn) in &[
            (1, 576, 384),
            (5, 256, 200),
            (8, 520, 96),
            (3, 130, 64),
            (20, 128, 96),
        ] {
            out.push((
                "matmul_gated_act".into(),
                format!("{} {m}x{k}x(2x{ffn})", dtype.name()),
                matmul_tolerance(dtype, m, k),
                C::from(GatedMatmul {
                    dtype,
                    m,
                    k,
                    ffn,
                    x: rand_vec(r, m * k),
                    w: rand_vec(r, 2 * ffn * k),
                }),
            ));
        }
    }
}
