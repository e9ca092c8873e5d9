//! Collectives between GPUs through NCCL (CUDA) or RCCL (HIP): device buffers go from device to
//! device, never through the host. Both libraries are loaded at run time, so the crate builds
//! and starts without them; a missing library is an error that names it, raised before any
//! weight is loaded.
//!
//! NOTE: NCCL and RCCL export the same C API (RCCL is AMD's port of NCCL, with the same names,
//! enum values and structs), so one binding of the dozen entry points we use serves both;
//! cudarc's NCCL binding would cover NCCL only, and it panics when the library is missing.
//! The binding is also what `--backend emu` runs when `PAGODA_EMU_CCL` names a library with
//! this API (the tests build a host-memory one), so that the calls and their sizes are checked
//! without a GPU.
//!
//! Every collective is queued on the device's default stream, where the runtime queues its
//! kernels, so it is ordered after the kernels that wrote its input and before those that read
//! its output, with no host synchronisation.

use super::comm::Communicator;
use super::{DeviceGroups, GroupControl, MultiDevice, ParallelConfig};
use crate::backend::Backend;
use crate::backend::gpu::{GpuBackend, GpuBuf, GpuRuntime};
use anyhow::{Context, Result, bail};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

type Comm = *mut c_void;
type Res = c_int;
const NCCL_SUCCESS: Res = 0;
/// `ncclFloat32` and `ncclSum` (the same values in NCCL and RCCL).
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> Res;
type GetErrorString = unsafe extern "C" fn(Res) -> *const c_char;
type CommInitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Res;
type CommFree = unsafe extern "C" fn(Comm) -> Res;
/// `ncclAllReduce(send, recv, count, type, op, comm, stream)`.
type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> Res;
/// `ncclAllGather(send, recv, sendcount, type, comm, stream)`.
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> Res;
/// `ncclBroadcast(send, recv, count, type, root, comm, stream)`.
type Broadcast =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> Res;
/// `ncclSend(send, count, type, peer, comm, stream)`.
type SendFn = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> Res;
/// `ncclRecv(recv, count, type, peer, comm, stream)`.
type RecvFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> Res;

/// The library's entry points (`nccl.h`).
struct Api {
    get_version: GetVersion,
    get_error_string: GetErrorString,
    comm_init_all: CommInitAll,
    comm_destroy: CommFree,
    comm_abort: CommFree,
    all_reduce: AllReduce,
    all_gather: AllGather,
    broadcast: Broadcast,
    send: SendFn,
    recv: RecvFn,
}

/// A loaded NCCL or RCCL.
pub struct Library {
    what: &'static str,
    name: String,
    api: Api,
    version: i32,
}

// SAFETY: the library's entry points are thread-safe for one thread per communicator, which
// is how the workers use them; the handle is never closed.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

