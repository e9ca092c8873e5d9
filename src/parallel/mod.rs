//! Tensor and pipeline parallelism: how a model is split over workers, and the collectives
//! they use ([`comm`]). The scheduler and the block manager run once; each worker has its own
//! backend, its shard of the weights and its part of the KV pool (its heads, its layers), and
//! every step's batch goes to every worker (see `engine/runner.rs`).
//!
//! Workers form a grid of `pipeline × tensor` ranks: stage `s` holds a contiguous run of
//! layers; within a stage, rank `r` of the tensor-parallel group holds `1/tensor` of every
//! layer's heads and MLP columns (Megatron style: column-parallel QKV and gate/up, row-parallel
//! output and down projections, each followed by an all-reduce) and a contiguous part of the
//! vocabulary (embedding and LM head).

pub mod ccl;
pub mod comm;
pub mod tcp;

pub use ccl::{Binder, DeviceGroups, MultiDevice, WorkerComms};
pub use comm::{Communicator, HostCollectives, LocalComm, LocalGroup};

use crate::backend::Backend;
use anyhow::{Result, bail};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// How a failed step is cleaned up in one group of workers: [`GroupControl::abort`] wakes (or
/// cancels) every rank waiting in a collective, so that no worker waits for one that failed;
/// [`GroupControl::reset`] readies the group for the next step once every rank has answered.
pub trait GroupControl: Send + Sync {
    fn abort(&self);
    fn reset(&self);
}

impl GroupControl for LocalGroup {
    fn abort(&self) {
        LocalGroup::abort(self)
    }
    fn reset(&self) {
        LocalGroup::reset(self)
    }
}

/// What placement needs to know of a model: the sizes that are split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_layers: usize,
}

/// `--tensor-parallel-size` and `--pipeline-parallel-size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelConfig {
    pub tensor: usize,
    pub pipeline: usize,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            tensor: 1,
            pipeline: 1,
        }
    }
}

impl ParallelConfig {
    pub fn is_single(&self) -> bool {
        self.tensor == 1 && self.pipeline == 1
    }

    pub fn world_size(&self) -> usize {
        self.tensor * self.pipeline
    }

    /// Whether the model splits this way: every tensor-parallel rank gets whole query heads
    /// (an equal number), the KV heads its query heads use (replicated where there are fewer
    /// KV heads than ranks), a part of the MLP's columns and of the vocabulary (these two need
    /// not divide: parts differ by one at most, one block of 256 for the MLP where it can); every
    /// stage at least one layer. Checked before any weight is loaded.
    pub fn check(&self, c: &Dims) -> Result<()> {
        if self.tensor == 0 || self.pipeline == 0 {
            bail!("--tensor-parallel-size and --pipeline-parallel-size must be at least 1");
        }
        for r in 0..self.tensor {
            HeadShard::new(c.num_heads, c.num_kv_heads, self.tensor, r)?;
        }
        if self.tensor > c.intermediate_size || self.tensor > c.vocab_size {
            bail!(
                "--tensor-parallel-size {} is larger than the MLP or the vocabulary",
                self.tensor
            );
        }
        if self.pipeline > c.num_layers {
            bail!(
                "--pipeline-parallel-size {} is more than the model's {} layers",
                self.pipeline,
                c.num_layers
            );
        }
        Ok(())
    }
}

/// The workers spread over several processes (machines): `--nnodes`, `--node-rank`,
/// `--master-addr`, `--master-port`, as torchrun and vLLM name them. Node 0 runs the engine
/// (scheduler, block manager, sampling) and its share of the workers; every other node runs
/// workers only. Workers are numbered `stage × tensor + rank` and node `n` holds the `n`-th run
/// of `world / nnodes` of them, so that a tensor-parallel group stays on one node where it
/// fits (its all-reduces are the traffic that needs the fastest link).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub nnodes: usize,
    pub node_rank: usize,
    /// Where node 0 listens for the other nodes' workers.
    pub master_addr: String,
    pub master_port: u16,
    /// How long node 0 waits for every other node's workers to connect and load, and how long
    /// they wait for node 0.
    pub timeout: Duration,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            timeout: Duration::from_secs(600),
        }
    }
}

impl NodeConfig {
    pub fn is_single(&self) -> bool {
        self.nnodes == 1
    }

