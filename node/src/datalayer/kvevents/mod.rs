//! The KV-event subscriber: one ZMQ SUB socket per pod (and a DEALER for its replay socket),
//! feeding the precise prefix index.
//!
//! Where a pod publishes: its label (or, from Kubernetes, annotation) `llm-d.ai/kv-events-endpoint`
//! (and `llm-d.ai/kv-events-replay-endpoint`), else llm-d's pod discovery:
//! `tcp://<pod IP>:<socketPort>` (replay on `replayPort` when configured). In llm-d's centralized
//! mode (`discoverPods: false`) the pods connect instead: one SUB socket bound on `zmqEndpoint`
//! takes every pod's stream, told apart by the pod in its topic (`kv@<ip>:<port>@<model>`, the
//! candidate's address; an IP alone when one pod of the pool has it), then followed as a stream
//! of its own — sequence, gaps, replays (from the pod's replay socket), restarts; in a cluster
//! the replica a pod publishes to forwards its messages to the pod's owners ([`central`]).
//! Messages from a pod outside the pool are counted (`unknown`) and dropped. A task follows the
//! pool ([`follow`]) and hands the subscription set to the thread that owns every socket (ZMQ
//! sockets are not thread-safe), which polls them, decodes each batch
//! ([`index::kvevents`]) and applies it under the index's write lock, one message at a time.
//!
//! Per pod the thread tracks the publisher's sequence:
//! - in order → apply;
//! - a gap (the first batches after a connect are lost by design, and any beyond the high-water
//!   mark) → ask the replay socket for the missing batches, hold live ones meanwhile (bounded),
//!   apply the replayed ones in order, then the held ones; when the pod has no replay socket, the
//!   replay does not go back far enough, or it does not answer in time, the pod is *resynced*:
//!   its entries are dropped (a stale entry routes to a pod that no longer holds the blocks; a
//!   missing one only costs a hit) and the stream is followed from there;
//! - backwards (the publisher restarted: its cache is empty) → drop the pod's entries, then as a
//!   new publisher. Before the first live message, a sequence the replay already applied is a
//!   duplicate only if it carries the same batch (payload digests of the last [`RECENT`] batches):
//!   a different one is a publisher that restarted after the replay.
//!
//! A pod flooding events cannot starve the others or routing: each poll round reads at most
//! [`BUDGET`] messages per pod, the SUB socket's high-water mark bounds what waits in ZMQ, and
//! index writes are one batch each. Garbage is counted and dropped.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use index::kvevents::{self, Replay};
use index::precise::Applied;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

mod central;

use central::Central;
pub use central::Forwarded;

use super::endpoint::Endpoint;
use super::store::Datastore;
use crate::metrics::Metrics;

/// Label (or annotation) naming a pod's KV-event PUB endpoint.
pub const ENDPOINT_LABEL: &str = "llm-d.ai/kv-events-endpoint";
/// Label (or annotation) naming a pod's replay ROUTER endpoint.
pub const REPLAY_LABEL: &str = "llm-d.ai/kv-events-replay-endpoint";

/// Messages read from one pod per poll round.
pub const BUDGET: usize = 256;
/// Live messages held per pod while a replay runs; past it the replay is abandoned (resync).
const BACKLOG: usize = 4096;
/// How long a replay may take before the pod is resynced instead.
const REPLAY_DEADLINE: Duration = Duration::from_secs(2);
/// After a replay failed, gaps resync directly for this long (a pod whose replay socket is down
/// is not asked on every gap).
const REPLAY_COOLDOWN: Duration = Duration::from_secs(5);
/// SUB receive high-water mark (messages).
const RCVHWM: i32 = 10_000;
/// The largest KV-event message taken from a publisher (ZMQ_MAXMSGSIZE, per frame): ZMQ
/// disconnects a peer that sends more, before the message is buffered (the publisher reconnects;
/// the stream's sequence gap is then resynced like any other). An engine's batches are kilobytes.
pub const MAX_MESSAGE_BYTES: i64 = 8 << 20;
/// Batches remembered per stream (sequence and payload digest) to tell a late duplicate from a
/// restarted publisher's new batch.
const RECENT: usize = 64;
const POLL_MS: i64 = 20;

