//! Active-Active prefix affinity: replicas exchange their approximate-prefix-index state.
//!
//! Each pod's part of the index is a state-based CRDT (`index::PodState`: per block hash the
//! newest routing time, the K newest kept, a recreated pod's higher epoch wins), so replicas
//! converge whatever the order, duplication or loss of what they exchange:
//!
//! - **Deltas.** Every routing decision's changed entries go to the [`Outbox`] (coalesced per pod
//!   and hash, bounded); every [`GossipOptions::interval`] one batch is offered to every peer's
//!   bounded queue. A full queue or a failed push drops the batch and marks the peer for
//!   anti-entropy — routing never waits for a peer.
//! - **Anti-entropy.** Every [`GossipOptions::anti_entropy`] (at once for a new or repaired peer) a
//!   replica sends its per-pod digests; the peer answers with its state of every differing pod and
//!   names the pods it wants back, which are then pushed. One round makes the pair equal; an empty
//!   replica (a new member) receives everything this way, as a snapshot.
//!
//! - **Scrape fan-out.** Each pod is scraped only by its owners (`datalayer::shard`); every
//!   [`GossipOptions::samples_interval`] they send what they scraped to every peer, newest wins
//!   by original scrape time (a latest-value slot per peer: a slow peer skips samples, never
//!   queues them).
//!
//! Peers are the Raft membership's addresses; the services run on the peer port beside the
//! consensus RPCs, over the same channels (TLS, routes).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use consensus::network::tls::PeerIdentity;
use consensus::{ConsensusNode, StateMachine};
use index::{PodDigest, PodState, Replicated};
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::member::ClusterMember;
use super::options::GossipOptions;
use crate::datalayer::inflight::{InflightTracker, RemoteLoadFeed};
use crate::datalayer::responses::ResponseBindings;
use crate::datalayer::scraper::{mono_now, unix_us};
use crate::datalayer::store::Datastore;
use crate::metrics::Metrics;
use crate::scheduling::prefix::ApproxPrefixProducer;

/// Generated protobuf / tonic code for `proto/gossip.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("epp.gossip.v1");
}

mod fanout;
mod precise;
mod wire;

pub use wire::Outbox;
use wire::{chunk, digest_to_pb, from_pb_all, to_pb};

pub use precise::PreciseGossipService;

use pb::prefix_gossip_client::PrefixGossipClient;
use pb::prefix_gossip_server::{PrefixGossip, PrefixGossipServer};
use pb::sample_fanout_client::SampleFanoutClient;

/// How often every pod's capacity and incarnation are applied from the scraped metrics.
const BOUNDS_REFRESH: Duration = Duration::from_millis(100);

/// A peer not heard from for this long (its fan-out batches, sent every 50 ms even when empty,
/// stopped) no longer owns scrapes. Peer-to-peer rather than the Raft leases: an overloaded
/// cluster whose heartbeats commit slowly must not conclude everyone is dead and have every
/// replica scrape everything.
const PEER_LIVENESS: Duration = Duration::from_secs(2);

/// How far beyond this replica's clock a peer's index timestamps and pod incarnations may be.
/// Generous against clock skew; tight enough that a garbage value cannot pin anything.
const MAX_PEER_AHEAD: Duration = Duration::from_secs(60);

/// Largest gossip message either side sends or accepts.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The space of the prefix index (also what a message naming none means: older senders).
pub const PREFIX_SPACE: &str = "prefix";
/// The space of the response bindings (`previous_response_id` affinity).
pub const RESPONSES_SPACE: &str = "responses";

/// One replicated index and the outbox of its local inserts.
#[derive(Debug)]
struct Space {
    name: &'static str,
    index: Arc<dyn Replicated>,
    outbox: Arc<Outbox>,
}

