//! The engine step — schedule, execute, update — and the front APIs built on it: [`Engine`]
//! (add_request / step / abort, streaming per-step outputs, for the server) and [`LLM`]
//! (offline batch generation and chat).

pub mod launch;
mod llm;
mod nodes;
pub mod runner;
mod worker;
mod workers;

pub use llm::{CompletionOutput, LLM, RequestOutput};
pub use runner::{KvBudget, ModelRunner, StepResult};

use crate::backend::{BackendKind, BatchInput};
use crate::kv::{KvCacheManager, KvUsage, NULL_BLOCK, PrefixCacheStats};
use crate::models::{KvCacheDtype, ModelConfig, load_model};
use crate::parallel::{NodeConfig, ParallelConfig};
use crate::sampling::{Choice, LogitEdit, RowSampling};
use crate::sampling::{
    IncrementalDetokenizer, InvalidParam, Restrict, SamplingDefaults, SamplingParams, StopChecker,
    StructuredCompiler, TokenLogprobs, sampler::sample_restricted, sampler::uniform_bits,
    structured::allowed_tokens, token_logprob,
};
use crate::sched::{
    FinishReason, PreemptionMode, Request, RequestId, Scheduler, SchedulerConfig, SchedulerOutput,
    SchedulingPolicy,
};
use crate::tensor::WeightDtype;
use crate::tokenizer::{ChatMessage, Tokenizer};
use anyhow::{Context, Result, bail, ensure};
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
        }
    }
}

/// Whether a request's next token can be chosen where the logits are ([`RowSampling`]: the
/// host sampler's logit bias, banned tokens and penalties, then greedy or its temperature,
/// top-k, top-p and min-p with its draw, and the raw log-probabilities): no structured output,
/// whose grammar is on the host.
fn samples_anywhere(p: &SamplingParams) -> bool {
    p.structured.is_none()
}

/// How a request that [`samples_anywhere`] chooses its next token, as the host sampler would:
/// the edits of its logit bias, the tokens it may not choose yet (`banned`) and its penalties
/// over `prompt` and `output` (tokens past `vocab` ignored), then greedy (also top-k 1) as the
/// argmax, or a draw of `(seed, step)` with `step` the output's length; the log-probabilities
/// it asks for, or the chosen token's alone where `best_of` ranks its sequences by them.
fn row_sampling(
    p: &SamplingParams,
    seed: u64,
    prompt: &[u32],
    output: &[u32],
    banned: &[u32],
    vocab: usize,
) -> RowSampling {
    let mut edits: HashMap<u32, LogitEdit> = HashMap::new();
    fn edit(edits: &mut HashMap<u32, LogitEdit>, t: u32) -> &mut LogitEdit {
        edits.entry(t).or_insert(LogitEdit {
            token: t,
            ..Default::default()
        })
    }
    for (&t, &b) in &p.logit_bias {
        edit(&mut edits, t).bias += b;
    }
    for &t in banned {
        edit(&mut edits, t).banned = true;
    }
    if p.repetition_penalty != 1.0 {
        for &t in prompt.iter().chain(output) {
            edit(&mut edits, t).seen = true;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for &t in output {
            edit(&mut edits, t).count += 1;
        }
    }
    let mut edits: Vec<LogitEdit> = edits
        .into_values()
        .filter(|e| (e.token as usize) < vocab)
        .collect();
    edits.sort_unstable_by_key(|e| e.token);
    let mut row = RowSampling {
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        edits,
        logprobs: p
            .logprobs
            .or((p.best_of() > p.n).then_some(0))
            .map(|k| k as u32),
        ..RowSampling::GREEDY
    };
    if !p.chooses_argmax() {
        row.temperature = p.temperature;
        row.top_k = p
            .effective_top_k()
            .map_or(0, |k| k.min(u32::MAX as usize) as u32);
        row.top_p = p.top_p;
        row.min_p = p.min_p;
        row.u53 = uniform_bits(seed, output.len());
    }
    row
}

/// The token sequences of `bad_words` (vLLM's way): each word as written and with a leading
/// space, since a word mid-sentence is usually tokenized with its space.
fn bad_word_ids(tok: &Tokenizer, words: &[String]) -> Result<Vec<Vec<u32>>, RequestError> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for w in words {
        let w = w.trim_start();
        for text in [w.to_string(), format!(" {w}")] {
            let ids = tok
                .inner()
                .encode_fast(text.as_str(), false)
                .map_err(|e| RequestError::Internal(anyhow::anyhow!("tokenizing failed: {e}")))?
                .get_ids()
                .to_vec();
            if !ids.is_empty() && !out.contains(&ids) {
                out.push(ids);
            }
        }
    }
    Ok(out)
}

