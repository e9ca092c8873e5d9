//! Model hyper-parameters, read from an HF `config.json` or from GGUF metadata.

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::backend::Activation;

/// The largest context (`max_position_embeddings`, `--max-model-len`) a config may have.
pub const MAX_CONTEXT: usize = 1 << 24;

/// The largest value of each size a config may have.
///
/// NOTE: far beyond every released model (today's largest: 126 layers, 128 heads, head_dim
/// 256, hidden 25600, FFN 53248, vocab 262144, context 10M for Llama 4 Scout), they exist to
/// turn a corrupt size into an error before anything is sized from it: a block_count of 2^40
/// made `Vec::with_capacity` panic, a context of 2^31 aborted building the RoPE tables. Within
/// them every product the engine forms fits a u64 with room to spare (the largest weight,
/// vocab × hidden, is 2^44 elements; KV bytes per token × context is under 2^60), positions
/// and token ids fit a u32, and both are exact in an f32 (2^24).
pub const LIMITS: &[(&str, usize)] = &[
    ("num_hidden_layers", 1024),
    ("num_attention_heads", 1024),
    ("num_key_value_heads", 1024),
    ("head_dim", 1024),
    ("hidden_size", 1 << 20),
    ("intermediate_size", 1 << 20),
    ("vocab_size", 1 << 24),
    ("max_position_embeddings", MAX_CONTEXT),
];

/// The largest value [`LIMITS`] allows the size `name`.
fn limit(name: &str) -> usize {
    LIMITS
        .iter()
        .find(|(k, _)| *k == name)
        .map(|l| l.1)
        .expect("every size has a limit")
}

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

/// A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks `top_k` of
/// `num_experts` gated MLPs for each token, whose outputs are summed with the routing weights.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// The experts each token is routed to.
    pub top_k: usize,
    /// Each expert's MLP size (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub expert_ffn: usize,
    /// The top-k routing weights are renormalised to sum to 1 (else they are the softmax over
    /// all experts, taken as they are).
    pub norm_topk_prob: bool,
    /// A shared expert every token goes through, its output scaled by `sigmoid(x · w)` (Qwen2-
    /// MoE): its MLP size.
    pub shared_expert_ffn: Option<usize>,
    /// Per layer, whether its MLP is dense (of `intermediate_size`): Qwen's `mlp_only_layers`
    /// and `decoder_sparse_step`.
    pub dense_layers: Vec<bool>,
}

/// The most experts a config may have (DeepSeek-V3 and Qwen3.5 have 256, Llama 4 Maverick 128).
pub const MAX_EXPERTS: usize = 1024;

impl MoeConfig {
    /// Whether layer `l` routes to experts (else its MLP is dense).
    pub fn sparse(&self, l: usize) -> bool {
        !self.dense_layers.get(l).copied().unwrap_or(false)
    }

    /// Checks the sizes: at least one expert, `top_k` of them at most, an MLP of each.
    pub fn validate(&self, num_layers: usize) -> Result<()> {
        let max_ffn = limit("intermediate_size");
        if self.num_experts == 0 || self.num_experts > MAX_EXPERTS {
            bail!(
                "the number of experts must be between 1 and {MAX_EXPERTS}, got {}",
                self.num_experts
            );
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            bail!(
                "num_experts_per_tok must be between 1 and the number of experts ({}), got {}",
                self.num_experts,
                self.top_k
            );
        }
        for (name, f) in [
            ("the experts' intermediate size", Some(self.expert_ffn)),
            ("shared_expert_intermediate_size", self.shared_expert_ffn),
        ] {
            if let Some(f) = f
                && (f == 0 || f > max_ffn)
            {
                bail!("{name} must be between 1 and {max_ffn}, got {f}");
            }
        }
        if self.dense_layers.len() != num_layers {
            bail!(
                "{} dense-layer flags for {num_layers} layers",
                self.dense_layers.len()
            );
        }
        Ok(())
    }
}

