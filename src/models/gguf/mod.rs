//! GGUF model files. This file is the container reader: header, metadata, tensor directory,
//! tensors loaded by HF name; `config.rs` turns the metadata into a model config, `names.rs`
//! maps HF tensor names to GGUF ones, `tokenizer.rs` builds the tokenizer from the metadata and
//! `crate::quant` dequantizes.
//!
//! Format (little-endian, versions 2 and 3): magic `GGUF`, `u32` version, `u64` tensor count,
//! `u64` metadata count, the metadata key/value pairs, the tensor infos (name, `u32` n_dims,
//! `u64` dims with `ne[0]` first, `u32` type, `u64` offset relative to the data section), then
//! the data section, which starts at the next multiple of `general.alignment` (default 32).
//!
//! Everything read from the file is untrusted: sizes and offsets are checked with checked
//! arithmetic, counts are bounded by the bytes left before anything is allocated, and every
//! tensor's byte range is checked against the file size when the file is opened.

mod config;
pub mod convert;
mod hf;
mod names;
mod tokenizer;

pub use crate::quant::{GgmlType, dequantize};
use names::unpermute_order;
pub use names::{
    GgufFix, GgufTensorName, llama_tensor_name, map_name, permutes_qk, unpermute_rows,
};

use super::Weight;
use crate::quant::QuantTensor;
use crate::tensor::{DType, HostTensor};
use crate::untrusted::text;
use anyhow::{Context, Result, anyhow, bail};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

/// A metadata value. Its `Debug` is bounded: strings are escaped and cut
/// ([`crate::untrusted::text`]) and arrays show their length and first few elements, so that
/// a value can go into an error message whatever the file holds.
#[derive(Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl fmt::Debug for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        /// Array elements shown before the rest is summed up by the length.
        const SHOWN: usize = 4;
        match self {
            GgufValue::U8(v) => write!(f, "U8({v})"),
            GgufValue::I8(v) => write!(f, "I8({v})"),
            GgufValue::U16(v) => write!(f, "U16({v})"),
            GgufValue::I16(v) => write!(f, "I16({v})"),
            GgufValue::U32(v) => write!(f, "U32({v})"),
            GgufValue::I32(v) => write!(f, "I32({v})"),
            GgufValue::U64(v) => write!(f, "U64({v})"),
            GgufValue::I64(v) => write!(f, "I64({v})"),
            GgufValue::F32(v) => write!(f, "F32({v:?})"),
            GgufValue::F64(v) => write!(f, "F64({v:?})"),
            GgufValue::Bool(v) => write!(f, "Bool({v})"),
            GgufValue::String(s) => write!(f, "String(\"{}\")", crate::untrusted::text(s)),
            GgufValue::Array(a) => {
                write!(f, "Array(len {}: [", a.len())?;
                for (i, x) in a.iter().take(SHOWN).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    match x {
                        // a nested array by its length only: the whole stays bounded
                        GgufValue::Array(inner) => write!(f, "Array(len {})", inner.len())?,
                        x => write!(f, "{x:?}")?,
                    }
                }
                if a.len() > SHOWN {
                    f.write_str(", …")?;
                }
                f.write_str("])")
            }
        }
    }
}

impl GgufValue {
    /// Any integer that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any number (integers converted).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F32(_) => "f32",
            GgufValue::F64(_) => "f64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The GGUF (llama.cpp) name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// GGUF order: `ne[0]` first (fastest varying), i.e. the reverse of the HF/PyTorch shape.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An opened, validated GGUF file (memory-mapped).
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    /// The metadata section as stored (for [`convert`]'s copies), and `general.alignment`.
    kv: Kv,
}

/// Where the metadata section lies in the file, and its pair count.
#[derive(Clone, Copy)]
struct Kv {
    start: usize,
    end: usize,
    count: u64,
    alignment: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Nesting limit for arrays of arrays (the format allows them; real files use one level).
const MAX_ARRAY_DEPTH: u32 = 8;

// Metadata value type ids.
const VT_U8: u32 = 0;
const VT_I8: u32 = 1;
const VT_U16: u32 = 2;
const VT_I16: u32 = 3;
const VT_U32: u32 = 4;
const VT_I32: u32 = 5;
const VT_F32: u32 = 6;
const VT_BOOL: u32 = 7;
const VT_STRING: u32 = 8;
const VT_ARRAY: u32 = 9;
const VT_U64: u32 = 10;
const VT_I64: u32 = 11;
const VT_F64: u32 = 12;

/// The smallest number of bytes a value of type `vt` takes in the file (bounds untrusted counts).
fn min_value_size(vt: u32) -> Option<usize> {
    Some(match vt {
        VT_U8 | VT_I8 | VT_BOOL => 1,
        VT_U16 | VT_I16 => 2,
        VT_U32 | VT_I32 | VT_F32 => 4,
        VT_U64 | VT_I64 | VT_F64 | VT_STRING => 8,
        VT_ARRAY => 12,
        _ => return None,
    })
}

/// A bounds-checked little-endian reader over the header.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn bytes(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => bail!(
                "truncated header: {} needs {n} bytes at offset {} but the file has {} bytes",
                what(),
                self.pos,
                self.data.len()
            ),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.bytes(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A `u64` count of items of at least `min_size` bytes each, checked against the bytes left.
    fn count(&mut self, min_size: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.u64(what)?;
        let max = (self.remaining() / min_size.max(1)) as u64;
        if n > max {
            bail!(
                "{} is {n}, but only {} bytes follow at offset {} (file truncated or corrupt)",
                what(),
                self.remaining(),
                self.pos
            );
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.count(1, &|| format!("the length of {}", what()))?;
        let b = self.bytes(len, what)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => bail!("{} is not valid UTF-8", what()),
        }
    }

    fn value(&mut self, vt: u32, depth: u32, what: &dyn Fn() -> String) -> Result<GgufValue> {
        Ok(match vt {
            VT_U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            VT_I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            VT_U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            VT_I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            VT_U32 => GgufValue::U32(self.u32(what)?),
            VT_I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            VT_U64 => GgufValue::U64(self.u64(what)?),
            VT_I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            VT_F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            VT_F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            VT_BOOL => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => bail!("{} is a bool with the invalid byte {b}", what()),
            },
            VT_STRING => GgufValue::String(self.string(what)?),
            VT_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    bail!(
                        "{} nests arrays deeper than {MAX_ARRAY_DEPTH} levels",
                        what()
                    );
                }
                let et = self.u32(&|| format!("the element type of {}", what()))?;
                let Some(min) = min_value_size(et) else {
                    bail!("{} is an array of the unknown value type {et}", what());
                };
                let n = self.count(min, &|| format!("the element count of {}", what()))?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.value(et, depth + 1, &|| format!("{}[{i}]", what()))?);
                }
                GgufValue::Array(items)
            }
            other => bail!("{} has the unknown value type {other}", what()),
        })
    }
}

/// Renders an error with the file's path in front, flattened into one message so that it
/// reads the same whichever way it is printed.
fn in_file(path: &Path, e: anyhow::Error) -> anyhow::Error {
    anyhow!("{}: {e:#}", path.display())
}

impl GgufFile {
    /// Opens, memory-maps and validates a GGUF file (header, metadata, tensor directory, and
    /// every tensor's byte range). Tensor data are read lazily by [`GgufFile::tensor`].
    pub fn open(path: &Path) -> Result<Self> {
        crate::untrusted::regular_file(path)?;
        let file = File::open(path).map_err(|e| anyhow!("{}: cannot open: {e}", path.display()))?;
        // SAFETY: the map is read-only; as with any memory-mapped file, the file must not be
        // truncated or modified by another process while this `GgufFile` lives.
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| anyhow!("{}: cannot memory-map: {e}", path.display()))?;
        let parsed = parse(&mmap).map_err(|e| in_file(path, e))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            by_name: parsed
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: parsed.tensors,
            kv: parsed.kv,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The directory entry of the tensor with this GGUF name.
    pub fn tensor_info(&self, gguf_name: &str) -> Option<&TensorInfo> {
        self.by_name.get(gguf_name).map(|&i| &self.tensors[i])
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.arch_str().map_err(|e| in_file(&self.path, e))
    }

