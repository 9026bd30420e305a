//! `EndpointPickerConfig` — the llm-d YAML that says what the picker does.
//!
//! Decoding is strict: the YAML is first read into a JSON value and then decoded with
//! `serde_path_to_error`, so an unknown key fails with its full path
//! (`plugins[1].parameters.foo`). Plugin `parameters` are decoded by each plugin the same way, with
//! the path prefixed. Defaults are injected in one place ([`crate::scheduling::build`]), mirroring llm-d.

use serde::de::DeserializeOwned;
use serde_json::Value;

mod v1;
mod v1alpha1;

pub use v1::{
    CrossReplicaSpec, DataLayerSpec, DataSourceSpec, DiscoverySpec, EndpointPickerConfig,
    PluginRefSpec, PluginSpec, ProfilePluginRef, ProfileSpec, RequestHandlerSpec,
};

/// The current apiVersion (llm-d v1.0).
pub const API_VERSION: &str = "llm-d.ai/v1";
/// The versions still read, converted to [`API_VERSION`] at load with one deprecation line:
/// llm-d v0.x's, and the Gateway API Inference Extension's before it.
pub const DEPRECATED_API_VERSIONS: [&str; 2] = [
    "llm-d.ai/v1alpha1",
    "inference.networking.x-k8s.io/v1alpha1",
];
pub const KIND: &str = "EndpointPickerConfig";

/// What `epp serve` runs without a config file: the cost model (`cost-model-scorer`, with its
/// producers injected: approximate prefix matches, the in-flight ledger, the TTFT prediction)
/// behind the max-score picker. Our own default — see `docs/configuration.md` for the reasoning
/// and the measurements; [`LLMD_DEFAULT`] is llm-d's.
pub const BUILTIN_DEFAULT: &str = r#"
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: cost-model-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: cost-model-scorer
"#;

/// llm-d's built-in default configuration (and its Helm chart's `default-plugins.yaml`).
pub const LLMD_DEFAULT: &str = r#"
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"#;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config is not valid YAML: {0}")]
    Yaml(String),
    #[error("config key `{path}`: {message}")]
    Field { path: String, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Flow(#[from] flowctl::ConfigError),
    #[error("reading config file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ConfigError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        ConfigError::Invalid(msg.into())
    }
}

/// Calls `f` with each non-empty document of a multi-document YAML `text`, named `what[i]`.
pub fn each_doc(
    text: &str,
    what: &str,
    mut f: impl FnMut(&Value, &str) -> Result<(), ConfigError>,
) -> Result<(), ConfigError> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
    for (i, doc) in docs.iter().enumerate() {
        if !doc.is_null() {
            f(doc, &format!("{what}[{i}]"))?;
        }
    }
    Ok(())
}

/// Decode `value` into `T`, reporting the failing key as `prefix.path` (flowctl's strict decoder,
/// shared so every config error reads the same).
pub fn decode_at<T: DeserializeOwned>(value: &Value, prefix: &str) -> Result<T, ConfigError> {
    Ok(flowctl::config::decode_at(value, prefix)?)
}

