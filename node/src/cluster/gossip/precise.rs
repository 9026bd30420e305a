//! The precise prefix index between replicas (`PreciseGossip` in `proto/gossip.proto`).
//!
//! A pod's KV-event stream is subscribed by its scrape owners only (`datalayer::kvevents::follow`).
//! Each owner sends the changes of the pod's distinct block keys to every peer at the gossip
//! interval; a replica that does not own the pod mirrors them (idempotent per key: adding a held
//! key or removing an absent one changes nothing). The owners read the same stream, so their
//! last change of every key agrees and the interleaving of their batches does not matter; two
//! senders keep the mirrors fresh while a dead owner is not yet detected (2 s), at twice the
//! bytes. Lost batches, and owners whose states differ (one resynced), are repaired by
//! anti-entropy, pulled by each mirror from the pod's *primary* (its first owner):
//! per pod the number of distinct keys and their wrapping sum; a differing pod comes back whole
//! and replaces the mirror. An owner's own subscription is authoritative: what peers send about
//! a pod this replica owns is ignored. Ownership moves with the live members: the new owner
//! subscribes (replaying the stream), the old one keeps its entries as a mirror
//! (`PrecisePrefixProducer::hand_over`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use consensus::network::tls::PeerIdentity;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::{Gossip, MAX_MESSAGE_BYTES, Peer, pb};
use crate::datalayer::kvevents::{Forwarded, Subscriber};
use crate::scheduling::precise::PrecisePrefixProducer;
use index::precise::PodKeys;
use pb::precise_gossip_client::PreciseGossipClient;
use pb::precise_gossip_server::{PreciseGossip, PreciseGossipServer};

/// Centralized KV events: messages queued for forwarding, in all and per peer (beyond, they are
/// dropped and counted; the owners see a gap and replay it from the pod).
pub(super) const FORWARD_QUEUE: usize = 8192;
/// Messages, and payload bytes, per forwarding call at most.
const FORWARD_BATCH: usize = 512;
const FORWARD_BYTES: usize = 8 << 20;

/// How often a mirror compares its pods with their primaries.
const ANTI_ENTROPY: Duration = Duration::from_secs(1);
/// The first comparison after a peer appears (a new replica fills its mirrors at once).
const FIRST_SYNC: Duration = Duration::from_millis(200);

pub(super) type Client = PreciseGossipClient<tonic::transport::Channel>;