/// One replica's side of the peer exchange.
#[derive(Debug)]
pub struct Gossip {
    node_id: u64,
    /// The replicated indexes: the prefix index (when replication is on and a producer is
    /// configured) and the response bindings. Each is exchanged on its own: its own deltas,
    /// digests and anti-entropy rounds.
    spaces: Vec<Space>,
    /// The prefix producer, whose per-pod bounds follow the scraped metrics.
    prefix: Option<Arc<ApproxPrefixProducer>>,
    store: Arc<Datastore>,
    opts: GossipOptions,
    metrics: Arc<Metrics>,
    /// The latest fan-out batch; each peer sends the newest it has not sent.
    samples: tokio::sync::watch::Sender<Arc<pb::SampleBatch>>,
    /// When each peer (node id) was last heard from: the liveness scrape ownership uses.
    heard: Mutex<HashMap<u64, Instant>>,
    /// Load sharing (no cluster-wide flow control): this replica's ledger, reported with every
    /// fan-out batch, and the feed where the peers' reports go, summed.
    load: OnceLock<(Arc<InflightTracker>, RemoteLoadFeed)>,
    /// Each peer's last load report.
    peer_load: Mutex<HashMap<u64, (Instant, Vec<pb::PodLoad>)>>,
    /// The replicated precise prefix index (`precise`), when one runs and subscriptions are
    /// sharded.
    precise: OnceLock<Arc<crate::scheduling::precise::PrecisePrefixProducer>>,
    /// Centralized KV events: the subscriber forwarded messages go to, and the queue of
    /// messages for each peer (node id) that forwards them.
    kv_inbox: OnceLock<Arc<crate::datalayer::kvevents::Subscriber>>,
    kv_routes: Mutex<HashMap<u64, mpsc::Sender<pb::KvFrame>>>,
    /// The other members' node ids (the Raft membership, refreshed with the peers): only they
    /// may gossip to this replica, whatever certificate the CA signed for anyone else.
    members: Mutex<std::collections::HashSet<u64>>,
}

impl Gossip {
    /// The members to accept gossip from until the membership is known (the initial voters).
    pub fn expect_members(&self, ids: impl IntoIterator<Item = u64>) {
        let mut m = self.members.lock().unwrap_or_else(|e| e.into_inner());
        m.extend(ids.into_iter().filter(|id| *id != self.node_id));
    }

