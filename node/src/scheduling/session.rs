//! `session-affinity-scorer` and `session-affinity-filter`: a session's requests go to the pod
//! that served it before — as a soft preference (scorer: 1 for that pod, 0 for the others) or a
//! hard pin (filter: only that pod when it is a candidate, else everyone).
//!
//! Two strategies, as llm-d:
//! - `encoded_endpoint_header` (default, stateless): the request header (`x-session-token`) holds
//!   base64 of `namespace/name` of the pod; the token of the pod picked now is written back on the
//!   response. The EPP hands it to Envoy in the `envoy.lb` dynamic metadata under the header's
//!   name, and the route's `response_headers_to_add` sets it (see `deploy/local/envoy.template.yaml`)
//!   — the response path stays observe-only. Stateless, so it works across Active-Active replicas.
//! - `session_id` (stateful): an opaque id from configured sources (headers, the `agent-identity`
//!   attribute, or the `session-id` attribute a `session-id-producer` reads from a header or a
//!   cookie) bound server-side to the pod that served it, dropped after `evictionTtlSeconds`
//!   unused. An unbound session expresses no preference; a bound one whose pod is not a candidate
//!   migrates to the pod the request is routed to. The bindings live in this replica.
//!
//! Both parameter generations of llm-d decode: the current `strategy` +
//! `encodedEndpointHeaderConfig` / `sessionIdConfig`, and the scorer's earlier `algorithm`
//! (`encoded_endpoint_header` | `session_id_header`) + `headerName`, `evictionTtlSeconds`,
//! `evictionSweepSeconds`, `missThreshold`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde::Deserialize;

use super::{Filter, RequestData, SchedRequest, Scorer};
use crate::config::ConfigError;
use crate::datalayer::store::Candidate;
use crate::request::meta::AgentIdentity;

pub const SCORER_TYPE: &str = "session-affinity-scorer";
pub const FILTER_TYPE: &str = "session-affinity-filter";
pub const DEFAULT_TOKEN_HEADER: &str = "x-session-token";
pub const DEFAULT_SESSION_ID_HEADER: &str = "x-session-id";
/// The request attribute holding the agent's session id ([`AgentIdentity`]).
pub const AGENT_IDENTITY: &str = "agent-identity";
/// The request attribute a `session-id-producer` writes ([`SessionIdSource`]).
pub const SESSION_ID_ATTRIBUTE: &str = "session-id";
/// llm-d's `session-id-producer` (its default instance name too).
pub const SESSION_ID_PRODUCER: &str = "session-id-producer";
/// Namespace of pod names in tokens (endpoints come from a file, without Kubernetes namespaces).
const TOKEN_NAMESPACE: &str = "default";

/// Both parameter generations; [`SessionParams::resolve`] checks they are not mixed.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SessionParams {
    strategy: Option<String>,
    encoded_endpoint_header_config: Option<EncodedConfig>,
    session_id_config: Option<SessionIdConfig>,
    profile_name: Option<String>,
    algorithm: Option<String>,
    header_name: Option<String>,
    eviction_ttl_seconds: Option<f64>,
    eviction_sweep_seconds: Option<f64>,
    miss_threshold: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EncodedConfig {
    header: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SessionIdConfig {
    #[serde(default)]
    sources: Vec<SourceSpec>,
    eviction_ttl_seconds: Option<f64>,
    eviction_sweep_seconds: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceSpec {
    header: Option<String>,
    attribute: Option<String>,
    producer: Option<String>,
}

/// Where a session id is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Header(String),
    AgentIdentity,
    /// The `session-id` attribute of the named `session-id-producer` instance.
    Produced(String),
}

/// `session-id-producer` parameters: exactly one of them.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SessionIdProducerParams {
    header_name: Option<String>,
    cookie_name: Option<String>,
}

/// What a `session-id-producer` reads: a request header, or a cookie of the `cookie` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionIdSource {
    Header(String),
    Cookie(String),
}

impl SessionIdProducerParams {
    pub fn source(&self, path: &str) -> Result<SessionIdSource, ConfigError> {
        fn set(v: &Option<String>) -> Option<&str> {
            v.as_deref().map(str::trim).filter(|v| !v.is_empty())
        }
        match (set(&self.header_name), set(&self.cookie_name)) {
            (Some(h), None) => Ok(SessionIdSource::Header(header_name(h))),
            (None, Some(c)) => Ok(SessionIdSource::Cookie(c.to_string())),
            _ => Err(invalid(
                path,
                "exactly one of headerName or cookieName must be set",
            )),
        }
    }
}