/// What the subscriber feeds: the precise index (`scheduling::precise` implements it).
pub trait KvIndex: Send + Sync {
    /// Apply one batch of pod `pod`'s events (`model`: the model its topic names).
    fn apply(&self, pod: &str, model: &str, events: &[index::kvevents::KvEvent]) -> Applied;
    /// Forget what the pod holds (resync, restart), here and on the replicas mirroring it.
    fn clear(&self, pod: &str) -> u64;
    /// Forget what the pod holds here only (a subscription starting over a mirror).
    fn reset_locally(&self, pod: &str);
    /// Keep what the pod holds as a mirror (another replica subscribes to it now).
    fn hand_over(&self, pod: &str);
    /// Drop the pod (gone from the pool).
    fn remove(&self, pod: &str);
    /// Pods in the index.
    fn pods(&self) -> Vec<String>;
    /// Blocks the pod holds.
    fn pod_blocks(&self, pod: &str) -> usize;
    /// (entries, heap bytes) of the whole index.
    fn size(&self) -> (usize, usize);
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PodDiscoveryConfig {
    /// The pods' PUB port (`tcp://<pod IP>:<socketPort>`).
    #[serde(default = "d_socket_port")]
    pub socket_port: u16,
    /// The pods' replay ROUTER port; none = no replay (gaps resync the pod).
    #[serde(default)]
    pub replay_port: Option<u16>,
}

fn d_socket_port() -> u16 {
    5557
}

impl Default for PodDiscoveryConfig {
    fn default() -> Self {
        PodDiscoveryConfig {
            socket_port: d_socket_port(),
            replay_port: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KvEventsParams {
    /// Centralized mode's bind address (pods connect to the EPP); see `discoverPods`.
    #[serde(default)]
    pub zmq_endpoint: Option<String>,
    #[serde(default = "d_topic")]
    pub topic_filter: String,
    /// llm-d's worker count; one thread here serves every subscription.
    #[serde(default)]
    pub concurrency: Option<usize>,
    /// Subscribe to each pod of the pool; false: centralized mode, the pods connect to
    /// `zmqEndpoint` (default `tcp://*:5557`), which this replica binds.
    #[serde(default = "d_true")]
    pub discover_pods: bool,
    #[serde(default)]
    pub pod_discovery_config: PodDiscoveryConfig,
    /// `vllm` or `sglang`: both publish the same frames; the decoder takes either.
    #[serde(default)]
    pub engine_type: Option<String>,
}

fn d_topic() -> String {
    "kv@".into()
}

impl KvEventsParams {
    /// Where the pods publish in centralized mode (`discoverPods: false`), else `None`.
    pub fn central_endpoint(&self) -> Option<&str> {
        (!self.discover_pods).then(|| self.zmq_endpoint.as_deref().unwrap_or("tcp://*:5557"))
    }
}

fn d_true() -> bool {
    true
}

impl Default for KvEventsParams {
    fn default() -> Self {
        KvEventsParams {
            zmq_endpoint: None,
            topic_filter: d_topic(),
            concurrency: None,
            discover_pods: true,
            pod_discovery_config: PodDiscoveryConfig::default(),
            engine_type: None,
        }
    }
}

/// What the subscriber thread is told.
enum Msg {
    /// Follow exactly these streams.
    Targets(Vec<Target>),
    /// Centralized mode in a cluster: the pods other replicas own (see [`central`]).
    Foreign(Vec<String>),
    ForwardTo(tokio::sync::mpsc::Sender<Forwarded>),
}

/// One pod's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The pod as the index and the candidates name it (`ip:port`).
    pub pod: String,
    pub endpoint: String,
    pub replay: Option<String>,
    /// The pod publishes to the socket this replica binds (centralized mode): no socket of its
    /// own; `endpoint` names the bound one.
    pub shared: bool,
}

fn host(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// Where each endpoint publishes: its label, else llm-d's pod discovery, or (centralized mode)
/// the socket this replica binds.
pub fn targets(endpoints: &[Arc<Endpoint>], params: &KvEventsParams) -> Vec<Target> {
    let d = &params.pod_discovery_config;
    let central = params.central_endpoint();
    let mut out: Vec<Target> = endpoints
        .iter()
        .map(|e| {
            let (endpoint, shared) = match (e.labels.get(ENDPOINT_LABEL), central) {
                (Some(label), _) => (label.clone(), false),
                (None, Some(central)) => (central.to_string(), true),
                (None, None) => (
                    format!("tcp://{}:{}", host(e.addr.ip()), d.socket_port),
                    false,
                ),
            };
            let replay = e.labels.get(REPLAY_LABEL).cloned().or_else(|| {
                d.replay_port
                    .map(|p| format!("tcp://{}:{p}", host(e.addr.ip())))
            });
            Target {
                pod: e.hostport.clone(),
                endpoint,
                replay,
                shared,
            }
        })
        .collect();
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
    out
}

/// What `/debug/kv-events` shows of one subscription.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PodStatus {
    pub endpoint: String,
    pub replay: Option<String>,
    pub model: String,
    pub last_seq: Option<u64>,
    pub applied: u64,
    pub replayed: u64,
    pub garbage: u64,
    pub gaps: u64,
    pub resyncs: u64,
    pub restarts: u64,
    pub replaying: bool,
    pub blocks: usize,
    /// Seconds since the last message (None before the first).
    pub idle_s: Option<f64>,
}

/// The running subscriber; dropping it stops the thread.
pub struct Subscriber {
    tx: mpsc::Sender<Msg>,
    /// Centralized mode: the PUSH end of the thread's inbox of forwarded messages.
    inject: Option<Mutex<zmq::Socket>>,
    /// Centralized mode: the address the shared SUB socket is bound to.
    central: Option<String>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    status: Arc<Mutex<BTreeMap<String, PodStatus>>>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber").finish_non_exhaustive()
    }
}

impl Subscriber {
    /// `topic_filter`: the SUB sockets' subscription prefix; `fallback_model`: the model of
    /// pods whose topic names none; `central`: centralized mode's address to bind, where the
    /// pods connect (an error if it cannot be bound).
    pub fn start(
        index: Arc<dyn KvIndex>,
        topic_filter: String,
        fallback_model: Option<String>,
        metrics: Arc<Metrics>,
        central: Option<&str>,
    ) -> std::io::Result<Subscriber> {
        let ctx = zmq::Context::new();
        let (central, inject) = match central {
            Some(addr) => {
                let (c, push) = Central::bind(&ctx, addr, &topic_filter, RCVHWM)?;
                tracing::info!(endpoint = %c.endpoint, "kv events: centralized mode, pods publish here");
                (Some(c), Some(Mutex::new(push)))
            }
            None => (None, None),
        };
        let bound = central.as_ref().map(|c| c.endpoint.clone());
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let status = Arc::new(Mutex::new(BTreeMap::new()));
        let thread = {
            let (stop, status) = (stop.clone(), status.clone());
            std::thread::Builder::new()
                .name("kv-events".into())
                .spawn(move || {
                    Thread {
                        ctx,
                        central,
                        subs: Vec::new(),
                        producer: index,
                        topic_filter,
                        fallback_model,
                        metrics,
                        status,
                        rounds: 0,
                    }
                    .run(&rx, &stop)
                })?
        };
        Ok(Subscriber {
            tx,
            inject,
            central: bound,
            stop,
            thread: Some(thread),
            status,
        })
    }

