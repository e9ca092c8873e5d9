//! The CUDA backend: the driver API, NVRTC and cuBLAS through `cudarc`, loaded at run time, so
//! that the crate builds and starts on machines without a toolkit or a driver. Everything
//! above the runtime API (buffers, kernels, launch geometry) is shared with HIP in
//! [`super::gpu`].
//!
//! NOTE: cudarc panics when a library it loads lazily is missing, so each library is looked
//! for first and its absence is an error that names it; creation also runs under
//! `catch_unwind`, so that a missing symbol (an old driver) is an error, never an abort.

use super::gpu::kernels::Dialect;
use super::gpu::{CclLibrary, Elem, GemmEx, GpuBackend, GpuRuntime};
use anyhow::{Context, Result, anyhow, bail};
use cudarc::cublas::sys as blas;
use cudarc::driver::{result as drv, sys as cu};
use cudarc::nvrtc::sys as nvrtc;
use std::ffi::{CString, c_void};
use std::sync::Mutex;

/// The CUDA backend: [`GpuBackend`] over the CUDA driver API.
pub type CudaBackend = GpuBackend<CudaRt>;

impl GpuBackend<CudaRt> {
    /// Opens CUDA device 0 (`CUDA_VISIBLE_DEVICES` chooses which), compiles the kernels for it
    /// (or takes them from the disk cache) and creates the cuBLAS handle. Fails with an error
    /// that says what is missing where there is no driver, no NVRTC, no cuBLAS or no device.
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }
}

fn ck<T, E: std::fmt::Debug>(r: std::result::Result<T, E>, what: &str) -> Result<T> {
    r.map_err(|e| anyhow!("CUDA: {what} failed: {e:?}"))
}

/// Which of the libraries the CUDA backend loads can be found; `Err` names the first missing
/// one and what to do about it.
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only try to open the libraries by name.
    unsafe {
        if !cu::is_culib_present() {
            bail!(
                "CUDA: the driver library (libcuda.so) was not found: this machine has no NVIDIA driver, or it is not on the library path"
            );
        }
        if !nvrtc::is_culib_present() {
            bail!(
                "CUDA: NVRTC (libnvrtc.so) was not found: install the CUDA toolkit or the nvidia-cuda-nvrtc wheel and add its lib folder to LD_LIBRARY_PATH"
            );
        }
        if !blas::is_culib_present() {
            bail!(
                "CUDA: cuBLAS (libcublas.so) was not found: install the CUDA toolkit or the nvidia-cublas wheel and add its lib folder to LD_LIBRARY_PATH"
            );
        }
    }
    Ok(())
}

/// The NVRTC version, where NVRTC can be loaded (it needs no GPU).
pub fn nvrtc_version() -> Option<(i32, i32)> {
    // SAFETY: only opens the library; nvrtcVersion writes two ints.
    unsafe {
        if !nvrtc::is_culib_present() {
            return None;
        }
        let (mut a, mut b) = (0, 0);
        (nvrtc::nvrtcVersion(&mut a, &mut b) == nvrtc::nvrtcResult::NVRTC_SUCCESS).then_some((a, b))
    }
}

/// Compiles one prepared source with NVRTC for `arch` ("sm_90") and returns the cubin. Needs
/// NVRTC only, no GPU: the tests use it to check that every kernel file compiles.
pub fn nvrtc_compile(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(source).context("kernel source has a NUL byte")?;
    let cname = CString::new(name)?;
    let opts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()?;
    let opt_ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: standard NVRTC call sequence; every pointer outlives the program.
    unsafe {
        let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
        let r = nvrtc::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            bail!("nvrtcCreateProgram: {r:?}");
        }
        let r = nvrtc::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let mut log_size = 0usize;
        nvrtc::nvrtcGetProgramLogSize(prog, &mut log_size);
        let mut log = vec![0u8; log_size.max(1)];
        nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut _);
        let log = String::from_utf8_lossy(&log[..log_size.saturating_sub(1)]).into_owned();
        let out = if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            Err(anyhow!("NVRTC could not compile {name} ({r:?}):\n{log}"))
        } else {
            let mut size = 0usize;
            let r = nvrtc::nvrtcGetCUBINSize(prog, &mut size);
            if r != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(anyhow!(
                    "NVRTC produced no cubin for {name} ({r:?}); the architecture must be a real one (sm_XY)"
                ))
            } else {
                let mut bin = vec![0u8; size];
                let r = nvrtc::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut _);
                if r != nvrtc::nvrtcResult::NVRTC_SUCCESS {
                    Err(anyhow!("nvrtcGetCUBIN: {r:?}"))
                } else {
                    if !log.trim().is_empty() {
                        tracing::debug!("NVRTC {name}: {log}");
                    }
                    Ok(bin)
                }
            }
        };
        nvrtc::nvrtcDestroyProgram(&mut prog);
        out
    }
}

