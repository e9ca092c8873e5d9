//! The engine step — schedule, execute, update — and the front APIs built on it: [`Engine`]
//! (add_request / step / abort, streaming per-step outputs, for the server) and [`LLM`]
//! (offline batch generation and chat).

mod adapters;
mod batch;
pub mod launch;
mod llm;
mod lora;
mod nodes;
mod output;
mod pool;
mod request;
pub mod runner;
mod spec;
mod worker;
mod workers;

pub use adapters::{LoraArgs, LoraError, LoraInfo, LoraModule};
pub use llm::{CompletionOutput, LLM, PoolingOutput, RequestOutput};
pub use pool::{PoolingParams, cosine};
pub use request::{Prompt, PromptLogprob, RequestError, StepOutput, StopReason, sample_seed};
pub use runner::{KvBudget, ModelRunner, StepResult};

use crate::backend::BackendKind;
use crate::kv::{KvCacheManager, KvUsage, PrefixCacheStats};
use crate::models::pooling::{Pooler, PoolingType, Task};
use crate::models::{KvCacheDtype, ModelConfig, load_model};
use crate::parallel::{NodeConfig, ParallelConfig};
use crate::sampling::{
    IncrementalDetokenizer, InvalidParam, SamplingDefaults, SamplingParams, StopChecker,
    StructuredCompiler,
};
use crate::sched::{
    FinishReason, NgramConfig, PreemptionMode, Request, RequestId, Scheduler, SchedulerConfig,
    SchedulingPolicy,
};
use crate::tensor::WeightDtype;
use crate::tokenizer::{ChatMessage, Tokenizer};
use anyhow::{Context, Result};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use request::{
    Group, PendingStep, Ranked, RequestState, bad_word_ids, compute_masks, constrained_matchers,
};
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
    /// How weights are kept in memory (`--dtype`): `auto` (the default) keeps a GGUF's block
    /// formats on the CPU; `f32` reproduces the reference exactly.
    pub dtype: WeightDtype,
    /// Element type of the KV cache (`--kv-cache-dtype`): `auto` follows the weights (bf16
    /// weights, bf16 cache) where the backend stores it, else f32.
    pub kv_cache_dtype: KvCacheDtype,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size; `None`: the backend's default.
    pub kv_budget: Option<KvBudget>,
    /// Token budget per step; `None`: the backend's default
    /// ([`crate::backend::Backend::default_token_budget`]).
    pub max_num_batched_tokens: Option<usize>,
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
    /// The largest `n` and `best_of` a request may ask for.
    pub max_n: usize,
    /// What preemption does with a request's K/V: recompute it later, or swap it to host
    /// memory.
    pub preemption_mode: PreemptionMode,
    /// Host memory for swapped-out blocks, in bytes (vLLM's `--swap-space`).
    pub swap_space: u64,
    /// Tensor and pipeline parallel sizes (`--tensor-parallel-size`,
    /// `--pipeline-parallel-size`).
    pub parallel: ParallelConfig,
    /// The workers spread over several nodes (`--nnodes`, ...): node 0 runs the engine, the
    /// others [`run_worker_node`].
    pub nodes: NodeConfig,
    /// What the model is served for (`--task`): generation, embeddings or scores.
    pub task: Task,
    /// Overrides the model's pooling (`--pooling-type`).
    pub pooling_type: Option<PoolingType>,
    /// The tokens whose logits a score is made of (`--classifier-from-token no,yes`).
    pub classifier_from_token: Option<Vec<String>>,
    /// Speculative decoding (`--speculative-config`): n-gram drafts verified in each step.
    pub speculative: Option<NgramConfig>,
    /// LoRA adapters beside the base model (`--enable-lora`, `--lora-modules`, ...).
    pub lora: LoraArgs,
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            model: None,
            backend: BackendKind::Cpu,
            dtype: WeightDtype::Auto,
            kv_cache_dtype: KvCacheDtype::Auto,
            block_size: 16,
            kv_budget: None,
            max_num_batched_tokens: None,
            max_num_seqs: 256,
            max_model_len: None,
            scheduling: SchedulingPolicy::Continuous,
            seed: 0,
            progress: false,
            enable_prefix_caching: true,
            max_n: 16,
            preemption_mode: PreemptionMode::Recompute,
            swap_space: 4 << 30,
            parallel: ParallelConfig::default(),
            nodes: NodeConfig::default(),
            task: Task::Generate,
            pooling_type: None,
            classifier_from_token: None,
            speculative: None,
            lora: LoraArgs::default(),
        }
    }
}

