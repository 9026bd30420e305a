//! "Why this pod?" from outside: `epp serve` over four hand-built pods (fake `/metrics` servers
//! with a given queue, KV usage and LoRA table; the prefix hit made by routing a request over
//! ext_proc first), then `epp explain` — the CLI against the replica's admin port — prints every
//! scorer's raw and weighted score per pod and the pick, and the dry run records nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chaos::epp::EppProcess;
use chaos::extproc::{answer, chat_request, header};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Prefix ×3, queue ×2, KV ×1, LoRA ×1 (the unit test `scheduling::explain` uses the same).
const CONFIG: &str = r#"
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {autoTune: false, blockSizeTokens: 64}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: lora-affinity-scorer
  - pluginRef: max-score-picker
"#;

/// A pod that only serves `/metrics`, whatever its text is at the moment.
async fn fake_pod(text: Arc<Mutex<String>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let text = text.clone();
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let body = text.lock().unwrap().clone();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

fn metrics(queue: u32, kv: f64, max_lora: u32, running: &str, waiting: &str) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\"}} {queue}\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} 1\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv}\n\
         # TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{{max_lora=\"{max_lora}\",\
         running_lora_adapters=\"{running}\",waiting_lora_adapters=\"{waiting}\"}} 1.7e9\n"
    )
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4}))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epp_explain_prints_every_plugins_scores_for_a_hand_built_pool() {
    let names = ["a", "b", "c", "d"];
    let texts: Vec<Arc<Mutex<String>>> = (0..4)
        .map(|_| Arc::new(Mutex::new(metrics(5, 0.9, 2, "x,y", ""))))
        .collect();
    // First only `a` looks good, so the first request goes there and its prefix is cached on `a`.
    *texts[0].lock().unwrap() = metrics(0, 0.0, 4, "m", "");
    let mut addrs = Vec::new();
    for t in &texts {
        addrs.push(fake_pod(t.clone()).await);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = String::from("pods:\n");
    for (n, a) in names.iter().zip(&addrs) {
        yaml += &format!(
            "  - name: {n}\n    address: {}\n    port: {}\n",
            a.ip(),
            a.port()
        );
    }
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, yaml).unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let epp = EppProcess::start(
        &endpoints,
        &[
            "--config-file",
            config.to_str().unwrap(),
            "--refresh-metrics-interval",
            "50ms",
        ],
    )
    .await
    .unwrap();
    let admin = format!("http://{}", epp.addrs.admin);

    // 64-token blocks of 4-byte estimate tokens: 256 bytes a block; the head is 8 blocks of the
    // 16-block prompt explained below.
    let text: String = (0..4096u32)
        .map(|i| (b'a' + (i % 23) as u8) as char)
        .collect();
    let mut msgs = chat_request(&completion(&text[..2048]), None);
    if let Some(Req::RequestHeaders(h)) = &mut msgs[0].request {
        for hv in &mut h.headers.as_mut().unwrap().headers {
            if hv.key == ":path" {
                *hv = header(":path", "/v1/completions");
            }
        }
    }
    let body = dir.path().join("body.json");
    std::fs::write(&body, completion(&text)).unwrap();
    let explain = |json: bool| {
        let mut cmd = std::process::Command::new(chaos::locate::epp_binary().unwrap());
        cmd.args(["explain", "--admin", &admin, "--path", "/v1/completions"]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.arg(&body).output().unwrap();
        assert!(
            out.status.success(),
            "epp explain: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let queues = |x: &serde_json::Value| -> Vec<f64> {
        x["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["waiting"].as_f64().unwrap_or(-1.0))
            .collect()
    };
    // Route only once every pod has been scraped (before that every pod looks the same and the
    // first request would cache its prefix anywhere).
    loop {
        let x: serde_json::Value = serde_json::from_str(&explain(true)).unwrap();
        if queues(&x) == [0.0, 5.0, 5.0, 5.0] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pods were never scraped: {x}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let routed = answer(epp.addrs.ext_proc, msgs).await.unwrap();
    assert_eq!(routed.destination, addrs[0].to_string());

    // The state to explain: each pod best at one thing.
    *texts[0].lock().unwrap() = metrics(4, 0.5, 4, "m", "");
    *texts[1].lock().unwrap() = metrics(0, 0.2, 4, "x", "");
    *texts[2].lock().unwrap() = metrics(2, 0.9, 2, "x,y", "m");
    *texts[3].lock().unwrap() = metrics(8, 0.0, 2, "x,y", "");
    let x = loop {
        let x: serde_json::Value = serde_json::from_str(&explain(true)).unwrap();
        if queues(&x) == [4.0, 0.0, 2.0, 8.0] {
            break x;
        }
        assert!(
            Instant::now() < deadline,
            "the new metrics were never scraped: {x}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let blocks: Vec<u64> = x["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prefix_blocks"].as_u64().unwrap())
        .collect();
    assert_eq!(blocks, [8, 0, 0, 0], "{x}");
    assert_eq!(x["picked"], serde_json::json!(["a"]), "{x}");

    // The printed tables: one row per pod, best total first, `raw → weighted` per scorer.
    let printed = explain(false);
    let rows: Vec<&str> = printed
        .lines()
        .skip_while(|l| !l.contains("prefix-cache-scorer ×3"))
        .skip(1)
        .take(4)
        .collect();
    let expect = [
        (
            "a",
            [
                "0.500 → 1.500",
                "0.500 → 1.000",
                "0.500 → 0.500",
                "1.000 → 1.000",
            ],
            "4.000",
        ),
        (
            "b",
            [
                "0.000 → 0.000",
                "1.000 → 2.000",
                "0.800 → 0.800",
                "0.800 → 0.800",
            ],
            "3.600",
        ),
        (
            "c",
            [
                "0.000 → 0.000",
                "0.750 → 1.500",
                "0.100 → 0.100",
                "0.600 → 0.600",
            ],
            "2.200",
        ),
        (
            "d",
            [
                "0.000 → 0.000",
                "0.000 → 0.000",
                "1.000 → 1.000",
                "0.000 → 0.000",
            ],
            "1.000",
        ),
    ];
    assert_eq!(rows.len(), 4, "{printed}");
    for (row, (pod, cells, total)) in rows.iter().zip(expect) {
        let cols: Vec<&str> = row
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        assert_eq!(cols[0], pod, "{printed}");
        assert_eq!(&cols[1..5], cells, "{printed}");
        assert_eq!(cols[5], total, "{printed}");
    }
    assert!(printed.ends_with("picked: a\n"), "{printed}");

    // Nothing was recorded: routing the same request again still sees the head's 8 blocks only
    // (a dry run that recorded its pick would have cached all 16 on `a`).
    let again: serde_json::Value = serde_json::from_str(&explain(true)).unwrap();
    assert_eq!(again["candidates"][0]["prefix_blocks"], 8, "{again}");

    // A body the router would refuse is refused the same way; a bad dry-run request is a 400.
    std::fs::write(&body, "{not json").unwrap();
    let out = std::process::Command::new(chaos::locate::epp_binary().unwrap())
        .args(["explain", "--admin", &admin])
        .arg(&body)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("400"), "{err}");
    let resp = reqwest::Client::new()
        .post(format!("{admin}/debug/schedule"))
        .body("[]")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    drop(epp);
}
