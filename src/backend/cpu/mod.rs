//! The CPU backend: the reference every other backend is checked against, and the default where
//! no GPU exists. Multi-threaded with rayon; batch-invariant matmuls of our own (see matmul.rs); paged attention
//! reads K and V through the block tables in place, never gathering them into a contiguous copy.

mod attention;
mod exp;
pub mod matmul;
pub mod qmatmul;
pub(crate) mod simd;

use attention::{AttnArgs, AttnTask, Scratch};
use matmul::{Elem, Packed, Weights};

use super::{
    Activation, AttentionOptions, Backend, DeviceBatch, KvLayout, LoraGroup, QkNormSpan, QkvLayout,
    args,
};
use crate::quant::QuantTensor;
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail, ensure};
use half::{bf16, f16};
use rayon::prelude::*;

/// CPU device memory: a host vector of one element type, or a weight matrix.
pub enum CpuBuf {
    F32(Vec<f32>),
    U32(Vec<u32>),
    /// A KV cache in half precision (`--kv-cache-dtype f16|bf16`).
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// A dense weight matrix in panels (see matmul.rs), in its storage type.
    PackedF32(Packed<f32>),
    PackedF16(Packed<f16>),
    PackedBF16(Packed<bf16>),
    /// A linear weight kept in GGML block formats (see qmatmul.rs).
    Quant(QuantTensor),
}

/// A dense weight `[n, k]` as the matmul reads it, its shape checked.
fn dense(w: &CpuBuf, n: usize, k: usize) -> Result<Weights<'_>> {
    let (wn, wk, w) = match w {
        CpuBuf::PackedF32(p) => (p.n, p.k, Weights::F32(p)),
        CpuBuf::PackedF16(p) => (p.n, p.k, Weights::F16(p)),
        CpuBuf::PackedBF16(p) => (p.n, p.k, Weights::BF16(p)),
        _ => bail!("cpu backend: expected a dense matrix uploaded with upload_weight"),
    };
    ensure!(
        wn == n && wk == k,
        "cpu backend: a {wn}x{wk} matrix where {n}x{k} was expected"
    );
    Ok(w)
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks given one write to disjoint parts of the buffer it points into.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl CpuBuf {
    fn f32(&self) -> Result<&[f32]> {
        match self {
            CpuBuf::F32(v) => Ok(v),
            _ => bail!("cpu backend: expected an f32 buffer"),
        }
    }
    fn f32_mut(&mut self) -> Result<&mut [f32]> {
        match self {
            CpuBuf::F32(v) => Ok(v),
            _ => bail!("cpu backend: expected an f32 buffer"),
        }
    }
    fn u32(&self) -> Result<&[u32]> {
        match self {
            CpuBuf::U32(v) => Ok(v),
            _ => bail!("cpu backend: expected a u32 buffer"),
        }
    }
    /// The row length of a packed matrix.
    fn packed_k(&self) -> Option<usize> {
        match self {
            CpuBuf::PackedF32(p) => Some(p.k),
            CpuBuf::PackedF16(p) => Some(p.k),
            CpuBuf::PackedBF16(p) => Some(p.k),
            _ => None,
        }
    }
    fn len(&self) -> usize {
        match self {
            CpuBuf::F32(v) => v.len(),
            CpuBuf::U32(v) => v.len(),
            CpuBuf::F16(v) => v.len(),
            CpuBuf::BF16(v) => v.len(),
            CpuBuf::PackedF32(p) => p.numel(),
            CpuBuf::PackedF16(p) => p.numel(),
            CpuBuf::PackedBF16(p) => p.numel(),
            CpuBuf::Quant(q) => q.rows() * q.k,
        }
    }
}

