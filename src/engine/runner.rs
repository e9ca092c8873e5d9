//! Binds a model to a backend: picks the backend, uploads the weights, sizes and allocates the
//! paged KV pool, and runs one flattened batch per step. Everything behind the object-safe
//! [`ModelRunner`] trait, so the engine above it is not generic.

use crate::backend::{
    Backend, BackendKind, BatchInput, CpuBackend, CudaBackend, DeviceBatch, HipBackend, WgpuBackend,
};
use crate::models::kv_cache::{self, KvCache};
use crate::models::{CausalLm, LoadedModel, registry};
use crate::tensor::DType;
use anyhow::{Context, Result, bail};

/// How much memory the KV pool may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// Exactly this many bytes (`--kv-cache-memory`).
    Bytes(u64),
    /// This fraction of the device's memory (or, on CPU, of the system's memory) less the
    /// weights (`--memory-utilization`, vLLM's `--gpu-memory-utilization`).
    Fraction(f64),
}

/// Default KV budget on the CPU backend, as vLLM's CPU backend does (`VLLM_CPU_KVCACHE_SPACE`).
pub const DEFAULT_CPU_KV_BYTES: u64 = 4 << 30;

pub trait ModelRunner: Send {
    fn backend_name(&self) -> String;
    fn num_blocks(&self) -> usize;
    fn weight_bytes(&self) -> u64;
    /// Parameters uploaded, as counted while loading.
    fn num_params(&self) -> u64;
    fn kv_bytes(&self) -> u64;
    /// Runs the batch: writes its K/V into the pool and returns the logits `[R, vocab]` of the
    /// rows in `logits_rows`, on the host.
    fn execute(&mut self, input: BatchInput) -> Result<Vec<f32>>;
    /// Runs the batch like [`Self::execute`] but returns the argmax token of each row in
    /// `logits_rows` (greedy requests): on a GPU only the token ids come back.
    fn execute_greedy(&mut self, input: BatchInput) -> Result<Vec<u32>>;
    /// Copies KV blocks of every layer to host blocks (`out`: device, host), then host blocks
    /// to device blocks (`inn`: host, device): swap preemption's transfers for one step.
    fn swap_blocks(&mut self, out: &[(u32, u32)], inn: &[(u32, u32)]) -> Result<()>;
}

struct Runner<B: Backend> {
    backend: B,
    model: Box<dyn CausalLm<B>>,
    kv: KvCache<B>,
    kv_bytes: u64,
    /// Host blocks of swapped-out requests: per layer, K then V, `block_len` values per block,
    /// grown as host blocks are first used.
    host: Vec<[Vec<f32>; 2]>,
}

impl<B: Backend> ModelRunner for Runner<B> {
    fn backend_name(&self) -> String {
        self.backend.name()
    }
    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }
    fn weight_bytes(&self) -> u64 {
        self.model.weight_bytes()
    }
    fn num_params(&self) -> u64 {
        self.model.num_params()
    }
    fn kv_bytes(&self) -> u64 {
        self.kv_bytes
    }
    fn execute(&mut self, input: BatchInput) -> Result<Vec<f32>> {
        let batch = DeviceBatch::upload(&self.backend, input)?;
        let logits = self.model.forward(&self.backend, &batch, &mut self.kv)?;
        self.backend.download_f32(&logits)
    }
    fn execute_greedy(&mut self, input: BatchInput) -> Result<Vec<u32>> {
        let rows = input.logits_rows.len();
        let batch = DeviceBatch::upload(&self.backend, input)?;
        let logits = self.model.forward(&self.backend, &batch, &mut self.kv)?;
        self.backend
            .argmax_rows(&logits, rows, self.model.config().vocab_size)
    }
    fn swap_blocks(&mut self, out: &[(u32, u32)], inn: &[(u32, u32)]) -> Result<()> {
        let (b, kv) = (&self.backend, &mut self.kv);
        let dev_out: Vec<u32> = out.iter().map(|p| p.0).collect();
        let dev_in: Vec<u32> = inn.iter().map(|p| p.1).collect();
        for (l, layout) in kv.layouts.iter().enumerate() {
            let bl = layout.block_len();
            for (half, cache) in [&mut kv.k[l], &mut kv.v[l]].into_iter().enumerate() {
                let host = &mut self.host[l][half];
                if !out.is_empty() {
                    let data = b.read_kv_blocks(cache, bl, &dev_out)?;
                    for (&(_, h), block) in out.iter().zip(data.chunks_exact(bl)) {
                        let at = h as usize * bl;
                        if host.len() < at + bl {
                            host.resize(at + bl, 0.0);
                        }
                        host[at..at + bl].copy_from_slice(block);
                    }
                }
                if !inn.is_empty() {
                    let mut data = Vec::with_capacity(inn.len() * bl);
                    for &(h, _) in inn {
                        let at = h as usize * bl;
                        let block = host
                            .get(at..at + bl)
                            .context("swap-in of a host block that was never written")?;
                        data.extend_from_slice(block);
                    }
                    b.write_kv_blocks(cache, bl, &dev_in, &data)?;
                }
            }
        }
        Ok(())
    }
}

