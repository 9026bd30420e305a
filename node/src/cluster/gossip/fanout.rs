//! The scrape fan-out half of the peer exchange: this replica's fresh scrapes (and, without
//! cluster-wide flow control, its per-pod in-flight load) go to every peer every
//! [`GossipOptions::samples_interval`](super::GossipOptions); peers' samples are applied when
//! newer (aged by the age their sender measured), and their load reports summed into the
//! in-flight ledger's remote feed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::pb::sample_fanout_client::SampleFanoutClient;
use super::pb::sample_fanout_server::{SampleFanout, SampleFanoutServer};
use super::{Gossip, GossipService, MAX_MESSAGE_BYTES, PEER_LIVENESS, pb};
use crate::datalayer::EndpointMetrics;
use crate::datalayer::inflight::{InflightLoad, InflightTracker, RemoteLoadFeed};
use crate::datalayer::scraper::{mono_now, unix_us};

/// Bounds on a peer's load report for one pod.
const MAX_POD_REQUESTS: u64 = 1_000_000;
const MAX_POD_TOKENS: u64 = 1 << 40;

impl Gossip {
    /// Share in-flight load with the peers: report `tracker`'s own load with every fan-out
    /// batch, and publish the peers' (summed per pod) into `feed`, which the tracker reads.
    /// For clusters without cluster-wide flow control (its ledger already knows everyone's).
    pub fn share_load(&self, tracker: Arc<InflightTracker>, feed: RemoteLoadFeed) -> bool {
        self.load.set((tracker, feed)).is_ok()
    }

    /// Fold in peer `from`'s load report and publish the live peers' sum.
    pub(super) fn peer_load(&self, from: u64, load: Vec<pb::PodLoad>) {
        let Some((_, feed)) = self.load.get() else {
            return;
        };
        let known = self.store.by_hostport();
        let mut reports = self.peer_load.lock().unwrap_or_else(|p| p.into_inner());
        reports.insert(from, (Instant::now(), load));
        reports.retain(|_, (at, _)| at.elapsed() < PEER_LIVENESS);
        let mut sum: HashMap<String, InflightLoad> = HashMap::new();
        for (_, pods) in reports.values() {
            for p in pods {
                if !known.contains_key(&p.pod) {
                    continue;
                }
                let e = sum.entry(p.pod.clone()).or_default();
                e.requests = e.requests.saturating_add(p.requests.min(MAX_POD_REQUESTS));
                e.tokens = e.tokens.saturating_add(p.tokens.min(MAX_POD_TOKENS));
                e.prefilling = e
                    .prefilling
                    .saturating_add(p.prefilling.min(p.requests).min(MAX_POD_REQUESTS));
            }
        }
        feed.publish_others(sum);
    }

