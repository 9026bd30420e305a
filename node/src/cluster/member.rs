//! Cluster mode: this replica as a member of a Raft group (`consensus`) replicating `flowctl`'s
//! cluster state: the members' liveness leases and, with the `flowControl` gate, the global flow
//! state that [`super::gate`] drives.
//!
//! Every replica proposes a heartbeat every [`ClusterOptions::heartbeat`]; the replicated state
//! says who is alive. A replica that cannot commit (no quorum reachable) keeps answering ext_proc
//! — routing does not depend on consensus — and reports it: `llm_d_epp_cluster_quorum 0`, a
//! warning in the log, `"quorum": false` in `/debug/cluster`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use consensus::{ConsensusNode, StateMachine};
use flowctl::cluster::{ClusterCommand, ClusterOutput, ClusterState, Member, MemberId};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::options::{ClusterOptions, MAX_VOTERS};
use crate::metrics::Metrics;

/// `flowctl`'s cluster state as the consensus layer's state machine.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Replicated(pub ClusterState);

impl StateMachine for Replicated {
    type Command = ClusterCommand;
    type Output = ClusterOutput;

    fn apply(&mut self, cmd: ClusterCommand) -> ClusterOutput {
        self.0.apply(cmd)
    }

    fn stamp(&mut self, stamp_us: u64) {
        self.0.stamp(stamp_us);
    }

    fn acting_for(cmd: &ClusterCommand) -> Option<consensus::NodeId> {
        match cmd {
            ClusterCommand::Heartbeat { node, .. }
            | ClusterCommand::Leave { node }
            | ClusterCommand::Flow { node, .. }
            | ClusterCommand::Quota { node, .. }
            | ClusterCommand::Probe { node, .. } => Some(*node),
            ClusterCommand::ConfigureFlow { .. } | ClusterCommand::ObservePool { .. } => None,
        }
    }
}

/// A running cluster member.
pub struct ClusterMember {
    pub node: ConsensusNode<Replicated>,
    opts: ClusterOptions,
    quorum: AtomicBool,
    /// A member (a voter, or a learner the cluster has no vote for): `auto_join` has nothing
    /// left to do. Always with `auto_join` off.
    joined: AtomicBool,
    started: Instant,
    started_ms: u64,
    /// When the last committed heartbeat was proposed (the rest of the cluster holds this
    /// replica's lease until at most that instant + the lease), and the local applied index at
    /// which this replica's own state first reflected it.
    lease_from: std::sync::Mutex<Option<(Instant, u64)>>,
    /// Sequence number of this replica's last probe (`epp cluster probe`).
    probe_seq: AtomicU64,
}

impl std::fmt::Debug for ClusterMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterMember")
            .field("node_id", &self.opts.node_id)
            .finish_non_exhaustive()
    }
}

/// A stopping replica hands in its vote only while more voters than this remain (`resign`):
/// with three voters one may be down, and shrinking the voter set further would only make the
/// next failure costlier.
const MIN_VOTERS_KEPT: usize = 3;

/// How long a replica joining with `auto_join` reports not ready at most.
const JOINED_WITHIN: Duration = Duration::from_secs(30);

/// This replica's wall clock (with the test offset): heartbeats carry it, but the replicated
/// state keeps time by its leaders' stamps (`consensus::clock`).
fn wall_ms() -> u64 {
    consensus::clock::now_ms()
}

/// `/debug/cluster`: Raft's view plus the replicated membership leases.
#[derive(Debug, Serialize)]
pub struct ClusterView {
    pub node_id: u64,
    /// Whether this replica's last heartbeat committed.
    pub quorum: bool,
    pub raft: consensus::ClusterStatus,
    pub lease_ms: u64,
    pub members: Vec<MemberView>,
}

#[derive(Debug, Serialize)]
pub struct MemberView {
    pub id: MemberId,
    pub live: bool,
    #[serde(flatten)]
    pub member: Member,
}

/// An operator's probe request (`POST /debug/cluster/probe`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    pub count: u32,
    /// Probes in flight at once (they coalesce into shared log entries); default 1.
    #[serde(default)]
    pub concurrency: Option<u32>,
}

/// What [`ClusterMember::probe`] measured.
#[derive(Debug, Serialize)]
pub struct ProbeReport {
    pub node_id: u64,
    pub count: u32,
    pub committed: u32,
    pub failed: u32,
    pub first_error: Option<String>,
    /// This replica's probe sequence numbers, first and last.
    pub seqs: (u64, u64),
    pub elapsed_ms: f64,
    pub per_second: f64,
    /// Commit latency of one probe (proposal → applied output), ms.
    pub latency_ms: ProbeLatency,
}

