//! Rotate-half RoPE tables (`[max_positions, head_dim / 2]` cos and sin, computed in f64), with
//! the scalings the families use: Llama 3's frequency bands and Phi-3's `longrope`; and the
//! order of Q and K rows that makes partial and interleaved RoPE this same rotation.
//!
//! NOTE: the one RoPE op pairs dimensions (i, i + D/2) of a head. Partial RoPE (GPT-NeoX,
//! StableLM: the first `r` dimensions, paired (i, i + r/2)) and interleaved RoPE (GPT-J,
//! Cohere: pairs (2i, 2i + 1)) are that op after a fixed reordering of each Q and K head's
//! rows, done once on the weights ([`head_order`]), with cos 1 and sin 0 for the pairs of
//! dimensions that are not rotated. Q and K get the same order, so their dot products, and
//! the attention, are unchanged; V is not reordered.

use super::Weight;
use super::config::ModelConfig;
use crate::backend::{Alibi, AttentionOptions, Backend};
use anyhow::Result;

/// The rotated dimensions of a head.
fn rotary_dim(cfg: &ModelConfig) -> usize {
    cfg.rotary_dim.unwrap_or(cfg.head_dim)
}

/// Inverse frequencies of the rotated pairs for base `theta`, with Llama 3's scaling when
/// configured.
fn inv_freq(cfg: &ModelConfig, theta: f64) -> Vec<f64> {
    let d = rotary_dim(cfg);
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / theta.powf(2.0 * i as f64 / d as f64);
            match &cfg.rope_scaling {
                None => f,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f64;
                    let low_wavelen = old / s.low_freq_factor;
                    let high_wavelen = old / s.high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

/// cos and sin tables `[max_positions, head_dim / 2]` for base `theta`.
///
/// NOTE: with `longrope`, positions before `original_max_position_embeddings` use the short
/// factors and later ones the long factors (vLLM's choice: a token's rotation never changes once
/// its K is cached); transformers switches the whole sequence to the long factors once it is
/// longer, which agrees below the original length. Both scale cos and sin by the attention
/// factor.
pub fn tables(cfg: &ModelConfig, theta: f64, max_positions: usize) -> (Vec<f32>, Vec<f32>) {
    let base = inv_freq(cfg, theta);
    let (short, long, orig, mag) = match &cfg.longrope {
        Some(l) => {
            let f = |ext: &[f64]| base.iter().zip(ext).map(|(b, e)| b / e).collect::<Vec<_>>();
            (
                f(&l.short_factor),
                f(&l.long_factor),
                l.original_max_position_embeddings,
                l.attention_factor,
            )
        }
        None => (base.clone(), base, usize::MAX, 1.0),
    };
    let half = cfg.head_dim / 2;
    let mut cos = Vec::with_capacity(max_positions * half);
    let mut sin = Vec::with_capacity(max_positions * half);
    for p in 0..max_positions {
        let freqs = if p < orig { &short } else { &long };
        for &fq in freqs {
            let a = p as f64 * fq;
            cos.push((a.cos() * mag) as f32);
            sin.push((a.sin() * mag) as f32);
        }
        // the pairs past the rotated dimensions stay as they are
        for _ in freqs.len()..half {
            cos.push(1.0);
            sin.push(0.0);
        }
    }
    (cos, sin)
}

/// [`tables`] uploaded to `backend`: the cos and sin tables.
pub fn upload<B: Backend>(
    backend: &B,
    cfg: &ModelConfig,
    theta: f64,
    max_positions: usize,
) -> Result<(B::Buf, B::Buf)> {
    let (cos, sin) = tables(cfg, theta, max_positions);
    Ok((backend.upload_f32(&cos)?, backend.upload_f32(&sin)?))
}

/// How a family's attention sees positions: Q and K rotated by the cos and sin tables
/// (`[max_positions, D / 2]`), or ALiBi's bias on the scores.
pub enum Positions<B: Backend> {
    Rope(B::Buf, B::Buf),
    Alibi(Alibi),
}

impl<B: Backend> Positions<B> {
    /// ALiBi where `alibi` gives its maximum bias and slope scale (the slopes of the model's
    /// heads, this rank's from `first_head`), else RoPE at the model's base.
    pub fn load(
        backend: &B,
        cfg: &ModelConfig,
        first_head: usize,
        alibi: Option<(f64, f32)>,
        max_positions: usize,
    ) -> Result<Self> {
        Ok(match alibi {
            Some((max_bias, scale)) => Positions::Alibi(Alibi {
                num_heads: cfg.num_heads as u32,
                first_head: first_head as u32,
                max_bias: max_bias as f32,
                scale,
            }),
            None => {
                let (cos, sin) = upload(backend, cfg, cfg.rope_theta, max_positions)?;
                Positions::Rope(cos, sin)
            }
        })
    }

    /// The tables to rotate Q and K with, if any.
    pub fn rope(&self) -> Option<(&B::Buf, &B::Buf)> {
        match self {
            Positions::Rope(cos, sin) => Some((cos, sin)),
            Positions::Alibi(_) => None,
        }
    }

    /// `opts` with ALiBi's slopes, where there are.
    pub fn options(&self, opts: AttentionOptions) -> AttentionOptions {
        match self {
            Positions::Rope(..) => opts,
            Positions::Alibi(a) => AttentionOptions {
                alibi: Some(*a),
                ..opts
            },
        }
    }
}

/// For each row `j` of a Q or K head as the RoPE op reads it, the row of the checkpoint's head
/// it is taken from; `None` where the two agree (full rotate-half RoPE).
///
/// ```text
///   ours:   [ rotated x_i (i < r/2) | passed | rotated partners | passed ]   (halves of D/2)
///   NeoX:   x_i pairs with x_{i + r/2}, dimensions r.. are passed
///   GPT-J:  x_{2i} pairs with x_{2i + 1}, dimensions r.. are passed
/// ```
pub fn head_order(cfg: &ModelConfig) -> Option<Vec<usize>> {
    let (d, r) = (cfg.head_dim, rotary_dim(cfg));
    if r == d && !cfg.rope_interleaved {
        return None;
    }
    let (half, rh) = (d / 2, r / 2);
    // the passed dimensions r.. fill the two halves' ends, first half first
    let first_pass = half - rh;
    Some(
        (0..d)
            .map(|j| match (j < half, j % half < rh) {
                (true, true) if cfg.rope_interleaved => 2 * j,
                (true, true) => j,
                (false, true) if cfg.rope_interleaved => 2 * (j - half) + 1,
                (false, true) => rh + (j - half),
                (true, false) => r + (j - rh),
                (false, false) => r + first_pass + (j - half - rh),
            })
            .collect(),
    )
}

/// `w` (rows `[heads · D, ..]`: a Q or K projection, its bias or its per-head norm) with each
/// head's rows in [`head_order`].
pub fn reorder_heads(w: Weight, heads: usize, cfg: &ModelConfig) -> Result<Weight> {
    let Some(order) = head_order(cfg) else {
        return Ok(w);
    };
    let d = cfg.head_dim;
    let rows: Vec<usize> = (0..heads)
        .flat_map(|h| order.iter().map(move |&j| h * d + j))
        .collect();
    w.permute_rows(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(d: usize, r: usize, interleaved: bool) -> ModelConfig {
        let mut c = crate::models::registry::hf_config(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 64 / d, "vocab_size": 16,
        }))
        .unwrap();
        c.rotary_dim = (r != d).then_some(r);
        c.rope_interleaved = interleaved;
        c
    }

    /// The reference rotations, written as transformers writes them, against the reordered
    /// rows through rotate-half tables.
    #[test]
    fn reordered_rotate_half_is_partial_and_interleaved_rope() {
        for (d, r, inter) in [
            (16, 4, false),
            (16, 8, false),
            (16, 16, true),
            (16, 8, true),
        ] {
            let c = cfg(d, r, inter);
            let order = head_order(&c).unwrap();
            let mut seen = order.clone();
            seen.sort();
            assert_eq!(seen, (0..d).collect::<Vec<_>>(), "a permutation");
            let (cos, sin) = tables(&c, 10000.0, 8);
            let x: Vec<f64> = (0..d).map(|i| ((i * 7 + 3) % 11) as f64 - 5.0).collect();
            for p in 0..8 {
                // reference: rotate dims < r, pairs by the family's convention
                let mut want = x.clone();
                for i in 0..r / 2 {
                    let a = p as f64 / 10000f64.powf(2.0 * i as f64 / r as f64);
                    let (i0, i1) = if inter {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + r / 2)
                    };
                    want[i0] = x[i0] * a.cos() - x[i1] * a.sin();
                    want[i1] = x[i1] * a.cos() + x[i0] * a.sin();
                }
                // ours: reorder, rotate half with the tables
                let y: Vec<f64> = order.iter().map(|&s| x[s]).collect();
                let mut got = vec![0.0; d];
                for i in 0..d / 2 {
                    let (c, s) = (cos[p * d / 2 + i] as f64, sin[p * d / 2 + i] as f64);
                    got[order[i]] = y[i] * c - y[i + d / 2] * s;
                    got[order[i + d / 2]] = y[i + d / 2] * c + y[i] * s;
                }
                for i in 0..d {
                    assert!(
                        (got[i] - want[i]).abs() < 1e-5,
                        "d {d} r {r} {inter} p {p} i {i}"
                    );
                }
            }
        }
    }
}
