use super::*;
use proptest::prelude::*;

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

#[test]
fn allocate_grows_by_blocks() {
    let mut m = KvCacheManager::new(5, 4, false);
    let t = toks(9, 0);
    assert!(m.allocate_slots(1, &t, 5));
    assert_eq!(m.block_table(1).len(), 2);
    assert!(m.allocate_slots(1, &t, 8));
    assert_eq!(m.block_table(1).len(), 2);
    assert!(m.allocate_slots(1, &t, 9));
    assert_eq!(m.block_table(1).len(), 3);
    assert!(!m.allocate_slots(2, &t, 8), "only one block left");
    assert_eq!(m.block_table(2).len(), 0);
    assert_eq!(m.usage().blocks_used, 3);
    assert!((m.usage().utilization - 9.0 / 12.0).abs() < 1e-12);
    m.free(1);
    assert_eq!(m.usage().blocks_free, 4);
    m.check_invariants();
}

/// Admits a request the way the scheduler does: look up, then take the hit and compute the rest.
fn admit_all(m: &mut KvCacheManager, id: u64, t: &[u32]) -> Option<usize> {
    let p = m.cached_prefix(t, 0);
    let hit = p.num_blocks() * m.block_size();
    m.admit(id, t, t.len(), Some(0), p).then_some(hit)
}

#[test]
fn a_second_identical_prompt_reuses_all_but_its_last_block() {
    let mut m = KvCacheManager::new(20, 4, true);
    let t = toks(10, 100);
    assert_eq!(admit_all(&mut m, 1, &t), Some(0));
    assert_eq!(
        admit_all(&mut m, 2, &t),
        Some(8),
        "blocks 0 and 1 are full and shared"
    );
    assert_eq!(m.block_table(1)[..2], m.block_table(2)[..2]);
    assert_ne!(
        m.block_table(1)[2],
        m.block_table(2)[2],
        "the partial block is private"
    );
    assert_eq!(m.usage().blocks_used, 4);
    m.check_invariants();
    // a prompt of exactly two blocks finds one: its last token must be computed
    assert_eq!(admit_all(&mut m, 3, &t[..8]), Some(4));
    // another root sees nothing
    assert_eq!(m.cached_prefix(&t, 7).num_blocks(), 0);
    // a different second block stops the match there
    let mut u = t.clone();
    u[5] = 0;
    assert_eq!(m.cached_prefix(&u, 0).num_blocks(), 1);
    m.check_invariants();
}

#[test]
fn freed_blocks_stay_cached_until_evicted_plain_ones_first() {
    let mut m = KvCacheManager::new(7, 4, true);
    let t = toks(13, 0); // 3 full blocks and one token
    admit_all(&mut m, 1, &t).unwrap();
    let table = m.block_table(1).to_vec();
    m.free(1);
    assert_eq!(m.pool().num_cached_free(), 3);
    assert_eq!(m.pool().num_free(), 6);
    // it comes back whole, after the request is gone
    assert_eq!(admit_all(&mut m, 2, &t), Some(12));
    assert_eq!(m.block_table(2)[..3], table[..3]);
    m.free(2);
    // 5 blocks of other data: the 3 plain ones first, then the tail of the prefix, then the next
    let other = toks(17, 1000);
    assert!(m.allocate_slots(3, &other, 17));
    assert_eq!(m.pool().num_cached_free(), 1, "two evicted");
    assert_eq!(m.cached_prefix(&t, 0).num_blocks(), 1, "the head survives");
    m.check_invariants();
    m.free(3);
    m.check_invariants();
    assert_eq!(m.pool().num_free(), 6);
}

#[test]
fn without_prefix_caching_only_live_requests_share() {
    let mut m = KvCacheManager::new(20, 4, false);
    let t = toks(9, 5);
    admit_all(&mut m, 1, &t).unwrap();
    assert_eq!(
        admit_all(&mut m, 2, &t),
        Some(8),
        "siblings alive together share"
    );
    m.free(1);
    m.free(2);
    assert_eq!(m.pool().num_cached_free(), 0);
    assert_eq!(m.cached_prefix(&t, 0).num_blocks(), 0);
    m.check_invariants();
}

#[test]
fn reset_forgets_every_prefix() {
    let mut m = KvCacheManager::new(20, 4, true);
    let t = toks(9, 5);
    admit_all(&mut m, 1, &t).unwrap();
    admit_all(&mut m, 2, &t).unwrap();
    m.free(2);
    m.reset_prefix_cache();
    m.check_invariants();
    assert_eq!(m.cached_prefix(&t, 0).num_blocks(), 0);
    m.free(1);
    assert_eq!(m.pool().num_cached_free(), 0);
    m.check_invariants();
}

