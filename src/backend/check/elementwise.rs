//! Elementwise ops (`gated_act`, `act`, `scale`, `softcap`, `clamp`, `add_assign`), the row
//! gathers (`embedding`, `gather_rows`) and the weighted row scatter (`scatter_add_rows`).

use super::util::{rand_vec, rounded};
use crate::backend::{Activation, Backend};
use crate::tensor::{DType, HostTensor};
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

pub(super) struct Elementwise {
    pub(super) rows: usize,
    pub(super) ffn: usize,
    pub(super) gu: Vec<f32>,
    pub(super) a: Vec<f32>,
    pub(super) b: Vec<f32>,
}

impl Elementwise {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Elementwise {
            rows,
            ffn,
            gu,
            a,
            b,
        } = self;
        let mut v = Vec::new();
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            let mut out = be.alloc_f32(rows * ffn)?;
            be.gated_act(&be.upload_f32(gu)?, *rows, *ffn, act, &mut out)?;
            v.extend(be.download_f32(&out)?);
            let mut xb = be.upload_f32(a)?;
            be.act(&mut xb, rows * ffn, act)?;
            v.extend(be.download_f32(&xb)?);
        }
        let mut sb = be.upload_f32(b)?;
        be.scale(&mut sb, 25.298221, rows * ffn)?;
        v.extend(be.download_f32(&sb)?);
        let mut cb = be.upload_f32(gu)?;
        be.softcap(&mut cb, 1.5, gu.len())?;
        v.extend(be.download_f32(&cb)?);
        let mut lb = be.upload_f32(gu)?;
        be.clamp(&mut lb, 2.5, gu.len())?;
        v.extend(be.download_f32(&lb)?);
        let mut ab = be.upload_f32(a)?;
        be.add_assign(&mut ab, &be.upload_f32(b)?, rows * ffn)?;
        v.extend(be.download_f32(&ab)?);
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Elementwise {
            rows,
            ffn,
            gu,
            a,
            b,
        } = self;
        let mut v = Vec::new();
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            for r in 0..*rows {
                for i in 0..*ffn {
                    let g = gu[r * 2 * ffn + i] as f64;
                    v.push(act.apply_f64(g) * gu[r * 2 * ffn + ffn + i] as f64);
                }
            }
            v.extend(a.iter().map(|&x| act.apply_f64(x as f64)));
        }
        v.extend(b.iter().map(|&x| x as f64 * 25.298221));
        v.extend(gu.iter().map(|&x| 1.5 * (x as f64 / 1.5).tanh()));
        v.extend(gu.iter().map(|&x| (x as f64).clamp(-2.5, 2.5)));
        v.extend(a.iter().zip(b).map(|(x, y)| *x as f64 + *y as f64));
        v
    }
}

pub(super) struct Embedding {
    pub(super) dtype: DType,
    pub(super) dim: usize,
    pub(super) table: Vec<f32>,
    pub(super) ids: Vec<u32>,
    pub(super) rows: Vec<u32>,
}

impl Embedding {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Embedding {
            dtype,
            dim,
            table,
            ids,
            rows,
        } = self;
        let vocab = table.len() / dim;
        let tb = be.upload_weight(&HostTensor::new(vec![vocab, *dim], table.clone()), *dtype)?;
        let mut out = be.alloc_f32(ids.len() * dim)?;
        be.embedding(&tb, &be.upload_u32(ids)?, *dim, &mut out)?;
        let mut g = be.alloc_f32(rows.len() * dim)?;
        be.gather_rows(&out, &be.upload_u32(rows)?, *dim, &mut g)?;
        let mut v = be.download_f32(&out)?;
        v.extend(be.download_f32(&g)?);
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Embedding {
            dtype,
            dim,
            table,
            ids,
            rows,
        } = self;
        let t = rounded(*dtype, table);
        let out: Vec<f64> = ids
            .iter()
            .flat_map(|&id| t[id as usize * dim..(id as usize + 1) * dim].to_vec())
            .collect();
        let mut v = out.clone();
        v.extend(
            rows.iter()
                .flat_map(|&r| out[r as usize * dim..(r as usize + 1) * dim].to_vec()),
        );
        v
    }
}

/// Two routed experts' outputs added into the tokens that chose them (`scatter_add_rows`
/// twice, the second call's rows overlapping the first's), over an output already holding
/// values.
pub(super) struct ScatterAdd {
    pub(super) dim: usize,
    pub(super) out: Vec<f32>,
    /// Per call: the rows, their weights, the source rows.
    pub(super) calls: Vec<(Vec<u32>, Vec<f32>, Vec<f32>)>,
}

impl ScatterAdd {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let mut out = be.upload_f32(&self.out)?;
        for (rows, w, y) in &self.calls {
            let (y, rows, w) = (be.upload_f32(y)?, be.upload_u32(rows)?, be.upload_f32(w)?);
            be.scatter_add_rows(&y, &rows, &w, self.dim, &mut out)?;
        }
        be.download_f32(&out)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let dim = self.dim;
        let mut out: Vec<f64> = self.out.iter().map(|&v| v as f64).collect();
        for (rows, w, y) in &self.calls {
            for (i, &r) in rows.iter().enumerate() {
                for c in 0..dim {
                    out[r as usize * dim + c] += w[i] as f64 * y[i * dim + c] as f64;
                }
            }
        }
        out
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<Elementwise> + From<Embedding>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    out.push((
        "gated_act+act+scale+softcap+clamp+add".into(),
        "9x1000".into(),
        1e-5,
        C::from(Elementwise {
            rows: 9,
            ffn: 1000,
            gu: rand_vec(r, 9 * 2000).iter().map(|v| v * 6.0).collect(),
            a: rand_vec(r, 9000),
            b: rand_vec(r, 9000),
        }),
    ));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (vocab, dim) = (301, 96);
        out.push((
            "embedding+gather".into(),
            format!("{} {vocab}x{dim}", dtype.name()),
            1e-6,
            C::from(Embedding {
                dtype,
                dim,
                table: rand_vec(r, vocab * dim),
                ids: (0..11).map(|i| (i * 37 + 5) % vocab as u32).collect(),
                rows: vec![10, 0, 4, 4],
            }),
        ));
    }
}

/// The scatter's rows, drawn last from `r` (after every other family's), so that adding them
/// left the other rows' inputs as they were.
pub(super) fn scatter_cases<C: From<ScatterAdd>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    let (tokens, dim) = (13, 200);
    let mut call = |rows: Vec<u32>| {
        let w = rand_vec(r, rows.len()).iter().map(|v| v.abs()).collect();
        let y = rand_vec(r, rows.len() * dim);
        (rows, w, y)
    };
    let calls = vec![call(vec![12, 3, 0, 7, 5]), call(vec![3, 4, 12, 1])];
    out.push((
        "scatter_add_rows".into(),
        format!("2 calls into {tokens}x{dim}"),
        1e-6,
        C::from(ScatterAdd {
            dim,
            out: rand_vec(r, tokens * dim),
            calls,
        }),
    ));
}
