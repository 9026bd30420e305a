//! Centralized mode (`discoverPods: false`): the pods connect to one SUB socket this replica
//! binds, each pod's stream told apart by its topic.
//!
//! In a cluster a pod's publisher connects to whichever replica its connection lands on (a
//! Service picks one), while the pod's stream is followed by its scrape owners, as with pod
//! discovery. So a replica passes what it receives for a pod to the pod's owners other than
//! itself ([`Forwarded`], sent over the peer port by `cluster::gossip::precise`); an owner takes
//! those messages as if from its own socket (an `inproc` PULL socket polled with the
//! others, fed by [`Subscriber::inject`]), with the same sequence tracking: a message lost on the
//! way is a gap, filled from the pod's replay socket.

use std::collections::BTreeMap;
use std::time::Instant;

use index::kvevents;

use super::{BUDGET, Subscriber, Thread};

/// A message of a pod's stream that reached this replica's shared socket, for the pod's owners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forwarded {
    pub pod: String,
    pub seq: u64,
    pub topic: Vec<u8>,
    pub payload: Vec<u8>,
}

/// Where a topic's messages go.
#[derive(Debug, Clone)]
pub(super) enum Route {
    /// A stream this replica follows (index into the subscriptions).
    Own(usize),
    /// A pod of the pool other replicas own: forwarded to them.
    Foreign(String),
}

/// The in-process address forwarded messages arrive on.
const INBOX: &str = "inproc://kv-events-forwarded";

/// Centralized mode's shared socket.
pub(super) struct Central {
    pub(super) socket: zmq::Socket,
    pub(super) endpoint: String,
    /// By the pod's address, and by its IP when one pod of the pool has it (a topic naming the
    /// IP alone): where its messages go.
    pub(super) routes: BTreeMap<String, Route>,
    /// Messages other replicas forwarded to this one (pods it owns).
    pub(super) inbox: zmq::Socket,
    /// Pods of the pool publishing to the shared sockets that other replicas own.
    pub(super) foreign: Vec<String>,
    /// Where their messages go (cluster mode); `None` counts them as `unknown`.
    pub(super) forward: Option<tokio::sync::mpsc::Sender<Forwarded>>,
}

impl Central {
    /// Binds the shared socket on `addr` and the inbox; returns the PUSH end of the inbox.
    pub(super) fn bind(
        ctx: &zmq::Context,
        addr: &str,
        topic_filter: &str,
        hwm: i32,
    ) -> std::io::Result<(Central, zmq::Socket)> {
        let zerr = |what: &str, e: zmq::Error| {
            std::io::Error::other(format!("kv events: {what} {addr}: {e}"))
        };
        let socket = ctx.socket(zmq::SUB).map_err(|e| zerr("socket for", e))?;
        socket
            .set_rcvhwm(hwm)
            .and_then(|()| socket.set_maxmsgsize(super::MAX_MESSAGE_BYTES))
            .and_then(|()| socket.set_linger(0))
            .and_then(|()| socket.set_subscribe(topic_filter.as_bytes()))
            .map_err(|e| zerr("configuring", e))?;
        socket.bind(addr).map_err(|e| zerr("binding", e))?;
        let endpoint = socket
            .get_last_endpoint()
            .ok()
            .and_then(Result::ok)
            .unwrap_or_else(|| addr.to_string());
        let inbox = ctx.socket(zmq::PULL).map_err(|e| zerr("inbox for", e))?;
        let push = ctx.socket(zmq::PUSH).map_err(|e| zerr("inbox for", e))?;
        inbox
            .set_rcvhwm(hwm)
            .and_then(|()| inbox.set_linger(0))
            .and_then(|()| inbox.bind(INBOX))
            .and_then(|()| push.set_sndhwm(hwm))
            .and_then(|()| push.set_linger(0))
            .and_then(|()| push.connect(INBOX))
            .map_err(|e| zerr("inbox for", e))?;
        let central = Central {
            socket,
            endpoint,
            routes: BTreeMap::new(),
            inbox,
            foreign: Vec::new(),
            forward: None,
        };
        Ok((central, push))
    }
}

impl Subscriber {
    /// Centralized mode in a cluster: a message another replica received for a pod this one
    /// follows. False when it cannot be queued (not centralized, or the inbox is full: the
    /// stream's next message shows the gap, which the pod's replay fills).
    pub fn inject(&self, m: &Forwarded) -> bool {
        let Some(push) = &self.inject else {
            return false;
        };
        let push = push.lock().unwrap_or_else(|p| p.into_inner());
        let frames: [&[u8]; 4] = [m.pod.as_bytes(), &m.topic, &m.seq.to_be_bytes(), &m.payload];
        push.send_multipart(frames, zmq::DONTWAIT).is_ok()
    }

