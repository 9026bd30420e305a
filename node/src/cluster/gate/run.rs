//! The gate's background work: the single writer that proposes the outbox, the watcher that
//! follows the applied state (verdicts, credit, degradation, backstops) and the duties it
//! triggers (the configuration proposal; on the leader, the pool's metrics every
//! `pool_interval`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowctl::DropReason;
use flowctl::cluster::{ClusterCommand, ClusterOutput, FEATURE_HELD};
use flowctl::global::{FlowCmd, RECONCILE_MIN_AGE_MS, RECONCILE_PERSIST_MS, Verdict as GVerdict};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{ADMITTED_MAX_AGE, AbortOnDrop, GlobalGate, State, wall_us};
use crate::cluster::member::ClusterMember;
use crate::datalayer::inflight::InflightLoad;
use crate::datalayer::store::Candidate;
use crate::metrics::{BandLabels, SaturationLabels};
use crate::request::admission::{Ticket, Verdict, snapshot_with};

/// What the watcher reads from the applied state on each pass.
struct Applied {
    /// Verdicts on this replica's waiting requests.
    verdicts: Vec<(u64, GVerdict)>,
    /// Whether the fast path is open, for every priority seen here.
    open: Vec<(i32, bool)>,
    /// This life's credit, last sequence number and credit admissions counted.
    credit: u32,
    last_seq: u64,
    held_admitted: u64,
    /// This replica's lease ended.
    expired: bool,
    /// The state runs this replica's flow configuration.
    same_config: bool,
    /// Members with their lease.
    live: Vec<u64>,
    /// Every live member applies count reports.
    bulk: bool,
}

impl GlobalGate {
    /// Start the writer and the watcher (cluster mode, once the consensus node runs).
    pub async fn run(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let _ = self.member.set(member.clone());
        let writer = tokio::spawn(self.clone().writer(member.clone(), stop.clone()));
        self.watcher(member, stop).await;
        let _ = writer.await;
    }

    /// Propose the outbox, one batch (one log entry) at a time.
    async fn writer(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let lease = Duration::from_millis(self.opts.params.lease_ms);
        let incarnation = member.incarnation();
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    self.retire(&member, incarnation).await;
                    break;
                }
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            self.sort_foreign(&member).await;
            let urgent = {
                let st = self.lock();
                if st.outbox.is_empty() && !st.held.dirty && !st.held.whole {
                    continue;
                }
                st.outbox
                    .iter()
                    .any(|c| matches!(c, FlowCmd::Enqueue { .. } | FlowCmd::Cancel { .. }))
            };
            if !urgent {
                let t0 = Instant::now();
                loop {
                    tokio::time::sleep(self.opts.report_linger).await;
                    self.sort_foreign(&member).await;
                    if t0.elapsed() >= self.opts.report_linger_max || self.reports_due() {
                        break;
                    }
                }
            }
            let cmds: Vec<FlowCmd> = {
                let mut st = self.lock();
                let mut cmds: Vec<FlowCmd> = std::mem::take(&mut st.outbox).into();
                cmds.extend(st.held.report());
                cmds
            };
            if cmds.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            let res = tokio::time::timeout(
                lease,
                member.node.propose(ClusterCommand::Flow {
                    node: self.node_id,
                    incarnation,
                    now_us: wall_us(),
                    cmds: cmds.clone(),
                }),
            )
            .await;
            match res {
                Ok(Ok(out)) => {
                    self.metrics.cluster.flow_batch(cmds.len(), t0.elapsed());
                    if let Some(admitted) = cmds.iter().rev().find_map(|c| match c {
                        FlowCmd::Held { admitted, .. } => Some(*admitted),
                        _ => None,
                    }) {
                        let mut st = self.lock();
                        st.held.committed_admitted = st.held.committed_admitted.max(admitted);
                    }
                    // Enqueues dispatched (or refused) as the batch applied: release them now,
                    // without waiting for this replica to apply the entry.
                    if let ClusterOutput::Flow(res) = out
                        && !res.decided.is_empty()
                    {
                        let mut st = self.lock();
                        self.deliver(&mut st, res.decided);
                    }
                }
                _ => {
                    // Retry (the state ignores what it has already applied), oldest first.
                    {
                        let mut st = self.lock();
                        let newer = std::mem::take(&mut st.outbox);
                        st.outbox = cmds.into();
                        for c in newer {
                            st.push(c);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    self.wake.notify_one();
                }
            }
        }
    }