/// Whether `arch` ("sm_90") has mma.sync with bf16 and f16 inputs: compute capability 8.0 on.
pub fn arch_has_tensor_cores(arch: &str) -> bool {
    arch.strip_prefix("sm_")
        .and_then(|v| v.trim_end_matches(char::is_alphabetic).parse::<u32>().ok())
        .is_some_and(|v| v >= 80)
}

/// NVRTC options for a device of compute capability `arch` ("sm_90").
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-DPG_WARP_SIZE=32".into(),
    ];
    if arch_has_tensor_cores(arch) {
        o.push(crate::backend::gpu::kernels::TENSOR_CORES_DEFINE.into());
    }
    o
}

/// The CUDA half of the CUDA backend: a device's primary context, the kernels' modules and a
/// cuBLAS handle, all on the legacy default stream.
pub struct CudaRt {
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
    blas: blas::cublasHandle_t,
    name: String,
    arch: String,
    sms: u32,
    nvrtc: (i32, i32),
    modules: Mutex<Vec<cu::CUmodule>>,
}

// SAFETY: the context, modules and cuBLAS handle are used from any thread after `bind` makes
// the context current there; the driver API and cuBLAS are thread-safe for that use, and every
// launch goes to one in-order stream.
unsafe impl Send for CudaRt {}
unsafe impl Sync for CudaRt {}

/// The devices CUDA sees (after `CUDA_VISIBLE_DEVICES`), at least one.
fn device_count() -> Result<usize> {
    check_libraries()?;
    ck(
        drv::init(),
        "cuInit (is an NVIDIA GPU present and its driver loaded?)",
    )?;
    let count = ck(drv::device::get_count(), "cuDeviceGetCount")?;
    if count <= 0 {
        bail!("CUDA: the driver is present but sees no GPU");
    }
    Ok(count as usize)
}

