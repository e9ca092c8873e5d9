//! The `pagoda` command line: generate, chat, serve, bench, info.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use pagoda::engine::{KvBudget, LoraModule};
use pagoda::models::KvCacheDtype;
use pagoda::models::pooling::{PoolingType, Task};
use pagoda::sampling::{SamplingDefaults, StructuredOutput};
use pagoda::sched::{NgramConfig, PreemptionMode, SchedulingPolicy};
use pagoda::{BackendKind, ChatMessage, EngineArgs, LLM, Prompt, SamplingParams, WeightDtype};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "pagoda",
    version,
    about = "LLM inference with a paged KV cache and continuous batching"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Threads for the CPU's work (default: $RAYON_NUM_THREADS, else one per physical core).
    #[arg(long, global = true, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate continuations of prompts, all run as one batch.
    Generate {
        /// Prompts (each one a request).
        prompts: Vec<String>,
        /// Read prompts from a file, one per line.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Apply the model's chat template to each prompt (as a user message).
        #[arg(long)]
        chat_template: bool,
        /// Print one JSON object per request (prompt and output token ids, text, logprobs)
        /// instead of the text.
        #[arg(long)]
        json: bool,
        /// Generate through this LoRA adapter (a name of --lora-modules).
        #[arg(long)]
        lora: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// Embed texts with a model served for embeddings (as --task embed): one JSON object per
    /// text, with its embedding; or, with --query, each text's relevance score to it (a
    /// reranker's, with --task score; else the cosine of the embeddings).
    Embed {
        /// Texts (each one a request).
        texts: Vec<String>,
        /// Read texts from a file, one per line.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Cut the embeddings to this many dimensions (Matryoshka models).
        #[arg(long)]
        dimensions: Option<usize>,
        /// Score each text against this query instead.
        #[arg(long)]
        query: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Chat interactively; tokens stream as they come.
    Chat {
        /// A system prompt.
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// Serve the OpenAI API (`/v1/completions`, `/v1/chat/completions`, ...) over HTTP.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        server: ServeArgs,
    },
    /// Show the model, its architecture and size, the backend and the KV pool.
    Info {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Run every backend operation against the CPU backend on fresh random inputs and print
    /// a table of the errors (exit status 1 if any case fails).
    CheckBackend {
        /// cuda, hip, wgpu or cpu.
        #[arg(long, default_value = "cuda")]
        backend: BackendKind,
        /// Seed of the random inputs.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Benchmarks: throughput, latency, a serving load, reports (see docs/benchmarks.md).
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

// NOTE: parsed once per run; the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum BenchCommand {
    /// Offline throughput: all requests at once; continuous against static batching, KV
    /// utilization against a reserve-per-request engine.
    Throughput {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        bench: pagoda::bench::ThroughputArgs,
    },
    /// Latency of one batch run repeatedly (TTFT, TPOT, end-to-end), swept over batch sizes.
    Latency {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        bench: pagoda::bench::LatencyArgs,
    },
    /// Load against any OpenAI-compatible server (Pagoda, llama-server, vLLM), streaming.
    Serve(pagoda::bench::ServeBenchArgs),
    /// Markdown table and SVG chart from JSON results.
    Report(pagoda::bench::ReportArgs),
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A GGUF file, an HF-layout directory, or a hub name: ORG/NAME (an HF-layout repository)
    /// or ORG/NAME:QUANT (a GGUF repository's file for that quant), from the Hugging Face cache
    /// or downloaded into it. Default: SmolLM2-135M-Instruct (fetched once; its Q4_1 weights run as an f16 copy).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// The hub revision (branch, tag or commit) of a model given by name.
    #[arg(long)]
    revision: Option<String>,
    /// The GGUF file to take from a hub repository given by name (instead of the :QUANT rule).
    #[arg(long)]
    gguf_file: Option<String>,
    /// cpu, wgpu, cuda, hip or auto. `bench` takes a list (cpu,wgpu,cuda): one run each.
    #[arg(long, default_value = "cpu", value_delimiter = ',')]
    backend: Vec<BackendKind>,
    /// Weights in memory: auto (as the file stores them: a GGUF's Q4_0..Q6_K blocks stay
    /// quantized on the CPU backend), or every weight as f32, f16 or bf16 (f32 reproduces the
    /// reference outputs exactly).
    #[arg(long, default_value = "auto")]
    dtype: WeightDtype,
    /// KV cache element type: auto (the weights' type where the backend stores it: bf16 or
    /// f16 weights keep a bf16 or f16 cache on CUDA/HIP; f32 otherwise), f32, bf16, f16 or
    /// fp8 (E4M3, half of bf16's bytes: values rounded to 3 mantissa bits and saturated at
    /// ±448, no scaling; CUDA and HIP only). The CPU backend stores f32, bf16 and f16; wgpu f32.
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: KvCacheDtype,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV pool size in bytes (suffixes K, M, G, KiB, MiB, GiB accepted).
    #[arg(long, value_parser = parse_bytes)]
    kv_cache_memory: Option<u64>,
    /// Fraction of device (or system) memory for weights plus KV pool, as vLLM's
    /// --gpu-memory-utilization (also accepted). Ignored when --kv-cache-memory is given.
    #[arg(long, alias = "gpu-memory-utilization")]
    memory_utilization: Option<f64>,
    /// Token budget per step (default: 512 on the CPU backend, 2048 on GPUs).
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Context length limit (default: the model's).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Reuse the K/V of cached prompt prefixes across requests (the default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    enable_prefix_caching: bool,
    /// Compute every prompt in full (the samples of one request still share their prompt).
    #[arg(long, overrides_with = "enable_prefix_caching")]
    no_enable_prefix_caching: bool,
    /// The largest `n` and `best_of` a request may ask for.
    #[arg(long, default_value_t = 16)]
    max_n: usize,
    /// What preemption does with a request's K/V when blocks run out: recompute (free them,
    /// compute again later) or swap (copy them to host memory and back).
    #[arg(long, default_value = "recompute", value_parser = PreemptionMode::parse)]
    preemption_mode: PreemptionMode,
    /// Host memory for swapped-out KV blocks, in GiB (with --preemption-mode swap).
    #[arg(long, default_value_t = 4.0)]
    swap_space: f64,
    /// Split every layer's heads and MLP over this many workers (Megatron-style tensor
    /// parallelism): one per GPU on cuda/hip (NCCL/RCCL between them); on the CPU the workers
    /// share the cores.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
    /// Split the layers into this many pipeline stages, one worker each (times
    /// --tensor-parallel-size), with one step per stage in flight.
    #[arg(long, default_value_t = 1)]
    pipeline_parallel_size: usize,
    /// Spread the workers over this many nodes (processes, on one machine or several): node 0
    /// runs the engine and the command; every other node runs the same command with its own
    /// --node-rank and serves its workers only.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's rank, 0 to --nnodes - 1.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Where node 0 listens for the other nodes (with --nnodes).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds node 0 waits for the other nodes to connect and load (and they for node 0).
    #[arg(long, default_value_t = 600.0)]
    rendezvous_timeout: f64,
    /// What the model is served for: generate, embed (/v1/embeddings) or score (/v1/score and
    /// /v1/rerank: a cross-encoder, or a decoder reranker with --classifier-from-token).
    #[arg(long, value_parser = Task::parse)]
    task: Option<Task>,
    /// vLLM's --runner: generate, or pooling (embeddings unless --convert says otherwise).
    #[arg(long)]
    runner: Option<String>,
    /// vLLM's --convert: embed, or classify (as --task score).
    #[arg(long, value_parser = Task::parse)]
    convert: Option<Task>,
    /// Pool embeddings as mean, cls or last (default: the model's sentence-transformers
    /// config, else last with L2 normalization).
    #[arg(long, value_parser = PoolingType::parse)]
    pooling_type: Option<PoolingType>,
    /// Score with the logits of these tokens (`no,yes`: the sigmoid of their difference, as
    /// Qwen3-Reranker), instead of a classifier in the checkpoint.
    #[arg(long, value_delimiter = ',')]
    classifier_from_token: Option<Vec<String>>,
    /// Speculative decoding, as vLLM's JSON: `{"method": "ngram", "num_speculative_tokens": K,
    /// "prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}` (prompt
    /// lookup: drafts copied from the context, verified in the same step; every request but
    /// those with structured output uses it, and outputs are unchanged, seeded ones included)
    #[arg(long, value_parser = NgramConfig::from_json)]
    speculative_config: Option<NgramConfig>,
    /// Serve LoRA adapters beside the base model (requests name one as their model).
    #[arg(long)]
    enable_lora: bool,
    /// Adapters loaded at start, as NAME=PATH (a PEFT adapter directory or a GGUF adapter file) or vLLM's JSON
    /// `{"name": ..., "path": ..., "base_model_name": ...}`; needs --enable-lora.
    #[arg(long, num_args = 1.., value_parser = parse_lora_module)]
    lora_modules: Vec<LoraModule>,
    /// The most distinct adapters in one step (others wait), and on the device at once.
    #[arg(long, default_value_t = 1)]
    max_loras: usize,
    /// Adapters of a larger rank are refused.
    #[arg(long, default_value_t = 16)]
    max_lora_rank: usize,
    /// The most adapters loaded at once, kept in host memory (the --max-loras used last are
    /// on the device); a run-time load beyond it is refused (default: 16, or --max-loras or the
    /// --lora-modules given if more).
    #[arg(long)]
    max_cpu_loras: Option<usize>,
}

/// `--lora-modules`: `NAME=PATH`, or vLLM's JSON form.
fn parse_lora_module(s: &str) -> Result<LoraModule, String> {
    if s.trim_start().starts_with('{') {
        let v: serde_json::Value =
            serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))?;
        let field = |k: &str| v[k].as_str().map(String::from);
        return match (field("name"), field("path")) {
            (Some(name), Some(p)) if !name.is_empty() => Ok(LoraModule {
                name,
                path: PathBuf::from(p),
                base_model_name: field("base_model_name"),
            }),
            _ => Err("the JSON form needs string fields \"name\" and \"path\"".into()),
        };
    }
    match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !p.is_empty() => Ok(LoraModule {
            name: n.to_string(),
            path: PathBuf::from(p),
            base_model_name: None,
        }),
        _ => Err(format!("expected NAME=PATH, got '{s}'")),
    }
}

impl ModelArgs {
    fn engine_args(&self) -> Result<EngineArgs> {
        if !(self.swap_space.is_finite() && self.swap_space >= 0.0) {
            anyhow::bail!("--swap-space must be a number of GiB >= 0");
        }
        let kv_budget = match (self.kv_cache_memory, self.memory_utilization) {
            (Some(b), _) => Some(KvBudget::Bytes(b)),
            (None, Some(f)) => Some(KvBudget::Fraction(f)),
            _ => None,
        };
        if self.backend.len() > 1 {
            tracing::warn!("several backends given: only `bench` runs each; using the first");
        }
        let task = match (self.task, self.convert, self.runner.as_deref()) {
            (Some(t), _, _) | (None, Some(t), _) => t,
            (None, None, None | Some("generate")) => Task::Generate,
            (None, None, Some("pooling")) => Task::Embed,
            (None, None, Some(r)) => anyhow::bail!("unknown --runner '{r}' (generate, pooling)"),
        };
        Ok(EngineArgs {
            task,
            pooling_type: self.pooling_type,
            classifier_from_token: self.classifier_from_token.clone(),
            speculative: self.speculative_config,
            lora: pagoda::engine::LoraArgs {
                enable: self.enable_lora,
                max_loras: self.max_loras,
                max_lora_rank: self.max_lora_rank,
                max_cpu_loras: self.max_cpu_loras,
                modules: self.lora_modules.clone(),
            },
            model: self.model_path()?,
            backend: self.backend.first().copied().unwrap_or(BackendKind::Cpu),
            dtype: self.dtype,
            kv_cache_dtype: self.kv_cache_dtype,
            block_size: self.block_size,
            kv_budget,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            scheduling: SchedulingPolicy::Continuous,
            seed: 0,
            progress: true,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            max_n: self.max_n,
            preemption_mode: self.preemption_mode,
            swap_space: (self.swap_space * (1u64 << 30) as f64) as u64,
            parallel: pagoda::parallel::ParallelConfig {
                tensor: self.tensor_parallel_size,
                pipeline: self.pipeline_parallel_size,
            },
            nodes: pagoda::parallel::NodeConfig {
                nnodes: self.nnodes,
                node_rank: self.node_rank,
                master_addr: self.master_addr.clone(),
                master_port: self.master_port,
                timeout: std::time::Duration::try_from_secs_f64(self.rendezvous_timeout)
                    .map_err(|_| anyhow::anyhow!("--rendezvous-timeout must be seconds >= 0"))?,
            },
        })
    }

    /// `--model` as a local path: a hub name is looked up in the Hugging Face cache, or
    /// downloaded.
    fn model_path(&self) -> Result<Option<PathBuf>> {
        let name = self
            .model
            .as_ref()
            .and_then(|p| p.to_str())
            .filter(|s| pagoda::hub::is_hub_name(s));
        match name {
            Some(spec) => {
                let env = pagoda::hub::HubEnv::from_env();
                pagoda::hub::resolve(
                    &env,
                    spec,
                    self.revision.as_deref(),
                    self.gguf_file.as_deref(),
                )
                .map(Some)
            }
            None if self.revision.is_some() || self.gguf_file.is_some() => anyhow::bail!(
                "--revision and --gguf-file apply to a model given by its hub name (ORG/NAME), not to a local path"
            ),
            None => Ok(self.model.clone()),
        }
    }

    /// One `EngineArgs` per backend in `--backend`, for `bench`.
    fn engine_args_per_backend(&self) -> Result<Vec<(BackendKind, EngineArgs)>> {
        let mut kinds = self.backend.clone();
        kinds.dedup();
        kinds
            .into_iter()
            .map(|b| {
                let one = ModelArgs {
                    backend: vec![b],
                    ..self.clone()
                };
                one.engine_args().map(|a| (b, a))
            })
            .collect()
    }
}

#[derive(Args, Clone)]
struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the log says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model names clients may send (default: the --model argument, else the model's name).
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// Require `Authorization: Bearer KEY` on every /v1 route (default: $PAGODA_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Most requests waiting for the engine; more are refused with 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Seconds that running requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Largest request body in bytes (suffixes as for --kv-cache-memory).
    #[arg(long, default_value = "8MiB", value_parser = parse_bytes)]
    max_body_size: u64,
    /// Seconds a client gets to send a request's headers before its connection is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds an idle keep-alive connection (no request in flight) stays open (uvicorn's
    /// --timeout-keep-alive, as vLLM serves).
    #[arg(long, default_value_t = 5.0)]
    keep_alive_timeout: f64,
    /// Most open connections; more wait to be accepted. Default: 4096, or fewer where the
    /// open-file limit is lower.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Serve `tool_choice: "auto"`: the model decides whether to call tools, and its output
    /// is parsed with --tool-call-parser (as vLLM's flag of the same name).
    #[arg(long)]
    enable_auto_tool_choice: bool,
    /// How the model writes tool calls: hermes (Qwen 2.5/3, Hermes), llama3_json, mistral.
    #[arg(long)]
    tool_call_parser: Option<String>,
}

impl ServeArgs {
    fn server_args(&self, model: &ModelArgs) -> Result<pagoda::server::ServerArgs> {
        if !(self.shutdown_timeout.is_finite() && self.shutdown_timeout >= 0.0) {
            anyhow::bail!("--shutdown-timeout must be a number of seconds >= 0");
        }
        let seconds = |flag: &str, s: f64| {
            if s.is_finite() && s > 0.0 && s < 1e6 {
                Ok(std::time::Duration::from_secs_f64(s))
            } else {
                Err(anyhow::anyhow!(
                    "--{flag} must be a positive number of seconds, got {s}"
                ))
            }
        };
        if self.max_connections == Some(0) {
            anyhow::bail!("--max-connections must be at least 1");
        }
        let tool_call_parser = match (&self.tool_call_parser, self.enable_auto_tool_choice) {
            (Some(p), true) => Some(
                pagoda::server::tools::ToolCallParser::parse(p)
                    .map_err(|e| anyhow::anyhow!("--tool-call-parser: {e}"))?,
            ),
            (None, true) => anyhow::bail!("--enable-auto-tool-choice needs --tool-call-parser"),
            (Some(_), false) => anyhow::bail!(
                "--tool-call-parser is used for tool_choice \"auto\": add --enable-auto-tool-choice"
            ),
            (None, false) => None,
        };
        let served_model_names = if self.served_model_name.is_empty() {
            // As vLLM: the model is served under the name it was given on the command line.
            model
                .model
                .iter()
                .map(|p| p.display().to_string())
                .collect()
        } else {
            self.served_model_name.clone()
        };
        Ok(pagoda::server::ServerArgs {
            host: self.host.clone(),
            port: self.port,
            served_model_names,
            api_key: self
                .api_key
                .clone()
                .or_else(|| std::env::var("PAGODA_API_KEY").ok())
                .filter(|k| !k.is_empty()),
            max_waiting: self.max_waiting,
            shutdown_grace: std::time::Duration::from_secs_f64(self.shutdown_timeout),
            max_body_bytes: usize::try_from(self.max_body_size).unwrap_or(usize::MAX),
            header_read_timeout: seconds("header-timeout", self.header_timeout)?,
            idle_timeout: seconds("keep-alive-timeout", self.keep_alive_timeout)?,
            max_connections: self
                .max_connections
                .unwrap_or_else(pagoda::server::default_max_connections),
            tool_call_parser,
        })
    }
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// 0 = greedy. Default: greedy for `generate`; for `chat`, the model's own default
    /// (generation_config.json or GGUF), else 0.7.
    #[arg(long, allow_hyphen_values = true)]
    temperature: Option<f32>,
    /// Default: 1.0 (`chat`: the model's, else 0.9).
    #[arg(long, allow_hyphen_values = true)]
    top_p: Option<f32>,
    /// 0 or -1 = disabled (default; `chat`: the model's).
    #[arg(long, allow_hyphen_values = true)]
    top_k: Option<i32>,
    /// Default: 0 (`chat`: the model's).
    #[arg(long, allow_hyphen_values = true)]
    min_p: Option<f32>,
    /// Default: 1.0 (`chat`: the model's).
    #[arg(long, allow_hyphen_values = true)]
    repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Stop token ids (repeatable).
    #[arg(long)]
    stop_token_id: Vec<u32>,
    #[arg(long)]
    ignore_eos: bool,
    /// Log-probabilities of the N most likely tokens at each step (with --json).
    #[arg(long)]
    logprobs: Option<usize>,
    /// Completions per prompt (sampled: give a temperature).
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Generate this many completions per prompt and keep the `n` most likely.
    #[arg(long)]
    best_of: Option<usize>,
    /// The output must be JSON valid against the JSON schema in this file.
    #[arg(long, value_name = "FILE", group = "structured")]
    json_schema: Option<PathBuf>,
    /// The output must match this regular expression.
    #[arg(long, group = "structured")]
    regex: Option<String>,
    /// The output must be one of these strings (repeatable).
    #[arg(long, group = "structured")]
    choice: Vec<String>,
    /// The output must follow the Lark grammar in this file (llguidance's dialect).
    #[arg(long, value_name = "FILE", group = "structured")]
    grammar: Option<PathBuf>,
}

impl SamplingArgs {
    /// The flags given, as a set of overrides.
    fn explicit(&self) -> SamplingDefaults {
        SamplingDefaults {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        }
    }

    /// The structured-output constraint the flags ask for.
    fn structured(&self) -> Result<Option<StructuredOutput>> {
        let read = |p: &PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
        };
        Ok(if let Some(p) = &self.json_schema {
            let schema = serde_json::from_str(&read(p)?)
                .with_context(|| format!("{} is not valid JSON", p.display()))?;
            Some(StructuredOutput::Json(schema))
        } else if let Some(r) = &self.regex {
            Some(StructuredOutput::Regex(r.clone()))
        } else if !self.choice.is_empty() {
            Some(StructuredOutput::Choice(self.choice.clone()))
        } else if let Some(p) = &self.grammar {
            Some(StructuredOutput::Grammar(read(p)?))
        } else {
            None
        })
    }

    /// Parameters from the flags; what they leave out comes from `defaults`, then from `base`.
    fn params(&self, defaults: &SamplingDefaults, base: SamplingParams) -> Result<SamplingParams> {
        let base = SamplingParams {
            structured: self.structured()?,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            max_tokens: Some(self.max_tokens),
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_id.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            n: self.n,
            best_of: self.best_of,
            ..base
        };
        Ok(defaults.fill(&self.explicit(), base))
    }
}

