//! Tensor and pipeline parallelism: one worker per (stage, tensor rank), a thread of this
//! process or one on another node (`nodes.rs`), each with its own backend, its shard of the
//! weights and its part of the KV pool, behind the same [`ModelRunner`] trait as a single
//! device. The engine above is unchanged: its one
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

use super::nodes;
use super::runner::{LogitsPart, ModelRunner, Runner, RunnerArgs, kv_spec, plan, pool_blocks};
use crate::backend::{Backend, BatchInput};
use crate::models::kv_cache;
use crate::models::{LoadedModel, WeightStats, registry};
use crate::parallel::tcp::{Msg, write_msg};
use crate::parallel::{Communicator, LocalComm, LocalGroup, ParallelConfig, Placement, split_even};
use crate::tensor::DType;
use anyhow::{Context, Result, anyhow, bail};
use std::io::BufWriter;
use std::net::TcpStream;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub(super) enum Job {
    Execute(Arc<BatchInput>),
    Swap(Arc<SwapPairs>),
}

/// Swap preemption's block pairs of one step: out (device, host), in (host, device).
type SwapPairs = (Vec<(u32, u32)>, Vec<(u32, u32)>);

/// Where a worker's jobs go: its thread here, or its connection to another node.
pub(super) enum Sink {
    Local(Sender<Job>),
    Remote(Arc<Mutex<BufWriter<TcpStream>>>),
}

pub(super) struct Worker {
    pub(super) sink: Sink,
    /// Its results, one per job (from its thread, or from its proxy thread on this node).
    pub(super) replies: Receiver<Result<LogitsPart>>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
    /// Why a worker on another node is gone for good, once its proxy has seen it go.
    pub(super) gone: Arc<Mutex<Option<String>>>,
}

impl Worker {
    fn give(&self, job: &Job) -> Result<()> {
        match &self.sink {
            Sink::Local(tx) => tx
                .send(job.clone())
                .map_err(|_| anyhow!("a worker thread has stopped")),
            Sink::Remote(w) => {
                let msg = match job {
                    Job::Execute(b) => Msg::Execute(b.as_ref().clone()),
                    Job::Swap(p) => Msg::Swap(p.0.clone(), p.1.clone()),
                };
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                write_msg(&mut *w, &msg)
                    .map_err(|e| anyhow!("a worker on another node is gone: {e:#}"))
            }
        }
    }
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
    kv_dtype: DType,
    stats: WeightStats,
    token_budget: usize,
}

/// Runs one job; a panic becomes an error.
pub(super) fn run_job<B: Backend>(runner: &mut Runner<B>, job: &Job) -> Result<LogitsPart> {
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job {
        Job::Execute(input) => runner.execute_part(input.as_ref().clone()),
        Job::Swap(pairs) => runner.swap_blocks(&pairs.0, &pairs.1).map(|_| None),
    }));
    run.unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(anyhow!("a worker panicked: {msg}"))
    })
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
        let reply = run_job(&mut runner, &job);
        if reply.is_err() {
            groups.iter().for_each(|g| g.abort());
        }
        if replies.send(reply).is_err() {
            break;
        }
    }
}

/// Every worker's two handles, in worker order (`stage × tensor + rank`): its stage's
/// tensor-parallel group and its rank's pipeline group; and every group.
pub(super) fn make_groups(pc: ParallelConfig) -> (Vec<[LocalComm; 2]>, Vec<Arc<LocalGroup>>) {
    let tp: Vec<Vec<LocalComm>> = (0..pc.pipeline)
        .map(|_| LocalGroup::new(pc.tensor))
        .collect();
    let pp: Vec<Vec<LocalComm>> = (0..pc.tensor)
        .map(|_| LocalGroup::new(pc.pipeline))
        .collect();
    let groups = tp.iter().chain(&pp).map(|g| g[0].group().clone()).collect();
    let mut tp: Vec<_> = tp.into_iter().map(|g| g.into_iter()).collect();
    let mut pp: Vec<_> = pp.into_iter().map(|g| g.into_iter()).collect();
    let mut comms = Vec::with_capacity(pc.world_size());
    for stage in tp.iter_mut() {
        for rank_pp in pp.iter_mut() {
            let t = stage.next().expect("one handle per rank");
            let p = rank_pp.next().expect("one handle per stage");
            comms.push([t, p]);
        }
    }
    (comms, groups)
}

