//! The backend trait: device memory, the paged KV cache, attention over block tables, and the
//! dense operations of a transformer. Model code is written once over it (see `models/llama.rs`)
//! and never sees a `#[cfg]`: backends whose Cargo feature is off are stubs with the same API
//! that say so.
//!
//! Conventions for every op:
//! - activations are f32, row-major; a "row" is one token of the flattened batch;
//! - weights are uploaded once in the `--dtype` chosen (f32, f16 or bf16, or a GGML block format
//!   where the backend `supports_quant`), math accumulates in f32;
//! - a linear weight is `[out_features, in_features]` (PyTorch order), so `matmul` computes
//!   `y = x · Wᵀ (+ b)`;
//! - index buffers (token ids, positions, slots, block tables) are u32.

pub mod args;
pub mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gpu;
#[cfg(feature = "hip")]
pub mod hip;
mod stubs;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use crate::quant::{GgmlType, QuantTensor};
use crate::sampling::{Choice, RowSampling};
use crate::tensor::{DType, HostTensor};
use anyhow::Result;

#[cfg(feature = "wgpu")]
pub use self::wgpu::WgpuBackend;
pub use cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
pub use gpu::emu::EmuBackend;
#[cfg(feature = "hip")]
pub use hip::HipBackend;
#[cfg(not(feature = "cuda"))]
pub use stubs::CudaBackend;
#[cfg(not(feature = "hip"))]
pub use stubs::HipBackend;
#[cfg(not(feature = "wgpu"))]
pub use stubs::WgpuBackend;

/// Which backend to run on (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Wgpu,
    Cuda,
    Hip,
    /// The CUDA kernels run on the CPU by an emulator of the GPU's execution model
    /// (`gpu/emu.rs`): for checking kernels without a GPU; slow.
    Emu,
    /// The fastest compiled backend with a real device: CUDA, then HIP, then wgpu, then CPU.
    Auto,
}

impl std::str::FromStr for BackendKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "cpu" => BackendKind::Cpu,
            "wgpu" | "vulkan" | "webgpu" => BackendKind::Wgpu,
            "cuda" => BackendKind::Cuda,
            "hip" | "rocm" => BackendKind::Hip,
            "emu" => BackendKind::Emu,
            "auto" => BackendKind::Auto,
            _ => {
                anyhow::bail!("unknown backend '{s}' (expected cpu, wgpu, cuda, hip, emu or auto)")
            }
        })
    }
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Hip => "hip",
            BackendKind::Emu => "emu",
            BackendKind::Auto => "auto",
        }
    }
}

