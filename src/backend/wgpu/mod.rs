//! The wgpu backend: the whole model on any Vulkan, Metal or DX12 device, with the WGSL kernels of
//! `shaders/` (see `kernels.rs` for how they are put together).
//!
//! - Weights are uploaded once, in f32, in f16 where the adapter has `shader-f16` (else widened
//!   to f32, said once in the log), or in bf16 packed two to a u32. Math accumulates in f32.
//! - A buffer larger than one storage binding is split into parts of whole rows: a weight by
//!   output rows (matmul and embedding run once per part), a layer's KV cache by blocks
//!   (write_kv runs once per part; attention carries its softmax state from part to part).
//!   Activations stay whole and are bound in windows of rows when they outgrow a binding.
//! - Every op is recorded into one command encoder; the step is submitted when its logits (or
//!   the greedy token ids, `argmax_rows`) are read back: one submission and one wait per step.
//! - Index buffers (token ids, positions, slots, block tables) keep a host copy, so that bad
//!   indices are errors with the same words as on the CPU backend, not garbage.

mod attention;
mod cache;
mod device;
mod kernels;

pub use device::is_software;

use super::{
    Activation, AttentionOptions, Backend, DeviceBatch, KvLayout, LoraGroup, QkNormSpan, QkvLayout,
    args,
};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail, ensure};
use device::{AdapterPolicy, Bind, Gpu};
use half::{bf16, f16};
use kernels::{Kernel, PipelineKey, WeightStorage};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Element type of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
    BF16,
    U32,
}

impl Elem {
    fn bytes(self) -> u64 {
        match self {
            Elem::F32 | Elem::U32 => 4,
            Elem::F16 | Elem::BF16 => 2,
        }
    }
    fn weights(self) -> Result<WeightStorage> {
        match self {
            Elem::F32 => Ok(WeightStorage::F32),
            Elem::F16 => Ok(WeightStorage::F16),
            Elem::BF16 => Ok(WeightStorage::BF16),
            Elem::U32 => bail!("wgpu backend: expected a float weight, got a u32 buffer"),
        }
    }
}

/// One device buffer holding rows `row0 .. row0 + rows` of a split buffer.
struct Part {
    buf: wgpu::Buffer,
    row0: usize,
    rows: usize,
}

/// Device memory: one buffer, or a buffer split into parts of whole rows of `row_len` elements
/// where it is larger than one storage binding.
pub struct WgpuBuf {
    parts: Vec<Part>,
    elem: Elem,
    len: usize,
    row_len: usize,
    /// Host copy of a u32 index buffer.
    host: Option<Vec<u32>>,
}

impl WgpuBuf {
    /// Where block `b` of a KV cache (rows of `block_len` elements) lives.
    fn block_bind(&self, b: usize, block_len: usize) -> Result<Bind<'_>> {
        ensure!(
            block_len == self.row_len,
            "a KV block is one row of the cache"
        );
        let p = self
            .parts
            .iter()
            .find(|p| p.row0 <= b && b < p.row0 + p.rows)
            .with_context(|| format!("block {b} is outside the KV cache"))?;
        Ok(Bind {
            buf: &p.buf,
            offset: ((b - p.row0) * block_len * 4) as u64,
            size: (block_len * 4) as u64,
        })
    }

    fn whole(&self, what: &str) -> Result<&wgpu::Buffer> {
        ensure!(
            self.parts.len() == 1,
            "wgpu backend: {what} is split into {} parts, which this op cannot read",
            self.parts.len()
        );
        Ok(&self.parts[0].buf)
    }
    fn f32(&self, what: &str) -> Result<&wgpu::Buffer> {
        ensure!(
            self.elem == Elem::F32,
            "wgpu backend: {what} must be an f32 buffer, not {:?}",
            self.elem
        );
        self.whole(what)
    }
    /// The parts of a weight of `rows` rows, as (buffer, first row, rows). A weight in one part
    /// is all rows whatever shape it was uploaded with.
    fn row_parts(&self, rows: usize) -> Vec<(&wgpu::Buffer, usize, usize)> {
        if self.parts.len() == 1 {
            vec![(&self.parts[0].buf, 0, rows)]
        } else {
            self.parts
                .iter()
                .map(|p| (&p.buf, p.row0, p.rows))
                .collect()
        }
    }
    fn u32(&self, what: &str) -> Result<(&wgpu::Buffer, &[u32])> {
        ensure!(
            self.elem == Elem::U32,
            "wgpu backend: {what} must be a u32 buffer"
        );
        let host = self
            .host
            .as_deref()
            .context("wgpu backend: index buffer without host copy")?;
        Ok((self.whole(what)?, host))
    }
}