#[test]
fn a_hit_on_free_blocks_counts_them_against_the_free_pool() {
    // 4 usable blocks: a cached prefix of 2 free blocks, then a request needing 2 + 3 blocks
    let mut m = KvCacheManager::new(5, 4, true);
    let t = toks(9, 0);
    admit_all(&mut m, 1, &t).unwrap();
    m.free(1);
    let mut long = t.clone();
    long.extend(toks(11, 50)); // 20 tokens: 5 blocks
    let p = m.cached_prefix(&long, 0);
    assert_eq!(p.num_blocks(), 2);
    assert!(
        !m.admit(2, &long, 20, Some(0), p),
        "5 blocks do not fit in 4"
    );
    m.check_invariants();
    assert_eq!(m.pool().num_cached_free(), 2, "nothing changed");
}

#[test]
fn swap_out_and_in_pairs_every_block_and_returns_the_host_blocks() {
    let mut m = KvCacheManager::new(10, 4, true).with_swap_space(3);
    let t = toks(10, 0);
    admit_all(&mut m, 1, &t).unwrap();
    let before = m.block_table(1).to_vec();
    let out = m.swap_out(1).unwrap();
    assert_eq!(out.iter().map(|p| p.0).collect::<Vec<_>>(), before);
    assert_eq!(m.num_free_host_blocks(), 0);
    assert_eq!(m.num_swapped(), 1);
    assert_eq!(m.pool().num_free(), 9);
    m.check_invariants();
    // no room for a second one: the caller recomputes it
    admit_all(&mut m, 2, &toks(5, 50)).unwrap();
    assert!(m.swap_out(2).is_none());
    // back, one token longer: the same host blocks in order, a fresh table
    let inn = m.swap_in(1, &t, 11).unwrap();
    let host: Vec<u32> = out.iter().map(|p| p.1).collect();
    assert_eq!(inn.iter().map(|p| p.0).collect::<Vec<_>>(), host);
    assert_eq!(
        inn.iter().map(|p| p.1).collect::<Vec<_>>(),
        m.block_table(1)
    );
    assert_eq!(m.num_free_host_blocks(), 3);
    m.check_invariants();
    // a swapped request that is aborted gives its host blocks back
    m.swap_out(1).unwrap();
    m.free(1);
    assert_eq!(m.num_free_host_blocks(), 3);
    assert_eq!(m.num_swapped(), 0);
    m.check_invariants();
}

/// A model of the cache's contents: each slot holds the token whose K/V were written there.
struct Sim {
    m: KvCacheManager,
    slots: Vec<Option<u32>>,
    /// Per request: its tokens and how many are computed.
    reqs: HashMap<u64, (Vec<u32>, usize)>,
    /// The host pool's slots, and the requests swapped out there.
    host: Vec<Option<u32>>,
    swapped: HashMap<u64, (Vec<u32>, usize)>,
}

impl Sim {
    fn swap_out(&mut self, id: u64) {
        let bs = self.m.block_size();
        let Some(pairs) = self.m.swap_out(id) else {
            return;
        };
        for (d, h) in pairs {
            for j in 0..bs {
                self.host[h as usize * bs + j] = self.slots[d as usize * bs + j];
            }
        }
        let r = self.reqs.remove(&id).unwrap();
        self.swapped.insert(id, r);
    }

    fn swap_in(&mut self, id: u64) {
        let bs = self.m.block_size();
        let Some((tokens, computed)) = self.swapped.get(&id).cloned() else {
            return;
        };
        let Some(pairs) = self.m.swap_in(id, &tokens, computed) else {
            return;
        };
        for (h, d) in pairs {
            assert_eq!(self.m.pool().ref_count(d), 1, "swap-in into a shared block");
            for j in 0..bs {
                self.slots[d as usize * bs + j] = self.host[h as usize * bs + j];
            }
        }
        self.swapped.remove(&id);
        self.reqs.insert(id, (tokens, computed));
    }

    fn write(&mut self, id: u64, from: usize, to: usize) {
        let bs = self.m.block_size();
        let (tokens, _) = &self.reqs[&id];
        let table = self.m.block_table(id);
        for pos in from..to {
            let b = table[pos / bs];
            assert_eq!(
                self.m.pool().ref_count(b),
                1,
                "request {id} writes into shared block {b}"
            );
            self.slots[b as usize * bs + pos % bs] = Some(tokens[pos]);
        }
    }

