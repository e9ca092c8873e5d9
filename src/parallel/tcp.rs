//! Workers in other processes, on this machine or others: the messages between node 0 (the
//! engine) and another node's workers over TCP, and [`RemoteComm`], a worker's handle on a
//! group whose state lives on node 0.
//!
//! ```text
//!  node 0: engine ── Execute / Swap ──────────────────────────▶ node n: worker w
//!          proxy(w) ◀── Comm {group, op, data} ── RemoteComm ──┘  (inside the forward pass)
//!          proxy(w) ── CommDone(result) ─────────────────────▶
//!          engine ◀── Done(logits part or error) ───────────────
//! ```
//!
//! NOTE: every collective of a remote worker is run by its proxy thread on node 0 with the
//! worker's [`LocalComm`](super::LocalComm) handle, so a group spanning nodes is still one
//! `LocalGroup`: the same rank-order sums (every rank gets the same bits, single node or not),
//! the same abort when a rank fails. The price is that every byte goes through node 0 (a star,
//! not NCCL's rings): right for CPU workers and for testing the rendezvous, not a fast path.
//!
//! Where the workers' groups go through NCCL or RCCL, the collectives do not come here: the
//! connection carries the steps, the results, the groups' unique ids (`Start`, `Reset`) and
//! aborts both ways (see `engine/nodes.rs`).
//!
//! A connection is one worker's: it opens with `Hello` (the worker and a fingerprint of the
//! settings, which must match node 0's), `Loaded` (its shard's KV bytes per block and weights,
//! or why it failed), and `Start` (the pool size every worker uses, or why node 0 gave up).
//! Frames are a little-endian `u64` length and the message; a frame over 4 GiB, an unknown tag
//! or trailing bytes is a protocol error, never a panic.

use super::HostCollectives;
use crate::backend::BatchInput;
use crate::tensor::WeightStats;
use anyhow::{Context, Result, anyhow, bail};
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A worker's part of a step's logits (see `engine::runner`).
pub type LogitsPart = Option<(Range<usize>, usize, Vec<f32>)>;

/// A collective, as a remote worker asks node 0 to run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    AllReduce,
    AllGather,
    Broadcast(u32),
    Send(u32),
    Recv(u32),
    Barrier,
}

impl Op {
    /// Runs the collective on `c` with the worker's `data`.
    pub fn run(self, c: &dyn HostCollectives, data: Vec<f32>) -> Result<Vec<f32>> {
        match self {
            Op::AllReduce => c.all_reduce_host(data),
            Op::AllGather => c.all_gather_host(data),
            Op::Broadcast(root) => c.broadcast_host(data, root as usize),
            Op::Send(to) => c.send_host(data, to as usize).map(|_| Vec::new()),
            Op::Recv(from) => c.recv_host(from as usize),
            Op::Barrier => c.barrier_host().map(|_| Vec::new()),
        }
    }
}

/// The tensor-parallel (0) or pipeline (1) group of a worker.
pub const TP: u8 = 0;
pub const PP: u8 = 1;

#[derive(Debug, Clone, PartialEq)]
pub enum Msg {
    /// worker → node 0, first: which worker this connection is, and its settings.
    Hello { worker: u32, fingerprint: String },
    /// worker → node 0: its KV bytes per block and weights, once loaded.
    Loaded(Result<(u64, WeightStats), String>),
    /// node 0 → worker: the pool's blocks and, where the groups go through NCCL or RCCL, the
    /// unique id of every group of the split (`ccl::NodeCcl`); or why node 0 gave up.
    Start(Result<(u64, Vec<Vec<u8>>), String>),
    /// node 0 → worker: a step.
    Execute(BatchInput),
    /// node 0 → worker: swap preemption's block pairs, out (device, host) and in.
    Swap(Vec<(u32, u32)>, Vec<(u32, u32)>),
    /// worker → node 0: the step's (or the swap's) result.
    Done(Result<LogitsPart, String>),
    /// worker → node 0: a collective on one of its groups.
    Comm { group: u8, op: Op, data: Vec<f32> },
    /// node 0 → worker: the collective's result.
    CommDone(Result<Vec<f32>, String>),
    /// worker → node 0: it failed in this step; wake everyone waiting for it. node 0 → a
    /// worker whose groups go through NCCL or RCCL: abort them, if they are still those made
    /// the given number of times (`ccl::NodeCcl::generation`; 0 where unused).
    Abort(u64),
    /// node 0 → a worker whose groups go through NCCL or RCCL, after a failed step: make
    /// them again from these ids (one per group).
    Reset(Vec<Vec<u8>>),
}