    /// Centralized mode: where the pods publish (the bound address, ports resolved).
    pub fn central_endpoint(&self) -> Option<&str> {
        self.central.as_deref()
    }

    /// Subscribe to exactly these streams.
    pub fn set_targets(&self, targets: Vec<Target>) {
        let _ = self.tx.send(Msg::Targets(targets));
    }

    /// Every subscription's state, by pod.
    pub fn status(&self) -> BTreeMap<String, PodStatus> {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Follow the pool: every 500 ms, the subscription set from the datastore's endpoints this
/// replica owns (cluster mode: the pod's scrape owners; standalone: every pod), the pods whose
/// messages are forwarded (centralized mode in a cluster: those other replicas own), and pods
/// gone from the pool dropped from the index.
pub async fn follow(
    sub: Arc<Subscriber>,
    producer: Arc<dyn KvIndex>,
    store: Arc<Datastore>,
    params: KvEventsParams,
    stop: CancellationToken,
) {
    let mut last: Option<Vec<Target>> = None;
    let mut last_foreign: Option<Vec<String>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let endpoints = store.endpoints();
        let known = store.by_hostport();
        for pod in producer.pods() {
            if !known.contains_key(&pod) {
                producer.remove(&pod);
            }
        }
        let (now, foreign): (Vec<Target>, Vec<Target>) = targets(&endpoints, &params)
            .into_iter()
            .partition(|t| store.shard.owns(&t.pod));
        // Centralized mode: what reaches this replica for the others' pods goes to them.
        let foreign: Vec<String> = foreign
            .into_iter()
            .filter(|t| t.shared)
            .map(|t| t.pod)
            .collect();
        if last_foreign.as_ref() != Some(&foreign) {
            sub.forward_foreign(foreign.clone());
            last_foreign = Some(foreign);
        }
        if last.as_ref() != Some(&now) {
            sub.set_targets(now.clone());
            last = Some(now);
        }
    }
}

struct Replaying {
    deadline: Instant,
    /// Whether a replayed batch arrived yet.
    got_any: bool,
    /// Live messages held meanwhile: (seq, topic, payload).
    backlog: VecDeque<(u64, Vec<u8>, Vec<u8>)>,
}

struct Sub {
    target: Target,
    /// `None` for a pod publishing to the shared socket.
    sub: Option<zmq::Socket>,
    dealer: Option<zmq::Socket>,
    /// The last sequence number applied.
    last: Option<u64>,
    /// The last sequence number received live (the SUB socket delivers in order: a live number
    /// going back is a restarted publisher; a live number at or below `last` but above this one
    /// was already applied from a replay).
    live_last: Option<u64>,
    /// Whether the index holds anything from this stream (a resync has something to drop).
    has_state: bool,
    /// The last [`RECENT`] batches applied: (sequence, payload digest).
    recent: VecDeque<(u64, u64)>,
    replaying: Option<Replaying>,
    cooldown_until: Option<Instant>,
    status: PodStatus,
    last_message: Option<Instant>,
}

struct Thread {
    ctx: zmq::Context,
    central: Option<Central>,
    subs: Vec<Sub>,
    producer: Arc<dyn KvIndex>,
    topic_filter: String,
    fallback_model: Option<String>,
    metrics: Arc<Metrics>,
    status: Arc<Mutex<BTreeMap<String, PodStatus>>>,
    /// Status publications so far.
    rounds: u64,
}

impl Thread {
    fn run(mut self, rx: &mpsc::Receiver<Msg>, stop: &AtomicBool) {
        let mut published = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let (mut targets, mut foreign) = (None, None);
            while let Ok(m) = rx.try_recv() {
                match m {
                    Msg::Targets(t) => targets = Some(t),
                    Msg::Foreign(p) => foreign = Some(p),
                    Msg::ForwardTo(tx) => {
                        if let Some(c) = &mut self.central {
                            c.forward = Some(tx);
                        }
                    }
                }
            }
            if let (Some(p), Some(c)) = (foreign, &mut self.central) {
                c.foreign = p;
                self.route_topics();
            }
            if let Some(t) = targets {
                self.reconcile(t);
            }
            if self.subs.is_empty() && self.central.is_none() {
                std::thread::sleep(Duration::from_millis(POLL_MS as u64));
            } else {
                self.poll_round();
            }
            self.check_deadlines();
            if published.elapsed() >= Duration::from_millis(250) {
                self.publish_status();
                published = Instant::now();
            }
        }
    }

