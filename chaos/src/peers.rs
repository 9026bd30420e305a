//! Peer routers from PyPI — `sglang-router` and `vllm-router` — as child processes on loopback, in
//! front of the simulated pods, so benchmarks compare the EPP with them side by side.
//!
//! `deploy/local/install-peers.sh` installs both into the workspace's `.venv`. They are started
//! with `HF_HUB_OFFLINE=1` (no tokenizer downloads), on an OS-chosen loopback port, with the pods'
//! URLs as workers; a handle kills its router when dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

use crate::locate::workspace_root;

/// Which router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// `sglang-router` (`python -m sglang_router.launch_router`).
    Sglang,
    /// `vllm-router`.
    Vllm,
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang-router",
            Peer::Vllm => "vllm-router",
        }
    }
}

/// A running peer router.
#[derive(Debug)]
pub struct PeerRouter {
    pub peer: Peer,
    pub addr: SocketAddr,
    _child: Child,
}

fn venv_bin(name: &str) -> PathBuf {
    workspace_root().join(".venv/bin").join(name)
}

/// A free loopback port (bound, then released for the router to take).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

impl PeerRouter {
    /// Start `peer` with `policy` (e.g. `cache_aware`) in front of `workers` (`http://ip:port`);
    /// returns once it answers `GET /v1/models` through to a worker.
    pub async fn start(peer: Peer, policy: &str, workers: &[String]) -> anyhow::Result<Self> {
        let port = free_port()?;
        // Both default their metrics port to 29000: give each its own.
        let metrics_port = free_port()?;
        let mut cmd = match peer {
            Peer::Sglang => {
                let mut c = Command::new(venv_bin("python"));
                c.args(["-m", "sglang_router.launch_router"]);
                c
            }
            Peer::Vllm => Command::new(venv_bin("vllm-router")),
        };
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--worker-urls")
            .args(workers)
            .args(["--policy", policy])
            .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
            .arg(metrics_port.to_string())
            .env("HF_HUB_OFFLINE", "1")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .stdin(Stdio::null())
            .stdout(if std::env::var_os("EPP_TEST_LOGS").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(if std::env::var_os("EPP_TEST_LOGS").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true);
        let mut child = cmd.spawn().with_context(|| {
            format!(
                "starting {} (install it with deploy/local/install-peers.sh)",
                peer.name()
            )
        })?;
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{} exited before serving ({status}); run with EPP_TEST_LOGS=1 to see why",
                    peer.name()
                );
            }
            let ok = client
                .get(format!("http://{addr}/v1/models"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("{} did not serve /v1/models within 60 s", peer.name());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(PeerRouter {
            peer,
            addr,
            _child: child,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