/// A zero-filled vector from the allocator's zeroed pages: a large KV pool costs nothing until
/// it is written, and a failed allocation is an error instead of an abort.
fn zeroed<T: bytemuck::Zeroable>(n: usize) -> Result<Vec<T>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let size = std::mem::size_of::<T>();
    let layout = std::alloc::Layout::array::<T>(n)
        .map_err(|_| anyhow::anyhow!("cpu backend: {n} values is too large an allocation"))?;
    // SAFETY: the layout is non-zero-sized and is that of `[T; n]`; all-zero bytes are a valid
    // T (Zeroable); the Vec takes ownership with the same layout, capacity and length.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut T;
        if p.is_null() {
            bail!("cpu backend: cannot allocate {} MiB", (n * size) >> 20);
        }
        Ok(Vec::from_raw_parts(p, n, n))
    }
}

/// A layer's K or V cache as a slice of its element type.
enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl CpuBuf {
    fn kv(&self) -> Result<KvSlice<'_>> {
        Ok(match self {
            CpuBuf::F32(v) => KvSlice::F32(v),
            CpuBuf::F16(v) => KvSlice::F16(v),
            CpuBuf::BF16(v) => KvSlice::BF16(v),
            _ => bail!("cpu backend: expected a KV cache"),
        })
    }
}

/// Blocks `blocks` (`block_len` values each) of a cache, widened to f32, in the order given.
fn read_blocks<T: Elem>(c: &[T], block_len: usize, blocks: &[u32]) -> Result<Vec<f32>> {
    args::kv_blocks("read_kv_blocks", blocks, block_len, c.len())?;
    let mut out = Vec::with_capacity(blocks.len() * block_len);
    for &b in blocks {
        let at = b as usize * block_len;
        out.extend(c[at..at + block_len].iter().map(|x| x.f32()));
    }
    Ok(out)
}

/// `data` written over blocks `blocks` of a cache, rounded to its element type.
fn write_blocks<T: Elem>(
    c: &mut [T],
    block_len: usize,
    blocks: &[u32],
    data: &[f32],
) -> Result<()> {
    args::kv_blocks_data(data, blocks, block_len)?;
    args::kv_blocks("write_kv_blocks", blocks, block_len, c.len())?;
    for (&b, src) in blocks.iter().zip(data.chunks_exact(block_len)) {
        let at = b as usize * block_len;
        store(&mut c[at..at + block_len], src);
    }
    Ok(())
}

/// `src` rounded into `dst`.
fn store<T: Elem>(dst: &mut [T], src: &[f32]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, &x)| *d = T::from_f32(x));
}

/// Each row's K and V (from the fused QKV rows, `stride` apart) at its slot in the caches,
/// rounded to their element type.
fn write_rows<T: Elem>(
    qkv: &[f32],
    slots: &[u32],
    rows: usize,
    layout: QkvLayout,
    kc: &mut [T],
    vc: &mut [T],
    kv: KvLayout,
) -> Result<()> {
    let (d, hkv, bs) = (layout.head_dim, layout.num_kv_heads, kv.block_size);
    let stride = layout.row_len();
    args::write_kv(qkv.len(), slots, rows, layout, (kc.len(), vc.len()), kv)?;
    for t in 0..rows {
        let slot = slots[t] as usize;
        let (block, off) = (slot / bs, slot % bs);
        let row = &qkv[t * stride..(t + 1) * stride];
        let k = &row[layout.q_len()..layout.q_len() + layout.kv_len()];
        let v = &row[layout.q_len() + layout.kv_len()..];
        for g in 0..hkv {
            let dst = ((block * hkv + g) * bs + off) * d;
            store(&mut kc[dst..dst + d], &k[g * d..(g + 1) * d]);
            store(&mut vc[dst..dst + d], &v[g * d..(g + 1) * d]);
        }
    }
    Ok(())
}

