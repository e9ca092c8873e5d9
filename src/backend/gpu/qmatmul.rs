//! Weights kept in GGML's block formats on the CUDA and HIP backends (and the emulator): the
//! upload, and the launches of kernels/qmatmul.cu.
//!
//! A weight `[n, k]` of one or more parts (row ranges of one type each, as in
//! [`QuantTensor`]) is one allocation. For each part, one after the other, 16-byte aligned,
//! blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) in planes:
//!
//! ```text
//!   qs  [rows, k/32, 16 bytes] (Q8_0: 32)   the packed values, as the block stores them
//!   qh  [rows, k/32] u32                    the fifth bits (Q5_0, Q5_1)
//!   d   [rows, k/32] f16 bits               the scales
//!   m   [rows, k/32] f16 bits               the minimums (Q4_1, Q5_1)
//! ```
//!
//! and super-blocks of 256 (Q2_K .. Q6_K, IQ4_XS), each padded to a multiple of 16 bytes
//! (`[rows, k/256, stride]`), with the words of its values in lane-major order: the words each
//! of the 8 lanes of `qmatvec_<type>` sums, next to each other ([`lane_word`]), so that a lane
//! loads its share 16 (or 8) bytes at a time.
//!
//! NOTE: planes and padding so that every load of a lane is aligned to its size (the file's
//! blocks of 18, 20, 22, 24, 34, 84, 110 and 210 bytes would not be), and the lane-major order
//! so that the super-blocks' loads are wide (the blocks of 32 are still read 4 bytes a lane);
//! the bytes are the same but for the padding of Q2_K (84 to 96 bytes, 14%), Q3_K (2%), Q6_K
//! (7%) and IQ4_XS (6%).

use super::kernels::{QMATVEC_ROWS, QUANT_TYPES};
use super::memory::{Layout, QPart};
use super::{Arg, Elem, GpuBackend, GpuBuf, GpuRuntime, u32_arg};
use crate::quant::{GgmlType, QuantTensor};
use anyhow::{Result, bail, ensure};
use std::sync::Arc;

/// Threads per block of `qmatvec_<type>`, and lanes per weight row of the blocks of 32 and
/// of the super-blocks (`QM_THREADS`, `QLANES` and `KLANES` in qmatmul.cu).
const QM_THREADS: usize = 256;
const QLANES: usize = 16;
const KLANES: usize = 8;

/// The kernels' name for a block type, where there is a kernel for it.
fn kernel_type(ty: GgmlType) -> Option<&'static str> {
    // NOTE: QUANT_TYPES names them in the order of GgmlType::WITH_KERNELS.
    let i = GgmlType::WITH_KERNELS.iter().position(|&t| t == ty)?;
    Some(QUANT_TYPES[i])
}

