//! Weights kept in GGML block formats: the types (with their GGUF ids and block layouts), the
//! reference dequantizers (`dequant.rs`), and [`QuantTensor`], a linear weight whose rows stay in
//! their block format in memory for the backends that multiply them as they are (the CPU's
//! `qmatmul`).

mod dequant;

pub use dequant::{IQ4_LEVELS, dequantize, dequantize_into};

use anyhow::{Result, bail};
use std::fmt;

/// GGML tensor element types, with their GGUF type ids.
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

impl GgmlType {
    /// The type with GGUF/GGML type id `id`, if it is one this reader knows.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block), as in ggml's type traits.
    pub fn block_layout(self) -> (usize, usize) {
        use GgmlType::*;
        const QK_K: usize = 256;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 2 + 16),
            Q4_1 => (32, 2 + 2 + 16),
            Q5_0 => (32, 2 + 4 + 16),
            Q5_1 => (32, 2 + 2 + 4 + 16),
            Q8_0 => (32, 2 + 32),
            Q8_1 => (32, 2 + 2 + 32),
            Q2_K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3_K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4_K => (QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5_K => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6_K => (QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8_K => (QK_K, 4 + QK_K + QK_K / 8),
            IQ2_XXS => (QK_K, 2 + QK_K / 4),
            IQ2_XS => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3_XXS => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1_S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4_NL => (32, 2 + 16),
            IQ3_S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2_S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4_XS => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            IQ1_M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            TQ1_0 => (QK_K, 2 + 4 * 13),
            TQ2_0 => (QK_K, 2 + 64),
            MXFP4 => (32, 1 + 16),
        }
    }

    /// Whether [`dequantize`] handles this type.
    pub fn is_supported(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q2_K
                | Q3_K
                | Q4_K
                | Q5_K
                | Q6_K
                | IQ4_NL
                | IQ4_XS
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl GgmlType {
    /// The types a weight can stay in: those the quantized matmuls multiply as they are
    /// (blocks of 32, then super-blocks of 256).
    pub const WITH_KERNELS: [GgmlType; 12] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::IQ4_NL,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ];

    /// Whether a weight of this type can stay in its block format: one of
    /// [`Self::WITH_KERNELS`] (the others are dequantized at load).
    pub fn has_kernel(self) -> bool {
        Self::WITH_KERNELS.contains(&self)
    }

    /// Bytes of one row of `k` values, if `k` is a whole number of blocks.
    pub fn row_bytes(self, k: usize) -> Result<usize> {
        let (block, bytes) = self.block_layout();
        if !k.is_multiple_of(block) {
            bail!("rows of {k} values are not a whole number of {self} blocks of {block}");
        }
        (k / block)
            .checked_mul(bytes)
            .ok_or_else(|| anyhow::anyhow!("rows of {k} {self} values are too long"))
    }
}

/// Consecutive rows `[rows, k]` of a linear weight in one block format.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantPart {
    pub ty: GgmlType,
    pub rows: usize,
    /// `rows` rows of `ty.row_bytes(k)` bytes, in the file's block layout.
    pub data: Vec<u8>,
}

/// A linear weight `[n, k]` (PyTorch order) whose rows stay in GGML block formats: row ranges
/// (parts), each in one type with a kernel ([`GgmlType::has_kernel`]).
///
/// NOTE: parts because fused projections mix types: a Q4_K_M file stores Q and K in Q5_0 and
/// V in Q8_0, and the three become one QKV matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantTensor {
    pub k: usize,
    pub parts: Vec<QuantPart>,
}

impl QuantTensor {
    /// `rows` rows of `k` values of type `ty` in `data`, checked.
    pub fn new(ty: GgmlType, rows: usize, k: usize, data: Vec<u8>) -> Result<Self> {
        if !ty.has_kernel() {
            bail!("{ty} weights cannot stay quantized (no kernel for them)");
        }
        let need = ty
            .row_bytes(k)?
            .checked_mul(rows)
            .ok_or_else(|| anyhow::anyhow!("{rows} rows of {k} {ty} values are too many"))?;
        if data.len() != need {
            bail!(
                "{rows} rows of {k} {ty} values take {need} bytes, but {} were given",
                data.len()
            );
        }
        Ok(QuantTensor {
            k,
            parts: vec![QuantPart { ty, rows, data }],
        })
    }

