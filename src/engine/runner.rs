//! Binds a model to a backend: picks the backend, uploads the weights, sizes and allocates the
//! paged KV pool, and runs one flattened batch per step. Everything behind the object-safe
//! [`ModelRunner`] trait, so the engine above it is not generic.

use crate::backend::{Backend, BackendKind, BatchInput, DeviceBatch};
use crate::models::kv_cache::{self, KvCache, KvCacheDtype, LayerKvSpec};
use crate::models::lora::LoraAdapter;
use crate::models::pooling::OutputHead;
use crate::models::{CausalLm, LoadedModel, registry};
use crate::parallel::{NodeConfig, ParallelConfig};
use crate::sampling::{Choice, RowSampling};
use crate::tensor::WeightStats;
use crate::tensor::{DType, WeightDtype};
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

/// A worker's part of the logits: on the last pipeline stage `[R, row_len]` covering `range`
/// of the vocabulary, `(range, row_len, values)`; before it nothing.
pub use crate::parallel::tcp::LogitsPart;

pub trait ModelRunner: Send {
    fn backend_name(&self) -> String;
    /// The backend's default token budget per step.
    fn default_token_budget(&self) -> usize;
    fn num_blocks(&self) -> usize;
    /// What the weights take, as counted while loading.
    fn weight_stats(&self) -> &WeightStats;
    fn kv_bytes(&self) -> u64;
    /// Element type of the KV pool (`--kv-cache-dtype` resolved).
    fn kv_dtype(&self) -> DType;
    /// Runs the batch: writes its K/V into the pool, then for each row in `logits_rows` either
    /// chooses (or scores) its token where the logits are (a [`RowSampling`] in `sampling`; on
    /// a GPU only the token and the asked log-probabilities come back) or brings its logits to
    /// the host (`None`). Rows with edits, log-probabilities or a random draw only where
    /// [`Self::samples_on_device`]; plain greedy rows everywhere.
    fn execute(
        &mut self,
        input: BatchInput,
        sampling: &[Option<RowSampling>],
    ) -> Result<StepResult>;
    /// Whether [`Self::execute`] applies edits, draws random samples and computes
    /// log-probabilities (not only plain greedy rows).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Loads a LoRA adapter's factors into `slot`, or with `None` unloads it; the bytes they
    /// take on the device.
    fn set_lora(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        let _ = (slot, adapter);
        bail!("LoRA adapters with tensor or pipeline parallelism are not supported yet")
    }
    /// Copies KV blocks of every layer to host blocks (`out`: device, host), then host blocks
    /// to device blocks (`inn`: host, device): swap preemption's transfers for one step.
    fn swap_blocks(&mut self, out: &[(u32, u32)], inn: &[(u32, u32)]) -> Result<()>;
    /// How the model is split over workers (1 and 1: one device).
    fn parallel(&self) -> ParallelConfig {
        ParallelConfig::default()
    }
    /// How many steps may be in flight at once ([`Self::start`]): the pipeline's stages; 1
    /// where steps run one at a time.
    fn max_in_flight(&self) -> usize {
        1
    }
    /// Starts a step and returns without waiting for it (where [`Self::max_in_flight`] is
    /// more than 1): [`Self::finish`] returns the results of the steps started, oldest first,
    /// as `execute` would.
    fn start(&mut self, input: BatchInput, sampling: Vec<Option<RowSampling>>) -> Result<()> {
        let _ = (input, sampling);
        bail!("this runner runs one step at a time")
    }
    /// Waits for the oldest step started and returns its results. After an error every step
    /// in flight is dropped.
    fn finish(&mut self) -> Result<StepResult> {
        bail!("this runner runs one step at a time")
    }
}

/// What a step brings back to the host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepResult {
    /// Per logits row: the token chosen (or scored) where the logits are, or `None` for a row
    /// whose logits came back.
    pub choices: Vec<Option<Choice>>,
    /// The logits `[rows without a token, vocab]`, in row order.
    pub logits: Vec<f32>,
}

