//! Models: configuration, weight loading (HF safetensors directories and GGUF files), the
//! tokenizer with its chat template, the registry of families, and one file per family.

pub mod config;
pub mod falcon;
pub mod gemma3;
pub mod gguf;
pub mod gguf_lora;
pub mod gpt2;
pub mod kv_cache;
pub mod llama;
pub mod loader;
pub mod lora;
pub mod mmap;
pub mod moe;
pub mod neox;
pub mod olmo2;
pub mod open;
pub mod peft;
pub mod phi3;
pub mod pooling;
pub mod registry;
pub mod rope;
pub mod shard;
pub mod stack;

pub use config::Arch;
pub use config::ModelConfig;
pub use kv_cache::{KvCache, KvCacheDtype, LayerKvSpec};
pub use loader::WeightSource;
pub use open::{DEFAULT_MODEL_F16_FILE, LoadedModel, default_model, load_model};

use crate::backend::{AttentionOptions, Backend, DeviceBatch, QkvLayout};
use crate::quant::{GgmlType, QuantTensor};
use crate::tensor::{DType, HostTensor, WeightDtype, WeightStats};
use anyhow::{Context, Result, bail};

use std::ops::Range;

/// A causal language model on a backend: what the runner needs of every family.
pub trait CausalLm<B: Backend>: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// What each layer keeps in the KV cache, in layer order: by default every layer's KV
    /// heads in f32, with the layer's window.
    fn kv_spec(&self) -> Vec<LayerKvSpec> {
        kv_cache::default_spec(self.config())
    }

    /// Runs every layer over the whole flattened batch (writing each row's K/V into `kv`) and
    /// returns the logits of the rows in `batch.logits_rows`, as a device buffer `[R, vocab]`
    /// (see [`CausalLm::logits_shard`]). On a pipeline stage before the last: its output
    /// residual stream `[T, hidden]`, which it has sent on to the next stage.
    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf>;

    /// What was uploaded: bytes, parameters, bytes by storage type.
    fn weight_stats(&self) -> &WeightStats;

    /// Loads a LoRA adapter's factors into `slot` (the rows of `batch.host.lora_slots` equal
    /// to it use them from then on), or with `None` unloads the slot; the bytes they take on
    /// the device.
    fn set_lora(
        &mut self,
        backend: &B,
        slot: u32,
        adapter: Option<&lora::LoraAdapter>,
    ) -> Result<u64>;

    /// The part of the vocabulary this worker's logits cover, and the length of their rows
    /// (`forward` returns `[R, row_len]`, whose first `range.len()` columns are that part);
    /// `None` on a pipeline stage before the last. One device: the whole vocabulary.
    fn logits_shard(&self) -> Option<(Range<usize>, usize)> {
        let v = self.config().vocab_size;
        Some((0..v, v))
    }
}

/// A linear weight as the source holds it: dense values with the type they are stored in, or
/// rows in a GGML block format.
#[derive(Debug, Clone)]
pub enum Weight {
    Dense { t: HostTensor, stored: DType },
    Quant(QuantTensor),
}

impl Weight {
    /// Dense f32 values read from a file of this storage type.
    pub fn dense(t: HostTensor, stored: DType) -> Self {
        Weight::Dense { t, stored }
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Weight::Dense { t, .. } => t.shape.clone(),
            Weight::Quant(q) => vec![q.rows(), q.k],
        }
    }

    /// The values in f32 and the type they were stored in (f32 for a block format, whose
    /// values f32 holds exactly).
    pub fn into_dense(self) -> Result<(HostTensor, DType)> {
        Ok(match self {
            Weight::Dense { t, stored } => (t, stored),
            Weight::Quant(q) => {
                let shape = vec![q.rows(), q.k];
                (HostTensor::new(shape, q.dequantize()?), DType::F32)
            }
        })
    }

    /// The weight with its dense values transformed (a block format is dequantized first).
    pub fn map_dense(self, f: impl FnOnce(HostTensor) -> HostTensor) -> Result<Weight> {
        let (t, stored) = self.into_dense()?;
        Ok(Weight::Dense { t: f(t), stored })
    }
}