impl SessionIdSource {
    /// The session id the request carries (trimmed; an empty one is none). A cookie is the first
    /// `name=value` pair of that exact name.
    pub fn read<'a>(&self, headers: &'a HashMap<String, String>) -> Option<&'a str> {
        let v = match self {
            SessionIdSource::Header(h) => headers.get(h)?.trim(),
            SessionIdSource::Cookie(name) => {
                headers.get("cookie")?.split(';').find_map(|pair| {
                    let (k, v) = pair.trim().split_once('=')?;
                    (k == name).then_some(v.trim())
                })?
            }
        };
        (!v.is_empty()).then_some(v)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum StrategySpec {
    Encoded {
        header: String,
    },
    SessionId {
        sources: Vec<Source>,
        ttl: Duration,
        sweep: Duration,
        /// Consecutive requests the bound pod may be missing before the session migrates.
        miss_threshold: u32,
    },
}

fn invalid(path: &str, msg: impl std::fmt::Display) -> ConfigError {
    ConfigError::invalid(format!("{path}: {msg}"))
}

fn seconds(v: Option<f64>, default: f64, path: &str, key: &str) -> Result<Duration, ConfigError> {
    // Unset or 0 → the default, as llm-d.
    let s = v.filter(|s| *s != 0.0).unwrap_or(default);
    if !s.is_finite() || s <= 0.0 {
        return Err(invalid(path, format!("{key} must be > 0, got {s}")));
    }
    Ok(Duration::from_secs_f64(s))
}

fn header_name(h: &str) -> String {
    h.trim().to_ascii_lowercase()
}

impl SessionParams {
    /// The strategy these parameters select (llm-d's defaults applied) and the profile name.
    pub fn resolve(&self, path: &str) -> Result<(StrategySpec, Option<String>), ConfigError> {
        let earlier = self.algorithm.is_some()
            || self.header_name.is_some()
            || self.eviction_ttl_seconds.is_some()
            || self.eviction_sweep_seconds.is_some()
            || self.miss_threshold.is_some();
        let current = self.strategy.is_some()
            || self.encoded_endpoint_header_config.is_some()
            || self.session_id_config.is_some();
        if earlier && current {
            return Err(invalid(
                path,
                "mixes the current parameters (strategy, encodedEndpointHeaderConfig, \
                 sessionIdConfig) with the earlier ones (algorithm, headerName, \
                 evictionTtlSeconds, evictionSweepSeconds, missThreshold)",
            ));
        }
        let profile = self.profile_name.clone().filter(|p| !p.is_empty());
        if earlier {
            let header = header_name(self.header_name.as_deref().unwrap_or(DEFAULT_TOKEN_HEADER));
            let spec = match self
                .algorithm
                .as_deref()
                .unwrap_or("encoded_endpoint_header")
            {
                "encoded_endpoint_header" => StrategySpec::Encoded { header },
                "session_id_header" => {
                    let miss = self.miss_threshold.unwrap_or(0);
                    if miss < 0 {
                        return Err(invalid(
                            path,
                            format!("missThreshold must be >= 0, got {miss}"),
                        ));
                    }
                    StrategySpec::SessionId {
                        // The id rides in the same header, else the agent's session.
                        sources: vec![Source::Header(header), Source::AgentIdentity],
                        ttl: seconds(self.eviction_ttl_seconds, 600.0, path, "evictionTtlSeconds")?,
                        sweep: seconds(
                            self.eviction_sweep_seconds,
                            30.0,
                            path,
                            "evictionSweepSeconds",
                        )?,
                        miss_threshold: if miss == 0 { 3 } else { miss as u32 },
                    }
                }
                other => {
                    return Err(invalid(
                        path,
                        format!(
                            "algorithm must be `encoded_endpoint_header` or `session_id_header`, got `{other}`"
                        ),
                    ));
                }
            };
            return Ok((spec, profile));
        }
        let spec = match self
            .strategy
            .as_deref()
            .unwrap_or("encoded_endpoint_header")
        {
            "encoded_endpoint_header" => StrategySpec::Encoded {
                header: header_name(
                    self.encoded_endpoint_header_config
                        .as_ref()
                        .and_then(|c| c.header.as_deref())
                        .filter(|h| !h.trim().is_empty())
                        .unwrap_or(DEFAULT_TOKEN_HEADER),
                ),
            },
            "session_id" => {
                let c = self.session_id_config.clone().unwrap_or_default();
                let mut sources = Vec::new();
                for (i, s) in c.sources.iter().enumerate() {
                    let at = format!("{path}.sessionIdConfig.sources[{i}]");
                    sources.push(match (&s.header, &s.attribute) {
                        (Some(h), None) if !h.trim().is_empty() => Source::Header(header_name(h)),
                        (None, Some(a)) if a == AGENT_IDENTITY => {
                            match s.producer.as_deref() {
                                None | Some("") | Some(AGENT_IDENTITY) => Source::AgentIdentity,
                                Some(p) => {
                                    return Err(invalid(
                                        &at,
                                        format!("producer `{p}` is not built; leave it empty"),
                                    ));
                                }
                            }
                        }
                        (None, Some(a)) if a == SESSION_ID_ATTRIBUTE => Source::Produced(
                            s.producer
                                .as_deref()
                                .filter(|p| !p.is_empty())
                                .unwrap_or(SESSION_ID_PRODUCER)
                                .to_string(),
                        ),
                        (None, Some(a)) => {
                            return Err(invalid(
                                &at,
                                format!(
                                    "attribute `{a}` is not produced by this build (supported: `{AGENT_IDENTITY}`, `{SESSION_ID_ATTRIBUTE}`)"
                                ),
                            ));
                        }
                        _ => return Err(invalid(&at, "exactly one of header or attribute must be set")),
                    });
                }
                if sources.is_empty() {
                    sources.push(Source::Header(DEFAULT_SESSION_ID_HEADER.into()));
                }
                StrategySpec::SessionId {
                    sources,
                    ttl: seconds(c.eviction_ttl_seconds, 300.0, path, "evictionTtlSeconds")?,
                    sweep: seconds(c.eviction_sweep_seconds, 10.0, path, "evictionSweepSeconds")?,
                    miss_threshold: 1,
                }
            }
            other => {
                return Err(invalid(
                    path,
                    format!(
                        "strategy must be `encoded_endpoint_header` or `session_id`, got `{other}`"
                    ),
                ));
            }
        };
        Ok((spec, profile))
    }
}

