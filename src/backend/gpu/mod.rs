//! What the CUDA and HIP backends share: everything but the runtime API. [`GpuBackend`]
//! implements [`Backend`] once — buffers, the caching allocator, kernel compilation and
//! loading, launch geometry, argument checks — over a [`GpuRuntime`], which is the thin part
//! each vendor provides (memory, copies, the run-time compiler, module loading, launches, and
//! optionally a vendor GEMM). The kernels are the same `kernels/*.cu` sources for both.
//!
//! All work goes to one in-order stream (the legacy default stream), so a buffer returned to
//! the allocator can be handed out again at once: whatever reads it next is queued after
//! whatever used it before. Host copies are synchronous.

mod attention;
pub mod emu;
pub mod kernels;
mod matmul;
mod memory;
mod norm;
mod plan;
mod qmatmul;
mod runtime;
mod sample;

pub use memory::GpuBuf;
pub use runtime::{CclLibrary, Elem, GemmEx, GpuRuntime};

use super::{
    Activation, AttentionOptions, Backend, BatchInput, DeviceBatch, KvLayout, LoraGroup,
    QkNormSpan, QkvLayout, args,
};
use crate::sampling::{Choice, RowSampling};
use crate::tensor::{DType, HostTensor, e4m3_to_f32, f32_to_e4m3};
use anyhow::{Context, Result, bail, ensure};
use half::{bf16, f16};
use kernels::{KernelCache, SOURCES};
use memory::Pool;
use runtime::panic_text;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
// ---- kernels --------------------------------------------------------------------------------

/// A kernel argument: a device pointer (0 for "none") or a scalar.
#[derive(Clone, Copy)]
enum Arg {
    P(u64),
    U(u32),
    F(f32),
}

impl Arg {
    /// The argument's bytes at the start of a u64 (little-endian: a 4-byte parameter reads the
    /// low half).
    fn bits(self) -> u64 {
        match self {
            Arg::P(p) => p,
            Arg::U(u) => u as u64,
            Arg::F(f) => f.to_bits() as u64,
        }
    }
}

fn ptr_or_null<R: GpuRuntime>(b: Option<&GpuBuf<R>>) -> Arg {
    Arg::P(b.map_or(0, |b| b.ptr()))
}

const ELEMWISE_THREADS: u32 = 256;

/// Groups per launch, threads per block of the shrink and of the expand (`LORA_GROUPS`,
/// `LORA_SHRINK_THREADS`, `LORA_EXPAND_THREADS` in lora.cu).
const LORA_GROUPS: usize = 16;
const LORA_SHRINK_THREADS: u32 = 128;
const LORA_EXPAND_THREADS: u32 = 256;

/// lora.cu's `LoraGroups` for up to [`LORA_GROUPS`] groups: the pointers A, B, rows and
/// weights (16 each), then u32 `start[17]` (each group's first entry; the last, their total)
/// and `rank[16]`, packed into 81 words.
fn lora_groups<R: GpuRuntime>(groups: &[&LoraGroup<'_, GpuBackend<R>>]) -> Result<Vec<u64>> {
    ensure!(
        groups.len() <= LORA_GROUPS,
        "lora: more than {LORA_GROUPS} groups in a launch"
    );
    let mut words = vec![0u64; 4 * LORA_GROUPS];
    let mut small = [0u32; 2 * LORA_GROUPS + 2];
    let mut start = 0;
    for (i, g) in groups.iter().enumerate() {
        words[i] = g.a.ptr();
        words[LORA_GROUPS + i] = g.b.ptr();
        words[2 * LORA_GROUPS + i] = g.rows.ptr();
        words[3 * LORA_GROUPS + i] = g.weights.ptr();
        small[i] = start;
        start += u32::try_from(g.m).context("lora: rows")?;
        small[LORA_GROUPS + 1 + i] = u32::try_from(g.rank).context("lora: rank")?;
    }
    // NOTE: the unused groups start where the last ends, so no entry falls in them.
    for s in &mut small[groups.len()..=LORA_GROUPS] {
        *s = start;
    }
    words.extend(small.chunks(2).map(|p| p[0] as u64 | (p[1] as u64) << 32));
    Ok(words)
}

/// How matmuls are computed (`PAGODA_GPU_GEMM`): vendor BLAS where there is one (default), or
/// our kernels only (`kernel`), which is how HIP runs and lets CUDA check those kernels too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPath {
    Auto,
    Kernel,
}

pub struct GpuBackend<R: GpuRuntime> {
    rt: Arc<R>,
    pool: Arc<Pool<R>>,
    funcs: HashMap<String, R::Function>,
    /// prefill attention on tensor cores ([`GpuRuntime::tensor_cores`]), unless
    /// `PAGODA_GPU_ATTENTION=general` keeps it on the SIMT kernel (to measure one against the other)
    mma_attention: bool,
    gemm_path: GemmPath,
    profile: Option<OpProfile>,
}