pub(super) fn client(channel: tonic::transport::Channel) -> Client {
    PreciseGossipClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

impl Gossip {
    /// Replicate `producer`'s index: its owned pods' changes go to the peers, the peers' to it.
    pub fn replicate_precise(&self, producer: Arc<PrecisePrefixProducer>) {
        producer.replicate();
        if self.precise.set(producer).is_err() {
            tracing::warn!("precise index already replicated; a second gossip is ignored");
        }
    }

    /// Centralized KV events in a cluster (`discoverPods: false`): the messages `sub` receives
    /// for pods other replicas own go to those owners (the returned queue, for
    /// [`Subscriber::forward_to`]), and what the peers forward is handed to `sub`.
    /// Call before [`Gossip::run`]: the peers get their forwarding queues as they are added.
    pub fn forward_kv_events(
        self: &Arc<Self>,
        sub: Arc<Subscriber>,
        stop: CancellationToken,
    ) -> mpsc::Sender<Forwarded> {
        if self.kv_inbox.set(sub).is_err() {
            tracing::warn!("kv events already forwarded; a second subscriber is ignored");
        }
        let (tx, rx) = mpsc::channel(FORWARD_QUEUE);
        tokio::spawn(self.clone().route_forwarded(rx, stop));
        tx
    }

    /// Each message to the queues of its pod's owners other than this replica.
    async fn route_forwarded(
        self: Arc<Self>,
        mut rx: mpsc::Receiver<Forwarded>,
        stop: CancellationToken,
    ) {
        loop {
            let f = tokio::select! {
                _ = stop.cancelled() => return,
                f = rx.recv() => match f { Some(f) => f, None => return },
            };
            let frame = pb::KvFrame {
                pod: f.pod.clone(),
                topic: f.topic.clone(),
                seq: f.seq,
                payload: f.payload.clone(),
            };
            for owner in self.store.shard.owners(&f.pod) {
                if owner == self.node_id {
                    // Applied here already (or, ownership having just moved here, missed: the
                    // stream's next message shows the gap, which the replay fills).
                    continue;
                }
                let queued = self
                    .kv_routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&owner)
                    .is_some_and(|tx| tx.try_send(frame.clone()).is_ok());
                if !queued {
                    self.metrics.gossip.dropped_batch();
                }
            }
        }
    }

    /// Sends the messages queued for one peer, batched.
    pub(super) async fn kv_forward_loop(
        self: Arc<Self>,
        addr: String,
        mut client: Client,
        mut rx: mpsc::Receiver<pb::KvFrame>,
        stop: CancellationToken,
    ) {
        let mut failing = false;
        loop {
            let first = tokio::select! {
                _ = stop.cancelled() => return,
                f = rx.recv() => match f { Some(f) => f, None => return },
            };
            let mut bytes = first.payload.len();
            let mut frames = vec![first];
            while frames.len() < FORWARD_BATCH && bytes < FORWARD_BYTES {
                let Ok(f) = rx.try_recv() else { break };
                bytes += f.payload.len();
                frames.push(f);
            }
            let msg = pb::KvFrames {
                from: self.node_id,
                frames,
            };
            let (size, n) = (msg.encoded_len(), msg.frames.len());
            let mut req = Request::new(msg);
            req.set_timeout(self.opts.rpc_timeout);
            let res = tokio::time::timeout(self.opts.rpc_timeout, client.forward(req)).await;
            match res {
                Ok(Ok(_)) => {
                    self.metrics.gossip.sent(size, n);
                    if failing {
                        tracing::info!(%addr, "kv events: forwarding to the peer again");
                        failing = false;
                    }
                }
                Ok(Err(e)) => self.forward_failed(&addr, &mut failing, &e.to_string()),
                Err(_) => self.forward_failed(&addr, &mut failing, "timed out"),
            }
        }
    }

    fn forward_failed(&self, addr: &str, failing: &mut bool, error: &str) {
        self.metrics.gossip.push_failed();
        if !*failing {
            tracing::warn!(%addr, %error, "kv events: forwarding failed; the owners replay the gap");
            *failing = true;
        }
    }

    /// Messages a peer forwarded: those of pods this replica owns to its subscriber.
    fn kv_receive(&self, frames: Vec<pb::KvFrame>) -> Result<(), Status> {
        let sub = self.kv_inbox.get().ok_or_else(|| {
            Status::failed_precondition("no centralized KV events on this replica")
        })?;
        let known = self.store.by_hostport();
        for f in frames {
            if !known.contains_key(&f.pod) {
                self.metrics.rejected_value("peer", "pod");
                continue;
            }
            // Ownership moved meanwhile: the new owner replays what it missed.
            if !self.store.shard.owns(&f.pod) {
                continue;
            }
            let m = Forwarded {
                pod: f.pod,
                seq: f.seq,
                topic: f.topic,
                payload: f.payload,
            };
            if !sub.inject(&m) {
                self.metrics.kv_events.messages(&m.pod, "overflow", 1);
            }
        }
        Ok(())
    }

    pub(super) fn precise(&self) -> Result<&PrecisePrefixProducer, Status> {
        self.precise
            .get()
            .map(Arc::as_ref)
            .ok_or_else(|| Status::failed_precondition("no precise prefix index on this replica"))
    }

    /// The gRPC service to serve on the peer port.
    pub fn precise_service(
        self: &Arc<Self>,
        identity: Option<PeerIdentity>,
    ) -> PreciseGossipServer<PreciseGossipService> {
        PreciseGossipServer::new(PreciseGossipService(self.clone(), identity))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    fn primary_of(&self, pod: &str) -> Option<u64> {
        self.store.shard.owners(pod).first().copied()
    }

    /// Offer the changes of the pods this replica owns to every peer.
    pub(super) fn precise_flush(&self, peers: &BTreeMap<String, Peer>) {
        let Some(producer) = self.precise.get() else {
            return;
        };
        let changes = producer.take_changes();
        if changes.is_empty() || peers.is_empty() {
            return;
        }
        // One delta per pod and tier (the GPU's with an empty medium).
        let mut pods: Vec<pb::PreciseDelta> = changes
            .into_iter()
            .filter(|(pod, _)| self.store.shard.owns(pod))
            .flat_map(|(pod, c)| {
                let tiers = std::iter::once((String::new(), c.keys)).chain(c.offload);
                tiers.map(move |(medium, keys)| {
                    let (mut adds, mut removes) = (Vec::new(), Vec::new());
                    for (k, added) in keys {
                        if added {
                            adds.push(k);
                        } else {
                            removes.push(k);
                        }
                    }
                    pb::PreciseDelta {
                        pod: pod.clone(),
                        block_size: c.block_size,
                        adds,
                        removes,
                        medium,
                    }
                })
            })
            .filter(|d| !d.adds.is_empty() || !d.removes.is_empty())
            .collect();
        if pods.is_empty() {
            return;
        }
        pods.sort_by(|a, b| (&a.pod, &a.medium).cmp(&(&b.pod, &b.medium)));
        let msg = Arc::new(pb::PreciseDeltas {
            from: self.node_id,
            pods,
        });
        for p in peers.values() {
            if let Some(tx) = &p.precise_tx
                && tx.try_send(msg.clone()).is_err()
            {
                // The peer's next anti-entropy round repairs it.
                self.metrics.gossip.dropped_batch();
            }
        }
    }

    /// Pushes this replica's deltas to one peer and pulls anti-entropy for the pods that peer is
    /// the primary of.
    pub(super) async fn precise_peer_loop(
        self: Arc<Self>,
        addr: String,
        peer_id: u64,
        mut client: Client,
        mut rx: mpsc::Receiver<Arc<pb::PreciseDeltas>>,
        stop: CancellationToken,
    ) {
        let mut sync =
            tokio::time::interval_at(tokio::time::Instant::now() + FIRST_SYNC, ANTI_ENTROPY);
        sync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            let res = tokio::select! {
                _ = stop.cancelled() => return,
                msg = rx.recv() => {
                    let Some(msg) = msg else { return };
                    self.precise_push(&mut client, (*msg).clone()).await
                }
                _ = sync.tick() => self.precise_sync(&mut client, peer_id).await,
            };
            match res {
                Ok(()) if failing => {
                    tracing::info!(%addr, "precise gossip: peer reachable again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) => {
                    self.metrics.gossip.push_failed();
                    if !failing {
                        tracing::warn!(%addr, error = %e, "precise gossip: exchange failed; anti-entropy will repair");
                        failing = true;
                    }
                    while rx.try_recv().is_ok() {
                        self.metrics.gossip.dropped_batch();
                    }
                }
            }
        }
    }

    async fn precise_push(
        &self,
        client: &mut Client,
        msg: pb::PreciseDeltas,
    ) -> Result<(), Status> {
        let bytes = msg.encoded_len();
        let entries: usize = msg
            .pods
            .iter()
            .map(|p| p.adds.len() + p.removes.len())
            .sum();
        let mut req = Request::new(msg);
        req.set_timeout(self.opts.rpc_timeout);
        tokio::time::timeout(self.opts.rpc_timeout, client.push(req))
            .await
            .map_err(|_| Status::deadline_exceeded("push timed out"))??;
        self.metrics.gossip.sent(bytes, entries);
        Ok(())
    }

    /// One anti-entropy pull: the digests of the pods `peer_id` is the primary of (and this
    /// replica does not own); its differing pods replace ours.
    async fn precise_sync(&self, client: &mut Client, peer_id: u64) -> Result<(), Status> {
        let producer = self.precise()?;
        let shard = &self.store.shard;
        let mut pods: Vec<pb::PreciseDigest> = self
            .store
            .by_hostport()
            .keys()
            .filter(|pod| !shard.owns(pod) && self.primary_of(pod) == Some(peer_id))
            .cloned()
            .map(|pod| {
                let (distinct, digest) = producer.digest(&pod);
                pb::PreciseDigest {
                    pod,
                    distinct,
                    digest,
                }
            })
            .collect();
        if pods.is_empty() {
            return Ok(());
        }
        pods.sort_by(|a, b| a.pod.cmp(&b.pod));
        let msg = pb::PreciseDigests {
            from: self.node_id,
            pods,
        };
        self.metrics.gossip.sent(msg.encoded_len(), 0);
        let mut req = Request::new(msg);
        req.set_timeout(self.opts.rpc_timeout);
        let reply = tokio::time::timeout(self.opts.rpc_timeout, client.sync(req))
            .await
            .map_err(|_| Status::deadline_exceeded("sync timed out"))??
            .into_inner();
        let entries: usize = reply.pods.iter().map(state_entries).sum();
        self.metrics.gossip.received(reply.encoded_len(), entries);
        let known = self.store.by_hostport();
        for st in reply.pods {
            // Ownership may have moved meanwhile: an owner's own stream wins.
            if known.contains_key(&st.pod) && !shard.owns(&st.pod) {
                let keys = PodKeys {
                    block_size: st.block_size,
                    gpu: st.keys,
                    offload: st.offload.into_iter().map(|t| (t.medium, t.keys)).collect(),
                };
                producer.replace(&st.pod, &keys);
            }
        }
        Ok(())
    }

    /// The pods of a mirror's digests this replica owns and holds differently: whole (bounded;
    /// the rest differ still and come in the next round).
    fn precise_answer(
        &self,
        digests: Vec<pb::PreciseDigest>,
    ) -> Result<pb::PreciseSyncReply, Status> {
        let producer = self.precise()?;
        let known = self.store.by_hostport();
        let mut pods = Vec::new();
        let mut n = 0;
        for d in digests {
            if !known.contains_key(&d.pod) || !self.store.shard.owns(&d.pod) {
                continue;
            }
            if producer.digest(&d.pod) == (d.distinct, d.digest) {
                continue;
            }
            let Some(state) = producer.state(&d.pod) else {
                continue;
            };
            let len = state.gpu.len() + state.offload.iter().map(|t| t.1.len()).sum::<usize>();
            if n > 0 && n + len > self.opts.max_sync_entries {
                break;
            }
            n += len;
            pods.push(pb::PreciseState {
                pod: d.pod,
                block_size: state.block_size,
                keys: state.gpu,
                offload: state
                    .offload
                    .into_iter()
                    .map(|(medium, keys)| pb::PreciseTier { medium, keys })
                    .collect(),
            });
        }
        Ok(pb::PreciseSyncReply { pods })
    }

    /// A primary's changes: mirrored for known pods this replica does not own.
    fn precise_merge(&self, pods: Vec<pb::PreciseDelta>) -> Result<(), Status> {
        let producer = self.precise()?;
        let known = self.store.by_hostport();
        for d in pods {
            if !known.contains_key(&d.pod) {
                self.metrics.rejected_value("peer", "pod");
                continue;
            }
            if self.store.shard.owns(&d.pod) {
                continue;
            }
            if !producer.mirror(&d.pod, &d.medium, d.block_size, &d.adds, &d.removes) {
                self.metrics.rejected_value("peer", "medium");
            }
        }
        Ok(())
    }
}

/// Keys in a pod's state, all tiers.
fn state_entries(st: &pb::PreciseState) -> usize {
    st.keys.len() + st.offload.iter().map(|t| t.keys.len()).sum::<usize>()
}

/// The `PreciseGossip` gRPC service.
#[derive(Debug, Clone)]
pub struct PreciseGossipService(Arc<Gossip>, Option<PeerIdentity>);

impl PreciseGossipService {
    fn authorize<T>(&self, req: &Request<T>, from: u64) -> Result<(), Status> {
        crate::cluster::authorize_peer(self.1.as_ref(), req, from, &self.0.metrics, "gossip")?;
        self.0.check_member(from, "gossip")
    }
}

#[tonic::async_trait]
impl PreciseGossip for PreciseGossipService {
    async fn push(
        &self,
        req: Request<pb::PreciseDeltas>,
    ) -> Result<Response<pb::PushReply>, Status> {
        self.authorize(&req, req.get_ref().from)?;
        let msg = req.into_inner();
        self.0.heard_from(msg.from);
        let entries: usize = msg
            .pods
            .iter()
            .map(|p| p.adds.len() + p.removes.len())
            .sum();
        self.0.metrics.gossip.received(msg.encoded_len(), entries);
        self.0.precise_merge(msg.pods)?;
        Ok(Response::new(pb::PushReply {}))
    }

    async fn forward(&self, req: Request<pb::KvFrames>) -> Result<Response<pb::PushReply>, Status> {
        self.authorize(&req, req.get_ref().from)?;
        let msg = req.into_inner();
        self.0.heard_from(msg.from);
        self.0
            .metrics
            .gossip
            .received(msg.encoded_len(), msg.frames.len());
        self.0.kv_receive(msg.frames)?;
        Ok(Response::new(pb::PushReply {}))
    }

    async fn sync(
        &self,
        req: Request<pb::PreciseDigests>,
    ) -> Result<Response<pb::PreciseSyncReply>, Status> {
        self.authorize(&req, req.get_ref().from)?;
        let msg = req.into_inner();
        self.0.heard_from(msg.from);
        self.0.metrics.gossip.received(msg.encoded_len(), 0);
        let reply = self.0.precise_answer(msg.pods)?;
        self.0.metrics.gossip.sent(
            reply.encoded_len(),
            reply.pods.iter().map(state_entries).sum(),
        );
        Ok(Response::new(reply))
    }
}
