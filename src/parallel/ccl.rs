//! The devices of tensor and pipeline parallelism ([`MultiDevice`]: one worker per device, on
//! the CPU threads sharing it) and the collectives between GPUs through NCCL (CUDA) or RCCL
//! (HIP): device buffers go from device to device, never through the host. Both libraries are
//! loaded at run time, so the crate builds and starts without them; a missing library is an
//! error that names it, raised before any weight is loaded.
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
use super::{GroupControl, ParallelConfig};
use crate::backend::gpu::{GpuBackend, GpuBuf, GpuRuntime};
use crate::backend::{Backend, CpuBackend};
use anyhow::{Context, Result, anyhow, bail};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// A worker's two communicators (its stage's tensor-parallel group, its rank's pipeline
/// group), and those groups.
pub type WorkerComms<B> = ([Arc<dyn Communicator<B>>; 2], [Arc<dyn GroupControl>; 2]);

/// Communicators that pass device buffers from device to device ([`MultiDevice::device_groups`]).
pub struct DeviceGroups<B: Backend> {
    /// Every worker's, in worker order (`None`: a worker of another node).
    pub workers: Vec<Option<WorkerComms<B>>>,
    /// Every group.
    pub all: Vec<Arc<dyn GroupControl>>,
    /// The library, for the runner's name: "NCCL libnccl.so.2 (version 22703)".
    pub library: String,
    /// Where the groups span nodes: they are made once every node has loaded its shards,
    /// from ids node 0 makes (until then every collective fails).
    pub nodes: Option<Arc<NodeCcl>>,
}

/// Makes a backend's device the calling thread's current one.
pub type Binder = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// A backend that runs one worker per device.
pub trait MultiDevice: Backend + Sized {
    /// "cpu", "cuda", "hip", "emu": nodes must agree on it.
    fn kind() -> &'static str;
    /// How many devices this process sees (`usize::MAX` where the workers share one, as on
    /// the CPU).
    fn device_count() -> Result<usize>;
    /// The backend on device `device`.
    fn open_device(device: usize) -> Result<Self>;
    /// Communicators that pass device buffers from device to device (NCCL, RCCL) between
    /// workers on `devices` (worker `w` on device `devices[w]` of this process, `None` on
    /// another node), or `None` where buffers go through the host ([`LocalGroup`]). An error
    /// where the library is needed and missing.
    fn device_groups(
        pc: ParallelConfig,
        devices: &[Option<usize>],
    ) -> Result<Option<DeviceGroups<Self>>>;
    /// Makes this backend's device current on the calling thread (as a collective library's
    /// set-up needs).
    fn binder(&self) -> Binder;
}

impl MultiDevice for CpuBackend {
    fn kind() -> &'static str {
        "cpu"
    }
    fn device_count() -> Result<usize> {
        Ok(usize::MAX)
    }
    fn open_device(_device: usize) -> Result<Self> {
        Ok(CpuBackend::new())
    }
    fn device_groups(_: ParallelConfig, _: &[Option<usize>]) -> Result<Option<DeviceGroups<Self>>> {
        Ok(None)
    }
    fn binder(&self) -> Binder {
        Arc::new(|| Ok(()))
    }
}

/// A backend whose Cargo feature is off (`backend/stubs.rs`): never constructed, so every call
/// fails as its `new` does.
#[cfg(not(all(feature = "wgpu", feature = "cuda", feature = "hip")))]
macro_rules! unavailable_multi_device {
    ($name:ty, $feature:literal) => {
        impl MultiDevice for $name {
            fn kind() -> &'static str {
                $feature
            }
            fn device_count() -> Result<usize> {
                <$name>::new().map(|b| b.never())
            }
            fn open_device(_device: usize) -> Result<Self> {
                <$name>::new()
            }
            fn device_groups(
                _: ParallelConfig,
                _: &[Option<usize>],
            ) -> Result<Option<DeviceGroups<Self>>> {
                <$name>::new().map(|b| b.never())
            }
            fn binder(&self) -> Binder {
                self.never()
            }
        }
    };
}
#[cfg(not(feature = "wgpu"))]
unavailable_multi_device!(crate::backend::WgpuBackend, "wgpu");
#[cfg(not(feature = "cuda"))]
unavailable_multi_device!(crate::backend::CudaBackend, "cuda");
#[cfg(not(feature = "hip"))]
unavailable_multi_device!(crate::backend::HipBackend, "hip");