impl Library {
    /// Opens the first of `files` that loads (`what` names the library in errors: "NCCL").
    pub fn open(what: &'static str, files: &[String], hint: &str) -> Result<Arc<Self>> {
        let mut handle = std::ptr::null_mut();
        let mut name = String::new();
        for f in files {
            let c = CString::new(f.as_str()).context("a library name with a NUL byte")?;
            // SAFETY: dlopen of a file name; the handle is kept for the process's lifetime.
            handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !handle.is_null() {
                name = f.clone();
                break;
            }
        }
        if handle.is_null() {
            bail!(
                "{what} was not found (tried {}): tensor and pipeline parallelism on this backend \
                 exchange activations through it; {hint}",
                files.join(", ")
            );
        }
        let sym = |s: &str| -> Result<*mut c_void> {
            let c = CString::new(s).expect("a symbol name");
            // SAFETY: dlsym on a live handle.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if p.is_null() {
                bail!("{what} ({name}) has no {s}: too old a version");
            }
            Ok(p)
        };
        // SAFETY: each symbol has the signature `nccl.h` declares for it.
        let api = unsafe {
            Api {
                get_version: std::mem::transmute::<*mut c_void, GetVersion>(sym("ncclGetVersion")?),
                get_error_string: std::mem::transmute::<*mut c_void, GetErrorString>(sym(
                    "ncclGetErrorString",
                )?),
                comm_init_all: std::mem::transmute::<*mut c_void, CommInitAll>(sym(
                    "ncclCommInitAll",
                )?),
                comm_destroy: std::mem::transmute::<*mut c_void, CommFree>(sym("ncclCommDestroy")?),
                comm_abort: std::mem::transmute::<*mut c_void, CommFree>(sym("ncclCommAbort")?),
                all_reduce: std::mem::transmute::<*mut c_void, AllReduce>(sym("ncclAllReduce")?),
                all_gather: std::mem::transmute::<*mut c_void, AllGather>(sym("ncclAllGather")?),
                broadcast: std::mem::transmute::<*mut c_void, Broadcast>(sym("ncclBroadcast")?),
                send: std::mem::transmute::<*mut c_void, SendFn>(sym("ncclSend")?),
                recv: std::mem::transmute::<*mut c_void, RecvFn>(sym("ncclRecv")?),
            }
        };
        let mut version = 0;
        let lib = Library {
            what,
            name: name.clone(),
            api,
            version: 0,
        };
        // SAFETY: writes one int.
        lib.check(
            unsafe { (lib.api.get_version)(&mut version) },
            "ncclGetVersion",
        )?;
        tracing::info!("{what}: {name}, version {version}");
        Ok(Arc::new(Library { version, ..lib }))
    }

    /// The file it was loaded from, and its version code (NCCL's `major*10000+minor*100+patch`).
    pub fn describe(&self) -> String {
        format!("{} {} (version {})", self.what, self.name, self.version)
    }

    fn check(&self, r: Res, what: &str) -> Result<()> {
        if r == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: returns a static C string (or null).
        let msg = unsafe { (self.api.get_error_string)(r) };
        let msg = if msg.is_null() {
            String::new()
        } else {
            // SAFETY: a NUL-terminated static string.
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        bail!("{}: {what} failed (error {r}: {msg})", self.name)
    }

    /// One communicator per device of `devices` (distinct device ordinals of this process),
    /// in that order: rank `i` is `devices[i]`.
    fn init_all(&self, devices: &[usize]) -> Result<Vec<Comm>> {
        let devs: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        let mut comms = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `comms` has room for one handle per device.
        let r = unsafe {
            (self.api.comm_init_all)(comms.as_mut_ptr(), devs.len() as c_int, devs.as_ptr())
        };
        self.check(r, "ncclCommInitAll")?;
        Ok(comms)
    }
}

/// One group of devices (a tensor-parallel group, or a pipeline's stages): its communicators,
/// one per rank.
pub struct CclGroup {
    lib: Arc<Library>,
    devices: Vec<usize>,
    comms: Mutex<Vec<Comm>>,
    aborted: AtomicBool,
    /// Calls of the library under way (see [`CclGroup::call`]).
    in_flight: AtomicUsize,
    /// The host-side barrier: ranks arrived, and barriers completed.
    meet: Mutex<(usize, u64)>,
    met: Condvar,
}

// SAFETY: the communicator handles are used by one rank's thread each; abort and reset come
// from the engine while no collective is queued by another thread on the same handle, or to
// cancel those that are (ncclCommAbort is made for that).
unsafe impl Send for CclGroup {}
unsafe impl Sync for CclGroup {}

impl CclGroup {
    pub fn new(lib: Arc<Library>, devices: Vec<usize>) -> Result<Arc<Self>> {
        let comms = lib.init_all(&devices)?;
        Ok(Arc::new(CclGroup {
            lib,
            devices,
            comms: Mutex::new(comms),
            aborted: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            meet: Mutex::new((0, 0)),
            met: Condvar::new(),
        }))
    }

    /// Rank `rank`'s handle.
    pub fn comm(self: &Arc<Self>, rank: usize) -> CclComm {
        CclComm {
            group: self.clone(),
            rank,
        }
    }

    /// Runs one call of the library on rank `rank`'s handle.
    fn call(&self, rank: usize, what: &str, f: impl FnOnce(&Api, Comm) -> Res) -> Result<()> {
        // NOTE: a call counts itself in flight before it looks at the abort flag, and abort
        // sets the flag before it waits for the calls in flight: so either the call sees the
        // flag and stays out, or abort waits for it before freeing the handle it uses.
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let r = if self.aborted.load(Ordering::SeqCst) {
            None
        } else {
            let c = self.comms.lock().unwrap_or_else(|e| e.into_inner())[rank];
            Some(f(&self.lib.api, c))
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        match r {
            None => bail!(
                "another worker failed (the {} group was aborted)",
                self.lib.name
            ),
            Some(r) => self.lib.check(r, what),
        }
    }
}

impl GroupControl for CclGroup {
    fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        // NOTE: NCCL's calls return once their work is queued, so the wait is short; a
        // library whose calls wait for the other ranks (the tests' host one) is woken by the
        // abort itself, and does not free an aborted handle.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while self.in_flight.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // NOTE: an aborted handle is gone: null marks it, so that it is never used or freed
        // again.
        let mut comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        for c in comms.iter_mut() {
            if !c.is_null() {
                // SAFETY: our handle; abort cancels what is queued on it and frees it.
                let _ = unsafe { (self.lib.api.comm_abort)(*c) };
                *c = std::ptr::null_mut();
            }
        }
    }