/// `t`'s parts in the device's layout (see the module's note), one after the other, and where
/// each starts.
fn device_layout(t: &QuantTensor) -> Result<(Vec<u8>, Vec<QPart>)> {
    ensure!(
        t.k.is_multiple_of(32),
        "rows of {} values are not whole blocks of 32",
        t.k
    );
    let mut bytes = Vec::with_capacity(t.bytes() + 64 * t.parts.len());
    let mut parts = Vec::with_capacity(t.parts.len());
    let align = |b: &mut Vec<u8>| b.resize(b.len().next_multiple_of(16), 0);
    for p in &t.parts {
        let Some(ty) = kernel_type(p.ty) else {
            bail!("{} weights have no GPU kernel", p.ty);
        };
        let (values, bb) = p.ty.block_layout();
        ensure!(
            t.k.is_multiple_of(values) && p.data.len() == p.rows * (t.k / values) * bb,
            "{} data of the wrong size for {} rows of {}",
            p.ty,
            p.rows,
            t.k
        );
        let blocks = p.data.chunks_exact(bb);
        if values == 256 {
            let (at, stride) = (bytes.len(), bb.next_multiple_of(16));
            for b in blocks {
                let start = bytes.len();
                bytes.resize(start + stride, 0);
                lane_major(p.ty, b, &mut bytes[start..]);
            }
            let layout = Layout::Padded { at, stride };
            parts.push(QPart {
                ty,
                rows: p.rows,
                layout,
            });
            continue;
        }
        // (offset of the minimum, of the fifth bits, of the values; values' bytes)
        let (mo, ho, vo, vb) = match p.ty {
            GgmlType::Q4_1 => (Some(2), None, 4, 16),
            GgmlType::Q5_0 => (None, Some(2), 6, 16),
            GgmlType::Q5_1 => (Some(2), Some(4), 8, 16),
            GgmlType::Q8_0 => (None, None, 2, 32),
            _ => (None, None, 2, 16), // Q4_0, IQ4_NL
        };
        // Bytes o .. o + len of every block, one after the other: a plane; where it starts.
        let mut plane = |o: usize, len: usize| {
            let at = bytes.len();
            blocks
                .clone()
                .for_each(|b| bytes.extend_from_slice(&b[o..o + len]));
            align(&mut bytes);
            at
        };
        let qs = plane(vo, vb);
        let qh = ho.map(|o| plane(o, 4));
        let d = plane(0, 2);
        let m = mo.map(|o| plane(o, 2));
        let layout = Layout::Planes { qs, qh, d, m };
        parts.push(QPart {
            ty,
            rows: p.rows,
            layout,
        });
    }
    Ok((bytes, parts))
}

/// Word `w` of a super-block as the file stores it goes to word `lane_word(ty, w)` on the
/// device: the words of values each lane of `qmatvec_k_impl` sums, next to each other (`k_word`
/// in kernels/qmatmul.cu, which reads them back; its table says where each section goes).
fn lane_word(ty: GgmlType, w: usize) -> usize {
    // (first word of the section, words in it, words a lane takes from it)
    let section = match ty {
        GgmlType::Q2_K => [(4, 16, 2), (0, 0, 1)],
        GgmlType::Q3_K => [(8, 16, 2), (0, 0, 1)],
        GgmlType::Q4_K => [(4, 32, 4), (0, 0, 1)],
        GgmlType::Q5_K => [(12, 32, 4), (0, 0, 1)],
        GgmlType::Q6_K => [(0, 32, 4), (32, 16, 2)],
        // the 8-byte header after the values; value words by lane group of 4
        GgmlType::IQ4_XS if w < 2 => return 32 + w,
        GgmlType::IQ4_XS => return 8 * ((w - 2) % 4) + (w - 2) / 4,
        _ => return w,
    };
    for (first, len, per_lane) in section {
        if (first..first + len).contains(&w) {
            let i = w - first;
            return first + per_lane * (i % 8) + i / 8;
        }
    }
    w
}

/// A super-block `src` of type `ty` in the device's order (into `dst`, its padded bytes).
fn lane_major(ty: GgmlType, src: &[u8], dst: &mut [u8]) {
    let words = src.len() / 4;
    for w in 0..words {
        let to = 4 * lane_word(ty, w);
        dst[to..to + 4].copy_from_slice(&src[4 * w..4 * w + 4]);
    }
    // Q3_K's and Q6_K's last 2 bytes (a half word: the scale d) stay where they are
    let tail = 4 * words;
    dst[tail..src.len()].copy_from_slice(&src[tail..]);
}

impl<R: GpuRuntime> GpuBackend<R> {
    /// Whether weights of type `ty` stay in their blocks here.
    pub(super) fn has_block_kernel(&self, ty: GgmlType) -> bool {
        kernel_type(ty).is_some()
    }

    /// Uploads a weight whose every part has a kernel ([`kernel_type`]).
    pub(super) fn upload_quant_op(&self, t: QuantTensor) -> Result<GpuBuf<R>> {
        let (bytes, parts) = device_layout(&t)?;
        let mut buf = self.upload_bytes(&bytes, bytes.len(), Elem::Blocks)?;
        // NOTE: `len` counts the weight's values (n·k), as for every other weight, so that
        // the ops' size checks read it alike.
        buf.len = t.rows() * t.k;
        buf.quant = Some(Arc::new(parts));
        Ok(buf)
    }