/// How attention heads are laid out in the fused QKV activation of one row:
///
/// ```text
///   row = [ q: num_heads × head_dim | k: num_kv_heads × head_dim | v: num_kv_heads × head_dim ]
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvLayout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl QkvLayout {
    pub fn row_len(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
    pub fn q_len(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// What [`Backend::qk_norm`] normalises as one, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNormSpan {
    /// RMSNorm of each head, one weight of `[head_dim]` for all (Qwen3, Gemma 3).
    Head,
    /// RMSNorm of all of q and of all of k, weights `[H head_dim]` and `[Hkv head_dim]` (OLMo 2).
    All,
    /// LayerNorm without bias of each head, each with its own weight: `[H head_dim]` and
    /// `[Hkv head_dim]`, a row per head (StableLM's `qk_layernorm`, Cohere's `use_qk_norm`).
    HeadLayer,
}

impl QkNormSpan {
    /// The spans of a row: (q spans, values in a q span, k spans, values in a k span).
    pub fn spans(self, l: QkvLayout) -> (usize, usize, usize, usize) {
        let d = l.head_dim;
        match self {
            QkNormSpan::Head | QkNormSpan::HeadLayer => (l.num_heads, d, l.num_kv_heads, d),
            QkNormSpan::All => (1, l.num_heads * d, 1, l.num_kv_heads * d),
        }
    }

    /// Whether each span has its own row of the weights (else all share one).
    pub fn own_weights(self) -> bool {
        !matches!(self, QkNormSpan::Head)
    }

    /// Whether the mean is subtracted first (LayerNorm), else RMSNorm.
    pub fn centered(self) -> bool {
        self == QkNormSpan::HeadLayer
    }

    /// The lengths of the q and k weights.
    pub fn weight_lens(self, l: QkvLayout) -> (usize, usize) {
        let (nq, qs, nk, ks) = self.spans(l);
        match self.own_weights() {
            true => (nq * qs, nk * ks),
            false => (qs, ks),
        }
    }
}

/// What a model asks of attention besides Q, K and V; a new option is a field here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies q·k: `1 / sqrt(head_dim)` for most models, `query_pre_attn_scalar^-1/2` for
    /// Gemma.
    pub scale: f32,
    /// A query at position `p` sees only the keys `p - window + 1 ..= p` (Mistral, the local
    /// layers of Gemma 3 and Phi-3); `None`: every key `0 ..= p`.
    pub sliding_window: Option<usize>,
    /// Scores become `cap · tanh(score / cap)` before the softmax (Gemma 2); `None`: unchanged.
    pub logit_softcap: Option<f32>,
    /// A linear bias on the key's distance (BLOOM, MPT, Falcon-RW); `None`: none.
    pub alibi: Option<Alibi>,
}

/// ALiBi: `slope(h) · (key − query)` (positions; never positive) added to each scaled score,
/// after the soft-cap. Head `h` of `n` (the model's, wherever this rank's heads start) has
/// slope `2^(−b·(h+1)/p)` for `h < p`, the largest power of two `p ≤ n`, and
/// `2^(−b·(2(h−p)+1)/(2p))` past it (BLOOM's, MPT's, vLLM's and llama.cpp's slopes), times
/// `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Alibi {
    /// The model's query heads.
    pub num_heads: u32,
    /// The global index of this rank's first head.
    pub first_head: u32,
    /// `b` above: 8 in every released model (MPT's `alibi_bias_max`).
    pub max_bias: f32,
    /// Multiplies every slope (1; Falcon adds the bias before the attention scale: the scale).
    pub scale: f32,
}

impl Alibi {
    /// The largest power of two not above the heads.
    fn pow2(&self) -> u32 {
        1 << (31 - self.num_heads.max(1).leading_zeros())
    }

    /// What the kernels take: `(scale, l0, p, first_head)`, with `l0 = −b / p`; `scale` 0 for
    /// no ALiBi. The slope of this rank's head `h` is `scale · 2^e`, `e = l0·(g+1)` for the
    /// global head `g = first_head + h < p`, else `e = l0/2 · (2(g−p)+1)` ([`Alibi::slope`]).
    pub fn kernel_args(alibi: Option<Alibi>) -> (f32, f32, u32, u32) {
        match alibi {
            None => (0.0, 0.0, 0, 0),
            Some(a) => {
                let p = a.pow2();
                (a.scale, -a.max_bias / p as f32, p, a.first_head)
            }
        }
    }

    /// The slope of this rank's head `h`, as the kernels compute it.
    pub fn slope(&self, h: usize) -> f32 {
        let (scale, l0, p, h0) = Alibi::kernel_args(Some(*self));
        let g = h0 + h as u32;
        let e = match g < p {
            true => l0 * (g + 1) as f32,
            false => 0.5 * l0 * (2 * (g - p) + 1) as f32,
        };
        scale * e.exp2()
    }
}

impl AttentionOptions {
    /// Full attention with this scale.
    pub fn new(scale: f32) -> Self {
        AttentionOptions {
            scale,
            sliding_window: None,
            logit_softcap: None,
            alibi: None,
        }
    }