    fn reset(&self) {
        if !self.aborted.load(Ordering::SeqCst) {
            return;
        }
        // NOTE: an aborted communicator cannot be used again: the group is made anew, on the
        // same devices, for the next step.
        match self.lib.init_all(&self.devices) {
            Ok(fresh) => {
                *self.comms.lock().unwrap_or_else(|e| e.into_inner()) = fresh;
                self.aborted.store(false, Ordering::SeqCst);
            }
            Err(e) => {
                tracing::error!("the failed step's communicators cannot be made again: {e:#}")
            }
        }
    }
}

impl Drop for CclGroup {
    fn drop(&mut self) {
        let comms = self.comms.get_mut().unwrap_or_else(|e| e.into_inner());
        for &c in comms.iter().filter(|c| !c.is_null()) {
            // SAFETY: our live handles; no worker uses them any more.
            let _ = unsafe { (self.lib.api.comm_destroy)(c) };
        }
    }
}

/// Rank `rank` of a [`CclGroup`].
pub struct CclComm {
    group: Arc<CclGroup>,
    rank: usize,
}

fn prefix<R: GpuRuntime>(buf: &GpuBuf<R>, n: usize, what: &str) -> Result<*mut c_void> {
    if n > buf.len() {
        bail!("{what}: {n} values asked of a buffer of {}", buf.len());
    }
    if buf.elem() != crate::backend::gpu::Elem::F32 {
        bail!("{what}: an f32 buffer is expected");
    }
    Ok(buf.ptr() as usize as *mut c_void)
}

impl CclComm {
    fn peer(&self, p: usize, what: &str) -> Result<c_int> {
        if p >= self.group.devices.len() || p == self.rank {
            bail!(
                "{what}: rank {p} is not another rank of this group of {}",
                self.group.devices.len()
            );
        }
        Ok(p as c_int)
    }
}

/// NOTE: the null stream is the legacy default stream, the one every kernel of the runtime is
/// launched on.
const STREAM: *mut c_void = std::ptr::null_mut();

