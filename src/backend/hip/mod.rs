//! The HIP backend (AMD GPUs): the same kernels as CUDA (`kernels/*.cu`, compiled by hipRTC
//! through `kernels/hip_compat.h`), the same Rust above the runtime API ([`super::gpu`]), and
//! the HIP runtime loaded at run time through `cubecl-hip-sys`, so the crate builds without
//! ROCm. Matrix products use our own GEMM kernels (no hipBLAS binding is loaded).
//!
//! NOTE: untested on AMD hardware: no AMD GPU has been available to this project. The calls of
//! `cubecl-hip-sys` panic when ROCm is missing, so availability is checked first and creation
//! runs under `catch_unwind`.

use super::gpu::kernels::Dialect;
use super::gpu::{CclLibrary, GpuBackend, GpuRuntime};
use anyhow::{Context, Result, anyhow, bail};
use cubecl_hip_sys as hip;
use std::ffi::{CStr, CString, c_void};
use std::sync::Mutex;

/// The HIP backend: [`GpuBackend`] over the HIP runtime.
pub type HipBackend = GpuBackend<HipRt>;

impl GpuBackend<HipRt> {
    /// Opens HIP device 0 (`HIP_VISIBLE_DEVICES` chooses which) and compiles the kernels for
    /// it. Fails with a clear error where ROCm (libamdhip64, hipRTC) or a device is missing.
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }
}

fn ck(code: hip::hipError_t, what: &str) -> Result<()> {
    if code == hip::hipError_t_hipSuccess {
        Ok(())
    } else {
        Err(anyhow!("HIP: {what} failed (hipError_t {code})"))
    }
}

pub struct HipRt {
    device: i32,
    name: String,
    arch: String,
    warp: u32,
    sms: u32,
    hiprtc: (i32, i32),
    modules: Mutex<Vec<hip::hipModule_t>>,
}

// SAFETY: HIP runtime calls are thread-safe; each op sets the device on its thread first, and
// every launch goes to the default stream in order.
unsafe impl Send for HipRt {}
unsafe impl Sync for HipRt {}

/// The devices HIP sees (after `HIP_VISIBLE_DEVICES`), at least one.
fn device_count() -> Result<usize> {
    if !hip::is_available() {
        bail!(
            "HIP: ROCm was not found (libamdhip64.so and libhiprtc.so): install ROCm or set ROCM_PATH"
        );
    }
    let mut count = 0;
    // SAFETY: plain HIP runtime calls with valid out-pointers.
    unsafe {
        ck(hip::hipInit(0), "hipInit")?;
        ck(hip::hipGetDeviceCount(&mut count), "hipGetDeviceCount")?;
    }
    if count <= 0 {
        bail!("HIP: ROCm is present but sees no GPU");
    }
    Ok(count as usize)
}

impl HipRt {
    fn open_device(device: usize) -> Result<Self> {
        let count = device_count()?;
        if device >= count {
            bail!("HIP: there is no device {device} (this process sees {count})");
        }
        let device = device as i32;
        if !hip::is_available() {
            bail!(
                "HIP: ROCm was not found (libamdhip64.so and libhiprtc.so): install ROCm or set ROCM_PATH"
            );
        }
        // SAFETY: plain HIP runtime calls with valid out-pointers.
        unsafe {
            ck(hip::hipSetDevice(device), "hipSetDevice")?;
            let mut prop: hip::hipDeviceProp_tR0600 = std::mem::zeroed();
            ck(
                hip::hipGetDevicePropertiesR0600(&mut prop, device),
                "hipGetDeviceProperties",
            )?;
            let name = CStr::from_ptr(prop.name.as_ptr())
                .to_string_lossy()
                .into_owned();
            let arch = CStr::from_ptr(prop.gcnArchName.as_ptr())
                .to_string_lossy()
                .into_owned();
            let (mut a, mut b) = (0, 0);
            if hip::hiprtcVersion(&mut a, &mut b) != hip::hiprtcResult_HIPRTC_SUCCESS {
                bail!("HIP: hipRTC does not answer hiprtcVersion");
            }
            Ok(HipRt {
                device,
                name,
                arch,
                warp: prop.warpSize.max(1) as u32,
                sms: prop.multiProcessorCount.max(1) as u32,
                hiprtc: (a, b),
                modules: Mutex::new(Vec::new()),
            })
        }
    }
}

impl Drop for HipRt {
    fn drop(&mut self) {
        // SAFETY: our modules; nothing uses them after this.
        unsafe {
            let _ = hip::hipSetDevice(self.device);
            let _ = hip::hipDeviceSynchronize();
            if let Ok(mods) = self.modules.lock() {
                for &m in mods.iter() {
                    let _ = hip::hipModuleUnload(m);
                }
            }
        }
    }
}

/// A kernel handle (`hipFunction_t`).
#[derive(Clone, Copy)]
pub struct HipFunction(hip::hipFunction_t);
// SAFETY: an immutable handle into a loaded module.
unsafe impl Send for HipFunction {}
unsafe impl Sync for HipFunction {}

impl GpuRuntime for HipRt {
    type Function = HipFunction;
    const API: &'static str = "hip";
    const DIALECT: Dialect = Dialect::Hip;

