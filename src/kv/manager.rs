//! Per-request block tables over a [`BlockPool`], and the prefix cache that lets requests share
//! the blocks of a common prefix.
//!
//! Prefix caching (vLLM v1's design): every full block is named by a hash chained over the
//! previous block's hash and its own token ids, so equal hashes mean equal prefixes and thus
//! equal K/V. A block is registered under its hash as soon as it is allocated for tokens that
//! fill it (its K/V are written in the same step, before any attention reads them, since each
//! layer writes the whole batch's K/V first). A new request looks its prompt up block by block
//! and takes the blocks it finds (reference count up) instead of computing them. A freed block
//! keeps its hash and contents, parked in the pool's cached list until a hit revives it or a
//! new allocation evicts it.
//!
//! ```text
//!   tokens  [t0 .. t15][t16 .. t31][t32 .. t40]
//!   hash     h0=H(root,t0..)  h1=H(h0,t16..)   (partial: no hash, never shared)
//!   table    [ b7 ][ b3 ][ b12 ]        b7, b3 may be in other tables too
//! ```

use super::block_pool::{BlockId, BlockPool, FreeKind};
use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// A block's identity: SHA-256 over the chain of token ids up to its end (and the root that
/// scopes who may share it). NOTE: a cryptographic hash, as vLLM's default, so that no prompt
/// can be crafted to collide with another user's and read its K/V.
pub type BlockHash = [u8; 32];

/// KV usage at one moment, for metrics and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvUsage {
    pub num_blocks: usize,
    pub blocks_used: usize,
    pub blocks_free: usize,
    /// Tokens whose K/V are (or are being) stored, counted once per request (a shared block
    /// counts for each request that holds it).
    pub tokens_stored: usize,
    /// Tokens stored over the slots of the allocated blocks: 1.0 means no slot is wasted; above
    /// 1.0 when sharing stores several requests' tokens in one block.
    pub utilization: f64,
    /// Blocks used over usable blocks.
    pub usage: f64,
}

/// Prefix-cache lookups since the start, in tokens (vLLM's `prefix_cache_queries` and `_hits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCacheStats {
    /// Tokens of the requests that looked their prefix up.
    pub queries: u64,
    /// Of those, tokens found in the cache (not computed).
    pub hits: u64,
}

impl PrefixCacheStats {
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

/// The cached blocks a prompt starts with, found by [`KvCacheManager::cached_prefix`].
#[derive(Debug, Clone, Default)]
pub struct CachedPrefix {
    pub blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
}

impl CachedPrefix {
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
}

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    tables: HashMap<u64, Table>,
    /// Freed blocks keep their hash and may be revived (prefix caching on).
    keep_freed: bool,
    /// Hash to the one block registered under it.
    cached: HashMap<BlockHash, BlockId>,
    /// The hash each block is registered under: `block_hash[b] == Some(h)` iff `cached[h] == b`.
    block_hash: Vec<Option<BlockHash>>,
    stats: PrefixCacheStats,
    /// Host blocks for swapped-out requests (swap preemption): the free ones, as a stack.
    host_free: Vec<u32>,
    host_blocks: usize,
    /// Requests whose blocks are in host memory.
    swapped: HashMap<u64, Swapped>,
}

/// A swapped-out request: its table with host blocks in place of device blocks.
#[derive(Debug, Clone)]
struct Swapped {
    host: Vec<u32>,
    num_tokens: usize,
    root: Option<u64>,
    hashes: Vec<BlockHash>,
}

#[derive(Debug, Clone, Default)]
struct Table {
    blocks: Vec<BlockId>,
    num_tokens: usize,
    /// `Some`: the request's full blocks are registered in the cache under this root.
    root: Option<u64>,
    /// Hashes of the request's full blocks so far (when `root` is `Some`).
    hashes: Vec<BlockHash>,
}

