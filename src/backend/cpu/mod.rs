//! The CPU backend: the reference every other backend is checked against, and the default where
//! no GPU exists. Multi-threaded with rayon; batch-invariant matmuls of our own (see matmul.rs); paged attention
//! reads K and V through the block tables in place, never gathering them into a contiguous copy.

pub mod matmul;
pub mod qmatmul;

use matmul::{Packed, Weights};

use super::{Activation, AttentionOptions, Backend, DeviceBatch, KvLayout, QkvLayout};
use crate::quant::QuantTensor;
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail, ensure};
use half::{bf16, f16};
use rayon::prelude::*;

/// CPU device memory: a host vector of one element type, or a weight matrix.
pub enum CpuBuf {
    F32(Vec<f32>),
    U32(Vec<u32>),
    /// A dense weight matrix in panels (see matmul.rs), in its storage type.
    PackedF32(Packed<f32>),
    PackedF16(Packed<f16>),
    PackedBF16(Packed<bf16>),
    /// A linear weight kept in GGML block formats (see qmatmul.rs).
    Quant(QuantTensor),
}

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
            CpuBuf::PackedF32(p) => p.numel(),
            CpuBuf::PackedF16(p) => p.numel(),
            CpuBuf::PackedBF16(p) => p.numel(),
            CpuBuf::Quant(q) => q.rows() * q.k,
        }
    }
}

