//! Outgoing peer RPCs.

// openraft's trait-mandated `RPCError` is large; helpers return it as-is.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use openraft::BasicNode;
use openraft::LogId;
use openraft::RPCTypes;
use openraft::RaftNetwork;
use openraft::RaftNetworkFactory;
use openraft::error::InstallSnapshotError;
use openraft::error::NetworkError;
use openraft::error::RPCError;
use openraft::error::RaftError;
use openraft::error::RemoteError as RaftRemoteError;
use openraft::error::Unreachable;
use openraft::network::Backoff;
use openraft::network::RPCOption;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::InstallSnapshotRequest;
use openraft::raft::InstallSnapshotResponse;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use tonic::Code;
use tonic::transport::Channel;
use tonic::transport::Endpoint;

use super::proto::Frame;
use super::proto::SnapshotChunk;
use super::proto::raft_peer_client::RaftPeerClient;
use super::tls::PeerTls;
use super::transport::DialService;
use super::transport::Dialer;
use crate::codec;
use crate::error::ConsensusError;
use crate::state_machine::StateMachine;
use crate::types::NodeId;
use crate::types::TypeConfig;

/// Backoff openraft applies between attempts to a peer that was unreachable: 50 ms doubling to
/// 1 s, forever (a peer may come back at any time).
pub fn reconnect_backoff() -> Backoff {
    Backoff::new(std::iter::successors(
        Some(Duration::from_millis(50)),
        |d| Some((*d * 2).min(Duration::from_secs(1))),
    ))
}

/// Lazily connected gRPC channels keyed by peer address (and the name expected in its
/// certificate), shared by all clients of a node.
///
/// A tonic `Channel` reconnects by itself after a failure, so one channel per address lives for
/// the life of the node — or until reloaded TLS material replaces it.
#[derive(Clone)]
pub struct ChannelPool {
    channels: Arc<Mutex<Channels>>,
    tls: Option<Arc<PeerTls>>,
    connect_timeout: Duration,
    max_message_bytes: usize,
    routes: Arc<BTreeMap<String, String>>,
    /// Dial through this instead of TCP (a custom transport).
    dialer: Option<Dialer>,
}

#[derive(Default)]
struct Channels {
    /// The TLS generation the channels were made with.
    generation: u64,
    by_peer: HashMap<(String, Option<NodeId>), Channel>,
}

impl ChannelPool {
    /// A pool with the given connection settings.
    pub(crate) fn new(
        tls: Option<Arc<PeerTls>>,
        connect_timeout: Duration,
        max_message_bytes: usize,
    ) -> Self {
        Self {
            channels: Arc::new(Mutex::new(Channels::default())),
            tls,
            connect_timeout,
            max_message_bytes,
            routes: Arc::new(BTreeMap::new()),
            dialer: None,
        }
    }

    /// Dial peers with `dialer` instead of TCP.
    pub(crate) fn with_dialer(mut self, dialer: Option<Dialer>) -> Self {
        self.dialer = dialer;
        self
    }

    /// Dial `routes[addr]` instead of `addr` (see `ConsensusConfig::peer_routes`).
    pub fn with_routes(mut self, routes: BTreeMap<String, String>) -> Self {
        self.routes = Arc::new(routes);
        self
    }

    /// The (lazily connecting, shared) channel to the peer at `addr` (`host:port`) — node
    /// `target` when known, whose identity its certificate must then carry — with the pool's
    /// TLS and routes; created on first use.
    pub fn channel(&self, addr: &str, target: Option<NodeId>) -> Result<Channel, tonic::Status> {
        let dial = self.routes.get(addr).map_or(addr, String::as_str);
        let mut channels = self
            .channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let generation = self.tls.as_ref().map_or(0, |t| t.generation());
        if channels.generation != generation {
            channels.by_peer.clear();
            channels.generation = generation;
        }
        let key = (dial.to_string(), target);
        Ok(match channels.by_peer.get(&key) {
            Some(ch) => ch.clone(),
            None => {
                let endpoint = self.endpoint(dial, target)?;
                let ch = match &self.dialer {
                    Some(d) => endpoint.connect_with_connector_lazy(DialService(d.clone())),
                    None => endpoint.connect_lazy(),
                };
                channels.by_peer.insert(key, ch.clone());
                ch
            }
        })
    }