    fn quant_parts<'a>(&self, w: &'a GpuBuf<R>, what: &str) -> Result<&'a [QPart]> {
        match &w.quant {
            Some(p) if w.elem == Elem::Blocks => Ok(p),
            _ => bail!(
                "{what}: expected a weight in blocks, got a {:?} buffer",
                w.elem
            ),
        }
    }

    /// `out[m, n] = x[m, k] · Wᵀ (+ b)` for a weight in blocks: x quantized once per 32 and
    /// once per 256 as the parts need, then one launch per part. Sizes are checked by the
    /// caller.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qmatmul_op(
        &self,
        x: &GpuBuf<R>,
        w: &GpuBuf<R>,
        bias: Option<&GpuBuf<R>>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        let parts = self.quant_parts(w, "matmul")?;
        let grid_y = m.div_ceil(QMATVEC_ROWS);
        ensure!(
            grid_y <= 65535,
            "matmul: {m} rows is more than one launch takes"
        );
        let padded = |p: &&QPart| matches!(p.layout, Layout::Padded { .. });
        // x as the blocks of 32 take it: i8 [m, k], the scales and d·Σq per 32.
        let x32 = match parts.iter().any(|p| !padded(&p)) {
            true => Some(self.quantize_x(x, m * k / 32, 32)?),
            false => None,
        };
        // x as the super-blocks take it: i8 [m, k] in their lane-major order, and each lane's
        // record (its two groups' Σq and the scale).
        let x256 = match parts.iter().any(|p| padded(&p)) {
            true => Some(self.quantize_x(x, m * k / 256, 256)?),
            false => None,
        };
        let mut row0 = 0;
        for p in parts {
            let (lanes, args) = match (&p.layout, &x32, &x256) {
                (&Layout::Planes { qs, qh, d, m: mn }, Some(xq), _) => {
                    let at = |o: Option<usize>| Arg::P(o.map_or(0, |o| w.ptr() + o as u64));
                    let nb = u32_arg(k / 32, "blocks per row")?;
                    (
                        QLANES,
                        [
                            xq.args(),
                            vec![
                                u32_arg(m, "m")?,
                                nb,
                                at(Some(qs)),
                                at(qh),
                                at(Some(d)),
                                at(mn),
                            ],
                        ]
                        .concat(),
                    )
                }
                (&Layout::Padded { at, stride }, _, Some(xq)) => {
                    let nsb = u32_arg(k / 256, "super-blocks per row")?;
                    let w0 = Arg::P(w.ptr() + at as u64);
                    (
                        KLANES,
                        [
                            xq.args(),
                            vec![u32_arg(m, "m")?, nsb, w0, u32_arg(stride / 4, "stride")?],
                        ]
                        .concat(),
                    )
                }
                _ => unreachable!("x is quantized for every layout among the parts"),
            };
            let bias_part = bias.map_or(Arg::P(0), |b| Arg::P(b.ptr() + 4 * row0 as u64));
            let tail = [
                bias_part,
                Arg::P(out.ptr() + 4 * row0 as u64),
                u32_arg(p.rows, "rows")?,
                u32_arg(n, "n")?,
            ];
            self.launch(
                &format!("qmatvec_{}", p.ty),
                [p.rows.div_ceil(QM_THREADS / lanes) as u32, grid_y as u32, 1],
                [QM_THREADS as u32, 1, 1],
                0,
                &[args, tail.to_vec()].concat(),
            )?;
            row0 += p.rows;
        }
        Ok(())
    }

    /// `x` quantized per `group` (32 or 256) values over its `blocks` groups, by
    /// `quantize_x32_f32` or `quantize_x256_f32`.
    fn quantize_x(&self, x: &GpuBuf<R>, blocks: usize, group: usize) -> Result<QuantizedX<R>> {
        let q = self.alloc(blocks * group / 4, Elem::U32, false)?;
        let (d, sums) = if group == 32 {
            // the scales, and d·Σq per block
            let d = self.alloc(blocks, Elem::F32, false)?;
            (Some(d), self.alloc(blocks, Elem::F32, false)?)
        } else {
            // per lane of a super-block: {Σq of its two groups of 16, the scale, 0}
            (None, self.alloc(blocks * 32, Elem::U32, false)?)
        };
        let xq = QuantizedX { q, d, sums };
        let mut args = vec![Arg::P(x.ptr())];
        args.extend(xq.args());
        args.push(u32_arg(blocks, "blocks")?);
        self.elementwise(&format!("quantize_x{group}_f32"), blocks, &args)?;
        Ok(xq)
    }

    /// Rows of a table in blocks, dequantized: one launch per part, each writing the ids in
    /// its rows. Ids are checked by the caller.
    pub(super) fn qembedding_op(
        &self,
        table: &GpuBuf<R>,
        ids: &GpuBuf<R>,
        dim: usize,
        out: &mut GpuBuf<R>,
    ) -> Result<()> {
        let parts = self.quant_parts(table, "embedding")?;
        let n = ids.len;
        let mut row0 = 0;
        for p in parts {
            let at = |o: Option<usize>| Arg::P(o.map_or(0, |o| table.ptr() + o as u64));
            let weight = match p.layout {
                Layout::Planes { qs, qh, d, m } => vec![at(Some(qs)), at(qh), at(Some(d)), at(m)],
                Layout::Padded { at: a, stride } => {
                    vec![at(Some(a)), u32_arg(stride / 4, "stride")?]
                }
            };
            let rest = [
                Arg::P(ids.ptr()),
                Arg::P(out.ptr()),
                u32_arg(n, "tokens")?,
                u32_arg(dim, "dim")?,
                u32_arg(row0, "row")?,
                u32_arg(p.rows, "rows")?,
            ];
            self.elementwise(
                &format!("embedding_{}", p.ty),
                n * dim,
                &[weight, rest.to_vec()].concat(),
            )?;
            row0 += p.rows;
        }
        Ok(())
    }
}