/// Time per kernel (`PAGODA_PROFILE_OPS=1`): the device is synchronised before and after each
/// launch and the host clock read between, so each figure is the kernel's time plus one launch
/// latency (a few microseconds; the steps run slower while profiling). Printed to stderr,
/// largest first, when the backend is dropped.
#[derive(Default)]
struct OpProfile {
    ops: Mutex<HashMap<String, (u64, f64)>>,
}

impl OpProfile {
    fn table(&self) -> String {
        let ops = self.ops.lock().unwrap();
        let total: f64 = ops.values().map(|v| v.1).sum();
        let mut rows: Vec<_> = ops.iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let mut out = format!(
            "op profile (synchronised per launch): {:.3} ms in {} launches\n{:<40} {:>8} {:>11} {:>10} {:>6}\n",
            total * 1e3,
            ops.values().map(|v| v.0).sum::<u64>(),
            "kernel",
            "calls",
            "total ms",
            "mean us",
            "share"
        );
        for (name, &(n, secs)) in rows {
            out.push_str(&format!(
                "{name:<40} {n:>8} {:>11.3} {:>10.1} {:>5.1}%\n",
                secs * 1e3,
                secs * 1e6 / n as f64,
                100.0 * secs / total.max(f64::MIN_POSITIVE)
            ));
        }
        out
    }
}

impl<R: GpuRuntime> Drop for GpuBackend<R> {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.table());
        }
    }
}

