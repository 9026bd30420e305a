//! The pods of a [`crate::Sim`] and their server tasks: one place that can crash, restart and stop
//! any pod's listener, shared by the library API and the admin server.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Mutex, oneshot, watch};
use tokio::task::JoinHandle;

use crate::SimError;
use crate::engine::Pod;
use crate::kvevents::{KvEndpoints, Publisher};
use crate::server;

#[derive(Debug, Default)]
struct PodServer {
    task: Option<JoinHandle<()>>,
    kill: Option<oneshot::Sender<()>>,
}

/// Every pod, its server task and the fleet's KV-event publisher.
#[derive(Debug)]
pub struct Fleet {
    pub pods: Vec<Arc<Pod>>,
    servers: Vec<Mutex<PodServer>>,
    stop: watch::Receiver<bool>,
    kv: Option<Publisher>,
}

impl Fleet {
    pub fn new(pods: Vec<Arc<Pod>>, stop: watch::Receiver<bool>, kv: Option<Publisher>) -> Fleet {
        let servers = pods.iter().map(|_| Mutex::default()).collect();
        Fleet {
            pods,
            servers,
            stop,
            kv,
        }
    }

    fn server(&self, index: usize) -> Result<&Mutex<PodServer>, SimError> {
        self.servers.get(index).ok_or(SimError::NoSuchPod {
            index,
            pods: self.pods.len(),
        })
    }

    /// Where pod `index` publishes KV events, when events are on.
    pub fn kv_endpoints(&self, index: usize) -> Option<KvEndpoints> {
        self.kv.as_ref()?.endpoints.get(index).cloned()
    }

    /// Starts serving pod `index` on `listener`.
    pub async fn launch(&self, index: usize, listener: TcpListener) -> Result<(), SimError> {
        let pod = self.pods.get(index).ok_or(SimError::NoSuchPod {
            index,
            pods: self.pods.len(),
        })?;
        let mut srv = self.server(index)?.lock().await;
        let (kill, killed) = oneshot::channel();
        srv.task = Some(tokio::spawn(server::serve_pod(
            listener,
            Arc::clone(pod),
            self.stop.clone(),
            async move {
                // A dropped sender is not a kill.
                if killed.await.is_err() {
                    std::future::pending::<()>().await;
                }
            },
        )));
        srv.kill = Some(kill);
        Ok(())
    }

    /// Whether pod `index` is serving.
    pub fn is_up(&self, index: usize) -> bool {
        self.servers
            .get(index)
            .and_then(|s| s.try_lock().ok().map(|s| s.task.is_some()))
            .unwrap_or(false)
    }

    /// Simulated crash: the listener closes and open connections are cut. Returns once nothing of
    /// the old server runs any more. Crashing a pod that is down is a no-op.
    pub async fn crash(&self, index: usize) -> Result<(), SimError> {
        let mut srv = self.server(index)?.lock().await;
        if let Some(kill) = srv.kill.take() {
            let _ = kill.send(());
        }
        if let Some(task) = srv.task.take() {
            let _ = task.await;
        }
        Ok(())
    }

    /// Simulated restart: crash if up, reset the engine to a fresh start and serve again on the same
    /// port.
    pub async fn restart(&self, index: usize) -> Result<(), SimError> {
        self.crash(index).await?;
        let pod = &self.pods[index];
        pod.restart();
        let listener = TcpListener::bind(pod.addr)
            .await
            .map_err(|source| SimError::Bind {
                addr: pod.addr,
                source,
            })?;
        self.launch(index, listener).await
    }

    /// After the stop signal: waits for every server to drain, cutting the ones that take longer
    /// than `grace` in total.
    pub async fn drain(&self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        for s in &self.servers {
            let mut srv = s.lock().await;
            if let Some(mut task) = srv.task.take()
                && tokio::time::timeout_at(deadline, &mut task).await.is_err()
            {
                task.abort();
                let _ = task.await;
            }
        }
    }

    /// Aborts every server task without waiting (the owner was dropped without shutdown).
    pub fn abort_all(&self) {
        for s in &self.servers {
            if let Ok(mut srv) = s.try_lock()
                && let Some(task) = srv.task.take()
            {
                task.abort();
            }
        }
    }
}
