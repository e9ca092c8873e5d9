//! Workers on several nodes (`--nnodes`): node 0 runs the engine and its workers, and for
//! every worker of another node a proxy thread that passes on its results (and, where the
//! activations go through the host, runs its collectives on its handles: see
//! `parallel::tcp`); each other node runs [`serve_node`]: its workers, each with one
//! connection to node 0, taking steps until node 0 closes it.
//!
//! On GPUs with NCCL (or RCCL) the activations go from device to device, not through node 0:
//! every group is made with NCCL's own bootstrap once every node has loaded (node 0 makes a
//! unique id per group and sends them in `Start`; every rank of the group calls
//! `ncclCommInitRank` with it). node 0 passes a failed step's abort on to every node, and
//! after it sends fresh ids (`Reset`), from which every node makes the groups again
//! ([`NodeControl`]).
//!
//! ```text
//!  node 0                                         node n
//!  listen(master) ◀───── Hello(worker, settings) ─ connect (retried until the timeout)
//!  load its shards          Loaded(KV bytes/block) ─ load its shards (RemoteComm handles)
//!  pool size over all ────── Start(num_blocks) ───▶ its KV pools
//!  steps ─────────────────── Execute / Swap ──────▶ forward pass ── Comm ──▶ proxy ─┐
//!                                                                 ◀─ CommDone ──────┘
//!        ◀─────────────────── Done(logits part) ───
//! ```

use super::runner::{LogitsPart, Runner, RunnerArgs, kv_spec, plan};
use super::worker::{Job, Sink, Worker, load_shards, node_devices, run_job, stage_layers};
use crate::backend::Backend;
use crate::models::{LoadedModel, kv_cache};
use crate::parallel::ccl::NodeCcl;
use crate::parallel::tcp::{Conn, Msg, PP, RemoteComm, TP, read_msg, resolve, write_msg};
use crate::parallel::{
    Binder, Communicator, GroupControl, LocalComm, MultiDevice, NodeConfig, Placement,
};
use crate::tensor::WeightStats;
use anyhow::{Context, Result, anyhow, bail};
use std::io::{BufReader, BufWriter, ErrorKind};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What node 0 and every other node must agree on before their shards fit together: the
/// model's shape, how its weights are stored, the block size, the split, the RoPE positions.
pub(super) fn fingerprint(
    model: &LoadedModel,
    args: &RunnerArgs,
    positions: usize,
    backend: &str,
) -> String {
    let c = &model.config;
    format!(
        "{} {} layers, {} heads / {} KV heads, hidden {}, vocab {}; --dtype {}, block size {}, \
         tensor {} x pipeline {} over {} nodes, {positions} positions; {backend}",
        c.arch.name(),
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.hidden_size,
        c.vocab_size,
        args.dtype.name(),
        args.block_size,
        args.parallel.tensor,
        args.parallel.pipeline,
        args.nodes.nnodes
    )
}

pub(super) fn listen(nodes: &NodeConfig) -> Result<TcpListener> {
    let addr = resolve(&nodes.master_addr, nodes.master_port)?;
    TcpListener::bind(addr)
        .with_context(|| format!("node 0 cannot listen on {addr} (--master-addr, --master-port)"))
}

/// A worker of another node, connected and loaded, not yet started.
pub(super) struct Pending {
    conn: Conn,
    pub(super) per_block: u64,
    pub(super) stats: WeightStats,
}

/// Tells every pending worker that node 0 gave up, and why.
pub(super) fn refuse(pending: Vec<Pending>, why: &str) {
    for mut p in pending {
        let _ = p.conn.send(&Msg::Start(Err(why.to_string())));
    }
}