/// The tokens a sample may not choose next: its stop tokens while it has fewer than
/// `min_tokens`, and the last token of each bad word whose other tokens end the output.
fn banned_tokens(st: &RequestState, output: &[u32]) -> Vec<u32> {
    let mut banned = Vec::new();
    if output.len() < st.params.min_tokens {
        banned.extend_from_slice(&st.stop_ids);
    }
    for word in &st.bad_words {
        if let Some((&last, head)) = word.split_last()
            && output.ends_with(head)
        {
            banned.push(last);
        }
    }
    banned
}

/// The seed of sample `index` of a request seeded with `seed`: sample 0 keeps the request's
/// seed (so `n = 1` is unchanged), the others get independent streams (SplitMix64's mixer).
pub fn sample_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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

/// What one step produced for one completion of a request: the new tokens and text (deltas),
/// and whether it ended. With `best_of > n` the `n` chosen completions come whole, once all
/// `best_of` have ended.
#[derive(Debug, Clone)]
pub struct StepOutput {
    pub request_id: RequestId,
    /// Which of the request's `n` completions (0 when `n` is 1).
    pub index: usize,
    pub new_token_ids: Vec<u32>,
    pub new_text: String,
    /// One entry per new token when `logprobs` was asked for.
    pub new_logprobs: Vec<TokenLogprobs>,
    /// With `prompt_logprobs`, in the request's first output: the score of each prompt token
    /// after the first (which nothing predicts).
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    pub finish_reason: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
}

/// How likely the model found one prompt token, given the tokens before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub logprobs: TokenLogprobs,
    /// Its rank among all tokens (1 = the most likely).
    pub rank: usize,
}

fn prompt_logprob(row: &[f32], token: u32, k: usize) -> PromptLogprob {
    PromptLogprob {
        logprobs: crate::sampling::sampler::logprobs_of(row, token, k),
        rank: crate::sampling::sampler::rank_of(row, token) as usize,
    }
}

