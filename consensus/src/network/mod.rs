//! Peer networking over tonic gRPC.
//!
//! - [`client`]: openraft's `RaftNetworkFactory` / `RaftNetwork` on top of a pool of lazily
//!   connected channels keyed by peer address, plus the typed calls the node uses to forward
//!   proposals, reads and admin requests to the leader. Every call has a timeout; unreachable
//!   peers are retried by openraft with the exponential [`client::reconnect_backoff`].
//! - [`server`]: the `RaftPeer` gRPC service that feeds incoming RPCs into the local node.
//! - [`wire`]: the request/response bodies carried in `Frame.data`.
//! - [`transport`]: peer transports other than TCP (the deterministic simulation's network).
//! - [`tls`] and [`accept`]: peer TLS (reloaded files, node identities bound to certificate
//!   names) and the peer port's TLS accept loop.
//!
//! Snapshots use openraft's chunked transfer: one `InstallSnapshot` RPC per chunk of at most
//! `snapshot.chunk_bytes`, raw bytes in the protobuf message.

pub(crate) mod accept;
pub mod client;
pub mod server;
pub mod tls;
pub mod transport;
pub mod wire;

/// Generated protobuf / tonic code for `proto/raft.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("consensus.v1");
}