/// Counters since the engine started.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub batched_tokens: u64,
    pub preemptions: u64,
    /// KV blocks copied to host memory and back (swap preemption), and their bytes.
    pub blocks_swapped_out: u64,
    pub blocks_swapped_in: u64,
    pub swap_bytes: u64,
    pub step_time_s: f64,
    /// Steps started while another was in flight (pipeline parallelism).
    pub overlapped_steps: u64,
    /// Tokens drawn at random by the backend where the logits are (temperature, top-k, top-p,
    /// min-p on a GPU), not on the host.
    pub random_samples_on_device: u64,
    /// Speculative decoding: request-steps that verified drafts, the draft tokens verified
    /// and those kept (vLLM's `spec_decode_num_drafts`, `_num_draft_tokens`,
    /// `_num_accepted_tokens`).
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
}

pub struct Engine {
    runner: Box<dyn ModelRunner>,
    /// Steps in flight (pipeline parallelism), oldest first, and how many may be.
    pending: std::collections::VecDeque<PendingStep>,
    depth: usize,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    config: ModelConfig,
    model_name: String,
    eos_token_ids: Vec<u32>,
    sampling_defaults: SamplingDefaults,
    states: HashMap<RequestId, RequestState>,
    groups: HashMap<RequestId, Group>,
    max_n: usize,
    next_id: RequestId,
    seed_rng: ChaCha8Rng,
    stats: EngineStats,
    /// Compiles structured-output constraints; built at the first request that has one.
    structured: Option<StructuredCompiler>,
    /// How results are pooled, where the model is served for embeddings or scores.
    pooler: Option<Pooler>,
    /// Speculative decoding's proposer, if on.
    speculative: Option<NgramConfig>,
    /// The pooling requests' rows so far.
    pools: HashMap<RequestId, pool::PoolState>,
    /// The length of the rows a step brings back: the vocabulary, or the pooler's width.
    row_len: usize,
    /// The LoRA adapters loaded.
    loras: adapters::Loras,
}

/// The model loaded (its file mapped, not yet its weights), the runner's settings, checked,
/// and the pooling of a model served for embeddings or scores.
fn prepare(
    args: &EngineArgs,
) -> Result<(
    crate::models::LoadedModel,
    runner::RunnerArgs,
    Option<Pooler>,
)> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::models::default_model()?,
    };
    let model = load_model(&path)?;
    let cfg = &model.config;
    // NOTE: as vLLM, a max model length past the model's context is refused: positions
    // the model was never trained on (and, for GPT-2, has no embedding for).
    let model_len = cfg.max_position_embeddings;
    let max_model_len = match args.max_model_len {
        None => model_len,
        Some(l) if l > model_len => anyhow::bail!(
            "max_model_len {l} is greater than the model's context length {model_len} \
             (max_position_embeddings or context_length in its config)"
        ),
        Some(l) => l,
    };
    if max_model_len < 2 {
        anyhow::bail!("max_model_len must be at least 2, got {max_model_len}");
    }
    if args.block_size == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == Some(0) {
        anyhow::bail!("block size, max_num_seqs and max_num_batched_tokens must be positive");
    }
    let max_useful_blocks = args
        .max_num_seqs
        .checked_mul(max_model_len.div_ceil(args.block_size))
        .with_context(|| {
            format!(
                "max_num_seqs ({}) x max_model_len ({max_model_len}) / block_size ({}) overflows",
                args.max_num_seqs, args.block_size
            )
        })?;
    let files = crate::models::pooling::ModelFiles {
        path: &model.path,
        config: &model.config,
        tokenizer: &model.tokenizer,
        weights: model.weights.as_ref(),
    };
    let pooler = crate::models::pooling::pooler(
        &files,
        args.task,
        args.pooling_type,
        args.classifier_from_token.as_deref(),
    )?;
    if pooler.is_some() && !(args.parallel.is_single() && args.nodes.is_single()) {
        anyhow::bail!(
            "--task {} runs on one device: tensor and pipeline parallelism are for generation",
            args.task.name()
        );
    }
    let runner_args = runner::RunnerArgs {
        backend: args.backend,
        dtype: args.dtype,
        kv_cache_dtype: args.kv_cache_dtype,
        block_size: args.block_size,
        kv_budget: args.kv_budget,
        max_model_len,
        max_useful_blocks,
        parallel: args.parallel,
        nodes: args.nodes.clone(),
        head: pooler.as_ref().map(|p| p.head.clone()).unwrap_or_default(),
    };
    Ok((model, runner_args, pooler))
}