impl Weight {
    /// The rows in `ranges`, one run after the other: a column-parallel shard (of each part of
    /// a fused projection). The whole weight is returned as it is.
    pub fn select_rows(self, ranges: &[Range<usize>]) -> Result<Weight> {
        let rows = self.shape()[0];
        if let [r] = ranges
            && *r == (0..rows)
        {
            return Ok(self);
        }
        match self {
            Weight::Dense { t, stored } => Ok(Weight::Dense {
                t: t.select_rows(ranges)?,
                stored,
            }),
            Weight::Quant(q) => Ok(Weight::Quant(QuantTensor::stack(
                ranges
                    .iter()
                    .map(|r| q.slice_rows(r.clone()))
                    .collect::<Result<_>>()?,
            )?)),
        }
    }

    /// The rows in `order` (each row index once, a bias's values likewise): a reordering that
    /// keeps a block format in its format (its blocks run along the rows).
    pub fn permute_rows(self, order: &[usize]) -> Result<Weight> {
        match self {
            Weight::Dense { t, stored } => {
                let ranges: Vec<Range<usize>> = order.iter().map(|&r| r..r + 1).collect();
                Ok(Weight::Dense {
                    t: t.select_rows(&ranges)?,
                    stored,
                })
            }
            Weight::Quant(q) => Ok(Weight::Quant(q.select_rows(order)?)),
        }
    }

    /// Columns `c` of every row: a row-parallel shard. A block format whose blocks `c` would
    /// split is dequantized (f32 holds its values exactly), and the log says so.
    pub fn slice_cols(self, c: Range<usize>) -> Result<Weight> {
        let k = self.shape()[1];
        if c == (0..k) {
            return Ok(self);
        }
        match self {
            Weight::Dense { t, stored } => Ok(Weight::Dense {
                t: t.slice_cols(c)?,
                stored,
            }),
            Weight::Quant(q) => match q.slice_cols(c.clone())? {
                Some(s) => Ok(Weight::Quant(s)),
                None => {
                    tracing::info!(
                        "columns {}..{} split blocks of a {} weight: this shard is kept in f32",
                        c.start,
                        c.end,
                        q.parts[0].ty
                    );
                    let t = HostTensor::new(vec![q.rows(), q.k], q.dequantize()?);
                    Ok(Weight::Dense {
                        t: t.slice_cols(c)?,
                        stored: DType::F32,
                    })
                }
            },
        }
    }

    /// The weight with one more row of zeros (the row a vocabulary shard's embedding gives
    /// tokens outside its part).
    pub fn with_zero_row(self) -> Result<Weight> {
        match self {
            Weight::Dense { mut t, stored } => {
                t.data.resize(t.data.len() + t.shape[1], 0.0);
                t.shape[0] += 1;
                Ok(Weight::Dense { t, stored })
            }
            Weight::Quant(mut q) => {
                // NOTE: every block format here decodes all-zero bytes (scales 0) as zeros.
                let last = q.parts.last_mut().context("a weight without rows")?;
                let rb = last.ty.row_bytes(q.k)?;
                last.data.resize(last.data.len() + rb, 0);
                last.rows += 1;
                Ok(Weight::Quant(q))
            }
        }
    }
}

/// What one worker of a split model reads of a `[rows, cols]` linear weight: some of its rows
/// (runs stacked in order; `None`: all) and some of its columns (`None`: all).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Part {
    pub rows: Option<Vec<Range<usize>>>,
    pub cols: Option<Range<usize>>,
}

impl Part {
    pub fn rows(rows: Vec<Range<usize>>) -> Part {
        Part {
            rows: Some(rows),
            cols: None,
        }
    }