    /// Settlements of other live replicas' keys observed here: those the ledger holds (admitted
    /// through the global queue, or in degraded mode) are settled in it from here, at once; the
    /// others — credit admissions, counted by the replica that made them — are relayed to it.
    async fn sort_foreign(&self, member: &ClusterMember) {
        let foreign = std::mem::take(&mut self.lock().foreign);
        if foreign.is_empty() {
            return;
        }
        let (held, _) = member
            .node
            .local_read(|s| {
                s.0.flow().map(|f| {
                    foreign
                        .iter()
                        .map(|(k, _)| f.holds_request(k))
                        .collect::<Vec<bool>>()
                })
            })
            .await;
        let held = held.unwrap_or_default();
        let relay = self.relay.get();
        let mut st = self.lock();
        for (i, (key, tokens)) in foreign.into_iter().enumerate() {
            if held.get(i).copied().unwrap_or(false) || relay.is_none() {
                st.push(FlowCmd::Settle {
                    request_id: key,
                    actual_tokens: tokens,
                });
            } else if let Some(relay) = relay
                && relay.try_send((key, tokens)).is_err()
            {
                self.metrics.gossip.dropped_batch();
            }
        }
    }

    /// Whether the lingering reports should go now rather than at `report_linger_max`: they
    /// matter at once when the outbox holds a command for the replicated ledger (a settlement
    /// or routed pod of a queued request's slot), a request waits for the credit they free, the
    /// fast path is closed for a priority seen
    /// here (someone waits, or the pool is near its limit), half this replica's credit is spent
    /// on admissions no committed report counts (the fast path must not stall on a lingering
    /// report; those committed count even before this replica applies them), or the replica is
    /// degraded, stopping or not yet configured.
    fn reports_due(&self) -> bool {
        let st = self.lock();
        !st.outbox.is_empty()
            || !st.parked.is_empty()
            || st.held.whole
            || st.degraded
            || st.shutting_down
            || !st.configured
            || 2 * (st.unreported.len() + st.held.uncommitted()) >= st.credit as usize
            || st.open_by_priority.values().any(|open| !open)
    }

    /// After a graceful shutdown (the gate admits nothing more): propose what is left in the
    /// outbox and [`FlowCmd::Retire`], so that this replica's credit returns to the others at
    /// once instead of waiting in quarantine (best effort: without it the lease ends as usual).
    async fn retire(&self, member: &ClusterMember, incarnation: u64) {
        let cmds: Vec<FlowCmd> = {
            let mut st = self.lock();
            if !st.shutting_down {
                return;
            }
            let mut cmds: Vec<FlowCmd> = std::mem::take(&mut st.outbox).into();
            cmds.extend(st.held.report());
            cmds.push(FlowCmd::Retire);
            cmds
        };
        let res = tokio::time::timeout(
            Duration::from_millis(500),
            member.node.propose(ClusterCommand::Flow {
                node: self.node_id,
                incarnation,
                now_us: wall_us(),
                cmds,
            }),
        )
        .await;
        match res {
            Ok(Ok(_)) => tracing::info!("cluster flow control: retired this replica's credit"),
            _ => tracing::warn!(
                "cluster flow control: could not retire this replica's credit; it returns \
                 when the pods vouch for it"
            ),
        }
    }