    /// The first key a query sees when it sees keys `0 .. n_keys` causally.
    pub fn first_key(&self, n_keys: usize) -> usize {
        match self.sliding_window {
            Some(w) => n_keys.saturating_sub(w),
            None => 0,
        }
    }

    /// The window as the kernels take it: 0 for none.
    pub fn window_u32(&self) -> Result<u32> {
        match self.sliding_window {
            None => Ok(0),
            Some(0) => anyhow::bail!("a sliding window of 0 keys"),
            Some(w) => Ok(u32::try_from(w).unwrap_or(u32::MAX)),
        }
    }

    /// The soft-cap as the kernels take it: 0 for none.
    pub fn softcap_f32(&self) -> Result<f32> {
        match self.logit_softcap {
            None => Ok(0.0),
            Some(c) if c > 0.0 && c.is_finite() => Ok(c),
            Some(c) => anyhow::bail!("a logit soft-cap must be positive and finite, got {c}"),
        }
    }
}

/// The activation of an MLP, gated (`act(gate) · up`) or plain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (Llama, Mistral, Qwen, Phi-3).
    Silu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`: Gemma's `gelu_pytorch_tanh`, GPT-2's
    /// `gelu_new`.
    GeluTanh,
    /// `0.5 x (1 + erf(x / √2))`: PyTorch's exact `nn.GELU` (Falcon).
    Gelu,
}

impl Activation {
    /// From an HF config's `hidden_act` / `hidden_activation` / `activation_function`.
    pub fn from_hf(name: &str) -> Result<Self> {
        Ok(match name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" | "gelu_tanh" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            other => anyhow::bail!(
                "activation '{}' is not supported (silu, gelu, gelu_new, gelu_pytorch_tanh)",
                crate::untrusted::text(other)
            ),
        })
    }

    /// The code the kernels switch on.
    pub fn code(self) -> u32 {
        match self {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
            Activation::Gelu => 2,
        }
    }

    /// The function in f64, the reference the kernels are tested against.
    pub fn apply_f64(self, x: f64) -> f64 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => {
                0.5 * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
            }
            Activation::Gelu => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
        }
    }
}

/// Geometry of one layer's paged K (or V) cache:
/// `[num_blocks, num_kv_heads, block_size, head_dim]`, so that one block of one head is a
/// contiguous `block_size × head_dim` tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Element type of the cache ([`Backend::kv_cache_dtypes`] says which a backend stores).
    pub dtype: DType,
}

impl KvLayout {
    /// Elements of one block: `Hkv · block_size · D`, contiguous in the cache.
    pub fn block_len(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    pub fn numel(&self) -> usize {
        self.num_blocks * self.block_len()
    }
}

/// The flattened batch of one engine step, on the host (see ENGINE-STEP in ARCHITECTURE.md).
///
/// ```text
///   token_ids     [T]      positions [T]      slot_mapping [T]
///   query_start   [S+1]    row range of each sequence
///   seq_lens      [S]      context length after this step
///   block_tables  [S × max_blocks]  padded with the null block
///   logits_rows   [R]      rows whose logits are wanted (last row of each sampling sequence)
///   lora_slots    [S]      each sequence's adapter (0: the base model), or empty
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchInput {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slot_mapping: Vec<u32>,
    pub query_start: Vec<u32>,
    pub seq_lens: Vec<u32>,
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
    pub logits_rows: Vec<u32>,
    /// `[S]` or empty: each sequence's LoRA adapter slot, 0 for the base model (empty: all
    /// base).
    pub lora_slots: Vec<u32>,
}