    fn reconcile(&mut self, targets: Vec<Target>) {
        // Gone, moved to another endpoint, or owned by other replicas now: unsubscribe; what
        // the pod holds stays as a mirror the owners' gossip maintains (a pod gone from the pool
        // is dropped by `follow`).
        self.subs.retain(|s| {
            let keep = targets.contains(&s.target);
            if !keep {
                self.producer.hand_over(&s.target.pod);
                self.metrics.kv_events.forget_pod(&s.target.pod);
                tracing::info!(pod = %s.target.pod, "kv events: unsubscribed");
            }
            keep
        });
        for t in targets {
            if self.subs.iter().any(|s| s.target == t) {
                continue;
            }
            match self.connect(&t) {
                Ok(mut sub) => {
                    // The stream rebuilds the pod from its engine's events: the past from the
                    // replay socket at once (a quiet pod publishes nothing to detect a gap by).
                    self.producer.reset_locally(&t.pod);
                    if let Some(d) = &sub.dealer {
                        let frames: [&[u8]; 2] = [b"", &0u64.to_be_bytes()];
                        if d.send_multipart(frames, zmq::DONTWAIT).is_ok() {
                            sub.replaying = Some(Replaying {
                                deadline: Instant::now() + REPLAY_DEADLINE,
                                got_any: false,
                                backlog: VecDeque::new(),
                            });
                        }
                    }
                    tracing::info!(pod = %t.pod, endpoint = %t.endpoint, replay = ?t.replay, "kv events: subscribed");
                    self.subs.push(sub);
                }
                Err(e) => {
                    tracing::warn!(pod = %t.pod, endpoint = %t.endpoint, error = %e, "kv events: cannot subscribe");
                }
            }
        }
        self.route_topics();
        self.publish_status();
    }

