//! CPU decode throughput on SmolLM2-135M-Instruct: tokens/s for one sequence, and aggregate
//! tokens/s for 16 and 64 concurrent sequences. Prefill is excluded: the clock starts once every
//! prompt has been computed.
//!
//!     cargo bench --bench decode                       # all
//!     cargo bench --bench decode -- 1 16 --tokens 64   # some batch sizes, shorter runs
//!     PAGODA_BENCH_MODEL=path/to/model.gguf --dtype f32 ...   (default auto: as stored)
//!     cargo bench --features wgpu --bench decode -- --backend wgpu 1 8 --tokens 32
//!
//! Prints one line per batch size and a JSON summary last.

use pagoda::{Engine, EngineArgs, SamplingParams, WeightDtype};
use std::path::PathBuf;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut batches = vec![];
    let mut tokens = 128usize;
    let mut dtype = WeightDtype::Auto;
    let mut backend = pagoda::BackendKind::Cpu;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokens" => tokens = args.next().unwrap_or_default().parse()?,
            "--dtype" => dtype = args.next().unwrap_or_default().parse()?,
            "--backend" => backend = args.next().unwrap_or_default().parse()?,
            "--bench" => {}
            s => batches.push(s.parse::<usize>()?),
        }
    }
    if batches.is_empty() {
        batches = vec![1, 16, 64];
    }
    let model = match std::env::var_os("PAGODA_BENCH_MODEL") {
        Some(p) => PathBuf::from(p),
        None => pagoda::fetch::default_model()?,
    };
    let mut engine = Engine::new(EngineArgs {
        model: Some(model.clone()),
        dtype,
        backend,
        ..Default::default()
    })?;
    println!(
        "model {} ({}), backend {}, {} threads",
        model.display(),
        dtype.name(),
        engine.backend_name(),
        rayon::current_num_threads()
    );
    let mut results = vec![];
    // Prefill: one prompt of 512 tokens, timed to its first token.
    let long: Vec<u32> = (0..512u32).map(|i| 1000 + (i * 7919) % 30000).collect();
    let t0 = Instant::now();
    engine.add_request(
        long.into(),
        SamplingParams {
            max_tokens: Some(1),
            ..SamplingParams::greedy()
        },
    )?;
    while engine.has_unfinished() {
        engine.step()?;
    }
    let prefill = 512.0 / t0.elapsed().as_secs_f64();
    println!("prefill 512 tokens: {prefill:.1} tokens/s");
    results.push(format!("{{\"prefill_tokens_per_s\": {prefill:.2}}}"));
    for &n in &batches {
        let params = SamplingParams {
            max_tokens: Some(tokens),
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        for i in 0..n {
            let prompt =
                format!("Request {i}: write a long story about a lighthouse keeper and the sea.");
            engine.add_request(prompt.into(), params.clone())?;
        }
        // Prefill: step until every request has its first token.
        let mut produced = 0usize;
        while produced < n {
            produced += engine.step()?.len();
        }
        let t0 = Instant::now();
        let mut generated = 0usize;
        let mut steps = 0;
        while engine.has_unfinished() {
            generated += engine
                .step()?
                .iter()
                .map(|o| o.new_token_ids.len())
                .sum::<usize>();
            steps += 1;
        }
        let secs = t0.elapsed().as_secs_f64();
        let tps = generated as f64 / secs;
        println!(
            "batch {n:>3}: {generated} tokens in {secs:.2} s = {tps:.1} tokens/s ({:.1} ms/step, {:.1} tokens/s per sequence)",
            secs * 1e3 / steps as f64,
            tps / n as f64
        );
        results.push(format!(
            "{{\"batch\": {n}, \"tokens_per_s\": {tps:.2}, \"ms_per_step\": {:.2}}}",
            secs * 1e3 / steps as f64
        ));
    }
    // Resident memory now, after the runs (the peak during loading is higher: the file's
    // mapped pages and the weights being read).
    let rss_mib = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            l.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(-1.0, |kb| kb / 1024.0);
    println!(
        "{{\"backend\": \"{}\", \"dtype\": \"{}\", \"weights_mib\": {:.1}, \"rss_mib\": {rss_mib:.1}, \"results\": [{}]}}",
        engine.backend_name(),
        dtype.name(),
        engine.weight_bytes() as f64 / (1u64 << 20) as f64,
        results.join(", ")
    );
    Ok(())
}
