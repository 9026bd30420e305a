//! The Grafana dashboard and the Prometheus alert rules the chart ships
//! (`deploy/helm/epp/files/`): every expression parses with Prometheus' own PromQL grammar,
//! every `llm_d_epp_*` series it reads is one the EPP exports (a counter's `_total`, a
//! histogram's `_bucket`/`_sum`/`_count`), every label it groups, matches or prints is one of
//! our label sets' (or a scrape target's), every rule is complete, and both cover what an
//! operator watches: saturation, queue time by priority, refusals by reason, leader changes,
//! gossip lag, scrape staleness and quota rejections.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use serde_json::Value;

fn files() -> std::path::PathBuf {
    chaos::locate::workspace_root().join("deploy/helm/epp/files")
}

/// The series names the EPP exports (every family the registry holds, with or without series).
fn exported() -> BTreeSet<String> {
    let out: BTreeSet<String> = node::metrics::Metrics::new("pool")
        .series_names()
        .iter()
        .cloned()
        .collect();
    assert!(out.len() > 100, "{out:?}");
    out
}

/// Every label name our label sets define (the fields of `EncodeLabelSet` structs in
/// `node/src/metrics/`), plus `le` and what a Prometheus scrape adds.
fn label_names() -> BTreeSet<String> {
    let mut out: BTreeSet<String> = ["le", "job", "instance", "namespace", "pod", "service"]
        .map(String::from)
        .into();
    let dir = chaos::locate::workspace_root().join("node/src/metrics");
    for entry in std::fs::read_dir(dir).unwrap() {
        let src = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let mut in_labels = false;
        let mut derive_seen = false;
        for line in src.lines().map(str::trim) {
            if line.starts_with("#[derive(") {
                derive_seen = line.contains("EncodeLabelSet");
            } else if line.starts_with("pub struct ") && line.ends_with('{') {
                in_labels = derive_seen;
                derive_seen = false;
            } else if line == "}" {
                in_labels = false;
            } else if in_labels && let Some(field) = line.strip_prefix("pub ") {
                out.insert(field.split(':').next().unwrap().trim().to_string());
            }
        }
    }
    assert!(
        out.contains("model_name") && out.contains("tenant"),
        "{out:?}"
    );
    out
}

/// The `llm_d_epp_*` names an expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("llm_d_epp_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// The label names an expression groups by, joins on or matches: `by (…)`, `without (…)`,
/// `on (…)`, `ignoring (…)`, `group_left (…)` and the keys of `{…}` selectors.
fn expr_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ] {
        let pat = format!("{kw} (");
        let mut rest = expr;
        while let Some(i) = rest.find(&pat) {
            let boundary = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
            let tail = &rest[i + pat.len()..];
            let end = tail.find(')').unwrap();
            if boundary {
                out.extend(
                    tail[..end]
                        .split(',')
                        .map(|l| l.trim().to_string())
                        .filter(|l| !l.is_empty()),
                );
            }
            rest = &tail[end..];
        }
    }
    let mut rest = expr;
    while let Some(i) = rest.find('{') {
        let tail = &rest[i + 1..];
        let end = tail.find('}').unwrap();
        for matcher in tail[..end].split(',') {
            let name = matcher.split(['=', '!']).next().unwrap().trim();
            if !name.is_empty() {
                out.push(name.to_string());
            }
        }
        rest = &tail[end..];
    }
    out
}