/// Worker `w`'s layers.
pub(super) fn stage_layers(
    pc: ParallelConfig,
    num_layers: usize,
    w: usize,
) -> std::ops::Range<usize> {
    split_even(num_layers, pc.pipeline, w / pc.tensor)
}

/// A worker's backend, its shard of the model, and what goes with it.
pub(super) type Loaded<B, E> = (B, Box<dyn crate::models::CausalLm<B>>, E);

/// Loads the shards of `places` (a placement and what goes with it), all at once: the first on this
/// thread (its layers are the progress shown), the others on threads of their own.
pub(super) fn load_shards<B: Backend, E: Send>(
    make: &(impl Fn() -> Result<B> + Sync),
    model: &LoadedModel,
    args: &RunnerArgs,
    positions: usize,
    places: Vec<(Placement<B>, E)>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Loaded<B, E>>> {
    let load = |place: Placement<B>, progress: &mut dyn FnMut(usize, usize)| -> Result<_> {
        let backend = make()?;
        let lm = registry::load_shard(
            &backend,
            &model.config,
            model.weights.as_ref(),
            args.dtype,
            positions,
            place,
            progress,
        )?;
        Ok((backend, lm))
    };
    let mut places = places.into_iter();
    let Some((place0, extra0)) = places.next() else {
        return Ok(Vec::new());
    };
    let loaded: Vec<Result<_>> = std::thread::scope(|s| {
        let handles: Vec<_> = places
            .map(|(place, extra)| {
                let load = &load;
                s.spawn(move || load(place, &mut |_, _| {}).map(|(b, lm)| (b, lm, extra)))
            })
            .collect();
        let first = load(place0, progress).map(|(b, lm)| (b, lm, extra0));
        std::iter::once(first)
            .chain(handles.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("loading a shard panicked")))
            }))
            .collect()
    });
    loaded
        .into_iter()
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("loading {}", model.path.display()))
}

