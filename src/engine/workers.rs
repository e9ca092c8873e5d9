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
//! NOTE: with pipeline parallelism up to one step per stage is in flight (vLLM's virtual
//! engines; the engine keeps them apart, `Engine::step_pipelined`): each worker runs its jobs
//! in order, so stage 0 starts the next step while stage 1 runs the last. On the CPU the
//! workers share the cores, so this is a way to test the sharded model more than a speed-up.

use super::nodes;
use super::runner::{
    LogitsPart, ModelRunner, Runner, RunnerArgs, StepResult, kv_spec, plan, pool_blocks,
};
use super::worker::{
    Job, Sink, Worker, load_shards, make_groups, node_devices, serve, stage_layers,
};
use crate::backend::BatchInput;
use crate::models::LoadedModel;
use crate::models::kv_cache;
use crate::models::lora::LoraAdapter;
use crate::parallel::{Communicator, GroupControl, MultiDevice, ParallelConfig, Placement};
use crate::sampling::RowSampling;
use crate::tensor::DType;
use crate::tensor::WeightStats;
use anyhow::{Context, Result, anyhow, bail, ensure};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::channel;

pub struct ParallelRunner {
    name: String,
    config: ParallelConfig,
    workers: Vec<Worker>,
    /// Every group, to abort and reset after a failed step.
    groups: Vec<Arc<dyn GroupControl>>,
    vocab_size: usize,
    num_blocks: usize,
    kv_bytes: u64,
    kv_dtype: DType,
    stats: WeightStats,
    token_budget: usize,
    /// Jobs given and not yet collected, oldest first: how many workers got each, and why the
    /// others could not be given it.
    given: VecDeque<(usize, Option<anyhow::Error>)>,
    /// Steps started and not yet finished: how each of their logits rows is reduced.
    in_flight: VecDeque<Vec<Option<RowSampling>>>,
    /// Steps that may be in flight: the pipeline's stages (`PAGODA_PIPELINE_STEPS` sets fewer).
    max_in_flight: usize,
}