impl<R: GpuRuntime> GpuBackend<R> {
    /// Opens device `device` and compiles the kernels for it (or takes them from the disk
    /// cache). A runtime library that panics while it loads (cudarc and cubecl-hip-sys do
    /// when a library or a symbol is missing) is an error, never an abort.
    pub fn on_device(device: usize) -> Result<Self> {
        let rt = std::panic::catch_unwind(|| R::open(device)).map_err(|p| {
            anyhow::anyhow!(
                "{}: the runtime libraries failed to load: {}",
                R::API,
                panic_text(&p)
            )
        })??;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            GpuBackend::with_runtime(rt)
        }))
        .map_err(|p| anyhow::anyhow!("{}: backend creation failed: {}", R::API, panic_text(&p)))?
    }

    /// Compiles (or takes from the disk cache) every kernel file for the device and loads it.
    pub fn with_runtime(rt: R) -> Result<Self> {
        let rt = Arc::new(rt);
        rt.bind()?;
        let cache = KernelCache::from_env();
        let arch = rt.arch();
        let tensor_cores = rt.tensor_cores();
        let opts = rt.compile_options();
        ensure!(
            opts.iter().any(|o| o == kernels::TENSOR_CORES_DEFINE) == tensor_cores,
            "{}: the kernels' compile options disagree with the device about tensor cores",
            R::API
        );
        let compiler = rt.compiler_id();
        let t0 = std::time::Instant::now();
        // NOTE: files compile in parallel; a cold start is then as long as the slowest file.
        let results: Vec<Result<(&str, Vec<u8>, bool)>> = std::thread::scope(|s| {
            let handles: Vec<_> = SOURCES
                .iter()
                .map(|(stem, src)| {
                    let (rt, cache, arch, opts, compiler) = (&rt, &cache, &arch, &opts, &compiler);
                    s.spawn(move || -> Result<(&str, Vec<u8>, bool)> {
                        let source = kernels::prepare(stem, src, R::DIALECT, tensor_cores);
                        let key = kernels::cache_key(R::API, compiler, arch, opts, &source);
                        let (bin, cached) =
                            cache.get_or_compile(stem, arch, &key, rt.binary_ext(), || {
                                rt.compile(&format!("{stem}.cu"), &source, opts)
                            })?;
                        Ok((stem, bin, cached))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("kernel compilation panicked")))
                })
                .collect()
        });
        let mut funcs = HashMap::new();
        let mut compiled = 0;
        for r in results {
            let (stem, bin, cached) = r?;
            compiled += usize::from(!cached);
            let names = kernels::kernel_names(stem, tensor_cores);
            let fs = rt
                .load(&bin, &names)
                .with_context(|| format!("loading kernels/{stem}.cu for {arch}"))?;
            funcs.extend(names.into_iter().zip(fs));
        }
        tracing::info!(
            "{}: kernels for {arch} ready in {:.2} s ({compiled} of {} files compiled, the rest from {})",
            R::API,
            t0.elapsed().as_secs_f64(),
            SOURCES.len(),
            cache
                .dir()
                .map_or("nowhere".to_string(), |d| d.display().to_string())
        );
        let gemm_path = match std::env::var("PAGODA_GPU_GEMM").as_deref() {
            Ok("kernel") => GemmPath::Kernel,
            _ => GemmPath::Auto,
        };
        let profile = std::env::var("PAGODA_PROFILE_OPS")
            .is_ok_and(|v| !v.is_empty() && v != "0")
            .then(OpProfile::default);
        Ok(GpuBackend {
            pool: Arc::new(Pool {
                rt: rt.clone(),
                free: Mutex::new(HashMap::new()),
            }),
            rt,
            funcs,
            mma_attention: tensor_cores
                && std::env::var("PAGODA_GPU_ATTENTION").as_deref() != Ok("general"),
            gemm_path,
            profile,
        })
    }

    pub fn runtime(&self) -> &R {
        &self.rt
    }

    /// The runtime, to keep beyond the backend's borrow.
    pub fn runtime_arc(&self) -> Arc<R> {
        self.rt.clone()
    }

    /// Forces our own GEMM kernels (`GemmPath::Kernel`) or lets vendor BLAS take the larger
    /// products (`GemmPath::Auto`).
    pub fn set_gemm_path(&mut self, p: GemmPath) {
        self.gemm_path = p;
    }

    pub fn gemm_path(&self) -> GemmPath {
        self.gemm_path
    }

    /// Waits for all queued work (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.rt.synchronize()
    }

    fn alloc(&self, len: usize, elem: Elem, zero: bool) -> Result<GpuBuf<R>> {
        self.rt.bind()?;
        let bytes = len * elem.size();
        let mem = self.pool.alloc(bytes)?;
        if bytes > 0 {
            // SAFETY: the allocation holds at least `bytes`.
            unsafe {
                if zero {
                    self.rt.memset_zero(mem.ptr, bytes)?
                } else {
                    self.rt.fill_uninit(mem.ptr, bytes)?
                }
            };
        }
        Ok(GpuBuf {
            mem,
            offset: 0,
            len,
            elem,
            host: None,
            quant: None,
        })
    }

    fn upload_bytes(&self, bytes: &[u8], len: usize, elem: Elem) -> Result<GpuBuf<R>> {
        let buf = self.alloc(len, elem, false)?;
        if !bytes.is_empty() {
            // SAFETY: the allocation holds `len * elem.size() == bytes.len()` bytes.
            unsafe { self.rt.htod(buf.ptr(), bytes)? };
        }
        Ok(buf)
    }

    fn download_bytes(&self, buf: &GpuBuf<R>) -> Result<Vec<u8>> {
        ensure!(
            buf.elem != Elem::Blocks,
            "a weight in blocks cannot be read back"
        );
        self.rt.bind()?;
        let mut out = vec![0u8; buf.len * buf.elem.size()];
        if !out.is_empty() {
            // SAFETY: the buffer holds that many bytes.
            unsafe { self.rt.dtoh(&mut out, buf.ptr())? };
        }
        Ok(out)
    }

    fn launch(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_with(name, grid, block, shared, args, &[])
    }

    /// [`Self::launch`] with a last parameter passed by value whose bytes are `tail` (a struct
    /// of the kernel's; none when empty).
    fn launch_with(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        args: &[Arg],
        tail: &[u64],
    ) -> Result<()> {
        let f = *self
            .funcs
            .get(name)
            .with_context(|| format!("{}: no kernel named {name}", R::API))?;
        if grid.contains(&0) {
            return Ok(());
        }
        let mut vals: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut tail = tail.to_vec();
        let mut ptrs: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        if !tail.is_empty() {
            ptrs.push(tail.as_mut_ptr() as *mut c_void);
        }
        self.timed(name, || {
            // SAFETY: every op below passes the arguments of the kernel it names, in order,
            // with buffer sizes checked beforehand.
            unsafe { self.rt.launch(f, grid, block, shared, &mut ptrs) }
                .with_context(|| format!("{}: launching {name}", R::API))
        })
    }

    /// Runs `f`, timed under `name` when profiling (see [`OpProfile`]).
    fn timed(&self, name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let Some(p) = &self.profile else {
            return f();
        };
        self.rt.synchronize()?;
        let t0 = std::time::Instant::now();
        f()?;
        self.rt.synchronize()?;
        let secs = t0.elapsed().as_secs_f64();
        let mut ops = p.ops.lock().unwrap();
        let e = ops.entry(name.to_string()).or_default();
        e.0 += 1;
        e.1 += secs;
        Ok(())
    }

    /// Blocks for a grid-stride loop over `n` elements.
    fn blocks_for(&self, n: usize) -> u32 {
        let max = self.rt.multiprocessors().max(1) as usize * 32;
        n.div_ceil(ELEMWISE_THREADS as usize).clamp(1, max) as u32
    }

    fn elementwise(&self, name: &str, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.launch(
            name,
            [self.blocks_for(n), 1, 1],
            [ELEMWISE_THREADS, 1, 1],
            0,
            args,
        )
    }

    fn norm_threads(&self, dim: usize) -> u32 {
        let w = self.rt.warp_size() as usize;
        (dim.div_ceil(4).div_ceil(w) * w).clamp(w, 1024) as u32
    }
}

