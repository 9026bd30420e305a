//! Settlements relayed between replicas, for requests that are not settled cluster-wide.
//!
//! Envoy's ext_proc streams for one request may reach different replicas: the one that routed a
//! request holds its in-flight charge (and, with `--flow-control-scope replica`, its flow-control
//! slot), but another may observe the response end. That replica finds nothing under the
//! request's key, so it hands the key to the [`SettleRelay`], which sends it to the replica the
//! key names as its maker (`dataplane::usage::request_key_owner`) — or, for a key that names no
//! member of the cluster (made before a restart changed the membership, or by an older build),
//! to every peer; the replica holding it releases charge and slot, any other finds nothing and
//! ignores it (`llm_d_epp_cluster_settlements_relayed_total` counts each outcome). Without this,
//! the routing replica would keep the charge until the one-hour sweep — load scorers, the
//! affinity filter's TTFT penalty and saturation detectors drifting upward.
//!
//! Keys are batched every [`FLUSH`] into one message per peer, over a bounded queue per peer: a
//! peer that cannot keep up loses batches (counted), and the sweep remains the backstop.
//! With cluster-wide flow control the gate relays only keys of other live replicas that the
//! replicated ledger does not hold — their credit admissions, which their makers count
//! (`gate::run::sort_foreign`); ledger entries are settled through the log.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::gossip::pb;
use super::member::ClusterMember;
use crate::datalayer::inflight::InflightTracker;
use crate::dataplane::usage::request_key_owner;
use crate::metrics::Metrics;
use crate::request::admission::Gate;

use pb::settlements_client::SettlementsClient;
use pb::settlements_server::{Settlements, SettlementsServer};

/// How often relayed keys are sent.
pub const FLUSH: Duration = Duration::from_millis(5);
/// Keys waiting to be sent; past it new ones are dropped (and counted).
const QUEUE: usize = 65_536;
/// Most keys one message carries (and one received message may carry).
const MAX_BATCH: usize = 16_384;
/// Longest key accepted (ours are 32 hex digits, `-` and at most 16 more).
const MAX_KEY_BYTES: usize = 64;
/// Batches waiting per peer.
const PEER_QUEUE: usize = 64;

/// A key to relay, with the response's token count when known.
pub type Settlement = (String, Option<u64>);

/// Where this replica's foreign settlements go, and where the peers' are applied.
pub struct SettleRelay {
    node_id: u64,
    tracker: Option<Arc<InflightTracker>>,
    gate: Arc<dyn Gate>,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Settlement>,
    rx: std::sync::Mutex<Option<mpsc::Receiver<Settlement>>>,
}

impl std::fmt::Debug for SettleRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettleRelay")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl SettleRelay {
    pub fn new(
        node_id: u64,
        tracker: Option<Arc<InflightTracker>>,
        gate: Arc<dyn Gate>,
        metrics: Arc<Metrics>,
    ) -> Arc<SettleRelay> {
        let (tx, rx) = mpsc::channel(QUEUE);
        Arc::new(SettleRelay {
            node_id,
            tracker,
            gate,
            metrics,
            tx,
            rx: std::sync::Mutex::new(Some(rx)),
        })
    }

    /// The data plane's end: settlements of requests this replica did not hold.
    pub fn sender(&self) -> mpsc::Sender<Settlement> {
        self.tx.clone()
    }

    /// The gRPC service to serve on the peer port.
    pub fn service(
        self: &Arc<Self>,
        identity: Option<consensus::network::tls::PeerIdentity>,
    ) -> SettlementsServer<SettleService> {
        SettlementsServer::new(SettleService(self.clone(), identity))
    }

    /// A peer's settlements: release what this replica holds.
    fn apply(&self, batch: pb::SettleBatch) -> usize {
        let mut released = 0;
        let mut not_held = 0;
        for s in batch.settled.into_iter().take(MAX_BATCH) {
            if s.key.len() > MAX_KEY_BYTES {
                self.metrics.rejected_value("peer", "settlement_key");
                continue;
            }
            let held = self.tracker.as_ref().is_some_and(|t| t.finish(&s.key));
            let slot = self.gate.settled_by_peer(&s.key, s.tokens);
            if held || slot {
                released += 1;
            } else {
                not_held += 1;
            }
        }
        self.metrics.gossip.relayed("released", released);
        self.metrics.gossip.relayed("not_held", not_held);
        released
    }

    /// Sends the relayed keys to the peers of `member`'s Raft membership until `stop`.
    pub async fn run(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let Some(mut rx) = self.rx.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return; // already running
        };
        let mut peers: BTreeMap<String, (mpsc::Sender<Arc<pb::SettleBatch>>, CancellationToken)> =
            BTreeMap::new();
        // The peers' node ids → addresses (whom a key's owner id names).
        let mut addrs: BTreeMap<u64, String> = BTreeMap::new();
        let mut flush = tokio::time::interval(FLUSH);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut membership = tokio::time::interval(Duration::from_millis(500));
        membership.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = membership.tick() => {
                    let status = member.node.status().await;
                    addrs = status
                        .members
                        .iter()
                        .filter(|m| m.addr != status.addr)
                        .map(|m| (m.node_id, m.addr.clone()))
                        .collect();
                    let wanted: Vec<String> = addrs.values().cloned().collect();
                    peers.retain(|addr, (_, s)| {
                        let keep = wanted.contains(addr);
                        if !keep {
                            s.cancel();
                        }
                        keep
                    });
                    for addr in wanted {
                        if peers.contains_key(&addr) {
                            continue;
                        }
                        let Ok(channel) = member.node.peer_channel(&addr) else {
                            continue;
                        };
                        let (tx, prx) = mpsc::channel(PEER_QUEUE);
                        let s = stop.child_token();
                        tokio::spawn(self.clone().peer_loop(SettlementsClient::new(channel), prx, s.clone()));
                        tracing::debug!(%addr, "settlement relay: peer added");
                        peers.insert(addr, (tx, s));
                    }
                }
                _ = flush.tick(), if !peers.is_empty() => {
                    // (No peer known yet: the keys wait in the queue.)
                    let mut settled = Vec::new();
                    while settled.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok((key, tokens)) => settled.push(pb::Settled { key, tokens }),
                            Err(_) => break,
                        }
                    }
                    if settled.is_empty() {
                        continue;
                    }
                    tracing::debug!(keys = settled.len(), peers = peers.len(), "relaying settlements");
                    self.metrics.gossip.relayed("sent", settled.len());
                    for (addr, settled) in by_peer(settled, &addrs, peers.keys()) {
                        let Some((tx, _)) = peers.get(addr) else {
                            continue;
                        };
                        let batch = Arc::new(pb::SettleBatch { from: self.node_id, settled });
                        if tx.try_send(batch).is_err() {
                            self.metrics.gossip.dropped_batch();
                        }
                    }
                }
            }
        }
        for (_, s) in peers.values() {
            s.cancel();
        }
    }

    async fn peer_loop(
        self: Arc<Self>,
        mut client: SettlementsClient<tonic::transport::Channel>,
        mut rx: mpsc::Receiver<Arc<pb::SettleBatch>>,
        stop: CancellationToken,
    ) {
        loop {
            let batch = tokio::select! {
                _ = stop.cancelled() => return,
                b = rx.recv() => match b { Some(b) => b, None => return },
            };
            let mut req = Request::new((*batch).clone());
            req.set_timeout(Duration::from_secs(2));
            if let Err(e) = client.settled(req).await {
                tracing::debug!(error = %e, "relaying settlements to a peer failed");
                self.metrics.gossip.push_failed();
            }
        }
    }
}