    /// Whether node `id` is another member of the cluster (as of the last membership refresh).
    pub(crate) fn is_member(&self, id: u64) -> bool {
        self.members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&id)
    }

    /// Refuses a message from a node that is not a member (counted with the peer refusals).
    pub(crate) fn check_member(&self, from: u64, what: &'static str) -> Result<(), Status> {
        if self.is_member(from) {
            return Ok(());
        }
        self.metrics.cluster.peer_refused(what);
        tracing::debug!(from, what, "peer message from a non-member refused");
        Err(Status::permission_denied(format!(
            "{what} from node {from}: not a member of this cluster"
        )))
    }

    /// Connects the inserts of `producer` (if replicating) and of `responses` to new outboxes.
    pub fn new(
        node_id: u64,
        producer: Option<Arc<ApproxPrefixProducer>>,
        responses: Option<Arc<ResponseBindings>>,
        store: Arc<Datastore>,
        opts: GossipOptions,
        metrics: Arc<Metrics>,
    ) -> Arc<Gossip> {
        let indexes = [
            producer
                .clone()
                .map(|p| (PREFIX_SPACE, p as Arc<dyn Replicated>)),
            responses.map(|r| (RESPONSES_SPACE, r as Arc<dyn Replicated>)),
        ];
        let spaces = indexes
            .into_iter()
            .flatten()
            .map(|(name, index)| {
                let outbox = Arc::new(Outbox::new(opts.max_outbox_entries));
                if !index.replicate_into(outbox.clone()) {
                    tracing::warn!(
                        space = name,
                        "index already replicated; a second gossip is ignored"
                    );
                }
                Space {
                    name,
                    index,
                    outbox,
                }
            })
            .collect();
        let (samples, _) = tokio::sync::watch::channel(Arc::new(pb::SampleBatch::default()));
        Arc::new(Gossip {
            node_id,
            spaces,
            prefix: producer,
            store,
            opts,
            metrics,
            samples,
            heard: Mutex::new(HashMap::new()),
            load: OnceLock::new(),
            peer_load: Mutex::new(HashMap::new()),
            precise: OnceLock::new(),
            kv_inbox: OnceLock::new(),
            kv_routes: Mutex::new(HashMap::new()),
            members: Mutex::default(),
        })
    }

    fn heard_from(&self, node: u64) {
        if node != self.node_id {
            let mut h = self.heard.lock().unwrap_or_else(|p| p.into_inner());
            h.insert(node, Instant::now());
        }
    }

    /// Peers heard from within [`PEER_LIVENESS`].
    fn live_peers(&self) -> Vec<u64> {
        let h = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        h.iter()
            .filter(|(_, t)| t.elapsed() < PEER_LIVENESS)
            .map(|(id, _)| *id)
            .collect()
    }

    /// The space a message names (none: the prefix index, as older senders meant).
    fn space(&self, name: &str) -> Result<&Space, Status> {
        let name = if name.is_empty() { PREFIX_SPACE } else { name };
        self.spaces.iter().find(|s| s.name == name).ok_or_else(|| {
            Status::failed_precondition(format!("`{name}` is not replicated on this replica"))
        })
    }

    /// The gRPC service to serve on the peer port.
    pub fn service(
        self: &Arc<Self>,
        identity: Option<PeerIdentity>,
    ) -> PrefixGossipServer<GossipService> {
        PrefixGossipServer::new(GossipService(self.clone(), identity))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Joins received pod states; `fresh`: they are routing decisions just made (their age is the
    /// propagation delay), not anti-entropy state.
    fn merge(
        &self,
        space: &str,
        pods: Vec<pb::PodDelta>,
        bytes: usize,
        fresh: bool,
    ) -> Result<usize, Status> {
        let space = self.space(space)?;
        let states = self.bounded(from_pb_all(pods)?);
        let entries: usize = states.iter().map(|s| s.entries.len()).sum();
        let (changed, newest) = space.index.merge(&states);
        self.metrics.gossip.received(bytes, entries);
        if fresh && newest > 0 {
            self.metrics
                .gossip
                .lag(unix_us().saturating_sub(newest) as f64 / 1e6);
        }
        Ok(changed)
    }

    /// What of a peer's pod states this replica takes in: only pods in its own endpoint set (a
    /// peer cannot make it index arbitrary names; a pod it has yet to discover arrives with a
    /// later anti-entropy round), incarnations and timestamps not beyond its own clock by more
    /// than [`MAX_PEER_AHEAD`] (one far-future value would pin every replica's clock, or the pod's
    /// epoch, forever). The rest is dropped and counted.
    fn bounded(&self, states: Vec<PodState>) -> Vec<PodState> {
        let known = self.store.by_hostport();
        let now_us = unix_us();
        let (max_ts, max_epoch) = (
            now_us.saturating_add(MAX_PEER_AHEAD.as_micros() as u64),
            (now_us / 1000).saturating_add(MAX_PEER_AHEAD.as_millis() as u64),
        );
        let mut out = Vec::with_capacity(states.len());
        for mut p in states {
            let field = if !known.contains_key(&p.name) {
                "pod"
            } else if p.epoch > max_epoch {
                "epoch"
            } else {
                let before = p.entries.len();
                p.entries.retain(|&(_, ts)| ts <= max_ts);
                if p.entries.len() != before {
                    self.metrics.rejected_value("peer", "timestamp");
                    tracing::debug!(pod = %p.name, dropped = before - p.entries.len(),
                        "prefix gossip: entries stamped in the future dropped");
                }
                out.push(p);
                continue;
            };
            self.metrics.rejected_value("peer", field);
            tracing::debug!(pod = %p.name, epoch = p.epoch, field, "prefix gossip: pod state refused");
        }
        out
    }

    /// Runs the exchange with `peers` (the Raft membership) until `stop`: delta flushes, bounds
    /// refresh, scrape ownership and fan-out.
    pub async fn run<P: Peers>(self: Arc<Self>, peers_of: Arc<P>, stop: CancellationToken) {
        let mut peers: BTreeMap<String, Peer> = BTreeMap::new();
        let mut flush = tokio::time::interval(self.opts.interval);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut membership = tokio::time::interval(Duration::from_millis(500));
        membership.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut bounds = tokio::time::interval(BOUNDS_REFRESH);
        bounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut samples = tokio::time::interval(self.opts.samples_interval);
        samples.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = membership.tick() => self.update_peers(&*peers_of, &mut peers, &stop).await,
                _ = flush.tick(), if !self.spaces.is_empty() || self.precise.get().is_some() => {
                    self.flush(&peers);
                    self.precise_flush(&peers);
                }
                _ = bounds.tick(), if self.prefix.is_some() => {
                    if let Some(p) = &self.prefix {
                        p.refresh_bounds(&self.store.candidates(mono_now()));
                    }
                }
                _ = samples.tick() => {
                    self.store.shard.set_members(self.live_peers());
                    self.publish_samples();
                }
            }
        }
        for p in peers.values() {
            p.stop.cancel();
        }
    }

    async fn update_peers(
        self: &Arc<Self>,
        members: &impl Peers,
        peers: &mut BTreeMap<String, Peer>,
        stop: &CancellationToken,
    ) {
        let wanted = members.peers().await;
        // Before this replica knows the membership (it has not joined or applied it yet) the
        // set stays as it was: the initial voters (`expect_members`).
        if !wanted.is_empty() {
            *self.members.lock().unwrap_or_else(|e| e.into_inner()) =
                wanted.iter().map(|(_, id)| *id).collect();
        }
        peers.retain(|addr, p| {
            let keep = wanted.iter().any(|(a, _)| a == addr);
            if !keep {
                p.stop.cancel();
                self.kv_routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&p.id);
            }
            keep
        });
        for (addr, peer_id) in wanted {
            if peers.contains_key(&addr) {
                continue;
            }
            let channel = match members.channel(&addr) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "prefix gossip: bad peer address");
                    continue;
                }
            };
            let mut receivers = Vec::new();
            let precise_rx;
            let peer = Peer {
                spaces: self
                    .spaces
                    .iter()
                    .map(|_| {
                        let (tx, rx) = mpsc::channel(self.opts.peer_queue.max(1));
                        // A new peer (or this replica, new) starts with a full anti-entropy
                        // round.
                        let needs_sync = Arc::new(AtomicBool::new(true));
                        receivers.push((rx, needs_sync.clone()));
                        (tx, needs_sync)
                    })
                    .collect(),
                stop: stop.child_token(),
                precise_tx: if self.precise.get().is_some() {
                    let (tx, rx) = mpsc::channel(self.opts.peer_queue.max(1));
                    precise_rx = Some(rx);
                    Some(tx)
                } else {
                    precise_rx = None;
                    None
                },
                id: peer_id,
            };
            if self.kv_inbox.get().is_some() {
                let (tx, rx) = mpsc::channel(precise::FORWARD_QUEUE);
                self.kv_routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(peer_id, tx);
                tokio::spawn(self.clone().kv_forward_loop(
                    addr.clone(),
                    precise::client(channel.clone()),
                    rx,
                    peer.stop.clone(),
                ));
            }
            if let Some(rx) = precise_rx {
                tokio::spawn(self.clone().precise_peer_loop(
                    addr.clone(),
                    peer_id,
                    precise::client(channel.clone()),
                    rx,
                    peer.stop.clone(),
                ));
            }
            let client = PrefixGossipClient::new(channel.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            for (space, (rx, needs_sync)) in receivers.into_iter().enumerate() {
                tokio::spawn(self.clone().peer_loop(
                    space,
                    addr.clone(),
                    client.clone(),
                    rx,
                    needs_sync,
                    peer.stop.clone(),
                ));
            }
            let samples = SampleFanoutClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            tokio::spawn(self.clone().sample_loop(
                samples,
                self.samples.subscribe(),
                peer.stop.clone(),
            ));
            tracing::info!(%addr, "prefix gossip: peer added");
            peers.insert(addr, peer);
        }
        self.metrics.gossip.set_peers(peers.len());
    }

    fn flush(&self, peers: &BTreeMap<String, Peer>) {
        for (i, space) in self.spaces.iter().enumerate() {
            let (pods, overflowed) = space.outbox.take();
            if overflowed {
                for p in peers.values() {
                    p.spaces[i].1.store(true, Ordering::Relaxed);
                }
            }
            if pods.is_empty() || peers.is_empty() {
                continue;
            }
            let msg = Arc::new(pb::Deltas {
                from: self.node_id,
                pods: pods.into_iter().map(to_pb).collect(),
                anti_entropy: false,
                space: space.name.to_string(),
            });
            for p in peers.values() {
                let (tx, needs_sync) = &p.spaces[i];
                if tx.try_send(msg.clone()).is_err() {
                    self.metrics.gossip.dropped_batch();
                    needs_sync.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    /// Sends one space's batches to one peer and runs its anti-entropy rounds.
    async fn peer_loop(
        self: Arc<Self>,
        space: usize,
        addr: String,
        mut client: PrefixGossipClient<tonic::transport::Channel>,
        mut rx: mpsc::Receiver<Arc<pb::Deltas>>,
        needs_sync: Arc<AtomicBool>,
        stop: CancellationToken,
    ) {
        let mut check = tokio::time::interval(Duration::from_millis(100));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sync: Option<Instant> = None;
        let mut failing = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                msg = rx.recv() => {
                    let Some(msg) = msg else { return };
                    if let Err(e) = self.push(&mut client, (*msg).clone()).await {
                        self.metrics.gossip.push_failed();
                        if !failing {
                            tracing::warn!(%addr, error = %e, "prefix gossip: push failed; anti-entropy will repair");
                            failing = true;
                        }
                        needs_sync.store(true, Ordering::Relaxed);
                        // What is queued behind it would most likely fail too; anti-entropy
                        // carries it instead.
                        while rx.try_recv().is_ok() {
                            self.metrics.gossip.dropped_batch();
                        }
                    }
                }
                _ = check.tick() => {
                    let due = needs_sync.load(Ordering::Relaxed)
                        || last_sync.is_none_or(|t| t.elapsed() >= self.opts.anti_entropy);
                    if !due {
                        continue;
                    }
                    // Cleared first: a drop while the round runs asks for another one.
                    needs_sync.store(false, Ordering::Relaxed);
                    match self.sync(space, &mut client).await {
                        Ok(()) => {
                            self.metrics.gossip.sync(true);
                            last_sync = Some(Instant::now());
                            if failing {
                                tracing::info!(%addr, "prefix gossip: peer reachable again");
                                failing = false;
                            }
                        }
                        Err(e) => {
                            self.metrics.gossip.sync(false);
                            needs_sync.store(true, Ordering::Relaxed);
                            last_sync = Some(Instant::now());
                            if !failing {
                                tracing::warn!(%addr, error = %e, "prefix gossip: anti-entropy failed");
                                failing = true;
                            }
                            // Retry at the anti-entropy period, not every check.
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                _ = tokio::time::sleep(self.opts.anti_entropy.min(Duration::from_secs(1))) => {}
                            }
                        }
                    }
                }
            }
        }
    }

    async fn push(
        &self,
        client: &mut PrefixGossipClient<tonic::transport::Channel>,
        msg: pb::Deltas,
    ) -> Result<(), Status> {
        let bytes = msg.encoded_len();
        let entries: usize = msg.pods.iter().map(|p| p.hashes.len()).sum();
        let mut req = Request::new(msg);
        req.set_timeout(self.opts.rpc_timeout);
        tokio::time::timeout(self.opts.rpc_timeout, client.push(req))
            .await
            .map_err(|_| Status::deadline_exceeded("push timed out"))??;
        self.metrics.gossip.sent(bytes, entries);
        Ok(())
    }

    /// One anti-entropy round with a peer: send digests, merge its differing pods, push back the
    /// pods it wants.
    async fn sync(
        &self,
        space: usize,
        client: &mut PrefixGossipClient<tonic::transport::Channel>,
    ) -> Result<(), Status> {
        let space = &self.spaces[space];
        let digests = pb::Digests {
            from: self.node_id,
            pods: space
                .index
                .digests()
                .into_iter()
                .map(digest_to_pb)
                .collect(),
            space: space.name.to_string(),
        };
        self.metrics.gossip.sent(digests.encoded_len(), 0);
        let mut req = Request::new(digests);
        req.set_timeout(self.opts.rpc_timeout);
        let reply = tokio::time::timeout(self.opts.rpc_timeout, client.sync(req))
            .await
            .map_err(|_| Status::deadline_exceeded("sync timed out"))??
            .into_inner();
        let bytes = reply.encoded_len();
        self.merge(space.name, reply.pods, bytes, false)?;
        let states = space.index.export(&reply.wanted);
        for part in chunk(states, self.opts.max_sync_entries) {
            self.push(
                client,
                pb::Deltas {
                    from: self.node_id,
                    pods: part.into_iter().map(to_pb).collect(),
                    anti_entropy: true,
                    space: space.name.to_string(),
                },
            )
            .await?;
        }
        Ok(())
    }

    /// The reply to a peer's digests: this replica's differing pods (bounded) and the pods wanted.
    fn answer(&self, space: &str, remote: Vec<pb::PodDigest>) -> Result<pb::SyncReply, Status> {
        let index = &self.space(space)?.index;
        let local: HashMap<String, PodDigest> = index
            .digests()
            .into_iter()
            .map(|d| (d.name.clone(), d))
            .collect();
        let same = |d: &pb::PodDigest, l: &PodDigest| {
            d.epoch == l.epoch && d.len == l.len && d.digest == l.digest
        };
        let known = self.store.by_hostport();
        let mut wanted = Vec::new();
        let mut send: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for d in &remote {
            seen.insert(d.pod.as_str());
            if !known.contains_key(&d.pod) {
                continue; // not a pod of this replica's pool (yet): neither wanted nor sent
            }
            match local.get(&d.pod) {
                Some(l) if same(d, l) => {}
                Some(l) => {
                    if d.len > 0 && d.epoch >= l.epoch {
                        wanted.push(d.pod.clone());
                    }
                    if l.len > 0 && l.epoch >= d.epoch {
                        send.push(l.name.clone());
                    }
                }
                None if d.len > 0 => wanted.push(d.pod.clone()),
                None => {}
            }
        }
        for (name, l) in &local {
            if l.len > 0 && !seen.contains(name.as_str()) {
                send.push(name.clone());
            }
        }
        send.sort();
        let mut pods = Vec::new();
        let mut n = 0;
        for state in index.export(&send) {
            if n > 0 && n + state.entries.len() > self.opts.max_sync_entries {
                break; // the digests still differ: the next round carries the rest
            }
            n += state.entries.len();
            pods.push(to_pb(state));
        }
        Ok(pb::SyncReply { pods, wanted })
    }
}

