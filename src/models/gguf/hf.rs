//! A GGUF file's tensors by their HF names (`model.layers.0.self_attn.q_proj.weight`), through
//! the family's name map in the registry: what [`crate::models::WeightSource`] reads.

use super::names::unpermute_order;
use super::{GgufFile, GgufFix, TensorInfo, hf_dims, keeps_blocks, stored_type};
use crate::models::registry;
use crate::models::{Part, Weight};
use crate::quant::{QuantTensor, dequantize_into};
use crate::tensor::HostTensor;
use crate::untrusted::text;
use anyhow::{Context, Result, anyhow, bail};
use std::ops::Range;

impl GgufFile {
    /// Loads one tensor by its HF name, dequantized to f32, in HF shape (row-major, `[out, in]`
    /// for linear weights; the GGUF dims reversed). `Ok(None)` if the model has no such tensor.
    /// For `llama`, llama.cpp's row permutation of the Q and K projections is undone.
    pub fn tensor(&self, hf_name: &str) -> Result<Option<HostTensor>> {
        self.by_hf_name(hf_name, |info, fix| self.load_hf(info, fix))
    }

    /// `load(info, fix)` of the tensor with this HF name, its errors naming the file and the
    /// tensor; `Ok(None)` if the model has no such tensor.
    fn by_hf_name<T>(
        &self,
        hf_name: &str,
        load: impl FnOnce(&TensorInfo, Option<GgufFix>) -> Result<T>,
    ) -> Result<Option<T>> {
        let family = registry::by_gguf_architecture(self.arch_str()?)?;
        let Some((gguf_name, fix)) = (family.gguf_tensor_name)(hf_name) else {
            return Ok(None);
        };
        let Some(info) = self.tensor_info(&gguf_name) else {
            return Ok(None);
        };
        let out = match fix {
            Some(GgufFix::Expert(j)) => expert_matrix(info, j).and_then(|m| load(&m, None)),
            _ => load(info, fix),
        };
        self.release(info);
        out.map(Some).map_err(|e| {
            anyhow!(
                "{}: tensor '{}' ({hf_name}): {e:#}",
                self.path.display(),
                text(&info.name)
            )
        })
    }

    /// A linear weight by its HF name, as stored: a 2-D tensor in a block format with a kernel
    /// stays in it (llama's Q/K rows put back in HF order), anything else is dequantized and
    /// says which type it was stored in. `Ok(None)` if the model has no such tensor.
    pub fn weight(&self, hf_name: &str) -> Result<Option<Weight>> {
        self.by_hf_name(hf_name, |info, fix| self.load_weight(info, fix))
    }

    /// The shape [`GgufFile::tensor`] gives the tensor with this HF name, without reading it.
    pub fn hf_shape(&self, hf_name: &str) -> Result<Option<Vec<usize>>> {
        self.by_hf_name(hf_name, |info, fix| {
            let mut shape = hf_dims(info)?;
            if fix == Some(GgufFix::Transpose) && shape.len() == 2 {
                shape.swap(0, 1);
            }
            Ok(shape)
        })
    }

    /// `part` of a linear weight by its HF name, as [`GgufFile::weight`] stores it, reading
    /// only the part's rows (through llama's Q/K row order) and, where a block format's blocks
    /// allow it, only its columns' bytes; a part that splits blocks is read as whole rows and
    /// cut (f32, as `Weight::slice_cols` makes it).
    pub fn weight_part(&self, hf_name: &str, part: &Part) -> Result<Option<Weight>> {
        self.by_hf_name(hf_name, |info, fix| {
            let matrix = info.dims.len() == 2
                && matches!(fix, None | Some(GgufFix::UnpermuteQ | GgufFix::UnpermuteK));
            if !matrix {
                return part.apply(self.load_weight(info, fix)?);
            }
            let k = usize::try_from(info.dims[0]).map_err(|_| anyhow!("dimension too large"))?;
            let rows = usize::try_from(info.dims[1]).map_err(|_| anyhow!("dimension too large"))?;
            let mut ids = part.row_ids(rows)?;
            if let Some(n_head) = self.unpermute_heads(fix)? {
                let order = unpermute_order(rows, n_head)?;
                ids.iter_mut().for_each(|i| *i = order[*i]);
            }
            let cols = part.col_range(k)?;
            let raw = self.raw_bytes(info)?;
            let rb = info.ty.row_bytes(k)?;
            let row = |r: usize, bytes: Range<usize>| {
                raw.get(r * rb + bytes.start..r * rb + bytes.end)
                    .context("tensor data outside the file")
            };
            if keeps_blocks(info, fix) {
                let (block, bb) = info.ty.block_layout();
                if cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block) {
                    let bytes = cols.start / block * bb..cols.end / block * bb;
                    let mut data = Vec::with_capacity(ids.len() * bytes.len());
                    for &r in &ids {
                        data.extend_from_slice(row(r, bytes.clone())?);
                    }
                    let q = QuantTensor::new(info.ty, ids.len(), cols.len(), data)?;
                    return Ok(Weight::Quant(q));
                }
                let mut data = Vec::with_capacity(ids.len() * rb);
                for &r in &ids {
                    data.extend_from_slice(row(r, 0..rb)?);
                }
                let q = QuantTensor::new(info.ty, ids.len(), k, data)?;
                return Weight::Quant(q).slice_cols(cols);
            }
            let mut data = Vec::with_capacity(ids.len() * cols.len());
            let mut values = vec![0f32; k];
            for &r in &ids {
                dequantize_into(info.ty, row(r, 0..rb)?, &mut values)?;
                data.extend_from_slice(&values[cols.clone()]);
            }
            let t = HostTensor::new(vec![ids.len(), cols.len()], data);
            Ok(Weight::dense(t, stored_type(info.ty)))
        })
    }
}

/// Expert `j`'s matrix of a 3-D experts tensor (GGUF dims `[in, out, experts]`), as a 2-D
/// tensor of its own: its rows are a contiguous range of the file, so that everything read
/// from a 2-D weight (blocks kept, parts, shapes) reads it the same way.
fn expert_matrix(info: &TensorInfo, j: usize) -> Result<TensorInfo> {
    let &[k, rows, experts] = info.dims.as_slice() else {
        bail!(
            "an experts tensor has 3 dimensions, not {}",
            info.dims.len()
        );
    };
    if j as u64 >= experts {
        bail!("expert {j} of {experts}");
    }
    let k = usize::try_from(k).map_err(|_| anyhow!("dimension too large"))?;
    let bytes = (info.ty.row_bytes(k)? as u64)
        .checked_mul(rows)
        .context("tensor too large")?;
    Ok(TensorInfo {
        name: info.name.clone(),
        dims: vec![k as u64, rows],
        ty: info.ty,
        offset: info.offset + j as u64 * bytes,
        n_bytes: bytes,
    })
}