/// Builds the workers, one per device of `B` (on the CPU they share the cores): checks the
/// split against the model and the devices, makes the communicators (NCCL or RCCL where the
/// backend has one, else through the host), loads every shard of this node (all at once, one
/// thread each), gathers the other nodes' workers (`--nnodes`), sizes one pool for all of them,
/// and starts their threads.
pub fn build_parallel<B: MultiDevice>(
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    let pc = args.parallel;
    let cfg = &model.config;
    pc.check(&cfg.dims())?;
    args.nodes.check(&pc)?;
    let mine = args.nodes.workers(&pc);
    let devices = node_devices::<B>(pc, &args.nodes)?;
    let device_of = |w: usize| devices[w].unwrap_or(0);
    let probe = B::open_device(0)?;
    let positions = plan(&probe, model, args)?;
    let token_budget = probe.default_token_budget();
    let nodes_text = if args.nodes.is_single() {
        String::new()
    } else {
        format!(", {} nodes", args.nodes.nnodes)
    };
    let probe_name = probe.name();
    drop(probe);

    let placement = |[tp, pp]: [Arc<dyn Communicator<B>>; 2], w: usize| Placement::<B> {
        tp,
        pp,
        layers: stage_layers(pc, cfg.num_layers, w),
    };
    let mut places = Vec::new();
    let mut remote = Vec::new();
    let mut groups: Vec<Arc<dyn GroupControl>>;
    // NOTE: the device communicators are made (or, across nodes, their library opened) before
    // any weight is loaded, so that a missing library fails at once.
    let mut through = "the host".to_string();
    let mut ccl = None;
    match B::device_groups(pc, &devices)? {
        Some(dg) => {
            for (w, c) in dg.workers.into_iter().enumerate() {
                if let Some((c, gs)) = c {
                    places.push((device_of(w), placement(c, w), gs));
                }
            }
            groups = dg.all;
            through = dg.library;
            ccl = dg.nodes;
        }
        None => {
            let (comms, local) = make_groups(pc);
            for (w, [t, p]) in comms.into_iter().enumerate() {
                if !mine.contains(&w) {
                    remote.push([t, p]);
                    continue;
                }
                let gs: [Arc<dyn GroupControl>; 2] = [t.group().clone(), p.group().clone()];
                places.push((device_of(w), placement([Arc::new(t), Arc::new(p)], w), gs));
            }
            groups = local
                .into_iter()
                .map(|g| g as Arc<dyn GroupControl>)
                .collect();
        }
    }
    // NOTE: node 0 listens before it loads, so that a bad address fails at once; the other
    // nodes' connections wait in the backlog meanwhile.
    let listener = (!args.nodes.is_single())
        .then(|| nodes::listen(&args.nodes))
        .transpose()?;
    let name = format!(
        "{probe_name} (tensor parallel {}, pipeline parallel {}{nodes_text}, through {through})",
        pc.tensor, pc.pipeline
    );
    let loaded = load_shards(&B::open_device, model, args, positions, places, progress)?;
    let others = match listener {
        Some(l) => nodes::gather(
            l,
            &args.nodes,
            mine.end..pc.world_size(),
            &nodes::fingerprint(model, args, positions, B::kind()),
        )?,
        None => Vec::new(),
    };

    // NOTE: one pool size for every worker (the block manager is one). Workers that share
    // the memory (the CPU) share the budget: it is the whole pool's, from the bytes a block
    // takes over all workers (of every node); a device's budget is its own, and the pool is
    // the most blocks every device holds.
    let mut per_block = 0u64;
    let mut stats = WeightStats::default();
    let mut specs = Vec::with_capacity(loaded.len());
    let mut device_blocks: Option<usize> = None;
    for (backend, lm, _) in &loaded {
        let spec = kv_spec(backend, lm.as_ref(), args.kv_cache_dtype)?;
        let bytes = kv_cache::bytes_per_block(&spec, args.block_size)?;
        per_block += bytes;
        stats.absorb(lm.weight_stats());
        specs.push(spec);
        if backend.device_memory().is_some() {
            let n = pool_blocks(backend, args, lm.weight_stats().bytes, bytes, positions)?;
            device_blocks = Some(device_blocks.map_or(n, |m| m.min(n)));
        }
    }
    for o in &others {
        per_block += o.per_block;
        stats.absorb(&o.stats);
    }
    let num_blocks = match (device_blocks, loaded.first()) {
        (Some(n), _) => Ok(n),
        (None, Some((b, ..))) => pool_blocks(b, args, stats.bytes, per_block, positions),
        (None, None) => bail!("node 0 holds no worker"),
    };
    // NOTE: groups that span nodes are controlled together: a failure anywhere aborts them on
    // every node, and a reset makes them all again from fresh ids.
    let control = ccl.map(|ccl| {
        let binds = loaded
            .iter()
            .zip(mine.clone())
            .map(|((b, ..), w)| (device_of(w), b.binder()))
            .collect();
        Arc::new(nodes::NodeControl::new(nodes::NodeDevices { ccl, binds }))
    });
    let ids = match &control {
        Some(c) => c.devices.ccl.ids(),
        None => Ok(Vec::new()),
    };
    let (num_blocks, ids) = match num_blocks.and_then(|n| Ok((n, ids?))) {
        Ok(v) => v,
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
        let gs = match &control {
            Some(c) => [c.clone() as Arc<dyn GroupControl>, c.clone()],
            None => gs,
        };
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
    let mut remote = remote.into_iter();
    for (w, o) in (mine.end..).zip(others) {
        let comms = remote.next();
        let controls: Vec<Arc<dyn GroupControl>> = match (&comms, &control) {
            (_, Some(c)) => vec![c.clone()],
            (Some([t, p]), None) => vec![t.group().clone(), p.group().clone()],
            (None, None) => bail!("worker {w} has no groups"),
        };
        let worker = nodes::start(o, w, num_blocks, ids.clone(), comms, controls)?;
        if let (Some(c), Sink::Remote(wr)) = (&control, &worker.sink) {
            c.remotes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(wr.clone());
        }
        workers.push(worker);
    }
    if let Some(c) = &control {
        // NOTE: returns once every node has made its part of every group from the ids.
        c.devices
            .join(&ids)
            .context("making the groups across nodes")?;
        groups = vec![c.clone()];
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
        given: VecDeque::new(),
        in_flight: VecDeque::new(),
        max_in_flight: pipeline_steps(pc)?,
    }))
}

/// Steps in flight with pipeline parallelism: one per stage, as vLLM's virtual engines;
/// `PAGODA_PIPELINE_STEPS=1` runs one at a time (the stages take turns), to compare.
fn pipeline_steps(pc: ParallelConfig) -> Result<usize> {
    match std::env::var("PAGODA_PIPELINE_STEPS") {
        Err(_) => Ok(pc.pipeline),
        Ok(v) => v
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .map(|n| n.min(pc.pipeline))
            .with_context(|| format!("PAGODA_PIPELINE_STEPS={v}: expected a count of steps")),
    }
}

impl ParallelRunner {
    /// Gives every worker the job without waiting: its replies are collected by
    /// [`Self::collect`], in the order the jobs were given. A worker that cannot be reached
    /// fails the job (at its collection) and aborts every group, so that the workers that
    /// have it do not wait for the one that has not.
    fn give_all(&mut self, job: Job) {
        // NOTE: a worker that is gone never comes back: no job is given without it (its
        // group would wait for it forever).
        for w in &self.workers {
            if let Some(why) = w.gone.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                self.given.push_back((0, Some(anyhow!("{why}"))));
                return;
            }
        }
        let mut given = 0;
        for w in &self.workers {
            match w.give(&job) {
                Ok(()) => given += 1,
                Err(e) => {
                    *w.gone.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{e:#}"));
                    self.groups.iter().for_each(|g| g.abort());
                    self.given.push_back((given, Some(e)));
                    return;
                }
            }
        }
        self.given.push_back((given, None));
    }