const MAX_FRAME: u64 = 4 << 30;

#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn u32s(&mut self, v: &[u32]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|x| self.u32(*x));
    }
    fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        v.iter().for_each(|x| self.u32(x.to_bits()));
    }
    fn blobs(&mut self, v: &[Vec<u8>]) {
        self.u64(v.len() as u64);
        for b in v {
            self.u64(b.len() as u64);
            self.0.extend_from_slice(b);
        }
    }
    fn pairs(&mut self, v: &[(u32, u32)]) {
        self.u64(v.len() as u64);
        for &(a, b) in v {
            self.u32(a);
            self.u32(b);
        }
    }
    /// A result: 0 and the value, or 1 and the error's text.
    fn result<T>(&mut self, r: &Result<T, String>, ok: impl FnOnce(&mut Self, &T)) {
        match r {
            Ok(v) => {
                self.u8(0);
                ok(self, v);
            }
            Err(e) => {
                self.u8(1);
                self.str(e);
            }
        }
    }
}

struct Dec<'a> {
    b: &'a [u8],
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            bail!("a message ends early");
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    /// A length of items of `size` bytes each, checked against what is left.
    fn len(&mut self, size: usize) -> Result<usize> {
        let n = self.u64()?;
        match usize::try_from(n).ok().and_then(|n| n.checked_mul(size)) {
            Some(bytes) if bytes <= self.b.len() => Ok(n as usize),
            _ => bail!("a message claims {n} items where it has not the bytes"),
        }
    }
    fn str(&mut self) -> Result<String> {
        let n = self.len(1)?;
        String::from_utf8(self.take(n)?.to_vec()).context("a message's text is not UTF-8")
    }
    fn u32s(&mut self) -> Result<Vec<u32>> {
        let n = self.len(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.len(4)?;
        (0..n).map(|_| self.u32().map(f32::from_bits)).collect()
    }
    fn blobs(&mut self) -> Result<Vec<Vec<u8>>> {
        let n = self.len(8)?;
        (0..n)
            .map(|_| {
                let len = self.len(1)?;
                Ok(self.take(len)?.to_vec())
            })
            .collect()
    }
    fn pairs(&mut self) -> Result<Vec<(u32, u32)>> {
        let n = self.len(8)?;
        (0..n).map(|_| Ok((self.u32()?, self.u32()?))).collect()
    }
    fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?).context("a size does not fit this machine")
    }
    fn result<T>(&mut self, ok: impl FnOnce(&mut Self) -> Result<T>) -> Result<Result<T, String>> {
        match self.u8()? {
            0 => Ok(Ok(ok(self)?)),
            1 => Ok(Err(self.str()?)),
            t => bail!("a result tagged {t}"),
        }
    }
}