    /// A client for the peer `target` at `addr` (`host:port`), creating its channel on first
    /// use.
    pub fn client(
        &self,
        addr: &str,
        target: Option<NodeId>,
    ) -> Result<RaftPeerClient<Channel>, tonic::Status> {
        let channel = self.channel(addr, target)?;
        Ok(RaftPeerClient::new(channel)
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes))
    }

    fn endpoint(&self, addr: &str, target: Option<NodeId>) -> Result<Endpoint, tonic::Status> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let bad = |e: tonic::transport::Error| {
            tonic::Status::invalid_argument(format!("peer address {addr}: {e}"))
        };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(bad)?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        if let Some(tls) = &self.tls {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            let name = tls.server_name(target, host);
            endpoint = endpoint
                .tls_config(tls.material().client(&name))
                .map_err(bad)?;
        }
        Ok(endpoint)
    }
}

/// openraft's network factory: one [`PeerNetwork`] per replication target.
pub struct NetworkFactory<S> {
    id: NodeId,
    pool: ChannelPool,
    _state: PhantomData<fn() -> S>,
}

impl<S> NetworkFactory<S> {
    /// A factory for node `id` using `pool`.
    pub fn new(id: NodeId, pool: ChannelPool) -> Self {
        Self {
            id,
            pool,
            _state: PhantomData,
        }
    }
}

impl<S: StateMachine> RaftNetworkFactory<TypeConfig<S>> for NetworkFactory<S> {
    type Network = PeerNetwork<S>;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        PeerNetwork {
            id: self.id,
            target,
            node: node.clone(),
            pool: self.pool.clone(),
            _state: PhantomData,
        }
    }
}

/// openraft's connection to one peer.
pub struct PeerNetwork<S> {
    id: NodeId,
    target: NodeId,
    node: BasicNode,
    pool: ChannelPool,
    _state: PhantomData<fn() -> S>,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, BasicNode, E>>;

impl<S: StateMachine> PeerNetwork<S> {
    fn status_error<E: std::error::Error>(status: tonic::Status) -> RPCError<NodeId, BasicNode, E> {
        match status.code() {
            // Connection refused / reset: openraft backs off with `backoff()`.
            Code::Unavailable => RPCError::Unreachable(Unreachable::new(&status)),
            _ => RPCError::Network(NetworkError::new(&status)),
        }
    }

    async fn call<E, Fut>(&self, action: RPCTypes, ttl: Duration, fut: Fut) -> RpcResult<Bytes, E>
    where
        E: std::error::Error,
        Fut: Future<Output = Result<tonic::Response<Frame>, tonic::Status>>,
    {
        match tokio::time::timeout(ttl, fut).await {
            Ok(Ok(resp)) => Ok(resp.into_inner().data),
            Ok(Err(status)) => Err(Self::status_error(status)),
            Err(_) => Err(RPCError::Timeout(openraft::error::Timeout {
                action,
                id: self.id,
                target: self.target,
                timeout: ttl,
            })),
        }
    }

    fn decode_reply<T, E>(&self, bytes: &[u8]) -> RpcResult<T, RaftError<NodeId, E>>
    where
        T: serde::de::DeserializeOwned,
        E: std::error::Error + serde::de::DeserializeOwned,
    {
        let res: Result<T, RaftError<NodeId, E>> =
            codec::decode(bytes).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        res.map_err(|e| {
            RPCError::RemoteError(RaftRemoteError::new_with_node(
                self.target,
                self.node.clone(),
                e,
            ))
        })
    }

    fn request<T>(ttl: Duration, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(ttl);
        req
    }

