//! Every backend op against an independent f64 reference on fresh random inputs (never zeros):
//! relative error at most 1e-5 with f32 weights, 1e-2 with f16/bf16. The `backend_ops!` macro
//! instantiates the whole table for each compiled backend.

use pagoda::backend::{
    Activation, AttentionOptions, Backend, BatchInput, DeviceBatch, KvLayout, QkvLayout,
};
use pagoda::tensor::{DType, HostTensor};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn randn(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (r.next_u32() as f64 / u32::MAX as f64 * 2.0 - 1.0) as f32)
        .collect()
}

/// max |a - b| / max(max |b|, tiny): an error normalised by the reference's scale.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max)
        / scale
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

fn round_to(dtype: DType, v: &[f32]) -> Vec<f64> {
    v.iter()
        .map(|&x| match dtype {
            DType::F32 => x as f64,
            DType::F16 => half::f16::from_f32(x).to_f64(),
            DType::BF16 => half::bf16::from_f32(x).to_f64(),
        })
        .collect()
}

pub fn check_matmul<B: Backend>(
    be: &B,
    dtype: DType,
    m: usize,
    k: usize,
    n: usize,
    bias: bool,
    seed: u64,
) {
    let mut r = rng(seed);
    let x = randn(&mut r, m * k);
    let w = randn(&mut r, n * k);
    let b = randn(&mut r, n);
    let wq = round_to(dtype, &w);
    let mut want = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = if bias { b[j] as f64 } else { 0.0 };
            for kk in 0..k {
                acc += x[i * k + kk] as f64 * wq[j * k + kk];
            }
            want[i * n + j] = acc;
        }
    }
    let xb = be.upload_f32(&x).unwrap();
    let wb = be
        .upload_weight(&HostTensor::new(vec![n, k], w), dtype)
        .unwrap();
    let bb = be.upload_f32(&b).unwrap();
    let mut out = be.alloc_f32(m * n).unwrap();
    be.matmul(&xb, &wb, bias.then_some(&bb), m, k, n, &mut out)
        .unwrap();
    let e = rel_err(&be.download_f32(&out).unwrap(), &want);
    // NOTE: inputs are rounded to `dtype` in the reference too, so f16/bf16 differ from it only
    // by f32 accumulation; the tolerance by precision still applies.
    assert!(e < tol(dtype), "matmul {dtype:?} {m}x{k}x{n}: rel err {e}");
}

pub fn check_rms_norm<B: Backend>(be: &B, rows: usize, dim: usize, seed: u64) {
    let mut r = rng(seed);
    let x = randn(&mut r, rows * dim);
    let w = randn(&mut r, dim);
    let eps = 1e-5;
    let mut want = vec![0f64; rows * dim];
    for i in 0..rows {
        let row = &x[i * dim..(i + 1) * dim];
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..dim {
            want[i * dim + j] = row[j] as f64 * inv * w[j] as f64;
        }
    }
    let mut out = be.alloc_f32(rows * dim).unwrap();
    let wb = be
        .upload_weight(&HostTensor::new(vec![dim], w), DType::F32)
        .unwrap();
    be.rms_norm(
        &be.upload_f32(&x).unwrap(),
        &wb,
        rows,
        dim,
        eps as f32,
        &mut out,
    )
    .unwrap();
    let e = rel_err(&be.download_f32(&out).unwrap(), &want);
    assert!(e < 1e-5, "rms_norm {rows}x{dim}: {e}");
}

/// LayerNorm with bias; rows with a large mean, where a one-pass variance would lose digits.
pub fn check_layer_norm<B: Backend>(be: &B, rows: usize, dim: usize, seed: u64) {
    let mut r = rng(seed);
    let x: Vec<f32> = randn(&mut r, rows * dim)
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v + if (i / dim).is_multiple_of(2) {
                0.0
            } else {
                30.0
            }
        })
        .collect();
    let (w, b) = (randn(&mut r, dim), randn(&mut r, dim));
    let eps = 1e-5;
    let mut want = vec![0f64; rows * dim];
    for i in 0..rows {
        let row: Vec<f64> = x[i * dim..(i + 1) * dim]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mean = row.iter().sum::<f64>() / dim as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / dim as f64;
        for j in 0..dim {
            want[i * dim + j] = (row[j] - mean) / (var + eps).sqrt() * w[j] as f64 + b[j] as f64;
        }
    }
    let mut out = be.alloc_f32(rows * dim).unwrap();
    be.layer_norm(
        &be.upload_f32(&x).unwrap(),
        &be.upload_f32(&w).unwrap(),
        &be.upload_f32(&b).unwrap(),
        rows,
        dim,
        eps as f32,
        &mut out,
    )
    .unwrap();
    let e = rel_err(&be.download_f32(&out).unwrap(), &want);
    assert!(e < 1e-5, "layer_norm {rows}x{dim}: {e}");
}

