//! `pagoda check-backend`: every backend operation against the CPU backend on fresh random
//! inputs, with the error of each in a table. Users run it on new hardware; the GPU checks run
//! it first (see scripts/gpu-check.sh).
//!
//! The table of op cases is the one place ops are checked: `check-backend` runs it against the
//! CPU backend, and `cargo test` (tests/backend_ops.rs) runs it for every compiled backend, the
//! CPU one included, against an f64 reference computed here. A new op is a new `Case` variant:
//! how to run it, its reference, and its rows in `cases`.
//!
//! The error of a case is `max |got − want| / max |want|` (normalised by the reference's scale).
//! Tolerances: 1e-5 for f32 arithmetic, 1e-2 where a vendor GEMM rounds activations to f16/bf16
//! first, exact for argmax and for sampling on the device (whose cases keep clear of the
//! boundaries where rounding could choose another token).

use super::{
    Activation, AttentionOptions, Backend, BackendKind, BatchInput, CpuBackend, CudaBackend,
    DeviceBatch, EmuBackend, HipBackend, KvLayout, QkvLayout, WgpuBackend,
};
use crate::sampling::sampler::{logprobs_of, rank_of};
use crate::sampling::{Choice, LogitEdit, RowSampling};
use crate::tensor::{DType, HostTensor};
use anyhow::{Result, bail};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

/// One row of the table.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub op: String,
    pub case: String,
    /// Normalised error; `None` when the op failed (see `error`).
    pub err: Option<f64>,
    pub tol: f64,
    pub error: Option<String>,
    pub micros: f64,
}

impl CheckRow {
    pub fn passed(&self) -> bool {
        self.err.is_some_and(|e| e <= self.tol)
    }
}

fn rand_vec(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (r.next_u32() as f64 / u32::MAX as f64 * 2.0 - 1.0) as f32)
        .collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
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

/// The inputs of one op case, built once and run on both backends.
// NOTE: a few dozen cases are built once per check; their sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Case {
    Matmul {
        dtype: DType,
        m: usize,
        k: usize,
        n: usize,
        x: Vec<f32>,
        w: Vec<f32>,
        b: Option<Vec<f32>>,
    },
    RmsNorm {
        rows: usize,
        dim: usize,
        x: Vec<f32>,
        y: Vec<f32>,
        w: Vec<f32>,
        fused: bool,
    },
    LayerNorm {
        rows: usize,
        dim: usize,
        x: Vec<f32>,
        w: Vec<f32>,
        b: Vec<f32>,
    },
    Elementwise {
        rows: usize,
        ffn: usize,
        gu: Vec<f32>,
        a: Vec<f32>,
        b: Vec<f32>,
    },
    Embedding {
        dtype: DType,
        dim: usize,
        table: Vec<f32>,
        ids: Vec<u32>,
        rows: Vec<u32>,
    },
    Rope {
        rows: usize,
        layout: QkvLayout,
        x: Vec<f32>,
        pos: Vec<u32>,
        cos: Vec<f32>,
        sin: Vec<f32>,
    },
    QkNorm {
        rows: usize,
        layout: QkvLayout,
        x: Vec<f32>,
        qw: Vec<f32>,
        kw: Vec<f32>,
    },
    /// `rope_write_kv`: the rows after RoPE, then the K and V caches (every slot of the pool
    /// written once, in a shuffled order).
    RopeWriteKv {
        rope: Box<Case>,
        kv: KvLayout,
        slots: Vec<u32>,
    },
    Attention {
        layout: QkvLayout,
        kv: KvLayout,
        prefix_rows: Vec<f32>,
        prefix_slots: Vec<u32>,
        qkv: Vec<f32>,
        batch: BatchInput,
        opts: AttentionOptions,
    },
    /// The gated MLP's gate and up projections with the activation's product
    /// (`matmul_gated_act`), under each activation.
    GatedMatmul {
        dtype: DType,
        m: usize,
        k: usize,
        ffn: usize,
        x: Vec<f32>,
        w: Vec<f32>,
    },
    Argmax {
        rows: usize,
        cols: usize,
        logits: Vec<f32>,
    },
    /// Random sampling on the device (`sample_rows`): one token per row, each row with its
    /// own temperature, top-k, top-p, min-p and draw.
    Sample {
        cols: usize,
        logits: Vec<f32>,
        rows: Vec<RowSampling>,
    },
    /// Log-probabilities on the device (`sample_rows` with [`RowSampling::logprobs`]), of rows
    /// sampled, greedy, edited or given a token to score: the tokens and ranks (`ids`, exact)
    /// or the log-probabilities (f32's tolerance), of the same rows.
    Logprobs {
        cols: usize,
        logits: Vec<f32>,
        rows: Vec<RowSampling>,
        ids: bool,
    },
    /// Swap's block copies: the cache filled block by block, some blocks overwritten, some
    /// read back; the result is the blocks read, then the whole cache.
    KvBlocks {
        kv: KvLayout,
        cache: Vec<f32>,
        write: Vec<u32>,
        data: Vec<f32>,
        read: Vec<u32>,
    },
}