impl<R: GpuRuntime> Communicator<GpuBackend<R>> for CclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.group.devices.len()
    }
    fn all_reduce_sum(&self, backend: &GpuBackend<R>, buf: &mut GpuBuf<R>, n: usize) -> Result<()> {
        let p = prefix(buf, n, "all-reduce")?;
        backend.runtime().bind()?;
        // SAFETY: `p[..n]` is device memory of this rank's device; in place is allowed.
        self.group
            .call(self.rank, "ncclAllReduce", |api, c| unsafe {
                (api.all_reduce)(p, p, n, NCCL_FLOAT32, NCCL_SUM, c, STREAM)
            })
    }
    fn all_gather(&self, backend: &GpuBackend<R>, part: &GpuBuf<R>, n: usize) -> Result<GpuBuf<R>> {
        let p = prefix(part, n, "all-gather")?;
        let out = backend.alloc_scratch_f32(n * self.group.devices.len())?;
        let q = prefix(&out, n * self.group.devices.len(), "all-gather")?;
        backend.runtime().bind()?;
        // SAFETY: `p[..n]` and `q[..size × n]` are device memory of this rank's device.
        self.group
            .call(self.rank, "ncclAllGather", |api, c| unsafe {
                (api.all_gather)(p, q, n, NCCL_FLOAT32, c, STREAM)
            })?;
        Ok(out)
    }
    fn broadcast(
        &self,
        backend: &GpuBackend<R>,
        buf: &mut GpuBuf<R>,
        n: usize,
        root: usize,
    ) -> Result<()> {
        let size = self.group.devices.len();
        if root >= size {
            bail!("broadcast: root {root} is not a rank of this group of {size}");
        }
        let p = prefix(buf, n, "broadcast")?;
        backend.runtime().bind()?;
        // SAFETY: `p[..n]` is device memory of this rank's device; in place is allowed.
        self.group
            .call(self.rank, "ncclBroadcast", |api, c| unsafe {
                (api.broadcast)(p, p, n, NCCL_FLOAT32, root as c_int, c, STREAM)
            })
    }
    fn send(&self, backend: &GpuBackend<R>, buf: &GpuBuf<R>, n: usize, to: usize) -> Result<()> {
        let peer = self.peer(to, "send")?;
        let p = prefix(buf, n, "send")?;
        backend.runtime().bind()?;
        // NOTE: the buffer may be dropped when this returns: its memory goes back to the pool
        // and is written next by work queued after the send on the same stream.
        // SAFETY: `p[..n]` is device memory of this rank's device.
        self.group.call(self.rank, "ncclSend", |api, c| unsafe {
            (api.send)(p, n, NCCL_FLOAT32, peer, c, STREAM)
        })
    }
    fn recv(&self, backend: &GpuBackend<R>, n: usize, from: usize) -> Result<GpuBuf<R>> {
        let peer = self.peer(from, "recv")?;
        let out = backend.alloc_scratch_f32(n)?;
        let q = prefix(&out, n, "recv")?;
        backend.runtime().bind()?;
        // SAFETY: `q[..n]` is device memory of this rank's device.
        self.group.call(self.rank, "ncclRecv", |api, c| unsafe {
            (api.recv)(q, n, NCCL_FLOAT32, peer, c, STREAM)
        })?;
        Ok(out)
    }
    fn barrier(&self) -> Result<()> {
        // NOTE: the ranks of a group are threads of this process: they meet on the host.
        let g = &self.group;
        let mut m = g.meet.lock().unwrap_or_else(|e| e.into_inner());
        let generation = m.1;
        m.0 += 1;
        if m.0 == g.devices.len() {
            *m = (0, generation + 1);
            g.met.notify_all();
            return Ok(());
        }
        while m.1 == generation {
            if g.aborted.load(Ordering::SeqCst) {
                m.0 -= 1;
                bail!(
                    "another worker failed (the {} group was aborted)",
                    g.lib.name
                );
            }
            m = g
                .met
                .wait_timeout(m, std::time::Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

/// Every worker's communicators on devices: for each stage, a tensor-parallel group over its
/// ranks' devices; for each tensor rank, a pipeline group over its stages' devices. Worker `w`
/// (`stage × tensor + rank`) runs on device `devices[w]`.
fn groups<R: GpuRuntime>(
    lib: &Arc<Library>,
    pc: ParallelConfig,
    devices: &[usize],
) -> Result<DeviceGroups<GpuBackend<R>>> {
    let dev = |stage: usize, rank: usize| devices[stage * pc.tensor + rank];
    let tp: Vec<Arc<CclGroup>> = (0..pc.pipeline)
        .map(|s| CclGroup::new(lib.clone(), (0..pc.tensor).map(|r| dev(s, r)).collect()))
        .collect::<Result<_>>()?;
    let pp: Vec<Arc<CclGroup>> = (0..pc.tensor)
        .map(|r| CclGroup::new(lib.clone(), (0..pc.pipeline).map(|s| dev(s, r)).collect()))
        .collect::<Result<_>>()?;
    let mut workers = Vec::with_capacity(pc.world_size());
    for (s, t) in tp.iter().enumerate() {
        for (r, p) in pp.iter().enumerate() {
            let comms: [Arc<dyn Communicator<GpuBackend<R>>>; 2] =
                [Arc::new(t.comm(r)), Arc::new(p.comm(s))];
            let controls: [Arc<dyn GroupControl>; 2] = [t.clone(), p.clone()];
            workers.push((comms, controls));
        }
    }
    let all = tp
        .into_iter()
        .chain(pp)
        .map(|g| g as Arc<dyn GroupControl>)
        .collect();
    Ok(DeviceGroups {
        workers,
        all,
        library: lib.describe(),
    })
}

impl<R: GpuRuntime> MultiDevice for GpuBackend<R> {
    fn device_count() -> Result<usize> {
        R::device_count()
    }
    fn open_device(device: usize) -> Result<Self> {
        GpuBackend::on_device(device)
    }
    fn device_groups(pc: ParallelConfig, devices: &[usize]) -> Result<Option<DeviceGroups<Self>>> {
        let Some(spec) = R::ccl_library() else {
            return Ok(None);
        };
        let lib = Library::open(spec.name, &spec.files, spec.hint)?;
        groups(&lib, pc, devices).map(Some)
    }
}