/// Rows `r0 .. r0 + n` of a buffer whose rows have `row_elems` f32/u32 elements.
fn rows<'a>(buf: &'a wgpu::Buffer, r0: usize, n: usize, row_elems: usize) -> Bind<'a> {
    Bind {
        buf,
        offset: (r0 * row_elems * 4) as u64,
        size: (n * row_elems * 4) as u64,
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// Options of the wgpu backend.
#[derive(Debug, Clone, Default)]
pub struct WgpuOptions {
    /// Pick only a real GPU, never a software rasteriser (what `--backend auto` does).
    pub hardware_only: bool,
    /// Cap storage bindings (and so the parts of split buffers) below the adapter's limit; tests
    /// use it to run the split paths on small data.
    pub max_binding_bytes: Option<u64>,
    /// Use the kernels tuned for software rasterisers (`Some(true)`) or for GPUs
    /// (`Some(false)`) whatever the adapter; `None`: by the adapter.
    pub software_kernels: Option<bool>,
    /// Do without `shader-f16` even where the adapter has it (f16 weights then go to f32, as
    /// on an adapter without it).
    pub disable_f16: bool,
}

/// A handle on one wgpu device; clones share the device, its pipelines and its step encoder.
#[derive(Clone)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    why: String,
    warned_f16: Arc<AtomicBool>,
    software_kernels: bool,
}

/// Output columns per thread of matvec.wgsl.
const MATVEC_TN: usize = 8;

impl WgpuBackend {
    /// The best adapter there is, a software rasteriser if there is nothing else.
    pub fn new() -> Result<Self> {
        Self::with_options(WgpuOptions::default())
    }

    /// A real GPU only: what `--backend auto` uses.
    pub fn new_hardware() -> Result<Self> {
        Self::with_options(WgpuOptions {
            hardware_only: true,
            ..Default::default()
        })
    }

    pub fn with_options(opts: WgpuOptions) -> Result<Self> {
        let policy = if opts.hardware_only {
            AdapterPolicy::HardwareOnly
        } else {
            AdapterPolicy::Any
        };
        let (gpu, why) = Gpu::new(policy, opts.max_binding_bytes, !opts.disable_f16)?;
        tracing::info!(
            "wgpu: {} ({}); largest storage binding {} MiB, largest buffer {} MiB, shader-f16 {}",
            gpu.describe(),
            why,
            gpu.max_binding >> 20,
            gpu.limits.max_buffer_size >> 20,
            if gpu.f16 { "yes" } else { "no" }
        );
        let software_kernels = opts
            .software_kernels
            .unwrap_or_else(|| device::is_software(&gpu.info));
        Ok(WgpuBackend {
            gpu: Arc::new(gpu),
            why,
            warned_f16: Arc::new(AtomicBool::new(false)),
            software_kernels,
        })
    }

    /// Why this adapter was picked, in words ("DiscreteGpu", "software rasteriser").
    pub fn adapter_kind(&self) -> &str {
        &self.why
    }

    /// Whether the adapter rasterises in software (llvmpipe and the like).
    pub fn is_software(&self) -> bool {
        device::is_software(&self.gpu.info)
    }

    /// Destroys the device, as a driver reset would: every later call is an error that says the
    /// device was lost. For tests of that path.
    pub fn destroy_device(&self) {
        self.gpu.device.destroy();
    }

    /// Whether f16 weights stay f16 on this adapter.
    pub fn has_f16(&self) -> bool {
        self.gpu.f16
    }