fn run<B: Backend>(be: &B, case: &Case) -> Result<Vec<f32>> {
    Ok(match case {
        Case::Matmul {
            dtype,
            m,
            k,
            n,
            x,
            w,
            b,
        } => {
            let xb = be.upload_f32(x)?;
            let wb = be.upload_weight(&HostTensor::new(vec![*n, *k], w.clone()), *dtype)?;
            let bb = b.as_ref().map(|b| be.upload_f32(b)).transpose()?;
            let mut out = be.alloc_f32(m * n)?;
            be.matmul(&xb, &wb, bb.as_ref(), *m, *k, *n, &mut out)?;
            be.download_f32(&out)?
        }
        Case::GatedMatmul {
            dtype,
            m,
            k,
            ffn,
            x,
            w,
        } => {
            let xb = be.upload_f32(x)?;
            let wb = be.upload_weight(&HostTensor::new(vec![2 * ffn, *k], w.clone()), *dtype)?;
            let mut v = Vec::new();
            for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
                let mut gu = be.alloc_f32(m * 2 * ffn)?;
                let mut out = be.alloc_f32(m * ffn)?;
                be.matmul_gated_act(&xb, &wb, *m, *k, *ffn, act, &mut gu, &mut out)?;
                v.extend(be.download_f32(&out)?);
            }
            v
        }
        Case::RmsNorm {
            rows,
            dim,
            x,
            y,
            w,
            fused,
        } => {
            let mut xb = be.upload_f32(x)?;
            let wb = be.upload_weight(&HostTensor::new(vec![*dim], w.clone()), DType::F32)?;
            let mut out = be.alloc_f32(rows * dim)?;
            if *fused {
                let yb = be.upload_f32(y)?;
                be.add_rms_norm(&mut xb, &yb, &wb, *rows, *dim, 1e-5, &mut out)?;
                let mut v = be.download_f32(&out)?;
                v.extend(be.download_f32(&xb)?);
                v
            } else {
                be.rms_norm(&xb, &wb, *rows, *dim, 1e-5, &mut out)?;
                be.download_f32(&out)?
            }
        }
        Case::LayerNorm { rows, dim, x, w, b } => {
            let mut out = be.alloc_f32(rows * dim)?;
            let (wb, bb) = (be.upload_f32(w)?, be.upload_f32(b)?);
            be.layer_norm(&be.upload_f32(x)?, &wb, &bb, *rows, *dim, 1e-5, &mut out)?;
            be.download_f32(&out)?
        }
        Case::Elementwise {
            rows,
            ffn,
            gu,
            a,
            b,
        } => {
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
            let mut ab = be.upload_f32(a)?;
            be.add_assign(&mut ab, &be.upload_f32(b)?, rows * ffn)?;
            v.extend(be.download_f32(&ab)?);
            v
        }
        Case::Embedding {
            dtype,
            dim,
            table,
            ids,
            rows,
        } => {
            let vocab = table.len() / dim;
            let tb =
                be.upload_weight(&HostTensor::new(vec![vocab, *dim], table.clone()), *dtype)?;
            let mut out = be.alloc_f32(ids.len() * dim)?;
            be.embedding(&tb, &be.upload_u32(ids)?, *dim, &mut out)?;
            let mut g = be.alloc_f32(rows.len() * dim)?;
            be.gather_rows(&out, &be.upload_u32(rows)?, *dim, &mut g)?;
            let mut v = be.download_f32(&out)?;
            v.extend(be.download_f32(&g)?);
            v
        }
        Case::Rope {
            rows,
            layout,
            x,
            pos,
            cos,
            sin,
        } => {
            let mut xb = be.upload_f32(x)?;
            let (cb, sb) = (be.upload_f32(cos)?, be.upload_f32(sin)?);
            be.rope(&mut xb, &be.upload_u32(pos)?, &cb, &sb, *rows, *layout)?;
            be.download_f32(&xb)?
        }
        Case::RopeWriteKv { rope, kv, slots } => {
            let Case::Rope {
                rows,
                layout,
                x,
                pos,
                cos,
                sin,
            } = rope.as_ref()
            else {
                bail!("rope_write_kv: not a rope case");
            };
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
            v
        }
        Case::QkNorm {
            rows,
            layout,
            x,
            qw,
            kw,
        } => {
            let mut xb = be.upload_f32(x)?;
            let (qb, kb) = (be.upload_f32(qw)?, be.upload_f32(kw)?);
            be.qk_norm(&mut xb, &qb, &kb, *rows, *layout, 1e-6)?;
            be.download_f32(&xb)?
        }
        Case::Attention {
            layout,
            kv,
            prefix_rows,
            prefix_slots,
            qkv,
            batch,
            opts,
        } => {
            let mut kc = be.alloc_kv(*kv)?;
            let mut vc = be.alloc_kv(*kv)?;
            if !prefix_slots.is_empty() {
                be.write_kv(
                    &be.upload_f32(prefix_rows)?,
                    &be.upload_u32(prefix_slots)?,
                    prefix_slots.len(),
                    *layout,
                    &mut kc,
                    &mut vc,
                    *kv,
                )?;
            }
            let t = batch.num_tokens();
            let db = DeviceBatch::upload(be, batch.clone())?;
            let qb = be.upload_f32(qkv)?;
            be.write_kv(&qb, &db.slot_mapping, t, *layout, &mut kc, &mut vc, *kv)?;
            let mut out = be.alloc_f32(t * layout.q_len())?;
            be.paged_attention(&qb, &kc, &vc, &db, *layout, *kv, *opts, &mut out)?;
            let mut v = be.download_f32(&out)?;
            v.extend(be.download_f32(&kc)?);
            v
        }
        Case::Argmax { rows, cols, logits } => {
            let lb = be.upload_f32(logits)?;
            be.argmax_rows(&lb, *rows, *cols)?
                .into_iter()
                .map(|i| i as f32)
                .collect()
        }
        Case::Sample { cols, logits, rows } => {
            let mut lb = be.upload_f32(logits)?;
            be.sample_rows(&mut lb, *cols, rows)?
                .into_iter()
                .map(|c| c.token as f32)
                .collect()
        }
        Case::Logprobs {
            cols,
            logits,
            rows,
            ids,
        } => {
            let mut lb = be.upload_f32(logits)?;
            logprob_words(&be.sample_rows(&mut lb, *cols, rows)?, *ids)
                .into_iter()
                .map(|v| v as f32)
                .collect()
        }
        Case::KvBlocks {
            kv,
            cache,
            write,
            data,
            read,
        } => {
            let bl = kv.block_len();
            let mut c = be.alloc_kv(*kv)?;
            let all: Vec<u32> = (0..kv.num_blocks as u32).collect();
            be.write_kv_blocks(&mut c, bl, &all, cache)?;
            be.write_kv_blocks(&mut c, bl, write, data)?;
            let mut v = be.read_kv_blocks(&c, bl, read)?;
            v.extend(be.download_f32(&c)?);
            v
        }
    })
}

/// A weight as the backend stores it in `dtype`.
fn rounded(dtype: DType, v: &[f32]) -> Vec<f64> {
    v.iter()
        .map(|&x| match dtype {
            DType::F32 => x as f64,
            DType::F16 => half::f16::from_f32(x).to_f64(),
            DType::BF16 => half::bf16::from_f32(x).to_f64(),
            DType::F8E4M3 => crate::tensor::e4m3_to_f32(crate::tensor::f32_to_e4m3(x)) as f64,
        })
        .collect()
}

fn rms_f64(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(x, w)| x * inv * *w as f64).collect()
}

