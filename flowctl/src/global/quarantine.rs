//! The quarantine of what a lost life may have forwarded unreported (see the parent module's
//! docs): its credit held back, its orphaned reservations, both eased by the pods' reports.

use serde::{Deserialize, Serialize};

use super::{GlobalFlow, MemberId, Verdict};
use crate::machine::{Command, RequestId};
use crate::outcome::DropReason;

/// A quarantine is eased only on pod reports taken this long after it began (what the lost life
/// forwarded has reached the pods and their scrapes)…
pub const QUARANTINE_MIN_AGE_MS: u64 = 1_000;
/// …and to the most requests beyond the ledger the pods reported over this window (one report
/// can miss a request between two scrapes).
pub const QUARANTINE_WINDOW_MS: u64 = 1_000;
/// Quarantined credit returns after this long whatever the pods report (they may serve traffic
/// that never passed through this cluster, which would otherwise pin it forever).
pub const QUARANTINE_MAX_MS: u64 = 300_000;

/// Credit a member's past life may have spent without reporting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Quarantine {
    credit: u32,
    /// When it began (µs).
    since_us: u64,
}

impl GlobalFlow {
    /// Credit in quarantine (lives whose lease ended or that restarted, see the module docs).
    pub fn quarantined_credit(&self) -> u64 {
        self.quarantine.values().map(|q| u64::from(q.credit)).sum()
    }

    /// Move into quarantine, under `member`'s current incarnation, its credit and what a
    /// rebalance took from it that it may not have seen.
    pub(super) fn quarantine_credit(&mut self, member: MemberId) {
        let Some(m) = self.members.get_mut(&member) else {
            return;
        };
        let shrunk = self
            .shrunk
            .remove(&(member, m.incarnation))
            .map_or(0, |s| s.0);
        let credit = std::mem::take(&mut m.credit).saturating_add(shrunk);
        if credit == 0 {
            return;
        }
        let now = self.now_us;
        let q = self
            .quarantine
            .entry((member, m.incarnation))
            .or_insert(Quarantine {
                credit: 0,
                since_us: now,
            });
        q.credit = q.credit.saturating_add(credit);
        q.since_us = now;
    }

    /// Ease the quarantine with the pods' latest reports (`unaccounted`: the requests they run or
    /// hold beyond what the ledger has routed to them). Orphans and quarantined credit old enough
    /// that their lives' forwarding has reached the pods shrink, orphans first (they hold
    /// capacity) and oldest first, to the most the pods showed over a whole window: what a lost
    /// life forwarded unreported is among those requests until it ends. An owner that comes back
    /// reads a released orphan's verdict as a rejection.
    pub(super) fn ease_quarantine(&mut self, unaccounted: u64) {
        let now = self.now_us;
        let min_age = QUARANTINE_MIN_AGE_MS * 1000;
        let max_age = QUARANTINE_MAX_MS * 1000;
        self.quarantine
            .retain(|_, q| now.saturating_sub(q.since_us) < max_age);
        let orphans: Vec<(u64, RequestId)> = self
            .entries
            .iter()
            .filter_map(|(id, e)| e.orphaned_us.map(|t| (t, *id)))
            .collect();
        let oldest = orphans
            .iter()
            .map(|o| o.0)
            .chain(self.quarantine.values().map(|q| q.since_us))
            .min();
        if oldest.is_none_or(|t| now.saturating_sub(t) < min_age) {
            self.unaccounted_window = None;
            return;
        }
        let (start, most) = match self.unaccounted_window {
            Some((start, most)) => (start, most.max(unaccounted)),
            None => (now, unaccounted),
        };
        let expired = |t: u64| now.saturating_sub(t) >= max_age;
        if now.saturating_sub(start) < QUARANTINE_WINDOW_MS * 1000
            && !orphans.iter().any(|o| expired(o.0))
        {
            self.unaccounted_window = Some((start, most));
            return;
        }
        self.unaccounted_window = None;
        let eligible = |t: u64| t.saturating_add(min_age) <= start || expired(t);
        let mut orphans: Vec<(u64, RequestId)> =
            orphans.into_iter().filter(|o| eligible(o.0)).collect();
        orphans.sort_unstable();
        let mut credit: Vec<(u64, (MemberId, u64))> = self
            .quarantine
            .iter()
            .filter(|(_, q)| eligible(q.since_us))
            .map(|(k, q)| (q.since_us, *k))
            .collect();
        credit.sort_unstable();
        let held = orphans.len() as u64
            + credit
                .iter()
                .filter_map(|(_, k)| self.quarantine.get(k))
                .map(|q| u64::from(q.credit))
                .sum::<u64>();
        let mut excess = held.saturating_sub(most);
        for (t, id) in orphans {
            if excess == 0 && !expired(t) {
                break;
            }
            excess = excess.saturating_sub(1);
            if let Some(key) = self.entries.get(&id).map(|e| e.key) {
                // Only while the key is still this entry's (a new life reuses sequence numbers).
                if self.by_key.get(&key) == Some(&id) && self.verdicts.contains_key(&key) {
                    self.decide(key, Verdict::Rejected(DropReason::RejectedSaturated));
                }
                self.run(Command::Cancel { id });
                self.forget(id);
                self.reclaimed += 1;
            }
        }
        for (_, k) in credit {
            if excess == 0 {
                break;
            }
            let Some(q) = self.quarantine.get_mut(&k) else {
                continue;
            };
            let take = excess.min(u64::from(q.credit));
            q.credit -= take as u32;
            excess -= take;
            if q.credit == 0 {
                self.quarantine.remove(&k);
            }
        }
    }

    /// Credit members hold or may still spend: theirs, what rebalances took from them lately,
    /// and the quarantined.
    pub(super) fn credit_held(&self) -> u64 {
        let own: u64 = self.members.values().map(|m| u64::from(m.credit)).sum();
        let shrunk: u64 = self.shrunk.values().map(|s| u64::from(s.0)).sum();
        own + shrunk + self.quarantined_credit()
    }
}
