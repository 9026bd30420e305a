//! The `RaftPeer` gRPC service: decodes peer requests and hands them to the local node.

use std::sync::Arc;

use openraft::raft::InstallSnapshotRequest;
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

#[tonic::async_trait]
impl<S: StateMachine> RaftPeer for PeerService<S> {
    async fn append_entries(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let rpc = decode(&request.into_inner().data)?;
        reply(&self.inner.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let rpc = decode(&request.into_inner().data)?;
        reply(&self.inner.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<SnapshotChunk>,
    ) -> Result<Response<Frame>, Status> {
        let chunk = request.into_inner();
        let rpc = InstallSnapshotRequest {
            vote: decode(&chunk.vote)?,
            meta: decode(&chunk.meta)?,
            offset: chunk.offset,
            data: chunk.data.to_vec(),
            done: chunk.done,
        };
        reply(&self.inner.raft.install_snapshot(rpc).await)
    }

    async fn client_write(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let batch: Batch<S::Command> = decode(&request.into_inner().data)?;
        reply(&self.inner.local_write(batch).await)
    }

    async fn read_index(&self, _request: Request<Frame>) -> Result<Response<Frame>, Status> {
        reply(&self.inner.local_read_index().await)
    }

    async fn status(&self, _request: Request<Frame>) -> Result<Response<Frame>, Status> {
        reply(&self.inner.status().await)
    }

    async fn add_learner(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let req: AddLearnerRequest = decode(&request.into_inner().data)?;
        reply(&self.inner.local_add_learner(req).await)
    }

    async fn change_membership(&self, request: Request<Frame>) -> Result<Response<Frame>, Status> {
        let change: MembershipChange = decode(&request.into_inner().data)?;
        reply(&self.inner.local_change_membership(change).await)
    }
}