    fn open(device: usize) -> Result<Self> {
        Self::open_device(device)
    }
    fn device_count() -> Result<usize> {
        std::panic::catch_unwind(device_count)
            .map_err(|_| anyhow!("HIP: the ROCm runtime libraries failed to load"))?
    }
    fn ccl_library() -> Option<CclLibrary> {
        let files = match std::env::var("PAGODA_RCCL_LIBRARY") {
            Ok(f) if !f.is_empty() => vec![f],
            _ => vec!["librccl.so.1".into(), "librccl.so".into()],
        };
        Some(CclLibrary {
            name: "RCCL",
            files,
            hint: "install RCCL (ROCm's rccl package) and add its lib folder to \
                   LD_LIBRARY_PATH, or name the file in PAGODA_RCCL_LIBRARY",
        })
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }
    fn arch(&self) -> String {
        self.arch.clone()
    }
    fn warp_size(&self) -> u32 {
        self.warp
    }
    fn multiprocessors(&self) -> u32 {
        self.sms
    }
    fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        ck(
            unsafe { hip::hipMemGetInfo(&mut free, &mut total) },
            "hipMemGetInfo",
        )?;
        Ok((free as u64, total as u64))
    }
    fn bind(&self) -> Result<()> {
        // SAFETY: a device index that hipGetDeviceCount reported.
        ck(unsafe { hip::hipSetDevice(self.device) }, "hipSetDevice")
    }
    fn malloc(&self, bytes: usize) -> Result<u64> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        ck(unsafe { hip::hipMalloc(&mut p, bytes.max(1)) }, "hipMalloc")?;
        Ok(p as u64)
    }
    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller hands over a pointer from malloc.
        let _ = unsafe { hip::hipFree(ptr as *mut c_void) };
    }
    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller guarantees the range; the default stream keeps it in order.
        ck(
            unsafe { hip::hipMemsetAsync(ptr as *mut c_void, 0, bytes, std::ptr::null_mut()) },
            "hipMemsetAsync",
        )
    }
    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        ck(
            unsafe {
                hip::hipMemcpyHtoD(dst as *mut c_void, src.as_ptr() as *const c_void, src.len())
            },
            "hipMemcpyHtoD",
        )
    }
    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        ck(
            unsafe {
                hip::hipMemcpyDtoH(
                    dst.as_mut_ptr() as *mut c_void,
                    src as *mut c_void,
                    dst.len(),
                )
            },
            "hipMemcpyDtoH",
        )
    }
    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments.
        ck(
            unsafe { hip::hipDeviceSynchronize() },
            "hipDeviceSynchronize",
        )
    }
    fn compiler_id(&self) -> String {
        format!("hiprtc {}.{}", self.hiprtc.0, self.hiprtc.1)
    }
    fn binary_ext(&self) -> &'static str {
        "hsaco"
    }
    fn compile_options(&self) -> Vec<String> {
        vec![
            format!("--offload-arch={}", self.arch),
            "-O3".into(),
            "-std=c++17".into(),
            format!("-DPG_WARP_SIZE={}", self.warp),
        ]
    }
    fn compile(&self, name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
        let src = CString::new(source).context("kernel source has a NUL byte")?;
        let cname = CString::new(name)?;
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<std::result::Result<_, _>>()?;
        let mut opt_ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: standard hipRTC call sequence; every pointer outlives the program.
        unsafe {
            let mut prog: hip::hiprtcProgram = std::ptr::null_mut();
            let r = hip::hiprtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            if r != hip::hiprtcResult_HIPRTC_SUCCESS {
                bail!("hiprtcCreateProgram: {r}");
            }
            let r = hip::hiprtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_mut_ptr());
            let mut log_size = 0usize;
            hip::hiprtcGetProgramLogSize(prog, &mut log_size);
            let mut log = vec![0u8; log_size.max(1)];
            hip::hiprtcGetProgramLog(prog, log.as_mut_ptr() as *mut _);
            let log = String::from_utf8_lossy(&log[..log_size.saturating_sub(1)]).into_owned();
            let out = if r != hip::hiprtcResult_HIPRTC_SUCCESS {
                Err(anyhow!("hipRTC could not compile {name} ({r}):\n{log}"))
            } else {
                let mut size = 0usize;
                hip::hiprtcGetCodeSize(prog, &mut size);
                let mut bin = vec![0u8; size];
                if size == 0
                    || hip::hiprtcGetCode(prog, bin.as_mut_ptr() as *mut _)
                        != hip::hiprtcResult_HIPRTC_SUCCESS
                {
                    Err(anyhow!("hipRTC produced no code object for {name}"))
                } else {
                    Ok(bin)
                }
            };
            hip::hiprtcDestroyProgram(&mut prog);
            out
        }
    }
    fn load(&self, image: &[u8], names: &[String]) -> Result<Vec<HipFunction>> {
        self.bind()?;
        let mut module: hip::hipModule_t = std::ptr::null_mut();
        // SAFETY: a complete code object.
        ck(
            unsafe { hip::hipModuleLoadData(&mut module, image.as_ptr() as *const c_void) },
            "hipModuleLoadData",
        )?;
        self.modules.lock().unwrap().push(module);
        names
            .iter()
            .map(|n| {
                let cn = CString::new(n.as_str())?;
                let mut f: hip::hipFunction_t = std::ptr::null_mut();
                // SAFETY: a loaded module and a valid out-pointer.
                ck(
                    unsafe { hip::hipModuleGetFunction(&mut f, module, cn.as_ptr()) },
                    &format!("hipModuleGetFunction({n})"),
                )?;
                Ok(HipFunction(f))
            })
            .collect()
    }
    unsafe fn launch(
        &self,
        f: HipFunction,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        ck(
            unsafe {
                hip::hipModuleLaunchKernel(
                    f.0,
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    shared_bytes,
                    std::ptr::null_mut(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "hipModuleLaunchKernel",
        )
    }
}
