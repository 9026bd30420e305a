//! How requests are admitted, from the `EndpointPickerConfig`: `featureGates` and `flowControl`.

use flowctl::{ControllerConfig, SaturationDetector};

use crate::config::{ConfigError, EndpointPickerConfig, PluginRefSpec, decode_at};

/// How requests are admitted, from `featureGates` and `flowControl`.
#[derive(Debug, Clone)]
pub enum AdmissionConfig {
    /// Gate off: llm-d's legacy controller with this detector.
    Legacy(SaturationDetector),
    /// Gate on: flow control.
    FlowControl(Box<ControllerConfig>),
}

impl AdmissionConfig {
    pub fn from_config(cfg: &EndpointPickerConfig) -> Result<AdmissionConfig, ConfigError> {
        if cfg.gate("flowControl")? == Some(true) {
            return Ok(AdmissionConfig::FlowControl(Box::new(controller_config(
                cfg,
            )?)));
        }
        if cfg
            .flow_control
            .as_ref()
            .and_then(|v| v.as_object())
            .is_some_and(|o| o.keys().any(|k| k != "saturationDetector"))
        {
            tracing::warn!(
                "flowControl section present but the flowControl gate is off: only its saturationDetector is used"
            );
        }
        Ok(AdmissionConfig::Legacy(legacy_detector(cfg)?))
    }

    /// The start-up log line's part.
    pub fn summary(&self) -> String {
        match self {
            AdmissionConfig::Legacy(d) => format!("admission=legacy({})", d.type_name()),
            AdmissionConfig::FlowControl(c) => {
                let r = c.demand_reserve;
                let reserve = if r.enabled() {
                    format!(
                        " demandReserve=(factor={} settle={}ms maxSettle={}ms)",
                        r.factor,
                        r.settle / 1_000_000,
                        r.max_settle / 1_000_000
                    )
                } else {
                    " demandReserve=off".to_string()
                };
                format!(
                    "admission=flow-control(bands=[{}] detector={} maxRequests={} ttl={}s{reserve})",
                    c.bands
                        .iter()
                        .map(|b| match b.settings.request_ttl {
                            Some(t) => format!("{}(ttl={}ms)", b.priority, t / 1_000_000),
                            None => b.priority.to_string(),
                        })
                        .collect::<Vec<_>>()
                        .join(","),
                    c.detector.type_name(),
                    c.max_requests,
                    c.default_request_ttl / 1_000_000_000,
                )
            }
        }
    }
}

/// Resolve the configured saturation detector (`flowControl.saturationDetector`, where a
/// v1alpha1 file's top-level `saturationDetector` lands; default `utilization-detector`) for the
/// legacy controller.
pub fn legacy_detector(cfg: &EndpointPickerConfig) -> Result<SaturationDetector, ConfigError> {
    let reference = cfg
        .flow_control
        .as_ref()
        .and_then(|fc| fc.get("saturationDetector"));
    let Some(r) = reference else {
        return Ok(SaturationDetector::default());
    };
    let spec: PluginRefSpec = decode_at(r, "flowControl.saturationDetector")?;
    let decls = plugin_decls(cfg);
    let (ty, params, path) = match decls
        .iter()
        .enumerate()
        .find(|(_, p)| p.name == spec.plugin_ref)
    {
        Some((i, p)) => (
            p.type_name,
            p.parameters,
            format!("plugins[{i}].parameters"),
        ),
        None => (
            spec.plugin_ref.as_str(),
            None,
            "flowControl.saturationDetector".to_string(),
        ),
    };
    Ok(SaturationDetector::from_plugin(ty, params, &path)?)
}

/// The top-level plugins as flowctl sees them.
pub fn plugin_decls(cfg: &EndpointPickerConfig) -> Vec<flowctl::PluginDecl<'_>> {
    cfg.plugins
        .iter()
        .map(|p| flowctl::PluginDecl {
            name: p.instance_name(),
            type_name: &p.type_name,
            parameters: p.parameters.as_ref(),
        })
        .collect()
}

/// The flow controller's configuration from the `flowControl` section (absent = all defaults).
pub fn controller_config(cfg: &EndpointPickerConfig) -> Result<ControllerConfig, ConfigError> {
    let empty = serde_json::Value::Object(Default::default());
    let section = cfg.flow_control.clone().unwrap_or(empty);
    let fc = flowctl::FlowControlConfig::from_value(&section)?;
    Ok(fc.resolve(&plugin_decls(cfg))?)
}
