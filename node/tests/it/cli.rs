//! The `epp` binary's configuration handling, as an operator meets it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn epp(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_epp"))
        .args(args)
        .output()
        .expect("run epp");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn sample() -> String {
    format!(
        "{}/../deploy/local/epp-config.yaml",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn sample_config_validates() {
    let (ok, out) = epp(&["validate-config", "--config-file", &sample()]);
    assert!(ok, "{out}");
    assert!(
        out.contains("cost-model-scorer(cost-model-scorer)*1")
            && out.contains("max-score-picker")
            && out.contains(
                "producers=[approx-prefix-cache-producer, inflight-load-producer, cost-model-producer]"
            ),
        "{out}"
    );
    // llm-d's own default profile, written out, loads as llm-d's.
    let llmd = format!(
        "{}/../deploy/examples/llm-d-affinity.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let (ok, out) = epp(&["validate-config", "--config-file", &llmd]);
    assert!(ok, "{out}");
    assert!(
        out.contains("queue-scorer(queue-scorer)*2")
            && out.contains("prefix-cache-scorer(prefix-cache-scorer)*3"),
        "{out}"
    );
}

#[test]
fn unknown_key_and_type_are_named() {
    let text = std::fs::read_to_string(sample()).unwrap();
    let bad_key = text.replace(
        "maxNumOfEndpoints: 1",
        "maxNumOfEndpoints: 1\n    tieBreak: random",
    );
    let (ok, out) = epp(&["validate-config", "--config-text", &bad_key]);
    assert!(!ok);
    assert!(
        out.contains("config key `plugins[") && out.contains("].parameters.tieBreak`"),
        "{out}"
    );

    let bad_type = text.replace("type: cost-model-scorer", "type: cost-model-scorer-v9");
    let (ok, out) = epp(&["validate-config", "--config-text", &bad_type]);
    assert!(!ok);
    assert!(
        out.contains("unknown plugin type `cost-model-scorer-v9`"),
        "{out}"
    );
}

#[test]
fn serve_refuses_bad_config_before_binding() {
    let dir = std::env::temp_dir().join(format!("epp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let endpoints = dir.join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let (ok, out) = epp(&[
        "serve",
        "--bind",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--grpc-health-port",
        "0",
        "--metrics-port",
        "0",
        "--endpoints-file",
        endpoints.to_str().unwrap(),
        "--config-text",
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugin: []\n",
    ]);
    assert!(!ok);
    assert!(out.contains("plugin"), "{out}");
    // It never printed its bound ports.
    assert!(!out.contains("\"ext_proc\""), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn serve_refuses_a_drain_delay_beyond_the_drain_timeout() {
    let (ok, out) = epp(&[
        "serve",
        "--endpoints-file",
        "/nonexistent",
        "--drain-delay",
        "10s",
        "--drain-timeout",
        "5s",
    ]);
    assert!(!ok);
    assert!(
        out.contains("--drain-delay (10s) must not exceed --drain-timeout (5s)"),
        "{out}"
    );
}

/// The sample configs of `deploy/examples` (flow control, P/D) and the built-in default validate,
/// and the effective configuration says what they do.
#[test]
fn example_configs_validate() {
    let dir = format!("{}/../deploy/examples", env!("CARGO_MANIFEST_DIR"));
    let (ok, out) = epp(&[
        "validate-config",
        "--config-file",
        &format!("{dir}/flow-control.yaml"),
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("admission=flow-control(bands=[10,0,-10] detector=concurrency-detector maxRequests=10000 ttl=30s demandReserve=(factor=8 settle=20ms maxSettle=100ms))"),
        "{out}"
    );
    let (ok, out) = epp(&[
        "validate-config",
        "--config-file",
        &format!("{dir}/pd.yaml"),
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("disagg-profile-handler decode: profile=decode")
            && out.contains("prefill when prefix-based-pd-decider: profile=prefill"),
        "{out}"
    );
    let (ok, out) = epp(&["validate-config"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("admission=legacy(utilization-detector)")
            && out.contains("cost-model-scorer(cost-model-scorer)*1"),
        "{out}"
    );
}

/// Cluster mode is secure by default: without mutual TLS on the peer port (or the explicit
/// `--peer-insecure`) `epp serve` refuses to start, and says what to give it.
#[test]
fn cluster_mode_refuses_an_unauthenticated_peer_port() {
    let dir = std::env::temp_dir().join(format!("epp-cli-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let endpoints = dir.join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let ep = endpoints.to_str().unwrap();
    let base = [
        "serve",
        "--bind",
        "127.0.0.1",
        "--endpoints-file",
        ep,
        "--node-id",
        "1",
        "--peers",
        "1=127.0.0.1:1",
    ];
    let (ok, out) = epp(&base);
    assert!(!ok);
    assert!(
        out.contains("mutual TLS") && out.contains("--peer-insecure"),
        "{out}"
    );
    // A certificate without a CA to verify peers with is not mutual.
    let mut with_cert = base.to_vec();
    with_cert.extend(["--peer-tls-cert", ep, "--peer-tls-key", ep]);
    let (ok, out) = epp(&with_cert);
    assert!(!ok);
    assert!(out.contains("--peer-tls-ca is required"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// With mutual TLS the node id is bound to the certificate (`--peer-tls-identity`, default
/// `epp-node-{id}`): a replica given another node's certificate refuses to start and names the
/// identity it expected.
#[test]
fn cluster_mode_refuses_a_certificate_for_another_node() {
    let dir = tempfile::tempdir().unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/local/make-test-certs.sh"
    );
    let made = Command::new("bash")
        .arg(script)
        .arg(dir.path())
        .arg("2")
        .output()
        .expect("run make-test-certs.sh");
    assert!(made.status.success(), "{made:?}");
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let p = |f: &str| dir.path().join(f).display().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_epp"))
        .args(["serve", "--bind", "127.0.0.1", "--grpc-port", "0"])
        .args([
            "--grpc-health-port",
            "0",
            "--metrics-port",
            "0",
            "--peer-port",
            "0",
        ])
        .args(["--endpoints-file", &p("endpoints.yaml"), "--node-id", "1"])
        .args(["--data-dir", &p("data"), "--peers", "1=127.0.0.1:1"])
        .args([
            "--peer-tls-cert",
            &p("node-2.pem"),
            "--peer-tls-key",
            &p("node-2.key"),
        ])
        .args(["--peer-tls-ca", &p("ca.pem")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run epp");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            panic!("epp started with another node's certificate");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("not valid for this node's identity `epp-node-1`"),
        "{text}"
    );
}

/// `--node-id-from-pod-name` takes a StatefulSet pod's name (`NAME-ORDINAL` → ordinal + 1) and
/// refuses anything else, naming it; it excludes `--node-id`.
#[test]
fn node_id_from_a_pod_name() {
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--bind", "127.0.0.1", "--peers", "1=127.0.0.1:1"];
        args.extend_from_slice(extra);
        epp(&args)
    };
    let (ok, out) = serve(&["--node-id-from-pod-name", "epp"]);
    assert!(
        !ok && out.contains("`epp` is not a StatefulSet pod name"),
        "{out}"
    );
    let (ok, out) = serve(&["--node-id-from-pod-name", "epp-x"]);
    assert!(
        !ok && out.contains("`epp-x` is not a StatefulSet pod name"),
        "{out}"
    );
    let (ok, out) = serve(&["--node-id-from-pod-name", "epp-0", "--node-id", "2"]);
    assert!(!ok && out.contains("cannot be used with"), "{out}");
}

/// `validate-config` prints any accepted version as `llm-d.ai/v1` (which loads back) and what it
/// makes the EPP do; a v1alpha1 file gets one deprecation line, a v1 file none.
#[test]
fn validate_config_prints_v1_and_deprecates_v1alpha1_once() {
    let old = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
               - {name: sync, type: local-syncer}\n- type: queue-scorer\n\
               dataLayer: {crossReplicaSyncerPluginRef: sync, crossReplicaSyncInterval: 200ms}\n";
    let (ok, out) = epp(&["validate-config", "--config-text", old]);
    assert!(ok, "{out}");
    assert_eq!(out.matches("DEPRECATION").count(), 1, "{out}");
    assert!(
        out.contains("apiVersion: llm-d.ai/v1\n")
            && out.contains("crossReplica:")
            && out.contains("syncerPluginRef: sync")
            && out.contains("# effective: ")
            && out.contains("cluster mode (--peers"),
        "{out}"
    );
    let printed: String = out
        .lines()
        .take_while(|l| !l.starts_with("# effective"))
        .filter(|l| !l.contains("DEPRECATION"))
        .map(|l| format!("{l}\n"))
        .collect();
    let (ok, again) = epp(&["validate-config", "--config-text", &printed]);
    assert!(ok, "{again}");
    assert!(!again.contains("DEPRECATION"), "{again}");
}
