//! Collectives between the workers of one model: the [`Communicator`] trait the model code
//! calls, and [`LocalGroup`], its in-process implementation (workers are threads, buffers pass
//! through shared host memory).
//!
//! NOTE: `LocalGroup` (and `tcp::RemoteComm`, its handle in another process) stages every
//! buffer through the host (`download_f32`, `upload_f32`): they implement [`HostCollectives`],
//! and [`Communicator`] follows for any backend; on the CPU backend that is one copy each way.
//! GPU groups exchange device buffers directly through NCCL or RCCL instead (`ccl.rs`).

use crate::backend::Backend;
use anyhow::{Result, bail};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One rank's view of a group of workers. Every collective must be called by every rank of
/// the group, in the same order; `send`/`recv` pair one rank with another.
pub trait Communicator<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// `buf[..n]` becomes the element-wise sum over the ranks, added in rank order (rank 0
    /// first), so every rank gets the same bits and a run is reproducible.
    fn all_reduce_sum(&self, backend: &B, buf: &mut B::Buf, n: usize) -> Result<()>;
    /// Every rank's `part[..n]` one after the other, in rank order: `[size × n]`.
    fn all_gather(&self, backend: &B, part: &B::Buf, n: usize) -> Result<B::Buf>;
    /// `buf[..n]` of rank `root` on every rank.
    fn broadcast(&self, backend: &B, buf: &mut B::Buf, n: usize, root: usize) -> Result<()>;
    /// Sends `buf[..n]` to rank `to` (returns once it is queued).
    fn send(&self, backend: &B, buf: &B::Buf, n: usize, to: usize) -> Result<()>;
    /// Receives the `n` values rank `from` sent next.
    fn recv(&self, backend: &B, n: usize, from: usize) -> Result<B::Buf>;
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;
}

#[derive(Default)]
struct State {
    /// Ranks waiting at the current barrier, and how many barriers have completed.
    arrived: usize,
    generation: u64,
    /// Set when a rank failed: every rank waiting or arriving later gets an error instead of
    /// waiting for a rank that will never come.
    aborted: bool,
    /// What each rank contributes to the exchange in progress.
    slots: Vec<Option<Arc<Vec<f32>>>>,
    /// Point-to-point messages by (from, to), in order.
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
}

