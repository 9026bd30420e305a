//! What a load run reports: per-request records summarized (all requests, per tenant, per pod,
//! per turn bucket), as tables and an SVG.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::DEFAULT_TENANT;

/// Latency and cache figures of a set of requests.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub requests: u64,
    pub errors: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    #[serde(default)]
    pub ttft_p95_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p90_ms: f64,
    pub e2e_p99_ms: f64,
    /// Inter-token latency: per request, (e2e − TTFT) / (output tokens − 1); percentiles over the
    /// requests with more than one output token.
    #[serde(default)]
    pub itl_p50_ms: f64,
    #[serde(default)]
    pub itl_p99_ms: f64,
    pub cached_ratio: f64,
    pub output_tokens: u64,
    pub requests_per_s: f64,
    pub statuses: BTreeMap<u16, u64>,
    pub dropped: BTreeMap<String, u64>,
}

/// Results of one run against one target.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub target: String,
    pub requests: u64,
    /// Non-2xx answers, error events in the stream, and transport failures.
    pub errors: u64,
    /// Connection failures, timeouts and truncated streams.
    pub transport_errors: u64,
    pub ttft_p50_ms: f64,
    #[serde(default)]
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    #[serde(default)]
    pub e2e_p90_ms: f64,
    pub e2e_p99_ms: f64,
    /// Inter-token latency ([`Summary::itl_p50_ms`]).
    #[serde(default)]
    pub itl_p50_ms: f64,
    #[serde(default)]
    pub itl_p99_ms: f64,
    /// Sum of cached prompt tokens / sum of prompt tokens, from the usage chunks.
    pub cached_ratio: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    pub requests_per_s: f64,
    #[serde(default)]
    pub output_tokens_per_s: f64,
    pub duration_s: f64,
    /// Requests per serving pod (`x-inference-pod`).
    pub pods: BTreeMap<String, u64>,
    /// Requests per `x-llm-d-request-dropped-reason`.
    pub dropped: BTreeMap<String, u64>,
    /// Requests per HTTP status.
    pub statuses: BTreeMap<u16, u64>,
    /// Failed requests per reason: `status:<code>`, `dropped:<reason>`, `transport`, `stream_error`.
    #[serde(default)]
    pub error_reasons: BTreeMap<String, u64>,
    /// The same figures per tenant ([`DEFAULT_TENANT`] for conversations and short prompts).
    #[serde(default)]
    pub tenants: BTreeMap<String, Summary>,
    /// The same figures per serving pod: imbalance shows as one pod's TTFT or ITL above the rest.
    #[serde(default)]
    pub per_pod: BTreeMap<String, Summary>,
    /// The same figures for the conversations' early and late turns ([`TURN_BUCKETS`]).
    #[serde(default)]
    pub turns: BTreeMap<String, Summary>,
    /// TTFT of every successful request, sorted, in ms (for plots; not serialized).
    #[serde(skip)]
    pub ttft_samples_ms: Vec<f64>,
}

#[derive(Debug, Default)]
pub(super) struct Record {
    pub(super) status: Option<u16>,
    pub(super) error: bool,
    pub(super) transport_error: bool,
    pub(super) stream_error: bool,
    pub(super) ttft: Option<Duration>,
    pub(super) e2e: Duration,
    pub(super) prompt_tokens: u64,
    pub(super) cached_tokens: u64,
    pub(super) output_tokens: u64,
    pub(super) pod: Option<String>,
    pub(super) dropped: Option<String>,
    pub(super) tenant: Option<String>,
    /// A conversation's turn (0 = its first).
    pub(super) turn: Option<usize>,
}

/// The keys of [`Report::turns`]: a conversation's turns 1 to 4, and 5 and later (an agent loop
/// well under way).
pub const TURN_BUCKETS: [&str; 2] = ["turns 1-4", "turns 5+"];

/// Nearest-rank percentile of sorted values, in ms.
pub(super) fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let idx = rank.clamp(1, sorted.len()) - 1;
    sorted[idx].as_secs_f64() * 1000.0
}

