//! Phi-3 (`phi3`): the Llama graph with the Q, K and V projections stored fused (`qkv_proj`)
//! and the gate and up projections too (`gate_up_proj`), in the order the Llama model stacks
//! them; `longrope` (`su`) RoPE scaling for the 128k variants (read with the common config);
//! a sliding window over every layer where the config sets one.

use super::config::ModelConfig;
use super::gguf::{GgufFile, GgufTensorName, map_name};
use anyhow::{Context, Result, bail};
use serde_json::Value;

pub fn hf_config(v: &Value, c: &mut ModelConfig) -> Result<()> {
    c.sliding_window = super::llama::hf_sliding_window(v)?;
    Ok(())
}

/// llama.cpp's `phi3` files: the fused tensors are `attn_qkv` and `ffn_up` (gate and up).
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    super::llama::gguf_config(g, arch, c)?;
    // longrope (the 128k variants): the factors as tensors, the original context and the
    // attention factor as keys
    let factors = |name: &str| -> Result<Option<Vec<f64>>> {
        let Some(f) = g.gguf_tensor_f32(name)? else {
            return Ok(None);
        };
        if f.len() != c.head_dim / 2 {
            bail!(
                "{name} has {} factors, expected head_dim / 2 = {}",
                f.len(),
                c.head_dim / 2
            );
        }
        Ok(Some(f.into_iter().map(f64::from).collect()))
    };
    match (
        factors("rope_factors_short.weight")?,
        factors("rope_factors_long.weight")?,
    ) {
        (None, None) => {}
        (Some(short_factor), Some(long_factor)) => {
            let key = format!("{arch}.rope.scaling.original_context_length");
            let original = g
                .meta_usize(&key)?
                .with_context(|| format!("longrope needs the integer metadata '{key}'"))?;
            let scale = c.max_position_embeddings as f64 / original as f64;
            let attention_factor = match g.meta_f64(&format!("{arch}.rope.scaling.attn_factor"))? {
                Some(a) => a,
                None if scale <= 1.0 => 1.0,
                None => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
            };
            c.longrope = Some(super::config::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings: original,
                attention_factor,
            });
        }
        _ => bail!("longrope needs both rope_factors_short.weight and rope_factors_long.weight"),
    }
    Ok(())
}

pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    map_name(
        hf,
        &[
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ],
        "model.layers.",
        &[
            ("input_layernorm", "attn_norm", None),
            ("post_attention_layernorm", "ffn_norm", None),
            ("self_attn.qkv_proj", "attn_qkv", None),
            ("self_attn.o_proj", "attn_output", None),
            ("mlp.gate_up_proj", "ffn_up", None),
            ("mlp.down_proj", "ffn_down", None),
        ],
    )
}
