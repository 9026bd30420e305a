//! End to end through Envoy: tenant mode (`--tenants-file`) — identity by API key, the tenant's
//! grants instead of the client's control headers, quotas before flow control, billing.
//!
//! Tenant A has 3× B's concurrency and tokens per minute. A runs as many clients as its
//! concurrency allows, B three times its own, for a minute; B's extra clients retry quickly on
//! 429. Checked from outside the EPP (what Envoy returned, the usage the pods reported): B gets
//! `rejected-quota-concurrency` 429s with `Retry-After` and A none (a response reaches the client
//! a moment before the observing ext_proc stream reports its end: A's clients resubmit at once
//! and must find the slot they just gave back); the tokens the pods served each tenant follow
//! 3:1 within 10%; every success carries the `x-ratelimit-*` headers. B's
//! spoofed objective and fairness id change nothing (the EPP's token metrics file B's requests
//! under B's granted id and priority). A tenant with a small token quota gets
//! `rejected-quota-tpm`; a streamed response the client cuts is billed the tokens generated
//! before the cut (the EPP asked the engine for cumulative usage on every chunk); requests without a key or with an unknown one get 401. Rotating a key in the
//! tenants file takes effect without a restart; a broken file is refused and changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chaos::cluster::{ClusterSpec, LocalCluster};
use serde_json::{Value, json};
use sim::{PodKnobs, SimConfig};

const KEY_A: &str = "key-of-team-a";
const KEY_B: &str = "key-of-team-b";
const KEY_C: &str = "key-of-team-c";
const MAX_TOKENS: u64 = 48;

fn tenants_yaml() -> String {
    let h = |k: &str| node::request::tenant::hash_key(k);
    format!(
        "\
apiVersion: epp.dev/v1alpha1
kind: TenantQuota
metadata: {{name: team-a}}
spec:
  apiKeys: [{{sha256: {}}}]
  objective: interactive
  limits: [{{model: '*', concurrency: 6, tokensPerMinute: 3000000, maxTokensCap: 400}}]
---
apiVersion: epp.dev/v1alpha1
kind: TenantQuota
metadata: {{name: team-b}}
spec:
  apiKeys: [{{sha256: {}}}]
  objective: batch
  limits: [{{model: '*', concurrency: 2, tokensPerMinute: 1000000, maxTokensCap: 400}}]
---
apiVersion: epp.dev/v1alpha1
kind: TenantQuota
metadata: {{name: team-c}}
spec:
  apiKeys: [{{sha256: {}}}]
  limits: [{{model: '*', tokensPerMinute: 1500, defaultMaxTokens: 16}}]
",
        h(KEY_A),
        h(KEY_B),
        h(KEY_C)
    )
}

fn body(prompt: &str, max_tokens: Option<u64>, stream: bool) -> Value {
    let mut v = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
    });
    if let Some(m) = max_tokens {
        v["max_tokens"] = json!(m);
    }
    v
}

fn prompt(words: usize, salt: u64) -> String {
    (0..words)
        .map(|i| format!("w{}", (i as u64 * 31 + salt) % 997))
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    tokens: AtomicU64,
    quota_429: AtomicU64,
    other: AtomicU64,
    missing_headers: AtomicU64,
    missing_retry_after: AtomicU64,
}

