//! The paged KV cache on wgpu: its buffers (split by blocks into parts that each fit one
//! storage binding), the step's K/V written at their slots (shaders/write_kv.wgsl), and the
//! block copies of swap.

use super::device::Bind;
use super::kernels::Kernel;
use super::{Elem, Part, WgpuBackend, WgpuBuf, rows};
use crate::backend::{KvLayout, QkvLayout, args};
use crate::tensor::DType;
use anyhow::{Result, bail, ensure};

impl WgpuBackend {
    pub(super) fn alloc_kv_op(&self, layout: KvLayout) -> Result<WgpuBuf> {
        anyhow::ensure!(
            layout.dtype == DType::F32,
            "the wgpu backend stores the KV cache in f32 only, not {}",
            layout.dtype.name()
        );
        let block = layout.block_len();
        let block_bytes = block as u64 * 4;
        let per = (self.gpu.max_binding / block_bytes.max(1)) as usize;
        if per == 0 {
            bail!(
                "wgpu backend: one KV block ({block_bytes} bytes) is larger than the adapter's \
                 storage binding ({} bytes)",
                self.gpu.max_binding
            );
        }
        let mut parts = Vec::new();
        for row0 in (0..layout.num_blocks).step_by(per) {
            let rows = per.min(layout.num_blocks - row0);
            let buf = self.gpu.buffer(rows as u64 * block_bytes, "KV cache")?;
            parts.push(Part { buf, row0, rows });
        }
        Ok(WgpuBuf {
            parts,
            elem: Elem::F32,
            len: layout.numel(),
            row_len: block,
            host: None,
        })
    }

    pub(super) fn read_kv_blocks_op(
        &self,
        cache: &WgpuBuf,
        block_len: usize,
        blocks: &[u32],
    ) -> Result<Vec<f32>> {
        ensure!(
            cache.elem == Elem::F32,
            "read_kv_blocks: the KV cache is not f32"
        );
        args::kv_blocks("read_kv_blocks", blocks, block_len, cache.len)?;
        let binds = blocks
            .iter()
            .map(|&b| cache.block_bind(b as usize, block_len))
            .collect::<Result<Vec<_>>>()?;
        let bytes = self.gpu.read(&binds)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    pub(super) fn write_kv_blocks_op(
        &self,
        cache: &mut WgpuBuf,
        block_len: usize,
        blocks: &[u32],
        data: &[f32],
    ) -> Result<()> {
        ensure!(
            cache.elem == Elem::F32,
            "write_kv_blocks: the KV cache is not f32"
        );
        args::kv_blocks_data(data, blocks, block_len)?;
        args::kv_blocks("write_kv_blocks", blocks, block_len, cache.len)?;
        let binds = blocks
            .iter()
            .map(|&b| cache.block_bind(b as usize, block_len))
            .collect::<Result<Vec<_>>>()?;
        self.gpu.copy_in(bytemuck::cast_slice(data), &binds)
    }

    pub(super) fn write_kv_op(
        &self,
        qkv: &WgpuBuf,
        slot_mapping: &WgpuBuf,
        rows_n: usize,
        layout: QkvLayout,
        k_cache: &mut WgpuBuf,
        v_cache: &mut WgpuBuf,
        kv: KvLayout,
    ) -> Result<()> {
        let (sb, slots) = slot_mapping.u32("slot mapping")?;
        let caches = (k_cache.len, v_cache.len);
        args::write_kv(qkv.len, slots, rows_n, layout, caches, kv)?;
        ensure!(
            k_cache.parts.len() == v_cache.parts.len(),
            "write_kv: K and V caches are split differently"
        );
        let stride = layout.row_len();
        let qb = qkv.f32("qkv")?;
        for (r0, n) in self.windows(rows_n, &[stride as u64 * 4])? {
            for (kp, vp) in k_cache.parts.iter().zip(&v_cache.parts) {
                let params = [
                    n as u32,
                    r0 as u32,
                    layout.num_kv_heads as u32,
                    layout.head_dim as u32,
                    kv.block_size as u32,
                    stride as u32,
                    layout.q_len() as u32,
                    kp.row0 as u32,
                    kp.rows as u32,
                ];
                self.gpu.dispatch(
                    &Kernel::WriteKv.key(),
                    &params,
                    &[
                        rows(qb, r0, n, stride),
                        Bind::whole(sb),
                        Bind::whole(&kp.buf),
                        Bind::whole(&vp.buf),
                    ],
                    self.grid(n * layout.kv_len()),
                )?;
            }
        }
        Ok(())
    }
}
