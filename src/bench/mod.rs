//! Benchmarks in vLLM's spirit, on any backend and against the same baselines: offline
//! throughput (continuous against static batching; KV utilization against an engine that
//! reserves memory per request), latency over batch sizes, a load generator for any
//! OpenAI-compatible server, and reports (Markdown and an SVG chart) from the JSON results.
//!
//! ```text
//!   workload.rs   lengths (fixed | uniform | sharegpt-like) and prompts, from a seed
//!   stats.rs      mean, percentiles
//!   throughput.rs latency.rs   runs on an Engine          serve.rs   runs against a server
//!   report.rs     JSON results → Markdown table + SVG chart
//!   cli.rs        the `pagoda bench` subcommands: flags, tables printed, JSON written
//! ```

pub mod cli;
pub mod latency;
pub mod report;
pub mod serve;
pub mod stats;
pub mod throughput;
pub mod workload;

pub use cli::{LatencyArgs, ReportArgs, ServeBenchArgs, ThroughputArgs};

use serde::{Deserialize, Serialize};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The machine a result was measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Machine {
    pub hostname: String,
    pub os: String,
    pub arch: String,
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
}

impl Machine {
    pub fn detect() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let memory_gib = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map(|kb| (kb / (1024.0 * 1024.0) * 10.0).round() / 10.0)
            .unwrap_or(0.0);
        Machine {
            hostname: read("/proc/sys/kernel/hostname").trim().to_string(),
            os: std::env::consts::OS.to_string(),
            arch: std::env::consts::ARCH.to_string(),
            cpu,
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_gib,
        }
    }
}

/// A flag that Ctrl-C sets: runs stop at their next step and still write what they measured.
/// A second Ctrl-C ends the process at once.
pub fn interrupt_flag() -> &'static AtomicBool {
    static FLAG: AtomicBool = AtomicBool::new(false);
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("ctrl-c".into())
            .spawn(|| {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async {
                    while tokio::signal::ctrl_c().await.is_ok() {
                        if FLAG.swap(true, Ordering::SeqCst) {
                            eprintln!("\ninterrupted again: exiting without results");
                            std::process::exit(130);
                        }
                        eprintln!("\ninterrupted: finishing the step, then writing what was measured (Ctrl-C again to quit)");
                    }
                });
            });
        if let Err(e) = spawned {
            tracing::warn!("no Ctrl-C handler: {e}");
        }
    });
    &FLAG
}

/// A progress bar on stderr (hidden when `enabled` is false or stderr is not a terminal).
pub fn progress_bar(enabled: bool, len: u64, what: &str) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{elapsed_precise}} {{bar:40}} {{pos}}/{{len}} {what} {{msg}}"
        ))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}
