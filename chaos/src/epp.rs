//! An `epp serve` child process.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::locate;

/// Ports the replica reported once bound.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct EppAddrs {
    pub ext_proc: SocketAddr,
    pub health: SocketAddr,
    pub admin: SocketAddr,
    /// Peer gRPC (cluster mode only).
    #[serde(default)]
    pub peer: Option<SocketAddr>,
}

#[derive(Debug)]
pub struct EppProcess {
    child: Child,
    pub addrs: EppAddrs,
    /// The admin token (`--admin-token-file`'s), sent with every `/debug` call.
    admin_token: Option<String>,
}

impl EppProcess {
    /// Start `epp serve` on OS-chosen loopback ports with `endpoints_file` and extra flags; returns
    /// once it has printed its bound addresses.
    pub async fn start(endpoints_file: &Path, extra: &[&str]) -> anyhow::Result<EppProcess> {
        Self::start_with_env(endpoints_file, extra, &[]).await
    }

    /// [`Self::start`] with extra environment variables (e.g. `OTEL_*`).
    pub async fn start_with_env(
        endpoints_file: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<EppProcess> {
        let file = endpoints_file.display().to_string();
        let mut args = vec!["--endpoints-file", file.as_str()];
        args.extend_from_slice(extra);
        let env: Vec<(&str, &std::ffi::OsStr)> = env
            .iter()
            .map(|(k, v)| (*k, std::ffi::OsStr::new(*v)))
            .collect();
        Self::spawn(&args, &env).await
    }

    /// Start `epp serve` discovering its pods from Kubernetes (`--pool-name` and the rest in
    /// `extra`) through the API server `kubeconfig` names.
    pub async fn start_kube(kubeconfig: &Path, extra: &[&str]) -> anyhow::Result<EppProcess> {
        Self::spawn(extra, &[("KUBECONFIG", kubeconfig.as_os_str())]).await
    }

    async fn spawn(extra: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> anyhow::Result<EppProcess> {
        let bin = locate::epp_binary()?;
        let mut cmd = Command::new(&bin);
        cmd.args(["serve", "--bind", "127.0.0.1"])
            .args([
                "--grpc-port",
                "0",
                "--grpc-health-port",
                "0",
                "--metrics-port",
                "0",
            ])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("EPP_TEST_LOGS").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .context("epp did not report its ports within 30s")??;
        let Some(line) = line else {
            let status = child.wait().await?;
            bail!("epp exited before binding ({status}); run with EPP_TEST_LOGS=1 to see why");
        };
        let addrs: EppAddrs =
            serde_json::from_str(&line).with_context(|| format!("bad epp ready line: {line}"))?;
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let token_file = extra
            .iter()
            .enumerate()
            .find_map(|(i, a)| match a.split_once('=') {
                Some(("--admin-token-file", path)) => Some(path),
                _ if *a == "--admin-token-file" => extra.get(i + 1).copied(),
                _ => None,
            });
        let admin_token = token_file
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|t| t.lines().next().map(|l| l.trim().to_string()));
        Ok(EppProcess {
            child,
            addrs,
            admin_token,
        })
    }

    /// The OS process id, while the process runs.
    pub fn pid_u32(&self) -> Option<u32> {
        self.child.id()
    }

    fn pid(&self) -> anyhow::Result<Pid> {
        let id = self
            .child
            .id()
            .ok_or_else(|| anyhow!("process already reaped"))?;
        Ok(Pid::from_raw(i32::try_from(id)?))
    }

    /// `kill -9`: no drain, no goodbye.
    pub async fn kill9(&mut self) -> anyhow::Result<()> {
        kill(self.pid()?, Signal::SIGKILL)?;
        self.child.wait().await?;
        Ok(())
    }

    /// SIGSTOP: the process freezes (a GC pause, a stuck VM); its sockets stay open.
    pub fn pause(&self) -> anyhow::Result<()> {
        kill(self.pid()?, Signal::SIGSTOP)?;
        Ok(())
    }

    /// SIGCONT after [`EppProcess::pause`].
    pub fn resume(&self) -> anyhow::Result<()> {
        kill(self.pid()?, Signal::SIGCONT)?;
        Ok(())
    }

    /// SIGTERM (graceful drain).
    pub fn terminate(&self) -> anyhow::Result<()> {
        kill(self.pid()?, Signal::SIGTERM)?;
        Ok(())
    }

    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        Ok(tokio::time::timeout(timeout, self.child.wait()).await??)
    }

    /// `GET /debug/cluster` (cluster mode).
    pub async fn cluster_view(&self) -> anyhow::Result<serde_json::Value> {
        self.admin_json("/debug/cluster").await
    }

    /// `GET /debug/cluster/probes` (cluster mode): the probes applied, newest last.
    pub async fn cluster_probes(&self) -> anyhow::Result<serde_json::Value> {
        self.admin_json("/debug/cluster/probes").await
    }

    /// `GET /debug/prefix-index`: per pod epoch, entries and digest.
    pub async fn prefix_index(&self) -> anyhow::Result<serde_json::Value> {
        self.admin_json("/debug/prefix-index").await
    }

    /// `GET /debug/flow`: flow control (cluster-wide: this replica's side and the global state).
    pub async fn flow_view(&self) -> anyhow::Result<serde_json::Value> {
        self.admin_json("/debug/flow").await
    }

    /// `GET` one of the admin port's JSON views.
    pub async fn admin_json(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let mut req = reqwest::Client::new()
            .get(format!("http://{}{path}", self.addrs.admin))
            .timeout(Duration::from_secs(2));
        if let Some(t) = &self.admin_token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await?;
        if !resp.status().is_success() {
            bail!("{path}: {}", resp.status());
        }
        Ok(resp.json().await?)
    }

    /// The replica's Prometheus text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(reqwest::get(format!("http://{}/metrics", self.addrs.admin))
            .await?
            .text()
            .await?)
    }
}

/// The sum of a metric's series in a Prometheus text exposition: `name` is the metric's name
/// (every label set counts) or a name with a label set (that series only).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// CPU seconds (user + system) process `pid` has used so far, from `/proc/<pid>/stat`.
pub fn proc_cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').ok_or_else(|| anyhow!("bad stat"))?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    // fields after the command: state(0) ... utime(11) stime(12), in clock ticks (100 Hz here)
    let utime: f64 = f.get(11).ok_or_else(|| anyhow!("no utime"))?.parse()?;
    let stime: f64 = f.get(12).ok_or_else(|| anyhow!("no stime"))?.parse()?;
    Ok((utime + stime) / 100.0)
}

/// The `p` quantile of `sorted` (nearest rank; NaN when empty).
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// (bucket upper bound, cumulative count) of a Prometheus histogram summed over replicas.
pub fn histogram(texts: &[String], name: &str) -> Vec<(f64, f64)> {
    let mut buckets: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
    for t in texts {
        for l in t
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_bucket{{")))
        {
            let le = l.split("le=\"").nth(1).and_then(|r| r.split('"').next());
            let v = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(le), Some(v)) = (le, v) {
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::INFINITY)
                };
                let e = buckets.entry(bound.to_bits()).or_insert((bound, 0.0));
                e.1 += v;
            }
        }
    }
    let mut v: Vec<(f64, f64)> = buckets.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The upper bound of the bucket holding the `q` quantile of histogram `h` ([`histogram`]).
pub fn histogram_quantile(h: &[(f64, f64)], q: f64) -> f64 {
    let total = h.last().map_or(0.0, |b| b.1);
    h.iter()
        .find(|b| b.1 >= q * total)
        .map_or(f64::NAN, |b| b.0)
}