/// A zero-filled vector from the allocator's zeroed pages: a large KV pool costs nothing until
/// it is written, and a failed allocation is an error instead of an abort.
fn zeroed_f32(n: usize) -> Result<Vec<f32>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(n)
        .map_err(|_| anyhow::anyhow!("cpu backend: {n} floats is too large an allocation"))?;
    // SAFETY: the layout is non-zero-sized and is that of `[f32; n]`; all-zero bytes are a valid
    // f32 (0.0); the Vec takes ownership with the same layout, capacity and length.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut f32;
        if p.is_null() {
            bail!("cpu backend: cannot allocate {} MiB", (n * 4) >> 20);
        }
        Ok(Vec::from_raw_parts(p, n, n))
    }
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
        format!("cpu ({} threads)", self.threads)
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
        Ok(CpuBuf::F32(zeroed_f32(n)?))
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<CpuBuf> {
        super::expect_f32_kv(layout, "cpu")?;
        self.alloc_f32(layout.numel())
    }

    fn download_f32(&self, buf: &CpuBuf) -> Result<Vec<f32>> {
        Ok(match buf {
            CpuBuf::F32(v) => v.clone(),
            CpuBuf::PackedF32(p) => p.unpack(),
            CpuBuf::PackedF16(p) => p.unpack(),
            CpuBuf::PackedBF16(p) => p.unpack(),
            CpuBuf::U32(v) => v.iter().map(|&x| x as f32).collect(),
            CpuBuf::Quant(q) => q.dequantize()?,
        })
    }

    fn read_kv_blocks(&self, cache: &CpuBuf, block_len: usize, blocks: &[u32]) -> Result<Vec<f32>> {
        let CpuBuf::F32(c) = cache else {
            bail!("read_kv_blocks: the KV cache is not f32");
        };
        let mut out = Vec::with_capacity(blocks.len() * block_len);
        for &b in blocks {
            let at = b as usize * block_len;
            let src = c
                .get(at..at + block_len)
                .with_context(|| format!("read_kv_blocks: block {b} is outside the cache"))?;
            out.extend_from_slice(src);
        }
        Ok(out)
    }

    fn write_kv_blocks(
        &self,
        cache: &mut CpuBuf,
        block_len: usize,
        blocks: &[u32],
        data: &[f32],
    ) -> Result<()> {
        let CpuBuf::F32(c) = cache else {
            bail!("write_kv_blocks: the KV cache is not f32");
        };
        super::check_kv_blocks_data(data, blocks, block_len)?;
        for (&b, src) in blocks.iter().zip(data.chunks_exact(block_len)) {
            let at = b as usize * block_len;
            c.get_mut(at..at + block_len)
                .with_context(|| format!("write_kv_blocks: block {b} is outside the cache"))?
                .copy_from_slice(src);
        }
        Ok(())
    }

    fn len(&self, buf: &CpuBuf) -> usize {
        buf.len()
    }

    fn embedding(&self, table: &CpuBuf, ids: &CpuBuf, dim: usize, out: &mut CpuBuf) -> Result<()> {
        let ids = ids.u32()?;
        let out = out.f32_mut()?;
        ensure!(out.len() >= ids.len() * dim, "embedding: output too small");
        let vocab = table.len() / dim;
        if let Some(k) = table.packed_k() {
            ensure!(
                k == dim,
                "embedding: the table's rows have {k} values, not {dim}"
            );
        }
        for (t, &id) in ids.iter().enumerate() {
            ensure!(
                (id as usize) < vocab,
                "token id {id} is outside the vocabulary ({vocab})"
            );
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
                CpuBuf::U32(_) => bail!("embedding: table must be a float buffer"),
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
        ensure!(
            x.len() >= m * k && out.len() >= m * n,
            "matmul: buffer too small for {m}x{k}x{n}"
        );
        ensure!(
            w.len() == n * k,
            "matmul: weight has {} elements, expected {n}x{k}",
            w.len()
        );
        let out = &mut out[..m * n];
        let x = &x[..m * k];
        let w = match w {
            CpuBuf::PackedF32(w) => Weights::F32(w),
            CpuBuf::PackedF16(w) => Weights::F16(w),
            CpuBuf::PackedBF16(w) => Weights::BF16(w),
            CpuBuf::Quant(q) => Weights::Quant(q),
            CpuBuf::F32(_) | CpuBuf::U32(_) => {
                bail!("matmul: the weight must be a matrix uploaded with upload_weight")
            }
        };
        matmul::matmul(x, m, k, n, out, w);
        if let Some(b) = bias {
            let b = b.f32()?;
            ensure!(
                b.len() == n,
                "matmul: bias has {} elements, expected {n}",
                b.len()
            );
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
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.len() == dim,
            "rms_norm: bad sizes"
        );
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
        eps: f32,
    ) -> Result<()> {
        let (qw, kw) = (q_w.f32()?, k_w.f32()?);
        let qkv = qkv.f32_mut()?;
        let (d, stride) = (layout.head_dim, layout.row_len());
        let heads = layout.num_heads + layout.num_kv_heads;
        ensure!(
            qkv.len() >= rows * stride && qw.len() == d && kw.len() == d,
            "qk_norm: bad sizes"
        );
        qkv[..rows * stride].par_chunks_mut(stride).for_each(|row| {
            for (h, x) in row[..heads * d].chunks_mut(d).enumerate() {
                let w = if h < layout.num_heads { qw } else { kw };
                let inv = 1.0 / (dot(x, x) / d as f32 + eps).sqrt();
                x.iter_mut().zip(w).for_each(|(x, w)| *x = *x * inv * w);
            }
        });
        Ok(())
    }

    fn add_assign(&self, x: &mut CpuBuf, y: &CpuBuf, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        let y = y.f32()?;
        ensure!(
            x.len() >= n && y.len() >= n,
            "add_assign: buffers too small"
        );
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
        ensure!(
            qkv.len() >= rows * stride && pos.len() >= rows,
            "rope: bad sizes"
        );
        let max_pos = cos.len() / half;
        if let Some(&p) = pos[..rows].iter().find(|&&p| p as usize >= max_pos) {
            bail!("rope: position {p} is beyond the table ({max_pos})");
        }
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
        ensure!(
            gu.len() >= rows * 2 * ffn && out.len() >= rows * ffn,
            "gated_act: bad sizes"
        );
        out[..rows * ffn]
            .par_chunks_mut(ffn)
            .zip(gu.par_chunks(2 * ffn))
            .for_each(|(o, gu)| {
                let (g, u) = gu.split_at(ffn);
                for i in 0..ffn {
                    o[i] = activation(act, g[i]) * u[i];
                }
            });
        Ok(())
    }

    fn act(&self, x: &mut CpuBuf, n: usize, act: Activation) -> Result<()> {
        let x = x.f32_mut()?;
        ensure!(x.len() >= n, "act: buffer too small");
        x[..n]
            .par_chunks_mut(4096)
            .for_each(|c| c.iter_mut().for_each(|v| *v = activation(act, *v)));
        Ok(())
    }

    fn scale(&self, x: &mut CpuBuf, s: f32, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        ensure!(x.len() >= n, "scale: buffer too small");
        x[..n].iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn softcap(&self, x: &mut CpuBuf, cap: f32, n: usize) -> Result<()> {
        let x = x.f32_mut()?;
        ensure!(x.len() >= n, "softcap: buffer too small");
        ensure!(cap > 0.0, "softcap: the cap must be positive");
        x[..n]
            .par_chunks_mut(4096)
            .for_each(|c| c.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh()));
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
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.len() == dim && b.len() == dim,
            "layer_norm: bad sizes"
        );
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
        ensure!(
            out.len() >= rows.len() * dim,
            "gather_rows: output too small"
        );
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            ensure!(
                (r + 1) * dim <= x.len(),
                "gather_rows: row {r} out of range"
            );
            out[i * dim..(i + 1) * dim].copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
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
        let qkv = qkv.f32()?;
        let slots = slot_mapping.u32()?;
        let (kc, vc) = (k_cache.f32_mut()?, v_cache.f32_mut()?);
        let (d, hkv, bs) = (layout.head_dim, layout.num_kv_heads, kv.block_size);
        let stride = layout.row_len();
        ensure!(
            kc.len() == kv.numel() && vc.len() == kv.numel(),
            "write_kv: cache size mismatch"
        );
        for t in 0..rows {
            let slot = slots[t] as usize;
            let (block, off) = (slot / bs, slot % bs);
            ensure!(
                block < kv.num_blocks,
                "write_kv: slot {slot} outside the pool"
            );
            let row = &qkv[t * stride..(t + 1) * stride];
            let k = &row[layout.q_len()..layout.q_len() + layout.kv_len()];
            let v = &row[layout.q_len() + layout.kv_len()..];
            for g in 0..hkv {
                let dst = ((block * hkv + g) * bs + off) * d;
                kc[dst..dst + d].copy_from_slice(&k[g * d..(g + 1) * d]);
                vc[dst..dst + d].copy_from_slice(&v[g * d..(g + 1) * d]);
            }
        }
        Ok(())
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
        let (kc, vc) = (k_cache.f32()?, v_cache.f32()?);
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
        ensure!(
            out.len() >= t_rows * h * d,
            "paged_attention: output too small"
        );
        // Which sequence each row belongs to, and its position.
        let mut row_seq = vec![0usize; t_rows];
        for s in 0..b.num_seqs() {
            let (q0, q1) = (b.query_start[s] as usize, b.query_start[s + 1] as usize);
            ensure!(q1 <= t_rows && q0 <= q1, "paged_attention: bad query_start");
            ensure!(
                (b.seq_lens[s] as usize).div_ceil(bs) <= b.max_blocks,
                "paged_attention: block table too short for sequence {s}"
            );
            row_seq[q0..q1].iter_mut().for_each(|x| *x = s);
        }
        let args = AttnTask {
            row_seq: &row_seq,
            b,
            opts,
            qkv,
            kc,
            vc,
            scale,
            softcap,
            d,
            hkv,
            rep,
            bs,
            stride,
        };
        let avx2 = matmul::Path::Avx2.available();
        // NOTE: one task per (row, kv head): decode of a single sequence still uses every thread
        // when there are several kv heads, and each task reads its K/V block by block.
        out[..t_rows * h * d]
            .par_chunks_mut(rep * d)
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (task, o)| {
                if avx2 {
                    // SAFETY: AVX2 and FMA were detected on this CPU.
                    unsafe { args.run_avx2(scratch, task, o) }
                } else {
                    args.run::<false>(scratch, task, o)
                }
            });
        Ok(())
    }
}

