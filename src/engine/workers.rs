//! Tensor and pipeline parallelism on one machine: one worker thread per (stage, tensor rank),
//! each with its own backend, its shard of the weights and its part of the KV pool, behind
//! the same [`ModelRunner`] trait as a single device. The engine above is unchanged: its one
//! scheduler and block manager hand out block ids that index every worker's pool alike.
//!
//! ```text
//!  execute(batch) ──▶ every worker gets the batch ──▶ stage 0: embed, its layers ─send─▶
//!                                                    stage 1: its layers ... last stage:
//!                                                    logits of its vocabulary part
//!  ◀── logits [R, vocab]: the last stage's parts side by side
//! ```
//!
//! NOTE: one batch is in flight at a time, so with pipeline parallelism one stage computes
//! while the others wait (vLLM keeps `pp` micro-batches in flight through virtual engines;
//! not done here). On the CPU the workers share the cores, so this is a way to test the
//! sharded model, not a speed-up.

use super::runner::{LogitsPart, ModelRunner, Runner, RunnerArgs, plan, pool_blocks};
use crate::backend::{Backend, BatchInput};
use crate::models::kv_cache;
use crate::models::{LoadedModel, WeightStats, registry};
use crate::parallel::{Communicator, LocalComm, LocalGroup, ParallelConfig, Placement, split_even};
use anyhow::{Context, Result, anyhow, bail};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};

enum Job {
    Execute(Arc<BatchInput>),
    Swap(Arc<SwapPairs>),
}

/// Swap preemption's block pairs of one step: out (device, host), in (host, device).
type SwapPairs = (Vec<(u32, u32)>, Vec<(u32, u32)>);

struct Worker {
    jobs: Sender<Job>,
    replies: Receiver<Result<LogitsPart>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub struct ParallelRunner {
    name: String,
    config: ParallelConfig,
    workers: Vec<Worker>,
    /// Every group, to abort and reset after a failed step.
    groups: Vec<Arc<LocalGroup>>,
    vocab_size: usize,
    num_blocks: usize,
    kv_bytes: u64,
    stats: WeightStats,
    token_budget: usize,
}

/// The worker at (stage, rank) runs its jobs until the runner is dropped. A failure or a panic
/// aborts the worker's groups, so that no other worker waits for it in a collective.
fn serve<B: Backend>(
    mut runner: Runner<B>,
    groups: [Arc<LocalGroup>; 2],
    jobs: Receiver<Job>,
    replies: Sender<Result<LogitsPart>>,
) {
    while let Ok(job) = jobs.recv() {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &job {
            Job::Execute(input) => runner.execute_part(input.as_ref().clone()),
            Job::Swap(pairs) => runner.swap_blocks(&pairs.0, &pairs.1).map(|_| None),
        }));
        let reply = run.unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(anyhow!("a worker panicked: {msg}"))
        });
        if reply.is_err() {
            groups.iter().for_each(|g| g.abort());
        }
        if replies.send(reply).is_err() {
            break;
        }
    }
}

/// Builds the workers on the CPU backend (`make` makes each worker's backend): checks the
/// split against the model, loads every shard (all at once, one thread each), sizes one pool
/// for all of them, and starts their threads.
pub fn build_parallel<B: Backend>(
    make: impl Fn() -> Result<B> + Sync,
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    let pc = args.parallel;
    let cfg = &model.config;
    pc.check(cfg)?;
    let probe = make()?;
    let positions = plan(&probe, model, args)?;
    let token_budget = probe.default_token_budget();
    let name = format!(
        "{} (tensor parallel {}, pipeline parallel {})",
        probe.name(),
        pc.tensor,
        pc.pipeline
    );
    drop(probe);

    // worker w = stage * tensor + rank; one tensor group per stage, one pipeline group per rank
    let mut tp: Vec<Vec<LocalComm>> = (0..pc.pipeline)
        .map(|_| LocalGroup::new(pc.tensor))
        .collect();
    let mut pp: Vec<Vec<LocalComm>> = (0..pc.tensor)
        .map(|_| LocalGroup::new(pc.pipeline))
        .collect();
    let groups: Vec<Arc<LocalGroup>> = tp.iter().chain(&pp).map(|g| g[0].group().clone()).collect();
    let mut places = Vec::with_capacity(pc.world_size());
    for stage in (0..pc.pipeline).rev() {
        for rank in (0..pc.tensor).rev() {
            let t = tp[stage].pop().expect("one handle per rank");
            let p = pp[rank].pop().expect("one handle per stage");
            let gs = [t.group().clone(), p.group().clone()];
            let place = Placement::<B> {
                tp: Arc::new(t) as Arc<dyn Communicator<B>>,
                pp: Arc::new(p) as Arc<dyn Communicator<B>>,
                layers: split_even(cfg.num_layers, pc.pipeline, stage),
            };
            places.push((place, gs));
        }
    }
    places.reverse();

    // NOTE: every shard loads at once, worker 0's on this thread (its layers are the progress
    // shown), the others on threads of their own.
    let load = |place: Placement<B>, progress: &mut dyn FnMut(usize, usize)| -> Result<_> {
        let backend = make()?;
        let lm = registry::load_shard(
            &backend,
            cfg,
            model.weights.as_ref(),
            args.dtype,
            positions,
            place,
            progress,
        )?;
        Ok((backend, lm))
    };
    let mut places = places.into_iter();
    let (place0, gs0) = places.next().expect("at least one worker");
    let loaded: Vec<Result<_>> = std::thread::scope(|s| {
        let handles: Vec<_> = places
            .map(|(place, gs)| {
                let load = &load;
                s.spawn(move || load(place, &mut |_, _| {}).map(|(b, lm)| (b, lm, gs)))
            })
            .collect();
        let first = load(place0, progress).map(|(b, lm)| (b, lm, gs0));
        std::iter::once(first)
            .chain(handles.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("loading a shard panicked")))
            }))
            .collect()
    });
    let loaded = loaded
        .into_iter()
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("loading {}", model.path.display()))?;

    // NOTE: one pool size for every worker (the block manager is one), from the bytes a
    // block takes over all workers: on the CPU they share the memory, and the budget is the
    // whole pool's.
    let mut per_block = 0u64;
    let mut stats = WeightStats::default();
    for (_, lm, _) in &loaded {
        per_block += kv_cache::bytes_per_block(&lm.kv_spec(), args.block_size)?;
        stats.absorb(lm.weight_stats());
    }
    let num_blocks = pool_blocks(&loaded[0].0, args, stats.bytes, per_block, positions)?;

    let mut workers = Vec::with_capacity(loaded.len());
    for (w, (backend, lm, gs)) in loaded.into_iter().enumerate() {
        let runner = Runner::new(backend, lm, num_blocks, args.block_size)?;
        let (jobs, job_rx) = channel();
        let (reply_tx, replies) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("pagoda-worker-{w}"))
            .spawn(move || serve(runner, gs, job_rx, reply_tx))
            .context("starting a worker thread")?;
        workers.push(Worker {
            jobs,
            replies,
            thread: Some(thread),
        });
    }
    Ok(Box::new(ParallelRunner {
        name,
        config: pc,
        workers,
        groups,
        vocab_size: cfg.vocab_size,
        num_blocks,
        kv_bytes: num_blocks as u64 * per_block,
        stats,
        token_budget,
    }))
}

