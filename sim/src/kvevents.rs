//! vLLM KV-cache events over ZMQ.
//!
//! Each pod owns a PUB socket (live stream) and a ROUTER socket (replay). Every engine step that
//! changed the prefix cache produces one batch; the batch goes out as three frames
//! `[topic, seq (u64 big-endian), msgpack [ts, events, dp_rank]]` and is kept in a ring for replay.
//! A replay request `[identity, "", start_seq (8 bytes BE)]` is answered with one message
//! `["", topic, seq, payload]` per retained batch with `seq >= start`, then the end marker
//! `["", "", ff×8, ""]` (the DEALER sees the frames after the empty delimiter).
//!
//! ZMQ sockets are not thread-safe, so one thread owns every socket of the fleet: the engine sends
//! [`Command`]s over a channel, the thread publishes them and services replay requests in between.
//!
//! Events come in vLLM's two encodings ([`Encoding`]): the map form of current vLLM (tag under the
//! key `"type"`, fields by name, nil-default fields omitted) and the legacy array form (tag first,
//! then fields in declaration order). Block hashes are integers (vLLM's default
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};

/// Medium of the simulated KV pool.
pub const MEDIUM_GPU: &str = "GPU";
/// The medium of vLLM's CPU offloading tier.
pub const MEDIUM_CPU: &str = "CPU";

/// Seq value of the replay end marker (-1 as i64).
pub const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// How events are encoded inside a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// Current vLLM (v0.26+): each event a msgpack map with a `"type"` tag.
    #[default]
    Map,
    /// Older vLLM and SGLang: each event an array whose first element is the tag.
    Array,
}

/// KV-event publishing of a [`crate::Sim`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    pub encoding: Encoding,
    /// Batches each pod keeps for replay (vLLM `buffer_steps`).
    pub buffer_steps: usize,
    /// PUB send high-water mark.
    pub hwm: i32,
    /// Publish by connecting to this endpoint, as vLLM does with an `endpoint` without a
    /// wildcard (llm-d's centralized mode: the router binds, every pod connects), instead of
    /// binding a PUB socket per pod. The replay ROUTER is bound either way. A comma-separated
    /// list spreads the pods over several (pod `i` connects to entry `i mod n`), as a Service in
    /// front of several router replicas would.
    pub connect: Option<String>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            encoding: Encoding::Map,
            buffer_steps: 10_000,
            hwm: 100_000,
            connect: None,
        }
    }
}

/// One KV-cache event, as vLLM defines it.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<u64>,
        lora_name: Option<String>,
        /// The request's `cache_salt`, on a run that starts at the prompt's first block (vLLM puts
        /// it in that block's `extra_keys`, after the adapter's name).
        cache_salt: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
    },
    /// Blocks copied to the CPU offload tier: a `BlockStored` with medium "CPU" naming the
    /// blocks by hash only (no tokens, no parent), as offloading connectors publish them.
    Offloaded {
        block_hashes: Vec<u64>,
        block_size: usize,
    },
    /// Blocks dropped from the CPU offload tier (`BlockRemoved` with medium "CPU").
    OffloadRemoved {
        block_hashes: Vec<u64>,
    },
    AllBlocksCleared,
}

struct Wire<'a>(&'a KvEvent, Encoding);

/// vLLM's `extra_keys` of a salted run: per block `nil` or a tuple — the first block's holds the
/// adapter's name (if any) then the salt, the others the adapter's name. `None` (nil) unsalted.
fn extra_keys<'a>(
    blocks: usize,
    lora_name: &'a Option<String>,
    cache_salt: &'a Option<String>,
) -> Option<Vec<Option<Vec<&'a str>>>> {
    let salt = cache_salt.as_deref()?;
    let lora = lora_name.as_deref();
    Some(
        (0..blocks)
            .map(|i| match (i, lora) {
                (0, l) => Some(l.into_iter().chain([salt]).collect()),
                (_, Some(l)) => Some(vec![l]),
                (_, None) => None,
            })
            .collect(),
    )
}

