//! The kernel sources (`kernels/*.cu`, one file per op family, and the shared header), how they
//! are handed to a run-time compiler, and the on-disk cache of what it produced.
//!
//! NOTE: the sources are compiled for the device's own architecture (`sm_90` on Hopper, the
//! `gfx…` target on AMD), never only as generic PTX. A compiled binary is cached under
//! `~/.cache/pagoda/kernels/` (or `$PAGODA_KERNEL_CACHE`; `off` disables the cache) by a key
//! that covers everything that changes the output:
//!
//! ```text
//!   <file>-<arch>-<sha256(api, compiler version, arch, options, prepared source)[..16]>.<ext>
//! ```

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub const COMMON: &str = include_str!("../../../kernels/common.cuh");
pub const HIP_COMPAT: &str = include_str!("../../../kernels/hip_compat.h");
pub const EMU: &str = include_str!("../../../kernels/emu.h");

/// `(file stem, source)` of every kernel file.
pub const SOURCES: &[(&str, &str)] = &[
    (
        "elementwise",
        include_str!("../../../kernels/elementwise.cu"),
    ),
    ("norm", include_str!("../../../kernels/norm.cu")),
    ("rope", include_str!("../../../kernels/rope.cu")),
    ("cache", include_str!("../../../kernels/cache.cu")),
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("matmul", include_str!("../../../kernels/matmul.cu")),
    ("qmatmul", include_str!("../../../kernels/qmatmul.cu")),
    ("sample", include_str!("../../../kernels/sample.cu")),
    ("lora", include_str!("../../../kernels/lora.cu")),
];

/// Weight dtypes as they appear in kernel names.
pub const WEIGHT_DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// KV cache types as they appear in kernel names.
pub const KV_DTYPES: [&str; 4] = ["f32", "bf16", "f16", "fp8"];

/// KV cache types whose prefill attention runs on tensor cores (`PG_TENSOR_CORES`).
pub const MMA_KV_DTYPES: [&str; 3] = ["bf16", "f16", "fp8"];

/// The compile option that defines the tensor-core kernels (common.cuh, attention.cu).
pub const TENSOR_CORES_DEFINE: &str = "-DPG_TENSOR_CORES=1";

/// Head sizes with a `paged_attention_decode_<kv dtype>_d<D>` kernel (attention.cu), and with
/// a `paged_attention_prefill_<kv dtype>_d<D>` one where there are tensor cores; others go
/// through the general kernel.
pub const DECODE_HEAD_DIMS: [usize; 7] = [16, 32, 64, 80, 96, 128, 256];

/// Threads per block of the `sample` kernels (`SAMPLE_THREADS` in sample.cu).
pub const SAMPLE_THREADS: u32 = 512;

/// Most top log-probabilities per row of `logprobs_f32`, and the words of one row of its
/// output (`LOGPROBS_MAX` and `LOGPROBS_WORDS` in sample.cu).
pub const LOGPROBS_MAX: usize = 20;
pub const LOGPROBS_WORDS: usize = 3 + 2 * LOGPROBS_MAX;

/// GGML block types with kernels (`qmatvec_<type>` and `embedding_<type>` in qmatmul.cu), in
/// the order of `GgmlType::WITH_KERNELS`.
pub const QUANT_TYPES: [&str; 12] = [
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
    "iq4_xs",
];

/// Rows of x per launch row of `qmatvec_<type>` (`QM_ROWS` in qmatmul.cu).
pub const QMATVEC_ROWS: usize = 8;

/// Largest row count served by the `matvec_<dtype>_<M>` and `matvec_gated_<dtype>_<M>` kernels.
pub const MATVEC_MAX_ROWS: usize = 8;

