//! What one `apply` does inside: enqueue (caps, bands, flows), release, expiry, dispatch by band
//! → fairness → ordering under the usage limit, and eviction.

use std::collections::BTreeMap;

use super::state::*;
use super::*;
use crate::outcome::DropReason;
use crate::policy::{BandPosition, OrderingPolicy, UsageLimit, soft_reflective_cycle};
use crate::saturation::{ConcurrencyDetector, SaturationDetector};

/// Saturation for one dispatch run: constant, or recomputed from the in-flight ledger.
pub(crate) enum Probe {
    Const(f64),
    /// The detector, the endpoints, their request capacity.
    Concurrency(ConcurrencyDetector, u64, u64),
}

impl Probe {
    /// Saturation with `reserve` more requests in flight (of the average in-flight size); only
    /// the concurrency detector counts requests, a constant saturation ignores it.
    pub(super) fn eval_reserving(&self, totals: &Totals, reserve: f64) -> f64 {
        let extra = reserve.ceil() as u64;
        if extra == 0 {
            return self.eval(totals);
        }
        let per_request = totals
            .inflight_tokens
            .checked_div(totals.inflight_requests)
            .unwrap_or(0);
        self.eval(&Totals {
            inflight_requests: totals.inflight_requests.saturating_add(extra),
            inflight_tokens: totals
                .inflight_tokens
                .saturating_add(extra.saturating_mul(per_request)),
            ..*totals
        })
    }

    pub(super) fn eval(&self, totals: &Totals) -> f64 {
        match self {
            Probe::Const(v) => *v,
            Probe::Concurrency(d, n, cap) => d.saturation_with_capacity(
                *n,
                *cap,
                totals.inflight_requests,
                totals.inflight_tokens,
            ),
        }
    }
}

/// Keep metric inputs finite (serializable, comparable): NaN counts as saturated, ±∞ is clamped.
pub(super) fn sanitize(v: f64) -> f64 {
    if v.is_nan() { 1.0 } else { v.clamp(0.0, 1e12) }
}

impl FlowController {
    pub(super) fn probe(&self, now: Nanos) -> Probe {
        if self.pool.is_empty() {
            return Probe::Const(1.0);
        }
        match (&self.pool, &self.config.detector) {
            (Pool::Fixed { saturation, .. }, _) => Probe::Const(*saturation),
            (Pool::Endpoints(eps), SaturationDetector::Utilization(d)) => {
                Probe::Const(d.saturation(eps, now))
            }
            (Pool::Endpoints(eps), SaturationDetector::Concurrency(d)) => {
                Probe::Concurrency(*d, eps.len() as u64, d.request_capacity(eps))
            }
        }
    }

    /// Index of the band for `priority`, created from the configured band or template if needed.
    pub(super) fn band_index(&mut self, priority: i32) -> u32 {
        let pos = self.band_order.binary_search_by(|&b| {
            let p = self.bands.get(b as usize).map_or(i32::MIN, |b| b.priority);
            priority.cmp(&p) // descending order
        });
        match pos {
            Ok(i) => self.band_order[i],
            Err(i) => {
                let settings = self.config.band_settings(priority).clone();
                let idx = self.bands.len() as u32;
                self.bands.push(Band {
                    priority,
                    sched: Sched::new(&settings.fairness),
                    settings,
                    queued: 0,
                    queued_bytes: 0,
                    inflight: 0,
                    inflight_tokens: 0,
                    recent: Default::default(),
                });
                self.band_order.insert(i, idx);
                idx
            }
        }
    }

    pub(super) fn find_band(&self, priority: i32) -> Option<&Band> {
        self.band_order
            .binary_search_by(|&b| {
                let p = self.bands.get(b as usize).map_or(i32::MIN, |b| b.priority);
                priority.cmp(&p)
            })
            .ok()
            .and_then(|i| self.bands.get(self.band_order[i] as usize))
    }

