//! GGUF metadata to a model config: the common `{arch}.*` keys, RoPE scaling (keys or a
//! `rope_freqs.weight` tensor), sampling defaults; the family's own keys through its registry
//! hook.

use super::{GgufFile, in_file};
use crate::models::config::{Llama3RopeScaling, ModelConfig};
use crate::untrusted::text;
use anyhow::{Result, anyhow, bail};

impl GgufFile {
    /// The model's default sampling parameters, from llama.cpp's `general.sampling.*` keys;
    /// one of the wrong type, or that no request could use, is an error naming it.
    pub fn sampling_defaults(&self) -> Result<crate::sampling::SamplingDefaults> {
        let f = |k: &str| -> Result<Option<f32>> {
            let key = format!("general.sampling.{k}");
            Ok(self
                .meta_f64(&key)
                .map_err(|e| in_file(&self.path, e))?
                .map(|x| x as f32))
        };
        let d = crate::sampling::SamplingDefaults {
            temperature: f("temp")?,
            top_p: f("top_p")?,
            top_k: f("top_k")?.map(|x| x as i32),
            min_p: f("min_p")?,
            repetition_penalty: f("penalty_repeat")?,
        };
        d.check().map_err(|e| in_file(&self.path, anyhow!("{e}")))?;
        Ok(d)
    }

