//! The engine step — schedule, execute, update — and the front APIs built on it: [`Engine`]
//! (add_request / step / abort, streaming per-step outputs, for the server) and [`LLM`]
//! (offline batch generation and chat).

mod llm;
pub mod runner;

pub use llm::{CompletionOutput, LLM, RequestOutput};
pub use runner::{KvBudget, ModelRunner};

use crate::backend::{BackendKind, BatchInput};
use crate::kv::{KvCacheManager, KvUsage, NULL_BLOCK};
use crate::models::tokenizer::{ChatMessage, Tokenizer};
use crate::models::{ModelConfig, load_model};
use crate::sampling::{
    IncrementalDetokenizer, InvalidParam, SamplingDefaults, SamplingParams, StopChecker,
    TokenLogprobs, sample,
};
use crate::sched::{
    FinishReason, Request, RequestId, Scheduler, SchedulerConfig, SchedulingPolicy,
};
use crate::tensor::DType;
use anyhow::{Context, Result};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Everything that configures an engine (the CLI flags map onto it one to one).
#[derive(Debug, Clone)]
pub struct EngineArgs {
    /// A GGUF file or an HF-layout directory; `None`: the default model, fetched if needed.
    pub model: Option<PathBuf>,
    pub backend: BackendKind,
    pub dtype: DType,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size; `None`: the backend's default.
    pub kv_budget: Option<KvBudget>,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// Context length limit; `None`: the model's.
    pub max_model_len: Option<usize>,
    pub scheduling: SchedulingPolicy,
    /// Seed from which requests without their own seed draw one.
    pub seed: u64,
    /// Show a progress bar while the weights load.
    pub progress: bool,
    /// Keep the K/V of full blocks for later requests with the same prefix (vLLM's
    /// `--enable-prefix-caching`, on by default as in vLLM v1).
    pub enable_prefix_caching: bool,
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            model: None,
            backend: BackendKind::Cpu,
            dtype: DType::F32,
            block_size: 16,
            kv_budget: None,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: None,
            scheduling: SchedulingPolicy::Continuous,
            seed: 0,
            progress: false,
            enable_prefix_caching: true,
        }
    }
}

/// Whether a request's next token is the argmax of the raw logits: greedy (or top-k 1), no
/// penalties, no logprobs.
fn argmax_suffices(p: &SamplingParams) -> bool {
    (p.is_greedy() || p.effective_top_k() == Some(1))
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && p.logprobs.is_none()
}

/// Why a request was refused. The server maps these to HTTP 400 with the `param` named.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    InvalidParam(#[from] InvalidParam),
    #[error("{0}")]
    PromptTooLong(String),
    #[error("{0}")]
    InvalidPrompt(String),
    #[error("{0:#}")]
    Internal(anyhow::Error),
}

/// A prompt as text or as token ids.
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}
impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}
impl From<Vec<u32>> for Prompt {
    fn from(t: Vec<u32>) -> Self {
        Prompt::Tokens(t)
    }
}

/// What one step produced for one request: the new tokens and text (deltas), and whether it
/// ended.
#[derive(Debug, Clone)]
pub struct StepOutput {
    pub request_id: RequestId,
    pub new_token_ids: Vec<u32>,
    pub new_text: String,
    /// One entry per new token when `logprobs` was asked for.
    pub new_logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
}

impl StepOutput {
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

struct RequestState {
    params: SamplingParams,
    seed: u64,
    detok: IncrementalDetokenizer,
    stop: StopChecker,
}

/// Counters since the engine started.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub batched_tokens: u64,
    pub preemptions: u64,
    pub step_time_s: f64,
}

pub struct Engine {
    runner: Box<dyn ModelRunner>,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    config: ModelConfig,
    model_name: String,
    eos_token_ids: Vec<u32>,
    sampling_defaults: SamplingDefaults,
    states: HashMap<RequestId, RequestState>,
    next_id: RequestId,
    seed_rng: ChaCha8Rng,
    stats: EngineStats,
}