impl Msg {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        match self {
            Msg::Hello {
                worker,
                fingerprint,
            } => {
                e.u8(1);
                e.u32(*worker);
                e.str(fingerprint);
            }
            Msg::Loaded(r) => {
                e.u8(2);
                e.result(r, |e, (per_block, stats)| {
                    e.u64(*per_block);
                    e.u64(stats.bytes);
                    e.u64(stats.params);
                    e.u64(stats.by_type.len() as u64);
                    for (t, b) in &stats.by_type {
                        e.str(t);
                        e.u64(*b);
                    }
                });
            }
            Msg::Start(r) => {
                e.u8(3);
                e.result(r, |e, (n, ids)| {
                    e.u64(*n);
                    e.blobs(ids);
                });
            }
            Msg::Execute(b) => {
                e.u8(4);
                for v in [
                    &b.token_ids,
                    &b.positions,
                    &b.slot_mapping,
                    &b.query_start,
                    &b.seq_lens,
                    &b.block_tables,
                    &b.logits_rows,
                ] {
                    e.u32s(v);
                }
                e.u64(b.max_blocks as u64);
            }
            Msg::Swap(out, inn) => {
                e.u8(5);
                e.pairs(out);
                e.pairs(inn);
            }
            Msg::Done(r) => {
                e.u8(6);
                e.result(r, |e, part| match part {
                    None => e.u8(0),
                    Some((range, cols, data)) => {
                        e.u8(1);
                        e.u64(range.start as u64);
                        e.u64(range.end as u64);
                        e.u64(*cols as u64);
                        e.f32s(data);
                    }
                });
            }
            Msg::Comm { group, op, data } => {
                e.u8(7);
                e.u8(*group);
                let (code, arg) = match *op {
                    Op::AllReduce => (0, 0),
                    Op::AllGather => (1, 0),
                    Op::Broadcast(r) => (2, r),
                    Op::Send(r) => (3, r),
                    Op::Recv(r) => (4, r),
                    Op::Barrier => (5, 0),
                };
                e.u8(code);
                e.u32(arg);
                e.f32s(data);
            }
            Msg::CommDone(r) => {
                e.u8(8);
                e.result(r, |e, v| e.f32s(v));
            }
            Msg::Abort(g) => {
                e.u8(9);
                e.u64(*g);
            }
            Msg::Reset(ids) => {
                e.u8(10);
                e.blobs(ids);
            }
        }
        e.0
    }

    /// The message's kind, for protocol errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::Loaded(_) => "Loaded",
            Msg::Start(_) => "Start",
            Msg::Execute(_) => "Execute",
            Msg::Swap(..) => "Swap",
            Msg::Done(_) => "Done",
            Msg::Comm { .. } => "Comm",
            Msg::CommDone(_) => "CommDone",
            Msg::Abort(_) => "Abort",
            Msg::Reset(_) => "Reset",
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Msg> {
        let mut d = Dec { b: bytes };
        let msg = match d.u8()? {
            1 => Msg::Hello {
                worker: d.u32()?,
                fingerprint: d.str()?,
            },
            2 => Msg::Loaded(d.result(|d| {
                let per_block = d.u64()?;
                let mut stats = WeightStats {
                    bytes: d.u64()?,
                    params: d.u64()?,
                    ..WeightStats::default()
                };
                for _ in 0..d.len(16)? {
                    let t = d.str()?;
                    stats.by_type.insert(t, d.u64()?);
                }
                Ok((per_block, stats))
            })?),
            3 => Msg::Start(d.result(|d| Ok((d.u64()?, d.blobs()?)))?),
            4 => {
                let mut v: Vec<Vec<u32>> = (0..7).map(|_| d.u32s()).collect::<Result<_>>()?;
                let logits_rows = v.pop().unwrap_or_default();
                let mut v = v.into_iter();
                let mut next = || v.next().unwrap_or_default();
                Msg::Execute(BatchInput {
                    token_ids: next(),
                    positions: next(),
                    slot_mapping: next(),
                    query_start: next(),
                    seq_lens: next(),
                    block_tables: next(),
                    logits_rows,
                    max_blocks: d.usize()?,
                    // NOTE: workers on other nodes load no LoRA adapters (the runner over
                    // workers refuses them), so every row is the base model's.
                    lora_slots: Vec::new(),
                })
            }
            5 => Msg::Swap(d.pairs()?, d.pairs()?),
            6 => Msg::Done(d.result(|d| {
                Ok(match d.u8()? {
                    0 => None,
                    1 => {
                        let range = d.usize()?..d.usize()?;
                        let cols = d.usize()?;
                        Some((range, cols, d.f32s()?))
                    }
                    t => bail!("a logits part tagged {t}"),
                })
            })?),
            7 => {
                let group = d.u8()?;
                if group != TP && group != PP {
                    bail!("a collective on group {group}");
                }
                let (code, arg) = (d.u8()?, d.u32()?);
                let op = match code {
                    0 => Op::AllReduce,
                    1 => Op::AllGather,
                    2 => Op::Broadcast(arg),
                    3 => Op::Send(arg),
                    4 => Op::Recv(arg),
                    5 => Op::Barrier,
                    c => bail!("an unknown collective {c}"),
                };
                Msg::Comm {
                    group,
                    op,
                    data: d.f32s()?,
                }
            }
            8 => Msg::CommDone(d.result(|d| d.f32s())?),
            9 => Msg::Abort(d.u64()?),
            10 => Msg::Reset(d.blobs()?),
            t => bail!("an unknown message {t}"),
        };
        if !d.b.is_empty() {
            bail!("{} bytes after a message", d.b.len());
        }
        Ok(msg)
    }
}