impl CudaRt {
    fn open_device(device: usize) -> Result<Self> {
        let count = device_count()?;
        if device >= count {
            bail!("CUDA: there is no device {device} (this process sees {count})");
        }
        let dev = ck(drv::device::get(device as i32), "cuDeviceGet")?;
        // SAFETY: `dev` came from cuDeviceGet.
        let ctx = ck(
            unsafe { drv::primary_ctx::retain(dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        // SAFETY: a retained primary context.
        ck(unsafe { drv::ctx::set_current(ctx) }, "cuCtxSetCurrent")?;
        let attr = |a| {
            // SAFETY: `dev` came from cuDeviceGet.
            ck(
                unsafe { drv::device::get_attribute(dev, a) },
                "cuDeviceGetAttribute",
            )
        };
        let major = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let name = ck(drv::device::get_name(dev), "cuDeviceGetName")?;
        let nvrtc = nvrtc_version().context("CUDA: NVRTC does not answer nvrtcVersion")?;
        let blas = ck(cudarc::cublas::result::create_handle(), "cublasCreate")?;
        // SAFETY: a fresh handle; the null stream is the legacy default stream.
        ck(
            unsafe { cudarc::cublas::result::set_stream(blas, std::ptr::null_mut()) },
            "cublasSetStream",
        )?;
        Ok(CudaRt {
            dev,
            ctx,
            blas,
            name,
            arch: format!("sm_{major}{minor}"),
            sms: sms.max(1) as u32,
            nvrtc,
            modules: Mutex::new(Vec::new()),
        })
    }
}

impl Drop for CudaRt {
    fn drop(&mut self) {
        // SAFETY: the handle, modules and context are ours; nothing uses them after this.
        unsafe {
            let _ = drv::ctx::set_current(self.ctx);
            let _ = drv::ctx::synchronize();
            let _ = cudarc::cublas::result::destroy_handle(self.blas);
            if let Ok(mods) = self.modules.lock() {
                for &m in mods.iter() {
                    let _ = drv::module::unload(m);
                }
            }
            let _ = drv::primary_ctx::release(self.dev);
        }
    }
}

impl GpuRuntime for CudaRt {
    type Function = CudaFunction;
    const API: &'static str = "cuda";
    const DIALECT: Dialect = Dialect::Cuda;

    fn open(device: usize) -> Result<Self> {
        Self::open_device(device)
    }
    fn device_count() -> Result<usize> {
        std::panic::catch_unwind(device_count)
            .map_err(|_| anyhow!("CUDA: the driver library failed to load"))?
    }
    fn ccl_library() -> Option<CclLibrary> {
        let files = match std::env::var("PAGODA_NCCL_LIBRARY") {
            Ok(f) if !f.is_empty() => vec![f],
            _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
        };
        Some(CclLibrary {
            name: "NCCL",
            files,
            hint: "install NCCL (the nvidia-nccl-cu12 or -cu13 wheel has it) and add its lib \
                   folder to LD_LIBRARY_PATH, or name the file in PAGODA_NCCL_LIBRARY",
        })
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }
    fn arch(&self) -> String {
        self.arch.clone()
    }
    fn tensor_cores(&self) -> bool {
        arch_has_tensor_cores(&self.arch)
    }
    fn warp_size(&self) -> u32 {
        32
    }
    fn multiprocessors(&self) -> u32 {
        self.sms
    }
    fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (free, total) = ck(drv::mem_get_info(), "cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }
    fn bind(&self) -> Result<()> {
        if ck(drv::ctx::get_current(), "cuCtxGetCurrent")? != Some(self.ctx) {
            // SAFETY: our retained primary context.
            ck(
                unsafe { drv::ctx::set_current(self.ctx) },
                "cuCtxSetCurrent",
            )?;
        }
        Ok(())
    }
    fn malloc(&self, bytes: usize) -> Result<u64> {
        // SAFETY: plain device allocation in the current context.
        ck(unsafe { drv::malloc_sync(bytes) }, "cuMemAlloc")
    }
    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller hands over a pointer from malloc.
        let _ = unsafe { drv::free_sync(ptr) };
    }
    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller guarantees the range; the null stream keeps it in order.
        ck(
            unsafe { drv::memset_d8_async(ptr, 0, bytes, std::ptr::null_mut()) },
            "cuMemsetD8Async",
        )
    }
    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        ck(unsafe { drv::memcpy_htod_sync(dst, src) }, "cuMemcpyHtoD")
    }
    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        ck(unsafe { drv::memcpy_dtoh_sync(dst, src) }, "cuMemcpyDtoH")
    }
    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        ck(drv::ctx::synchronize(), "cuCtxSynchronize")
    }
    fn compiler_id(&self) -> String {
        format!("nvrtc {}.{}", self.nvrtc.0, self.nvrtc.1)
    }
    fn binary_ext(&self) -> &'static str {
        "cubin"
    }
    fn compile_options(&self) -> Vec<String> {
        nvrtc_options(&self.arch)
    }
    fn compile(&self, name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
        nvrtc_compile(name, source, options)
    }
    fn load(&self, image: &[u8], names: &[String]) -> Result<Vec<CudaFunction>> {
        self.bind()?;
        // NOTE: cuModuleLoadData reads a cubin from an arbitrary pointer; keep an aligned,
        // owned copy alive for the call.
        let words: Vec<u64> = image
            .chunks(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        // SAFETY: a complete cubin image.
        let module = ck(
            unsafe { drv::module::load_data(words.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        self.modules.lock().unwrap().push(module);
        names
            .iter()
            .map(|n| {
                let cn = CString::new(n.as_str())?;
                // SAFETY: a loaded module.
                let f = ck(
                    unsafe { drv::module::get_function(module, cn) },
                    &format!("cuModuleGetFunction({n})"),
                )?;
                Ok(CudaFunction(f))
            })
            .collect()
    }
    unsafe fn launch(
        &self,
        f: CudaFunction,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        ck(
            unsafe {
                drv::launch_kernel(
                    f.0,
                    (grid[0], grid[1], grid[2]),
                    (block[0], block[1], block[2]),
                    shared_bytes,
                    std::ptr::null_mut(),
                    args,
                )
            },
            "cuLaunchKernel",
        )
    }
    fn has_blas(&self) -> bool {
        true
    }
    unsafe fn gemm_ex(&self, g: &GemmEx) -> Result<()> {
        g.check()?;
        let t = match g.ab {
            Elem::F32 => blas::cudaDataType_t::CUDA_R_32F,
            Elem::F16 => blas::cudaDataType_t::CUDA_R_16F,
            _ => blas::cudaDataType_t::CUDA_R_16BF,
        };
        let op = |t: bool| {
            if t {
                blas::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let dims = [g.m, g.n, g.k, g.lda, g.ldb, g.ldc].map(|v| i32::try_from(v).ok());
        let [Some(m), Some(n), Some(k), Some(lda), Some(ldb), Some(ldc)] = dims else {
            bail!("cuBLAS: {}x{}x{} is too large for one call", g.m, g.k, g.n);
        };
        self.bind()?;
        // SAFETY: forwarded from the caller's contract; alpha and beta live on the host.
        ck(
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    self.blas,
                    op(g.trans_a),
                    op(g.trans_b),
                    m,
                    n,
                    k,
                    &g.alpha as *const f32 as *const c_void,
                    g.a as *const c_void,
                    t,
                    lda,
                    g.b as *const c_void,
                    t,
                    ldb,
                    &g.beta as *const f32 as *const c_void,
                    g.c as *mut c_void,
                    blas::cudaDataType_t::CUDA_R_32F,
                    ldc,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            },
            "cublasGemmEx",
        )
    }
}

/// A kernel handle (`CUfunction`).
#[derive(Clone, Copy)]
pub struct CudaFunction(cu::CUfunction);
// SAFETY: a CUfunction is an immutable handle into a loaded module; launching it from any
// thread with the context current is allowed.
unsafe impl Send for CudaFunction {}
unsafe impl Sync for CudaFunction {}