fn system_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub struct RunnerArgs {
    pub backend: BackendKind,
    pub dtype: DType,
    pub block_size: usize,
    pub kv_budget: Option<KvBudget>,
    pub max_model_len: usize,
    /// Upper bound on useful KV blocks (max_num_seqs sequences of max_model_len tokens).
    pub max_useful_blocks: usize,
}

pub fn create_runner(
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    match args.backend {
        BackendKind::Cpu => build(CpuBackend::new(), model, args, progress),
        BackendKind::Auto => {
            // NOTE: CUDA, then HIP, then wgpu on a real GPU (never a software rasteriser), then
            // the CPU; each one passed over is logged with its reason.
            match CudaBackend::new() {
                Ok(b) => return build(b, model, args, progress),
                Err(e) => tracing::info!("backend auto: cuda unavailable: {e:#}"),
            }
            match HipBackend::new() {
                Ok(b) => return build(b, model, args, progress),
                Err(e) => tracing::info!("backend auto: hip unavailable: {e:#}"),
            }
            match WgpuBackend::new_hardware() {
                Ok(b) => {
                    tracing::info!("backend auto: using {} (a real GPU)", b.name());
                    return build(b, model, args, progress);
                }
                Err(e) => tracing::info!("backend auto: wgpu unavailable: {e:#}"),
            }
            tracing::info!("backend auto: using cpu");
            build(CpuBackend::new(), model, args, progress)
        }
        BackendKind::Cuda => build(CudaBackend::new()?, model, args, progress),
        BackendKind::Hip => build(HipBackend::new()?, model, args, progress),
        BackendKind::Wgpu => build(WgpuBackend::new()?, model, args, progress),
    }
}

/// The KV budget on a device with its own memory, measured after the weights are loaded, as
/// vLLM's `--gpu-memory-utilization` does: `fraction × total − (total − free now)`, less a
/// reserve for the step's activations. Everything in use — the weights, the context, other
/// processes — counts against the fraction. `None` where the backend reports no free memory.
fn gpu_kv_budget<B: Backend>(backend: &B, fraction: f64) -> Result<Option<u64>> {
    let (Some(total), Some(free)) = (backend.device_memory(), backend.free_device_memory()) else {
        return Ok(None);
    };
    const ACTIVATION_RESERVE: u64 = 1 << 30;
    let used = total.saturating_sub(free);
    let allowed = (total as f64 * fraction) as u64;
    let budget = allowed
        .checked_sub(used + ACTIVATION_RESERVE)
        .with_context(|| {
            format!(
                "{fraction} of the device's {} MiB leaves no room for a KV cache: {} MiB are in use (weights included) and {} MiB are kept for activations",
                total >> 20,
                used >> 20,
                ACTIVATION_RESERVE >> 20
            )
        })?;
    tracing::info!(
        "KV budget: {fraction} x {} MiB of device memory - {} MiB in use after loading the weights - {} MiB for activations = {} MiB",
        total >> 20,
        used >> 20,
        ACTIVATION_RESERVE >> 20,
        budget >> 20
    );
    Ok(Some(budget))
}

fn build<B: Backend>(
    backend: B,
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    let lm = registry::load(
        &backend,
        &model.config,
        model.weights.as_ref(),
        args.dtype,
        args.max_model_len,
        progress,
    )
    .with_context(|| format!("loading {}", model.path.display()))?;
    let wbytes = lm.weight_bytes();
    let spec = lm.kv_spec();
    let per_block = kv_cache::bytes_per_block(&spec, args.block_size) as u64;
    let budget = match args.kv_budget {
        Some(KvBudget::Bytes(b)) => b,
        Some(KvBudget::Fraction(f)) => {
            if !(f > 0.0 && f <= 1.0) {
                bail!("memory utilization must be in (0, 1], got {f}");
            }
            if let Some(b) = gpu_kv_budget(&backend, f)? {
                b
            } else {
                let total = backend
                    .device_memory()
                    .or_else(system_memory_bytes)
                    .context(
                        "cannot tell how much memory this device has; pass --kv-cache-memory",
                    )?;
                ((total as f64 * f) as u64)
                    .checked_sub(wbytes)
                    .with_context(|| {
                        format!(
                            "the weights ({} MiB) leave no room for a KV cache in {f} of the memory",
                            wbytes >> 20
                        )
                    })?
            }
        }
        None => match gpu_kv_budget(&backend, 0.9)? {
            Some(b) => b,
            None => match backend.device_memory() {
                Some(total) => ((total as f64 * 0.9) as u64).saturating_sub(wbytes),
                None => DEFAULT_CPU_KV_BYTES,
            },
        },
    };
    let num_blocks = ((budget / per_block) as usize).min(args.max_useful_blocks + 1);
    if num_blocks < 2 {
        bail!(
            "the KV cache budget ({budget} bytes) holds no block of {} tokens ({per_block} bytes each)",
            args.block_size
        );
    }
    let kv = KvCache::new(&backend, &spec, num_blocks, args.block_size)
        .with_context(|| format!("allocating a KV pool of {num_blocks} blocks"))?;
    Ok(Box::new(Runner {
        backend,
        model: lm,
        host: (0..kv.layouts.len())
            .map(|_| [Vec::new(), Vec::new()])
            .collect(),
        kv,
        kv_bytes: num_blocks as u64 * per_block,
    }))
}
