//! The `emu` backend: the CUDA kernels of `kernels/` run on the CPU, under the same
//! [`GpuBackend`] as CUDA and HIP. `kernels/emu.h` emulates the GPU's execution model in C++
//! (a block's threads as fibers switched at barriers, warps, shuffles, shared memory); each
//! kernel file is compiled by the host's C++ compiler into a shared library, loaded with
//! `dlopen`, and launched by name through a small wrapper per kernel.
//!
//! It exists so that kernels and the host code around them (launch geometry, buffer sizes,
//! split-K plans, batch layouts) are checked against the CPU reference on machines without a
//! GPU, in CI. It is slow (a fiber switch per thread per barrier) and says nothing about speed.
//!
//! Settings: `PAGODA_EMU_CXX` (the compiler, default `c++`), `PAGODA_EMU_WARP` (32, or 64 to
//! run the kernels as on AMD's 64-wide wavefronts), `PAGODA_EMU_THREADS` (OS threads running
//! blocks, default all cores), `PAGODA_EMU_MEMORY` (the device memory it reports, in MiB,
//! default 4096), `PAGODA_EMU_DEVICES` (how many devices it shows for tensor and pipeline
//! parallelism, default 8, each with its own memory), `PAGODA_EMU_CCL` (a library with NCCL's
//! API for their collectives; without it they go through the host), `PAGODA_EMU_ORDER` (the
//! order a block's threads run in between barriers: `forward`, the default, `reverse` or
//! `random:SEED`, shuffled per block and barrier; a kernel that reads another thread's write
//! without a barrier gives results that depend on it).

use super::kernels::Dialect;
use super::{CclLibrary, Elem, GemmEx, GpuBackend, GpuRuntime};
use anyhow::{Context, Result, anyhow, bail, ensure};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The emulator backend: [`GpuBackend`] over [`EmuRt`].
pub type EmuBackend = GpuBackend<EmuRt>;

impl GpuBackend<EmuRt> {
    /// Compiles the kernels with the host's C++ compiler (or takes them from the kernel cache).
    /// Fails with a clear error where there is no C++ compiler.
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }
}

/// `int pg_emu_launch_<kernel>(void** args, const unsigned grid[3], const unsigned block[3],
/// unsigned shared_bytes, char* err, unsigned err_len)`: 0, or 1 with a message in `err`.
type LaunchFn =
    unsafe extern "C" fn(*mut *mut c_void, *const u32, *const u32, u32, *mut c_char, u32) -> i32;

#[derive(Clone, Copy)]
pub struct EmuFunction(LaunchFn);

pub struct EmuRt {
    cxx: String,
    cxx_version: String,
    warp: u32,
    memory: u64,
    order: ThreadOrder,
    fp_contract: bool,
    blas: bool,
    allocated: AtomicU64,
    /// Live allocations: pointer to layout, for `free`.
    allocations: Mutex<HashMap<u64, std::alloc::Layout>>,
    /// `dlopen` handles, kept open for the runtime's lifetime.
    libraries: Mutex<Vec<usize>>,
}

/// What the emulator is asked to be; [`EmuOptions::from_env`] reads the settings above.
#[derive(Debug, Clone)]
pub struct EmuOptions {
    pub cxx: String,
    /// Lanes per warp: 32 (NVIDIA) or 64 (AMD's wavefronts).
    pub warp: u32,
    /// Bytes of device memory reported and allowed.
    pub memory: u64,
    /// The order of a block's threads between barriers.
    pub order: ThreadOrder,
    /// Multiplies and adds contracted to FMAs by the host compiler, as NVRTC and hipcc do by
    /// default (`PAGODA_EMU_FP_CONTRACT=fast`); off by default, so that results are the
    /// host's plain IEEE operations.
    pub fp_contract: bool,
    /// Matrix products through [`GpuRuntime::gemm_ex`], a reference with cuBLAS's contract,
    /// so that the host code of the vendor-BLAS path runs (`PAGODA_EMU_BLAS=1`); off by
    /// default, so that the GEMM kernels run.
    pub blas: bool,
}