/// Where the gossip finds its peers: the other members of the Raft membership, and channels to
/// them on the peer port (TLS and routes as the consensus RPCs').
pub trait Peers: Send + Sync + 'static {
    /// Every other member: (peer address, node id).
    fn peers(&self) -> impl std::future::Future<Output = Vec<(String, u64)>> + Send;
    /// A channel to the member at `addr`.
    fn channel(&self, addr: &str) -> Result<tonic::transport::Channel, Status>;
}

impl<S: StateMachine> Peers for ConsensusNode<S> {
    async fn peers(&self) -> Vec<(String, u64)> {
        let status = self.status().await;
        status
            .members
            .iter()
            .filter(|m| m.addr != status.addr)
            .map(|m| (m.addr.clone(), m.node_id))
            .collect()
    }

    fn channel(&self, addr: &str) -> Result<tonic::transport::Channel, Status> {
        self.peer_channel(addr)
    }
}

impl Peers for ClusterMember {
    async fn peers(&self) -> Vec<(String, u64)> {
        self.node.peers().await
    }

    fn channel(&self, addr: &str) -> Result<tonic::transport::Channel, Status> {
        self.node.channel(addr)
    }
}

#[derive(Debug)]
struct Peer {
    /// Per space (as `Gossip::spaces`): the queue of batches for the peer, and whether an
    /// anti-entropy round is due.
    spaces: Vec<(mpsc::Sender<Arc<pb::Deltas>>, Arc<AtomicBool>)>,
    stop: CancellationToken,
    /// The precise index's deltas for this peer (when replicated).
    precise_tx: Option<mpsc::Sender<Arc<pb::PreciseDeltas>>>,
    id: u64,
}