    /// Rows in all parts (`n`).
    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    /// Bytes the weight takes in memory.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// The rows of `parts` one after the other (a fused projection); neighbouring parts of
    /// one type become one part.
    pub fn stack(tensors: Vec<QuantTensor>) -> Result<QuantTensor> {
        let Some(k) = tensors.first().map(|t| t.k) else {
            bail!("stacking no tensors");
        };
        let mut parts: Vec<QuantPart> = Vec::new();
        for t in tensors {
            if t.k != k {
                bail!("stacking rows of {} values onto rows of {k}", t.k);
            }
            for p in t.parts {
                match parts.last_mut() {
                    Some(last) if last.ty == p.ty => {
                        last.rows += p.rows;
                        last.data.extend_from_slice(&p.data);
                    }
                    _ => parts.push(p),
                }
            }
        }
        Ok(QuantTensor { k, parts })
    }

    /// The rows in the order `order` (row `i` of the result is row `order[i]` of `self`); a
    /// single-part tensor only (the Q/K permutation of llama GGUFs).
    pub fn select_rows(&self, order: &[usize]) -> Result<QuantTensor> {
        let [part] = self.parts.as_slice() else {
            bail!("reordering the rows of a weight with several types");
        };
        let rb = part.ty.row_bytes(self.k)?;
        let mut data = Vec::with_capacity(order.len() * rb);
        for &r in order {
            if r >= part.rows {
                bail!("row {r} of a weight with {} rows", part.rows);
            }
            data.extend_from_slice(&part.data[r * rb..(r + 1) * rb]);
        }
        QuantTensor::new(part.ty, order.len(), self.k, data)
    }

    /// Rows `r` of all parts (a tensor-parallel shard of a column-parallel weight).
    pub fn slice_rows(&self, r: std::ops::Range<usize>) -> Result<QuantTensor> {
        if r.start >= r.end || r.end > self.rows() {
            bail!(
                "rows {}..{} of a weight with {} rows",
                r.start,
                r.end,
                self.rows()
            );
        }
        let mut pieces = Vec::new();
        let mut at = 0;
        for p in &self.parts {
            let (lo, hi) = (r.start.max(at), r.end.min(at + p.rows));
            if lo < hi {
                let rb = p.data.len() / p.rows;
                let data = p.data[(lo - at) * rb..(hi - at) * rb].to_vec();
                pieces.push(QuantTensor::new(p.ty, hi - lo, self.k, data)?);
            }
            at += p.rows;
        }
        QuantTensor::stack(pieces)
    }

    /// Columns `c` of every row (a shard of a row-parallel weight), where `c` starts and ends
    /// on a block boundary of every part; `None` where it does not (blocks cannot be split).
    pub fn slice_cols(&self, c: std::ops::Range<usize>) -> Result<Option<QuantTensor>> {
        if c.start >= c.end || c.end > self.k {
            bail!(
                "columns {}..{} of a weight with {} columns",
                c.start,
                c.end,
                self.k
            );
        }
        let mut pieces = Vec::with_capacity(self.parts.len());
        for p in &self.parts {
            let (be, bb) = p.ty.block_layout();
            if !c.start.is_multiple_of(be) || !c.end.is_multiple_of(be) {
                return Ok(None);
            }
            let rb = p.ty.row_bytes(self.k)?;
            let (lo, hi) = (c.start / be * bb, c.end / be * bb);
            let mut data = Vec::with_capacity(p.rows * (hi - lo));
            for row in p.data.chunks_exact(rb) {
                data.extend_from_slice(&row[lo..hi]);
            }
            pieces.push(QuantTensor::new(p.ty, p.rows, c.len(), data)?);
        }
        QuantTensor::stack(pieces).map(Some)
    }

    /// The type and bytes of row `r`.
    pub fn row(&self, mut r: usize) -> Option<(GgmlType, &[u8])> {
        for p in &self.parts {
            if r < p.rows {
                let rb = p.data.len() / p.rows;
                return Some((p.ty, &p.data[r * rb..(r + 1) * rb]));
            }
            r -= p.rows;
        }
        None
    }

    /// All values as f32 `[n, k]`, row-major: the reference the kernels are checked against,
    /// and what backends without quantized kernels upload.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.rows() * self.k];
        let mut at = 0;
        for p in &self.parts {
            let n = p.rows * self.k;
            dequantize_into(p.ty, &p.data, &mut out[at..at + n])?;
            at += n;
        }
        Ok(out)
    }
}