#[derive(Debug, Serialize)]
pub struct ProbeLatency {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

/// Largest probe an operator may ask for in one call.
pub const MAX_PROBES: u32 = 100_000;

/// An operator's membership request (`POST /debug/cluster/<op>`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MembershipRequest {
    pub id: u64,
    #[serde(default)]
    pub addr: Option<String>,
}

impl ClusterMember {
    /// Starts the consensus node; `routes` are further peer services served on its port.
    pub async fn start(
        opts: ClusterOptions,
        listener: TcpListener,
        routes: tonic::service::Routes,
    ) -> Result<ClusterMember, consensus::ConsensusError> {
        let node =
            ConsensusNode::start_with_routes(opts.consensus_config(), listener, routes).await?;
        Ok(ClusterMember {
            node,
            joined: AtomicBool::new(!opts.auto_join),
            opts,
            quorum: AtomicBool::new(false),
            started: Instant::now(),
            started_ms: wall_ms(),
            lease_from: std::sync::Mutex::new(None),
            probe_seq: AtomicU64::new(0),
        })
    }

    /// This run's incarnation (its start time, ms): heartbeats and flow batches carry it.
    pub fn incarnation(&self) -> u64 {
        self.started_ms
    }

    pub fn node_id(&self) -> u64 {
        self.opts.node_id
    }