/// A thread's buffers for its attention tasks: where each key's row starts in the cache, and
/// the scores (`[rep, n_keys]`).
#[derive(Default)]
struct Scratch {
    rows: Vec<usize>,
    scores: Vec<f32>,
}

/// One attention task: the `rep` query heads of one kv head for one row.
struct AttnTask<'a> {
    row_seq: &'a [usize],
    b: &'a super::BatchInput,
    opts: AttentionOptions,
    qkv: &'a [f32],
    kc: &'a [f32],
    vc: &'a [f32],
    scale: f32,
    softcap: f32,
    d: usize,
    hkv: usize,
    rep: usize,
    bs: usize,
    stride: usize,
}

impl AttnTask<'_> {
    /// NOTE: the same operations in the same order as [`Self::run`]'s portable loops, so the
    /// same bits, with 8-lane vectors: fused multiply-adds where those call `mul_add` (the
    /// scores and p·v), separate operations elsewhere (Rust never fuses them by itself). On
    /// x86 without FMA the portable `mul_add` is a library call: slow, but such CPUs predate
    /// AVX2, and ARM has the instruction.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        self.run::<true>(scratch, task, o)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn run_avx2(&self, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        self.run::<false>(scratch, task, o)
    }

    #[inline(always)]
    fn run<const AVX2: bool>(&self, scratch: &mut Scratch, task: usize, o: &mut [f32]) {
        let AttnTask {
            row_seq,
            b,
            opts,
            qkv,
            kc,
            vc,
            scale,
            softcap,
            d,
            hkv,
            rep,
            bs,
            stride,
        } = *self;
        let (t, g) = (task / hkv, task % hkv);
        let s = row_seq[t];
        let q_end = b.query_start[s + 1] as usize;
        let ctx = b.seq_lens[s] as usize;
        // the last row of the sequence sits at position ctx - 1; with a sliding window
        // the row sees keys k0 .. k0 + n_keys only
        let end = ctx - (q_end - 1 - t);
        let k0 = opts.first_key(end);
        let n_keys = end - k0;
        // Where each key's row starts in the cache, in key order: block by block, so that no
        // key costs a division by the block size.
        let table = &b.block_tables[s * b.max_blocks..(s + 1) * b.max_blocks];
        let rows = &mut scratch.rows;
        rows.clear();
        for (bi, &blk) in table
            .iter()
            .enumerate()
            .take(end.div_ceil(bs))
            .skip(k0 / bs)
        {
            let base = (blk as usize * hkv + g) * bs;
            let (lo, hi) = (k0.max(bi * bs), end.min((bi + 1) * bs));
            rows.extend((lo - bi * bs..hi - bi * bs).map(|off| (base + off) * d));
        }
        let rows = &rows[..];
        // NOTE: the `rep` query heads of one kv head share the task, so its K and V blocks
        // are fetched once for the group.
        let q0 = t * stride + g * rep * d;
        let scores = &mut scratch.scores;
        scores.clear();
        scores.resize(rep * n_keys, 0.0);
        let qs = &qkv[q0..q0 + rep * d];
        #[cfg(target_arch = "x86_64")]
        if AVX2 {
            // SAFETY: AVX2 is available (run_avx2).
            unsafe { qk_avx2(qs, kc, rows, d, n_keys, scores) };
        }
        if !AVX2 {
            for (q, row) in qs
                .chunks_exact(d)
                .zip(scores.chunks_exact_mut(n_keys.max(1)))
            {
                for (sc, &at) in row.iter_mut().zip(rows) {
                    *sc = dot_fma(q, &kc[at..at + d]);
                }
            }
        }
        for row in scores.chunks_mut(n_keys.max(1)) {
            for sc in row.iter_mut() {
                *sc *= scale;
                if softcap > 0.0 {
                    *sc = softcap * (*sc / softcap).tanh();
                }
            }
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            #[cfg(target_arch = "x86_64")]
            let sum = if AVX2 {
                // SAFETY: AVX2 is available (run_avx2).
                unsafe { exp_sum_avx2(row, max) }
            } else {
                exp_sum(row, max)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let sum = exp_sum(row, max);
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|p| *p *= inv);
        }
        // Each output element is 0 + p₀·v₀ + p₁·v₁ + … in key order. On AVX2, 64 columns at a
        // time in registers, over blocks of keys whose V rows stay in L1 while every head
        // passes over them (a head's partial sums wait in `o` between blocks).
        let mut c_avx2 = 0;
        #[cfg(target_arch = "x86_64")]
        if AVX2 && d >= 64 {
            c_avx2 = d / 64 * 64;
            for k0 in (0..n_keys).step_by(PV_KEYS) {
                let k1 = (k0 + PV_KEYS).min(n_keys);
                for (r, o) in o.chunks_exact_mut(d).enumerate().take(rep) {
                    let p = &scores[r * n_keys + k0..r * n_keys + k1];
                    for c0 in (0..c_avx2).step_by(64) {
                        // SAFETY: AVX2 is available (run_avx2); c0 + 64 <= d.
                        unsafe {
                            pv64_avx2(p, vc, &rows[k0..k1], c0, &mut o[c0..c0 + 64], k0 == 0)
                        };
                    }
                }
            }
        }
        for (r, o) in o.chunks_exact_mut(d).enumerate().take(rep) {
            let p = &scores[r * n_keys..(r + 1) * n_keys];
            let c0 = c_avx2;
            let rest = &mut o[c0..];
            rest.fill(0.0);
            for (&pj, &at) in p.iter().zip(rows) {
                for (a, v) in rest.iter_mut().zip(&vc[at + c0..at + d]) {
                    *a = pj.mul_add(*v, *a);
                }
            }
        }
    }
}

