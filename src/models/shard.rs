//! What a family needs to split its layers over workers (tensor and pipeline parallelism):
//! one worker's slices of each kind of weight, its embedding through a vocabulary shard, and
//! the hand-over between pipeline stages. A family written over these loads a single device's
//! model with [`Placement::single`] and the same code.

use super::config::ModelConfig;
use super::kv_cache::{self, LayerKvSpec};
use super::lora::RankRows;
use super::pooling::OutputHead;
use super::{Norm, Part, Uploader, Weight, final_logits, final_rows, stack_linear};
use crate::backend::{Backend, DeviceBatch, QkvLayout};
use crate::parallel::{HeadShard, Placement, split_aligned};
use crate::tensor::{DType, HostTensor};
use anyhow::{Result, bail};
use std::ops::Range;

/// One tensor-parallel rank's part of every layer: its query heads and the KV heads they read
/// (column-parallel QKV, the same columns of o_proj, which is row-parallel), a slice of the
/// MLP's columns (gate/up by rows, down by columns), a contiguous part of the vocabulary. The
/// MLP and the vocabulary need not divide: their parts differ by one at most (one block of 256
/// for the MLP where it is made of them).
pub struct Shard {
    pub tp: usize,
    pub heads: HeadShard,
    /// This rank's MLP columns, of `intermediate_size`.
    pub ffn: Range<usize>,
    /// This rank's part of the vocabulary.
    pub vocab: Range<usize>,
    /// This rank's heads as the kernels see them.
    pub ql: QkvLayout,
    rank: usize,
    h: usize,
    hkv: usize,
    d: usize,
    f: usize,
}

/// A linear weight a shard takes its part of: by name and shape in the model's files, of which
/// only the part is read, or one in hand (biases, GPT-2's transposed Conv1D weights), cut.
pub enum Lin<'a> {
    File(&'a str, [usize; 2]),
    Have(Weight),
}

impl Lin<'_> {
    /// A bias (or any vector) in hand, in f32.
    pub fn bias(t: HostTensor) -> Lin<'static> {
        Lin::Have(Weight::dense(t, DType::F32))
    }
}

fn take<B: Backend>(up: &Uploader<B>, w: Lin, part: Part) -> Result<Weight> {
    match w {
        Lin::File(name, shape) => up.fetch_linear_part(name, &shape, &part),
        Lin::Have(w) => part.apply(w),
    }
}

