//! The replicated cluster state: which replicas are alive (liveness leases) and, once configured,
//! the cluster-wide flow state ([`GlobalFlow`]: credit, the global queue, the in-flight ledger).
//!
//! Every replica proposes a [`ClusterCommand::Heartbeat`] through the consensus log every few
//! hundred milliseconds; a replica whose last heartbeat is older than the lease TTL is dead to
//! everyone, at the same log position, and the flow state returns what it held. Like the rest of
//! `flowctl` it is pure: time comes with the log — each entry's leader stamp
//! ([`ClusterState::stamp`]), or the commands' proposer times in a log without stamps — and every
//! replica computes the same state. Members' clocks need not agree.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::ControllerConfig;
use crate::global::{BatchResult, FlowCmd, GlobalFlow, GlobalParams};
use crate::quota::shared::{Billed, QuotaCmd, SharedQuota};
use crate::saturation::EndpointSnapshot;

pub use crate::global::MemberId;

/// What the cluster knows about one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The replica's ext_proc address (what Envoy connects to).
    pub ext_proc: String,
    /// The replica's admin HTTP address.
    pub admin: String,
    /// Wall-clock milliseconds of the proposer when it started (a restart changes it).
    pub started_ms: u64,
    /// Wall-clock milliseconds of its last heartbeat.
    pub last_seen_ms: u64,
    pub heartbeats: u64,
    /// What the replica's build speaks ([`FEATURE_HELD`]…), as its last heartbeat said (none
    /// from a build older than the field).
    #[serde(default)]
    pub features: u32,
}

/// A member's build applies [`crate::global::FlowCmd::Held`] (bulk holdings): members report
/// their credit admissions that way only while every live member does (a build without it
/// could not decode the log).
pub const FEATURE_HELD: u32 = 1;

/// A member's build runs `program-aware-fairness` with `strategy: turn-priority`: a replica
/// proposes a flow configuration that uses it only once every live member does (an older build
/// would run least attained service in its place, and the members' states would part).
pub const FEATURE_TURN_PRIORITY: u32 = 2;

/// Everything this build speaks, as its heartbeats say.
pub const FEATURES: u32 = FEATURE_HELD | FEATURE_TURN_PRIORITY;

/// Commands of the cluster state machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClusterCommand {
    /// `node` is alive (`now_ms`: the proposer's wall clock, used only without leader stamps).
    Heartbeat {
        node: MemberId,
        now_ms: u64,
        ext_proc: String,
        admin: String,
        started_ms: u64,
        /// [`FEATURE_HELD`]… (absent from older builds' heartbeats: none).
        #[serde(default)]
        features: u32,
    },
    /// `node` leaves (graceful shutdown): its lease ends now.
    Leave { node: MemberId },
    /// Turn on cluster-wide flow control with this configuration. The first one wins; a different
    /// one replaces it only while nothing is queued or in flight.
    ConfigureFlow {
        config: Box<ControllerConfig>,
        params: GlobalParams,
    },
    /// A member's batch of flow-control commands, stamped with its incarnation and wall clock.
    Flow {
        node: MemberId,
        incarnation: u64,
        now_us: u64,
        cmds: Vec<FlowCmd>,
    },
    /// The pool's endpoint metrics (sample times in the proposer's wall-clock ns, at its `now_us`:
    /// what counts is their age), proposed by the leader, and
    /// the requests each pod reports running or waiting (for [`GlobalFlow::reconcile`]).
    ObservePool {
        now_us: u64,
        endpoints: Vec<EndpointSnapshot>,
        #[serde(default)]
        observed: Vec<(String, u64)>,
    },
    /// A member's batch of tenant-quota commands ([`crate::quota::shared`]); `lease_ms` is the
    /// members' lease (the same flag everywhere), which ends a silent member's slices.
    Quota {
        node: MemberId,
        incarnation: u64,
        /// The member's batch number (a retried proposal is applied once).
        seq: u64,
        now_us: u64,
        lease_ms: u64,
        cmds: Vec<QuotaCmd>,
    },
    /// A no-op write through the log (`epp cluster probe`): proves the cluster commits and lets
    /// operators and tests compare the order in which every replica applied them.
    Probe { node: MemberId, seq: u64 },
}

/// How many applied probes [`ClusterState::probes`] keeps, newest last.
pub const PROBE_LOG: usize = 4096;

/// The probes applied so far: their count and the most recent ones in apply order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeLog {
    pub applied: u64,
    pub recent: VecDeque<(MemberId, u64)>,
}