/// `{{name}}` / `{{ $labels.name }}` references in a legend or an annotation.
fn template_labels(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("{{") {
        let tail = &rest[i + 2..];
        let end = tail.find("}}").unwrap();
        let inner = tail[..end].trim();
        let name = inner.strip_prefix("$labels.").unwrap_or(inner);
        if !name.starts_with('$') {
            out.push(name.split_whitespace().next().unwrap().to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Grafana's variables replaced by what Prometheus would see.
fn as_promql(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m").replace("$job", ".*")
}

#[test]
fn dashboard_and_alerts_read_only_what_the_epp_exports_and_parse() {
    let series = exported();
    let labels = label_names();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(files().join("grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let rules: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(files().join("prometheus-rules.yaml")).unwrap(),
    )
    .unwrap();

    // (expression, where, templates printing its labels)
    let mut exprs: Vec<(String, String, Vec<String>)> = Vec::new();
    let mut ids = BTreeSet::new();
    for p in dashboard["panels"].as_array().unwrap() {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        let title = p["title"].as_str().unwrap();
        assert!(!title.is_empty());
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}");
        for t in targets {
            exprs.push((
                t["expr"].as_str().unwrap().to_string(),
                format!("panel {title:?}"),
                vec![t["legendFormat"].as_str().unwrap_or("").to_string()],
            ));
        }
    }
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["definition"].as_str() {
            for m in metric_names(q) {
                assert!(
                    series.contains(&m),
                    "variable {}: {m} is not exported",
                    v["name"]
                );
            }
        }
    }
    let mut alerts = BTreeSet::new();
    for g in rules["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            let name = r["alert"]
                .as_str()
                .expect("every rule is an alert")
                .to_string();
            assert!(alerts.insert(name.clone()), "duplicate alert {name}");
            let severity = r["labels"]["severity"].as_str().unwrap_or("");
            assert!(
                ["critical", "warning", "info"].contains(&severity),
                "{name}: severity {severity:?}"
            );
            let summary = r["annotations"]["summary"].as_str().unwrap_or("");
            let description = r["annotations"]["description"].as_str().unwrap_or("");
            assert!(!summary.is_empty() && !description.is_empty(), "{name}");
            exprs.push((
                r["expr"].as_str().unwrap().trim().to_string(),
                format!("alert {name}"),
                vec![summary.to_string(), description.to_string()],
            ));
        }
    }

    for (expr, at, templates) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{at} reads no llm_d_epp_ metric: {expr}");
        for m in &names {
            assert!(series.contains(m), "{at}: {m} is not exported ({expr})");
        }
        let mut used = expr_labels(expr);
        for t in templates {
            used.extend(template_labels(t));
        }
        for l in used {
            assert!(
                labels.contains(&l),
                "{at}: no metric has a label {l:?} ({expr})"
            );
        }
    }
    let promql: Vec<String> = exprs.iter().map(|(e, _, _)| as_promql(e)).collect();
    chaos::chart::check_promql(&promql).unwrap();

    // What an operator watches, in both.
    let topics = [
        ("saturation", "llm_d_epp_flow_control_pool_saturation"),
        (
            "queue time",
            "llm_d_epp_flow_control_request_queue_duration_seconds_bucket",
        ),
        ("refusals", "llm_d_epp_request_refusals_total"),
        ("leader changes", "llm_d_epp_cluster_raft_leader"),
        (
            "gossip lag",
            "llm_d_epp_prefix_gossip_delta_lag_seconds_bucket",
        ),
        ("scrape staleness", "llm_d_epp_datalayer_stale_endpoints"),
        ("quota rejections", "llm_d_epp_tenant_requests_total"),
    ];
    for (topic, metric) in topics {
        for kind in ["panel", "alert"] {
            assert!(
                exprs.iter().any(|(e, at, _)| at.starts_with(kind)
                    && metric_names(e).iter().any(|m| m == metric)),
                "no {kind} for {topic} ({metric})"
            );
        }
    }
    let by_priority = exprs.iter().any(|(e, at, _)| {
        at.starts_with("panel")
            && e.contains("queue_duration_seconds_bucket")
            && expr_labels(e).contains(&"priority".to_string())
    });
    assert!(by_priority, "queue time is shown by priority");
}

#[test]
fn the_checks_catch_what_they_look_for() {
    assert!(chaos::chart::check_promql(&["sum by (job (rate(x[5m]))".to_string()]).is_err());
    assert!(chaos::chart::check_promql(&["sum by (job) (rate(x_total[5m]))".to_string()]).is_ok());
    assert_eq!(
        expr_labels(r#"sum by (a, b) (x{c="1", d=~"2"}) / on (e) y"#),
        ["a", "b", "e", "c", "d"]
    );
    assert_eq!(
        template_labels("{{ $labels.pod }} at {{ $value | humanize }}, {{tenant}}"),
        ["pod", "tenant"]
    );
    assert_eq!(
        metric_names("rate(llm_d_epp_a_total[5m]) + llm_d_epp_b"),
        ["llm_d_epp_a_total", "llm_d_epp_b"]
    );
    let series = exported();
    // The catalog names what the exposition shows.
    let text = node::metrics::Metrics::new("pool").encode();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap();
        assert!(
            series.contains(name),
            "{name} is exposed but not in the catalog"
        );
    }
    assert!(series.contains("llm_d_epp_request_total"));
    assert!(series.contains("llm_d_epp_request_duration_seconds_bucket"));
    assert!(!series.contains("llm_d_epp_request"));
}