/// Which peer each settlement goes to: the one its key names as owner, or — a key naming no
/// peer — every peer (each batch in the order the keys came).
fn by_peer<'a>(
    settled: Vec<pb::Settled>,
    addrs: &'a BTreeMap<u64, String>,
    peers: impl Iterator<Item = &'a String>,
) -> BTreeMap<&'a String, Vec<pb::Settled>> {
    let mut out: BTreeMap<&String, Vec<pb::Settled>> = peers.map(|p| (p, Vec::new())).collect();
    for s in settled {
        let owner = request_key_owner(&s.key).and_then(|id| addrs.get(&id));
        if let Some(v) = owner.and_then(|addr| out.get_mut(addr)) {
            v.push(s);
        } else {
            for v in out.values_mut() {
                v.push(s.clone());
            }
        }
    }
    out.retain(|_, v| !v.is_empty());
    out
}

/// The `Settlements` gRPC service.
#[derive(Debug, Clone)]
pub struct SettleService(
    Arc<SettleRelay>,
    Option<consensus::network::tls::PeerIdentity>,
);

#[tonic::async_trait]
impl Settlements for SettleService {
    async fn settled(
        &self,
        req: Request<pb::SettleBatch>,
    ) -> Result<Response<pb::PushReply>, Status> {
        let from = req.get_ref().from;
        crate::cluster::authorize_peer(self.1.as_ref(), &req, from, &self.0.metrics, "settle")?;
        let batch = req.into_inner();
        let keys = batch.settled.len();
        let released = self.0.apply(batch);
        tracing::debug!(from, keys, released, "settlements relayed by a peer");
        Ok(Response::new(pb::PushReply {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::usage::new_request_key;

    fn keys(out: &BTreeMap<&String, Vec<pb::Settled>>, peer: &str) -> Vec<String> {
        out.iter()
            .find(|(p, _)| p.as_str() == peer)
            .map(|(_, v)| v.iter().map(|s| s.key.clone()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn a_key_goes_to_its_owner_and_a_key_naming_no_peer_to_every_peer() {
        let addrs: BTreeMap<u64, String> = [(2, "b:1".to_string()), (3, "c:1".to_string())].into();
        let peers: Vec<String> = addrs.values().cloned().collect();
        let to_b = new_request_key(Some(2));
        let to_c = new_request_key(Some(3));
        let anonymous = new_request_key(None);
        let gone = new_request_key(Some(9));
        let settled = [&to_b, &anonymous, &to_c, &gone]
            .iter()
            .map(|k| pb::Settled {
                key: k.to_string(),
                tokens: None,
            })
            .collect();
        let out = by_peer(settled, &addrs, peers.iter());
        assert_eq!(
            keys(&out, "b:1"),
            vec![to_b, anonymous.clone(), gone.clone()]
        );
        assert_eq!(keys(&out, "c:1"), vec![anonymous, to_c, gone]);
        // A peer with nothing to receive gets no message.
        let only_b = vec![pb::Settled {
            key: new_request_key(Some(2)),
            tokens: None,
        }];
        let out = by_peer(only_b, &addrs, peers.iter());
        assert_eq!(out.len(), 1);
        assert_eq!(keys(&out, "b:1").len(), 1);
    }
}