/// Float buffer bytes as f32.
fn widen(elem: Elem, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match elem {
        Elem::F32 => from_bytes::<f32>(bytes),
        Elem::F16 => from_bytes::<f16>(bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        Elem::BF16 => from_bytes::<bf16>(bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        Elem::F8 => bytes.iter().map(|&b| e4m3_to_f32(b)).collect(),
        Elem::U32 => bail!("expected a float buffer, got a u32 one"),
        Elem::Blocks => bail!("expected a float buffer, got one of blocks"),
    })
}

/// f32 values as a float buffer's bytes (halves rounded to nearest even, fp8 also saturated,
/// as the kernels do).
fn narrow(elem: Elem, v: &[f32]) -> Result<std::borrow::Cow<'_, [u8]>> {
    Ok(match elem {
        Elem::F32 => std::borrow::Cow::Borrowed(bytemuck::cast_slice(v)),
        Elem::F16 => {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            std::borrow::Cow::Owned(bytemuck::cast_slice(&h).to_vec())
        }
        Elem::BF16 => {
            let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            std::borrow::Cow::Owned(bytemuck::cast_slice(&h).to_vec())
        }
        Elem::F8 => std::borrow::Cow::Owned(v.iter().map(|&x| f32_to_e4m3(x)).collect()),
        Elem::U32 => bail!("expected a float buffer, got a u32 one"),
        Elem::Blocks => bail!("expected a float buffer, got one of blocks"),
    })
}

/// Copies bytes into a vector of `T` (the bytes need not be aligned for `T`).
fn from_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v)
        .copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
    v
}

/// Views of one allocation holding every batch array, each part 256-byte aligned.
fn pack_u32(parts: &[&[u32]]) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::new();
    let mut offsets = Vec::with_capacity(parts.len());
    for p in parts {
        offsets.push(bytes.len());
        bytes.extend_from_slice(bytemuck::cast_slice(p));
        bytes.resize(bytes.len().div_ceil(256) * 256, 0);
    }
    (bytes, offsets)
}

/// The checks of `rope`: sizes, tables, and every position inside them.
fn check_rope<R: GpuRuntime>(
    qkv: &GpuBuf<R>,
    positions: &GpuBuf<R>,
    cos: &GpuBuf<R>,
    sin: &GpuBuf<R>,
    rows: usize,
    layout: QkvLayout,
) -> Result<()> {
    let pos = positions.host_u32("rope")?;
    args::rope(qkv.len, pos, cos.len, sin.len, rows, layout)
}

/// The checks of `write_kv`: sizes, and every slot inside the pool.
fn check_write_kv<R: GpuRuntime>(
    qkv: &GpuBuf<R>,
    slot_mapping: &GpuBuf<R>,
    rows: usize,
    layout: QkvLayout,
    k_cache: &GpuBuf<R>,
    v_cache: &GpuBuf<R>,
    kv: KvLayout,
) -> Result<()> {
    let slots = slot_mapping.host_u32("write_kv")?;
    args::write_kv(qkv.len, slots, rows, layout, (k_cache.len, v_cache.len), kv)?;
    ensure!(
        k_cache.elem == v_cache.elem,
        "write_kv: K and V caches of different types"
    );
    Ok(())
}

fn u32_arg(v: usize, what: &str) -> Result<Arg> {
    Ok(Arg::U(u32::try_from(v).with_context(|| {
        format!("{what} ({v}) does not fit in 32 bits")
    })?))
}

impl<R: GpuRuntime> Backend for GpuBackend<R> {
    type Buf = GpuBuf<R>;

    fn name(&self) -> String {
        format!(
            "{}: {} ({}, {} multiprocessors)",
            R::API,
            self.rt.device_name(),
            self.rt.arch(),
            self.rt.multiprocessors()
        )
    }

    fn device_memory(&self) -> Option<u64> {
        self.rt.mem_info().ok().map(|(_, total)| total)
    }

    fn free_device_memory(&self) -> Option<u64> {
        self.rt.bind().ok()?;
        self.rt.mem_info().ok().map(|(free, _)| free)
    }