impl StepOutput {
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

/// One sequence the scheduler runs: a request, or one of its `best_of` samples.
struct RequestState {
    params: SamplingParams,
    seed: u64,
    /// The tokens that end this sample (EOS unless ignored, `stop_token_ids`): banned before
    /// `min_tokens`.
    stop_ids: Vec<u32>,
    /// `bad_words`, tokenized.
    bad_words: Vec<Vec<u32>>,
    /// The structured-output constraint's state: what the output may continue with.
    matcher: Option<llguidance::Matcher>,
    /// `prompt_logprobs`: the scores of prompt tokens 1.. so far, sent with the first output.
    prompt_logprobs: Vec<PromptLogprob>,
    prompt_logprobs_sent: bool,
    detok: IncrementalDetokenizer,
    stop: StopChecker,
    /// The request (the id its caller knows) and this sample's place in it.
    group: RequestId,
    index: usize,
    /// Sum of the sampled tokens' log-probabilities (ranks the samples of `best_of`).
    cum_logprob: f64,
}

/// The samples of one request. Its id is its first sample's.
struct Group {
    seqs: Vec<RequestId>,
    unfinished: usize,
    /// `best_of > n`: every sample's output so far, kept until all have ended.
    ranked: Option<Ranked>,
}

struct Ranked {
    /// How many samples to return.
    n: usize,
    /// Each sample's whole output and its cumulative log-probability.
    kept: Vec<(StepOutput, f64)>,
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
}

/// A scheduled step on its way through the model, and what its results are for.
struct PendingStep {
    sched: SchedulerOutput,
    /// The requests that sample a token, and the logits row of each.
    sampling: Vec<RequestId>,
    sample_rows: Vec<usize>,
    /// The prompt rows asked for by `prompt_logprobs`: (request, position whose next token
    /// they score, row).
    prompt_rows: Vec<(RequestId, usize, usize)>,
    /// How each logits row is reduced: its token chosen where the logits are (greedy rows,
    /// and random ones where the backend samples), or `None`: its logits come to the host.
    reduce: Vec<Option<RowSampling>>,
}

/// A structured-output request's allowed tokens for the next step, or why there are none.
type Masked = std::result::Result<llguidance::toktrie::SimpleVob, String>;

/// The matchers of the constrained requests among `sampling`.
/// NOTE: nothing is collected in a step without a constrained row (the common case).
fn constrained_matchers<'a>(
    states: &'a mut HashMap<RequestId, RequestState>,
    sampling: &[RequestId],
) -> Vec<(RequestId, &'a mut llguidance::Matcher)> {
    if !sampling
        .iter()
        .any(|id| states.get(id).is_some_and(|st| st.matcher.is_some()))
    {
        return Vec::new();
    }
    let wanted: std::collections::HashSet<RequestId> = sampling.iter().copied().collect();
    states
        .iter_mut()
        .filter(|(id, _)| wanted.contains(id))
        .filter_map(|(id, st)| st.matcher.as_mut().map(|m| (*id, m)))
        .collect()
}

fn compute_masks(
    constrained: Vec<(RequestId, &mut llguidance::Matcher)>,
) -> HashMap<RequestId, Masked> {
    constrained
        .into_iter()
        .map(|(id, m)| (id, allowed_tokens(m)))
        .collect()
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
}

/// The model loaded (its file mapped, not yet its weights) and the runner's settings, checked.
fn prepare(args: &EngineArgs) -> Result<(crate::models::LoadedModel, runner::RunnerArgs)> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::fetch::default_model()?,
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
    };
    Ok((model, runner_args))
}

/// A node other than 0 of a run over several nodes (`--nnodes`, `--node-rank` 1 or more):
/// loads its workers' shards and runs their steps for the engine on node 0, returning when
/// node 0 closes the connections.
pub fn run_worker_node(args: EngineArgs) -> Result<()> {
    let (model, runner_args) = prepare(&args)?;
    launch::serve_node(&model, &runner_args)
}

