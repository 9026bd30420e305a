//! Multi-process consensus: three `epp serve` replicas in cluster mode on loopback, every peer
//! link behind a controllable proxy. They elect a leader and replicate the liveness heartbeats
//! (each replica commits one every 200 ms, so a moving commit index is proof of a working quorum);
//! then we kill the leader, restart it from its data directory, cut a follower off, and add a
//! fourth replica through `epp cluster add-learner` / `promote`; finally we kill -9 a majority and
//! restart it from disk. 1000 probes from each replica at once (`epp cluster probe`) are applied
//! in one order everywhere and survive the failover, the snapshot and the restart. Failover is
//! printed against the target (two election timeouts) and enforced at twice that, see
//! `chaos::raft::failover_hard_limit`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use chaos::raft::{RaftCluster, failover_hard_limit, failover_target};
use chaos::wait;

async fn commit(c: &RaftCluster, id: u64) -> u64 {
    c.leader_and_commit(id).await.map(|(_, n)| n).unwrap_or(0)
}

/// Wait until every replica in `ids` has committed past `floor`.
async fn all_commit_past(c: &RaftCluster, ids: &[u64], floor: u64, what: &str) {
    wait::until(what, Duration::from_secs(10), || async {
        for id in ids {
            if commit(c, *id).await <= floor {
                return false;
            }
        }
        true
    })
    .await
    .unwrap();
}