/// What applying a command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClusterOutput {
    /// The member's heartbeat count after this command (0 after `Leave`).
    Heartbeats(u64),
    /// The member was restarted (new `started_ms`): its old lease's resources are void.
    Restarted,
    UnknownMember,
    /// `ConfigureFlow`: whether the configuration is now the given one.
    Configured(bool),
    Flow(BatchResult),
    /// A flow command while cluster flow control is not configured.
    NoFlow,
    /// `Probe`: how many probes the cluster has applied, this one included.
    Probed(u64),
    /// `Quota`: the requests it settled.
    Quota(Vec<Billed>),
}

/// Replicated membership with liveness leases, and the global flow state when configured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterState {
    members: BTreeMap<MemberId, Member>,
    /// The state's notion of "now" (monotone): the log clock once entries carry their leader's
    /// stamp, else the highest proposer time seen.
    now_ms: u64,
    /// The log clock (µs): the highest leader stamp of the entries applied so far; 0 before the
    /// first stamped entry. Once set, proposers' clocks are not read: leases, flow time and
    /// sample ages do not depend on members' clocks agreeing.
    #[serde(default)]
    clock_us: u64,
    #[serde(default)]
    flow: Option<GlobalFlow>,
    #[serde(default)]
    probes: ProbeLog,
    /// Tenant quotas, once a member proposed any quota command.
    #[serde(default)]
    quota: SharedQuota,
    /// The members' lease for quotas (from their `Quota` batches; 0: none seen).
    #[serde(default)]
    quota_lease_ms: u64,
}

impl ClusterState {
    /// The leader's stamp of the entry whose commands follow.
    pub fn stamp(&mut self, stamp_us: u64) {
        self.clock_us = self.clock_us.max(stamp_us);
    }

    /// A command's time (µs): the log clock when entries are stamped, else the proposer's.
    fn time_us(&self, proposer_us: u64) -> u64 {
        if self.clock_us > 0 {
            self.clock_us
        } else {
            proposer_us
        }
    }

    pub fn apply(&mut self, cmd: ClusterCommand) -> ClusterOutput {
        let heartbeat = match &cmd {
            ClusterCommand::Heartbeat {
                node, started_ms, ..
            } => Some((*node, *started_ms)),
            _ => None,
        };
        self.compensate_stall(&cmd);
        let out = self.apply_inner(cmd);
        if self.quota_lease_ms > 0 {
            let live = self.live_set_with(self.quota_lease_ms);
            let now = self.now_ms.saturating_mul(1_000_000);
            self.quota.advance(now, &live);
        }
        if let Some(lease) = self.flow.as_ref().map(|f| f.params().lease_ms) {
            let live = self.live_set_with(lease);
            let now_us = self.now_ms.saturating_mul(1000);
            if let Some(flow) = self.flow.as_mut() {
                if let Some((node, started_ms)) = heartbeat
                    && live.contains(&node)
                {
                    flow.member_alive(node, started_ms, &live);
                }
                flow.advance(now_us, &live);
            }
        }
        out
    }

    /// A member cannot be blamed for heartbeats the log could not take: when the log was stalled
    /// (no command for longer than a heartbeat period — an election), every lease is extended by
    /// the stall, so an election does not expire the survivors (and reclaim their requests) the
    /// moment the log resumes. A dead member still expires one lease after the log resumes.
    fn compensate_stall(&mut self, cmd: &ClusterCommand) {
        let lease = match self.flow.as_ref().map(|f| f.params().lease_ms) {
            Some(l) => l,
            None if self.quota_lease_ms > 0 => self.quota_lease_ms,
            None => return,
        };
        let now = match cmd {
            ClusterCommand::Heartbeat { now_ms, .. } => self.time_us(now_ms.saturating_mul(1000)),
            ClusterCommand::Flow { now_us, .. }
            | ClusterCommand::ObservePool { now_us, .. }
            | ClusterCommand::Quota { now_us, .. } => self.time_us(*now_us),
            _ => return,
        } / 1000;
        let period = lease / 3;
        let gap = now.saturating_sub(self.now_ms);
        if self.now_ms > 0 && gap > period {
            for m in self.members.values_mut() {
                m.last_seen_ms = m.last_seen_ms.saturating_add(gap - period);
            }
        }
    }

    fn live_set_with(&self, lease_ms: u64) -> BTreeSet<MemberId> {
        self.live(self.now_ms, lease_ms).map(|(id, _)| id).collect()
    }

