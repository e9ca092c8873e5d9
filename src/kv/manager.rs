//! Per-request block tables over a [`BlockPool`].

use super::block_pool::{BlockId, BlockPool};
use std::collections::HashMap;

/// KV usage at one moment, for metrics and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvUsage {
    pub num_blocks: usize,
    pub blocks_used: usize,
    pub blocks_free: usize,
    /// Tokens whose K/V are (or are being) stored.
    pub tokens_stored: usize,
    /// Tokens stored over the slots of the allocated blocks: 1.0 means no slot is wasted.
    pub utilization: f64,
    /// Blocks used over usable blocks.
    pub usage: f64,
}

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    tables: HashMap<u64, Table>,
}

#[derive(Debug, Clone, Default)]
struct Table {
    blocks: Vec<BlockId>,
    num_tokens: usize,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0);
        KvCacheManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            tables: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Tokens the pool can hold at most (usable blocks times block size).
    pub fn capacity_tokens(&self) -> usize {
        self.pool.num_usable() * self.block_size
    }

    pub fn blocks_needed(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Makes the request's block table cover `num_tokens` tokens (its computed tokens plus the
    /// ones scheduled now), taking new blocks as needed. Returns `false`, changing nothing, when
    /// the pool has too few free blocks; the scheduler then decides whom to preempt.
    pub fn allocate_slots(&mut self, request_id: u64, num_tokens: usize) -> bool {
        let need = self.blocks_needed(num_tokens);
        let table = self.tables.entry(request_id).or_default();
        if need > table.blocks.len() {
            match self.pool.take(need - table.blocks.len()) {
                Some(new) => table.blocks.extend(new),
                None => {
                    if table.blocks.is_empty() {
                        self.tables.remove(&request_id);
                    }
                    return false;
                }
            }
        }
        table.num_tokens = table.num_tokens.max(num_tokens);
        true
    }

    /// Frees all blocks of a request (finished, aborted or preempted), tail first.
    pub fn free(&mut self, request_id: u64) {
        if let Some(t) = self.tables.remove(&request_id) {
            self.pool.release(t.blocks.into_iter().rev());
        }
    }

    pub fn block_table(&self, request_id: u64) -> &[BlockId] {
        self.tables
            .get(&request_id)
            .map(|t| t.blocks.as_slice())
            .unwrap_or(&[])
    }

    pub fn num_requests(&self) -> usize {
        self.tables.len()
    }

    pub fn usage(&self) -> KvUsage {
        let used = self.pool.num_usable() - self.pool.num_free();
        let tokens: usize = self.tables.values().map(|t| t.num_tokens).sum();
        KvUsage {
            num_blocks: self.pool.num_usable(),
            blocks_used: used,
            blocks_free: self.pool.num_free(),
            tokens_stored: tokens,
            utilization: if used == 0 {
                1.0
            } else {
                tokens as f64 / (used * self.block_size) as f64
            },
            usage: used as f64 / self.pool.num_usable() as f64,
        }
    }

    /// Checks that no block is owned twice, reference counts match the block tables, and the
    /// free list holds exactly the unowned blocks. Panics with a description otherwise.
    pub fn check_invariants(&self) {
        let n = self.pool.num_blocks();
        let mut owners = vec![0u32; n];
        for t in self.tables.values() {
            assert!(
                t.blocks.len() * self.block_size >= t.num_tokens,
                "table too short"
            );
            for &b in &t.blocks {
                assert_ne!(b, super::NULL_BLOCK, "null block in a block table");
                owners[b as usize] += 1;
            }
        }
        let free = self.pool.free_blocks();
        assert_eq!(
            free.len(),
            self.pool.num_free(),
            "free count disagrees with free list"
        );
        let mut is_free = vec![false; n];
        for b in free {
            assert!(!is_free[b as usize], "block {b} twice in the free list");
            is_free[b as usize] = true;
        }
        for b in 1..n {
            let rc = self.pool.ref_count(b as BlockId);
            assert_eq!(
                rc, owners[b],
                "block {b}: ref count {rc} but {} owners",
                owners[b]
            );
            // NOTE: without sharing (not implemented yet) a block has at most one owner.
            assert!(owners[b] <= 1, "block {b} owned {} times", owners[b]);
            assert_eq!(
                is_free[b],
                rc == 0,
                "block {b}: free-list membership disagrees with rc"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocate_grows_by_blocks() {
        let mut m = KvCacheManager::new(5, 4);
        assert!(m.allocate_slots(1, 5));
        assert_eq!(m.block_table(1).len(), 2);
        assert!(m.allocate_slots(1, 8));
        assert_eq!(m.block_table(1).len(), 2);
        assert!(m.allocate_slots(1, 9));
        assert_eq!(m.block_table(1).len(), 3);
        assert!(!m.allocate_slots(2, 8), "only one block left");
        assert_eq!(m.block_table(2).len(), 0);
        assert_eq!(m.usage().blocks_used, 3);
        assert!((m.usage().utilization - 9.0 / 12.0).abs() < 1e-12);
        m.free(1);
        assert_eq!(m.usage().blocks_free, 4);
        m.check_invariants();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u8, u16),
        Grow(u8, u16),
        Finish(u8),
        Abort(u8),
        Preempt(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..12, 1u16..80).prop_map(|(r, n)| Op::Add(r, n)),
            (0u8..12, 1u16..20).prop_map(|(r, n)| Op::Grow(r, n)),
            (0u8..12).prop_map(Op::Finish),
            (0u8..12).prop_map(Op::Abort),
            (0u8..12).prop_map(Op::Preempt),
        ]
    }

    proptest! {
        #[test]
        fn block_ownership_invariants(ops in proptest::collection::vec(op(), 1..200), bs in 1usize..9) {
            let mut m = KvCacheManager::new(40, bs);
            let mut tokens: HashMap<u64, usize> = HashMap::new();
            for o in ops {
                match o {
                    Op::Add(r, n) => {
                        let r = r as u64;
                        if !tokens.contains_key(&r) && m.allocate_slots(r, n as usize) {
                            tokens.insert(r, n as usize);
                        }
                    }
                    Op::Grow(r, n) => {
                        let r = r as u64;
                        if let Some(t) = tokens.get_mut(&r) {
                            let before = m.block_table(r).to_vec();
                            if m.allocate_slots(r, *t + n as usize) {
                                *t += n as usize;
                                // growing never moves existing blocks
                                prop_assert_eq!(&m.block_table(r)[..before.len()], &before[..]);
                            } else {
                                prop_assert_eq!(m.block_table(r), &before[..]);
                            }
                        }
                    }
                    Op::Finish(r) | Op::Abort(r) | Op::Preempt(r) => {
                        m.free(r as u64);
                        tokens.remove(&(r as u64));
                    }
                }
                m.check_invariants();
                prop_assert_eq!(m.num_requests(), tokens.len());
            }
            for r in tokens.keys() {
                m.free(*r);
            }
            m.check_invariants();
            prop_assert_eq!(m.pool().num_free(), 39);
        }
    }
}