struct Binding {
    pod: String,
    last_seen: Instant,
    misses: u32,
}

/// Most session bindings one replica holds: ids are client strings, so a client inventing a new
/// one per request must not grow the map without bound. When full (after dropping the expired),
/// new sessions are not bound — existing ones keep their pods — and a warning is logged.
pub const MAX_SESSIONS: usize = 100_000;

#[derive(Default)]
struct Bindings {
    /// By a 128-bit hash of the session id: a fixed size per binding, whatever the id's length.
    map: HashMap<u128, Binding>,
    last_sweep: Option<Instant>,
    /// The map was found full (warned once per episode).
    full: bool,
}

fn session_key(id: &str) -> u128 {
    xxhash_rust::xxh3::xxh3_128(id.as_bytes())
}

/// One configured instance (scorer or filter).
pub struct SessionAffinity {
    type_name: &'static str,
    pub spec: StrategySpec,
    /// `profileName`: pin the pod of that profile (e.g. the prefill pick); default the primary.
    pub profile: Option<String>,
    bindings: Mutex<Bindings>,
    /// The `agent-identity` plugin's headers (its built-in ones when none is configured).
    agent: std::sync::OnceLock<AgentIdentity>,
    /// The configuration's `session-id-producer` instances, by name.
    producers: std::sync::OnceLock<HashMap<String, SessionIdSource>>,
}

impl std::fmt::Debug for SessionAffinity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionAffinity")
            .field("type", &self.type_name)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

/// `base64(namespace/name)` of a pod.
pub fn encode_token(pod: &str) -> String {
    let full = if pod.contains('/') {
        pod.to_string()
    } else {
        format!("{TOKEN_NAMESPACE}/{pod}")
    };
    base64::engine::general_purpose::STANDARD.encode(full)
}

/// The pod name a token names (any namespace), if it decodes.
fn decode_token(token: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(token.trim())
        .ok()?;
    let s = String::from_utf8(bytes).ok()?;
    let name = s.rsplit('/').next()?;
    (!name.is_empty()).then(|| name.to_string())
}