    pub(super) fn over_caps(&self, priority: i32, bytes: u64) -> bool {
        let cfg = &self.config;
        let t = &self.totals;
        if cfg.max_requests > 0 && t.queued_requests + 1 > cfg.max_requests {
            return true;
        }
        if cfg.max_bytes > 0 && t.queued_bytes.saturating_add(bytes) > cfg.max_bytes {
            return true;
        }
        let (queued, queued_bytes, settings) = match self.find_band(priority) {
            Some(b) => (b.queued, b.queued_bytes, &b.settings),
            None => (0, 0, cfg.band_settings(priority)),
        };
        (settings.max_requests > 0 && queued + 1 > settings.max_requests)
            || (settings.max_bytes > 0 && queued_bytes.saturating_add(bytes) > settings.max_bytes)
    }

    pub(super) fn enqueue(&mut self, now: Nanos, req: EnqueueRequest, out: &mut Vec<Outcome>) {
        let id = req.id;
        if self.shutting_down {
            out.push(Outcome::Rejected {
                id,
                reason: DropReason::RejectedShuttingDown,
            });
            return;
        }
        if self.queued.contains_key(&id) || self.inflight.contains_key(&id) {
            out.push(Outcome::Ignored {
                id,
                why: IgnoredReason::DuplicateId,
            });
            return;
        }
        if self.over_caps(req.flow.priority, req.bytes) {
            out.push(Outcome::Rejected {
                id,
                reason: DropReason::RejectedSaturated,
            });
            return;
        }
        let band_idx = self.band_index(req.flow.priority);
        self.note_arrivals(band_idx, 1);
        let ttl = req
            .ttl
            .unwrap_or_else(|| self.config.request_ttl(req.flow.priority));
        let fi = self.flow_for(req.flow, band_idx);
        let deadline = if ttl == 0 {
            NO_DEADLINE
        } else {
            now.saturating_add(ttl)
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let Some(band) = self.bands.get_mut(band_idx as usize) else {
            return;
        };
        let ord = match band.settings.ordering {
            OrderingPolicy::Fcfs => seq,
            OrderingPolicy::Edf => deadline,
            OrderingPolicy::SloDeadline => {
                req.slo_ttft.map_or(NO_DEADLINE, |s| now.saturating_add(s))
            }
        };
        let key = (ord, seq);
        let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) else {
            return;
        };
        let old = flow.head();
        flow.queue.insert(key, id);
        flow.queued_bytes += req.bytes;
        let new = flow.head();
        band.sched.head_changed(flow, fi, old, new);
        band.queued += 1;
        band.queued_bytes += req.bytes;
        self.totals.queued_requests += 1;
        self.totals.queued_bytes += req.bytes;
        if deadline != NO_DEADLINE {
            self.deadlines.insert((deadline, id));
        }
        self.arrivals.insert((now, id));
        self.queued.insert(
            id,
            Queued {
                flow: fi,
                key,
                bytes: req.bytes,
                tokens: req.tokens,
                deadline,
                enqueued_at: now,
            },
        );
    }

    pub(super) fn flow_for(&mut self, key: FlowKey, band_idx: u32) -> u32 {
        if let Some(&fi) = self.flow_index.get(&key) {
            return fi;
        }
        let weight = match self
            .bands
            .get(band_idx as usize)
            .map(|b| &b.settings.fairness)
        {
            Some(FairnessPolicy::Weighted(p)) => p.weight_of(&key.fairness_id),
            _ => 1.0,
        };
        let flow = Flow {
            fairness_id: key.fairness_id.clone(),
            priority: key.priority,
            band: band_idx,
            queue: BTreeMap::new(),
            queued_bytes: 0,
            inflight: 0,
            weight,
            pass: 0.0,
        };
        let fi = match self.free_flows.pop() {
            Some(fi) => {
                if let Some(slot) = self.flows.get_mut(fi as usize) {
                    *slot = Some(flow);
                }
                fi
            }
            None => {
                self.flows.push(Some(flow));
                (self.flows.len() - 1) as u32
            }
        };
        self.flow_index.insert(key, fi);
        fi
    }