    fn upload_weight(&self, t: &HostTensor, dtype: DType) -> Result<GpuBuf<R>> {
        let n = t.data.len();
        match dtype {
            DType::F32 => self.upload_bytes(bytemuck::cast_slice(&t.data), n, Elem::F32),
            DType::F16 => {
                let v: Vec<f16> = t.data.iter().map(|&x| f16::from_f32(x)).collect();
                self.upload_bytes(bytemuck::cast_slice(&v), n, Elem::F16)
            }
            DType::BF16 => {
                let v: Vec<bf16> = t.data.iter().map(|&x| bf16::from_f32(x)).collect();
                self.upload_bytes(bytemuck::cast_slice(&v), n, Elem::BF16)
            }
            DType::F8E4M3 => bail!("fp8 is a KV cache type, not one for weights"),
        }
    }

    fn supports_quant(&self) -> bool {
        true
    }

    fn keeps_quant(&self, ty: crate::quant::GgmlType) -> bool {
        self.has_block_kernel(ty)
    }

    fn upload_quant(&self, t: crate::quant::QuantTensor) -> Result<GpuBuf<R>> {
        self.upload_quant_op(t)
    }

    fn upload_f32(&self, data: &[f32]) -> Result<GpuBuf<R>> {
        self.upload_bytes(bytemuck::cast_slice(data), data.len(), Elem::F32)
    }

    fn upload_u32(&self, data: &[u32]) -> Result<GpuBuf<R>> {
        let mut b = self.upload_bytes(bytemuck::cast_slice(data), data.len(), Elem::U32)?;
        b.host = Some(Arc::new(data.to_vec()));
        Ok(b)
    }

    fn upload_batch(&self, host: BatchInput) -> Result<DeviceBatch<Self>> {
        // NOTE: one allocation and one copy for the seven arrays instead of seven of each.
        let parts: [&[u32]; 7] = [
            &host.token_ids,
            &host.positions,
            &host.slot_mapping,
            &host.query_start,
            &host.seq_lens,
            &host.block_tables,
            &host.logits_rows,
        ];
        let (bytes, offsets) = pack_u32(&parts);
        let all = self.upload_bytes(&bytes, bytes.len() / 4, Elem::U32)?;
        let view = |i: usize| GpuBuf {
            mem: all.mem.clone(),
            offset: offsets[i],
            len: parts[i].len(),
            elem: Elem::U32,
            host: Some(Arc::new(parts[i].to_vec())),
            quant: None,
        };
        Ok(DeviceBatch {
            shape: host.shape()?,
            token_ids: view(0),
            positions: view(1),
            slot_mapping: view(2),
            query_start: view(3),
            seq_lens: view(4),
            block_tables: view(5),
            logits_rows: view(6),
            host,
        })
    }

    fn alloc_f32(&self, n: usize) -> Result<GpuBuf<R>> {
        self.alloc(n, Elem::F32, true)
    }

    fn alloc_scratch_f32(&self, n: usize) -> Result<GpuBuf<R>> {
        self.alloc(n, Elem::F32, false)
    }

