//! Where weights come from, by HF tensor name: the [`WeightSource`] trait, over a GGUF file or
//! the safetensors of an HF-layout directory (one file, or shards with an index).

use super::gguf::{GgmlType, GgufFile};
use super::{Part, Weight};
use crate::tensor::{DType, HostTensor};
use crate::untrusted::{optional_regular_file, regular_file, text};
use anyhow::{Context, Result, bail};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Where weights come from, by HF tensor name (`model.layers.0.self_attn.q_proj.weight`).
pub trait WeightSource: Send + Sync {
    /// The tensor, as f32 in HF shape; `Ok(None)` when the model has no such tensor.
    fn get(&self, name: &str) -> Result<Option<HostTensor>>;

    /// Elements of every tensor the source holds (what loading them costs, before it is
    /// tried).
    fn num_elements(&self) -> u64;

    /// A linear weight as the source stores it (a GGUF's block formats kept as they are); by
    /// default the dense tensor of [`WeightSource::get`], stored in f32.
    fn get_weight(&self, name: &str) -> Result<Option<Weight>> {
        Ok(self.get(name)?.map(|t| Weight::dense(t, DType::F32)))
    }

    /// The shape [`WeightSource::get`] gives the tensor, without reading it (by default it is
    /// read).
    fn shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
        Ok(self.get(name)?.map(|t| t.shape))
    }

    /// `part` of a linear weight, as [`WeightSource::get_weight`] stores it. By default the
    /// whole weight is read and cut; the file sources read only the part's bytes.
    fn get_weight_part(&self, name: &str, part: &Part) -> Result<Option<Weight>> {
        self.get_weight(name)?.map(|w| part.apply(w)).transpose()
    }

    /// Bytes every tensor takes as stored (what `--dtype auto` costs at most where block
    /// formats stay quantized); by default 4 per element.
    fn stored_bytes(&self) -> u64 {
        self.num_elements().saturating_mul(4)
    }
}

impl WeightSource for GgufFile {
    fn get(&self, name: &str) -> Result<Option<HostTensor>> {
        self.tensor(name)
    }

    fn get_weight(&self, name: &str) -> Result<Option<Weight>> {
        self.weight(name)
    }

    fn shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
        self.hf_shape(name)
    }

    fn get_weight_part(&self, name: &str, part: &Part) -> Result<Option<Weight>> {
        self.weight_part(name, part)
    }

    fn stored_bytes(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|t| match t.ty {
                ty if ty.has_kernel() => t.n_bytes,
                GgmlType::F16 | GgmlType::BF16 => t.n_bytes,
                _ => t.dims.iter().product::<u64>().saturating_mul(4),
            })
            .fold(0, u64::saturating_add)
    }

    fn num_elements(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|t| t.dims.iter().product::<u64>())
            .fold(0, u64::saturating_add)
    }
}

/// Safetensors files of an HF directory, memory-mapped.
pub struct SafetensorsWeights {
    files: Vec<(PathBuf, Mmap)>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
    /// The names the families ask for -> the names a bare base model's file holds.
    alias: HashMap<String, String>,
    /// Elements of all tensors.
    num_elements: u64,
    /// Bytes of all tensors as stored.
    stored_bytes: u64,
}

impl SafetensorsWeights {
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if optional_regular_file(&single)? {
            vec![single]
        } else if optional_regular_file(&index_path)? {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = v["weight_map"]
                .as_object()
                .with_context(|| format!("{} has no weight_map", index_path.display()))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            bail!(
                "{} has neither model.safetensors nor model.safetensors.index.json",
                dir.display()
            );
        };
        Self::open_files(paths)
    }

    /// The tensors of these safetensors files (a model's shards, or one LoRA adapter's file).
    pub fn open_files(paths: Vec<PathBuf>) -> Result<Self> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut alias = HashMap::new();
        let (mut num_elements, mut stored_bytes) = (0u64, 0u64);
        for (i, p) in paths.into_iter().enumerate() {
            // NOTE: shard names come from the index file: shown escaped.
            let shown = text(&p.display().to_string());
            regular_file(&p).map_err(|e| anyhow::anyhow!("{}", text(&e.to_string())))?;
            let f = File::open(&p).with_context(|| format!("cannot open {shown}"))?;
            // SAFETY: the file is opened read-only; a change of the file under us while mapped
            // is outside what we can guard against (as with every mmap-based loader).
            let mmap = unsafe { Mmap::map(&f) }.with_context(|| format!("cannot map {shown}"))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| {
                anyhow::anyhow!(
                    "{} is not a valid safetensors file: {}",
                    text(&p.display().to_string()),
                    text(&e.to_string())
                )
            })?;
            for (name, view) in st.tensors() {
                num_elements = view
                    .shape()
                    .iter()
                    .fold(1u64, |n, &d| n.saturating_mul(d as u64))
                    .saturating_add(num_elements);
                stored_bytes = stored_bytes.saturating_add(view.data().len() as u64);
                index.insert(name, i);
            }
            files.push((p, mmap));
        }
        // NOTE: a base model saved without its LM head (sentence-transformers saves
        // `Qwen3Model`, not `Qwen3ForCausalLM`; BLOOM's checkpoints are `BloomModel`s) names
        // its tensors without `model.` (`transformer.`).
        for (prefix, embed) in [
            ("model.", "embed_tokens.weight"),
            ("transformer.", "word_embeddings.weight"),
        ] {
            if !index.contains_key(&format!("{prefix}{embed}")) && index.contains_key(embed) {
                for k in index.keys() {
                    alias.insert(format!("{prefix}{k}"), k.clone());
                }
            }
        }
        Ok(SafetensorsWeights {
            files,
            index,
            alias,
            num_elements,
            stored_bytes,
        })
    }
}