type Comm = *mut c_void;
type Res = c_int;

/// The bytes of an `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`, the same in RCCL).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: what rank 0 of a group makes and every rank passes to `ncclCommInitRank`
/// (it holds the address of rank 0's bootstrap socket).
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; UNIQUE_ID_BYTES]);
const NCCL_SUCCESS: Res = 0;
/// `ncclFloat32` and `ncclSum` (the same values in NCCL and RCCL).
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> Res;
type GetErrorString = unsafe extern "C" fn(Res) -> *const c_char;
type CommInitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Res;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> Res;
/// `ncclCommInitRank(comm, nranks, id, rank)`: the id is passed by value.
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Res;
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
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
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
                get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(sym(
                    "ncclGetUniqueId",
                )?),
                comm_init_rank: std::mem::transmute::<*mut c_void, CommInitRank>(sym(
                    "ncclCommInitRank",
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

    /// A new `ncclUniqueId` (node 0 makes one per group that spans nodes).
    pub fn unique_id(&self) -> Result<Vec<u8>> {
        let mut id = UniqueId([0; UNIQUE_ID_BYTES]);
        // SAFETY: writes one `ncclUniqueId`.
        self.check(
            unsafe { (self.api.get_unique_id)(&mut id) },
            "ncclGetUniqueId",
        )?;
        Ok(id.0.to_vec())
    }

    /// Rank `rank`'s communicator of a group of `size` made from `id`: returns once every rank
    /// of the group (in any process) has called it. The calling thread's current device is
    /// the rank's.
    fn init_rank(&self, size: usize, id: &[u8], rank: usize) -> Result<Comm> {
        let id =
            UniqueId(id.try_into().map_err(|_| {
                anyhow!("a unique id of {} bytes, not {UNIQUE_ID_BYTES}", id.len())
            })?);
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one handle.
        let r = unsafe { (self.api.comm_init_rank)(&mut comm, size as c_int, id, rank as c_int) };
        self.check(r, "ncclCommInitRank")?;
        Ok(comm)
    }
}

/// One group of devices (a tensor-parallel group, or a pipeline's stages): the communicators
/// of its ranks in this process.
pub struct CclGroup {
    lib: Arc<Library>,
    /// Ranks in the group, in every process.
    size: usize,
    /// This process's ranks and their devices, by rank.
    members: Vec<(usize, usize)>,
    /// Every rank is here: the handles are made with `ncclCommInitAll` (else with
    /// `ncclCommInitRank`, by [`NodeCcl::join`]).
    whole: bool,
    /// One handle per member (null: not made yet, or aborted).
    comms: Mutex<Vec<Comm>>,
    /// Set while the handles cannot be used: aborted, or not made yet.
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
    fn with(lib: Arc<Library>, size: usize, members: Vec<(usize, usize)>) -> Self {
        let whole = members.len() == size;
        CclGroup {
            lib,
            size,
            comms: Mutex::new(vec![std::ptr::null_mut(); members.len()]),
            members,
            whole,
            aborted: AtomicBool::new(true),
            in_flight: AtomicUsize::new(0),
            meet: Mutex::new((0, 0)),
            met: Condvar::new(),
        }
    }

    /// A group whose ranks are all devices of this process: rank `i` on `devices[i]`.
    pub fn new(lib: Arc<Library>, devices: Vec<usize>) -> Result<Arc<Self>> {
        let g = Self::with(
            lib,
            devices.len(),
            devices.into_iter().enumerate().collect(),
        );
        *g.comms.lock().unwrap_or_else(|e| e.into_inner()) = g.lib.init_all(&g.devices())?;
        g.aborted.store(false, Ordering::SeqCst);
        Ok(Arc::new(g))
    }

    fn devices(&self) -> Vec<usize> {
        self.members.iter().map(|&(_, d)| d).collect()
    }

    /// Rank `rank`'s handle (a rank of this process).
    pub fn comm(self: &Arc<Self>, rank: usize) -> CclComm {
        let slot = self
            .members
            .iter()
            .position(|&(r, _)| r == rank)
            .expect("a rank of this process");
        CclComm {
            group: self.clone(),
            rank,
            slot,
        }
    }

    /// Runs one call of the library on the handle of member `slot`.
    fn call(&self, slot: usize, what: &str, f: impl FnOnce(&Api, Comm) -> Res) -> Result<()> {
        // NOTE: a call counts itself in flight before it looks at the abort flag, and abort
        // sets the flag before it waits for the calls in flight: so either the call sees the
        // flag and stays out, or abort waits for it before freeing the handle it uses.
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let r = if self.aborted.load(Ordering::SeqCst) {
            None
        } else {
            let c = self.comms.lock().unwrap_or_else(|e| e.into_inner())[slot];
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

    /// Makes this process's handles from `id` (every member on its own thread, its device
    /// bound by `bind`), returning once every rank of the group, in every process, has.
    fn join(&self, id: &[u8], bind: &(dyn Fn(usize) -> Result<()> + Sync)) -> Result<()> {
        // NOTE: a handle crosses threads as an address (it is the library's, not the thread's)
        let made: Vec<Result<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = self
                .members
                .iter()
                .map(|&(rank, device)| {
                    s.spawn(move || {
                        bind(device)?;
                        Ok(self.lib.init_rank(self.size, id, rank)? as usize)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("ncclCommInitRank panicked")))
                })
                .collect()
        });
        let mut comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        let mut failed = None;
        for (c, m) in comms.iter_mut().zip(made) {
            match m {
                Ok(h) => *c = h as Comm,
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            // NOTE: the handles made stay (aborted): the next reset frees them
            Some(e) => Err(e),
            None => {
                self.aborted.store(false, Ordering::SeqCst);
                Ok(())
            }
        }
    }

    /// Cancels what is queued on this process's handles and frees them.
    fn abort_here(&self) {
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
        self.free(true);
    }

    /// Frees every handle (`abort`: with `ncclCommAbort`, else `ncclCommDestroy`); null marks
    /// a handle gone, so that it is never used or freed again.
    fn free(&self, abort: bool) {
        let mut comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        for c in comms.iter_mut().filter(|c| !c.is_null()) {
            let f = if abort {
                self.lib.api.comm_abort
            } else {
                self.lib.api.comm_destroy
            };
            // SAFETY: our handle, used by no call now.
            let _ = unsafe { f(*c) };
            *c = std::ptr::null_mut();
        }
    }
}

impl GroupControl for CclGroup {
    fn abort(&self) {
        self.abort_here()
    }

    fn reset(&self) {
        if !self.aborted.load(Ordering::SeqCst) {
            return;
        }
        if !self.whole {
            // NOTE: never reached: workers on several nodes are controlled by their node's
            // groups ([`NodeCcl`]), which make every group again from node 0's fresh ids.
            tracing::error!("a group that spans nodes is made again only with a fresh id");
            return;
        }
        // NOTE: an aborted communicator cannot be used again: the group is made anew, on the
        // same devices, for the next step.
        match self.lib.init_all(&self.devices()) {
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
        self.free(false);
    }
}

/// Every group of the split as this process sees it when the workers span nodes: made once
/// every node has loaded its shards, from one `ncclUniqueId` per group that node 0 makes and
/// sends (NCCL's own bootstrap: rank 0's address is in the id, and the ranks meet there);
/// made again, from fresh ids, after a failed step.
///
/// NOTE: every rank of every group here is made on its own thread, all at once: each call
/// returns only when its whole group has come, so making the groups one after the other
/// could wait forever on a group another process makes later.
pub struct NodeCcl {
    lib: Arc<Library>,
    /// Tensor-parallel groups by stage, then pipeline groups by rank (some may have no rank
    /// here).
    groups: Vec<Arc<CclGroup>>,
    /// How many times the groups were made, and the ids they were last made from.
    made: Mutex<(u64, Vec<Vec<u8>>)>,
}

impl NodeCcl {
    /// A fresh id per group (node 0).
    pub fn ids(&self) -> Result<Vec<Vec<u8>>> {
        self.groups.iter().map(|_| self.lib.unique_id()).collect()
    }

    /// Makes every group's handles here from `ids` (one per group), binding each member's
    /// device with `bind` first. Nothing to do when they were made from these ids already
    /// (every worker of a node passes the reset on).
    pub fn join(&self, ids: &[Vec<u8>], bind: &(dyn Fn(usize) -> Result<()> + Sync)) -> Result<()> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        if made.1 == ids {
            return Ok(());
        }
        if ids.len() != self.groups.len() {
            bail!(
                "{} ids for the split's {} groups (are the nodes started with the same sizes?)",
                ids.len(),
                self.groups.len()
            );
        }
        for g in &self.groups {
            g.abort_here();
            g.free(false);
        }
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = self
                .groups
                .iter()
                .zip(ids)
                .map(|(g, id)| s.spawn(move || g.join(id, bind)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("joining a group panicked")))
                })
                .collect()
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
        *made = (made.0 + 1, ids.to_vec());
        Ok(())
    }

    /// How many times the groups were made (the same count on every node).
    pub fn generation(&self) -> u64 {
        self.made.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Cancels and frees this process's handles of every group.
    pub fn abort(&self) {
        let _made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        self.groups.iter().for_each(|g| g.abort_here());
    }

    /// [`Self::abort`] if the groups are still those made `generation` times: an abort that
    /// arrives late (on another worker's connection, after the reset that followed it) leaves
    /// the groups made since alone.
    pub fn abort_generation(&self, generation: u64) {
        let made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        if made.0 == generation {
            self.groups.iter().for_each(|g| g.abort_here());
        }
    }

    pub fn describe(&self) -> String {
        self.lib.describe()
    }
}
/// Rank `rank` of a [`CclGroup`].
pub struct CclComm {
    group: Arc<CclGroup>,
    rank: usize,
    /// Its place among the group's members here.
    slot: usize,
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
        if p >= self.group.size || p == self.rank {
            bail!(
                "{what}: rank {p} is not another rank of this group of {}",
                self.group.size
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
        self.group.size
    }
    fn all_reduce_sum(&self, backend: &GpuBackend<R>, buf: &mut GpuBuf<R>, n: usize) -> Result<()> {
        let p = prefix(buf, n, "all-reduce")?;
        backend.runtime().bind()?;
        // SAFETY: `p[..n]` is device memory of this rank's device; in place is allowed.
        self.group
            .call(self.slot, "ncclAllReduce", |api, c| unsafe {
                (api.all_reduce)(p, p, n, NCCL_FLOAT32, NCCL_SUM, c, STREAM)
            })
    }
    fn all_gather(&self, backend: &GpuBackend<R>, part: &GpuBuf<R>, n: usize) -> Result<GpuBuf<R>> {
        let p = prefix(part, n, "all-gather")?;
        let out = backend.alloc_scratch_f32(n * self.group.size)?;
        let q = prefix(&out, n * self.group.size, "all-gather")?;
        backend.runtime().bind()?;
        // SAFETY: `p[..n]` and `q[..size × n]` are device memory of this rank's device.
        self.group
            .call(self.slot, "ncclAllGather", |api, c| unsafe {
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
        let size = self.group.size;
        if root >= size {
            bail!("broadcast: root {root} is not a rank of this group of {size}");
        }
        let p = prefix(buf, n, "broadcast")?;
        backend.runtime().bind()?;
        // SAFETY: `p[..n]` is device memory of this rank's device; in place is allowed.
        self.group
            .call(self.slot, "ncclBroadcast", |api, c| unsafe {
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
        self.group.call(self.slot, "ncclSend", |api, c| unsafe {
            (api.send)(p, n, NCCL_FLOAT32, peer, c, STREAM)
        })
    }
    fn recv(&self, backend: &GpuBackend<R>, n: usize, from: usize) -> Result<GpuBuf<R>> {
        let peer = self.peer(from, "recv")?;
        let out = backend.alloc_scratch_f32(n)?;
        let q = prefix(&out, n, "recv")?;
        backend.runtime().bind()?;
        // SAFETY: `q[..n]` is device memory of this rank's device.
        self.group.call(self.slot, "ncclRecv", |api, c| unsafe {
            (api.recv)(q, n, NCCL_FLOAT32, peer, c, STREAM)
        })?;
        Ok(out)
    }
    fn barrier(&self) -> Result<()> {
        // NOTE: the ranks of a group are threads of this process: they meet on the host. Nothing
        // calls a barrier across nodes (it would need a device buffer to all-reduce).
        let g = &self.group;
        if !g.whole {
            bail!("a barrier between ranks on several nodes is not implemented");
        }
        let mut m = g.meet.lock().unwrap_or_else(|e| e.into_inner());
        let generation = m.1;
        m.0 += 1;
        if m.0 == g.size {
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
/// (`stage × tensor + rank`) runs on device `devices[w]` of this process, or on another node
/// (`None`): then the groups are made later, by [`NodeCcl::join`].
fn groups<R: GpuRuntime>(
    lib: &Arc<Library>,
    pc: ParallelConfig,
    devices: &[Option<usize>],
) -> Result<DeviceGroups<GpuBackend<R>>> {
    let spanning = devices.iter().any(Option::is_none);
    let group = |workers: Vec<usize>| -> Result<Arc<CclGroup>> {
        let members: Vec<(usize, usize)> = workers
            .iter()
            .enumerate()
            .filter_map(|(rank, &w)| devices[w].map(|d| (rank, d)))
            .collect();
        if spanning {
            Ok(Arc::new(CclGroup::with(
                lib.clone(),
                workers.len(),
                members,
            )))
        } else {
            CclGroup::new(lib.clone(), members.into_iter().map(|(_, d)| d).collect())
        }
    };
    let tp: Vec<Arc<CclGroup>> = (0..pc.pipeline)
        .map(|s| group((0..pc.tensor).map(|r| s * pc.tensor + r).collect()))
        .collect::<Result<_>>()?;
    let pp: Vec<Arc<CclGroup>> = (0..pc.tensor)
        .map(|r| group((0..pc.pipeline).map(|s| s * pc.tensor + r).collect()))
        .collect::<Result<_>>()?;
    let mut workers = Vec::with_capacity(pc.world_size());
    for (s, t) in tp.iter().enumerate() {
        for (r, p) in pp.iter().enumerate() {
            if devices[s * pc.tensor + r].is_none() {
                workers.push(None);
                continue;
            }
            let comms: [Arc<dyn Communicator<GpuBackend<R>>>; 2] =
                [Arc::new(t.comm(r)), Arc::new(p.comm(s))];
            let controls: [Arc<dyn GroupControl>; 2] = [t.clone(), p.clone()];
            workers.push(Some((comms, controls)));
        }
    }
    let all: Vec<Arc<CclGroup>> = tp.into_iter().chain(pp).collect();
    Ok(DeviceGroups {
        workers,
        all: all
            .iter()
            .map(|g| g.clone() as Arc<dyn GroupControl>)
            .collect(),
        library: lib.describe(),
        nodes: spanning.then(|| {
            Arc::new(NodeCcl {
                lib: lib.clone(),
                groups: all,
                made: Mutex::new((0, Vec::new())),
            })
        }),
    })
}

impl<R: GpuRuntime> MultiDevice for GpuBackend<R> {
    fn kind() -> &'static str {
        R::API
    }
    fn device_count() -> Result<usize> {
        R::device_count()
    }
    fn open_device(device: usize) -> Result<Self> {
        GpuBackend::on_device(device)
    }
    fn device_groups(
        pc: ParallelConfig,
        devices: &[Option<usize>],
    ) -> Result<Option<DeviceGroups<Self>>> {
        let Some(spec) = R::ccl_library() else {
            return Ok(None);
        };
        let lib = Library::open(spec.name, &spec.files, spec.hint)?;
        groups(&lib, pc, devices).map(Some)
    }
    fn binder(&self) -> Binder {
        let rt = self.runtime_arc();
        Arc::new(move || rt.bind())
    }
}