/// What a case's outputs should be, in f64 and in the order [`run`] returns them: the reference
/// `cargo test` checks every backend against (independent of the CPU backend's code).
fn reference(case: &Case) -> Vec<f64> {
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    match case {
        Case::Matmul {
            dtype,
            m,
            k,
            n,
            x,
            w,
            b,
        } => {
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
        Case::GatedMatmul {
            dtype,
            m,
            k,
            ffn,
            x,
            w,
        } => {
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
        Case::RmsNorm {
            dim,
            x,
            y,
            w,
            fused,
            ..
        } => {
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
        Case::LayerNorm { dim, x, w, b, .. } => f(x)
            .chunks(*dim)
            .flat_map(|r| {
                let mean = r.iter().sum::<f64>() / *dim as f64;
                let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / *dim as f64;
                let inv = 1.0 / (var + 1e-5).sqrt();
                (0..*dim)
                    .map(|i| (r[i] - mean) * inv * w[i] as f64 + b[i] as f64)
                    .collect::<Vec<_>>()
            })
            .collect(),
        Case::Elementwise {
            rows,
            ffn,
            gu,
            a,
            b,
        } => {
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
            v.extend(a.iter().zip(b).map(|(x, y)| *x as f64 + *y as f64));
            v
        }
        Case::Embedding {
            dtype,
            dim,
            table,
            ids,
            rows,
        } => {
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
        Case::Rope {
            rows,
            layout,
            x,
            pos,
            cos,
            sin,
        } => {
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
        Case::RopeWriteKv { rope, kv, slots } => {
            let Case::Rope { rows, layout, .. } = rope.as_ref() else {
                return Vec::new();
            };
            let rows_after = reference(rope);
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
                            caches[c * kv.numel()
                                + ((blk * hkv + g) * kv.block_size + off) * d
                                + i] = rounded(kv.dtype, &[x])[0];
                        }
                    }
                }
            }
            let mut out = rows_after;
            out.extend(caches);
            out
        }
        Case::QkNorm {
            rows,
            layout,
            x,
            qw,
            kw,
        } => {
            let (d, rl) = (layout.head_dim, layout.row_len());
            let mut v = f(x);
            for t in 0..*rows {
                for h in 0..layout.num_heads + layout.num_kv_heads {
                    let base = t * rl + h * d;
                    let w = if h < layout.num_heads { qw } else { kw };
                    let normed = rms_f64(&v[base..base + d], w, 1e-6);
                    v[base..base + d].copy_from_slice(&normed);
                }
            }
            v
        }
        Case::Attention {
            layout,
            kv,
            prefix_rows,
            prefix_slots,
            qkv,
            batch,
            opts,
        } => attention_reference(layout, kv, prefix_rows, prefix_slots, qkv, batch, opts),
        Case::Argmax { rows, cols, logits } => (0..*rows)
            .map(|r| super::argmax(&logits[r * cols..(r + 1) * cols]) as f64)
            .collect(),
        Case::Sample { cols, logits, rows } => logits
            .chunks(*cols)
            .zip(rows)
            .map(|(x, s)| sample_reference(&s.edited(x), s).0 as f64)
            .collect(),
        Case::Logprobs {
            cols,
            logits,
            rows,
            ids,
        } => {
            let choices: Vec<Choice> = logits
                .chunks(*cols)
                .zip(rows)
                .map(|(x, s)| {
                    let token = s
                        .score
                        .unwrap_or_else(|| sample_reference(&s.edited(x), s).0 as u32);
                    Choice {
                        token,
                        logprobs: s.logprobs.map(|k| logprobs_of(x, token, k as usize)),
                        rank: rank_of(x, token),
                    }
                })
                .collect();
            logprob_words(&choices, *ids)
        }
        Case::KvBlocks {
            kv,
            cache,
            write,
            data,
            read,
        } => {
            let bl = kv.block_len();
            let mut c = rounded(kv.dtype, cache);
            for (&b, d) in write.iter().zip(data.chunks_exact(bl)) {
                let at = b as usize * bl;
                c[at..at + bl].copy_from_slice(&rounded(kv.dtype, d));
            }
            let mut out: Vec<f64> = read
                .iter()
                .flat_map(|&b| c[b as usize * bl..(b as usize + 1) * bl].to_vec())
                .collect();
            out.extend(c);
            out
        }
    }
}

/// The token the device sampler must draw from `x`, from the definitions in f64 (a sort, no
/// radix select, no integers): top-k on the logits (ties: lowest ids), top-p over what is left
/// most likely first, min-p, then the draw over what is left in id order. Tokens below 2^-40 of
/// the most likely one are out, as on the device. Also returns how close the row came to a
/// boundary (a top-p cut or the draw's edges, relative to the mass; a min-p test, relative to
/// min-p): a case keeps its rows only where that margin leaves f32 rounding no say.
fn sample_reference(x: &[f32], s: &RowSampling) -> (usize, f64) {
    let max = x
        .iter()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if s.is_greedy() || !max.is_finite() {
        return (super::argmax(x), f64::INFINITY);
    }
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let p: Vec<f64> = x
        .iter()
        .map(|&v| {
            let q = ((f64::from(key(v)) - f64::from(max)) / f64::from(s.temperature)).exp();
            if q >= 2f64.powi(-40) { q } else { 0.0 }
        })
        .collect();
    let mut keep: Vec<usize> = (0..x.len()).collect();
    keep.sort_by(|&a, &b| key(x[b]).total_cmp(&key(x[a])).then(a.cmp(&b)));
    if s.top_k > 0 {
        keep.truncate(s.top_k as usize);
    }
    let mut margin = f64::INFINITY;
    if s.top_p < 1.0 {
        let z: f64 = keep.iter().map(|&i| p[i]).sum();
        let target = f64::from(s.top_p) * z;
        let mut cum = 0.0;
        let mut cut = keep.len();
        for (j, &i) in keep.iter().enumerate() {
            let before = cum;
            cum += p[i];
            if cum >= target && p[i] > 0.0 {
                margin = margin.min((cum - target).min(target - before) / z);
                cut = j + 1;
                break;
            }
        }
        keep.truncate(cut);
    }
    if s.min_p > 0.0 {
        for &i in &keep {
            margin = margin.min((p[i] / f64::from(s.min_p) - 1.0).abs());
        }
        keep.retain(|&i| p[i] >= f64::from(s.min_p));
    }
    keep.retain(|&i| p[i] > 0.0);
    keep.sort_unstable();
    let total: f64 = keep.iter().map(|&i| p[i]).sum();
    let t = s.u53 as f64 / (1u64 << 53) as f64 * total;
    let mut cum = 0.0;
    for &i in &keep {
        let before = cum;
        cum += p[i];
        if cum > t {
            return (i, margin.min((t - before).min(cum - t) / total));
        }
    }
    (super::argmax(x), 0.0)
}

/// How far a sampling case keeps each row from a boundary. The device's probabilities are within
/// about 2e-6 of the exact ones (expf of an argument rounded in f32, up to 13 in magnitude
/// here), so their sums are too.
const SAMPLE_MARGIN: f64 = 5e-6;

/// Edits of a row `x` that change its choice: its 12 most likely tokens raised to a head
/// (2 to 0 above the rest, so that the penalties leave them in the running), all seen (the
/// repetition penalty), some in the output once or twice (presence and frequency), the most
/// likely banned, two biased (+0.5, -1), and 5 tokens anywhere biased by -4; half of the rows
/// shifted below 0.
fn sample_edits(r: &mut ChaCha8Rng, x: &mut [f32]) -> Vec<LogitEdit> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    let top = x[order[0]];
    for (j, &i) in order.iter().take(12).enumerate() {
        x[i] = top + 2.0 - 0.17 * j as f32;
    }
    // half of the rows entirely negative, where the repetition penalty multiplies
    if r.next_u32().is_multiple_of(2) {
        x.iter_mut().for_each(|v| *v -= top + 3.0);
    }
    let mut edits: Vec<LogitEdit> = (0..12.min(x.len()))
        .map(|j| LogitEdit {
            token: order[j] as u32,
            bias: [0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, -1.0][j % 8],
            banned: j == 0,
            seen: true,
            count: j as u32 % 3,
        })
        .collect();
    for _ in 0..5 {
        let token = r.next_u32() % x.len() as u32;
        if !edits.iter().any(|e| e.token == token) {
            edits.push(LogitEdit {
                token,
                bias: -4.0,
                ..Default::default()
            });
        }
    }
    edits.sort_unstable_by_key(|e| e.token);
    edits
}