impl Serialize for Wire<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match (self.0, self.1) {
            (
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    lora_name,
                    cache_salt,
                },
                Encoding::Map,
            ) => {
                let extra = extra_keys(block_hashes.len(), lora_name, cache_salt);
                let mut m = s.serialize_map(Some(9 + usize::from(extra.is_some())))?;
                m.serialize_entry("type", "BlockStored")?;
                m.serialize_entry("block_hashes", block_hashes)?;
                m.serialize_entry("parent_block_hash", parent_block_hash)?;
                m.serialize_entry("token_ids", token_ids)?;
                m.serialize_entry("block_size", block_size)?;
                m.serialize_entry("lora_id", lora_id)?;
                m.serialize_entry("medium", MEDIUM_GPU)?;
                m.serialize_entry("lora_name", lora_name)?;
                // Omitted when it is its default (nil), as msgspec does.
                if let Some(extra) = &extra {
                    m.serialize_entry("extra_keys", extra)?;
                }
                m.serialize_entry("group_idx", &0u32)?;
                m.end()
            }
            (
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    lora_name,
                    cache_salt,
                },
                Encoding::Array,
            ) => {
                let mut a = s.serialize_seq(Some(10))?;
                a.serialize_element("BlockStored")?;
                a.serialize_element(block_hashes)?;
                a.serialize_element(parent_block_hash)?;
                a.serialize_element(token_ids)?;
                a.serialize_element(block_size)?;
                a.serialize_element(lora_id)?;
                a.serialize_element(MEDIUM_GPU)?;
                a.serialize_element(lora_name)?;
                a.serialize_element(&extra_keys(block_hashes.len(), lora_name, cache_salt))?;
                a.serialize_element(&0u32)?; // group_idx
                a.end()
            }
            (
                KvEvent::Offloaded {
                    block_hashes,
                    block_size,
                },
                Encoding::Map,
            ) => {
                let mut m = s.serialize_map(Some(9))?;
                m.serialize_entry("type", "BlockStored")?;
                m.serialize_entry("block_hashes", block_hashes)?;
                m.serialize_entry("parent_block_hash", &None::<u64>)?;
                m.serialize_entry("token_ids", &[0u32; 0])?;
                m.serialize_entry("block_size", block_size)?;
                m.serialize_entry("lora_id", &None::<u64>)?;
                m.serialize_entry("medium", MEDIUM_CPU)?;
                m.serialize_entry("lora_name", &None::<String>)?;
                m.serialize_entry("group_idx", &0u32)?;
                m.end()
            }
            (
                KvEvent::Offloaded {
                    block_hashes,
                    block_size,
                },
                Encoding::Array,
            ) => {
                let mut a = s.serialize_seq(Some(10))?;
                a.serialize_element("BlockStored")?;
                a.serialize_element(block_hashes)?;
                a.serialize_element(&None::<u64>)?;
                a.serialize_element(&[0u32; 0])?;
                a.serialize_element(block_size)?;
                a.serialize_element(&None::<u64>)?;
                a.serialize_element(MEDIUM_CPU)?;
                a.serialize_element(&None::<String>)?;
                a.serialize_element(&None::<Vec<u8>>)?; // extra_keys
                a.serialize_element(&0u32)?; // group_idx
                a.end()
            }
            (KvEvent::BlockRemoved { block_hashes }, enc) => {
                removed(s, enc, block_hashes, MEDIUM_GPU)
            }
            (KvEvent::OffloadRemoved { block_hashes }, enc) => {
                removed(s, enc, block_hashes, MEDIUM_CPU)
            }
            (KvEvent::AllBlocksCleared, Encoding::Map) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("type", "AllBlocksCleared")?;
                m.end()
            }
            (KvEvent::AllBlocksCleared, Encoding::Array) => {
                let mut a = s.serialize_seq(Some(1))?;
                a.serialize_element("AllBlocksCleared")?;
                a.end()
            }
        }
    }
}

fn removed<S: Serializer>(
    s: S,
    enc: Encoding,
    block_hashes: &[u64],
    medium: &str,
) -> Result<S::Ok, S::Error> {
    match enc {
        Encoding::Map => {
            let mut m = s.serialize_map(Some(4))?;
            m.serialize_entry("type", "BlockRemoved")?;
            m.serialize_entry("block_hashes", block_hashes)?;
            m.serialize_entry("medium", medium)?;
            m.serialize_entry("group_idx", &0u32)?;
            m.end()
        }
        Encoding::Array => {
            let mut a = s.serialize_seq(Some(4))?;
            a.serialize_element("BlockRemoved")?;
            a.serialize_element(block_hashes)?;
            a.serialize_element(medium)?;
            a.serialize_element(&0u32)?;
            a.end()
        }
    }
}

struct Batch<'a> {
    ts: f64,
    events: &'a [KvEvent],
    encoding: Encoding,
    dp_rank: u32,
}

