//! JWT identity: a trusted issuer (`kind: JwtIssuer`) whose signed tokens name the tenant in a
//! claim.
//!
//! ```yaml
//! apiVersion: epp.dev/v1alpha1
//! kind: JwtIssuer
//! metadata: {name: corp-sso}
//! spec:
//!   issuer: https://sso.example.com   # the `iss` a token must carry
//!   audience: llm-gateway             # optional: an `aud` it must carry
//!   jwksFile: jwks.json               # the issuer's keys (RSA, EC, Ed25519; matched by `kid`),
//!   # publicKeyFile: key.pem          #   or one PEM public key,
//!   # hmacSecretFile: secret          #   or an HMAC secret (HS256/384/512)
//!   tenantClaim: tenant               # the claim naming the tenant (default `tenant`)
//! ```
//!
//! Relative file names are read next to the tenants file. A token must be signed by one of the
//! keys with an algorithm of that key's family, unexpired (`exp` required; 30 s leeway for
//! clock skew), not before its `nbf`, from the issuer, for the audience when one is configured.

use std::path::{Path, PathBuf};

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Header, Validation};
use serde::Deserialize;

use crate::config::{ConfigError, decode_at};

pub const KIND: &str = "JwtIssuer";
const LEEWAY_S: u64 = 30;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Spec {
    issuer: String,
    #[serde(default)]
    audience: Option<String>,
    #[serde(default)]
    jwks_file: Option<PathBuf>,
    #[serde(default)]
    public_key_file: Option<PathBuf>,
    #[serde(default)]
    hmac_secret_file: Option<PathBuf>,
    #[serde(default)]
    tenant_claim: Option<String>,
}

struct Key {
    kid: Option<String>,
    key: DecodingKey,
    algorithms: Vec<Algorithm>,
}

/// A trusted issuer and its keys.
pub struct Issuer {
    pub name: String,
    issuer: String,
    audience: Option<String>,
    tenant_claim: String,
    keys: Vec<Key>,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("name", &self.name)
            .field("issuer", &self.issuer)
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

const RSA: [Algorithm; 6] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
];
const EC: [Algorithm; 2] = [Algorithm::ES256, Algorithm::ES384];
const HMAC: [Algorithm; 3] = [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512];

fn read(path: &Path, base: Option<&Path>, at: &str) -> Result<Vec<u8>, ConfigError> {
    let path = match base {
        Some(b) if path.is_relative() => b.join(path),
        _ => path.to_path_buf(),
    };
    std::fs::read(&path)
        .map_err(|e| ConfigError::invalid(format!("{at}: reading {}: {e}", path.display())))
}

