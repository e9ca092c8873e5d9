//! The norms on the GPU backends (RMSNorm, the residual add fused with it, LayerNorm, the
//! per-head Q/K norm): one block per row; the kernels are in kernels/norm.cu.

use super::{Arg, Elem, GpuBackend, GpuBuf, GpuRuntime, u32_arg};
use crate::backend::{QkNormSpan, QkvLayout, args};
use anyhow::{Result, ensure};

impl<R: GpuRuntime> GpuBackend<R> {
    /// A norm kernel's launch: one block per row of `dim` values.
    fn row_launch(&self, name: &str, rows: usize, dim: usize, args: &[Arg]) -> Result<()> {
        ensure!(rows <= i32::MAX as usize, "{name}: too many rows");
        let threads = self.norm_threads(dim);
        self.launch(name, [rows as u32, 1, 1], [threads, 1, 1], 0, args)
    }

    pub(super) fn rms_norm_op(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "rms_norm x")?;
        w.expect(Elem::F32, "rms_norm weight")?;
        args::rms_norm(x.len, w.len, rows, dim, out.len)?;
        self.row_launch(
            "rms_norm_f32",
            rows,
            dim,
            &[
                Arg::P(x.ptr()),
                Arg::P(w.ptr()),
                Arg::P(out.ptr()),
                u32_arg(dim, "dim")?,
                Arg::F(eps),
            ],
        )
    }

    pub(super) fn qk_norm_op(
        &self,
        qkv: &mut GpuBuf<R>,
        q_w: &GpuBuf<R>,
        k_w: &GpuBuf<R>,
        rows: usize,
        (layout, span): (QkvLayout, QkNormSpan),
        eps: f32,
    ) -> Result<()> {
        self.rt.bind()?;
        qkv.expect(Elem::F32, "qk_norm qkv")?;
        q_w.expect(Elem::F32, "q norm weight")?;
        k_w.expect(Elem::F32, "k norm weight")?;
        args::qk_norm(qkv.len, q_w.len, k_w.len, rows, layout, span)?;
        let (nq, qs, nk, ks) = span.spans(layout);
        if rows == 0 || nq + nk == 0 {
            return Ok(());
        }
        ensure!(rows <= i32::MAX as usize, "qk_norm: too many rows");
        self.launch(
            "qk_norm_f32",
            [rows as u32, u32_arg(nq + nk, "spans")?.bits() as u32, 1],
            [self.norm_threads(qs.max(ks)), 1, 1],
            0,
            &[
                Arg::P(qkv.ptr()),
                Arg::P(q_w.ptr()),
                Arg::P(k_w.ptr()),
                u32_arg(nq, "q spans")?,
                u32_arg(qs, "q span")?,
                u32_arg(ks, "k span")?,
                u32_arg(layout.row_len(), "row length")?,
                Arg::F(eps),
                u32_arg(span.own_weights() as usize, "own weights")?,
                u32_arg(span.centered() as usize, "center")?,
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_rms_norm_op(
        &self,
        x: &mut GpuBuf<R>,
        y: &GpuBuf<R>,
        w: &GpuBuf<R>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "add_rms_norm x")?;
        y.expect(Elem::F32, "add_rms_norm y")?;
        w.expect(Elem::F32, "add_rms_norm weight")?;
        args::add_rms_norm(x.len, y.len, w.len, rows, dim, out.len)?;
        self.row_launch(
            "add_rms_norm_f32",
            rows,
            dim,
            &[
                Arg::P(x.ptr()),
                Arg::P(y.ptr()),
                Arg::P(w.ptr()),
                Arg::P(out.ptr()),
                u32_arg(dim, "dim")?,
                Arg::F(eps),
            ],
        )
    }

    pub(super) fn layer_norm_op(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        b: &GpuBuf<R>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "layer_norm x")?;
        w.expect(Elem::F32, "layer_norm weight")?;
        b.expect(Elem::F32, "layer_norm bias")?;
        args::layer_norm(x.len, w.len, b.len, rows, dim, out.len)?;
        self.row_launch(
            "layer_norm_f32",
            rows,
            dim,
            &[
                Arg::P(x.ptr()),
                Arg::P(w.ptr()),
                Arg::P(b.ptr()),
                Arg::P(out.ptr()),
                u32_arg(dim, "dim")?,
                Arg::F(eps),
            ],
        )
    }
}