    /// One run of rows.
    pub fn row_range(rows: Range<usize>) -> Part {
        Part::rows(vec![rows])
    }

    pub fn cols(cols: Range<usize>) -> Part {
        Part {
            rows: None,
            cols: Some(cols),
        }
    }

    /// The part cut out of the whole weight: what a source that cannot read parts gives, and
    /// the reference for those that can.
    pub fn apply(&self, w: Weight) -> Result<Weight> {
        let w = match &self.rows {
            Some(r) => w.select_rows(r)?,
            None => w,
        };
        match &self.cols {
            Some(c) => w.slice_cols(c.clone()),
            None => Ok(w),
        }
    }

    /// Whether the part is all of a weight of this shape.
    pub fn is_whole(&self, shape: &[usize]) -> bool {
        let all = |r: &Range<usize>, n: usize| r.start == 0 && r.end == n;
        let rows = match &self.rows {
            None => true,
            Some(r) => matches!(r.as_slice(), [r] if all(r, shape[0])),
        };
        rows && self.cols.as_ref().is_none_or(|c| all(c, shape[1]))
    }

    /// The row indices of the part of a weight of `n` rows, checked.
    pub fn row_ids(&self, n: usize) -> Result<Vec<usize>> {
        match &self.rows {
            None => Ok((0..n).collect()),
            Some(rs) => {
                if let Some(r) = rs.iter().find(|r| r.start > r.end || r.end > n) {
                    bail!("rows {r:?} of a weight of {n} rows");
                }
                Ok(rs.iter().flat_map(|r| r.clone()).collect())
            }
        }
    }

    /// The columns of the part of a weight of `k` columns, checked.
    pub fn col_range(&self, k: usize) -> Result<Range<usize>> {
        match &self.cols {
            None => Ok(0..k),
            Some(c) if c.start <= c.end && c.end <= k => Ok(c.clone()),
            Some(c) => bail!("columns {c:?} of a weight of {k} columns"),
        }
    }
}

/// Concatenates linear weights along their rows (fused projections): block formats stay in
/// their formats when all parts have one; otherwise every part becomes dense.
pub fn stack_linear(parts: Vec<Weight>) -> Result<Weight> {
    if parts.iter().all(|w| matches!(w, Weight::Quant(_))) {
        let qs = parts
            .into_iter()
            .map(|w| match w {
                Weight::Quant(q) => q,
                Weight::Dense { .. } => unreachable!(),
            })
            .collect();
        return Ok(Weight::Quant(QuantTensor::stack(qs)?));
    }
    let mut stored = None;
    let mut dense = Vec::with_capacity(parts.len());
    for w in parts {
        let (t, s) = w.into_dense()?;
        // NOTE: parts stored in different types are uploaded in the widest, f32.
        stored = match stored {
            None => Some(s),
            Some(prev) if prev == s => Some(s),
            Some(_) => Some(DType::F32),
        };
        dense.push(t);
    }
    Ok(Weight::Dense {
        t: stack(dense),
        stored: stored.unwrap_or(DType::F32),
    })
}

/// Fetches tensors by HF name, checks their shapes and uploads them, counting what it uploads.
/// Linear weights follow the `--dtype` policy; norms and biases are uploaded in the type the
/// model asks for (f32).
pub struct Uploader<'a, B: Backend> {
    pub backend: &'a B,
    src: &'a dyn WeightSource,
    dtype: WeightDtype,
    /// What was uploaded so far.
    pub stats: WeightStats,
    /// Block types dequantized at load so far (each is logged once).
    dequantized: std::collections::HashSet<GgmlType>,
}

fn check_shape(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        bail!("tensor '{name}' has shape {got:?} but the config implies {want:?}");
    }
    Ok(())
}

impl<'a, B: Backend> Uploader<'a, B> {
    pub fn new(backend: &'a B, src: &'a dyn WeightSource, dtype: WeightDtype) -> Self {
        Uploader {
            backend,
            src,
            dtype,
            stats: WeightStats::default(),
            dequantized: Default::default(),
        }
    }