/// A `sample_rows` case: `rows` over random logits in [-scale, scale] with `cols` columns
/// (`ties` tokens of each row given the row's largest logit; a row whose template has edits
/// gets [`sample_edits`] of its logits), each row's draw and logits drawn again until the row is
/// [`SAMPLE_MARGIN`] away from every boundary.
fn sample_case(
    r: &mut ChaCha8Rng,
    cols: usize,
    scale: f32,
    ties: usize,
    rows: &[RowSampling],
) -> Case {
    let mut logits = Vec::with_capacity(rows.len() * cols);
    let mut out = Vec::with_capacity(rows.len());
    for s in rows {
        let mut s = s.clone();
        let row = loop {
            let mut x: Vec<f32> = rand_vec(r, cols).iter().map(|v| v * scale).collect();
            let top = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for j in 0..ties {
                x[(j * 7919 + 13) % cols] = top;
            }
            if !s.edits.is_empty() {
                s.edits = sample_edits(r, &mut x);
            }
            s.u53 = r.next_u64() >> 11;
            if sample_reference(&s.edited(&x), &s).1 > SAMPLE_MARGIN {
                break x;
            }
        };
        logits.extend(row);
        out.push(s);
    }
    Case::Sample {
        cols,
        logits,
        rows: out,
    }
}

/// What a [`Case::Logprobs`] compares of each row: the token, its rank and the top tokens
/// (`ids`), or the token's log-probability and the top ones'. A row without log-probabilities
/// gives its token alone.
fn logprob_words(choices: &[Choice], ids: bool) -> Vec<f64> {
    let mut out = Vec::new();
    for c in choices {
        match (&c.logprobs, ids) {
            (None, _) => out.push(c.token as f64),
            (Some(lp), true) => {
                out.extend([c.token as f64, c.rank as f64, lp.top.len() as f64]);
                out.extend(lp.top.iter().map(|t| t.0 as f64));
            }
            (Some(lp), false) => {
                out.push(lp.logprob as f64);
                out.extend(lp.top.iter().map(|t| t.1 as f64));
            }
        }
    }
    out
}

/// The two [`Case::Logprobs`] of `rows` made by [`sample_case`] (its margins keep the draws
/// clear of f32 rounding), each asking for its own count of top log-probabilities.
fn logprobs_cases(
    r: &mut ChaCha8Rng,
    cols: usize,
    scale: f32,
    ties: usize,
    rows: &[RowSampling],
) -> [Case; 2] {
    let Case::Sample { logits, rows, .. } = sample_case(r, cols, scale, ties, rows) else {
        unreachable!("sample_case makes a sample case")
    };
    let case = |ids| Case::Logprobs {
        cols,
        logits: logits.clone(),
        rows: rows.clone(),
        ids,
    };
    [case(true), case(false)]
}

/// The tolerance of an attention case: f32's, but where tensor cores may run the prefill of a
/// half cache (rows with more than one query), that half type's (Q and P rounded to it).
fn attention_tolerance(kv: DType, seqs: &[(usize, usize)]) -> f64 {
    match kv {
        _ if seqs.iter().all(|&(_, q)| q <= 1) => 1e-5,
        DType::BF16 => 1e-2,
        // NOTE: an fp8 cache's tiles are widened to f16 for the MMAs
        DType::F16 | DType::F8E4M3 => 2e-3,
        DType::F32 => 1e-5,
    }
}