    /// Whether every member live within the flow lease speaks `feature` (false before flow
    /// control is configured).
    pub fn live_members_speak(&self, feature: u32) -> bool {
        let Some(lease) = self.flow.as_ref().map(|f| f.params().lease_ms) else {
            return false;
        };
        self.members_speak(feature, lease, &[])
    }

    /// Whether every member heard from within `lease_ms` speaks `feature` (with or without
    /// cluster flow control configured), and so do the `required` ones (e.g. the voters: a
    /// member that has not heartbeated yet has not said what it speaks).
    pub fn members_speak(&self, feature: u32, lease_ms: u64, required: &[MemberId]) -> bool {
        let speaks = |m: &Member| m.features & feature == feature;
        self.live(self.now_ms, lease_ms).all(|(_, m)| speaks(m))
            && required
                .iter()
                .all(|id| self.members.get(id).is_some_and(speaks))
    }

    /// The global flow state, when cluster flow control is configured.
    pub fn flow(&self) -> Option<&GlobalFlow> {
        self.flow.as_ref()
    }

    fn apply_inner(&mut self, cmd: ClusterCommand) -> ClusterOutput {
        match cmd {
            ClusterCommand::ConfigureFlow { config, params } => {
                let replace = match &self.flow {
                    None => true,
                    Some(f) if f.config() == config.as_ref() && f.params() == params => {
                        return ClusterOutput::Configured(true);
                    }
                    Some(f) => {
                        let t = f.totals();
                        t.queued_requests == 0 && t.inflight_requests == 0
                    }
                };
                if !replace {
                    return ClusterOutput::Configured(false);
                }
                match GlobalFlow::new(*config, params) {
                    Ok(mut f) => {
                        let live = self.live_set_with(params.lease_ms);
                        for (id, m) in &self.members {
                            if live.contains(id) {
                                f.member_alive(*id, m.started_ms, &live);
                            }
                        }
                        self.flow = Some(f);
                        ClusterOutput::Configured(true)
                    }
                    Err(_) => ClusterOutput::Configured(false),
                }
            }
            ClusterCommand::Flow {
                node,
                incarnation,
                now_us,
                cmds,
            } => {
                let now_us = self.time_us(now_us);
                self.now_ms = self.now_ms.max(now_us / 1000);
                let Some(flow) = self.flow.as_mut() else {
                    return ClusterOutput::NoFlow;
                };
                ClusterOutput::Flow(flow.apply_batch(now_us, node, incarnation, cmds))
            }
            ClusterCommand::ObservePool {
                now_us: proposed_us,
                mut endpoints,
                observed,
            } => {
                let now_us = self.time_us(proposed_us);
                self.now_ms = self.now_ms.max(now_us / 1000);
                let Some(flow) = self.flow.as_mut() else {
                    return ClusterOutput::NoFlow;
                };
                // Sample times are on the proposer's clock: keep their age, on the log clock.
                let (at, now) = (
                    proposed_us.saturating_mul(1000),
                    now_us.saturating_mul(1000),
                );
                for e in &mut endpoints {
                    e.sampled_at = e
                        .sampled_at
                        .map(|t| now.saturating_sub(at.saturating_sub(t)));
                }
                flow.observe_pool(endpoints);
                flow.reconcile(now_us, &observed);
                ClusterOutput::Configured(true)
            }
            ClusterCommand::Heartbeat {
                node,
                now_ms,
                ext_proc,
                admin,
                started_ms,
                features,
            } => {
                let now_ms = self.time_us(now_ms.saturating_mul(1000)) / 1000;
                self.now_ms = self.now_ms.max(now_ms);
                match self.members.get_mut(&node) {
                    Some(m) if m.started_ms == started_ms => {
                        m.last_seen_ms = m.last_seen_ms.max(now_ms);
                        m.heartbeats += 1;
                        m.ext_proc = ext_proc;
                        m.admin = admin;
                        m.features = features;
                        ClusterOutput::Heartbeats(m.heartbeats)
                    }
                    existing => {
                        let restarted = existing.is_some();
                        self.members.insert(
                            node,
                            Member {
                                ext_proc,
                                admin,
                                started_ms,
                                last_seen_ms: now_ms,
                                heartbeats: 1,
                                features,
                            },
                        );
                        if restarted {
                            ClusterOutput::Restarted
                        } else {
                            ClusterOutput::Heartbeats(1)
                        }
                    }
                }
            }
            ClusterCommand::Quota {
                node,
                incarnation,
                seq,
                now_us,
                lease_ms,
                cmds,
            } => {
                let now_us = self.time_us(now_us);
                self.now_ms = self.now_ms.max(now_us / 1000);
                self.quota_lease_ms = lease_ms;
                let now = self.now_ms.saturating_mul(1_000_000);
                ClusterOutput::Quota(self.quota.apply(now, node, incarnation, seq, cmds))
            }
            ClusterCommand::Probe { node, seq } => {
                let p = &mut self.probes;
                p.applied += 1;
                if p.recent.len() == PROBE_LOG {
                    p.recent.pop_front();
                }
                p.recent.push_back((node, seq));
                ClusterOutput::Probed(p.applied)
            }
            ClusterCommand::Leave { node } => match self.members.remove(&node) {
                Some(_) => ClusterOutput::Heartbeats(0),
                None => ClusterOutput::UnknownMember,
            },
        }
    }