impl StepResult {
    /// The logits of the rows without a token, and the plain greedy ones' argmax, from the
    /// logits of every row `[R, vocab]` already on the host. Other rows are refused: sampling
    /// them is the engine's (this runner's `samples_on_device` is false).
    pub fn from_host(
        logits: Vec<f32>,
        vocab: usize,
        sampling: &[Option<RowSampling>],
    ) -> Result<Self> {
        anyhow::ensure!(
            logits.len() == sampling.len() * vocab,
            "{} logits for {} rows of {vocab}",
            logits.len(),
            sampling.len()
        );
        if sampling.iter().all(Option::is_none) {
            let choices = vec![None; sampling.len()];
            return Ok(StepResult { choices, logits });
        }
        let mut out = StepResult::default();
        for (row, s) in logits.chunks_exact(vocab.max(1)).zip(sampling) {
            out.choices.push(match s {
                None => {
                    out.logits.extend_from_slice(row);
                    None
                }
                Some(s) => {
                    anyhow::ensure!(
                        s.is_plain_greedy(),
                        "this runner samples on the host: only plain greedy rows are reduced here"
                    );
                    Some(Choice::token(crate::backend::argmax(row) as u32))
                }
            });
        }
        Ok(out)
    }
}

/// [`ModelRunner::execute`]'s reduction on one backend: the rows with a [`RowSampling`]
/// sampled where the logits are `[R, vocab]`, the others' logits gathered and downloaded.
fn reduce_logits<B: Backend>(
    b: &B,
    logits: &mut B::Buf,
    vocab: usize,
    sampling: &[Option<RowSampling>],
) -> Result<StepResult> {
    let host: Vec<u32> = (0..sampling.len() as u32)
        .filter(|&i| sampling[i as usize].is_none())
        .collect();
    let choices = if host.len() == sampling.len() {
        vec![None; sampling.len()]
    } else {
        // NOTE: the rows whose logits come back are reduced too (as greedy, one cheap pass)
        // rather than gathered out first; they have no edits, so their logits are unchanged.
        let rows: Vec<RowSampling> = sampling
            .iter()
            .map(|s| s.clone().unwrap_or(RowSampling::GREEDY))
            .collect();
        let c = b.sample_rows(logits, vocab, &rows)?;
        sampling
            .iter()
            .zip(c)
            .map(|(s, c)| s.as_ref().map(|_| c))
            .collect()
    };
    let logits = if host.is_empty() {
        Vec::new()
    } else if host.len() == sampling.len() {
        b.download_f32(logits)?
    } else {
        let idx = b.upload_u32(&host)?;
        let mut out = b.alloc_f32(host.len() * vocab)?;
        b.gather_rows(logits, &idx, vocab, &mut out)?;
        b.download_f32(&out)?
    };
    Ok(StepResult { choices, logits })
}

