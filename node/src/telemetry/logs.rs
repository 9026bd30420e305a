//! Log hygiene: a condition that is expected and repeats — a peer restarting makes openraft log
//! every failed replication RPC and vote request at `WARN`/`ERROR`, several times a second per
//! peer — is logged the first time, then at most once per [`QUIET_INTERVAL`] per call site; what
//! is held back is counted in `llm_d_epp_log_events_suppressed_total{target}` (the metrics room reads [`suppressed`]). The condition
//! itself has its own metrics and state (`llm_d_epp_cluster_quorum`, `/debug/cluster`).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::subscriber::Interest;
use tracing::{Level, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// How often one noisy call site may log.
pub const QUIET_INTERVAL: Duration = Duration::from_secs(30);

/// Targets whose warnings and errors are rate-limited: libraries that log each retry of a
/// condition our own code reports once (on the transition) and measures.
const NOISY: &[&str] = &["openraft"];

/// Events held back so far, by target.
static SUPPRESSED: LazyLock<Mutex<HashMap<String, u64>>> = LazyLock::new(Default::default);

/// What each target has had suppressed so far (cumulative).
pub fn suppressed() -> Vec<(String, u64)> {
    let map = SUPPRESSED.lock().unwrap_or_else(|e| e.into_inner());
    map.iter().map(|(k, v)| (k.clone(), *v)).collect()
}

fn noisy(meta: &Metadata<'_>) -> bool {
    meta.is_event()
        && *meta.level() <= Level::WARN
        && NOISY
            .iter()
            .any(|t| meta.target() == *t || meta.target().starts_with(&format!("{t}::")))
}

/// The log's per-layer filter: rate-limits noisy call sites and keeps the traces' spans out.
#[derive(Debug)]
pub struct Quiet {
    interval: Duration,
    /// Spans of this target are for traces, never for the log.
    spans_target: &'static str,
    last: Mutex<HashMap<Identifier, Instant>>,
}

impl Quiet {
    pub fn new(interval: Duration, spans_target: &'static str) -> Self {
        Quiet {
            interval,
            spans_target,
            last: Mutex::default(),
        }
    }

    /// Whether an event of `meta` logged at `now` may be written.
    fn allow(&self, meta: &Metadata<'_>, now: Instant) -> bool {
        if !noisy(meta) {
            return true;
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.get(&meta.callsite()) {
            Some(t) if now.saturating_duration_since(*t) < self.interval => {
                drop(last);
                let mut n = SUPPRESSED.lock().unwrap_or_else(|e| e.into_inner());
                match n.get_mut(meta.target()) {
                    Some(c) => *c += 1,
                    None => {
                        n.insert(meta.target().to_string(), 1);
                    }
                }
                false
            }
            _ => {
                last.insert(meta.callsite(), now);
                true
            }
        }
    }
}

impl<S> Filter<S> for Quiet {
    fn enabled(&self, meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        !(meta.is_span() && meta.target() == self.spans_target) && self.allow(meta, Instant::now())
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.is_span() && meta.target() == self.spans_target {
            // The request path's spans are for traces only.
            Interest::never()
        } else if noisy(meta) {
            // Asked per event: whether it may be written depends on when the last one was.
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Site;
    static SITE: Site = Site;
    impl tracing::Callsite for Site {
        fn set_interest(&self, _: Interest) {}
        fn metadata(&self) -> &Metadata<'_> {
            &META
        }
    }
    static META: Metadata<'static> = tracing::metadata!(
        name: "replication",
        target: "openraft::replication",
        level: Level::ERROR,
        fields: &[],
        callsite: &SITE,
        kind: tracing::metadata::Kind::EVENT
    );

    struct Other;
    static OTHER: Other = Other;
    impl tracing::Callsite for Other {
        fn set_interest(&self, _: Interest) {}
        fn metadata(&self) -> &Metadata<'_> {
            &OURS
        }
    }
    static OURS: Metadata<'static> = tracing::metadata!(
        name: "ours",
        target: "node::cluster",
        level: Level::ERROR,
        fields: &[],
        callsite: &OTHER,
        kind: tracing::metadata::Kind::EVENT
    );

    fn count() -> u64 {
        suppressed()
            .into_iter()
            .find(|(t, _)| t == "openraft::replication")
            .map_or(0, |(_, n)| n)
    }

    #[test]
    fn a_noisy_site_logs_once_per_interval_and_counts_the_rest() {
        let q = Quiet::new(Duration::from_secs(30), "epp::trace");
        let t0 = Instant::now();
        let before = count();
        assert!(q.allow(&META, t0), "the first one is written");
        for i in 1..=20 {
            assert!(!q.allow(&META, t0 + Duration::from_millis(50 * i)));
        }
        assert_eq!(count() - before, 20);
        assert!(
            q.allow(&META, t0 + Duration::from_secs(31)),
            "again after the interval"
        );
        // Our own events are never held back.
        for _ in 0..5 {
            assert!(q.allow(&OURS, t0));
        }
        let interest =
            tracing_subscriber::layer::Filter::<tracing_subscriber::Registry>::callsite_enabled(
                &q, &OURS,
            );
        assert!(interest.is_always());
    }
}