/// `chat`'s defaults: the model's own, or temperature 0.7 and top-p 0.9 where the model sets
/// none (greedy decoding loops on small models).
fn chat_defaults(model: &SamplingDefaults) -> SamplingDefaults {
    if model.is_empty() {
        SamplingDefaults {
            temperature: Some(0.7),
            top_p: Some(0.9),
            ..Default::default()
        }
    } else {
        *model
    }
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size in bytes"))?;
    let mul: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("unknown size unit '{u}'")),
    };
    Ok((n * mul) as u64)
}

fn main() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The model flags of a command that loads a model.
fn model_args(cmd: &Command) -> Option<&ModelArgs> {
    match cmd {
        Command::Generate { model, .. }
        | Command::Chat { model, .. }
        | Command::Serve { model, .. }
        | Command::Embed { model, .. }
        | Command::Info { model } => Some(model),
        Command::Bench { command } => match command {
            BenchCommand::Throughput { model, .. } | BenchCommand::Latency { model, .. } => {
                Some(model)
            }
            _ => None,
        },
        Command::CheckBackend { .. } => None,
    }
}

fn run(cli: Cli) -> Result<()> {
    let threads = match cli.threads {
        Some(n) => Some(n as usize),
        None if std::env::var_os("RAYON_NUM_THREADS").is_some() => None,
        None => Some(pagoda::backend::cpu::physical_cores()),
    };
    if let Some(n) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("starting the CPU threads")?;
    }
    // NOTE: on a node other than 0 the command's own work (prompts, the server) is node 0's;
    // this node serves its workers, as vLLM's other nodes do.
    if let Some(m) = model_args(&cli.command).filter(|m| m.node_rank > 0) {
        return pagoda::engine::run_worker_node(m.engine_args()?);
    }
    match cli.command {
        Command::Generate {
            prompts,
            file,
            chat_template,
            json,
            lora,
            model,
            sampling,
        } => {
            let mut prompts = prompts;
            if let Some(f) = file {
                let text = std::fs::read_to_string(&f)
                    .with_context(|| format!("cannot read {}", f.display()))?;
                prompts.extend(
                    text.lines()
                        .filter(|l| !l.trim().is_empty())
                        .map(String::from),
                );
            }
            if prompts.is_empty() {
                anyhow::bail!("no prompt given: pass prompts as arguments or --file FILE");
            }
            // NOTE: `generate` is greedy unless told otherwise (reproducible runs, goldens).
            let params = sampling.params(&SamplingDefaults::default(), SamplingParams::greedy())?;
            params.validate()?;
            let mut llm = LLM::new(model.engine_args()?)?;
            if chat_template {
                let engine = llm.engine();
                prompts = prompts
                    .iter()
                    .map(|p| engine.apply_chat_template(&[ChatMessage::new("user", p.clone())]))
                    .collect::<Result<_>>()?;
            }
            let t0 = Instant::now();
            let requests = prompts
                .iter()
                .map(|p| (Prompt::Text(p.clone()), params.clone(), lora.clone()))
                .collect();
            let outs = llm.generate_with_lora(requests)?;
            let secs = t0.elapsed().as_secs_f64();
            let mut n_out = 0;
            for (i, o) in outs.iter().enumerate() {
                for c in &o.outputs {
                    n_out += c.token_ids.len();
                    if json {
                        let logprobs: Vec<_> = c
                        .logprobs
                        .iter()
                        .map(|l| serde_json::json!({"token_id": l.token_id, "logprob": l.logprob, "top": l.top}))
                        .collect();
                        println!(
                            "{}",
                            serde_json::json!({
                                "index": i,
                                "sample": c.index,
                                "prompt_token_ids": o.prompt_token_ids,
                                "token_ids": c.token_ids,
                                "text": c.text,
                                "finish_reason": c.finish_reason.map(|f| f.as_str()),
                                "logprobs": logprobs,
                            })
                        );
                        continue;
                    }
                    if o.outputs.len() > 1 {
                        println!(
                            "--- [{i}.{}] {:?}",
                            c.index,
                            o.prompt.as_deref().unwrap_or_default()
                        );
                    } else if outs.len() > 1 {
                        println!("--- [{i}] {:?}", o.prompt.as_deref().unwrap_or_default());
                    }
                    println!(
                        "{}{}",
                        o.prompt
                            .as_deref()
                            .filter(|_| !chat_template)
                            .unwrap_or_default(),
                        c.text
                    );
                    // NOTE: a small model decoded greedily often loops until max_tokens; say
                    // so rather than leave the user to wonder whether the engine is at fault.
                    if let Some((period, repeats)) = c.repeating_tail() {
                        eprintln!(
                            "note: request {i} ran out of tokens repeating the same {period} \
                             token(s) {repeats} times (greedy decoding loops like this; try \
                             --repetition-penalty 1.2, or --temperature with --seed)"
                        );
                    }
                }
            }
            eprintln!(
                "\n{} requests, {n_out} tokens generated in {secs:.3} s: {:.1} tokens/s",
                outs.len(),
                n_out as f64 / secs
            );
            let st = llm.engine().stats();
            if st.spec_drafts > 0 {
                eprintln!(
                    "speculation: {} of {} draft tokens accepted ({:.1}%), {:.2} tokens a step where drafts were verified",
                    st.spec_accepted_tokens,
                    st.spec_draft_tokens,
                    100.0 * st.spec_accepted_tokens as f64 / st.spec_draft_tokens as f64,
                    1.0 + st.spec_accepted_tokens as f64 / st.spec_drafts as f64
                );
            }
            let pc = llm.engine().prefix_cache_stats();
            if pc.queries > 0 {
                eprintln!(
                    "prefix cache: {} of {} prompt tokens found ({:.1}%)",
                    pc.hits,
                    pc.queries,
                    100.0 * pc.hit_rate()
                );
            }
        }
        Command::Chat {
            system,
            model,
            sampling,
        } => chat(system, model, sampling)?,
        Command::Embed {
            texts,
            file,
            dimensions,
            query,
            model,
        } => embed(texts, file, dimensions, query, model)?,
        Command::CheckBackend { backend, seed } => {
            let (name, rows) = pagoda::backend::check::check_backend_kind(backend, seed)?;
            print!("{}", pagoda::backend::check::format_table(&name, &rows));
            if rows.iter().any(|r| !r.passed()) {
                std::process::exit(1);
            }
        }
        Command::Serve { model, server } => {
            let args = server.server_args(&model)?;
            pagoda::server::serve(model.engine_args()?, args)?;
        }
        Command::Bench { command } => bench(command)?,
        Command::Info { model } => {
            let mut llm = LLM::new(model.engine_args()?)?;
            let e = llm.engine();
            let c = e.config().clone();
            let kv = e.kv_usage();
            println!("model:            {}", e.model_name());
            println!("architecture:     {}", c.arch.name());
            println!("parameters:       {:.1} M", e.num_params() as f64 / 1e6);
            println!("layers:           {}", c.num_layers);
            println!(
                "hidden / ffn:     {} / {}",
                c.hidden_size, c.intermediate_size
            );
            println!(
                "heads / kv heads: {} / {} (head_dim {})",
                c.num_heads, c.num_kv_heads, c.head_dim
            );
            if let Some(m) = &c.moe {
                println!(
                    "experts:          {} of {} per token, each an MLP of {}{}",
                    m.top_k,
                    m.num_experts,
                    m.expert_ffn,
                    m.shared_expert_ffn
                        .map_or(String::new(), |f| format!(", a shared one of {f}"))
                );
            }
            println!("vocab:            {}", c.vocab_size);
            println!(
                "context:          {} (model), {} (engine)",
                c.max_position_embeddings,
                e.max_model_len()
            );
            println!(
                "weights:          --dtype {}: {} MiB ({})",
                model.dtype.name(),
                e.weight_bytes() >> 20,
                e.weight_stats().describe()
            );
            println!("backend:          {}", e.backend_name());
            println!(
                "KV pool:          {} blocks x {} tokens = {} tokens, {} MiB",
                kv.num_blocks,
                model.block_size,
                kv.num_blocks * model.block_size,
                e.kv_bytes() >> 20
            );
        }
    }
    Ok(())
}