/// Keys per block of the AVX2 p·v loop: their V rows (256 bytes each at head size 64) stay
/// in L1 while every head of the group passes over them.
const PV_KEYS: usize = 32;

/// `out[r·n_keys + j] = dot_fma(q_r, k_j)` for the `qs.len() / d` query heads `q_r` and the
/// keys whose rows start at `rows[j]`: four keys against two heads at a time (eight sums side
/// by side, each load of k used twice and of q four times) while the four K rows sit in L1, the
/// last few keys one by one. Each is [`dot_fma`]'s lanes, products, sums and reduction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn qk_avx2(qs: &[f32], kc: &[f32], rows: &[usize], d: usize, n_keys: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let d8 = d / 8 * 8;
    let n = rows.len().min(n_keys);
    let heads = qs.len() / d;
    // Key u's sum of lanes, then its tail, into `out`.
    let finish = |acc: __m256, q: &[f32], k: &[f32]| {
        let mut s = matmul::hsum8(acc);
        for (x, y) in q[d8..].iter().zip(&k[d8..]) {
            s = x.mul_add(*y, s);
        }
        s
    };
    let mut j = 0;
    while j + 4 <= n {
        let k: [&[f32]; 4] = std::array::from_fn(|u| &kc[rows[j + u]..rows[j + u] + d]);
        let mut h = 0;
        while h < heads {
            let two = h + 1 < heads;
            let q0 = &qs[h * d..(h + 1) * d];
            let q1 = if two {
                &qs[(h + 1) * d..(h + 2) * d]
            } else {
                q0
            };
            let mut a0 = [_mm256_setzero_ps(); 4];
            let mut a1 = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i < d8 {
                // SAFETY: i + 8 <= d8 <= d, the length of each q and k.
                unsafe {
                    let x0 = _mm256_loadu_ps(q0.as_ptr().add(i));
                    let x1 = _mm256_loadu_ps(q1.as_ptr().add(i));
                    for u in 0..4 {
                        let y = _mm256_loadu_ps(k[u].as_ptr().add(i));
                        a0[u] = _mm256_fmadd_ps(x0, y, a0[u]);
                        if two {
                            a1[u] = _mm256_fmadd_ps(x1, y, a1[u]);
                        }
                    }
                }
                i += 8;
            }
            for u in 0..4 {
                out[h * n_keys + j + u] = finish(a0[u], q0, k[u]);
                if two {
                    out[(h + 1) * n_keys + j + u] = finish(a1[u], q1, k[u]);
                }
            }
            h += if two { 2 } else { 1 };
        }
        j += 4;
    }
    for (q, out) in qs.chunks_exact(d).zip(out.chunks_exact_mut(n_keys.max(1))) {
        for (sc, &at) in out[j..n].iter_mut().zip(&rows[j..n]) {
            *sc = dot_fma_avx2(q, &kc[at..at + d]);
        }
    }
}