/// The `extern "C"` kernels that each file defines (those stamped out by macros included);
/// `tensor_cores`: compiled with [`TENSOR_CORES_DEFINE`].
pub fn kernel_names(stem: &str, tensor_cores: bool) -> Vec<String> {
    let fixed: &[&str] = match stem {
        "elementwise" => &[
            "add_assign_f32",
            "gated_act_f32",
            "act_f32",
            "scale_f32",
            "softcap_f32",
            "clamp_f32",
            "gather_rows_f32",
            "scatter_add_rows_f32",
            "add_bias_f32",
            "cast_f32_bf16",
            "cast_f32_f16",
        ],
        "norm" => &[
            "rms_norm_f32",
            "add_rms_norm_f32",
            "layer_norm_f32",
            "qk_norm_f32",
        ],
        "sample" => &[
            "argmax_f32",
            "logit_edits_f32",
            "sample_f32",
            "logprobs_f32",
        ],
        "rope" => &["rope_f32"],
        "qmatmul" => &["quantize_x32_f32", "quantize_x256_f32"],
        "attention" => &["attention_reduce_f32"],
        "lora" => &[
            "lora_shrink_f32",
            "lora_shrink_f16",
            "lora_shrink_bf16",
            "lora_expand_f32",
            "lora_expand_f16",
            "lora_expand_bf16",
        ],
        _ => &[],
    };
    let mut names: Vec<String> = fixed.iter().map(|s| s.to_string()).collect();
    match stem {
        "elementwise" => names.extend(WEIGHT_DTYPES.iter().map(|d| format!("embedding_{d}"))),
        "cache" => {
            for k in KV_DTYPES {
                names.push(format!("write_kv_{k}"));
                names.push(format!("rope_write_kv_{k}"));
            }
        }
        "attention" => {
            for k in KV_DTYPES {
                names.push(format!("paged_attention_{k}"));
                for d in DECODE_HEAD_DIMS {
                    names.push(format!("paged_attention_decode_{k}_d{d}"));
                }
            }
            if tensor_cores {
                for k in MMA_KV_DTYPES {
                    for d in DECODE_HEAD_DIMS {
                        names.push(format!("paged_attention_prefill_{k}_d{d}"));
                    }
                }
            }
        }
        "matmul" => {
            for d in WEIGHT_DTYPES {
                names.push(format!("gemm_{d}"));
                for m in 1..=MATVEC_MAX_ROWS {
                    names.push(format!("matvec_{d}_{m}"));
                    names.push(format!("matvec_gated_{d}_{m}"));
                }
            }
        }
        "qmatmul" => {
            for t in QUANT_TYPES {
                names.push(format!("qmatvec_{t}"));
                names.push(format!("embedding_{t}"));
            }
        }
        _ => {}
    }
    names
}

/// Which run-time compiler a source is prepared for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Cuda,
    Hip,
    /// The host's C++ compiler, with `kernels/emu.h` (the `emu` backend).
    Emu,
}