/// Plain causal attention over each sequence's rows in position order (its cached prefix, then
/// this step's rows), keys limited to the window and scores soft-capped as asked; then the K
/// cache as `write_kv` must leave it.
fn attention_reference(
    layout: &QkvLayout,
    kv: &KvLayout,
    prefix_rows: &[f32],
    prefix_slots: &[u32],
    qkv: &[f32],
    batch: &BatchInput,
    opts: &AttentionOptions,
) -> Vec<f64> {
    let (h, hkv, d, rl) = (
        layout.num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        layout.row_len(),
    );
    // K and V as the cache stores them (rounded to its type); q stays f32.
    let stored = |x: f32| rounded(kv.dtype, &[x])[0];
    let mut out = Vec::new();
    let mut prefix_at = 0;
    for s in 0..batch.num_seqs() {
        let (q0, q1) = (
            batch.query_start[s] as usize,
            batch.query_start[s + 1] as usize,
        );
        let c = batch.seq_lens[s] as usize - (q1 - q0);
        let mut rows: Vec<&[f32]> = prefix_rows[prefix_at * rl..(prefix_at + c) * rl]
            .chunks(rl)
            .collect();
        prefix_at += c;
        rows.extend(qkv[q0 * rl..q1 * rl].chunks(rl));
        for p in c..c + (q1 - q0) {
            let lo = opts.first_key(p + 1);
            for hq in 0..h {
                let g = hq / (h / hkv);
                let q = &rows[p][hq * d..(hq + 1) * d];
                let scores: Vec<f64> = (lo..=p)
                    .map(|j| {
                        let k = &rows[j][layout.q_len() + g * d..][..d];
                        let sc = q
                            .iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * stored(*b))
                            .sum::<f64>()
                            * opts.scale as f64;
                        match opts.logit_softcap {
                            Some(cap) => cap as f64 * (sc / cap as f64).tanh(),
                            None => sc,
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..d {
                    let vo = layout.q_len() + layout.kv_len() + g * d + i;
                    out.push((lo..=p).map(|j| e[j - lo] / z * stored(rows[j][vo])).sum());
                }
            }
        }
    }
    let mut cache = vec![0f64; kv.numel()];
    let written = prefix_rows
        .chunks(rl)
        .zip(prefix_slots)
        .chain(qkv.chunks(rl).zip(&batch.slot_mapping));
    for (row, &slot) in written {
        let (blk, off) = (slot as usize / kv.block_size, slot as usize % kv.block_size);
        for g in 0..hkv {
            for i in 0..d {
                cache[((blk * hkv + g) * kv.block_size + off) * d + i] =
                    stored(row[layout.q_len() + g * d + i]);
            }
        }
    }
    out.extend(cache);
    out
}

/// A mixed batch: decode rows, a prefill from scratch and chunks after cached prefixes, over
/// randomly permuted blocks. `seqs` is (cached, new) tokens per sequence.
fn attention_case(
    r: &mut ChaCha8Rng,
    layout: QkvLayout,
    block_size: usize,
    seqs: &[(usize, usize)],
    opts: AttentionOptions,
    kv_dtype: DType,
) -> Case {
    let blocks_needed: usize = seqs.iter().map(|(c, n)| (c + n).div_ceil(block_size)).sum();
    let num_blocks = blocks_needed + 5;
    let kv = KvLayout {
        num_blocks,
        block_size,
        num_kv_heads: layout.num_kv_heads,
        head_dim: layout.head_dim,
        dtype: kv_dtype,
    };
    let mut perm: Vec<u32> = (1..num_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, r.next_u32() as usize % (i + 1));
    }
    let mut next = 0;
    let tables: Vec<Vec<u32>> = seqs
        .iter()
        .map(|(c, n)| {
            let nb = (c + n).div_ceil(block_size);
            next += nb;
            perm[next - nb..next].to_vec()
        })
        .collect();
    let max_blocks = tables.iter().map(|t| t.len()).max().unwrap_or(1);
    let rl = layout.row_len();
    let slot = |s: usize, p: usize| {
        tables[s][p / block_size] * block_size as u32 + (p % block_size) as u32
    };
    let (mut prefix_rows, mut prefix_slots, mut qkv) = (vec![], vec![], vec![]);
    let mut batch = BatchInput {
        max_blocks,
        query_start: vec![0],
        ..Default::default()
    };
    for (s, &(c, n)) in seqs.iter().enumerate() {
        prefix_rows.extend(rand_vec(r, c * rl));
        prefix_slots.extend((0..c).map(|p| slot(s, p)));
        qkv.extend(rand_vec(r, n * rl));
        for p in c..c + n {
            batch.token_ids.push(0);
            batch.positions.push(p as u32);
            batch.slot_mapping.push(slot(s, p));
        }
        batch.query_start.push(batch.positions.len() as u32);
        batch.seq_lens.push((c + n) as u32);
        batch.block_tables.extend_from_slice(&tables[s]);
        batch
            .block_tables
            .extend(std::iter::repeat_n(0, max_blocks - tables[s].len()));
    }
    Case::Attention {
        layout,
        kv,
        prefix_rows,
        prefix_slots,
        qkv,
        batch,
        opts,
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

fn cases(seed: u64) -> Vec<(String, String, f64, Case)> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
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
                Case::Matmul {
                    dtype,
                    m,
                    k,
                    n,
                    x: rand_vec(&mut r, m * k),
                    w: rand_vec(&mut r, n * k),
                    b: bias.then(|| rand_vec(&mut r, n)),
                },
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
                Case::GatedMatmul {
                    dtype,
                    m,
                    k,
                    ffn,
                    x: rand_vec(&mut r, m * k),
                    w: rand_vec(&mut r, 2 * ffn * k),
                },
            ));
        }
    }
    for &(rows, dim) in &[(1, 2048), (7, 576), (3, 33)] {
        for fused in [false, true] {
            out.push((
                if fused { "add_rms_norm" } else { "rms_norm" }.into(),
                format!("{rows}x{dim}"),
                1e-5,
                Case::RmsNorm {
                    rows,
                    dim,
                    x: rand_vec(&mut r, rows * dim),
                    y: rand_vec(&mut r, rows * dim),
                    w: rand_vec(&mut r, dim),
                    fused,
                },
            ));
        }
    }
    for &(rows, dim) in &[(5, 768), (2, 33)] {
        out.push((
            "layer_norm".into(),
            format!("{rows}x{dim}"),
            1e-5,
            Case::LayerNorm {
                rows,
                dim,
                x: rand_vec(&mut r, rows * dim)
                    .iter()
                    .map(|v| v + 10.0)
                    .collect(),
                w: rand_vec(&mut r, dim),
                b: rand_vec(&mut r, dim),
            },
        ));
    }
    out.push((
        "gated_act+act+scale+softcap+add".into(),
        "9x1000".into(),
        1e-5,
        Case::Elementwise {
            rows: 9,
            ffn: 1000,
            gu: rand_vec(&mut r, 9 * 2000).iter().map(|v| v * 6.0).collect(),
            a: rand_vec(&mut r, 9000),
            b: rand_vec(&mut r, 9000),
        },
    ));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (vocab, dim) = (301, 96);
        out.push((
            "embedding+gather".into(),
            format!("{} {vocab}x{dim}", dtype.name()),
            1e-6,
            Case::Embedding {
                dtype,
                dim,
                table: rand_vec(&mut r, vocab * dim),
                ids: (0..11).map(|i| (i * 37 + 5) % vocab as u32).collect(),
                rows: vec![10, 0, 4, 4],
            },
        ));
    }
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
        let rope = Case::Rope {
            rows,
            layout,
            x: rand_vec(&mut r, rows * layout.row_len()),
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
            let Case::Rope {
                x, pos, cos, sin, ..
            } = &rope
            else {
                unreachable!()
            };
            out.push((
                "rope+write_kv".into(),
                format!("{} KV, {rows} rows h={h} hkv={hkv} d={d}", dtype.name()),
                1e-5,
                Case::RopeWriteKv {
                    rope: Box::new(Case::Rope {
                        rows,
                        layout,
                        x: x.clone(),
                        pos: pos.clone(),
                        cos: cos.clone(),
                        sin: sin.clone(),
                    }),
                    kv,
                    slots,
                },
            ));
        }
        out.push((
            "rope".into(),
            format!("{rows} rows h={h} hkv={hkv} d={d}"),
            1e-5,
            rope,
        ));
    }
    for &(rows, h, hkv, d) in &[(7, 16, 8, 128), (2, 14, 2, 64), (5, 2, 1, 80)] {
        let layout = QkvLayout {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        };
        out.push((
            "qk_norm".into(),
            format!("{rows} rows h={h} hkv={hkv} d={d}"),
            1e-5,
            Case::QkNorm {
                rows,
                layout,
                x: rand_vec(&mut r, rows * layout.row_len()),
                qw: rand_vec(&mut r, d),
                kw: rand_vec(&mut r, d),
            },
        ));
    }
    // (name, block size, heads, kv heads, head dim, (cached, new) tokens per sequence)
    type AttnCase<'a> = (&'a str, usize, usize, usize, usize, &'a [(usize, usize)]);
    let attn: &[AttnCase] = &[
        (
            "mixed",
            16,
            4,
            4,
            32,
            &[(0, 1), (16, 1), (37, 1), (0, 23), (19, 13), (47, 5)],
        ),
        (
            "mixed gqa",
            16,
            32,
            8,
            64,
            &[(0, 7), (30, 1), (100, 40), (5, 1)],
        ),
        (
            "decode x8",
            16,
            32,
            8,
            64,
            &[
                (20, 1),
                (33, 1),
                (64, 1),
                (1, 1),
                (90, 1),
                (7, 1),
                (15, 1),
                (200, 1),
            ],
        ),
        ("long decode", 16, 32, 8, 64, &[(3000, 1)]),
        ("long prefill", 16, 14, 2, 64, &[(0, 300), (700, 64)]),
        ("odd blocks", 5, 6, 2, 16, &[(0, 9), (11, 1), (23, 4)]),
        ("d=128", 16, 16, 8, 128, &[(40, 1), (0, 33)]),
        ("d=80", 16, 6, 2, 80, &[(40, 1), (0, 21)]),
        ("block size 1", 1, 2, 1, 8, &[(0, 7), (16, 1), (5, 3)]),
        ("block size 3", 3, 16, 2, 128, &[(8, 1), (0, 10)]),
        // pure decode steps: the GPU backends' decode kernel (one per head size)
        (
            "decode d=128 rep 7",
            32,
            14,
            2,
            128,
            &[(40, 1), (700, 1), (4, 1)],
        ),
        ("decode d=80", 16, 6, 2, 80, &[(90, 1), (0, 1), (33, 1)]),
        ("decode d=256", 16, 8, 4, 256, &[(300, 1), (17, 1)]),
        ("decode d=16", 4, 4, 2, 16, &[(23, 1), (7, 1), (64, 1)]),
        ("decode d=32 rep 8", 8, 16, 2, 32, &[(1000, 1), (2, 1)]),
    ];
    // the same with a sliding window (long decodes split the context: whole partitions fall
    // before the window) and with soft-capped scores
    let windowed: &[(AttnCase, Option<usize>, Option<f32>)] = &[
        (
            (
                "window 32",
                16,
                32,
                8,
                64,
                &[(0, 40), (100, 1), (3000, 1), (60, 20)],
            ),
            Some(32),
            None,
        ),
        (
            ("window 5", 5, 6, 2, 16, &[(0, 9), (11, 1), (23, 4)]),
            Some(5),
            None,
        ),
        (
            ("softcap", 16, 8, 2, 64, &[(0, 20), (50, 1)]),
            None,
            Some(1.5),
        ),
        (
            (
                "window 9, softcap",
                4,
                6,
                2,
                16,
                &[(0, 23), (19, 13), (11, 5)],
            ),
            Some(9),
            Some(5.0),
        ),
        (("window 1", 1, 2, 1, 8, &[(0, 7), (16, 1)]), Some(1), None),
        (
            (
                "decode, window 40",
                16,
                32,
                8,
                64,
                &[(3000, 1), (100, 1), (20, 1)],
            ),
            Some(40),
            None,
        ),
        (
            ("decode, softcap", 16, 8, 2, 64, &[(50, 1), (1000, 1)]),
            None,
            Some(1.5),
        ),
        // a prefill of several query tiles whose later tiles start past the window
        (
            ("window 12, prefill", 16, 4, 2, 16, &[(0, 62), (5, 40)]),
            Some(12),
            None,
        ),
        (
            ("window 100", 8, 4, 4, 64, &[(0, 23), (37, 1)]),
            Some(100),
            None,
        ),
    ];
    // the same kernels over bf16 and f16 caches (the GPU backends' `--kv-cache-dtype`); the
    // reference reads K and V rounded to the cache's type. Prefill on tensor cores rounds Q and
    // the probabilities to the cache's type too: half precision's tolerance
    let half: &[(AttnCase, Option<usize>, DType)] = &[
        (
            ("mixed gqa", 16, 32, 8, 64, &[(0, 40), (20, 1), (7, 9)]),
            None,
            DType::BF16,
        ),
        (
            ("long prefill", 16, 14, 2, 64, &[(0, 150), (300, 32)]),
            None,
            DType::BF16,
        ),
        (
            (
                "decode d=128 rep 7",
                32,
                14,
                2,
                128,
                &[(40, 1), (700, 1), (4, 1)],
            ),
            None,
            DType::BF16,
        ),
        (
            ("decode, window 40", 16, 32, 8, 64, &[(3000, 1), (100, 1)]),
            Some(40),
            DType::BF16,
        ),
        (
            ("decode d=80", 16, 6, 2, 80, &[(90, 1), (0, 1), (33, 1)]),
            None,
            DType::F16,
        ),
        (
            ("decode d=16", 4, 4, 2, 16, &[(23, 1), (7, 1)]),
            None,
            DType::F16,
        ),
        (
            ("window 12, prefill", 16, 4, 2, 16, &[(0, 62)]),
            Some(12),
            DType::F16,
        ),
    ];
    // prefill on tensor cores at each key tile (64, 32, 16 keys by head size), one to three
    // warps, rows of a tile left empty (rep 20), the soft cap, and a window across partitions
    let half_prefill: &[(AttnCase, Option<usize>, Option<f32>, DType)] = &[
        (
            ("prefill d=128, cap 30", 16, 8, 2, 128, &[(5, 70), (0, 33)]),
            None,
            Some(30.0),
            DType::F16,
        ),
        (
            ("prefill d=256, window 50", 16, 4, 2, 256, &[(20, 90)]),
            Some(50),
            None,
            DType::BF16,
        ),
        (
            ("mixed d=96", 16, 6, 2, 96, &[(0, 20), (50, 1), (10, 5)]),
            None,
            None,
            DType::F16,
        ),
        (
            ("prefill d=32 rep 20", 8, 20, 1, 32, &[(3, 17)]),
            None,
            None,
            DType::BF16,
        ),
        // fp8 (E4M3) caches: decode (split, and not), prefill, and a mixed step
        (
            ("mixed gqa", 16, 32, 8, 64, &[(0, 40), (20, 1), (7, 9)]),
            None,
            None,
            DType::F8E4M3,
        ),
        (
            (
                "decode d=128 rep 7",
                32,
                14,
                2,
                128,
                &[(40, 1), (700, 1), (4, 1)],
            ),
            None,
            None,
            DType::F8E4M3,
        ),
        (
            ("prefill d=80, cap 20", 16, 6, 2, 80, &[(30, 45)]),
            None,
            Some(20.0),
            DType::F8E4M3,
        ),
        // blocks of sizes that are not powers of two: a key's block found by division
        (
            ("odd blocks, prefill", 5, 6, 2, 16, &[(7, 20), (0, 9)]),
            None,
            None,
            DType::BF16,
        ),
        (
            ("block size 3, mixed", 3, 8, 2, 32, &[(11, 6), (40, 1)]),
            Some(9),
            None,
            DType::F8E4M3,
        ),
    ];
    let plain = attn.iter().map(|c| (c, None, None, DType::F32));
    let windowed = windowed.iter().map(|(c, w, s)| (c, *w, *s, DType::F32));
    let half = half.iter().map(|(c, w, t)| (c, *w, None, *t));
    let half = half.chain(half_prefill.iter().map(|(c, w, s, t)| (c, *w, *s, *t)));
    for (&(name, bs, h, hkv, d, seqs), window, cap, dtype) in plain.chain(windowed).chain(half) {
        let layout = QkvLayout {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        };
        let opts = AttentionOptions {
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: window,
            logit_softcap: cap,
        };
        let kv = match dtype {
            DType::F32 => String::new(),
            t => format!("{} KV, ", t.name()),
        };
        out.push((
            "write_kv+attention".into(),
            format!("{kv}{name}: bs={bs} h={h} hkv={hkv} d={d}"),
            attention_tolerance(dtype, seqs),
            attention_case(&mut r, layout, bs, seqs, opts, dtype),
        ));
    }
    // argmax: random rows, plus a row of ties, a row with NaN and -inf, and a row where
    // nothing beats -inf
    let (rows, cols) = (5, 50_000);
    let mut logits = rand_vec(&mut r, rows * cols);
    for v in &mut logits[cols..2 * cols] {
        *v = 1.0;
    }
    logits[2 * cols] = f32::NAN;
    logits[2 * cols + 1] = f32::NEG_INFINITY;
    logits[3 * cols - 2] = 7.0;
    for (i, v) in logits[4 * cols..].iter_mut().enumerate() {
        *v = if i % 3 == 1 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    out.push((
        "argmax".into(),
        format!("{rows}x{cols} (ties, NaN)"),
        0.0,
        Case::Argmax { rows, cols, logits },
    ));
    // sampling on the device: each stage alone and together, ties across the top-k and top-p
    // cuts, greedy and top-k 1 rows among random ones, a peaked row; then many small rows
    let row = |temperature: f32, top_k: u32, top_p: f32, min_p: f32| RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        ..RowSampling::GREEDY
    };
    // edits made for each row by `sample_case`, with these penalties
    let edited = |s: RowSampling, repetition: f32, presence: f32, frequency: f32| RowSampling {
        repetition_penalty: repetition,
        presence_penalty: presence,
        frequency_penalty: frequency,
        edits: vec![LogitEdit::default()],
        ..s
    };
    let cols = 50_000;
    let rows = [
        row(1.0, 0, 1.0, 0.0),
        row(0.7, 50, 1.0, 0.0),
        row(1.3, 0, 0.9, 0.0),
        row(0.9, 0, 1.0, 0.1),
        row(0.8, 1000, 0.8, 0.05),
        RowSampling::GREEDY,
        row(1.0, 1, 1.0, 0.0),
        row(2.0, 200, 0.95, 0.01),
        edited(RowSampling::GREEDY, 1.3, 0.5, 0.2),
        edited(row(0.8, 50, 1.0, 0.0), 1.2, 0.3, 0.1),
        edited(row(1.0, 0, 0.9, 0.0), 1.0, 0.0, 0.0),
    ];
    out.push((
        "sample".into(),
        format!(
            "{}x{cols}: T, top-k, top-p, min-p, greedy, bias, bans, penalties",
            rows.len()
        ),
        0.0,
        sample_case(&mut r, cols, 6.0, 0, &rows),
    ));
    let ties = [
        row(1.0, 20, 1.0, 0.0),
        row(1.0, 40, 0.5, 0.0),
        row(0.5, 0, 0.3, 0.0),
    ];
    out.push((
        "sample".into(),
        format!("{}x{cols}: 30 tokens tied for first", ties.len()),
        0.0,
        sample_case(&mut r, cols, 6.0, 30, &ties),
    ));
    let peaked = [row(1.0, 0, 1.0, 0.0), row(0.6, 0, 0.99, 0.0)];
    out.push((
        "sample".into(),
        format!("{}x{cols}: logits up to 40", peaked.len()),
        0.0,
        sample_case(&mut r, cols, 40.0, 0, &peaked),
    ));
    let small: Vec<RowSampling> = (0..48)
        .map(|i| {
            let mut pick = |n: u32| r.next_u32() % n;
            let s = row(
                [0.5, 1.0, 1.5][pick(3) as usize],
                [0, 0, 5, 100][pick(4) as usize],
                [1.0, 0.9, 0.6][pick(3) as usize],
                [0.0, 0.0, 0.2][i % 3],
            );
            if i % 4 == 3 {
                edited(s, 1.1, 0.2, 0.4)
            } else {
                s
            }
        })
        .collect();
    out.push((
        "sample".into(),
        format!("{}x100: random settings", small.len()),
        0.0,
        sample_case(&mut r, 100, 3.0, 0, &small),
    ));
    // log-probabilities on the device: sampled, greedy and edited rows (whose raw logits are
    // kept for them), rows without any between them, prompt tokens scored; ties across the
    // top 20; rows shorter than the count asked
    let lp = |k: u32, s: RowSampling| RowSampling {
        logprobs: Some(k),
        ..s
    };
    let score = |k: u32, token: u32| RowSampling {
        score: Some(token),
        ..lp(k, RowSampling::GREEDY)
    };
    let cols = 20_000;
    let rows = [
        lp(5, row(1.0, 0, 1.0, 0.0)),
        lp(20, RowSampling::GREEDY),
        lp(0, row(0.8, 50, 0.9, 0.0)),
        lp(3, edited(row(1.0, 0, 0.9, 0.0), 1.2, 0.3, 0.1)),
        row(1.0, 0, 1.0, 0.0),
        lp(20, edited(RowSampling::GREEDY, 1.3, 0.5, 0.2)),
        score(4, 7),
        score(0, cols as u32 - 1),
    ];
    let plain = [
        lp(20, row(1.0, 20, 1.0, 0.0)),
        lp(20, RowSampling::GREEDY),
        score(20, 3),
    ];
    for (what, cols, ties, rows) in [
        ("sampled, greedy, edited, scored", cols, 0, &rows[..]),
        ("30 tokens tied for first", cols, 30, &plain[..]),
        ("rows of 12", 12, 0, &plain[..]),
    ] {
        let [ids, values] = logprobs_cases(&mut r, cols, 6.0, ties, rows);
        let name = format!("{}x{cols}: {what}", rows.len());
        out.push((
            "logprobs".into(),
            format!("{name}: tokens, ranks"),
            0.0,
            ids,
        ));
        out.push(("logprobs".into(), format!("{name}: values"), 1e-5, values));
    }
    // KV block copies (swap): 80 blocks of 512 bytes span several parts of a split cache;
    // half and fp8 caches round what is written (the reference too) and widen what is read
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
        let kv = KvLayout {
            num_blocks: 80,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 16,
            dtype,
        };
        let bl = kv.block_len();
        let write = vec![79, 3, 40, 0, 33];
        out.push((
            "kv block copies".into(),
            format!(
                "{} blocks of {bl}, {}: write 5, read 6",
                kv.num_blocks,
                dtype.name()
            ),
            0.0,
            Case::KvBlocks {
                kv,
                cache: rand_vec(&mut r, kv.num_blocks * bl),
                data: rand_vec(&mut r, write.len() * bl),
                write,
                read: vec![40, 1, 79, 31, 32, 0],
            },
        ));
    }
    out
}

