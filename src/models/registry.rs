//! The registry of model families: the one place that knows which architectures exist. Each
//! entry names the HF `model_type`s and GGUF `general.architecture`s it reads, adds its own
//! config fields and checks to the common ones, maps HF tensor names to GGUF ones, and loads
//! its model over any [`Backend`]. Nothing outside this file matches on the architecture.
//!
//! Adding a family that needs no new op: one new file in `src/models/` (its graph, written over
//! the `Backend` trait) and an entry here (an `Arch` variant, a `Family` row, a `load` arm).

use super::CausalLm;
use super::config::{Arch, Fields, ModelConfig};
use super::falcon::Falcon;
use super::gemma3::Gemma3;
use super::gguf::{GgufFile, GgufTensorName};
use super::gpt2::Gpt2;
use super::llama::Llama;
use super::loader::WeightSource;
use super::neox::NeoX;
use super::olmo2::Olmo2;
use super::pooling::OutputHead;
use super::stack::Load;
use crate::backend::Backend;
use crate::parallel::Placement;
use crate::tensor::WeightDtype;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

/// One family's entry.
#[derive(Debug)]
pub struct Family {
    pub arch: Arch,
    pub name: &'static str,
    /// HF `config.json` `model_type`s read as this family.
    pub hf_model_types: &'static [&'static str],
    /// GGUF `general.architecture`s read as this family.
    pub gguf_architectures: &'static [&'static str],
    /// Renames the family's own `config.json` keys to the common ones (`n_embd` to
    /// `hidden_size`, ...) before the common fields are read.
    pub hf_prepare: fn(&mut Value) -> Result<()>,
    /// Reads the family's own `config.json` fields into a config whose common fields are set.
    pub hf_config: fn(&Value, &mut ModelConfig) -> Result<()>,
    /// Reads the family's own GGUF metadata (`{arch}.*` keys) likewise.
    pub gguf_config: fn(&GgufFile, &str, &mut ModelConfig) -> Result<()>,
    /// The GGUF name of an HF tensor name.
    pub gguf_tensor_name: fn(&str) -> Option<GgufTensorName>,
}

