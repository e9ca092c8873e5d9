//! The benchmark runs on the real (small) SmolLM2 model with tiny workloads: the static
//! baseline really waits for the longest request of its batch, and the figures hang together.

mod common;

use pagoda::bench::latency::{self, LatencyOptions};
use pagoda::bench::throughput::{self, ThroughputOptions, ThroughputResult};
use pagoda::bench::workload::{RequestLens, SharedPrefixes};
use pagoda::engine::KvBudget;
use pagoda::sched::SchedulingPolicy;
use pagoda::{Engine, EngineArgs};
use std::sync::atomic::AtomicBool;

fn engine(policy: SchedulingPolicy, max_num_seqs: usize) -> Engine {
    Engine::new(EngineArgs {
        model: Some(common::model_path(common::SMOL_GGUF)),
        max_num_seqs,
        max_model_len: Some(512),
        kv_budget: Some(KvBudget::Bytes(32 << 20)),
        scheduling: policy,
        ..Default::default()
    })
    .unwrap()
}

fn run(policy: SchedulingPolicy, reqs: &[RequestLens], stop: &AtomicBool) -> ThroughputResult {
    let mut e = engine(policy, 2);
    let opts = ThroughputOptions {
        backend: "cpu".into(),
        scheduling: format!("{policy:?}"),
        block_size: 16,
        seed: 5,
        prefixes: None,
        n: 1,
        separate_n: false,
        temperature: 0.0,
        top_p: 1.0,
        structured: None,
        stop,
        progress: false,
    };
    throughput::run(&mut e, reqs, &opts).unwrap()
}

fn lens(v: &[(usize, usize)]) -> Vec<RequestLens> {
    v.iter()
        .map(|&(prompt_len, output_len)| RequestLens {
            prompt_len,
            output_len,
        })
        .collect()
}

#[test]
fn static_batching_waits_for_the_longest_request_and_continuous_does_not() {
    // two at a time: request 1 is the long one of the first batch
    let reqs = lens(&[(8, 2), (8, 12), (8, 2), (8, 2)]);
    let stop = AtomicBool::new(false);
    let st = run(SchedulingPolicy::Static, &reqs, &stop);
    let co = run(SchedulingPolicy::Continuous, &reqs, &stop);
    for r in [&st, &co] {
        assert_eq!(r.completed, 4);
        assert_eq!(r.output_tokens, 18);
        assert_eq!(r.prompt_tokens, 32);
        assert!(r.requests.iter().all(|q| q.produced == q.output_len));
        assert_eq!(r.preemptions, 0);
        assert!(!r.interrupted);
    }
    let first = |r: &ThroughputResult, i: usize| r.requests[i].first_token_step.unwrap();
    let end = |r: &ThroughputResult, i: usize| r.requests[i].finish_step.unwrap();
    // static: the second batch (2 and 3) starts only after the longest of the first ends
    assert!(end(&st, 0) < end(&st, 1));
    assert!(first(&st, 2) > end(&st, 1), "{:?}", st.requests);
    assert!(first(&st, 3) > end(&st, 1));
    // while request 1 finishes alone, others wait although a slot is free: for 10 steps under
    // static batching, for one step at a time (until the next admission) under continuous
    let idle_slot = |r: &ThroughputResult| {
        r.kv_timeline
            .iter()
            .filter(|s| s.running == 1 && s.waiting > 0)
            .count()
    };
    assert!(idle_slot(&st) >= 9, "{}", idle_slot(&st));
    assert!(idle_slot(&co) <= 2, "{}", idle_slot(&co));
    // continuous: request 2 takes request 0's place while request 1 still runs
    assert!(first(&co, 2) < end(&co, 1), "{:?}", co.requests);
    assert!(co.steps < st.steps);
}

#[test]
fn kv_figures_hang_together() {
    let reqs = lens(&[(40, 6), (3, 20), (17, 9), (60, 3), (5, 5)]);
    let stop = AtomicBool::new(false);
    let r = run(SchedulingPolicy::Continuous, &reqs, &stop);
    assert_eq!(r.steps as usize, r.kv_timeline.len());
    assert_eq!(r.step_time_ms.count as u64, r.steps);
    assert!(r.kv_utilization_mean > 0.3 && r.kv_utilization_mean <= 1.0);
    assert!(r.kv_utilization_peak >= r.kv_utilization_mean && r.kv_utilization_peak <= 1.0);
    // an engine reserving prompt + max_tokens uses at most all of it, and one reserving the
    // whole context (512) uses less still
    assert!(r.reserve_max_tokens_kv_utilization <= 1.0);
    assert!(r.reserve_baseline_kv_utilization < r.reserve_max_tokens_kv_utilization);
    assert_eq!(r.max_model_len, 512);
    assert_eq!(r.reserve_baseline_peak_tokens, 2 * 512);
    assert!(r.reserve_max_tokens_peak_tokens <= 46 + 63);
    assert!(r.kv_peak_tokens <= r.reserve_max_tokens_peak_tokens + 2 * 16);
    assert!(r.kv_peak_bytes > 0 && r.reserve_baseline_peak_bytes > r.kv_peak_bytes);
    assert!(r.output_tokens_per_s > 0.0 && r.total_tokens_per_s > r.output_tokens_per_s);
}