impl Serialize for Batch<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut env = s.serialize_seq(Some(3))?;
        env.serialize_element(&self.ts)?;
        let events: Vec<Wire<'_>> = self.events.iter().map(|e| Wire(e, self.encoding)).collect();
        env.serialize_element(&events)?;
        env.serialize_element(&self.dp_rank)?;
        env.end()
    }
}

/// The msgpack payload of one batch: `[ts: float64, events, dp_rank]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], encoding: Encoding) -> Vec<u8> {
    let batch = Batch {
        ts,
        events,
        encoding,
        dp_rank: 0,
    };
    // Serializing plain sequences, maps, numbers and strings into a Vec cannot fail.
    rmp_serde::to_vec(&batch).unwrap_or_default()
}

/// The topic llm-d expects: `kv@<ip>:<port>@<model>`.
pub fn topic(addr: std::net::SocketAddr, model: &str) -> String {
    format!("kv@{}:{}@{model}", addr.ip(), addr.port())
}

/// Where a pod publishes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KvEndpoints {
    /// PUB socket, e.g. `tcp://127.0.0.1:41234`.
    pub publisher: String,
    /// ROUTER socket serving replay.
    pub replay: String,
    pub topic: String,
    /// The PUB socket connects to `publisher` (a centralized subscriber) rather than binding it.
    pub connects: bool,
}

/// Messages from the engine to the publisher thread.
#[derive(Debug)]
pub enum Command {
    /// One engine step's events of pod `pod`.
    Publish { pod: usize, events: Vec<KvEvent> },
    /// The pod restarted: sequence back to 0, replay ring emptied.
    Reset { pod: usize },
}

/// Errors setting up the sockets.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    #[error("zmq {what}: {source}")]
    Zmq {
        what: &'static str,
        #[source]
        source: zmq::Error,
    },
    #[error("cannot start the publisher thread: {0}")]
    Thread(#[from] std::io::Error),
}

fn zerr(what: &'static str) -> impl FnOnce(zmq::Error) -> KvEventsError {
    move |source| KvEventsError::Zmq { what, source }
}

struct PodSockets {
    publisher: zmq::Socket,
    replay: zmq::Socket,
    topic: Vec<u8>,
    seq: u64,
    ring: VecDeque<(u64, Vec<u8>)>,
}

/// The running publisher of a fleet; dropping it stops the thread.
#[derive(Debug)]
pub struct Publisher {
    tx: Option<mpsc::Sender<Command>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub endpoints: Vec<KvEndpoints>,
}

/// Binds `socket`, retrying when a signal interrupts the call (a child process exiting sends
/// SIGCHLD; zmq reports EINTR rather than restarting).
fn bind(socket: &zmq::Socket, endpoint: &str, what: &'static str) -> Result<(), KvEventsError> {
    loop {
        match socket.bind(endpoint) {
            Err(zmq::Error::EINTR) => continue,
            other => return other.map_err(zerr(what)),
        }
    }
}

fn bound_endpoint(socket: &zmq::Socket) -> Result<String, KvEventsError> {
    match socket.get_last_endpoint().map_err(zerr("last endpoint"))? {
        Ok(s) => Ok(s),
        Err(raw) => Ok(String::from_utf8_lossy(&raw).into_owned()),
    }
}

