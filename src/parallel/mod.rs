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

pub mod comm;

pub use comm::{Communicator, LocalComm, LocalGroup};

use crate::backend::Backend;
use crate::models::ModelConfig;
use anyhow::{Result, bail};
use std::ops::Range;
use std::sync::Arc;

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
    /// not divide: parts differ by one at most); every stage at least one layer. Checked before any weight
    /// is loaded.
    pub fn check(&self, c: &ModelConfig) -> Result<()> {
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

/// Part `i` of `n` items split into `parts` contiguous runs whose lengths differ by at most one
/// (the longer ones first).
pub fn split_even(n: usize, parts: usize, i: usize) -> Range<usize> {
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
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
}
