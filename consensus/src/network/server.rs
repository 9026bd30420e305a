//! The `RaftPeer` gRPC service: decodes peer requests and hands them to the local node.

use std::sync::Arc;

use openraft::raft::AppendEntriesRequest;
use openraft::raft::InstallSnapshotRequest;
use openraft::raft::VoteRequest;
use rustls::pki_types::CertificateDer;
use serde::Serialize;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::proto::Frame;
use super::proto::SnapshotChunk;
use super::proto::raft_peer_server::RaftPeer;
use super::wire::AddLearnerRequest;
use super::wire::MembershipChange;
use crate::codec;
use crate::node::Inner;
use crate::state_machine::Batch;
use crate::state_machine::StateMachine;
use crate::types::NodeId;
use crate::types::TypeConfig;
use crate::types::Vote;

/// Serves peer RPCs for one node.
pub(crate) struct PeerService<S: StateMachine> {
    inner: Arc<Inner<S>>,
}

impl<S: StateMachine> PeerService<S> {
    pub(crate) fn new(inner: Arc<Inner<S>>) -> Self {
        Self { inner }
    }
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Status> {
    codec::decode(bytes).map_err(|e| Status::invalid_argument(e.to_string()))
}

fn reply<T: Serialize>(value: &T) -> Result<Response<Frame>, Status> {
    codec::encode(value)
        .map(|data| Response::new(Frame { data: data.into() }))
        .map_err(|e| Status::internal(e.to_string()))
}

/// The peer's certificate chain, when the connection is TLS.
fn certs<T>(request: &Request<T>) -> Option<Arc<Vec<CertificateDer<'static>>>> {
    request.peer_certs()
}

impl<S: StateMachine> PeerService<S> {
    /// With identities bound: the sender must be node `id` (Raft RPCs name their leader or
    /// candidate).
    fn check_node(
        &self,
        certs: Option<&Arc<Vec<CertificateDer<'static>>>>,
        vote: &Vote,
        rpc: &str,
    ) -> Result<(), Status> {
        let Some(tls) = &self.inner.tls else {
            return Ok(());
        };
        let id = vote.leader_id().voted_for();
        tls.authorize(
            certs.map(|c| c.as_slice()),
            id,
            &format!(
                "{rpc} from node {}",
                id.map_or("?".into(), |i| i.to_string())
            ),
        )
    }

    /// With identities bound: the sender must be a current member (or `or`).
    fn check_member(
        &self,
        certs: Option<&Arc<Vec<CertificateDer<'static>>>>,
        or: Option<NodeId>,
        rpc: &str,
    ) -> Result<(), Status> {
        let Some(tls) = &self.inner.tls else {
            return Ok(());
        };
        let mut ids = self.inner.member_ids();
        ids.extend(or);
        tls.authorize(
            certs.map(|c| c.as_slice()),
            ids,
            &format!("{rpc} (a member)"),
        )
    }
}

#[tonic::async_trait]
impl<S: StateMachine> RaftPeer for PeerService<S> {
    async fn append_entries(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let certs = certs(&request);
        let rpc: AppendEntriesRequest<TypeConfig<S>> = decode(&request.into_inner().data)?;
        self.check_node(certs.as_ref(), &rpc.vote, "AppendEntries")?;
        reply(&self.inner.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let certs = certs(&request);
        let rpc: VoteRequest<NodeId> = decode(&request.into_inner().data)?;
        self.check_node(certs.as_ref(), &rpc.vote, "Vote")?;
        reply(&self.inner.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<SnapshotChunk>,
    ) -> Result<Response<Frame>, Status> {
        let certs = certs(&request);
        let chunk = request.into_inner();
        let rpc = InstallSnapshotRequest {
            vote: decode(&chunk.vote)?,
            meta: decode(&chunk.meta)?,
            offset: chunk.offset,
            data: chunk.data.to_vec(),
            done: chunk.done,
        };
        self.check_node(certs.as_ref(), &rpc.vote, "InstallSnapshot")?;
        reply(&self.inner.raft.install_snapshot(rpc).await)
    }

    async fn client_write(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let certs = certs(&request);
        self.check_member(certs.as_ref(), None, "ClientWrite")?;
        let batch: Batch<S::Command> = decode(&request.into_inner().data)?;
        if let Some(tls) = &self.inner.tls {
            // Each command naming a member must come from that member's certificate.
            let mut checked = Vec::new();
            for node in batch.commands.iter().filter_map(S::acting_for) {
                if !checked.contains(&node) {
                    tls.authorize(
                        certs.as_ref().map(|c| c.as_slice()),
                        [node],
                        &format!("ClientWrite for node {node}"),
                    )?;
                    checked.push(node);
                }
            }
        }
        reply(&self.inner.local_write(batch).await)
    }

    async fn read_index(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        self.check_member(certs(&request).as_ref(), None, "ReadIndex")?;
        reply(&self.inner.local_read_index().await)
    }

    /// Read-only, and how a joining node or an operator's tool finds the leader: any peer the
    /// CA vouches for.
    async fn status(&self, _request: Request<Frame>) -> Result<Response<Frame>, Status> {
        reply(&self.inner.status().await)
    }

    async fn add_learner(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let certs = certs(&request);
        let req: AddLearnerRequest = decode(&request.into_inner().data)?;
        // A node may add itself (joining); members may add others (the admin API forwards).
        self.check_member(certs.as_ref(), Some(req.node_id), "AddLearner")?;
        reply(&self.inner.local_add_learner(req).await)
    }

    async fn change_membership(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        self.check_member(certs(&request).as_ref(), None, "ChangeMembership")?;
        let change: MembershipChange = decode(&request.into_inner().data)?;
        reply(&self.inner.local_change_membership(change).await)
    }
}
