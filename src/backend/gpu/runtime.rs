//! The vendor part of a GPU backend: [`GpuRuntime`] (memory, copies, the run-time compiler,
//! module loading, launches, an optional vendor GEMM, the devices and their collective
//! library) and the element types of device buffers.

use super::kernels::Dialect;
use crate::tensor::DType;
use anyhow::{Result, bail};
use std::ffi::c_void;

/// Element type of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 (KV caches only)
    F8,
    U32,
    /// A weight in GGML blocks, in the device's layout (`gpu/qmatmul.rs`): bytes.
    Blocks,
}

impl Elem {
    pub fn of(d: DType) -> Elem {
        match d {
            DType::F32 => Elem::F32,
            DType::F16 => Elem::F16,
            DType::BF16 => Elem::BF16,
            DType::F8E4M3 => Elem::F8,
        }
    }
    pub fn size(self) -> usize {
        match self {
            Elem::F8 | Elem::Blocks => 1,
            Elem::F16 | Elem::BF16 => 2,
            Elem::F32 | Elem::U32 => 4,
        }
    }
    /// The suffix of kernels specialised for this weight type.
    pub(super) fn kernel_suffix(self) -> Result<&'static str> {
        Ok(match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
            Elem::F8 => "fp8",
            Elem::U32 => bail!("expected a float buffer, got a u32 one"),
            Elem::Blocks => bail!("expected a float buffer, got one of blocks"),
        })
    }
}

/// The vendor part of a GPU backend. Device pointers are plain `u64` addresses.
pub trait GpuRuntime: Send + Sync + Sized + 'static {
    type Function: Copy + Send + Sync;
    /// "cuda" or "hip".
    const API: &'static str;
    const DIALECT: Dialect;

    /// Opens device `device` of this process (the first is 0: `CUDA_VISIBLE_DEVICES` or
    /// `HIP_VISIBLE_DEVICES` choose which devices the process sees).
    fn open(device: usize) -> Result<Self>;
    /// How many devices this process sees.
    fn device_count() -> Result<usize>;
    /// The collective library the workers of tensor and pipeline parallelism exchange device
    /// buffers through (NCCL, RCCL), or `None` where they go through the host.
    fn ccl_library() -> Option<CclLibrary> {
        None
    }

    fn device_name(&self) -> String;
    /// The compile target: "sm_90", "gfx90a", ...
    fn arch(&self) -> String;
    fn warp_size(&self) -> u32;
    /// Whether the kernels may use warp-wide 16-bit matrix instructions (mma.sync m16n8k16:
    /// sm_80 and later); then [`Self::compile_options`] defines `PG_TENSOR_CORES`, and the
    /// host launches the kernels it brings.
    fn tensor_cores(&self) -> bool {
        false
    }
    fn multiprocessors(&self) -> u32;
    /// (free, total) bytes of device memory.
    fn mem_info(&self) -> Result<(u64, u64)>;
    /// Makes the device current on the calling thread (each op calls it first).
    fn bind(&self) -> Result<()>;

    fn malloc(&self, bytes: usize) -> Result<u64>;
    /// # Safety
    /// `ptr` came from [`Self::malloc`] and is not used afterwards.
    unsafe fn free(&self, ptr: u64);
    /// # Safety
    /// `ptr .. ptr + bytes` is device memory of this runtime.
    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()>;
    /// Synchronous host-to-device copy (ordered after all queued work).
    /// # Safety
    /// `dst .. dst + src.len()` is device memory of this runtime.
    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Synchronous device-to-host copy (waits for all queued work).
    /// # Safety
    /// `src .. src + dst.len()` is device memory of this runtime.
    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    /// What a buffer handed out without zeroing holds: nothing is done on a GPU; the emulator
    /// writes NaNs, so that a kernel reading what no one wrote shows in the results.
    /// # Safety
    /// `ptr .. ptr + bytes` is device memory of this runtime.
    unsafe fn fill_uninit(&self, ptr: u64, bytes: usize) -> Result<()> {
        let _ = (ptr, bytes);
        Ok(())
    }

    /// Identifies the run-time compiler and its version, for the cache key.
    fn compiler_id(&self) -> String;
    /// File extension of compiled binaries ("cubin", "hsaco").
    fn binary_ext(&self) -> &'static str;
    fn compile_options(&self) -> Vec<String>;
    /// Compiles one prepared source for [`Self::arch`].
    fn compile(&self, name: &str, source: &str, options: &[String]) -> Result<Vec<u8>>;
    /// Loads a compiled binary (kept loaded for the runtime's lifetime) and resolves the named
    /// kernels, in order.
    fn load(&self, image: &[u8], names: &[String]) -> Result<Vec<Self::Function>>;
    /// # Safety
    /// `args` point at values of the kernel's parameter types, in order; every pointer among
    /// them is device memory large enough for what the kernel touches.
    unsafe fn launch(
        &self,
        f: Self::Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &mut [*mut c_void],
    ) -> Result<()>;

    /// Whether [`Self::gemm_ex`] is backed by a vendor library (or, in the emulator, by a
    /// reference with the same contract).
    fn has_blas(&self) -> bool {
        false
    }
    /// One column-major GEMM as cuBLAS's and hipBLAS's `gemm_ex` take it.
    /// # Safety
    /// `a`, `b` and `c` are device memory holding the elements that `g`'s shapes and leading
    /// dimensions reach.
    unsafe fn gemm_ex(&self, g: &GemmEx) -> Result<()> {
        let _ = g;
        bail!("{}: no vendor GEMM", Self::API)
    }
}