    /// What a request reads through its table equals its own tokens.
    fn check_reads(&self, id: u64) {
        let bs = self.m.block_size();
        let (tokens, computed) = &self.reqs[&id];
        let table = self.m.block_table(id);
        for (pos, &t) in tokens.iter().enumerate().take(*computed) {
            let b = table[pos / bs];
            assert_eq!(
                self.slots[b as usize * bs + pos % bs],
                Some(t),
                "request {id} reads another token at position {pos}"
            );
        }
        // and its table's hashes are the hashes of its own tokens
        let mut parent = None;
        for (i, chunk) in tokens.chunks_exact(bs).enumerate() {
            if (i + 1) * bs > *computed {
                break;
            }
            let h = hash_block(parent.as_ref(), 0, chunk);
            assert_eq!(self.m.tables[&id].hashes[i], h);
            parent = Some(h);
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A request whose prompt is `len` tokens of shared template `tpl` then `tail`; the first
    /// step computes at most `chunk` tokens.
    Add(u8, u8, u8, Vec<u32>, u8),
    /// Computes up to `k` more prompt tokens, or decodes one new token.
    Step(u8, u8, u32),
    Free(u8),
    SwapOut(u8),
    SwapIn(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..10, 0u8..3, 0u8..30, proptest::collection::vec(0u32..3, 0..10), 1u8..40)
            .prop_map(|(r, tpl, len, tail, chunk)| Op::Add(r, tpl, len, tail, chunk)),
        3 => (0u8..10, 1u8..12, 0u32..3).prop_map(|(r, k, t)| Op::Step(r, k, t)),
        1 => (0u8..10).prop_map(Op::Free),
        1 => (0u8..10).prop_map(Op::SwapOut),
        1 => (0u8..10).prop_map(Op::SwapIn),
    ]
}

proptest! {
    /// Random interleavings of admission (with prefix hits), chunked prefill, decode growth,
    /// finish/abort/preempt (all free the blocks) and eviction under a small pool.
    #[test]
    fn prefix_sharing_invariants(
        ops in proptest::collection::vec(op(), 1..150),
        bs in 1usize..6,
        blocks in 6usize..40,
        caching in any::<bool>(),
        host_blocks in 0usize..20,
    ) {
        let templates: Vec<Vec<u32>> =
            (0..3u32).map(|k| (0..30).map(|i| (i * 7 + k * 13) % 5).collect()).collect();
        let mut s = Sim {
            m: KvCacheManager::new(blocks, bs, caching).with_swap_space(host_blocks),
            slots: vec![None; blocks * bs],
            reqs: HashMap::new(),
            host: vec![None; host_blocks * bs],
            swapped: HashMap::new(),
        };
        for o in ops {
            match o {
                Op::Add(r, tpl, len, tail, chunk) => {
                    let id = r as u64;
                    if s.reqs.contains_key(&id) || s.swapped.contains_key(&id) {
                        continue;
                    }
                    let mut tokens = templates[tpl as usize][..len as usize].to_vec();
                    tokens.extend(tail);
                    if tokens.is_empty() {
                        continue;
                    }
                    let p = s.m.cached_prefix(&tokens, 0);
                    let hit = p.num_blocks() * bs;
                    prop_assert!(hit < tokens.len());
                    let upto = (hit + chunk as usize).min(tokens.len());
                    if s.m.admit(id, &tokens, upto, Some(0), p) {
                        s.reqs.insert(id, (tokens, hit));
                        s.check_reads(id);
                        s.write(id, hit, upto);
                        s.reqs.get_mut(&id).unwrap().1 = upto;
                    }
                }
                Op::Step(r, k, t) => {
                    let id = r as u64;
                    let Some((tokens, computed)) = s.reqs.get_mut(&id) else { continue };
                    let from = *computed;
                    let pushed = from == tokens.len();
                    if pushed {
                        tokens.push(t);
                    }
                    let upto = (from + k as usize).min(tokens.len());
                    let tokens = tokens.clone();
                    let before = s.m.block_table(id).to_vec();
                    if s.m.allocate_slots(id, &tokens, upto) {
                        prop_assert_eq!(&s.m.block_table(id)[..before.len()], &before[..]);
                        s.write(id, from, upto);
                        s.reqs.get_mut(&id).unwrap().1 = upto;
                    } else {
                        prop_assert_eq!(s.m.block_table(id), &before[..]);
                        if pushed {
                            s.reqs.get_mut(&id).unwrap().0.pop();
                        }
                    }
                    s.check_reads(id);
                }
                Op::Free(r) => {
                    s.m.free(r as u64);
                    s.reqs.remove(&(r as u64));
                    s.swapped.remove(&(r as u64));
                }
                Op::SwapOut(r) => s.swap_out(r as u64),
                Op::SwapIn(r) => s.swap_in(r as u64),
            }
            s.m.check_invariants();
            prop_assert_eq!(s.m.num_requests(), s.reqs.len());
            prop_assert_eq!(s.m.num_swapped(), s.swapped.len());
            for id in s.reqs.keys() {
                s.check_reads(*id);
            }
        }
        let ids: Vec<u64> = s.reqs.keys().chain(s.swapped.keys()).copied().collect();
        for id in ids {
            s.m.free(id);
        }
        s.m.check_invariants();
        prop_assert_eq!(s.m.pool().num_free(), blocks - 1);
        prop_assert_eq!(s.m.num_free_host_blocks(), host_blocks);
        if !caching {
            prop_assert_eq!(s.m.pool().num_cached_free(), 0);
        }
    }
}
