//! Every mode's rendered manifests: valid offline, the values that cannot work refused.

use super::*;
use std::collections::BTreeMap;

use chaos::chart::{container_args, validate};
use serde_json::json;

#[test]
fn the_chart_renders_valid_manifests_for_every_mode() {
    let helm = Helm::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = chaos::locate::workspace_root();
    let flow = root.join("deploy/examples/flow-control.yaml");
    let config = format!("config=@{}", flow.display());
    let cases: [(&str, Vec<&str>); 5] = [
        (
            "three replicas",
            vec!["pool.name=llm", "cluster.tls.issuer.name=epp-ca"],
        ),
        ("one replica", vec!["pool.name=llm", "replicas=1"]),
        (
            "everything",
            vec![
                "pool.name=llm",
                "replicas=5",
                "cluster.tls.issuer.name=epp-ca",
                "cluster.tls.issuer.kind=ClusterIssuer",
                "cluster.tls.caConfigMap=epp-trust",
                "pool.create=true",
                "pool.matchLabels.app=vllm",
                "serviceMonitor.enabled=true",
                "prometheusRule.enabled=true",
                "grafanaDashboard.enabled=true",
                "tracing.otlpEndpoint=http://otel-collector.monitoring:4317",
                "standalone.enabled=true",
                "adminTokenSecret=epp-admin",
                "tenantsSecret=epp-tenants",
                // The models' tokenizer files for the local token producer.
                "extraVolumes[0].name=tokenizers",
                "extraVolumes[0].persistentVolumeClaim.claimName=models",
                "extraVolumeMounts[0].name=tokenizers",
                "extraVolumeMounts[0].mountPath=/models",
                "extraVolumeMounts[0].readOnly=true",
                &config,
            ],
        ),
        (
            "one replica, centralized KV events",
            vec!["pool.name=llm", "replicas=1", "kvEvents.centralPort=5557"],
        ),
        (
            "three replicas, centralized KV events (forwarded to the owners)",
            vec![
                "pool.name=llm",
                "cluster.tls.secretName=epp-peer-tls",
                "kvEvents.centralPort=5557",
            ],
        ),
    ];
    for (what, values) in &cases {
        let (text, docs) = render(&helm, values);
        // Peer TLS from an issuer: each pod's own key from the csi-driver, no Secret of keys.
        if values
            .iter()
            .any(|v| v.starts_with("cluster.tls.issuer.name="))
        {
            let volumes = pod_spec(&docs)["volumes"].as_array().unwrap();
            let tls = volumes.iter().find(|v| v["name"] == "peer-tls").unwrap();
            assert_eq!(tls["csi"]["driver"], "csi.cert-manager.io", "{what}: {tls}");
            assert!(tls.get("secret").is_none(), "{what}: {tls}");
            assert!(
                !text.contains("node-{id}"),
                "{what}: a path into a Secret of every node's key"
            );
        }
        // Centralized KV events: the port the model servers publish to, on the pod and the
        // Service; no such port otherwise.
        let central = values.contains(&"kvEvents.centralPort=5557");
        let port = |list: &Value| {
            list.as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == "zmq-kv-events")
                .cloned()
        };
        let svc = find(&docs, "Service", FULL).expect("the Service");
        assert_eq!(
            port(&svc["spec"]["ports"]).map(|p| (p["port"].clone(), p["targetPort"].clone())),
            central.then(|| (Value::from(5557), Value::from("zmq-kv-events"))),
            "{what}"
        );
        assert_eq!(
            port(&epp_container(&docs)["ports"]).map(|p| p["containerPort"].clone()),
            central.then(|| Value::from(5557)),
            "{what}"
        );
        // Extra volumes reach the pod, and their mounts the EPP container only.
        let pod = &find(&docs, "StatefulSet", FULL).unwrap()["spec"]["template"]["spec"];
        let named = |list: &Value, name: &str| {
            list.as_array()
                .into_iter()
                .flatten()
                .find(|v| v["name"] == name)
                .cloned()
        };
        let extra = values.iter().any(|v| v.starts_with("extraVolumes"));
        let volume = named(&pod["volumes"], "tokenizers");
        assert_eq!(
            volume.map(|v| v["persistentVolumeClaim"]["claimName"].clone()),
            extra.then(|| Value::from("models")),
            "{what}"
        );
        for c in pod["containers"].as_array().unwrap() {
            let mount = named(&c["volumeMounts"], "tokenizers");
            let want = extra && c["name"] == "epp";
            assert_eq!(mount.is_some(), want, "{what}: {}", c["name"]);
            if let Some(m) = mount {
                assert_eq!(m["mountPath"], "/models", "{what}");
                assert_eq!(m["readOnly"], true, "{what}");
            }
        }
        let path = dir.path().join(format!("{what}.yaml"));
        std::fs::write(&path, &text).unwrap();
        validate(&path, &["ServiceMonitor", "PrometheusRule"])
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        // The monitoring assets (when enabled) carry the files of `files/` unchanged.
        let monitored = values.contains(&"prometheusRule.enabled=true");
        assert_eq!(
            find(&docs, "PrometheusRule", FULL).is_some(),
            monitored,
            "{what}"
        );
        assert_eq!(
            find(&docs, "ConfigMap", &format!("{FULL}-dashboard")).is_some(),
            monitored,
            "{what}"
        );
        if let Some(rule) = find(&docs, "PrometheusRule", FULL) {
            let file: Value = serde_saphyr::from_str(
                &std::fs::read_to_string(
                    chaos::chart::chart_dir().join("files/prometheus-rules.yaml"),
                )
                .unwrap(),
            )
            .unwrap();
            assert_eq!(rule["spec"], file, "{what}");
        }
        if let Some(cm) = find(&docs, "ConfigMap", &format!("{FULL}-dashboard")) {
            let file: Value = serde_json::from_str(
                &std::fs::read_to_string(
                    chaos::chart::chart_dir().join("files/grafana-dashboard.json"),
                )
                .unwrap(),
            )
            .unwrap();
            let shipped: Value =
                serde_json::from_str(cm["data"]["llm-d-epp.json"].as_str().unwrap()).unwrap();
            assert_eq!(shipped, file, "{what}");
            assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
        }

        // Least privilege: read-only, the four resources the EPP watches.
        let role = find(&docs, "Role", FULL).unwrap();
        let mut granted = BTreeMap::new();
        for rule in role["rules"].as_array().unwrap() {
            for r in rule["resources"].as_array().unwrap() {
                granted.insert(r.as_str().unwrap().to_string(), rule["verbs"].clone());
            }
        }
        assert_eq!(
            granted.keys().collect::<Vec<_>>(),
            [
                "inferencemodelrewrites",
                "inferenceobjectives",
                "inferencepools",
                "pods"
            ],
            "{what}"
        );
        assert!(
            granted
                .values()
                .all(|v| *v == json!(["get", "list", "watch"])),
            "{what}"
        );

        // Every Service port targets a port the pods declare.
        let pod = &find(&docs, "StatefulSet", FULL).unwrap()["spec"]["template"]["spec"];
        let declared: Vec<&Value> = pod["containers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| c["ports"].as_array().into_iter().flatten())
            .map(|p| &p["name"])
            .collect();
        for svc in docs.iter().filter(|d| d["kind"] == "Service") {
            for p in svc["spec"]["ports"].as_array().unwrap() {
                let name = svc["metadata"]["name"].as_str().unwrap();
                let clustered = find(&docs, "PodDisruptionBudget", FULL).is_some();
                if name.ends_with("-peers") && !clustered {
                    continue; // the StatefulSet's governing Service; no peer port alone
                }
                assert!(
                    declared.contains(&&p["targetPort"]),
                    "{what}: Service {name} targets {} which no container declares",
                    p["targetPort"]
                );
            }
        }
    }

    // Three and five replicas keep a majority through voluntary disruptions; one has no PDB.
    let (_, three) = render(&helm, &cases[0].1);
    assert_eq!(
        find(&three, "PodDisruptionBudget", FULL).unwrap()["spec"]["minAvailable"],
        2
    );
    let (_, one) = render(&helm, &cases[1].1);
    assert!(find(&one, "PodDisruptionBudget", FULL).is_none());
    assert!(
        !container_args(epp_container(&one), &[])
            .iter()
            .any(|a| a.starts_with("--peers")),
        "one replica runs standalone"
    );
    let (_, all) = render(&helm, &cases[2].1);
    assert_eq!(
        find(&all, "PodDisruptionBudget", FULL).unwrap()["spec"]["minAvailable"],
        3
    );

    // Tenant mode: the Secret's file is the replicas' --tenants-file.
    let epp = epp_container(&all);
    assert!(
        container_args(epp, &[])
            .iter()
            .any(|a| a == "--tenants-file=/etc/epp/tenants/tenants.yaml")
    );
    let pod = &find(&all, "StatefulSet", FULL).unwrap()["spec"]["template"]["spec"];
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["secret"]["secretName"] == "epp-tenants")
    );

    // Tenant mode from TenantQuota objects: the flag, and read access to them (only then).
    let (_, watching) = render(&helm, &["pool.name=llm", "replicas=1", "watchTenants=true"]);
    assert!(
        container_args(epp_container(&watching), &[])
            .iter()
            .any(|a| a == "--watch-tenants")
    );
    let role = find(&watching, "Role", FULL).unwrap();
    assert!(
        role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["resources"] == json!(["tenantquotas"])
                && r["verbs"] == json!(["get", "list", "watch"]))
    );

    // The InferencePool points the gateway at the chart's ext_proc Service.
    let pool = find(&all, "InferencePool", "llm").unwrap();
    assert_eq!(pool["spec"]["endpointPickerRef"]["name"], FULL);
    assert_eq!(pool["spec"]["endpointPickerRef"]["port"]["number"], 9002);

    // Traces: the replicas get the OpenTelemetry environment, the sidecar Envoy its tracer.
    let env = epp_container(&all)["env"].as_array().unwrap().clone();
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .map(String::from)
    };
    assert_eq!(
        var("OTEL_EXPORTER_OTLP_ENDPOINT").as_deref(),
        Some("http://otel-collector.monitoring:4317")
    );
    assert_eq!(
        var("OTEL_TRACES_SAMPLER").as_deref(),
        Some("parentbased_traceidratio")
    );
    assert_eq!(var("OTEL_TRACES_SAMPLER_ARG").as_deref(), Some("0.05"));
    // Standalone mode's Envoy bootstrap: Envoy itself accepts it.
    let envoy_cm = find(&all, "ConfigMap", &format!("{FULL}-envoy")).unwrap();
    let bootstrap_text = envoy_cm["data"]["envoy.yaml"].as_str().unwrap();
    assert!(
        bootstrap_text.contains("envoy.tracers.opentelemetry")
            && bootstrap_text.contains("address: otel-collector.monitoring, port_value: 4317"),
        "{bootstrap_text}"
    );
    let bootstrap = dir.path().join("envoy.yaml");
    std::fs::write(&bootstrap, envoy_cm["data"]["envoy.yaml"].as_str().unwrap()).unwrap();
    let envoy = chaos::locate::envoy_binary().unwrap();
    let out = std::process::Command::new(envoy)
        .args(["--mode", "validate", "-c"])
        .arg(&bootstrap)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "Envoy refuses the bootstrap: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Standalone Envoy's trust boundary (issue 51): its admin interface on loopback (the kubelet
    // reaches /ready through a listener of its own), the destination header removed from client
    // requests before anything reads it, and no destination from the EPP → 503 when failing
    // closed, round robin over the pool's pods (a headless Service on its labels) when failing
    // open; Envoy accepts both bootstraps.
    let standalone = |failure_mode: &str| {
        let values = [
            "pool.name=llm",
            "replicas=1",
            "standalone.enabled=true",
            "pool.matchLabels.app=vllm",
            "pool.targetPorts[0]=8200",
            failure_mode,
        ];
        let (_, docs) = render(&helm, &values);
        let cm = find(&docs, "ConfigMap", &format!("{FULL}-envoy")).unwrap();
        let text = cm["data"]["envoy.yaml"].as_str().unwrap().to_string();
        let path = dir.path().join("standalone-envoy.yaml");
        std::fs::write(&path, &text).unwrap();
        let out = std::process::Command::new(chaos::locate::envoy_binary().unwrap())
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{failure_mode}: Envoy refuses the bootstrap: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bootstrap: Value = serde_saphyr::from_str(&text).unwrap();
        (docs, bootstrap)
    };
    for failure_mode in ["pool.failureMode=FailOpen", "pool.failureMode=FailClose"] {
        let (docs, bootstrap) = standalone(failure_mode);
        let open = failure_mode.ends_with("FailOpen");
        assert_eq!(
            bootstrap["admin"]["address"]["socket_address"]["address"], "127.0.0.1",
            "{failure_mode}"
        );
        let listeners = bootstrap["static_resources"]["listeners"]
            .as_array()
            .unwrap();
        let hcm = |name: &str| {
            listeners.iter().find(|l| l["name"] == name).unwrap()["filter_chains"][0]["filters"][0]
                ["typed_config"]
                .clone()
        };
        let ready = hcm("ready");
        let ready_routes = &ready["route_config"]["virtual_hosts"][0]["routes"];
        assert_eq!(ready_routes.as_array().unwrap().len(), 1, "{failure_mode}");
        assert_eq!(ready_routes[0]["match"]["path"], "/ready", "{failure_mode}");
        let inference = hcm("inference_listener");
        let removed: Vec<&str> =
            inference["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|m| m["remove"].as_str())
                .collect();
        assert!(
            removed.contains(&"x-gateway-destination-endpoint"),
            "{failure_mode}: {removed:?}"
        );
        let routes = inference["route_config"]["virtual_hosts"][0]["routes"]
            .as_array()
            .unwrap();
        for r in routes {
            if r["route"]["cluster"] == "original_destination_cluster" {
                assert!(
                    r["match"]["headers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|h| h["name"] == "x-gateway-destination-endpoint"),
                    "{failure_mode}: the pod picked only from the EPP's destination: {r}"
                );
            }
        }
        let last = routes.last().unwrap();
        if open {
            assert_eq!(last["route"]["cluster"], "pool_pods", "{failure_mode}");
            let pool = find(&docs, "Service", &format!("{FULL}-pool-pods")).unwrap();
            assert_eq!(pool["spec"]["clusterIP"], "None");
            assert_eq!(pool["spec"]["selector"], json!({"app": "vllm"}));
            assert_eq!(pool["spec"]["ports"][0]["port"], 8200);
        } else {
            assert_eq!(last["direct_response"]["status"], 503, "{failure_mode}");
            assert!(find(&docs, "Service", &format!("{FULL}-pool-pods")).is_none());
        }
        let sts = find(&docs, "StatefulSet", FULL).unwrap();
        let envoy = sts["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "envoy")
            .unwrap();
        assert_eq!(envoy["readinessProbe"]["httpGet"]["port"], "envoy-ready");
    }

    // The EndpointPickerConfig in the ConfigMap: `epp` accepts it.
    let cm = find(&all, "ConfigMap", &format!("{FULL}-config")).unwrap();
    let cfg = dir.path().join("epp-config.yaml");
    std::fs::write(&cfg, cm["data"]["epp-config.yaml"].as_str().unwrap()).unwrap();
    let out = std::process::Command::new(chaos::locate::epp_binary().unwrap())
        .args(["validate-config", "--config-file"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "epp refuses the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Values that cannot work are refused with a reason, at render time.
    for (values, reason) in [
        (vec!["replicas=1"], "pool.name is required"),
        (vec!["pool.name=llm"], "cluster.tls.issuer.name"),
        (
            vec![
                "pool.name=llm",
                "cluster.tls.issuer.name=ca",
                "cluster.tls.secretName=keys",
            ],
            "exclude each other",
        ),
        (
            vec![
                "pool.name=llm",
                "cluster.tls.issuer.name=ca",
                "cluster.tls.issuer.kind=Certificate",
            ],
            "Issuer or ClusterIssuer",
        ),
        (
            vec!["pool.name=llm", "replicas=1", "pool.create=true"],
            "pool.matchLabels",
        ),
        (
            vec![
                "pool.name=llm",
                "replicas=1",
                "standalone.enabled=true",
                "pool.failureMode=FailOpen",
            ],
            "needs pool.matchLabels",
        ),
        (
            vec!["pool.name=llm", "replicas=1", "pool.failureMode=Open"],
            "FailOpen or FailClose",
        ),
        (
            vec!["pool.name=llm", "replicas=1", "drain.delaySeconds=40"],
            "drain.delaySeconds must not exceed",
        ),
        (
            vec![
                "pool.name=llm",
                "replicas=1",
                "watchTenants=true",
                "tenantsSecret=t",
            ],
            "exclude each other",
        ),
        (
            vec![
                "pool.name=llm",
                "replicas=1",
                "terminationGracePeriodSeconds=30",
            ],
            "terminationGracePeriodSeconds must exceed",
        ),
    ] {
        let out = helm.template(RELEASE, NS, &values).unwrap();
        assert!(
            !out.ok && out.stderr.contains(reason),
            "{values:?}: {}",
            out.stderr
        );
    }
}
