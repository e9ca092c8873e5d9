//! Matrix products on the GPU backends: the decode matvecs (weights streamed once for up to
//! `MATVEC_MAX_ROWS` rows, the gated one writing act(gate)·up) and the tiled GEMMs or the
//! vendor's; the kernels are in kernels/matmul.cu.

use super::kernels::MATVEC_MAX_ROWS;
use super::{Arg, Elem, GemmEx, GpuBackend, GpuBuf, GpuRuntime, u32_arg};
use super::{GemmPath, ptr_or_null};
use crate::backend::{Activation, Backend, args};
use anyhow::{Result, ensure};

impl<R: GpuRuntime> GpuBackend<R> {
    pub(super) fn matmul_op(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        bias: Option<&GpuBuf<R>>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        self.rt.bind()?;
        x.expect(Elem::F32, "matmul x")?;
        out.expect(Elem::F32, "matmul out")?;
        args::matmul(x.len, w.len, bias.map(|b| b.len), (m, k, n), out.len)?;
        if let Some(b) = bias {
            b.expect(Elem::F32, "matmul bias")?;
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if w.elem == Elem::Blocks {
            return self.qmatmul_op(x, w, bias, m, k, n, out);
        }
        let dt = w.elem.kernel_suffix()?;
        let (mu, nu, ku) = (u32_arg(m, "m")?, u32_arg(n, "n")?, u32_arg(k, "k")?);
        let vec = if w.elem == Elem::F32 { 4 } else { 8 };
        if m <= MATVEC_MAX_ROWS && k.is_multiple_of(vec) {
            // Decode: weights streamed once, x kept in f32.
            let warps = 256 / self.rt.warp_size();
            return self.launch(
                &format!("matvec_{dt}_{m}"),
                [n.div_ceil(warps as usize) as u32, 1, 1],
                [256, 1, 1],
                0,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(w.ptr()),
                    ptr_or_null(bias),
                    Arg::P(out.ptr()),
                    nu,
                    ku,
                ],
            );
        }
        if self.gemm_path == GemmPath::Auto && self.rt.has_blas() {
            // NOTE: vendor GEMMs take both operands in one type, so with half weights x is
            // rounded to that type first (as a framework running in f16/bf16 would have it).
            let xb = match w.elem {
                Elem::F32 => None,
                e => {
                    let xh = self.alloc(m * k, e, false)?;
                    let cast = if e == Elem::F16 {
                        "cast_f32_f16"
                    } else {
                        "cast_f32_bf16"
                    };
                    self.elementwise(
                        cast,
                        m * k,
                        &[Arg::P(x.ptr()), Arg::P(xh.ptr()), u32_arg(m * k, "m*k")?],
                    )?;
                    Some(xh)
                }
            };
            let xp = xb.as_ref().map_or(x.ptr(), |b| b.ptr());
            self.timed("gemm (vendor BLAS)", || {
                // SAFETY: sizes checked above; xb holds m*k elements of w's type.
                unsafe {
                    let g = GemmEx::linear(w.elem, m, n, k, xp, w.ptr(), out.ptr());
                    self.rt.gemm_ex(&g)
                }
            })?;
            if let Some(b) = bias {
                self.elementwise(
                    "add_bias_f32",
                    m * n,
                    &[Arg::P(out.ptr()), Arg::P(b.ptr()), mu, nu],
                )?;
            }
            return Ok(());
        }
        ensure!(
            m.div_ceil(64) <= 65535,
            "matmul: {m} rows is more than one launch takes"
        );
        self.launch(
            &format!("gemm_{dt}"),
            [n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1],
            [256, 1, 1],
            0,
            &[
                Arg::P(x.ptr()),
                Arg::P(w.ptr()),
                ptr_or_null(bias),
                Arg::P(out.ptr()),
                mu,
                nu,
                ku,
            ],
        )
    }

    pub(super) fn matmul_gated_act_op(
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
        let vec = if w_gate_up.elem == Elem::F32 { 4 } else { 8 };
        // NOTE: weights in blocks take the two steps (there is no fused kernel for them): at
        // decode the gate/up rows written and read again are 2·F floats a row, against the
        // 2F·k weights (about F·k bytes at 4 bits) the matvec streams.
        if rows == 0
            || rows > MATVEC_MAX_ROWS
            || !k.is_multiple_of(vec)
            || w_gate_up.elem == Elem::Blocks
        {
            self.matmul(x, w_gate_up, None, rows, k, 2 * ffn, gate_up)?;
            return self.gated_act(gate_up, rows, ffn, act, out);
        }
        // Decode: the gate and up rows streamed together, their product written once.
        self.rt.bind()?;
        x.expect(Elem::F32, "matmul_gated_act x")?;
        out.expect(Elem::F32, "matmul_gated_act out")?;
        args::matmul_gated_act(x.len, w_gate_up.len, rows, k, ffn, out.len)?;
        let dt = w_gate_up.elem.kernel_suffix()?;
        let warps = 256 / self.rt.warp_size();
        self.launch(
            &format!("matvec_gated_{dt}_{rows}"),
            [ffn.div_ceil(warps as usize) as u32, 1, 1],
            [256, 1, 1],
            0,
            &[
                Arg::P(x.ptr()),
                Arg::P(w_gate_up.ptr()),
                Arg::P(out.ptr()),
                u32_arg(ffn, "ffn")?,
                u32_arg(k, "k")?,
                Arg::U(act.code()),
            ],
        )
    }
}
