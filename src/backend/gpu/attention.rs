//! Paged attention on the GPU backends: which kernel a call takes (decode, tensor-core prefill
//! or the general one; the plans are in `plan.rs`), its checks and its launches; the kernels
//! are in kernels/attention.cu.

use super::plan::{
    AttentionLaunch, DEC_THREADS, plan_attention, plan_decode_attention, plan_prefill_attention_mma,
};
use super::{Arg, Elem, GpuBackend, GpuBuf, GpuRuntime, kernels, u32_arg};
use crate::backend::args;
use crate::backend::{Alibi, AttentionOptions, DeviceBatch, KvLayout, QkvLayout};
use anyhow::{Result, ensure};

impl<R: GpuRuntime> GpuBackend<R> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        &self,
        qkv: &GpuBuf<R>,
        k_cache: &GpuBuf<R>,
        v_cache: &GpuBuf<R>,
        batch: &DeviceBatch<GpuBackend<R>>,
        layout: QkvLayout,
        kv: KvLayout,
        opts: AttentionOptions,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        let (window, softcap) = (opts.window_u32()?, opts.softcap_f32()?);
        let (a_scale, a_l0, a_p, a_h0) = Alibi::kernel_args(opts.alibi);
        let alibi = [Arg::F(a_scale), Arg::F(a_l0), Arg::U(a_p), Arg::U(a_h0)];
        self.rt.bind()?;
        let b = &batch.host;
        let (d, h, hkv, bs) = (
            layout.head_dim,
            layout.num_heads,
            layout.num_kv_heads,
            kv.block_size,
        );
        let caches = (k_cache.len, v_cache.len);
        args::paged_attention(qkv.len, b.num_tokens(), layout, caches, kv, out.len)?;
        // NOTE: K, V and q rows are read in 16-byte chunks (8-byte for fp8 rows, see below).
        ensure!(
            d % 8 == 0,
            "paged_attention: head size {d} is not a multiple of 8"
        );
        let t_rows = b.num_tokens();
        ensure!(
            k_cache.elem == v_cache.elem,
            "paged_attention: K and V caches of different types"
        );
        // NOTE: the tensor-core and decode kernels have instances for head sizes that are
        // multiples of 16 only; the general kernel reads fp8 rows of 8 mod 16 in 8-byte chunks.
        let kv_type = k_cache.elem.kernel_suffix()?;
        batch.shape.check_kv(kv.num_blocks, bs, b.max_blocks)?;
        let max_q = batch.shape.max_query_len;
        if t_rows == 0 || b.num_seqs() == 0 {
            return Ok(());
        }
        ensure!(
            b.num_seqs() <= 65535,
            "paged_attention: more than 65535 sequences in one step"
        );
        // Pure decode steps take the decode kernel where it has an instance; the rest
        // (prefill chunks, mixed batches) the general one.
        let decode = (max_q == 1)
            .then(|| {
                plan_decode_attention(
                    b.num_seqs(),
                    b.max_seq_len(),
                    h / hkv,
                    d,
                    hkv,
                    bs,
                    k_cache.elem.size(),
                    self.rt.warp_size() as usize,
                    self.rt.multiprocessors() as usize,
                )
            })
            .flatten();
        // NOTE: prefill on tensor cores rounds Q and P to a 16-bit type; an f32 cache stays on
        // the general kernel, the exact one, and so do decode steps the decode kernel cannot
        // take (one row per sequence would fill one of a warp's 16 rows).
        let mma = (max_q > 1 && self.mma_attention && kernels::MMA_KV_DTYPES.contains(&kv_type))
            .then(|| {
                plan_prefill_attention_mma(
                    b.num_seqs(),
                    max_q,
                    b.max_seq_len(),
                    h / hkv,
                    d,
                    hkv,
                    self.rt.multiprocessors() as usize,
                )
            })
            .flatten();
        let plan = match (decode, mma) {
            (Some(p), _) => AttentionLaunch::Decode(p),
            (None, Some(p)) => AttentionLaunch::Prefill(p),
            (None, None) => AttentionLaunch::General(plan_attention(
                b.num_seqs(),
                max_q,
                b.max_seq_len(),
                h / hkv,
                d,
                hkv,
                self.rt.multiprocessors() as usize,
            )?),
        };
        let (part_size, num_splits) = plan.split();
        let mma_kernel = matches!(plan, AttentionLaunch::Prefill(_))
            .then(|| format!("paged_attention_prefill_{kv_type}_d{d}"));
        let split = num_splits > 1;
        let parts = if split {
            let n = t_rows * h * num_splits;
            Some((
                self.alloc(n * d, Elem::F32, false)?,
                self.alloc(n * 2, Elem::F32, false)?,
            ))
        } else {
            None
        };
        let (pa, pm) = parts.as_ref().map_or((Arg::P(0), Arg::P(0)), |(a, m)| {
            (Arg::P(a.ptr()), Arg::P(m.ptr()))
        });
        // the arguments both kernels begin with
        let mut args = vec![
            Arg::P(qkv.ptr()),
            Arg::P(k_cache.ptr()),
            Arg::P(v_cache.ptr()),
            Arg::P(batch.query_start.ptr()),
            Arg::P(batch.seq_lens.ptr()),
            Arg::P(batch.block_tables.ptr()),
            Arg::P(out.ptr()),
            pa,
            pm,
            u32_arg(b.max_blocks, "max blocks")?,
            u32_arg(h, "heads")?,
            u32_arg(hkv, "kv heads")?,
        ];
        match plan {
            AttentionLaunch::Decode(p) => {
                args.extend([
                    Arg::U(bs.trailing_zeros()),
                    u32_arg(layout.row_len(), "row length")?,
                    Arg::F(opts.scale),
                    Arg::U(window),
                    Arg::F(softcap),
                    u32_arg(p.part_size, "partition")?,
                    u32_arg(p.num_splits, "splits")?,
                ]);
                args.extend(alibi);
                self.launch(
                    &format!("paged_attention_decode_{kv_type}_d{d}"),
                    [
                        b.num_seqs() as u32,
                        hkv as u32,
                        u32_arg(p.num_splits, "splits")?.bits() as u32,
                    ],
                    [DEC_THREADS as u32, 1, 1],
                    p.shared_bytes as u32,
                    &args,
                )?;
            }
            AttentionLaunch::Prefill(p) | AttentionLaunch::General(p) => {
                // NOTE: the tensor-core kernel has its head size and key tile built in.
                let general = mma_kernel.is_none();
                if general {
                    args.push(u32_arg(d, "head_dim")?);
                }
                args.extend([
                    u32_arg(bs, "block size")?,
                    u32_arg(layout.row_len(), "row length")?,
                    Arg::F(opts.scale),
                    Arg::U(window),
                    Arg::F(softcap),
                    u32_arg(p.q_tile, "q tile")?,
                ]);
                if general {
                    args.push(u32_arg(p.k_tile, "k tile")?);
                }
                args.extend([
                    u32_arg(p.part_size, "partition")?,
                    u32_arg(p.num_splits, "splits")?,
                ]);
                args.extend(alibi);
                self.launch(
                    &mma_kernel.unwrap_or_else(|| format!("paged_attention_{kv_type}")),
                    [
                        u32_arg(p.num_q_tiles, "query tiles")?.bits() as u32,
                        b.num_seqs() as u32,
                        u32_arg(hkv * p.num_splits, "kv heads x splits")?.bits() as u32,
                    ],
                    [p.threads as u32, 1, 1],
                    p.shared_bytes as u32,
                    &args,
                )?;
            }
        }
        if split {
            let w = self.rt.warp_size() as usize;
            let threads = d.div_ceil(w).clamp(1, 128 / w.min(128)) * w;
            self.launch(
                "attention_reduce_f32",
                [u32_arg(t_rows, "rows")?.bits() as u32, h as u32, 1],
                [threads as u32, 1, 1],
                0,
                &[
                    pa,
                    pm,
                    Arg::P(batch.query_start.ptr()),
                    Arg::P(batch.seq_lens.ptr()),
                    Arg::P(out.ptr()),
                    u32_arg(b.num_seqs(), "sequences")?,
                    u32_arg(h, "heads")?,
                    u32_arg(d, "head_dim")?,
                    u32_arg(part_size, "partition")?,
                    u32_arg(num_splits, "splits")?,
                ],
            )?;
        }
        Ok(())
    }
}