fn bench(command: BenchCommand) -> Result<()> {
    use pagoda::bench::cli;
    match command {
        BenchCommand::Throughput { model, bench } => {
            cli::throughput_cmd(&model.engine_args_per_backend()?, &bench)
        }
        BenchCommand::Latency { model, bench } => {
            cli::latency_cmd(&model.engine_args_per_backend()?, &bench)
        }
        BenchCommand::Serve(args) => cli::serve_cmd(&args),
        BenchCommand::Report(args) => cli::report_cmd(&args),
    }
}

fn chat(system: Option<String>, model: ModelArgs, sampling: SamplingArgs) -> Result<()> {
    let mut llm = LLM::new(model.engine_args()?)?;
    let engine = llm.engine();
    let defaults = chat_defaults(engine.sampling_defaults());
    let params = sampling.params(&defaults, SamplingParams::default())?;
    params.validate()?;
    tracing::info!(
        "sampling: temperature {}, top-p {}, top-k {}, min-p {}, repetition penalty {}{}",
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        if engine.sampling_defaults().is_empty() {
            " (the model sets no defaults)"
        } else {
            " (the model's defaults where no flag is given)"
        }
    );
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(ChatMessage::new("system", s));
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        print!("> ");
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            println!();
            return Ok(());
        }
        let line = line.trim_end().to_string();
        if line.is_empty() {
            continue;
        }
        messages.push(ChatMessage::new("user", line));
        let prompt = engine.apply_chat_template(&messages)?;
        let id = engine.add_request(prompt.into(), params.clone())?;
        let t0 = Instant::now();
        let mut reply = String::new();
        let mut n = 0;
        'stream: while engine.has_unfinished() {
            for o in engine.step()? {
                if o.request_id != id {
                    continue;
                }
                print!("{}", o.new_text);
                out.flush()?;
                reply.push_str(&o.new_text);
                n = o.num_output_tokens;
                if o.finished() {
                    break 'stream;
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        println!();
        eprintln!("[{n} tokens, {:.1} tokens/s]", n as f64 / secs);
        messages.push(ChatMessage::new("assistant", reply));
    }
}