/// Waits until every worker in `remote` has connected from its node with the same settings
/// (`fingerprint`) and loaded its shard, or the timeout passes. In worker order.
pub(super) fn gather(
    listener: TcpListener,
    nodes: &NodeConfig,
    remote: Range<usize>,
    fingerprint: &str,
) -> Result<Vec<Pending>> {
    let deadline = Instant::now() + nodes.timeout;
    let addr = listener.local_addr()?;
    let mut conns: Vec<Option<Conn>> = remote.clone().map(|_| None).collect();
    let fail = |conns: Vec<Option<Conn>>, e: anyhow::Error| -> anyhow::Error {
        for mut c in conns.into_iter().flatten() {
            let _ = c.send(&Msg::Start(Err(format!("{e:#}"))));
        }
        e
    };
    listener.set_nonblocking(true)?;
    while conns.iter().any(Option::is_none) {
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let have = conns.iter().flatten().count();
                    let e = anyhow!(
                        "node 0 waited {:.0} s at {addr} for the other nodes' {} workers and {have} \
                         came: start the same command with --node-rank 1..{} (and the same \
                         --master-addr, --master-port) on the other nodes",
                        nodes.timeout.as_secs_f64(),
                        remote.len(),
                        nodes.nnodes - 1
                    );
                    return Err(fail(conns, e));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(fail(conns, e.into())),
        };
        // NOTE: a worker says hello as soon as it connects; a connection that does not (a
        // port scan, a stray client) is dropped with a warning and the wait goes on.
        let hello = (|| {
            stream.set_nonblocking(false)?;
            let mut c = Conn::new(stream)?;
            c.read_deadline(Some(deadline.min(Instant::now() + Duration::from_secs(10))))?;
            match c.recv()? {
                Msg::Hello {
                    worker,
                    fingerprint,
                } => Ok((worker as usize, fingerprint, c)),
                m => bail!("it opened with {} instead of Hello", m.name()),
            }
        })();
        let (w, theirs, mut c) = match hello {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("node 0 ignored a connection from {peer}: {e:#}");
                continue;
            }
        };
        let refused = if theirs != fingerprint {
            Some(format!(
                "worker {w} (from {peer}) was started with other settings than node 0's: \
                 theirs {theirs}; node 0's {fingerprint}"
            ))
        } else if !remote.contains(&w) || conns[w - remote.start].is_some() {
            Some(format!(
                "{peer} announced worker {w}, which is not one of the other nodes' {remote:?} \
                 or came twice (is --node-rank the same on two nodes?)"
            ))
        } else {
            None
        };
        if let Some(e) = refused {
            let _ = c.send(&Msg::Start(Err(e.clone())));
            return Err(fail(conns, anyhow!(e)));
        }
        conns[w - remote.start] = Some(c);
    }
    let mut pending = Vec::with_capacity(remote.len());
    let mut failure = None;
    for (w, mut c) in remote.clone().zip(conns.into_iter().flatten()) {
        match c.read_deadline(Some(deadline)).and_then(|_| c.recv()) {
            Ok(Msg::Loaded(Ok((per_block, stats)))) => pending.push(Pending {
                conn: c,
                per_block,
                stats,
            }),
            Ok(Msg::Loaded(Err(e))) => {
                failure.get_or_insert(anyhow!("worker {w}: {e}"));
            }
            Ok(m) => {
                failure.get_or_insert(anyhow!("worker {w} sent {} before Loaded", m.name()));
            }
            Err(e) => {
                failure.get_or_insert(e.context(format!("waiting for worker {w} to load")));
            }
        }
    }
    if let Some(e) = failure {
        refuse(pending, &format!("{e:#}"));
        return Err(e).context("the other nodes' workers");
    }
    for p in &pending {
        p.conn.read_deadline(None)?;
    }
    Ok(pending)
}

/// Writes to a worker of another node.
pub(super) type Writer = Arc<Mutex<BufWriter<TcpStream>>>;

/// Starts a pending worker `w`: tells it the pool's size (and the groups' ids, where they go
/// through NCCL), and runs its proxy thread: with its handles on node 0's groups where the
/// activations go through the host (`comms`), and `controls` to abort when it fails.
pub(super) fn start(
    p: Pending,
    w: usize,
    num_blocks: usize,
    ids: Vec<Vec<u8>>,
    comms: Option<[LocalComm; 2]>,
    controls: Vec<Arc<dyn GroupControl>>,
) -> Result<Worker> {
    let Pending { mut conn, .. } = p;
    conn.send(&Msg::Start(Ok((num_blocks as u64, ids))))?;
    let Conn { reader, writer, .. } = conn;
    let writer = Arc::new(Mutex::new(writer));
    let (tx, replies) = channel();
    let gone = Arc::new(Mutex::new(None));
    let (wr, g) = (writer.clone(), gone.clone());
    let thread = std::thread::Builder::new()
        .name("pagoda-proxy".into())
        .spawn(move || proxy(w, reader, wr, comms, controls, tx, g))
        .context("starting a proxy thread")?;
    Ok(Worker {
        sink: Sink::Remote(writer),
        replies,
        thread: Some(thread),
        gone,
    })
}