/// The decoder families this engine can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2.
    Llama,
    /// Mistral: Llama with sliding-window attention.
    Mistral,
    /// Qwen2 / Qwen2.5: Llama with QKV biases.
    Qwen2,
    /// Qwen3: Llama with per-head RMSNorm of Q and K before RoPE.
    Qwen3,
    /// Phi-3: Llama with fused projections and longrope.
    Phi3,
    /// Gemma 3: local and global layers, four norms per layer, GeGLU.
    Gemma3,
    /// GPT-2: learned positions, LayerNorm, a plain GELU MLP, biases everywhere.
    Gpt2,
    /// Falcon: attention and MLP in parallel off LayerNorm, multi-query or grouped KV.
    Falcon,
    /// Granite: Llama with multipliers on the embeddings, the residual branches, the attention
    /// scores and the logits.
    Granite,
    /// GPT-BigCode (StarCoder): GPT-2 with multi-query attention and `Linear` weights.
    GptBigCode,
    /// GPT-J: attention and MLP in parallel off one LayerNorm, interleaved partial RoPE, an
    /// output head with a bias.
    GptJ,
    /// OLMo 2: norms after attention and MLP, RMSNorm of all of Q and of K.
    Olmo2,
    /// BLOOM: ALiBi, a LayerNorm on the embeddings, fused per-head QKV, biases.
    Bloom,
    /// MPT: ALiBi, LayerNorm without bias, no biases.
    Mpt,
    /// GPT-NeoX (Pythia): fused per-head QKV, partial rotary, parallel residual with two norms.
    GptNeoX,
    /// StableLM: LayerNorm, partial rotary, a gated MLP, parallel or sequential residual.
    StableLm,
    /// StarCoder2: LayerNorm, biases everywhere, a GELU MLP, a sliding window.
    Starcoder2,
    /// Cohere (Command-R): one LayerNorm without bias feeding attention and MLP in parallel,
    /// interleaved RoPE, scaled logits.
    Cohere,
    /// Mixtral: Mistral with a mixture of experts in every layer.
    Mixtral,
    /// Qwen2-MoE: Qwen2 with experts and a gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: Qwen3 with experts.
    Qwen3Moe,
    /// OLMoE: experts, RMSNorm of all of Q and of K.
    Olmoe,
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
    /// RoPE rotates the first `rotary_dim` dimensions of each head only (GPT-NeoX, StableLM);
    /// `None`: all of them.
    pub rotary_dim: Option<usize>,
    /// RoPE pairs dimensions (2i, 2i + 1) (GPT-J, Cohere) rather than (i, i + rotary_dim / 2).
    pub rope_interleaved: bool,
    /// The MLP's activation.
    pub hidden_act: Activation,
    /// Attention scale; `None`: `1 / sqrt(head_dim)`.
    pub attn_scale: Option<f64>,
    /// Attention scores and final logits soft-capped as `cap · tanh(x / cap)` (Gemma).
    pub attn_logit_softcap: Option<f64>,
    pub final_logit_softcap: Option<f64>,
    /// The LM head's logits are multiplied by this (Granite's `1 / logits_scaling`).
    pub logit_scale: Option<f64>,
    /// The mixture of experts that replaces the MLP, if the model has one.
    pub moe: Option<MoeConfig>,
    /// Settings only one family has, recorded by its config hook and read by its model (so a
    /// new family needs no new field here).
    pub extra: Value,
    pub bos_token_id: Option<u32>,
    /// Every token id that ends generation (`eos_token_id` may be a list in HF configs).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// The sizes that tensor and pipeline parallelism split.
    pub fn dims(&self) -> crate::parallel::Dims {
        crate::parallel::Dims {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            num_layers: self.num_layers,
        }
    }

    /// The sliding window of layer `l`, if it has one.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        match self.sliding_layers.get(l) {
            Some(false) => None,
            _ => self.sliding_window,
        }
    }

    /// A layer's sizes: query heads, KV heads, head size, hidden size, MLP size (all ranks').
    pub fn layer_sizes(&self) -> (usize, usize, usize, usize, usize) {
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        (h, hkv, d, self.hidden_size, self.intermediate_size)
    }

    /// What layer `l` asks of attention: the scale, its window, the soft-cap.
    pub fn attention_options(&self, l: usize) -> crate::backend::AttentionOptions {
        crate::backend::AttentionOptions {
            scale: self.attention_scale(),
            sliding_window: self.layer_window(l),
            logit_softcap: self.attn_logit_softcap.map(|x| x as f32),
            alibi: None,
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

    /// Checks the relations between hyper-parameters that the model code relies on, and that
    /// every size and value is one a real model could have (see [`LIMITS`]).
    pub fn validate(&self) -> Result<()> {
        self.check_sizes()?;
        if let Some(m) = &self.moe {
            m.validate(self.num_layers)?;
        }
        self.check_values()
    }

    /// Checks every size against [`LIMITS`]. The readers call it before the family hooks,
    /// which size things from the config (Gemma 3's per-layer pattern).
    pub fn check_sizes(&self) -> Result<()> {
        let c = self;
        let sizes = [
            ("num_hidden_layers", c.num_layers),
            ("num_attention_heads", c.num_heads),
            ("num_key_value_heads", c.num_kv_heads),
            ("head_dim", c.head_dim),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
            ("max_position_embeddings", c.max_position_embeddings),
        ];
        for (name, n) in sizes {
            let max = limit(name);
            if n == 0 {
                bail!("{name} must be positive, got 0");
            }
            if n > max {
                bail!(
                    "{name} {n} is larger than any model this engine runs (at most {max}): \
                     the file is corrupt"
                );
            }
        }
        Ok(())
    }

    fn check_values(&self) -> Result<()> {
        let c = self;
        let max_context = MAX_CONTEXT;
        if let Some(w) = c.sliding_window
            && w > max_context
        {
            bail!("sliding_window {w} is larger than the largest context ({max_context})");
        }
        for (name, v) in [
            ("rope_theta", Some(c.rope_theta)),
            ("the local rope_theta", c.rope_theta_local),
        ] {
            if let Some(v) = v
                && !(v > 0.0 && v.is_finite())
            {
                bail!("{name} (the RoPE base) must be a positive number, got {v}");
            }
        }
        // NOTE: no family uses an epsilon of 0 (it divides by zero on a zero row); llama.cpp
        // does not check, transformers does not either, but such a file is corrupt.
        if !(c.rms_norm_eps > 0.0 && c.rms_norm_eps.is_finite()) {
            bail!(
                "the norm epsilon (rms_norm_eps, layer_norm_epsilon) must be a positive number, got {}",
                c.rms_norm_eps
            );
        }
        if let Some(a) = c.attn_scale
            && !(a > 0.0 && a.is_finite())
        {
            bail!("the attention scale must be a positive number, got {a}");
        }
        if let Some(s) = &c.rope_scaling {
            let positive = |name: &str, v: f64| {
                if v > 0.0 && v.is_finite() {
                    Ok(())
                } else {
                    Err(anyhow::anyhow!(
                        "llama3 RoPE scaling: {name} must be a positive number, got {v}"
                    ))
                }
            };
            positive("factor", s.factor)?;
            positive("low_freq_factor", s.low_freq_factor)?;
            positive("high_freq_factor", s.high_freq_factor)?;
            // transformers' rule; equal factors divide by zero in the smooth band
            if s.high_freq_factor <= s.low_freq_factor {
                bail!(
                    "llama3 RoPE scaling: high_freq_factor ({}) must be greater than low_freq_factor ({})",
                    s.high_freq_factor,
                    s.low_freq_factor
                );
            }
            let o = s.original_max_position_embeddings;
            if o == 0 || o > max_context {
                bail!(
                    "llama3 RoPE scaling: original_max_position_embeddings must be in 1..={max_context}, got {o}"
                );
            }
        }
        if let Some(l) = &c.longrope {
            let o = l.original_max_position_embeddings;
            // NOTE: 1 is refused too: the attention factor divides by ln(original).
            if o < 2 || o > max_context {
                bail!(
                    "longrope: original_max_position_embeddings must be in 2..={max_context}, got {o}"
                );
            }
            if let Some(x) = l
                .short_factor
                .iter()
                .chain(&l.long_factor)
                .find(|x| !(**x > 0.0 && x.is_finite()))
            {
                bail!("longrope: every short and long factor must be a positive number, got {x}");
            }
            if !(l.attention_factor > 0.0 && l.attention_factor.is_finite()) {
                bail!(
                    "longrope: the attention factor must be a positive number, got {}",
                    l.attention_factor
                );
            }
        }
        if !c.num_heads.is_multiple_of(c.num_kv_heads) {
            bail!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                c.num_heads,
                c.num_kv_heads
            );
        }
        if !c.head_dim.is_multiple_of(2) {
            bail!("head_dim must be even, got {}", c.head_dim);
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
        if let Some(r) = c.rotary_dim
            && (r == 0 || r % 2 == 1 || r > c.head_dim)
        {
            bail!(
                "the rotary dimensions ({r}) must be even, positive and at most head_dim ({})",
                c.head_dim
            );
        }
        if (c.rotary_dim.is_some() || c.rope_interleaved) && !c.arch.rotary_options() {
            bail!(
                "partial or interleaved rotary embeddings are not supported for {}",
                c.arch.name()
            );
        }
        if c.rotary_dim.is_some() && c.longrope.is_some() {
            bail!("partial rotary embeddings with longrope scaling are not supported");
        }
        if let Some(s) = c.logit_scale
            && !(s > 0.0 && s.is_finite())
        {
            bail!("the logits' scale must be positive, got {s}");
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

    /// The common fields of an HF `config.json` (after the family's renames), for a model of
    /// family `arch`; the family's own fields are the registry's to add
    /// ([`crate::models::registry::hf_config`]).
    pub fn from_hf_common(v: &Value, arch: Arch) -> Result<Self> {
        let f = Fields::top(v);
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
            arch,
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
            rotary_dim: None,
            rope_interleaved: false,
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
            logit_scale: None,
            moe: None,
            extra: Value::Null,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
        };
        c.check_sizes()?;
        if let (Some(s), Some("longrope" | "su")) = (&scaling, rope_type) {
            c.longrope = Some(longrope(&f, s, head_dim, max_position_embeddings)?);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 100,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2
        })
    }

    fn err(edit: impl Fn(&mut Value)) -> String {
        let mut v = base();
        edit(&mut v);
        match crate::models::registry::hf_config(&v) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn the_base_config_is_valid() {
        let c = crate::models::registry::hf_config(&base()).unwrap();
        assert_eq!((c.num_layers, c.head_dim), (2, 16));
    }

    #[test]
    fn huge_sizes_are_refused_before_anything_is_sized_from_them() {
        for (key, limit) in LIMITS {
            for n in [*limit as u64 + 1, 1 << 31, 1 << 40, 1 << 62, u64::MAX] {
                let e = err(|v| v[*key] = n.into());
                assert!(
                    e.contains(&format!("{key} {n} is larger than any model")),
                    "{key} = {n}: {e}"
                );
            }
            let e = err(|v| v[*key] = 0.into());
            assert!(e.contains(&format!("{key} must be positive")), "{key}: {e}");
        }
        // Gemma 3 sizes its per-layer pattern from the layer count: checked before that
        let e = err(|v| {
            v["model_type"] = "gemma3_text".into();
            v["sliding_window"] = 16.into();
            v["num_hidden_layers"] = (1u64 << 60).into();
        });
        assert!(e.contains("num_hidden_layers 1152921504606846976"), "{e}");
        let e = err(|v| {
            v["model_type"] = "mistral".into();
            v["sliding_window"] = (1u64 << 40).into();
        });
        assert!(e.contains("sliding_window 1099511627776 is larger"), "{e}");
    }

    #[test]
    fn bad_values_are_refused() {
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Edit)> = vec![
            (
                "rope_theta (the RoPE base) must be a positive number, got 0",
                Box::new(|v| v["rope_theta"] = 0.into()),
            ),
            (
                "got -10000",
                Box::new(|v| v["rope_theta"] = (-10000).into()),
            ),
            ("norm epsilon", Box::new(|v| v["rms_norm_eps"] = 0.into())),
            (
                "norm epsilon",
                Box::new(|v| v["rms_norm_eps"] = json!(-1e-5)),
            ),
            (
                "llama3 RoPE scaling: factor must be a positive number, got 0",
                Box::new(|v| v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 0})),
            ),
            (
                "high_freq_factor (2) must be greater than low_freq_factor (2)",
                Box::new(|v| {
                    v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8,
                        "low_freq_factor": 2, "high_freq_factor": 2})
                }),
            ),
            (
                "original_max_position_embeddings must be in 1..=16777216, got 0",
                Box::new(|v| {
                    v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8,
                        "original_max_position_embeddings": 0})
                }),
            ),
            (
                "longrope: every short and long factor must be a positive number, got 0",
                Box::new(|v| {
                    v["model_type"] = "phi3".into();
                    v["rope_scaling"] = json!({"type": "longrope",
                        "short_factor": [1, 1, 1, 1, 1, 1, 1, 1],
                        "long_factor": [1, 1, 1, 1, 1, 1, 1, 0],
                        "original_max_position_embeddings": 128});
                }),
            ),
            (
                "longrope: original_max_position_embeddings must be in 2..",
                Box::new(|v| {
                    v["model_type"] = "phi3".into();
                    v["rope_scaling"] = json!({"type": "longrope",
                        "short_factor": [1, 1, 1, 1, 1, 1, 1, 1],
                        "long_factor": [1, 1, 1, 1, 1, 1, 1, 1],
                        "original_max_position_embeddings": 1});
                }),
            ),
            (
                "the attention scale must be a positive number, got inf",
                Box::new(|v| {
                    v["model_type"] = "gemma3_text".into();
                    v["sliding_window"] = 16.into();
                    v["query_pre_attn_scalar"] = 0.into();
                }),
            ),
            (
                "the local rope_theta (the RoPE base) must be a positive number",
                Box::new(|v| {
                    v["model_type"] = "gemma3_text".into();
                    v["sliding_window"] = 16.into();
                    v["rope_local_base_freq"] = (-1).into();
                }),
            ),
            (
                "eos_token_id 100 is not a token",
                Box::new(|v| v["eos_token_id"] = 100.into()),
            ),
        ];
        for (want, edit) in cases {
            let e = err(edit);
            assert!(e.contains(want), "want {want:?}: {e}");
        }
        // non-finite values, which JSON cannot hold, reach validate from GGUF files
        let mut c = crate::models::registry::hf_config(&base()).unwrap();
        for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            c.rope_theta = x;
            assert!(c.validate().unwrap_err().to_string().contains("RoPE base"));
            c.rope_theta = 1e4;
            c.rms_norm_eps = x;
            assert!(c.validate().unwrap_err().to_string().contains("epsilon"));
            c.rms_norm_eps = 1e-5;
            c.rope_scaling = Some(Llama3RopeScaling {
                factor: x,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            });
            assert!(c.validate().unwrap_err().to_string().contains("factor"));
            c.rope_scaling = None;
        }
        c.validate().unwrap();
    }
}
