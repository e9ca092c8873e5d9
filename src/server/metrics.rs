//! Server metrics in the Prometheus text format, named as vLLM names them with `pagoda:` in place
//! of `vllm:` (so a vLLM dashboard ports with one substitution).
//!
//! The engine thread writes them (gauges after every step, counters and histograms when a request
//! ends); `GET /metrics` reads them. One mutex is enough: both sides hold it for microseconds.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Bucket upper bounds (seconds), as vLLM's.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last entry is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// The gauges the engine thread refreshes after each step.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineGauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and of those found there.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Speculative decoding: request-steps that verified drafts, drafts verified, kept.
    pub spec_decode_num_drafts: u64,
    pub spec_decode_num_draft_tokens: u64,
    pub spec_decode_num_accepted_tokens: u64,
}

/// vLLM's `lora_requests_info`: the adapters of the running and of the waiting requests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraGauge {
    pub max_loras: usize,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

#[derive(Debug)]
struct Inner {
    gauges: EngineGauges,
    /// With `--enable-lora`.
    lora: Option<LoraGauge>,
    success: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
}

#[derive(Debug)]
pub struct Metrics {
    model_name: String,
    inner: Mutex<Inner>,
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let mut success = BTreeMap::new();
        for r in ["stop", "length", "abort"] {
            success.insert(r, 0);
        }
        Metrics {
            model_name: model_name.replace('\\', "\\\\").replace('"', "\\\""),
            inner: Mutex::new(Inner {
                gauges: EngineGauges::default(),
                lora: None,
                success,
                ttft: Histogram::new(TTFT_BUCKETS),
                tpot: Histogram::new(TPOT_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // NOTE: a poisoned lock only means a panic elsewhere mid-update; the numbers are still
        // numbers, so keep serving them.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_gauges(&self, g: EngineGauges) {
        self.lock().gauges = g;
    }

    pub fn set_lora(&self, g: LoraGauge) {
        self.lock().lora = Some(g);
    }

    pub fn gauges(&self) -> EngineGauges {
        self.lock().gauges
    }

    pub fn observe_first_token(&self, ttft_s: f64) {
        self.lock().ttft.observe(ttft_s);
    }

    /// A request ended: its finish reason, end-to-end latency, and the mean time per output
    /// token after the first (when it generated more than one).
    pub fn observe_finished(&self, reason: &'static str, e2e_s: f64, tpot_s: Option<f64>) {
        let mut m = self.lock();
        *m.success.entry(reason).or_default() += 1;
        m.e2e.observe(e2e_s);
        if let Some(t) = tpot_s {
            m.tpot.observe(t);
        }
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let m = self.lock();
        let g = m.gauges;
        let label = format!("model_name=\"{}\"", self.model_name);
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{{label}}} {value}");
        };
        one(
            "pagoda:num_requests_running",
            "gauge",
            "Requests in the running batch.",
            g.running.to_string(),
        );
        one(
            "pagoda:num_requests_waiting",
            "gauge",
            "Requests waiting to be scheduled.",
            g.waiting.to_string(),
        );
        one(
            "pagoda:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV cache blocks in use (1 = full).",
            g.kv_usage.to_string(),
        );
        one(
            "pagoda:kv_cache_blocks_used",
            "gauge",
            "KV cache blocks in use.",
            g.kv_blocks_used.to_string(),
        );
        one(
            "pagoda:kv_cache_blocks_total",
            "gauge",
            "Usable KV cache blocks.",
            g.kv_blocks_total.to_string(),
        );
        one(
            "pagoda:prompt_tokens_total",
            "counter",
            "Prompt tokens admitted.",
            g.prompt_tokens.to_string(),
        );
        one(
            "pagoda:generation_tokens_total",
            "counter",
            "Tokens generated.",
            g.generation_tokens.to_string(),
        );
        one(
            "pagoda:num_preemptions_total",
            "counter",
            "Requests preempted (recomputed later) for lack of KV blocks.",
            g.preemptions.to_string(),
        );
        one(
            "pagoda:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            g.prefix_cache_queries.to_string(),
        );
        one(
            "pagoda:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache (not computed).",
            g.prefix_cache_hits.to_string(),
        );
        one(
            "pagoda:spec_decode_num_drafts_total",
            "counter",
            "Speculative decoding: request-steps that verified draft tokens.",
            g.spec_decode_num_drafts.to_string(),
        );
        one(
            "pagoda:spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative decoding: draft tokens verified.",
            g.spec_decode_num_draft_tokens.to_string(),
        );
        one(
            "pagoda:spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative decoding: draft tokens accepted.",
            g.spec_decode_num_accepted_tokens.to_string(),
        );
        let name = "pagoda:request_success_total";
        let _ = writeln!(out, "# HELP {name} Requests finished, by finish reason.");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (reason, n) in &m.success {
            let _ = writeln!(out, "{name}{{{label},finished_reason=\"{reason}\"}} {n}");
        }
        for (name, help, h) in [
            (
                "pagoda:time_to_first_token_seconds",
                "Time from arrival to the first generated token.",
                &m.ttft,
            ),
            (
                "pagoda:time_per_output_token_seconds",
                "Mean time per output token after the first, per request.",
                &m.tpot,
            ),
            (
                "pagoda:e2e_request_latency_seconds",
                "Time from arrival to the end of the request.",
                &m.e2e,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
            let mut cum = 0;
            for (i, c) in h.counts.iter().enumerate() {
                cum += c;
                let le = h
                    .bounds
                    .get(i)
                    .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
                let _ = writeln!(out, "{name}_bucket{{{label},le=\"{le}\"}} {cum}");
            }
            let _ = writeln!(out, "{name}_sum{{{label}}} {}", h.sum);
            let _ = writeln!(out, "{name}_count{{{label}}} {}", h.count);
        }
        if let Some(l) = &m.lora {
            // NOTE: as vLLM's, an info gauge: the labels carry the data, the value is when.
            let name = "pagoda:lora_requests_info";
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let esc = |v: &[String]| v.join(",").replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "# HELP {name} LoRA adapters of the running and waiting requests."
            );
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(
                out,
                "{name}{{{label},max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now}",
                l.max_loras,
                esc(&l.running),
                esc(&l.waiting)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_requests_info_names_the_adapters_in_its_labels() {
        let m = Metrics::new("m");
        assert!(
            !m.render().contains("lora_requests_info"),
            "only with --enable-lora"
        );
        m.set_lora(LoraGauge {
            max_loras: 4,
            running: vec!["sql".into(), "chat".into()],
            waiting: vec!["q\"x".into()],
        });
        let text = m.render();
        let line = text
            .lines()
            .find(|l| l.starts_with("pagoda:lora_requests_info{"))
            .unwrap();
        assert!(
            line.starts_with(
                "pagoda:lora_requests_info{model_name=\"m\",max_lora=\"4\",running_lora_adapters=\"sql,chat\",waiting_lora_adapters=\"q\\\"x\"} "
            ),
            "{line}"
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::new("m");
        m.observe_first_token(0.003);
        m.observe_first_token(0.5);
        m.observe_first_token(1e6);
        m.observe_finished("stop", 1.0, Some(0.02));
        let text = m.render();
        assert!(text.contains(
            "pagoda:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.005\"} 1"
        ));
        assert!(
            text.contains(
                "pagoda:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.5\"} 2"
            )
        );
        assert!(
            text.contains(
                "pagoda:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 3"
            )
        );
        assert!(text.contains("pagoda:time_to_first_token_seconds_count{model_name=\"m\"} 3"));
        assert!(
            text.contains(
                "pagoda:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 1"
            )
        );
        assert!(text.contains(
            "pagoda:request_success_total{model_name=\"m\",finished_reason=\"length\"} 0"
        ));
    }
}