impl Case {
    /// The KV cache type a case allocates, if it allocates one.
    fn kv_dtype(&self) -> Option<DType> {
        match self {
            Case::Attention { kv, .. }
            | Case::KvBlocks { kv, .. }
            | Case::RopeWriteKv { kv, .. } => Some(kv.dtype),
            _ => None,
        }
    }

    /// Whether `be` runs the case: a KV cache type it stores, random sampling where it samples
    /// on the device.
    fn runs_on<B: Backend>(&self, be: &B) -> bool {
        let kv = self
            .kv_dtype()
            .is_none_or(|d| be.kv_cache_dtypes().contains(&d));
        kv && (be.samples_on_device()
            || !matches!(self, Case::Sample { .. } | Case::Logprobs { .. }))
    }
}

/// Runs every case of the table on `be` against `want` (the CPU backend or the f64 reference).
/// Cases the backend does not run ([`Case::runs_on`]) are left out.
fn check_with<B: Backend>(
    be: &B,
    seed: u64,
    want: impl Fn(&Case) -> Result<Vec<f64>>,
) -> Vec<CheckRow> {
    cases(seed)
        .into_iter()
        .filter(|(.., case)| case.runs_on(be))
        .map(|(op, case_name, tol, case)| {
            let want = want(&case);
            let t0 = std::time::Instant::now();
            let got = run(be, &case);
            let micros = t0.elapsed().as_secs_f64() * 1e6;
            let (err, error) = match (got, want) {
                (Ok(g), Ok(w)) => (Some(rel_err(&g, &w)), None),
                (Err(e), _) => (None, Some(format!("{e:#}"))),
                (_, Err(e)) => (None, Some(format!("the reference failed: {e:#}"))),
            };
            CheckRow {
                op,
                case: case_name,
                err,
                tol,
                error,
                micros,
            }
        })
        .collect()
}