impl BatchInput {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }
    pub fn max_seq_len(&self) -> usize {
        self.seq_lens.iter().copied().max().unwrap_or(0) as usize
    }

    /// Checks the batch's structure (`query_start` covers the rows in order, no sequence has
    /// more new rows than context, `block_tables` holds `max_blocks` entries per sequence) and
    /// returns what attention needs of it: done once per step, when the batch is uploaded.
    pub fn shape(&self) -> Result<BatchShape> {
        let (t, s) = (self.num_tokens(), self.num_seqs());
        anyhow::ensure!(
            self.query_start.len() == s + 1
                && self.query_start[0] == 0
                && self.query_start[s] as usize == t,
            "batch: query_start does not cover the {t} rows of {s} sequences"
        );
        anyhow::ensure!(
            self.block_tables.len() == s * self.max_blocks,
            "batch: {} block table entries for {s} sequences of {} blocks",
            self.block_tables.len(),
            self.max_blocks
        );
        anyhow::ensure!(
            self.lora_slots.is_empty() || self.lora_slots.len() == s,
            "batch: {} LoRA slots for {s} sequences",
            self.lora_slots.len()
        );
        let mut max_query_len = 0;
        for (i, q) in self.query_start.windows(2).enumerate() {
            anyhow::ensure!(q[0] <= q[1], "batch: query_start decreases at sequence {i}");
            anyhow::ensure!(
                q[1] - q[0] <= self.seq_lens[i],
                "batch: sequence {i} has more new rows than context"
            );
            max_query_len = max_query_len.max((q[1] - q[0]) as usize);
        }
        Ok(BatchShape {
            max_query_len,
            max_seq_len: self.max_seq_len(),
            blocks_used: self
                .block_tables
                .iter()
                .max()
                .map_or(0, |&b| b as usize + 1),
        })
    }
}

/// What every layer's attention needs of a batch ([`BatchInput::shape`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// The most new rows of one sequence (1 in a pure decode step).
    pub max_query_len: usize,
    /// The longest context.
    pub max_seq_len: usize,
    /// One past the largest block id in the block tables (0 when they are empty).
    pub blocks_used: usize,
}

impl BatchShape {
    /// One layer's check, in constant time: every block of the tables lies in the pool of
    /// `num_blocks`, and the longest context's blocks of `block_size` fit a table row of
    /// `max_blocks`.
    pub fn check_kv(&self, num_blocks: usize, block_size: usize, max_blocks: usize) -> Result<()> {
        anyhow::ensure!(
            self.blocks_used <= num_blocks,
            "paged_attention: block {} outside the pool of {num_blocks}",
            self.blocks_used.saturating_sub(1)
        );
        anyhow::ensure!(
            self.max_seq_len.div_ceil(block_size.max(1)) <= max_blocks,
            "paged_attention: a context of {} tokens needs more than the {max_blocks} blocks of its table",
            self.max_seq_len
        );
        Ok(())
    }
}

/// The batch once uploaded: the same arrays in device memory, plus the host copy (launch
/// geometry, and the CPU backend reads it directly).
pub struct DeviceBatch<B: Backend + ?Sized> {
    pub host: BatchInput,
    /// `host.shape()`, checked at upload
    pub shape: BatchShape,
    pub token_ids: B::Buf,
    pub positions: B::Buf,
    pub slot_mapping: B::Buf,
    pub query_start: B::Buf,
    pub seq_lens: B::Buf,
    pub block_tables: B::Buf,
    pub logits_rows: B::Buf,
}

impl<B: Backend + ?Sized> DeviceBatch<B> {
    pub fn upload(backend: &B, host: BatchInput) -> Result<Self> {
        backend.upload_batch(host)
    }

    /// Each array in its own buffer: [`Backend::upload_batch`]'s default.
    pub fn upload_each(backend: &B, host: BatchInput) -> Result<Self> {
        Ok(DeviceBatch {
            shape: host.shape()?,
            token_ids: backend.upload_u32(&host.token_ids)?,
            positions: backend.upload_u32(&host.positions)?,
            slot_mapping: backend.upload_u32(&host.slot_mapping)?,
            query_start: backend.upload_u32(&host.query_start)?,
            seq_lens: backend.upload_u32(&host.seq_lens)?,
            block_tables: backend.upload_u32(&host.block_tables)?,
            logits_rows: backend.upload_u32(&host.logits_rows)?,
            host,
        })
    }
}