/// Activations quantized for the block kernels: the i8 values (four to a word); per block of
/// 32 the scales and d·Σq, or per super-block the lanes' records (`quantize_x256_f32`).
struct QuantizedX<R: GpuRuntime> {
    q: GpuBuf<R>,
    d: Option<GpuBuf<R>>,
    sums: GpuBuf<R>,
}

impl<R: GpuRuntime> QuantizedX<R> {
    /// The kernels' first arguments.
    fn args(&self) -> Vec<Arg> {
        let mut a = vec![Arg::P(self.q.ptr())];
        a.extend(self.d.as_ref().map(|d| Arg::P(d.ptr())));
        a.push(Arg::P(self.sums.ptr()));
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lane-major order moves every whole word of a super-block to a word of its own
    /// inside the padded block, and keeps the half word at the end in place.
    #[test]
    fn lane_major_order_is_a_permutation_of_each_super_block() {
        for ty in GgmlType::WITH_KERNELS
            .into_iter()
            .filter(|t| t.block_layout().0 == 256)
        {
            let (_, bb) = ty.block_layout();
            let stride = bb.next_multiple_of(16);
            let mut to: Vec<usize> = (0..bb / 4).map(|w| lane_word(ty, w)).collect();
            assert!(to.iter().all(|&t| 4 * t + 4 <= stride), "{ty}: {to:?}");
            to.sort_unstable();
            to.dedup();
            assert_eq!(to.len(), bb / 4, "{ty}: two words land on one");
            let src: Vec<u8> = (0..bb).map(|i| i as u8).collect();
            let mut dst = vec![0u8; stride];
            lane_major(ty, &src, &mut dst);
            let mut bytes = dst[..bb.next_multiple_of(4)].to_vec();
            bytes.sort_unstable();
            assert_eq!(&bytes[bytes.len() - bb..], &src[..], "{ty}: bytes lost");
        }
    }
}
