//! The engine's LoRA settings and the adapters it has loaded: names, slots, prefix-cache
//! roots (what `lora.rs` keeps up to date).

use crate::models::lora::LoraAdapter;
use std::collections::HashMap;
use std::path::PathBuf;

/// The LoRA settings of an engine (`--enable-lora`, `--max-loras`, `--max-lora-rank`,
/// `--lora-modules`).
#[derive(Debug, Clone)]
pub struct LoraArgs {
    pub enable: bool,
    /// The most distinct adapters in one step.
    pub max_loras: usize,
    /// Adapters of a larger rank are refused.
    pub max_lora_rank: usize,
    /// The most adapters loaded at once, kept in host memory (vLLM's `--max-cpu-loras`): a
    /// load beyond it is refused. `max_loras` of them are on the device, the least recently
    /// used moved out when a step needs another. `None`: 16, or more where `max_loras` or
    /// `modules` need it.
    pub max_cpu_loras: Option<usize>,
    /// Loaded at start.
    pub modules: Vec<LoraModule>,
}

/// An adapter of `--lora-modules`: `NAME=PATH`, or vLLM's JSON form with `base_model_name`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraModule {
    pub name: String,
    /// A PEFT adapter directory, or a GGUF adapter file (llama.cpp's).
    pub path: PathBuf,
    /// The `parent` `/v1/models` lists it under (the served model's name where unset).
    pub base_model_name: Option<String>,
}

impl Default for LoraArgs {
    fn default() -> Self {
        // NOTE: vLLM's defaults.
        LoraArgs {
            enable: false,
            max_loras: 1,
            max_lora_rank: 16,
            max_cpu_loras: None,
            modules: Vec::new(),
        }
    }
}

/// Why an adapter could not be loaded or unloaded.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("LoRA adapters are not enabled: start with --enable-lora")]
    Disabled,
    #[error("no LoRA adapter is loaded under the name `{0}`")]
    NotFound(String),
    #[error("a LoRA adapter is already loaded under the name `{0}`")]
    Exists(String),
    /// The adapter itself: unreadable, of too large a rank, or for other layers.
    #[error("{0:#}")]
    Invalid(anyhow::Error),
}

/// A loaded adapter.
#[derive(Debug, Clone)]
pub struct LoraInfo {
    pub name: String,
    pub path: PathBuf,
    pub rank: usize,
    /// Bytes its factors take in device memory (all workers' parts together).
    pub bytes: u64,
    /// Whether its factors are on the device now (the `max_loras` used last are).
    pub on_device: bool,
    /// `--lora-modules`' `base_model_name`.
    pub parent: Option<String>,
    pub(super) slot: u32,
    pub(super) root: u64,
}

/// The engine's adapters.
#[derive(Debug, Default)]
pub(super) struct Loras {
    pub(super) args: LoraArgs,
    /// The most adapters loaded at once (`--max-cpu-loras` resolved).
    pub(super) max_cpu: usize,
    pub(super) by_name: HashMap<String, LoraInfo>,
    /// Slots of adapters unloaded while requests still used them.
    pub(super) draining: Vec<LoraInfo>,
    /// Every loaded or draining adapter's factors in host memory, by slot.
    pub(super) host: HashMap<u32, LoraAdapter>,
    /// The slots whose factors are on the device, the least recently used first.
    pub(super) on_device: Vec<u32>,
    /// Prefix-cache roots handed out so far (0 is the base model's).
    pub(super) roots: u64,
}

impl Loras {
    pub(super) fn new(args: &LoraArgs) -> anyhow::Result<Self> {
        if !args.enable && !args.modules.is_empty() {
            anyhow::bail!("--lora-modules needs --enable-lora");
        }
        if args.enable && (args.max_loras == 0 || args.max_lora_rank == 0) {
            anyhow::bail!("--max-loras and --max-lora-rank must be positive");
        }
        let need = args.max_loras.max(args.modules.len());
        let max_cpu = args.max_cpu_loras.unwrap_or(need.max(16));
        if args.enable && max_cpu < need {
            anyhow::bail!(
                "--max-cpu-loras ({max_cpu}) must be at least --max-loras ({}) and the number of --lora-modules ({})",
                args.max_loras,
                args.modules.len()
            );
        }
        Ok(Loras {
            args: args.clone(),
            max_cpu,
            ..Default::default()
        })
    }

    /// The smallest slot neither loaded nor draining.
    pub(super) fn free_slot(&self) -> u32 {
        (1..)
            .find(|s| {
                !self
                    .by_name
                    .values()
                    .chain(&self.draining)
                    .any(|l| l.slot == *s)
            })
            .expect("a free slot")
    }
}