/// `row[j] = exp(row[j] - max)` ([`exp_approx`]); returns their sum, added in 8 lanes then
/// reduced in [`matmul::reduce8`]'s order, the tail one by one.
fn exp_sum(row: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *x = exp_approx(*x - max);
            *a += *x;
        }
    }
    let mut s = matmul::reduce8(&acc);
    for x in chunks.into_remainder() {
        *x = exp_approx(*x - max);
        s += *x;
    }
    s
}

/// [`exp_sum`] with 8-lane vectors: the same operations, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp_sum_avx2(row: &mut [f32], max: f32) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    let m = _mm256_set1_ps(max);
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: c holds 8 values.
        unsafe {
            let e = exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut s = matmul::hsum8(acc);
    for x in chunks.into_remainder() {
        *x = exp_approx(*x - max);
        s += *x;
    }
    s
}

// `exp_approx`'s constants: Cody and Waite's split of ln 2 and Cephes' `expf` polynomial.
const EXP_LO: f32 = -87.336_55;
const EXP_HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `eˣ` within 2.5e-7 relative (a few ulp) for `x` in [-87.3, 88] (clamped there): `x = n·ln 2 + r`, a polynomial in
/// `r`, times `2ⁿ` built in the exponent bits.
///
/// NOTE: ours rather than libm's so that the AVX2 attention ([`exp8_avx2`]) computes exactly
/// the same bits eight at a time: softmax called the scalar `expf` once per score.
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    // NOTE: not `clamp`, which keeps a NaN; `max` drops it, as `_mm256_max_ps(x, lo)` does.
    #[allow(clippy::manual_clamp)]
    let x = x.max(EXP_LO).min(EXP_HI);
    let n = (x * LOG2E).round_ties_even();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p * r + c;
    }
    let y = (p * (r * r) + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// [`exp_approx`] on 8 lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp8_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
        _mm256_set1_ps(EXP_HI),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)),
    );
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(*c));
    }
    let y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
        _mm256_set1_ps(1.0),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// [`dot_fma`] on AVX2: the same lanes, fused products, sums and reduction.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_fma_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let n8 = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n8 <= the length of both.
        unsafe {
            let x = _mm256_loadu_ps(a.as_ptr().add(i));
            let y = _mm256_loadu_ps(b.as_ptr().add(i));
            acc = _mm256_fmadd_ps(x, y, acc);
        }
        i += 8;
    }
    let mut s = matmul::hsum8(acc);
    for (x, y) in a[n8..n].iter().zip(&b[n8..n]) {
        s = x.mul_add(*y, s);
    }
    s
}