/// The source as one self-contained translation unit: `#include "common.cuh"` is replaced by
/// the header (after hip_compat.h for HIP, after emu.h for the emulator), so the compiler needs no include path and no
/// header from a toolkit. For the emulator, the file's launchers follow (see `gpu/emu.rs`), for
/// the kernels it defines with or without `tensor_cores`.
pub fn prepare(stem: &str, source: &str, dialect: Dialect, tensor_cores: bool) -> String {
    let strip = |s: &str| {
        s.lines()
            .filter(|l| l.trim() != "#pragma once")
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut header = String::new();
    match dialect {
        Dialect::Cuda => {}
        Dialect::Hip => header.push_str(&strip(HIP_COMPAT)),
        Dialect::Emu => header.push_str(&strip(EMU)),
    }
    header.push('\n');
    header.push_str(&strip(COMMON));
    let mut out = String::with_capacity(source.len() + header.len());
    for line in source.lines() {
        if line.trim() == "#include \"common.cuh\"" {
            out.push_str(&header);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    if dialect == Dialect::Emu {
        // `int pg_emu_launch_<kernel>(args, grid, block, shared bytes, error, error length)`;
        // emu.h's `launch` deduces the kernel's parameter types.
        for k in kernel_names(stem, tensor_cores) {
            out.push_str(&format!(
                "extern \"C\" int pg_emu_launch_{k}(void** a, const unsigned* g, const unsigned* b, \
                 unsigned s, char* e, unsigned n) {{ return pg_emu::launch(&{k}, a, g, b, s, e, n); }}\n"
            ));
        }
    }
    out
}

/// The cache key of one compiled file: a hash of everything that changes the binary.
pub fn cache_key(
    api: &str,
    compiler: &str,
    arch: &str,
    options: &[String],
    source: &str,
) -> String {
    let mut h = Sha256::new();
    for part in [api, compiler, arch] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    for o in options {
        h.update(o.as_bytes());
        h.update([0u8]);
    }
    h.update(source.as_bytes());
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Where compiled kernels are kept between runs.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// `$PAGODA_KERNEL_CACHE` (`off`, `0` or empty: no cache), else `~/.cache/pagoda/kernels`.
    pub fn from_env() -> Self {
        let dir = match std::env::var_os("PAGODA_KERNEL_CACHE") {
            Some(v) if v.is_empty() || v == "off" || v == "0" => None,
            Some(v) => Some(PathBuf::from(v)),
            None => dirs::cache_dir().map(|d| d.join("pagoda").join("kernels")),
        };
        KernelCache { dir }
    }

    pub fn at(dir: Option<PathBuf>) -> Self {
        KernelCache { dir }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn path(&self, stem: &str, arch: &str, key: &str, ext: &str) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("{stem}-{arch}-{key}.{ext}")))
    }

    /// The cached binary, or `compile()`'s result (then stored). Returns whether it was cached.
    /// A cache that cannot be read or written is only a warning: the kernel is compiled.
    pub fn get_or_compile(
        &self,
        stem: &str,
        arch: &str,
        key: &str,
        ext: &str,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, bool)> {
        let path = self.path(stem, arch, key, ext);
        if let Some(p) = &path
            && let Ok(bin) = std::fs::read(p)
            && !bin.is_empty()
        {
            return Ok((bin, true));
        }
        let bin = compile().with_context(|| format!("compiling kernels/{stem}.cu for {arch}"))?;
        if let Some(p) = &path
            && let Err(e) = store(p, &bin)
        {
            tracing::warn!("cannot cache compiled kernels at {}: {e:#}", p.display());
        }
        Ok((bin, false))
    }
}

/// Writes through a temporary file and a rename, so that a concurrent reader never sees half
/// a binary.
fn store(path: &Path, bin: &[u8]) -> Result<()> {
    let dir = path.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bin)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_sources_are_self_contained() {
        for (stem, src) in SOURCES {
            for d in [Dialect::Cuda, Dialect::Hip, Dialect::Emu] {
                let p = prepare(stem, src, d, false);
                // NOTE: the emulator's header includes the C++ standard library.
                assert!(!p.contains("#include \""), "{stem}: an include is left");
                assert!(!p.contains("#pragma once"), "{stem}: #pragma once is left");
                assert!(
                    p.contains("struct bf16_t"),
                    "{stem}: the header is not inlined"
                );
                assert_eq!(p.contains("#define PG_HIP 1"), d == Dialect::Hip);
                assert_eq!(p.contains("#define PG_EMU 1"), d == Dialect::Emu);
            }
        }
    }

    #[test]
    fn every_listed_kernel_is_defined_in_its_file() {
        for (stem, src) in SOURCES {
            let names = kernel_names(stem, true);
            assert!(!names.is_empty(), "{stem}: no kernels listed");
            for n in names {
                // Macro-stamped names are checked through their macro's invocation.
                let direct = src.contains(&format!(" {n}("));
                let block_type = n.split_once('_').map(|(_, t)| t).unwrap_or("");
                let block_kernel = *stem == "qmatmul"
                    && (src.contains(&format!("QMATMUL({block_type},"))
                        || src.contains(&format!("QMATMUL_K({block_type},")));
                let stamped = block_kernel
                    || match n.split('_').collect::<Vec<_>>()[..] {
                        ["embedding", d] => src.contains(&format!("EMBEDDING(embedding_{d},")),
                        ["gemm", d] => src.contains(&format!("GEMM({d},")),
                        ["lora", op, d] => {
                            src.contains(&format!("LORA_{}({d},", op.to_uppercase()))
                        }
                        ["matvec", d, m] | ["matvec", "gated", d, m] => {
                            src.contains(&format!("MATVEC_ALL_M({d},"))
                                && src.contains(&format!("MATVEC(DT, W, {m})"))
                        }
                        ["paged", "attention", kv] => {
                            src.contains(&format!("PAGED_ATTENTION({kv},"))
                        }
                        ["paged", "attention", "prefill", kv, d] => {
                            src.contains(&format!("PG_HEAD_DIMS(PAGED_ATTENTION_MMA, {kv},"))
                                && src.contains(&format!("X(DT, KV, {})", &d[1..]))
                        }
                        ["write", "kv", kv] => src.contains(&format!("WRITE_KV({kv},")),
                        ["rope", "write", "kv", kv] => {
                            src.contains(&format!("ROPE_WRITE_KV({kv},"))
                        }
                        ["paged", "attention", "decode", kv, d] => {
                            src.contains(&format!("PG_HEAD_DIMS(PAGED_ATTENTION_DECODE, {kv},"))
                                && src.contains(&format!("X(DT, KV, {})", &d[1..]))
                        }
                        _ => false,
                    };
                assert!(direct || stamped, "{stem}: kernel {n} is not defined");
            }
        }
    }

    /// A kernel missing from `kernel_names` is never loaded, and its op fails on the device
    /// with "no kernel named …" (layer_norm_f32 was, until the emulator ran it).
    #[test]
    fn every_kernel_defined_in_a_file_is_listed() {
        for (stem, src) in SOURCES {
            let names = kernel_names(stem, true);
            for def in src.split("extern \"C\" __global__ void").skip(1) {
                let head = def.split('(').collect::<Vec<_>>();
                // `__launch_bounds__(N) name(` or `name(`
                let name = if head[0].trim() == "__launch_bounds__" {
                    head[1].split(')').nth(1).unwrap_or("").trim()
                } else {
                    head[0].trim()
                };
                if name.contains("##") || name.chars().all(|c| c.is_ascii_uppercase()) {
                    continue; // stamped by a macro: the other test
                }
                assert!(
                    names.iter().any(|n| n == name),
                    "{stem}: kernel {name} is defined but not listed"
                );
            }
        }
    }

    #[test]
    fn cache_key_covers_every_input() {
        let opts = vec!["--gpu-architecture=sm_90".to_string()];
        let base = cache_key("cuda", "nvrtc 13.0", "sm_90", &opts, "src");
        assert_eq!(base.len(), 32);
        assert_eq!(base, cache_key("cuda", "nvrtc 13.0", "sm_90", &opts, "src"));
        let other_opts = vec!["--gpu-architecture=sm_80".to_string()];
        for k in [
            cache_key("hip", "nvrtc 13.0", "sm_90", &opts, "src"),
            cache_key("cuda", "nvrtc 13.1", "sm_90", &opts, "src"),
            cache_key("cuda", "nvrtc 13.0", "sm_89", &opts, "src"),
            cache_key("cuda", "nvrtc 13.0", "sm_90", &other_opts, "src"),
            cache_key("cuda", "nvrtc 13.0", "sm_90", &opts, "src "),
            // no ambiguity between fields
            cache_key("cud", "anvrtc 13.0", "sm_90", &opts, "src"),
        ] {
            assert_ne!(k, base);
        }
    }

    #[test]
    fn cache_stores_and_reuses_binaries() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::at(Some(dir.path().join("k")));
        let mut calls = 0;
        let (bin, cached) = cache
            .get_or_compile("norm", "sm_90", "abc", "cubin", || {
                calls += 1;
                Ok(vec![1, 2, 3])
            })
            .unwrap();
        assert_eq!((bin, cached), (vec![1, 2, 3], false));
        let (bin, cached) = cache
            .get_or_compile("norm", "sm_90", "abc", "cubin", || {
                calls += 1;
                Ok(vec![9])
            })
            .unwrap();
        assert_eq!((bin, cached), (vec![1, 2, 3], true));
        assert_eq!(calls, 1);
        assert!(dir.path().join("k/norm-sm_90-abc.cubin").exists());
        // another key compiles again
        let (_, cached) = cache
            .get_or_compile("norm", "sm_90", "abd", "cubin", || Ok(vec![4]))
            .unwrap();
        assert!(!cached);
        // no cache directory: always compiles, never fails for it
        let none = KernelCache::at(None);
        let (_, cached) = none
            .get_or_compile("norm", "sm_90", "abc", "cubin", || Ok(vec![5]))
            .unwrap();
        assert!(!cached);
        // a compile error names the file and the architecture
        let err = none
            .get_or_compile("norm", "sm_90", "x", "cubin", || anyhow::bail!("boom"))
            .unwrap_err();
        assert!(format!("{err:#}").contains("kernels/norm.cu for sm_90"));
    }
}