    fn arch_str(&self) -> Result<&str> {
        match self.metadata.get("general.architecture") {
            Some(v) => v.as_str().ok_or_else(|| {
                anyhow!("general.architecture is a {}, not a string", v.type_name())
            }),
            None => bail!("no general.architecture in the metadata"),
        }
    }

    fn load_hf(&self, info: &TensorInfo, fix: Option<GgufFix>) -> Result<HostTensor> {
        let shape = hf_dims(info)?;
        let mut data = self.load_gguf_tensor(info)?;
        match fix {
            Some(GgufFix::SubtractOne) => data.iter_mut().for_each(|x| *x -= 1.0),
            Some(GgufFix::Transpose) if shape.len() == 2 => {
                let (rows, cols) = (shape[0], shape[1]);
                let mut t = vec![0f32; data.len()];
                for r in 0..rows {
                    for c in 0..cols {
                        t[c * rows + r] = data[r * cols + c];
                    }
                }
                return Ok(HostTensor::new(vec![cols, rows], t));
            }
            _ => {}
        }
        if let Some(n_head) = self.unpermute_heads(fix)? {
            let rows = shape.first().copied().unwrap_or(0);
            let cols = shape.iter().skip(1).product::<usize>();
            data = unpermute_rows(&data, rows, cols, n_head)?;
        }
        Ok(HostTensor::new(shape, data))
    }

    /// The heads whose rows llama.cpp permuted, where `fix` asks to undo it in this file.
    fn unpermute_heads(&self, fix: Option<GgufFix>) -> Result<Option<usize>> {
        let Some(which @ (GgufFix::UnpermuteQ | GgufFix::UnpermuteK)) = fix else {
            return Ok(None);
        };
        let a = match self.arch_str() {
            Ok(a) if permutes_qk(a) => a,
            _ => return Ok(None),
        };
        let heads_key = match which {
            GgufFix::UnpermuteQ => format!("{a}.attention.head_count"),
            _ => format!("{a}.attention.head_count_kv"),
        };
        let n_head = match self.metadata.get(&heads_key).and_then(GgufValue::as_u64) {
            Some(n) => n,
            None if which == GgufFix::UnpermuteK => self
                .metadata
                .get(&format!("{a}.attention.head_count"))
                .and_then(GgufValue::as_u64)
                .ok_or_else(|| anyhow!("metadata lacks {a}.attention.head_count"))?,
            None => bail!("metadata lacks {heads_key}"),
        };
        usize::try_from(n_head)
            .map(Some)
            .map_err(|_| anyhow!("{heads_key} is too large"))
    }

    fn load_weight(&self, info: &TensorInfo, fix: Option<GgufFix>) -> Result<Weight> {
        if keeps_blocks(info, fix) {
            return self.load_quant(info, fix);
        }
        self.load_hf(info, fix)
            .map(|t| Weight::dense(t, stored_type(info.ty)))
    }

    fn load_quant(&self, info: &TensorInfo, fix: Option<GgufFix>) -> Result<Weight> {
        let k = usize::try_from(info.dims[0]).map_err(|_| anyhow!("dimension too large"))?;
        let rows = usize::try_from(info.dims[1]).map_err(|_| anyhow!("dimension too large"))?;
        let q = QuantTensor::new(info.ty, rows, k, self.raw_bytes(info)?.to_vec())?;
        Ok(Weight::Quant(match self.unpermute_heads(fix)? {
            Some(n_head) => q.select_rows(&unpermute_order(rows, n_head)?)?,
            None => q,
        }))
    }

    /// A tensor of the directory as it is (no fix), dequantized to f32 in HF shape, with the
    /// type a dense copy of it keeps (`--dtype auto`'s): what a LoRA adapter's factors are read
    /// with.
    pub fn hf_tensor(&self, info: &TensorInfo) -> Result<(HostTensor, DType)> {
        let t = self.load_hf(info, None);
        self.release(info);
        Ok((t?, stored_type(info.ty)))
    }

    /// A tensor by its GGUF name, dequantized to f32 in file order (RoPE factor tables and the
    /// like, which have no HF name); `Ok(None)` if the file has no such tensor.
    pub fn gguf_tensor_f32(&self, gguf_name: &str) -> Result<Option<Vec<f32>>> {
        match self.tensor_info(gguf_name) {
            Some(info) => {
                let out = self.load_gguf_tensor(info);
                self.release(info);
                out.map(Some)
            }
            None => Ok(None),
        }
    }

    fn load_gguf_tensor(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        let n = usize::try_from(info.n_elements())?;
        dequantize(info.ty, self.raw_bytes(info)?, n)
    }

    /// Lets the tensor's pages go once it has been read (see `models::mmap::release`).
    fn release(&self, info: &TensorInfo) {
        if let Ok(bytes) = self.raw_bytes(info) {
            super::mmap::release(&self.mmap, bytes);
        }
    }

    /// The bytes of a tensor in the file.
    fn raw_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        // Both were checked against the file size at open.
        let start = usize::try_from(info.offset)?;
        let end = start
            .checked_add(usize::try_from(info.n_bytes)?)
            .context("tensor range overflows")?;
        self.mmap
            .get(start..end)
            .context("tensor data outside the file")
    }
}

/// A tensor's dimensions in HF order (the GGUF dims reversed).
fn hf_dims(info: &TensorInfo) -> Result<Vec<usize>> {
    info.dims
        .iter()
        .rev()
        .map(|&d| usize::try_from(d).map_err(|_| anyhow!("dimension {d} is too large")))
        .collect()
}

/// Whether a linear weight stays in its block format (a 2-D tensor in a format with a kernel,
/// whose only fix is llama's Q/K row order).
fn keeps_blocks(info: &TensorInfo, fix: Option<GgufFix>) -> bool {
    info.ty.has_kernel()
        && info.dims.len() == 2
        && matches!(fix, None | Some(GgufFix::UnpermuteQ | GgufFix::UnpermuteK))
}