pub static FAMILIES: &[Family] = &[
    Family {
        arch: Arch::Llama,
        name: "llama",
        hf_model_types: &["llama"],
        gguf_architectures: &["llama"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_llama,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Mistral,
        name: "mistral",
        hf_model_types: &["mistral"],
        gguf_architectures: &[],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_mistral,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Qwen2,
        name: "qwen2",
        hf_model_types: &["qwen2"],
        gguf_architectures: &["qwen2"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_qwen2,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Qwen3,
        name: "qwen3",
        hf_model_types: &["qwen3"],
        gguf_architectures: &["qwen3"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_qwen3,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Mixtral,
        name: "mixtral",
        hf_model_types: &["mixtral"],
        gguf_architectures: &[],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_mixtral,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Qwen2Moe,
        name: "qwen2_moe",
        hf_model_types: &["qwen2_moe"],
        gguf_architectures: &["qwen2moe"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_qwen2_moe,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Qwen3Moe,
        name: "qwen3_moe",
        hf_model_types: &["qwen3_moe"],
        gguf_architectures: &["qwen3moe"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_qwen3_moe,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Olmoe,
        name: "olmoe",
        hf_model_types: &["olmoe"],
        gguf_architectures: &["olmoe"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_olmoe,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Granite,
        name: "granite",
        hf_model_types: &["granite"],
        gguf_architectures: &["granite"],
        hf_prepare: no_renames,
        hf_config: super::llama::hf_config_granite,
        gguf_config: super::llama::gguf_config,
        gguf_tensor_name: super::gguf::llama_tensor_name,
    },
    Family {
        arch: Arch::Phi3,
        name: "phi3",
        hf_model_types: &["phi3"],
        gguf_architectures: &["phi3"],
        hf_prepare: no_renames,
        hf_config: super::phi3::hf_config,
        gguf_config: super::phi3::gguf_config,
        gguf_tensor_name: super::phi3::gguf_tensor_name,
    },
    Family {
        arch: Arch::Gemma3,
        name: "gemma3",
        hf_model_types: &["gemma3_text"],
        gguf_architectures: &["gemma3"],
        hf_prepare: no_renames,
        hf_config: super::gemma3::hf_config,
        gguf_config: super::gemma3::gguf_config,
        gguf_tensor_name: super::gemma3::gguf_tensor_name,
    },
    Family {
        arch: Arch::Gpt2,
        name: "gpt2",
        hf_model_types: &["gpt2"],
        gguf_architectures: &["gpt2"],
        hf_prepare: super::gpt2::hf_prepare,
        hf_config: super::gpt2::hf_config,
        gguf_config: super::gpt2::gguf_config,
        gguf_tensor_name: super::gpt2::gguf_tensor_name,
    },
    Family {
        arch: Arch::Falcon,
        name: "falcon",
        hf_model_types: &["falcon"],
        gguf_architectures: &["falcon"],
        hf_prepare: super::falcon::hf_prepare,
        hf_config: super::falcon::hf_config,
        gguf_config: super::falcon::gguf_config,
        gguf_tensor_name: super::falcon::gguf_tensor_name,
    },
    Family {
        arch: Arch::GptBigCode,
        name: "gpt_bigcode",
        hf_model_types: &["gpt_bigcode"],
        gguf_architectures: &["starcoder"],
        hf_prepare: super::gpt2::hf_prepare_bigcode,
        hf_config: super::gpt2::hf_config_bigcode,
        gguf_config: super::gpt2::gguf_config_bigcode,
        gguf_tensor_name: super::gpt2::gguf_tensor_name_bigcode,
    },
    Family {
        arch: Arch::GptJ,
        name: "gptj",
        hf_model_types: &["gptj"],
        gguf_architectures: &["gptj"],
        hf_prepare: super::neox::hf_prepare_gptj,
        hf_config: super::neox::hf_config_gptj,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
    Family {
        arch: Arch::Olmo2,
        name: "olmo2",
        hf_model_types: &["olmo2"],
        gguf_architectures: &["olmo2"],
        hf_prepare: no_renames,
        hf_config: super::olmo2::hf_config,
        gguf_config: super::olmo2::gguf_config,
        gguf_tensor_name: super::olmo2::gguf_tensor_name,
    },
    Family {
        arch: Arch::Bloom,
        name: "bloom",
        hf_model_types: &["bloom"],
        gguf_architectures: &["bloom"],
        hf_prepare: super::neox::hf_prepare_alibi,
        hf_config: super::neox::hf_config_bloom,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
    Family {
        arch: Arch::Mpt,
        name: "mpt",
        hf_model_types: &["mpt"],
        gguf_architectures: &["mpt"],
        hf_prepare: super::neox::hf_prepare_alibi,
        hf_config: super::neox::hf_config_mpt,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
    Family {
        arch: Arch::GptNeoX,
        name: "gpt_neox",
        hf_model_types: &["gpt_neox"],
        gguf_architectures: &["gptneox"],
        hf_prepare: super::neox::hf_prepare,
        hf_config: super::neox::hf_config_gpt_neox,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
    Family {
        arch: Arch::StableLm,
        name: "stablelm",
        hf_model_types: &["stablelm"],
        gguf_architectures: &["stablelm"],
        hf_prepare: super::neox::hf_prepare,
        hf_config: super::neox::hf_config_stablelm,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
    Family {
        arch: Arch::Starcoder2,
        name: "starcoder2",
        hf_model_types: &["starcoder2"],
        gguf_architectures: &["starcoder2"],
        hf_prepare: super::neox::hf_prepare,
        hf_config: super::neox::hf_config_starcoder2,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
    Family {
        arch: Arch::Cohere,
        name: "cohere",
        hf_model_types: &["cohere"],
        gguf_architectures: &["command-r"],
        hf_prepare: super::neox::hf_prepare,
        hf_config: super::neox::hf_config_cohere,
        gguf_config: super::neox::gguf_config,
        gguf_tensor_name: super::neox::gguf_tensor_name,
    },
];

fn no_renames(_: &mut Value) -> Result<()> {
    Ok(())
}

impl Arch {
    pub fn family(self) -> &'static Family {
        FAMILIES
            .iter()
            .find(|f| f.arch == self)
            .expect("every Arch has a registry entry")
    }

    pub fn name(self) -> &'static str {
        self.family().name
    }

    /// The `general.architecture` llama.cpp's converter writes for this family (its own, or
    /// `llama` for Mistral and Mixtral, which it converts as Llama).
    pub fn gguf_architecture(self) -> Option<&'static str> {
        match self {
            Arch::Mistral | Arch::Mixtral => Some("llama"),
            a => a.family().gguf_architectures.first().copied(),
        }
    }

    /// Whether the family's loader reorders Q and K for partial or interleaved RoPE
    /// ([`super::rope::head_order`]); the others refuse such a config.
    pub fn rotary_options(self) -> bool {
        matches!(
            self,
            Arch::GptNeoX | Arch::GptJ | Arch::StableLm | Arch::Starcoder2 | Arch::Cohere
        )
    }
}

fn supported(names: impl Fn(&Family) -> &'static [&'static str]) -> String {
    FAMILIES
        .iter()
        .flat_map(|f| names(f).iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The family of an HF `model_type`.
pub fn by_hf_model_type(model_type: &str) -> Result<&'static Family> {
    match FAMILIES
        .iter()
        .find(|f| f.hf_model_types.contains(&model_type))
    {
        Some(f) => Ok(f),
        None => bail!(
            "unknown architecture '{}' (model_type; supported: {})",
            crate::untrusted::text(model_type),
            supported(|f| f.hf_model_types)
        ),
    }
}

/// The family of a GGUF `general.architecture`.
pub fn by_gguf_architecture(arch: &str) -> Result<&'static Family> {
    match FAMILIES
        .iter()
        .find(|f| f.gguf_architectures.contains(&arch))
    {
        Some(f) => Ok(f),
        None => bail!(
            "unknown architecture '{}' (general.architecture; supported: {})",
            crate::untrusted::text(arch),
            supported(|f| f.gguf_architectures)
        ),
    }
}

/// Uploads a model's weights to `backend` as the model of its family. `max_positions` bounds
/// the RoPE tables (the max model length); `progress(done, total)` follows the layers.
pub fn load<B: Backend>(
    backend: &B,
    cfg: &ModelConfig,
    src: &dyn WeightSource,
    dtype: WeightDtype,
    max_positions: usize,
    head: &OutputHead,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn CausalLm<B>>> {
    let place = Placement::single(cfg.num_layers);
    load_shard(
        backend,
        cfg,
        src,
        dtype,
        max_positions,
        place,
        head,
        progress,
    )
}

/// Uploads one worker's shard of a model (tensor and pipeline parallelism): the layers of its
/// stage, the heads and columns of its tensor rank. Every family splits (see `shard.rs`).
pub fn load_shard<B: Backend>(
    backend: &B,
    cfg: &ModelConfig,
    src: &dyn WeightSource,
    dtype: WeightDtype,
    max_positions: usize,
    place: Placement<B>,
    head: &OutputHead,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn CausalLm<B>>> {
    let ld = Load {
        backend,
        cfg,
        src,
        dtype,
        max_positions,
        place,
        head: head.clone(),
    };
    Ok(match cfg.arch {
        Arch::Gemma3 => Box::new(Gemma3::load(ld, progress)?),
        Arch::Olmo2 => Box::new(Olmo2::load(ld, progress)?),
        Arch::Gpt2 | Arch::GptBigCode => Box::new(Gpt2::load(ld, progress)?),
        Arch::Falcon => Box::new(Falcon::load(ld, progress)?),
        Arch::GptNeoX
        | Arch::GptJ
        | Arch::StableLm
        | Arch::Starcoder2
        | Arch::Cohere
        | Arch::Bloom
        | Arch::Mpt => Box::new(NeoX::load(ld, progress)?),
        Arch::Llama
        | Arch::Mistral
        | Arch::Qwen2
        | Arch::Qwen3
        | Arch::Phi3
        | Arch::Granite
        | Arch::Mixtral
        | Arch::Qwen2Moe
        | Arch::Qwen3Moe
        | Arch::Olmoe => Box::new(Llama::load(ld, progress)?),
    })
}

/// Reads an HF `config.json`.
pub fn hf_config_file(path: &Path) -> Result<ModelConfig> {
    crate::untrusted::regular_file(path)?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    hf_config(&v).with_context(|| format!("in {}", path.display()))
}

/// Reads an HF `config.json`'s value: the family's renames, the common fields, then the
/// family's own fields and checks.
pub fn hf_config(v: &Value) -> Result<ModelConfig> {
    let family = match Fields::top(v).str("model_type")? {
        None | Some("") => bail!("config.json has no model_type"),
        Some(t) => by_hf_model_type(t)?,
    };
    let mut v = v.clone();
    (family.hf_prepare)(&mut v)?;
    let mut c = ModelConfig::from_hf_common(&v, family.arch)?;
    (family.hf_config)(&v, &mut c)?;
    c.validate()?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arch_has_one_entry_and_names_are_unique() {
        for f in FAMILIES {
            assert!(std::ptr::eq(f.arch.family(), f), "{}", f.name);
        }
        let mut names: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|f| f.hf_model_types.iter().copied())
            .collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "an HF model_type is claimed twice");
    }

    #[test]
    fn unknown_architectures_name_what_is_supported() {
        let e = by_hf_model_type("mamba").unwrap_err().to_string();
        assert!(e.contains("'mamba'") && e.contains("qwen3"), "{e}");
        let e = by_gguf_architecture("rwkv6").unwrap_err().to_string();
        assert!(e.contains("'rwkv6'") && e.contains("llama"), "{e}");
        assert_eq!(by_hf_model_type("mistral").unwrap().arch, Arch::Mistral);
        assert_eq!(by_gguf_architecture("qwen2").unwrap().arch, Arch::Qwen2);
    }
}