    fn connect(&self, t: &Target) -> Result<Sub, zmq::Error> {
        // A signal (SIGCHLD, ...) can interrupt a zmq call with EINTR: try again.
        loop {
            match self.try_connect(t) {
                Err(zmq::Error::EINTR) => continue,
                other => return other,
            }
        }
    }

    fn try_connect(&self, t: &Target) -> Result<Sub, zmq::Error> {
        let sub = if t.shared {
            if self.central.is_none() {
                // Targets and the subscriber's mode come from the same parameters.
                return Err(zmq::Error::EINVAL);
            }
            None
        } else {
            let sub = self.ctx.socket(zmq::SUB)?;
            sub.set_rcvhwm(RCVHWM)?;
            sub.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
            sub.set_linger(0)?;
            sub.set_subscribe(self.topic_filter.as_bytes())?;
            sub.connect(&t.endpoint)?;
            Some(sub)
        };
        let dealer = match &t.replay {
            Some(r) => {
                let d = self.ctx.socket(zmq::DEALER)?;
                d.set_linger(0)?;
                d.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
                d.set_sndhwm(16)?;
                d.connect(r)?;
                Some(d)
            }
            None => None,
        };
        Ok(Sub {
            status: PodStatus {
                // A shared stream shows the bound address (ports resolved).
                endpoint: match (&self.central, t.shared) {
                    (Some(c), true) => c.endpoint.clone(),
                    _ => t.endpoint.clone(),
                },
                replay: t.replay.clone(),
                ..PodStatus::default()
            },
            target: t.clone(),
            sub,
            dealer,
            last: None,
            live_last: None,
            has_state: false,
            recent: VecDeque::new(),
            replaying: None,
            cooldown_until: None,
            last_message: None,
        })
    }

    fn poll_round(&mut self) {
        // Which sockets are readable: the shared SUB and the inbox of forwarded messages, then
        // each pod's SUB and DEALER.
        let (central, inbox, ready): (bool, bool, Vec<(bool, bool)>) = {
            let mut items = Vec::with_capacity(self.subs.len() * 2 + 2);
            if let Some(c) = &self.central {
                items.push(c.socket.as_poll_item(zmq::POLLIN));
                items.push(c.inbox.as_poll_item(zmq::POLLIN));
            }
            for s in &self.subs {
                if let Some(sub) = &s.sub {
                    items.push(sub.as_poll_item(zmq::POLLIN));
                }
                if let Some(d) = &s.dealer {
                    items.push(d.as_poll_item(zmq::POLLIN));
                }
            }
            if zmq::poll(&mut items, POLL_MS).is_err() {
                return;
            }
            let mut k = 0;
            let mut next = |present: bool| {
                present && {
                    k += 1;
                    items[k - 1].is_readable()
                }
            };
            let central = next(self.central.is_some());
            let inbox = next(self.central.is_some());
            let ready = self
                .subs
                .iter()
                .map(|s| (next(s.sub.is_some()), next(s.dealer.is_some())))
                .collect();
            (central, inbox, ready)
        };
        if central {
            self.drain_central();
        }
        if inbox {
            self.drain_inbox();
        }
        for (i, (live, replay)) in ready.into_iter().enumerate() {
            if replay {
                self.drain_replay(i);
            }
            if live {
                self.drain_live(i);
            }
        }
    }

