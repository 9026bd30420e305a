//! The engine's KV cache as its events show it: eviction, newly cached blocks (published as
//! `BlockStored`, one event per run) and vLLM's CPU offload tier (every block the GPU caches
//! copied there, least recently used dropped first; hash-only events with medium "CPU").

use super::{Adapter, PodState};
use crate::kvevents::KvEvent;

impl PodState {
    pub(super) fn evict(&mut self) {
        let budget = self
            .knobs
            .kv_blocks
            .saturating_sub(self.extra_held + self.step_outside());
        self.evict_to(budget);
    }

    pub(super) fn evict_to(&mut self, budget: usize) -> usize {
        let mut removed = Vec::new();
        self.cache.evict_into(budget, &mut removed);
        let n = removed.len();
        if self.events_on {
            self.counters.kv_event_blocks += n as u64;
            // vLLM emits one BlockRemoved per evicted block.
            self.pending
                .extend(removed.into_iter().map(|h| KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                }));
        }
        n
    }

    /// Pins `hashes` (blocks of `tokens`), emitting BlockStored for each run of newly cached
    /// blocks, and copies those to the CPU offload tier.
    pub(super) fn store(
        &mut self,
        hashes: &[u64],
        first: usize,
        tokens: &[u32],
        bs: usize,
        lora: Option<&Adapter>,
        salt: Option<&str>,
    ) {
        let inserted = self.cache.acquire(&hashes[first..]);
        if inserted.is_empty() {
            return;
        }
        let mut i = 0;
        while self.events_on && i < inserted.len() {
            let mut j = i;
            while j + 1 < inserted.len() && inserted[j + 1] == inserted[j] + 1 {
                j += 1;
            }
            let (a, b) = (first + inserted[i], first + inserted[j]);
            self.counters.kv_event_blocks += (b + 1 - a) as u64;
            self.pending.push(KvEvent::BlockStored {
                block_hashes: hashes[a..=b].to_vec(),
                parent_block_hash: a.checked_sub(1).map(|p| hashes[p]),
                token_ids: tokens[a * bs..(b + 1) * bs].to_vec(),
                block_size: bs,
                lora_id: lora.map(|l| l.id),
                lora_name: lora.map(|l| l.name.clone()),
                // Only the prompt's first block carries the salt.
                cache_salt: salt.filter(|_| a == 0).map(str::to_owned),
            });
            i = j + 1;
        }
        self.offload_copy(&hashes[first..], &inserted, bs);
    }

    /// The blocks the GPU cache just took (`inserted` positions of `hashes`) are copied to the
    /// CPU tier, which drops its least recently used beyond its capacity; copies already there
    /// are touched.
    fn offload_copy(&mut self, hashes: &[u64], inserted: &[usize], bs: usize) {
        let cap = self.knobs.cpu_offload_blocks;
        if cap == 0 {
            return;
        }
        let mut new = Vec::new();
        for &i in inserted {
            let h = hashes[i];
            if self.offload.acquire(&[h]).len() == 1 {
                new.push(h);
            }
            self.offload.release(&[h]);
        }
        let mut dropped = Vec::new();
        self.offload.evict_into(cap, &mut dropped);
        if !self.events_on {
            return;
        }
        // A block copied and dropped in the same call is announced neither way.
        let fresh: std::collections::HashSet<u64> = new.iter().copied().collect();
        dropped.retain(|h| !fresh.contains(h));
        new.retain(|h| self.offload.contains(*h));
        self.counters.kv_event_blocks += (new.len() + dropped.len()) as u64;
        if !new.is_empty() {
            self.pending.push(KvEvent::Offloaded {
                block_hashes: new,
                block_size: bs,
            });
        }
        if !dropped.is_empty() {
            self.pending.push(KvEvent::OffloadRemoved {
                block_hashes: dropped,
            });
        }
    }

    /// Of `hashes`, how many leading ones the CPU tier holds.
    pub(super) fn offload_prefix(&self, hashes: &[u64]) -> usize {
        if self.knobs.cpu_offload_blocks == 0 {
            return 0;
        }
        self.offload.longest_prefix(hashes)
    }
}