/// Writes one frame and flushes it.
pub fn write_msg(w: &mut impl Write, msg: &Msg) -> Result<()> {
    let body = msg.encode();
    w.write_all(&(body.len() as u64).to_le_bytes())?;
    w.write_all(&body)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame: `None` where the peer closed the connection between frames.
pub fn read_msg(r: &mut impl Read) -> Result<Option<Msg>> {
    let mut len = [0u8; 8];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME {
        bail!("a frame of {len} bytes (at most {MAX_FRAME})");
    }
    // NOTE: read as it comes (reserving at most 64 MiB ahead), so that a length a peer merely
    // claims allocates little
    let mut body = Vec::with_capacity(len.min(64 << 20) as usize);
    r.take(len).read_to_end(&mut body)?;
    if body.len() as u64 != len {
        bail!("the connection closed mid-message");
    }
    Msg::decode(&body).map(Some)
}

/// One connection, both ways.
pub struct Conn {
    pub reader: BufReader<TcpStream>,
    pub writer: BufWriter<TcpStream>,
    /// Jobs (Execute, Swap) that arrived while a collective waited for its answer: with
    /// pipeline parallelism node 0 sends the next step while this one runs.
    pub queued: std::collections::VecDeque<Msg>,
}

impl Conn {
    pub fn new(stream: TcpStream) -> Result<Conn> {
        // NOTE: collectives are small and latency-bound: no Nagle delay.
        stream.set_nodelay(true)?;
        Ok(Conn {
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::new(stream),
            queued: Default::default(),
        })
    }

    /// Connects to `addr`, retrying until `deadline` (node 0 may not listen yet).
    pub fn connect(addr: SocketAddr, deadline: Instant) -> Result<Conn> {
        loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => return Conn::new(s),
                Err(e) if Instant::now() >= deadline => {
                    return Err(anyhow!(e)).with_context(|| {
                        format!("cannot reach node 0 at {addr} (--master-addr, --master-port)")
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    pub fn send(&mut self, msg: &Msg) -> Result<()> {
        write_msg(&mut self.writer, msg)
    }

    /// The next message; the connection closing is an error here.
    pub fn recv(&mut self) -> Result<Msg> {
        read_msg(&mut self.reader)?.context("the other node closed the connection")
    }

    /// Waits at most until `deadline` for each read from now on (`None`: forever).
    pub fn read_deadline(&self, deadline: Option<Instant>) -> Result<()> {
        let t = deadline.map(|d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        self.reader.get_ref().set_read_timeout(t)?;
        Ok(())
    }
}

/// `host:port` resolved, for the error messages too.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve --master-addr {host}"))?
        .next()
        .with_context(|| format!("--master-addr {host} has no address"))
}

/// A worker's handle on one of its groups when the group lives on node 0: every collective is
/// a request over the worker's connection, answered when node 0 has run it.
pub struct RemoteComm {
    pub link: Arc<Mutex<Conn>>,
    pub group: u8,
    pub rank: usize,
    pub size: usize,
}

impl RemoteComm {
    fn call(&self, op: Op, data: Vec<f32>) -> Result<Vec<f32>> {
        let mut c = self.link.lock().unwrap_or_else(|e| e.into_inner());
        c.send(&Msg::Comm {
            group: self.group,
            op,
            data,
        })?;
        loop {
            match c.recv()? {
                Msg::CommDone(r) => return r.map_err(|e| anyhow!(e)),
                m @ (Msg::Execute(_) | Msg::Swap(..)) => c.queued.push_back(m),
                m => bail!("node 0 answered a collective with {}", m.name()),
            }
        }
    }
}

impl HostCollectives for RemoteComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_host(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        self.call(Op::AllReduce, data)
    }
    fn all_gather_host(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        self.call(Op::AllGather, data)
    }
    fn broadcast_host(&self, data: Vec<f32>, root: usize) -> Result<Vec<f32>> {
        self.call(Op::Broadcast(root as u32), data)
    }
    fn send_host(&self, data: Vec<f32>, to: usize) -> Result<()> {
        self.call(Op::Send(to as u32), data).map(drop)
    }
    fn recv_host(&self, from: usize) -> Result<Vec<f32>> {
        self.call(Op::Recv(from as u32), Vec::new())
    }
    fn barrier_host(&self) -> Result<()> {
        self.call(Op::Barrier, Vec::new()).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_message() -> Vec<Msg> {
        let mut stats = WeightStats {
            bytes: 1234,
            params: 617,
            ..WeightStats::default()
        };
        stats.by_type.insert("Q4_1".into(), 1000);
        stats.by_type.insert("f32".into(), 234);
        vec![
            Msg::Hello {
                worker: 3,
                fingerprint: "llama 30 layers".into(),
            },
            Msg::Loaded(Ok((4096, stats))),
            Msg::Loaded(Err("no such file".into())),
            Msg::Start(Ok((812, vec![]))),
            Msg::Start(Ok((3, vec![vec![7; 128], vec![0, 1, 2]]))),
            Msg::Start(Err("node 1 differs".into())),
            Msg::Execute(BatchInput {
                token_ids: vec![5, 6, 7],
                positions: vec![0, 1, 2],
                slot_mapping: vec![16, 17, 18],
                query_start: vec![0, 3],
                seq_lens: vec![3],
                block_tables: vec![1, 0],
                max_blocks: 2,
                logits_rows: vec![2],
                lora_slots: Vec::new(),
            }),
            Msg::Swap(vec![(1, 2), (3, 4)], vec![]),
            Msg::Done(Ok(None)),
            Msg::Done(Ok(Some((
                100..200,
                101,
                vec![0.5, -1.25, f32::MIN_POSITIVE],
            )))),
            Msg::Done(Err("a position past the tables".into())),
            Msg::Comm {
                group: PP,
                op: Op::Recv(1),
                data: vec![],
            },
            Msg::Comm {
                group: TP,
                op: Op::Broadcast(2),
                data: vec![1.0, f32::NAN.copysign(-1.0)],
            },
            Msg::CommDone(Ok(vec![3.5; 5])),
            Msg::CommDone(Err("another worker failed".into())),
            Msg::Abort(0),
            Msg::Abort(3),
            Msg::Reset(vec![vec![9; 128], vec![]]),
        ]
    }

    #[test]
    fn every_message_survives_a_round_trip() {
        let mut wire = Vec::new();
        let msgs = every_message();
        for m in &msgs {
            write_msg(&mut wire, m).unwrap();
        }
        let mut r = wire.as_slice();
        for m in &msgs {
            let got = read_msg(&mut r).unwrap().unwrap();
            // NOTE: compared as bytes: NaN != NaN, but its bits must come through
            assert_eq!(got.encode(), m.encode(), "{}", m.name());
        }
        assert!(read_msg(&mut r).unwrap().is_none(), "a clean end");
    }

    #[test]
    fn damaged_frames_are_errors_not_panics() {
        for m in every_message() {
            let body = m.encode();
            // every cut short of the whole message, and one byte too many
            for cut in 0..body.len() {
                assert!(
                    Msg::decode(&body[..cut]).is_err(),
                    "{} cut at {cut}",
                    m.name()
                );
            }
            let mut long = body.clone();
            long.push(0);
            assert!(Msg::decode(&long).is_err(), "{}", m.name());
        }
        assert!(Msg::decode(&[42]).is_err());
        // a length that claims more than there is, and a frame too large to accept
        let mut lie = vec![7u8, 0, 0, 0, 0, 0, 0];
        lie.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(Msg::decode(&lie).is_err());
        let mut huge = (MAX_FRAME + 1).to_le_bytes().to_vec();
        huge.push(9);
        let e = read_msg(&mut huge.as_slice()).unwrap_err().to_string();
        assert!(e.contains("a frame of"), "{e}");
        // a frame cut mid-body is an error, not a clean end
        let mut cut = Vec::new();
        write_msg(&mut cut, &Msg::Abort(1)).unwrap();
        write_msg(&mut cut, &Msg::Start(Ok((1, vec![])))).unwrap();
        cut.pop();
        let mut r = cut.as_slice();
        assert_eq!(read_msg(&mut r).unwrap(), Some(Msg::Abort(1)));
        assert!(read_msg(&mut r).is_err());
    }
}