    fn drain_live(&mut self, i: usize) {
        for _ in 0..BUDGET {
            let Some(sub) = &self.subs[i].sub else { return };
            let Ok(frames) = sub.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            self.subs[i].last_message = Some(Instant::now());
            match kvevents::parse_live(&frames) {
                Ok(m) => {
                    let (seq, topic, payload) = (m.seq, m.topic.to_vec(), m.payload.to_vec());
                    self.receive_live(i, seq, topic, payload);
                }
                Err(e) => self.garbage(i, &e),
            }
        }
    }

    fn drain_replay(&mut self, i: usize) {
        for _ in 0..BUDGET {
            let Some(d) = &self.subs[i].dealer else {
                return;
            };
            let Ok(frames) = d.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            match kvevents::parse_replay(&frames) {
                Ok(Replay::Batch(m)) => {
                    let (seq, topic, payload) = (m.seq, m.topic.to_vec(), m.payload.to_vec());
                    self.on_replayed(i, seq, &topic, &payload);
                }
                Ok(Replay::End) => self.finish_replay(i, false),
                Err(e) => self.garbage(i, &e),
            }
        }
    }

    fn garbage(&mut self, i: usize, e: &kvevents::Error) {
        let s = &mut self.subs[i];
        s.status.garbage += 1;
        self.metrics.kv_events.messages(&s.target.pod, "garbage", 1);
        tracing::debug!(pod = %s.target.pod, error = %e, "kv events: garbage dropped");
    }

    /// A message from the SUB socket.
    fn receive_live(&mut self, i: usize, seq: u64, topic: Vec<u8>, payload: Vec<u8>) {
        let s = &mut self.subs[i];
        let restarted = match s.live_last {
            Some(l) => seq <= l,
            // The stream's first live message at a sequence a replay already applied: the same
            // batch again, or a publisher that restarted meanwhile (its new batch differs).
            None => s
                .recent
                .iter()
                .find(|(q, _)| *q == seq)
                .is_some_and(|(_, d)| *d != xxhash_rust::xxh3::xxh3_64(&payload)),
        };
        s.live_last = Some(seq);
        if restarted {
            // The publisher restarted: its cache is empty, its old batches are gone.
            s.status.restarts += 1;
            self.metrics.kv_events.recovery(&s.target.pod, "restart");
            s.replaying = None;
            self.producer.clear(&s.target.pod);
            s.has_state = false;
            s.last = None;
            s.recent.clear();
        }
        self.on_live(i, seq, topic, payload);
    }

    fn on_live(&mut self, i: usize, seq: u64, topic: Vec<u8>, payload: Vec<u8>) {
        let s = &mut self.subs[i];
        if let Some(r) = &mut s.replaying {
            if r.backlog.len() >= BACKLOG {
                self.metrics
                    .kv_events
                    .messages(&s.target.pod, "overflow", 1);
                // The replay can no longer bring the stream up to date without this message.
                self.finish_replay(i, true);
                return self.on_live(i, seq, topic, payload);
            }
            r.backlog.push_back((seq, topic, payload));
            return;
        }
        match s.last {
            None if seq == 0 => self.apply(i, seq, &topic, &payload, "applied"),
            Some(l) if seq == l.saturating_add(1) => {
                self.apply(i, seq, &topic, &payload, "applied")
            }
            Some(l) if seq <= l => {
                // Already applied from a replay.
                self.metrics
                    .kv_events
                    .messages(&s.target.pod, "duplicate", 1);
            }
            _ => {
                let from = s.last.map_or(0, |l| l.saturating_add(1));
                self.gap(i, from, seq, topic, payload);
            }
        }
    }

