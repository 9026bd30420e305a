//! Tenants: who is asking, what they are granted, and their limits — the `TenantQuota` resource.
//!
//! ```yaml
//! apiVersion: epp.dev/v1alpha1
//! kind: TenantQuota
//! metadata: {name: team-a}
//! spec:
//!   apiKeys:                       # SHA-256 of each key, hex (`epp hash-key` prints it)
//!   - sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
//!   anonymous: false               # serve requests that carry no key as this tenant (≤ 1 tenant)
//!   fairnessId: team-a             # the flow-control fairness id granted (default: the name)
//!   objective: interactive         # the InferenceObjective granted (its priority); none: 0
//!   limits:                        # per model the client names; "*" for every other model
//!   - model: "*"
//!     requestsPerMinute: 600
//!     tokensPerMinute: 300000      # input + output
//!     concurrency: 16
//!     defaultMaxTokens: 512        # output budget of a request naming no maximum
//!     maxTokensCap: 4096           # no request generates more
//! ```
//!
//! With tenants configured (tenant mode), a request's identity is its API key — `Authorization:
//! Bearer <key>` or `x-api-key` — looked up by its SHA-256 (only hashes are configured or kept),
//! or a JWT bearer token signed by a trusted issuer ([`jwt`], `kind: JwtIssuer` in the same file)
//! whose claim names the tenant.
//! An unknown key is 401; no key is the anonymous tenant if one is configured, else 401. The
//! client's own control headers (fairness id, objective, TTFT objective, the model-rewrite header,
//! and the agent-session headers that would stand in for a fairness id) are ignored: the tenant's
//! grants are the request's metadata.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

pub mod jwt;

use ring::digest::{SHA256, digest};
use serde::Deserialize;

use super::reject::Rejection;
use crate::config::{ConfigError, decode_at, each_doc};
use flowctl::quota::Limits;

pub const API_VERSION: &str = "epp.dev/v1alpha1";
pub const KIND: &str = "TenantQuota";
/// The limits that apply to every model without its own entry.
pub const ANY_MODEL: &str = "*";

/// One tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    pub fairness_id: String,
    pub objective: Option<String>,
    /// Limits by model name (`"*"`: every other model).
    pub limits: BTreeMap<String, Limits>,
}

impl Tenant {
    /// The limits for the client's `model` and the key they are filed under (the model's own
    /// entry, else `"*"`); `None`: the tenant is unlimited for that model.
    pub fn limits_for(&self, model: &str) -> Option<(&str, &Limits)> {
        self.limits
            .get_key_value(model)
            .or_else(|| self.limits.get_key_value(ANY_MODEL))
            .map(|(k, l)| (k.as_str(), l))
    }
}

