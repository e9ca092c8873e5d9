//! One worker of tensor and pipeline parallelism: its jobs, where they go (its thread here, or
//! its connection to another node), how it runs them, and how the workers' shards are loaded.
//! The parallel runner (`workers.rs`) and a node's share of the workers (`nodes.rs`) are built
//! from these.

use super::runner::{LogitsPart, ModelRunner, Runner, RunnerArgs};
use crate::backend::{Backend, BatchInput};
use crate::models::lora::LoraAdapter;
use crate::models::{LoadedModel, registry};
use crate::parallel::tcp::{Msg, write_msg};
use crate::parallel::{
    GroupControl, LocalComm, LocalGroup, MultiDevice, ParallelConfig, Placement, split_even,
};
use anyhow::{Context, Result, anyhow, bail};
use std::io::BufWriter;
use std::net::TcpStream;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub(super) enum Job {
    Execute(Arc<BatchInput>),
    Swap(Arc<SwapPairs>),
    /// A LoRA adapter into a slot (`None`: out of it); each worker sends the bytes its part
    /// takes on the sender. Workers on this node only.
    SetLora(u32, Option<Arc<LoraAdapter>>, Sender<u64>),
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
    pub(super) fn give(&self, job: &Job) -> Result<()> {
        match &self.sink {
            Sink::Local(tx) => tx
                .send(job.clone())
                .map_err(|_| anyhow!("a worker thread has stopped")),
            Sink::Remote(w) => {
                let msg = match job {
                    Job::Execute(b) => Msg::Execute(b.as_ref().clone()),
                    Job::Swap(p) => Msg::Swap(p.0.clone(), p.1.clone()),
                    Job::SetLora(..) => {
                        bail!("internal: LoRA adapters for a worker on another node")
                    }
                };
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                write_msg(&mut *w, &msg)
                    .map_err(|e| anyhow!("a worker on another node is gone: {e:#}"))
            }
        }
    }
}

/// Runs one job; a panic becomes an error.
pub(super) fn run_job<B: Backend>(runner: &mut Runner<B>, job: &Job) -> Result<LogitsPart> {
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job {
        Job::Execute(input) => runner.execute_part(input.as_ref().clone()),
        Job::Swap(pairs) => runner.swap_blocks(&pairs.0, &pairs.1).map(|_| None),
        Job::SetLora(slot, adapter, bytes) => {
            let n = runner.set_lora(*slot, adapter.as_deref())?;
            let _ = bytes.send(n);
            Ok(None)
        }
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
pub(super) fn serve<B: Backend>(
    mut runner: Runner<B>,
    groups: [Arc<dyn GroupControl>; 2],
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

/// Loads the shards of `places` (a device, a placement and what goes with it), all at once:
/// the first on this thread (its layers are the progress shown), the others on threads of
/// their own. `make` opens a device's backend.
pub(super) fn load_shards<B: Backend, E: Send>(
    make: &(impl Fn(usize) -> Result<B> + Sync),
    model: &LoadedModel,
    args: &RunnerArgs,
    positions: usize,
    places: Vec<(usize, Placement<B>, E)>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Loaded<B, E>>> {
    let load =
        |device: usize, place: Placement<B>, progress: &mut dyn FnMut(usize, usize)| -> Result<_> {
            let backend = make(device)?;
            let lm = registry::load_shard(
                &backend,
                &model.config,
                model.weights.as_ref(),
                args.dtype,
                positions,
                place,
                &args.head,
                progress,
            )?;
            Ok((backend, lm))
        };
    let mut places = places.into_iter();
    let Some((device0, place0, extra0)) = places.next() else {
        return Ok(Vec::new());
    };
    let loaded: Vec<Result<_>> = std::thread::scope(|s| {
        let handles: Vec<_> = places
            .map(|(device, place, extra)| {
                let load = &load;
                s.spawn(move || load(device, place, &mut |_, _| {}).map(|(b, lm)| (b, lm, extra)))
            })
            .collect();
        let first = load(device0, place0, progress).map(|(b, lm)| (b, lm, extra0));
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

/// Each worker's device on this node (`None`: a worker of another node): worker `w` of the
/// node on its device `w - first` (all on device 0 where the workers share one, the CPU); an
/// error where this process sees fewer devices than the node has workers.
pub(super) fn node_devices<B: MultiDevice>(
    pc: ParallelConfig,
    nodes: &crate::parallel::NodeConfig,
) -> Result<Vec<Option<usize>>> {
    let mine = nodes.workers(&pc);
    let count = B::device_count()?;
    if count != usize::MAX && mine.len() > count {
        bail!(
            "--tensor-parallel-size {} x --pipeline-parallel-size {} needs {} devices on this \
             node, and this process sees {count} (CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES \
             choose them)",
            pc.tensor,
            pc.pipeline,
            mine.len()
        );
    }
    Ok((0..pc.world_size())
        .map(|w| {
            mine.contains(&w).then(|| {
                if count == usize::MAX {
                    0
                } else {
                    w - mine.start
                }
            })
        })
        .collect())
}