impl SessionAffinity {
    pub fn new(
        type_name: &'static str,
        params: &SessionParams,
        path: &str,
    ) -> Result<SessionAffinity, ConfigError> {
        let (spec, profile) = params.resolve(path)?;
        Ok(SessionAffinity {
            type_name,
            spec,
            profile,
            bindings: Mutex::new(Bindings::default()),
            agent: std::sync::OnceLock::new(),
            producers: std::sync::OnceLock::new(),
        })
    }

    pub fn is_filter(&self) -> bool {
        self.type_name == FILTER_TYPE
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Bindings> {
        match self.bindings.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Read the `agent-identity` source with the configured plugin's headers (set once, when
    /// the configuration is built).
    pub fn use_agent_identity(&self, agent: AgentIdentity) {
        let _ = self.agent.set(agent);
    }

    /// Read `session-id` sources with the configuration's `session-id-producer` instances (set
    /// once, when the configuration is built); the producer names they miss.
    pub fn use_session_id_producers(
        &self,
        producers: HashMap<String, SessionIdSource>,
    ) -> Vec<String> {
        let missing = match &self.spec {
            StrategySpec::SessionId { sources, .. } => sources
                .iter()
                .filter_map(|s| match s {
                    Source::Produced(p) if !producers.contains_key(p) => Some(p.clone()),
                    _ => None,
                })
                .collect(),
            StrategySpec::Encoded { .. } => Vec::new(),
        };
        let _ = self.producers.set(producers);
        missing
    }

    fn session_id<'a>(&self, req: &'a SchedRequest<'_>, sources: &[Source]) -> Option<&'a str> {
        sources.iter().find_map(|s| match s {
            Source::Header(h) => req
                .headers
                .get(h)
                .map(|v| v.trim())
                .filter(|v| !v.is_empty()),
            Source::AgentIdentity => match self.agent.get() {
                Some(a) => a.session(req.headers),
                None => AgentIdentity::default().session(req.headers),
            },
            Source::Produced(name) => self.producers.get()?.get(name)?.read(req.headers),
        })
    }

    /// The pod (name) this request's session points at, if any.
    fn session_pod(&self, req: &SchedRequest<'_>) -> Option<String> {
        match &self.spec {
            StrategySpec::Encoded { header } => {
                req.headers.get(header).and_then(|t| decode_token(t))
            }
            StrategySpec::SessionId { sources, .. } => {
                let id = self.session_id(req, sources)?;
                self.lock().map.get(&session_key(id)).map(|b| b.pod.clone())
            }
        }
    }

    /// The index among `idx` of the session's pod, if it is a candidate.
    fn target(
        &self,
        req: &SchedRequest<'_>,
        candidates: &[Candidate],
        idx: &[usize],
    ) -> Option<usize> {
        let pod = self.session_pod(req)?;
        idx.iter()
            .copied()
            .find(|i| candidates[*i].endpoint.name == pod)
    }

    /// Which of the request's picks this instance pins.
    pub fn pinned(
        &self,
        prefill_profile: Option<&str>,
        primary: usize,
        prefill: Option<usize>,
    ) -> Option<usize> {
        match (&self.profile, prefill_profile) {
            (Some(p), Some(pp)) if p == pp => prefill,
            _ => Some(primary),
        }
    }

    /// The request was routed (`pod` = the pinned pick): bind, refresh or migrate its session.
    pub fn pre_request(&self, req: &SchedRequest<'_>, candidates: &[Candidate], pod: usize) {
        let StrategySpec::SessionId {
            sources,
            ttl,
            sweep,
            miss_threshold,
        } = &self.spec
        else {
            return;
        };
        let Some(id) = self.session_id(req, sources) else {
            return;
        };
        let Some(picked) = candidates.get(pod).map(|c| c.endpoint.name.as_str()) else {
            return;
        };
        let now = Instant::now();
        let mut b = self.lock();
        if b.last_sweep.is_none_or(|t| now.duration_since(t) >= *sweep) {
            b.map.retain(|_, v| now.duration_since(v.last_seen) <= *ttl);
            b.last_sweep = Some(now);
        }
        let key = session_key(id);
        match b.map.get_mut(&key) {
            Some(e) if e.pod == picked => {
                e.last_seen = now;
                e.misses = 0;
            }
            Some(e) => {
                // Migrate only when the bound pod was not a candidate (not merely outscored),
                // `miss_threshold` times in a row.
                if candidates.iter().any(|c| c.endpoint.name == e.pod) {
                    e.last_seen = now;
                    e.misses = 0;
                } else {
                    e.misses += 1;
                    if e.misses >= *miss_threshold {
                        *e = Binding {
                            pod: picked.to_string(),
                            last_seen: now,
                            misses: 0,
                        };
                    }
                }
            }
            None => {
                if b.map.len() >= MAX_SESSIONS {
                    b.map.retain(|_, v| now.duration_since(v.last_seen) <= *ttl);
                    if b.map.len() >= MAX_SESSIONS {
                        if !std::mem::replace(&mut b.full, true) {
                            tracing::warn!(
                                bindings = b.map.len(),
                                "session affinity: {MAX_SESSIONS} live sessions, new ones are \
                                 not bound until some expire"
                            );
                        }
                        return;
                    }
                }
                b.full = false;
                b.map.insert(
                    key,
                    Binding {
                        pod: picked.to_string(),
                        last_seen: now,
                        misses: 0,
                    },
                );
            }
        }
    }

    /// `(header, token)` to write back on the response for pod `pod` (encoded strategy only).
    pub fn response_token(&self, candidates: &[Candidate], pod: usize) -> Option<(String, String)> {
        match &self.spec {
            StrategySpec::Encoded { header } => candidates
                .get(pod)
                .map(|c| (header.clone(), encode_token(&c.endpoint.name))),
            StrategySpec::SessionId { .. } => None,
        }
    }

    /// Live session bindings (session_id strategy).
    pub fn bindings(&self) -> usize {
        self.lock().map.len()
    }
}

impl Scorer for SessionAffinity {
    fn type_name(&self) -> &'static str {
        self.type_name
    }

    fn score(
        &self,
        req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let target = self.target(req, candidates, idx);
        for (o, i) in out.iter_mut().zip(idx) {
            *o = if Some(*i) == target { 1.0 } else { 0.0 };
        }
    }
}

impl Filter for SessionAffinity {
    fn type_name(&self) -> &'static str {
        self.type_name
    }

