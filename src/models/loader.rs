//! Finds a model on disk and opens its weights, config and tokenizer: an HF-layout directory
//! (config.json, model.safetensors or sharded safetensors with an index, tokenizer.json,
//! tokenizer_config.json, generation_config.json) or a GGUF file.

use super::config::ModelConfig;
use super::gguf::{GgmlType, GgufFile};
use super::tokenizer::Tokenizer;
use super::{Part, Weight};
use crate::sampling::SamplingDefaults;
use crate::tensor::{DType, HostTensor};
use crate::untrusted::text;
use anyhow::{Context, Result, bail};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// What kind of file system object this is, for error messages.
fn kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// The metadata of `path`, symbolic links followed; `Ok(None)` when nothing is there. A
/// dangling link and every other failure (a loop of links, no permission) are errors that say
/// so.
fn metadata(path: &Path) -> Result<Option<std::fs::Metadata>> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Ok(target) = std::fs::read_link(path) {
                bail!(
                    "{} is a symbolic link to {}, which does not exist",
                    path.display(),
                    target.display()
                );
            }
            Ok(None)
        }
        Err(e) => bail!("cannot access {}: {e}", path.display()),
    }
}

/// Checks, before it is opened, that the optional file `path` is a regular file where it
/// exists: `Ok(false)` when it does not.
///
/// NOTE: opening a FIFO blocks until a writer comes and a device may read forever, so a model
/// path of the wrong type would hang the load instead of failing.
pub(crate) fn optional_regular_file(path: &Path) -> Result<bool> {
    match metadata(path)? {
        None => Ok(false),
        Some(m) if m.is_file() => Ok(true),
        Some(m) => bail!(
            "{} is {}, not a regular file",
            path.display(),
            kind(&m.file_type())
        ),
    }
}

/// Checks that `path` exists and is a regular file, before it is opened.
pub(crate) fn regular_file(path: &Path) -> Result<()> {
    if !optional_regular_file(path)? {
        bail!("{} does not exist", path.display());
    }
    Ok(())
}

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
        let mut files = Vec::new();
        let mut index = HashMap::new();
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
        Ok(SafetensorsWeights {
            files,
            index,
            num_elements,
            stored_bytes,
        })
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
        release(mmap, t.data());
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

/// Lets the pages of `bytes` (a range of `mmap`) go from this process's memory once a tensor
/// has been copied out of them: a hint; reading them again faults them back in from the file.
/// NOTE: every loader copies (or converts) what it reads, so without this a model's file
/// stayed resident beside its weights until the mapping was dropped, and loading peaked near
/// twice the weights' size.
pub(super) fn release(mmap: &Mmap, bytes: &[u8]) {
    #[cfg(unix)]
    if let Some(start) = (bytes.as_ptr() as usize).checked_sub(mmap.as_ptr() as usize) {
        // SAFETY: the mapping is read-only and shared, so dropping its pages (memmap2 widens
        // the range to whole pages) loses nothing: the next access reads the file again.
        let _ = unsafe {
            mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, bytes.len())
        };
    }
    #[cfg(not(unix))]
    let _ = (mmap, bytes);
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

/// What generation needs from a model besides its weights.
pub struct LoadedModel {
    /// A short name for logs and the API (the file or directory name).
    pub name: String,
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub weights: Box<dyn WeightSource>,
    /// Token ids that end generation by default (EOS of config, generation_config and tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// The model's default sampling parameters (generation_config.json, or a GGUF's
    /// `general.sampling.*` keys).
    pub sampling_defaults: SamplingDefaults,
}

/// End-of-turn tokens of common chat formats. NOTE: chat models end a turn with these while their
/// config names only one EOS (SmolLM2: `<|im_end|>`, while `<|endoftext|>` ends documents);
/// llama.cpp stops on the same set.
const END_OF_GENERATION_TOKENS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
];

fn end_of_generation_ids(mut ids: Vec<u32>, tokenizer: &Tokenizer) -> Vec<u32> {
    ids.extend(tokenizer.eos_token_id());
    ids.extend(
        END_OF_GENERATION_TOKENS
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t)),
    );
    ids.sort();
    ids.dedup();
    ids
}

/// Opens a GGUF file or an HF-layout directory.
pub fn load_model(path: &Path) -> Result<LoadedModel> {
    let meta = metadata(path)
        .map_err(|e| anyhow::anyhow!("model path: {e}"))?
        .with_context(|| format!("model path {} does not exist", path.display()))?;
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| path.display().to_string());
    if meta.is_dir() {
        let config_path = path.join("config.json");
        if !optional_regular_file(&config_path)? {
            bail!(
                "{} is a directory without config.json: neither an HF model directory nor a GGUF file",
                path.display()
            );
        }
        let config = ModelConfig::from_hf_json(&config_path)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        let weights = SafetensorsWeights::open(path)?;
        let gen_path = path.join("generation_config.json");
        let generation_defaults = if optional_regular_file(&gen_path)? {
            let text = std::fs::read_to_string(&gen_path)
                .with_context(|| format!("cannot read {}", gen_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?
        } else {
            serde_json::Value::Null
        };
        let mut eos = config.eos_token_ids.clone();
        let gen_eos = super::config::Fields::top(&generation_defaults)
            .token_ids("eos_token_id")
            .with_context(|| format!("in {}", gen_path.display()))?;
        if let Some(&bad) = gen_eos.iter().find(|&&t| t as usize >= config.vocab_size) {
            bail!(
                "in {}: eos_token_id {bad} is not a token (the vocabulary has {})",
                gen_path.display(),
                config.vocab_size
            );
        }
        eos.extend(gen_eos);
        let eos = end_of_generation_ids(eos, &tokenizer);
        Ok(LoadedModel {
            name,
            path: path.to_path_buf(),
            config,
            tokenizer,
            weights: Box::new(weights),
            eos_token_ids: eos,
            sampling_defaults: SamplingDefaults::from_generation_config(&generation_defaults)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        })
    } else if meta.is_file() {
        let g = GgufFile::open(path)?;
        let config = g
            .config()
            .with_context(|| format!("in {}", path.display()))?;
        let text = |id: Option<u32>| id.and_then(|i| g.token_text(i)).map(String::from);
        let tokenizer = Tokenizer::from_parts(
            g.tokenizer()
                .with_context(|| format!("tokenizer of {}", path.display()))?,
            g.chat_template(),
            text(config.bos_token_id),
            text(config.eos_token_ids.first().copied()),
            g.add_bos_token(),
        );
        let eos = end_of_generation_ids(config.eos_token_ids.clone(), &tokenizer);
        let sampling_defaults = g.sampling_defaults()?;
        Ok(LoadedModel {
            name,
            path: path.to_path_buf(),
            config,
            tokenizer,
            weights: Box::new(g),
            eos_token_ids: eos,
            sampling_defaults,
        })
    } else {
        bail!(
            "model path {} is {}, not a GGUF file or an HF model directory",
            path.display(),
            kind(&meta.file_type())
        )
    }
}