    fn kv_cache_dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::BF16, DType::F16, DType::F8E4M3]
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<GpuBuf<R>> {
        self.alloc(layout.numel(), Elem::of(layout.dtype), true)
    }

    fn read_kv_blocks(
        &self,
        cache: &GpuBuf<R>,
        block_len: usize,
        blocks: &[u32],
    ) -> Result<Vec<f32>> {
        self.rt.bind()?;
        let bytes = block_len * cache.elem.size();
        args::kv_blocks("read_kv_blocks", blocks, block_len, cache.len)?;
        let mut out = vec![0u8; blocks.len() * bytes];
        for (&b, dst) in blocks.iter().zip(out.chunks_exact_mut(bytes.max(1))) {
            // SAFETY: the block lies inside the buffer (checked above).
            unsafe {
                self.rt
                    .dtoh(dst, cache.ptr() + (b as usize * bytes) as u64)?
            };
        }
        widen(cache.elem, &out)
    }

    fn write_kv_blocks(
        &self,
        cache: &mut GpuBuf<R>,
        block_len: usize,
        blocks: &[u32],
        data: &[f32],
    ) -> Result<()> {
        args::kv_blocks_data(data, blocks, block_len)?;
        args::kv_blocks("write_kv_blocks", blocks, block_len, cache.len)?;
        self.rt.bind()?;
        let bytes = block_len * cache.elem.size();
        let src = narrow(cache.elem, data)?;
        for (&b, chunk) in blocks.iter().zip(src.chunks_exact(bytes.max(1))) {
            // SAFETY: the block lies inside the buffer (checked above).
            unsafe {
                self.rt
                    .htod(cache.ptr() + (b as usize * bytes) as u64, chunk)?
            };
        }
        Ok(())
    }

    fn download_f32(&self, buf: &GpuBuf<R>) -> Result<Vec<f32>> {
        let bytes = self.download_bytes(buf)?;
        Ok(match buf.elem {
            Elem::U32 => from_bytes::<u32>(&bytes)
                .iter()
                .map(|&x| x as f32)
                .collect(),
            e => widen(e, &bytes)?,
        })
    }

    fn len(&self, buf: &GpuBuf<R>) -> usize {
        buf.len
    }

    fn embedding(
        &self,
        table: &GpuBuf<R>,
        ids: &GpuBuf<R>,
        dim: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        let host = ids.host_u32("embedding")?;
        let n = ids.len;
        out.expect(Elem::F32, "embedding")?;
        args::embedding(host, table.len, dim, out.len)?;
        if table.elem == Elem::Blocks {
            return self.qembedding_op(table, ids, dim, out);
        }
        let name = format!("embedding_{}", table.elem.kernel_suffix()?);
        self.elementwise(
            &name,
            n * dim,
            &[
                Arg::P(table.ptr()),
                Arg::P(ids.ptr()),
                Arg::P(out.ptr()),
                u32_arg(n, "tokens")?,
                u32_arg(dim, "dim")?,
            ],
        )
    }

    fn matmul(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        bias: Option<&GpuBuf<R>>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.matmul_op(x, w, bias, m, k, n, out)
    }

    fn rms_norm(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rms_norm_op(x, w, rows, dim, eps, out)
    }

    fn qk_norm(
        &self,
        qkv: &mut GpuBuf<R>,
        q_w: &GpuBuf<R>,
        k_w: &GpuBuf<R>,
        rows: usize,
        layout: QkvLayout,
        span: QkNormSpan,
        eps: f32,
    ) -> Result<()> {
        self.qk_norm_op(qkv, q_w, k_w, rows, (layout, span), eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        x: &mut GpuBuf<R>,
        y: &GpuBuf<R>,
        w: &GpuBuf<R>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.add_rms_norm_op(x, y, w, rows, dim, eps, out)
    }

    fn add_assign(&self, x: &mut GpuBuf<R>, y: &GpuBuf<R>, n: usize) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "add_assign x")?;
        y.expect(Elem::F32, "add_assign y")?;
        args::add_assign(x.len, y.len, n)?;
        self.elementwise(
            "add_assign_f32",
            n,
            &[Arg::P(x.ptr()), Arg::P(y.ptr()), u32_arg(n, "n")?],
        )
    }

    fn rope(
        &self,
        qkv: &mut GpuBuf<R>,
        positions: &GpuBuf<R>,
        cos: &GpuBuf<R>,
        sin: &GpuBuf<R>,
        rows: usize,
        layout: QkvLayout,
    ) -> Result<()> {
        self.rt.bind()?;
        check_rope(qkv, positions, cos, sin, rows, layout)?;
        let (d, half, stride) = (layout.head_dim, layout.head_dim / 2, layout.row_len());
        let heads = layout.num_heads + layout.num_kv_heads;
        self.elementwise(
            "rope_f32",
            rows * heads * half,
            &[
                Arg::P(qkv.ptr()),
                Arg::P(positions.ptr()),
                Arg::P(cos.ptr()),
                Arg::P(sin.ptr()),
                u32_arg(rows, "rows")?,
                u32_arg(heads, "heads")?,
                u32_arg(d, "head_dim")?,
                u32_arg(stride, "row length")?,
            ],
        )
    }

    fn gated_act(
        &self,
        gate_up: &GpuBuf<R>,
        rows: usize,
        ffn: usize,
        act: Activation,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        args::gated_act(gate_up.len, rows, ffn, out.len)?;
        self.elementwise(
            "gated_act_f32",
            rows * ffn,
            &[
                Arg::P(gate_up.ptr()),
                Arg::P(out.ptr()),
                u32_arg(rows, "rows")?,
                u32_arg(ffn, "ffn")?,
                Arg::U(act.code()),
            ],
        )
    }

    fn matmul_gated_act(
        &self,
        x: &GpuBuf<R>,
        w_gate_up: &GpuBuf<R>,
        rows: usize,
        k: usize,
        ffn: usize,
        act: Activation,
        gate_up: &mut GpuBuf<R>,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.matmul_gated_act_op(x, w_gate_up, rows, k, ffn, act, gate_up, out)
    }

    fn act(&self, x: &mut GpuBuf<R>, n: usize, act: Activation) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "act x")?;
        args::in_place("act", x.len, n)?;
        self.elementwise(
            "act_f32",
            n,
            &[Arg::P(x.ptr()), u32_arg(n, "n")?, Arg::U(act.code())],
        )
    }

    fn scale(&self, x: &mut GpuBuf<R>, s: f32, n: usize) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "scale x")?;
        args::in_place("scale", x.len, n)?;
        self.elementwise(
            "scale_f32",
            n,
            &[Arg::P(x.ptr()), u32_arg(n, "n")?, Arg::F(s)],
        )
    }

    fn clamp(&self, x: &mut GpuBuf<R>, limit: f32, n: usize) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "clamp x")?;
        args::clamp(x.len, n, limit)?;
        self.elementwise(
            "clamp_f32",
            n,
            &[Arg::P(x.ptr()), u32_arg(n, "n")?, Arg::F(limit)],
        )
    }

    fn softcap(&self, x: &mut GpuBuf<R>, cap: f32, n: usize) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "softcap x")?;
        args::softcap(x.len, n, cap)?;
        self.elementwise(
            "softcap_f32",
            n,
            &[Arg::P(x.ptr()), u32_arg(n, "n")?, Arg::F(cap)],
        )
    }

    fn layer_norm(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        b: &GpuBuf<R>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.layer_norm_op(x, w, b, rows, dim, eps, out)
    }

    fn gather_rows(
        &self,
        x: &GpuBuf<R>,
        rows: &GpuBuf<R>,
        dim: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        let idx = rows.host_u32("gather_rows")?;
        args::gather_rows(x.len, idx, dim, out.len)?;
        self.elementwise(
            "gather_rows_f32",
            idx.len() * dim,
            &[
                Arg::P(x.ptr()),
                Arg::P(rows.ptr()),
                Arg::P(out.ptr()),
                u32_arg(idx.len(), "rows")?,
                u32_arg(dim, "dim")?,
            ],
        )
    }

    fn scatter_add_rows(
        &self,
        y: &GpuBuf<R>,
        rows: &GpuBuf<R>,
        weights: &GpuBuf<R>,
        dim: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        let idx = rows.host_u32("scatter_add_rows")?;
        args::scatter_add_rows(y.len, idx, weights.len, dim, out.len)?;
        self.elementwise(
            "scatter_add_rows_f32",
            idx.len() * dim,
            &[
                Arg::P(y.ptr()),
                Arg::P(rows.ptr()),
                Arg::P(weights.ptr()),
                Arg::P(out.ptr()),
                u32_arg(idx.len(), "rows")?,
                u32_arg(dim, "dim")?,
            ],
        )
    }

    fn lora(
        &self,
        x: &GpuBuf<R>,
        groups: &[LoraGroup<'_, Self>],
        k: usize,
        n: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        let mut lens = Vec::with_capacity(groups.len());
        for g in groups {
            let rows = g.rows.host_u32("lora")?;
            g.weights.expect(Elem::F32, "lora")?;
            ensure!(
                matches!(g.a.elem(), Elem::F32 | Elem::F16 | Elem::BF16),
                "lora: factors of type {:?} (f32, f16 or bf16 expected)",
                g.a.elem()
            );
            ensure!(
                g.a.elem() == g.b.elem(),
                "lora: factors of types {:?} and {:?} (one type expected)",
                g.a.elem(),
                g.b.elem()
            );
            lens.push(args::LoraLens {
                rows,
                m: g.m,
                weights: g.weights.len(),
                a: g.a.len(),
                b: g.b.len(),
                rank: g.rank,
            });
        }
        args::lora(&lens, k, n, x.len(), out.len())?;
        let col_blocks = n.div_ceil(LORA_EXPAND_THREADS as usize);
        ensure!(
            col_blocks <= 65535,
            "lora: {n} output columns are more than one launch's grid holds"
        );
        // NOTE: two launches for up to LORA_GROUPS adapters of one weight type, their groups
        // passed by value (a struct parameter), so no table is uploaded per call.
        for elem in [Elem::F32, Elem::F16, Elem::BF16] {
            let same: Vec<&LoraGroup<Self>> =
                groups.iter().filter(|g| g.a.elem() == elem).collect();
            for chunk in same.chunks(LORA_GROUPS) {
                let entries: usize = chunk.iter().map(|g| g.m).sum();
                let max_rank = chunk.iter().map(|g| g.rank).max().unwrap_or(0);
                if entries == 0 || max_rank == 0 {
                    continue;
                }
                let words = lora_groups(chunk)?;
                let mid = self.alloc_scratch_f32(entries * max_rank)?; // [entries, max_rank]
                let sfx = elem.kernel_suffix()?;
                let (e, r) = (
                    u32::try_from(entries).context("lora: rows")?,
                    u32_arg(max_rank, "lora rank")?,
                );
                self.launch_with(
                    &format!("lora_shrink_{sfx}"),
                    [e, 1, 1],
                    [LORA_SHRINK_THREADS, 1, 1],
                    0,
                    &[Arg::P(x.ptr()), Arg::P(mid.ptr()), u32_arg(k, "k")?, r],
                    &words,
                )?;
                self.launch_with(
                    &format!("lora_expand_{sfx}"),
                    [e, col_blocks as u32, 1],
                    [LORA_EXPAND_THREADS, 1, 1],
                    0,
                    &[Arg::P(mid.ptr()), Arg::P(out.ptr()), u32_arg(n, "n")?, r],
                    &words,
                )?;
            }
        }
        Ok(())
    }

    fn write_kv(
        &self,
        qkv: &GpuBuf<R>,
        slot_mapping: &GpuBuf<R>,
        rows: usize,
        layout: QkvLayout,
        k_cache: &mut GpuBuf<R>,
        v_cache: &mut GpuBuf<R>,
        kv: KvLayout,
    ) -> Result<()> {
        self.rt.bind()?;
        check_write_kv(qkv, slot_mapping, rows, layout, k_cache, v_cache, kv)?;
        self.elementwise(
            &format!("write_kv_{}", k_cache.elem.kernel_suffix()?),
            rows * layout.kv_len(),
            &[
                Arg::P(qkv.ptr()),
                Arg::P(slot_mapping.ptr()),
                Arg::P(k_cache.ptr()),
                Arg::P(v_cache.ptr()),
                u32_arg(rows, "rows")?,
                u32_arg(layout.num_kv_heads, "kv heads")?,
                u32_arg(layout.head_dim, "head_dim")?,
                u32_arg(kv.block_size, "block size")?,
                u32_arg(layout.row_len(), "row length")?,
                u32_arg(layout.q_len(), "q length")?,
            ],
        )
    }

    fn rope_write_kv(
        &self,
        qkv: &mut GpuBuf<R>,
        positions: &GpuBuf<R>,
        cos: &GpuBuf<R>,
        sin: &GpuBuf<R>,
        slot_mapping: &GpuBuf<R>,
        rows: usize,
        layout: QkvLayout,
        k_cache: &mut GpuBuf<R>,
        v_cache: &mut GpuBuf<R>,
        kv: KvLayout,
    ) -> Result<()> {
        self.rt.bind()?;
        check_rope(qkv, positions, cos, sin, rows, layout)?;
        check_write_kv(qkv, slot_mapping, rows, layout, k_cache, v_cache, kv)?;
        let heads = layout.num_heads + 2 * layout.num_kv_heads;
        self.elementwise(
            &format!("rope_write_kv_{}", k_cache.elem.kernel_suffix()?),
            rows * heads * (layout.head_dim / 2),
            &[
                Arg::P(qkv.ptr()),
                Arg::P(positions.ptr()),
                Arg::P(cos.ptr()),
                Arg::P(sin.ptr()),
                Arg::P(slot_mapping.ptr()),
                Arg::P(k_cache.ptr()),
                Arg::P(v_cache.ptr()),
                u32_arg(rows, "rows")?,
                u32_arg(layout.num_heads, "heads")?,
                u32_arg(layout.num_kv_heads, "kv heads")?,
                u32_arg(layout.head_dim, "head_dim")?,
                u32_arg(kv.block_size, "block size")?,
            ],
        )
    }

    fn paged_attention(
        &self,
        qkv: &GpuBuf<R>,
        k_cache: &GpuBuf<R>,
        v_cache: &GpuBuf<R>,
        batch: &DeviceBatch<Self>,
        layout: QkvLayout,
        kv: KvLayout,
        opts: AttentionOptions,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.attend(qkv, k_cache, v_cache, batch, layout, kv, opts, out)
    }

    fn argmax_rows(&self, logits: &GpuBuf<R>, rows: usize, cols: usize) -> Result<Vec<u32>> {
        self.argmax_rows_op(logits, rows, cols)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn sample_rows(
        &self,
        logits: &mut GpuBuf<R>,
        cols: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<Choice>> {
        self.sample_rows_op(logits, cols, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_arrays_pack_aligned() {
        let (bytes, offs) = pack_u32(&[&[1, 2, 3], &[], &[7; 100]]);
        assert_eq!(offs, vec![0, 256, 256]);
        assert_eq!(bytes.len(), 256 + 512);
        assert_eq!(&bytes[..4], &1u32.to_le_bytes());
        assert_eq!(&bytes[256..260], &7u32.to_le_bytes());
    }
}
