//! Rendering the Envoy bootstrap and running Envoy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use tokio::process::{Child, Command};

use crate::{locate, wait};

pub const TEMPLATE: &str = include_str!("../../deploy/local/envoy.template.yaml");

#[derive(Debug, Clone)]
pub struct EnvoyParams {
    pub listen_port: u16,
    pub admin_port: u16,
    pub epp: Vec<SocketAddr>,
    pub pods: Vec<SocketAddr>,
    pub failure_mode_allow: bool,
    /// Keep the observability-mode filter that sees responses (the default data plane).
    pub observe_responses: bool,
    /// Route to the pods through GIE's override_host policy (fallback endpoints tried in order,
    /// the served one reported) instead of the ORIGINAL_DST cluster.
    pub fallback_lb: bool,
    /// Trace with Envoy's OpenTelemetry tracer, exporting to this OTLP/gRPC collector.
    pub otlp: Option<SocketAddr>,
}

fn endpoints(addrs: &[SocketAddr]) -> String {
    let items: Vec<String> = addrs
        .iter()
        .map(|a| {
            format!(
                "{{endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}}}",
                a.ip(),
                a.port()
            )
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// Fill the template's placeholders.
pub fn render(p: &EnvoyParams) -> String {
    let mut text = String::with_capacity(TEMPLATE.len());
    // Blocks may nest (the fallback variant's forwarding sits inside the observe filter).
    let (mut skip_observe, mut skip_fallback, mut skip_tracing) = (false, false, false);
    for line in TEMPLATE.lines() {
        match line.trim() {
            "# observe-begin" => skip_observe = !p.observe_responses,
            "# observe-end" => skip_observe = false,
            "# fallback-begin" => skip_fallback = !p.fallback_lb,
            "# fallback-end" => skip_fallback = false,
            "# tracing-begin" => skip_tracing = p.otlp.is_none(),
            "# tracing-end" => skip_tracing = false,
            _ if skip_observe || skip_fallback || skip_tracing => {}
            _ => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    text.replace("{{ADMIN_PORT}}", &p.admin_port.to_string())
        .replace("{{LISTEN_PORT}}", &p.listen_port.to_string())
        .replace("{{EPP_ENDPOINTS}}", &endpoints(&p.epp))
        .replace("{{RR_ENDPOINTS}}", &endpoints(&p.pods))
        .replace("{{FAILURE_MODE_ALLOW}}", &p.failure_mode_allow.to_string())
        .replace("{{OTLP_ENDPOINTS}}", &endpoints(p.otlp.as_slice()))
        .replace(
            "{{POD_CLUSTER}}",
            if p.fallback_lb {
                "fallback_pods"
            } else {
                "original_destination_cluster"
            },
        )
}

#[derive(Debug)]
pub struct EnvoyProcess {
    child: Child,
    pub admin: SocketAddr,
    pub listener: SocketAddr,
    dir: tempfile::TempDir,
}

impl EnvoyProcess {
    /// Start Envoy on OS-chosen loopback ports (admin and listener port 0 are rendered in; the real
    /// ports are read back from the admin address file and `/listeners`).
    pub async fn start(
        epp: Vec<SocketAddr>,
        pods: Vec<SocketAddr>,
        failure_mode_allow: bool,
        observe_responses: bool,
    ) -> anyhow::Result<EnvoyProcess> {
        Self::start_with(EnvoyParams {
            listen_port: 0,
            admin_port: 0,
            epp,
            pods,
            failure_mode_allow,
            observe_responses,
            fallback_lb: false,
            otlp: None,
        })
        .await
    }

    /// [`EnvoyProcess::start`] with every rendering parameter (ports are OS-chosen regardless).
    pub async fn start_with(params: EnvoyParams) -> anyhow::Result<EnvoyProcess> {
        let bin = locate::envoy_binary()?;
        let dir = tempfile::tempdir()?;
        let cfg_path = dir.path().join("envoy.yaml");
        let admin_path = dir.path().join("admin-address");
        let log_path = dir.path().join("envoy.log");
        std::fs::write(
            &cfg_path,
            render(&EnvoyParams {
                listen_port: 0,
                admin_port: 0,
                ..params
            }),
        )?;
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(&bin)
            .arg("-c")
            .arg(&cfg_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "2",
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let mut env = EnvoyProcess {
            child,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
        };
        if let Err(e) = env.await_ready(&admin_path).await {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: String = log
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            bail!("envoy did not become ready: {e:#}\n--- envoy log ---\n{tail}");
        }
        Ok(env)
    }

    async fn await_ready(&mut self, admin_path: &std::path::Path) -> anyhow::Result<()> {
        let t = Duration::from_secs(30);
        wait::until("envoy admin address file", t, || async {
            std::fs::read_to_string(admin_path).is_ok_and(|s| !s.trim().is_empty())
        })
        .await?;
        if let Some(status) = self.child.try_wait()? {
            bail!("envoy exited: {status}");
        }
        self.admin = std::fs::read_to_string(admin_path)?.trim().parse()?;
        let admin = self.admin;
        wait::until("envoy /ready", t, || async move {
            match reqwest::get(format!("http://{admin}/ready")).await {
                Ok(r) => r.status().is_success(),
                Err(_) => false,
            }
        })
        .await?;
        let listeners: serde_json::Value =
            reqwest::get(format!("http://{admin}/listeners?format=json"))
                .await?
                .json()
                .await?;
        let port = listeners["listener_statuses"]
            .as_array()
            .and_then(|l| l.first())
            .and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64())
            .ok_or_else(|| anyhow!("no listener port in {listeners}"))?;
        self.listener = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port)?));
        Ok(())
    }

    /// Base URL of the gateway listener.
    pub fn url(&self) -> String {
        format!("http://{}", self.listener)
    }

    /// The rendered bootstrap's directory (config and log).
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// Counter or gauge from Envoy's admin `/stats` (0 when absent).
    pub async fn stat(&self, name: &str) -> anyhow::Result<u64> {
        let text = reqwest::get(format!(
            "http://{}/stats?filter=^{}$",
            self.admin,
            name.replace('.', "\\.")
        ))
        .await?
        .text()
        .await?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(observe: bool) -> EnvoyParams {
        EnvoyParams {
            listen_port: 1,
            admin_port: 2,
            epp: vec!["127.0.0.1:9002".parse().unwrap()],
            pods: vec![
                "127.0.0.1:8000".parse().unwrap(),
                "127.0.0.1:8001".parse().unwrap(),
            ],
            failure_mode_allow: false,
            observe_responses: observe,
            fallback_lb: false,
            otlp: None,
        }
    }

    #[test]
    fn renders_every_placeholder() {
        let text = render(&params(true));
        assert!(!text.contains("{{"), "{text}");
        assert!(text.contains("port_value: 8001"));
        assert!(text.contains("envoy.filters.http.ext_proc.observe"));
        assert!(text.contains("cluster: original_destination_cluster"));
        assert!(!text.contains("forwarding_namespaces"), "{text}");
        assert!(
            !text.contains("load_balancing_policies.override_host"),
            "{text}"
        );
        let text = render(&params(false));
        assert!(!text.contains("observability_mode"), "{text}");
        assert!(!text.contains("ext_proc.observe"), "{text}");
        let text = render(&EnvoyParams {
            fallback_lb: true,
            ..params(true)
        });
        assert!(text.contains("cluster: fallback_pods"), "{text}");
        assert!(text.contains("override_host") && text.contains("retry_policy"));
        assert!(text.contains("forwarding_namespaces"));
        // Without the observe filter its nested fallback lines go too.
        let text = render(&EnvoyParams {
            fallback_lb: true,
            ..params(false)
        });
        assert!(!text.contains("forwarding_namespaces") && !text.contains("observability_mode"));
        assert!(text.contains("cluster: fallback_pods"));
        // Envoy's tracer only with a collector.
        assert!(!render(&params(true)).contains("otel_collector"));
        let text = render(&EnvoyParams {
            otlp: Some("127.0.0.1:4317".parse().unwrap()),
            ..params(true)
        });
        assert!(text.contains("envoy.tracers.opentelemetry") && text.contains("port_value: 4317"));
        assert!(!text.contains("{{"), "{text}");
    }
}
