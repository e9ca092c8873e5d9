//! Ops on the fused QKV rows: `rope`, `qk_norm` (RMSNorm or LayerNorm, per head or of all of q
//! and k), and `rope_write_kv` (RoPE and the rows' K and V written into the cache at their
//! slots, for every KV type).

use super::util::{rand_vec, rms_f64, rounded};
use crate::backend::{Backend, KvLayout, QkNormSpan, QkvLayout};
use crate::tensor::DType;
use anyhow::Result;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

pub(super) struct Rope {
    pub(super) rows: usize,
    pub(super) layout: QkvLayout,
    pub(super) x: Vec<f32>,
    pub(super) pos: Vec<u32>,
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
}

impl Rope {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Rope {
            rows,
            layout,
            x,
            pos,
            cos,
            sin,
        } = self;
        let mut xb = be.upload_f32(x)?;
        let (cb, sb) = (be.upload_f32(cos)?, be.upload_f32(sin)?);
        be.rope(&mut xb, &be.upload_u32(pos)?, &cb, &sb, *rows, *layout)?;
        be.download_f32(&xb)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let Rope {
            rows,
            layout,
            x,
            pos,
            cos,
            sin,
        } = self;
        let (d, rl) = (layout.head_dim, layout.row_len());
        let mut v = f(x);
        for (t, &p) in pos.iter().enumerate().take(*rows) {
            let p = p as usize;
            for h in 0..layout.num_heads + layout.num_kv_heads {
                let base = t * rl + h * d;
                for i in 0..d / 2 {
                    let (c, s) = (cos[p * d / 2 + i] as f64, sin[p * d / 2 + i] as f64);
                    let (x1, x2) = (x[base + i] as f64, x[base + i + d / 2] as f64);
                    v[base + i] = x1 * c - x2 * s;
                    v[base + i + d / 2] = x2 * c + x1 * s;
                }
            }
        }
        v
    }
}

pub(super) struct QkNorm {
    pub(super) rows: usize,
    pub(super) layout: QkvLayout,
    pub(super) span: QkNormSpan,
    pub(super) x: Vec<f32>,
    pub(super) qw: Vec<f32>,
    pub(super) kw: Vec<f32>,
}

impl QkNorm {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let QkNorm {
            rows,
            layout,
            span,
            x,
            qw,
            kw,
        } = self;
        let mut xb = be.upload_f32(x)?;
        let (qb, kb) = (be.upload_f32(qw)?, be.upload_f32(kw)?);
        be.qk_norm(&mut xb, &qb, &kb, *rows, *layout, *span, 1e-6)?;
        be.download_f32(&xb)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let QkNorm {
            rows,
            layout,
            span,
            x,
            qw,
            kw,
        } = self;
        let rl = layout.row_len();
        let (nq, qs, nk, ks) = span.spans(*layout);
        let own = *span == QkNormSpan::HeadLayer;
        // (first value, length, weight) of each normalised part of a row
        let mut parts: Vec<(usize, usize, &[f32])> = vec![];
        for i in 0..nq + nk {
            let (n, j, w) = match i < nq {
                true => (qs, i, &qw[..]),
                false => (ks, i - nq, &kw[..]),
            };
            let start = if i < nq { i * qs } else { nq * qs + j * ks };
            parts.push((start, n, if own { &w[j * n..(j + 1) * n] } else { w }));
        }
        let mut v = f(x);
        for t in 0..*rows {
            for &(start, n, w) in &parts {
                let x = &mut v[t * rl + start..][..n];
                if own {
                    let mean = x.iter().sum::<f64>() / n as f64;
                    x.iter_mut().for_each(|x| *x -= mean);
                }
                let normed = rms_f64(x, w, 1e-6);
                x.copy_from_slice(&normed);
            }
        }
        v
    }
}

/// `rope_write_kv`: the rows after RoPE, then the K and V caches (every slot of the pool
/// written once, in a shuffled order).
pub(super) struct RopeWriteKv {
    pub(super) rope: Rope,
    pub(super) kv: KvLayout,
    pub(super) slots: Vec<u32>,
}

