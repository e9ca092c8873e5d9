//! Rotate-half RoPE tables (`[max_positions, head_dim / 2]` cos and sin, computed in f64), with
//! the scalings the families use: Llama 3's frequency bands and Phi-3's `longrope`.

use super::config::ModelConfig;

/// Inverse frequencies for base `theta`, with Llama 3's scaling when configured.
fn inv_freq(cfg: &ModelConfig, theta: f64) -> Vec<f64> {
    let d = cfg.head_dim;
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
    }
    (cos, sin)
}
