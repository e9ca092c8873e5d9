//! What every handler shares: the engine thread's command channel, the tokenizer, the served
//! names and limits, and the server's flags (draining, engine dead).

use super::error::ApiError;
use super::metrics::Metrics;
use super::tools;
use super::worker::Command;
use crate::tokenizer::Tokenizer;
use axum::extract::State;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};

/// The handlers' state extractor.
pub type St = State<Arc<AppState>>;

/// What the handlers share.
pub struct AppState {
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) model_names: Vec<String>,
    pub(super) model_root: String,
    /// The LoRA adapters a request's `model` may name (`--enable-lora`), as the engine last
    /// said, by name.
    pub(super) loras: Option<std::sync::RwLock<Vec<crate::engine::LoraInfo>>>,
    pub(super) max_model_len: usize,
    pub(super) vocab_size: usize,
    /// The model's own sampling defaults, for the fields a request leaves out (as vLLM does with
    /// `--generation-config auto`).
    pub(super) sampling_defaults: crate::sampling::SamplingDefaults,
    pub(super) api_key: Option<String>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) created: u64,
    pub(super) id_prefix: u64,
    pub(super) next_id: AtomicU64,
    pub(super) draining: AtomicBool,
    pub(super) dead: Arc<AtomicBool>,
    pub(super) max_body_bytes: usize,
    pub(super) max_waiting: usize,
    /// Longest text worth tokenizing: longer ones have more tokens than the model's context.
    pub(super) max_prompt_bytes: usize,
    /// Tokenizer and chat template work running at once (each may take a core and memory in
    /// proportion to its text).
    pub(super) tokenizer_slots: tokio::sync::Semaphore,
    pub(super) tool_call_parser: Option<tools::ToolCallParser>,
    /// The model's fill-in-the-middle tokens (`suffix`, `/infill`), if it has them.
    pub(super) fim: Option<crate::tokenizer::Fim>,
    /// Finished Responses-API responses, for `previous_response_id` and `GET /v1/responses/{id}`.
    pub(super) responses: std::sync::Mutex<super::store::ResponseStore>,
    /// How results are pooled, where the model is served for embeddings or scores.
    pub(super) pooler: Option<crate::models::pooling::Pooler>,
    /// Ignored request fields already logged (each is logged once).
    pub(super) warned_fields: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl AppState {
    pub(super) fn send(&self, cmd: Command) -> Result<(), ApiError> {
        self.commands
            .send(cmd)
            .map_err(|_| ApiError::internal("the engine thread is gone"))
    }

    /// The LoRA adapter a checked `model` names (`None`: the base model).
    pub(super) fn lora_of(&self, model: &str) -> Option<String> {
        let loras = self
            .loras
            .as_ref()?
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let base = self.model_names.iter().any(|n| n == model);
        (!base && loras.iter().any(|l| l.name == model)).then(|| model.to_string())
    }

    /// `cmpl-…` / `chatcmpl-…`: unique within a run and unlikely to repeat across runs.
    pub(super) fn new_id(&self, kind: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{kind}-{:012x}{n:08x}", self.id_prefix)
    }
}