/// The physical cores this process may run on (SMT siblings counted once), where Linux says;
/// else the logical CPUs it may use.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set, and the call fills it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is a cpu_set_t of `size` bytes.
        if unsafe { libc::sched_getaffinity(0, size, &mut set) } == 0 {
            let mut cores = std::collections::HashSet::new();
            for cpu in 0..libc::CPU_SETSIZE as usize {
                // SAFETY: cpu < CPU_SETSIZE.
                if !unsafe { libc::CPU_ISSET(cpu, &set) } {
                    continue;
                }
                let topo = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
                let core = std::fs::read_to_string(format!("{topo}/core_id"));
                let pkg = std::fs::read_to_string(format!("{topo}/physical_package_id"));
                match (core, pkg) {
                    (Ok(c), Ok(p)) => cores.insert((p.trim().to_owned(), c.trim().to_owned())),
                    _ => return logical,
                };
            }
            if !cores.is_empty() {
                return cores.len().min(logical);
            }
        }
    }
    logical
}

pub struct CpuBackend {
    threads: usize,
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            threads: rayon::current_num_threads(),
        }
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;

    fn name(&self) -> String {
        format!("cpu ({} threads, {})", self.threads, qmatmul::path().name())
    }

    fn upload_weight(&self, t: &HostTensor, dtype: DType) -> Result<CpuBuf> {
        // NOTE: matrices (linear weights, embedding tables) are packed once here for the
        // matmul; vectors (norms, biases) stay plain f32.
        let &[n, k] = t.shape.as_slice() else {
            ensure!(
                dtype == DType::F32,
                "cpu backend: a {} weight of shape {:?} (only matrices are kept in half precision)",
                dtype.name(),
                t.shape
            );
            return Ok(CpuBuf::F32(t.data.clone()));
        };
        Ok(match dtype {
            DType::F32 => CpuBuf::PackedF32(Packed::pack(&t.data, n, k)),
            DType::F16 => {
                let h: Vec<f16> = t.data.iter().map(|&v| f16::from_f32(v)).collect();
                CpuBuf::PackedF16(Packed::pack(&h, n, k))
            }
            DType::BF16 => {
                let h: Vec<bf16> = t.data.iter().map(|&v| bf16::from_f32(v)).collect();
                CpuBuf::PackedBF16(Packed::pack(&h, n, k))
            }
            DType::F8E4M3 => bail!("fp8 is a KV cache type, not one for weights"),
        })
    }

    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // NOTE: from outside the pool, every parallel op would be injected into it and the
        // caller put to sleep until it ends: two futex round trips per op, hundreds a step.
        rayon::scope(|_| f())
    }

    fn supports_quant(&self) -> bool {
        true
    }

    /// NOTE: a step of 2048 prompt tokens takes seconds on a few cores, and every running
    /// stream waits that long for its next token while requests that arrive meanwhile wait for
    /// the whole step. The matmuls are compute-bound from a few dozen rows on, so steps of 512
    /// tokens cost no throughput: measured at 64 streams (docs/benchmarks.md), the same output
    /// tokens/s with a median time to first token of 3.1 s instead of 10.6 s.
    fn default_token_budget(&self) -> usize {
        512
    }

    fn upload_quant(&self, t: QuantTensor) -> Result<CpuBuf> {
        Ok(CpuBuf::Quant(t))
    }

    fn upload_f32(&self, data: &[f32]) -> Result<CpuBuf> {
        Ok(CpuBuf::F32(data.to_vec()))
    }

    fn upload_u32(&self, data: &[u32]) -> Result<CpuBuf> {
        Ok(CpuBuf::U32(data.to_vec()))
    }

    fn alloc_f32(&self, n: usize) -> Result<CpuBuf> {
        Ok(CpuBuf::F32(zeroed(n)?))
    }

    /// NOTE: a half cache halves the bytes decode attention reads every step (as llama.cpp's
    /// default f16 cache); values are widened exactly as they are loaded, so only the rounding
    /// at the write differs from an f32 cache.
    fn kv_cache_dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::F16, DType::BF16]
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<CpuBuf> {
        let n = layout.numel();
        Ok(match layout.dtype {
            DType::F32 => CpuBuf::F32(zeroed(n)?),
            DType::F16 => CpuBuf::F16(zeroed(n)?),
            DType::BF16 => CpuBuf::BF16(zeroed(n)?),
            DType::F8E4M3 => bail!("cpu backend: no fp8 KV cache (f32, f16, bf16)"),
        })
    }

    fn download_f32(&self, buf: &CpuBuf) -> Result<Vec<f32>> {
        Ok(match buf {
            CpuBuf::F32(v) => v.clone(),
            CpuBuf::PackedF32(p) => p.unpack(),
            CpuBuf::PackedF16(p) => p.unpack(),
            CpuBuf::PackedBF16(p) => p.unpack(),
            CpuBuf::U32(v) => v.iter().map(|&x| x as f32).collect(),
            CpuBuf::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            CpuBuf::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            CpuBuf::Quant(q) => q.dequantize()?,
        })
    }

    fn read_kv_blocks(&self, cache: &CpuBuf, block_len: usize, blocks: &[u32]) -> Result<Vec<f32>> {
        match cache.kv()? {
            KvSlice::F32(c) => read_blocks(c, block_len, blocks),
            KvSlice::F16(c) => read_blocks(c, block_len, blocks),
            KvSlice::BF16(c) => read_blocks(c, block_len, blocks),
        }
    }

    fn write_kv_blocks(
        &self,
        cache: &mut CpuBuf,
        block_len: usize,
        blocks: &[u32],
        data: &[f32],
    ) -> Result<()> {
        match cache {
            CpuBuf::F32(c) => write_blocks(c, block_len, blocks, data),
            CpuBuf::F16(c) => write_blocks(c, block_len, blocks, data),
            CpuBuf::BF16(c) => write_blocks(c, block_len, blocks, data),
            _ => bail!("write_kv_blocks: not a KV cache"),
        }
    }

    fn len(&self, buf: &CpuBuf) -> usize {
        buf.len()
    }

    fn embedding(&self, table: &CpuBuf, ids: &CpuBuf, dim: usize, out: &mut CpuBuf) -> Result<()> {
        let ids = ids.u32()?;
        let out = out.f32_mut()?;
        args::embedding(ids, table.len(), dim, out.len())?;
        if let Some(k) = table.packed_k() {
            ensure!(
                k == dim,
                "embedding: the table's rows have {k} values, not {dim}"
            );
        }
        for (t, &id) in ids.iter().enumerate() {
            let src = id as usize * dim..(id as usize + 1) * dim;
            let dst = &mut out[t * dim..(t + 1) * dim];
            match table {
                CpuBuf::F32(v) => dst.copy_from_slice(&v[src]),
                CpuBuf::PackedF32(p) => p.row_into(id as usize, dst),
                CpuBuf::PackedF16(p) => p.row_into(id as usize, dst),
                CpuBuf::PackedBF16(p) => p.row_into(id as usize, dst),
                CpuBuf::Quant(q) => {
                    let (ty, row) = q
                        .row(id as usize)
                        .context("embedding: row outside the table")?;
                    crate::quant::dequantize_into(ty, row, dst)?;
                }
                CpuBuf::U32(_) | CpuBuf::F16(_) | CpuBuf::BF16(_) => {
                    bail!("embedding: the table must be a weight matrix or f32")
                }
            }
        }
        Ok(())
    }

    fn matmul(
        &self,
        x: &CpuBuf,
        w: &CpuBuf,
        bias: Option<&CpuBuf>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let x = x.f32()?;
        let out = out.f32_mut()?;
        args::matmul(
            x.len(),
            w.len(),
            bias.map(CpuBuf::len),
            (m, k, n),
            out.len(),
        )?;
        let out = &mut out[..m * n];
        let x = &x[..m * k];
        let w = match w {
            CpuBuf::PackedF32(w) => Weights::F32(w),
            CpuBuf::PackedF16(w) => Weights::F16(w),
            CpuBuf::PackedBF16(w) => Weights::BF16(w),
            CpuBuf::Quant(q) => Weights::Quant(q),
            CpuBuf::F32(_) | CpuBuf::U32(_) | CpuBuf::F16(_) | CpuBuf::BF16(_) => {
                bail!("matmul: the weight must be a matrix uploaded with upload_weight")
            }
        };
        matmul::matmul(x, m, k, n, out, w);
        if let Some(b) = bias {
            let b = b.f32()?;
            out.par_chunks_mut(n)
                .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuBuf,
        w: &CpuBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let x = x.f32()?;
        let w = w.f32()?;
        let out = out.f32_mut()?;
        args::rms_norm(x.len(), w.len(), rows, dim, out.len())?;
        out[..rows * dim]
            .par_chunks_mut(dim)
            .zip(x[..rows * dim].par_chunks(dim))
            .for_each(|(o, x)| {
                let ss = dot(x, x) / dim as f32;
                let inv = 1.0 / (ss + eps).sqrt();
                o.iter_mut()
                    .zip(x)
                    .zip(w)
                    .for_each(|((o, x), w)| *o = x * inv * w);
            });
        Ok(())
    }

    fn qk_norm(
        &self,
        qkv: &mut CpuBuf,
        q_w: &CpuBuf,
        k_w: &CpuBuf,
        rows: usize,
        layout: QkvLayout,
        span: QkNormSpan,
        eps: f32,
    ) -> Result<()> {
        let (qw, kw) = (q_w.f32()?, k_w.f32()?);
        let qkv = qkv.f32_mut()?;
        let stride = layout.row_len();
        let (nq, qs, nk, ks) = span.spans(layout);
        args::qk_norm(qkv.len(), qw.len(), kw.len(), rows, layout, span)?;
        let center = span.centered();
        let norm = |x: &mut [f32], w: &[f32]| {
            // NOTE: a LayerNorm's variance is that of x - mean, as PyTorch computes it
            if center {
                let mean = x.iter().sum::<f32>() / x.len() as f32;
                x.iter_mut().for_each(|x| *x -= mean);
            }
            let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
            x.iter_mut().zip(w).for_each(|(x, w)| *x = *x * inv * w);
        };
        // the weights of span i: row i, or the one row
        let (qw_step, kw_step) = match span.own_weights() {
            true => (qs, ks),
            false => (0, 0),
        };
        qkv[..rows * stride].par_chunks_mut(stride).for_each(|row| {
            let (q, rest) = row.split_at_mut(nq * qs);
            q.chunks_mut(qs)
                .enumerate()
                .for_each(|(i, x)| norm(x, &qw[i * qw_step..]));
            rest[..nk * ks]
                .chunks_mut(ks)
                .enumerate()
                .for_each(|(i, x)| norm(x, &kw[i * kw_step..]));
        });
        Ok(())
    }

    fn add_assign(&self, x: &mut CpuBuf, y: &CpuBuf, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        let y = y.f32()?;
        args::add_assign(x.len(), y.len(), n)?;
        x[..n].iter_mut().zip(&y[..n]).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn rope(
        &self,
        qkv: &mut CpuBuf,
        positions: &CpuBuf,
        cos: &CpuBuf,
        sin: &CpuBuf,
        rows: usize,
        layout: QkvLayout,
    ) -> Result<()> {
        let qkv = qkv.f32_mut()?;
        let pos = positions.u32()?;
        let (cos, sin) = (cos.f32()?, sin.f32()?);
        let d = layout.head_dim;
        let half = d / 2;
        let stride = layout.row_len();
        args::rope(qkv.len(), pos, cos.len(), sin.len(), rows, layout)?;
        let heads = layout.num_heads + layout.num_kv_heads;
        qkv[..rows * stride]
            .par_chunks_mut(stride)
            .zip(&pos[..rows])
            .for_each(|(row, &p)| {
                let c = &cos[p as usize * half..(p as usize + 1) * half];
                let s = &sin[p as usize * half..(p as usize + 1) * half];
                for h in row[..heads * d].chunks_mut(d) {
                    let (a, b) = h.split_at_mut(half);
                    for i in 0..half {
                        let (x1, x2) = (a[i], b[i]);
                        a[i] = x1 * c[i] - x2 * s[i];
                        b[i] = x2 * c[i] + x1 * s[i];
                    }
                }
            });
        Ok(())
    }

    fn gated_act(
        &self,
        gate_up: &CpuBuf,
        rows: usize,
        ffn: usize,
        act: Activation,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let gu = gate_up.f32()?;
        let out = out.f32_mut()?;
        args::gated_act(gu.len(), rows, ffn, out.len())?;
        let simd = act == Activation::Silu && matmul::Path::Avx2.available();
        out[..rows * ffn]
            .par_chunks_mut(ffn)
            .zip(gu.par_chunks(2 * ffn))
            .for_each(|(o, gu)| {
                let (g, u) = gu.split_at(ffn);
                let mut i = 0;
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: AVX2 was detected.
                    i = unsafe { exp::silu_mul_avx2(g, u, o) };
                }
                for i in i..ffn {
                    o[i] = activation(act, g[i]) * u[i];
                }
            });
        Ok(())
    }

    fn act(&self, x: &mut CpuBuf, n: usize, act: Activation) -> Result<()> {
        let x = x.f32_mut()?;
        args::in_place("act", x.len(), n)?;
        x[..n]
            .par_chunks_mut(4096)
            .for_each(|c| c.iter_mut().for_each(|v| *v = activation(act, *v)));
        Ok(())
    }

    fn scale(&self, x: &mut CpuBuf, s: f32, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        args::in_place("scale", x.len(), n)?;
        x[..n].iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn softcap(&self, x: &mut CpuBuf, cap: f32, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        args::softcap(x.len(), n, cap)?;
        x[..n]
            .par_chunks_mut(4096)
            .for_each(|c| c.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh()));
        Ok(())
    }

    fn clamp(&self, x: &mut CpuBuf, limit: f32, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        args::clamp(x.len(), n, limit)?;
        x[..n].iter_mut().for_each(|v| *v = v.clamp(-limit, limit));
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CpuBuf,
        w: &CpuBuf,
        b: &CpuBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let (x, w, b) = (x.f32()?, w.f32()?, b.f32()?);
        let out = out.f32_mut()?;
        args::layer_norm(x.len(), w.len(), b.len(), rows, dim, out.len())?;
        out[..rows * dim]
            .par_chunks_mut(dim)
            .zip(x[..rows * dim].par_chunks(dim))
            .for_each(|(o, x)| {
                // NOTE: two passes (mean, then the variance of x - mean), as PyTorch does; the
                // one-pass E[x²] - E[x]² loses digits when the mean is large.
                let mean = x.iter().sum::<f32>() / dim as f32;
                let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
                let inv = 1.0 / (var + eps).sqrt();
                for i in 0..dim {
                    o[i] = (x[i] - mean) * inv * w[i] + b[i];
                }
            });
        Ok(())
    }

    fn gather_rows(&self, x: &CpuBuf, rows: &CpuBuf, dim: usize, out: &mut CpuBuf) -> Result<()> {
        let x = x.f32()?;
        let rows = rows.u32()?;
        let out = out.f32_mut()?;
        args::gather_rows(x.len(), rows, dim, out.len())?;
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            out[i * dim..(i + 1) * dim].copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        y: &CpuBuf,
        rows: &CpuBuf,
        weights: &CpuBuf,
        dim: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let (y, rows, weights) = (y.f32()?, rows.u32()?, weights.f32()?);
        let out = out.f32_mut()?;
        args::scatter_add_rows(y.len(), rows, weights.len(), dim, out.len())?;
        for (i, &r) in rows.iter().enumerate() {
            let o = &mut out[r as usize * dim..(r as usize + 1) * dim];
            for (o, &v) in o.iter_mut().zip(&y[i * dim..(i + 1) * dim]) {
                *o += weights[i] * v;
            }
        }
        Ok(())
    }

    fn lora(
        &self,
        x: &CpuBuf,
        groups: &[LoraGroup<'_, Self>],
        k: usize,
        n: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        // NOTE: one task per few rows of one adapter, each running its two small products on
        // its own thread: composed from gather, matmuls and scatter-add per adapter, the update
        // spent more time dispatching ops than computing them. A row's bits do not depend on
        // the other rows: the serial products are the matmul's, whose cut changes no result.
        const ROWS: usize = 8;
        let x = x.f32()?;
        let out = out.f32_mut()?;
        let mut parts = Vec::with_capacity(groups.len());
        for g in groups {
            let rows = g.rows.u32()?;
            parts.push((rows, g.weights.f32()?));
        }
        let lens: Vec<_> = groups
            .iter()
            .zip(&parts)
            .map(|(g, (rows, w))| args::LoraLens {
                rows,
                m: g.m,
                weights: w.len(),
                a: g.a.len(),
                b: g.b.len(),
                rank: g.rank,
            })
            .collect();
        args::lora(&lens, k, n, x.len(), out.len())?;
        if n == 0 {
            return Ok(());
        }
        let mut tasks = Vec::new();
        for (g, (rows, weights)) in groups.iter().zip(&parts) {
            let (a, b) = (dense(g.a, g.rank, k)?, dense(g.b, n, g.rank)?);
            for (i, chunk) in rows.chunks(ROWS).enumerate() {
                tasks.push((a, b, g.rank, chunk, &weights[i * ROWS..]));
            }
        }
        let out_ptr = SendPtr(out.as_mut_ptr());
        tasks.par_iter().for_each(|&(a, b, rank, rows, weights)| {
            let m = rows.len();
            let mut xs = Vec::with_capacity(m * k); // [m, k]
            for &r in rows {
                xs.extend_from_slice(&x[r as usize * k..(r as usize + 1) * k]);
            }
            let mut mid = vec![0.0; m * rank]; // [m, rank]
            matmul::matmul_serial(&xs, m, k, rank, &mut mid, a);
            let mut up = vec![0.0; m * n]; // [m, n]
            matmul::matmul_serial(&mid, m, rank, n, &mut up, b);
            let o = out_ptr;
            for ((&r, &w), up) in rows.iter().zip(weights).zip(up.chunks(n)) {
                // SAFETY: the rows are inside `out` and no other task has them (checked).
                let o = unsafe { std::slice::from_raw_parts_mut(o.0.add(r as usize * n), n) };
                o.iter_mut().zip(up).for_each(|(o, u)| *o += w * u);
            }
        });
        Ok(())
    }

    fn write_kv(
        &self,
        qkv: &CpuBuf,
        slot_mapping: &CpuBuf,
        rows: usize,
        layout: QkvLayout,
        k_cache: &mut CpuBuf,
        v_cache: &mut CpuBuf,
        kv: KvLayout,
    ) -> Result<()> {
        let (qkv, slots) = (qkv.f32()?, slot_mapping.u32()?);
        match (k_cache, v_cache) {
            (CpuBuf::F32(k), CpuBuf::F32(v)) => write_rows(qkv, slots, rows, layout, k, v, kv),
            (CpuBuf::F16(k), CpuBuf::F16(v)) => write_rows(qkv, slots, rows, layout, k, v, kv),
            (CpuBuf::BF16(k), CpuBuf::BF16(v)) => write_rows(qkv, slots, rows, layout, k, v, kv),
            _ => bail!("write_kv: K and V caches of one type expected"),
        }
    }

    fn argmax_rows(&self, logits: &CpuBuf, rows: usize, cols: usize) -> Result<Vec<u32>> {
        let v = logits.f32()?;
        args::argmax_rows(v.len(), rows, cols)?;
        if cols == 0 {
            return Ok(vec![0; rows]);
        }
        // NOTE: in place (the default copies every logit first) and a row per task.
        Ok(v[..rows * cols]
            .par_chunks(cols)
            .map(|row| argmax_row(row) as u32)
            .collect())
    }

    fn paged_attention(
        &self,
        qkv: &CpuBuf,
        k_cache: &CpuBuf,
        v_cache: &CpuBuf,
        batch: &DeviceBatch<Self>,
        layout: QkvLayout,
        kv: KvLayout,
        opts: AttentionOptions,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let (scale, softcap) = (opts.scale, opts.softcap_f32()?);
        opts.window_u32()?;
        let qkv = qkv.f32()?;
        let out = out.f32_mut()?;
        let b = &batch.host;
        let (d, h, hkv, bs) = (
            layout.head_dim,
            layout.num_heads,
            layout.num_kv_heads,
            kv.block_size,
        );
        let rep = h / hkv;
        let t_rows = b.num_tokens();
        let stride = layout.row_len();
        let caches = (k_cache.len(), v_cache.len());
        args::paged_attention(qkv.len(), t_rows, layout, caches, kv, out.len())?;
        batch.shape.check_kv(kv.num_blocks, bs, b.max_blocks)?;
        // Which sequence each row belongs to (query_start was checked at upload).
        let mut row_seq = vec![0usize; t_rows];
        for s in 0..b.num_seqs() {
            let (q0, q1) = (b.query_start[s] as usize, b.query_start[s + 1] as usize);
            row_seq[q0..q1].iter_mut().for_each(|x| *x = s);
        }
        let args = AttnArgs {
            row_seq: &row_seq,
            b,
            opts,
            qkv,
            scale,
            softcap,
            d,
            hkv,
            rep,
            bs,
            stride,
        };
        let out = &mut out[..t_rows * h * d];
        match (k_cache.kv()?, v_cache.kv()?) {
            (KvSlice::F32(k), KvSlice::F32(v)) => attend(AttnTask { args, kc: k, vc: v }, out),
            (KvSlice::F16(k), KvSlice::F16(v)) => attend(AttnTask { args, kc: k, vc: v }, out),
            (KvSlice::BF16(k), KvSlice::BF16(v)) => attend(AttnTask { args, kc: k, vc: v }, out),
            _ => bail!("paged_attention: K and V caches of one type expected"),
        }
    }
}

/// Every attention task of a step into `out` (`[T, H·D]`).
fn attend<T: Elem>(task: AttnTask<T>, out: &mut [f32]) -> Result<()> {
    let path = matmul::Path::detect();
    // NOTE: one task per (row, kv head): decode of a single sequence still uses every thread
    // when there are several kv heads, and each task reads its K/V block by block.
    out.par_chunks_mut(task.args.rep * task.args.d)
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (i, o)| {
            task.run_on(path, scratch, i, o)
        });
    Ok(())
}