impl EndpointPickerConfig {
    /// Parse and strictly decode a YAML document: `llm-d.ai/v1` as it is, an older version
    /// ([`DEPRECATED_API_VERSIONS`]) converted to it with one deprecation line.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_saphyr::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
        let version = value.get("apiVersion").and_then(Value::as_str);
        let cfg = match version {
            Some(API_VERSION) => {
                if let Some((path, instead)) = v1alpha1::moved_key(&value) {
                    return Err(ConfigError::Field {
                        path,
                        message: format!(
                            "not a key of {API_VERSION} (it was in v1alpha1): write {instead}"
                        ),
                    });
                }
                decode_at::<EndpointPickerConfig>(&value, "")?
            }
            Some(v) if DEPRECATED_API_VERSIONS.contains(&v) => {
                let old: v1alpha1::EndpointPickerConfig = decode_at(&value, "")?;
                tracing::warn!(
                    "DEPRECATION: EndpointPickerConfig apiVersion `{v}` is deprecated and read as \
                     `{API_VERSION}` (`epp validate-config` prints the file in that form)"
                );
                old.into_v1(API_VERSION)
            }
            _ => {
                return Err(ConfigError::Field {
                    path: "apiVersion".into(),
                    message: format!(
                        "unsupported apiVersion {} (expected `{API_VERSION}`; `{}` is still read)",
                        version.map_or("(none)".into(), |v| format!("`{v}`")),
                        DEPRECATED_API_VERSIONS.join("`, `")
                    ),
                });
            }
        };
        if cfg.kind != KIND {
            return Err(ConfigError::Field {
                path: "kind".into(),
                message: format!("unsupported kind `{}` (expected `{KIND}`)", cfg.kind),
            });
        }
        Ok(cfg)
    }

    /// The configuration as a `llm-d.ai/v1` YAML document.
    pub fn to_v1_yaml(&self) -> String {
        serde_saphyr::to_string(self).unwrap_or_else(|e| format!("# not printable: {e}\n"))
    }

    pub fn from_file(path: &str) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_string(),
            source,
        })?;
        Self::from_yaml(&text)
    }

    /// The configuration llm-d uses when no file is given: queue ×2, kv-cache ×2, prefix ×3.
    pub fn builtin_default() -> Result<Self, ConfigError> {
        Self::from_yaml(BUILTIN_DEFAULT)
    }

    /// llm-d's default configuration ([`LLMD_DEFAULT`]).
    pub fn llm_d_default() -> Result<Self, ConfigError> {
        Self::from_yaml(LLMD_DEFAULT)
    }

    /// Feature gates as (name, enabled); `name`, `name=true`, `name=false`.
    pub fn gate(&self, name: &str) -> Result<Option<bool>, ConfigError> {
        let mut out = None;
        for (i, entry) in self.feature_gates.iter().enumerate() {
            let (gate, val) = match entry.split_once('=') {
                Some((g, v)) => (g.trim(), v.trim()),
                None => (entry.trim(), "true"),
            };
            if gate != name {
                continue;
            }
            out = Some(match val {
                "true" => true,
                "false" => false,
                other => {
                    return Err(ConfigError::Field {
                        path: format!("featureGates[{i}]"),
                        message: format!("expected true or false, got `{other}`"),
                    });
                }
            });
        }
        Ok(out)
    }
}

/// Parse a Go duration ("50ms", "2s", "1m30s", "200us") with flowctl's parser.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    flowctl::GoDuration::parse(s)
        .map(|d| std::time::Duration::from_nanos(d.nanos()))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_top_level_key_is_named() {
        let err = EndpointPickerConfig::from_yaml(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\nbogus: 1\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn unknown_nested_key_has_path() {
        let err = EndpointPickerConfig::from_yaml(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n  prameters: {}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("plugins[0]"), "{err}");
        assert!(err.contains("prameters"), "{err}");
    }

    #[test]
    fn wrong_api_version_rejected() {
        let err = EndpointPickerConfig::from_yaml("apiVersion: v1\nkind: EndpointPickerConfig\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("apiVersion"), "{err}");
    }

    #[test]
    fn gates_parse() {
        let cfg = EndpointPickerConfig::from_yaml(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl=false, other]\n",
        )
        .unwrap();
        assert_eq!(cfg.gate("flowControl").unwrap(), Some(false));
        assert_eq!(cfg.gate("other").unwrap(), Some(true));
        assert_eq!(cfg.gate("missing").unwrap(), None);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("50ms").unwrap().as_millis(), 50);
        assert_eq!(parse_duration("1m30s").unwrap().as_secs(), 90);
        assert_eq!(parse_duration("200us").unwrap().as_micros(), 200);
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5x").is_err());
    }
}