impl RopeWriteKv {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let RopeWriteKv { rope, kv, slots } = self;
        let Rope {
            rows,
            layout,
            x,
            pos,
            cos,
            sin,
        } = rope;
        let mut xb = be.upload_f32(x)?;
        let (cb, sb) = (be.upload_f32(cos)?, be.upload_f32(sin)?);
        let (mut kc, mut vc) = (be.alloc_kv(*kv)?, be.alloc_kv(*kv)?);
        be.rope_write_kv(
            &mut xb,
            &be.upload_u32(pos)?,
            &cb,
            &sb,
            &be.upload_u32(slots)?,
            *rows,
            *layout,
            &mut kc,
            &mut vc,
            *kv,
        )?;
        let mut v = be.download_f32(&xb)?;
        v.extend(be.download_f32(&kc)?);
        v.extend(be.download_f32(&vc)?);
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let RopeWriteKv { rope, kv, slots } = self;
        let Rope { rows, layout, .. } = rope;
        let rows_after = rope.reference();
        let (d, rl, hkv) = (layout.head_dim, layout.row_len(), layout.num_kv_heads);
        let mut caches = vec![0f64; 2 * kv.numel()];
        for (t, &slot) in slots.iter().enumerate().take(*rows) {
            let (blk, off) = (slot as usize / kv.block_size, slot as usize % kv.block_size);
            for (c, part) in [layout.q_len(), layout.q_len() + layout.kv_len()]
                .into_iter()
                .enumerate()
            {
                for g in 0..hkv {
                    for i in 0..d {
                        let x = rows_after[t * rl + part + g * d + i] as f32;
                        caches[c * kv.numel() + ((blk * hkv + g) * kv.block_size + off) * d + i] =
                            rounded(kv.dtype, &[x])[0];
                    }
                }
            }
        }
        let mut out = rows_after;
        out.extend(caches);
        out
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<Rope> + From<QkNorm> + From<RopeWriteKv>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    for &(rows, h, hkv, d) in &[(9, 4, 2, 16), (5, 32, 8, 64), (2, 14, 2, 128)] {
        let layout = QkvLayout {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        };
        let max_pos = 400;
        let (mut cos, mut sin) = (vec![], vec![]);
        for p in 0..max_pos {
            for i in 0..d / 2 {
                let a = p as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let rope = Rope {
            rows,
            layout,
            x: rand_vec(r, rows * layout.row_len()),
            pos: (0..rows as u32)
                .map(|i| (i * 97 + 3) % max_pos as u32)
                .collect(),
            cos,
            sin,
        };
        // the same rows through the fused op, into a pool of 4-token blocks with room to
        // spare, each row at a slot of a shuffled order, for every KV type
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let kv = KvLayout {
                num_blocks: rows.div_ceil(4) + 3,
                block_size: 4,
                num_kv_heads: hkv,
                head_dim: d,
                dtype,
            };
            let mut slots: Vec<u32> = (0..(kv.num_blocks * 4) as u32).collect();
            for i in (1..slots.len()).rev() {
                slots.swap(i, r.next_u32() as usize % (i + 1));
            }
            slots.truncate(rows);
            let Rope {
                x, pos, cos, sin, ..
            } = &rope;
            out.push((
                "rope+write_kv".into(),
                format!("{} KV, {rows} rows h={h} hkv={hkv} d={d}", dtype.name()),
                1e-5,
                C::from(RopeWriteKv {
                    rope: Rope {
                        rows,
                        layout,
                        x: x.clone(),
                        pos: pos.clone(),
                        cos: cos.clone(),
                        sin: sin.clone(),
                    },
                    kv,
                    slots,
                }),
            ));
        }
        out.push((
            "rope".into(),
            format!("{rows} rows h={h} hkv={hkv} d={d}"),
            1e-5,
            C::from(rope),
        ));
    }
    for &(rows, h, hkv, d) in &[(7, 16, 8, 128), (2, 14, 2, 64), (5, 2, 1, 80)] {
        let layout = QkvLayout {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        };
        for span in [QkNormSpan::Head, QkNormSpan::All, QkNormSpan::HeadLayer] {
            let (qn, kn) = span.weight_lens(layout);
            let mut x = rand_vec(r, rows * layout.row_len());
            // NOTE: a LayerNorm's inputs off zero mean, so that a missing or wrong mean shows
            if span.centered() {
                x.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x += (i % 7) as f32 * 0.5);
            }
            out.push((
                "qk_norm".into(),
                format!("{rows} rows h={h} hkv={hkv} d={d} {span:?}"),
                1e-5,
                C::from(QkNorm {
                    rows,
                    layout,
                    span,
                    x,
                    qw: rand_vec(r, qn),
                    kw: rand_vec(r, kn),
                }),
            ));
        }
    }
}