/// `pagoda check-backend`: every case on `be` and on the CPU backend.
pub fn check_backend<B: Backend>(be: &B, seed: u64) -> Vec<CheckRow> {
    let cpu = CpuBackend::new();
    check_with(be, seed, |case| {
        // NOTE: a cache type the CPU does not store is checked against the f64 reference,
        // which rounds K and V as the cache does; so is sampling on the device.
        if !case.runs_on(&cpu) {
            return Ok(reference(case));
        }
        Ok(run(&cpu, case)?.into_iter().map(f64::from).collect())
    })
}

/// The same table against an f64 reference computed here, independently of every backend:
/// what `cargo test` runs for each compiled backend (`tests/backend_ops.rs`).
pub fn check_against_reference<B: Backend>(be: &B, seed: u64) -> Vec<CheckRow> {
    check_with(be, seed, |case| Ok(reference(case)))
}

/// Creates the backend `kind` names and checks it.
pub fn check_backend_kind(kind: BackendKind, seed: u64) -> Result<(String, Vec<CheckRow>)> {
    fn go<B: Backend>(b: B, seed: u64) -> Result<(String, Vec<CheckRow>)> {
        Ok((b.name(), check_backend(&b, seed)))
    }
    match kind {
        BackendKind::Cpu => go(CpuBackend::new(), seed),
        BackendKind::Cuda => go(CudaBackend::new()?, seed),
        BackendKind::Hip => go(HipBackend::new()?, seed),
        BackendKind::Emu => go(EmuBackend::new()?, seed),
        BackendKind::Wgpu => go(WgpuBackend::new()?, seed),
        BackendKind::Auto => {
            bail!("check-backend needs a named backend (cuda, hip, wgpu, emu, cpu)")
        }
    }
}

