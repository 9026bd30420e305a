//! [`ConsensusNode`]: the handle the rest of the system uses.
//!
//! A node owns its Raft core, the peer gRPC server (on a listener the caller bound), and a
//! batcher task that coalesces concurrent proposals into one log entry. Leader-only operations
//! (writes, read indexes, membership changes) run locally on the leader and are forwarded over
//! the peer RPCs by followers, following `ForwardToLeader` hints.
//!
//! - [`batcher`]: proposals coalesced into log entries, written on the leader;
//! - [`status`]: [`ConsensusMetrics`] and [`ClusterStatus`], what a node reports.

mod batcher;
mod status;

use batcher::{Proposal, run_batcher};
pub use status::{ClusterStatus, ConsensusMetrics, MemberStatus};

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use openraft::BasicNode;
use openraft::ChangeMembers;
use openraft::error::InitializeError;
use openraft::error::RaftError;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::sync::oneshot;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::ConsensusConfig;
use crate::error::ConsensusError;
use crate::network::accept::tls_incoming;
use crate::network::client::ChannelPool;
use crate::network::client::NetworkFactory;
use crate::network::client::NodeRpc;
use crate::network::proto::raft_peer_server::RaftPeerServer;
use crate::network::server::PeerService;
use crate::network::tls::PeerTls;
use crate::network::tls::reload_loop;
use crate::network::transport::Dialer;
use crate::network::transport::Incoming;
use crate::network::transport::Transport;
use crate::network::wire::AddLearnerRequest;
use crate::network::wire::AdminReply;
use crate::network::wire::MembershipChange;
use crate::network::wire::ReadIndexReply;
use crate::network::wire::RemoteError;
use crate::network::wire::WriteReply;
use crate::state_machine::Batch;
use crate::state_machine::StateMachine;
use crate::storage;
use crate::storage::StateReader;
use crate::types::LogId;
use crate::types::NodeId;
use crate::types::Raft;
use crate::types::RaftMetrics;

/// State shared by the node handle, the batcher and the peer service.
pub(crate) struct Inner<S: StateMachine> {
    pub(crate) id: NodeId,
    pub(crate) addr: String,
    pub(crate) config: ConsensusConfig,
    pub(crate) raft: Raft<S>,
    pub(crate) reader: StateReader<S>,
    pool: ChannelPool,
    pub(crate) tls: Option<Arc<PeerTls>>,
}

/// Where a leader-only request goes next.
enum Target {
    Local,
    Remote { id: NodeId, addr: String },
}

/// Retry delay between leader lookups: 10 ms doubling to 200 ms.
fn retry_delay(attempt: u32) -> Duration {
    Duration::from_millis(10u64.saturating_mul(1u64 << attempt.min(5)))
        .min(Duration::from_millis(200))
}

/// Whether a failed RPC certainly never reached the peer (so retrying cannot duplicate it).
fn never_sent(err: &ConsensusError) -> bool {
    let ConsensusError::Rpc { status, .. } = err else {
        return false;
    };
    if status.code() != tonic::Code::Unavailable {
        return false;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(status.as_ref());
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            );
        }
        source = e.source();
    }
    false
}

impl<S: StateMachine> Inner<S> {
    fn metrics_now(&self) -> RaftMetrics {
        self.raft.metrics().borrow().clone()
    }

    fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().current_leader == Some(self.id)
    }

    /// Voters and learners of the effective membership, with their addresses.
    fn members(&self) -> Vec<(NodeId, String)> {
        self.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .nodes()
            .map(|(id, n)| (*id, n.addr.clone()))
            .collect()
    }

    /// Voters and learners of the effective membership.
    pub(crate) fn member_ids(&self) -> Vec<NodeId> {
        self.members().into_iter().map(|(id, _)| id).collect()
    }

    /// The member advertised at `addr`, if any.
    fn id_at(&self, addr: &str) -> Option<NodeId> {
        self.members()
            .into_iter()
            .find_map(|(id, a)| (a == addr).then_some(id))
    }

    fn addr_of(&self, id: NodeId) -> Option<String> {
        self.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.addr.clone())
    }

    /// Resolves the leader, waiting until `deadline` for one to be known.
    async fn target(
        &self,
        hint: Option<(NodeId, Option<String>)>,
        deadline: Instant,
    ) -> Result<Target, ConsensusError> {
        let leader = match hint {
            Some((id, addr)) => Some((id, addr)),
            None => self
                .raft
                .metrics()
                .borrow()
                .current_leader
                .map(|id| (id, None)),
        };
        let id = match leader {
            Some((id, _)) if id == self.id => return Ok(Target::Local),
            Some((id, Some(addr))) => return Ok(Target::Remote { id, addr }),
            Some((id, None)) => id,
            None => {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let m = self
                    .raft
                    .wait(Some(remaining))
                    .metrics(|m| m.current_leader.is_some(), "leader known")
                    .await
                    .map_err(|_| ConsensusError::NoLeader {
                        waited: self.config.propose_timeout,
                    })?;
                match m.current_leader {
                    Some(id) if id == self.id => return Ok(Target::Local),
                    Some(id) => id,
                    None => {
                        return Err(ConsensusError::NoLeader {
                            waited: self.config.propose_timeout,
                        });
                    }
                }
            }
        };
        match self.addr_of(id) {
            Some(addr) => Ok(Target::Remote { id, addr }),
            None => Err(ConsensusError::Rejected {
                node_id: self.id,
                reason: format!("leader {id} has no known address"),
            }),
        }
    }

    fn remote_to_error(&self, from: NodeId, e: RemoteError) -> ConsensusError {
        match e {
            RemoteError::ForwardToLeader { leader_id, .. } => ConsensusError::Rejected {
                node_id: from,
                reason: format!("not the leader (leader: {leader_id:?})"),
            },
            RemoteError::Rejected { reason } => ConsensusError::Rejected {
                node_id: from,
                reason,
            },
            RemoteError::Stopped { reason } => ConsensusError::Stopped { reason },
            RemoteError::Indeterminate { reason } => ConsensusError::Indeterminate { reason },
        }
    }

    /// Runs a leader-only operation: locally when this node leads, else on the leader over
    /// `rpc`, following redirects until `deadline`. `retry_unsent_only` restricts transport
    /// retries to requests that certainly never left (writes); idempotent requests retry on
    /// any transport failure.
    async fn on_leader<Req, T, F, Fut>(
        &self,
        rpc: NodeRpc,
        req: &Req,
        retry_unsent_only: bool,
        deadline: Instant,
        local: F,
    ) -> Result<T, ConsensusError>
    where
        Req: Serialize,
        T: serde::de::DeserializeOwned,
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, RemoteError>>,
    {
        let mut hint = None;
        let mut attempt = 0u32;
        loop {
            let result = match self.target(hint.take(), deadline).await? {
                Target::Local => local().await.map_err(|e| (self.id, e)),
                Target::Remote { id, addr } => {
                    let timeout = self
                        .config
                        .rpc_timeout
                        .min(deadline.saturating_duration_since(Instant::now()));
                    match self
                        .pool
                        .call_node::<Req, Result<T, RemoteError>>(id, &addr, rpc, req, timeout)
                        .await
                    {
                        Ok(reply) => reply.map_err(|e| (id, e)),
                        Err(e)
                            if (!retry_unsent_only || never_sent(&e))
                                && Instant::now() < deadline =>
                        {
                            tracing::debug!(error = %e, "leader unreachable, retrying");
                            tokio::time::sleep(retry_delay(attempt)).await;
                            attempt += 1;
                            continue;
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            match result {
                Ok(v) => return Ok(v),
                Err((
                    from,
                    RemoteError::ForwardToLeader {
                        leader_id,
                        leader_addr,
                    },
                )) => {
                    if Instant::now() >= deadline {
                        return Err(ConsensusError::NoLeader {
                            waited: self.config.propose_timeout,
                        });
                    }
                    tracing::debug!(from, ?leader_id, "redirected to leader");
                    hint = leader_id.map(|id| (id, leader_addr));
                    if attempt > 0 {
                        tokio::time::sleep(retry_delay(attempt)).await;
                    }
                    attempt += 1;
                }
                Err((from, e)) => return Err(self.remote_to_error(from, e)),
            }
        }
    }

    /// Leader side of a write: appends the batch if this node leads.
    pub(crate) async fn local_write(&self, batch: Batch<S::Command>) -> WriteReply<S::Output> {
        self.raft
            .client_write(batch.stamped())
            .await
            .map(|resp| resp.data.outputs)
            .map_err(RemoteError::from_raft)
    }

    /// Leader side of a follower read: confirms leadership, returns the read log id.
    pub(crate) async fn local_read_index(&self) -> ReadIndexReply {
        self.raft
            .get_read_log_id()
            .await
            .map(|(read_log_id, _applied)| read_log_id)
            .map_err(RemoteError::from_raft)
    }

    pub(crate) async fn local_add_learner(&self, req: AddLearnerRequest) -> AdminReply {
        self.raft
            .add_learner(req.node_id, BasicNode::new(req.addr), req.blocking)
            .await
            .map(|resp| Some(resp.log_id))
            .map_err(RemoteError::from_raft)
    }

    pub(crate) async fn local_change_membership(&self, change: MembershipChange) -> AdminReply {
        let membership = self.raft.metrics().borrow().membership_config.clone();
        let membership = membership.membership();
        let is_voter = |id: &NodeId| membership.voter_ids().any(|v| v == *id);
        let (changes, retain): (ChangeMembers<NodeId, BasicNode>, bool) = match change {
            MembershipChange::Promote(id) => {
                if self.is_leader() && membership.get_node(&id).is_none() {
                    return Err(RemoteError::Rejected {
                        reason: format!("node {id} is not a member; add it as a learner first"),
                    });
                }
                (ChangeMembers::AddVoterIds(BTreeSet::from([id])), true)
            }
            MembershipChange::Remove(id) => {
                if is_voter(&id) {
                    (ChangeMembers::RemoveVoters(BTreeSet::from([id])), false)
                } else {
                    (ChangeMembers::RemoveNodes(BTreeSet::from([id])), false)
                }
            }
            MembershipChange::Demote(id) => {
                (ChangeMembers::RemoveVoters(BTreeSet::from([id])), true)
            }
            MembershipChange::ReplaceVoters(ids) => (ChangeMembers::ReplaceAllVoters(ids), false),
        };
        self.raft
            .change_membership(changes, retain)
            .await
            .map(|resp| Some(resp.log_id))
            .map_err(RemoteError::from_raft)
    }
}

/// Where the peer port accepts connections.
enum Listen {
    Tcp(TcpListener),
    Custom(Incoming),
}

/// A running consensus node.
pub struct ConsensusNode<S: StateMachine> {
    inner: Arc<Inner<S>>,
    proposals: mpsc::Sender<Proposal<S>>,
    server_shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    batcher: Option<JoinHandle<()>>,
    reloader: Option<JoinHandle<()>>,
}

impl<S: StateMachine> ConsensusNode<S> {
    /// Opens the data directory, starts Raft and serves the peer gRPC on `listener`.
    ///
    /// A fresh cluster is bootstrapped exactly once: by the lowest id of
    /// `config.initial_members`, and only when its data directory held no database. Restarted
    /// nodes reopen their log, vote and last snapshot and rejoin.
    pub async fn start(
        config: ConsensusConfig,
        listener: TcpListener,
    ) -> Result<Self, ConsensusError> {
        Self::start_with_routes(config, listener, tonic::service::Routes::default()).await
    }

    /// [`ConsensusNode::start`], also serving `routes` (other peer-to-peer gRPC services of the
    /// application) on the same port, with the same TLS.
    pub async fn start_with_routes(
        config: ConsensusConfig,
        listener: TcpListener,
        routes: tonic::service::Routes,
    ) -> Result<Self, ConsensusError> {
        let local = listener.local_addr().map_err(|source| ConsensusError::Io {
            op: "listener local_addr",
            source,
        })?;
        Self::start_inner(
            config,
            local.to_string(),
            Listen::Tcp(listener),
            None,
            routes,
        )
        .await
    }

    /// [`ConsensusNode::start_with_routes`] on a custom [`Transport`] (the deterministic
    /// simulation's network): no TLS, and `advertise_addr` must name this node's address on it.
    pub async fn start_on(
        config: ConsensusConfig,
        transport: Transport,
        routes: tonic::service::Routes,
    ) -> Result<Self, ConsensusError> {
        if config.tls.is_some() {
            return Err(ConsensusError::Config(crate::config::invalid(
                "tls",
                "a custom peer transport carries no TLS",
            )));
        }
        if config.advertise_addr.is_empty() {
            return Err(ConsensusError::Config(crate::config::invalid(
                "advertise_addr",
                "must be set on a custom peer transport",
            )));
        }
        let addr = config.advertise_addr.clone();
        let Transport { incoming, dialer } = transport;
        Self::start_inner(config, addr, Listen::Custom(incoming), Some(dialer), routes).await
    }

    async fn start_inner(
        config: ConsensusConfig,
        local: String,
        listen: Listen,
        dialer: Option<Dialer>,
        routes: tonic::service::Routes,
    ) -> Result<Self, ConsensusError> {
        config.validate()?;
        let raft_config = Arc::new(config.raft_config()?);
        let addr = if config.advertise_addr.is_empty() {
            local
        } else {
            config.advertise_addr.clone()
        };
        std::fs::create_dir_all(&config.data_dir).map_err(|source| ConsensusError::Io {
            op: "create data_dir",
            source,
        })?;
        let tls = config
            .tls
            .as_ref()
            .map(|t| PeerTls::load(t, config.node_id))
            .transpose()?;

        let storage = storage::open_with::<S>(&config.data_dir, config.inline_flush)?;
        let recovered = storage.recovered;
        let reader = storage.state_machine.reader();
        let pool = ChannelPool::new(
            tls.clone(),
            config.connect_timeout,
            config.max_message_bytes,
        )
        .with_routes(config.peer_routes.clone())
        .with_dialer(dialer);
        let network = NetworkFactory::new(config.node_id, pool.clone());
        let raft = openraft::Raft::new(
            config.node_id,
            raft_config,
            network,
            storage.log,
            storage.state_machine,
        )
        .await
        .map_err(|e| ConsensusError::Raft {
            op: "start",
            reason: e.to_string(),
        })?;

        let inner = Arc::new(Inner {
            id: config.node_id,
            addr: addr.clone(),
            config,
            raft,
            reader,
            pool,
            tls: tls.clone(),
        });

        // Peer server: TLS accepted by our own loop (reloadable material, peer certificates
        // in each request for the identity checks).
        let max = inner.config.max_message_bytes;
        let router = tonic::transport::Server::builder().add_routes(
            routes.add_service(
                RaftPeerServer::new(PeerService::new(Arc::clone(&inner)))
                    .max_decoding_message_size(max)
                    .max_encoding_message_size(max),
            ),
        );
        let (server_shutdown, shutdown_rx) = oneshot::channel::<()>();
        let stop = async move {
            let _ = shutdown_rx.await;
        };
        let server = match (listen, &tls) {
            (Listen::Tcp(listener), Some(tls)) => tokio::spawn(
                router.serve_with_incoming_shutdown(tls_incoming(listener, Arc::clone(tls)), stop),
            ),
            (Listen::Tcp(listener), None) => tokio::spawn(router.serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop,
            )),
            (Listen::Custom(incoming), _) => {
                tokio::spawn(router.serve_with_incoming_shutdown(incoming, stop))
            }
        };
        let reloader = tls
            .clone()
            .filter(|t| !t.reload_interval().is_zero())
            .map(|t| tokio::spawn(reload_loop(t, inner.id)));

        let (proposals, rx) = mpsc::channel(inner.config.max_batch.saturating_mul(4));
        let batcher = tokio::spawn(run_batcher(Arc::clone(&inner), rx));
        let node = Self {
            inner,
            proposals,
            server_shutdown: Some(server_shutdown),
            server: Some(server),
            batcher: Some(batcher),
            reloader,
        };
        node.bootstrap(recovered).await?;
        tracing::info!(node_id = node.inner.id, %addr, recovered, "consensus node started");
        Ok(node)
    }

    async fn bootstrap(&self, recovered: bool) -> Result<(), ConsensusError> {
        let inner = &self.inner;
        let Some(lowest) = inner.config.initial_members.keys().next().copied() else {
            return Ok(());
        };
        if recovered || lowest != inner.id {
            return Ok(());
        }
        let initialized =
            inner
                .raft
                .is_initialized()
                .await
                .map_err(|e| ConsensusError::Stopped {
                    reason: e.to_string(),
                })?;
        if initialized {
            return Ok(());
        }
        // An empty log on the lowest member is a new cluster — or this member came back without
        // its volume to a cluster that runs on. Initializing then would start a rival history
        // whose elections disturb the leader until its log is overwritten; uninitialized, it runs
        // no elections and the leader brings it up to date.
        if let Some(peer) = self.running_peer().await {
            tracing::info!(
                node_id = inner.id,
                peer,
                "empty log, but the cluster runs: waiting for its leader"
            );
            return Ok(());
        }
        let members: BTreeMap<NodeId, BasicNode> = inner
            .config
            .initial_members
            .iter()
            .map(|(id, addr)| (*id, BasicNode::new(addr)))
            .collect();
        match inner.raft.initialize(members).await {
            Ok(()) => {
                tracing::info!(node_id = inner.id, "bootstrapped new cluster");
                Ok(())
            }
            Err(RaftError::APIError(InitializeError::NotAllowed(e))) => {
                tracing::info!(node_id = inner.id, error = %e, "already initialized");
                Ok(())
            }
            Err(e) => Err(ConsensusError::Raft {
                op: "initialize",
                reason: e.to_string(),
            }),
        }
    }

    /// A configured peer that has a log (a cluster exists), asked all at once within the RPC
    /// timeout; `None` when none has one or none answers (a new cluster starting).
    async fn running_peer(&self) -> Option<NodeId> {
        let inner = &self.inner;
        let asks = inner
            .config
            .initial_members
            .iter()
            .filter(|(id, _)| **id != inner.id)
            .map(|(id, addr)| async move {
                let st = self.remote_status(*id, addr).await.ok()?;
                (st.metrics.last_log_index.is_some() || st.metrics.term > 0).then_some(*id)
            });
        futures::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .next()
    }

    /// A channel to the peer at `addr` (an advertised peer address) with this node's peer TLS and
    /// routes, shared with Raft's own traffic — for the application's other peer services.
    pub fn peer_channel(&self, addr: &str) -> Result<tonic::transport::Channel, tonic::Status> {
        self.inner.pool.channel(addr, self.inner.id_at(addr))
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.inner.id
    }

    /// The address peers use to reach this node.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The underlying openraft handle (for metrics waits and advanced use).
    pub fn raft(&self) -> &Raft<S> {
        &self.inner.raft
    }

    /// The largest proposal (encoded commands) a log entry may hold: see
    /// [`ConsensusConfig::max_entry_bytes`].
    pub fn max_entry_bytes(&self) -> usize {
        self.inner.config.max_entry_bytes()
    }

    /// Proposes one command and returns its output once committed and applied on the leader.
    ///
    /// Concurrent proposals are coalesced into one log entry. On a follower the batch is
    /// forwarded to the leader. An `Err` other than [`ConsensusError::Rejected`] /
    /// [`ConsensusError::NoLeader`] means the outcome is unknown: the command may still commit
    /// (make commands idempotent, e.g. keyed by request id).
    pub async fn propose(&self, cmd: S::Command) -> Result<S::Output, ConsensusError> {
        let mut outputs = self.propose_many(vec![cmd]).await?;
        outputs.pop().ok_or_else(|| ConsensusError::Indeterminate {
            reason: "no output returned".into(),
        })
    }

    /// Proposes several commands that are applied contiguously, in order, in one log entry.
    pub async fn propose_many(
        &self,
        commands: Vec<S::Command>,
    ) -> Result<Vec<S::Output>, ConsensusError> {
        if commands.is_empty() {
            return Ok(Vec::new());
        }
        // Bounded before it is queued: the batcher keeps every entry under the bound, so one
        // oversize proposal is refused here, cleanly, rather than making an append that cannot
        // be sent.
        let bytes = crate::codec::encode(&commands)?.len();
        let limit = self.inner.config.max_entry_bytes();
        if bytes > limit {
            return Err(ConsensusError::TooLarge { bytes, limit });
        }
        let (reply, rx) = oneshot::channel();
        self.proposals
            .send(Proposal {
                commands,
                bytes,
                reply,
            })
            .await
            .map_err(|_| ConsensusError::Shutdown)?;
        rx.await.map_err(|_| ConsensusError::Shutdown)?
    }

    /// Runs `f` on a state that reflects every write committed before this call started
    /// (linearizable). The leader confirms its leadership with a quorum; a follower asks the
    /// leader for the read index and waits until it has applied that far, then reads locally.
    pub async fn linearizable_read<R>(&self, f: impl FnOnce(&S) -> R) -> Result<R, ConsensusError> {
        let timeout = self.inner.config.rpc_timeout;
        let deadline = Instant::now() + timeout;
        let inner = &self.inner;
        let read_log_id: Option<LogId> = inner
            .on_leader(NodeRpc::ReadIndex, &(), false, deadline, || {
                inner.local_read_index()
            })
            .await?;
        let index = read_log_id.map_or(0, |l| l.index);
        self.wait_applied(index, deadline.saturating_duration_since(Instant::now()))
            .await?;
        Ok(inner.reader.read(f).await.0)
    }

    /// Runs `f` on the local applied state without any freshness guarantee. Returns the result
    /// and the index of the last applied entry it reflects.
    pub async fn local_read<R>(&self, f: impl FnOnce(&S) -> R) -> (R, u64) {
        self.inner.reader.read(f).await
    }

    /// A receiver of the index of the last entry applied to the local state machine.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.inner.reader.subscribe()
    }

    /// Waits until the local state machine has applied `index`.
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> Result<(), ConsensusError> {
        let mut rx = self.watch();
        match tokio::time::timeout(timeout, rx.wait_for(|applied| *applied >= index)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(ConsensusError::Shutdown),
            Err(_) => Err(ConsensusError::Timeout {
                op: "wait for apply",
                after: timeout,
            }),
        }
    }

    /// Current Raft progress of this node.
    pub async fn metrics(&self) -> ConsensusMetrics {
        self.inner.metrics().await
    }

    /// Cluster view for `/debug/cluster` (replication progress only on the leader).
    pub async fn status(&self) -> ClusterStatus {
        self.inner.status().await
    }

    /// Asks the cluster status of node `target` at `addr` over the peer RPC.
    pub async fn remote_status(
        &self,
        target: NodeId,
        addr: &str,
    ) -> Result<ClusterStatus, ConsensusError> {
        self.inner
            .pool
            .call_node(
                target,
                addr,
                NodeRpc::Status,
                &(),
                self.inner.config.rpc_timeout,
            )
            .await
    }

    /// Adds `node_id` at `addr` as a learner (non-voting member receiving the log). With
    /// `blocking`, returns once the learner has caught up with the leader.
    pub async fn add_learner(
        &self,
        node_id: NodeId,
        addr: impl Into<String>,
        blocking: bool,
    ) -> Result<Option<LogId>, ConsensusError> {
        let req = AddLearnerRequest {
            node_id,
            addr: addr.into(),
            blocking,
        };
        let inner = &self.inner;
        let deadline = Instant::now() + inner.config.propose_timeout;
        inner
            .on_leader(NodeRpc::AddLearner, &req, true, deadline, || {
                inner.local_add_learner(req.clone())
            })
            .await
    }

    /// Asks the cluster to add this node as a learner, through the first of `seeds` (node id →
    /// peer address) that answers — following it to the leader — and returns once the leader
    /// has added it and it has caught up. For a node that is not a member yet, so knows no
    /// leader: its certificate lets it ask for itself only.
    pub async fn join(
        &self,
        seeds: &BTreeMap<NodeId, String>,
    ) -> Result<Option<LogId>, ConsensusError> {
        let inner = &self.inner;
        let req = AddLearnerRequest {
            node_id: inner.id,
            addr: inner.addr.clone(),
            blocking: true,
        };
        let mut last = ConsensusError::NoLeader {
            waited: inner.config.propose_timeout,
        };
        for (id, addr) in seeds.iter().filter(|(id, _)| **id != inner.id) {
            let mut at = (*id, addr.clone());
            // A seed, then at most the leaders it names.
            for _ in 0..3 {
                let reply = inner
                    .pool
                    .call_node::<_, AdminReply>(
                        at.0,
                        &at.1,
                        NodeRpc::AddLearner,
                        &req,
                        inner.config.propose_timeout,
                    )
                    .await;
                match reply {
                    Ok(Ok(log)) => return Ok(log),
                    Ok(Err(RemoteError::ForwardToLeader {
                        leader_id: Some(leader),
                        leader_addr: Some(addr),
                    })) if leader != inner.id => at = (leader, addr),
                    Ok(Err(e)) => {
                        last = inner.remote_to_error(at.0, e);
                        break;
                    }
                    Err(e) => {
                        last = e;
                        break;
                    }
                }
            }
        }
        Err(last)
    }

    /// Turns learner `node_id` into a voter.
    pub async fn promote(&self, node_id: NodeId) -> Result<Option<LogId>, ConsensusError> {
        self.change_membership(MembershipChange::Promote(node_id))
            .await
    }

    /// Turns the voter `node_id` into a learner.
    pub async fn demote(&self, node_id: NodeId) -> Result<Option<LogId>, ConsensusError> {
        self.change_membership(MembershipChange::Demote(node_id))
            .await
    }

    /// Removes `node_id` (voter or learner) from the cluster.
    pub async fn remove(&self, node_id: NodeId) -> Result<Option<LogId>, ConsensusError> {
        self.change_membership(MembershipChange::Remove(node_id))
            .await
    }

    /// Applies a membership change on the leader.
    pub async fn change_membership(
        &self,
        change: MembershipChange,
    ) -> Result<Option<LogId>, ConsensusError> {
        let inner = &self.inner;
        let deadline = Instant::now() + inner.config.propose_timeout;
        inner
            .on_leader(NodeRpc::ChangeMembership, &change, true, deadline, || {
                inner.local_change_membership(change.clone())
            })
            .await
    }

    /// Stops the batcher, the Raft core and the peer server, and waits for them, so the data
    /// directory can be reopened afterwards. Pending proposals fail with
    /// [`ConsensusError::Shutdown`].
    pub async fn shutdown(mut self) -> Result<(), ConsensusError> {
        if let Some(reloader) = self.reloader.take() {
            reloader.abort();
        }
        if let Some(batcher) = self.batcher.take() {
            batcher.abort();
            let _ = batcher.await;
        }
        let raft_result = self.inner.raft.shutdown().await;
        if let Some(tx) = self.server_shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(mut server) = self.server.take() {
            // Graceful stop waits for open requests; do not let a stuck peer hold us.
            if tokio::time::timeout(Duration::from_secs(2), &mut server)
                .await
                .is_err()
            {
                server.abort();
                let _ = server.await;
            }
        }
        tracing::info!(node_id = self.inner.id, "consensus node stopped");
        raft_result.map_err(|e| ConsensusError::Stopped {
            reason: e.to_string(),
        })
    }
}

impl<S: StateMachine> Drop for ConsensusNode<S> {
    fn drop(&mut self) {
        // Dropped without `shutdown`: stop the tasks we own. The Raft core stops once every
        // handle to it is gone.
        if let Some(reloader) = self.reloader.take() {
            reloader.abort();
        }
        if let Some(batcher) = self.batcher.take() {
            batcher.abort();
        }
        if let Some(tx) = self.server_shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}