    /// Metadata `key` as a non-negative integer: `None` when absent, an error naming the key
    /// and the value when it is of another type.
    pub fn meta_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
                Some(x) => Ok(Some(x)),
                None => bail!(
                    "metadata '{}' should be a non-negative integer, found {v:?}",
                    text(key)
                ),
            },
        }
    }

    /// Metadata `key` as a number (integers converted), as [`Self::meta_usize`].
    pub fn meta_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(Some(x)),
                None => bail!("metadata '{}' should be a number, found {v:?}", text(key)),
            },
        }
    }

    /// Metadata `key` as a string, as [`Self::meta_usize`].
    pub fn meta_str(&self, key: &str) -> Result<Option<&str>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => match v.as_str() {
                Some(x) => Ok(Some(x)),
                None => bail!("metadata '{}' should be a string, found {v:?}", text(key)),
            },
        }
    }

    /// The model hyper-parameters, from the `{arch}.*` and `tokenizer.ggml.*` metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        self.config_inner().map_err(|e| in_file(&self.path, e))
    }

    fn config_inner(&self) -> Result<ModelConfig> {
        let arch_name = self.arch_str()?.to_owned();
        let family = crate::models::registry::by_gguf_architecture(&arch_name)?;
        let a = &arch_name;
        let opt_usize = |k: &str| self.meta_usize(k);
        let req_usize = |k: &str| -> Result<usize> {
            opt_usize(k)?.ok_or_else(|| anyhow!("metadata lacks the integer '{k}'"))
        };
        let opt_f64 = |k: &str| self.meta_f64(k);
        let opt_u32 = |k: &str| -> Result<Option<u32>> {
            match opt_usize(k)? {
                None => Ok(None),
                Some(x) => {
                    Ok(Some(u32::try_from(x).map_err(|_| {
                        anyhow!("metadata '{k}' = {x} is not a token id")
                    })?))
                }
            }
        };

        let hidden_size = req_usize(&format!("{a}.embedding_length"))?;
        let num_heads = req_usize(&format!("{a}.attention.head_count"))?;
        let num_kv_heads = opt_usize(&format!("{a}.attention.head_count_kv"))?.unwrap_or(num_heads);
        let head_dim = match opt_usize(&format!("{a}.attention.key_length"))? {
            Some(d) => d,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        if let Some(vd) = opt_usize(&format!("{a}.attention.value_length"))?
            && vd != head_dim
        {
            bail!("value head size {vd} differs from key head size {head_dim}: not supported");
        }
        let rotary_dim =
            opt_usize(&format!("{a}.rope.dimension_count"))?.filter(|&r| r != head_dim);
        let rope_theta = opt_f64(&format!("{a}.rope.freq_base"))?.unwrap_or(10000.0);
        let vocab_size = match self.metadata.get("tokenizer.ggml.tokens") {
            Some(v) => v
                .as_array()
                .ok_or_else(|| anyhow!("tokenizer.ggml.tokens is not an array"))?
                .len(),
            None => opt_usize(&format!("{a}.vocab_size"))?.ok_or_else(|| {
                anyhow!("metadata has neither tokenizer.ggml.tokens nor {a}.vocab_size")
            })?,
        };
        let rope_scaling = self.rope_scaling(a, head_dim, rope_theta)?;
        let bos_token_id = opt_u32("tokenizer.ggml.bos_token_id")?;
        let mut eos_token_ids = Vec::new();
        if let Some(e) = opt_u32("tokenizer.ggml.eos_token_id")? {
            eos_token_ids.push(e);
        }
        if let Some(e) = opt_u32("tokenizer.ggml.eot_token_id")?
            && !eos_token_ids.contains(&e)
        {
            eos_token_ids.push(e);
        }
        let mut c = ModelConfig {
            arch: family.arch,
            hidden_size,
            intermediate_size: req_usize(&format!("{a}.feed_forward_length"))?,
            num_layers: req_usize(&format!("{a}.block_count"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings: opt_usize(&format!("{a}.context_length"))?.unwrap_or(4096),
            rms_norm_eps: opt_f64(&format!("{a}.attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: !self.by_name.contains_key("output.weight"),
            attention_bias: arch_name == "qwen2",
            sliding_window: None,
            qk_norm: false,
            sliding_layers: Vec::new(),
            rope_theta_local: None,
            longrope: None,
            rotary_dim,
            rope_interleaved: false,
            hidden_act: crate::backend::Activation::Silu,
            attn_scale: None,
            attn_logit_softcap: None,
            final_logit_softcap: None,
            logit_scale: None,
            moe: None,
            extra: serde_json::Value::Null,
            bos_token_id,
            eos_token_ids,
        };
        c.check_sizes()?;
        (family.gguf_config)(self, &arch_name, &mut c)?;
        // NOTE: a family whose hook reads no experts would run such a file without them.
        if let Some(n) = opt_usize(&format!("{a}.expert_count"))?
            && n > 0
            && c.moe.is_none()
        {
            bail!("mixture-of-experts models of {a} ({a}.expert_count = {n}) are not supported");
        }
        c.validate()?;
        // NOTE: llama.cpp refuses a file with tensors it does not use; a layer's tensors past
        // block_count mean a corrupt count (running fewer layers would go unnoticed).
        for t in &self.tensors {
            if let Some(n) = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(n, _)| n.parse::<u64>().ok())
                && n >= c.num_layers as u64
            {
                bail!(
                    "tensor '{}' is of layer {n}, but {a}.block_count is {}",
                    text(&t.name),
                    c.num_layers
                );
            }
        }
        Ok(c)
    }

    /// Llama 3 RoPE scaling: from `{arch}.rope.scaling.*` keys when they say `llama3`, else
    /// recognised from a `rope_freqs.weight` tensor (what llama.cpp's converter stores for
    /// Llama 3.1+), which must match the Llama 3 formula with the usual low/high frequency
    /// factors 1 and 4 and original context 8192.
    fn rope_scaling(
        &self,
        a: &str,
        head_dim: usize,
        theta: f64,
    ) -> Result<Option<Llama3RopeScaling>> {
        let key = |k: &str| format!("{a}.rope.scaling.{k}");
        let num = |k: &str| self.meta_f64(&key(k));
        let ty = self.meta_str(&key("type"))?.unwrap_or("none");
        let from_keys = match ty {
            "none" => None,
            "llama3" => Some(Llama3RopeScaling {
                factor: num("factor")?.ok_or_else(|| anyhow!("{} is missing", key("factor")))?,
                low_freq_factor: num("low_freq_factor")?.unwrap_or(1.0),
                high_freq_factor: num("high_freq_factor")?.unwrap_or(4.0),
                original_max_position_embeddings: self
                    .meta_usize(&key("original_context_length"))?
                    .unwrap_or(8192),
            }),
            "linear" if num("factor")? == Some(1.0) => None,
            other => bail!(
                "RoPE scaling of type '{}' is not supported (only llama3)",
                crate::untrusted::text(other)
            ),
        };
        if from_keys.is_some() {
            return Ok(from_keys);
        }
        let Some(info) = self.tensor_info("rope_freqs.weight") else {
            return Ok(None);
        };
        let factors = self.load_gguf_tensor(info)?;
        if factors.len() * 2 != head_dim || factors.is_empty() {
            bail!(
                "rope_freqs.weight has {} entries, expected head_dim/2 = {}",
                factors.len(),
                head_dim / 2
            );
        }
        if factors.iter().all(|&f| f == 1.0) {
            return Ok(None);
        }
        let factor = factors.iter().copied().fold(f32::MIN, f32::max) as f64;
        let s = Llama3RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let expected = llama3_rope_factors(&s, head_dim, theta);
        let ok = expected
            .iter()
            .zip(&factors)
            .all(|(&e, &f)| ((f as f64) - e).abs() <= 1e-4 * e.abs().max(1.0));
        if !ok {
            bail!(
                "rope_freqs.weight does not match Llama 3 RoPE scaling (factor {factor}, low/high frequency \
                 factors 1/4, original context 8192): this RoPE scaling is not supported"
            );
        }
        Ok(Some(s))
    }
}

/// The Llama 3 RoPE frequency factors (what llama.cpp stores as `rope_freqs.weight`).
pub(super) fn llama3_rope_factors(s: &Llama3RopeScaling, head_dim: usize, theta: f64) -> Vec<f64> {
    let old_ctx = s.original_max_position_embeddings as f64;
    let low_wavelen = old_ctx / s.low_freq_factor;
    let high_wavelen = old_ctx / s.high_freq_factor;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                s.factor
            } else {
                let smooth = (old_ctx / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                1.0 / ((1.0 - smooth) / s.factor + smooth)
            }
        })
        .collect()
}