fn summary(records: &[&Record], elapsed: Duration) -> Summary {
    let mut s = Summary {
        requests: records.len() as u64,
        ..Summary::default()
    };
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    let mut itl = Vec::new();
    let (mut prompt, mut cached) = (0u64, 0u64);
    for rec in records {
        if rec.error {
            s.errors += 1;
        } else {
            e2e.push(rec.e2e);
            ttft.extend(rec.ttft);
            if let Some(t) = rec.ttft
                && rec.output_tokens > 1
            {
                let gaps = u32::try_from(rec.output_tokens - 1).unwrap_or(u32::MAX);
                itl.push(rec.e2e.saturating_sub(t) / gaps);
            }
        }
        prompt += rec.prompt_tokens;
        cached += rec.cached_tokens;
        s.output_tokens += rec.output_tokens;
        if let Some(d) = &rec.dropped {
            *s.dropped.entry(d.clone()).or_default() += 1;
        }
        if let Some(st) = rec.status {
            *s.statuses.entry(st).or_default() += 1;
        }
    }
    ttft.sort();
    e2e.sort();
    itl.sort();
    s.itl_p50_ms = percentile_ms(&itl, 50.0);
    s.itl_p99_ms = percentile_ms(&itl, 99.0);
    s.ttft_p50_ms = percentile_ms(&ttft, 50.0);
    s.ttft_p90_ms = percentile_ms(&ttft, 90.0);
    s.ttft_p95_ms = percentile_ms(&ttft, 95.0);
    s.ttft_p99_ms = percentile_ms(&ttft, 99.0);
    s.e2e_p50_ms = percentile_ms(&e2e, 50.0);
    s.e2e_p90_ms = percentile_ms(&e2e, 90.0);
    s.e2e_p99_ms = percentile_ms(&e2e, 99.0);
    if prompt > 0 {
        s.cached_ratio = cached as f64 / prompt as f64;
    }
    if elapsed.as_secs_f64() > 0.0 {
        s.requests_per_s = s.requests as f64 / elapsed.as_secs_f64();
    }
    s
}

pub(super) fn summarize(target: &str, records: &[Record], elapsed: Duration) -> Report {
    let all: Vec<&Record> = records.iter().collect();
    let s = summary(&all, elapsed);
    let mut r = Report {
        target: target.to_owned(),
        requests: s.requests,
        errors: s.errors,
        ttft_p50_ms: s.ttft_p50_ms,
        ttft_p90_ms: s.ttft_p90_ms,
        ttft_p99_ms: s.ttft_p99_ms,
        e2e_p50_ms: s.e2e_p50_ms,
        e2e_p90_ms: s.e2e_p90_ms,
        e2e_p99_ms: s.e2e_p99_ms,
        cached_ratio: s.cached_ratio,
        output_tokens: s.output_tokens,
        requests_per_s: s.requests_per_s,
        duration_s: elapsed.as_secs_f64(),
        dropped: s.dropped,
        statuses: s.statuses,
        ..Report::default()
    };
    let mut by_tenant: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    let mut by_pod: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    let mut by_turn: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for rec in records {
        if let Some(t) = rec.turn {
            let bucket = TURN_BUCKETS[usize::from(t >= 4)];
            by_turn.entry(bucket.to_owned()).or_default().push(rec);
        }
        if rec.transport_error {
            r.transport_errors += 1;
        }
        r.prompt_tokens += rec.prompt_tokens;
        r.cached_tokens += rec.cached_tokens;
        if let Some(p) = &rec.pod {
            *r.pods.entry(p.clone()).or_default() += 1;
            by_pod.entry(p.clone()).or_default().push(rec);
        }
        if rec.error {
            let reason = match (&rec.dropped, rec.status) {
                (Some(d), _) => format!("dropped:{d}"),
                (None, Some(st)) if !(200..300).contains(&st) => format!("status:{st}"),
                _ if rec.stream_error => "stream_error".to_owned(),
                _ => "transport".to_owned(),
            };
            *r.error_reasons.entry(reason).or_default() += 1;
        }
        if !rec.error
            && let Some(t) = rec.ttft
        {
            r.ttft_samples_ms.push(t.as_secs_f64() * 1000.0);
        }
        let tenant = rec.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        by_tenant.entry(tenant.to_owned()).or_default().push(rec);
    }
    r.ttft_samples_ms.sort_by(f64::total_cmp);
    if r.duration_s > 0.0 {
        r.output_tokens_per_s = r.output_tokens as f64 / r.duration_s;
    }
    r.tenants = by_tenant
        .into_iter()
        .map(|(k, v)| (k, summary(&v, elapsed)))
        .collect();
    r.per_pod = by_pod
        .into_iter()
        .map(|(k, v)| (k, summary(&v, elapsed)))
        .collect();
    r.turns = by_turn
        .into_iter()
        .map(|(k, v)| (k, summary(&v, elapsed)))
        .collect();
    r.itl_p50_ms = s.itl_p50_ms;
    r.itl_p99_ms = s.itl_p99_ms;
    r
}