impl Engine {
    pub fn new(args: EngineArgs) -> Result<Self> {
        let path = match &args.model {
            Some(p) => p.clone(),
            None => crate::fetch::default_model()?,
        };
        let model = load_model(&path)?;
        let cfg = model.config.clone();
        let max_model_len = args.max_model_len.unwrap_or(cfg.max_position_embeddings);
        if max_model_len < 2 {
            anyhow::bail!("max_model_len must be at least 2, got {max_model_len}");
        }
        if args.block_size == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
            anyhow::bail!("block size, max_num_seqs and max_num_batched_tokens must be positive");
        }
        let runner_args = runner::RunnerArgs {
            backend: args.backend,
            dtype: args.dtype,
            block_size: args.block_size,
            kv_budget: args.kv_budget,
            max_model_len,
            max_useful_blocks: args.max_num_seqs * max_model_len.div_ceil(args.block_size),
        };
        let bar = args.progress.then(|| {
            let b = indicatif::ProgressBar::new(cfg.num_layers as u64 + 2);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "loading {msg} {bar:40} {pos}/{len} tensors groups",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b.set_message(model.name.clone());
            b
        });
        let mut progress = |done: usize, _total: usize| {
            if let Some(b) = &bar {
                b.set_position(done as u64);
            }
        };
        let runner = runner::create_runner(&model, &runner_args, &mut progress)?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let kv = KvCacheManager::new(
            runner.num_blocks(),
            args.block_size,
            args.enable_prefix_caching,
        );
        let sched_cfg = SchedulerConfig {
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            max_model_len,
            policy: args.scheduling,
        };
        let scheduler = Scheduler::new(sched_cfg, kv);
        let eff_len = scheduler.config().max_model_len;
        tracing::info!(
            "model {} ({}, {:.0}M params, {}) on {}; KV pool: {} blocks of {} tokens = {} tokens, {} MiB; max model len {}",
            model.name,
            cfg.arch.name(),
            runner.num_params() as f64 / 1e6,
            args.dtype.name(),
            runner.backend_name(),
            runner.num_blocks() - 1,
            args.block_size,
            (runner.num_blocks() - 1) * args.block_size,
            runner.kv_bytes() >> 20,
            eff_len
        );
        if eff_len < max_model_len {
            tracing::warn!(
                "max model len lowered from {max_model_len} to {eff_len}: the KV pool holds no more"
            );
        }
        Ok(Engine {
            runner,
            scheduler,
            tokenizer: Arc::new(model.tokenizer),
            config: cfg,
            model_name: model.name,
            eos_token_ids: model.eos_token_ids,
            sampling_defaults: model.sampling_defaults,
            states: HashMap::new(),
            next_id: 0,
            seed_rng: ChaCha8Rng::seed_from_u64(args.seed),
            stats: EngineStats::default(),
        })
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn model_name(&self) -> &str {
        &self.model_name
    }
    pub fn backend_name(&self) -> String {
        self.runner.backend_name()
    }
    pub fn max_model_len(&self) -> usize {
        self.scheduler.config().max_model_len
    }
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }
    pub fn weight_bytes(&self) -> u64 {
        self.runner.weight_bytes()
    }
    /// The model's own default sampling parameters (generation_config.json or GGUF keys).
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling_defaults
    }
    /// Parameters of the loaded model, as counted while uploading them.
    pub fn num_params(&self) -> u64 {
        self.runner.num_params()
    }
    pub fn kv_bytes(&self) -> u64 {
        self.runner.kv_bytes()
    }
    pub fn kv_usage(&self) -> KvUsage {
        self.scheduler.kv().usage()
    }
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
    pub fn num_running(&self) -> usize {
        self.scheduler.num_running()
    }
    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }
    /// The requests that hold KV blocks now (benchmarks compare them with a reserving engine).
    pub fn running_request_ids(&self) -> &[RequestId] {
        self.scheduler.running_ids()
    }
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Renders chat messages with the model's chat template (generation prompt added).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        self.tokenizer.apply_chat_template(messages, true)
    }

    /// Validates and queues a request. Nothing is queued when it fails.
    pub fn add_request(
        &mut self,
        prompt: Prompt,
        params: SamplingParams,
    ) -> Result<RequestId, RequestError> {
        params.validate()?;
        let ids = match prompt {
            Prompt::Text(t) => self.tokenizer.encode(&t).map_err(RequestError::Internal)?,
            Prompt::Tokens(t) => t,
        };
        if ids.is_empty() {
            return Err(RequestError::InvalidPrompt("the prompt is empty".into()));
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(RequestError::InvalidPrompt(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        let max_len = self.max_model_len();
        if ids.len() >= max_len {
            return Err(RequestError::PromptTooLong(format!(
                "the prompt has {} tokens, but the maximum context length is {max_len} tokens (with room for at least one generated token)",
                ids.len()
            )));
        }
        let room = max_len - ids.len();
        let max_tokens = match params.max_tokens {
            Some(m) if m > room => {
                return Err(RequestError::PromptTooLong(format!(
                    "the prompt ({} tokens) plus max_tokens ({m}) exceeds the maximum context length of {max_len} tokens",
                    ids.len()
                )));
            }
            Some(m) => m,
            None => room,
        };
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend(&self.eos_token_ids);
        }
        let id = self.next_id;
        self.next_id += 1;
        let seed = params.seed.unwrap_or_else(|| self.seed_rng.next_u64());
        let state = RequestState {
            detok: IncrementalDetokenizer::new(
                self.tokenizer.clone(),
                &ids,
                params.skip_special_tokens,
            ),
            stop: StopChecker::new(&params.stop),
            params,
            seed,
        };
        self.stats.prompt_tokens += ids.len() as u64;
        self.scheduler
            .add_request(Request::new(id, ids, max_tokens, stop_ids))
            .map_err(RequestError::PromptTooLong)?;
        self.states.insert(id, state);
        Ok(id)
    }

    /// Aborts a request: its blocks return to the pool at once. False if it was not running
    /// or waiting.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let ok = self.scheduler.finish_request(id, FinishReason::Abort);
        self.scheduler.remove_finished(id);
        self.states.remove(&id);
        ok
    }

    /// One engine step: schedule, execute, update. Returns an output for every request that
    /// produced a token or ended.
    pub fn step(&mut self) -> Result<Vec<StepOutput>> {
        let t0 = Instant::now();
        let sched = self.scheduler.schedule();
        self.stats.preemptions += sched.preempted.len() as u64;
        if sched.is_empty() {
            return Ok(Vec::new());
        }

        // Build the flattened batch (see ARCHITECTURE.md, "One engine step").
        let bs = self.scheduler.kv().block_size();
        let max_blocks = sched
            .scheduled
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1);
        let mut input = BatchInput {
            max_blocks,
            ..Default::default()
        };
        input.query_start.push(0);
        let mut sampling = Vec::new();
        for s in &sched.scheduled {
            let req = self
                .scheduler
                .request(s.id)
                .context("scheduled request is unknown")?;
            let range = s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens;
            input
                .token_ids
                .extend_from_slice(&req.tokens[range.clone()]);
            for pos in range {
                input.positions.push(pos as u32);
                input
                    .slot_mapping
                    .push(s.block_table[pos / bs] * bs as u32 + (pos % bs) as u32);
            }
            input.query_start.push(input.token_ids.len() as u32);
            input
                .seq_lens
                .push((s.num_computed_tokens + s.num_new_tokens) as u32);
            input.block_tables.extend_from_slice(&s.block_table);
            input.block_tables.extend(std::iter::repeat_n(
                NULL_BLOCK,
                max_blocks - s.block_table.len(),
            ));
            if s.sample {
                input.logits_rows.push(input.token_ids.len() as u32 - 1);
                sampling.push(s.id);
            }
        }
        self.stats.batched_tokens += input.token_ids.len() as u64;
        // NOTE: when every sampled row is plain greedy, the backend reduces the logits to token
        // ids itself (on a GPU, only those come back).
        let greedy_only = !sampling.is_empty()
            && sampling.iter().all(|id| {
                self.states
                    .get(id)
                    .is_some_and(|st| argmax_suffices(&st.params))
            });
        let (logits, greedy_ids) = if greedy_only {
            (Vec::new(), Some(self.runner.execute_greedy(input)?))
        } else {
            (self.runner.execute(input)?, None)
        };
        let vocab = self.config.vocab_size;

        let mut sampled = HashMap::new();
        let mut logprobs = HashMap::new();
        for (i, id) in sampling.iter().enumerate() {
            if let Some(g) = &greedy_ids {
                sampled.insert(*id, g[i]);
                continue;
            }
            let req = self
                .scheduler
                .request(*id)
                .context("sampled request is unknown")?;
            let st = &self.states[id];
            let row = &logits[i * vocab..(i + 1) * vocab];
            let tok = sample(
                row,
                &st.params,
                req.prompt(),
                req.output(),
                st.seed,
                req.output().len(),
            );
            sampled.insert(*id, tok.token_id);
            if let Some(lp) = tok.logprobs {
                logprobs.insert(*id, lp);
            }
        }

        let events = self.scheduler.update_from_output(&sched, &sampled);
        let mut outputs = Vec::with_capacity(events.len());
        for ev in events {
            self.stats.generated_tokens += 1;
            let st = self
                .states
                .get_mut(&ev.id)
                .context("request state is missing")?;
            let delta = st.detok.push(ev.token)?;
            let (mut text, stopped) = st.stop.push(&delta);
            let mut finish = ev.finished;
            if stopped {
                // NOTE: a stop string ends the request even when the token also hit a limit.
                self.scheduler.finish_request(ev.id, FinishReason::Stop);
                finish = Some(FinishReason::Stop);
            } else if finish.is_some() {
                text.push_str(&st.stop.flush());
            }
            let req = self
                .scheduler
                .request(ev.id)
                .context("request is unknown")?;
            outputs.push(StepOutput {
                request_id: ev.id,
                new_token_ids: vec![ev.token],
                new_text: text,
                new_logprobs: logprobs.remove(&ev.id).into_iter().collect(),
                finish_reason: finish,
                num_prompt_tokens: req.prompt_len,
                num_output_tokens: req.output().len(),
            });
            if finish.is_some() {
                self.scheduler.remove_finished(ev.id);
                self.states.remove(&ev.id);
            }
        }
        self.stats.steps += 1;
        self.stats.step_time_s += t0.elapsed().as_secs_f64();
        Ok(outputs)
    }
}