impl ParallelRunner {
    /// Gives every worker the job and waits for all of them; after a failure every group is
    /// reset (each worker has answered, so none is inside a collective) and the error most
    /// likely to be the cause is returned (not "another worker failed").
    fn run_all(&mut self, job: impl Fn() -> Job) -> Result<Vec<LogitsPart>> {
        for w in &self.workers {
            w.jobs
                .send(job())
                .map_err(|_| anyhow!("a worker thread has stopped"))?;
        }
        let replies: Vec<Result<LogitsPart>> = self
            .workers
            .iter()
            .map(|w| {
                w.replies
                    .recv()
                    .unwrap_or_else(|_| Err(anyhow!("a worker thread has stopped")))
            })
            .collect();
        if replies.iter().all(|r| r.is_ok()) {
            return Ok(replies.into_iter().map(|r| r.unwrap()).collect());
        }
        self.groups.iter().for_each(|g| g.reset());
        let mut errs: Vec<anyhow::Error> = replies.into_iter().filter_map(|r| r.err()).collect();
        let cause = errs
            .iter()
            .position(|e| !format!("{e:#}").contains("another worker failed"))
            .unwrap_or(0);
        Err(errs.swap_remove(cause))
    }

    /// The logits `[R, vocab]` from the last stage's parts.
    fn logits(&mut self, input: BatchInput) -> Result<Vec<f32>> {
        let rows = input.logits_rows.len();
        let input = Arc::new(input);
        let parts = self.run_all(|| Job::Execute(input.clone()))?;
        let v = self.vocab_size;
        let mut out = vec![0f32; rows * v];
        let mut covered = 0;
        for (range, row_len, data) in parts.into_iter().flatten() {
            if data.len() != rows * row_len || range.end > v || range.len() > row_len {
                bail!("a worker returned logits of the wrong shape");
            }
            for r in 0..rows {
                out[r * v + range.start..r * v + range.end]
                    .copy_from_slice(&data[r * row_len..r * row_len + range.len()]);
            }
            covered += range.len();
        }
        if covered != v {
            bail!("the workers' logits cover {covered} of {v} tokens");
        }
        Ok(out)
    }
}

impl ModelRunner for ParallelRunner {
    fn backend_name(&self) -> String {
        self.name.clone()
    }
    fn default_token_budget(&self) -> usize {
        self.token_budget
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn weight_stats(&self) -> &WeightStats {
        &self.stats
    }
    fn kv_bytes(&self) -> u64 {
        self.kv_bytes
    }
    fn parallel(&self) -> ParallelConfig {
        self.config
    }
    fn execute(&mut self, input: BatchInput) -> Result<Vec<f32>> {
        self.logits(input)
    }
    fn execute_greedy(&mut self, input: BatchInput) -> Result<Vec<u32>> {
        let logits = self.logits(input)?;
        Ok(logits
            .chunks_exact(self.vocab_size.max(1))
            .map(|row| crate::backend::argmax(row) as u32)
            .collect())
    }
    fn swap_blocks(&mut self, out: &[(u32, u32)], inn: &[(u32, u32)]) -> Result<()> {
        let pairs = Arc::new((out.to_vec(), inn.to_vec()));
        self.run_all(|| Job::Swap(pairs.clone())).map(drop)
    }
}

impl Drop for ParallelRunner {
    fn drop(&mut self) {
        for mut w in self.workers.drain(..) {
            drop(w.jobs);
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}