    /// Centralized mode in a cluster: the pods of the pool other replicas own, whose messages
    /// reaching this replica go to `forward`.
    pub fn forward_foreign(&self, pods: Vec<String>) {
        let _ = self.tx.send(super::Msg::Foreign(pods));
    }

    /// Where messages for pods other replicas own go (cluster mode).
    pub fn forward_to(&self, tx: tokio::sync::mpsc::Sender<Forwarded>) {
        let _ = self.tx.send(super::Msg::ForwardTo(tx));
    }
}

impl Thread {
    /// The topics' routes from the subscriptions and the foreign pods.
    pub(super) fn route_topics(&mut self) {
        let Some(c) = &mut self.central else { return };
        c.routes.clear();
        let own = self
            .subs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.target.shared)
            .map(|(i, s)| (s.target.pod.clone(), Route::Own(i)));
        let foreign = c
            .foreign
            .iter()
            .map(|p| (p.clone(), Route::Foreign(p.clone())));
        let mut ips: BTreeMap<String, Option<Route>> = BTreeMap::new();
        for (pod, route) in own.chain(foreign) {
            if let Some((ip, _)) = pod.rsplit_once(':') {
                let ip = ip.trim_start_matches('[').trim_end_matches(']').to_string();
                ips.entry(ip)
                    .and_modify(|e| *e = None)
                    .or_insert(Some(route.clone()));
            }
            c.routes.insert(pod, route);
        }
        for (ip, route) in ips {
            if let Some(route) = route {
                c.routes.entry(ip).or_insert(route);
            }
        }
    }

    /// The shared socket's messages, each to its pod's stream here and (in a cluster) to the
    /// pod's other owners. One budget per pod routed a round; the socket delivers in arrival order, so a flooding pod delays the
    /// others by at most its share of the high-water mark.
    pub(super) fn drain_central(&mut self) {
        let Some(c) = &self.central else { return };
        let budget = BUDGET * c.routes.len().max(1);
        for _ in 0..budget {
            let Some(c) = &self.central else { return };
            let Ok(frames) = c.socket.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            let m = match kvevents::parse_live(&frames) {
                Ok(m) => m,
                Err(e) => {
                    // No pod to charge it to.
                    self.metrics.kv_events.messages("", "garbage", 1);
                    tracing::debug!(error = %e, "kv events: garbage on the shared socket");
                    continue;
                }
            };
            let route = kvevents::parse_topic(m.topic).and_then(|t| c.routes.get(t.pod));
            let (own, pod) = match route {
                Some(Route::Own(i)) => (Some(*i), &self.subs[*i].target.pod),
                Some(Route::Foreign(pod)) => (None, pod),
                None => {
                    // A pod outside the pool: its label stays fixed, a topic is whatever the
                    // publisher sends.
                    self.metrics.kv_events.messages("", "unknown", 1);
                    tracing::debug!(topic = %String::from_utf8_lossy(m.topic), "kv events: a pod outside the pool");
                    continue;
                }
            };
            // In a cluster the pod's other owners get it from here (its publisher reached only
            // this replica). A full queue loses the message: they see a gap and replay it.
            if let Some(tx) = &c.forward {
                let f = Forwarded {
                    pod: pod.clone(),
                    seq: m.seq,
                    topic: m.topic.to_vec(),
                    payload: m.payload.to_vec(),
                };
                let outcome = if tx.try_send(f).is_ok() {
                    "forwarded"
                } else {
                    "overflow"
                };
                self.metrics.kv_events.messages(pod, outcome, 1);
            } else if own.is_none() {
                self.metrics.kv_events.messages("", "unknown", 1);
            }
            if let Some(i) = own {
                self.subs[i].last_message = Some(Instant::now());
                let (seq, topic, payload) = (m.seq, m.topic.to_vec(), m.payload.to_vec());
                self.receive_live(i, seq, topic, payload);
            }
        }
    }

    /// Messages other replicas forwarded, each to its pod's stream (a pod no longer followed
    /// here — ownership moved meanwhile — is counted `unknown`).
    pub(super) fn drain_inbox(&mut self) {
        let Some(c) = &self.central else { return };
        let budget = BUDGET * c.routes.len().max(1);
        for _ in 0..budget {
            let Some(c) = &self.central else { return };
            let Ok(frames) = c.inbox.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            let [pod, topic, seq, payload]: [Vec<u8>; 4] = match frames.try_into() {
                Ok(f) => f,
                Err(_) => continue, // written by `inject` only
            };
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
                continue;
            };
            let pod = String::from_utf8_lossy(&pod).into_owned();
            match c.routes.get(&pod) {
                Some(Route::Own(i)) => {
                    let i = *i;
                    self.subs[i].last_message = Some(Instant::now());
                    self.receive_live(i, seq, topic, payload);
                }
                _ => self.metrics.kv_events.messages("", "unknown", 1),
            }
        }
    }
}
