//! Per-pod prefix cache of fixed-size token blocks.
//!
//! Only full blocks are cached. A block's key chains the previous block's key with the block's tokens,
//! so a key identifies the whole prefix up to and including that block. Blocks used by running requests
//! are *pinned* (reference counted) and never evicted; unpinned blocks sit on a free list ordered by
//! last use and are evicted least-recently-used first when the pod needs room.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64;

/// Chained keys of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_hashes_seeded(tokens, block_size, 0)
}

/// Like [`block_hashes`], with the chain started from `seed` instead of 0 — a LoRA adapter's blocks
/// must not match the base model's (vLLM puts the adapter into the hash's extra keys).
pub fn block_hashes_seeded(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut prev: u64 = seed;
    let mut buf = Vec::with_capacity(8 + block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        buf.clear();
        buf.extend_from_slice(&prev.to_le_bytes());
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        prev = xxh3_64(&buf);
        out.push(prev);
    }
    out
}

#[derive(Debug)]
struct Entry {
    refs: u32,
    /// Tick of the last release; the key of this block in `free` while `refs == 0`.
    last_use: u64,
}

/// LRU block cache with pinning. Capacity is enforced by [`PrefixCache::evict_to`], because the budget
/// for cached blocks depends on how many non-cached blocks running requests hold.
#[derive(Debug, Default)]
pub struct PrefixCache {
    tick: u64,
    blocks: HashMap<u64, Entry>,
    free: BTreeMap<u64, u64>,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of blocks in the cache (pinned and free).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Number of blocks pinned by running requests.
    pub fn pinned(&self) -> usize {
        self.blocks.len() - self.free.len()
    }

    /// Every cached block key, in no particular order.
    pub fn hashes(&self) -> Vec<u64> {
        self.blocks.keys().copied().collect()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// How many leading blocks of `hashes` are cached.
    pub fn longest_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Pins each block, inserting the ones not yet cached. Returns the positions (in `hashes`) of
    /// the inserted blocks.
    pub fn acquire(&mut self, hashes: &[u64]) -> Vec<usize> {
        let mut inserted = Vec::new();
        for (i, &h) in hashes.iter().enumerate() {
            match self.blocks.get_mut(&h) {
                Some(e) => {
                    if e.refs == 0 {
                        self.free.remove(&e.last_use);
                    }
                    e.refs += 1;
                }
                None => {
                    self.blocks.insert(
                        h,
                        Entry {
                            refs: 1,
                            last_use: 0,
                        },
                    );
                    inserted.push(i);
                }
            }
        }
        inserted
    }

    /// Unpins each block. Blocks are released back to front so that, among one request's blocks, the
    /// tail is the least recently used and is evicted before the shared head.
    pub fn release(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            if let Some(e) = self.blocks.get_mut(&h) {
                if e.refs == 0 {
                    continue;
                }
                e.refs -= 1;
                if e.refs == 0 {
                    self.tick += 1;
                    e.last_use = self.tick;
                    self.free.insert(self.tick, h);
                }
            }
        }
    }

    /// Evicts free blocks, least recently used first, until at most `budget` blocks remain or only
    /// pinned blocks are left. Returns how many were evicted.
    pub fn evict_to(&mut self, budget: usize) -> usize {
        let mut removed = Vec::new();
        self.evict_into(budget, &mut removed);
        removed.len()
    }

    /// [`PrefixCache::evict_to`], appending the evicted keys to `removed` in eviction order.
    pub fn evict_into(&mut self, budget: usize, removed: &mut Vec<u64>) {
        while self.blocks.len() > budget {
            let Some((_, h)) = self.free.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
            removed.push(h);
        }
    }

    /// Forgets every block, pinned or not (an engine restart).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.free.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 31 + salt).collect()
    }

    #[test]
    fn hashes_cover_full_blocks_and_chain() {
        assert_eq!(block_hashes(&toks(47, 0), 16).len(), 2);
        let a = block_hashes(&toks(32, 0), 16);
        let mut other = toks(32, 0);
        other[0] += 1;
        let b = block_hashes(&other, 16);
        // A change in the first block changes every later key.
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Same tokens in block 2 but a different prefix: different key.
        assert_eq!(toks(32, 0)[16..], other[16..]);
    }

    #[test]
    fn prefix_lookup_counts_leading_blocks_only() {
        let mut c = PrefixCache::new();
        let h = block_hashes(&toks(64, 1), 16);
        assert_eq!(c.acquire(&h[..2]), vec![0, 1]);
        c.release(&h[..2]);
        assert_eq!(c.longest_prefix(&h), 2);
        assert_eq!(c.acquire(&h[..3]), vec![2]);
        c.release(&h[..3]);
        assert_ne!(
            block_hashes_seeded(&toks(16, 1), 16, 9),
            block_hashes(&toks(16, 1), 16)
        );
        let mut c2 = PrefixCache::new();
        c2.acquire(&h[1..]);
        assert_eq!(c2.longest_prefix(&h), 0);
    }

    #[test]
    fn overflow_evicts_least_recently_used_unpinned_blocks() {
        let mut c = PrefixCache::new();
        let a = block_hashes(&toks(32, 1), 16);
        let b = block_hashes(&toks(32, 2), 16);
        let d = block_hashes(&toks(32, 3), 16);
        c.acquire(&a);
        c.release(&a);
        c.acquire(&b);
        c.release(&b);
        // Touch `a` again so `b` becomes the LRU entry.
        c.acquire(&a);
        c.release(&a);
        c.acquire(&d);
        assert_eq!(c.evict_to(4), 2);
        assert_eq!(c.longest_prefix(&a), 2);
        assert_eq!(c.longest_prefix(&b), 0);
        assert_eq!(c.longest_prefix(&d), 2);
    }

    #[test]
    fn tail_blocks_are_evicted_before_head_blocks() {
        let mut c = PrefixCache::new();
        let a = block_hashes(&toks(48, 1), 16);
        c.acquire(&a);
        c.release(&a);
        assert_eq!(c.evict_to(2), 1);
        assert_eq!(c.longest_prefix(&a), 2);
    }

    #[test]
    fn pinned_blocks_survive_eviction() {
        let mut c = PrefixCache::new();
        let a = block_hashes(&toks(48, 1), 16);
        let b = block_hashes(&toks(48, 2), 16);
        c.acquire(&a);
        c.acquire(&b);
        c.release(&b);
        assert_eq!(c.pinned(), 3);
        assert_eq!(c.evict_to(0), 3);
        assert_eq!(c.len(), 3);
        assert_eq!(c.longest_prefix(&a), 3);
        // Shared pin: two holders, one release keeps it pinned.
        c.acquire(&a[..1]);
        c.release(&a);
        assert_eq!(c.pinned(), 1);
        assert_eq!(c.evict_to(0), 2);
        assert!(c.contains(a[0]));
    }
}