    /// Batches `from..seq` are missing; `seq` arrived.
    fn gap(&mut self, i: usize, from: u64, seq: u64, topic: Vec<u8>, payload: Vec<u8>) {
        let s = &mut self.subs[i];
        s.status.gaps += 1;
        self.metrics.kv_events.recovery(&s.target.pod, "gap");
        let cooled = s.cooldown_until.is_none_or(|t| Instant::now() >= t);
        if let Some(d) = s.dealer.as_ref().filter(|_| cooled) {
            let frames: [&[u8]; 2] = [b"", &from.to_be_bytes()];
            if d.send_multipart(frames, zmq::DONTWAIT).is_ok() {
                let mut backlog = VecDeque::new();
                backlog.push_back((seq, topic, payload));
                s.replaying = Some(Replaying {
                    deadline: Instant::now() + REPLAY_DEADLINE,
                    got_any: false,
                    backlog,
                });
                return;
            }
        }
        self.resync(i);
        self.apply(i, seq, &topic, &payload, "applied");
    }

    /// What we hold of this pod may be stale beyond repair: drop it, follow from here.
    fn resync(&mut self, i: usize) {
        let s = &mut self.subs[i];
        if s.has_state {
            s.status.resyncs += 1;
            self.metrics.kv_events.recovery(&s.target.pod, "resync");
            self.producer.clear(&s.target.pod);
            s.has_state = false;
        }
    }

    fn on_replayed(&mut self, i: usize, seq: u64, topic: &[u8], payload: &[u8]) {
        let s = &mut self.subs[i];
        let Some(r) = &mut s.replaying else {
            return; // a late answer to an abandoned replay
        };
        let first = !r.got_any;
        r.got_any = true;
        let expected = s.last.map_or(0, |l| l.saturating_add(1));
        if seq < expected {
            self.metrics
                .kv_events
                .messages(&s.target.pod, "duplicate", 1);
            return;
        }
        if seq > expected {
            // The publisher's ring does not reach back to what we missed.
            if !first {
                tracing::debug!(pod = %s.target.pod, seq, expected, "kv events: hole inside a replay");
            }
            self.resync(i);
        }
        self.apply(i, seq, topic, payload, "replayed");
    }

    /// The replay ended (or was abandoned): apply what was held meanwhile.
    fn finish_replay(&mut self, i: usize, abandoned: bool) {
        let s = &mut self.subs[i];
        let Some(r) = s.replaying.take() else { return };
        if abandoned {
            s.cooldown_until = Some(Instant::now() + REPLAY_COOLDOWN);
        } else if r.got_any {
            self.metrics.kv_events.recovery(&s.target.pod, "replayed");
        }
        let mut backlog = r.backlog;
        // Whatever the replay did not cover is gone: take the held stream from its first message.
        if let Some((first, _, _)) = backlog.front()
            && s.last.is_none_or(|l| *first > l.saturating_add(1))
        {
            let first = *first;
            self.resync(i);
            self.subs[i].last = first.checked_sub(1);
        }
        while let Some((seq, topic, payload)) = backlog.pop_front() {
            let s = &self.subs[i];
            if s.replaying.is_some() {
                // A new gap inside the backlog started another replay: hold the rest again.
                if let Some(r) = &mut self.subs[i].replaying {
                    r.backlog.push_back((seq, topic, payload));
                }
                continue;
            }
            if s.last.is_some_and(|l| seq <= l) {
                self.metrics
                    .kv_events
                    .messages(&s.target.pod, "duplicate", 1);
                continue;
            }
            self.on_live(i, seq, topic, payload);
        }
    }

    fn check_deadlines(&mut self) {
        let now = Instant::now();
        for i in 0..self.subs.len() {
            if self.subs[i]
                .replaying
                .as_ref()
                .is_some_and(|r| now >= r.deadline)
            {
                tracing::debug!(pod = %self.subs[i].target.pod, "kv events: replay timed out");
                self.finish_replay(i, true);
            }
        }
    }