    /// The tensor `name`, which must exist and have this shape.
    pub fn fetch(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self
            .src
            .get(name)?
            .with_context(|| format!("the model has no tensor '{name}'"))?;
        check_shape(name, &t.shape, shape)?;
        Ok(t)
    }

    /// The tensor `name` if the model has it, with this shape.
    pub fn fetch_opt(&self, name: &str, shape: &[usize]) -> Result<Option<HostTensor>> {
        match self.src.get(name)? {
            None => Ok(None),
            Some(t) => check_shape(name, &t.shape, shape).map(|_| Some(t)),
        }
    }

    /// The linear weight `name` as the source stores it, which must exist and have this shape.
    pub fn fetch_linear(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        self.fetch_linear_opt(name, shape)?
            .with_context(|| format!("the model has no tensor '{name}'"))
    }

    /// Whether the model has a tensor `name` (nothing of it is read).
    pub fn has(&self, name: &str) -> Result<bool> {
        Ok(self.src.shape(name)?.is_some())
    }

    /// `part` of the linear weight `name`, which must exist and have this shape: only the
    /// part's bytes are read where the source can (memory-mapped files), so that each worker
    /// of a split model reads its slices and holds no more than them.
    pub fn fetch_linear_part(&self, name: &str, shape: &[usize], part: &Part) -> Result<Weight> {
        let got = self
            .src
            .shape(name)?
            .with_context(|| format!("the model has no tensor '{name}'"))?;
        check_shape(name, &got, shape)?;
        if part.is_whole(shape) {
            return self.fetch_linear(name, shape);
        }
        let w = self
            .src
            .get_weight_part(name, part)?
            .with_context(|| format!("the model has no tensor '{name}'"))?;
        let want = [
            part.row_ids(shape[0])?.len(),
            part.col_range(shape[1])?.len(),
        ];
        check_shape(name, &w.shape(), &want)?;
        Ok(w)
    }

    /// The linear weight `name` if the model has it, with this shape.
    pub fn fetch_linear_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Weight>> {
        match self.src.get_weight(name)? {
            None => Ok(None),
            Some(w) => check_shape(name, &w.shape(), shape).map(|_| Some(w)),
        }
    }

    /// Uploads a tensor in `dtype`.
    pub fn upload(&mut self, t: &HostTensor, dtype: DType) -> Result<B::Buf> {
        let buf = self.backend.upload_weight(t, dtype)?;
        let n = t.numel() as u64;
        self.stats
            .add(dtype.name().into(), n * dtype.size_in_bytes() as u64, n);
        Ok(buf)
    }

    /// Uploads a bias (a shard's part of one, say) in f32.
    pub fn upload_bias(&mut self, w: Weight) -> Result<B::Buf> {
        let (t, _) = w.into_dense()?;
        self.upload(&t, DType::F32)
    }

