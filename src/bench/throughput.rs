//! Offline throughput: every request of a workload is submitted at once and the engine steps
//! until all have ended. After each step the KV pool is sampled, and the same moment is
//! measured against an engine that reserves KV memory per request:
//!
//! ```text
//!   Pagoda:              stored tokens / slots of the blocks allocated        (kv_utilization)
//!   reserve max len:     stored tokens / Σ max_model_len          over running (reserve_baseline)
//!   reserve max tokens:  stored tokens / Σ (prompt + max_tokens)  over running (reserve_max_tokens)
//! ```
//!
//! Means are over steps (each step one sample, steps with nothing allocated left out); peaks
//! are the largest sample.

use super::stats::{Summary, mean};
use super::workload::{RequestLens, SharedPrefixes, request_tokens, word_token_ids};
use crate::engine::{Engine, Prompt, sample_seed};
use crate::sampling::{SamplingParams, StructuredOutput};
use crate::sched::RequestId;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Most points of the KV time series kept in a result (longer runs are thinned evenly).
pub const MAX_TIMELINE_POINTS: usize = 2000;

/// The KV pool at the end of one step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvSample {
    /// Seconds since the run started.
    pub t_s: f64,
    /// Tokens stored over the slots of the allocated blocks.
    pub kv_utilization: f64,
    /// Blocks allocated over usable blocks.
    pub kv_blocks_used: f64,
    /// Tokens stored over what a reserve-per-request engine (max_model_len each) would hold.
    pub reserve_baseline_utilization: f64,
    /// Tokens stored over what an engine reserving prompt + max_tokens would hold.
    pub reserve_max_tokens_utilization: f64,
    pub running: usize,
    pub waiting: usize,
}

/// One request's life in a run, in seconds since the start and in step indices.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub prompt_len: usize,
    pub output_len: usize,
    /// Output tokens actually produced, all samples together (less than `n × output_len` only
    /// when interrupted).
    pub produced: usize,
    pub first_token_s: Option<f64>,
    pub finish_s: Option<f64>,
    pub first_token_step: Option<u64>,
    pub finish_step: Option<u64>,
}

/// Every figure of one throughput run (one backend, one scheduling policy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThroughputResult {
    /// The backend asked for (`cpu`, `wgpu`, ...).
    pub backend: String,
    /// The backend as the engine describes it (device, threads).
    pub backend_detail: String,
    pub scheduling: String,
    pub num_requests: usize,
    pub completed: usize,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub steps: u64,
    pub step_time_ms: Summary,
    pub kv_utilization_mean: f64,
    pub kv_utilization_peak: f64,
    pub kv_blocks_used_mean: f64,
    pub kv_blocks_used_peak: f64,
    /// Largest number of token slots allocated at once (blocks × block size).
    pub kv_peak_tokens: usize,
    pub kv_peak_bytes: u64,
    pub kv_capacity_tokens: usize,
    pub max_model_len: usize,
    /// Mean over steps of stored / Σ max_model_len over the running requests.
    pub reserve_baseline_kv_utilization: f64,
    /// Largest Σ max_model_len over the running requests: what that engine must reserve.
    pub reserve_baseline_peak_tokens: usize,
    pub reserve_baseline_peak_bytes: u64,
    /// Mean over steps of stored / Σ (prompt + max_tokens) over the running requests.
    pub reserve_max_tokens_kv_utilization: f64,
    pub reserve_max_tokens_peak_tokens: usize,
    pub reserve_max_tokens_peak_bytes: u64,
    pub preemptions: u64,
    /// Prefix caching on or off in this run.
    #[serde(default)]
    pub prefix_caching: bool,
    /// Samples per request, and whether they ran as one request (`group`: they share the
    /// prompt's blocks) or as `n` separate requests (`separate`).
    #[serde(default = "one")]
    pub n: usize,
    #[serde(default)]
    pub n_mode: String,
    /// `recompute` or `swap`, and the bytes swap copied to host memory and back.
    #[serde(default)]
    pub preemption_mode: String,
    #[serde(default)]
    pub swap_bytes: u64,
    /// Prompt tokens looked up in the prefix cache, and found there.
    #[serde(default)]
    pub prefix_cache_queries: u64,
    #[serde(default)]
    pub prefix_cache_hits: u64,
    #[serde(default)]
    pub prefix_cache_hit_rate: f64,
    /// Speculative decoding: draft tokens verified, and kept.
    #[serde(default)]
    pub spec_draft_tokens: u64,
    #[serde(default)]
    pub spec_accepted_tokens: u64,
    /// Time to first token over requests, in milliseconds since the run started.
    #[serde(default)]
    pub ttft_ms: Summary,
    /// Most KV blocks in use at once.
    #[serde(default)]
    pub kv_peak_blocks: usize,
    /// The structured-output constraint every request had (`none`, `json`).
    #[serde(default)]
    pub structured: String,
    /// Time per output token over requests (first token to last, per later token), in ms.
    #[serde(default)]
    pub tpot_ms: Summary,
    /// The requests' sampling temperature (0: greedy) and top-p.
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "top_p_one")]
    pub top_p: f32,
    /// Tokens drawn at random on the device rather than on the host.
    #[serde(default)]
    pub random_samples_on_device: u64,
    pub interrupted: bool,
    pub kv_timeline: Vec<KvSample>,
    pub requests: Vec<RequestRecord>,
}