    /// Drop a flow that has nothing queued and nothing in flight (bounded memory for many ids).
    pub(super) fn maybe_gc_flow(&mut self, fi: u32) {
        let Some(slot) = self.flows.get_mut(fi as usize) else {
            return;
        };
        let idle = slot
            .as_ref()
            .is_some_and(|f| f.queue.is_empty() && f.inflight == 0);
        if idle && let Some(f) = slot.take() {
            self.flow_index.remove(&FlowKey {
                fairness_id: f.fairness_id,
                priority: f.priority,
            });
            self.free_flows.push(fi);
        }
    }

    /// Remove a queued request from every index; `None` if it is not queued.
    pub(super) fn remove_queued(&mut self, id: RequestId) -> Option<Queued> {
        let q = self.queued.remove(&id)?;
        if q.deadline != NO_DEADLINE {
            self.deadlines.remove(&(q.deadline, id));
        }
        self.arrivals.remove(&(q.enqueued_at, id));
        if let Some(flow) = self.flows.get_mut(q.flow as usize).and_then(Option::as_mut) {
            let old = flow.head();
            flow.queue.remove(&q.key);
            flow.queued_bytes -= q.bytes;
            let new = flow.head();
            if let Some(band) = self.bands.get_mut(flow.band as usize) {
                band.sched.head_changed(flow, q.flow, old, new);
                band.queued -= 1;
                band.queued_bytes -= q.bytes;
            }
        }
        self.totals.queued_requests -= 1;
        self.totals.queued_bytes -= q.bytes;
        self.maybe_gc_flow(q.flow);
        Some(q)
    }

    /// Release an in-flight request (completion, cancel after dispatch, eviction).
    pub(super) fn release(&mut self, id: RequestId, actual_tokens: Option<u64>) -> bool {
        let Some(r) = self.inflight.remove(&id) else {
            return false;
        };
        if r.priority < 0 {
            self.evictable
                .remove(&(r.priority, u64::MAX - r.dispatch_seq, id));
        }
        let now = self.now;
        let n = r.requests;
        if let Some(flow) = self.flows.get_mut(r.flow as usize).and_then(Option::as_mut) {
            flow.inflight = flow
                .inflight
                .saturating_sub(u32::try_from(n).unwrap_or(u32::MAX));
            if let Some(band) = self.bands.get_mut(flow.band as usize) {
                if let Some(actual) = actual_tokens {
                    band.sched.settle(flow, r.flow, r.tokens, actual);
                }
                band.sched.released(flow, n, actual_tokens, now);
                band.inflight = band.inflight.saturating_sub(n);
                band.inflight_tokens = band.inflight_tokens.saturating_sub(r.tokens);
            }
        }
        self.totals.inflight_requests = self.totals.inflight_requests.saturating_sub(n);
        self.totals.inflight_tokens = self.totals.inflight_tokens.saturating_sub(r.tokens);
        self.maybe_gc_flow(r.flow);
        true
    }