/// `pagoda embed`: one JSON line per text, with its embedding or its score.
fn embed(
    mut texts: Vec<String>,
    file: Option<PathBuf>,
    dimensions: Option<usize>,
    query: Option<String>,
    model: ModelArgs,
) -> Result<()> {
    if let Some(f) = file {
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("cannot read {}", f.display()))?;
        texts.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
    }
    if texts.is_empty() {
        anyhow::bail!("no text given: pass texts as arguments or --file FILE");
    }
    let mut args = model.engine_args()?;
    if args.task == Task::Generate {
        args.task = Task::Embed;
    }
    let mut llm = LLM::new(args)?;
    if let Some(q) = query {
        if dimensions.is_some() {
            anyhow::bail!("--dimensions goes with embeddings, not with --query");
        }
        let docs: Vec<&str> = texts.iter().map(String::as_str).collect();
        for (i, s) in llm.score(&q, &docs)?.into_iter().enumerate() {
            println!(
                "{}",
                serde_json::json!({"index": i, "text": texts[i], "score": s})
            );
        }
        return Ok(());
    }
    let params = pagoda::engine::PoolingParams {
        dimensions,
        truncate_prompt_tokens: None,
    };
    for (i, o) in llm.embed(&texts, &params)?.into_iter().enumerate() {
        println!(
            "{}",
            serde_json::json!({"index": i, "prompt_tokens": o.prompt_token_ids.len(), "embedding": o.data})
        );
    }
    Ok(())
}