/// Node 0's side of remote worker `w`: passes its results on, and runs its collectives where
/// they go through the host. When the worker fails, or its connection does (then the worker
/// is marked gone), `controls` are aborted, so that no one waits for it, in this step or a
/// later one.
fn proxy(
    w: usize,
    mut reader: BufReader<TcpStream>,
    writer: Writer,
    comms: Option<[LocalComm; 2]>,
    controls: Vec<Arc<dyn GroupControl>>,
    replies: Sender<Result<LogitsPart>>,
    gone: Arc<Mutex<Option<String>>>,
) {
    let abort = || controls.iter().for_each(|c| c.abort());
    loop {
        let why = match read_msg(&mut reader) {
            Ok(Some(Msg::Comm { group, op, data })) => {
                let Some(comms) = &comms else {
                    break_gone(&gone, &replies, w, "it asked node 0 for a collective");
                    abort();
                    return;
                };
                let c = &comms[usize::from(group == PP)];
                let done = Msg::CommDone(op.run(c, data).map_err(|e| format!("{e:#}")));
                let mut wr = writer.lock().unwrap_or_else(|e| e.into_inner());
                match write_msg(&mut *wr, &done) {
                    Ok(()) => continue,
                    Err(e) => format!("{e:#}"),
                }
            }
            Ok(Some(Msg::Abort(_))) => {
                abort();
                continue;
            }
            Ok(Some(Msg::Done(r))) => {
                if replies.send(r.map_err(|e| anyhow!(e))).is_err() {
                    return;
                }
                continue;
            }
            Ok(Some(m)) => format!("it sent {} mid-run", m.name()),
            Ok(None) => "it closed the connection".to_string(),
            Err(e) => format!("{e:#}"),
        };
        break_gone(&gone, &replies, w, &why);
        abort();
        return;
    }
}

/// Marks remote worker `w` gone for good, and fails the step that waits for it.
fn break_gone(
    gone: &Mutex<Option<String>>,
    replies: &Sender<Result<LogitsPart>>,
    w: usize,
    why: &str,
) {
    let why = format!("worker {w} on another node is gone: {why}");
    *gone.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
    let _ = replies.send(Err(anyhow!(why)));
}

/// Makes a node's groups from ids (see [`NodeCcl::join`]), each member's device bound by its
/// worker's backend.
pub(super) struct NodeDevices {
    pub(super) ccl: Arc<NodeCcl>,
    /// Each worker's device here, and its backend's binder.
    pub(super) binds: Vec<(usize, Binder)>,
}

impl NodeDevices {
    pub(super) fn join(&self, ids: &[Vec<u8>]) -> Result<()> {
        self.ccl.join(ids, &|device| {
            let (_, b) = self
                .binds
                .iter()
                .find(|(d, _)| *d == device)
                .context("a device without a worker")?;
            b()
        })
    }
}

/// Node 0's control of groups that span nodes through NCCL or RCCL: an abort aborts this
/// node's handles and tells every other node's workers to abort theirs; a reset makes fresh
/// ids, sends them to every other node's workers, and makes this node's handles from them
/// (returning when every node has).
pub(super) struct NodeControl {
    pub(super) devices: NodeDevices,
    pub(super) remotes: Mutex<Vec<Writer>>,
    aborted: AtomicBool,
}

impl NodeControl {
    pub(super) fn new(devices: NodeDevices) -> Self {
        NodeControl {
            devices,
            remotes: Mutex::new(Vec::new()),
            aborted: AtomicBool::new(false),
        }
    }

    fn tell(&self, msg: &Msg) -> Result<()> {
        for r in self
            .remotes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let mut w = r.lock().unwrap_or_else(|e| e.into_inner());
            write_msg(&mut *w, msg).context("a worker on another node is gone")?;
        }
        Ok(())
    }
}