    /// Splits `n` rows into windows whose bindings fit: a buffer with rows of `b` bytes is bound
    /// `rows * b` bytes at a time, from an offset the adapter accepts. One window when everything
    /// fits.
    fn windows(&self, n: usize, row_bytes: &[u64]) -> Result<Vec<(usize, usize)>> {
        // attention's grid has one workgroup per row, so a window is also bounded by that
        let max_grid = self.gpu.limits.max_compute_workgroups_per_dimension as usize;
        let widest = row_bytes.iter().copied().max().unwrap_or(4).max(4);
        if n as u64 * widest <= self.gpu.max_binding && n <= max_grid {
            return Ok(vec![(0, n)]);
        }
        // every window starts at a row whose byte offset in each buffer is aligned
        let align = self.gpu.limits.min_storage_buffer_offset_alignment.max(4) as u64;
        let step = row_bytes
            .iter()
            .map(|&b| align / gcd(b.max(1), align))
            .fold(1, lcm) as usize;
        let per = ((self.gpu.max_binding / widest) as usize).min(max_grid);
        let per = per / step * step;
        if per == 0 {
            bail!(
                "wgpu backend: {step} rows of {widest} bytes do not fit the adapter's storage \
                 binding ({} bytes)",
                self.gpu.max_binding
            );
        }
        Ok((0..n)
            .step_by(per)
            .map(|r0| (r0, per.min(n - r0)))
            .collect())
    }

    /// Workgroups for `threads` invocations of a 64-wide kernel that computes its linear index
    /// as `(wid.y * num_workgroups.x + wid.x) * 64 + lid.x`.
    fn grid(&self, threads: usize) -> [u32; 3] {
        self.grid_groups(threads.div_ceil(64))
    }

    /// `act.wgsl` in one of its in-place modes (1: activation, 2: scale, 3: soft-cap) over
    /// `n` elements.
    fn elementwise_in_place(
        &self,
        x: &mut WgpuBuf,
        n: usize,
        mode: u32,
        act: u32,
        s: f32,
    ) -> Result<()> {
        let xb = x.f32("elementwise op")?;
        for (e0, len) in self.windows(n, &[4])? {
            self.gpu.dispatch(
                &Kernel::Act.key(),
                &[len as u32, 1, mode, act, s.to_bits()],
                &[Bind::whole(&self.gpu.dummy), rows(xb, e0, len, 1)],
                self.grid(len),
            )?;
        }
        Ok(())
    }

    fn grid_groups(&self, groups: usize) -> [u32; 3] {
        let max = self.gpu.limits.max_compute_workgroups_per_dimension as usize;
        let x = groups.min(max);
        [x as u32, groups.div_ceil(x.max(1)) as u32, 1]
    }

    /// Uploads `data` (any element type) as a buffer split into parts of at most one storage
    /// binding each, of whole rows of `row_len` elements.
    fn upload_parts(
        &self,
        elem: Elem,
        n: usize,
        row_len: usize,
        bytes_of: &dyn Fn(std::ops::Range<usize>) -> Vec<u8>,
        label: &str,
    ) -> Result<WgpuBuf> {
        let row_len = row_len.max(1);
        let total_rows = n.div_ceil(row_len);
        let row_bytes = row_len as u64 * elem.bytes();
        // room for padding to 4 bytes
        let per = ((self.gpu.max_binding - 4) / row_bytes) as usize;
        if per == 0 {
            bail!(
                "wgpu backend: one row of {label} ({row_bytes} bytes) is larger than the adapter's \
                 storage binding ({} bytes)",
                self.gpu.max_binding
            );
        }
        let mut parts = Vec::new();
        for row0 in (0..total_rows.max(1)).step_by(per) {
            let rows = per.min(total_rows - row0);
            let range = (row0 * row_len).min(n)..((row0 + rows) * row_len).min(n);
            let buf = self.gpu.buffer_init(&bytes_of(range), label)?;
            parts.push(Part { buf, row0, rows });
        }
        Ok(WgpuBuf {
            parts,
            elem,
            len: n,
            row_len,
            host: None,
        })
    }