/// Every configured tenant, by key hash, and the trusted JWT issuers.
#[derive(Debug, Default)]
pub struct Tenants {
    tenants: Vec<Arc<Tenant>>,
    by_hash: HashMap<[u8; 32], usize>,
    anonymous: Option<usize>,
    issuers: Vec<jwt::Issuer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Doc {
    api_version: String,
    kind: String,
    metadata: Meta,
    spec: Spec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    name: String,
    #[serde(default)]
    #[allow(dead_code)]
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Spec {
    #[serde(default)]
    api_keys: Vec<KeyDoc>,
    #[serde(default)]
    anonymous: bool,
    #[serde(default)]
    fairness_id: Option<String>,
    #[serde(default)]
    objective: Option<String>,
    #[serde(default)]
    limits: Vec<LimitDoc>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyDoc {
    sha256: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LimitDoc {
    model: String,
    #[serde(default)]
    requests_per_minute: Option<u64>,
    #[serde(default)]
    tokens_per_minute: Option<u64>,
    #[serde(default)]
    concurrency: Option<u32>,
    #[serde(default)]
    default_max_tokens: Option<u64>,
    #[serde(default)]
    max_tokens_cap: Option<u64>,
}

/// The SHA-256 of an API key, as configured (lowercase hex).
pub fn hash_key(key: &str) -> String {
    hex(digest(&SHA256, key.as_bytes()).as_ref())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Tenants {
    /// Parse `TenantQuota` (and `JwtIssuer`) documents.
    pub fn from_yaml(text: &str) -> Result<Tenants, ConfigError> {
        Tenants::from_yaml_in(text, None)
    }

    /// Parse documents whose relative key files are in `base`.
    pub fn from_yaml_in(text: &str, base: Option<&Path>) -> Result<Tenants, ConfigError> {
        let mut out = Tenants::default();
        each_doc(text, "tenants", |doc, at| out.add(doc, at, base))?;
        if out.tenants.is_empty() {
            return Err(ConfigError::invalid("tenants: no TenantQuota defined"));
        }
        Ok(out)
    }

    pub fn from_file(path: &Path) -> Result<Tenants, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Tenants::from_yaml_in(&text, path.parent())
    }

    fn add(
        &mut self,
        doc: &serde_json::Value,
        at: &str,
        base: Option<&Path>,
    ) -> Result<(), ConfigError> {
        if doc.get("kind").and_then(|k| k.as_str()) == Some(jwt::KIND) {
            return self.add_issuer(doc, at, base);
        }
        let d: Doc = decode_at(doc, at)?;
        let invalid = |m: String| Err(ConfigError::invalid(format!("{at}: {m}")));
        if d.kind != KIND {
            return invalid(format!("kind `{}` is not {KIND}", d.kind));
        }
        if d.api_version != API_VERSION {
            return invalid(format!(
                "apiVersion `{}` is not {API_VERSION}",
                d.api_version
            ));
        }
        let name = d.metadata.name;
        if name.is_empty() || self.tenants.iter().any(|t| t.name == name) {
            return invalid(format!("tenant name `{name}` is empty or defined twice"));
        }
        let index = self.tenants.len();
        for (i, k) in d.spec.api_keys.iter().enumerate() {
            let Some(h) = parse_hash(&k.sha256) else {
                return invalid(format!(
                    "spec.apiKeys[{i}].sha256: not a SHA-256 in hex (64 hex digits; the key \
                     itself is never configured)"
                ));
            };
            if let Some(other) = self.by_hash.insert(h, index) {
                return invalid(format!(
                    "spec.apiKeys[{i}]: the same key is already tenant `{}`'s",
                    self.tenants.get(other).map_or(&name, |t| &t.name)
                ));
            }
        }
        if d.spec.anonymous {
            if let Some(a) = self.anonymous {
                return invalid(format!(
                    "spec.anonymous: tenant `{}` is already the anonymous tenant",
                    self.tenants[a].name
                ));
            }
            self.anonymous = Some(index);
        } else if d.spec.api_keys.is_empty() {
            return invalid("spec: a tenant needs apiKeys or anonymous: true".into());
        }
        let mut limits = BTreeMap::new();
        for (i, l) in d.spec.limits.into_iter().enumerate() {
            let bad = |f: &str| {
                invalid(format!(
                    "spec.limits[{i}].{f}: must be positive (omit it for no limit)"
                ))
            };
            if l.requests_per_minute == Some(0) {
                return bad("requestsPerMinute");
            }
            if l.tokens_per_minute == Some(0) {
                return bad("tokensPerMinute");
            }
            if l.concurrency == Some(0) {
                return bad("concurrency");
            }
            if l.max_tokens_cap == Some(0) {
                return bad("maxTokensCap");
            }
            let lim = Limits {
                requests_per_minute: l.requests_per_minute,
                tokens_per_minute: l.tokens_per_minute,
                concurrency: l.concurrency,
                default_max_tokens: l.default_max_tokens,
                max_tokens_cap: l.max_tokens_cap,
            };
            if limits.insert(l.model.clone(), lim).is_some() {
                return invalid(format!(
                    "spec.limits[{i}].model: `{}` listed twice",
                    l.model
                ));
            }
        }
        self.tenants.push(Arc::new(Tenant {
            fairness_id: d.spec.fairness_id.unwrap_or_else(|| name.clone()),
            name,
            objective: d.spec.objective,
            limits,
        }));
        Ok(())
    }

    /// Add one `TenantQuota` document (an object from the API server); `at` names it in
    /// errors. Nothing is added when it is refused.
    pub fn add_doc(&mut self, doc: &serde_json::Value, at: &str) -> Result<(), ConfigError> {
        let mut next = Tenants {
            tenants: self.tenants.clone(),
            by_hash: self.by_hash.clone(),
            anonymous: self.anonymous,
            issuers: Vec::new(),
        };
        next.add(doc, at, None)?;
        self.tenants = next.tenants;
        self.by_hash = next.by_hash;
        self.anonymous = next.anonymous;
        Ok(())
    }

    fn add_issuer(
        &mut self,
        doc: &serde_json::Value,
        at: &str,
        base: Option<&Path>,
    ) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::invalid(format!("{at}: {m}")));
        if doc.get("apiVersion").and_then(|v| v.as_str()) != Some(API_VERSION) {
            return invalid(&format!("apiVersion must be {API_VERSION}"));
        }
        let Some(name) = doc
            .pointer("/metadata/name")
            .and_then(|n| n.as_str())
            .filter(|n| !n.is_empty())
        else {
            return invalid("metadata.name is required");
        };
        if self.issuers.iter().any(|i| i.name == name) {
            return invalid(&format!("JwtIssuer `{name}` defined twice"));
        }
        let Some(spec) = doc.get("spec") else {
            return invalid("spec is required");
        };
        let issuer = jwt::Issuer::parse(name.to_string(), spec, at, base)?;
        self.issuers.push(issuer);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Tenant> {
        self.tenants.iter().map(|t| t.as_ref())
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.tenants.iter().find(|t| t.name == name)
    }

    /// The tenant a request's headers identify, or the 401 to answer.
    pub fn identify(&self, headers: &HashMap<String, String>) -> Result<Arc<Tenant>, Rejection> {
        match api_key(headers) {
            Some((token, true)) if !self.issuers.is_empty() && jwt::looks_like_jwt(token) => {
                self.identify_jwt(token)
            }
            Some((key, _)) => {
                let h = digest(&SHA256, key.as_bytes());
                let mut hash = [0u8; 32];
                hash.copy_from_slice(h.as_ref());
                self.by_hash
                    .get(&hash)
                    .map(|i| self.tenants[*i].clone())
                    .ok_or_else(|| Rejection::unauthorized("unknown API key"))
            }
            None => self
                .anonymous
                .map(|i| self.tenants[i].clone())
                .ok_or_else(|| {
                    Rejection::unauthorized(
                        "an API key is required (Authorization: Bearer <key>, or x-api-key)",
                    )
                }),
        }
    }
}

impl Tenants {
    /// A JWT bearer token: the tenant its verified claim names.
    fn identify_jwt(&self, token: &str) -> Result<Arc<Tenant>, Rejection> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| Rejection::unauthorized(format!("invalid token: {e}")))?;
        let mut why = None;
        for issuer in &self.issuers {
            match issuer.verify(token, &header) {
                Ok(Some(name)) => {
                    return self
                        .tenants
                        .iter()
                        .find(|t| t.name == name)
                        .cloned()
                        .ok_or_else(|| {
                            Rejection::unauthorized(format!("invalid token: no tenant `{name}`"))
                        });
                }
                Ok(None) => {}
                Err(e) => why = Some(e),
            }
        }
        Err(Rejection::unauthorized(format!(
            "invalid token: {}",
            why.unwrap_or_else(|| "no trusted issuer has its key".into())
        )))
    }
}

/// The credential a request carries: a bearer token (`true`), else `x-api-key`.
fn api_key(headers: &HashMap<String, String>) -> Option<(&str, bool)> {
    let bearer = headers.get("authorization").and_then(|v| {
        let v = v.trim();
        let (scheme, rest) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
    });
    bearer
        .map(|b| (b, true))
        .or_else(|| headers.get("x-api-key").map(|v| (v.trim(), false)))
        .filter(|(k, _)| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(name: &str, key: &str, extra: &str) -> String {
        format!(
            "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: {name}}}\nspec:\n  apiKeys: [{{sha256: {}}}]\n{extra}",
            hash_key(key)
        )
    }

    fn headers(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn keys_identify_tenants_by_their_hash() {
        let yaml = format!(
            "{}---\n{}",
            doc(
                "a",
                "key-a",
                "  objective: interactive\n  limits:\n  - {model: '*', tokensPerMinute: 3000, concurrency: 6}\n  - {model: big, tokensPerMinute: 10}\n"
            ),
            doc("b", "key-b", "  fairnessId: batch-jobs\n")
        );
        let t = Tenants::from_yaml(&yaml).unwrap();
        let a = t
            .identify(&headers(&[("authorization", "Bearer key-a")]))
            .unwrap();
        assert_eq!(
            (
                a.name.as_str(),
                a.fairness_id.as_str(),
                a.objective.as_deref()
            ),
            ("a", "a", Some("interactive"))
        );
        assert_eq!(a.limits_for("big").unwrap().0, "big");
        assert_eq!(
            a.limits_for("small").unwrap(),
            ("*", &a.limits["*"]),
            "the fallback"
        );
        let b = t.identify(&headers(&[("x-api-key", " key-b ")])).unwrap();
        assert_eq!(
            (b.name.as_str(), b.fairness_id.as_str()),
            ("b", "batch-jobs")
        );
        assert_eq!(b.limits_for("m"), None, "no limits: unlimited");
        // Bearer wins over x-api-key; the scheme is case-insensitive.
        let h = headers(&[("authorization", "bearer key-b"), ("x-api-key", "key-a")]);
        assert_eq!(t.identify(&h).unwrap().name, "b");
        for bad in [
            headers(&[("authorization", "Bearer nope")]),
            headers(&[]),
            headers(&[("authorization", "Basic a2V5LWE=")]),
            headers(&[("x-api-key", "")]),
        ] {
            let r = t.identify(&bad).unwrap_err();
            assert_eq!(r.status, 401, "{bad:?}");
        }
    }

    #[test]
    fn the_anonymous_tenant_serves_requests_without_a_key_only() {
        let yaml = format!(
            "{}---\napiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: anon}}\nspec: {{anonymous: true}}\n",
            doc("a", "key-a", "")
        );
        let t = Tenants::from_yaml(&yaml).unwrap();
        assert_eq!(t.identify(&headers(&[])).unwrap().name, "anon");
        assert_eq!(
            t.identify(&headers(&[("x-api-key", "wrong")]))
                .unwrap_err()
                .status,
            401,
            "a wrong key is not anonymous"
        );
    }

    #[test]
    fn bad_documents_name_what_is_wrong() {
        let cases = [
            (
                "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {name: a}\nspec: {apiKeys: [{sha256: key-a}]}\n".to_string(),
                "64 hex digits",
            ),
            (doc("a", "k", "  limits: [{model: '*', tokensPerMinute: 0}]\n"), "tokensPerMinute"),
            (doc("a", "k", "  limits: [{model: m}, {model: m}]\n"), "twice"),
            (doc("a", "k", "  limts: []\n"), "limts"),
            (format!("{}---\n{}", doc("a", "k", ""), doc("b", "k", "")), "already tenant `a`"),
            (format!("{}---\n{}", doc("a", "k", ""), doc("a", "j", "")), "defined twice"),
            (
                "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {name: a}\nspec: {}\n".to_string(),
                "apiKeys or anonymous",
            ),
            (doc("a", "k", "").replace("TenantQuota", "Tenant"), "kind"),
            (String::new(), "no TenantQuota"),
        ];
        for (yaml, want) in cases {
            let e = Tenants::from_yaml(&yaml).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn the_example_tenants_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/tenants.yaml");
        let t = Tenants::from_file(&path).unwrap();
        assert!(t.len() >= 2);
        assert!(t.iter().all(|t| t.limits_for("any-model").is_some()));
    }

    #[test]
    fn hashes_are_sha256_hex() {
        // sha256("foo")
        assert_eq!(
            hash_key("foo"),
            "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
        );
    }
}