/// An activation in f32 (see [`Activation`]).
#[inline]
fn activation(act: Activation, x: f32) -> f32 {
    match act {
        // NOTE: our exp (exp.rs) rather than libm's: the loops over a row vectorize.
        Activation::Silu => x / (1.0 + exp::exp_approx(-x)),
        Activation::GeluTanh => {
            0.5 * x * (1.0 + (0.797_884_6_f32 * (x + 0.044715 * x * x * x)).tanh())
        }
        Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
    }
}

/// A dot product with 8 independent lanes, so the compiler can vectorise it (a plain `sum` of
/// products is a serial chain under IEEE rules), reduced in one fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// [`crate::backend::argmax`] in two passes that vectorize: the largest value (`x > m`
/// keeps `m` when `x` is NaN, as `maxps` does), then where it first is.
fn argmax_row(v: &[f32]) -> usize {
    let m = v
        .chunks(16)
        .fold([f32::NEG_INFINITY; 16], |mut m, c| {
            for (m, &x) in m.iter_mut().zip(c) {
                *m = if x > *m { x } else { *m };
            }
            m
        })
        .into_iter()
        .fold(f32::NEG_INFINITY, |a, x| if x > a { x } else { a });
    if m == f32::NEG_INFINITY {
        return 0;
    }
    v.iter().position(|&x| x == m).unwrap_or(0)
}
