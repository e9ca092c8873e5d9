//! The `pagoda bench` subcommands: their flags, the tables they print and the JSON they write.
//! The binary flattens its model flags (`--model`, `--backend`, KV pool, batch limits) next to
//! these and hands over one `EngineArgs` per backend asked for.

use super::latency::{self, LatencyOptions};
use super::report;
use super::serve::{self, ServeOptions};
use super::throughput::{self, ThroughputOptions, ThroughputResult};
use super::workload::{SharedPrefixes, Workload, WorkloadKind};
use super::{Machine, interrupt_flag};
use crate::backend::BackendKind;
use crate::engine::{Engine, EngineArgs};
use crate::sampling::StructuredOutput;
use crate::sched::{PreemptionMode, SchedulingPolicy};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(clap::Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Number of requests.
    #[arg(long, default_value_t = 200)]
    pub num_prompts: usize,
    /// Length distribution: fixed, uniform, or sharegpt (log-normal long tail; see
    /// docs/benchmarks.md).
    #[arg(long, value_enum, default_value = "sharegpt")]
    pub workload: WorkloadKind,
    /// Prompt tokens: exact (fixed), centre (uniform) or median (sharegpt; default 100, else
    /// 128).
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Output tokens: exact (fixed), centre (uniform) or median (sharegpt; default 64, else
    /// 128).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Uniform: lengths within ±this fraction of the centre.
    #[arg(long, default_value_t = 0.5)]
    pub range_ratio: f64,
    /// Sharegpt: longest prompt (default 10 × the median).
    #[arg(long)]
    pub max_input_len: Option<usize>,
    /// Sharegpt: longest output (default 4 × the median).
    #[arg(long)]
    pub max_output_len: Option<usize>,
    /// Prefix: tokens of each shared prompt (the workload's requests add --input-len of their
    /// own).
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: usize,
    /// Prefix: how many shared prompts there are (request i uses prompt i mod this).
    #[arg(long, default_value_t = 4)]
    pub num_prefixes: usize,
    /// Seed of the lengths, the prompts and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl WorkloadArgs {
    pub fn workload(&self) -> Result<Workload> {
        if self.num_prompts == 0 {
            bail!("--num-prompts must be at least 1");
        }
        if !(0.0..1.0).contains(&self.range_ratio) {
            bail!("--range-ratio must be in [0, 1), got {}", self.range_ratio);
        }
        let mut w = Workload::new(
            self.workload,
            self.num_prompts,
            self.input_len,
            self.output_len,
            self.seed,
        );
        w.range_ratio = self.range_ratio;
        if let Some(m) = self.max_input_len {
            w.max_input_len = m.max(1);
        }
        if let Some(m) = self.max_output_len {
            w.max_output_len = m.max(1);
        }
        if self.workload == WorkloadKind::Prefix {
            if self.num_prefixes == 0 || self.prefix_len == 0 {
                bail!("--num-prefixes and --prefix-len must be at least 1");
            }
            w.shared_prefixes = Some(SharedPrefixes {
                len: self.prefix_len,
                count: self.num_prefixes,
            });
        }
        Ok(w)
    }
}

fn parse_policy(s: &str) -> Result<SchedulingPolicy, String> {
    match s.to_ascii_lowercase().as_str() {
        "continuous" => Ok(SchedulingPolicy::Continuous),
        "static" => Ok(SchedulingPolicy::Static),
        _ => Err(format!("unknown scheduling '{s}' (continuous or static)")),
    }
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => Err(format!("'{s}': on or off")),
    }
}

/// `separate` is true.
fn parse_temperature(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(t) if (0.0..=100.0).contains(&t) => Ok(t),
        _ => Err(format!("`{s}` is not a temperature in [0, 100]")),
    }
}

fn parse_top_p(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("`{s}` is not a top-p in (0, 1]")),
    }
}

fn parse_n_mode(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "group" => Ok(false),
        "separate" => Ok(true),
        _ => Err(format!("'{s}': group or separate")),
    }
}

fn policy_name(p: SchedulingPolicy) -> &'static str {
    match p {
        SchedulingPolicy::Continuous => "continuous",
        SchedulingPolicy::Static => "static",
    }
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.to_ascii_lowercase().as_str() {
        "inf" | "infinity" => Ok(f64::INFINITY),
        _ => match s.parse::<f64>() {
            Ok(x) if x > 0.0 => Ok(x),
            _ => Err(format!("'{s}' is not a positive rate (or inf)")),
        },
    }
}