/// The type a dense weight of this GGML type is kept in by `--dtype auto`.
fn stored_type(ty: GgmlType) -> DType {
    match ty {
        GgmlType::F16 => DType::F16,
        GgmlType::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<TensorInfo>,
    kv: Kv,
}

fn parse(data: &[u8]) -> Result<Parsed> {
    let mut r = Reader { data, pos: 0 };
    let magic = r.array::<4>(&|| "the magic number".to_string())?;
    if &magic != GGUF_MAGIC {
        bail!(
            "not a GGUF file (magic bytes {:02x?}, expected \"GGUF\" = {:02x?})",
            magic,
            GGUF_MAGIC
        );
    }
    let version = r.u32(&|| "the version".to_string())?;
    match version {
        2 | 3 => {}
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            bail!(
                "unsupported GGUF version {v}: this is a big-endian GGUF file, only little-endian is supported"
            )
        }
        v => bail!("unsupported GGUF version {v} (supported: 2, 3)"),
    }
    // Minimum sizes: a tensor info has a name length, n_dims, type and offset; a metadata pair
    // has a key length, a value type and at least one byte of value.
    let n_tensors = r.u64(&|| "the tensor count".to_string())?;
    let n_kv = r.count(8 + 4 + 1, &|| "the metadata count".to_string())?;
    if n_tensors > (r.remaining() / (8 + 4 + 4 + 8)) as u64 {
        bail!(
            "the tensor count is {n_tensors}, but only {} bytes follow (file truncated or corrupt)",
            r.remaining()
        );
    }
    let n_tensors = n_tensors as usize;

    let mut metadata = BTreeMap::new();
    let kv_start = r.pos;
    for i in 0..n_kv {
        let key = r.string(&|| format!("the key of metadata entry {i}"))?;
        let k = text(&key);
        let vt = r.u32(&|| format!("the value type of metadata '{k}'"))?;
        let value = r.value(vt, 0, &|| format!("metadata '{k}'"))?;
        if metadata.insert(key, value).is_some() {
            bail!("duplicate metadata key '{k}'");
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => bail!("general.alignment must be a power of two, found {v:?}"),
        },
    };

    let kv = Kv {
        start: kv_start,
        end: r.pos,
        count: n_kv as u64,
        alignment,
    };
    let mut infos = Vec::with_capacity(n_tensors);
    let mut seen = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(&|| format!("the name of tensor {i}"))?;
        let shown = text(&name);
        let what = |field: &str| format!("the {field} of tensor '{shown}'");
        let n_dims = r.u32(&|| what("dimension count"))?;
        if n_dims > MAX_DIMS {
            bail!("tensor '{shown}' has {n_dims} dimensions (at most {MAX_DIMS} are allowed)");
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64(&|| what("dimensions"))?);
        }
        let type_id = r.u32(&|| what("type"))?;
        let offset = r.u64(&|| what("offset"))?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            bail!("tensor '{shown}' has the unknown tensor type id {type_id}");
        };
        if seen.insert(name.clone(), i).is_some() {
            bail!("duplicate tensor name '{shown}'");
        }
        infos.push((name, dims, ty, offset));
    }

    let header_end = r.pos as u64;
    let data_start = header_end
        .checked_next_multiple_of(alignment)
        .context("data section offset overflows")?;
    let file_len = data.len() as u64;

    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dims, ty, rel) in infos {
        let shown = text(&name);
        let (block, type_size) = ty.block_layout();
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| anyhow!("tensor '{shown}' has an absurd shape {dims:?}"))?;
        let ne0 = dims.first().copied().unwrap_or(1);
        if !ne0.is_multiple_of(block as u64) {
            bail!(
                "tensor '{shown}' of type {ty}: its first dimension {ne0} is not a multiple of the block size {block}"
            );
        }
        let n_bytes = (n_elements / block as u64)
            .checked_mul(type_size as u64)
            .ok_or_else(|| anyhow!("tensor '{shown}' is too large"))?;
        if !rel.is_multiple_of(alignment) {
            bail!(
                "tensor '{shown}' has offset {rel}, which is not a multiple of the alignment {alignment}"
            );
        }
        let offset = data_start.checked_add(rel);
        let end = offset.and_then(|o| o.checked_add(n_bytes));
        match (offset, end) {
            (Some(offset), Some(end)) if end <= file_len => tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_bytes,
            }),
            _ => bail!(
                "tensor '{shown}' ({ty}, shape {dims:?}) needs bytes {}..{} but the file has only {file_len} bytes: \
                 the file is truncated",
                data_start as u128 + rel as u128,
                data_start as u128 + rel as u128 + n_bytes as u128
            ),
        }
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
        kv,
    })
}

#[cfg(test)]
mod tests {
    use super::config::llama3_rope_factors;
    use super::*;
    use crate::models::Part;
    use crate::models::config::{Arch, Llama3RopeScaling, ModelConfig};
    use half::f16;
    use std::path::PathBuf;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gguf");

    // ---- a tiny GGUF writer --------------------------------------------------------------

    #[derive(Clone)]
    struct Writer {
        version: u32,
        alignment: u64,
        kvs: Vec<(String, u32, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    fn enc_str(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    impl Writer {
        fn new() -> Self {
            Writer {
                version: 3,
                alignment: 32,
                kvs: vec![],
                tensors: vec![],
            }
        }
        fn kv(mut self, k: &str, vt: u32, bytes: Vec<u8>) -> Self {
            self.kvs.push((k.to_string(), vt, bytes));
            self
        }
        fn str(self, k: &str, v: &str) -> Self {
            self.kv(k, VT_STRING, enc_str(v))
        }
        fn u32(self, k: &str, v: u32) -> Self {
            self.kv(k, VT_U32, v.to_le_bytes().to_vec())
        }
        fn f32(self, k: &str, v: f32) -> Self {
            self.kv(k, VT_F32, v.to_le_bytes().to_vec())
        }
        fn strs(self, k: &str, v: &[&str]) -> Self {
            let mut b = VT_STRING.to_le_bytes().to_vec();
            b.extend((v.len() as u64).to_le_bytes());
            for s in v {
                b.extend(enc_str(s));
            }
            self.kv(k, VT_ARRAY, b)
        }
        fn i32s(self, k: &str, v: &[i32]) -> Self {
            let mut b = VT_I32.to_le_bytes().to_vec();
            b.extend((v.len() as u64).to_le_bytes());
            for x in v {
                b.extend(x.to_le_bytes());
            }
            self.kv(k, VT_ARRAY, b)
        }
        fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
            self.tensors
                .push((name.to_string(), dims.to_vec(), ty, data));
            self
        }
        fn f32_tensor(self, name: &str, dims: &[u64], f: impl Fn(usize) -> f32) -> Self {
            let n: u64 = dims.iter().product();
            let data = (0..n as usize).flat_map(|i| f(i).to_le_bytes()).collect();
            self.tensor(name, dims, 0, data)
        }
        fn bytes(&self) -> Vec<u8> {
            let a = self.alignment as usize;
            let mut b = b"GGUF".to_vec();
            b.extend(self.version.to_le_bytes());
            b.extend((self.tensors.len() as u64).to_le_bytes());
            b.extend((self.kvs.len() as u64).to_le_bytes());
            for (k, vt, v) in &self.kvs {
                b.extend(enc_str(k));
                b.extend(vt.to_le_bytes());
                b.extend(v);
            }
            let mut off = 0usize;
            for (name, dims, ty, data) in &self.tensors {
                b.extend(enc_str(name));
                b.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    b.extend(d.to_le_bytes());
                }
                b.extend(ty.to_le_bytes());
                b.extend((off as u64).to_le_bytes());
                off = (off + data.len()).next_multiple_of(a);
            }
            b.resize(b.len().next_multiple_of(a), 0);
            for (_, _, _, data) in &self.tensors {
                b.extend(data);
                b.resize(b.len().next_multiple_of(a), 0);
            }
            b
        }
    }

    struct Tmp {
        _dir: tempfile::TempDir,
        path: PathBuf,
    }

    fn write_tmp(bytes: &[u8]) -> Tmp {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        std::fs::write(&path, bytes).unwrap();
        Tmp { _dir: dir, path }
    }

    /// The error reading the config of the file `w` writes.
    fn config_err(w: &Writer) -> String {
        let t = write_tmp(&w.bytes());
        GgufFile::open(&t.path)
            .unwrap()
            .config()
            .unwrap_err()
            .to_string()
    }

    fn open_err(bytes: &[u8]) -> (String, String) {
        let t = write_tmp(bytes);
        let e = GgufFile::open(&t.path).expect_err("open should fail");
        (e.to_string(), t.path.display().to_string())
    }

    /// A Q8_0 row of 32 values: scale `d` (exact in f16) and quants `q`.
    fn q8_0_block(d: f32, q: impl Fn(usize) -> i8) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        b.extend((0..32).map(|c| q(c) as u8));
        b
    }

    // Synthetic model: hidden 32, 4 heads of 8, 2 KV heads, FFN 64, 1 layer, vocab 8.
    const TOKENS: [&str; 8] = ["<s>", "a", "b", "ab", "Ġ", "Ġa", "</s>", "<|eot|>"];
    const K_ROWS: usize = 16;