    fn filter(
        &self,
        req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        if let Some(t) = self.target(req, candidates, keep) {
            keep.retain(|i| *i == t);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::scheduling::testutil::*;

    fn plugin(type_name: &'static str, yaml: &str) -> Result<SessionAffinity, ConfigError> {
        let v: serde_json::Value = serde_saphyr::from_str(yaml).unwrap();
        let p: SessionParams = crate::scheduling::params(Some(&v), "p").unwrap();
        SessionAffinity::new(type_name, &p, "p")
    }

    fn pods() -> Vec<Candidate> {
        ["a", "b", "c"]
            .iter()
            .map(|n| cand(n, metrics(0.0, 0.0, 0.0), false))
            .collect()
    }

    fn with_headers(h: &HashMap<String, String>) -> SchedRequest<'_> {
        let mut r = req();
        r.headers = h;
        r
    }

    fn scores(s: &SessionAffinity, h: &HashMap<String, String>, cs: &[Candidate]) -> Vec<f64> {
        let idx: Vec<usize> = (0..cs.len()).collect();
        let mut out = vec![-1.0; cs.len()];
        s.score(
            &with_headers(h),
            &RequestData::default(),
            cs,
            &idx,
            &mut out,
        );
        out
    }

    fn hdr(k: &str, v: &str) -> HashMap<String, String> {
        [(k.to_string(), v.to_string())].into_iter().collect()
    }

    #[test]
    fn both_parameter_generations_decode() {
        let d = plugin(SCORER_TYPE, "{}").unwrap();
        assert_eq!(
            d.spec,
            StrategySpec::Encoded {
                header: "x-session-token".into()
            }
        );
        let cur = plugin(
            FILTER_TYPE,
            "{strategy: session_id, sessionIdConfig: {sources: [{header: X-Conv}, {attribute: agent-identity}], evictionTtlSeconds: 60}, profileName: prefill}",
        )
        .unwrap();
        assert_eq!(
            cur.spec,
            StrategySpec::SessionId {
                sources: vec![Source::Header("x-conv".into()), Source::AgentIdentity],
                ttl: Duration::from_secs(60),
                sweep: Duration::from_secs(10),
                miss_threshold: 1,
            }
        );
        assert_eq!(cur.profile.as_deref(), Some("prefill"));
        let old = plugin(
            SCORER_TYPE,
            "{algorithm: session_id_header, headerName: x-s, missThreshold: 2}",
        )
        .unwrap();
        assert_eq!(
            old.spec,
            StrategySpec::SessionId {
                sources: vec![Source::Header("x-s".into()), Source::AgentIdentity],
                ttl: Duration::from_secs(600),
                sweep: Duration::from_secs(30),
                miss_threshold: 2,
            }
        );
        let enc = plugin(FILTER_TYPE, "{encodedEndpointHeaderConfig: {header: x-t}}").unwrap();
        assert_eq!(
            enc.spec,
            StrategySpec::Encoded {
                header: "x-t".into()
            }
        );
        let default_sources = plugin(SCORER_TYPE, "{strategy: session_id}").unwrap();
        assert!(matches!(
            default_sources.spec,
            StrategySpec::SessionId { ref sources, .. } if sources == &[Source::Header("x-session-id".into())]
        ));
    }

    #[test]
    fn bad_parameters_are_refused_with_their_reason() {
        let err = |t, y| plugin(t, y).unwrap_err().to_string();
        assert!(err(SCORER_TYPE, "{strategy: session_id, headerName: x}").contains("mixes"));
        assert!(err(SCORER_TYPE, "{strategy: sticky}").contains("strategy must be"));
        assert!(err(SCORER_TYPE, "{algorithm: session_id}").contains("algorithm must be"));
        assert!(
            err(
                SCORER_TYPE,
                "{strategy: session_id, sessionIdConfig: {sources: [{header: a, attribute: b}]}}"
            )
            .contains("exactly one")
        );
        assert!(
            err(
                SCORER_TYPE,
                "{strategy: session_id, sessionIdConfig: {sources: [{attribute: tenant}]}}"
            )
            .contains("not produced")
        );
        assert!(
            err(
                SCORER_TYPE,
                "{strategy: session_id, sessionIdConfig: {evictionTtlSeconds: -1}}"
            )
            .contains("> 0")
        );
        assert!(
            err(
                SCORER_TYPE,
                "{algorithm: session_id_header, missThreshold: -1}"
            )
            .contains(">= 0")
        );
        let v: serde_json::Value = serde_saphyr::from_str("{strategie: x}").unwrap();
        assert!(crate::scheduling::params::<SessionParams>(Some(&v), "p").is_err());
    }

    #[test]
    fn encoded_token_scores_and_filters_its_pod() {
        let cs = pods();
        let s = plugin(SCORER_TYPE, "{}").unwrap();
        let f = plugin(FILTER_TYPE, "{}").unwrap();
        assert_eq!(encode_token("b"), "ZGVmYXVsdC9i"); // base64("default/b")
        let h = hdr("x-session-token", &encode_token("b"));
        assert_eq!(scores(&s, &h, &cs), vec![0.0, 1.0, 0.0]);
        let mut keep = vec![0, 1, 2];
        f.filter(&with_headers(&h), &RequestData::default(), &cs, &mut keep);
        assert_eq!(keep, vec![1]);
        // Another namespace names the same pod name; no token, garbage, or a pod that is not a
        // candidate: no preference (all zero; the filter keeps everyone).
        let other_ns = hdr(
            "x-session-token",
            &base64::engine::general_purpose::STANDARD.encode("prod/c"),
        );
        assert_eq!(scores(&s, &other_ns, &cs), vec![0.0, 0.0, 1.0]);
        for h in [
            HashMap::new(),
            hdr("x-session-token", "%%%"),
            hdr("x-session-token", &encode_token("gone")),
        ] {
            assert_eq!(scores(&s, &h, &cs), vec![0.0, 0.0, 0.0]);
            let mut keep = vec![0, 2];
            f.filter(&with_headers(&h), &RequestData::default(), &cs, &mut keep);
            assert_eq!(keep, vec![0, 2]);
        }
        // Filtered out earlier: the token's pod is not among `keep`, so nothing is pinned.
        let mut keep = vec![0, 2];
        f.filter(&with_headers(&h), &RequestData::default(), &cs, &mut keep);
        assert_eq!(keep, vec![0, 2]);
        assert_eq!(
            s.response_token(&cs, 2),
            Some(("x-session-token".into(), encode_token("c")))
        );
        assert_eq!(scores(&s, &h, &[]), Vec::<f64>::new());
    }

    #[test]
    fn session_ids_bind_refresh_and_migrate_only_when_their_pod_is_gone() {
        let cs = pods();
        let s = plugin(
            SCORER_TYPE,
            "{strategy: session_id, sessionIdConfig: {sources: [{header: x-session-id}, {attribute: agent-identity}]}}",
        )
        .unwrap();
        let h = hdr("x-session-id", "s1");
        // Unbound: no preference.
        assert_eq!(scores(&s, &h, &cs), vec![0.0, 0.0, 0.0]);
        s.pre_request(&with_headers(&h), &cs, 2);
        assert_eq!(scores(&s, &h, &cs), vec![0.0, 0.0, 1.0]);
        // Routed elsewhere while its pod was a candidate (outscored): the binding stays.
        s.pre_request(&with_headers(&h), &cs, 0);
        assert_eq!(scores(&s, &h, &cs), vec![0.0, 0.0, 1.0]);
        // Its pod left the candidates: it migrates to where the request went.
        let without_c = &cs[..2];
        assert_eq!(scores(&s, &h, without_c), vec![0.0, 0.0]);
        s.pre_request(&with_headers(&h), without_c, 1);
        assert_eq!(scores(&s, &h, &cs), vec![0.0, 1.0, 0.0]);
        // The agent-identity source is the fallback; no id at all binds nothing.
        let agent = hdr("x-claude-code-session-id", "cc-7");
        s.pre_request(&with_headers(&agent), &cs, 0);
        assert_eq!(scores(&s, &agent, &cs), vec![1.0, 0.0, 0.0]);
        s.pre_request(&with_headers(&HashMap::new()), &cs, 0);
        assert_eq!(s.bindings(), 2);
        assert_eq!(
            s.response_token(&cs, 0),
            None,
            "session_id writes nothing back"
        );
    }

    #[test]
    fn earlier_generation_waits_for_miss_threshold_before_migrating() {
        let cs = pods();
        let s = plugin(
            SCORER_TYPE,
            "{algorithm: session_id_header, missThreshold: 2}",
        )
        .unwrap();
        let h = hdr("x-session-token", "conv-1");
        s.pre_request(&with_headers(&h), &cs, 0);
        let without_a = &cs[1..];
        s.pre_request(&with_headers(&h), without_a, 0);
        assert_eq!(
            scores(&s, &h, &cs),
            vec![1.0, 0.0, 0.0],
            "one miss: still bound"
        );
        s.pre_request(&with_headers(&h), without_a, 1);
        assert_eq!(
            scores(&s, &h, &cs),
            vec![0.0, 0.0, 1.0],
            "two misses: migrated to c"
        );
    }

    #[test]
    fn a_flood_of_session_ids_is_bounded_and_spares_existing_sessions() {
        let cs = pods();
        let s = plugin(SCORER_TYPE, "{strategy: session_id}").unwrap();
        let kept = hdr("x-session-id", "kept");
        s.pre_request(&with_headers(&kept), &cs, 2);
        // Ids of any length cost one fixed-size binding each.
        let long = "x".repeat(1_000);
        for i in 0..MAX_SESSIONS + 10 {
            let h = hdr("x-session-id", &format!("{long}{i}"));
            s.pre_request(&with_headers(&h), &cs, i % 3);
        }
        assert_eq!(s.bindings(), MAX_SESSIONS);
        assert_eq!(scores(&s, &kept, &cs), vec![0.0, 0.0, 1.0]);
        let unbound = hdr("x-session-id", "late");
        s.pre_request(&with_headers(&unbound), &cs, 0);
        assert_eq!(
            scores(&s, &unbound, &cs),
            vec![0.0, 0.0, 0.0],
            "not bound while full"
        );
    }

    #[test]
    fn idle_bindings_expire() {
        let cs = pods();
        let s = plugin(
            SCORER_TYPE,
            "{strategy: session_id, sessionIdConfig: {evictionTtlSeconds: 0.01, evictionSweepSeconds: 0.001}}",
        )
        .unwrap();
        s.pre_request(&with_headers(&hdr("x-session-id", "old")), &cs, 0);
        std::thread::sleep(Duration::from_millis(30));
        // The next routing decision sweeps: the idle session is gone.
        s.pre_request(&with_headers(&hdr("x-session-id", "new")), &cs, 1);
        assert_eq!(s.bindings(), 1);
        assert_eq!(
            scores(&s, &hdr("x-session-id", "old"), &cs),
            vec![0.0, 0.0, 0.0]
        );
    }
}