    fn frame<T: serde::Serialize, E: std::error::Error>(value: &T) -> RpcResult<Frame, E> {
        let data = codec::encode(value).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        Ok(Frame { data: data.into() })
    }
}

impl<S: StateMachine> PeerNetwork<S> {
    /// The append as one message within the peer message limit: all of it, or the longest
    /// prefix of its entries that fits (at least one: proposals are bounded so that one entry
    /// always fits) with the last log id sent.
    fn fitting_append(
        &self,
        mut rpc: AppendEntriesRequest<TypeConfig<S>>,
    ) -> RpcResult<(Frame, Option<LogId<NodeId>>), RaftError<NodeId>> {
        let limit = self.pool.max_message_bytes;
        let frame = Self::frame(&rpc)?;
        if frame.data.len() <= limit || rpc.entries.len() <= 1 {
            return Ok((frame, None));
        }
        // Shrink in proportion to the overshoot until the prefix fits.
        let mut n = rpc.entries.len();
        let mut size = frame.data.len();
        while size > limit && n > 1 {
            n = (n * limit / size).clamp(1, n - 1);
            let prefix = AppendEntriesRequest::<TypeConfig<S>> {
                vote: rpc.vote,
                prev_log_id: rpc.prev_log_id,
                entries: rpc.entries[..n].to_vec(),
                leader_commit: rpc.leader_commit,
            };
            size = Self::frame(&prefix)?.data.len();
        }
        rpc.entries.truncate(n);
        let last = rpc.entries.last().map(|e| e.log_id);
        Ok((Self::frame(&rpc)?, last))
    }
}

impl<S: StateMachine> RaftNetwork<TypeConfig<S>> for PeerNetwork<S> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig<S>>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        let ttl = option.hard_ttl();
        let (frame, sent_up_to) = self.fitting_append(rpc)?;
        let mut client = self
            .pool
            .client(&self.node.addr, Some(self.target))
            .map_err(Self::status_error)?;
        let bytes = self
            .call(
                RPCTypes::AppendEntries,
                ttl,
                client.append_entries(Self::request(ttl, frame)),
            )
            .await?;
        let reply = self.decode_reply(&bytes)?;
        Ok(match (reply, sent_up_to) {
            // Only a prefix went: openraft sends the rest next.
            (AppendEntriesResponse::Success, Some(last)) => {
                AppendEntriesResponse::PartialSuccess(Some(last))
            }
            (reply, _) => reply,
        })
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig<S>>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        let ttl = option.hard_ttl();
        let encode_err = |e: codec::CodecError| RPCError::Network(NetworkError::new(&e));
        let chunk = SnapshotChunk {
            vote: codec::encode(&rpc.vote).map_err(encode_err)?.into(),
            meta: codec::encode(&rpc.meta).map_err(encode_err)?.into(),
            offset: rpc.offset,
            data: rpc.data.into(),
            done: rpc.done,
        };
        let mut client = self
            .pool
            .client(&self.node.addr, Some(self.target))
            .map_err(Self::status_error)?;
        let bytes = self
            .call(
                RPCTypes::InstallSnapshot,
                ttl,
                client.install_snapshot(Self::request(ttl, chunk)),
            )
            .await?;
        self.decode_reply(&bytes)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, RaftError<NodeId>> {
        let ttl = option.hard_ttl();
        let frame = Self::frame(&rpc)?;
        let mut client = self
            .pool
            .client(&self.node.addr, Some(self.target))
            .map_err(Self::status_error)?;
        let bytes = self
            .call(RPCTypes::Vote, ttl, client.vote(Self::request(ttl, frame)))
            .await?;
        self.decode_reply(&bytes)
    }

    fn backoff(&self) -> Backoff {
        reconnect_backoff()
    }
}

/// The node-level RPCs (forwarding, reads, admin) to one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRpc {
    /// Forward a batch of proposals to the leader.
    ClientWrite,
    /// Ask the leader for a read index.
    ReadIndex,
    /// Cluster status.
    Status,
    /// Add a learner.
    AddLearner,
    /// Change membership.
    ChangeMembership,
}

impl NodeRpc {
    fn name(self) -> &'static str {
        match self {
            Self::ClientWrite => "ClientWrite",
            Self::ReadIndex => "ReadIndex",
            Self::Status => "Status",
            Self::AddLearner => "AddLearner",
            Self::ChangeMembership => "ChangeMembership",
        }
    }
}

impl ChannelPool {
    /// Calls `rpc` on node `target` at `addr` with body `body`, returning the decoded reply.
    pub async fn call_node<Req, Resp>(
        &self,
        target: NodeId,
        addr: &str,
        rpc: NodeRpc,
        body: &Req,
        timeout: Duration,
    ) -> Result<Resp, ConsensusError>
    where
        Req: serde::Serialize,
        Resp: serde::de::DeserializeOwned,
    {
        let rpc_err = |status: tonic::Status| ConsensusError::Rpc {
            method: rpc.name(),
            target,
            addr: addr.to_string(),
            status: Box::new(status),
        };
        let frame = Frame {
            data: codec::encode(body)?.into(),
        };
        let mut req = tonic::Request::new(frame);
        req.set_timeout(timeout);
        let mut client = self.client(addr, Some(target)).map_err(rpc_err)?;
        let fut = async move {
            match rpc {
                NodeRpc::ClientWrite => client.client_write(req).await,
                NodeRpc::ReadIndex => client.read_index(req).await,
                NodeRpc::Status => client.status(req).await,
                NodeRpc::AddLearner => client.add_learner(req).await,
                NodeRpc::ChangeMembership => client.change_membership(req).await,
            }
        };
        let resp = tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| ConsensusError::Timeout {
                op: rpc.name(),
                after: timeout,
            })?
            .map_err(rpc_err)?;
        Ok(codec::decode(&resp.into_inner().data)?)
    }
}
