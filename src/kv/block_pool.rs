//! A pool of KV blocks with O(1) take and return and reference counts.
//!
//! The free blocks form an intrusive doubly linked list over two index arrays (as vLLM v1's
//! `FreeKVCacheBlockQueue`), so that a block can later be taken out of the middle of the list in
//! O(1) when prefix caching revives a freed block that still holds useful K/V.
//!
//! ```text
//!   head -> b5 <-> b2 <-> b9 <-> ... <-> b7 <- tail      take from head, return to tail
//! ```

/// Index of a physical block in the KV pool.
pub type BlockId = u32;

/// Block 0 is never handed out: padded block-table entries point at it, so a kernel that reads
/// past a sequence's end reads harmless memory instead of another request's cache.
pub const NULL_BLOCK: BlockId = 0;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
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
            head: NIL,
            tail: NIL,
            num_free: 0,
        };
        // NOTE: the null block holds a permanent reference so it is never free.
        pool.ref_cnt[NULL_BLOCK as usize] = 1;
        for b in 1..n as u32 {
            pool.push_back(b);
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

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_cnt[b as usize]
    }

    /// Takes `n` blocks, all or nothing. `None` when fewer than `n` are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Adds a reference to a block in use (for sharing between sequences).
    pub fn incref(&mut self, b: BlockId) {
        assert!(self.ref_cnt[b as usize] > 0, "incref of free block {b}");
        self.ref_cnt[b as usize] += 1;
    }

    /// Drops one reference to each block; a block whose count reaches zero returns to the pool.
    /// NOTE: callers pass a request's blocks tail first, so that the ends of sequences are the
    /// first to be reused, keeping prefixes (future prefix-cache hits) alive longest.
    pub fn release(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            assert_ne!(b, NULL_BLOCK, "the null block is never released");
            let rc = &mut self.ref_cnt[b as usize];
            assert!(*rc > 0, "double free of block {b}");
            *rc -= 1;
            if *rc == 0 {
                self.push_back(b);
            }
        }
    }

    fn push_back(&mut self, b: BlockId) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.num_free -= 1;
    }

    /// Walks the free list (for tests and invariant checks).
    pub fn free_blocks(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.head;
        while b != NIL {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_and_release_round_trip() {
        let mut p = BlockPool::new(5);
        assert_eq!(p.num_free(), 4);
        let a = p.take(3).unwrap();
        assert!(!a.contains(&NULL_BLOCK));
        assert_eq!(p.num_free(), 1);
        assert!(p.take(2).is_none(), "all or nothing");
        assert_eq!(p.num_free(), 1);
        p.release(a.iter().rev().copied());
        assert_eq!(p.num_free(), 4);
        let mut free = p.free_blocks();
        free.sort();
        assert_eq!(free, vec![1, 2, 3, 4]);
    }

    #[test]
    fn shared_block_returns_on_last_reference() {
        let mut p = BlockPool::new(3);
        let b = p.take(1).unwrap()[0];
        p.incref(b);
        p.release([b]);
        assert_eq!(p.num_free(), 1);
        p.release([b]);
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut p = BlockPool::new(3);
        let b = p.take(1).unwrap()[0];
        p.release([b]);
        p.release([b]);
    }
}