/// A node other than 0 of a run over several nodes (`--nnodes`, `--node-rank` 1 or more):
/// loads its workers' shards and runs their steps for the engine on node 0, returning when
/// node 0 closes the connections.
pub fn run_worker_node(args: EngineArgs) -> Result<()> {
    let (model, runner_args, _) = prepare(&args)?;
    launch::serve_node(&model, &runner_args)
}

impl Engine {
    pub fn new(args: EngineArgs) -> Result<Self> {
        if args.speculative.is_some() && args.task != Task::Generate {
            anyhow::bail!(
                "--speculative-config applies to generation, not to --task {}",
                args.task.name()
            );
        }
        let loras = adapters::Loras::new(&args.lora)?;
        if args.lora.enable && args.task != Task::Generate {
            anyhow::bail!(
                "--enable-lora applies to generation, not to --task {}",
                args.task.name()
            );
        }
        let (model, runner_args, pooler) = prepare(&args)?;
        let cfg = model.config.clone();
        let max_model_len = runner_args.max_model_len;
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
        let runner = launch::create_runner(&model, &runner_args, &mut progress)?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let mut kv = KvCacheManager::new(
            runner.num_blocks(),
            args.block_size,
            args.enable_prefix_caching,
        );
        let block_bytes = runner.kv_bytes() / runner.num_blocks() as u64;
        if args.preemption_mode == PreemptionMode::Swap {
            let host_blocks = (args.swap_space / block_bytes.max(1)).min(u32::MAX as u64 - 1);
            kv = kv.with_swap_space(host_blocks as usize);
            tracing::info!(
                "swap preemption: {host_blocks} host blocks ({} MiB)",
                (host_blocks * block_bytes) >> 20
            );
        }
        // NOTE: swap preemption's copies go between steps, so it keeps one step in flight.
        let depth = if args.preemption_mode == PreemptionMode::Swap {
            1
        } else {
            runner.max_in_flight().max(1)
        };
        if depth > 1 {
            tracing::info!("pipeline parallelism: up to {depth} steps in flight");
        }
        let sched_cfg = SchedulerConfig {
            max_num_batched_tokens: args
                .max_num_batched_tokens
                .unwrap_or_else(|| runner.default_token_budget()),
            max_num_seqs: args.max_num_seqs,
            max_model_len,
            policy: args.scheduling,
            preemption_mode: args.preemption_mode,
            steps_in_flight: depth,
            max_loras: args.lora.max_loras,
        };
        let scheduler = Scheduler::new(sched_cfg, kv);
        let eff_len = scheduler.config().max_model_len;
        tracing::info!(
            "model {} ({}, {:.0}M params, --dtype {}: {}) on {}; KV pool: {} blocks of {} tokens = {} tokens, {} MiB of {}; max model len {}",
            model.name,
            cfg.arch.name(),
            runner.weight_stats().params as f64 / 1e6,
            args.dtype.name(),
            runner.weight_stats().describe(),
            runner.backend_name(),
            runner.num_blocks() - 1,
            args.block_size,
            (runner.num_blocks() - 1) * args.block_size,
            runner.kv_bytes() >> 20,
            runner.kv_dtype().name(),
            eff_len
        );
        if eff_len < max_model_len {
            tracing::warn!(
                "max model len lowered from {max_model_len} to {eff_len}: the KV pool holds no more"
            );
        }
        let row_len = pooler.as_ref().map_or(cfg.vocab_size, |p| p.width);
        let mut engine = Engine {
            pending: Default::default(),
            depth,
            runner,
            scheduler,
            tokenizer: Arc::new(model.tokenizer),
            config: cfg,
            model_name: model.name,
            eos_token_ids: model.eos_token_ids,
            sampling_defaults: model.sampling_defaults,
            states: HashMap::new(),
            groups: HashMap::new(),
            max_n: args.max_n,
            next_id: 0,
            seed_rng: ChaCha8Rng::seed_from_u64(args.seed),
            structured: None,
            stats: EngineStats::default(),
            row_len,
            pooler,
            pools: HashMap::new(),
            speculative: args.speculative,
            loras,
        };
        engine.load_lora_modules()?;
        Ok(engine)
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
    /// The token budget of a step (`--max-num-batched-tokens` or the backend's default).
    pub fn max_num_batched_tokens(&self) -> usize {
        self.scheduler.config().max_num_batched_tokens
    }
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }
    pub fn weight_bytes(&self) -> u64 {
        self.runner.weight_stats().bytes
    }
    /// What the weights take: bytes, parameters, bytes by storage type (`f32`, `Q4_1`, ...).
    pub fn weight_stats(&self) -> &crate::tensor::WeightStats {
        self.runner.weight_stats()
    }
    /// The model's own default sampling parameters (generation_config.json or GGUF keys).
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling_defaults
    }
    /// Parameters of the loaded model, as counted while uploading them.
    pub fn num_params(&self) -> u64 {
        self.runner.weight_stats().params
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
    /// Sequences waiting to run: new or preempted, and swapped out to host memory.
    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting() + self.scheduler.num_swapped()
    }
    /// The sequences (samples of requests) that hold KV blocks now (benchmarks compare them
    /// with a reserving engine).
    pub fn running_sequence_ids(&self) -> &[RequestId] {
        self.scheduler.running_ids()
    }
    /// The request a sequence belongs to (itself for unknown ids).
    pub fn request_of(&self, seq: RequestId) -> RequestId {
        self.states.get(&seq).map_or(seq, |st| st.group)
    }
    pub fn prefix_caching(&self) -> bool {
        self.scheduler.kv().prefix_caching()
    }
    pub fn preemption_mode(&self) -> PreemptionMode {
        self.scheduler.config().preemption_mode
    }
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Renders chat messages with the model's chat template (generation prompt added).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        self.tokenizer.apply_chat_template(messages, true)
    }

    /// A matcher for `c` (the compiler is built on first use).
    fn compile_structured(
        &mut self,
        c: &crate::sampling::StructuredOutput,
    ) -> Result<llguidance::Matcher, RequestError> {
        let compiler = match &mut self.structured {
            Some(compiler) => compiler,
            slot => slot.insert(
                StructuredCompiler::new(
                    self.tokenizer.clone(),
                    self.config.vocab_size,
                    &self.eos_token_ids,
                )
                .map_err(RequestError::Internal)?,
            ),
        };
        compiler.compile(c).map_err(|message| {
            RequestError::InvalidParam(InvalidParam {
                param: "structured_outputs",
                message: format!(
                    "the structured output constraint does not compile: {}",
                    crate::untrusted::text(&message)
                ),
            })
        })
    }

    /// Validates and queues a request (its `best_of` samples, which share the prompt's blocks).
    /// Nothing is queued when it fails. Its outputs carry the returned id and their `index`.
    pub fn add_request(
        &mut self,
        prompt: Prompt,
        params: SamplingParams,
    ) -> Result<RequestId, RequestError> {
        self.add_request_with_lora(prompt, params, None)
    }

    /// [`Self::add_request`] through the LoRA adapter named `lora` (loaded by
    /// [`Self::load_lora`] or `--lora-modules`), or the base model with `None`.
    pub fn add_request_with_lora(
        &mut self,
        prompt: Prompt,
        params: SamplingParams,
        lora: Option<&str>,
    ) -> Result<RequestId, RequestError> {
        params.validate()?;
        let (lora_slot, lora_root) = self.lora_slot(lora)?;
        if let Some(p) = &self.pooler {
            return Err(RequestError::InvalidPrompt(format!(
                "this model is served for {} (--task {}): it does not generate",
                if p.task == Task::Embed {
                    "embeddings"
                } else {
                    "scores"
                },
                p.task.name()
            )));
        }
        for (param, v) in [("n", params.n), ("best_of", params.best_of())] {
            if v > self.max_n {
                return Err(RequestError::InvalidParam(InvalidParam {
                    param,
                    message: format!("{param} must be at most {} (--max-n), got {v}", self.max_n),
                }));
            }
        }
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
        if let Some(&bad) = params.logit_bias.keys().find(|&&t| t >= vocab) {
            return Err(RequestError::InvalidParam(InvalidParam {
                param: "logit_bias",
                message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
            }));
        }
        let bad_words = bad_word_ids(&self.tokenizer, &params.bad_words)?;
        let matcher = match &params.structured {
            Some(c) => Some(self.compile_structured(c)?),
            None => None,
        };
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend(&self.eos_token_ids);
        }
        let group = self.next_id;
        let best_of = params.best_of();
        let seed = params.seed.unwrap_or_else(|| self.seed_rng.next_u64());
        // NOTE: with prefix caching every request shares one root; without it, the samples of
        // one request still share their prompt's blocks under a root of their own.
        // NOTE: prompt log-probs need the logits of every prompt position, so such a request
        // computes its whole prompt (as vLLM skips the prefix cache for it).
        let root = if params.prompt_logprobs.is_some() {
            None
        } else if self.scheduler.kv().prefix_caching() {
            Some(lora_root)
        } else {
            (best_of > 1).then_some(group + 1)
        };
        let mut seqs = Vec::with_capacity(best_of);
        for index in 0..best_of {
            let id = self.next_id;
            let mut req = Request::new(id, ids.clone(), max_tokens, stop_ids.clone());
            req.lora = lora_slot;
            if let Err(e) = self.scheduler.add_request(req.with_cache_root(root)) {
                for &s in &seqs {
                    self.scheduler.finish_request(s, FinishReason::Abort);
                    self.scheduler.remove_finished(s);
                    self.states.remove(&s);
                }
                return Err(RequestError::PromptTooLong(e));
            }
            self.next_id += 1;
            self.states.insert(
                id,
                RequestState {
                    detok: IncrementalDetokenizer::new(
                        self.tokenizer.clone(),
                        &ids,
                        params.skip_special_tokens,
                    ),
                    stop: StopChecker::new(&params.stop),
                    params: params.clone(),
                    seed: sample_seed(seed, index),
                    stop_ids: stop_ids.clone(),
                    bad_words: bad_words.clone(),
                    matcher: matcher.as_ref().map(|m| m.deep_clone()),
                    prompt_logprobs: Vec::new(),
                    prompt_logprobs_sent: false,
                    group,
                    index,
                    cum_logprob: 0.0,
                },
            );
            seqs.push(id);
        }
        self.stats.prompt_tokens += ids.len() as u64;
        self.groups.insert(
            group,
            Group {
                unfinished: seqs.len(),
                seqs,
                ranked: (best_of > params.n).then(|| Ranked {
                    n: params.n,
                    kept: Vec::new(),
                }),
            },
        );
        Ok(group)
    }

    /// How this engine pools (`None`: it generates).
    pub fn pooler(&self) -> Option<&Pooler> {
        self.pooler.as_ref()
    }

    /// Validates and queues an embedding or score request: `prompt` whole (text is tokenized
    /// with the tokenizer's special tokens, as sentence-transformers does). Its one output
    /// carries the result in `pooled`.
    pub fn add_pooling_request(
        &mut self,
        prompt: Prompt,
        params: PoolingParams,
    ) -> Result<RequestId, RequestError> {
        let Some(pooler) = &self.pooler else {
            return Err(RequestError::InvalidPrompt(
                "this model is served for generation: embeddings and scores need --task embed or \
                 --task score"
                    .into(),
            ));
        };
        let invalid =
            |param, message: String| RequestError::InvalidParam(InvalidParam { param, message });
        if let Some(d) = params.dimensions {
            let width = pooler.width;
            match &pooler.matryoshka {
                _ if pooler.task != Task::Embed => {
                    return Err(invalid("dimensions", "dimensions is for embeddings".into()));
                }
                None => {
                    return Err(invalid(
                        "dimensions",
                        "this model does not support Matryoshka embeddings (its config.json has \
                         neither is_matryoshka nor matryoshka_dimensions): dimensions cannot be set"
                            .into(),
                    ));
                }
                Some(_) if d == 0 || d > width => {
                    return Err(invalid(
                        "dimensions",
                        format!("dimensions must be between 1 and {width}, got {d}"),
                    ));
                }
                Some(dims) if !dims.is_empty() && !dims.contains(&d) => {
                    return Err(invalid(
                        "dimensions",
                        format!("dimensions must be one of {dims:?}, got {d}"),
                    ));
                }
                Some(_) => {}
            }
        }
        let mut ids = match prompt {
            Prompt::Text(t) => self
                .tokenizer
                .encode_special(&t)
                .map_err(RequestError::Internal)?,
            Prompt::Tokens(t) => t,
        };
        let max_len = self.max_model_len();
        if let Some(k) = params.truncate_prompt_tokens {
            if k == 0 || k > max_len {
                return Err(invalid(
                    "truncate_prompt_tokens",
                    format!("truncate_prompt_tokens must be between 1 and {max_len}, got {k}"),
                ));
            }
            // NOTE: as vLLM: the last tokens are kept.
            ids.drain(..ids.len().saturating_sub(k));
        }
        if ids.is_empty() {
            return Err(RequestError::InvalidPrompt("the input is empty".into()));
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(RequestError::InvalidPrompt(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        if ids.len() > max_len {
            return Err(RequestError::PromptTooLong(format!(
                "the input has {} tokens, but the maximum context length is {max_len} tokens \
                 (truncate_prompt_tokens cuts it to its last tokens)",
                ids.len()
            )));
        }
        let id = self.next_id;
        let len = ids.len();
        // NOTE: no prefix caching: mean pooling needs every row computed, and the request
        // keeps no K/V past its prefill.
        let req = Request::new(id, ids, 0, Vec::new());
        self.scheduler
            .add_request(req)
            .map_err(RequestError::PromptTooLong)?;
        self.next_id += 1;
        self.stats.prompt_tokens += len as u64;
        self.pools.insert(
            id,
            pool::PoolState {
                pooling: pooler.pooling,
                dimensions: params.dimensions,
                acc: Vec::new(),
                next: 0,
            },
        );
        self.groups.insert(
            id,
            Group {
                seqs: vec![id],
                unfinished: 1,
                ranked: None,
            },
        );
        Ok(id)
    }

    /// Aborts a request, all its samples: their blocks return to the pool at once. False if
    /// it was not running or waiting.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(g) = self.groups.remove(&id) else {
            return false;
        };
        let mut ok = false;
        for s in g.seqs {
            ok |= self.scheduler.finish_request(s, FinishReason::Abort);
            self.scheduler.remove_finished(s);
            self.states.remove(&s);
            self.pools.remove(&s);
        }
        self.free_drained_loras();
        ok
    }

    /// Prefix-cache lookups and hits since the start, in tokens.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.scheduler.kv().prefix_cache_stats()
    }

    /// Forgets every cached prefix; requests in flight keep their blocks.
    pub fn reset_prefix_cache(&mut self) {
        self.scheduler.reset_prefix_cache();
    }

    /// One engine step: schedule, execute, update. Returns an output for every request that
    /// produced a token or ended.
    ///
    /// NOTE: with pipeline parallelism several steps are in flight (vLLM's virtual engines):
    /// see [`Engine::step_pipelined`].
    pub fn step(&mut self) -> Result<Vec<StepOutput>> {
        if self.depth > 1 {
            return self.step_pipelined();
        }
        let t0 = Instant::now();
        self.propose_drafts();
        let sched = self.scheduler.schedule();
        self.stats.preemptions += sched.preempted.len() as u64;
        if !sched.swap_out.is_empty() || !sched.swap_in.is_empty() {
            // NOTE: before the forward, which may write the blocks just swapped out.
            if let Err(e) = self.runner.swap_blocks(&sched.swap_out, &sched.swap_in) {
                self.scheduler.reset_prefix_cache();
                self.scheduler.step_failed(&sched);
                return Err(e);
            }
            let n = (sched.swap_out.len() + sched.swap_in.len()) as u64;
            self.stats.blocks_swapped_out += sched.swap_out.len() as u64;
            self.stats.blocks_swapped_in += sched.swap_in.len() as u64;
            self.stats.swap_bytes += n * (self.runner.kv_bytes() / self.runner.num_blocks() as u64);
        }
        if sched.is_empty() {
            return Ok(Vec::new());
        }
        let (input, step) = match self.prepare_step(sched) {
            Ok(x) => x,
            Err((e, sched)) => {
                self.scheduler.step_failed(&sched);
                return Err(e);
            }
        };
        let reduce = &step.reduce;
        let runner = &mut self.runner;
        let execute = move || runner.execute(input, reduce);
        // NOTE: the structured-output masks are computed while the model runs (as vLLM
        // overlaps them): they depend only on each request's output so far.
        let constrained = constrained_matchers(&mut self.states, &step.sampling);
        let (executed, masks) = if constrained.is_empty() {
            (execute(), HashMap::new())
        } else {
            // NOTE: the model runs on this thread (a GPU context is bound to it); the masks
            // on a scoped one.
            let ids: Vec<RequestId> = constrained.iter().map(|(id, _)| *id).collect();
            std::thread::scope(|scope| {
                let masks = scope.spawn(move || compute_masks(constrained));
                let executed = execute();
                let masks = masks.join().unwrap_or_else(|_| {
                    ids.into_iter()
                        .map(|id| (id, Err("the mask thread panicked".to_string())))
                        .collect()
                });
                (executed, masks)
            })
        };
        let outputs = match executed {
            Ok(result) => self.complete_step(step, result, masks),
            Err(e) => {
                // NOTE: blocks registered in the prefix cache this step were not (all)
                // written: forget every cached prefix rather than let a later request read
                // them.
                self.scheduler.reset_prefix_cache();
                self.scheduler.step_failed(&step.sched);
                return Err(e);
            }
        };
        self.stats.step_time_s += t0.elapsed().as_secs_f64();
        outputs
    }

    /// A step of pipeline parallelism: up to `depth` (the stages) steps in flight, each of
    /// other requests (a request is in one step at a time: its next token needs the last). A
    /// call schedules and starts a new step while there is room and something to run, and
    /// returns at once; once the queue is full, or nothing more can be scheduled, it waits for
    /// the oldest step and returns its outputs. The stages then work on different steps at
    /// the same time instead of taking turns. Each worker runs its steps in the order they were
    /// started, so a block freed and handed to a new request is written by the new step only
    /// after the old one is done with it.
    fn step_pipelined(&mut self) -> Result<Vec<StepOutput>> {
        let t0 = Instant::now();
        let mut started = false;
        if self.pending.len() < self.depth {
            self.propose_drafts();
            let sched = self.scheduler.schedule();
            self.stats.preemptions += sched.preempted.len() as u64;
            // NOTE: swap preemption keeps one step in flight (`Engine::new`).
            debug_assert!(sched.swap_out.is_empty() && sched.swap_in.is_empty());
            if !sched.is_empty() {
                let (input, step) = match self.prepare_step(sched) {
                    Ok(x) => x,
                    Err((e, sched)) => {
                        self.scheduler.step_failed(&sched);
                        return Err(self.fail_pending(e));
                    }
                };
                if let Err(e) = self.runner.start(input, step.reduce.clone()) {
                    self.scheduler.step_failed(&step.sched);
                    return Err(self.fail_pending(e));
                }
                self.stats.overlapped_steps += u64::from(!self.pending.is_empty());
                self.pending.push_back(step);
                started = true;
            }
        }
        if started && self.pending.len() < self.depth {
            self.stats.step_time_s += t0.elapsed().as_secs_f64();
            return Ok(Vec::new());
        }
        let Some(step) = self.pending.pop_front() else {
            return Ok(Vec::new());
        };
        // NOTE: the masks are computed while the stages run the steps in flight.
        let masks = compute_masks(constrained_matchers(&mut self.states, &step.sampling));
        let outputs = match self.runner.finish() {
            Ok(result) => self.complete_step(step, result, masks),
            Err(e) => {
                self.scheduler.step_failed(&step.sched);
                return Err(self.fail_pending(e));
            }
        };
        self.stats.step_time_s += t0.elapsed().as_secs_f64();
        outputs
    }

    /// After a failed step with others in flight: the runner has dropped them all; their
    /// requests are scheduled again from where they were, and the cached prefixes (whose
    /// blocks were not all written) are forgotten.
    fn fail_pending(&mut self, e: anyhow::Error) -> anyhow::Error {
        for step in std::mem::take(&mut self.pending) {
            self.scheduler.step_failed(&step.sched);
        }
        self.scheduler.reset_prefix_cache();
        e
    }
}
