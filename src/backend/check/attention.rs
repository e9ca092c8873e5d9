//! `paged_attention` over block tables: decode, prefill chunks after a cached prefix, mixed
//! batches, sliding windows, soft caps, every KV type, with the cache written by `write_kv`.

use super::util::{rand_vec, rounded};
use crate::backend::{
    Alibi, AttentionOptions, Backend, BatchInput, DeviceBatch, KvLayout, QkvLayout,
};
use crate::tensor::DType;
use anyhow::Result;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

pub(super) struct Attention {
    pub(super) layout: QkvLayout,
    pub(super) kv: KvLayout,
    pub(super) prefix_rows: Vec<f32>,
    pub(super) prefix_slots: Vec<u32>,
    pub(super) qkv: Vec<f32>,
    pub(super) batch: BatchInput,
    pub(super) opts: AttentionOptions,
}

impl Attention {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Attention {
            layout,
            kv,
            prefix_rows,
            prefix_slots,
            qkv,
            batch,
            opts,
        } = self;
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
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Attention {
            layout,
            kv,
            prefix_rows,
            prefix_slots,
            qkv,
            batch,
            opts,
        } = self;
        attention_reference(layout, kv, prefix_rows, prefix_slots, qkv, batch, opts)
    }
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
/// ALiBi's slope of this rank's head `hq`, as BLOOM's `build_alibi_tensor` writes it: the
/// powers 1, 2, .. of `2^(−b/p)` for the first `p` heads (`p` the largest power of two not
/// above the heads), then the odd powers 1, 3, .. of `2^(−b/(2p))`.
fn alibi_slope(a: &Alibi, hq: usize) -> f64 {
    let n = a.num_heads as usize;
    let p = (0..)
        .map(|i| 1usize << i)
        .take_while(|&x| x <= n)
        .last()
        .unwrap();
    let b = a.max_bias as f64;
    let mut slopes: Vec<f64> = (1..=p)
        .map(|i| (2f64).powf(-b / p as f64).powi(i as i32))
        .collect();
    let extra = (2f64).powf(-b / (2 * p) as f64);
    slopes.extend((0..n - p).map(|i| extra.powi(2 * i as i32 + 1)));
    slopes[a.first_head as usize + hq] * a.scale as f64
}

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
                        let sc = match opts.logit_softcap {
                            Some(cap) => cap as f64 * (sc / cap as f64).tanh(),
                            None => sc,
                        };
                        match &opts.alibi {
                            Some(a) => sc + alibi_slope(a, hq) * (j as f64 - p as f64),
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
) -> Attention {
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
    Attention {
        layout,
        kv,
        prefix_rows,
        prefix_slots,
        qkv,
        batch,
        opts,
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<Attention>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
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
        // fp8 rows of 24 bytes: every other key's row starts 8 bytes past a 16-byte boundary
        (
            ("d=24, mixed", 8, 4, 2, 24, &[(9, 14), (30, 1)]),
            None,
            None,
            DType::F8E4M3,
        ),
    ];
    // ALiBi: heads that are not a power of two (slopes past it), a rank's heads of a split
    // model (its first head 4 of 12), Falcon's scaled slopes, with a window, decode splits
    // and prefill on tensor cores
    let alibi = |num_heads, first_head, scale| Alibi {
        num_heads,
        first_head,
        max_bias: 8.0,
        scale,
    };
    let alibi_cases: &[(AttnCase, Option<usize>, DType, Alibi)] = &[
        (
            ("alibi, mixed", 16, 6, 6, 32, &[(0, 20), (30, 1), (7, 4)]),
            None,
            DType::F32,
            alibi(6, 0, 1.0),
        ),
        (
            (
                "alibi rank 2 of 3, decode",
                16,
                4,
                1,
                64,
                &[(900, 1), (3, 1)],
            ),
            None,
            DType::F32,
            alibi(12, 4, 0.125),
        ),
        (
            ("alibi, window 9", 8, 8, 8, 16, &[(0, 30), (40, 1)]),
            Some(9),
            DType::F32,
            alibi(8, 0, 1.0),
        ),
        (
            ("alibi, prefill", 16, 12, 4, 64, &[(5, 70), (0, 33)]),
            None,
            DType::F16,
            alibi(12, 0, 1.0),
        ),
    ];
    for &(c, window, dtype, a) in alibi_cases {
        let (name, bs, h, hkv, d, seqs) = c;
        let layout = QkvLayout {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        };
        let opts = AttentionOptions {
            sliding_window: window,
            alibi: Some(a),
            ..AttentionOptions::new(1.0 / (d as f32).sqrt())
        };
        out.push((
            "write_kv+attention".into(),
            format!("{} KV, {name}: bs={bs} h={h} hkv={hkv} d={d}", dtype.name()),
            attention_tolerance(dtype, seqs),
            C::from(attention_case(r, layout, bs, seqs, opts, dtype)),
        ));
    }
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
            alibi: None,
        };
        let kv = match dtype {
            DType::F32 => String::new(),
            t => format!("{} KV, ", t.name()),
        };
        out.push((
            "write_kv+attention".into(),
            format!("{kv}{name}: bs={bs} h={h} hkv={hkv} d={d}"),
            attention_tolerance(dtype, seqs),
            C::from(attention_case(r, layout, bs, seqs, opts, dtype)),
        ));
    }
}
