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
        for (key, id) in c
            .bos_token_id
            .iter()
            .map(|&t| ("bos_token_id", t))
            .chain(c.eos_token_ids.iter().map(|&t| ("eos_token_id", t)))
        {
            if id as usize >= c.vocab_size {
                bail!(
                    "{key} {id} is not a token: the vocabulary has {} (vocab_size)",
                    c.vocab_size
                );
            }
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
        let family = match Fields::top(v).str("model_type")? {
            None | Some("") => bail!("config.json has no model_type"),
            Some(t) => super::registry::by_hf_model_type(t)?,
        };
        let mut v = v.clone();
        (family.hf_prepare)(&mut v)?;
        let f = Fields::top(&v);
        let hidden_size = f.req_usize("hidden_size")?;
        let num_heads = f.req_usize("num_attention_heads")?;
        let num_kv_heads = f.usize("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match f.usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_heads.max(1),
        };
        // NOTE: transformers 5 writes `rope_parameters` (rope_theta and the scaling together)
        // where earlier versions wrote `rope_theta` and `rope_scaling`; both are read.
        let rope_params = f.object("rope_parameters")?;
        let scaling = match f.object("rope_scaling")? {
            None => rope_params.clone(),
            s => s,
        };
        let rope_type = match &scaling {
            None => None,
            Some(s) => Some(match s.str("rope_type")? {
                Some(t) => t,
                None => s.str("type")?.unwrap_or_default(),
            }),
        };
        let rope_scaling = match (&scaling, rope_type) {
            (Some(s), Some("llama3")) => Some(Llama3RopeScaling {
                factor: s.f64("factor")?.context("rope_scaling.factor is missing")?,
                low_freq_factor: s.f64("low_freq_factor")?.unwrap_or(1.0),
                high_freq_factor: s.f64("high_freq_factor")?.unwrap_or(4.0),
                original_max_position_embeddings: s
                    .usize("original_max_position_embeddings")?
                    .unwrap_or(8192),
            }),
            (_, None | Some("default" | "" | "longrope" | "su")) => None,
            (_, Some(other)) => bail!(
                "rope_scaling of type '{}' is not supported (llama3, longrope)",
                crate::untrusted::text(other)
            ),
        };
        let max_position_embeddings = f.usize("max_position_embeddings")?;
        let mut c = ModelConfig {
            arch: family.arch,
            hidden_size,
            intermediate_size: f.req_usize("intermediate_size")?,
            num_layers: f.req_usize("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: f.req_usize("vocab_size")?,
            max_position_embeddings: max_position_embeddings.unwrap_or(4096),
            rms_norm_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: match f.f64("rope_theta")? {
                Some(t) => t,
                None => match &rope_params {
                    Some(p) => p.f64("rope_theta")?.unwrap_or(10000.0),
                    None => 10000.0,
                },
            },
            rope_scaling,
            tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: f.bool("attention_bias")?.unwrap_or(false),
            sliding_window: None,
            qk_norm: false,
            sliding_layers: Vec::new(),
            rope_theta_local: None,
            longrope: None,
            hidden_act: match f.str("hidden_act")? {
                Some(a) => Activation::from_hf(a)?,
                None => match f.str("hidden_activation")? {
                    Some(a) => Activation::from_hf(a)?,
                    None => Activation::Silu,
                },
            },
            attn_scale: None,
            attn_logit_softcap: None,
            final_logit_softcap: None,
            extra: Value::Null,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
        };
        if let (Some(s), Some("longrope" | "su")) = (&scaling, rope_type) {
            c.longrope = Some(longrope(&f, s, head_dim, max_position_embeddings)?);
        }
        (family.hf_config)(&v, &mut c)?;
        c.validate()?;
        Ok(c)
    }
}

/// Typed reads of the fields of a `config.json` object. An absent or null field is `None` (the
/// caller's default); a field that is present with a value of the wrong type is an error that
/// names the key and the value, never silently the default.
#[derive(Clone)]
pub struct Fields<'a> {
    v: &'a Value,
    /// The object's key in its parent with a dot (`rope_scaling.`), or "" for the top level.
    prefix: String,
}