    /// The lease of cluster members (three heartbeats).
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.opts.lease_ms())
    }

    /// Whether this replica is the Raft leader now.
    pub async fn is_leader(&self) -> bool {
        self.node.metrics().await.leader == Some(self.opts.node_id)
    }

    /// Whether the cluster still counts this replica as live (its last committed heartbeat is
    /// younger than the lease, measured from when it was proposed — never later than the others'
    /// view).
    pub fn lease_valid(&self) -> bool {
        self.lease_index().is_some()
    }

    /// While the lease is valid: the local applied index from which this replica's own state
    /// knows it (a state read at an earlier index may predate the lease — e.g. show the credit
    /// this replica had before a partition, which the leader has since re-granted).
    pub fn lease_index(&self) -> Option<u64> {
        let lease = self.lease();
        self.lease_from
            .lock()
            .ok()
            .and_then(|l| *l)
            .filter(|(t, _)| t.elapsed() < lease)
            .map(|(_, i)| i)
    }

    /// After a heartbeat committed: wait (within `deadline`) until the local state applied it,
    /// and return that applied index.
    async fn applied_own_heartbeat(&self, count: u64, deadline: Instant) -> Option<u64> {
        let (me, started) = (self.opts.node_id, self.started_ms);
        let mut applied = self.node.watch();
        loop {
            let (seen, index) = self
                .node
                .local_read(|s| {
                    s.0.members()
                        .get(&me)
                        .is_some_and(|m| m.started_ms == started && m.heartbeats >= count)
                })
                .await;
            if seen {
                return Some(index);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            tokio::time::timeout(left, applied.changed())
                .await
                .ok()?
                .ok()?;
        }
    }

    pub fn has_quorum(&self) -> bool {
        self.quorum.load(Ordering::Relaxed)
    }

    /// Heartbeats until `stop`; records proposal latency and Raft progress in `metrics`.
    pub async fn run(
        self: Arc<Self>,
        ext_proc: String,
        admin: String,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.opts.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut warned = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let t0 = Instant::now();
            let cmd = ClusterCommand::Heartbeat {
                node: self.opts.node_id,
                now_ms: wall_ms(),
                ext_proc: ext_proc.clone(),
                admin: admin.clone(),
                started_ms: self.started_ms,
                features: self.opts.features,
            };
            // A heartbeat slower than its lease is as good as lost.
            let res = tokio::time::timeout(
                Duration::from_millis(self.opts.lease_ms()),
                self.node.propose(cmd),
            )
            .await;
            let ok = matches!(res, Ok(Ok(_)));
            if let Ok(Ok(out)) = &res {
                let count = match out {
                    ClusterOutput::Heartbeats(n) => *n,
                    _ => 1,
                };
                let deadline = t0 + Duration::from_millis(self.opts.lease_ms());
                if let Some(index) = self.applied_own_heartbeat(count, deadline).await
                    && let Ok(mut l) = self.lease_from.lock()
                {
                    *l = Some((t0, index));
                }
            }
            if ok {
                metrics.cluster.proposal(t0.elapsed().as_secs_f64());
                if warned {
                    tracing::info!("cluster quorum regained");
                    warned = false;
                }
            } else if !warned {
                let why = match res {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".to_string(),
                };
                tracing::warn!(%why, "cannot commit to the cluster (no quorum?): routing continues on local state");
                warned = true;
            }
            self.quorum.store(ok, Ordering::Relaxed);
            let m = self.node.metrics().await;
            metrics.cluster.observe(&m, ok);
        }
    }

    /// Membership upkeep until `stop`: with `auto_join`, a replica that is not a voter a few
    /// seconds after start asks the configured peers to add it, then promotes itself while the
    /// cluster has fewer than [`MAX_VOTERS`] voters; with `remove_departed_after`, a member the
    /// configuration of this replica no longer names is removed (through the leader) once it has
    /// been dead that long — by the first replica restarted with the new configuration, so a
    /// rolling update does not wait for the leader's turn.
    pub async fn reconcile(self: Arc<Self>, stop: CancellationToken) {
        // The bootstrap of a new cluster reaches its first voters well within this.
        const JOIN_AFTER: Duration = Duration::from_secs(3);
        let me = self.opts.node_id;
        let mut dead_since = BTreeMap::new();
        let (mut join_attempts, mut promotions_failed) = (0, 0);
        let mut tick = tokio::time::interval(self.opts.heartbeat * 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let m = self.node.metrics().await;
            if !self.is_joined() {
                // A voter the leader's membership confirms is home (a restart from its volume,
                // or the bootstrap reaching it). One whose volume shows it outside the voters
                // (it handed in its vote when it stopped) asks at once; a new one gives the
                // bootstrap time first.
                let home = m.voters.contains(&me) && self.confirmed_voter().await;
                let outside = !m.voters.is_empty() && !m.voters.contains(&me);
                let done = home
                    || ((outside || self.started.elapsed() >= JOIN_AFTER)
                        && self
                            .join_step(&m, &mut join_attempts, &mut promotions_failed)
                            .await);
                if done {
                    self.joined.store(true, Ordering::Relaxed);
                }
            }
            if let Some(grace) = self.opts.remove_departed_after
                && m.leader.is_some()
            {
                self.remove_departed(&m, grace, &mut dead_since).await;
            }
        }
    }

    /// One attempt of joining; `true` once nothing is left to do.
    async fn join_step(
        &self,
        m: &consensus::ConsensusMetrics,
        attempts: &mut u32,
        promotions_failed: &mut u32,
    ) -> bool {
        let me = self.opts.node_id;
        // Asked again after a failed promotion too: a replica removed while it was away still
        // sees itself a learner (or a voter) in its volume's membership, and the leader refuses
        // a non-member's promotion. (Adding a current learner changes nothing.)
        if !m.learners.contains(&me) || m.leader.is_none() || *promotions_failed > 0 {
            *attempts += 1;
            if *attempts == 1 || attempts.is_power_of_two() {
                tracing::info!(
                    node_id = me,
                    attempts = *attempts,
                    "not a member: asking the peers to add this replica"
                );
            }
            if let Err(e) = self.node.join(&self.opts.peers).await {
                if *attempts == 1 || attempts.is_power_of_two() {
                    tracing::warn!(error = %e, attempts = *attempts, "joining the cluster failed; retrying");
                }
                return false;
            }
            tracing::info!(node_id = me, "added as a learner, caught up");
            *promotions_failed = 0;
            return false; // promoted at the next step, once the membership shows it
        }
        if m.voters.len() >= MAX_VOTERS {
            tracing::info!(
                node_id = me,
                voters = m.voters.len(),
                "the cluster has its voters: staying a learner"
            );
            return true;
        }
        match self.node.promote(me).await {
            Ok(_) => {
                tracing::info!(node_id = me, "promoted to voter");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "promotion failed; asking the peers to add this replica again");
                *promotions_failed += 1;
                false
            }
        }
    }

    /// Removes one member `peers` does not name that this replica has seen dead for `grace` or
    /// more; `dead_since` is when it first saw each such member dead.
    async fn remove_departed(
        &self,
        m: &consensus::ConsensusMetrics,
        grace: Duration,
        dead_since: &mut BTreeMap<u64, Instant>,
    ) {
        let lease = self.opts.lease_ms();
        let unnamed: Vec<u64> = m
            .voters
            .iter()
            .chain(&m.learners)
            .copied()
            .filter(|id| !self.opts.peers.contains_key(id))
            .collect();
        // Dead: its lease expired, or gone from the replicated members (it left). (A learner
        // without a lease may also be a joiner whose first heartbeat is yet to commit — well
        // within any sane grace period.)
        let (dead, _) = self
            .node
            .local_read(|s| {
                let now = s.0.now_ms();
                unnamed
                    .iter()
                    .copied()
                    .filter(|id| {
                        s.0.members()
                            .get(id)
                            .is_none_or(|_| !s.0.is_live(*id, now, lease))
                    })
                    .collect::<Vec<_>>()
            })
            .await;
        dead_since.retain(|id, _| dead.contains(id));
        for id in &dead {
            dead_since.entry(*id).or_insert_with(Instant::now);
        }
        let Some(id) = dead_since
            .iter()
            .find(|(_, since)| since.elapsed() >= grace)
            .map(|(id, _)| *id)
        else {
            return;
        };
        tracing::info!(
            node_id = id,
            ?grace,
            "removing a departed member the configuration no longer names"
        );
        match self.node.remove(id).await {
            Ok(_) => {
                dead_since.remove(&id);
            }
            Err(e) => {
                tracing::warn!(node_id = id, error = %e, "removing a departed member failed; retrying");
            }
        }
    }

    /// Whether the cluster's membership — not a stale local view of it — has this replica as a
    /// voter: a linearizable read brings the local log up to the leader's commit index (a
    /// replica the cluster removed, which the leader no longer replicates to, never gets there),
    /// then the local membership is read.
    async fn confirmed_voter(&self) -> bool {
        self.node.linearizable_read(|_| ()).await.is_ok()
            && self
                .node
                .metrics()
                .await
                .voters
                .contains(&self.opts.node_id)
    }

    /// Whether `auto_join` has made this replica a member (always, without `auto_join`).
    pub fn is_joined(&self) -> bool {
        self.joined.load(Ordering::Relaxed)
    }

    /// Why this replica is not ready yet as a member: with `auto_join`, until it is one again
    /// — a StatefulSet's rolling update then waits for it before it stops the next voter — or
    /// for [`JOINED_WITHIN`] at most (without a quorum to join, it still routes).
    pub fn not_ready(&self) -> Option<&'static str> {
        (!self.is_joined() && self.started.elapsed() < JOINED_WITHIN)
            .then_some("joining the cluster")
    }

    /// Hands in this replica's vote: demoted to a learner (through the leader) while more than
    /// [`MIN_VOTERS_KEPT`] voters would remain, retrying for a few seconds (another replica's change may be in progress),
    /// until its own log shows the change — so that it restarts as a learner, which never
    /// campaigns, and `auto_join` promotes it again. While it is away the others are the whole
    /// quorum: a scale-down, or a rolling update after it, never counts a stopped voter against
    /// it. Best effort: a replica that cannot resign stops as a voter, as if killed.
    async fn resign(&self) {
        const BUDGET: Duration = Duration::from_secs(5);
        let me = self.opts.node_id;
        let deadline = Instant::now() + BUDGET;
        let mut asked = false;
        loop {
            let m = self.node.metrics().await;
            if !m.voters.contains(&me) {
                if asked {
                    tracing::info!(
                        node_id = me,
                        "handed in the vote: a learner until it starts again"
                    );
                }
                return;
            }
            if m.voters.len() <= MIN_VOTERS_KEPT {
                return; // a voter down among three costs no quorum; fewer voters would cost more
            }
            if Instant::now() >= deadline {
                tracing::warn!(?BUDGET, "could not hand in the vote: stopping as a voter");
                return;
            }
            if !asked {
                let left = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, self.node.demote(me)).await {
                    Ok(Ok(_)) => asked = true,
                    Ok(Err(e)) => tracing::debug!(error = %e, "handing in the vote: retrying"),
                    Err(_) => continue,
                }
            }
            // Until this replica's own log shows it (the leader replicates to learners).
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn view(&self) -> ClusterView {
        let raft = self.node.status().await;
        let lease = self.opts.lease_ms();
        let (members, _) = self
            .node
            .local_read(|s| {
                // Liveness as of the state's own time (its leaders' clocks), not this replica's.
                let now = s.0.now_ms();
                s.0.members()
                    .iter()
                    .map(|(id, m)| MemberView {
                        id: *id,
                        live: s.0.is_live(*id, now, lease),
                        member: m.clone(),
                    })
                    .collect()
            })
            .await;
        ClusterView {
            node_id: self.opts.node_id,
            quorum: self.has_quorum(),
            raft,
            lease_ms: lease,
            members,
        }
    }

    /// Proposes `count` no-op [`ClusterCommand::Probe`]s through the log (from a follower they
    /// are forwarded to the leader), `concurrency` at a time, and measures their commit latency.
    pub async fn probe(&self, req: ProbeRequest) -> Result<ProbeReport, String> {
        use futures::StreamExt;
        if req.count == 0 || req.count > MAX_PROBES {
            return Err(format!("count must be 1..={MAX_PROBES}"));
        }
        let concurrency = req.concurrency.unwrap_or(1).clamp(1, 1024) as usize;
        let first = self
            .probe_seq
            .fetch_add(u64::from(req.count), Ordering::Relaxed)
            + 1;
        let last = first + u64::from(req.count) - 1;
        let t0 = Instant::now();
        let node = self.opts.node_id;
        let results: Vec<(f64, Result<(), String>)> = futures::stream::iter(first..=last)
            .map(|seq| async move {
                let t = Instant::now();
                let res = tokio::time::timeout(
                    Duration::from_secs(10),
                    self.node.propose(ClusterCommand::Probe { node, seq }),
                )
                .await;
                let res = match res {
                    Ok(Ok(ClusterOutput::Probed(_))) => Ok(()),
                    Ok(Ok(other)) => Err(format!("unexpected output {other:?}")),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("not committed within 10 s".to_string()),
                };
                (t.elapsed().as_secs_f64() * 1000.0, res)
            })
            .buffered(concurrency)
            .collect()
            .await;
        let elapsed = t0.elapsed().as_secs_f64();
        let mut lat: Vec<f64> = results
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(l, _)| *l)
            .collect();
        lat.sort_by(f64::total_cmp);
        let q = |f: f64| {
            lat.get(((lat.len() as f64 * f).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(0.0)
        };
        let committed = lat.len() as u32;
        Ok(ProbeReport {
            node_id: node,
            count: req.count,
            committed,
            failed: req.count - committed,
            first_error: results.into_iter().find_map(|(_, r)| r.err()),
            seqs: (first, last),
            elapsed_ms: elapsed * 1000.0,
            per_second: f64::from(committed) / elapsed.max(1e-9),
            latency_ms: ProbeLatency {
                p50: q(0.5),
                p99: q(0.99),
                max: lat.last().copied().unwrap_or(0.0),
            },
        })
    }

    /// The probes this replica has applied (`GET /debug/cluster/probes`), with the index of the
    /// last log entry applied.
    pub async fn probes(&self) -> (flowctl::cluster::ProbeLog, u64) {
        self.node.local_read(|s| s.0.probes().clone()).await
    }

    /// `add-learner`, `promote` or `remove`.
    pub async fn membership(&self, op: &str, req: MembershipRequest) -> Result<String, String> {
        let res = match op {
            "add-learner" => {
                let Some(addr) = req.addr else {
                    return Err("add-learner needs `addr` (host:port of the peer port)".into());
                };
                self.node.add_learner(req.id, addr, true).await
            }
            "promote" => self.node.promote(req.id).await,
            "remove" => self.node.remove(req.id).await,
            other => return Err(format!("unknown operation `{other}`")),
        };
        res.map(|log| format!("{op} {}: committed at {log:?}", req.id))
            .map_err(|e| e.to_string())
    }

    /// Leave gracefully (best effort), then stop Raft. Leaving releases the lease; with
    /// `auto_join` it also hands in the vote (see [`Self::resign`]).
    pub async fn shutdown(self: Arc<Self>) {
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            self.node.propose(ClusterCommand::Leave {
                node: self.opts.node_id,
            }),
        )
        .await;
        if self.opts.auto_join {
            self.resign().await;
        }
        match Arc::try_unwrap(self) {
            Ok(me) => {
                if let Err(e) = me.node.shutdown().await {
                    tracing::warn!(%e, "consensus shutdown");
                }
            }
            Err(_) => tracing::debug!("cluster member still referenced; dropped without shutdown"),
        }
    }
}