    /// Whether the workers of `pc` spread evenly over the nodes. Checked before any weight is
    /// loaded.
    pub fn check(&self, pc: &ParallelConfig) -> Result<()> {
        if self.nnodes == 0 || self.node_rank >= self.nnodes {
            bail!(
                "--node-rank {} is not one of --nnodes {} (0 to {})",
                self.node_rank,
                self.nnodes,
                self.nnodes.saturating_sub(1)
            );
        }
        let world = pc.world_size();
        if !world.is_multiple_of(self.nnodes) {
            bail!(
                "{world} workers (--tensor-parallel-size {} x --pipeline-parallel-size {}) do \
                 not spread evenly over --nnodes {}",
                pc.tensor,
                pc.pipeline,
                self.nnodes
            );
        }
        Ok(())
    }

    /// The workers this node holds.
    pub fn workers(&self, pc: &ParallelConfig) -> Range<usize> {
        let per = pc.world_size() / self.nnodes.max(1);
        self.node_rank * per..(self.node_rank + 1) * per
    }

    /// The node holding worker `w`.
    pub fn node_of(&self, pc: &ParallelConfig, w: usize) -> usize {
        w / (pc.world_size() / self.nnodes.max(1)).max(1)
    }
}

/// Part `i` of `n` items split into `parts` contiguous runs whose lengths differ by at most one
/// (the longer ones first).
pub fn split_even(n: usize, parts: usize, i: usize) -> Range<usize> {
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

/// [`split_even`] in whole units of `unit` where `n` is made of at least `parts` of them (the
/// parts then differ by one unit at most), else item by item.
pub fn split_aligned(n: usize, parts: usize, i: usize, unit: usize) -> Range<usize> {
    if unit > 0 && n.is_multiple_of(unit) && n / unit >= parts {
        let r = split_even(n / unit, parts, i);
        r.start * unit..r.end * unit
    } else {
        split_even(n, parts, i)
    }
}

/// The attention heads of one tensor-parallel rank, as head indices of the whole model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadShard {
    pub q: Range<usize>,
    pub kv: Range<usize>,
}

impl HeadShard {
    /// Rank `rank` of `tp` holds query heads `[rank H/tp, (rank+1) H/tp)` and the KV heads
    /// they read. With fewer KV heads than ranks a KV head is held by every rank whose query
    /// heads use it. The rank's own grouping must be even (`q.len()` a multiple of `kv.len()`,
    /// each KV head serving consecutive query heads), as the attention kernels assume.
    pub fn new(h: usize, hkv: usize, tp: usize, rank: usize) -> Result<Self> {
        if !h.is_multiple_of(tp) {
            bail!("--tensor-parallel-size {tp} does not divide the model's {h} attention heads");
        }
        if hkv == 0 || !h.is_multiple_of(hkv) {
            bail!("{h} attention heads cannot share {hkv} KV heads evenly");
        }
        let per = h / tp;
        let group = h / hkv;
        let q = rank * per..(rank + 1) * per;
        let kv = q.start / group..(q.end - 1) / group + 1;
        let local_group = per / kv.len();
        let even = per.is_multiple_of(kv.len())
            && q.clone()
                .enumerate()
                .all(|(j, head)| head / group - kv.start == j / local_group);
        if !even {
            bail!(
                "--tensor-parallel-size {tp} splits the model's {h} attention heads so that rank \
                 {rank}'s heads {}..{} use KV heads {}..{} unevenly ({hkv} KV heads): choose a \
                 size that divides the KV heads, or a multiple of them",
                q.start,
                q.end,
                kv.start,
                kv.end
            );
        }
        Ok(HeadShard { q, kv })
    }
}

/// Where one worker sits: its tensor-parallel group (the ranks of its stage), its pipeline
/// group (the workers of its tensor rank, one per stage, ranked by stage), and its layers.
pub struct Placement<B: Backend> {
    pub tp: Arc<dyn Communicator<B>>,
    pub pp: Arc<dyn Communicator<B>>,
    /// This stage's layers, of the whole model's.
    pub layers: Range<usize>,
}

impl<B: Backend> Placement<B> {
    /// The whole model on one worker.
    pub fn single(num_layers: usize) -> Self {
        let one = || -> Arc<dyn Communicator<B>> { Arc::new(LocalGroup::new(1).remove(0)) };
        Placement {
            tp: one(),
            pp: one(),
            layers: 0..num_layers,
        }
    }

    pub fn is_single(&self) -> bool {
        self.tp.size() == 1 && self.pp.size() == 1
    }

    pub fn tp_rank(&self) -> usize {
        self.tp.rank()
    }

    pub fn tp_size(&self) -> usize {
        self.tp.size()
    }