    /// Waits for every reply to the oldest job given. After a failure the jobs given since are
    /// waited for too and dropped, every group is reset (each worker has answered every job,
    /// so none is inside a collective), and the error most likely to be the cause is returned
    /// (not "another worker failed").
    fn collect(&mut self) -> Result<Vec<LogitsPart>> {
        let (given, unreachable) = self.given.pop_front().context("no step is in flight")?;
        let replies = self.replies(given);
        if unreachable.is_none() && replies.iter().all(|r| r.is_ok()) {
            return Ok(replies.into_iter().map(|r| r.unwrap()).collect());
        }
        while let Some((n, _)) = self.given.pop_front() {
            self.replies(n);
        }
        self.in_flight.clear();
        self.groups.iter().for_each(|g| g.reset());
        if let Some(e) = unreachable {
            return Err(e);
        }
        let mut errs: Vec<anyhow::Error> = replies.into_iter().filter_map(|r| r.err()).collect();
        let cause = errs
            .iter()
            .position(|e| !format!("{e:#}").contains("another worker failed"))
            .unwrap_or(0);
        Err(errs.swap_remove(cause))
    }

    /// One reply from each of the first `n` workers.
    fn replies(&self, n: usize) -> Vec<Result<LogitsPart>> {
        self.workers[..n]
            .iter()
            .map(|w| {
                w.replies
                    .recv()
                    .unwrap_or_else(|_| Err(anyhow!("a worker thread has stopped")))
            })
            .collect()
    }

    /// Runs one job to its end (nothing else in flight).
    fn run_all(&mut self, job: Job) -> Result<Vec<LogitsPart>> {
        ensure!(
            self.given.is_empty(),
            "a job cannot run alone while steps are in flight"
        );
        self.give_all(job);
        self.collect()
    }

    /// The logits `[R, vocab]` from the last stage's parts.
    fn logits(&self, rows: usize, parts: Vec<LogitsPart>) -> Result<Vec<f32>> {
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
    fn execute(
        &mut self,
        input: BatchInput,
        sampling: &[Option<RowSampling>],
    ) -> Result<StepResult> {
        let rows = input.logits_rows.len();
        ensure!(
            sampling.len() == rows,
            "{} sampling entries for {rows} logits rows",
            sampling.len()
        );
        let parts = self.run_all(Job::Execute(Arc::new(input)))?;
        StepResult::from_host(self.logits(rows, parts)?, self.vocab_size, sampling)
    }
    fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }
    fn start(&mut self, input: BatchInput, sampling: Vec<Option<RowSampling>>) -> Result<()> {
        ensure!(
            self.given.len() < self.max_in_flight,
            "{} steps are in flight already",
            self.given.len()
        );
        ensure!(
            sampling.len() == input.logits_rows.len(),
            "{} sampling entries for {} logits rows",
            sampling.len(),
            input.logits_rows.len()
        );
        self.in_flight.push_back(sampling);
        self.give_all(Job::Execute(Arc::new(input)));
        Ok(())
    }
    fn finish(&mut self) -> Result<StepResult> {
        let sampling = self.in_flight.pop_front().context("no step is in flight")?;
        let parts = self.collect()?;
        StepResult::from_host(
            self.logits(sampling.len(), parts)?,
            self.vocab_size,
            &sampling,
        )
    }
    fn swap_blocks(&mut self, out: &[(u32, u32)], inn: &[(u32, u32)]) -> Result<()> {
        let pairs = Arc::new((out.to_vec(), inn.to_vec()));
        self.run_all(Job::Swap(pairs)).map(drop)
    }
    /// Every worker takes its part of the adapter: its layers, its rows or columns. The bytes
    /// of all the parts.
    fn set_lora(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        // NOTE: the factors would need a wire format of their own (`parallel::tcp`).
        if self
            .workers
            .iter()
            .any(|w| matches!(w.sink, Sink::Remote(_)))
        {
            bail!("LoRA adapters with workers on other nodes are not supported yet");
        }
        let (tx, rx) = channel();
        let job = Job::SetLora(slot, adapter.map(|a| Arc::new(a.clone())), tx);
        if let Err(e) = self.run_all(job) {
            // NOTE: the workers that took it free it again (the engine loads into empty
            // slots only, so nothing else is lost).
            let (tx, _) = channel();
            let _ = self.run_all(Job::SetLora(slot, None, tx));
            return Err(e);
        }
        Ok(rx.try_iter().sum())
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