pub fn check_elementwise<B: Backend>(be: &B, rows: usize, ffn: usize, seed: u64) {
    let mut r = rng(seed);
    let gu: Vec<f32> = randn(&mut r, rows * 2 * ffn)
        .iter()
        .map(|v| v * 6.0)
        .collect();
    for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
        let mut want = vec![0f64; rows * ffn];
        for i in 0..rows {
            for j in 0..ffn {
                let g = gu[i * 2 * ffn + j] as f64;
                let u = gu[i * 2 * ffn + ffn + j] as f64;
                want[i * ffn + j] = act.apply_f64(g) * u;
            }
        }
        let mut out = be.alloc_f32(rows * ffn).unwrap();
        be.gated_act(&be.upload_f32(&gu).unwrap(), rows, ffn, act, &mut out)
            .unwrap();
        let e = rel_err(&be.download_f32(&out).unwrap(), &want);
        assert!(e < 1e-5, "gated_act {act:?}: {e}");

        // the plain activation, in place, over the gate half's values
        let x: Vec<f32> = gu[..rows * ffn].to_vec();
        let want: Vec<f64> = x.iter().map(|&v| act.apply_f64(v as f64)).collect();
        let mut xb = be.upload_f32(&x).unwrap();
        be.act(&mut xb, rows * ffn, act).unwrap();
        let e = rel_err(&be.download_f32(&xb).unwrap(), &want);
        assert!(e < 1e-5, "act {act:?}: {e}");
    }
    let x = randn(&mut r, rows * ffn);
    let want: Vec<f64> = x.iter().map(|&v| v as f64 * 25.298221).collect();
    let mut xb = be.upload_f32(&x).unwrap();
    be.scale(&mut xb, 25.298221, rows * ffn).unwrap();
    assert!(
        rel_err(&be.download_f32(&xb).unwrap(), &want) < 1e-6,
        "scale"
    );

    let a = randn(&mut r, rows * ffn);
    let b = randn(&mut r, rows * ffn);
    let want: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| *x as f64 + *y as f64)
        .collect();
    let mut ab = be.upload_f32(&a).unwrap();
    be.add_assign(&mut ab, &be.upload_f32(&b).unwrap(), rows * ffn)
        .unwrap();
    assert!(
        rel_err(&be.download_f32(&ab).unwrap(), &want) < 1e-6,
        "add_assign"
    );

    // embedding and gather_rows (ids spread over the table, which a backend may split by rows)
    let (vocab, dim) = (301, ffn);
    let table = randn(&mut r, vocab * dim);
    let ids: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 97 + 3) % vocab as u32)
        .collect();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tq = round_to(dtype, &table);
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&i| tq[i as usize * dim..(i as usize + 1) * dim].to_vec())
            .collect();
        let tb = be
            .upload_weight(&HostTensor::new(vec![vocab, dim], table.clone()), dtype)
            .unwrap();
        let mut out = be.alloc_f32(rows * dim).unwrap();
        be.embedding(&tb, &be.upload_u32(&ids).unwrap(), dim, &mut out)
            .unwrap();
        assert!(
            rel_err(&be.download_f32(&out).unwrap(), &want) < 1e-6,
            "embedding {dtype:?}"
        );
    }
    let rows_idx: Vec<u32> = (0..rows as u32).rev().step_by(2).collect();
    let want: Vec<f64> = rows_idx
        .iter()
        .flat_map(|&i| {
            a[i as usize * ffn..(i as usize + 1) * ffn]
                .iter()
                .map(|&v| v as f64)
        })
        .collect();
    let mut out = be.alloc_f32(rows_idx.len() * ffn).unwrap();
    be.gather_rows(
        &be.upload_f32(&a).unwrap(),
        &be.upload_u32(&rows_idx).unwrap(),
        ffn,
        &mut out,
    )
    .unwrap();
    assert!(
        rel_err(&be.download_f32(&out).unwrap(), &want) < 1e-7,
        "gather_rows"
    );
}

