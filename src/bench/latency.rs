//! Latency: one batch of a fixed size (fixed prompt and output lengths) submitted at once and
//! run to its end, repeated; per request the time to first token (TTFT), the time per output
//! token after the first (TPOT) and the end-to-end latency; per iteration the batch latency.
//! Swept over batch sizes.

use super::stats::Summary;
use super::workload::{prompt_tokens, word_token_ids};
use crate::engine::{Engine, Prompt};
use crate::sampling::SamplingParams;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Latency figures of one batch size on one backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencyResult {
    pub backend: String,
    pub backend_detail: String,
    pub batch_size: usize,
    pub input_len: usize,
    pub output_len: usize,
    /// Measured iterations (warm-up ones excluded).
    pub iterations: usize,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub e2e_ms: Summary,
    /// Time for the whole batch, per iteration.
    pub batch_latency_ms: Summary,
    /// Output tokens of all iterations over their total time.
    pub output_tokens_per_s: f64,
    pub interrupted: bool,
}

pub struct LatencyOptions<'a> {
    pub backend: String,
    pub input_len: usize,
    pub output_len: usize,
    pub iterations: usize,
    pub warmup: usize,
    pub seed: u64,
    pub stop: &'a AtomicBool,
    pub progress: bool,
}

/// Per-request times of one batch, in seconds from its submission.
struct Timing {
    first: Option<f64>,
    end: Option<f64>,
    tokens: usize,
}

/// Runs `warmup + iterations` batches of `batch_size` and summarises the measured ones.
pub fn run(engine: &mut Engine, batch_size: usize, opts: &LatencyOptions) -> Result<LatencyResult> {
    let tok = engine.tokenizer().clone();
    let vocab = word_token_ids(|w| tok.encode(w))?;
    let params = SamplingParams {
        max_tokens: Some(opts.output_len),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let (mut ttft, mut tpot, mut e2e, mut batch) = (vec![], vec![], vec![], vec![]);
    let (mut tokens, mut busy) = (0usize, 0.0f64);
    let total = (opts.warmup + opts.iterations) as u64;
    let bar = super::progress_bar(opts.progress, total, &format!("batch {batch_size}"));
    let mut interrupted = false;
    let mut measured = 0;
    for it in 0..opts.warmup + opts.iterations {
        if opts.stop.load(Ordering::Relaxed) {
            interrupted = true;
            break;
        }
        let t0 = Instant::now();
        let mut timing = HashMap::new();
        for i in 0..batch_size {
            let prompt = prompt_tokens(opts.seed, it * batch_size + i, opts.input_len, &vocab);
            let id = engine
                .add_request(Prompt::Tokens(prompt), params.clone())
                .map_err(|e| anyhow::anyhow!("request refused: {e}"))?;
            timing.insert(
                id,
                Timing {
                    first: None,
                    end: None,
                    tokens: 0,
                },
            );
        }
        while engine.has_unfinished() {
            if opts.stop.load(Ordering::Relaxed) {
                interrupted = true;
                for id in timing.keys() {
                    engine.abort(*id);
                }
                break;
            }
            let outs = engine.step()?;
            let now = t0.elapsed().as_secs_f64();
            for o in outs {
                if let Some(t) = timing.get_mut(&o.request_id) {
                    t.tokens += o.new_token_ids.len();
                    t.first.get_or_insert(now);
                    if o.finished() {
                        t.end = Some(now);
                    }
                }
            }
        }
        if interrupted {
            break;
        }
        let secs = t0.elapsed().as_secs_f64();
        bar.inc(1);
        if it < opts.warmup {
            continue;
        }
        measured += 1;
        batch.push(secs);
        busy += secs;
        for t in timing.values() {
            let (Some(first), Some(end)) = (t.first, t.end) else {
                continue;
            };
            tokens += t.tokens;
            ttft.push(first);
            e2e.push(end);
            if t.tokens > 1 {
                tpot.push((end - first) / (t.tokens - 1) as f64);
            }
        }
    }
    bar.finish_and_clear();
    Ok(LatencyResult {
        backend: opts.backend.clone(),
        backend_detail: engine.backend_name(),
        batch_size,
        input_len: opts.input_len,
        output_len: opts.output_len,
        iterations: measured,
        ttft_ms: Summary::of(&ttft).scaled(1e3),
        tpot_ms: Summary::of(&tpot).scaled(1e3),
        e2e_ms: Summary::of(&e2e).scaled(1e3),
        batch_latency_ms: Summary::of(&batch).scaled(1e3),
        output_tokens_per_s: if busy > 0.0 {
            tokens as f64 / busy
        } else {
            0.0
        },
        interrupted,
    })
}