/// The shared part of an in-process group: [`LocalGroup::new`] makes one handle per rank.
pub struct LocalGroup {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// Rank `rank`'s handle on a [`LocalGroup`].
pub struct LocalComm {
    rank: usize,
    group: Arc<LocalGroup>,
}

impl LocalGroup {
    /// A group of `size` ranks: handle `i` is rank `i`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(size: usize) -> Vec<LocalComm> {
        let group = Arc::new(LocalGroup {
            size,
            state: Mutex::new(State {
                slots: vec![None; size],
                ..State::default()
            }),
            cv: Condvar::new(),
        });
        (0..size)
            .map(|rank| LocalComm {
                rank,
                group: group.clone(),
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // NOTE: a rank that panicked while holding the lock leaves plain data behind; the
        // group is still usable after `reset`.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every rank waiting in this group with an error (a rank failed mid-step).
    pub fn abort(&self) {
        self.lock().aborted = true;
        self.cv.notify_all();
    }

    /// Clears an aborted group for the next step; only when no rank is inside a collective.
    pub fn reset(&self) {
        let mut s = self.lock();
        s.aborted = false;
        s.arrived = 0;
        s.slots.iter_mut().for_each(|x| *x = None);
        s.mail.clear();
    }

    fn wait_all<'a>(&'a self, mut s: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>> {
        if s.aborted {
            bail!("another worker failed in this step");
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.size {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            return Ok(s);
        }
        let s = self
            .cv
            .wait_while(s, |s| s.generation == generation && !s.aborted)
            .unwrap_or_else(|e| e.into_inner());
        if s.generation == generation {
            bail!("another worker failed in this step");
        }
        Ok(s)
    }

    /// Every rank's contribution, in rank order, once all have given theirs.
    fn exchange(&self, rank: usize, data: Vec<f32>) -> Result<Vec<Arc<Vec<f32>>>> {
        let mut s = self.lock();
        if s.aborted {
            bail!("another worker failed in this step");
        }
        s.slots[rank] = Some(Arc::new(data));
        let mut s = self.wait_all(s)?;
        let all: Vec<Arc<Vec<f32>>> = s.slots.iter().flatten().cloned().collect();
        // NOTE: a second barrier, so that no rank overwrites its slot for the next exchange
        // before every rank has read this one.
        s = self.wait_all(s)?;
        s.slots[rank] = None;
        Ok(all)
    }
}

/// Collectives over host memory, the whole of an implementation that stages buffers through
/// the host (every one here); [`Communicator`] follows from it for every backend.
pub trait HostCollectives: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The element-wise sum over ranks, added in rank order.
    fn all_reduce_host(&self, data: Vec<f32>) -> Result<Vec<f32>>;
    /// Every rank's values one after the other.
    fn all_gather_host(&self, data: Vec<f32>) -> Result<Vec<f32>>;
    /// `root`'s values (what the other ranks pass is ignored).
    fn broadcast_host(&self, data: Vec<f32>, root: usize) -> Result<Vec<f32>>;
    fn send_host(&self, data: Vec<f32>, to: usize) -> Result<()>;
    fn recv_host(&self, from: usize) -> Result<Vec<f32>>;
    fn barrier_host(&self) -> Result<()>;
}

impl LocalComm {
    /// The group this handle belongs to (to abort or reset it).
    pub fn group(&self) -> &Arc<LocalGroup> {
        &self.group
    }
}

impl HostCollectives for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn all_reduce_host(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        let n = data.len();
        let all = self.group.exchange(self.rank, data)?;
        if all.iter().any(|p| p.len() != n) {
            bail!("all-reduce of buffers of different lengths");
        }
        let mut out = all[0].as_ref().clone();
        for p in &all[1..] {
            for (o, v) in out.iter_mut().zip(p.iter()) {
                *o += v;
            }
        }
        Ok(out)
    }

    fn all_gather_host(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        let all = self.group.exchange(self.rank, data)?;
        Ok(all.iter().flat_map(|p| p.iter().copied()).collect())
    }

    fn broadcast_host(&self, data: Vec<f32>, root: usize) -> Result<Vec<f32>> {
        if root >= self.group.size {
            bail!(
                "broadcast from rank {root} in a group of {}",
                self.group.size
            );
        }
        let mine = if self.rank == root { data } else { Vec::new() };
        let all = self.group.exchange(self.rank, mine)?;
        Ok(all[root].as_ref().clone())
    }

    fn send_host(&self, data: Vec<f32>, to: usize) -> Result<()> {
        if to >= self.group.size || to == self.rank {
            bail!("rank {} cannot send to rank {to}", self.rank);
        }
        let mut s = self.group.lock();
        if s.aborted {
            bail!("another worker failed in this step");
        }
        s.mail.entry((self.rank, to)).or_default().push_back(data);
        self.group.cv.notify_all();
        Ok(())
    }

    fn recv_host(&self, from: usize) -> Result<Vec<f32>> {
        if from >= self.group.size || from == self.rank {
            bail!("rank {} cannot receive from rank {from}", self.rank);
        }
        let key = (from, self.rank);
        let mut s = self
            .group
            .cv
            .wait_while(self.group.lock(), |s| {
                !s.aborted && s.mail.get(&key).is_none_or(|q| q.is_empty())
            })
            .unwrap_or_else(|e| e.into_inner());
        match s.mail.get_mut(&key).and_then(|q| q.pop_front()) {
            Some(data) => Ok(data),
            None => bail!("another worker failed in this step"),
        }
    }

    fn barrier_host(&self) -> Result<()> {
        let s = self.group.lock();
        self.group.wait_all(s).map(drop)
    }
}

/// `buf[..n]` on the host, checked against the buffer's length.
fn host_prefix<B: Backend>(backend: &B, buf: &B::Buf, n: usize) -> Result<Vec<f32>> {
    let mut v = backend.download_f32(buf)?;
    if v.len() < n {
        bail!("a collective over {n} values of a buffer of {}", v.len());
    }
    v.truncate(n);
    Ok(v)
}

/// Writes `head` over the start of `buf` (keeping whatever follows `head.len()`).
fn replace_prefix<B: Backend>(backend: &B, buf: &mut B::Buf, head: &[f32]) -> Result<()> {
    if backend.len(buf) == head.len() {
        *buf = backend.upload_f32(head)?;
        return Ok(());
    }
    let mut all = backend.download_f32(buf)?;
    all[..head.len()].copy_from_slice(head);
    *buf = backend.upload_f32(&all)?;
    Ok(())
}

impl<B: Backend, T: HostCollectives> Communicator<B> for T {
    fn rank(&self) -> usize {
        HostCollectives::rank(self)
    }
    fn size(&self) -> usize {
        HostCollectives::size(self)
    }
    fn all_reduce_sum(&self, backend: &B, buf: &mut B::Buf, n: usize) -> Result<()> {
        if HostCollectives::size(self) == 1 {
            return Ok(());
        }
        let sum = self.all_reduce_host(host_prefix(backend, buf, n)?)?;
        replace_prefix(backend, buf, &sum)
    }
    fn all_gather(&self, backend: &B, part: &B::Buf, n: usize) -> Result<B::Buf> {
        let all = self.all_gather_host(host_prefix(backend, part, n)?)?;
        backend.upload_f32(&all)
    }
    fn broadcast(&self, backend: &B, buf: &mut B::Buf, n: usize, root: usize) -> Result<()> {
        if HostCollectives::size(self) == 1 {
            return Ok(());
        }
        let mine = if HostCollectives::rank(self) == root {
            host_prefix(backend, buf, n)?
        } else {
            Vec::new()
        };
        let got = self.broadcast_host(mine, root)?;
        if got.len() != n {
            bail!("broadcast of {} values where {n} were expected", got.len());
        }
        replace_prefix(backend, buf, &got)
    }
    fn send(&self, backend: &B, buf: &B::Buf, n: usize, to: usize) -> Result<()> {
        self.send_host(host_prefix(backend, buf, n)?, to)
    }
    fn recv(&self, backend: &B, n: usize, from: usize) -> Result<B::Buf> {
        let data = self.recv_host(from)?;
        if data.len() != n {
            bail!(
                "received {} values from rank {from} where {n} were expected",
                data.len()
            );
        }
        backend.upload_f32(&data)
    }
    fn barrier(&self) -> Result<()> {
        self.barrier_host()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;

    /// Runs `f(rank)` on one thread per rank of a fresh group and returns the results by rank.
    fn on_ranks<T: Send>(size: usize, f: impl Fn(&LocalComm) -> T + Sync) -> Vec<T> {
        let comms = LocalGroup::new(size);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn values(rank: usize, n: usize) -> Vec<f32> {
        // NOTE: magnitudes far apart, so the order of the additions shows in the bits.
        (0..n)
            .map(|i| ((rank * 7919 + i * 104729) % 1000) as f32 * 10f32.powi(rank as i32 * 3 - 4))
            .collect()
    }

    #[test]
    fn all_reduce_adds_in_rank_order_and_every_rank_gets_the_same_bits() {
        let be = CpuBackend::new();
        for size in [1, 2, 3, 5] {
            let n = 37;
            let got = on_ranks(size, |c| {
                let mut buf = be.upload_f32(&values(c.rank, n)).unwrap();
                for _ in 0..3 {
                    // three rounds: the group is reusable
                    let mut b2 = be.upload_f32(&values(c.rank, n)).unwrap();
                    c.all_reduce_sum(&be, &mut b2, n).unwrap();
                    buf = b2;
                }
                be.download_f32(&buf).unwrap()
            });
            let mut want = values(0, n);
            for r in 1..size {
                for (w, v) in want.iter_mut().zip(values(r, n)) {
                    *w += v;
                }
            }
            for g in &got {
                assert_eq!(
                    g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "size {size}"
                );
            }
        }
    }

    #[test]
    fn all_reduce_of_a_prefix_keeps_the_rest() {
        let be = CpuBackend::new();
        let got = on_ranks(2, |c| {
            let mut buf = be
                .upload_f32(&[1.0 + c.rank as f32, 2.0, 9.0 + c.rank as f32])
                .unwrap();
            c.all_reduce_sum(&be, &mut buf, 2).unwrap();
            be.download_f32(&buf).unwrap()
        });
        assert_eq!(got, vec![vec![3.0, 4.0, 9.0], vec![3.0, 4.0, 10.0]]);
    }

    #[test]
    fn gather_broadcast_send_recv_and_barrier() {
        let be = CpuBackend::new();
        let got = on_ranks(3, |c| {
            let r = c.rank as f32;
            let part = be.upload_f32(&[r, r + 0.5]).unwrap();
            let all = be
                .download_f32(&c.all_gather(&be, &part, 2).unwrap())
                .unwrap();
            let mut b = be.upload_f32(&[10.0 * r + 1.0; 4]).unwrap();
            c.broadcast(&be, &mut b, 4, 2).unwrap();
            let b = be.download_f32(&b).unwrap();
            // a ring: each rank sends to the next and receives from the previous
            let next = (c.rank + 1) % 3;
            let prev = (c.rank + 2) % 3;
            let msg = be.upload_f32(&values(c.rank, 5)).unwrap();
            c.send(&be, &msg, 5, next).unwrap();
            let got = be.download_f32(&c.recv(&be, 5, prev).unwrap()).unwrap();
            Communicator::<CpuBackend>::barrier(c).unwrap();
            (all, b, got, prev)
        });
        for (all, b, got, prev) in got {
            assert_eq!(all, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            assert_eq!(b, vec![21.0; 4]);
            assert_eq!(got, values(prev, 5));
        }
    }

    #[test]
    fn a_failed_rank_wakes_the_others_with_an_error_and_reset_reuses_the_group() {
        let be = CpuBackend::new();
        let comms = LocalGroup::new(3);
        let group = comms[0].group().clone();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms[..2]
                .iter()
                .map(|c| {
                    s.spawn(|| {
                        let mut b = be.upload_f32(&[1.0]).unwrap();
                        c.all_reduce_sum(&be, &mut b, 1).unwrap_err().to_string()
                    })
                })
                .collect();
            let r = s.spawn(|| comms[1].recv_host(2).unwrap_err().to_string());
            std::thread::sleep(std::time::Duration::from_millis(20));
            group.abort(); // rank 2 failed before its all-reduce
            let mut v: Vec<String> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            v.push(r.join().unwrap());
            v
        });
        for e in errs {
            assert!(e.contains("another worker failed"), "{e}");
        }
        group.reset();
        let got = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| s.spawn(|| c.all_reduce_host(vec![c.rank as f32]).unwrap()))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(got, vec![vec![3.0]; 3]);
    }

    #[test]
    fn bad_ranks_and_lengths_are_errors() {
        let c = LocalGroup::new(2);
        assert!(c[0].send_host(vec![1.0], 0).is_err());
        assert!(c[0].send_host(vec![1.0], 2).is_err());
        assert!(c[0].recv_host(5).is_err());
        assert!(c[1].broadcast_host(vec![], 3).is_err());
    }
}