    /// Records a matmul of rows `r0 .. r0 + m` of x into the same rows of out.
    #[allow(clippy::too_many_arguments)]
    fn matmul_window(
        &self,
        xb: &wgpu::Buffer,
        w: &WgpuBuf,
        bias: Option<&wgpu::Buffer>,
        r0: usize,
        m: usize,
        k: usize,
        n: usize,
        outb: &wgpu::Buffer,
    ) -> Result<()> {
        let weights = Some(w.elem.weights()?);
        let mr = match m {
            1 => 1,
            2 => 2,
            3..=4 => 4,
            _ => 8,
        };
        if m <= 8 && self.software_kernels {
            // NOTE: on a software rasteriser, matvec.wgsl: no workgroup memory, no barriers
            let key = PipelineKey {
                kernel: Kernel::Matvec,
                weights,
                constants: vec![("MR", mr), ("TN", MATVEC_TN as u32)],
            };
            for (buf, n0, nc) in w.row_parts(n) {
                let params = [
                    m as u32,
                    k as u32,
                    nc as u32,
                    n as u32,
                    n0 as u32,
                    bias.is_some() as u32,
                ];
                let binds = [
                    rows(xb, r0, m, k),
                    Bind::whole(buf),
                    Bind::whole(bias.unwrap_or(&self.gpu.dummy)),
                    rows(outb, r0, m, n),
                ];
                self.gpu
                    .dispatch(&key, &params, &binds, self.grid(nc.div_ceil(MATVEC_TN)))?;
            }
            return Ok(());
        }
        // NOTE: up to 8 rows (decode), 64 columns a workgroup with every row in registers;
        // up to 32, 32x64 tiles; beyond, 64x64 tiles. All accumulate each output in the same
        // order (see matmul.wgsl), so a row's logits do not depend on the step's size.
        let (wg_x, wg_y, tm, tn) = match m {
            0..=8 => (64, 1, mr, 1),
            9..=32 => (8, 4, 8, 8),
            _ => (8, 8, 8, 8),
        };
        let key = PipelineKey {
            kernel: Kernel::Matmul,
            weights,
            constants: vec![("WG_X", wg_x), ("WG_Y", wg_y), ("TM", tm), ("TN", tn)],
        };
        let (bm, bn) = ((wg_y * tm) as usize, (wg_x * tn) as usize);
        for (buf, n0, nc) in w.row_parts(n) {
            let params = [
                m as u32,
                k as u32,
                nc as u32,
                n as u32,
                n0 as u32,
                bias.is_some() as u32,
            ];
            let binds = [
                rows(xb, r0, m, k),
                Bind::whole(buf),
                Bind::whole(bias.unwrap_or(&self.gpu.dummy)),
                rows(outb, r0, m, n),
            ];
            self.gpu.dispatch(
                &key,
                &params,
                &binds,
                [nc.div_ceil(bn) as u32, m.div_ceil(bm) as u32, 1],
            )?;
        }
        Ok(())
    }
}

impl Backend for WgpuBackend {
    type Buf = WgpuBuf;

    fn name(&self) -> String {
        format!("wgpu: {}", self.gpu.describe())
    }

    fn device_memory(&self) -> Option<u64> {
        self.gpu.memory
    }

