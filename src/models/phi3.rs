//! Phi-3 (`phi3`): the Llama graph with the Q, K and V projections stored fused (`qkv_proj`)
//! and the gate and up projections too (`gate_up_proj`), in the order the Llama model stacks
//! them; `longrope` (`su`) RoPE scaling for the 128k variants (read with the common config);
//! a sliding window over every layer where the config sets one.

use super::config::ModelConfig;
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
