//! Phi-3 (`phi3`): the Llama graph with the Q, K and V projections stored fused (`qkv_proj`)
//! and the gate and up projections too (`gate_up_proj`), in the order the Llama model stacks
//! them; `longrope` (`su`) RoPE scaling for the 128k variants (read with the common config);
//! a sliding window over every layer where the config sets one.

use super::config::ModelConfig;
use super::gguf::{GgufFile, GgufTensorName, map_name};
use anyhow::{Result, bail};
use serde_json::Value;

pub fn hf_config(v: &Value, c: &mut ModelConfig) -> Result<()> {
    c.sliding_window = match &v["sliding_window"] {
        Value::Null => None,
        w => match w.as_u64() {
            Some(w) if w > 0 => Some(w as usize),
            _ => bail!("sliding_window must be a positive integer or null, found {w}"),
        },
    };
    Ok(())
}

/// llama.cpp's `phi3` files: the fused tensors are `attn_qkv` and `ffn_up` (gate and up).
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    super::llama::gguf_config(g, arch, c)?;
    if g.tensor_info("rope_factors_long.weight").is_some() {
        bail!("Phi-3 with longrope from a GGUF file is not supported yet (its HF directory is)");
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