    fn k_quant(r: usize, c: usize) -> i8 {
        ((r * 7 + c * 3) % 200) as i8 // wraps into negatives too
    }

    fn synthetic(arch: &str) -> Writer {
        let mut k_data = vec![];
        for r in 0..K_ROWS {
            k_data.extend(q8_0_block(0.25, |c| k_quant(r, c)));
        }
        let v_data: Vec<u8> = (0..K_ROWS)
            .flat_map(|r| q8_0_block(-1.5, |c| (c as i8) - (r as i8)))
            .collect();
        Writer::new()
            .str("general.architecture", arch)
            .str("general.name", "tiny")
            .u32(&format!("{arch}.block_count"), 1)
            .u32(&format!("{arch}.context_length"), 128)
            .u32(&format!("{arch}.embedding_length"), 32)
            .u32(&format!("{arch}.feed_forward_length"), 64)
            .u32(&format!("{arch}.attention.head_count"), 4)
            .u32(&format!("{arch}.attention.head_count_kv"), 2)
            .f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-5)
            .f32(&format!("{arch}.rope.freq_base"), 500000.0)
            .str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", "default")
            .strs("tokenizer.ggml.tokens", &TOKENS)
            .i32s("tokenizer.ggml.token_type", &[3, 1, 1, 1, 1, 1, 3, 3])
            .strs("tokenizer.ggml.merges", &["a b", "Ġ a"])
            .u32("tokenizer.ggml.bos_token_id", 0)
            .u32("tokenizer.ggml.eos_token_id", 6)
            .u32("tokenizer.ggml.eot_token_id", 7)
            .str("tokenizer.chat_template", "{{ messages }}")
            .f32_tensor("token_embd.weight", &[32, 8], |i| i as f32 * 0.5)
            .f32_tensor("blk.0.attn_q.weight", &[32, 32], |i| i as f32)
            .f32_tensor("blk.0.attn_q.bias", &[32], |i| 1000.0 + i as f32)
            .tensor("blk.0.attn_k.weight", &[32, K_ROWS as u64], 8, k_data)
            .tensor("blk.0.attn_v.weight", &[32, K_ROWS as u64], 8, v_data)
            .f32_tensor("blk.0.ffn_down.weight", &[64, 32], |i| -(i as f32))
            .f32_tensor("output_norm.weight", &[32], |i| 1.0 + i as f32 / 64.0)
    }

    /// llama.cpp's permutation written out by hand: HF row `r` of a head of `hd` rows is
    /// GGUF row `2 * r` in the first half of the head and `2 * (r - hd/2) + 1` in the second.
    fn gguf_row_of_hf_row(r: usize, hd: usize) -> usize {
        let (h, i) = (r / hd, r % hd);
        h * hd
            + if i < hd / 2 {
                2 * i
            } else {
                2 * (i - hd / 2) + 1
            }
    }

    /// The f16 copy keeps every metadata value and tensor shape, copies f32 tensors as they
    /// are, and holds each quantized tensor's reference values rounded to f16.
    #[test]
    fn f16_copy_keeps_metadata_and_values() {
        let src = write_tmp(&synthetic("llama").bytes());
        let src = GgufFile::open(&src.path).unwrap();
        let out = tempfile::tempdir().unwrap();
        let dst = out.path().join("copy.gguf");
        convert::f16_copy(&src, &dst).unwrap();
        let copy = GgufFile::open(&dst).unwrap();
        assert_eq!(copy.metadata(), src.metadata());
        assert_eq!(copy.tensors().len(), src.tensors().len());
        let mut quantized = 0;
        for (a, b) in src.tensors().iter().zip(copy.tensors()) {
            assert_eq!((&a.name, &a.dims), (&b.name, &b.dims));
            let want = src.load_gguf_tensor(a).unwrap();
            let got = copy.load_gguf_tensor(b).unwrap();
            if a.ty == GgmlType::F32 {
                assert_eq!((b.ty, &got), (GgmlType::F32, &want), "{}", a.name);
            } else {
                quantized += 1;
                assert_eq!(b.ty, GgmlType::F16, "{}", a.name);
                let rounded: Vec<f32> = want.iter().map(|&w| f16::from_f32(w).to_f32()).collect();
                assert_eq!(got, rounded, "{}", a.name);
            }
        }
        assert_eq!(quantized, 2);
    }

    // ---- dequantization against gguf.quants ----------------------------------------------

    #[test]
    fn dequantize_matches_python_reference() {
        use GgmlType::*;
        let cases = [
            ("F32", F32),
            ("F16", F16),
            ("BF16", BF16),
            ("Q4_0", Q4_0),
            ("Q4_1", Q4_1),
            ("Q5_0", Q5_0),
            ("Q5_1", Q5_1),
            ("Q8_0", Q8_0),
            ("Q2_K", Q2_K),
            ("Q3_K", Q3_K),
            ("Q4_K", Q4_K),
            ("Q5_K", Q5_K),
            ("Q6_K", Q6_K),
            ("IQ4_NL", IQ4_NL),
            ("IQ4_XS", IQ4_XS),
        ];
        for (name, ty) in cases {
            assert!(ty.is_supported(), "{name}");
            let raw = std::fs::read(format!("{FIXTURES}/{name}.blocks")).unwrap();
            let expected: Vec<f32> = std::fs::read(format!("{FIXTURES}/{name}.f32"))
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert!(expected.len() >= 200, "{name}: fixture too small");
            assert!(
                expected.iter().any(|&x| x != 0.0),
                "{name}: fixture is all zeros"
            );
            let got = dequantize(ty, &raw, expected.len()).unwrap();
            assert_eq!(got.len(), expected.len());
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    g.to_bits() == e.to_bits(),
                    "{name}[{i}]: got {g}, expected {e} (gguf.quants)"
                );
            }
        }
    }

    #[test]
    fn dequantize_parallel_path_equals_serial() {
        // Large enough for several parallel chunks: the fixture blocks repeated.
        let raw = std::fs::read(format!("{FIXTURES}/Q4_K.blocks")).unwrap();
        let one = dequantize(GgmlType::Q4_K, &raw, raw.len() / 144 * 256).unwrap();
        let reps = 200;
        let big: Vec<u8> = raw.iter().copied().cycle().take(raw.len() * reps).collect();
        let all = dequantize(GgmlType::Q4_K, &big, one.len() * reps).unwrap();
        for (i, c) in all.chunks_exact(one.len()).enumerate() {
            assert_eq!(c, &one[..], "repeat {i}");
        }
    }

    #[test]
    fn dequantize_rejects_bad_sizes_and_unsupported_types() {
        let e = dequantize(GgmlType::Q8_0, &[0u8; 34], 31)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a whole number of blocks"), "{e}");
        let e = dequantize(GgmlType::Q8_0, &[0u8; 33], 32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("take 34 bytes, but 33"), "{e}");
        let e = dequantize(GgmlType::Q8_K, &[0u8; 292], 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor type Q8_K is not supported"), "{e}");
        assert_eq!(
            dequantize(GgmlType::F32, &[], 0).unwrap(),
            Vec::<f32>::new()
        );
    }

    #[test]
    fn type_ids_and_layouts() {
        assert_eq!(GgmlType::from_id(0), Some(GgmlType::F32));
        assert_eq!(GgmlType::from_id(30), Some(GgmlType::BF16));
        assert_eq!(GgmlType::from_id(14), Some(GgmlType::Q6_K));
        assert_eq!(GgmlType::from_id(4), None); // removed Q4_2
        assert_eq!(GgmlType::from_id(99), None);
        assert_eq!(GgmlType::Q6_K.block_layout(), (256, 210));
        assert_eq!(GgmlType::Q4_K.block_layout(), (256, 144));
        assert_eq!(GgmlType::Q4_1.block_layout(), (32, 20));
    }

    // ---- a valid synthetic file ----------------------------------------------------------

    /// Expert j's matrix of a stacked `[experts, rows, k]` tensor in blocks: whole (kept in
    /// its blocks), a part of its rows and columns, its shape, and the router beside it.
    #[test]
    fn experts_are_read_one_matrix_each_from_their_stacked_tensor() {
        let (experts, rows) = (3usize, 2usize);
        let q = |e: usize, r: usize, c: usize| (e * 40 + r * 7 + c) as i8 - 60;
        let mut data = vec![];
        for e in 0..experts {
            for r in 0..rows {
                data.extend(q8_0_block(0.5, |c| q(e, r, c)));
            }
        }
        let dims = [32, rows as u64, experts as u64];
        let w = synthetic("llama")
            .tensor("blk.0.ffn_gate_exps.weight", &dims, 8, data)
            .f32_tensor("blk.0.ffn_gate_inp.weight", &[32, 3], |i| i as f32);
        let t = write_tmp(&w.bytes());
        let g = GgufFile::open(&t.path).unwrap();
        let name = |e: usize| format!("model.layers.0.mlp.experts.{e}.gate_proj.weight");
        for e in 0..experts {
            let want: Vec<f32> = (0..rows * 32)
                .map(|i| 0.5 * q(e, i / 32, i % 32) as f32)
                .collect();
            assert_eq!(g.hf_shape(&name(e)).unwrap(), Some(vec![rows, 32]));
            let Some(Weight::Quant(w)) = g.weight(&name(e)).unwrap() else {
                panic!("expert {e} is not kept in its blocks");
            };
            assert_eq!((w.rows(), w.k), (rows, 32));
            assert_eq!(g.tensor(&name(e)).unwrap().unwrap().data, want);
            let part = g
                .weight_part(&name(e), &Part::row_range(1..2))
                .unwrap()
                .unwrap();
            assert_eq!(part.into_dense().unwrap().0.data, want[32..]);
        }
        // Mixtral's names for the same tensor, the router
        let mixtral = "model.layers.0.block_sparse_moe.experts.2.w1.weight";
        assert_eq!(g.tensor(mixtral).unwrap(), g.tensor(&name(2)).unwrap());
        let router = g.tensor("model.layers.0.mlp.gate.weight").unwrap().unwrap();
        assert_eq!(router.shape, [3, 32]);
        let e = g.tensor(&name(3)).unwrap_err().to_string();
        assert!(e.contains("expert 3 of 3"), "{e}");
    }

    #[test]
    fn synthetic_llama_round_trip() {
        let t = write_tmp(&synthetic("llama").bytes());
        let g = GgufFile::open(&t.path).unwrap();
        assert_eq!(g.path(), t.path.as_path());
        assert_eq!(g.version(), 3);
        assert_eq!(g.architecture().unwrap(), "llama");
        assert_eq!(g.tensors().len(), 7);
        assert_eq!(g.metadata()["general.name"].as_str(), Some("tiny"));
        let k = g.tensor_info("blk.0.attn_k.weight").unwrap();
        assert_eq!(
            (k.ty, k.dims.clone(), k.n_bytes),
            (GgmlType::Q8_0, vec![32, 16], 16 * 34)
        );
        assert_eq!(k.offset % 32, 0);

        let c = g.config().unwrap();
        let expected = ModelConfig {
            arch: Arch::Llama,
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 1,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            vocab_size: 8,
            max_position_embeddings: 128,
            rms_norm_eps: 1e-5f32 as f64,
            rope_theta: 500000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            attention_bias: true, // blk.0.attn_q.bias exists
            sliding_window: None,
            qk_norm: false,
            sliding_layers: Vec::new(),
            rope_theta_local: None,
            longrope: None,
            rotary_dim: None,
            rope_interleaved: false,
            hidden_act: crate::backend::Activation::Silu,
            attn_scale: None,
            attn_logit_softcap: None,
            final_logit_softcap: None,
            logit_scale: None,
            moe: None,
            extra: serde_json::Value::Null,
            bos_token_id: Some(0),
            eos_token_ids: vec![6, 7],
        };
        assert_eq!(c, expected);

        let emb = g.tensor("model.embed_tokens.weight").unwrap().unwrap();
        assert_eq!(emb.shape, vec![8, 32]);
        assert_eq!(emb.data[33], 16.5);
        let down = g
            .tensor("model.layers.0.mlp.down_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(down.shape, vec![32, 64]);
        assert_eq!(down.data[64 * 3 + 5], -(64.0 * 3.0 + 5.0));
        let norm = g.tensor("model.norm.weight").unwrap().unwrap();
        assert_eq!(norm.shape, vec![32]);
        assert_eq!(norm.data[32 - 1], 1.0 + 31.0 / 64.0);

        // Q: F32 with value = GGUF row * 32 + col; 4 heads of 8 rows.
        let q = g
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(q.shape, vec![32, 32]);
        for r in 0..32 {
            let src = gguf_row_of_hf_row(r, 8);
            for c in 0..32 {
                assert_eq!(
                    q.data[r * 32 + c],
                    (src * 32 + c) as f32,
                    "q row {r} col {c}"
                );
            }
        }
        // e.g. head 0: HF rows 0..8 come from GGUF rows 0,2,4,6,1,3,5,7
        assert_eq!(q.data[32], (2 * 32) as f32);
        assert_eq!(q.data[4 * 32], 32.0);
        let qb = g
            .tensor("model.layers.0.self_attn.q_proj.bias")
            .unwrap()
            .unwrap();
        assert_eq!(qb.shape, vec![32]);
        for r in 0..32 {
            assert_eq!(qb.data[r], 1000.0 + gguf_row_of_hf_row(r, 8) as f32);
        }
        // K: Q8_0, 2 KV heads of 8 rows.
        let k = g
            .tensor("model.layers.0.self_attn.k_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(k.shape, vec![16, 32]);
        for r in 0..K_ROWS {
            let src = gguf_row_of_hf_row(r, 8);
            for c in 0..32 {
                assert_eq!(
                    k.data[r * 32 + c],
                    0.25 * k_quant(src, c) as f32,
                    "k row {r} col {c}"
                );
            }
        }
        // V: not permuted.
        let v = g
            .tensor("model.layers.0.self_attn.v_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(v.shape, vec![16, 32]);
        assert_eq!(v.data[3 * 32 + 10], -1.5 * (10.0 - 3.0));

        // Absent or unknown names.
        for name in [
            "lm_head.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.00.self_attn.v_proj.weight",
            "model.layers.0.self_attn.v_proj.scale",
            "token_embd.weight",
            "bogus",
        ] {
            assert!(g.tensor(name).unwrap().is_none(), "{name}");
        }

        assert_eq!(g.token_text(3), Some("ab"));
        assert_eq!(g.token_text(8), None);
        assert_eq!(g.chat_template().as_deref(), Some("{{ messages }}"));
        assert!(!g.add_bos_token());

        let tk = g.tokenizer().unwrap();
        assert_eq!(tk.get_vocab_size(true), 8);
        let enc = tk.encode("ab a</s>", false).unwrap();
        assert_eq!(enc.get_ids(), &[3, 5, 6]);
        assert_eq!(tk.decode(&[3, 5, 6, 1], false).unwrap(), "ab a</s>a");
        assert_eq!(tk.decode(&[3, 5, 6, 1], true).unwrap(), "ab aa");
    }

    /// A part read from the file is the whole weight cut: rows through llama's Q/K order
    /// (Q8_0 blocks kept, f32 dense), columns on block boundaries (bytes kept) and across them
    /// (f32), a transposed or 1-D tensor through the whole.
    #[test]
    fn weight_parts_are_the_whole_weight_cut() {
        let t = write_tmp(&synthetic("llama").bytes());
        let g = GgufFile::open(&t.path).unwrap();
        let parts = [
            Part::rows(vec![1..3, 5..9]),
            Part::row_range(8..16),
            Part::cols(8..24),
            Part::cols(0..32),
            Part {
                rows: Some(vec![0..2, 12..16]),
                cols: Some(16..32),
            },
        ];
        let bits = |w: Weight| {
            let quant = matches!(w, Weight::Quant(_));
            let (t, stored) = w.into_dense().unwrap();
            let b: Vec<u32> = t.data.iter().map(|x| x.to_bits()).collect();
            (quant, stored, t.shape, b)
        };
        for name in [
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
        ] {
            let whole = g.weight(name).unwrap().unwrap();
            assert_eq!(g.hf_shape(name).unwrap().unwrap(), whole.shape(), "{name}");
            for p in &parts {
                let got = g.weight_part(name, p).unwrap().unwrap();
                let want = p.apply(whole.clone()).unwrap();
                assert_eq!(bits(got), bits(want), "{name} {p:?}");
            }
        }
        // Q8_0 columns on the block boundary stay blocks; across it they become f32
        let k = "model.layers.0.self_attn.k_proj.weight";
        assert!(matches!(
            g.weight_part(k, &parts[0]).unwrap(),
            Some(Weight::Quant(_))
        ));
        assert!(matches!(
            g.weight_part(k, &parts[2]).unwrap(),
            Some(Weight::Dense { .. })
        ));
        // out of range, and no such tensor
        let e = g.weight_part(k, &Part::row_range(10..17)).unwrap_err();
        assert!(
            format!("{e:#}").contains("rows 10..17 of a weight of 16 rows"),
            "{e:#}"
        );
        let e = g.weight_part(k, &Part::cols(0..33)).unwrap_err();
        assert!(format!("{e:#}").contains("columns 0..33"), "{e:#}");
        assert!(g.weight_part("model.nothing", &parts[0]).unwrap().is_none());
    }

    #[test]
    fn synthetic_qwen2_is_not_permuted() {
        let t = write_tmp(&synthetic("qwen2").bytes());
        let g = GgufFile::open(&t.path).unwrap();
        let c = g.config().unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.attention_bias);
        let q = g
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .unwrap();
        assert!(q.data.iter().enumerate().all(|(i, &x)| x == i as f32));
        let k = g
            .tensor("model.layers.0.self_attn.k_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(k.data[32 + 1], 0.25 * k_quant(1, 1) as f32);
    }

    #[test]
    fn version_2_and_custom_alignment() {
        let mut w = synthetic("llama");
        w.version = 2;
        w.alignment = 64;
        let w = w.u32("general.alignment", 64);
        let t = write_tmp(&w.bytes());
        let g = GgufFile::open(&t.path).unwrap();
        assert_eq!(g.version(), 2);
        assert!(g.tensors().iter().all(|t| t.offset % 64 == 0));
        let emb = g.tensor("model.embed_tokens.weight").unwrap().unwrap();
        assert_eq!(emb.data[7], 3.5);
    }

    #[test]
    fn llama3_rope_scaling_from_rope_freqs() {
        let s = Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let f = llama3_rope_factors(&s, 8, 500000.0);
        assert_eq!(f.first(), Some(&1.0));
        assert_eq!(f.last(), Some(&32.0));
        let w = synthetic("llama").f32_tensor("rope_freqs.weight", &[4], |i| f[i] as f32);
        let t = write_tmp(&w.bytes());
        let g = GgufFile::open(&t.path).unwrap();
        assert_eq!(g.config().unwrap().rope_scaling, Some(s));

        let w = synthetic("llama").f32_tensor("rope_freqs.weight", &[4], |i| f[i] as f32 * 1.5);
        let e = config_err(&w);
        assert!(e.contains("does not match Llama 3 RoPE scaling"), "{e}");

        let w = synthetic("llama")
            .str("llama.rope.scaling.type", "llama3")
            .f32("llama.rope.scaling.factor", 8.0)
            .u32("llama.rope.scaling.original_context_length", 4096);
        let t = write_tmp(&w.bytes());
        let rs = GgufFile::open(&t.path)
            .unwrap()
            .config()
            .unwrap()
            .rope_scaling
            .unwrap();
        assert_eq!(
            (rs.factor, rs.original_max_position_embeddings),
            (8.0, 4096)
        );

        let w = synthetic("llama").str("llama.rope.scaling.type", "yarn");
        let e = config_err(&w);
        assert!(
            e.contains("RoPE scaling of type 'yarn' is not supported"),
            "{e}"
        );
    }

    // ---- malformed files -----------------------------------------------------------------

    #[test]
    fn bad_magic() {
        let mut b = synthetic("llama").bytes();
        b[..4].copy_from_slice(b"GGML");
        let (e, path) = open_err(&b);
        assert!(e.contains(&path) && e.contains("not a GGUF file"), "{e}");
    }

    #[test]
    fn unsupported_versions() {
        for v in [1u32, 4, 0x0300_0000] {
            let mut w = synthetic("llama");
            w.version = v;
            let (e, path) = open_err(&w.bytes());
            assert!(
                e.contains(&path) && e.contains(&format!("unsupported GGUF version {v}")),
                "{e}"
            );
        }
    }

    #[test]
    fn truncated_header() {
        let b = synthetic("llama").bytes();
        for cut in [0, 3, 7, 20, 40, 200, 600] {
            let (e, path) = open_err(&b[..cut]);
            assert!(e.contains(&path), "{e}");
            assert!(e.contains("truncated"), "cut at {cut}: {e}");
        }
    }

    #[test]
    fn truncated_tensor_data() {
        let b = synthetic("llama").bytes();
        // The last tensor (output_norm.weight, 128 bytes) loses its end.
        let (e, path) = open_err(&b[..b.len() - 10]);
        assert!(e.contains(&path), "{e}");
        assert!(
            e.contains("tensor 'output_norm.weight'") && e.contains("truncated"),
            "{e}"
        );
    }

    #[test]
    fn unknown_tensor_type() {
        let w = synthetic("llama").tensor("blk.0.ffn_up.weight", &[32, 2], 99, vec![0; 256]);
        let (e, path) = open_err(&w.bytes());
        assert!(e.contains(&path), "{e}");
        assert!(
            e.contains("tensor 'blk.0.ffn_up.weight' has the unknown tensor type id 99"),
            "{e}"
        );
    }

    #[test]
    fn known_but_unsupported_type_fails_at_load() {
        // Q8_K (id 15): one block of 256 values in 292 bytes.
        let w = synthetic("llama").tensor("blk.0.ffn_norm.weight", &[256], 15, vec![0; 292]);
        let t = write_tmp(&w.bytes());
        let g = GgufFile::open(&t.path).unwrap();
        let e = g
            .tensor("model.layers.0.post_attention_layernorm.weight")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&t.path.display().to_string()), "{e}");
        assert!(
            e.contains("blk.0.ffn_norm.weight") && e.contains("tensor type Q8_K is not supported"),
            "{e}"
        );
    }

    #[test]
    fn unknown_architecture() {
        for arch in ["mamba", "rwkv6"] {
            let t = write_tmp(&synthetic(arch).bytes());
            let g = GgufFile::open(&t.path).unwrap();
            assert_eq!(g.architecture().unwrap(), arch);
            let e = g.config().unwrap_err().to_string();
            assert!(e.contains(&t.path.display().to_string()), "{e}");
            assert!(
                e.contains(&format!(
                    "unknown architecture '{arch}' (general.architecture"
                )) && e.contains("supported: llama, qwen2"),
                "{e}"
            );
        }
        let w = Writer::new().u32("general.alignment", 32);
        let t = write_tmp(&w.bytes());
        let e = GgufFile::open(&t.path)
            .unwrap()
            .config()
            .unwrap_err()
            .to_string();
        assert!(e.contains("no general.architecture"), "{e}");
        let path = t.path.display().to_string();
        assert_eq!(e.matches(&path).count(), 1, "{e}");
        let e = GgufFile::open(&t.path)
            .unwrap()
            .architecture()
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!("{path}: no general.architecture in the metadata")
        );
    }

    #[test]
    fn invalid_config_is_rejected() {
        // 3 KV heads do not divide 4 heads: ModelConfig::validate must run.
        let w = synthetic("llama").u32("llama.attention.head_count_kv", 3);
        let mut w2 = w.clone();
        w2.kvs
            .retain(|(k, _, v)| k != "llama.attention.head_count_kv" || v == &3u32.to_le_bytes());
        let e = config_err(&w2);
        assert!(e.contains("not a multiple of num_key_value_heads"), "{e}");
        // Mixture of experts (Mixtral is stored as arch llama) without the experts per token;
        // experts in a family that has none.
        for (arch, want) in [
            ("llama", "expert_used_count"),
            ("gpt2", "mixture-of-experts"),
        ] {
            let w = synthetic(arch)
                .u32(&format!("{arch}.expert_count"), 8)
                .f32(&format!("{arch}.attention.layer_norm_epsilon"), 1e-5);
            let e = config_err(&w);
            assert!(e.contains(want), "{e}");
        }
        // A missing required key.
        let mut w3 = synthetic("llama");
        w3.kvs.retain(|(k, _, _)| k != "llama.block_count");
        let e = config_err(&w3);
        assert!(e.contains("llama.block_count"), "{e}");
    }

    #[test]
    fn absurd_counts_do_not_allocate() {
        // tensor count u64::MAX
        let mut b = synthetic("llama").bytes();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let (e, _) = open_err(&b);
        assert!(e.contains("tensor count"), "{e}");
        // metadata count u64::MAX
        let mut b = synthetic("llama").bytes();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let (e, _) = open_err(&b);
        assert!(e.contains("metadata count"), "{e}");
        // an array claiming 2^62 strings
        let mut arr = VT_STRING.to_le_bytes().to_vec();
        arr.extend((1u64 << 62).to_le_bytes());
        let w = Writer::new().kv("tokenizer.ggml.tokens", VT_ARRAY, arr);
        let (e, _) = open_err(&w.bytes());
        assert!(
            e.contains("element count of metadata 'tokenizer.ggml.tokens'"),
            "{e}"
        );
        // a string claiming 2^63 bytes
        let w = Writer::new().kv(
            "general.name",
            VT_STRING,
            (1u64 << 63).to_le_bytes().to_vec(),
        );
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("length of metadata 'general.name'"), "{e}");
        // a tensor whose dims overflow
        let w = synthetic("llama").tensor("x", &[u64::MAX, 4], 0, vec![]);
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("tensor 'x'"), "{e}");
        // too many dims
        let w = synthetic("llama").tensor("x", &[1, 1, 1, 1, 1], 0, vec![0; 4]);
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("5 dimensions"), "{e}");
    }

    #[test]
    fn other_header_errors() {
        let w = synthetic("llama").str("general.name", "again");
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("duplicate metadata key 'general.name'"), "{e}");
        let w = synthetic("llama").f32_tensor("output_norm.weight", &[32], |_| 0.0);
        let (e, _) = open_err(&w.bytes());
        assert!(
            e.contains("duplicate tensor name 'output_norm.weight'"),
            "{e}"
        );
        let w = synthetic("llama").u32("general.alignment", 24);
        let (e, _) = open_err(&w.bytes());
        assert!(
            e.contains("general.alignment must be a power of two"),
            "{e}"
        );
        let w = synthetic("llama").kv("x", 13, vec![0; 8]);
        let (e, _) = open_err(&w.bytes());
        assert!(
            e.contains("metadata 'x' has the unknown value type 13"),
            "{e}"
        );
        let w = synthetic("llama").kv("x", VT_STRING, [enc_str("").as_slice(), &[]].concat());
        assert!(GgufFile::open(&write_tmp(&w.bytes()).path).is_ok());
        let mut bad = 2u64.to_le_bytes().to_vec();
        bad.extend([0xff, 0xfe]);
        let w = synthetic("llama").kv("x", VT_STRING, bad);
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("metadata 'x' is not valid UTF-8"), "{e}");
        let w = synthetic("llama").tensor("q", &[33], 8, vec![0; 34]);
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("not a multiple of the block size 32"), "{e}");
        // deeply nested arrays
        let mut v = vec![];
        for _ in 0..20 {
            v.extend(VT_ARRAY.to_le_bytes());
            v.extend(1u64.to_le_bytes());
        }
        v.extend(VT_U8.to_le_bytes());
        v.extend(1u64.to_le_bytes());
        v.push(7);
        let w = Writer::new().kv("deep", VT_ARRAY, v.clone());
        let (e, _) = open_err(&w.bytes());
        assert!(e.contains("nests arrays deeper"), "{e}");
    }

    /// Corrupt sizes, values and layer counts are refused with the key and the value named.
    #[test]
    fn corrupt_sizes_and_values_are_refused() {
        let cfg_err = |w: Writer| -> String {
            let t = write_tmp(&w.bytes());
            match GgufFile::open(&t.path).unwrap().config() {
                Ok(c) => panic!("accepted: {c:?}"),
                Err(e) => e.to_string(),
            }
        };
        let set = |k: &str, vt: u32, bytes: Vec<u8>| {
            let mut w = synthetic("llama");
            w.kvs.retain(|(kk, _, _)| kk != k);
            w.kv(k, vt, bytes)
        };
        let u64_ = |n: u64| n.to_le_bytes().to_vec();
        let f32_ = |x: f32| x.to_le_bytes().to_vec();

        // a layer's tensors past block_count (llama.cpp refuses the file too)
        let w = synthetic("llama").f32_tensor("blk.1.ffn_norm.weight", &[32], |_| 1.0);
        let e = cfg_err(w);
        assert!(
            e.contains("tensor 'blk.1.ffn_norm.weight' is of layer 1, but llama.block_count is 1"),
            "{e}"
        );

        for n in [1u64 << 31, 1 << 40, 1 << 62, u64::MAX] {
            let e = cfg_err(set("llama.block_count", VT_U64, u64_(n)));
            assert!(
                e.contains(&format!("num_hidden_layers {n} is larger")),
                "{e}"
            );
            let e = cfg_err(set("llama.context_length", VT_U64, u64_(n)));
            assert!(
                e.contains(&format!("max_position_embeddings {n} is larger")),
                "{e}"
            );
            let e = cfg_err(set("llama.feed_forward_length", VT_U64, u64_(n)));
            assert!(
                e.contains(&format!("intermediate_size {n} is larger")),
                "{e}"
            );
        }
        for x in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
            let e = cfg_err(set("llama.rope.freq_base", VT_F32, f32_(x)));
            assert!(
                e.contains("rope_theta (the RoPE base) must be a positive number"),
                "{e}"
            );
            let e = cfg_err(set(
                "llama.attention.layer_norm_rms_epsilon",
                VT_F32,
                f32_(x),
            ));
            assert!(
                e.contains("epsilon") && e.contains("must be a positive number"),
                "{e}"
            );
            let w = synthetic("llama")
                .str("llama.rope.scaling.type", "llama3")
                .f32("llama.rope.scaling.factor", x);
            let e = cfg_err(w);
            assert!(
                e.contains("llama3 RoPE scaling: factor must be a positive number"),
                "{e}"
            );
        }
        let w = synthetic("llama")
            .str("llama.rope.scaling.type", "llama3")
            .f32("llama.rope.scaling.factor", 8.0)
            .f32("llama.rope.scaling.low_freq_factor", 4.0);
        let e = cfg_err(w);
        assert!(
            e.contains("high_freq_factor (4) must be greater than low_freq_factor (4)"),
            "{e}"
        );
        let w = synthetic("llama")
            .str("llama.rope.scaling.type", "llama3")
            .f32("llama.rope.scaling.factor", 8.0)
            .u32("llama.rope.scaling.original_context_length", 0);
        let e = cfg_err(w);
        assert!(
            e.contains("original_max_position_embeddings must be in 1..="),
            "{e}"
        );
        // keys of the wrong type are errors, not defaults
        let w = synthetic("llama").u32("llama.rope.scaling.type", 3);
        let e = cfg_err(w);
        assert!(
            e.contains("metadata 'llama.rope.scaling.type' should be a string, found U32(3)"),
            "{e}"
        );
        let w = synthetic("llama")
            .str("llama.rope.scaling.type", "llama3")
            .f32("llama.rope.scaling.factor", 8.0)
            .f32("llama.rope.scaling.original_context_length", -1.0);
        let e = cfg_err(w);
        assert!(
            e.contains("should be a non-negative integer, found F32(-1.0)"),
            "{e}"
        );
        // token ids
        let e = cfg_err(set(
            "tokenizer.ggml.eos_token_id",
            VT_U32,
            8u32.to_le_bytes().to_vec(),
        ));
        assert!(
            e.contains("eos_token_id 8 is not a token: the vocabulary has 8"),
            "{e}"
        );
        let e = cfg_err(set("tokenizer.ggml.bos_token_id", VT_U64, u64_(1 << 32)));
        assert!(
            e.contains("tokenizer.ggml.bos_token_id' = 4294967296 is not a token id"),
            "{e}"
        );
    }

    /// Keys, names and values from the file are escaped and cut in errors: no raw control
    /// characters or newlines (terminal and log injection), no message of hundreds of KB.
    #[test]
    fn text_from_the_file_is_escaped_and_cut_in_errors() {
        let clean = |e: &str| {
            assert!(e.len() < 1000, "{} bytes: {}", e.len(), &e[..1000]);
            assert!(!e.chars().any(|c| c.is_control()), "{e:?}");
        };
        let evil = "evil\x1b[2J\nINFO forged line";
        let w = synthetic("llama").kv(evil, 13, vec![0; 8]);
        let (e, _) = open_err(&w.bytes());
        clean(&e);
        assert!(
            e.contains(
                "metadata 'evil\\u{1b}[2J\\nINFO forged line' has the unknown value type 13"
            ),
            "{e}"
        );
        let w = synthetic("llama").tensor(evil, &[1, 1, 1, 1, 1], 0, vec![0; 4]);
        let (e, _) = open_err(&w.bytes());
        clean(&e);
        assert!(e.contains("tensor 'evil\\u{1b}[2J\\n"), "{e}");
        let long = format!("{evil}{}", "x".repeat(100_000));
        let w = synthetic("llama").kv(&long, 13, vec![0; 8]);
        let (e, _) = open_err(&w.bytes());
        clean(&e);
        assert!(e.contains("(100025 bytes in all)"), "{e}");

        // an array of 100000 strings where a number belongs
        let big = vec![evil; 100_000];
        let mut w = synthetic("llama");
        w.kvs.retain(|(k, _, _)| k != "llama.block_count");
        let w = w.strs("llama.block_count", &big);
        let e = config_err(&w);
        clean(&e);
        assert!(
            e.contains("'llama.block_count' should be a non-negative integer")
                && e.contains("Array(len 100000: [String(\"evil\\u{1b}[2J\\nINFO forged line\"), "),
            "{e}"
        );
        // string values: the architecture, the tokenizer model
        let t = write_tmp(&synthetic(&long).bytes());
        let e = GgufFile::open(&t.path)
            .unwrap()
            .config()
            .unwrap_err()
            .to_string();
        clean(&e);
        assert!(e.contains("unknown architecture 'evil\\u{1b}"), "{e}");
        let mut w = synthetic("llama");
        w.kvs.retain(|(k, _, _)| k != "tokenizer.ggml.model");
        let w = w.str("tokenizer.ggml.model", &long);
        let t = write_tmp(&w.bytes());
        let e = GgufFile::open(&t.path)
            .unwrap()
            .tokenizer()
            .unwrap_err()
            .to_string();
        clean(&e);
        assert!(e.contains("tokenizer model 'evil\\u{1b}"), "{e}");
    }

    #[test]
    fn debug_of_values_is_bounded() {
        let nested = GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::U8(1); 1000]); 1000]);
        assert_eq!(
            format!("{nested:?}"),
            "Array(len 1000: [Array(len 1000), Array(len 1000), Array(len 1000), Array(len 1000), …])"
        );
        assert_eq!(
            format!(
                "{:?}",
                GgufValue::Array(vec![GgufValue::F32(0.5), GgufValue::I8(-1)])
            ),
            "Array(len 2: [F32(0.5), I8(-1)])"
        );
        assert_eq!(
            format!("{:?}", GgufValue::String("a\nb".into())),
            "String(\"a\\nb\")"
        );
    }

    #[test]
    fn a_family_key_that_is_missing_is_named() {
        // a gemma3 file without its sliding window: the error names the file and the key
        let t = write_tmp(&synthetic("gemma3").bytes());
        let e = GgufFile::open(&t.path).unwrap().config().unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains(&t.path.display().to_string())
                && e.contains("gemma3.attention.sliding_window"),
            "{e}"
        );
    }

    #[test]
    fn tokenizer_errors() {
        let mut w = synthetic("llama");
        w.kvs.retain(|(k, _, _)| k != "tokenizer.ggml.model");
        let w = w.str("tokenizer.ggml.model", "bert");
        let t = write_tmp(&w.bytes());
        let e = GgufFile::open(&t.path)
            .unwrap()
            .tokenizer()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&t.path.display().to_string())
                && e.contains("tokenizer model 'bert' (tokenizer.ggml.model) is not supported yet"),
            "{e}"
        );

        let mut w = synthetic("llama");
        w.kvs.retain(|(k, _, _)| k != "tokenizer.ggml.pre");
        let w = w.str("tokenizer.ggml.pre", "deepseek-llm");
        let t = write_tmp(&w.bytes());
        let e = GgufFile::open(&t.path)
            .unwrap()
            .tokenizer()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'deepseek-llm'") && e.contains("not supported yet"),
            "{e}"
        );

        let mut w = synthetic("llama");
        w.kvs.retain(|(k, _, _)| k != "tokenizer.ggml.merges");
        let w = w.strs("tokenizer.ggml.merges", &["ab"]);
        let t = write_tmp(&w.bytes());
        let e = GgufFile::open(&t.path)
            .unwrap()
            .tokenizer()
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a space-separated pair"), "{e}");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
            /// Corrupted or cut files never panic: open either fails or yields a file whose
            /// every accessor returns normally.
            #[test]
            fn corrupt_files_never_panic(
                edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
                cut in any::<prop::sample::Index>(),
                do_cut in any::<bool>(),
            ) {
                let mut b = synthetic("llama").bytes();
                for (i, v) in edits {
                    let i = i.index(b.len());
                    b[i] = v;
                }
                if do_cut {
                    let n = cut.index(b.len());
                    b.truncate(n);
                }
                let t = write_tmp(&b);
                if let Ok(g) = GgufFile::open(&t.path) {
                    let _ = g.config();
                    let _ = g.tokenizer();
                    let _ = g.chat_template();
                    let _ = g.token_text(3);
                    for n in ["model.embed_tokens.weight", "model.norm.weight",
                              "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                              "model.layers.0.mlp.down_proj.weight"] {
                        if let Ok(Some(x)) = g.tensor(n) {
                            prop_assert_eq!(x.shape.iter().product::<usize>(), x.data.len());
                        }
                    }
                }
            }
        }
    }
}