impl SafetensorsWeights {
    /// The names of the tensors, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

impl WeightSource for SafetensorsWeights {
    fn num_elements(&self) -> u64 {
        self.num_elements
    }

    fn get(&self, name: &str) -> Result<Option<HostTensor>> {
        Ok(self.read(name)?.map(|(t, _)| t))
    }

    fn get_weight(&self, name: &str) -> Result<Option<Weight>> {
        Ok(self.read(name)?.map(|(t, stored)| Weight::dense(t, stored)))
    }

    fn shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
        self.with_view(name, |view| Ok(view.shape().to_vec()))
    }

    fn get_weight_part(&self, name: &str, part: &Part) -> Result<Option<Weight>> {
        let read = self.with_view(name, |t| {
            let &[rows, cols] = t.shape() else {
                return Ok(None);
            };
            let (ids, c) = (part.row_ids(rows)?, part.col_range(cols)?);
            let es = t.dtype().bitsize() / 8;
            let mut data = Vec::with_capacity(ids.len() * c.len());
            for r in ids.iter() {
                let at = (r * cols + c.start) * es;
                to_f32(name, t.dtype(), &t.data()[at..at + c.len() * es], &mut data)?;
            }
            let stored = stored_type(t.dtype());
            let part = HostTensor::new(vec![ids.len(), c.len()], data);
            Ok(Some(Weight::dense(part, stored)))
        })?;
        match read {
            Some(Some(w)) => Ok(Some(w)),
            // NOTE: not a matrix: the whole tensor, cut (it errs as get_weight's would)
            Some(None) => self.get_weight(name)?.map(|w| part.apply(w)).transpose(),
            None => Ok(None),
        }
    }

    fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }
}

impl SafetensorsWeights {
    /// `f(view)` of the tensor `name`, its errors naming the file; `Ok(None)` where there is
    /// no such tensor.
    fn with_view<T>(
        &self,
        name: &str,
        f: impl FnOnce(&safetensors::tensor::TensorView<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let name = self.alias.get(name).map_or(name, String::as_str);
        let Some(&i) = self.index.get(name) else {
            return Ok(None);
        };
        let (path, mmap) = &self.files[i];
        let shown = || text(&path.display().to_string());
        let st = SafeTensors::deserialize(mmap)
            .map_err(|e| anyhow::anyhow!("{}: {}", shown(), text(&e.to_string())))?;
        let t = st
            .tensor(name)
            .map_err(|e| anyhow::anyhow!("{}: {name}: {}", shown(), text(&e.to_string())))?;
        let out = f(&t).map(Some).with_context(shown);
        super::mmap::release(mmap, t.data());
        out
    }

    /// The tensor `name` in f32 and the type the file stores it in.
    fn read(&self, name: &str) -> Result<Option<(HostTensor, DType)>> {
        self.with_view(name, |t| {
            let mut data = Vec::with_capacity(t.data().len() / (t.dtype().bitsize() / 8).max(1));
            to_f32(name, t.dtype(), t.data(), &mut data)?;
            Ok((
                HostTensor::new(t.shape().to_vec(), data),
                stored_type(t.dtype()),
            ))
        })
    }
}

/// The type a safetensors dtype is kept in by `--dtype auto`.
fn stored_type(dtype: Dtype) -> DType {
    match dtype {
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

/// Appends the values of `b` (stored as `dtype`) to `out` in f32.
fn to_f32(name: &str, dtype: Dtype, b: &[u8], out: &mut Vec<f32>) -> Result<()> {
    match dtype {
        Dtype::F32 => out.extend(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        Dtype::F16 => out.extend(
            b.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        Dtype::BF16 => out.extend(
            b.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        other => bail!("tensor {name} has dtype {other:?} (supported: F32, F16, BF16)"),
    }
    Ok(())
}