/// The order in which the emulator runs a block's threads between two barriers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadOrder {
    Forward,
    Reverse,
    /// Shuffled per block and per barrier, from this seed.
    Random(u64),
}

impl ThreadOrder {
    /// `forward`, `reverse` or `random:SEED`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "forward" => ThreadOrder::Forward,
            "reverse" => ThreadOrder::Reverse,
            _ => match s.strip_prefix("random:").map(str::parse) {
                Some(Ok(seed)) => ThreadOrder::Random(seed),
                _ => bail!("PAGODA_EMU_ORDER={s}: expected forward, reverse or random:SEED"),
            },
        })
    }

    /// The C++ defines that select it.
    fn defines(self) -> [String; 2] {
        let (order, seed) = match self {
            ThreadOrder::Forward => (0, 0),
            ThreadOrder::Reverse => (1, 0),
            ThreadOrder::Random(s) => (2, s),
        };
        [
            format!("-DPG_EMU_ORDER={order}"),
            format!("-DPG_EMU_SEED={seed}ULL"),
        ]
    }
}

impl std::fmt::Display for ThreadOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ThreadOrder::Forward => write!(f, "forward"),
            ThreadOrder::Reverse => write!(f, "reverse"),
            ThreadOrder::Random(s) => write!(f, "random:{s}"),
        }
    }
}

impl EmuOptions {
    pub fn from_env() -> Result<Self> {
        let warp = match std::env::var("PAGODA_EMU_WARP").as_deref() {
            Err(_) => 32,
            Ok(w) => w
                .parse()
                .ok()
                .filter(|w| [32, 64].contains(w))
                .with_context(|| format!("PAGODA_EMU_WARP={w}: expected 32 or 64"))?,
        };
        let memory = match std::env::var("PAGODA_EMU_MEMORY") {
            Err(_) => 4096 << 20,
            Ok(m) => {
                m.parse::<u64>()
                    .ok()
                    .filter(|&m| m > 0 && m < 1 << 24)
                    .with_context(|| format!("PAGODA_EMU_MEMORY={m}: expected MiB"))?
                    << 20
            }
        };
        let order = match std::env::var("PAGODA_EMU_ORDER") {
            Err(_) => ThreadOrder::Forward,
            Ok(o) => ThreadOrder::parse(&o)?,
        };
        let fp_contract = match std::env::var("PAGODA_EMU_FP_CONTRACT").as_deref() {
            Err(_) | Ok("off") => false,
            Ok("fast") => true,
            Ok(c) => bail!("PAGODA_EMU_FP_CONTRACT={c}: expected fast or off"),
        };
        let blas = match std::env::var("PAGODA_EMU_BLAS").as_deref() {
            Err(_) | Ok("0") => false,
            Ok("1") => true,
            Ok(b) => bail!("PAGODA_EMU_BLAS={b}: expected 1 or 0"),
        };
        Ok(EmuOptions {
            cxx: std::env::var("PAGODA_EMU_CXX").unwrap_or_else(|_| "c++".into()),
            warp,
            memory,
            order,
            fp_contract,
            blas,
        })
    }
}

impl EmuRt {
    pub fn open() -> Result<Self> {
        Self::with_options(EmuOptions::from_env()?)
    }