fn parse_structured(s: &str) -> Result<bool, String> {
    match s {
        "none" => Ok(false),
        "json" => Ok(true),
        _ => Err(format!("'{s}' is not none or json")),
    }
}

/// The JSON schema `--structured json` uses without `--json-schema`: at least 8 records of a
/// name, an age and a city (about 120 tokens: the output cannot end after a few).
fn default_bench_schema() -> Value {
    serde_json::json!({
        "type": "array",
        "minItems": 8,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "maxLength": 24}
            },
            "required": ["name", "age", "city"],
            "additionalProperties": false
        }
    })
}

#[derive(clap::Args, Debug, Clone)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// continuous, static, or both (`continuous,static`: run back to back on one workload).
    #[arg(long, value_delimiter = ',', default_value = "continuous", value_parser = parse_policy)]
    pub scheduling: Vec<SchedulingPolicy>,
    /// Prefix caching on, off, or both (`on,off`: back to back on one workload). Default: as
    /// --enable-prefix-caching says (on).
    #[arg(long, value_delimiter = ',', value_parser = parse_on_off)]
    pub prefix_caching: Vec<bool>,
    /// Preemption by recompute, swap, or both (`recompute,swap`: back to back). Default: as
    /// --preemption-mode says (recompute).
    #[arg(long, value_delimiter = ',', value_parser = PreemptionMode::parse)]
    pub preemption: Vec<PreemptionMode>,
    /// Samples per request (above 1: sampled at temperature 1, or --temperature, seeded).
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Sampling temperature: 0 is greedy; above 0, each request seeded (vLLM's throughput
    /// benchmark samples at 1). A list (`0,1`) runs back to back.
    #[arg(long, value_delimiter = ',', default_value = "0", value_parser = parse_temperature)]
    pub temperature: Vec<f32>,
    /// top-p of the requests sampled at a temperature above 0.
    #[arg(long, default_value_t = 1.0, value_parser = parse_top_p)]
    pub top_p: f32,
    /// How the n samples run: `group` (one request of n samples, sharing the prompt),
    /// `separate` (n requests of one sample, the same seeds), or `group,separate`.
    #[arg(long, value_delimiter = ',', default_value = "group", value_parser = parse_n_mode)]
    pub n_mode: Vec<bool>,
    /// Structured output: `none`, `json` (every output must match a JSON schema: --json-schema,
    /// or a list of records), or `none,json` back to back. Outputs end where the JSON does.
    #[arg(long, value_delimiter = ',', default_value = "none", value_parser = parse_structured)]
    pub structured: Vec<bool>,
    /// The JSON schema of `--structured json` (default: a list of {name, age, city} records).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// Where to write the JSON results (default: bench-throughput-<UTC time>.json).
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct LatencyArgs {
    /// Batch sizes to sweep (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch_size: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// Measured iterations per batch size.
    #[arg(long, default_value_t = 3)]
    pub num_iters: usize,
    /// Iterations run first and not measured.
    #[arg(long, default_value_t = 1)]
    pub num_iters_warmup: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write the JSON results (default: bench-latency-<UTC time>.json).
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name sent in each request (default: the first one `GET /v1/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    /// The row's name in tables and charts (e.g. pagoda-cpu, llama-server).
    #[arg(long)]
    pub label: Option<String>,
    /// LoRA adapters the server serves (`--lora-modules` of its start): request i names
    /// adapter i mod N as its model, so that they are mixed uniformly.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Requests per second, Poisson arrivals; `inf` sends them all at once.
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    pub request_rate: f64,
    /// At most this many requests in flight. With the default `--request-rate inf` this is a
    /// closed loop: N clients, each sending its next request as soon as its last one ends.
    #[arg(long, visible_alias = "concurrency")]
    pub max_concurrency: Option<usize>,
    /// Requests sent one at a time before the measured run and not counted.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Send `ignore_eos: true` so that each request produces its whole output length (servers
    /// that do not know the field ignore it).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub ignore_eos: bool,
    /// Seconds before one request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Where to write the JSON results (default: bench-serve-<UTC time>.json).
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ReportArgs {
    /// JSON results written by `bench throughput`, `latency` or `serve`.
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    /// Write the Markdown here too (it is always printed).
    #[arg(long)]
    pub output_md: Option<PathBuf>,
    /// Where to write the SVG chart.
    #[arg(long, default_value = "bench-report.svg")]
    pub output_svg: PathBuf,
}

/// `2026-11-29T12-03-30Z`: seconds since the epoch as a UTC date and time, for file names.
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}-{:02}-{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The results document: what was run where, every row, and the first row's figures at the
/// top level (so `requests_per_s` and the like are found without looking into `results`).
fn document(kind: &str, model: &str, extra: Value, rows: &[Value], skipped: &[Value]) -> Value {
    let mut doc = json!({
        "kind": kind,
        "pagoda_version": env!("CARGO_PKG_VERSION"),
        "created_unix_s": now_secs(),
        "machine": Machine::detect(),
        "model": model,
    });
    let map = doc.as_object_mut().expect("an object");
    if let Value::Object(e) = extra {
        map.extend(e);
    }
    if let Some(Value::Object(first)) = rows.first() {
        for (k, v) in first {
            if !v.is_array() && !map.contains_key(k) {
                map.insert(k.clone(), v.clone());
            }
        }
    }
    map.insert(
        "interrupted".into(),
        json!(interrupt_flag().load(std::sync::atomic::Ordering::Relaxed)),
    );
    map.insert("results".into(), Value::Array(rows.to_vec()));
    map.insert("skipped".into(), Value::Array(skipped.to_vec()));
    doc
}

fn write_json(path: Option<&Path>, kind: &str, doc: &Value) -> Result<PathBuf> {
    let path = path
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(format!("bench-{kind}-{}.json", utc_stamp(now_secs()))));
    let text = serde_json::to_string_pretty(doc)?;
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("results written to {}", path.display());
    Ok(path)
}

fn to_value<T: Serialize>(x: &T) -> Value {
    serde_json::to_value(x).unwrap_or(Value::Null)
}

fn skipped(backend: BackendKind, e: &anyhow::Error) -> Value {
    eprintln!("backend {}: skipped: {e:#}", backend.name());
    json!({"backend": backend.name(), "reason": format!("{e:#}")})
}

fn engine_json(a: &EngineArgs, engine: &Engine) -> Value {
    json!({
        "dtype": a.dtype.name(),
        "block_size": a.block_size,
        "max_num_batched_tokens": engine.max_num_batched_tokens(),
        "max_num_seqs": a.max_num_seqs,
        "max_model_len": engine.max_model_len(),
        "tensor_parallel_size": a.parallel.tensor,
        "pipeline_parallel_size": a.parallel.pipeline,
        "nnodes": a.nodes.nnodes,
    })
}

/// `bench throughput`: every backend × every scheduling policy, on one workload.
pub fn throughput_cmd(engines: &[(BackendKind, EngineArgs)], args: &ThroughputArgs) -> Result<()> {
    let stop = interrupt_flag();
    let workload = args.workload.workload()?;
    let reqs = workload.generate();
    let mut policies = args.scheduling.clone();
    policies.dedup();
    if args.n == 0 {
        bail!("--n must be at least 1");
    }
    let mut n_modes = args.n_mode.clone();
    n_modes.dedup();
    let mut structured_modes = args.structured.clone();
    structured_modes.dedup();
    let schema = match &args.json_schema {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?,
        )
        .with_context(|| format!("{} is not JSON", p.display()))?,
        None => default_bench_schema(),
    };
    // Every combination of policy, prefix caching, preemption mode and n mode, in the order
    // given.
    let listed = |v: &[bool]| -> Vec<Option<bool>> {
        if v.is_empty() {
            vec![None]
        } else {
            v.iter().map(|&c| Some(c)).collect()
        }
    };
    let preemptions: Vec<Option<PreemptionMode>> = if args.preemption.is_empty() {
        vec![None]
    } else {
        args.preemption.iter().map(|&p| Some(p)).collect()
    };
    let mut variants = Vec::new();
    for &policy in &policies {
        for caching in listed(&args.prefix_caching) {
            for &preemption in &preemptions {
                for &separate in &n_modes {
                    for &structured in &structured_modes {
                        for &t in &args.temperature {
                            variants.push((policy, caching, preemption, separate, structured, t));
                        }
                    }
                }
            }
        }
    }
    let (mut rows, mut skips, mut results) = (vec![], vec![], vec![]);
    let (mut model, mut engine_cfg) = (String::new(), Value::Null);
    'outer: for (kind, base) in engines {
        for &(policy, caching, preemption, separate_n, structured, temperature) in &variants {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                break 'outer;
            }
            let ea = EngineArgs {
                scheduling: policy,
                seed: workload.seed,
                enable_prefix_caching: caching.unwrap_or(base.enable_prefix_caching),
                preemption_mode: preemption.unwrap_or(base.preemption_mode),
                ..base.clone()
            };
            let mut engine = match Engine::new(ea.clone()) {
                Ok(e) => e,
                Err(e) => {
                    skips.push(skipped(*kind, &e));
                    continue 'outer;
                }
            };
            model = engine.model_name().to_string();
            engine_cfg = engine_json(&ea, &engine);
            eprintln!(
                "throughput: {} requests ({}), backend {}, {} batching, prefix caching {}, preemption by {}, n {}{}{}, {}",
                reqs.len(),
                workload.kind.name(),
                kind.name(),
                policy_name(policy),
                if ea.enable_prefix_caching {
                    "on"
                } else {
                    "off"
                },
                ea.preemption_mode.name(),
                args.n,
                if separate_n {
                    " (separate requests)"
                } else {
                    ""
                },
                if structured {
                    ", JSON-schema output"
                } else {
                    ""
                },
                if temperature > 0.0 {
                    format!("sampled at temperature {temperature}, top-p {}", args.top_p)
                } else {
                    "greedy".to_string()
                }
            );
            let opts = ThroughputOptions {
                backend: kind.name().to_string(),
                scheduling: policy_name(policy).to_string(),
                block_size: ea.block_size,
                seed: workload.seed,
                prefixes: workload.shared_prefixes,
                n: args.n,
                separate_n,
                temperature,
                top_p: args.top_p,
                structured: structured
                    .then(|| ("json".to_string(), StructuredOutput::Json(schema.clone()))),
                stop,
                progress: true,
            };
            let r = throughput::run(&mut engine, &reqs, &opts)?;
            rows.push(to_value(&r));
            results.push(r);
        }
    }
    if results.is_empty() && skips.len() == engines.len() {
        bail!("no backend could run (see the reasons above)");
    }
    print_throughput(&results);
    let refs: Vec<&ThroughputResult> = results.iter().collect();
    let ratios: serde_json::Map<String, Value> = report::scheduling_ratios(&refs)
        .into_iter()
        .map(|(b, x)| (b, json!(x)))
        .collect();
    // NOTE: the drawn lengths, so that another engine can be run on the very same requests
    // (scripts/gpu_check.py gives them to transformers' generate).
    let extra = json!({
        "workload": workload,
        "request_lens": reqs.iter().map(|r| [r.prompt_len, r.output_len]).collect::<Vec<_>>(),
        "engine": engine_cfg,
        "continuous_over_static": ratios,
    });
    let doc = document("throughput", &model, extra, &rows, &skips);
    write_json(args.output_json.as_deref(), "throughput", &doc)?;
    Ok(())
}

fn print_throughput(results: &[ThroughputResult]) {
    println!(
        "\n{:<8} {:<10} {:>9} {:>8} {:>11} {:>10} {:>14} {:>14} {:>13} {:>13} {:>7}",
        "backend",
        "scheduling",
        "requests",
        "req/s",
        "out tok/s",
        "tot tok/s",
        "step p50/p99",
        "KV util m/pk",
        "reserve: max",
        "reserve: p+m",
        "preempt"
    );
    for r in results {
        println!(
            "{:<8} {:<10} {:>9} {:>8.2} {:>11.1} {:>10.1} {:>14} {:>14} {:>13} {:>13} {:>7}",
            r.backend,
            r.scheduling,
            format!("{}/{}", r.completed, r.num_requests),
            r.requests_per_s,
            r.output_tokens_per_s,
            r.total_tokens_per_s,
            format!("{:.0}/{:.0} ms", r.step_time_ms.p50, r.step_time_ms.p99),
            format!(
                "{:.1}/{:.1}%",
                r.kv_utilization_mean * 100.0,
                r.kv_utilization_peak * 100.0
            ),
            format!("{:.1}%", r.reserve_baseline_kv_utilization * 100.0),
            format!("{:.1}%", r.reserve_max_tokens_kv_utilization * 100.0),
            r.preemptions
        );
    }
    let refs: Vec<&ThroughputResult> = results.iter().collect();
    for (b, x) in report::scheduling_ratios(&refs) {
        println!("{b}: continuous / static batching = {x:.2}× output tokens/s");
    }
    println!(
        "\n{:<8} {:<10} {:>7} {:>10} {:>12} {:>6} {:>11} {:>13} {:>13} {:>9} {:>11} {:>8} {:>11}",
        "backend",
        "scheduling",
        "prefix",
        "preempt",
        "n",
        "output",
        "out tok/s",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "hit rate",
        "peak blocks",
        "preempt",
        "swap MiB"
    );
    for r in results {
        println!(
            "{:<8} {:<10} {:>7} {:>10} {:>12} {:>6} {:>11.1} {:>13.0} {:>13.1} {:>8.1}% {:>11} {:>8} {:>11.1}",
            r.backend,
            r.scheduling,
            if r.prefix_caching { "on" } else { "off" },
            r.preemption_mode,
            format!("{} {}", r.n, r.n_mode),
            r.structured,
            r.output_tokens_per_s,
            r.ttft_ms.p50,
            r.tpot_ms.p50,
            r.prefix_cache_hit_rate * 100.0,
            r.kv_peak_blocks,
            r.preemptions,
            r.swap_bytes as f64 / 1048576.0
        );
    }
    // Side-by-side ratios of runs that differ in one setting only.
    for a in results {
        for b in results {
            let same = a.backend == b.backend && a.scheduling == b.scheduling;
            // NOTE: the ratio of two runs that differ in one setting only.
            let same_output = a.structured == b.structured;
            if same
                && same_output
                && a.n == b.n
                && a.n_mode == b.n_mode
                && a.preemption_mode == b.preemption_mode
                && a.prefix_caching
                && !b.prefix_caching
            {
                println!(
                    "{} / {}: prefix caching on / off = {:.2}× output tokens/s, TTFT p50 {:.2}× (hit rate {:.1}%)",
                    a.backend,
                    a.scheduling,
                    a.output_tokens_per_s / b.output_tokens_per_s.max(1e-9),
                    a.ttft_ms.p50 / b.ttft_ms.p50.max(1e-9),
                    a.prefix_cache_hit_rate * 100.0
                );
            }
            if same
                && same_output
                && a.prefix_caching == b.prefix_caching
                && a.n == b.n
                && a.n_mode == b.n_mode
                && a.preemption_mode == "swap"
                && b.preemption_mode == "recompute"
            {
                println!(
                    "{} / {}: preemption by swap / recompute = {:.2}× output tokens/s ({} and {} preemptions, {:.1} MiB copied to host and back)",
                    a.backend,
                    a.scheduling,
                    a.output_tokens_per_s / b.output_tokens_per_s.max(1e-9),
                    a.preemptions,
                    b.preemptions,
                    a.swap_bytes as f64 / 1048576.0
                );
            }
            if same
                && a.prefix_caching == b.prefix_caching
                && a.preemption_mode == b.preemption_mode
                && a.n == b.n
                && a.n_mode == b.n_mode
                && a.structured == "json"
                && b.structured == "none"
            {
                println!(
                    "{} / {}: JSON-schema output / unconstrained: time per output token {:.3}× (p50 {:.1} / {:.1} ms), output tokens/s {:.2}×",
                    a.backend,
                    a.scheduling,
                    a.tpot_ms.p50 / b.tpot_ms.p50.max(1e-9),
                    a.tpot_ms.p50,
                    b.tpot_ms.p50,
                    a.output_tokens_per_s / b.output_tokens_per_s.max(1e-9)
                );
            }
            if same
                && same_output
                && a.prefix_caching == b.prefix_caching
                && a.preemption_mode == b.preemption_mode
                && a.n_mode == "group"
                && b.n_mode == "separate"
                && a.n == b.n
            {
                println!(
                    "{} / {}: n = {} as one request / as {} requests = {:.2}× output tokens/s, peak KV blocks {} / {} ({:.0}% fewer)",
                    a.backend,
                    a.scheduling,
                    a.n,
                    b.n,
                    a.output_tokens_per_s / b.output_tokens_per_s.max(1e-9),
                    a.kv_peak_blocks,
                    b.kv_peak_blocks,
                    100.0 * (1.0 - a.kv_peak_blocks as f64 / b.kv_peak_blocks.max(1) as f64)
                );
            }
        }
    }
    for r in results {
        println!(
            "{} / {}: peak KV allocated {:.1} MiB; reserving max_model_len ({}) per request would need {:.1} MiB, prompt + max_tokens {:.1} MiB",
            r.backend,
            r.scheduling,
            r.kv_peak_bytes as f64 / 1048576.0,
            r.max_model_len,
            r.reserve_baseline_peak_bytes as f64 / 1048576.0,
            r.reserve_max_tokens_peak_bytes as f64 / 1048576.0
        );
    }
}

/// `bench latency`: for each backend, a sweep over batch sizes.
pub fn latency_cmd(engines: &[(BackendKind, EngineArgs)], args: &LatencyArgs) -> Result<()> {
    let stop = interrupt_flag();
    if args.batch_size.contains(&0) || args.input_len == 0 || args.output_len == 0 {
        bail!("batch sizes and lengths must be at least 1");
    }
    let (mut rows, mut skips, mut results) = (vec![], vec![], vec![]);
    let (mut model, mut engine_cfg) = (String::new(), Value::Null);
    'outer: for (kind, base) in engines {
        let ea = EngineArgs {
            seed: args.seed,
            ..base.clone()
        };
        let mut engine = match Engine::new(ea.clone()) {
            Ok(e) => e,
            Err(e) => {
                skips.push(skipped(*kind, &e));
                continue;
            }
        };
        model = engine.model_name().to_string();
        engine_cfg = engine_json(&ea, &engine);
        for &b in &args.batch_size {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                break 'outer;
            }
            let opts = LatencyOptions {
                backend: kind.name().to_string(),
                input_len: args.input_len,
                output_len: args.output_len,
                iterations: args.num_iters,
                warmup: args.num_iters_warmup,
                seed: args.seed,
                stop,
                progress: true,
            };
            let r = latency::run(&mut engine, b, &opts)?;
            rows.push(to_value(&r));
            results.push(r);
        }
    }
    if results.is_empty() && skips.len() == engines.len() {
        bail!("no backend could run (see the reasons above)");
    }
    println!(
        "\n{:<8} {:>6} {:>24} {:>24} {:>16} {:>10}",
        "backend",
        "batch",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90/p99 ms",
        "e2e p50/p99 ms",
        "out tok/s"
    );
    for r in &results {
        println!(
            "{:<8} {:>6} {:>24} {:>24} {:>16} {:>10.1}",
            r.backend,
            r.batch_size,
            format!(
                "{:.1}/{:.1}/{:.1}",
                r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99
            ),
            format!(
                "{:.1}/{:.1}/{:.1}",
                r.tpot_ms.p50, r.tpot_ms.p90, r.tpot_ms.p99
            ),
            format!("{:.0}/{:.0}", r.e2e_ms.p50, r.e2e_ms.p99),
            r.output_tokens_per_s
        );
    }
    let extra = json!({
        "workload": {"kind": "fixed", "input_len": args.input_len, "output_len": args.output_len,
                     "batch_sizes": args.batch_size, "num_iters": args.num_iters,
                     "num_iters_warmup": args.num_iters_warmup, "seed": args.seed},
        "engine": engine_cfg,
    });
    let doc = document("latency", &model, extra, &rows, &skips);
    write_json(args.output_json.as_deref(), "latency", &doc)?;
    Ok(())
}

/// `bench serve`: load against an OpenAI-compatible server.
pub fn serve_cmd(args: &ServeBenchArgs) -> Result<()> {
    let stop = interrupt_flag();
    let workload = args.workload.workload()?;
    let reqs = workload.generate();
    let model = match &args.model {
        Some(m) => m.clone(),
        None => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(async { serve::discover_model(&serve::client()?, &args.base_url).await })?,
    };
    let label = args.label.clone().unwrap_or_else(|| {
        args.base_url
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .to_string()
    });
    if args.timeout.is_nan() || args.timeout <= 0.0 {
        bail!("--timeout must be positive");
    }
    eprintln!(
        "serve: {} requests ({}) to {} (model {model}), rate {}, concurrency {}",
        reqs.len(),
        workload.kind.name(),
        args.base_url,
        args.request_rate,
        args.max_concurrency
            .map(|c| c.to_string())
            .unwrap_or_else(|| "unlimited".into())
    );
    let opts = ServeOptions {
        base_url: args.base_url.clone(),
        endpoint: args.endpoint.clone(),
        model: model.clone(),
        loras: args.lora_modules.clone(),
        label,
        request_rate: args.request_rate,
        max_concurrency: args.max_concurrency,
        ignore_eos: args.ignore_eos,
        warmup: args.warmup,
        timeout: Duration::from_secs_f64(args.timeout),
        seed: workload.seed,
        prefixes: workload.shared_prefixes,
        stop,
        progress: true,
    };
    let r = serve::run(&reqs, &opts)?;
    println!(
        "\n{} ({}): {} completed, {} failed, {} cancelled in {:.1} s",
        r.backend, r.base_url, r.completed, r.failed, r.cancelled, r.duration_s
    );
    println!(
        "  {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
        r.requests_per_s, r.output_tokens_per_s, r.total_tokens_per_s
    );
    for (name, s) in [
        ("TTFT", r.ttft_ms),
        ("TPOT", r.tpot_ms),
        ("ITL", r.itl_ms),
        ("E2E", r.e2e_ms),
    ] {
        println!(
            "  {name:<5} ms: mean {:.1}  p50 {:.1}  p90 {:.1}  p99 {:.1}",
            s.mean, s.p50, s.p90, s.p99
        );
    }
    for e in &r.errors {
        println!("  error: {e}");
    }
    let extra = json!({
        "workload": workload,
        "request_rate": args.request_rate.is_finite().then_some(args.request_rate),
        "max_concurrency": args.max_concurrency,
    });
    let doc = document("serve", &model, extra, &[to_value(&r)], &[]);
    write_json(args.output_json.as_deref(), "serve", &doc)?;
    Ok(())
}

/// `bench report`: Markdown on stdout (and to `--output-md`), the chart to `--output-svg`.
pub fn report_cmd(args: &ReportArgs) -> Result<()> {
    let files = args
        .results
        .iter()
        .map(|p| report::load(p))
        .collect::<Result<Vec<_>>>()?;
    let svg = report::svg(&files)?;
    std::fs::write(&args.output_svg, svg)
        .with_context(|| format!("cannot write {}", args.output_svg.display()))?;
    // NOTE: the Markdown links the chart relative to where the Markdown is written.
    let link = match &args.output_md {
        Some(md) => {
            let dir = md.parent().filter(|d| !d.as_os_str().is_empty());
            relative_to(&args.output_svg, dir.unwrap_or(Path::new(".")))
        }
        None => args.output_svg.display().to_string(),
    };
    let md = report::markdown(&files, Some(&link));
    print!("{md}");
    if let Some(p) = &args.output_md {
        std::fs::write(p, &md).with_context(|| format!("cannot write {}", p.display()))?;
    }
    eprintln!("chart written to {}", args.output_svg.display());
    Ok(())
}

fn relative_to(path: &Path, dir: &Path) -> String {
    let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (p, d) = (abs(path), abs(dir));
    match p.strip_prefix(&d) {
        Ok(rel) => rel.display().to_string(),
        Err(_) => p.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(0), "1970-01-01T00-00-00Z");
        assert_eq!(utc_stamp(951_782_400 + 3_661), "2000-02-29T01-01-01Z");
        assert_eq!(utc_stamp(1_798_761_599), "2026-12-31T23-59-59Z");
    }

    #[test]
    fn the_document_has_the_headline_keys_at_the_top() {
        let row = json!({"requests_per_s": 2.5, "kv_timeline": [1, 2], "backend": "cpu"});
        let doc = document(
            "throughput",
            "m",
            json!({"workload": {"kind": "fixed"}}),
            &[row],
            &[],
        );
        assert_eq!(doc["requests_per_s"], 2.5);
        assert_eq!(doc["backend"], "cpu");
        assert!(doc.get("kv_timeline").is_none(), "arrays stay in results");
        assert_eq!(doc["results"][0]["kv_timeline"], json!([1, 2]));
        assert_eq!(doc["workload"]["kind"], "fixed");
        assert!(doc["machine"]["cores"].as_u64().unwrap() >= 1);
    }

    #[test]
    fn policies_and_rates_parse() {
        assert_eq!(parse_policy("Static"), Ok(SchedulingPolicy::Static));
        assert!(parse_policy("dynamic").is_err());
        assert_eq!(parse_rate("inf"), Ok(f64::INFINITY));
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        assert!(parse_rate("0").is_err());
    }
}
