//! The admin port's authorization, from outside: with `--admin-token-file`, a mutating call
//! (`POST /debug/cluster/probe`) without the token or with a wrong one is refused (401, counted)
//! and commits nothing; with it — over HTTP or through `epp cluster --admin-token-file` — it
//! commits. The scheduling dry run (`POST /debug/schedule`) is refused the same way. Without a token file, localhost may call (the rest of the suite relies on that).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chaos::raft::RaftCluster;

async fn probe(admin: std::net::SocketAddr, token: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new()
        .post(format!("http://{admin}/debug/cluster/probe"))
        .json(&serde_json::json!({"count": 3, "concurrency": 1}));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn applied(c: &RaftCluster) -> usize {
    let v = c.replica(1).unwrap().cluster_probes().await.unwrap();
    v["applied"].as_u64().unwrap() as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutating_admin_calls_need_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "correct-horse\n").unwrap();
    let token_arg = token.display().to_string();
    let c = RaftCluster::start_with(1, &endpoints, &["--admin-token-file", &token_arg])
        .await
        .unwrap();
    let admin = c.replica(1).unwrap().addrs.admin;
    chaos::wait::until("a leader", std::time::Duration::from_secs(15), || async {
        c.agreed_leader(&[1]).await.is_some()
    })
    .await
    .unwrap();

    for bad in [None, Some("wrong"), Some("correct-hors")] {
        let (status, body) = probe(admin, bad).await;
        assert_eq!(status, 401, "{bad:?}: {body}");
    }
    assert_eq!(applied(&c).await, 0, "a refused call commits nothing");
    let metrics = c.replica(1).unwrap().metrics().await.unwrap();
    assert!(
        metrics.contains(
            "llm_d_epp_untrusted_values_rejected_total{source=\"admin\",field=\"authorization\"} 3"
        ),
        "refusals are counted"
    );
    // With a token configured the views need it too: they show the pool and the cluster.
    for view in [
        "/debug/cluster",
        "/debug/cluster/probes",
        "/debug/inflight",
        "/debug/scrape",
    ] {
        let r = reqwest::get(format!("http://{admin}{view}")).await.unwrap();
        assert_eq!(r.status(), 401, "{view} without the token");
    }

    // The scheduling dry run shows every pod's state: it needs the token too.
    let dry_run = |token: Option<&'static str>| {
        let mut req = reqwest::Client::new()
            .post(format!("http://{admin}/debug/schedule"))
            .json(&serde_json::json!({"body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    assert_eq!(dry_run(None).await.unwrap().status(), 401);
    let resp = dry_run(Some("correct-horse")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let x: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(x["error"], "no candidate endpoints", "{x}");

    let (status, body) = probe(admin, Some("correct-horse")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(applied(&c).await, 3);

    // The CLI sends the token from its file; without it the same command fails.
    let epp = chaos::locate::epp_binary().unwrap();
    let run = |with_token: bool| {
        let mut cmd = std::process::Command::new(&epp);
        cmd.args(["cluster", "--admin", &format!("http://{admin}")]);
        if with_token {
            cmd.args(["--admin-token-file", &token_arg]);
        }
        cmd.args(["probe", "--count", "2"]).output().unwrap()
    };
    let refused = run(false);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("401"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let ok = run(true);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(applied(&c).await, 5);
}