/// A closed-loop client of one tenant until `until`: a 429 is retried after 20 ms.
async fn client(
    url: String,
    key: &'static str,
    spoof: bool,
    salt: u64,
    until: Instant,
    tally: Arc<Tally>,
) {
    let http = reqwest::Client::new();
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let mut req = http.post(&url).bearer_auth(key).json(&body(
            &prompt(120, salt * 1000 + n),
            Some(MAX_TOKENS),
            false,
        ));
        if spoof {
            req = req
                .header("x-llm-d-inference-objective", "interactive")
                .header("x-llm-d-inference-fairness-id", "team-a");
        }
        let Ok(resp) = req.send().await else {
            tally.other.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap_or_default();
        match status {
            200 => {
                let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                let u = &v["usage"];
                let t = u["prompt_tokens"].as_u64().unwrap_or(0)
                    + u["completion_tokens"].as_u64().unwrap_or(0);
                tally.ok.fetch_add(1, Ordering::Relaxed);
                tally.tokens.fetch_add(t, Ordering::Relaxed);
                if !headers.contains_key("x-ratelimit-remaining-tokens")
                    || !headers.contains_key("x-ratelimit-limit-tokens")
                {
                    tally.missing_headers.fetch_add(1, Ordering::Relaxed);
                }
            }
            429 if headers
                .get("x-llm-d-request-dropped-reason")
                .is_some_and(|v| v == "rejected-quota-concurrency") =>
            {
                tally.quota_429.fetch_add(1, Ordering::Relaxed);
                if !headers.contains_key("retry-after") {
                    tally.missing_retry_after.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ => {
                eprintln!("unexpected {status}: {text}");
                tally.other.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

async fn start(dir: &std::path::Path) -> LocalCluster {
    let tenants = dir.join("tenants.yaml");
    std::fs::write(&tenants, tenants_yaml()).unwrap();
    let objectives = dir.join("objectives.yaml");
    std::fs::write(
        &objectives,
        chaos::workloads::objectives_yaml(&[("interactive", 10), ("batch", -10)]),
    )
    .unwrap();
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 4,
            knobs: PodKnobs {
                max_num_seqs: 16,
                decode_ms_per_token: 4.0,
                // Four tokens a streamed chunk (vLLM's --stream-interval): counting chunks
                // would under-bill a cut stream; the usage on every chunk does not.
                stream_interval: 4,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        epp_args: vec![
            "--tenants-file".into(),
            tenants.display().to_string(),
            "--objectives-file".into(),
            objectives.display().to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .expect("cluster starts");
    c.wait_for_pods().await.unwrap();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_get_their_quota_share_and_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(dir.path()).await;
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let http = reqwest::Client::new();

    // Identity: no key, an unknown key → 401 (the request reaches no pod).
    for key in [None, Some("not-a-key")] {
        let mut req = http.post(&url).json(&body("hi", Some(4), false));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{key:?}");
        assert!(r.headers().contains_key("www-authenticate"));
    }

    // A cut stream is billed what was generated: 400 tokens asked, the client leaves after a
    // few events of four tokens (the pods decode 4 ms a token: the full answer would take 1.6 s).
    let mut resp = http
        .post(&url)
        .bearer_auth(KEY_A)
        .json(&body(&prompt(40, 7), Some(400), true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    // Tenant mode asks the engine for cumulative usage on every chunk (the client did not).
    let (mut events, mut text, mut seen_output) = (0, String::new(), Vec::new());
    while events < 10 {
        let chunk = resp.chunk().await.unwrap().expect("the stream goes on");
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let event: String = text.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            events += 1;
            let v: Value = serde_json::from_str(data).unwrap();
            seen_output.push(v["usage"]["completion_tokens"].as_u64().expect(data));
        }
    }
    drop(resp);
    let last_seen = *seen_output.last().unwrap();
    assert!(
        seen_output.windows(2).all(|w| w[0] <= w[1]) && last_seen >= 4 * 8,
        "{seen_output:?}"
    );
    let epp = c.epp(0).unwrap();
    let ledger = || async {
        let v = epp.admin_json("/debug/usage").await.unwrap();
        v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["tenant"] == "team-a")
            .fold((0, 0, 0), |(req, out, cut), r| {
                (
                    req + r["requests"].as_u64().unwrap(),
                    out + r["output"].as_u64().unwrap(),
                    cut + r["disconnects"].as_u64().unwrap(),
                )
            })
    };
    chaos::wait::until(
        "the cut stream settled",
        Duration::from_secs(10),
        || async { ledger().await.0 == 1 },
    )
    .await
    .unwrap();
    let (_, output, cut) = ledger().await;
    println!(
        "cut stream: {events} events read, the last with {last_seen} output tokens; \
         {output} output tokens billed"
    );
    assert_eq!(cut, 1, "billed as a disconnect");
    assert!(
        (last_seen..300).contains(&output),
        "billed {output} output tokens for a stream cut after {events} events of 400 \
         (the last usage the client saw: {last_seen})"
    );

    // A small token quota: 1500 a minute, ~1 token per 4 prompt characters + the default 16.
    let mut remaining = Vec::new();
    let tpm_429 = loop {
        let r = http
            .post(&url)
            .header("x-api-key", KEY_C)
            .json(&body(&prompt(60, remaining.len() as u64), None, false))
            .send()
            .await
            .unwrap();
        let h = r.headers().clone();
        if r.status().as_u16() == 429 {
            break h;
        }
        assert_eq!(r.status().as_u16(), 200);
        remaining.push(
            h["x-ratelimit-remaining-tokens"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap(),
        );
        assert!(remaining.len() < 40, "no tpm 429 after {remaining:?}");
    };
    println!("team-c remaining tokens after each request: {remaining:?}");
    assert!(remaining.windows(2).all(|w| w[1] < w[0]), "{remaining:?}");
    assert_eq!(
        tpm_429["x-llm-d-request-dropped-reason"],
        "rejected-quota-tpm"
    );
    assert_eq!(tpm_429["x-ratelimit-limit-tokens"], "1500");
    assert!(
        tpm_429["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );

    // A and B saturate their concurrency for a minute; B spoofs A's objective and fairness id.
    let until = Instant::now() + Duration::from_secs(60);
    let (a, b) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let mut tasks = Vec::new();
    for i in 0..6 {
        tasks.push(tokio::spawn(client(
            url.clone(),
            KEY_A,
            false,
            i,
            until,
            a.clone(),
        )));
    }
    for i in 0..6 {
        tasks.push(tokio::spawn(client(
            url.clone(),
            KEY_B,
            true,
            100 + i,
            until,
            b.clone(),
        )));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let get = |t: &Tally| {
        (
            t.ok.load(Ordering::Relaxed),
            t.tokens.load(Ordering::Relaxed),
            t.quota_429.load(Ordering::Relaxed),
            t.other.load(Ordering::Relaxed),
        )
    };
    let (a_ok, a_tokens, a_429, a_other) = get(&a);
    let (b_ok, b_tokens, b_429, b_other) = get(&b);
    let ratio = a_tokens as f64 / b_tokens.max(1) as f64;
    println!(
        "A: {a_ok} ok, {a_tokens} tokens, {a_429} quota 429s; B: {b_ok} ok, {b_tokens} tokens, \
         {b_429} quota 429s; tokens A:B = {ratio:.3}"
    );
    assert_eq!((a_other, b_other), (0, 0));
    assert_eq!(a_429, 0, "A: {a_429} quota 429s for {a_ok} requests");
    assert!(b_429 > 0, "B never hit its concurrency quota");
    assert!((2.7..=3.3).contains(&ratio), "tokens A:B = {ratio:.3}");
    for t in [&a, &b] {
        assert_eq!(t.missing_headers.load(Ordering::Relaxed), 0);
        assert_eq!(t.missing_retry_after.load(Ordering::Relaxed), 0);
    }

    // B's spoofed headers counted for nothing: its requests ran under its own grants.
    let m = epp.metrics().await.unwrap();
    let series = |fairness: &str, priority: &str| {
        m.lines().any(|l| {
            l.starts_with("llm_d_epp_request_input_tokens_count{")
                && l.contains(&format!("fairness_id=\"{fairness}\""))
                && l.contains(&format!("priority=\"{priority}\""))
        })
    };
    assert!(series("team-b", "-10") && series("team-a", "10"));
    assert!(!series("team-b", "10") && !series("team-a", "-10"));
    // The quota metrics agree with what the clients saw.
    let quota_429 = m
        .lines()
        .filter(|l| {
            l.starts_with("llm_d_epp_tenant_requests_total{")
                && l.contains("team-b")
                && l.contains("rejected-quota-concurrency")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert_eq!(quota_429 as u64, b_429);
    // And the refusals by reason (what the dashboard's "Refused by reason" panel plots) too.
    let refused = chaos::epp::metric_sum(
        &m,
        "llm_d_epp_request_refusals_total{status=\"429\",reason=\"rejected-quota-concurrency\"}",
    );
    assert_eq!(refused as u64, a_429 + b_429);

    // Key rotation: B's key replaced in the file, re-read while running.
    let tenants = dir.path().join("tenants.yaml");
    let hash = node::request::tenant::hash_key;
    std::fs::write(
        &tenants,
        tenants_yaml().replace(&hash(KEY_B), &hash("key-of-team-b-v2")),
    )
    .unwrap();
    let status = |key: &'static str| {
        let http = http.clone();
        let url = url.clone();
        async move {
            http.post(&url)
                .bearer_auth(key)
                .json(&body("rotated", Some(4), false))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    chaos::wait::until(
        "the new key is accepted",
        Duration::from_secs(10),
        || async { status("key-of-team-b-v2").await == 200 },
    )
    .await
    .unwrap();
    assert_eq!(status(KEY_B).await, 401, "the old key is gone");
    // A broken file is refused: the tenants stay as they were.
    std::fs::write(&tenants, "apiVersion: [broken").unwrap();
    chaos::wait::until(
        "the broken file refused",
        Duration::from_secs(10),
        || async {
            let m = epp.metrics().await.unwrap();
            m.lines().any(|l| {
                l.starts_with("llm_d_epp_tenant_config_reloads_total{")
                    && l.contains("error")
                    && !l.ends_with(" 0")
            })
        },
    )
    .await
    .unwrap();
    assert_eq!(status("key-of-team-b-v2").await, 200);
    assert_eq!(status(KEY_A).await, 200);
}