impl<'a> Fields<'a> {
    /// The top-level object.
    pub fn top(v: &'a Value) -> Self {
        Fields {
            v,
            prefix: String::new(),
        }
    }

    /// The raw value of `key` (`Null` when absent).
    pub fn get(&self, key: &str) -> &'a Value {
        &self.v[key]
    }

    fn wrong(&self, key: &str, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "'{}{key}' must be {what}, found {}",
            self.prefix,
            crate::untrusted::json(&self.v[key])
        )
    }

    /// A non-negative integer (a float with no fraction, as Python may write one, too).
    pub fn u64(&self, key: &str) -> Result<Option<u64>> {
        let x = &self.v[key];
        if x.is_null() {
            return Ok(None);
        }
        let n = x.as_u64().or_else(|| {
            x.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 9007199254740992.0)
                .map(|f| f as u64)
        });
        n.map(Some)
            .ok_or_else(|| self.wrong(key, "a non-negative integer"))
    }

    pub fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.u64(key)? {
            None => Ok(None),
            Some(n) => usize::try_from(n)
                .map(Some)
                .map_err(|_| self.wrong(key, "a smaller integer")),
        }
    }

    /// A non-negative integer that must be there.
    pub fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?
            .with_context(|| format!("config.json lacks the integer '{}{key}'", self.prefix))
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>> {
        let x = &self.v[key];
        if x.is_null() {
            return Ok(None);
        }
        x.as_f64()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a number"))
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        let x = &self.v[key];
        if x.is_null() {
            return Ok(None);
        }
        x.as_bool()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "true or false"))
    }

    pub fn str(&self, key: &str) -> Result<Option<&'a str>> {
        let x = &self.v[key];
        if x.is_null() {
            return Ok(None);
        }
        x.as_str()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a string"))
    }

    /// A list of numbers.
    pub fn f64s(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let x = &self.v[key];
        if x.is_null() {
            return Ok(None);
        }
        x.as_array()
            .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>())
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a list of numbers"))
    }

    /// A nested object, whose fields are named `key.field` in messages.
    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        let x = &self.v[key];
        match x {
            Value::Null => Ok(None),
            Value::Object(_) => Ok(Some(Fields {
                v: x,
                prefix: format!("{}{key}.", self.prefix),
            })),
            _ => Err(self.wrong(key, "an object")),
        }
    }

    /// Token ids: one integer or a list of them (`eos_token_id`), each of which must fit a u32.
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let x = &self.v[key];
        let one = |t: &Value| -> Result<u32> {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    self.wrong(
                        key,
                        "a token id (an integer from 0 to 2^32 - 1) or a list of them",
                    )
                })
        };
        match x {
            Value::Null => Ok(vec![]),
            Value::Array(a) => a.iter().map(one).collect(),
            t => Ok(vec![one(t)?]),
        }
    }
}

/// Phi-3's `longrope` (or `su`) scaling, from the `scaling` object `s`.
fn longrope(
    f: &Fields,
    s: &Fields,
    head_dim: usize,
    max_position_embeddings: Option<usize>,
) -> Result<LongRope> {
    let partial = match s.f64("partial_rotary_factor")? {
        Some(p) => Some(p),
        None => f.f64("partial_rotary_factor")?,
    };
    if let Some(p) = partial
        && p != 1.0
    {
        bail!("partial_rotary_factor {p} is not supported (only 1.0)");
    }
    let factors = |k: &str| -> Result<Vec<f64>> {
        let v = s
            .f64s(k)?
            .with_context(|| format!("rope_scaling.{k} is missing"))?;
        if v.len() != head_dim / 2 {
            bail!(
                "rope_scaling.{k} has {} numbers, expected head_dim / 2 = {}",
                v.len(),
                head_dim / 2
            );
        }
        Ok(v)
    };
    let original = match s.usize("original_max_position_embeddings")? {
        Some(o) => o,
        None => f
            .usize("original_max_position_embeddings")?
            .context("longrope needs original_max_position_embeddings")?,
    };
    let max = max_position_embeddings.context("longrope needs max_position_embeddings")?;
    let scale = max as f64 / original as f64;
    let attention_factor = match s.f64("attention_factor")? {
        Some(a) => a,
        None if scale <= 1.0 => 1.0,
        None => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}
