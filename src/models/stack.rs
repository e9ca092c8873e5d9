//! What every family's model holds besides its own layers, written once: the config, this
//! worker's shard and placement, the embedding table and the head, the weight statistics; the
//! start and the end of a forward pass over them; and [`CausalLm`] for every [`Family`].

use super::config::ModelConfig;
use super::kv_cache::{KvCache, LayerKvSpec};
use super::loader::WeightSource;
use super::lora::LoraAdapter;
use super::pooling::OutputHead;
use super::shard::{self, Head, Shard, stage_input, stage_output};
use super::{CausalLm, Norm, Uploader, check_positions};
use crate::backend::{Backend, DeviceBatch, QkvLayout};
use crate::parallel::Placement;
use crate::tensor::{WeightDtype, WeightStats};
use anyhow::Result;
use std::ops::Range;

/// What loading one worker's shard of a family's model starts from.
pub struct Load<'a, B: Backend> {
    pub backend: &'a B,
    pub cfg: &'a ModelConfig,
    pub src: &'a dyn WeightSource,
    /// The type to store the weights in (`auto`: as the file stores them).
    pub dtype: WeightDtype,
    /// Bounds the RoPE tables (the max model length).
    pub max_positions: usize,
    /// This worker's layers, heads and vocabulary ([`Placement::single`]: all of them).
    pub place: Placement<B>,
    /// What the last stage returns: logits, or an embedding model's or a classifier's rows.
    pub head: OutputHead,
}

impl<'a, B: Backend> Load<'a, B> {
    /// This worker's shard of the sizes, an uploader over the source, and the steps the
    /// progress counts (the embedding, each layer, the head).
    pub fn start(&self) -> Result<(Shard, Uploader<'a, B>, usize)> {
        let shard = Shard::new(self.cfg, &self.place)?;
        let up = Uploader::new(self.backend, self.src, self.dtype);
        Ok((shard, up, self.place.layers.len() + 2))
    }
}

/// A model's parts that are not its layers.
pub struct Stack<B: Backend> {
    pub cfg: ModelConfig,
    /// This rank's heads, MLP columns and vocabulary (all of them on one device).
    pub shard: Shard,
    /// `[rows, hidden]`: the embedding of this rank's vocabulary, with its row count; on the
    /// first stage, and on the last where the head is tied.
    pub embed: Option<(B::Buf, usize)>,
    /// The final norm and the head, on the last stage.
    pub head: Option<(Norm<B>, Head<B>)>,
    /// Positions at or past this are refused (the RoPE tables' or the learned table's rows).
    pub max_positions: usize,
    pub weights: WeightStats,
    pub place: Placement<B>,
}

impl<B: Backend> Stack<B> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &ModelConfig,
        shard: Shard,
        embed: Option<(B::Buf, usize)>,
        head: Option<(Norm<B>, Head<B>)>,
        max_positions: usize,
        weights: WeightStats,
        place: Placement<B>,
    ) -> Self {
        Stack {
            cfg: cfg.clone(),
            shard,
            embed,
            head,
            max_positions,
            weights,
            place,
        }
    }

    /// What a forward pass works in: the hidden size, this rank's MLP columns and attention
    /// heads, the norms' epsilon.
    pub fn sizes(&self) -> (usize, usize, QkvLayout, f32) {
        let c = &self.cfg;
        let eps = c.rms_norm_eps as f32;
        (c.hidden_size, self.shard.ffn.len(), self.shard.ql, eps)
    }

    /// The residual stream `[T, hidden]` this stage starts from, the batch's positions checked
    /// first: the embeddings of its tokens on the first stage, what the previous stage sent on
    /// a later one.
    pub fn input(&self, backend: &B, batch: &DeviceBatch<B>) -> Result<B::Buf> {
        check_positions(&batch.host.positions, self.max_positions)?;
        let embed = self.embed.as_ref().map(|e| &e.0);
        stage_input(backend, &self.place, &self.shard, embed, batch, &self.cfg)
    }

    /// Where a stage ends: the logits of the batch's logits rows on the last stage, the
    /// residual stream `x` sent on to the next stage before it.
    pub fn output(&self, backend: &B, x: B::Buf, batch: &DeviceBatch<B>) -> Result<B::Buf> {
        let (head, embed) = (self.head.as_ref(), self.embed.as_ref());
        stage_output(backend, &self.place, &self.cfg, x, batch, head, embed)
    }
}

/// A family's model: its [`Stack`] and its forward pass; the rest of [`CausalLm`] follows.
pub trait Family<B: Backend>: Send + Sync {
    fn stack(&self) -> &Stack<B>;

    /// [`CausalLm::forward`].
    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf>;

    /// [`CausalLm::set_lora`].
    fn set_lora(&mut self, backend: &B, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        let _ = (backend, slot, adapter);
        anyhow::bail!(
            "LoRA adapters are not supported for {:?} models yet",
            self.stack().cfg.arch
        )
    }
}

impl<B: Backend, F: Family<B>> CausalLm<B> for F {
    fn config(&self) -> &ModelConfig {
        &self.stack().cfg
    }

    fn kv_spec(&self) -> Vec<LayerKvSpec> {
        let s = self.stack();
        s.shard.kv_spec(&s.cfg, &s.place)
    }

    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf> {
        Family::forward(self, backend, batch, kv)
    }

    fn weight_stats(&self) -> &WeightStats {
        &self.stack().weights
    }

    fn set_lora(&mut self, backend: &B, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        Family::set_lora(self, backend, slot, adapter)
    }

    fn logits_shard(&self) -> Option<(Range<usize>, usize)> {
        let s = self.stack();
        shard::logits_shard(&s.shard, &s.cfg, s.head.as_ref(), s.embed.as_ref())
    }
}