    /// Follow the applied state: verdicts, credit, degradation, leader duties, gauges.
    async fn watcher(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let me = self.node_id;
        let incarnation = member.incarnation();
        let lease = Duration::from_millis(self.opts.params.lease_ms);
        let mut applied = member.node.watch();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_progress = Instant::now();
        let mut last_config = Instant::now() - Duration::from_secs(1);
        let mut last_gauges = Instant::now();
        // Proposals of its own (configuration, pool metrics) run beside the watcher, which must
        // never wait for a commit while verdicts are due.
        let duties = Arc::new(Notify::new());
        let duty_task = tokio::spawn(self.clone().duties(
            member.clone(),
            duties.clone(),
            stop.clone(),
        ));
        let _abort = AbortOnDrop(duty_task);
        let mut last_prune = Instant::now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = applied.changed() => {
                    if r.is_err() {
                        return;
                    }
                    last_progress = Instant::now();
                }
                _ = tick.tick() => {}
            }
            let (keys, priorities): (Vec<u64>, Vec<i32>) = {
                let st = self.lock();
                (
                    st.waiting.keys().copied().collect(),
                    st.open_by_priority.keys().copied().collect(),
                )
            };
            let (view, applied_index) = member
                .node
                .local_read(|s| {
                    let f = s.0.flow()?;
                    let verdicts: Vec<(u64, GVerdict)> = keys
                        .iter()
                        .filter_map(|k| f.verdict((me, *k), incarnation).map(|v| (*k, v)))
                        .collect();
                    let open: Vec<(i32, bool)> = priorities
                        .iter()
                        .map(|p| (*p, f.fast_path_open(me, *p)))
                        .collect();
                    let mf = f.member_as(me, incarnation);
                    Some(Applied {
                        verdicts,
                        open,
                        credit: mf.map_or(0, |m| m.credit),
                        last_seq: mf.map_or(0, |m| m.last_seq),
                        held_admitted: mf.map_or(0, |m| m.held_admitted),
                        expired: mf.is_some_and(|m| m.expired),
                        same_config: f.config() == &self.config && f.params() == self.opts.params,
                        live: f
                            .members()
                            .iter()
                            .filter(|(_, m)| !m.expired)
                            .map(|(id, _)| *id)
                            .collect(),
                        bulk: s.0.live_members_speak(FEATURE_HELD),
                    })
                })
                .await;
            let degraded = !member.has_quorum() || last_progress.elapsed() > lease;
            let reconfigure;
            {
                let mut st = self.lock();
                if st.degraded != degraded {
                    tracing::warn!(degraded, "cluster flow control: degraded mode changed");
                    // Whoever waits now waits for the cluster to recover, but not for long.
                    let until = degraded.then(|| Instant::now() + self.opts.degraded_wait);
                    for w in st.waiting.values_mut() {
                        w.degraded_deadline = until;
                    }
                    if !degraded {
                        st.degraded_running.clear();
                    }
                    st.degraded_base = if degraded { st.unreported() } else { 0 };
                    st.degraded = degraded;
                }
                match view {
                    Some(a) => {
                        st.configured = true;
                        st.live = a.live;
                        // Back from an expired lease: while it was out, the pods' reports may
                        // have eased its counts in the ledger; the next report restates them.
                        if st.expired && !a.expired {
                            st.held.whole = true;
                        }
                        st.expired = a.expired;
                        if st.bulk != a.bulk {
                            tracing::info!(
                                bulk = a.bulk,
                                "cluster flow control: credit admissions counted in bulk (every \
                                 live replica applies count reports), or else one by one"
                            );
                        }
                        st.bulk = a.bulk;
                        st.credit = a.credit;
                        st.credit_index = applied_index;
                        st.applied_last_seq = a.last_seq;
                        st.held.applied_admitted = a.held_admitted;
                        st.open_by_priority.extend(a.open);
                        while st.unreported.front().is_some_and(|s| *s <= a.last_seq) {
                            st.unreported.pop_front();
                        }
                        // A verdict read from a state older than this life's lease may have
                        // been revoked since: after a partition the local state can still show
                        // a dispatch the cluster undid when the lease ended (the orphan's slot
                        // given to others). Found by the deterministic simulation (dst.rs).
                        if member.lease_index().is_some_and(|l| applied_index >= l) {
                            self.deliver(&mut st, a.verdicts);
                        }
                        reconfigure = !a.same_config;
                    }
                    None => {
                        st.configured = false;
                        reconfigure = true;
                    }
                }
                self.unpark(&mut st);
                // Backstops: nobody waits past its TTL (plus two leases) for a verdict, nor more
                // than a lease while this replica cannot commit.
                let now = Instant::now();
                let late: Vec<(u64, DropReason)> = st
                    .waiting
                    .iter()
                    .filter_map(|(s, w)| {
                        if w.deadline.is_some_and(|d| d <= now) {
                            Some((*s, DropReason::RejectedTtlExpired))
                        } else if degraded && w.degraded_deadline.is_some_and(|d| d <= now) {
                            Some((*s, DropReason::RejectedSaturated))
                        } else {
                            None
                        }
                    })
                    .collect();
                for (seq, reason) in late {
                    if let Some(w) = st.waiting.remove(&seq) {
                        if reason == DropReason::RejectedSaturated {
                            st.degraded_rejects += 1;
                            self.metrics.cluster.flow_admission("degraded-reject");
                        }
                        w.waiter.resolve(&self.metrics, Verdict::Rejected(reason));
                        st.push(FlowCmd::Cancel { seq });
                    }
                }
            }
            if degraded {
                continue;
            }
            if last_prune.elapsed() >= Duration::from_secs(1) {
                last_prune = Instant::now();
                self.prune_admitted(&member).await;
                self.reconcile_held(&member).await;
            }
            if reconfigure && last_config.elapsed() >= Duration::from_secs(1) {
                last_config = Instant::now();
                duties.notify_one();
            }
            if last_gauges.elapsed() >= Duration::from_millis(100) {
                last_gauges = Instant::now();
                self.gauges(&member).await;
            }
        }
    }

    /// The configuration proposal (when the watcher asks) and, on the leader, the pool metrics
    /// every `pool_interval`.
    async fn duties(
        self: Arc<Self>,
        member: Arc<ClusterMember>,
        configure: Arc<Notify>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.opts.pool_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut warned, mut waited, mut pending) = (false, false, false);
        let needs = self.config.features();
        let lease = self.opts.params.lease_ms;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = configure.notified() => pending = true,
                _ = tick.tick() => {
                    if member.is_leader().await {
                        self.propose_pool(&member).await;
                    }
                }
            }
            if !pending {
                continue;
            }
            // A configuration some member's build cannot run waits until every voter and every
            // live member has said it can (retried every tick).
            let voters = if needs == 0 {
                Vec::new()
            } else {
                member.node.metrics().await.voters
            };
            if needs != 0
                && !member
                    .node
                    .local_read(|s| s.0.members_speak(needs, lease, &voters))
                    .await
                    .0
            {
                if !waited {
                    waited = true;
                    tracing::warn!(
                        "cluster flow control waits for every replica to run a build that \
                         speaks this flowControl configuration (turn priority)"
                    );
                }
                continue;
            }
            pending = false;
            let out = member
                .node
                .propose(ClusterCommand::ConfigureFlow {
                    config: Box::new(self.config.clone()),
                    params: self.opts.params,
                })
                .await;
            if matches!(out, Ok(ClusterOutput::Configured(false))) && !warned {
                warned = true;
                tracing::warn!(
                    "cluster flow control runs another replica's flowControl configuration (it \
                     is busy); every replica should run the same one"
                );
            }
        }
    }

    /// Hand verdicts to the requests still waiting for them (the writer's batch result and the
    /// watcher may both carry one: the first wins).
    fn deliver(&self, st: &mut State, verdicts: Vec<(u64, GVerdict)>) {
        for (seq, v) in verdicts {
            let Some(w) = st.waiting.remove(&seq) else {
                continue;
            };
            let verdict = match v {
                GVerdict::Dispatched => {
                    let rid = w.waiter.request_id.clone();
                    st.admitted.insert(seq, (Instant::now(), rid));
                    Verdict::Dispatched(Ticket(seq))
                }
                GVerdict::Rejected(r) => Verdict::Rejected(r),
            };
            if !w.waiter.resolve(&self.metrics, verdict) && matches!(v, GVerdict::Dispatched) {
                // The stream left just before its dispatch.
                st.push(FlowCmd::Cancel { seq });
            }
        }
    }

    /// Forget admissions the state no longer holds (settled anywhere, reclaimed); release those
    /// whose response nobody observed for [`ADMITTED_MAX_AGE`].
    async fn prune_admitted(&self, member: &ClusterMember) {
        let me = self.node_id;
        let seqs: Vec<u64> = self.lock().admitted.keys().copied().collect();
        let (held, _) = member
            .node
            .local_read(|s| {
                s.0.flow().map(|f| {
                    seqs.iter()
                        .map(|seq| f.holds((me, *seq)))
                        .collect::<Vec<bool>>()
                })
            })
            .await;
        let Some(held) = held else {
            return;
        };
        let mut st = self.lock();
        let unreported_from = st.unreported.front().copied().unwrap_or(u64::MAX);
        let mut expired = Vec::new();
        for (seq, held) in seqs.into_iter().zip(held) {
            if seq >= unreported_from {
                continue;
            }
            match st.admitted.get(&seq) {
                _ if !held => {
                    // Settled (perhaps observed by another replica) or reclaimed: this replica's
                    // own scoring ledger forgets it too.
                    if let (Some((_, rid)), Some(feed)) =
                        (st.admitted.remove(&seq), &self.load_feed)
                        && !feed.settled_elsewhere(rid)
                    {
                        tracing::debug!(
                            "in-flight ledger backlog full: a settlement waits for the sweep"
                        );
                    }
                }
                Some((at, _)) if at.elapsed() > ADMITTED_MAX_AGE => {
                    st.admitted.remove(&seq);
                    expired.push(seq);
                }
                _ => {}
            }
        }
        let stale: Vec<u64> = st
            .held
            .own
            .iter()
            .filter(|(_, o)| o.at.elapsed() > ADMITTED_MAX_AGE)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in &stale {
            st.held.end(*seq, None);
        }
        if !expired.is_empty() || !stale.is_empty() {
            tracing::warn!(
                expired = expired.len() + stale.len(),
                "cluster flow-control admissions released without an observed response"
            );
        }
        for seq in expired {
            st.push(FlowCmd::Cancel { seq });
        }
    }

    /// This replica's credit admissions whose settlement was lost (the observing stream failed,
    /// or its replica died before relaying it): a pod that has reported fewer requests running
    /// and waiting than the ledger holds for it, at two checks a second or more apart, loses
    /// this replica's share of the difference — its oldest requests there, at least
    /// [`RECONCILE_MIN_AGE_MS`] old — as the leader's reconciliation does for ledger entries.
    async fn reconcile_held(&self, member: &ClusterMember) {
        let pods: Vec<String> = {
            let st = self.lock();
            let mut pods: Vec<String> =
                st.held.own.values().filter_map(|o| o.pod.clone()).collect();
            pods.sort_unstable();
            pods.dedup();
            pods
        };
        if pods.is_empty() {
            self.lock().held.excess.clear();
            return;
        }
        let now = Instant::now();
        let seen: HashMap<String, u64> = pods_running(&self.store.candidates(now)).collect();
        let (ledger, _) = member
            .node
            .local_read(|s| {
                s.0.flow().map(|f| {
                    pods.iter()
                        .map(|p| f.pods().get(p).map_or(0, |l| l.requests))
                        .collect::<Vec<u64>>()
                })
            })
            .await;
        let Some(ledger) = ledger else {
            return;
        };
        let min_age = Duration::from_millis(RECONCILE_MIN_AGE_MS);
        let mut st = self.lock();
        let mut released = 0;
        for (pod, ledger) in pods.into_iter().zip(ledger) {
            // A pod without fresh metrics may run anything.
            let Some(&seen) = seen.get(&pod) else {
                st.held.excess.remove(&pod);
                continue;
            };
            if ledger <= seen {
                st.held.excess.remove(&pod);
                continue;
            }
            let since = *st.held.excess.entry(pod.clone()).or_insert(now);
            if now.duration_since(since) < Duration::from_millis(RECONCILE_PERSIST_MS) {
                continue;
            }
            st.held.excess.remove(&pod);
            let mut mine: Vec<(Instant, u64)> = st
                .held
                .own
                .iter()
                .filter(|(_, o)| o.pod.as_deref() == Some(pod.as_str()))
                .map(|(seq, o)| (o.at, *seq))
                .collect();
            // This replica's share of the excess (rounded up), oldest first.
            let share = ((ledger - seen) * mine.len() as u64).div_ceil(ledger) as usize;
            mine.sort_unstable();
            for (at, seq) in mine.into_iter().take(share) {
                if at.elapsed() >= min_age && st.held.end(seq, None).is_some() {
                    released += 1;
                }
            }
        }
        if released > 0 {
            tracing::warn!(
                released,
                "cluster flow control: credit admissions released, their pods report them gone"
            );
        }
    }

    /// The leader proposes the pool's endpoint metrics (sample times on the wall clock) and what
    /// each pod with fresh metrics reports running + waiting (the ledger's reconciliation).
    async fn propose_pool(&self, member: &ClusterMember) {
        let now = Instant::now();
        let wall_ns = wall_us().saturating_mul(1000);
        let candidates = self.store.candidates(now);
        let observed = pods_running(&candidates).collect();
        let endpoints = candidates
            .iter()
            .map(|c| {
                snapshot_with(c, |t| {
                    let age = now.saturating_duration_since(t).as_nanos();
                    wall_ns.saturating_sub(u64::try_from(age).unwrap_or(u64::MAX))
                })
            })
            .collect();
        let _ = tokio::time::timeout(
            Duration::from_millis(self.opts.params.lease_ms),
            member.node.propose(ClusterCommand::ObservePool {
                now_us: wall_us(),
                endpoints,
                observed,
            }),
        )
        .await;
    }

    /// Flow-control gauges from the replicated state (cluster-wide queue and in-flight), and the
    /// other replicas' per-pod load for the scorers.
    async fn gauges(&self, member: &ClusterMember) {
        let candidates = self.store.candidates(Instant::now());
        self.capacity
            .check(&self.config.detector, &candidates, &self.metrics);
        let me = self.node_id;
        let (stats, _) = member
            .node
            .local_read(|s| {
                s.0.flow().map(|f| {
                    // Saturation as of the state's time (sample ages are kept on its clock).
                    let now_ns = f.now_us().saturating_mul(1000);
                    let others: HashMap<String, InflightLoad> = f
                        .others_load(me)
                        .into_iter()
                        .map(|(pod, l)| {
                            // (The replicated ledger does not see first bytes: which of
                            // the others' requests still prefill is not known here.)
                            let load = InflightLoad {
                                requests: l.requests,
                                tokens: l.tokens,
                                prefilling: 0,
                            };
                            (pod.to_string(), load)
                        })
                        .collect();
                    (
                        f.controller().band_stats(),
                        f.controller().saturation(now_ns),
                        others,
                        f.quarantined_credit(),
                    )
                })
            })
            .await;
        let Some((bands, saturation, others, quarantined)) = stats else {
            return;
        };
        self.metrics.cluster.flow_quarantined(quarantined);
        if let Some(feed) = &self.load_feed {
            feed.publish_others(others);
        }
        let pool = self.metrics.pool_name().to_string();
        let f = &self.metrics.flow;
        for b in bands {
            let l = BandLabels {
                priority: b.priority.to_string(),
                inference_pool: pool.clone(),
            };
            let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            f.queue_size.get_or_create(&l).set(i(b.queued_requests));
            f.queue_bytes.get_or_create(&l).set(i(b.queued_bytes));
            f.inflight.get_or_create(&l).set(i(b.inflight_requests));
        }
        f.saturation
            .get_or_create(&SaturationLabels {
                inference_pool: pool,
                stage: "effective".to_string(),
            })
            .set(saturation);
        let st = self.lock();
        self.metrics
            .cluster
            .flow_local(st.credit, st.unreported(), st.waiting.len(), st.degraded);
    }
}

/// What each pod with fresh metrics reports running + waiting (the ledgers' reconciliation).
fn pods_running(candidates: &[Candidate]) -> impl Iterator<Item = (String, u64)> + '_ {
    candidates.iter().filter_map(|c| {
        let m = c.metrics()?;
        let n = m.running_requests? + m.waiting_queue_size.unwrap_or(0.0);
        Some((c.endpoint.hostport.clone(), n.max(0.0) as u64))
    })
}