fn shift(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

impl Shard {
    pub fn new<B: Backend>(c: &ModelConfig, place: &Placement<B>) -> Result<Self> {
        let (tp, rank) = (place.tp_size(), place.tp_rank());
        let heads = HeadShard::new(c.num_heads, c.num_kv_heads, tp, rank)?;
        let ql = QkvLayout {
            num_heads: heads.q.len(),
            num_kv_heads: heads.kv.len(),
            head_dim: c.head_dim,
        };
        Ok(Shard {
            tp,
            // NOTE: on 256-column boundaries where the MLP has enough of them (the largest block
            // of every format), so that the row-parallel down projection keeps its blocks
            // (Qwen2.5's 4864 over 2: 2560 and 2304, not 2432 each, which splits Q4_K blocks).
            ffn: split_aligned(c.intermediate_size, tp, rank, 256),
            vocab: place.vocab(c.vocab_size),
            heads,
            ql,
            rank,
            h: c.num_heads,
            hkv: c.num_kv_heads,
            d: c.head_dim,
            f: c.intermediate_size,
        })
    }

    /// This rank's rows and columns, as LoRA's sites take them.
    pub fn lora_rows(&self) -> RankRows {
        RankRows {
            q: self.q_rows(),
            kv: self.kv_rows(),
            ffn: self.ffn.clone(),
        }
    }

    /// This rank's rows of the Q projection (its query heads' `D` rows each).
    fn q_rows(&self) -> Range<usize> {
        self.heads.q.start * self.d..self.heads.q.end * self.d
    }

    /// This rank's rows of the K or V projection.
    fn kv_rows(&self) -> Range<usize> {
        self.heads.kv.start * self.d..self.heads.kv.end * self.d
    }

    /// The rows of `D` values of all heads' QKV rows (`[T (H + 2 Hkv), D]`) that are this
    /// rank's heads' rows, token by token: its q heads, its kv heads' k, then their v. (For Q/K
    /// norms over all heads, which each rank computes whole: OLMo 2, OLMoE.)
    pub fn own_qkv_rows(&self, all: QkvLayout, t: usize) -> Vec<u32> {
        let heads = &self.heads;
        let per_token = all.num_heads + 2 * all.num_kv_heads;
        let (k0, v0) = (all.num_heads, all.num_heads + all.num_kv_heads);
        let rows: Vec<usize> = (heads.q.clone())
            .chain(heads.kv.clone().map(|h| k0 + h))
            .chain(heads.kv.clone().map(|h| v0 + h))
            .collect();
        (0..t)
            .flat_map(|i| rows.iter().map(move |r| (i * per_token + r) as u32))
            .collect()
    }

    /// What each of this worker's layers keeps in the KV cache: its stage's layers, its KV
    /// heads.
    pub fn kv_spec<B: Backend>(&self, c: &ModelConfig, place: &Placement<B>) -> Vec<LayerKvSpec> {
        kv_cache::default_spec(c)[place.layers.clone()]
            .iter()
            .map(|s| LayerKvSpec {
                num_kv_heads: self.ql.num_kv_heads,
                ..*s
            })
            .collect()
    }

    /// This rank's rows of the Q, K and V projections (weights or biases), stacked.
    pub fn qkv<B: Backend>(&self, up: &Uploader<B>, q: Lin, k: Lin, v: Lin) -> Result<Weight> {
        let kv = || Part::row_range(self.kv_rows());
        stack_linear(vec![
            take(up, q, Part::row_range(self.q_rows()))?,
            take(up, k, kv())?,
            take(up, v, kv())?,
        ])
    }

    /// This rank's rows of a fused QKV projection (`[(H + 2 Hkv) D, hidden]`).
    pub fn qkv_fused<B: Backend>(&self, up: &Uploader<B>, w: Lin) -> Result<Weight> {
        let kv = self.kv_rows();
        let rows = vec![
            self.q_rows(),
            shift(&kv, self.h * self.d),
            shift(&kv, (self.h + self.hkv) * self.d),
        ];
        take(up, w, Part::rows(rows))
    }

    /// This rank's rows of vectors of a row per q head and per kv head (`[H D]`, `[Hkv D]`:
    /// per-head norm weights).
    pub fn qk_rows(&self, q: Weight, k: Weight) -> Result<(Weight, Weight)> {
        Ok((
            Part::row_range(self.q_rows()).apply(q)?,
            Part::row_range(self.kv_rows()).apply(k)?,
        ))
    }

    /// This rank's columns of the attention output projection (`[hidden, H D]`).
    pub fn o_proj<B: Backend>(&self, up: &Uploader<B>, w: Lin) -> Result<Weight> {
        take(up, w, Part::cols(self.q_rows()))
    }

    /// This rank's rows of the gate and up projections, stacked.
    pub fn gate_up<B: Backend>(&self, up: &Uploader<B>, gate: Lin, upw: Lin) -> Result<Weight> {
        self.gate_up_of(up, gate, upw, &self.ffn)
    }

    /// This rank's columns of an MLP of `f` (an expert's): split as the dense MLP is.
    pub fn ffn_of(&self, f: usize) -> Range<usize> {
        split_aligned(f, self.tp, self.rank, 256)
    }

    /// The rows `ffn` of the gate and up projections, stacked (an expert's part).
    pub fn gate_up_of<B: Backend>(
        &self,
        up: &Uploader<B>,
        gate: Lin,
        upw: Lin,
        ffn: &Range<usize>,
    ) -> Result<Weight> {
        let rows = || Part::row_range(ffn.clone());
        stack_linear(vec![take(up, gate, rows())?, take(up, upw, rows())?])
    }

    /// The columns `ffn` of a down projection (an expert's part).
    pub fn down_of<B: Backend>(
        &self,
        up: &Uploader<B>,
        w: Lin,
        ffn: &Range<usize>,
    ) -> Result<Weight> {
        take(up, w, Part::cols(ffn.clone()))
    }

    /// This rank's rows of a plain (ungated) MLP's first projection (`[F, hidden]`) or bias.
    pub fn ffn_rows<B: Backend>(&self, up: &Uploader<B>, w: Lin) -> Result<Weight> {
        take(up, w, Part::row_range(self.ffn.clone()))
    }

    /// This rank's rows of a fused gate-up projection (`[2 F, hidden]`).
    pub fn gate_up_fused<B: Backend>(&self, up: &Uploader<B>, w: Lin) -> Result<Weight> {
        let rows = vec![self.ffn.clone(), shift(&self.ffn, self.f)];
        take(up, w, Part::rows(rows))
    }

    /// This rank's columns of the down projection (`[hidden, F]`).
    pub fn down<B: Backend>(&self, up: &Uploader<B>, w: Lin) -> Result<Weight> {
        self.down_of(up, w, &self.ffn)
    }

    /// This rank's rows of a `[vocab, hidden]` table, uploaded, with its row count.
    ///
    /// NOTE: under tensor parallelism the table has one more row, of zeros: the row tokens
    /// outside the shard read, so that the all-reduce of the embeddings adds the one real row
    /// to zeros (exact). Used as a tied head, it gives one logit column more, which the
    /// runner drops.
    pub fn vocab_table<B: Backend>(
        &self,
        up: &mut Uploader<B>,
        name: &str,
        hidden: usize,
        vocab: usize,
    ) -> Result<(B::Buf, usize)> {
        let w = up.fetch_linear_part(name, &[vocab, hidden], &self.vocab_part())?;
        if self.tp > 1 {
            Ok((up.upload_linear(w.with_zero_row()?)?, self.vocab.len() + 1))
        } else {
            Ok((up.upload_linear(w)?, self.vocab.len()))
        }
    }

    fn vocab_part(&self) -> Part {
        Part::row_range(self.vocab.clone())
    }

    /// The token ids as rows of this rank's vocabulary table: ids outside it read the last row
    /// (zeros).
    fn shard_ids(&self, ids: &[u32], vocab: usize) -> Result<Vec<u32>> {
        let zero_row = self.vocab.len() as u32;
        ids.iter()
            .map(|&id| {
                let i = id as usize;
                if i >= vocab {
                    bail!("token id {id} is outside the vocabulary of {vocab}");
                }
                Ok(if self.vocab.contains(&i) {
                    (i - self.vocab.start) as u32
                } else {
                    zero_row
                })
            })
            .collect()
    }
}

/// The residual stream `[T, hidden]` a stage starts from: on the first stage the embeddings of
/// the batch's tokens (looked up in this rank's vocabulary part, then added over the ranks),
/// on a later one what the previous stage sent.
pub fn stage_input<B: Backend>(
    backend: &B,
    place: &Placement<B>,
    shard: &Shard,
    table: Option<&B::Buf>,
    batch: &DeviceBatch<B>,
    cfg: &ModelConfig,
) -> Result<B::Buf> {
    let (t, hid) = (batch.host.num_tokens(), cfg.hidden_size);
    let (tp, pp) = (&place.tp, &place.pp);
    let Some(table) = table.filter(|_| place.first_stage()) else {
        return pp.recv(backend, t * hid, pp.rank() - 1);
    };
    let mut x = backend.alloc_scratch_f32(t * hid)?;
    if tp.size() > 1 {
        let ids = shard.shard_ids(&batch.host.token_ids, cfg.vocab_size)?;
        backend.embedding(table, &backend.upload_u32(&ids)?, hid, &mut x)?;
        tp.all_reduce_sum(backend, &mut x, t * hid)?;
    } else {
        backend.embedding(table, &batch.token_ids, hid, &mut x)?;
    }
    Ok(x)
}

/// Where a stage ends: on the last stage (`head`: its final norm and head; `embed`: the
/// embedding table, where the head is tied) the logits `[R, rows]` of `batch.logits_rows`, or
/// what a model served for embeddings or scores returns in their place (see [`Head`]); on a
/// stage before it, the residual stream `x`, sent on to the next stage and returned.
#[allow(clippy::too_many_arguments)]
pub fn stage_output<B: Backend>(
    backend: &B,
    place: &Placement<B>,
    cfg: &ModelConfig,
    x: B::Buf,
    batch: &DeviceBatch<B>,
    head: Option<&(Norm<B>, Head<B>)>,
    embed: Option<&(B::Buf, usize)>,
) -> Result<B::Buf> {
    let Some((norm, head)) = head else {
        let n = batch.host.num_tokens() * cfg.hidden_size;
        place.pp.send(backend, &x, n, place.pp.rank() + 1)?;
        return Ok(x);
    };
    match head {
        Head::Hidden => final_rows(backend, cfg, &x, batch, norm),
        Head::Classifier(w, labels) => {
            final_logits(backend, cfg, &x, batch, norm, (w, None), *labels, false)
        }
        _ => {
            let (table, rows) = head.table(embed)?;
            let bias = match head {
                Head::Own(_, _, b) => b.as_ref(),
                _ => None,
            };
            final_logits(backend, cfg, &x, batch, norm, (table, bias), rows, true)
        }
    }
}

/// [`super::CausalLm::logits_shard`] of a model laid out as [`stage_output`] reads it.
pub fn logits_shard<B: Backend>(
    shard: &Shard,
    cfg: &ModelConfig,
    head: Option<&(Norm<B>, Head<B>)>,
    embed: Option<&(B::Buf, usize)>,
) -> Option<(Range<usize>, usize)> {
    let cols = match &head?.1 {
        // NOTE: not split over the vocabulary: every rank holds all of it.
        Head::Hidden => return Some((0..cfg.hidden_size, cfg.hidden_size)),
        Head::Classifier(_, labels) => return Some((0..*labels, *labels)),
        h => h.table(embed).ok()?.1,
    };
    Some((shard.vocab.clone(), cols))
}

/// The head of the last stage: an LM head, its own table (this rank's rows, with their count)
/// or the embedding's (tied); or, for a model served for embeddings or scores, none (the
/// final norm's rows) or a classifier `[labels, hidden]`.
pub enum Head<B: Backend> {
    /// Its own table, with its row count and its bias where it has one (GPT-J's).
    Own(B::Buf, usize, Option<B::Buf>),
    Tied,
    Hidden,
    Classifier(B::Buf, usize),
}

impl<B: Backend> Head<B> {
    /// The last stage's head: `lm_head` unless the model is tied or the checkpoint omits it
    /// (NOTE: some do although their config says untied), else the embedding table
    /// `embed_name`, loaded here where this stage has none of its own (`embed`: whether it
    /// has). A model served for embeddings or scores gets [`Head::task`]'s.
    pub fn load(
        up: &mut Uploader<B>,
        shard: &Shard,
        cfg: &ModelConfig,
        embed: (bool, &str),
        out: &OutputHead,
    ) -> Result<Head<B>> {
        Head::load_named(up, shard, cfg, "lm_head.weight", embed, out)
    }

    /// [`Head::load`] for a family whose LM head is named otherwise (GPT-NeoX's `embed_out`).
    pub fn load_named(
        up: &mut Uploader<B>,
        shard: &Shard,
        cfg: &ModelConfig,
        head_name: &str,
        (embed, embed_name): (bool, &str),
        out: &OutputHead,
    ) -> Result<Head<B>> {
        let (hid, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let own = !cfg.tie_word_embeddings && up.has(head_name)?;
        let table = if own { head_name } else { embed_name };
        if let Some(h) = Head::task(up, cfg, out, table)? {
            return Ok(h);
        }
        Ok(match own {
            true => {
                let w = up.fetch_linear_part(head_name, &[vocab, hid], &shard.vocab_part())?;
                let bias_name = head_name.replace(".weight", ".bias");
                let bias = match up.fetch_opt(&bias_name, &[vocab])? {
                    Some(b) => {
                        let b = shard.vocab_part().apply(Weight::dense(b, DType::F32))?;
                        Some(up.upload_bias(b)?)
                    }
                    None => None,
                };
                Head::Own(up.upload_linear(w)?, shard.vocab.len(), bias)
            }
            false if embed => Head::Tied,
            false => {
                let (t, rows) = shard.vocab_table(up, embed_name, hid, vocab)?;
                Head::Own(t, rows, None)
            }
        })
    }

    /// The head of a model served for embeddings or scores (`None` for generation): `table`
    /// names the LM head's weights, whose rows a classifier from tokens takes.
    fn task(
        up: &mut Uploader<B>,
        cfg: &ModelConfig,
        out: &OutputHead,
        table: &str,
    ) -> Result<Option<Head<B>>> {
        let (hid, vocab) = (cfg.hidden_size, cfg.vocab_size);
        Ok(Some(match out {
            OutputHead::Logits => return Ok(None),
            OutputHead::Hidden => Head::Hidden,
            OutputHead::Classifier => {
                let w = up.fetch_linear("score.weight", &[1, hid])?;
                Head::Classifier(up.upload_linear(w)?, 1)
            }
            OutputHead::TokenClassifier(ids) => {
                // NOTE: the difference of two rows is the difference of two logits only
                // where nothing bends the logits after the head.
                let biased = up.has(&table.replace(".weight", ".bias"))?;
                if cfg.final_logit_softcap.is_some() || cfg.logit_scale.is_some() || biased {
                    bail!(
                        "a classifier from tokens needs plain logits; this model scales, \
                         soft-caps or biases them"
                    );
                }
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    bail!("classifier token {bad} is outside the vocabulary of {vocab}");
                }
                let rows = ids.iter().map(|&t| t as usize..t as usize + 1).collect();
                let (w, _) = up
                    .fetch_linear_part(table, &[vocab, hid], &Part::rows(rows))?
                    .into_dense()?;
                let row = |i: usize| &w.data[i * hid..(i + 1) * hid];
                let data: Vec<f32> = match ids.len() {
                    1 => row(0).to_vec(),
                    _ => row(1).iter().zip(row(0)).map(|(y, n)| y - n).collect(),
                };
                let w = HostTensor::new(vec![1, hid], data);
                Head::Classifier(up.upload(&w, DType::F32)?, 1)
            }
        }))
    }

    /// The table and its rows (an LM head).
    pub fn table<'a>(&'a self, embed: Option<&'a (B::Buf, usize)>) -> Result<(&'a B::Buf, usize)> {
        match (self, embed) {
            (Head::Own(w, rows, _), _) => Ok((w, *rows)),
            (Head::Tied, Some((t, rows))) => Ok((t, *rows)),
            (Head::Tied, None) => bail!("a tied LM head without an embedding table"),
            (Head::Hidden | Head::Classifier(..), _) => bail!("the model has no LM head"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 1 of 2 with 4 q heads and 2 kv heads keeps q heads 2, 3, k head 1 and v head 1 of
    /// each token's 8 rows.
    #[test]
    fn a_rank_keeps_its_heads_rows() {
        let all = QkvLayout {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
        };
        let heads = HeadShard::new(4, 2, 2, 1).unwrap();
        let sh = Shard {
            tp: 2,
            ql: all,
            heads,
            ffn: 0..0,
            vocab: 0..0,
            rank: 1,
            h: 4,
            hkv: 2,
            d: 16,
            f: 0,
        };
        assert_eq!(sh.own_qkv_rows(all, 2), [2, 3, 5, 7, 10, 11, 13, 15]);
    }
}