/// A table row: label and how to format a report's cell.
type TableRow = (&'static str, fn(&Report) -> String);

fn table(header: &[String], rows: &[(String, Vec<String>)]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|n| n.len().max(10)).collect();
    for (_, cells) in rows {
        for (w, c) in widths.iter_mut().zip(cells) {
            *w = (*w).max(c.len());
        }
    }
    let label_w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let mut out = format!("{:label_w$}", "");
    for (name, w) in header.iter().zip(&widths) {
        out.push_str(&format!("  {name:>w$}"));
    }
    out.push('\n');
    for (label, cells) in rows {
        out.push_str(&format!("{label:label_w$}"));
        for (c, w) in cells.iter().zip(&widths) {
            out.push_str(&format!("  {c:>w$}"));
        }
        out.push('\n');
    }
    out
}

fn counts<K: std::fmt::Display>(m: &BTreeMap<K, u64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Side-by-side table of reports, one column per target; then one block per tenant when any
/// report has tenant classes.
pub fn render_table(reports: &[(String, Report)]) -> String {
    let fmt_rows: Vec<TableRow> = vec![
        ("requests", (|r| r.requests.to_string())),
        ("errors", (|r| r.errors.to_string())),
        ("transport errors", (|r| r.transport_errors.to_string())),
        ("ttft p50 ms", (|r| format!("{:.2}", r.ttft_p50_ms))),
        ("ttft p90 ms", (|r| format!("{:.2}", r.ttft_p90_ms))),
        ("ttft p99 ms", (|r| format!("{:.2}", r.ttft_p99_ms))),
        ("e2e p50 ms", (|r| format!("{:.2}", r.e2e_p50_ms))),
        ("e2e p90 ms", (|r| format!("{:.2}", r.e2e_p90_ms))),
        ("e2e p99 ms", (|r| format!("{:.2}", r.e2e_p99_ms))),
        ("itl p50 ms", (|r| format!("{:.2}", r.itl_p50_ms))),
        ("itl p99 ms", (|r| format!("{:.2}", r.itl_p99_ms))),
        ("cached ratio", (|r| format!("{:.3}", r.cached_ratio))),
        ("requests/s", (|r| format!("{:.1}", r.requests_per_s))),
        (
            "output tokens/s",
            (|r| format!("{:.1}", r.output_tokens_per_s)),
        ),
        ("pods used", (|r| r.pods.len().to_string())),
        ("errors by reason", (|r| counts(&r.error_reasons))),
    ];
    let header: Vec<String> = reports.iter().map(|(n, _)| n.clone()).collect();
    let rows: Vec<(String, Vec<String>)> = fmt_rows
        .iter()
        .map(|(l, f)| ((*l).to_owned(), reports.iter().map(|(_, r)| f(r)).collect()))
        .collect();
    let mut out = table(&header, &rows);
    let mut tenants: Vec<&String> = reports.iter().flat_map(|(_, r)| r.tenants.keys()).collect();
    tenants.sort();
    tenants.dedup();
    if tenants.len() > 1 || tenants.first().is_some_and(|t| *t != DEFAULT_TENANT) {
        type SummaryRow = (&'static str, fn(&Summary) -> String);
        let srows: Vec<SummaryRow> = vec![
            ("requests", (|s| s.requests.to_string())),
            ("errors", (|s| s.errors.to_string())),
            ("ttft p50 ms", (|s| format!("{:.2}", s.ttft_p50_ms))),
            ("ttft p90 ms", (|s| format!("{:.2}", s.ttft_p90_ms))),
            ("ttft p99 ms", (|s| format!("{:.2}", s.ttft_p99_ms))),
            ("e2e p90 ms", (|s| format!("{:.2}", s.e2e_p90_ms))),
            ("cached ratio", (|s| format!("{:.3}", s.cached_ratio))),
            ("requests/s", (|s| format!("{:.1}", s.requests_per_s))),
            ("statuses", (|s| counts(&s.statuses))),
        ];
        for t in tenants {
            out.push_str(&format!("\ntenant {t}\n"));
            let rows: Vec<(String, Vec<String>)> = srows
                .iter()
                .map(|(l, f)| {
                    (
                        (*l).to_owned(),
                        reports
                            .iter()
                            .map(|(_, r)| r.tenants.get(t).map(f).unwrap_or_else(|| "-".into()))
                            .collect(),
                    )
                })
                .collect();
            out.push_str(&table(&header, &rows));
        }
    }
    let mut pods: Vec<&String> = reports.iter().flat_map(|(_, r)| r.per_pod.keys()).collect();
    pods.sort();
    pods.dedup();
    if !pods.is_empty() {
        out.push_str("\nper pod: requests · TTFT p50 / p99 ms · ITL p50 ms\n");
        let rows: Vec<(String, Vec<String>)> = pods
            .iter()
            .map(|p| {
                let cells = reports
                    .iter()
                    .map(|(_, r)| {
                        r.per_pod.get(*p).map_or_else(
                            || "-".into(),
                            |s| {
                                format!(
                                    "{} · {:.0} / {:.0} · {:.1}",
                                    s.requests, s.ttft_p50_ms, s.ttft_p99_ms, s.itl_p50_ms
                                )
                            },
                        )
                    })
                    .collect();
                ((*p).clone(), cells)
            })
            .collect();
        out.push_str(&table(&header, &rows));
    }
    out
}

/// An SVG chart of each report's TTFT distribution (empirical CDF, log-scaled time axis), one
/// coloured line per target.
pub fn render_svg(reports: &[(String, Report)]) -> String {
    const W: f64 = 720.0;
    const H: f64 = 420.0;
    const L: f64 = 60.0;
    const R: f64 = 160.0;
    const T: f64 = 30.0;
    const B: f64 = 50.0;
    const COLOURS: [&str; 6] = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    ];
    let all = reports
        .iter()
        .flat_map(|(_, r)| r.ttft_samples_ms.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let lo = if lo.is_finite() { lo.max(0.01) } else { 0.1 };
    let hi = hi.max(lo * 10.0);
    let (llo, lhi) = (lo.log10().floor(), hi.log10().ceil());
    let x = |v: f64| L + (v.max(lo).log10() - llo) / (lhi - llo) * (W - L - R);
    let y = |p: f64| T + (1.0 - p) * (H - T - B);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{L}\" y=\"18\" font-size=\"14\">TTFT distribution (CDF)</text>\n"
    );
    // Axes, decade ticks, quartile grid.
    out.push_str(&format!(
        "<line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{L}\" y1=\"{T}\" x2=\"{L}\" y2=\"{}\" stroke=\"black\"/>\n",
        H - B,
        W - R,
        H - B,
        H - B
    ));
    let mut d = llo;
    while d <= lhi {
        let v = 10f64.powf(d);
        out.push_str(&format!(
            "<line x1=\"{0:.1}\" y1=\"{T}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"#ddd\"/><text x=\"{0:.1}\" y=\"{2}\" text-anchor=\"middle\">{3}</text>\n",
            x(v),
            H - B,
            H - B + 16.0,
            if v >= 1.0 { format!("{v:.0}") } else { format!("{v}") }
        ));
        d += 1.0;
    }
    for q in [0.0, 0.25, 0.5, 0.75, 0.9, 1.0] {
        out.push_str(&format!(
            "<line x1=\"{L}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{q}</text>\n",
            y(q),
            W - R,
            L - 6.0,
            y(q) + 4.0
        ));
    }
    out.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">TTFT ms (log)</text>\n",
        (L + W - R) / 2.0,
        H - 12.0
    ));
    for (i, (name, r)) in reports.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let n = r.ttft_samples_ms.len();
        if n > 0 {
            // At most ~400 points per line.
            let step = n.div_ceil(400).max(1);
            let pts: Vec<String> = r
                .ttft_samples_ms
                .iter()
                .enumerate()
                .filter(|(k, _)| k % step == 0 || *k == n - 1)
                .map(|(k, v)| format!("{:.1},{:.1}", x(*v), y((k + 1) as f64 / n as f64)))
                .collect();
            out.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n",
                pts.join(" ")
            ));
        }
        let ly = T + 20.0 * i as f64 + 10.0;
        let label: String = name
            .chars()
            .filter(|c| !matches!(c, '<' | '>' | '&' | '"'))
            .collect();
        out.push_str(&format!(
            "<line x1=\"{0}\" y1=\"{ly}\" x2=\"{1}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"3\"/><text x=\"{2}\" y=\"{3}\">{label} (p50 {4:.1} ms)</text>\n",
            W - R + 10.0,
            W - R + 30.0,
            W - R + 36.0,
            ly + 4.0,
            r.ttft_p50_ms
        ));
    }
    out.push_str("</svg>\n");
    out
}