#[test]
fn an_interrupted_run_returns_what_it_has() {
    let stop = AtomicBool::new(true);
    let r = run(SchedulingPolicy::Continuous, &lens(&[(8, 4)]), &stop);
    assert!(r.interrupted);
    assert_eq!((r.completed, r.steps), (0, 0));
    assert_eq!(r.requests_per_s, 0.0);
}

#[test]
fn latency_measures_each_request_of_each_iteration() {
    let mut e = engine(SchedulingPolicy::Continuous, 8);
    let stop = AtomicBool::new(false);
    let opts = LatencyOptions {
        backend: "cpu".into(),
        input_len: 8,
        output_len: 5,
        iterations: 2,
        warmup: 1,
        seed: 1,
        stop: &stop,
        progress: false,
    };
    let r = latency::run(&mut e, 3, &opts).unwrap();
    assert_eq!(r.iterations, 2);
    assert_eq!(
        (r.ttft_ms.count, r.tpot_ms.count, r.e2e_ms.count),
        (6, 6, 6)
    );
    assert_eq!(r.batch_latency_ms.count, 2);
    assert!(r.ttft_ms.p50 > 0.0 && r.e2e_ms.min >= r.ttft_ms.min);
    assert!(r.tpot_ms.p50 > 0.0 && r.output_tokens_per_s > 0.0);
    assert!(!e.has_unfinished());
}

fn run_with(
    e: &mut Engine,
    reqs: &[RequestLens],
    prefixes: Option<SharedPrefixes>,
    n: usize,
    separate_n: bool,
) -> ThroughputResult {
    let stop = AtomicBool::new(false);
    let opts = ThroughputOptions {
        backend: "cpu".into(),
        scheduling: "continuous".into(),
        block_size: 16,
        seed: 9,
        prefixes,
        n,
        separate_n,
        temperature: 0.0,
        top_p: 1.0,
        structured: None,
        stop: &stop,
        progress: false,
    };
    throughput::run(e, reqs, &opts).unwrap()
}

fn engine_caching(prefix_caching: bool) -> Engine {
    Engine::new(EngineArgs {
        model: Some(common::model_path(common::SMOL_GGUF)),
        max_model_len: Some(512),
        kv_budget: Some(KvBudget::Bytes(64 << 20)),
        enable_prefix_caching: prefix_caching,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn the_prefix_workload_hits_the_cache_only_when_it_is_on() {
    let p = SharedPrefixes { len: 64, count: 2 };
    // 64 shared + 8 own tokens each; request i uses prefix i % 2
    let reqs = lens(&[(72, 2); 6]);
    let on = run_with(&mut engine_caching(true), &reqs, Some(p), 1, false);
    let off = run_with(&mut engine_caching(false), &reqs, Some(p), 1, false);
    assert_eq!(off.prefix_cache_hits, 0);
    assert!(!off.prefix_caching && on.prefix_caching);
    // the first request of each prefix computes it, the other four find its 4 full blocks
    assert_eq!(on.prefix_cache_queries, 6 * 72);
    assert!(on.prefix_cache_hits >= 4 * 64, "{}", on.prefix_cache_hits);
    assert!(on.kv_peak_blocks < off.kv_peak_blocks);
    assert_eq!(on.output_tokens, off.output_tokens);
}

#[test]
fn n_samples_as_one_request_use_fewer_blocks_than_as_separate_requests() {
    let reqs = lens(&[(100, 4); 2]);
    let group = run_with(&mut engine_caching(false), &reqs, None, 4, false);
    let separate = run_with(&mut engine_caching(false), &reqs, None, 4, true);
    for r in [&group, &separate] {
        assert_eq!(r.output_tokens, 2 * 4 * 4);
        assert_eq!(r.completed, 2);
        assert!(r.requests.iter().all(|q| q.produced == 16));
    }
    // 100 tokens: 6 full blocks shared by the 4 samples, 1 own block each, per request
    assert_eq!(group.kv_peak_blocks, 2 * (6 + 4));
    assert_eq!(separate.kv_peak_blocks, 2 * 4 * 7);
    assert_eq!(group.n_mode, "group");
    assert_eq!(separate.n_mode, "separate");
}

/// `--structured json`: every output is JSON of the schema (ended where the JSON ends, so at
/// most the requested length), and the time per output token is measured.
#[test]
fn throughput_with_json_schema_output() {
    let mut e = engine(SchedulingPolicy::Continuous, 4);
    let stop = AtomicBool::new(false);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": false,
        // NOTE: compact JSON (llguidance's option), so that the length is known: {"n":D}.
        "x-guidance": {"whitespace_flexible": false}
    });
    let opts = ThroughputOptions {
        backend: "cpu".into(),
        scheduling: "continuous".into(),
        block_size: 16,
        seed: 3,
        prefixes: None,
        n: 1,
        separate_n: false,
        temperature: 0.0,
        top_p: 1.0,
        structured: Some((
            "json".into(),
            pagoda::sampling::StructuredOutput::Json(schema),
        )),
        stop: &stop,
        progress: false,
    };
    let reqs = lens(&[(20, 30), (12, 30), (40, 30)]);
    let r = throughput::run(&mut e, &reqs, &opts).unwrap();
    assert_eq!((r.structured.as_str(), r.completed), ("json", 3));
    for q in &r.requests {
        // {"n":D}: a handful of tokens, never the 30 asked for.
        assert!(q.produced >= 3 && q.produced < 12, "{q:?}");
    }
    assert!(r.tpot_ms.p50 > 0.0, "{:?}", r.tpot_ms);
}