impl Publisher {
    /// Binds a PUB (or connects it to [`KvEventsConfig::connect`]) and a ROUTER socket on `host`
    /// (OS-chosen ports) for each topic and starts the thread that owns them.
    pub fn start(
        cfg: &KvEventsConfig,
        host: std::net::IpAddr,
        topics: Vec<String>,
    ) -> Result<Publisher, KvEventsError> {
        let ctx = zmq::Context::new();
        let mut pods = Vec::with_capacity(topics.len());
        let mut endpoints = Vec::with_capacity(topics.len());
        let host = match host {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let connect: Vec<&str> = cfg
            .connect
            .as_deref()
            .map(|c| {
                c.split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        for (i, topic) in topics.into_iter().enumerate() {
            let publisher = ctx.socket(zmq::PUB).map_err(zerr("PUB socket"))?;
            publisher.set_sndhwm(cfg.hwm).map_err(zerr("set hwm"))?;
            publisher.set_linger(0).map_err(zerr("set linger"))?;
            let to = (!connect.is_empty()).then(|| connect[i % connect.len()]);
            match to {
                Some(to) => publisher.connect(to).map_err(zerr("connect PUB"))?,
                None => bind(&publisher, &format!("tcp://{host}:*"), "bind PUB")?,
            }
            let replay = ctx.socket(zmq::ROUTER).map_err(zerr("ROUTER socket"))?;
            replay.set_linger(0).map_err(zerr("set linger"))?;
            bind(&replay, &format!("tcp://{host}:*"), "bind ROUTER")?;
            endpoints.push(KvEndpoints {
                publisher: match to {
                    Some(to) => to.to_string(),
                    None => bound_endpoint(&publisher)?,
                },
                replay: bound_endpoint(&replay)?,
                topic: topic.clone(),
                connects: to.is_some(),
            });
            pods.push(PodSockets {
                publisher,
                replay,
                topic: topic.into_bytes(),
                seq: 0,
                ring: VecDeque::new(),
            });
        }
        let (tx, rx) = mpsc::channel();
        let encoding = cfg.encoding;
        let ring_len = cfg.buffer_steps;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || run(ctx, pods, rx, encoding, ring_len, &stopped))?;
        Ok(Publisher {
            tx: Some(tx),
            stop,
            thread: Some(thread),
            endpoints,
        })
    }

    /// A sender for the engine.
    pub fn sender(&self) -> Option<mpsc::Sender<Command>> {
        self.tx.clone()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // The thread checks the flag at least every POLL, so the join is short.
        self.stop.store(true, Ordering::Relaxed);
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

const POLL: Duration = Duration::from_millis(2);

fn run(
    _ctx: zmq::Context,
    mut pods: Vec<PodSockets>,
    rx: mpsc::Receiver<Command>,
    encoding: Encoding,
    ring_len: usize,
    stop: &AtomicBool,
) {
    let drain = |pods: &mut Vec<PodSockets>| -> bool {
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(pods, cmd, encoding, ring_len),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
    };
    while !stop.load(Ordering::Relaxed) {
        // Publish everything queued, then serve replay requests; block on the channel only briefly
        // so replay stays responsive.
        match rx.recv_timeout(POLL) {
            Ok(cmd) => handle(&mut pods, cmd, encoding, ring_len),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        if !drain(&mut pods) {
            return;
        }
        let requests = replay_requests(&pods);
        if requests.is_empty() {
            continue;
        }
        // A command queued before a request was received applies before the answer: a replay
        // asked once `restart` returned never sees the ring of the pod's previous life.
        if !drain(&mut pods) {
            return;
        }
        for (pod, identity, start) in requests {
            answer_replay(&pods[pod], &identity, start);
        }
    }
}

fn handle(pods: &mut [PodSockets], cmd: Command, encoding: Encoding, ring_len: usize) {
    match cmd {
        Command::Publish { pod, events } => {
            let Some(p) = pods.get_mut(pod) else { return };
            let payload = encode_batch(now_ts(), &events, encoding);
            let seq = p.seq;
            p.seq += 1;
            let frames: [&[u8]; 3] = [&p.topic, &seq.to_be_bytes(), &payload];
            if let Err(error) = p.publisher.send_multipart(frames, zmq::DONTWAIT) {
                tracing::debug!(%error, pod, "kv event batch dropped");
            }
            if ring_len > 0 {
                if p.ring.len() >= ring_len {
                    p.ring.pop_front();
                }
                p.ring.push_back((seq, payload));
            }
        }
        Command::Reset { pod } => {
            if let Some(p) = pods.get_mut(pod) {
                p.seq = 0;
                p.ring.clear();
            }
        }
    }
}

/// Every pending replay request, without blocking: (pod, requester identity, start seq).
fn replay_requests(pods: &[PodSockets]) -> Vec<(usize, Vec<u8>, u64)> {
    let mut out = Vec::new();
    for (i, p) in pods.iter().enumerate() {
        // Each ROUTER is drained without blocking; replay is rare, so polling all of them every
        // couple of ms costs one non-blocking recv each.
        while let Ok(mut frames) = p.replay.recv_multipart(zmq::DONTWAIT) {
            let [_, empty, start] = frames.as_slice() else {
                tracing::debug!(frames = frames.len(), "malformed replay request ignored");
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                tracing::debug!("replay start seq is not 8 bytes");
                continue;
            };
            if !empty.is_empty() {
                tracing::debug!("replay request without the empty delimiter ignored");
                continue;
            }
            out.push((i, frames.swap_remove(0), u64::from_be_bytes(start)));
        }
    }
    out
}

fn answer_replay(p: &PodSockets, identity: &[u8], start: u64) {
    for (seq, payload) in p.ring.iter().filter(|(s, _)| *s >= start) {
        let frames: [&[u8]; 5] = [identity, b"", &p.topic, &seq.to_be_bytes(), payload];
        if p.replay.send_multipart(frames, 0).is_err() {
            break;
        }
    }
    let end: [&[u8]; 5] = [identity, b"", b"", &END_OF_REPLAY, b""];
    let _ = p.replay.send_multipart(end, 0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn decode(bytes: &[u8]) -> Value {
        rmp_serde::from_slice(bytes).unwrap()
    }

    #[test]
    fn map_encoding_tags_first_and_names_fields() {
        let ev = [
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![5, 6],
                block_size: 2,
                lora_id: None,
                lora_name: None,
                cache_salt: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![7],
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &ev, Encoding::Map);
        // fixarray(3), float64 1.5
        assert_eq!(&bytes[..2], &[0x93, 0xcb]);
        let v = decode(&bytes);
        assert_eq!(v[0], json!(1.5));
        assert_eq!(v[2], json!(0));
        assert_eq!(
            v[1][0],
            json!({"type": "BlockStored", "block_hashes": [1, u64::MAX], "parent_block_hash": null,
                   "token_ids": [5, 6], "block_size": 2, "lora_id": null, "medium": "GPU",
                   "lora_name": null, "group_idx": 0})
        );
        assert_eq!(
            v[1][1],
            json!({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0})
        );
        assert_eq!(v[1][2], json!({"type": "AllBlocksCleared"}));
        // The tag is the first key of the map: fixmap header, then fixstr "type".
        let pos = bytes.windows(5).position(|w| w == b"\xa4type").unwrap();
        assert_eq!(bytes[pos - 1] & 0xf0, 0x80);
        // u64::MAX is a uint64.
        assert!(
            bytes
                .windows(9)
                .any(|w| w == [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])
        );
    }

    #[test]
    fn a_salted_run_carries_the_salt_in_its_first_blocks_extra_keys() {
        let stored = |lora: Option<&str>| KvEvent::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: vec![5, 6],
            block_size: 1,
            lora_id: lora.map(|_| 1),
            lora_name: lora.map(str::to_owned),
            cache_salt: Some("t1".into()),
        };
        let v = decode(&encode_batch(0.0, &[stored(None)], Encoding::Map));
        assert_eq!(v[1][0]["extra_keys"], json!([["t1"], null]));
        let v = decode(&encode_batch(0.0, &[stored(Some("ad"))], Encoding::Array));
        assert_eq!(v[1][0][8], json!([["ad", "t1"], ["ad"]]));
    }

    #[test]
    fn array_encoding_is_positional() {
        let ev = [
            KvEvent::BlockStored {
                block_hashes: vec![9],
                parent_block_hash: Some(3),
                token_ids: vec![1],
                block_size: 1,
                lora_id: Some(4),
                lora_name: Some("ad".into()),
                cache_salt: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![9],
            },
            KvEvent::AllBlocksCleared,
        ];
        let v = decode(&encode_batch(2.0, &ev, Encoding::Array));
        assert_eq!(
            v[1][0],
            json!(["BlockStored", [9], 3, [1], 1, 4, "GPU", "ad", null, 0])
        );
        assert_eq!(v[1][1], json!(["BlockRemoved", [9], "GPU", 0]));
        assert_eq!(v[1][2], json!(["AllBlocksCleared"]));
    }

    /// The CPU tier's events: hash-only stores, removals, in both encodings.
    #[test]
    fn offload_events_are_hash_only_cpu_stores_and_removals() {
        let ev = [
            KvEvent::Offloaded {
                block_hashes: vec![9, 10],
                block_size: 16,
            },
            KvEvent::OffloadRemoved {
                block_hashes: vec![9],
            },
        ];
        let v = decode(&encode_batch(0.0, &ev, Encoding::Map));
        assert_eq!(
            v[1][0],
            json!({"type": "BlockStored", "block_hashes": [9, 10], "parent_block_hash": null,
                   "token_ids": [], "block_size": 16, "lora_id": null, "medium": "CPU",
                   "lora_name": null, "group_idx": 0})
        );
        assert_eq!(
            v[1][1],
            json!({"type": "BlockRemoved", "block_hashes": [9], "medium": "CPU", "group_idx": 0})
        );
        let v = decode(&encode_batch(0.0, &ev, Encoding::Array));
        assert_eq!(
            v[1][0],
            json!([
                "BlockStored",
                [9, 10],
                null,
                [],
                16,
                null,
                "CPU",
                null,
                null,
                0
            ])
        );
        assert_eq!(v[1][1], json!(["BlockRemoved", [9], "CPU", 0]));
    }
}