/// `o[..64] (+)= Σ_j p[j] · v_j[c0 .. c0 + 64]` over the keys in order (`rows[j]`: where key
/// j's row starts), in eight registers; from zero when `first`, else on from `o`'s sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn pv64_avx2(p: &[f32], vc: &[f32], rows: &[usize], c0: usize, o: &mut [f32], first: bool) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    if !first {
        for (u, acc) in acc.iter_mut().enumerate() {
            // SAFETY: o holds 64 values.
            *acc = unsafe { _mm256_loadu_ps(o.as_ptr().add(8 * u)) };
        }
    }
    for (&pj, &at) in p.iter().zip(rows) {
        let v = &vc[at + c0..at + c0 + 64];
        let pj = _mm256_set1_ps(pj);
        for (u, acc) in acc.iter_mut().enumerate() {
            // SAFETY: v holds 64 values.
            let x = unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * u)) };
            *acc = _mm256_fmadd_ps(pj, x, *acc);
        }
    }
    for (u, acc) in acc.iter().enumerate() {
        // SAFETY: o holds 64 values.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * u), *acc) };
    }
}

/// An activation in f32 (see [`Activation`]).
#[inline]
fn activation(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Silu => x / (1.0 + (-x).exp()),
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

/// [`dot`] with fused multiply-adds (attention's scores: half the operations on CPUs with
/// FMA, and the AVX2 loops compute the same bits).
#[inline(always)]
fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = matmul::reduce8(&acc);
    for (x, y) in ar.iter().zip(br) {
        s = x.mul_add(*y, s);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_approx` against f64's `exp` over the range softmax uses (and a little past 0),
    /// and its clamps; the AVX2 version gives the same bits.
    #[test]
    fn exp_approx_is_within_two_ulp_and_the_same_on_avx2() {
        let xs: Vec<f32> = (0..20_000)
            .map(|i| -87.0 + 90.0 * i as f32 / 20_000.0)
            .chain([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.33])
            .collect();
        for &x in &xs {
            let (got, want) = (exp_approx(x), (x as f64).exp());
            assert!(
                ((got as f64 - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, not {want}"
            );
        }
        assert_eq!(exp_approx(-1e4), exp_approx(-87.336_55));
        assert!(exp_approx(-1e4) > 0.0 && exp_approx(-1e4) < 1.2e-38);
        assert!(exp_approx(1e4).is_finite());
        if matmul::Path::Avx2.available() {
            let mut a = xs.clone();
            let mut b = xs.clone();
            // SAFETY: AVX2 was detected.
            let s1 = unsafe { exp_sum_avx2(&mut a, 0.5) };
            let s2 = exp_sum(&mut b, 0.5);
            assert_eq!((a, s1), (b, s2));
        }
    }

    /// The AVX2 attention gives the portable loops' bits: head sizes below, at and past the
    /// 64-column parts (with tails), prefill and decode rows, a window and a soft cap.
    #[test]
    fn attention_on_avx2_matches_the_portable_loops_to_the_bit() {
        if !matmul::Path::Avx2.available() {
            return;
        }
        let mut seed = 0x5eed_a77e_u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let (hkv, rep, bs, num_blocks) = (2, 3, 4, 16);
        // sequence 0: 9 keys, its last 5 rows in the batch; sequence 1: 45 keys (more than
        // one block of PV_KEYS), one row
        let b = crate::backend::BatchInput {
            query_start: vec![0, 5, 6],
            seq_lens: vec![9, 45],
            block_tables: vec![
                3, 1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15,
            ],
            max_blocks: 12,
            ..Default::default()
        };
        let row_seq = [0, 0, 0, 0, 0, 1];
        for d in [8, 16, 64, 80, 128, 136] {
            let stride = (rep + 2) * hkv * d;
            let qkv: Vec<f32> = (0..6 * stride).map(|_| rnd()).collect();
            let kc: Vec<f32> = (0..num_blocks * hkv * bs * d).map(|_| rnd()).collect();
            let vc: Vec<f32> = (0..num_blocks * hkv * bs * d).map(|_| rnd()).collect();
            for (window, softcap) in [(None, 0.0), (Some(7), 1.5)] {
                let task = AttnTask {
                    row_seq: &row_seq,
                    b: &b,
                    opts: AttentionOptions {
                        scale: 0.3,
                        sliding_window: window,
                        logit_softcap: None,
                    },
                    qkv: &qkv,
                    kc: &kc,
                    vc: &vc,
                    scale: 0.3,
                    softcap,
                    d,
                    hkv,
                    rep,
                    bs,
                    stride,
                };
                for t in 0..row_seq.len() * hkv {
                    let (mut s1, mut s2) = (Scratch::default(), Scratch::default());
                    let (mut o1, mut o2) = (vec![f32::NAN; rep * d], vec![f32::NAN; rep * d]);
                    // SAFETY: AVX2 was detected above.
                    unsafe { task.run_avx2(&mut s1, t, &mut o1) };
                    task.run::<false>(&mut s2, t, &mut o2);
                    assert!(o1.iter().all(|v| v.is_finite()), "d={d} task {t}");
                    assert_eq!(o1, o2, "d={d} task {t} window {window:?}");
                }
            }
        }
    }
}
