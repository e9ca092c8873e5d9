//! A pool of KV blocks with O(1) take and return and reference counts.
//!
//! Unowned blocks sit in one of two intrusive doubly linked lists over shared index arrays (as
//! vLLM v1's `FreeKVCacheBlockQueue`): `plain` holds blocks with nothing worth keeping, `cached`
//! holds blocks that still hold K/V a prefix-cache hit may revive, least recently freed first.
//! A revived block is unlinked from the middle of `cached` in O(1).
//!
//! ```text
//!   plain:  head -> b5 <-> b2 <-> ... <- tail      taken first
//!   cached: head -> b9 <-> b7 <-> ... <- tail      taken (evicted) only when plain is empty,
//!                                                   the least recently freed first
//! ```

/// Index of a physical block in the KV pool.
pub type BlockId = u32;

/// Block 0 is never handed out: padded block-table entries point at it, so a kernel that reads
/// past a sequence's end reads harmless memory instead of another request's cache.
pub const NULL_BLOCK: BlockId = 0;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

/// Which list an unowned block is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeKind {
    Plain,
    Cached,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    /// The list each unowned block is in (meaningless while the block is owned).
    kind: Vec<FreeKind>,
    plain: List,
    cached: List,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, block 0 reserved as the null block.
    pub fn new(num_blocks: usize) -> Self {
        assert!(
            num_blocks >= 2,
            "a KV pool needs at least 2 blocks (one is the null block)"
        );
        assert!(num_blocks < NIL as usize, "too many KV blocks");
        let n = num_blocks;
        let mut pool = BlockPool {
            ref_cnt: vec![0; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            kind: vec![FreeKind::Plain; n],
            plain: List::EMPTY,
            cached: List::EMPTY,
        };
        // NOTE: the null block holds a permanent reference so it is never free.
        pool.ref_cnt[NULL_BLOCK as usize] = 1;
        for b in 1..n as u32 {
            pool.push_back(b, FreeKind::Plain);
        }
        pool
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks that can be handed out (the null block excluded).
    pub fn num_usable(&self) -> usize {
        self.ref_cnt.len() - 1
    }

    /// Blocks that can be taken now: plain ones and evictable cached ones.
    pub fn num_free(&self) -> usize {
        self.plain.len + self.cached.len
    }

    /// Unowned blocks that still hold reusable K/V.
    pub fn num_cached_free(&self) -> usize {
        self.cached.len
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_cnt[b as usize]
    }

    /// Takes `n` blocks, all or nothing, plain ones first, then the least recently freed
    /// cached ones. `None` when fewer than `n` are free. The caller forgets what the evicted
    /// blocks held: `evicted` receives each block taken from the cached list.
    pub fn take(&mut self, n: usize, mut evicted: impl FnMut(BlockId)) -> Option<Vec<BlockId>> {
        if n > self.num_free() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = if self.plain.head != NIL {
                self.plain.head
            } else {
                let b = self.cached.head;
                evicted(b);
                b
            };
            self.unlink(b);
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Adds a reference to a block: an owned one is shared, an unowned cached one is revived
    /// (taken out of the middle of the cached list).
    pub fn touch(&mut self, b: BlockId) {
        assert_ne!(b, NULL_BLOCK, "the null block is never shared");
        if self.ref_cnt[b as usize] == 0 {
            assert_eq!(
                self.kind[b as usize],
                FreeKind::Cached,
                "touch of plain free block {b}"
            );
            self.unlink(b);
        }
        self.ref_cnt[b as usize] += 1;
    }

    /// Drops one reference to `b`. When it was the last, the block joins the tail of the
    /// `kind` list and `true` is returned.
    pub fn release(&mut self, b: BlockId, kind: FreeKind) -> bool {
        assert_ne!(b, NULL_BLOCK, "the null block is never released");
        let rc = &mut self.ref_cnt[b as usize];
        assert!(*rc > 0, "double free of block {b}");
        *rc -= 1;
        if *rc == 0 {
            self.push_back(b, kind);
            true
        } else {
            false
        }
    }

    /// Moves every unowned cached block to the plain list (the prefix cache was reset).
    pub fn forget_cached(&mut self) {
        while self.cached.head != NIL {
            let b = self.cached.head;
            self.unlink(b);
            self.push_back(b, FreeKind::Plain);
        }
    }

    fn list(&mut self, kind: FreeKind) -> &mut List {
        match kind {
            FreeKind::Plain => &mut self.plain,
            FreeKind::Cached => &mut self.cached,
        }
    }

    fn push_back(&mut self, b: BlockId, kind: FreeKind) {
        self.kind[b as usize] = kind;
        let tail = self.list(kind).tail;
        self.prev[b as usize] = tail;
        self.next[b as usize] = NIL;
        if tail == NIL {
            self.list(kind).head = b;
        } else {
            self.next[tail as usize] = b;
        }
        let l = self.list(kind);
        l.tail = b;
        l.len += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let kind = self.kind[b as usize];
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.list(kind).head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.list(kind).tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.list(kind).len -= 1;
    }

    /// Walks one free list head to tail (for tests and invariant checks).
    pub fn free_list(&self, kind: FreeKind) -> Vec<BlockId> {
        let l = match kind {
            FreeKind::Plain => self.plain,
            FreeKind::Cached => self.cached,
        };
        let mut out = Vec::with_capacity(l.len);
        let mut b = l.head;
        while b != NIL {
            assert_eq!(self.kind[b as usize], kind, "block {b} in the wrong list");
            out.push(b);
            b = self.next[b as usize];
        }
        assert_eq!(out.len(), l.len, "list length disagrees with its count");
        out
    }

    /// Every free block, plain then cached.
    pub fn free_blocks(&self) -> Vec<BlockId> {
        let mut out = self.free_list(FreeKind::Plain);
        out.extend(self.free_list(FreeKind::Cached));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release_all(p: &mut BlockPool, blocks: &[BlockId], kind: FreeKind) {
        for &b in blocks.iter().rev() {
            p.release(b, kind);
        }
    }

    #[test]
    fn take_and_release_round_trip() {
        let mut p = BlockPool::new(5);
        assert_eq!(p.num_free(), 4);
        let a = p.take(3, |_| panic!("nothing to evict")).unwrap();
        assert!(!a.contains(&NULL_BLOCK));
        assert_eq!(p.num_free(), 1);
        assert!(p.take(2, |_| {}).is_none(), "all or nothing");
        assert_eq!(p.num_free(), 1);
        release_all(&mut p, &a, FreeKind::Plain);
        assert_eq!(p.num_free(), 4);
        let mut free = p.free_blocks();
        free.sort();
        assert_eq!(free, vec![1, 2, 3, 4]);
    }

    #[test]
    fn shared_block_returns_on_last_reference() {
        let mut p = BlockPool::new(3);
        let b = p.take(1, |_| {}).unwrap()[0];
        p.touch(b);
        assert!(!p.release(b, FreeKind::Plain));
        assert_eq!(p.num_free(), 1);
        assert!(p.release(b, FreeKind::Plain));
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn plain_blocks_go_before_cached_ones_and_cached_ones_in_lru_order() {
        let mut p = BlockPool::new(6);
        let a = p.take(5, |_| {}).unwrap();
        // a[0..3] hold a prefix (freed tail first), a[3..5] nothing worth keeping
        release_all(&mut p, &a[..3], FreeKind::Cached);
        release_all(&mut p, &a[3..], FreeKind::Plain);
        assert_eq!(p.num_cached_free(), 3);
        let mut evicted = Vec::new();
        let got = p.take(3, |b| evicted.push(b)).unwrap();
        assert_eq!(&got[..2], &[a[4], a[3]], "plain first");
        assert_eq!(evicted, vec![a[2]], "then the tail of the prefix");
        // revive the head of the prefix from the middle of nothing else
        p.touch(a[0]);
        assert_eq!(p.free_list(FreeKind::Cached), vec![a[1]]);
        assert_eq!(p.ref_count(a[0]), 1);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut p = BlockPool::new(3);
        let b = p.take(1, |_| {}).unwrap()[0];
        p.release(b, FreeKind::Plain);
        p.release(b, FreeKind::Plain);
    }

    #[test]
    #[should_panic(expected = "touch of plain free block")]
    fn a_plain_free_block_cannot_be_revived() {
        let mut p = BlockPool::new(3);
        p.touch(1);
    }
}
