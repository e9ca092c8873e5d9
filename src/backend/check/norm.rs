//! The norms over whole rows: `rms_norm`, the residual add fused with it (`add_rms_norm`),
//! `layer_norm`.

use super::util::{rand_vec, rms_f64};
use crate::backend::Backend;
use crate::tensor::{DType, HostTensor};
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

pub(super) struct RmsNorm {
    pub(super) rows: usize,
    pub(super) dim: usize,
    pub(super) x: Vec<f32>,
    pub(super) y: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) fused: bool,
}

impl RmsNorm {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let RmsNorm {
            rows,
            dim,
            x,
            y,
            w,
            fused,
        } = self;
        let mut xb = be.upload_f32(x)?;
        let wb = be.upload_weight(&HostTensor::new(vec![*dim], w.clone()), DType::F32)?;
        let mut out = be.alloc_f32(rows * dim)?;
        if !*fused {
            be.rms_norm(&xb, &wb, *rows, *dim, 1e-5, &mut out)?;
            return be.download_f32(&out);
        }
        let yb = be.upload_f32(y)?;
        be.add_rms_norm(&mut xb, &yb, &wb, *rows, *dim, 1e-5, &mut out)?;
        let mut v = be.download_f32(&out)?;
        v.extend(be.download_f32(&xb)?);
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let RmsNorm {
            dim,
            x,
            y,
            w,
            fused,
            ..
        } = self;
        let xs: Vec<f64> = if *fused {
            x.iter()
                .zip(y)
                .map(|(a, b)| *a as f64 + *b as f64)
                .collect()
        } else {
            f(x)
        };
        let mut out: Vec<f64> = xs.chunks(*dim).flat_map(|r| rms_f64(r, w, 1e-5)).collect();
        if *fused {
            out.extend(xs);
        }
        out
    }
}

pub(super) struct LayerNorm {
    pub(super) rows: usize,
    pub(super) dim: usize,
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) b: Vec<f32>,
}

impl LayerNorm {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let LayerNorm { rows, dim, x, w, b } = self;
        let mut out = be.alloc_f32(rows * dim)?;
        let (wb, bb) = (be.upload_f32(w)?, be.upload_f32(b)?);
        be.layer_norm(&be.upload_f32(x)?, &wb, &bb, *rows, *dim, 1e-5, &mut out)?;
        be.download_f32(&out)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let LayerNorm { dim, x, w, b, .. } = self;
        f(x).chunks(*dim)
            .flat_map(|r| {
                let mean = r.iter().sum::<f64>() / *dim as f64;
                let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / *dim as f64;
                let inv = 1.0 / (var + 1e-5).sqrt();
                (0..*dim)
                    .map(|i| (r[i] - mean) * inv * w[i] as f64 + b[i] as f64)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<RmsNorm> + From<LayerNorm>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    for &(rows, dim) in &[(1, 2048), (7, 576), (3, 33)] {
        for fused in [false, true] {
            out.push((
                if fused { "add_rms_norm" } else { "rms_norm" }.into(),
                format!("{rows}x{dim}"),
                1e-5,
                C::from(RmsNorm {
                    rows,
                    dim,
                    x: rand_vec(r, rows * dim),
                    y: rand_vec(r, rows * dim),
                    w: rand_vec(r, dim),
                    fused,
                }),
            ));
        }
    }
    for &(rows, dim) in &[(5, 768), (2, 33)] {
        out.push((
            "layer_norm".into(),
            format!("{rows}x{dim}"),
            1e-5,
            C::from(LayerNorm {
                rows,
                dim,
                x: rand_vec(r, rows * dim).iter().map(|v| v + 10.0).collect(),
                w: rand_vec(r, dim),
                b: rand_vec(r, dim),
            }),
        ));
    }
}