impl GroupControl for NodeControl {
    fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        // NOTE: a node that cannot be told is gone: its proxy fails its steps.
        let _ = self.tell(&Msg::Abort(self.devices.ccl.generation()));
        self.devices.ccl.abort();
    }

    fn reset(&self) {
        if !self.aborted.load(Ordering::SeqCst) {
            return;
        }
        let made = (|| {
            let ids = self.devices.ccl.ids()?;
            self.tell(&Msg::Reset(ids.clone()))?;
            self.devices.join(&ids)
        })();
        match made {
            Ok(()) => self.aborted.store(false, Ordering::SeqCst),
            Err(e) => tracing::error!("the groups across nodes cannot be made again: {e:#}"),
        }
    }
}

/// A node other than 0: connects its workers to node 0, loads their shards, and runs their
/// steps until node 0 closes the connections.
pub fn serve_node<B: MultiDevice>(model: &LoadedModel, args: &RunnerArgs) -> Result<()> {
    let pc = args.parallel;
    let nodes = &args.nodes;
    pc.check(&model.config.dims())?;
    nodes.check(&pc)?;
    if nodes.node_rank == 0 {
        bail!("node 0 runs the engine, not serve_node");
    }
    let mine = nodes.workers(&pc);
    let devices = node_devices::<B>(pc, nodes)?;
    let device_of = |w: usize| devices[w].unwrap_or(0);
    // NOTE: the collective library is opened before anything is loaded, so that a missing
    // one fails at once.
    let groups = B::device_groups(pc, &devices)?;
    let positions = plan(&B::open_device(device_of(mine.start))?, model, args)?;
    let fp = fingerprint(model, args, positions, B::kind());
    let addr = resolve(&nodes.master_addr, nodes.master_port)?;
    let deadline = Instant::now() + nodes.timeout;
    tracing::info!(
        "node {} of {}: workers {mine:?} for the engine at {addr}",
        nodes.node_rank,
        nodes.nnodes
    );
    let (mut device_comms, ccl) = match groups {
        Some(g) => (g.workers, g.nodes),
        None => (Vec::new(), None),
    };
    let mut places = Vec::new();
    for w in mine.clone() {
        let mut conn = Conn::connect(addr, deadline)?;
        conn.send(&Msg::Hello {
            worker: w as u32,
            fingerprint: fp.clone(),
        })?;
        let link = Arc::new(Mutex::new(conn));
        let [tp, pp] = match device_comms.get_mut(w).and_then(Option::take) {
            Some((comms, _)) => comms,
            None => {
                let comm = |group, rank, size| -> Arc<dyn Communicator<B>> {
                    Arc::new(RemoteComm {
                        link: link.clone(),
                        group,
                        rank,
                        size,
                    })
                };
                [
                    comm(TP, w % pc.tensor, pc.tensor),
                    comm(PP, w / pc.tensor, pc.pipeline),
                ]
            }
        };
        let place = Placement {
            tp,
            pp,
            layers: stage_layers(pc, model.config.num_layers, w),
        };
        places.push((device_of(w), place, link));
    }
    let links: Vec<Arc<Mutex<Conn>>> = places.iter().map(|(_, _, l)| l.clone()).collect();
    let loaded = load_shards(
        &B::open_device,
        model,
        args,
        positions,
        places,
        &mut |_, _| {},
    );
    let loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            for l in &links {
                let _ = lock(l).send(&Msg::Loaded(Err(format!(
                    "node {}: {e:#}",
                    nodes.node_rank
                ))));
            }
            return Err(e);
        }
    };
    drop(links);
    // NOTE: every worker reports before any waits for Start: node 0 reads all the reports
    // first, then starts them all.
    let mut specs = Vec::with_capacity(loaded.len());
    for (backend, lm, link) in &loaded {
        let spec = kv_spec(backend, lm.as_ref(), args.kv_cache_dtype)?;
        let per_block = kv_cache::bytes_per_block(&spec, args.block_size)?;
        lock(link).send(&Msg::Loaded(Ok((per_block, lm.weight_stats().clone()))))?;
        specs.push(spec);
    }
    let node = ccl.map(|ccl| NodeDevices {
        ccl,
        binds: loaded
            .iter()
            .zip(mine.clone())
            .map(|((b, ..), w)| (device_of(w), b.binder()))
            .collect(),
    });
    let mut runners = Vec::new();
    let mut ids = None;
    for ((backend, lm, link), spec) in loaded.into_iter().zip(specs) {
        let mut c = lock(&link);
        c.read_deadline(Some(deadline))?;
        let (num_blocks, these) = match c.recv().context("waiting for node 0 to start")? {
            Msg::Start(Ok((n, ids))) => (usize::try_from(n)?, ids),
            Msg::Start(Err(e)) => bail!("node 0 gave up: {e}"),
            m => bail!("node 0 sent {} instead of Start", m.name()),
        };
        c.read_deadline(None)?;
        drop(c);
        ids = Some(these);
        runners.push((
            Runner::new(backend, lm, &spec, num_blocks, args.block_size)?,
            link,
        ));
    }
    if let Some(node) = &node {
        node.join(ids.as_deref().unwrap_or_default())
            .context("making the groups across nodes")?;
    }
    tracing::info!("node {}: workers started", nodes.node_rank);
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let node = node.as_ref();
        let hs: Vec<_> = runners
            .into_iter()
            .map(|(mut runner, link)| {
                s.spawn(move || match node {
                    Some(node) => device_worker(&mut runner, link, node),
                    None => remote_worker(&mut runner, &link),
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a worker thread panicked")))
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>>>().map(drop)
}

/// One worker of another node whose collectives go through node 0: takes node 0's jobs
/// until it closes the connection.
fn remote_worker<B: Backend>(runner: &mut Runner<B>, link: &Mutex<Conn>) -> Result<()> {
    loop {
        // NOTE: the lock is not held while the job runs: its collectives use the connection.
        let msg = {
            let mut c = lock(link);
            match c.queued.pop_front() {
                Some(m) => Some(m),
                None => read_msg(&mut c.reader)?,
            }
        };
        let job = match msg {
            None => return Ok(()),
            Some(Msg::Execute(input)) => Job::Execute(Arc::new(input)),
            Some(Msg::Swap(out, inn)) => Job::Swap(Arc::new((out, inn))),
            Some(m) => bail!("node 0 sent {} between steps", m.name()),
        };
        let reply = run_job(runner, &job);
        let mut c = lock(link);
        if reply.is_err() {
            c.send(&Msg::Abort(0))?;
        }
        c.send(&Msg::Done(reply.map_err(|e| format!("{e:#}"))))?;
    }
}

/// One worker of another node whose groups go through NCCL or RCCL: takes node 0's jobs until
/// it closes the connection. A reader thread takes node 0's messages as they come, so that an
/// abort reaches the groups while a job waits in them.
fn device_worker<B: Backend>(
    runner: &mut Runner<B>,
    link: Arc<Mutex<Conn>>,
    node: &NodeDevices,
) -> Result<()> {
    let Ok(conn) = Arc::try_unwrap(link).map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
    else {
        bail!("a worker's connection is still shared");
    };
    let Conn {
        mut reader,
        mut writer,
        ..
    } = conn;
    let stream = writer.get_ref().try_clone()?;
    let (tx, rx) = channel::<Result<Msg>>();
    std::thread::scope(|s| {
        s.spawn(move || {
            loop {
                match read_msg(&mut reader) {
                    Ok(Some(Msg::Abort(g))) => node.ccl.abort_generation(g),
                    Ok(Some(m)) => {
                        if tx.send(Ok(m)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                }
            }
        });
        let served = (|| {
            for msg in rx {
                let job = match msg? {
                    Msg::Execute(input) => Job::Execute(Arc::new(input)),
                    Msg::Swap(out, inn) => Job::Swap(Arc::new((out, inn))),
                    Msg::Reset(ids) => {
                        node.join(&ids)
                            .context("making the groups across nodes again")?;
                        continue;
                    }
                    m => bail!("node 0 sent {} between steps", m.name()),
                };
                let generation = node.ccl.generation();
                let reply = run_job(runner, &job);
                if reply.is_err() {
                    node.ccl.abort();
                    write_msg(&mut writer, &Msg::Abort(generation))?;
                }
                write_msg(&mut writer, &Msg::Done(reply.map_err(|e| format!("{e:#}"))))?;
            }
            Ok(())
        })();
        // NOTE: ends the reader thread too, if the worker stopped first.
        let _ = stream.shutdown(Shutdown::Both);
        served
    })
}

fn lock(link: &Mutex<Conn>) -> MutexGuard<'_, Conn> {
    link.lock().unwrap_or_else(|e| e.into_inner())
}