fn live_members(v: &serde_json::Value) -> Vec<u64> {
    v["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["live"] == true)
        .map(|m| m["id"].as_u64().unwrap())
        .collect()
}

fn applied_probes(v: &serde_json::Value) -> Vec<(u64, u64)> {
    serde_json::from_value(v["recent"].clone()).unwrap()
}

/// Runs `epp cluster probe --count n` against every replica in `ids` at once and returns the
/// probes in the order every replica applied them (checked identical on all of them).
async fn probe_all(c: &RaftCluster, ids: &[u64], n: u32) -> Vec<(u64, u64)> {
    let epp = chaos::locate::epp_binary().unwrap();
    let children: Vec<_> = ids
        .iter()
        .map(|id| {
            let admin = format!("http://{}", c.replica(*id).unwrap().addrs.admin);
            std::process::Command::new(&epp)
                .args(["cluster", "--admin", &admin, "probe", "--count"])
                .arg(n.to_string())
                .args(["--concurrency", "16"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (id, child) in ids.iter().zip(children) {
        let out = tokio::task::spawn_blocking(move || child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "probe on {id}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: serde_json::Value = serde_json::from_str(&text).unwrap();
        eprintln!(
            "replica {id}: {} probes committed in {:.0} ms ({:.0}/s), latency p50 {:.2} ms p99 {:.2} ms",
            r["committed"],
            r["elapsed_ms"].as_f64().unwrap(),
            r["per_second"].as_f64().unwrap(),
            r["latency_ms"]["p50"].as_f64().unwrap(),
            r["latency_ms"]["p99"].as_f64().unwrap()
        );
        assert_eq!(r["committed"], n, "replica {id}: {r}");
    }
    // Every replica applies them all (the followers may lag the leader a little) …
    let total = n as usize * ids.len();
    wait::until(
        "every replica applied every probe",
        Duration::from_secs(10),
        || async {
            for id in ids {
                match c.replica(*id).unwrap().cluster_probes().await {
                    Ok(v) if applied_probes(&v).len() >= total => {}
                    _ => return false,
                }
            }
            true
        },
    )
    .await
    .unwrap();
    // … in the same order, each exactly once.
    let mut orders = Vec::new();
    for id in ids {
        let v = c.replica(*id).unwrap().cluster_probes().await.unwrap();
        orders.push(applied_probes(&v));
    }
    for (id, o) in ids.iter().zip(&orders).skip(1) {
        assert_eq!(
            o, &orders[0],
            "replica {id} applied the probes in another order"
        );
    }
    let mut seen = orders[0].clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), total, "a probe applied twice");
    for id in ids {
        let mine: Vec<u64> = orders[0]
            .iter()
            .filter(|(n, _)| n == id)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(mine.len(), n as usize, "replica {id}'s probes");
    }
    orders.swap_remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_elect_fail_over_restart_partition_and_grow() {
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let mut c = RaftCluster::start(3, &endpoints).await.unwrap();

    // 1. A leader everyone agrees on; all three members live in the replicated state.
    wait::until("a common leader", Duration::from_secs(15), || async {
        c.agreed_leader(&[1, 2, 3]).await.is_some()
    })
    .await
    .unwrap();
    wait::until("three live members", Duration::from_secs(10), || async {
        c.view(1)
            .await
            .is_ok_and(|v| live_members(&v) == vec![1, 2, 3] && v["quorum"] == true)
    })
    .await
    .unwrap();
    let leader = c.agreed_leader(&[1, 2, 3]).await.unwrap();
    let before = commit(&c, leader).await;
    all_commit_past(&c, &[1, 2, 3], before, "replication to every replica").await;

    // 1b. 1000 proposals from each replica at once (`epp cluster probe`; the followers' are
    //     forwarded to the leader): all commit, and every replica applies all 3000 in one order.
    let probes = probe_all(&c, &[1, 2, 3], 1000).await;
    assert_eq!(probes.len(), 3000);

    // 2. kill -9 the leader: the survivors elect a new one within two election timeouts and
    //    keep committing; nothing committed before is lost.
    let committed = commit(&c, leader).await;
    let survivors: Vec<u64> = [1, 2, 3].into_iter().filter(|i| *i != leader).collect();
    c.kill9(leader).await.unwrap();
    let killed_at = Instant::now();
    let new_leader = loop {
        if let Some(l) = c.agreed_leader(&survivors).await
            && l != leader
        {
            break l;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(10),
            "no new leader 10 s after the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let failover = killed_at.elapsed();
    eprintln!(
        "leader {leader} killed: {new_leader} leads after {failover:?} (target {:?}: {})",
        failover_target(),
        if failover <= failover_target() {
            "met"
        } else {
            "MISSED"
        }
    );
    assert!(
        failover <= failover_hard_limit(),
        "new leader after {failover:?} (hard limit {:?})",
        failover_hard_limit()
    );
    all_commit_past(&c, &survivors, committed, "survivors keep committing").await;
    // The new leader's retries towards the dead node (openraft logs each one at WARN/ERROR) are
    // held back by the log rate limit, and counted.
    chaos::wait::until(
        "the new leader's repeated openraft warnings held back",
        Duration::from_secs(10),
        || async {
            let m = c
                .replica(new_leader)
                .unwrap()
                .metrics()
                .await
                .unwrap_or_default();
            chaos::epp::metric_sum(&m, "llm_d_epp_log_events_suppressed_total") > 0.0
        },
    )
    .await
    .unwrap();
    // Nothing committed before the kill is lost: the survivors still hold every probe, in order.
    for id in &survivors {
        let v = c.replica(*id).unwrap().cluster_probes().await.unwrap();
        assert_eq!(
            applied_probes(&v)[..probes.len()],
            probes[..],
            "replica {id} after the failover"
        );
    }

    // 3. Restart the old leader from its data directory: it rejoins and catches up.
    c.restart(leader).await.unwrap();
    let now = commit(&c, new_leader).await;
    all_commit_past(&c, &[leader], now, "restarted replica catches up").await;
    wait::until(
        "restarted replica live again",
        Duration::from_secs(10),
        || async {
            c.view(new_leader)
                .await
                .is_ok_and(|v| live_members(&v).contains(&leader))
        },
    )
    .await
    .unwrap();

    // 4. Cut one follower off: it cannot commit (and says so), the majority keeps committing;
    //    after healing it catches up.
    let cut = [1, 2, 3].into_iter().find(|i| *i != new_leader).unwrap();
    let majority: Vec<u64> = [1, 2, 3].into_iter().filter(|i| *i != cut).collect();
    c.isolate(cut);
    wait::until(
        "the cut replica reports no quorum",
        Duration::from_secs(10),
        || async { c.view(cut).await.is_ok_and(|v| v["quorum"] == false) },
    )
    .await
    .unwrap();
    let stuck = commit(&c, cut).await;
    let majority_then = commit(&c, majority[0]).await;
    all_commit_past(
        &c,
        &majority,
        majority_then + 10,
        "the majority keeps committing",
    )
    .await;
    assert!(
        commit(&c, cut).await <= stuck + 1,
        "a partitioned minority must not commit"
    );
    c.heal_all();
    let healed = commit(&c, majority[0]).await;
    all_commit_past(&c, &[cut], healed, "the healed replica catches up").await;
    wait::until(
        "healed replica regains quorum",
        Duration::from_secs(10),
        || async { c.view(cut).await.is_ok_and(|v| v["quorum"] == true) },
    )
    .await
    .unwrap();

    // 5. A fourth replica joins through the CLI: add-learner, then promote. The leader has
    //    compacted its log by then (snapshots every 20 entries), so it must send a snapshot.
    wait::until(
        "the leader compacted its log",
        Duration::from_secs(10),
        || async {
            c.view(new_leader)
                .await
                .is_ok_and(|v| v["raft"]["metrics"]["purged_index"].as_u64().is_some())
        },
    )
    .await
    .unwrap();
    c.start_joiner(4).await.unwrap();
    let admin = format!("http://{}", c.replica(cut).unwrap().addrs.admin);
    let epp = chaos::locate::epp_binary().unwrap();
    let run = |args: Vec<String>| {
        let out = std::process::Command::new(&epp)
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "epp {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let addr4 = c.public_addr(4).unwrap();
    run(vec![
        "cluster".into(),
        "--admin".into(),
        admin.clone(),
        "add-learner".into(),
        "--id".into(),
        "4".into(),
        "--addr".into(),
        addr4,
    ]);
    run(vec![
        "cluster".into(),
        "--admin".into(),
        admin.clone(),
        "promote".into(),
        "--id".into(),
        "4".into(),
    ]);
    let status = run(vec![
        "cluster".into(),
        "--admin".into(),
        admin.clone(),
        "status".into(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    let voters: Vec<u64> = v["raft"]["metrics"]["voters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(voters, vec![1, 2, 3, 4], "{status}");
    let at = commit(&c, new_leader).await;
    all_commit_past(&c, &[4], at, "the new replica applies the log").await;
    // Its first entries were purged on the leader: it caught up by snapshot.
    let v4 = c.view(4).await.unwrap();
    assert!(
        v4["raft"]["metrics"]["snapshot_index"].as_u64().is_some(),
        "replica 4 should hold a snapshot: {v4:#}"
    );
    let v4 = c.replica(4).unwrap().cluster_probes().await.unwrap();
    assert_eq!(
        applied_probes(&v4),
        probes,
        "the snapshot carries the probes"
    );
    // Both the new replica and the one `epp cluster members` asks below must have applied every
    // member's heartbeat (followers apply at their own pace).
    if let Err(e) = wait::until("four live members", Duration::from_secs(10), || async {
        let mut ok = true;
        for id in [4, cut] {
            ok &= c
                .view(id)
                .await
                .is_ok_and(|v| live_members(&v) == vec![1, 2, 3, 4]);
        }
        ok
    })
    .await
    {
        panic!(
            "{e}: replica 4 sees {:#}\nreplica {cut} sees {:#}",
            c.view(4).await.unwrap(),
            c.view(cut).await.unwrap()
        );
    }
    let members = run(vec![
        "cluster".into(),
        "--admin".into(),
        admin,
        "members".into(),
    ]);
    assert_eq!(members.lines().count(), 4, "{members}");

    // 6. Durability: kill -9 a majority (three of the four voters, the leader among them), then
    //    restart them from their data directories. Everything committed before survives: the
    //    cluster resumes past the last index a quorum acknowledged.
    let leader = c.agreed_leader(&[1, 2, 3, 4]).await.unwrap_or(new_leader);
    let acknowledged = commit(&c, leader).await;
    let keep = [1, 2, 3, 4].into_iter().find(|i| *i != leader).unwrap();
    let victims: Vec<u64> = [1, 2, 3, 4].into_iter().filter(|i| *i != keep).collect();
    for v in &victims {
        c.kill9(*v).await.unwrap();
    }
    for v in &victims {
        c.restart(*v).await.unwrap();
    }
    all_commit_past(
        &c,
        &[1, 2, 3, 4],
        acknowledged,
        "the restarted majority resumes past every acknowledged entry",
    )
    .await;
    wait::until(
        "every probe back on every restarted replica",
        Duration::from_secs(10),
        || async {
            let mut ok = true;
            for id in [1, 2, 3, 4] {
                ok &= c
                    .replica(id)
                    .unwrap()
                    .cluster_probes()
                    .await
                    .is_ok_and(|v| applied_probes(&v) == probes);
            }
            ok
        },
    )
    .await
    .unwrap();
    c.shutdown().await;
}