    fn apply(&mut self, i: usize, seq: u64, topic: &[u8], payload: &[u8], outcome: &'static str) {
        let s = &mut self.subs[i];
        s.last = Some(seq);
        if s.recent.len() >= RECENT {
            s.recent.pop_front();
        }
        s.recent
            .push_back((seq, xxhash_rust::xxh3::xxh3_64(payload)));
        let batch = match kvevents::decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                // The sequence number is consumed either way: the batch is lost, like a gap
                // that nothing can fill.
                s.status.garbage += 1;
                self.metrics.kv_events.messages(&s.target.pod, "garbage", 1);
                tracing::debug!(pod = %s.target.pod, error = %e, "kv events: undecodable batch");
                self.resync(i);
                return;
            }
        };
        let model = kvevents::parse_topic(topic)
            .map(|t| t.model)
            .filter(|m| !m.is_empty())
            .or_else(|| (!s.status.model.is_empty()).then_some(s.status.model.as_str()))
            .or(self.fallback_model.as_deref())
            .unwrap_or("")
            .to_string();
        let applied = self.producer.apply(&s.target.pod, &model, &batch.events);
        s.status.model = model;
        s.has_state |= applied.stored > 0;
        if outcome == "replayed" {
            s.status.replayed += 1;
        } else {
            s.status.applied += 1;
        }
        self.metrics.kv_events.messages(&s.target.pod, outcome, 1);
        self.metrics.kv_events.blocks(&s.target.pod, &applied);
    }

    fn publish_status(&mut self) {
        let now = Instant::now();
        self.rounds += 1;
        let mut out = BTreeMap::new();
        for s in &mut self.subs {
            s.status.last_seq = s.last;
            s.status.replaying = s.replaying.is_some();
            s.status.blocks = self.producer.pod_blocks(&s.target.pod);
            s.status.idle_s = s.last_message.map(|t| (now - t).as_secs_f64());
            out.insert(s.target.pod.clone(), s.status.clone());
        }
        // Sizing walks the whole index: every 20th status (5 s).
        if self.rounds % 20 == 1 {
            let (entries, bytes) = self.producer.size();
            self.metrics
                .kv_events
                .set_index(self.subs.len(), entries, bytes);
        }
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = out;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_by_label_pod_discovery_or_the_shared_socket() {
        let ep = |addr: &str, label: Option<&str>| {
            let labels = label
                .map(|l| BTreeMap::from([(ENDPOINT_LABEL.to_string(), l.to_string())]))
                .unwrap_or_default();
            Arc::new(Endpoint::new(addr.into(), addr.parse().unwrap(), labels))
        };
        let pool = [
            ep("10.0.0.2:8000", None),
            ep("10.0.0.1:8000", Some("tcp://10.0.0.1:7777")),
        ];
        let discovery = KvEventsParams {
            pod_discovery_config: PodDiscoveryConfig {
                socket_port: 5557,
                replay_port: Some(5558),
            },
            ..KvEventsParams::default()
        };
        let t = targets(&pool, &discovery);
        assert_eq!(
            t.iter()
                .map(|t| (t.pod.as_str(), t.endpoint.as_str(), t.shared))
                .collect::<Vec<_>>(),
            [
                ("10.0.0.1:8000", "tcp://10.0.0.1:7777", false),
                ("10.0.0.2:8000", "tcp://10.0.0.2:5557", false),
            ]
        );
        assert_eq!(t[1].replay.as_deref(), Some("tcp://10.0.0.2:5558"));
        // Centralized: the unlabelled pod publishes to the bound socket; the label still wins.
        let central = KvEventsParams {
            discover_pods: false,
            zmq_endpoint: Some("tcp://*:6000".into()),
            ..discovery
        };
        let t = targets(&pool, &central);
        assert_eq!(
            t.iter()
                .map(|t| (t.endpoint.as_str(), t.shared))
                .collect::<Vec<_>>(),
            [("tcp://10.0.0.1:7777", false), ("tcp://*:6000", true)]
        );
        assert_eq!(t[1].replay.as_deref(), Some("tcp://10.0.0.2:5558"));
    }
}
