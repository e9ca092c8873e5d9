//! The engine's LoRA settings and the adapters it has loaded: names, slots, prefix-cache
//! roots (what `lora.rs` keeps up to date).

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
    /// Loaded at start: (name, PEFT adapter directory).
    pub modules: Vec<(String, PathBuf)>,
}

impl Default for LoraArgs {
    fn default() -> Self {
        // NOTE: vLLM's defaults.
        LoraArgs {
            enable: false,
            max_loras: 1,
            max_lora_rank: 16,
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
    /// Bytes its factors take on the device.
    pub bytes: u64,
    pub(super) slot: u32,
    pub(super) root: u64,
}

/// The engine's adapters.
#[derive(Debug, Default)]
pub(super) struct Loras {
    pub(super) args: LoraArgs,
    pub(super) by_name: HashMap<String, LoraInfo>,
    /// Slots of adapters unloaded while requests still used them.
    pub(super) draining: Vec<LoraInfo>,
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
        Ok(Loras {
            args: args.clone(),
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