impl Issuer {
    /// Parse a `JwtIssuer`'s `spec` (`at` names it in errors); key files relative to `base`.
    pub fn parse(
        name: String,
        spec: &serde_json::Value,
        at: &str,
        base: Option<&Path>,
    ) -> Result<Issuer, ConfigError> {
        let s: Spec = decode_at(spec, &format!("{at}.spec"))?;
        let invalid = |m: String| Err(ConfigError::invalid(format!("{at}.spec: {m}")));
        if s.issuer.trim().is_empty() {
            return invalid("issuer: must not be empty".into());
        }
        let keys = match (&s.jwks_file, &s.public_key_file, &s.hmac_secret_file) {
            (Some(f), None, None) => {
                let set: JwkSet = serde_json::from_slice(&read(f, base, at)?)
                    .map_err(|e| ConfigError::invalid(format!("{at}.spec.jwksFile: {e}")))?;
                let mut keys = Vec::new();
                for (i, jwk) in set.keys.iter().enumerate() {
                    let key = DecodingKey::from_jwk(jwk).map_err(|e| {
                        ConfigError::invalid(format!("{at}.spec.jwksFile: key {i}: {e}"))
                    })?;
                    let named = jwk
                        .common
                        .key_algorithm
                        .map(|a| a.to_string().parse::<Algorithm>());
                    let algorithms = match named {
                        Some(Ok(a)) => vec![a],
                        _ => match &jwk.algorithm {
                            jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => RSA.to_vec(),
                            jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => EC.to_vec(),
                            jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_) => {
                                vec![Algorithm::EdDSA]
                            }
                            jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_) => HMAC.to_vec(),
                        },
                    };
                    keys.push(Key {
                        kid: jwk.common.key_id.clone(),
                        key,
                        algorithms,
                    });
                }
                if keys.is_empty() {
                    return invalid("jwksFile: no keys".into());
                }
                keys
            }
            (None, Some(f), None) => {
                let pem = read(f, base, at)?;
                let (key, algorithms) = if let Ok(k) = DecodingKey::from_rsa_pem(&pem) {
                    (k, RSA.to_vec())
                } else if let Ok(k) = DecodingKey::from_ec_pem(&pem) {
                    (k, EC.to_vec())
                } else if let Ok(k) = DecodingKey::from_ed_pem(&pem) {
                    (k, vec![Algorithm::EdDSA])
                } else {
                    return invalid(
                        "publicKeyFile: not a PEM RSA, EC or Ed25519 public key".into(),
                    );
                };
                vec![Key {
                    kid: None,
                    key,
                    algorithms,
                }]
            }
            (None, None, Some(f)) => {
                let secret = read(f, base, at)?;
                let secret = secret.trim_ascii();
                if secret.len() < 32 {
                    return invalid("hmacSecretFile: a secret of at least 32 bytes".into());
                }
                vec![Key {
                    kid: None,
                    key: DecodingKey::from_secret(secret),
                    algorithms: HMAC.to_vec(),
                }]
            }
            _ => {
                return invalid(
                    "exactly one of jwksFile, publicKeyFile, hmacSecretFile is required".into(),
                );
            }
        };
        Ok(Issuer {
            name,
            issuer: s.issuer,
            audience: s.audience,
            tenant_claim: s.tenant_claim.unwrap_or_else(|| "tenant".into()),
            keys,
        })
    }

    /// The tenant `token` names if it verifies against this issuer: `Ok(None)` when none of the
    /// issuer's keys is the one the token's header asks for, `Err(why)` when it is and the token
    /// does not verify.
    pub fn verify(&self, token: &str, header: &Header) -> Result<Option<String>, String> {
        let mut candidates = self
            .keys
            .iter()
            .filter(|k| k.algorithms.contains(&header.alg))
            .filter(|k| match (&header.kid, &k.kid) {
                (Some(want), Some(have)) => want == have,
                _ => true,
            })
            .peekable();
        if candidates.peek().is_none() {
            return Ok(None);
        }
        let mut validation = Validation::new(header.alg);
        validation.leeway = LEEWAY_S;
        validation.validate_nbf = true;
        // A claim that is checked must be there (the library checks only those present).
        validation.set_issuer(&[&self.issuer]);
        validation.set_required_spec_claims(&["exp", "iss"]);
        match &self.audience {
            Some(a) => {
                validation.set_audience(&[a]);
                validation.set_required_spec_claims(&["exp", "iss", "aud"]);
            }
            None => validation.validate_aud = false,
        }
        let mut why = String::new();
        for k in candidates {
            match jsonwebtoken::decode::<serde_json::Value>(token, &k.key, &validation) {
                Ok(data) => {
                    return match data.claims.get(&self.tenant_claim) {
                        Some(serde_json::Value::String(t)) if !t.is_empty() => Ok(Some(t.clone())),
                        _ => Err(format!("the token has no `{}` claim", self.tenant_claim)),
                    };
                }
                Err(e) => why = e.to_string(),
            }
        }
        Err(why)
    }
}