/// The table as text, one line per case, with a summary line last.
pub fn format_table(backend: &str, rows: &[CheckRow]) -> String {
    let mut s = format!("check-backend: {backend} against cpu\n");
    s.push_str(&format!(
        "{:<20} {:<44} {:>10} {:>8} {:>10}  result\n",
        "op", "case", "error", "tol", "time (us)"
    ));
    for r in rows {
        let err = r.err.map_or("-".to_string(), |e| format!("{e:.2e}"));
        let result = match (&r.error, r.passed()) {
            (Some(e), _) => format!("ERROR {}", e.lines().next().unwrap_or("")),
            (None, true) => "ok".into(),
            (None, false) => "FAIL".into(),
        };
        s.push_str(&format!(
            "{:<20} {:<44} {:>10} {:>8.0e} {:>10.0}  {result}\n",
            r.op, r.case, err, r.tol, r.micros
        ));
    }
    let passed = rows.iter().filter(|r| r.passed()).count();
    s.push_str(&format!(
        "{passed} passed, {} failed\n",
        rows.len() - passed
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_agrees_with_itself() {
        let rows = check_backend(&CpuBackend::new(), 7);
        assert!(rows.len() > 30);
        for r in &rows {
            assert!(r.passed(), "{r:?}");
            assert_eq!(r.err, Some(0.0), "{r:?}");
        }
        let t = format_table("cpu", &rows);
        assert!(t.contains(&format!("{} passed, 0 failed", rows.len())));
    }

    #[test]
    fn the_cpu_backend_passes_the_table_against_the_f64_reference() {
        let rows = check_against_reference(&CpuBackend::new(), 7);
        let failed: Vec<_> = rows.iter().filter(|r| !r.passed()).collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }

    #[test]
    fn the_reference_can_fail() {
        // a wrong output is caught: every case run on the CPU (or, for a case the CPU does not
        // run, the reference itself), its first value off by more than the output's scale
        let cpu = CpuBackend::new();
        for (_, name, tol, case) in cases(3) {
            let mut got = if case.runs_on(&cpu) {
                run(&cpu, &case).unwrap()
            } else {
                reference(&case).into_iter().map(|x| x as f32).collect()
            };
            let scale = got.iter().fold(0f32, |m, x| m.max(x.abs()));
            got[0] += 1.0 + scale;
            assert!(rel_err(&got, &reference(&case)) > tol, "{name}");
        }
    }
}