pub fn check_rope<B: Backend>(be: &B, rows: usize, layout: QkvLayout, seed: u64) {
    let mut r = rng(seed);
    let d = layout.head_dim;
    let max_pos = 300;
    let x = randn(&mut r, rows * layout.row_len());
    let pos: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 37 + 5) % max_pos as u32)
        .collect();
    let theta = 10000f64;
    let (mut cos, mut sin) = (vec![], vec![]);
    for p in 0..max_pos {
        for i in 0..d / 2 {
            let a = p as f64 / theta.powf(2.0 * i as f64 / d as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..layout.num_heads + layout.num_kv_heads {
            let base = t * layout.row_len() + h * d;
            for i in 0..d / 2 {
                let a = p as f64 / theta.powf(2.0 * i as f64 / d as f64);
                let (x1, x2) = (x[base + i] as f64, x[base + i + d / 2] as f64);
                want[base + i] = x1 * a.cos() - x2 * a.sin();
                want[base + i + d / 2] = x2 * a.cos() + x1 * a.sin();
            }
        }
    }
    let mut xb = be.upload_f32(&x).unwrap();
    let (cb, sb) = (be.upload_f32(&cos).unwrap(), be.upload_f32(&sin).unwrap());
    be.rope(
        &mut xb,
        &be.upload_u32(&pos).unwrap(),
        &cb,
        &sb,
        rows,
        layout,
    )
    .unwrap();
    let e = rel_err(&be.download_f32(&xb).unwrap(), &want);
    assert!(e < 1e-5, "rope: {e}");
}

/// Per-head RMSNorm of the q and k heads of fused QKV rows, in place; v must be untouched.
pub fn check_qk_norm<B: Backend>(be: &B, rows: usize, layout: QkvLayout, seed: u64) {
    let mut r = rng(seed);
    let d = layout.head_dim;
    let x = randn(&mut r, rows * layout.row_len());
    let (qw, kw) = (randn(&mut r, d), randn(&mut r, d));
    let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for t in 0..rows {
        for h in 0..layout.num_heads + layout.num_kv_heads {
            let base = t * layout.row_len() + h * d;
            let w = if h < layout.num_heads { &qw } else { &kw };
            let ss: f64 = want[base..base + d].iter().map(|v| v * v).sum::<f64>() / d as f64;
            let inv = 1.0 / (ss + 1e-6).sqrt();
            for i in 0..d {
                want[base + i] *= inv * w[i] as f64;
            }
        }
    }
    let mut xb = be.upload_f32(&x).unwrap();
    let (qb, kb) = (be.upload_f32(&qw).unwrap(), be.upload_f32(&kw).unwrap());
    be.qk_norm(&mut xb, &qb, &kb, rows, layout, 1e-6).unwrap();
    let got = be.download_f32(&xb).unwrap();
    let e = rel_err(&got, &want);
    assert!(e < 1e-5, "qk_norm {layout:?}: {e}");
    let v0 = layout.q_len() + layout.kv_len();
    for t in 0..rows {
        let row = t * layout.row_len();
        assert_eq!(
            got[row + v0..row + layout.row_len()],
            x[row + v0..row + layout.row_len()],
            "qk_norm changed v"
        );
    }
}

/// Paged attention over randomly permuted block tables, for a batch mixing decode rows and
/// prefill chunks that continue a cached prefix. The K/V of every position are written with
/// `write_kv` (cached prefix in an earlier call, this step's rows in this one). `window` and
/// `softcap` are the [`AttentionOptions`] under test besides the scale.
#[allow(clippy::too_many_arguments)]
pub fn check_paged_attention<B: Backend>(
    be: &B,
    block_size: usize,
    h: usize,
    hkv: usize,
    d: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    seed: u64,
) {
    let mut r = rng(seed);
    let layout = QkvLayout {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
    };
    // (cached tokens, new tokens) per sequence: decode, prefill from scratch, chunk after a prefix
    let seqs = [
        (0usize, 1usize),
        (16, 1),
        (37, 1),
        (0, 23),
        (19, 13),
        (block_size * 3 - 1, 5),
    ];
    let total_blocks: usize = seqs
        .iter()
        .map(|(c, n)| (c + n).div_ceil(block_size))
        .sum::<usize>()
        + 1;
    let num_blocks = total_blocks + 7;
    let kvl = KvLayout {
        num_blocks,
        block_size,
        num_kv_heads: hkv,
        head_dim: d,
    };
    // a random permutation of blocks 1.. as the pool's assignment
    let mut perm: Vec<u32> = (1..num_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, r.next_u32() as usize % (i + 1));
    }
    let mut next = 0;
    let tables: Vec<Vec<u32>> = seqs
        .iter()
        .map(|(c, n)| {
            let nb = (c + n).div_ceil(block_size);
            let t = perm[next..next + nb].to_vec();
            next += nb;
            t
        })
        .collect();
    let max_blocks = tables.iter().map(|t| t.len()).max().unwrap();
    // Every position's q, k, v for each sequence.
    let all: Vec<Vec<f32>> = seqs
        .iter()
        .map(|(c, n)| randn(&mut r, (c + n) * layout.row_len()))
        .collect();
    let mut kc = be.alloc_kv(kvl).unwrap();
    let mut vc = be.alloc_kv(kvl).unwrap();
    let slot = |s: usize, p: usize| {
        tables[s][p / block_size] * block_size as u32 + (p % block_size) as u32
    };
    let write = |kc: &mut B::Buf, vc: &mut B::Buf, rows: Vec<f32>, slots: Vec<u32>| {
        let n = slots.len();
        be.write_kv(
            &be.upload_f32(&rows).unwrap(),
            &be.upload_u32(&slots).unwrap(),
            n,
            layout,
            kc,
            vc,
            kvl,
        )
        .unwrap();
    };
    // cached prefixes
    let (mut rows, mut slots) = (vec![], vec![]);
    for (s, (c, _)) in seqs.iter().enumerate() {
        rows.extend_from_slice(&all[s][..c * layout.row_len()]);
        slots.extend((0..*c).map(|p| slot(s, p)));
    }
    if !slots.is_empty() {
        write(&mut kc, &mut vc, rows, slots);
    }
    // this step's rows
    let mut input = BatchInput {
        max_blocks,
        query_start: vec![0],
        ..Default::default()
    };
    let mut qkv = vec![];
    for (s, (c, n)) in seqs.iter().enumerate() {
        qkv.extend_from_slice(&all[s][c * layout.row_len()..(c + n) * layout.row_len()]);
        for p in *c..c + n {
            input.positions.push(p as u32);
            input.slot_mapping.push(slot(s, p));
            input.token_ids.push(0);
        }
        input.query_start.push(input.positions.len() as u32);
        input.seq_lens.push((c + n) as u32);
        input.block_tables.extend_from_slice(&tables[s]);
        input
            .block_tables
            .extend(std::iter::repeat_n(0, max_blocks - tables[s].len()));
    }
    let t_rows = input.positions.len();
    let batch = DeviceBatch::upload(be, input).unwrap();
    let qkv_b = be.upload_f32(&qkv).unwrap();
    be.write_kv(
        &qkv_b,
        &batch.slot_mapping,
        t_rows,
        layout,
        &mut kc,
        &mut vc,
        kvl,
    )
    .unwrap();
    let mut out = be.alloc_f32(t_rows * h * d).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let opts = AttentionOptions {
        scale,
        sliding_window: window,
        logit_softcap: softcap,
    };
    be.paged_attention(&qkv_b, &kc, &vc, &batch, layout, kvl, opts, &mut out)
        .unwrap();

    // reference: plain causal attention over each sequence's full q/k/v, keys lo ..= p
    let mut want = vec![];
    let rl = layout.row_len();
    for (s, (c, n)) in seqs.iter().enumerate() {
        let a = &all[s];
        for p in *c..c + n {
            for hq in 0..h {
                let g = hq / (h / hkv);
                let q = &a[p * rl + hq * d..p * rl + (hq + 1) * d];
                let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
                let scores: Vec<f64> = (lo..=p)
                    .map(|j| {
                        let k = &a[j * rl + layout.q_len() + g * d..][..d];
                        let sc = q
                            .iter()
                            .zip(k)
                            .map(|(x, y)| *x as f64 * *y as f64)
                            .sum::<f64>()
                            * scale as f64;
                        match softcap {
                            Some(c) => c as f64 * (sc / c as f64).tanh(),
                            None => sc,
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..d {
                    let v: f64 = (lo..=p)
                        .map(|j| {
                            e[j - lo] / z
                                * a[j * rl + layout.q_len() + layout.kv_len() + g * d + i] as f64
                        })
                        .sum();
                    want.push(v);
                }
            }
        }
    }
    let err = rel_err(&be.download_f32(&out).unwrap(), &want);
    assert!(
        err < 1e-5,
        "paged attention bs={block_size} h={h} hkv={hkv} d={d} window={window:?} softcap={softcap:?}: {err}"
    );
}

/// Greedy argmax of each row, against `pagoda::backend::argmax` (ties: the lowest index; NaN
/// never wins).
pub fn check_argmax<B: Backend>(be: &B, rows: usize, cols: usize, seed: u64) {
    let mut r = rng(seed);
    let mut x = randn(&mut r, rows * cols);
    // a tie in row 0, a NaN before the maximum of row 1, a row of -inf
    x[3] = 5.0;
    x[cols - 2] = 5.0;
    if rows > 2 {
        x[cols + 1] = f32::NAN;
        x[cols + 7] = 4.0;
        x[2 * cols..3 * cols].fill(f32::NEG_INFINITY);
    }
    let want: Vec<u32> = (0..rows)
        .map(|i| pagoda::backend::argmax(&x[i * cols..(i + 1) * cols]) as u32)
        .collect();
    let got = be
        .argmax_rows(&be.upload_f32(&x).unwrap(), rows, cols)
        .unwrap();
    assert_eq!(got, want, "argmax_rows {rows}x{cols}");
}

/// Instantiates every op test for one backend. `$make` gives `Some(backend)`, or `None` where
/// the backend is compiled but its device is missing (each test then says so and passes: CI
/// has no GPU).
macro_rules! backend_ops {
    ($name:ident, $make:expr) => {
        mod $name {
            use super::*;
            fn be() -> Option<impl Backend> {
                $make
            }
            #[test]
            fn matmul_f32() {
                let Some(b) = be() else { return };
                for (i, &(m, k, n)) in [(1, 64, 96), (7, 130, 33), (64, 576, 192), (3, 1, 5)]
                    .iter()
                    .enumerate()
                {
                    check_matmul(&b, DType::F32, m, k, n, i % 2 == 0, i as u64);
                }
            }
            #[test]
            fn matmul_half() {
                let Some(b) = be() else { return };
                for dtype in [DType::F16, DType::BF16] {
                    for (i, &(m, k, n)) in [(1, 64, 130), (9, 200, 70)].iter().enumerate() {
                        check_matmul(&b, dtype, m, k, n, i == 1, 10 + i as u64);
                    }
                }
            }
            #[test]
            fn rms_norm() {
                let Some(b) = be() else { return };
                check_rms_norm(&b, 5, 576, 1);
                check_rms_norm(&b, 1, 33, 2);
            }
            #[test]
            fn elementwise_embedding_gather() {
                let Some(b) = be() else { return };
                check_elementwise(&b, 6, 48, 3);
            }
            #[test]
            fn layer_norm() {
                let Some(b) = be() else { return };
                check_layer_norm(&b, 4, 576, 11);
                check_layer_norm(&b, 3, 33, 12);
            }
            #[test]
            fn qk_norm() {
                let Some(b) = be() else { return };
                for (i, &(rows, h, hkv, d)) in [(3, 4, 2, 32), (1, 14, 2, 64), (5, 2, 1, 80)]
                    .iter()
                    .enumerate()
                {
                    let layout = QkvLayout {
                        num_heads: h,
                        num_kv_heads: hkv,
                        head_dim: d,
                    };
                    check_qk_norm(&b, rows, layout, 60 + i as u64);
                }
            }
            #[test]
            fn rope() {
                let Some(b) = be() else { return };
                check_rope(
                    &b,
                    9,
                    QkvLayout {
                        num_heads: 4,
                        num_kv_heads: 2,
                        head_dim: 16,
                    },
                    4,
                );
                check_rope(
                    &b,
                    3,
                    QkvLayout {
                        num_heads: 9,
                        num_kv_heads: 3,
                        head_dim: 64,
                    },
                    5,
                );
            }
            #[test]
            fn argmax_rows() {
                let Some(b) = be() else { return };
                check_argmax(&b, 4, 1000, 7);
                check_argmax(&b, 1, 3001, 8);
            }
            #[test]
            fn paged_attention() {
                let Some(b) = be() else { return };
                for (i, &(bs, h, hkv, d)) in [
                    (16, 4, 4, 32),
                    (16, 9, 3, 64),
                    (8, 14, 2, 64),
                    (1, 2, 1, 8),
                    (5, 6, 2, 16),
                    (3, 16, 2, 128),
                ]
                .iter()
                .enumerate()
                {
                    check_paged_attention(&b, bs, h, hkv, d, None, None, 100 + i as u64);
                }
            }
            #[test]
            fn paged_attention_sliding_window_and_softcap() {
                let Some(b) = be() else { return };
                // windows shorter than a block, across block edges, longer than every sequence
                for (i, &(bs, h, hkv, d, w, cap)) in [
                    (16, 4, 2, 32, Some(7), None),
                    (4, 6, 2, 16, Some(9), Some(5.0)),
                    (1, 2, 1, 8, Some(1), None),
                    (8, 4, 4, 64, Some(100), None),
                    (16, 9, 3, 64, None, Some(2.5)),
                ]
                .iter()
                .enumerate()
                {
                    check_paged_attention(&b, bs, h, hkv, d, w, cap, 200 + i as u64);
                }
            }
        }
    };
}

backend_ops!(cpu, Some(pagoda::backend::CpuBackend::new()));

/// A compiled GPU backend, or `None` (with the reason printed) where this machine lacks it.
#[allow(dead_code)]
fn gpu_or_skip<B: Backend>(b: anyhow::Result<B>) -> Option<B> {
    match b {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: {e:#}");
            None
        }
    }
}

#[cfg(feature = "cuda")]
backend_ops!(cuda, gpu_or_skip(pagoda::backend::CudaBackend::new()));
#[cfg(feature = "hip")]
backend_ops!(hip, gpu_or_skip(pagoda::backend::HipBackend::new()));

/// One wgpu device for the whole test binary (pipelines compile once); `WGPU_BACKEND=vulkan`
/// with Mesa's llvmpipe in CI.
#[cfg(feature = "wgpu")]
fn wgpu_backend(max_binding_bytes: Option<u64>) -> pagoda::backend::WgpuBackend {
    use pagoda::backend::wgpu::{WgpuBackend, WgpuOptions};
    use std::sync::OnceLock;
    static WHOLE: OnceLock<WgpuBackend> = OnceLock::new();
    static SPLIT: OnceLock<WgpuBackend> = OnceLock::new();
    let cell = if max_binding_bytes.is_some() {
        &SPLIT
    } else {
        &WHOLE
    };
    cell.get_or_init(|| {
        WgpuBackend::with_options(WgpuOptions {
            max_binding_bytes,
            disable_f16: max_binding_bytes.is_some(),
            // the GPU-tuned kernels on the split backend, whatever the adapter
            software_kernels: max_binding_bytes.map(|_| false),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("no wgpu adapter for the op tests: {e:#}"))
    })
    .clone()
}

#[cfg(feature = "wgpu")]
backend_ops!(wgpu, Some(wgpu_backend(None)));
// Storage bindings of 16 KiB: weights, the embedding table and the KV pool are split into parts
// and activations are bound in windows of rows, as on an adapter whose limits are small for the
// model; and no shader-f16, so f16 weights take the f32 fallback; and the kernels tuned for GPUs
// even on a software adapter (the other instance takes the adapter's choice).
#[cfg(feature = "wgpu")]
backend_ops!(wgpu_split, Some(wgpu_backend(Some(16 << 10))));
