//! Logs and traces.
//!
//! Logs: `--log-level` directives to stderr, with noisy libraries' repeated warnings rate-limited
//! ([`logs`]). Traces: off unless the standard OpenTelemetry environment asks for them — an OTLP
//! endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), or
//! `OTEL_TRACES_EXPORTER=otlp` (then `http://localhost:4317`); `OTEL_TRACES_EXPORTER=none` or
//! `OTEL_SDK_DISABLED=true` keep them off. The exporter speaks OTLP/gRPC (`grpc` is the only
//! protocol accepted) and reads the rest of its `OTEL_EXPORTER_OTLP_*` settings itself; the
//! sampler is `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default
//! `parentbased_always_on`; e.g. `parentbased_traceidratio` with `0.1`), the resource
//! `OTEL_SERVICE_NAME` (default `llm-d-epp`) and `OTEL_RESOURCE_ATTRIBUTES` (`service.instance.id`
//! defaults to the pod or host name and the process id).
//!
//! The request path's spans use the target [`TARGET`]: with traces off no layer is interested in
//! it, so creating them costs a disabled-callsite check and nothing else.

pub mod logs;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, bail};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::prelude::*;

/// The target of the request path's spans.
pub const TARGET: &str = "epp::trace";

/// The W3C trace-context header.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

static TRACES: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (decided once at start-up).
pub fn traces_on() -> bool {
    TRACES.load(Ordering::Relaxed)
}

/// What [`init`] set up; [`Telemetry::shutdown`] flushes the spans not yet exported.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    pub fn traces(&self) -> bool {
        self.provider.is_some()
    }

    /// Export what is buffered and stop (call inside the runtime the exporter was built in).
    pub fn shutdown(self) {
        if let Some(p) = self.provider
            && let Err(e) = p.shutdown()
        {
            tracing::warn!(error = %e, "flushing traces at shutdown failed");
        }
    }
}

/// Where traces go, from the environment: `None` when they are off.
pub fn traces_from_env(env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Option<String>> {
    let set = |k: &str| env(k).filter(|v| !v.trim().is_empty());
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let endpoint =
        set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let wanted = match set("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
        None => endpoint.is_some(),
        Some("none") => false,
        Some("otlp") => true,
        Some(other) => bail!("OTEL_TRACES_EXPORTER={other}: only `otlp` and `none` are supported"),
    };
    if !wanted {
        return Ok(None);
    }
    let protocol =
        set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"));
    if let Some(p) = protocol
        && p.trim() != "grpc"
    {
        bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={p}: the EPP exports traces over OTLP/gRPC only (`grpc`)"
        );
    }
    Ok(Some(
        endpoint.unwrap_or_else(|| "http://localhost:4317".to_string()),
    ))
}

/// Install the process' subscriber: logs at `log_level`, and — when `traces` and the
/// environment asks for them — the OTLP exporter (call inside a tokio runtime: the gRPC client
/// lives there).
pub fn init(log_level: &str, traces: bool) -> anyhow::Result<Telemetry> {
    let endpoint = if traces {
        traces_from_env(|k| std::env::var(k).ok())?
    } else {
        None
    };
    // One global level filter, as cheap as a static level check for whatever it turns off: the
    // request path's spans are on only when they are exported.
    let spans = if endpoint.is_some() { "info" } else { "off" };
    let filter = tracing_subscriber::EnvFilter::try_new(format!("{log_level},{TARGET}={spans}"))
        .with_context(|| format!("bad --log-level `{log_level}`"))?;
    // The log never shows the request path's spans, and holds back noisy libraries' repeats.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(logs::Quiet::new(logs::QUIET_INTERVAL, TARGET));
    let Some(endpoint) = endpoint else {
        tracing_subscriber::registry().with(filter).with(fmt).init();
        return Ok(Telemetry { provider: None });
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .context("building the OTLP trace exporter")?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("llm-d-epp");
    }
    // Which replica: the pod (or host) and the process, unless the environment names it.
    let named =
        std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.instance.id"));
    if !named {
        let host = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "epp".to_string());
        let id = format!("{host}/{}", std::process::id());
        resource = resource.with_attribute(opentelemetry::KeyValue::new("service.instance.id", id));
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    // Only the request path's spans become OpenTelemetry spans.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("llm-d-epp"))
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(
            tracing_subscriber::filter::Targets::new().with_target(TARGET, tracing::Level::TRACE),
        );
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .init();
    TRACES.store(true, Ordering::Relaxed);
    tracing::info!(%endpoint, "exporting traces over OTLP/gRPC");
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// The W3C trace context in `headers` (`traceparent`, `tracestate`).
pub fn extract(headers: &HashMap<String, String>) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(headers)
}

/// `span`'s context as W3C headers (`traceparent`, and `tracestate` when set); empty when the
/// span is not sampled or traces are off.
pub fn inject(span: &tracing::Span) -> Vec<(String, String)> {
    if span.is_disabled() {
        return Vec::new();
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut out: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut out);
    let mut v: Vec<(String, String)> = out.into_iter().collect();
    v.sort();
    v
}

/// The span context a `traceparent` value names (`None` if it is malformed).
pub fn span_context(traceparent: &str) -> Option<SpanContext> {
    let mut h = HashMap::new();
    h.insert(TRACEPARENT.to_string(), traceparent.to_string());
    let sc = extract(&h).span().span_context().clone();
    sc.is_valid().then_some(sc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn traces_are_off_unless_the_environment_asks() {
        assert_eq!(traces_from_env(env(&[])).unwrap(), None);
        assert_eq!(
            traces_from_env(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")])).unwrap(),
            Some("http://c:4317".into())
        );
        assert_eq!(
            traces_from_env(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:4317"),
            ]))
            .unwrap(),
            Some("http://t:4317".into())
        );
        assert_eq!(
            traces_from_env(env(&[("OTEL_TRACES_EXPORTER", "otlp")])).unwrap(),
            Some("http://localhost:4317".into())
        );
        for off in [
            [
                ("OTEL_TRACES_EXPORTER", "none"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ],
            [
                ("OTEL_SDK_DISABLED", "true"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ],
        ] {
            assert_eq!(traces_from_env(env(&off)).unwrap(), None);
        }
        assert!(traces_from_env(env(&[("OTEL_TRACES_EXPORTER", "zipkin")])).is_err());
        let http = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ];
        assert!(traces_from_env(env(&http)).is_err());
    }

    #[test]
    fn traceparents_round_trip() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = span_context(tp).unwrap();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled());
        assert!(span_context("00-garbage").is_none());
        assert!(span_context("").is_none());
    }
}