/// `C = alpha·op(A)·op(B) + beta·C` in column-major storage, as cuBLAS's `cublasGemmEx` (and
/// hipBLAS's) take it: `op(A)` is `m × k`, `op(B)` is `k × n`, `C` is `m × n` in f32; A and B
/// of type `ab`; f32 accumulation (`CUBLAS_COMPUTE_32F`). Element (i, j) of a column-major
/// matrix with leading dimension `ld` is at `i + j·ld`. With `beta == 0`, C is not read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmEx {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub beta: f32,
    pub c: u64,
    pub ldc: usize,
    pub ab: Elem,
}

impl GemmEx {
    /// Row-major `y[m, n] = x[m, k] · w[n, k]ᵀ` (a linear layer), which column-major is
    /// `yᵀ[n, m] = op(w)·xᵀ`: A = w read as `k × n` and transposed, B = x read as `k × m`.
    pub fn linear(ab: Elem, m: usize, n: usize, k: usize, x: u64, w: u64, y: u64) -> Self {
        GemmEx {
            trans_a: true,
            trans_b: false,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            a: w,
            lda: k,
            b: x,
            ldb: k,
            beta: 0.0,
            c: y,
            ldc: n,
            ab,
        }
    }

    /// Refuses what cuBLAS refuses with `CUBLAS_STATUS_INVALID_VALUE`: leading dimensions
    /// shorter than the stored rows, and operand types other than f32, f16 and bf16.
    pub fn check(&self) -> Result<()> {
        let rows_a = if self.trans_a { self.k } else { self.m };
        let rows_b = if self.trans_b { self.n } else { self.k };
        anyhow::ensure!(
            self.lda >= rows_a.max(1) && self.ldb >= rows_b.max(1) && self.ldc >= self.m.max(1),
            "gemm_ex: leading dimensions {} / {} / {} below the rows {rows_a} / {rows_b} / {}",
            self.lda,
            self.ldb,
            self.ldc,
            self.m
        );
        anyhow::ensure!(
            matches!(self.ab, Elem::F32 | Elem::F16 | Elem::BF16),
            "gemm_ex: a {:?} matrix",
            self.ab
        );
        Ok(())
    }
}

/// Where to find a collective library ([`GpuRuntime::ccl_library`]).
pub struct CclLibrary {
    /// "NCCL", "RCCL".
    pub name: &'static str,
    /// File names to try, in order.
    pub files: Vec<String>,
    /// What to do when none loads.
    pub hint: &'static str,
}

pub(super) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