    /// Tenant quotas (cluster mode with `--tenants-file`).
    pub fn quota(&self) -> &SharedQuota {
        &self.quota
    }

    /// Tenant quotas, for views that refill buckets to the log clock.
    pub fn quota_mut(&mut self) -> &mut SharedQuota {
        &mut self.quota
    }

    /// The probes applied so far (`epp cluster probe`).
    pub fn probes(&self) -> &ProbeLog {
        &self.probes
    }

    pub fn members(&self) -> &BTreeMap<MemberId, Member> {
        &self.members
    }

    /// The latest time any heartbeat carried.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Whether `node`'s lease is valid at `now_ms` with lease length `ttl_ms`.
    pub fn is_live(&self, node: MemberId, now_ms: u64, ttl_ms: u64) -> bool {
        self.members
            .get(&node)
            .is_some_and(|m| now_ms.saturating_sub(m.last_seen_ms) < ttl_ms)
    }

    /// Members whose lease is valid at `now_ms`.
    pub fn live(&self, now_ms: u64, ttl_ms: u64) -> impl Iterator<Item = (MemberId, &Member)> {
        self.members
            .iter()
            .filter(move |(_, m)| now_ms.saturating_sub(m.last_seen_ms) < ttl_ms)
            .map(|(id, m)| (*id, m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(node: MemberId, now_ms: u64, started_ms: u64) -> ClusterCommand {
        ClusterCommand::Heartbeat {
            node,
            now_ms,
            ext_proc: format!("127.0.0.1:{node}"),
            admin: String::new(),
            started_ms,
            features: FEATURE_HELD,
        }
    }

    /// Three members heartbeating every 100 ms for 5 s, member 2's clock 2 s behind and member
    /// 3's 2 s ahead; who is live at the end with a 1.5 s lease, when entries carry the leader's
    /// stamp (`stamped`) or not.
    fn live_after_skewed_heartbeats(stamped: bool) -> Vec<MemberId> {
        let mut s = ClusterState::default();
        let skew = |node: MemberId| match node {
            2 => -2000i64,
            3 => 2000,
            _ => 0,
        };
        for tick in 0..50u64 {
            let real = 1_000_000 + tick * 100;
            for node in [1, 2, 3] {
                if stamped {
                    s.stamp(real * 1000); // the leader's clock, node 1's
                }
                let own = real.saturating_add_signed(skew(node));
                s.apply(hb(node, own, 7));
            }
        }
        s.live(s.now_ms(), 1500).map(|(id, _)| id).collect()
    }

    #[test]
    fn skewed_clocks_do_not_end_live_leases_on_the_log_clock() {
        assert_eq!(live_after_skewed_heartbeats(true), vec![1, 2, 3]);
        // Proposers' clocks: the one 2 s ahead drags "now" along and the others look dead.
        assert_eq!(live_after_skewed_heartbeats(false), vec![3]);
    }

    #[test]
    fn pool_samples_keep_their_age_on_the_log_clock() {
        let mut s = ClusterState::default();
        s.apply(ClusterCommand::ConfigureFlow {
            config: Box::default(),
            params: GlobalParams::default(),
        });
        // The proposer's clock is 5 s behind the leader's; its sample is 10 ms old.
        let leader_us = 2_000_000_000;
        let proposer_us = leader_us - 5_000_000;
        s.stamp(leader_us);
        s.apply(ClusterCommand::ObservePool {
            now_us: proposer_us,
            endpoints: vec![EndpointSnapshot {
                sampled_at: Some((proposer_us - 10_000) * 1000),
                ..EndpointSnapshot::default()
            }],
            observed: vec![],
        });
        let f = s.flow().unwrap();
        let sampled = f.controller().pool_samples()[0].sampled_at.unwrap();
        assert_eq!(sampled, (leader_us - 10_000) * 1000);
    }

    #[test]
    fn leases_expire_restart_and_leave() {
        let mut s = ClusterState::default();
        assert_eq!(s.apply(hb(1, 1000, 1)), ClusterOutput::Heartbeats(1));
        assert_eq!(s.apply(hb(2, 1100, 5)), ClusterOutput::Heartbeats(1));
        assert_eq!(s.apply(hb(1, 1500, 1)), ClusterOutput::Heartbeats(2));
        // A late (reordered) heartbeat never moves a lease backwards.
        s.apply(hb(1, 1200, 1));
        assert_eq!(s.members()[&1].last_seen_ms, 1500);
        let live: Vec<MemberId> = s.live(2150, 1000).map(|(id, _)| id).collect();
        assert_eq!(live, vec![1], "node 2's lease (last 1100) ended at 2100");
        assert!(!s.is_live(2, 2150, 1000));
        assert_eq!(s.apply(hb(2, 3000, 9)), ClusterOutput::Restarted);
        assert_eq!(s.members()[&2].heartbeats, 1);
        assert_eq!(
            s.apply(ClusterCommand::Leave { node: 1 }),
            ClusterOutput::Heartbeats(0)
        );
        assert_eq!(
            s.apply(ClusterCommand::Leave { node: 1 }),
            ClusterOutput::UnknownMember
        );
        assert_eq!(s.now_ms(), 3000);
    }

    #[test]
    fn same_commands_same_state() {
        let cmds = vec![
            hb(3, 10, 1),
            hb(1, 20, 2),
            ClusterCommand::Probe { node: 3, seq: 1 },
            hb(3, 30, 1),
            ClusterCommand::Leave { node: 1 },
            ClusterCommand::Probe { node: 1, seq: 7 },
        ];
        let (mut a, mut b) = (ClusterState::default(), ClusterState::default());
        for c in &cmds {
            a.apply(c.clone());
            b.apply(c.clone());
        }
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        assert_eq!(a.probes().applied, 2);
        assert_eq!(a.probes().recent, VecDeque::from(vec![(3, 1), (1, 7)]));
    }

    #[test]
    fn a_silent_members_quota_slices_return_at_lease_end() {
        use crate::quota::Limits;
        let mut s = ClusterState::default();
        let limits = Limits {
            tokens_per_minute: Some(1000),
            concurrency: Some(4),
            ..Limits::default()
        };
        let want = |node| ClusterCommand::Quota {
            node,
            incarnation: 7,
            seq: 1,
            now_us: 1_000_000,
            lease_ms: 1500,
            cmds: vec![QuotaCmd::Want {
                tenant: "t".into(),
                limit_key: "*".into(),
                limits: limits.clone(),
                tokens: 400,
                requests: 0,
                slots: 3,
            }],
        };
        s.apply(hb(1, 1000, 7));
        s.apply(hb(2, 1000, 7));
        s.apply(want(1));
        s.apply(want(2));
        let q = s.quota();
        assert_eq!(
            (q.slice(1, "t", "*").tokens, q.slice(1, "t", "*").slots),
            (400, 3)
        );
        assert_eq!(
            (q.slice(2, "t", "*").tokens, q.slice(2, "t", "*").slots),
            (400, 1)
        );
        assert_eq!(q.book().tokens_left("t", "*"), Some(200));
        // Member 2 goes on heartbeating; member 1 falls silent past its lease.
        for t in [1400, 1800, 2200, 2600] {
            s.apply(hb(2, t, 7));
        }
        let q = s.quota();
        assert_eq!(q.slice(1, "t", "*"), crate::quota::shared::Slice::default());
        assert_eq!(q.sliced_slots("t", "*"), 1);
        // 200 + member 1's 400 back + 1.6 s of refill at 1000 a minute.
        assert_eq!(q.book().tokens_left("t", "*"), Some(626));
    }

    #[test]
    fn probe_log_keeps_the_newest() {
        let mut s = ClusterState::default();
        let n = PROBE_LOG as u64 + 10;
        for seq in 1..=n {
            assert_eq!(
                s.apply(ClusterCommand::Probe { node: 2, seq }),
                ClusterOutput::Probed(seq)
            );
        }
        assert_eq!(s.probes().applied, n);
        assert_eq!(s.probes().recent.len(), PROBE_LOG);
        assert_eq!(s.probes().recent.front(), Some(&(2, 11)));
        assert_eq!(s.probes().recent.back(), Some(&(2, n)));
    }
}
