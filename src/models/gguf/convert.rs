//! Writes a GGUF file's copy with its block-quantized tensors stored as f16: the same
//! metadata (copied byte for byte), the same tensor names and shapes, the values the reference
//! dequantizer gives rounded to f16. It is how the default model's higher-precision variant is
//! made (`models::default_model`): the weights are the packaged file's, but the CPU backend
//! multiplies f16 weights with f32 activations instead of quantizing the activations to 8 bits.

use super::{GgmlType, GgufFile};
use anyhow::{Context, Result, bail};
use half::f16;
use std::io::{BufWriter, Write};
use std::path::Path;

/// GGML type ids written by the copy.
const TYPE_F32: u32 = 0;
const TYPE_F16: u32 = 1;

/// Writes `src` to `dst` with every quantized tensor as f16 (f32 and f16 tensors are copied
/// as they are; any other type is refused). The file is written beside `dst` and renamed into
/// place, so an interrupted copy never leaves a partial `dst`.
///
/// NOTE: `general.file_type` is copied too, so it still names the source's type: it is a
/// description llama.cpp prints, not how it reads the tensors (each has its own type).
pub fn f16_copy(src: &GgufFile, dst: &Path) -> Result<()> {
    let mut plan = Vec::with_capacity(src.tensors.len());
    let mut rel = 0u64;
    for t in &src.tensors {
        let (block, _) = t.ty.block_layout();
        let (id, n_bytes) = match t.ty {
            GgmlType::F32 => (TYPE_F32, t.n_bytes),
            GgmlType::F16 => (TYPE_F16, t.n_bytes),
            ty if block > 1 && ty.is_supported() => (TYPE_F16, 2 * t.n_elements()),
            ty => bail!(
                "{}: tensor '{}' of type {ty} has no f16 copy",
                src.path.display(),
                t.name
            ),
        };
        plan.push((t, id, rel));
        rel = (rel + n_bytes).next_multiple_of(src.kv.alignment);
    }

    // NOTE: one name per process, so two processes making the same copy at once do not
    // write into one file; the rename is atomic and either copy is the same.
    let tmp = dst.with_extension(format!("part.{}", std::process::id()));
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut w = Out {
        w: BufWriter::with_capacity(1 << 20, file),
        at: 0,
    };
    let written = (|| -> std::io::Result<()> {
        w.put(b"GGUF")?;
        w.put(&3u32.to_le_bytes())?;
        w.put(&(src.tensors.len() as u64).to_le_bytes())?;
        w.put(&src.kv.count.to_le_bytes())?;
        w.put(&src.mmap[src.kv.start..src.kv.end])?;
        for &(t, id, rel) in &plan {
            w.put(&(t.name.len() as u64).to_le_bytes())?;
            w.put(t.name.as_bytes())?;
            w.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.put(&d.to_le_bytes())?;
            }
            w.put(&id.to_le_bytes())?;
            w.put(&rel.to_le_bytes())?;
        }
        let data_start = w.at.next_multiple_of(src.kv.alignment);
        for &(t, id, rel) in &plan {
            w.put(&vec![0u8; (data_start + rel - w.at) as usize])?;
            let raw = src.raw_bytes(t).map_err(std::io::Error::other)?;
            if id == TYPE_F16 && t.ty != GgmlType::F16 {
                let n = t.n_elements() as usize;
                let values = super::dequantize(t.ty, raw, n).map_err(std::io::Error::other)?;
                let bytes: Vec<u8> = values
                    .iter()
                    .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                    .collect();
                w.put(&bytes)?;
            } else {
                w.put(raw)?;
            }
            src.release(t);
        }
        w.w.flush()?;
        w.w.get_ref().sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", tmp.display()));
    }
    std::fs::rename(&tmp, dst).with_context(|| format!("cannot move {} into place", tmp.display()))
}

/// The file being written, and how many bytes it holds.
struct Out {
    w: BufWriter<std::fs::File>,
    at: u64,
}

impl Out {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.at += bytes.len() as u64;
        self.w.write_all(bytes)
    }
}
