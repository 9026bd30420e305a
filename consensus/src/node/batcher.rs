//! The batcher: concurrent proposals coalesced into one log entry, up to
//! `max_in_flight_batches` entries in flight, each written on the leader (here, or forwarded)
//! and its outputs handed back to the proposers in order.

use std::sync::Arc;

use openraft::error::ClientWriteError;
use tokio::sync::Semaphore;
use tokio::sync::mpsc;
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Inner;
use crate::error::ConsensusError;
use crate::network::client::NodeRpc;
use crate::state_machine::Batch;
use crate::state_machine::StateMachine;
use crate::types::TypeConfig;

pub(super) struct Proposal<S: StateMachine> {
    pub(super) commands: Vec<S::Command>,
    /// The commands' encoded size.
    pub(super) bytes: usize,
    pub(super) reply: oneshot::Sender<Result<Vec<S::Output>, ConsensusError>>,
}

impl<S: StateMachine> Inner<S> {
    /// Writes a batch through the leader (this node or a remote one).
    async fn write_via_leader(
        &self,
        batch: &Batch<S::Command>,
        deadline: Instant,
    ) -> Result<Vec<S::Output>, ConsensusError> {
        self.on_leader(NodeRpc::ClientWrite, batch, true, deadline, || {
            self.local_write(batch.clone())
        })
        .await
    }

    /// Completes one batch: waits for the local leader's answer, or forwards.
    pub(super) async fn finish_batch(
        &self,
        batch: Batch<S::Command>,
        submitted: Option<Result<WriteReceiver<S>, ConsensusError>>,
    ) -> Result<Vec<S::Output>, ConsensusError> {
        let deadline = Instant::now() + self.config.propose_timeout;
        let work = async {
            match submitted {
                Some(Err(e)) => return Err(e),
                Some(Ok(rx)) => match rx.await {
                    Ok(Ok(resp)) => return Ok(resp.data.outputs),
                    // Leadership moved before the entry was appended: forward it.
                    Ok(Err(ClientWriteError::ForwardToLeader(_))) => {}
                    Ok(Err(e)) => {
                        return Err(ConsensusError::Rejected {
                            node_id: self.id,
                            reason: e.to_string(),
                        });
                    }
                    Err(_) => {
                        return Err(ConsensusError::Indeterminate {
                            reason: "leader stepped down or stopped before answering".into(),
                        });
                    }
                },
                None => {}
            }
            self.write_via_leader(&batch, deadline).await
        };
        tokio::time::timeout_at(deadline, work)
            .await
            .map_err(|_| ConsensusError::Timeout {
                op: "propose",
                after: self.config.propose_timeout,
            })?
    }
}

/// The receiver `Raft::client_write_ff` returns with the oneshot responder on tokio.
type WriteReceiver<S> = oneshot::Receiver<openraft::raft::ClientWriteResult<TypeConfig<S>>>;

/// Coalesces pending proposals into batches; keeps up to `max_in_flight_batches` in flight.
pub(super) async fn run_batcher<S: StateMachine>(
    inner: Arc<Inner<S>>,
    mut rx: mpsc::Receiver<Proposal<S>>,
) {
    let permits = Arc::new(Semaphore::new(inner.config.max_in_flight_batches));
    let max_bytes = inner.config.max_entry_bytes();
    let mut in_flight = JoinSet::new();
    // A proposal that did not fit the previous batch: the next one starts with it.
    let mut carried: Option<Proposal<S>> = None;
    loop {
        let first = match carried.take() {
            Some(p) => p,
            None => tokio::select! {
                p = rx.recv() => match p {
                    Some(p) => p,
                    None => break,
                },
                Some(_) = in_flight.join_next(), if !in_flight.is_empty() => continue,
            },
        };
        // Waiting for a permit lets the next batch grow while earlier ones are in flight.
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            break;
        };
        while in_flight.try_join_next().is_some() {}
        let mut count = first.commands.len();
        let mut bytes = first.bytes;
        let mut proposals = vec![first];
        // Up to max_batch commands and max_entry_bytes per entry (each proposal alone fits:
        // propose_many refused it otherwise).
        while count < inner.config.max_batch {
            match rx.try_recv() {
                Ok(p) if bytes + p.bytes > max_bytes => {
                    carried = Some(p);
                    break;
                }
                Ok(p) => {
                    count += p.commands.len();
                    bytes += p.bytes;
                    proposals.push(p);
                }
                Err(_) => break,
            }
        }
        let mut commands = Vec::with_capacity(count);
        let mut waiters = Vec::with_capacity(proposals.len());
        for p in proposals {
            waiters.push((p.commands.len(), p.reply));
            commands.extend(p.commands);
        }
        let batch = Batch::new(commands);
        // On the leader, submit here, in order, so entries keep the proposal order; the
        // spawned task only waits for the commit.
        let submitted = if inner.is_leader() {
            Some(
                inner
                    .raft
                    .client_write_ff(batch.clone().stamped())
                    .await
                    .map_err(|e| ConsensusError::Stopped {
                        reason: e.to_string(),
                    }),
            )
        } else {
            None
        };
        let task_inner = Arc::clone(&inner);
        in_flight.spawn(async move {
            let result = task_inner.finish_batch(batch, submitted).await;
            deliver::<S>(result, waiters);
            drop(permit);
        });
    }
}

type Waiter<O> = (usize, oneshot::Sender<Result<Vec<O>, ConsensusError>>);

fn deliver<S: StateMachine>(
    result: Result<Vec<S::Output>, ConsensusError>,
    waiters: Vec<Waiter<S::Output>>,
) {
    match result {
        Ok(outputs) => {
            let expected: usize = waiters.iter().map(|(n, _)| n).sum();
            if outputs.len() != expected {
                for (_, tx) in waiters {
                    let _ = tx.send(Err(ConsensusError::Indeterminate {
                        reason: format!(
                            "leader returned {} outputs for {expected} commands",
                            outputs.len()
                        ),
                    }));
                }
                return;
            }
            let mut outputs = outputs.into_iter();
            for (n, tx) in waiters {
                let _ = tx.send(Ok(outputs.by_ref().take(n).collect()));
            }
        }
        Err(e) => {
            let reason = e.to_string();
            let mut first = Some(e);
            for (_, tx) in waiters {
                let err = first.take().unwrap_or_else(|| clone_error(&reason));
                let _ = tx.send(Err(err));
            }
        }
    }
}

/// Errors are not `Clone` (they carry sources); waiters after the first get an equivalent
/// outcome-unknown error with the same text.
fn clone_error(reason: &str) -> ConsensusError {
    ConsensusError::Indeterminate {
        reason: reason.to_string(),
    }
}
