//! Device memory: the caching allocator and the buffers handed out of it.

use super::{Elem, GpuRuntime};
use anyhow::{Context, Result, ensure};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A caching allocator: freed blocks are kept by size and handed out again, since a device
/// malloc/free pair per activation per step would cost more than the step. Small sizes round
/// up to a power of two; large ones (weights, KV caches) to 2 MiB.
pub(super) struct Pool<R: GpuRuntime> {
    pub(super) rt: Arc<R>,
    pub(super) free: Mutex<HashMap<usize, Vec<u64>>>,
}

/// The size a request is served at. Up to 1 MiB a power of two; up to 64 MiB one of 16 sizes
/// per doubling (at most 1/16 of the power of two above, so under 12.5% of the request, is
/// lost: a KV cache of 35 MB per layer took 64 MiB when every size up to 64 MiB was a power of
/// two, and the pool sized from the free memory then did not fit); beyond, 2 MiB multiples.
pub(super) fn bucket(bytes: usize) -> usize {
    const SMALL: usize = 1 << 20;
    const BIG: usize = 64 << 20;
    let b = bytes.max(256);
    if b <= SMALL {
        b.next_power_of_two()
    } else if b <= BIG {
        let step = b.next_power_of_two() / 16;
        b.div_ceil(step) * step
    } else {
        b.div_ceil(2 << 20) * (2 << 20)
    }
}

impl<R: GpuRuntime> Pool<R> {
    pub(super) fn alloc(self: &Arc<Self>, bytes: usize) -> Result<Arc<Allocation<R>>> {
        let size = bucket(bytes);
        let cached = self
            .free
            .lock()
            .unwrap()
            .get_mut(&size)
            .and_then(|v| v.pop());
        let ptr = match cached {
            Some(p) => p,
            None => match self.rt.malloc(size) {
                Ok(p) => p,
                Err(_) => {
                    // Out of memory: give the cached blocks back and try once more.
                    self.release_cached();
                    self.rt.malloc(size).with_context(|| {
                        format!(
                            "{}: cannot allocate {} MiB of device memory",
                            R::API,
                            size >> 20
                        )
                    })?
                }
            },
        };
        Ok(Arc::new(Allocation {
            ptr,
            size,
            pool: self.clone(),
        }))
    }

    pub(super) fn release_cached(&self) {
        // NOTE: frees need the context current; the pool may be dropped on any thread.
        let _ = self.rt.bind();
        let blocks: Vec<u64> = self
            .free
            .lock()
            .unwrap()
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        for p in blocks {
            // SAFETY: cached blocks are owned by the pool alone.
            unsafe { self.rt.free(p) };
        }
    }
}

impl<R: GpuRuntime> Drop for Pool<R> {
    fn drop(&mut self) {
        self.release_cached();
    }
}

pub(super) struct Allocation<R: GpuRuntime> {
    pub(super) ptr: u64,
    pub(super) size: usize,
    pub(super) pool: Arc<Pool<R>>,
}

impl<R: GpuRuntime> Drop for Allocation<R> {
    fn drop(&mut self) {
        if let Ok(mut free) = self.pool.free.lock() {
            free.entry(self.size).or_default().push(self.ptr);
        }
    }
}

/// Device memory of one element type: a whole allocation or a view into one (the batch
/// arrays share one upload). Index buffers keep their host copy, so that ids, slots and
/// positions are checked on the host exactly as the CPU backend checks them.
pub struct GpuBuf<R: GpuRuntime> {
    pub(super) mem: Arc<Allocation<R>>,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) elem: Elem,
    pub(super) host: Option<Arc<Vec<u32>>>,
    /// The parts of a weight in blocks (`Elem::Blocks`).
    pub(super) quant: Option<Arc<Vec<QPart>>>,
}

impl<R: GpuRuntime> GpuBuf<R> {
    pub fn ptr(&self) -> u64 {
        self.mem.ptr + self.offset as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn elem(&self) -> Elem {
        self.elem
    }
    pub(super) fn expect(&self, elem: Elem, what: &str) -> Result<()> {
        ensure!(
            self.elem == elem,
            "{what}: expected a {elem:?} buffer, got a {:?} one",
            self.elem
        );
        Ok(())
    }
    pub(super) fn host_u32(&self, what: &str) -> Result<&[u32]> {
        self.expect(Elem::U32, what)?;
        self.host
            .as_deref()
            .map(|v| v.as_slice())
            .with_context(|| format!("{what}: index buffer has no host copy"))
    }
}

/// One part of a weight in GGUF blocks on the device (`gpu/qmatmul.rs`): its type, its rows, and where it starts (byte offsets
/// into the buffer).
#[derive(Debug, Clone)]
pub struct QPart {
    pub(super) ty: &'static str,
    pub(super) rows: usize,
    pub(super) layout: Layout,
}

#[derive(Debug, Clone)]
pub(super) enum Layout {
    /// Blocks of 32: where each plane starts.
    Planes {
        qs: usize,
        qh: Option<usize>,
        d: usize,
        m: Option<usize>,
    },
    /// Super-blocks of 256 from `at`, `stride` bytes each.
    Padded { at: usize, stride: usize },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up() {
        assert_eq!(bucket(1), 256);
        assert_eq!(bucket(257), 512);
        assert_eq!(bucket(1 << 20), 1 << 20);
        assert_eq!(bucket((1 << 20) + 1), (1 << 20) + (1 << 17));
        assert_eq!(bucket(35_000_000), 36 << 20);
        assert_eq!(bucket(64 << 20), 64 << 20);
        assert_eq!(bucket((64 << 20) + 1), (66 << 20));
        assert_eq!(bucket(100 << 20), 100 << 20);
        for b in [300, 5000, 1 << 20, 3 << 20, 33 << 20, 40_000_000, 1 << 30] {
            let s = bucket(b);
            assert!(s >= b && (b < 1 << 20 || s - b <= b / 8), "{b} -> {s}");
        }
    }
}