    fn upload_weight(&self, t: &HostTensor, dtype: DType) -> Result<WgpuBuf> {
        let row_len = if t.shape.len() >= 2 {
            t.shape[1..].iter().product()
        } else {
            1
        };
        let n = t.data.len();
        let data = &t.data;
        match dtype {
            DType::F32 => self.upload_parts(
                Elem::F32,
                n,
                row_len,
                &|r| bytemuck::cast_slice(&data[r]).to_vec(),
                "a weight",
            ),
            DType::F16 if self.gpu.f16 => self.upload_parts(
                Elem::F16,
                n,
                row_len,
                &|r| {
                    let v: Vec<f16> = data[r].iter().map(|&x| f16::from_f32(x)).collect();
                    bytemuck::cast_slice(&v).to_vec()
                },
                "a weight",
            ),
            DType::F16 => {
                if !self.warned_f16.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "wgpu: {} has no shader-f16: f16 weights are rounded to f16 and stored as \
                         f32 (twice the memory)",
                        self.gpu.info.name
                    );
                }
                self.upload_parts(
                    Elem::F32,
                    n,
                    row_len,
                    &|r| {
                        let v: Vec<f32> =
                            data[r].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                        bytemuck::cast_slice(&v).to_vec()
                    },
                    "a weight",
                )
            }
            DType::BF16 => self.upload_parts(
                Elem::BF16,
                n,
                row_len,
                &|r| {
                    let v: Vec<bf16> = data[r].iter().map(|&x| bf16::from_f32(x)).collect();
                    bytemuck::cast_slice(&v).to_vec()
                },
                "a weight",
            ),
            DType::F8E4M3 => bail!("fp8 is a KV cache type, not one for weights"),
        }
    }

    fn upload_f32(&self, data: &[f32]) -> Result<WgpuBuf> {
        let buf = self
            .gpu
            .buffer_init(bytemuck::cast_slice(data), "f32 data")?;
        Ok(WgpuBuf {
            parts: vec![Part {
                buf,
                row0: 0,
                rows: 1,
            }],
            elem: Elem::F32,
            len: data.len(),
            row_len: data.len(),
            host: None,
        })
    }

    fn upload_u32(&self, data: &[u32]) -> Result<WgpuBuf> {
        let buf = self
            .gpu
            .buffer_init(bytemuck::cast_slice(data), "indices")?;
        Ok(WgpuBuf {
            parts: vec![Part {
                buf,
                row0: 0,
                rows: 1,
            }],
            elem: Elem::U32,
            len: data.len(),
            row_len: data.len(),
            host: Some(data.to_vec()),
        })
    }

    fn alloc_f32(&self, n: usize) -> Result<WgpuBuf> {
        // NOTE: wgpu zero-fills a buffer before its first use.
        let buf = self.gpu.buffer(n as u64 * 4, "activations")?;
        Ok(WgpuBuf {
            parts: vec![Part {
                buf,
                row0: 0,
                rows: 1,
            }],
            elem: Elem::F32,
            len: n,
            row_len: n,
            host: None,
        })
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<WgpuBuf> {
        self.alloc_kv_op(layout)
    }

    fn download_f32(&self, buf: &WgpuBuf) -> Result<Vec<f32>> {
        let eb = buf.elem.bytes();
        let binds: Vec<Bind> = buf
            .parts
            .iter()
            .map(|p| {
                let n = (p.rows * buf.row_len).min(buf.len - p.row0 * buf.row_len);
                Bind {
                    buf: &p.buf,
                    offset: 0,
                    size: n as u64 * eb,
                }
            })
            .collect();
        let bytes = self.gpu.read(&binds)?;
        Ok(match buf.elem {
            Elem::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(&bytes),
            Elem::U32 => bytemuck::pod_collect_to_vec::<u8, u32>(&bytes)
                .into_iter()
                .map(|x| x as f32)
                .collect(),
            Elem::F16 => bytemuck::pod_collect_to_vec::<u8, f16>(&bytes)
                .into_iter()
                .map(f16::to_f32)
                .collect(),
            Elem::BF16 => bytemuck::pod_collect_to_vec::<u8, bf16>(&bytes)
                .into_iter()
                .map(bf16::to_f32)
                .collect(),
        })
    }

    fn read_kv_blocks(
        &self,
        cache: &WgpuBuf,
        block_len: usize,
        blocks: &[u32],
    ) -> Result<Vec<f32>> {
        self.read_kv_blocks_op(cache, block_len, blocks)
    }

    fn write_kv_blocks(
        &self,
        cache: &mut WgpuBuf,
        block_len: usize,
        blocks: &[u32],
        data: &[f32],
    ) -> Result<()> {
        self.write_kv_blocks_op(cache, block_len, blocks, data)
    }

    fn len(&self, buf: &WgpuBuf) -> usize {
        buf.len
    }

    fn embedding(
        &self,
        table: &WgpuBuf,
        ids: &WgpuBuf,
        dim: usize,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        let (idb, host) = ids.u32("token ids")?;
        let t = host.len();
        args::embedding(host, table.len, dim, out.len)?;
        ensure!(
            table.parts.len() == 1 || table.row_len == dim,
            "embedding: table rows are not of length {dim}"
        );
        let vocab = table.len / dim;
        let outb = out.f32("embedding output")?;
        let key = PipelineKey {
            kernel: Kernel::Embedding,
            weights: Some(table.elem.weights()?),
            constants: Vec::new(),
        };
        for (r0, n) in self.windows(t, &[dim as u64 * 4])? {
            for (buf, v0, vn) in table.row_parts(vocab) {
                let params = [n as u32, dim as u32, r0 as u32, v0 as u32, vn as u32];
                self.gpu.dispatch(
                    &key,
                    &params,
                    &[Bind::whole(idb), Bind::whole(buf), rows(outb, r0, n, dim)],
                    self.grid(n * dim),
                )?;
            }
        }
        Ok(())
    }

    fn matmul(
        &self,
        x: &WgpuBuf,
        w: &WgpuBuf,
        bias: Option<&WgpuBuf>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        args::matmul(x.len, w.len, bias.map(|b| b.len), (m, k, n), out.len)?;
        ensure!(
            w.parts.len() == 1 || w.row_len == k,
            "matmul: weight rows are not of length {k}"
        );
        let bias_b = bias.map(|b| b.f32("bias")).transpose()?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let xb = x.f32("matmul input")?;
        let outb = out.f32("matmul output")?;
        for (r0, mm) in self.windows(m, &[k as u64 * 4, n as u64 * 4])? {
            self.matmul_window(xb, w, bias_b, r0, mm, k, n, outb)?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &WgpuBuf,
        w: &WgpuBuf,
        rows_n: usize,
        dim: usize,
        eps: f32,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        args::rms_norm(x.len, w.len, rows_n, dim, out.len)?;
        let (xb, wb, outb) = (
            x.f32("rms_norm input")?,
            w.f32("rms_norm weight")?,
            out.f32("rms_norm output")?,
        );
        let rb = dim as u64 * 4;
        for (r0, n) in self.windows(rows_n, &[rb])? {
            self.gpu.dispatch(
                &Kernel::RmsNorm.key(),
                &[n as u32, dim as u32, eps.to_bits()],
                &[
                    rows(xb, r0, n, dim),
                    Bind::whole(wb),
                    rows(outb, r0, n, dim),
                ],
                self.grid_groups(n),
            )?;
        }
        Ok(())
    }

    fn qk_norm(
        &self,
        qkv: &mut WgpuBuf,
        q_w: &WgpuBuf,
        k_w: &WgpuBuf,
        rows_n: usize,
        layout: QkvLayout,
        span: QkNormSpan,
        eps: f32,
    ) -> Result<()> {
        let stride = layout.row_len();
        let (nq, qs, nk, ks) = span.spans(layout);
        let spans = nq + nk;
        args::qk_norm(qkv.len, q_w.len, k_w.len, rows_n, layout, span)?;
        let (qb, qwb, kwb) = (
            qkv.f32("qkv")?,
            q_w.f32("q norm weight")?,
            k_w.f32("k norm weight")?,
        );
        for (r0, n) in self.windows(rows_n, &[stride as u64 * 4])? {
            self.gpu.dispatch(
                &Kernel::QkNorm.key(),
                &[
                    n as u32,
                    spans as u32,
                    nq as u32,
                    qs as u32,
                    ks as u32,
                    stride as u32,
                    eps.to_bits(),
                    span.own_weights() as u32,
                    span.centered() as u32,
                ],
                &[rows(qb, r0, n, stride), Bind::whole(qwb), Bind::whole(kwb)],
                self.grid_groups(n * spans),
            )?;
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut WgpuBuf, y: &WgpuBuf, n: usize) -> Result<()> {
        args::add_assign(x.len, y.len, n)?;
        let (xb, yb) = (x.f32("add_assign x")?, y.f32("add_assign y")?);
        for (e0, len) in self.windows(n, &[4])? {
            self.gpu.dispatch(
                &Kernel::Add.key(),
                &[len as u32],
                &[rows(xb, e0, len, 1), rows(yb, e0, len, 1)],
                self.grid(len),
            )?;
        }
        Ok(())
    }

    fn rope(
        &self,
        qkv: &mut WgpuBuf,
        positions: &WgpuBuf,
        cos: &WgpuBuf,
        sin: &WgpuBuf,
        rows_n: usize,
        layout: QkvLayout,
    ) -> Result<()> {
        let (pb, pos) = positions.u32("positions")?;
        let d = layout.head_dim;
        let half = d / 2;
        let stride = layout.row_len();
        args::rope(qkv.len, pos, cos.len, sin.len, rows_n, layout)?;
        let heads = layout.num_heads + layout.num_kv_heads;
        let (qb, cb, sb) = (qkv.f32("qkv")?, cos.f32("rope cos")?, sin.f32("rope sin")?);
        for (r0, n) in self.windows(rows_n, &[stride as u64 * 4])? {
            self.gpu.dispatch(
                &Kernel::Rope.key(),
                &[n as u32, r0 as u32, heads as u32, d as u32, stride as u32],
                &[
                    rows(qb, r0, n, stride),
                    Bind::whole(pb),
                    Bind::whole(cb),
                    Bind::whole(sb),
                ],
                self.grid(n * heads * half),
            )?;
        }
        Ok(())
    }

    fn gated_act(
        &self,
        gate_up: &WgpuBuf,
        rows_n: usize,
        ffn: usize,
        act: Activation,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        args::gated_act(gate_up.len, rows_n, ffn, out.len)?;
        let (gb, ob) = (gate_up.f32("gate_up")?, out.f32("gated_act output")?);
        for (r0, n) in self.windows(rows_n, &[2 * ffn as u64 * 4])? {
            self.gpu.dispatch(
                &Kernel::Act.key(),
                &[(n * ffn) as u32, ffn as u32, 0, act.code(), 0],
                &[rows(gb, r0, n, 2 * ffn), rows(ob, r0, n, ffn)],
                self.grid(n * ffn),
            )?;
        }
        Ok(())
    }

    fn act(&self, x: &mut WgpuBuf, n: usize, act: Activation) -> Result<()> {
        args::in_place("act", x.len, n)?;
        self.elementwise_in_place(x, n, 1, act.code(), 0.0)
    }

    fn scale(&self, x: &mut WgpuBuf, s: f32, n: usize) -> Result<()> {
        args::in_place("scale", x.len, n)?;
        self.elementwise_in_place(x, n, 2, 0, s)
    }

    fn softcap(&self, x: &mut WgpuBuf, cap: f32, n: usize) -> Result<()> {
        args::softcap(x.len, n, cap)?;
        self.elementwise_in_place(x, n, 3, 0, cap)
    }

    fn clamp(&self, x: &mut WgpuBuf, limit: f32, n: usize) -> Result<()> {
        args::clamp(x.len, n, limit)?;
        self.elementwise_in_place(x, n, 4, 0, limit)
    }

    fn layer_norm(
        &self,
        x: &WgpuBuf,
        w: &WgpuBuf,
        b: &WgpuBuf,
        rows_n: usize,
        dim: usize,
        eps: f32,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        args::layer_norm(x.len, w.len, b.len, rows_n, dim, out.len)?;
        let (xb, wb, bb, outb) = (
            x.f32("layer_norm input")?,
            w.f32("layer_norm weight")?,
            b.f32("layer_norm bias")?,
            out.f32("layer_norm output")?,
        );
        for (r0, n) in self.windows(rows_n, &[dim as u64 * 4])? {
            self.gpu.dispatch(
                &Kernel::LayerNorm.key(),
                &[n as u32, dim as u32, eps.to_bits()],
                &[
                    rows(xb, r0, n, dim),
                    Bind::whole(wb),
                    Bind::whole(bb),
                    rows(outb, r0, n, dim),
                ],
                self.grid_groups(n),
            )?;
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &WgpuBuf,
        rows_idx: &WgpuBuf,
        dim: usize,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        let (ib, idx) = rows_idx.u32("rows")?;
        args::gather_rows(x.len, idx, dim, out.len)?;
        let (xb, ob) = (x.f32("gather_rows input")?, out.f32("gather_rows output")?);
        ensure!(
            xb.size() <= self.gpu.max_binding,
            "gather_rows: the input ({} MiB) is larger than one storage binding",
            xb.size() >> 20
        );
        for (r0, n) in self.windows(idx.len(), &[dim as u64 * 4])? {
            self.gpu.dispatch(
                &Kernel::GatherRows.key(),
                &[n as u32, dim as u32, r0 as u32],
                &[Bind::whole(xb), Bind::whole(ib), rows(ob, r0, n, dim)],
                self.grid(n * dim),
            )?;
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        y: &WgpuBuf,
        rows_idx: &WgpuBuf,
        weights: &WgpuBuf,
        dim: usize,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        let (ib, idx) = rows_idx.u32("rows")?;
        args::scatter_add_rows(y.len, idx, weights.len, dim, out.len)?;
        let (yb, wb) = (y.f32("scatter_add_rows input")?, weights.f32("weights")?);
        let ob = out.f32("scatter_add_rows output")?;
        ensure!(
            yb.size().max(ob.size()) <= self.gpu.max_binding,
            "scatter_add_rows: the rows ({} MiB) are larger than one storage binding",
            yb.size().max(ob.size()) >> 20
        );
        self.gpu.dispatch(
            &Kernel::ScatterAddRows.key(),
            &[idx.len() as u32, dim as u32],
            &[
                Bind::whole(yb),
                Bind::whole(ib),
                Bind::whole(wb),
                Bind::whole(ob),
            ],
            self.grid(idx.len() * dim),
        )
    }

    fn lora(
        &self,
        x: &WgpuBuf,
        groups: &[LoraGroup<'_, Self>],
        k: usize,
        n: usize,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        // NOTE: two dispatches per adapter (a shader has no table of buffers to pick the
        // adapter's factors from), each row's sums in one fixed order.
        let mut lens = Vec::with_capacity(groups.len());
        for g in groups {
            let (_, rows) = g.rows.u32("lora rows")?;
            lens.push(args::LoraLens {
                rows,
                m: g.m,
                weights: g.weights.len,
                a: g.a.len,
                b: g.b.len,
                rank: g.rank,
            });
        }
        args::lora(&lens, k, n, x.len, out.len)?;
        let (xb, ob) = (x.f32("lora input")?, out.f32("lora output")?);
        ensure!(
            xb.size().max(ob.size()) <= self.gpu.max_binding,
            "lora: the rows ({} MiB) are larger than one storage binding",
            xb.size().max(ob.size()) >> 20
        );
        for g in groups {
            if g.m == 0 || g.rank == 0 {
                continue;
            }
            let (ib, _) = g.rows.u32("lora rows")?;
            let (ab, bb) = (g.a.whole("lora A")?, g.b.whole("lora B")?);
            let mid = self.alloc_scratch_f32(g.m * g.rank)?; // [m, rank]
            let midb = mid.f32("lora scratch")?;
            let (m, rank) = (g.m as u32, g.rank as u32);
            self.gpu.dispatch(
                &PipelineKey {
                    kernel: Kernel::LoraShrink,
                    weights: Some(g.a.elem.weights()?),
                    constants: Vec::new(),
                },
                &[m, k as u32, rank],
                &[
                    Bind::whole(xb),
                    Bind::whole(ab),
                    Bind::whole(ib),
                    Bind::whole(midb),
                ],
                self.grid(g.m * g.rank),
            )?;
            self.gpu.dispatch(
                &PipelineKey {
                    kernel: Kernel::LoraExpand,
                    weights: Some(g.b.elem.weights()?),
                    constants: Vec::new(),
                },
                &[m, n as u32, rank],
                &[
                    Bind::whole(midb),
                    Bind::whole(bb),
                    Bind::whole(ib),
                    Bind::whole(g.weights.f32("lora weights")?),
                    Bind::whole(ob),
                ],
                self.grid(g.m * n),
            )?;
        }
        Ok(())
    }

    fn write_kv(
        &self,
        qkv: &WgpuBuf,
        slot_mapping: &WgpuBuf,
        rows_n: usize,
        layout: QkvLayout,
        k_cache: &mut WgpuBuf,
        v_cache: &mut WgpuBuf,
        kv: KvLayout,
    ) -> Result<()> {
        self.write_kv_op(qkv, slot_mapping, rows_n, layout, k_cache, v_cache, kv)
    }

    fn paged_attention(
        &self,
        qkv: &WgpuBuf,
        k_cache: &WgpuBuf,
        v_cache: &WgpuBuf,
        batch: &DeviceBatch<Self>,
        layout: QkvLayout,
        kv: KvLayout,
        opts: AttentionOptions,
        out: &mut WgpuBuf,
    ) -> Result<()> {
        self.paged_attention_op(qkv, k_cache, v_cache, batch, layout, kv, opts, out)
    }

    fn argmax_rows(&self, logits: &WgpuBuf, rows_n: usize, cols: usize) -> Result<Vec<u32>> {
        args::argmax_rows(logits.len, rows_n, cols)?;
        if rows_n == 0 {
            return Ok(Vec::new());
        }
        let lb = logits.f32("logits")?;
        let out = self.gpu.buffer(rows_n as u64 * 4, "argmax")?;
        for (r0, n) in self.windows(rows_n, &[cols as u64 * 4])? {
            self.gpu.dispatch(
                &Kernel::Argmax.key(),
                &[n as u32, cols as u32, f32::NEG_INFINITY.to_bits()],
                &[rows(lb, r0, n, cols), rows(&out, r0, n, 1)],
                self.grid_groups(n),
            )?;
        }
        let bytes = self.gpu.read(&[Bind {
            buf: &out,
            offset: 0,
            size: rows_n as u64 * 4,
        }])?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}