pub(super) struct Runner<B: Backend> {
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
    fn default_token_budget(&self) -> usize {
        self.backend.default_token_budget()
    }
    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }
    fn weight_stats(&self) -> &WeightStats {
        self.model.weight_stats()
    }
    fn kv_bytes(&self) -> u64 {
        self.kv_bytes
    }
    fn kv_dtype(&self) -> DType {
        self.kv.layouts.first().map_or(DType::F32, |l| l.dtype)
    }
    fn execute(
        &mut self,
        input: BatchInput,
        sampling: &[Option<RowSampling>],
    ) -> Result<StepResult> {
        anyhow::ensure!(
            sampling.len() == input.logits_rows.len(),
            "{} sampling entries for {} logits rows",
            sampling.len(),
            input.logits_rows.len()
        );
        let batch = DeviceBatch::upload(&self.backend, input)?;
        let (model, backend, kv) = (&self.model, &self.backend, &mut self.kv);
        let mut logits = backend.run_step(|| model.forward(backend, &batch, kv))?;
        // NOTE: an embedding model's or a classifier's rows are as long as its head's.
        let width = model
            .logits_shard()
            .map_or(model.config().vocab_size, |(_, w)| w);
        reduce_logits(backend, &mut logits, width, sampling)
    }
    fn samples_on_device(&self) -> bool {
        self.backend.samples_on_device()
    }
    fn set_lora(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        self.model.set_lora(&self.backend, slot, adapter)
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

/// A `/proc/meminfo` field in bytes (`MemTotal`, `MemAvailable`); `None` off Linux.
fn meminfo_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

fn system_memory_bytes() -> Option<u64> {
    meminfo_bytes("MemTotal")
}

/// Memory the weights may take, where the backend or the system says: free device memory on a
/// GPU (its total where only that is known), `MemAvailable` for host memory (the CPU, software
/// adapters).
fn memory_for_weights<B: Backend>(backend: &B) -> Option<(u64, &'static str)> {
    match (backend.free_device_memory(), backend.device_memory()) {
        (Some(free), _) => Some((free, "free device memory")),
        (None, Some(total)) => Some((total, "device memory")),
        (None, None) => {
            meminfo_bytes("MemAvailable").map(|a| (a, "available memory (MemAvailable)"))
        }
    }
}

/// Refuses to load weights of `need` bytes where less memory is available, instead of trying
/// (an allocation that fails aborts the process, and the system may swap or kill first).
/// `as_f32`: the weights would be f32 (where `--dtype bf16` halves them).
fn check_weights_fit(
    need: u64,
    available: Option<(u64, &str)>,
    dtype: &str,
    as_f32: bool,
) -> Result<()> {
    if let Some((avail, what)) = available
        && need > avail
    {
        bail!(
            "the weights need {} MiB as {dtype} but only {} MiB of {what} are left: not loading them{}",
            need.div_ceil(1 << 20),
            avail >> 20,
            if as_f32 {
                " (--dtype bf16 halves them)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// The most bytes the KV pool could be given, known before the weights are loaded: the budget
/// itself, or the fraction of the whole device or system memory it is a part of. `None` where
/// the memory is unknown (the budget fails later with its own error).
fn kv_budget_upper_bound<B: Backend>(backend: &B, budget: Option<KvBudget>) -> Option<u64> {
    match budget {
        Some(KvBudget::Bytes(b)) => Some(b),
        Some(KvBudget::Fraction(f)) => backend
            .device_memory()
            .or_else(system_memory_bytes)
            .map(|t| (t as f64 * f) as u64),
        None => match backend.device_memory() {
            Some(total) => Some((total as f64 * 0.9) as u64),
            None => Some(DEFAULT_CPU_KV_BYTES),
        },
    }
}

pub struct RunnerArgs {
    pub backend: BackendKind,
    pub dtype: WeightDtype,
    pub kv_cache_dtype: KvCacheDtype,
    pub block_size: usize,
    pub kv_budget: Option<KvBudget>,
    pub max_model_len: usize,
    /// Upper bound on useful KV blocks (max_num_seqs sequences of max_model_len tokens).
    pub max_useful_blocks: usize,
    /// Tensor and pipeline parallel sizes.
    pub parallel: ParallelConfig,
    /// The nodes the workers are spread over.
    pub nodes: NodeConfig,
    /// What the model's last stage returns (logits, or rows for embeddings and scores).
    pub head: OutputHead,
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

/// The positions the RoPE tables need: `max_model_len`, or the tokens a pool of at most
/// `upper` bytes holds (less the null block) where that is fewer.
fn rope_positions(
    upper: Option<u64>,
    per_block: u64,
    block_size: usize,
    max_model_len: usize,
) -> Result<usize> {
    let Some(upper) = upper else {
        return Ok(max_model_len);
    };
    let usable = (upper / per_block).saturating_sub(1);
    if usable == 0 {
        bail!(
            "the KV cache budget ({upper} bytes) holds no block of {block_size} tokens ({per_block} bytes each)"
        );
    }
    Ok(usize::try_from(usable)
        .ok()
        .and_then(|u| u.checked_mul(block_size))
        .map_or(max_model_len, |t| t.min(max_model_len)))
}

/// Checks made before any weight is read: the memory fraction, whether the weights fit, and
/// the positions the RoPE tables need.
pub(super) fn plan<B: Backend>(
    backend: &B,
    model: &LoadedModel,
    args: &RunnerArgs,
) -> Result<usize> {
    let cfg = &model.config;
    let bs = args.block_size;
    if let Some(KvBudget::Fraction(f)) = args.kv_budget
        && !(f > 0.0 && f <= 1.0)
    {
        bail!("memory utilization must be in (0, 1], got {f}");
    }
    // NOTE: `auto` keeps block formats only where the backend has kernels for them; elsewhere
    // they become f32, so the bound is 4 bytes per element there.
    let elements = model.weights.num_elements();
    let auto = "stored (--dtype auto)";
    let (need, label, as_f32) = match args.dtype {
        WeightDtype::Fixed(dt) => (
            elements.saturating_mul(dt.size_in_bytes() as u64),
            dt.name(),
            dt == DType::F32,
        ),
        WeightDtype::Auto if backend.supports_quant() => {
            (model.weights.stored_bytes(), auto, false)
        }
        WeightDtype::Auto => (elements.saturating_mul(4), auto, true),
    };
    check_weights_fit(need, memory_for_weights(backend), label, as_f32)
        .with_context(|| format!("loading {}", model.path.display()))?;

    // NOTE: the RoPE tables hold one row per position, so they are sized by what the engine
    // can use, not by the model's context (up to 2^24 positions): max_model_len, or fewer
    // where the KV budget holds fewer tokens. The KV spec is a function of the config, so
    // the most tokens the budget could ever hold is known before the weights are loaded.
    let per_block = kv_cache::bytes_per_block(&kv_cache::default_spec(cfg), bs)?;
    rope_positions(
        kv_budget_upper_bound(backend, args.kv_budget),
        per_block,
        bs,
        args.max_model_len,
    )
}

/// The blocks of the KV pool, once the weights (`wbytes`) are loaded: the budget over the
/// bytes of one block (`per_block`, over every layer of every worker).
pub(super) fn pool_blocks<B: Backend>(
    backend: &B,
    args: &RunnerArgs,
    wbytes: u64,
    per_block: u64,
    positions: usize,
) -> Result<usize> {
    let bs = args.block_size;
    let budget = match args.kv_budget {
        Some(KvBudget::Bytes(b)) => b,
        Some(KvBudget::Fraction(f)) => {
            if let Some(b) = gpu_kv_budget(backend, f)? {
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
        None => match gpu_kv_budget(backend, 0.9)? {
            Some(b) => b,
            None => match backend.device_memory() {
                Some(total) => ((total as f64 * 0.9) as u64).saturating_sub(wbytes),
                None => DEFAULT_CPU_KV_BYTES,
            },
        },
    };
    // The pool never holds more than: the useful blocks, what u32 slot ids can address, and
    // (where the budget limited them) the positions of the RoPE tables.
    let mut num_blocks = usize::try_from(budget / per_block)
        .unwrap_or(usize::MAX)
        .min(args.max_useful_blocks.saturating_add(1))
        .min(u32::MAX as usize / bs);
    if positions < args.max_model_len {
        num_blocks = num_blocks.min(positions / bs + 1);
    }
    if num_blocks < 2 {
        bail!(
            "the KV cache budget ({budget} bytes) holds no block of {bs} tokens ({per_block} bytes each)"
        );
    }
    Ok(num_blocks)
}

impl<B: Backend> Runner<B> {
    /// One worker's part of a step (tensor and pipeline parallelism): its logits part on the
    /// last stage, nothing before it.
    pub(super) fn execute_part(&mut self, input: BatchInput) -> Result<LogitsPart> {
        let batch = DeviceBatch::upload(&self.backend, input)?;
        // NOTE: not inside `run_step`: on the CPU that runs the step on a rayon pool thread,
        // and a worker waiting there in a collective would hold a thread that the rank it
        // waits for may need.
        let out = self.model.forward(&self.backend, &batch, &mut self.kv)?;
        match self.model.logits_shard() {
            Some((range, cols)) => Ok(Some((range, cols, self.backend.download_f32(&out)?))),
            None => Ok(None),
        }
    }

    /// A runner over a loaded model (or one worker's shard of it) and a pool of `num_blocks`
    /// laid out as `spec` ([`kv_spec`]).
    pub(super) fn new(
        backend: B,
        model: Box<dyn CausalLm<B>>,
        spec: &[LayerKvSpec],
        num_blocks: usize,
        bs: usize,
    ) -> Result<Self> {
        let per_block = kv_cache::bytes_per_block(spec, bs)?;
        let kv = KvCache::new(&backend, spec, num_blocks, bs)
            .with_context(|| format!("allocating a KV pool of {num_blocks} blocks"))?;
        Ok(Runner {
            backend,
            model,
            host: (0..kv.layouts.len())
                .map(|_| [Vec::new(), Vec::new()])
                .collect(),
            kv,
            kv_bytes: num_blocks as u64 * per_block,
        })
    }
}

pub(super) fn build<B: Backend>(
    backend: B,
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    let positions = plan(&backend, model, args)?;
    let lm = registry::load(
        &backend,
        &model.config,
        model.weights.as_ref(),
        args.dtype,
        positions,
        &args.head,
        progress,
    )
    .with_context(|| format!("loading {}", model.path.display()))?;
    let spec = kv_spec(&backend, lm.as_ref(), args.kv_cache_dtype)?;
    let per_block = kv_cache::bytes_per_block(&spec, args.block_size)?;
    let wbytes = lm.weight_stats().bytes;
    let num_blocks = pool_blocks(&backend, args, wbytes, per_block, positions)?;
    Ok(Box::new(Runner::new(
        backend,
        lm,
        &spec,
        num_blocks,
        args.block_size,
    )?))
}

/// What a runner's KV pool holds per layer: the model's spec in the element type
/// `--kv-cache-dtype` resolves to on this backend.
pub(super) fn kv_spec<B: Backend>(
    backend: &B,
    lm: &dyn CausalLm<B>,
    want: KvCacheDtype,
) -> Result<Vec<LayerKvSpec>> {
    let dtype = want.resolve(
        backend.kv_cache_dtypes(),
        lm.weight_stats(),
        &backend.name(),
    )?;
    Ok(kv_cache::in_dtype(lm.kv_spec(), dtype))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_larger_than_the_memory_left_are_refused() {
        let gib = 1u64 << 30;
        check_weights_fit(4 * gib, Some((5 * gib, "x")), "f32", true).unwrap();
        check_weights_fit(4 * gib, None, "f32", true).unwrap();
        let e = check_weights_fit(
            6 * gib,
            Some((5 * gib, "available memory (MemAvailable)")),
            "f32",
            true,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "the weights need 6144 MiB as f32 but only 5120 MiB of available memory \
             (MemAvailable) are left: not loading them (--dtype bf16 halves them)"
        );
        let e = check_weights_fit(u64::MAX, Some((gib, "free device memory")), "bf16", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("of free device memory are left: not loading them"),
            "{e}"
        );
    }

    #[test]
    fn rope_tables_are_sized_by_what_the_pool_can_hold() {
        // 10 blocks of 16 tokens at 1000 bytes each: 9 usable, 144 positions
        assert_eq!(
            rope_positions(Some(10_000), 1000, 16, 1 << 24).unwrap(),
            144
        );
        assert_eq!(rope_positions(Some(10_999), 1000, 16, 100).unwrap(), 100);
        assert_eq!(rope_positions(None, 1000, 16, 1 << 24).unwrap(), 1 << 24);
        assert_eq!(
            rope_positions(Some(u64::MAX), 1, usize::MAX, 4096).unwrap(),
            4096
        );
        let e = rope_positions(Some(1999), 1000, 16, 4096).unwrap_err();
        assert!(e.to_string().contains("holds no block of 16 tokens"), "{e}");
    }

    #[test]
    fn meminfo_is_read_where_there_is_one() {
        if std::path::Path::new("/proc/meminfo").exists() {
            let (total, avail) = (
                system_memory_bytes().unwrap(),
                meminfo_bytes("MemAvailable").unwrap(),
            );
            assert!(avail > 0 && avail <= total, "{avail} of {total}");
        }
        assert_eq!(meminfo_bytes("NoSuchField"), None);
    }
}