/// Builds the workers on the CPU backend (`make` makes each worker's backend): checks the
/// split against the model, loads every shard of this node (all at once, one thread each),
/// gathers the other nodes' workers (`--nnodes`), sizes one pool for all of them, and starts
/// their threads.
pub fn build_parallel<B: Backend>(
    make: impl Fn() -> Result<B> + Sync,
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    let pc = args.parallel;
    let cfg = &model.config;
    pc.check(cfg)?;
    args.nodes.check(&pc)?;
    let probe = make()?;
    let positions = plan(&probe, model, args)?;
    let token_budget = probe.default_token_budget();
    let nodes_text = if args.nodes.is_single() {
        String::new()
    } else {
        format!(", {} nodes", args.nodes.nnodes)
    };
    let name = format!(
        "{} (tensor parallel {}, pipeline parallel {}{nodes_text})",
        probe.name(),
        pc.tensor,
        pc.pipeline
    );
    drop(probe);

    let (comms, groups) = make_groups(pc);
    let mine = args.nodes.workers(&pc);
    // NOTE: node 0 listens before it loads, so that a bad address fails at once; the other
    // nodes' connections wait in the backlog meanwhile.
    let listener = (!args.nodes.is_single())
        .then(|| nodes::listen(&args.nodes))
        .transpose()?;
    let mut places = Vec::new();
    let mut remote = Vec::new();
    for (w, [t, p]) in comms.into_iter().enumerate() {
        if !mine.contains(&w) {
            remote.push([t, p]);
            continue;
        }
        let gs = [t.group().clone(), p.group().clone()];
        let place = Placement::<B> {
            tp: Arc::new(t) as Arc<dyn Communicator<B>>,
            pp: Arc::new(p) as Arc<dyn Communicator<B>>,
            layers: stage_layers(pc, cfg.num_layers, w),
        };
        places.push((place, gs));
    }
    let loaded = load_shards(&make, model, args, positions, places, progress)?;
    let others = match listener {
        Some(l) => nodes::gather(
            l,
            &args.nodes,
            mine.end..pc.world_size(),
            &nodes::fingerprint(model, args, positions),
        )?,
        None => Vec::new(),
    };

    // NOTE: one pool size for every worker (the block manager is one), from the bytes a
    // block takes over all workers: on the CPU they share the memory, and the budget is the
    // whole pool's (over every node's workers).
    let mut per_block = 0u64;
    let mut stats = WeightStats::default();
    let mut specs = Vec::with_capacity(loaded.len());
    for (backend, lm, _) in &loaded {
        let spec = kv_spec(backend, lm.as_ref(), args.kv_cache_dtype)?;
        per_block += kv_cache::bytes_per_block(&spec, args.block_size)?;
        stats.absorb(lm.weight_stats());
        specs.push(spec);
    }
    for o in &others {
        per_block += o.per_block;
        stats.absorb(&o.stats);
    }
    let num_blocks = match loaded.first() {
        Some((b, ..)) => pool_blocks(b, args, stats.bytes, per_block, positions),
        None => bail!("node 0 holds no worker"),
    };
    let num_blocks = match num_blocks {
        Ok(n) => n,
        Err(e) => {
            nodes::refuse(others, &format!("{e:#}"));
            return Err(e);
        }
    };

    let kv_dtype = specs
        .first()
        .and_then(|s| s.first())
        .map_or(DType::F32, |l| l.dtype);
    let mut workers = Vec::with_capacity(pc.world_size());
    for (w, ((backend, lm, gs), spec)) in loaded.into_iter().zip(specs).enumerate() {
        let runner = Runner::new(backend, lm, &spec, num_blocks, args.block_size)?;
        let (jobs, job_rx) = channel();
        let (reply_tx, replies) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("pagoda-worker-{w}"))
            .spawn(move || serve(runner, gs, job_rx, reply_tx))
            .context("starting a worker thread")?;
        workers.push(Worker {
            sink: Sink::Local(jobs),
            replies,
            thread: Some(thread),
            gone: Arc::default(),
        });
    }
    for (o, comms) in others.into_iter().zip(remote) {
        workers.push(nodes::start(o, num_blocks, comms)?);
    }
    Ok(Box::new(ParallelRunner {
        name,
        config: pc,
        workers,
        groups,
        vocab_size: cfg.vocab_size,
        num_blocks,
        kv_bytes: num_blocks as u64 * per_block,
        kv_dtype,
        stats,
        token_budget,
    }))
}

impl ParallelRunner {
    /// Gives every worker the job and waits for all of them; after a failure every group is
    /// reset (each worker has answered, so none is inside a collective) and the error most
    /// likely to be the cause is returned (not "another worker failed").
    fn run_all(&mut self, job: Job) -> Result<Vec<LogitsPart>> {
        // NOTE: a worker that is gone never comes back: no step is started without it (its
        // group would wait for it forever).
        for w in &self.workers {
            if let Some(why) = w.gone.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                bail!("{why}");
            }
        }
        let mut given = 0;
        let mut unreachable = None;
        for w in &self.workers {
            match w.give(&job) {
                Ok(()) => given += 1,
                Err(e) => {
                    // the workers that have the job must not wait for the one that has not
                    *w.gone.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{e:#}"));
                    self.groups.iter().for_each(|g| g.abort());
                    unreachable = Some(e);
                    break;
                }
            }
        }
        let replies: Vec<Result<LogitsPart>> = self.workers[..given]
            .iter()
            .map(|w| {
                w.replies
                    .recv()
                    .unwrap_or_else(|_| Err(anyhow!("a worker thread has stopped")))
            })
            .collect();
        if let Some(e) = unreachable {
            self.groups.iter().for_each(|g| g.reset());
            return Err(e);
        }
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
        let parts = self.run_all(Job::Execute(input))?;
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
    fn kv_dtype(&self) -> DType {
        self.kv_dtype
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
        self.run_all(Job::Swap(pairs)).map(drop)
    }
}

impl Drop for ParallelRunner {
    fn drop(&mut self) {
        for mut w in self.workers.drain(..) {
            // NOTE: a local worker stops when its channel closes; a remote one when its
            // connection does (its proxy thread then ends too).
            if let Sink::Remote(s) = &w.sink {
                let s = s.lock().unwrap_or_else(|e| e.into_inner());
                let _ = s.get_ref().shutdown(std::net::Shutdown::Both);
            }
            drop(w.sink);
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}
