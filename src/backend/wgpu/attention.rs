//! Paged attention on wgpu (shaders/attention.wgsl): a workgroup per (query row, kv head)
//! group of query heads, online softmax over the sequence's blocks, its state `(m, l, acc)`
//! carried from one part of the cache to the next where the cache is split.

use super::device::Bind;
use super::kernels::Kernel;
use super::{WgpuBackend, WgpuBuf, rows};
use crate::backend::{Alibi, AttentionOptions, DeviceBatch, KvLayout, QkvLayout, args};
use anyhow::{Result, ensure};

impl WgpuBackend {
    pub(super) fn paged_attention_op(
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
        let (window, softcap) = (opts.window_u32()?, opts.softcap_f32()?);
        let (a_scale, a_l0, a_p, a_h0) = Alibi::kernel_args(opts.alibi);
        let b = &batch.host;
        let (d, h, hkv, bs) = (
            layout.head_dim,
            layout.num_heads,
            layout.num_kv_heads,
            kv.block_size,
        );
        let caches = (k_cache.len, v_cache.len);
        args::paged_attention(qkv.len, b.num_tokens(), layout, caches, kv, out.len)?;
        ensure!(
            (1..=256).contains(&d),
            "paged_attention: head_dim {d} is not supported by the wgpu kernel (at most 256)"
        );
        let t_rows = b.num_tokens();
        batch.shape.check_kv(kv.num_blocks, bs, b.max_blocks)?;
        if t_rows == 0 {
            return Ok(());
        }
        let rep = h / hkv;
        let dc = d.div_ceil(64);
        let hpw = rep.min(16).min(1024 / d).min(32 / dc).max(1);
        let nsub = rep.div_ceil(hpw);
        let stride = layout.row_len();
        let qb = qkv.f32("qkv")?;
        let ob = out.f32("attention output")?;
        let qs = batch.query_start.whole("query_start")?;
        let sl = batch.seq_lens.whole("seq_lens")?;
        let bt = batch.block_tables.whole("block tables")?;
        let parts = k_cache.parts.len();
        ensure!(
            parts == v_cache.parts.len(),
            "paged_attention: K and V caches are split differently"
        );
        let state_row = h * (d + 2);
        let mut row_bytes = vec![stride as u64 * 4, (h * d) as u64 * 4];
        if parts > 1 {
            row_bytes.push(state_row as u64 * 4);
        }
        let wins = self.windows(t_rows, &row_bytes)?;
        let state = if parts > 1 {
            let most = wins.iter().map(|w| w.1).max().unwrap_or(0);
            Some(
                self.gpu
                    .buffer((most * state_row) as u64 * 4, "attention state")?,
            )
        } else {
            None
        };
        for (r0, n) in wins {
            for (i, (kp, vp)) in k_cache.parts.iter().zip(&v_cache.parts).enumerate() {
                let mode = (i == 0) as u32 | (((i + 1 == parts) as u32) << 1);
                let params = [
                    n as u32,
                    r0 as u32,
                    b.num_seqs() as u32,
                    b.max_blocks as u32,
                    h as u32,
                    hkv as u32,
                    d as u32,
                    bs as u32,
                    hpw as u32,
                    kp.row0 as u32,
                    kp.rows as u32,
                    mode,
                    opts.scale.to_bits(),
                    window,
                    softcap.to_bits(),
                    a_scale.to_bits(),
                    a_l0.to_bits(),
                    a_p,
                    a_h0,
                ];
                let st = match &state {
                    Some(s) => rows(s, 0, n, state_row),
                    None => Bind::whole(&self.gpu.dummy),
                };
                self.gpu.dispatch(
                    &Kernel::Attention.key(),
                    &params,
                    &[
                        rows(qb, r0, n, stride),
                        Bind::whole(qs),
                        Bind::whole(sl),
                        Bind::whole(bt),
                        Bind::whole(&kp.buf),
                        Bind::whole(&vp.buf),
                        rows(ob, r0, n, h * d),
                        st,
                    ],
                    [n as u32, hkv as u32, nsub as u32],
                )?;
            }
        }
        Ok(())
    }
}