/// The `PrefixGossip` and `SampleFanout` gRPC services (and the certificate binding of their
/// senders, if any).
#[derive(Debug, Clone)]
pub struct GossipService(Arc<Gossip>, Option<PeerIdentity>);

impl GossipService {
    fn authorize<T>(&self, req: &Request<T>, from: u64, what: &'static str) -> Result<(), Status> {
        crate::cluster::authorize_peer(self.1.as_ref(), req, from, &self.0.metrics, what)?;
        self.0.check_member(from, what)
    }
}

#[tonic::async_trait]
impl PrefixGossip for GossipService {
    async fn push(&self, req: Request<pb::Deltas>) -> Result<Response<pb::PushReply>, Status> {
        self.authorize(&req, req.get_ref().from, "gossip")?;
        let msg = req.into_inner();
        self.0.heard_from(msg.from);
        let bytes = msg.encoded_len();
        self.0
            .merge(&msg.space, msg.pods, bytes, !msg.anti_entropy)?;
        Ok(Response::new(pb::PushReply {}))
    }

    async fn sync(&self, req: Request<pb::Digests>) -> Result<Response<pb::SyncReply>, Status> {
        self.authorize(&req, req.get_ref().from, "gossip")?;
        let msg = req.into_inner();
        self.0.heard_from(msg.from);
        self.0.metrics.gossip.received(msg.encoded_len(), 0);
        let reply = self.0.answer(&msg.space, msg.pods)?;
        self.0.metrics.gossip.sent(
            reply.encoded_len(),
            reply.pods.iter().map(|p| p.hashes.len()).sum(),
        );
        Ok(Response::new(reply))
    }
}

#[cfg(test)]
mod tests;