/// Whether a bearer token is shaped like a JWT (three base64url parts, a JSON header).
pub fn looks_like_jwt(token: &str) -> bool {
    token.starts_with("eyJ") && token.split('.').count() == 3
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use jsonwebtoken::{EncodingKey, encode};
    use ring::signature::{Ed25519KeyPair, KeyPair};
    use serde_json::json;

    use super::super::{Tenants, hash_key};

    const SECRET: &str = "an-hmac-secret-of-more-than-32-bytes!";

    fn b64url(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for c in bytes.chunks(3) {
            let n = c.iter().fold(0u32, |n, b| (n << 8) | u32::from(*b)) << (8 * (3 - c.len()));
            for i in 0..=c.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    fn bearer(token: &str) -> HashMap<String, String> {
        [("authorization".to_string(), format!("Bearer {token}"))]
            .into_iter()
            .collect()
    }

    /// Two issuers (HMAC with an audience, Ed25519 keys from a JWKS), three tenants.
    fn setup(dir: &std::path::Path) -> (Tenants, Vec<u8>) {
        std::fs::write(dir.join("secret"), SECRET).unwrap();
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
        let jwks = json!({"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "k1", "alg": "EdDSA",
            "x": b64url(pair.public_key().as_ref())}]});
        std::fs::write(dir.join("jwks.json"), jwks.to_string()).unwrap();
        let tenant = |name: &str| {
            format!(
                "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: {name}}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n",
                hash_key(&format!("key-{name}"))
            )
        };
        let yaml = format!(
            "{}---\n{}---\napiVersion: epp.dev/v1alpha1\nkind: JwtIssuer\nmetadata: {{name: hmac}}\nspec: {{issuer: https://a.example, audience: gw, hmacSecretFile: secret}}\n---\napiVersion: epp.dev/v1alpha1\nkind: JwtIssuer\nmetadata: {{name: sso}}\nspec: {{issuer: https://sso.example, jwksFile: jwks.json, tenantClaim: org}}\n",
            tenant("team-a"),
            tenant("team-b")
        );
        let path = dir.join("tenants.yaml");
        std::fs::write(&path, yaml).unwrap();
        (Tenants::from_file(&path).unwrap(), pkcs8.as_ref().to_vec())
    }

    #[test]
    fn signed_tokens_name_their_tenant_and_nothing_else_gets_in() {
        let dir = tempfile::tempdir().unwrap();
        let (t, ed) = setup(dir.path());
        let hs = |claims: serde_json::Value| {
            encode(
                &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
                &claims,
                &EncodingKey::from_secret(SECRET.as_bytes()),
            )
            .unwrap()
        };
        let eddsa = |claims: serde_json::Value| {
            let mut h = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
            h.kid = Some("k1".into());
            encode(&h, &claims, &EncodingKey::from_ed_der(&ed)).unwrap()
        };
        let exp = now() + 600;
        let who = |token: &str| t.identify(&bearer(token)).map(|t| t.name.clone());
        let ok =
            hs(json!({"iss": "https://a.example", "aud": "gw", "exp": exp, "tenant": "team-a"}));
        assert_eq!(who(&ok).unwrap(), "team-a");
        let ok = eddsa(json!({"iss": "https://sso.example", "exp": exp, "org": "team-b"}));
        assert_eq!(who(&ok).unwrap(), "team-b");
        // API keys still work beside tokens.
        let key = bearer("key-team-b");
        assert_eq!(t.identify(&key).unwrap().name, "team-b");
        let refused = [
            ("expired", hs(json!({"iss": "https://a.example", "aud": "gw", "exp": now() - 120, "tenant": "team-a"}))),
            ("no exp", hs(json!({"iss": "https://a.example", "aud": "gw", "tenant": "team-a"}))),
            ("no issuer", hs(json!({"aud": "gw", "exp": exp, "tenant": "team-a"}))),
            ("wrong issuer", hs(json!({"iss": "https://evil.example", "aud": "gw", "exp": exp, "tenant": "team-a"}))),
            ("no audience", hs(json!({"iss": "https://a.example", "exp": exp, "tenant": "team-a"}))),
            ("no claim", eddsa(json!({"iss": "https://sso.example", "exp": exp, "tenant": "team-b"}))),
            ("unknown tenant", eddsa(json!({"iss": "https://sso.example", "exp": exp, "org": "team-z"}))),
            ("not yet valid", hs(json!({"iss": "https://a.example", "aud": "gw", "exp": exp, "nbf": now() + 300, "tenant": "team-a"}))),
            ("another key", encode(
                &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
                &json!({"iss": "https://a.example", "aud": "gw", "exp": exp, "tenant": "team-a"}),
                &EncodingKey::from_secret(b"some-other-secret-that-is-long-enough"),
            ).unwrap()),
        ];
        for (what, token) in refused {
            let e = who(&token)
                .err()
                .unwrap_or_else(|| panic!("{what}: admitted"));
            assert_eq!(e.status, 401, "{what}");
            assert!(
                e.message.starts_with("invalid token"),
                "{what}: {}",
                e.message
            );
        }
        // A tampered payload: the signature no longer matches.
        let mut parts: Vec<String> = ok.split('.').map(String::from).collect();
        parts[1] = b64url(br#"{"iss":"https://sso.example","exp":9999999999,"org":"team-a"}"#);
        assert_eq!(who(&parts.join(".")).unwrap_err().status, 401);
        // An algorithm the key is not for (alg confusion).
        let none = format!("{}.{}.", b64url(br#"{"alg":"none","typ":"JWT"}"#), parts[1]);
        assert_eq!(who(&none).unwrap_err().status, 401);
    }

    #[test]
    fn issuers_are_validated_when_the_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let tenant = format!(
            "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: a}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n---\n",
            hash_key("k")
        );
        std::fs::write(dir.path().join("short"), "too short").unwrap();
        for (spec, want) in [
            ("{issuer: x}", "exactly one of"),
            ("{issuer: x, hmacSecretFile: short}", "at least 32 bytes"),
            ("{issuer: x, jwksFile: missing.json}", "missing.json"),
            ("{issuer: '', hmacSecretFile: short}", "issuer"),
            ("{issuer: x, hmacSecretFile: short, colour: red}", "colour"),
        ] {
            let yaml = format!(
                "{tenant}apiVersion: epp.dev/v1alpha1\nkind: JwtIssuer\nmetadata: {{name: i}}\nspec: {spec}\n"
            );
            let path = dir.path().join("t.yaml");
            std::fs::write(&path, yaml).unwrap();
            let e = Tenants::from_file(&path).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