/// A compute backend. Every op writes into an output buffer the caller owns, so a model can
/// reuse its activation buffers from step to step.
pub trait Backend: Send + Sync + 'static {
    /// Device memory holding f32, f16, bf16 or u32 elements.
    type Buf: Send + Sync + 'static;

    /// A human-readable name with the device ("cpu (2 threads)", "cuda: NVIDIA H200", ...).
    fn name(&self) -> String;

    /// Bytes of device memory that the KV pool may be sized against, where the device has its
    /// own memory (GPUs). `None` for host memory.
    fn device_memory(&self) -> Option<u64> {
        None
    }

    /// Bytes of device memory free now (GPUs): the KV pool is sized from it once the weights
    /// are loaded. `None` for host memory.
    fn free_device_memory(&self) -> Option<u64> {
        None
    }

    // ---- memory -------------------------------------------------------------------------

    /// Runs one step's forward pass. The CPU backend runs it on a thread of its pool, so that
    /// the parallel ops inside fork and join among the pool's threads instead of waking a
    /// sleeping caller after each one.
    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Uploads a weight, converting to `dtype`.
    fn upload_weight(&self, t: &HostTensor, dtype: DType) -> Result<Self::Buf>;
    /// The KV cache element types this backend stores (`--kv-cache-dtype`); K and V are
    /// written and read through f32 whatever the type.
    fn kv_cache_dtypes(&self) -> &'static [DType] {
        &[DType::F32]
    }
    /// The token budget per step when `--max-num-batched-tokens` is not given (vLLM's 2048).
    fn default_token_budget(&self) -> usize {
        2048
    }
    /// Whether `matmul` and `embedding` take weights in GGML block formats as they are
    /// ([`Backend::upload_quant`]); where not, the loader dequantizes them.
    fn supports_quant(&self) -> bool {
        false
    }
    /// Whether weights of block type `ty` stay in it on this backend (a type without a kernel
    /// here is dequantized at load).
    fn keeps_quant(&self, ty: GgmlType) -> bool {
        self.supports_quant() && ty.has_kernel()
    }
    /// Uploads a linear weight (or embedding table) kept in its block formats.
    fn upload_quant(&self, t: QuantTensor) -> Result<Self::Buf> {
        let _ = t;
        anyhow::bail!(
            "the {} backend has no kernels for quantized weights",
            self.name()
        )
    }
    fn upload_f32(&self, data: &[f32]) -> Result<Self::Buf>;
    fn upload_u32(&self, data: &[u32]) -> Result<Self::Buf>;
    /// Uploads a step's batch arrays. GPU backends override it to copy them in one transfer.
    fn upload_batch(&self, host: BatchInput) -> Result<DeviceBatch<Self>> {
        DeviceBatch::upload_each(self, host)
    }
    /// A zero-filled f32 buffer of `n` elements.
    fn alloc_f32(&self, n: usize) -> Result<Self::Buf>;
    /// An f32 buffer of `n` elements whose contents are undefined, for the output of an op
    /// that writes it in full (a step's activations). GPU backends skip the memset (the
    /// emulator fills it with NaNs instead, so that a read before the write shows).
    fn alloc_scratch_f32(&self, n: usize) -> Result<Self::Buf> {
        self.alloc_f32(n)
    }
    /// One layer's K or V cache, zero-filled.
    fn alloc_kv(&self, layout: KvLayout) -> Result<Self::Buf>;
    fn download_f32(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Copies whole blocks of one layer's K or V cache to the host (swap-out): the blocks in
    /// the order given, `block_len` elements each (`Hkv · block_size · D`).
    fn read_kv_blocks(
        &self,
        cache: &Self::Buf,
        block_len: usize,
        blocks: &[u32],
    ) -> Result<Vec<f32>>;
    /// Writes whole blocks of one layer's K or V cache from the host (swap-in), ordered after
    /// the work queued before it: `data` holds the blocks in the order given.
    fn write_kv_blocks(
        &self,
        cache: &mut Self::Buf,
        block_len: usize,
        blocks: &[u32],
        data: &[f32],
    ) -> Result<()>;
    /// Number of elements in a buffer.
    fn len(&self, buf: &Self::Buf) -> usize;

    // ---- dense ops ----------------------------------------------------------------------

    /// `out[t, :] = table[ids[t], :]`; table `[vocab, dim]` in any weight dtype.
    fn embedding(
        &self,
        table: &Self::Buf,
        ids: &Self::Buf,
        dim: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ + bias[n]`.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: Option<&Self::Buf>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// `out[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) * w`, rows of length `dim`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// `x += y` over the first `rows × dim` elements, then `out = rms_norm(x) * w`: the
    /// residual add and the norm after it. GPU backends fuse the two into one pass.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        x: &mut Self::Buf,
        y: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.add_assign(x, y, rows * dim)?;
        self.rms_norm(x, w, rows, dim, eps, out)
    }

    /// `x += y` over the first `n` elements.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize) -> Result<()>;

    /// RMSNorm or LayerNorm of the q and k parts of the fused QKV rows, in place, in spans
    /// ([`QkNormSpan`]): each q head (Qwen3, Gemma 3, StableLM, Cohere) or all of q (OLMo 2) is
    /// normalised and multiplied by `q_w` (one `[head_dim]`, or a row per span), k likewise by
    /// `k_w`; v is left as it is.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm(
        &self,
        qkv: &mut Self::Buf,
        q_w: &Self::Buf,
        k_w: &Self::Buf,
        rows: usize,
        layout: QkvLayout,
        span: QkNormSpan,
        eps: f32,
    ) -> Result<()>;

    /// Rotate-half (NeoX/HF) RoPE, in place, on the q and k heads of the fused QKV rows.
    /// `cos` and `sin` are `[max_positions, head_dim / 2]` tables.
    fn rope(
        &self,
        qkv: &mut Self::Buf,
        positions: &Self::Buf,
        cos: &Self::Buf,
        sin: &Self::Buf,
        rows: usize,
        layout: QkvLayout,
    ) -> Result<()>;

    /// `out[r, i] = act(gate_up[r, i]) * gate_up[r, ffn + i]`: the gated MLP's gate and up
    /// projections fused.
    fn gated_act(
        &self,
        gate_up: &Self::Buf,
        rows: usize,
        ffn: usize,
        act: Activation,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// `out[r, i] = act(g) · u` where `[g | u] = x[r] · w_gate_upᵀ` (`x` `[rows, k]`,
    /// `w_gate_up` `[2 ffn, k]`, gate rows then up rows): the gated MLP's first half.
    /// `gate_up` `[rows, 2 ffn]` is scratch: the default fills it ([`Self::matmul`], then
    /// [`Self::gated_act`]); a backend that fuses the two may leave it untouched.
    #[allow(clippy::too_many_arguments)]
    fn matmul_gated_act(
        &self,
        x: &Self::Buf,
        w_gate_up: &Self::Buf,
        rows: usize,
        k: usize,
        ffn: usize,
        act: Activation,
        gate_up: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.matmul(x, w_gate_up, None, rows, k, 2 * ffn, gate_up)?;
        self.gated_act(gate_up, rows, ffn, act, out)
    }

    /// `x[i] = act(x[i])` over the first `n` elements (a plain MLP).
    fn act(&self, x: &mut Self::Buf, n: usize, act: Activation) -> Result<()>;

    /// `x[i] *= s` over the first `n` elements (Gemma's embedding scale).
    fn scale(&self, x: &mut Self::Buf, s: f32, n: usize) -> Result<()>;

    /// `x[i] = cap · tanh(x[i] / cap)` over the first `n` elements (Gemma's final logits).
    fn softcap(&self, x: &mut Self::Buf, cap: f32, n: usize) -> Result<()>;

    /// `x[i] = min(max(x[i], −limit), limit)` over the first `n` elements (MPT's `clip_qkv`).
    fn clamp(&self, x: &mut Self::Buf, limit: f32, n: usize) -> Result<()>;

    /// LayerNorm with bias: `out[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b`, rows of
    /// length `dim` (GPT-2, Falcon).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// `out[i, :] = x[rows[i], :]` for the rows whose logits are wanted.
    fn gather_rows(
        &self,
        x: &Self::Buf,
        rows: &Self::Buf,
        dim: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// `out[rows[i], :] += weights[i] · y[i, :]` for the `rows` given, which are distinct: a
    /// routed expert's outputs added to the tokens that chose it, each with its routing weight.
    /// A row's sum is the same whatever other rows the call has (no reduction across rows).
    fn scatter_add_rows(
        &self,
        y: &Self::Buf,
        rows: &Self::Buf,
        weights: &Self::Buf,
        dim: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// LoRA's update of one projection for a step's adapters: for each group, and each of its
    /// `rows`, `out[row, :] += weights[i] · (x[row, :] · Aᵀ) · Bᵀ` with `x` `[T, k]`, `out`
    /// `[T, n]`, A `[rank, k]` and B `[n, rank]` (uploaded with `upload_weight`). A row is in
    /// one group at most, and its result does not depend on the other rows or groups.
    // NOTE: one op for every adapter of the step (Punica's BGMV/SGMV shape), not gather,
    // products and scatter per adapter: those were thousands of calls a step at 16 adapters.
    fn lora(
        &self,
        x: &Self::Buf,
        groups: &[LoraGroup<'_, Self>],
        k: usize,
        n: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    // ---- paged KV cache ----------------------------------------------------------------

    /// Writes each row's K and V (from the fused QKV rows) at its slot
    /// (`slot = block * block_size + offset`) in this layer's caches.
    fn write_kv(
        &self,
        qkv: &Self::Buf,
        slot_mapping: &Self::Buf,
        rows: usize,
        layout: QkvLayout,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        kv: KvLayout,
    ) -> Result<()>;

    /// [`Backend::rope`] then [`Backend::write_kv`]: q and k rotated in place, then K and V
    /// written at their slots, with the same results. The GPU backends do it in one pass
    /// over the rows (one launch instead of two, K read once).
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        qkv: &mut Self::Buf,
        positions: &Self::Buf,
        cos: &Self::Buf,
        sin: &Self::Buf,
        slot_mapping: &Self::Buf,
        rows: usize,
        layout: QkvLayout,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        kv: KvLayout,
    ) -> Result<()> {
        self.rope(qkv, positions, cos, sin, rows, layout)?;
        self.write_kv(qkv, slot_mapping, rows, layout, k_cache, v_cache, kv)
    }

    /// Attention of every query row over its sequence's keys `0 ..= position`, read through
    /// the block tables (the cached prefix and this step's own keys alike, causal inside a
    /// chunk), limited to the last `window` keys with a sliding window, scores soft-capped
    /// where asked (see [`AttentionOptions`]). Grouped-query: query head `h` uses kv head
    /// `h / (num_heads / num_kv_heads)`. `out` is `[T, num_heads × head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        qkv: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        batch: &DeviceBatch<Self>,
        layout: QkvLayout,
        kv: KvLayout,
        opts: AttentionOptions,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// Index of the largest value of each row (ties: the lowest index), for greedy requests.
    /// The default brings the logits to the host; GPU backends may do it on the device.
    fn argmax_rows(&self, logits: &Self::Buf, rows: usize, cols: usize) -> Result<Vec<u32>> {
        let v = self.download_f32(logits)?;
        Ok((0..rows)
            .map(|r| argmax(&v[r * cols..(r + 1) * cols]) as u32)
            .collect())
    }

    /// Whether [`Self::sample_rows`] draws random samples and applies [`LogitEdit`]s on the
    /// device (otherwise it takes plain greedy rows only, and the engine samples the others on
    /// the host).
    fn samples_on_device(&self) -> bool {
        false
    }

    /// The token chosen from each row of `logits` `[rows.len(), cols]` as `rows` asks, with
    /// its log-probabilities where asked (see [`RowSampling`]; the rows' edits are applied to
    /// `logits` in place first). The default takes greedy rows without edits or
    /// log-probabilities only ([`Self::argmax_rows`]).
    fn sample_rows(
        &self,
        logits: &mut Self::Buf,
        cols: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<Choice>> {
        anyhow::ensure!(
            rows.iter().all(RowSampling::is_plain_greedy),
            "{} samples on the host: only greedy rows without penalties, bias, banned tokens \
             or log-probabilities can be reduced on the device",
            self.name()
        );
        Ok(self
            .argmax_rows(logits, rows.len(), cols)?
            .into_iter()
            .map(Choice::token)
            .collect())
    }
}

/// One adapter's rows of a step and its factors for one projection ([`Backend::lora`]).
pub struct LoraGroup<'a, B: Backend + ?Sized> {
    /// `[m]` u32: distinct rows of the step.
    pub rows: &'a B::Buf,
    /// `[m]` f32: each row's weight on the update.
    pub weights: &'a B::Buf,
    pub m: usize,
    /// `[rank, k]`.
    pub a: &'a B::Buf,
    /// `[n, rank]`.
    pub b: &'a B::Buf,
    pub rank: usize,
}

/// Index of the largest value: ties go to the lowest index; NaN never wins (0 when nothing
/// beats -inf). The reference every backend's `argmax_rows` is checked against.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best_v = x;
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences: a decode row after 5 cached tokens, and a prefill of 3 rows; tables of 2
    /// blocks of 4 tokens.
    fn batch() -> BatchInput {
        BatchInput {
            token_ids: vec![1, 2, 3, 4],
            positions: vec![5, 0, 1, 2],
            slot_mapping: vec![21, 12, 13, 14],
            query_start: vec![0, 1, 4],
            seq_lens: vec![6, 3],
            block_tables: vec![4, 5, 3, 0],
            max_blocks: 2,
            logits_rows: vec![0, 3],
            lora_slots: Vec::new(),
        }
    }

    #[test]
    fn a_batch_shape_is_checked_once_and_each_layer_checks_it_in_constant_time() {
        let shape = batch().shape().unwrap();
        assert_eq!(
            shape,
            BatchShape {
                max_query_len: 3,
                max_seq_len: 6,
                blocks_used: 6,
            }
        );
        shape.check_kv(6, 4, 2).unwrap();
        let e = shape.check_kv(5, 4, 2).unwrap_err().to_string();
        assert!(e.contains("block 5 outside the pool of 5"), "{e}");
        let e = shape.check_kv(6, 2, 2).unwrap_err().to_string();
        assert!(e.contains("context of 6 tokens"), "{e}");
        // malformed batches are refused at upload, each with its reason
        type Spoil = fn(&mut BatchInput);
        let bad: [(Spoil, &str); 5] = [
            (|b| b.query_start = vec![0, 1, 3], "does not cover"),
            (|b| b.query_start = vec![1, 1, 4], "does not cover"),
            (|b| b.query_start = vec![0, 5, 4], "decreases"),
            (|b| b.seq_lens[1] = 2, "more new rows than context"),
            (
                |b| b.block_tables.pop().map_or((), drop),
                "block table entries",
            ),
        ];
        for (spoil, want) in bad {
            let mut b = batch();
            spoil(&mut b);
            let e = b.shape().unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        // an empty batch has an empty shape
        let empty = BatchInput {
            query_start: vec![0],
            ..Default::default()
        };
        assert_eq!(empty.shape().unwrap(), BatchShape::default());
    }
}