fn hash_block(parent: Option<&BlockHash>, root: u64, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    match parent {
        Some(p) => h.update(p),
        None => h.update(root.to_le_bytes()),
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

impl KvCacheManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens. `prefix_caching`: freed blocks
    /// stay revivable (otherwise only requests alive at the same time share blocks).
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0);
        KvCacheManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            tables: HashMap::new(),
            keep_freed: prefix_caching,
            cached: HashMap::new(),
            block_hash: vec![None; num_blocks],
            stats: PrefixCacheStats::default(),
            host_free: Vec::new(),
            host_blocks: 0,
            swapped: HashMap::new(),
        }
    }

    /// The same manager with `host_blocks` blocks of host memory for swapped-out requests.
    pub fn with_swap_space(mut self, host_blocks: usize) -> Self {
        assert!(host_blocks < u32::MAX as usize, "too many host blocks");
        self.host_blocks = host_blocks;
        self.host_free = (0..host_blocks as u32).rev().collect();
        self
    }

    /// Host blocks free for swapping out.
    pub fn num_free_host_blocks(&self) -> usize {
        self.host_free.len()
    }

    /// Moves a request's blocks to host memory: each device block is paired with a host block
    /// (the caller copies them before the device blocks are written again) and released.
    /// `None`, changing nothing, when the request holds no blocks or the host pool is too
    /// small (the caller recomputes instead).
    pub fn swap_out(&mut self, request_id: u64) -> Option<Vec<(BlockId, u32)>> {
        let t = self.tables.get(&request_id)?;
        if t.blocks.len() > self.host_free.len() {
            return None;
        }
        let t = self.tables.remove(&request_id)?;
        let host: Vec<u32> = (0..t.blocks.len())
            .map(|_| self.host_free.pop().expect("checked above"))
            .collect();
        let pairs = t.blocks.iter().copied().zip(host.iter().copied()).collect();
        self.release_blocks(t.blocks);
        self.swapped.insert(
            request_id,
            Swapped {
                host,
                num_tokens: t.num_tokens,
                root: t.root,
                hashes: t.hashes,
            },
        );
        Some(pairs)
    }

    /// Brings a swapped-out request back with a table covering `num_tokens` of `tokens`: each
    /// host block is paired with a new device block (the caller copies them before the step
    /// runs), and the host blocks are free again. `None`, changing nothing, when too few device
    /// blocks are free.
    pub fn swap_in(
        &mut self,
        request_id: u64,
        tokens: &[u32],
        num_tokens: usize,
    ) -> Option<Vec<(u32, BlockId)>> {
        let s = self.swapped.get(&request_id)?;
        let need = self.blocks_needed(num_tokens).max(s.host.len());
        if need > self.pool.num_free() {
            return None;
        }
        let s = self.swapped.remove(&request_id)?;
        // NOTE: the copies are private: their blocks are not registered under their hashes
        // (the originals may still be), but blocks filled from now on are.
        self.tables.insert(
            request_id,
            Table {
                blocks: Vec::new(),
                num_tokens: s.num_tokens,
                root: s.root,
                hashes: s.hashes,
            },
        );
        self.grow(request_id, tokens, num_tokens, need);
        let blocks = &self.tables[&request_id].blocks;
        let pairs = s.host.iter().copied().zip(blocks.iter().copied()).collect();
        self.host_free.extend(s.host);
        Some(pairs)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn prefix_caching(&self) -> bool {
        self.keep_freed
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Tokens the pool can hold at most (usable blocks times block size).
    pub fn capacity_tokens(&self) -> usize {
        self.pool.num_usable() * self.block_size
    }

    pub fn blocks_needed(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The longest run of cached blocks `tokens` starts with, under `root`. It covers whole
    /// blocks and stops before the last token, which must be computed to give logits.
    pub fn cached_prefix(&self, tokens: &[u32], root: u64) -> CachedPrefix {
        let mut out = CachedPrefix::default();
        let full = tokens.len().saturating_sub(1) / self.block_size;
        for chunk in tokens.chunks_exact(self.block_size).take(full) {
            let h = hash_block(out.hashes.last(), root, chunk);
            let Some(&b) = self.cached.get(&h) else { break };
            out.blocks.push(b);
            out.hashes.push(h);
        }
        out
    }

    /// Counts one lookup of `queried` tokens of which `hit` were found.
    pub fn record_prefix_query(&mut self, queried: usize, hit: usize) {
        self.stats.queries += queried as u64;
        self.stats.hits += hit as u64;
    }

    /// Makes a running request's block table cover `num_tokens` of its `tokens` (its computed
    /// tokens plus the ones scheduled now), taking new blocks as needed. Returns `false`,
    /// changing nothing, when the pool has too few free blocks; the scheduler then decides whom
    /// to preempt.
    pub fn allocate_slots(&mut self, request_id: u64, tokens: &[u32], num_tokens: usize) -> bool {
        let Some(table) = self.tables.get(&request_id) else {
            return self.admit(
                request_id,
                tokens,
                num_tokens,
                None,
                CachedPrefix::default(),
            );
        };
        let need = self
            .blocks_needed(num_tokens)
            .saturating_sub(table.blocks.len());
        if need > self.pool.num_free() {
            return false;
        }
        self.grow(request_id, tokens, num_tokens, need);
        true
    }

    /// Gives a new request a block table covering `num_tokens` of `tokens`: the blocks of
    /// `prefix` (shared, from [`Self::cached_prefix`] with the same `root`) and new ones for the
    /// rest. `root`: `Some` registers the request's full blocks for others to share. Returns
    /// `false`, changing nothing, when too few blocks are free.
    pub fn admit(
        &mut self,
        request_id: u64,
        tokens: &[u32],
        num_tokens: usize,
        root: Option<u64>,
        prefix: CachedPrefix,
    ) -> bool {
        assert!(
            !self.tables.contains_key(&request_id),
            "request {request_id} already has blocks"
        );
        assert!(prefix.blocks.is_empty() || root.is_some());
        assert!(prefix.blocks.len() * self.block_size <= num_tokens);
        let need = self.blocks_needed(num_tokens) - prefix.blocks.len();
        // NOTE: a hit on a free cached block takes it out of the free count too.
        let revived = prefix
            .blocks
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        if need + revived > self.pool.num_free() {
            return false;
        }
        for &b in &prefix.blocks {
            self.pool.touch(b);
        }
        self.tables.insert(
            request_id,
            Table {
                blocks: prefix.blocks,
                num_tokens: 0,
                root,
                hashes: prefix.hashes,
            },
        );
        self.grow(request_id, tokens, num_tokens, need);
        true
    }

    /// Takes `need` blocks (known to be free) for the table and registers its newly full blocks.
    fn grow(&mut self, request_id: u64, tokens: &[u32], num_tokens: usize, need: usize) {
        let Self {
            pool,
            tables,
            cached,
            block_hash,
            block_size,
            ..
        } = self;
        let new = pool
            .take(need, |b| {
                // NOTE: an evicted block's hash goes, or a later hit would read new data.
                if let Some(h) = block_hash[b as usize].take() {
                    cached.remove(&h);
                }
            })
            .expect("the caller checked that enough blocks are free");
        let table = tables.get_mut(&request_id).expect("the table exists");
        table.blocks.extend(new);
        table.num_tokens = table.num_tokens.max(num_tokens);
        let Some(root) = table.root else { return };
        let full = (table.num_tokens / *block_size).min(tokens.len() / *block_size);
        for i in table.hashes.len()..full {
            let h = hash_block(
                table.hashes.last(),
                root,
                &tokens[i * *block_size..(i + 1) * *block_size],
            );
            table.hashes.push(h);
            let b = table.blocks[i];
            // NOTE: if another block already holds these tokens (two requests computed the same
            // prefix at once), that one stays the cached copy and this one is private.
            if block_hash[b as usize].is_none() && !cached.contains_key(&h) {
                cached.insert(h, b);
                block_hash[b as usize] = Some(h);
            }
        }
    }

    /// Frees all blocks of a request (finished, aborted or preempted), tail first, so that with
    /// prefix caching the ends of prefixes are evicted before their beginnings.
    pub fn free(&mut self, request_id: u64) {
        if let Some(s) = self.swapped.remove(&request_id) {
            self.host_free.extend(s.host);
        }
        if let Some(t) = self.tables.remove(&request_id) {
            self.release_blocks(t.blocks);
        }
    }

    /// Drops one reference to each block, tail first.
    fn release_blocks(&mut self, blocks: Vec<BlockId>) {
        for b in blocks.into_iter().rev() {
            let keep = self.keep_freed && self.block_hash[b as usize].is_some();
            let kind = if keep {
                FreeKind::Cached
            } else {
                FreeKind::Plain
            };
            if self.pool.release(b, kind)
                && !keep
                && let Some(h) = self.block_hash[b as usize].take()
            {
                self.cached.remove(&h);
            }
        }
    }

    /// Forgets every cached prefix (the weights changed, say): blocks in use stay with their
    /// requests but are no longer found by lookups; freed cached blocks become plain.
    pub fn reset_prefix_cache(&mut self) {
        self.cached.clear();
        self.block_hash.iter_mut().for_each(|h| *h = None);
        self.pool.forget_cached();
    }

    pub fn block_table(&self, request_id: u64) -> &[BlockId] {
        self.tables
            .get(&request_id)
            .map(|t| t.blocks.as_slice())
            .unwrap_or(&[])
    }

    /// Requests holding device blocks.
    pub fn num_requests(&self) -> usize {
        self.tables.len()
    }

    /// Requests whose blocks are in host memory.
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
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

    /// Checks the block tables, reference counts, free lists and the prefix cache against each
    /// other. Panics with a description of the first violation.
    ///
    /// - reference counts equal the number of tables holding each block; unowned blocks are in
    ///   exactly one free list: the cached one iff the block is registered;
    /// - a block held by several tables is registered, and full in each of them (a request only
    ///   writes slots past its shared blocks, so no request's writes reach another's tokens);
    /// - the hash map and the per-block hashes agree, and a registered block sits where the
    ///   hash of that table's own tokens says it should.
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
        let mut where_free = vec![None; n];
        for kind in [FreeKind::Plain, FreeKind::Cached] {
            for b in self.pool.free_list(kind) {
                assert!(
                    where_free[b as usize].is_none(),
                    "block {b} twice in the free lists"
                );
                where_free[b as usize] = Some(kind);
            }
        }
        for (&h, &b) in &self.cached {
            assert_eq!(
                self.block_hash[b as usize],
                Some(h),
                "block {b} is in the map under another hash"
            );
        }
        let registered = self.block_hash.iter().filter(|h| h.is_some()).count();
        assert_eq!(
            registered,
            self.cached.len(),
            "a block has a hash the map lacks"
        );
        for b in 1..n {
            let rc = self.pool.ref_count(b as BlockId);
            assert_eq!(
                rc, owners[b],
                "block {b}: ref count {rc} but {} owners",
                owners[b]
            );
            let want = (rc == 0).then(|| {
                if self.block_hash[b].is_some() {
                    FreeKind::Cached
                } else {
                    FreeKind::Plain
                }
            });
            assert_eq!(where_free[b], want, "block {b}: in the wrong free list");
            if owners[b] > 1 {
                assert!(
                    self.block_hash[b].is_some(),
                    "block {b} shared but not cached"
                );
            }
        }
        let mut host_used = vec![false; self.host_blocks];
        for &h in self
            .host_free
            .iter()
            .chain(self.swapped.values().flat_map(|s| &s.host))
        {
            assert!(!host_used[h as usize], "host block {h} used twice");
            host_used[h as usize] = true;
        }
        assert!(host_used.iter().all(|&u| u), "a host block went missing");
        for id in self.swapped.keys() {
            assert!(
                !self.tables.contains_key(id),
                "request {id} is both swapped and resident"
            );
        }
        for t in self.tables.values() {
            let full = t.num_tokens / self.block_size;
            for (i, &b) in t.blocks.iter().enumerate() {
                if owners[b as usize] > 1 {
                    assert!(
                        i < full,
                        "shared block {b} is not full in one of its tables"
                    );
                }
                if let Some(h) = self.block_hash[b as usize]
                    && owners[b as usize] > 0
                {
                    assert_eq!(
                        t.hashes.get(i),
                        Some(&h),
                        "block {b} is cached under a hash that is not its tokens'"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
