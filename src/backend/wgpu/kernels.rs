//! The WGSL kernels: one file per op in `shaders/`, embedded at build time, compiled into compute
//! pipelines on first use and cached for the life of the device.
//!
//! A kernel that reads weights declares its binding as `w: array<WType>` and reads it only
//! through `load_w(i) -> f32`; one of the `weight_*.wgsl` snippets, prepended to the kernel's
//! source, defines both for the weight's storage type. Tile shapes are WGSL `override` constants,
//! set per pipeline.

use anyhow::{Context, Result, bail};

/// A kernel: one `shaders/*.wgsl` file with a `main` entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Matmul,
    Matvec,
    Embedding,
    RmsNorm,
    QkNorm,
    Add,
    Act,
    LayerNorm,
    Rope,
    GatherRows,
    ScatterAddRows,
    WriteKv,
    Attention,
    Argmax,
    LoraShrink,
    LoraExpand,
}

impl Kernel {
    #[cfg(test)]
    pub const ALL: [Kernel; 16] = [
        Kernel::Matmul,
        Kernel::Matvec,
        Kernel::Embedding,
        Kernel::RmsNorm,
        Kernel::QkNorm,
        Kernel::Add,
        Kernel::Act,
        Kernel::LayerNorm,
        Kernel::Rope,
        Kernel::GatherRows,
        Kernel::ScatterAddRows,
        Kernel::WriteKv,
        Kernel::Attention,
        Kernel::Argmax,
        Kernel::LoraShrink,
        Kernel::LoraExpand,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Matmul => "matmul",
            Kernel::Matvec => "matvec",
            Kernel::Embedding => "embedding",
            Kernel::RmsNorm => "rms_norm",
            Kernel::QkNorm => "qk_norm",
            Kernel::Add => "add",
            Kernel::Act => "act",
            Kernel::LayerNorm => "layer_norm",
            Kernel::Rope => "rope",
            Kernel::GatherRows => "gather_rows",
            Kernel::ScatterAddRows => "scatter_add_rows",
            Kernel::WriteKv => "write_kv",
            Kernel::Attention => "attention",
            Kernel::Argmax => "argmax",
            Kernel::LoraShrink => "lora_shrink",
            Kernel::LoraExpand => "lora_expand",
        }
    }

    fn source(self) -> &'static str {
        match self {
            Kernel::Matmul => include_str!("../../../shaders/matmul.wgsl"),
            Kernel::Matvec => include_str!("../../../shaders/matvec.wgsl"),
            Kernel::Embedding => include_str!("../../../shaders/embedding.wgsl"),
            Kernel::RmsNorm => include_str!("../../../shaders/rms_norm.wgsl"),
            Kernel::QkNorm => include_str!("../../../shaders/qk_norm.wgsl"),
            Kernel::Add => include_str!("../../../shaders/add.wgsl"),
            Kernel::Act => include_str!("../../../shaders/act.wgsl"),
            Kernel::LayerNorm => include_str!("../../../shaders/layer_norm.wgsl"),
            Kernel::Rope => include_str!("../../../shaders/rope.wgsl"),
            Kernel::GatherRows => include_str!("../../../shaders/gather_rows.wgsl"),
            Kernel::ScatterAddRows => include_str!("../../../shaders/scatter_add_rows.wgsl"),
            Kernel::WriteKv => include_str!("../../../shaders/write_kv.wgsl"),
            Kernel::Attention => include_str!("../../../shaders/attention.wgsl"),
            Kernel::Argmax => include_str!("../../../shaders/argmax.wgsl"),
            Kernel::LoraShrink => include_str!("../../../shaders/lora_shrink.wgsl"),
            Kernel::LoraExpand => include_str!("../../../shaders/lora_expand.wgsl"),
        }
    }

    /// Whether the kernel reads a weight through `load_w` (and so has a variant per storage type).
    pub fn reads_weights(self) -> bool {
        matches!(
            self,
            Kernel::Matmul
                | Kernel::Matvec
                | Kernel::Embedding
                | Kernel::LoraShrink
                | Kernel::LoraExpand
        )
    }
}

/// How a weight is stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightStorage {
    F32,
    /// Native `f16` (needs the adapter feature `shader-f16`).
    F16,
    /// bf16 packed two to a u32.
    BF16,
}

impl WeightStorage {
    fn snippet(self) -> &'static str {
        match self {
            WeightStorage::F32 => include_str!("../../../shaders/weight_f32.wgsl"),
            WeightStorage::F16 => include_str!("../../../shaders/weight_f16.wgsl"),
            WeightStorage::BF16 => include_str!("../../../shaders/weight_bf16.wgsl"),
        }
    }
}

/// The full WGSL source of a kernel variant.
pub fn source(kernel: Kernel, weights: Option<WeightStorage>) -> Result<String> {
    match (kernel.reads_weights(), weights) {
        (true, Some(w)) => Ok(format!("{}\n{}", w.snippet(), kernel.source())),
        (false, None) => Ok(kernel.source().to_string()),
        (true, None) => bail!("kernel {} needs a weight storage type", kernel.name()),
        (false, Some(_)) => bail!("kernel {} reads no weights", kernel.name()),
    }
}

/// Parses and validates WGSL with naga, so that a broken kernel is an error naming the file and
/// line instead of a failure deep inside the driver.
pub fn validate(kernel: Kernel, src: &str, f16: bool) -> Result<()> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| {
        anyhow::anyhow!(
            "shaders/{}.wgsl does not parse:\n{}",
            kernel.name(),
            e.emit_to_string(src)
        )
    })?;
    let mut caps = naga::valid::Capabilities::empty();
    if f16 {
        caps |= naga::valid::Capabilities::SHADER_FLOAT16;
    }
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| {
            anyhow::anyhow!(
                "shaders/{}.wgsl is not valid:\n{}",
                kernel.name(),
                e.emit_to_string(src)
            )
        })
        .context("validating a WGSL kernel")?;
    Ok(())
}

/// Which pipeline: a kernel, its weight storage, and its override constants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PipelineKey {
    pub kernel: Kernel,
    pub weights: Option<WeightStorage>,
    pub constants: Vec<(&'static str, u32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel variant parses and validates, without any adapter.
    #[test]
    fn every_kernel_validates() {
        for k in Kernel::ALL {
            if k.reads_weights() {
                for w in [WeightStorage::F32, WeightStorage::F16, WeightStorage::BF16] {
                    validate(k, &source(k, Some(w)).unwrap(), true)
                        .unwrap_or_else(|e| panic!("{e:#}"));
                }
            } else {
                validate(k, &source(k, None).unwrap(), false).unwrap_or_else(|e| panic!("{e:#}"));
            }
        }
    }
}