    /// The scrape fan-out gRPC service.
    pub fn sample_service(
        self: &Arc<Self>,
        identity: Option<consensus::network::tls::PeerIdentity>,
    ) -> SampleFanoutServer<GossipService> {
        SampleFanoutServer::new(GossipService(self.clone(), identity))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Queue this replica's fresh scrapes for the peers — also when there are none: the batch
    /// is this replica's liveness signal to them.
    pub(super) fn publish_samples(&self) {
        let samples: Vec<pb::Sample> = self
            .store
            .shard
            .take()
            .into_iter()
            .map(|(pod, m, t)| {
                let mut s = sample_to_pb(pod, m, t);
                s.age_us = Some(unix_us().saturating_sub(t));
                s
            })
            .collect();
        let load = self.load.get().map_or_else(Vec::new, |(t, _)| {
            t.own_load()
                .into_iter()
                .map(|(pod, l)| pb::PodLoad {
                    pod,
                    requests: l.requests,
                    tokens: l.tokens,
                    prefilling: l.prefilling,
                })
                .collect()
        });
        self.samples.send_replace(Arc::new(pb::SampleBatch {
            from: self.node_id,
            samples,
            load,
        }));
    }

    /// Apply peers' samples that are newer than what this replica holds.
    pub(super) fn apply_samples(&self, batch: pb::SampleBatch) -> usize {
        let by_addr = self.store.by_hostport();
        let (now, now_us) = (mono_now(), unix_us());
        let mut applied = 0;
        for s in batch.samples {
            let Some(ep) = by_addr.get(&s.pod) else {
                continue; // not (yet) in this replica's endpoint set
            };
            let age = Duration::from_micros(
                s.age_us
                    .unwrap_or_else(|| now_us.saturating_sub(s.scraped_unix_us)),
            );
            let Some(scraped_at) = now.checked_sub(age) else {
                continue;
            };
            if ep.sample().is_some_and(|cur| cur.scraped_at >= scraped_at) {
                continue;
            }
            let mut m = sample_from_pb(s);
            ep.check(&mut m, "peer", &self.metrics);
            self.store.set_metrics(ep, m, scraped_at);
            applied += 1;
        }
        applied
    }

    /// Sends each new fan-out batch to one peer; a batch superseded while a send was in flight
    /// is skipped (only the newest samples matter).
    pub(super) async fn sample_loop(
        self: Arc<Self>,
        mut client: SampleFanoutClient<tonic::transport::Channel>,
        mut rx: tokio::sync::watch::Receiver<Arc<pb::SampleBatch>>,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = rx.changed() => if changed.is_err() { return },
            }
            let batch = (*rx.borrow_and_update()).clone();
            let bytes = batch.encoded_len();
            let mut req = Request::new((*batch).clone());
            req.set_timeout(self.opts.rpc_timeout);
            match tokio::time::timeout(self.opts.rpc_timeout, client.samples(req)).await {
                Ok(Ok(_)) => self.metrics.gossip.samples_sent(bytes),
                _ => self.metrics.gossip.push_failed(),
            }
        }
    }
}

#[tonic::async_trait]
impl SampleFanout for GossipService {
    async fn samples(
        &self,
        req: Request<pb::SampleBatch>,
    ) -> Result<Response<pb::PushReply>, Status> {
        self.authorize(&req, req.get_ref().from, "samples")?;
        let mut batch = req.into_inner();
        self.0.heard_from(batch.from);
        let bytes = batch.encoded_len();
        if batch.from != self.0.node_id {
            self.0
                .peer_load(batch.from, std::mem::take(&mut batch.load));
        }
        let applied = self.0.apply_samples(batch);
        self.0.metrics.gossip.samples_received(bytes, applied);
        Ok(Response::new(pb::PushReply {}))
    }
}

pub(super) fn sample_to_pb(pod: String, m: EndpointMetrics, scraped_unix_us: u64) -> pb::Sample {
    pb::Sample {
        pod,
        scraped_unix_us,
        waiting_queue_size: m.waiting_queue_size,
        running_requests: m.running_requests,
        kv_cache_usage: m.kv_cache_usage,
        block_size: m.block_size,
        num_gpu_blocks: m.num_gpu_blocks,
        max_active_models: m.max_active_models,
        active_models: m.active_models,
        waiting_models: m.waiting_models,
        started_ms: m.started_ms,
        age_us: None,
    }
}

pub(super) fn sample_from_pb(s: pb::Sample) -> EndpointMetrics {
    let finite = |v: Option<f64>| v.filter(|x| x.is_finite());
    EndpointMetrics {
        waiting_queue_size: finite(s.waiting_queue_size),
        running_requests: finite(s.running_requests),
        kv_cache_usage: finite(s.kv_cache_usage).map(|v| v.clamp(0.0, 1.0)),
        block_size: s.block_size,
        num_gpu_blocks: s.num_gpu_blocks,
        max_active_models: s.max_active_models,
        active_models: s.active_models,
        waiting_models: s.waiting_models,
        started_ms: s.started_ms,
    }
}
