//! Model hyper-parameters, read from an HF `config.json` or from GGUF metadata.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

pub use super::registry::Arch;
use crate::backend::Activation;

/// Phi-3's `longrope` (`su`) RoPE scaling: per-frequency factors for short and long contexts,
/// and the cos/sin magnitude factor.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    pub short_factor: Vec<f64>,
    pub long_factor: Vec<f64>,
    pub original_max_position_embeddings: usize,
    /// Multiplies cos and sin: `sqrt(1 + ln(scale) / ln(original))` with
    /// `scale = max_position_embeddings / original`, or the config's `attention_factor`.
    pub attention_factor: f64,
}

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
    /// Q and K heads are RMS-normalised before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Which layers use `sliding_window` (Gemma 3's local layers); empty: all of them.
    pub sliding_layers: Vec<bool>,
    /// The RoPE base of the sliding-window layers, where it differs (Gemma 3).
    pub rope_theta_local: Option<f64>,
    pub longrope: Option<LongRope>,
    /// The MLP's activation.
    pub hidden_act: Activation,
    /// Attention scale; `None`: `1 / sqrt(head_dim)`.
    pub attn_scale: Option<f64>,
    /// Attention scores and final logits soft-capped as `cap · tanh(x / cap)` (Gemma).
    pub attn_logit_softcap: Option<f64>,
    pub final_logit_softcap: Option<f64>,
    /// Settings only one family has, recorded by its config hook and read by its model (so a
    /// new family needs no new field here).
    pub extra: Value,
    pub bos_token_id: Option<u32>,
    /// Every token id that ends generation (`eos_token_id` may be a list in HF configs).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// The sliding window of layer `l`, if it has one.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        match self.sliding_layers.get(l) {
            Some(false) => None,
            _ => self.sliding_window,
        }
    }

    /// What layer `l` asks of attention: the scale, its window, the soft-cap.
    pub fn attention_options(&self, l: usize) -> crate::backend::AttentionOptions {
        crate::backend::AttentionOptions {
            scale: self.attention_scale(),
            sliding_window: self.layer_window(l),
            logit_softcap: self.attn_logit_softcap.map(|x| x as f32),
        }
    }

    /// The layout of the fused QKV rows.
    pub fn qkv_layout(&self) -> crate::backend::QkvLayout {
        crate::backend::QkvLayout {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// The attention scale.
    pub fn attention_scale(&self) -> f32 {
        self.attn_scale
            .unwrap_or(1.0 / (self.head_dim as f64).sqrt()) as f32
    }

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
        if !c.sliding_layers.is_empty() && c.sliding_layers.len() != c.num_layers {
            bail!(
                "{} layer types for {} layers",
                c.sliding_layers.len(),
                c.num_layers
            );
        }
        for cap in [c.attn_logit_softcap, c.final_logit_softcap]
            .into_iter()
            .flatten()
        {
            if !(cap > 0.0 && cap.is_finite()) {
                bail!("a logit soft-cap must be positive, got {cap}");
            }
        }
        Ok(())
    }

    /// Reads an HF `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        super::loader::regular_file(path)?;
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
        let mut v = v.clone();
        (family.hf_prepare)(&mut v)?;
        let v = &v;
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
                    "default" | "" | "longrope" | "su" => None,
                    other => bail!(
                        "rope_scaling of type '{}' is not supported (llama3, longrope)",
                        crate::untrusted::text(other)
                    ),
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
            sliding_layers: Vec::new(),
            rope_theta_local: None,
            longrope: None,
            hidden_act: match v["hidden_act"].as_str().or(v["hidden_activation"].as_str()) {
                Some(a) => Activation::from_hf(a)?,
                None => Activation::Silu,
            },
            attn_scale: None,
            attn_logit_softcap: None,
            final_logit_softcap: None,
            extra: Value::Null,
            bos_token_id: v["bos_token_id"].as_u64().map(|x| x as u32),
            eos_token_ids,
        };
        c.longrope = longrope(v, scaling, head_dim)?;
        (family.hf_config)(v, &mut c)?;
        c.validate()?;
        Ok(c)
    }
}

/// Phi-3's `longrope` (or `su`) scaling, when `scaling` says so.
fn longrope(v: &Value, scaling: &Value, head_dim: usize) -> Result<Option<LongRope>> {
    let ty = scaling["rope_type"]
        .as_str()
        .or(scaling["type"].as_str())
        .unwrap_or_default();
    if ty != "longrope" && ty != "su" {
        return Ok(None);
    }
    if let Some(p) = scaling["partial_rotary_factor"]
        .as_f64()
        .or(v["partial_rotary_factor"].as_f64())
        && p != 1.0
    {
        bail!("partial_rotary_factor {p} is not supported (only 1.0)");
    }
    let factors = |k: &str| -> Result<Vec<f64>> {
        let a = scaling[k]
            .as_array()
            .with_context(|| format!("rope_scaling.{k} is missing"))?;
        let f: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
        if f.len() != head_dim / 2 || f.len() != a.len() {
            bail!(
                "rope_scaling.{k} has {} numbers, expected head_dim / 2 = {}",
                a.len(),
                head_dim / 2
            );
        }
        Ok(f)
    };
    let original = scaling["original_max_position_embeddings"]
        .as_u64()
        .or(v["original_max_position_embeddings"].as_u64())
        .context("longrope needs original_max_position_embeddings")? as usize;
    let max = v["max_position_embeddings"]
        .as_u64()
        .context("longrope needs max_position_embeddings")? as usize;
    let scale = max as f64 / original as f64;
    let attention_factor = match scaling["attention_factor"].as_f64() {
        Some(a) => a,
        None if scale <= 1.0 => 1.0,
        None => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(Some(LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    }))
}