    /// Whether this worker's stage is the first (it embeds the tokens).
    pub fn first_stage(&self) -> bool {
        self.pp.rank() == 0
    }

    /// Whether this worker's stage is the last (it computes the logits).
    pub fn last_stage(&self) -> bool {
        self.pp.rank() + 1 == self.pp.size()
    }

    /// The part of a `vocab` this worker's embedding and LM head hold.
    pub fn vocab(&self, vocab: usize) -> Range<usize> {
        split_even(vocab, self.tp_size(), self.tp_rank())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_even_covers_everything_once() {
        for (n, parts) in [(30, 2), (30, 4), (49152, 3), (151936, 7), (5, 5)] {
            let mut next = 0;
            for i in 0..parts {
                let r = split_even(n, parts, i);
                assert_eq!(r.start, next);
                assert!(r.len() == n / parts || r.len() == n / parts + 1);
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }

    #[test]
    fn aligned_splits_keep_whole_units() {
        // Qwen2.5-0.5B's MLP, 4864 = 19 x 256, over 2: 10 and 9 blocks, not 2432 each
        assert_eq!(split_aligned(4864, 2, 0, 256), 0..2560);
        assert_eq!(split_aligned(4864, 2, 1, 256), 2560..4864);
        // SmolLM2's 1536 = 6 x 256 over 3; 100 is not made of 256s; 512 has 2 units for 3 parts
        assert_eq!(split_aligned(1536, 3, 2, 256), 1024..1536);
        assert_eq!(split_aligned(100, 3, 1, 256), split_even(100, 3, 1));
        assert_eq!(split_aligned(512, 3, 0, 256), split_even(512, 3, 0));
    }

    #[test]
    fn heads_split_by_kv_heads_or_replicate_them() {
        // SmolLM2: 9 heads, 3 KV heads, tp 3: one KV head each
        for r in 0..3 {
            let s = HeadShard::new(9, 3, 3, r).unwrap();
            assert_eq!((s.q, s.kv), (3 * r..3 * r + 3, r..r + 1));
        }
        // Qwen2.5-0.5B: 14 heads, 2 KV heads (7 per KV head), tp 7: 2 heads per rank; rank 3
        // holds heads 6 and 7, which read KV heads 0 and 1: both, one query head each
        let s = HeadShard::new(14, 2, 7, 3).unwrap();
        assert_eq!((s.q, s.kv), (6..8, 0..2));
        let s = HeadShard::new(14, 2, 7, 2).unwrap();
        assert_eq!((s.q, s.kv), (4..6, 0..1));
        // tp 2: 7 heads and 1 KV head each
        let s = HeadShard::new(14, 2, 2, 1).unwrap();
        assert_eq!((s.q, s.kv), (7..14, 1..2));
        // multi-query: every rank replicates the one KV head
        let s = HeadShard::new(8, 1, 4, 3).unwrap();
        assert_eq!((s.q, s.kv), (6..8, 0..1));
    }

    #[test]
    fn splits_that_do_not_divide_are_errors() {
        let e = HeadShard::new(9, 3, 2, 0).unwrap_err().to_string();
        assert!(
            e.contains("does not divide the model's 9 attention heads"),
            "{e}"
        );
        // 15 heads, 3 KV heads (5 each), tp 5: rank 1 holds heads 3..6, KV heads 0 and 1
        // unevenly (2 + 1)
        let e = HeadShard::new(15, 3, 5, 1).unwrap_err().to_string();
        assert!(e.contains("unevenly"), "{e}");
    }

    #[test]
    fn nodes_hold_contiguous_runs_of_workers() {
        let pc = ParallelConfig {
            tensor: 3,
            pipeline: 2,
        };
        let node = |nnodes, node_rank| NodeConfig {
            nnodes,
            node_rank,
            ..NodeConfig::default()
        };
        assert_eq!(node(2, 0).workers(&pc), 0..3);
        assert_eq!(node(2, 1).workers(&pc), 3..6);
        assert_eq!(node(3, 2).workers(&pc), 4..6);
        assert_eq!(node(2, 0).node_of(&pc, 4), 1);
        assert_eq!(node(1, 0).workers(&pc), 0..6);
        let e = node(4, 0).check(&pc).unwrap_err().to_string();
        assert!(e.contains("do not spread evenly over --nnodes 4"), "{e}");
        let e = node(2, 2).check(&pc).unwrap_err().to_string();
        assert!(e.contains("--node-rank 2 is not one of --nnodes 2"), "{e}");
        assert!(node(6, 5).check(&pc).is_ok());
    }
}
