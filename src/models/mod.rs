//! Models: configuration, weight loading (HF safetensors directories and GGUF files), the
//! tokenizer with its chat template, the registry of families, and one file per family.

pub mod config;
pub mod falcon;
pub mod gemma3;
pub mod gguf;
pub mod gpt2;
pub mod kv_cache;
pub mod llama;
pub mod loader;
pub mod phi3;
pub mod registry;
pub mod rope;
pub mod spm;
pub mod tokenizer;

pub use config::ModelConfig;
pub use kv_cache::{KvCache, LayerKvSpec};
pub use loader::{LoadedModel, WeightSource, load_model};
pub use registry::Arch;

use crate::backend::{AttentionOptions, Backend, DeviceBatch, QkvLayout};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail};

/// A causal language model on a backend: what the runner needs of every family.
pub trait CausalLm<B: Backend>: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// What each layer keeps in the KV cache, in layer order: by default every layer's KV
    /// heads in f32, with the layer's window.
    fn kv_spec(&self) -> Vec<LayerKvSpec> {
        kv_cache::default_spec(self.config())
    }

    /// Runs every layer over the whole flattened batch (writing each row's K/V into `kv`) and
    /// returns the logits of the rows in `batch.logits_rows`, as a device buffer `[R, vocab]`.
    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf>;

    /// Bytes of weights uploaded, as measured while loading.
    fn weight_bytes(&self) -> u64;

    /// Parameters uploaded (elements of every weight, norm and bias).
    fn num_params(&self) -> u64;
}

/// Fetches tensors by HF name, checks their shapes and uploads them, counting what it uploads.
pub struct Uploader<'a, B: Backend> {
    pub backend: &'a B,
    src: &'a dyn WeightSource,
    /// Bytes uploaded so far.
    pub bytes: u64,
    /// Elements uploaded so far.
    pub params: u64,
}

impl<'a, B: Backend> Uploader<'a, B> {
    pub fn new(backend: &'a B, src: &'a dyn WeightSource) -> Self {
        Uploader {
            backend,
            src,
            bytes: 0,
            params: 0,
        }
    }

    /// The tensor `name`, which must exist and have this shape.
    pub fn fetch(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self
            .src
            .get(name)?
            .with_context(|| format!("the model has no tensor '{name}'"))?;
        if t.shape != shape {
            bail!(
                "tensor '{name}' has shape {:?} but the config implies {:?}",
                t.shape,
                shape
            );
        }
        Ok(t)
    }

    /// The tensor `name` if the model has it, with this shape.
    pub fn fetch_opt(&self, name: &str, shape: &[usize]) -> Result<Option<HostTensor>> {
        match self.src.get(name)? {
            None => Ok(None),
            Some(t) if t.shape == shape => Ok(Some(t)),
            Some(t) => bail!(
                "tensor '{name}' has shape {:?} but the config implies {:?}",
                t.shape,
                shape
            ),
        }
    }

    /// Uploads a tensor in `dtype`.
    pub fn upload(&mut self, t: &HostTensor, dtype: DType) -> Result<B::Buf> {
        let buf = self.backend.upload_weight(t, dtype)?;
        self.bytes += (t.numel() * dtype.size_in_bytes()) as u64;
        self.params += t.numel() as u64;
        Ok(buf)
    }

    /// Fetches and uploads in one go.
    pub fn weight(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<B::Buf> {
        let t = self.fetch(name, shape)?;
        self.upload(&t, dtype)
    }
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

/// Layer `l`'s attention: this step's K and V (from the fused QKV rows `qkv`) written at the
/// batch's slots, then every query row attending through the block tables. `out` is
/// `[T, H D]`.
#[allow(clippy::too_many_arguments)]
pub fn attend<B: Backend>(
    backend: &B,
    kv: &mut KvCache<B>,
    l: usize,
    qkv: &B::Buf,
    batch: &DeviceBatch<B>,
    ql: QkvLayout,
    opts: AttentionOptions,
    out: &mut B::Buf,
) -> Result<()> {
    let layout = kv.layouts[l];
    let t = batch.host.num_tokens();
    backend.write_kv(
        qkv,
        &batch.slot_mapping,
        t,
        ql,
        &mut kv.k[l],
        &mut kv.v[l],
        layout,
    )?;
    backend.paged_attention(qkv, &kv.k[l], &kv.v[l], batch, ql, layout, opts, out)
}

/// The logits `[R, vocab]` of the rows in `batch.logits_rows`: only those rows of the residual
/// stream `x` `[T, hidden]` go through the final norm and the head (soft-capped where the
/// config says).
pub fn final_logits<B: Backend>(
    backend: &B,
    cfg: &ModelConfig,
    x: &B::Buf,
    batch: &DeviceBatch<B>,
    norm: &Norm<B>,
    head: &B::Buf,
) -> Result<B::Buf> {
    let (r, hid, vocab) = (
        batch.host.logits_rows.len(),
        cfg.hidden_size,
        cfg.vocab_size,
    );
    let mut xs = backend.alloc_f32(r * hid)?; // [R, hidden]
    backend.gather_rows(x, &batch.logits_rows, hid, &mut xs)?;
    let mut xn = backend.alloc_f32(r * hid)?;
    norm.apply(backend, &xs, r, hid, cfg.rms_norm_eps as f32, &mut xn)?;
    let mut logits = backend.alloc_f32(r * vocab)?; // [R, vocab]
    backend.matmul(&xn, head, None, r, hid, vocab, &mut logits)?;
    if let Some(cap) = cfg.final_logit_softcap {
        backend.softcap(&mut logits, cap as f32, r * vocab)?;
    }
    Ok(logits)
}