fn one() -> usize {
    1
}

fn top_p_one() -> f32 {
    1.0
}

/// What the run loop needs to know besides the engine.
pub struct ThroughputOptions<'a> {
    pub backend: String,
    pub scheduling: String,
    pub block_size: usize,
    pub seed: u64,
    /// The prefix workload's shared prompts.
    pub prefixes: Option<SharedPrefixes>,
    /// Samples per request (sampled at `temperature`, or 1 where that is 0, when above 1).
    pub n: usize,
    /// Submit the `n` samples as `n` requests of one sample each, with the same seeds.
    pub separate_n: bool,
    /// 0: greedy; above 0, each request sampled, seeded, with `top_p`.
    pub temperature: f32,
    pub top_p: f32,
    /// A constraint every request's output must match (its name and itself).
    pub structured: Option<(String, StructuredOutput)>,
    /// Set (by Ctrl-C) to end the run early; what was measured is still returned.
    pub stop: &'a AtomicBool,
    pub progress: bool,
}

/// Submits every request at once (exact prompt lengths as token ids, EOS ignored so that each
/// produces exactly its `output_len`), steps until all have ended, and measures. Greedy when
/// `n` is 1; otherwise sampled at temperature 1 from seeds that make the `group` and `separate`
/// modes produce the same tokens.
pub fn run(
    engine: &mut Engine,
    reqs: &[RequestLens],
    opts: &ThroughputOptions,
) -> Result<ThroughputResult> {
    let tok = engine.tokenizer().clone();
    let vocab = word_token_ids(|w| tok.encode(w))?;
    let max_model_len = engine.max_model_len();
    let mut ids: HashMap<RequestId, usize> = HashMap::new();
    let mut records: Vec<RequestRecord> = reqs
        .iter()
        .map(|r| RequestRecord {
            prompt_len: r.prompt_len,
            output_len: r.output_len,
            produced: 0,
            first_token_s: None,
            finish_s: None,
            first_token_step: None,
            finish_step: None,
        })
        .collect();
    // Samples of each request still running.
    let mut unfinished = vec![opts.n; reqs.len()];
    for (i, r) in reqs.iter().enumerate() {
        let base = SamplingParams {
            max_tokens: Some(r.output_len),
            ignore_eos: true,
            structured: opts.structured.as_ref().map(|(_, c)| c.clone()),
            ..SamplingParams::greedy()
        };
        let seed = opts.seed.wrapping_add(i as u64);
        let sampled = SamplingParams {
            temperature: if opts.temperature > 0.0 {
                opts.temperature
            } else {
                1.0
            },
            top_p: opts.top_p,
            ..base.clone()
        };
        let each: Vec<SamplingParams> = if opts.n == 1 && opts.temperature == 0.0 {
            vec![base]
        } else if opts.n == 1 {
            vec![SamplingParams {
                seed: Some(seed),
                ..sampled
            }]
        } else if opts.separate_n {
            (0..opts.n)
                .map(|j| SamplingParams {
                    seed: Some(sample_seed(seed, j)),
                    ..sampled.clone()
                })
                .collect()
        } else {
            vec![SamplingParams {
                seed: Some(seed),
                n: opts.n,
                ..sampled
            }]
        };
        let prompt = request_tokens(opts.prefixes, opts.seed, i, r.prompt_len, &vocab);
        for params in each {
            let id = engine
                .add_request(Prompt::Tokens(prompt.clone()), params)
                .map_err(|e| anyhow::anyhow!("request {i} refused: {e}"))?;
            ids.insert(id, i);
        }
    }
    let pc0 = engine.prefix_cache_stats();

    let usage0 = engine.kv_usage();
    let bytes_per_token =
        engine.kv_bytes() as f64 / ((usage0.num_blocks + 1) * opts.block_size) as f64;
    let preempt0 = engine.stats().preemptions;
    let swap0 = engine.stats().swap_bytes;
    let device0 = engine.stats().random_samples_on_device;
    let spec0 = engine.stats().clone();
    let bar = super::progress_bar(opts.progress, reqs.len() as u64, "requests");

    let t0 = Instant::now();
    let mut step_times = Vec::new();
    let mut timeline = Vec::new();
    let (mut peak_blocks, mut peak_reserve_len, mut peak_reserve_tok) = (0usize, 0usize, 0usize);
    let mut completed = 0;
    let mut output_tokens = 0usize;
    let mut step: u64 = 0;
    let mut interrupted = false;
    while engine.has_unfinished() {
        if opts.stop.load(Ordering::Relaxed) {
            interrupted = true;
            break;
        }
        let ts = Instant::now();
        let outs = engine.step()?;
        let now = t0.elapsed().as_secs_f64();
        step_times.push(ts.elapsed().as_secs_f64());
        for o in &outs {
            let Some(&i) = ids.get(&o.request_id) else {
                continue;
            };
            let rec = &mut records[i];
            rec.produced += o.new_token_ids.len();
            output_tokens += o.new_token_ids.len();
            if rec.first_token_s.is_none() {
                rec.first_token_s = Some(now);
                rec.first_token_step = Some(step);
            }
            if o.finished() {
                unfinished[i] -= 1;
                if unfinished[i] == 0 {
                    rec.finish_s = Some(now);
                    rec.finish_step = Some(step);
                    completed += 1;
                    bar.inc(1);
                }
            }
        }
        let u = engine.kv_usage();
        let (mut reserve_len, mut reserve_tok) = (0usize, 0usize);
        // NOTE: the scheduler's ids are per sample; a reserving engine reserves per sample too.
        for id in engine.running_sequence_ids() {
            if let Some(&i) = ids.get(&engine.request_of(*id)) {
                reserve_len += max_model_len;
                reserve_tok += reqs[i].prompt_len + reqs[i].output_len;
            }
        }
        peak_blocks = peak_blocks.max(u.blocks_used);
        peak_reserve_len = peak_reserve_len.max(reserve_len);
        peak_reserve_tok = peak_reserve_tok.max(reserve_tok);
        let ratio = |den: usize| {
            if den == 0 {
                0.0
            } else {
                u.tokens_stored as f64 / den as f64
            }
        };
        timeline.push(KvSample {
            t_s: now,
            kv_utilization: if u.blocks_used == 0 {
                0.0
            } else {
                u.utilization
            },
            kv_blocks_used: u.usage,
            reserve_baseline_utilization: ratio(reserve_len),
            reserve_max_tokens_utilization: ratio(reserve_tok),
            running: engine.num_running(),
            waiting: engine.num_waiting(),
        });
        if step.is_multiple_of(8) {
            let secs = t0.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "{:.1} output tokens/s",
                output_tokens as f64 / secs
            ));
        }
        step += 1;
    }
    let duration = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let pc = engine.prefix_cache_stats();

    // NOTE: samples taken while nothing is allocated (the very end) say nothing about waste.
    let live: Vec<&KvSample> = timeline.iter().filter(|s| s.running > 0).collect();
    let col = |f: fn(&KvSample) -> f64| live.iter().map(|s| f(s)).collect::<Vec<f64>>();
    let util = col(|s| s.kv_utilization);
    let blocks = col(|s| s.kv_blocks_used);
    let peak = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    // NOTE: a prompt counts once its first token came out (all of it was computed then), so
    // an interrupted run counts the prompts of unfinished requests too.
    let prompt_tokens: usize = records
        .iter()
        .filter(|r| r.first_token_s.is_some())
        .map(|r| r.prompt_len)
        .sum();
    let bytes = |tokens: usize| (tokens as f64 * bytes_per_token).round() as u64;
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
    Ok(ThroughputResult {
        backend: opts.backend.clone(),
        backend_detail: engine.backend_name(),
        scheduling: opts.scheduling.clone(),
        num_requests: reqs.len(),
        completed,
        duration_s: duration,
        requests_per_s: per_s(completed as f64),
        output_tokens_per_s: per_s(output_tokens as f64),
        total_tokens_per_s: per_s((prompt_tokens + output_tokens) as f64),
        prompt_tokens,
        output_tokens,
        steps: step,
        step_time_ms: Summary::of(&step_times).scaled(1e3),
        kv_utilization_mean: mean(&util),
        kv_utilization_peak: peak(&util),
        kv_blocks_used_mean: mean(&blocks),
        kv_blocks_used_peak: peak(&blocks),
        kv_peak_tokens: peak_blocks * opts.block_size,
        kv_peak_bytes: bytes(peak_blocks * opts.block_size),
        kv_capacity_tokens: usage0.num_blocks * opts.block_size,
        max_model_len,
        reserve_baseline_kv_utilization: mean(&col(|s| s.reserve_baseline_utilization)),
        reserve_baseline_peak_tokens: peak_reserve_len,
        reserve_baseline_peak_bytes: bytes(peak_reserve_len),
        reserve_max_tokens_kv_utilization: mean(&col(|s| s.reserve_max_tokens_utilization)),
        reserve_max_tokens_peak_tokens: peak_reserve_tok,
        reserve_max_tokens_peak_bytes: bytes(peak_reserve_tok),
        preemptions: engine.stats().preemptions - preempt0,
        prefix_caching: engine.prefix_caching(),
        n: opts.n,
        n_mode: if opts.separate_n { "separate" } else { "group" }.to_string(),
        temperature: opts.temperature,
        top_p: opts.top_p,
        random_samples_on_device: engine.stats().random_samples_on_device - device0,
        preemption_mode: engine.preemption_mode().name().to_string(),
        swap_bytes: engine.stats().swap_bytes - swap0,
        spec_draft_tokens: engine.stats().spec_draft_tokens - spec0.spec_draft_tokens,
        spec_accepted_tokens: engine.stats().spec_accepted_tokens - spec0.spec_accepted_tokens,
        prefix_cache_queries: pc.queries - pc0.queries,
        prefix_cache_hits: pc.hits - pc0.hits,
        prefix_cache_hit_rate: if pc.queries > pc0.queries {
            (pc.hits - pc0.hits) as f64 / (pc.queries - pc0.queries) as f64
        } else {
            0.0
        },
        ttft_ms: Summary::of(
            &records
                .iter()
                .filter_map(|r| r.first_token_s)
                .collect::<Vec<_>>(),
        )
        .scaled(1e3),
        kv_peak_blocks: peak_blocks,
        structured: opts
            .structured
            .as_ref()
            .map_or("none".to_string(), |(name, _)| name.clone()),
        tpot_ms: Summary::of(
            &records
                .iter()
                .filter_map(|r| match (r.first_token_s, r.finish_s) {
                    (Some(a), Some(b)) if r.produced > 1 => Some((b - a) / (r.produced - 1) as f64),
                    _ => None,
                })
                .collect::<Vec<_>>(),
        )
        .scaled(1e3),
        interrupted,
        kv_timeline: thin(timeline, MAX_TIMELINE_POINTS),
        requests: records,
    })
}

/// Keeps at most `max` points, evenly spaced, the last one always kept.
pub fn thin<T: Copy>(v: Vec<T>, max: usize) -> Vec<T> {
    if v.len() <= max || max < 2 {
        return v;
    }
    let n = v.len();
    (0..max).map(|k| v[k * (n - 1) / (max - 1)]).collect()
}

#[cfg(test)]
mod tests {
    use super::thin;

    #[test]
    fn thinning_keeps_ends_and_spacing() {
        let v: Vec<usize> = (0..10_000).collect();
        let t = thin(v.clone(), 101);
        assert_eq!(t.len(), 101);
        assert_eq!((t[0], t[100]), (0, 9999));
        assert!(t.windows(2).all(|w| (99..=100).contains(&(w[1] - w[0]))));
        assert_eq!(thin(vec![1, 2, 3], 10), vec![1, 2, 3]);
    }
}