impl Engine {
    pub fn new(args: EngineArgs) -> Result<Self> {
        let (model, runner_args) = prepare(&args)?;
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
        Ok(Engine {
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
        params.validate()?;
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
            Some(0)
        } else {
            (best_of > 1).then_some(group + 1)
        };
        let mut seqs = Vec::with_capacity(best_of);
        for index in 0..best_of {
            let id = self.next_id;
            let req = Request::new(id, ids.clone(), max_tokens, stop_ids.clone());
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
        }
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

    /// The flattened batch of a schedule (see ARCHITECTURE.md, "One engine step"), and what
    /// its results are for. On an error the schedule comes back with it.
    fn prepare_step(
        &mut self,
        sched: SchedulerOutput,
    ) -> std::result::Result<(BatchInput, PendingStep), (anyhow::Error, SchedulerOutput)> {
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
        // The logits row of each sampled request, and the prompt rows asked for by
        // `prompt_logprobs`: (request, position whose next token they score, row).
        let mut sample_rows = Vec::new();
        let mut prompt_rows: Vec<(RequestId, usize, usize)> = Vec::new();
        for s in &sched.scheduled {
            let Some(req) = self.scheduler.request(s.id) else {
                return Err((anyhow::anyhow!("scheduled request is unknown"), sched));
            };
            let range = s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens;
            // NOTE: positions whose scores were taken before (a preempted request recomputes
            // its prompt) are not taken again.
            if let Some(st) = self.states.get(&s.id)
                && st.params.prompt_logprobs.is_some()
                && !st.prompt_logprobs_sent
            {
                let first = range.start.max(st.prompt_logprobs.len());
                let last = range.end.min(req.prompt_len.saturating_sub(1));
                for pos in first..last {
                    let row = input.token_ids.len() + (pos - range.start);
                    input.logits_rows.push(row as u32);
                    prompt_rows.push((s.id, pos, input.logits_rows.len() - 1));
                }
            }
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
                sample_rows.push(input.logits_rows.len() - 1);
            }
        }
        self.stats.batched_tokens += input.token_ids.len() as u64;
        // NOTE: where a row is sampled depends on its request and the backend only, never on
        // the rest of the batch, so a seeded request gives the same tokens in any batch.
        let on_device = self.runner.samples_on_device();
        let mut reduce = vec![None; input.logits_rows.len()];
        for (id, &row) in sampling.iter().zip(&sample_rows) {
            let (Some(st), Some(req)) = (self.states.get(id), self.scheduler.request(*id)) else {
                continue;
            };
            let p = &st.params;
            // NOTE: a backend that does not sample takes plain greedy rows only: no edits are
            // built for a random row that will be sampled on the host anyway.
            if !samples_anywhere(p) || !(on_device || p.chooses_argmax()) {
                continue;
            }
            let banned = banned_tokens(st, req.output());
            let how = row_sampling(
                &st.params,
                st.seed,
                req.prompt(),
                req.output(),
                &banned,
                self.config.vocab_size,
            );
            if on_device || how.is_plain_greedy() {
                reduce[row] = Some(how);
            }
        }
        if on_device {
            for &(id, pos, row) in &prompt_rows {
                let (Some(st), Some(req)) = (self.states.get(&id), self.scheduler.request(id))
                else {
                    continue;
                };
                reduce[row] = Some(RowSampling {
                    score: Some(req.tokens[pos + 1]),
                    logprobs: st.params.prompt_logprobs.map(|k| k as u32),
                    ..RowSampling::GREEDY
                });
            }
        }
        Ok((
            input,
            PendingStep {
                sched,
                sampling,
                sample_rows,
                prompt_rows,
                reduce,
            },
        ))
    }

    /// Samples a step's tokens from its results and applies them: the scheduler's update, stop
    /// strings, detokenization, the outputs.
    fn complete_step(
        &mut self,
        step: PendingStep,
        result: StepResult,
        mut masks: HashMap<RequestId, Masked>,
    ) -> Result<Vec<StepOutput>> {
        let PendingStep {
            sched,
            sampling,
            sample_rows,
            prompt_rows,
            reduce,
        } = step;
        let vocab = self.config.vocab_size;
        let StepResult {
            mut choices,
            logits,
        } = result;
        // Where each row's logits are in `logits` (rows that came back as a token have none).
        let mut host_row = Vec::with_capacity(reduce.len());
        let mut n = 0;
        for c in &choices {
            host_row.push(n);
            n += usize::from(c.is_none());
        }
        ensure!(
            choices.len() == reduce.len() && logits.len() == n * vocab,
            "the runner returned {} tokens and {} logits for {} rows",
            choices.len(),
            logits.len(),
            reduce.len()
        );

        // NOTE: a request aborted while its step was in flight has no state any more: its
        // results are dropped.
        for &(id, pos, row) in &prompt_rows {
            let (Some(req), Some(st)) = (self.scheduler.request(id), self.states.get_mut(&id))
            else {
                continue;
            };
            let scored = match choices[row].take() {
                Some(Choice {
                    logprobs: Some(logprobs),
                    rank,
                    ..
                }) => PromptLogprob {
                    logprobs,
                    rank: rank as usize,
                },
                Some(_) => bail!("the runner brought back no log-probabilities for a prompt row"),
                None => {
                    let row = host_row[row];
                    let row = &logits[row * vocab..(row + 1) * vocab];
                    let next = req.tokens[pos + 1];
                    let k = st.params.prompt_logprobs.unwrap_or(0);
                    prompt_logprob(row, next, k)
                }
            };
            st.prompt_logprobs.push(scored);
        }
        let mut sampled = HashMap::new();
        let mut logprobs = HashMap::new();
        for (i, id) in sampling.iter().enumerate() {
            let i = sample_rows[i];
            if let Some(c) = choices[i].take() {
                self.stats.random_samples_on_device +=
                    u64::from(reduce[i].as_ref().is_some_and(|r| !r.is_greedy()));
                sampled.insert(*id, c.token);
                if let (Some(lp), Some(st)) = (c.logprobs, self.states.get_mut(id)) {
                    if st.params.best_of() > st.params.n {
                        st.cum_logprob += lp.logprob as f64;
                    }
                    if st.params.logprobs.is_some() {
                        logprobs.insert(*id, lp);
                    }
                }
                continue;
            }
            let i = host_row[i];
            let (Some(req), Some(st)) = (self.scheduler.request(*id), self.states.get_mut(id))
            else {
                continue;
            };
            let row = &logits[i * vocab..(i + 1) * vocab];
            let banned = banned_tokens(st, req.output());
            // NOTE: a grammar that fails midway lets the output end (its stop tokens only)
            // rather than take the step down.
            let mask = match masks.remove(id) {
                Some(Ok(v)) => Some(v),
                Some(Err(e)) => {
                    tracing::warn!("request {id}: structured output failed: {e}");
                    let mut v = llguidance::toktrie::SimpleVob::alloc(vocab);
                    st.stop_ids.iter().for_each(|&t| v.allow_token(t));
                    Some(v)
                }
                None => None,
            };
            let restrict = Restrict {
                banned: &banned,
                allowed: mask.as_ref().map(|m| m.as_slice()),
            };
            let tok = sample_restricted(
                row,
                &st.params,
                req.prompt(),
                req.output(),
                &restrict,
                st.seed,
                req.output().len(),
            );
            if let Some(m) = &mut st.matcher
                && let Err(e) = m.consume_token(tok.token_id)
            {
                tracing::warn!("request {id}: structured output failed: {e:#}");
            }
            if st.params.best_of() > st.params.n {
                st.cum_logprob += match &tok.logprobs {
                    Some(lp) => lp.logprob,
                    None => token_logprob(row, tok.token_id),
                } as f64;
            }
            sampled.insert(*id, tok.token_id);
            if let Some(lp) = tok.logprobs {
                logprobs.insert(*id, lp);
            }
        }

        let events = self.scheduler.update_from_output(&sched, &sampled);
        let mut outputs = Vec::with_capacity(events.len());
        for ev in events {
            self.stats.generated_tokens += 1;
            let n_out = self
                .scheduler
                .request(ev.id)
                .map_or(0, |r| r.output().len());
            let st = self
                .states
                .get_mut(&ev.id)
                .context("request state is missing")?;
            // NOTE: the token that ends a request (EOS, a stop token id) is not part of its
            // text, as in vLLM, also when special tokens are kept.
            let delta =
                if ev.finished == Some(FinishReason::Stop) && st.stop_ids.contains(&ev.token) {
                    String::new()
                } else {
                    st.detok.push(ev.token)?
                };
            let (mut text, stopped) = if n_out <= st.params.min_tokens {
                (st.stop.push_unchecked(&delta), false)
            } else {
                st.stop.push(&delta)
            };
            let mut finish = ev.finished;
            // NOTE: a grammar that is complete and allows nothing more ends the output here
            // (the mask would allow only EOS next).
            let grammar_done = finish.is_none()
                && !stopped
                && st
                    .matcher
                    .as_ref()
                    .is_some_and(|m| m.is_stopped() && !st.stop_ids.contains(&ev.token));
            let stopped = stopped || grammar_done;
            if grammar_done {
                text.push_str(&st.stop.flush());
            }
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
            let prompt_logprobs = if st.params.prompt_logprobs.is_some() && !st.prompt_logprobs_sent
            {
                st.prompt_logprobs_sent = true;
                Some(std::mem::take(&mut st.prompt_logprobs))
            } else {
                None
            };
            let out = StepOutput {
                prompt_logprobs,
                request_id: st.group,
                index: st.index,
                new_token_ids: vec![ev.token],
                new_text: text,
                new_logprobs: logprobs.remove(&ev.id).into_iter().collect(),
                finish_reason: finish,
                num_prompt_tokens: req.prompt_len,
                num_output_tokens: req.output().len(),
            };
            let (group, cum_logprob) = (st.group, st.cum_logprob);
            if finish.is_some() {
                self.scheduler.remove_finished(ev.id);
                self.states.remove(&ev.id);
            }
            self.emit(group, out, cum_logprob, &mut outputs)?;
        }
        self.stats.steps += 1;
        Ok(outputs)
    }

    /// Passes a sample's output on, or keeps it while its request ranks `best_of` samples; ends
    /// the request when its last sample ends.
    fn emit(
        &mut self,
        group: RequestId,
        out: StepOutput,
        cum_logprob: f64,
        outputs: &mut Vec<StepOutput>,
    ) -> Result<()> {
        let g = self
            .groups
            .get_mut(&group)
            .context("request group is missing")?;
        let finished = out.finished();
        match &mut g.ranked {
            None => outputs.push(out),
            Some(r) => match r.kept.iter_mut().find(|(k, _)| k.index == out.index) {
                Some((k, score)) => {
                    k.new_token_ids.extend(out.new_token_ids);
                    k.new_text.push_str(&out.new_text);
                    k.new_logprobs.extend(out.new_logprobs);
                    k.finish_reason = out.finish_reason;
                    k.num_output_tokens = out.num_output_tokens;
                    *score = cum_logprob;
                }
                None => r.kept.push((out, cum_logprob)),
            },
        }
        if finished {
            g.unfinished -= 1;
        }
        if g.unfinished > 0 {
            return Ok(());
        }
        let g = self
            .groups
            .remove(&group)
            .context("request group is missing")?;
        if let Some(mut r) = g.ranked {
            // The n most likely samples, best first (ties: the lower sample index).
            r.kept
                .sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.index.cmp(&b.0.index)));
            for (index, (mut out, _)) in r.kept.into_iter().take(r.n).enumerate() {
                out.index = index;
                outputs.push(out);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha8Rng;
    use rand_chacha::rand_core::{Rng, SeedableRng};

    /// The edits a row carries to the device, applied as the kernel applies them, choose the
    /// token the host sampler chooses for a greedy request with the same bias, bans and
    /// penalties (tokens past the vocabulary ignored by both).
    #[test]
    fn device_edits_give_the_host_samplers_greedy_choice() {
        let mut r = ChaCha8Rng::seed_from_u64(4);
        let vocab = 300;
        let mut differs = 0;
        for trial in 0..300 {
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (r.next_u32() % 2000) as f32 / 250.0 - 4.0)
                .collect();
            let mut ids = |n: usize| -> Vec<u32> {
                (0..n).map(|_| r.next_u32() % (vocab as u32 + 5)).collect()
            };
            let (prompt, output, banned) = (ids(40), ids(trial % 30), ids(trial % 3));
            let mut params = SamplingParams {
                repetition_penalty: [1.0, 1.3, 0.8][trial % 3],
                presence_penalty: [0.0, 0.5, -0.4][trial % 3],
                frequency_penalty: [0.3, 0.0, 0.2][trial % 3],
                ..SamplingParams::greedy()
            };
            for t in ids(trial % 4) {
                params.logit_bias.insert(t, 2.5);
            }
            let row = row_sampling(&params, 1, &prompt, &output, &banned, vocab);
            assert!(row.is_greedy());
            let device = crate::backend::argmax(&row.edited(&logits)) as u32;
            let restrict = Restrict {
                banned: &banned,
                allowed: None,
            };
            let host = sample_restricted(&logits, &params, &prompt, &output, &restrict, 1, 0);
            assert_eq!(device, host.token_id, "trial {trial}");
            differs += usize::from(device != crate::backend::argmax(&logits) as u32);
        }
        assert!(
            differs > 100,
            "the edits changed only {differs} of 300 choices"
        );
    }
}
