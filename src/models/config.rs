//! Model hyper-parameters, read from an HF `config.json` or from GGUF metadata.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

pub use super::registry::Arch;

/// Llama 3's RoPE frequency scaling (`rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// Every layer attends to its last `sliding_window` keys only (Mistral).
    pub sliding_window: Option<usize>,
    /// Q and K heads are RMS-normalised before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    /// Every token id that ends generation (`eos_token_id` may be a list in HF configs).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Checks the relations between hyper-parameters that the model code relies on.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.hidden_size == 0 || c.num_layers == 0 || c.num_heads == 0 || c.num_kv_heads == 0 {
            bail!("config has a zero size: {c:?}");
        }
        if !c.num_heads.is_multiple_of(c.num_kv_heads) {
            bail!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                c.num_heads,
                c.num_kv_heads
            );
        }
        if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
            bail!("head_dim must be even and non-zero, got {}", c.head_dim);
        }
        if c.vocab_size == 0 || c.intermediate_size == 0 {
            bail!("vocab_size and intermediate_size must be non-zero");
        }
        if c.sliding_window == Some(0) {
            bail!("sliding_window must be positive");
        }
        Ok(())
    }

    /// Reads an HF `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_hf_value(&v).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_hf_value(v: &Value) -> Result<Self> {
        let family = match v["model_type"].as_str() {
            None | Some("") => bail!("config.json has no model_type"),
            Some(t) => super::registry::by_hf_model_type(t)?,
        };
        let req = |k: &str| -> Result<usize> {
            v[k].as_u64()
                .map(|x| x as usize)
                .with_context(|| format!("config.json lacks the integer '{k}'"))
        };
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads = v["num_key_value_heads"]
            .as_u64()
            .map(|x| x as usize)
            .unwrap_or(num_heads);
        let head_dim = match v["head_dim"].as_u64() {
            Some(d) => d as usize,
            None => hidden_size / num_heads.max(1),
        };
        // NOTE: transformers 5 writes `rope_parameters` (rope_theta and the scaling together)
        // where earlier versions wrote `rope_theta` and `rope_scaling`; both are read.
        let rope_params = &v["rope_parameters"];
        let scaling = match (&v["rope_scaling"], rope_params) {
            (Value::Null, p) if p.is_object() => p,
            (s, _) => s,
        };
        let rope_scaling = match scaling {
            Value::Null => None,
            s => {
                let ty = s["rope_type"]
                    .as_str()
                    .or(s["type"].as_str())
                    .unwrap_or_default();
                match ty {
                    "llama3" => Some(Llama3RopeScaling {
                        factor: s["factor"].as_f64().context("rope_scaling.factor")?,
                        low_freq_factor: s["low_freq_factor"].as_f64().unwrap_or(1.0),
                        high_freq_factor: s["high_freq_factor"].as_f64().unwrap_or(4.0),
                        original_max_position_embeddings: s["original_max_position_embeddings"]
                            .as_u64()
                            .unwrap_or(8192)
                            as usize,
                    }),
                    "default" | "" => None,
                    other => bail!("rope_scaling of type '{other}' is not supported (only llama3)"),
                }
            }
        };
        let eos_token_ids = match &v["eos_token_id"] {
            Value::Number(n) => vec![n.as_u64().unwrap_or(0) as u32],
            Value::Array(a) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => vec![],
        };
        let mut c = ModelConfig {
            arch: family.arch,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_layers: req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: req("vocab_size")?,
            max_position_embeddings: v["max_position_embeddings"].as_u64().unwrap_or(4096) as usize,
            rms_norm_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            rope_theta: v["rope_theta"]
                .as_f64()
                .or(rope_params["rope_theta"].as_f64())
                .unwrap_or(10000.0),
            rope_scaling,
            tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
            attention_bias: v["attention_bias"].as_bool().unwrap_or(false),
            sliding_window: None,
            qk_norm: false,
            bos_token_id: v["bos_token_id"].as_u64().map(|x| x as u32),
            eos_token_ids,
        };
        (family.hf_config)(v, &mut c)?;
        c.validate()?;
        Ok(c)
    }
}