    pub fn with_options(o: EmuOptions) -> Result<Self> {
        ensure!(
            [32, 64].contains(&o.warp),
            "emu: a warp of {} lanes (32 or 64)",
            o.warp
        );
        #[cfg(target_arch = "x86_64")]
        ensure!(
            !o.fp_contract || std::arch::is_x86_feature_detected!("fma"),
            "emu: PAGODA_EMU_FP_CONTRACT=fast needs a CPU with FMA instructions"
        );
        let cxx = o.cxx;
        let out = Command::new(&cxx).arg("--version").output().with_context(|| {
            format!(
                "emu: the C++ compiler `{cxx}` does not run (install g++ or clang++, or set PAGODA_EMU_CXX)"
            )
        })?;
        ensure!(
            out.status.success(),
            "emu: `{cxx} --version` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let cxx_version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();
        Ok(EmuRt {
            cxx,
            cxx_version,
            warp: o.warp,
            memory: o.memory,
            order: o.order,
            fp_contract: o.fp_contract,
            blas: o.blas,
            allocated: AtomicU64::new(0),
            allocations: Mutex::new(HashMap::new()),
            libraries: Mutex::new(Vec::new()),
        })
    }
}

impl Drop for EmuRt {
    fn drop(&mut self) {
        // NOTE: the libraries stay loaded: their thread-local shared arrays may still be
        // referenced by exiting threads' destructors, and unloading gains nothing here.
        let allocs = std::mem::take(&mut *self.allocations.lock().unwrap());
        for (p, layout) in allocs {
            // SAFETY: allocated in `malloc` with this layout and not freed.
            unsafe { std::alloc::dealloc(p as *mut u8, layout) };
        }
    }
}

/// A path for a temporary file, unique in this process.
fn temp_path(ext: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "pagoda-emu-{}-{}.{ext}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

impl GpuRuntime for EmuRt {
    type Function = EmuFunction;
    const API: &'static str = "emu";
    const DIALECT: Dialect = Dialect::Emu;

    fn open(_device: usize) -> Result<Self> {
        // NOTE: every emulated device is its own: memory, kernels, allocation count.
        Self::open()
    }
    fn device_count() -> Result<usize> {
        match std::env::var("PAGODA_EMU_DEVICES") {
            Err(_) => Ok(8),
            Ok(n) => n
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("PAGODA_EMU_DEVICES={n}: expected a count")),
        }
    }
    fn ccl_library() -> Option<CclLibrary> {
        // NOTE: there is no collective library for the emulator's devices: their buffers go
        // through the host unless a library with NCCL's API is named (the tests build one on
        // host memory, to check the NCCL binding's calls).
        let f = std::env::var("PAGODA_EMU_CCL")
            .ok()
            .filter(|f| !f.is_empty())?;
        Some(CclLibrary {
            name: "the collective library of PAGODA_EMU_CCL",
            files: vec![f],
            hint: "PAGODA_EMU_CCL must name a library with NCCL's API",
        })
    }

    fn device_name(&self) -> String {
        format!(
            "kernels emulated on the CPU, warp={} order={} fp-contract={} blas={}",
            self.warp,
            self.order,
            if self.fp_contract { "fast" } else { "off" },
            if self.blas { "on" } else { "off" }
        )
    }
    fn arch(&self) -> String {
        format!("emu-w{}", self.warp)
    }
    fn warp_size(&self) -> u32 {
        self.warp
    }
    fn tensor_cores(&self) -> bool {
        // NOTE: the fragments of mma.sync are laid out over 32 lanes.
        self.warp == 32
    }
    fn multiprocessors(&self) -> u32 {
        // NOTE: as many as a small GPU, so that launch plans split work as they would there.
        16
    }
    fn mem_info(&self) -> Result<(u64, u64)> {
        let used = self.allocated.load(Ordering::Relaxed);
        Ok((self.memory.saturating_sub(used), self.memory))
    }
    fn bind(&self) -> Result<()> {
        Ok(())
    }
    fn malloc(&self, bytes: usize) -> Result<u64> {
        let used = self.allocated.load(Ordering::Relaxed);
        ensure!(
            used + bytes as u64 <= self.memory,
            "emu: out of device memory ({} MiB of {} MiB in use)",
            used >> 20,
            self.memory >> 20
        );
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), 256)?;
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        ensure!(!p.is_null(), "emu: host allocation of {bytes} bytes failed");
        // NOTE: fresh device memory is not zeroed on a GPU; NaNs show reads of what nothing
        // wrote.
        // SAFETY: `p` holds `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0xff, bytes) };
        self.allocated.fetch_add(bytes as u64, Ordering::Relaxed);
        self.allocations.lock().unwrap().insert(p as u64, layout);
        Ok(p as u64)
    }
    unsafe fn free(&self, ptr: u64) {
        if let Some(layout) = self.allocations.lock().unwrap().remove(&ptr) {
            self.allocated
                .fetch_sub(layout.size() as u64, Ordering::Relaxed);
            // SAFETY: allocated in `malloc` with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }
    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(())
    }
    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    unsafe fn fill_uninit(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller guarantees the range.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0xff, bytes) };
        Ok(())
    }
    fn compiler_id(&self) -> String {
        format!("{} ({})", self.cxx, self.cxx_version)
    }
    fn binary_ext(&self) -> &'static str {
        "so"
    }
    fn compile_options(&self) -> Vec<String> {
        // NOTE: with contraction on (as NVRTC's default), x86-64 needs FMA instructions for it
        // to happen, and emu.h keeps the explicitly rounded operations (__fmul_rn, ...) out of
        // it, as the GPU does; off (GCC's default on aarch64 is on), every product and sum is
        // rounded on its own.
        let contract: &[&str] = match (self.fp_contract, cfg!(target_arch = "x86_64")) {
            (false, _) => &["-ffp-contract=off"],
            (true, true) => &["-ffp-contract=fast", "-mfma", "-DPG_EMU_CONTRACT=1"],
            (true, false) => &["-ffp-contract=fast", "-DPG_EMU_CONTRACT=1"],
        };
        [
            "-O2",
            "-std=c++17",
            "-fPIC",
            "-shared",
            "-pthread",
            "-U_FORTIFY_SOURCE",
            "-w",
        ]
        .iter()
        .chain(contract)
        .map(|s| s.to_string())
        .chain([format!("-DPG_WARP_SIZE={}", self.warp)])
        .chain(self.order.defines())
        .chain(
            self.tensor_cores()
                .then(|| super::kernels::TENSOR_CORES_DEFINE.to_string()),
        )
        .collect()
    }
    fn compile(&self, name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
        let (cpp, so) = (temp_path("cpp"), temp_path("so"));
        std::fs::write(&cpp, source)?;
        let out = Command::new(&self.cxx)
            .args(options)
            .arg("-o")
            .arg(&so)
            .arg(&cpp)
            .output()
            .with_context(|| format!("emu: running {}", self.cxx));
        let _ = std::fs::remove_file(&cpp);
        let out = out?;
        if !out.status.success() {
            let _ = std::fs::remove_file(&so);
            bail!(
                "emu: {} could not compile {name}:\n{}",
                self.cxx,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let bin = std::fs::read(&so);
        let _ = std::fs::remove_file(&so);
        Ok(bin?)
    }
    fn load(&self, image: &[u8], names: &[String]) -> Result<Vec<EmuFunction>> {
        let path = temp_path("so");
        std::fs::write(&path, image)?;
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())?;
        // SAFETY: a shared library we compiled; RTLD_LOCAL keeps its symbols to itself.
        let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let _ = std::fs::remove_file(&path);
        if handle.is_null() {
            // SAFETY: dlerror returns a C string or null.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                "unknown error".to_string()
            } else {
                // SAFETY: non-null, NUL-terminated.
                unsafe { CStr::from_ptr(why) }
                    .to_string_lossy()
                    .into_owned()
            };
            bail!("emu: dlopen failed: {why}");
        }
        self.libraries.lock().unwrap().push(handle as usize);
        names
            .iter()
            .map(|n| {
                let sym = CString::new(format!("pg_emu_launch_{n}"))?;
                // SAFETY: a loaded library and a NUL-terminated name.
                let f = unsafe { libc::dlsym(handle, sym.as_ptr()) };
                if f.is_null() {
                    bail!("emu: no kernel named {n}");
                }
                // SAFETY: the wrapper generated in `compile` has exactly this signature.
                Ok(EmuFunction(unsafe {
                    std::mem::transmute::<*mut c_void, LaunchFn>(f)
                }))
            })
            .collect()
    }
    unsafe fn launch(
        &self,
        f: EmuFunction,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let mut err = vec![0u8; 512];
        // SAFETY: forwarded from the caller's contract; the launch is synchronous, so `args`
        // outlive it.
        let rc = unsafe {
            (f.0)(
                args.as_mut_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                err.as_mut_ptr() as *mut c_char,
                err.len() as u32,
            )
        };
        if rc != 0 {
            let msg = CStr::from_bytes_until_nul(&err)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            return Err(anyhow!("emu: {msg}"));
        }
        Ok(())
    }
    fn has_blas(&self) -> bool {
        self.blas
    }
    unsafe fn gemm_ex(&self, g: &GemmEx) -> Result<()> {
        use rayon::prelude::*;
        ensure!(
            self.blas,
            "emu: no vendor GEMM (PAGODA_EMU_BLAS=1 emulates cuBLAS's)"
        );
        g.check()?;
        let at = |p: u64, i: usize| -> f32 {
            // SAFETY: the caller's contract: the operands hold every element their shapes and
            // leading dimensions reach, in this (host) memory.
            unsafe {
                match g.ab {
                    Elem::F32 => *(p as *const f32).add(i),
                    Elem::F16 => half::f16::from_bits(*(p as *const u16).add(i)).to_f32(),
                    _ => half::bf16::from_bits(*(p as *const u16).add(i)).to_f32(),
                }
            }
        };
        // Element (r, c) of op(M), M column-major with leading dimension ld.
        let op_at = |trans: bool, r: usize, c: usize, ld: usize| {
            if trans { c + r * ld } else { r + c * ld }
        };
        let c = g.c as usize;
        // NOTE: each column of C on its own task, its elements' products summed in k order with
        // FMAs; cuBLAS's order is its own, which the tolerances cover.
        (0..g.n).into_par_iter().for_each(|j| {
            for i in 0..g.m {
                let mut s = 0f32;
                for l in 0..g.k {
                    let a = at(g.a, op_at(g.trans_a, i, l, g.lda));
                    let b = at(g.b, op_at(g.trans_b, l, j, g.ldb));
                    s = a.mul_add(b, s);
                }
                // SAFETY: as above; each task writes its own column j.
                unsafe {
                    let y = (c as *mut f32).add(i + j * g.ldc);
                    *y = if g.beta == 0.0 {
                        g.alpha * s
                    } else {
                        g.alpha.mul_add(s, g.beta * *y)
                    };
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel that reads its neighbour's shared-memory write without a barrier: in index
    /// order the neighbour (a lower index) has always written first, so the race is hidden;
    /// in reverse or shuffled order it is not. And a launch over 48 KiB of dynamic shared
    /// memory is refused, as a GPU refuses it without an opt-in.
    #[test]
    fn thread_orders_expose_a_missing_barrier_and_launch_limits_hold() {
        let src = r#"#include "common.cuh"
extern "C" __global__ void racy(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = 1.0f + threadIdx.x;
    // NOTE: deliberately no __syncthreads() here
    out[threadIdx.x] = threadIdx.x > 0 ? s[threadIdx.x - 1] : 0.0f;
}
extern "C" int pg_emu_launch_racy(void** a, const unsigned* g, const unsigned* b, unsigned s,
                                  char* e, unsigned n) { return pg_emu::launch(&racy, a, g, b, s, e, n); }
"#;
        let src = super::super::kernels::prepare("racy", src, Dialect::Emu, false);
        let run = |order: ThreadOrder, shared: u32| -> Result<Vec<f32>> {
            let rt = EmuRt::with_options(EmuOptions {
                order,
                ..EmuOptions::from_env()?
            })?;
            let image = rt.compile("racy", &src, &rt.compile_options())?;
            let f = rt.load(&image, &["racy".to_string()])?.remove(0);
            let out = rt.malloc(64 * 4)?;
            let mut p = out;
            let mut args = [&mut p as *mut u64 as *mut c_void];
            // SAFETY: one pointer argument, to 64 floats of this runtime's memory.
            let launched = unsafe { rt.launch(f, [1, 1, 1], [64, 1, 1], shared, &mut args) };
            let mut bytes = vec![0u8; 64 * 4];
            // SAFETY: the 64 floats above.
            unsafe { rt.dtoh(&mut bytes, out)? };
            // SAFETY: allocated above, not used afterwards.
            unsafe { rt.free(out) };
            launched?;
            Ok(bytes
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect())
        };
        let right: Vec<f32> = (0..64).map(|i| i as f32).collect();
        assert_eq!(run(ThreadOrder::Forward, 0).unwrap(), right);
        assert_ne!(run(ThreadOrder::Reverse, 0).unwrap(), right);
        assert_ne!(run(ThreadOrder::Random(1), 0).unwrap(), right);
        assert!(run(ThreadOrder::Forward, 48 << 10).is_ok());
        let e = run(ThreadOrder::Forward, (48 << 10) + 16).unwrap_err();
        assert!(format!("{e:#}").contains("48 KiB"), "{e:#}");
        assert_eq!(
            ThreadOrder::parse("random:12").unwrap(),
            ThreadOrder::Random(12)
        );
        assert!(ThreadOrder::parse("sideways").is_err());
    }

    /// With `fp_contract` a product and a sum fuse into one FMA, as NVRTC compiles them, and an
    /// explicitly rounded product (`__fmul_rn`) still does not; without, neither does.
    #[test]
    fn fp_contract_fuses_plain_products_only() {
        let src = r#"#include "common.cuh"
extern "C" __global__ void fused(const float* in, float* out) {
    const float a = in[0], c = in[1];
    if (threadIdx.x == 0) out[0] = a * a - c;
    else out[1] = __fmul_rn(a, a) - c;
}
extern "C" int pg_emu_launch_fused(void** a, const unsigned* g, const unsigned* b, unsigned s,
                                   char* e, unsigned n) { return pg_emu::launch(&fused, a, g, b, s, e, n); }
"#;
        let src = super::super::kernels::prepare("fused", src, Dialect::Emu, false);
        // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: rounded to f32 it is 1 + 2^-11 (a tie, to even).
        let a = 1.0 + (-12f32).exp2();
        let c = 1.0 + (-11f32).exp2();
        let run = |fp_contract: bool| -> [f32; 2] {
            let rt = EmuRt::with_options(EmuOptions {
                fp_contract,
                ..EmuOptions::from_env().unwrap()
            })
            .unwrap();
            let image = rt.compile("fused", &src, &rt.compile_options()).unwrap();
            let f = rt.load(&image, &["fused".to_string()]).unwrap().remove(0);
            let (input, out) = (rt.malloc(8).unwrap(), rt.malloc(8).unwrap());
            let mut bytes = [a.to_le_bytes(), c.to_le_bytes()].concat();
            // SAFETY: 8 bytes each, allocated above; the kernel's 2 threads read 2 floats and
            // write one each.
            unsafe {
                rt.htod(input, &bytes).unwrap();
                let (mut i, mut o) = (input, out);
                let mut args = [
                    &mut i as *mut u64 as *mut c_void,
                    &mut o as *mut u64 as *mut c_void,
                ];
                rt.launch(f, [1, 1, 1], [2, 1, 1], 0, &mut args).unwrap();
                rt.dtoh(&mut bytes, out).unwrap();
                rt.free(input);
                rt.free(out);
            }
            let v = |i: usize| f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
            [v(0), v(1)]
        };
        assert_eq!(run(false), [0.0, 0.0]);
        assert_eq!(run(true), [(-24f32).exp2(), 0.0]);
    }

    /// The emulated `gemm_ex` keeps cuBLAS's contract: column-major operands, either
    /// transposed, leading dimensions longer than the rows, alpha and beta, half operands; and
    /// `GemmEx::linear` is the row-major `x · wᵀ` of a linear layer.
    #[test]
    fn emulated_gemm_ex_keeps_cublas_contract() {
        let rt = EmuRt::with_options(EmuOptions {
            blas: true,
            ..EmuOptions::from_env().unwrap()
        })
        .unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect()
        };
        let upload = |v: &[f32], ab: Elem| -> u64 {
            let bytes: Vec<u8> = match ab {
                Elem::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                _ => v
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            let p = rt.malloc(bytes.len()).unwrap();
            // SAFETY: allocated above with these bytes' length.
            unsafe { rt.htod(p, &bytes).unwrap() };
            p
        };
        let (m, n, k) = (5, 7, 9);
        for ab in [Elem::F32, Elem::BF16] {
            let q = |x: f32| match ab {
                Elem::F32 => x as f64,
                _ => half::bf16::from_f32(x).to_f32() as f64,
            };
            for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
                // Stored rows and leading dimensions 3 longer than needed.
                let (ra, ca) = if trans_a { (k, m) } else { (m, k) };
                let (rb, cb) = if trans_b { (n, k) } else { (k, n) };
                let (lda, ldb, ldc) = (ra + 3, rb + 3, m + 3);
                let (av, bv, cv) = (rand(lda * ca), rand(ldb * cb), rand(ldc * n));
                let (a, b) = (upload(&av, ab), upload(&bv, ab));
                let c = upload(&cv, Elem::F32);
                let g = GemmEx {
                    trans_a,
                    trans_b,
                    m,
                    n,
                    k,
                    alpha: 0.5,
                    a,
                    lda,
                    b,
                    ldb,
                    beta: 2.0,
                    c,
                    ldc,
                    ab,
                };
                let mut out = vec![0u8; 4 * ldc * n];
                // SAFETY: the operands above, of the sizes their shapes reach.
                unsafe {
                    rt.gemm_ex(&g).unwrap();
                    rt.dtoh(&mut out, c).unwrap();
                }
                let got = |i: usize| f32::from_le_bytes(out[4 * i..4 * i + 4].try_into().unwrap());
                for j in 0..n {
                    for i in 0..m {
                        let dot: f64 = (0..k)
                            .map(|l| {
                                let x = if trans_a {
                                    av[l + i * lda]
                                } else {
                                    av[i + l * lda]
                                };
                                let y = if trans_b {
                                    bv[j + l * ldb]
                                } else {
                                    bv[l + j * ldb]
                                };
                                q(x) * q(y)
                            })
                            .sum();
                        let want = 0.5 * dot + 2.0 * cv[i + j * ldc] as f64;
                        let e = (got(i + j * ldc) as f64 - want).abs();
                        assert!(e < 1e-5 * want.abs().max(1.0), "{ab:?} {trans_a} {trans_b}");
                    }
                    // The rows past m of each column are not C's and stay as they were.
                    for i in m..ldc {
                        assert_eq!(got(i + j * ldc), cv[i + j * ldc]);
                    }
                }
                assert!(
                    GemmEx { lda: ra - 1, ..g }.check().is_err(),
                    "a short leading dimension is refused"
                );
            }
        }
        // A linear layer: y[m, n] = x[m, k] · w[n, k]ᵀ, row-major.
        let (x, w) = (rand(m * k), rand(n * k));
        let (xp, wp, yp) = (
            upload(&x, Elem::F32),
            upload(&w, Elem::F32),
            rt.malloc(4 * m * n).unwrap(),
        );
        let mut out = vec![0u8; 4 * m * n];
        // SAFETY: the sizes above.
        unsafe {
            rt.gemm_ex(&GemmEx::linear(Elem::F32, m, n, k, xp, wp, yp))
                .unwrap();
            rt.dtoh(&mut out, yp).unwrap();
        }
        for r in 0..m {
            for col in 0..n {
                let want: f64 = (0..k)
                    .map(|l| x[r * k + l] as f64 * w[col * k + l] as f64)
                    .sum();
                let got = f32::from_le_bytes(out[4 * (r * n + col)..][..4].try_into().unwrap());
                assert!((got as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
            }
        }
    }

    /// Two halves of a warp at two different shuffles would pair up silently; they are a
    /// fault, as is a shuffle whose mask names a lane that has exited. One shuffle for the
    /// whole warp runs.
    #[test]
    fn divergent_shuffles_are_errors() {
        let src = r#"#include "common.cuh"
extern "C" __global__ void shuffles(unsigned mode, float* out) {
    float v = (float)threadIdx.x;
    if (mode == 1 && threadIdx.x >= 16) return;
    if (mode == 2 && threadIdx.x < 16) v = PG_SHFL_XOR(v, 1);
    else v = PG_SHFL_XOR(v, 1);
    out[threadIdx.x] = v;
}
extern "C" int pg_emu_launch_shuffles(void** a, const unsigned* g, const unsigned* b, unsigned s,
                                      char* e, unsigned n) { return pg_emu::launch(&shuffles, a, g, b, s, e, n); }
"#;
        let src = super::super::kernels::prepare("shuffles", src, Dialect::Emu, false);
        let rt = EmuRt::with_options(EmuOptions {
            warp: 32,
            ..EmuOptions::from_env().unwrap()
        })
        .unwrap();
        let image = rt.compile("shuffles", &src, &rt.compile_options()).unwrap();
        let f = rt
            .load(&image, &["shuffles".to_string()])
            .unwrap()
            .remove(0);
        let out = rt.malloc(32 * 4).unwrap();
        let run = |mode: u32| {
            let (mut mode, mut o) = (mode, out);
            let mut args = [
                &mut mode as *mut u32 as *mut c_void,
                &mut o as *mut u64 as *mut c_void,
            ];
            // SAFETY: the kernel's two arguments; it writes at most 32 floats.
            unsafe { rt.launch(f, [1, 1, 1], [32, 1, 1], 0, &mut args) }
        };
        run(0).unwrap();
        let e = format!("{:#}", run(1).unwrap_err());
        assert!(
            e.contains("divergent shuffle") && e.contains("exited"),
            "{e}"
        );
        let e = format!("{:#}", run(2).unwrap_err());
        assert!(
            e.contains("divergent shuffle") && e.contains("at line"),
            "{e}"
        );
        // SAFETY: allocated above, not used afterwards.
        unsafe { rt.free(out) };
    }

    /// A 16-byte load from an address 8 bytes past a 16-byte boundary stops the launch with an
    /// error, as a GPU stops it; the same load from a boundary runs.
    #[test]
    fn misaligned_vector_loads_are_errors() {
        let src = r#"#include "common.cuh"
extern "C" __global__ void load16(const unsigned char* in, unsigned off, unsigned* out) {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(in + off));
    out[threadIdx.x] = w.x + w.w;
}
extern "C" int pg_emu_launch_load16(void** a, const unsigned* g, const unsigned* b, unsigned s,
                                    char* e, unsigned n) { return pg_emu::launch(&load16, a, g, b, s, e, n); }
"#;
        let src = super::super::kernels::prepare("load16", src, Dialect::Emu, false);
        let rt = EmuRt::open().unwrap();
        let image = rt.compile("load16", &src, &rt.compile_options()).unwrap();
        let f = rt.load(&image, &["load16".to_string()]).unwrap().remove(0);
        let (input, out) = (rt.malloc(64).unwrap(), rt.malloc(4 * 4).unwrap());
        let run = |off: u32| {
            let (mut i, mut o, mut off) = (input, out, off);
            let mut args = [
                &mut i as *mut u64 as *mut c_void,
                &mut off as *mut u32 as *mut c_void,
                &mut o as *mut u64 as *mut c_void,
            ];
            // SAFETY: the kernel's three arguments; it reads 16 bytes at `off` <= 32 of the 64
            // and writes 4 words.
            unsafe { rt.launch(f, [1, 1, 1], [4, 1, 1], 0, &mut args) }
        };
        assert!(run(16).is_ok());
        let e = run(8).unwrap_err();
        assert!(
            format!("{e:#}").contains("misaligned 16-byte load"),
            "{e:#}"
        );
        // SAFETY: allocated above, not used afterwards.
        unsafe {
            rt.free(input);
            rt.free(out);
        }
    }
}