    /// [`Command::Hold`]: set bulk record `id` to `requests` requests of `tokens` tokens of
    /// `flow`, charging the increase like admissions and releasing the decrease.
    pub(super) fn hold(&mut self, id: RequestId, flow: FlowKey, requests: u64, tokens: u64) {
        if self.queued.contains_key(&id) {
            return;
        }
        let (old_n, old_t, fi) = match self.inflight.get(&id) {
            Some(r) => (r.requests, r.tokens, r.flow),
            None if requests == 0 => return,
            None => {
                let b = self.band_index(flow.priority);
                (0, 0, self.flow_for(flow, b))
            }
        };
        if old_n == requests && old_t == tokens {
            return;
        }
        let now = self.now;
        let Some(f) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) else {
            return;
        };
        let band_idx = f.band;
        let Some(band) = self.bands.get_mut(band_idx as usize) else {
            return;
        };
        let arrived = requests.saturating_sub(old_n);
        if requests > old_n {
            let (n, t) = (requests - old_n, tokens.saturating_sub(old_t));
            // An idle flow joins the weighted schedule at the current virtual time (as `admit`).
            if f.queue.is_empty() {
                band.sched.head_changed(f, fi, None, Some((0, 0)));
                band.sched.charge_n(f, fi, n, t);
                band.sched.head_changed(f, fi, Some((0, 0)), None);
            } else {
                band.sched.charge_n(f, fi, n, t);
            }
        } else if requests < old_n {
            band.sched.released(f, old_n - requests, None, now);
        }
        let to_u32 = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        f.inflight = f
            .inflight
            .saturating_sub(to_u32(old_n))
            .saturating_add(to_u32(requests));
        band.inflight = band.inflight.saturating_sub(old_n).saturating_add(requests);
        band.inflight_tokens = band
            .inflight_tokens
            .saturating_sub(old_t)
            .saturating_add(tokens);
        let priority = band.priority;
        self.totals.inflight_requests = self
            .totals
            .inflight_requests
            .saturating_sub(old_n)
            .saturating_add(requests);
        self.totals.inflight_tokens = self
            .totals
            .inflight_tokens
            .saturating_sub(old_t)
            .saturating_add(tokens);
        self.note_arrivals(band_idx, arrived);
        if requests == 0 {
            self.inflight.remove(&id);
            self.maybe_gc_flow(fi);
            return;
        }
        let dispatch_seq = self.next_seq;
        let r = self.inflight.entry(id).or_insert_with(|| InFlight {
            flow: fi,
            priority,
            tokens: 0,
            dispatch_seq,
            requests: 0,
            dispatched_at: None,
        });
        if r.requests == 0 {
            self.next_seq += 1;
        }
        r.requests = requests;
        r.tokens = tokens;
    }

    /// [`Command::Served`]: completions within a bulk holding correct their flow's charge and
    /// credit its program's service (their count leaves with the holding's next [`Command::Hold`]).
    pub(super) fn served(&mut self, flow: &FlowKey, requests: u64, charged: u64, actual: u64) {
        let now = self.now;
        let Some(&fi) = self.flow_index.get(flow) else {
            return;
        };
        let Some(f) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) else {
            return;
        };
        let Some(band) = self.bands.get_mut(f.band as usize) else {
            return;
        };
        if requests > 0 {
            band.sched
                .settle(f, fi, charged.max(requests), actual.max(requests));
        }
        band.sched.served(&f.fairness_id, actual, now);
    }

    pub(super) fn expire(&mut self, now: Nanos, out: &mut Vec<Outcome>) {
        let no_endpoints = self.pool.is_empty();
        let ttl_reason = if no_endpoints {
            DropReason::RejectedNoEndpoints
        } else {
            DropReason::RejectedTtlExpired
        };
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.remove_queued(id);
            out.push(Outcome::Rejected {
                id,
                reason: ttl_reason,
            });
        }
        if no_endpoints {
            let ttl = self.config.no_endpoint_request_ttl;
            while let Some(&(at, id)) = self.arrivals.first() {
                if at.saturating_add(ttl) > now {
                    break;
                }
                self.remove_queued(id);
                out.push(Outcome::Rejected {
                    id,
                    reason: DropReason::RejectedNoEndpoints,
                });
            }
        }
    }

    pub(super) fn top_waiting_band(&self) -> Option<u32> {
        self.band_order
            .iter()
            .copied()
            .find(|&b| self.bands.get(b as usize).is_some_and(|b| b.queued > 0))
    }

    pub(super) fn dispatch(&mut self, now: Nanos, out: &mut Vec<Outcome>) {
        if self.totals.queued_requests == 0 {
            return;
        }
        let probe = self.probe(now);
        if self.config.usage_limit == UsageLimit::SoftReflective {
            let sat = probe.eval(&self.totals);
            self.reflect_open = soft_reflective_cycle(&mut self.reflect_tick, sat);
        }
        self.dispatch_loop(&probe, out);
        if self.evict(now, &probe, out) {
            self.dispatch_loop(&probe, out);
        }
    }

    /// The usage-limit ceiling of band `b` at saturation `sat` (see [`UsageLimit::ceiling`]).
    pub(super) fn ceiling(&self, b: u32, sat: f64) -> f64 {
        let n = self.band_order.len();
        let rank = self.band_order.iter().position(|&x| x == b).unwrap_or(0);
        let prio = |i: Option<&u32>| {
            i.and_then(|&x| self.bands.get(x as usize))
                .map_or(0, |band| band.priority)
        };
        let at = BandPosition {
            rank,
            n,
            priority: self.bands.get(b as usize).map_or(0, |band| band.priority),
            lowest: prio(self.band_order.last()),
            highest: prio(self.band_order.first()),
        };
        self.config.usage_limit.ceiling(at, sat, self.reflect_open)
    }

    /// The ceiling a band of `priority` has or would have (ranked among the existing bands) at
    /// saturation `sat`.
    pub(super) fn ceiling_for(&self, priority: i32, sat: f64) -> f64 {
        let pos = self.band_order.binary_search_by(|&b| {
            let p = self.bands.get(b as usize).map_or(i32::MIN, |b| b.priority);
            priority.cmp(&p)
        });
        let (rank, n) = match pos {
            Ok(i) => (i, self.band_order.len()),
            Err(i) => (i, self.band_order.len() + 1),
        };
        let prio = |i: Option<&u32>| {
            i.and_then(|&x| self.bands.get(x as usize))
                .map(|b| b.priority)
        };
        let at = BandPosition {
            rank,
            n,
            priority,
            lowest: prio(self.band_order.last()).map_or(priority, |p| p.min(priority)),
            highest: prio(self.band_order.first()).map_or(priority, |p| p.max(priority)),
        };
        self.config.usage_limit.ceiling(at, sat, self.reflect_open)
    }

    /// The highest band with queued requests, and whether it is gated at the current saturation
    /// — counting the demand reserve of the bands above it as in flight — or by a burst's
    /// settling (`None`: nothing waits).
    pub(super) fn top_band_gated(&self, probe: &Probe) -> Option<(u32, bool)> {
        let b = self.top_waiting_band()?;
        let reserve = self.reserve_above(b);
        let sat = probe.eval_reserving(&self.totals, reserve);
        Some((
            b,
            sat >= self.ceiling(b, sat) || self.settle_gated(b, probe, reserve),
        ))
    }

    pub(super) fn dispatch_loop(&mut self, probe: &Probe, out: &mut Vec<Outcome>) {
        while self.totals.queued_requests > 0 {
            let Some((b, false)) = self.top_band_gated(probe) else {
                return;
            };
            if !self.dispatch_one(b, out) {
                // Index inconsistency: never spin.
                debug_assert!(false, "band {b} has queued requests but no pickable flow");
                return;
            }
        }
    }

    pub(super) fn dispatch_one(&mut self, b: u32, out: &mut Vec<Outcome>) -> bool {
        let Some(band) = self.bands.get_mut(b as usize) else {
            return false;
        };
        let Some(fi) = band.sched.pick(&self.flows, &self.queued, self.now) else {
            return false;
        };
        let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) else {
            return false;
        };
        let Some((&key, &id)) = flow.queue.first_key_value() else {
            return false;
        };
        let Some(q) = self.queued.remove(&id) else {
            return false;
        };
        band.sched.charge(flow, fi, q.tokens);
        flow.queue.remove(&key);
        flow.queued_bytes -= q.bytes;
        let new = flow.head();
        band.sched.head_changed(flow, fi, Some(key), new);
        band.queued -= 1;
        band.queued_bytes -= q.bytes;
        if q.deadline != NO_DEADLINE {
            self.deadlines.remove(&(q.deadline, id));
        }
        self.arrivals.remove(&(q.enqueued_at, id));
        self.totals.queued_requests -= 1;
        self.totals.queued_bytes -= q.bytes;
        self.start_inflight(b, fi, id, q.tokens);
        out.push(Outcome::Dispatched { id });
        true
    }

    /// Count `id` in flight on flow `fi` of band `b` (the flow was charged by the caller).
    pub(super) fn start_inflight(&mut self, b: u32, fi: u32, id: RequestId, tokens: u64) {
        let Some(band) = self.bands.get_mut(b as usize) else {
            return;
        };
        if let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) {
            flow.inflight += 1;
        }
        band.inflight += 1;
        band.inflight_tokens += tokens;
        let priority = band.priority;
        self.totals.inflight_requests += 1;
        self.totals.inflight_tokens += tokens;
        let dispatch_seq = self.next_seq;
        self.next_seq += 1;
        self.inflight.insert(
            id,
            InFlight {
                flow: fi,
                priority,
                tokens,
                dispatch_seq,
                requests: 1,
                dispatched_at: Some(self.now),
            },
        );
    }

    /// [`Command::Admit`]: straight into the ledger, charged to its flow.
    pub(super) fn admit(&mut self, req: EnqueueRequest, out: &mut Vec<Outcome>) {
        let id = req.id;
        if self.queued.contains_key(&id) || self.inflight.contains_key(&id) {
            out.push(Outcome::Ignored {
                id,
                why: IgnoredReason::DuplicateId,
            });
            return;
        }
        let b = self.band_index(req.flow.priority);
        let fi = self.flow_for(req.flow, b);
        if let Some(band) = self.bands.get_mut(b as usize)
            && let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut)
        {
            // An idle flow joins the weighted schedule at the current virtual time first, so a
            // burst of local admissions is charged from "now", not from its old pass.
            if flow.queue.is_empty() {
                band.sched.head_changed(flow, fi, None, Some((0, 0)));
                band.sched.charge(flow, fi, req.tokens);
                band.sched.head_changed(flow, fi, Some((0, 0)), None);
            } else {
                band.sched.charge(flow, fi, req.tokens);
            }
        }
        self.note_arrivals(b, 1);
        self.start_inflight(b, fi, id, req.tokens);
        out.push(Outcome::Dispatched { id });
    }

    /// One eviction decision; true if anything was evicted.
    pub(super) fn evict(&mut self, now: Nanos, probe: &Probe, out: &mut Vec<Outcome>) -> bool {
        let ev = self.config.eviction;
        if !ev.enabled || self.totals.queued_requests == 0 || self.pool.is_empty() {
            return false;
        }
        let Some((top_band, true)) = self.top_band_gated(probe) else {
            return false;
        };
        if let Some(last) = self.last_eviction
            && now < last.saturating_add(ev.grace)
        {
            return false;
        }
        let Some(top) = self.bands.get(top_band as usize).map(|b| b.priority) else {
            return false;
        };
        let mut evicted = 0;
        // Re-check before each revocation: evict only while still saturated.
        while evicted < ev.max_per_decision && {
            let sat = probe.eval(&self.totals);
            sat >= self.ceiling(top_band, sat)
        } {
            let Some(&(priority, _, id)) = self.evictable.first() else {
                break;
            };
            if priority >= top {
                break;
            }
            self.release(id, None);
            out.push(Outcome::Evicted {
                id,
                reason: DropReason::Evicted,
            });
            evicted += 1;
        }
        if evicted > 0 {
            self.last_eviction = Some(now);
        }
        evicted > 0
    }
}