    /// Fetches and uploads in one go.
    pub fn weight(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<B::Buf> {
        let t = self.fetch(name, shape)?;
        self.upload(&t, dtype)
    }

    /// Uploads a linear weight (or embedding table) as `--dtype` says: `auto` keeps a block
    /// format where the backend multiplies it as it is, and a dense weight in the type it was
    /// stored in; a block format the backend cannot use becomes f32 (exact). A fixed dtype
    /// converts everything to it.
    pub fn upload_linear(&mut self, w: Weight) -> Result<B::Buf> {
        match (self.dtype, w) {
            (WeightDtype::Auto, Weight::Quant(q))
                if q.parts.iter().all(|p| self.backend.keeps_quant(p.ty)) =>
            {
                let params = (q.rows() * q.k) as u64;
                let parts: Vec<(String, u64)> = q
                    .parts
                    .iter()
                    .map(|p| (p.ty.to_string(), p.data.len() as u64))
                    .collect();
                let buf = self.backend.upload_quant(q)?;
                for (i, (ty, bytes)) in parts.into_iter().enumerate() {
                    // NOTE: the parameters are counted once, with the first part.
                    self.stats.add(ty, bytes, if i == 0 { params } else { 0 });
                }
                Ok(buf)
            }
            (WeightDtype::Auto, w) => {
                if let Weight::Quant(q) = &w {
                    self.note_dequantized(q);
                }
                let (t, stored) = w.into_dense()?;
                self.upload(&t, stored)
            }
            (WeightDtype::Fixed(dt), w) => {
                let (t, _) = w.into_dense()?;
                self.upload(&t, dt)
            }
        }
    }

    /// Says once per type which of `q`'s block types are dequantized to f32 at load (the
    /// backend has no kernel for them), and what that costs.
    fn note_dequantized(&mut self, q: &QuantTensor) {
        for p in &q.parts {
            if !self.backend.keeps_quant(p.ty) && self.dequantized.insert(p.ty) {
                let (values, bytes) = p.ty.block_layout();
                let name = self.backend.name();
                tracing::info!(
                    "{} weights have no kernel on the {} backend: dequantized to f32 at load (4 \
                     bytes a value instead of {:.2})",
                    p.ty,
                    name.split([':', ' ']).next().unwrap_or(&name),
                    bytes as f64 / values as f64
                );
            }
        }
    }

    /// Fetches and uploads a linear weight in one go.
    pub fn linear(&mut self, name: &str, shape: &[usize]) -> Result<B::Buf> {
        let w = self.fetch_linear(name, shape)?;
        self.upload_linear(w)
    }
}

/// The rows of a fused QKV projection of `h` heads of `d` rows each (Q, K and V alike) in our
/// order `[q | k | v]`: for each of ours, the checkpoint's row. `per_head`: the checkpoint
/// holds q, k, v of head 0, then of head 1, ... (GPT-NeoX, GPT-BigCode without multi-query);
/// else `[q | k | v]` already. `qk_order`: each Q and K head's rows reordered so (RoPE's
/// order, `rope::head_order`).
pub fn qkv_rows(h: usize, d: usize, per_head: bool, qk_order: Option<&[usize]>) -> Vec<usize> {
    (0..3 * h)
        .flat_map(|dst| {
            let (part, head) = (dst / h, dst % h);
            let src = if per_head { head * 3 + part } else { dst };
            let order = qk_order.filter(|_| part < 2);
            (0..d).map(move |j| src * d + order.map_or(j, |o| o[j]))
        })
        .collect()
}

/// Concatenates tensors along their first dimension (fused projections).
pub fn stack(parts: Vec<HostTensor>) -> HostTensor {
    let mut shape = parts[0].shape.clone();
    shape[0] = parts.iter().map(|p| p.shape[0]).sum();
    let data = parts.into_iter().flat_map(|p| p.data).collect();
    HostTensor::new(shape, data)
}

/// The two norms the families use.
pub enum Norm<B: Backend> {
    /// RMSNorm: `[dim]` weight (f32).
    Rms(B::Buf),
    /// LayerNorm with bias: `[dim]` weight and bias (f32).
    Layer(B::Buf, B::Buf),
}

impl<B: Backend> Norm<B> {
    pub fn apply(
        &self,
        backend: &B,
        x: &B::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut B::Buf,
    ) -> Result<()> {
        match self {
            Norm::Rms(w) => backend.rms_norm(x, w, rows, dim, eps, out),
            Norm::Layer(w, b) => backend.layer_norm(x, w, b, rows, dim, eps, out),
        }
    }
}

/// Refuses a batch with a position beyond what the model's tables hold.
pub fn check_positions(positions: &[u32], max_positions: usize) -> Result<()> {
    if let Some(&p) = positions.iter().max()
        && p as usize >= max_positions
    {
        bail!("position {p} is beyond the maximum model length {max_positions}");
    }
    Ok(())
}

/// Layer `l`'s attention: RoPE on q and k where the model has it (`rope`: the cos and sin
/// tables), this step's K and V (from the fused QKV rows `qkv`) written at the batch's slots
/// (one op with the RoPE), then every query row attending through the block tables. `out` is
/// `[T, H D]`.
#[allow(clippy::too_many_arguments)]
pub fn attend<B: Backend>(
    backend: &B,
    kv: &mut KvCache<B>,
    l: usize,
    qkv: &mut B::Buf,
    rope: Option<(&B::Buf, &B::Buf)>,
    batch: &DeviceBatch<B>,
    ql: QkvLayout,
    opts: AttentionOptions,
    out: &mut B::Buf,
) -> Result<()> {
    let layout = kv.layouts[l];
    let t = batch.host.num_tokens();
    let (k, v) = (&mut kv.k[l], &mut kv.v[l]);
    match rope {
        Some((cos, sin)) => backend.rope_write_kv(
            qkv,
            &batch.positions,
            cos,
            sin,
            &batch.slot_mapping,
            t,
            ql,
            k,
            v,
            layout,
        )?,
        None => backend.write_kv(qkv, &batch.slot_mapping, t, ql, k, v, layout)?,
    }
    backend.paged_attention(qkv, &kv.k[l], &kv.v[l], batch, ql, layout, opts, out)
}

/// The rows `batch.logits_rows` of the residual stream `x` `[T, hidden]` through the final
/// norm: `[R, hidden]`, what the head reads (and an embedding model's output).
pub fn final_rows<B: Backend>(
    backend: &B,
    cfg: &ModelConfig,
    x: &B::Buf,
    batch: &DeviceBatch<B>,
    norm: &Norm<B>,
) -> Result<B::Buf> {
    let (r, hid) = (batch.host.logits_rows.len(), cfg.hidden_size);
    let mut xs = backend.alloc_scratch_f32(r * hid)?; // [R, hidden]
    backend.gather_rows(x, &batch.logits_rows, hid, &mut xs)?;
    let mut xn = backend.alloc_scratch_f32(r * hid)?;
    norm.apply(backend, &xs, r, hid, cfg.rms_norm_eps as f32, &mut xn)?;
    Ok(xn)
}

/// The logits `[R, vocab]` of the rows in `batch.logits_rows`: only those rows of the residual
/// stream `x` `[T, hidden]` go through the final norm ([`final_rows`]) and the head
/// `[vocab, hidden]`; an LM head's (`lm`) are scaled and soft-capped where the config says.
/// `vocab`: the head's rows (a shard's, under tensor parallelism; the labels of a classifier);
/// `head`: its weights `[vocab, hidden]` and bias `[vocab]` where it has one.
#[allow(clippy::too_many_arguments)]
pub fn final_logits<B: Backend>(
    backend: &B,
    cfg: &ModelConfig,
    x: &B::Buf,
    batch: &DeviceBatch<B>,
    norm: &Norm<B>,
    (head, bias): (&B::Buf, Option<&B::Buf>),
    vocab: usize,
    lm: bool,
) -> Result<B::Buf> {
    let (r, hid) = (batch.host.logits_rows.len(), cfg.hidden_size);
    let xn = final_rows(backend, cfg, x, batch, norm)?;
    let mut logits = backend.alloc_scratch_f32(r * vocab)?; // [R, vocab]
    backend.matmul(&xn, head, bias, r, hid, vocab, &mut logits)?;
    if let Some(s) = cfg.logit_scale.filter(|_| lm) {
        backend.scale(&mut logits, s as f32, r * vocab)?;
    }
    if let Some(cap) = cfg.final_logit_softcap.filter(|_| lm) {
        backend.softcap(&mut logits, cap as f32, r * vocab)?;
    }
    Ok(logits)
}
