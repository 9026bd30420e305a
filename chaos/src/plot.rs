//! A dependency-free SVG bar chart: groups (workloads) of bars (targets), one panel per metric.

use std::fmt::Write as _;

/// One panel: a metric's values, `values[group][series]`.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub unit: String,
    pub values: Vec<Vec<f64>>,
}

const COLORS: [&str; 6] = [
    "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Panels stacked vertically; every group has one bar per series, labelled with its value.
pub fn grouped_bars(title: &str, groups: &[String], series: &[String], panels: &[Panel]) -> String {
    let (width, panel_h, top, left) = (980.0, 260.0, 60.0, 70.0);
    let height = top + panels.len() as f64 * (panel_h + 70.0) + 40.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        svg,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" font-size="16" text-anchor="middle">{}</text>"#,
        width / 2.0,
        esc(title)
    );
    // Legend.
    for (k, s) in series.iter().enumerate() {
        let x = left + k as f64 * 170.0;
        let _ = write!(
            svg,
            r#"<rect x="{x}" y="36" width="12" height="12" fill="{}"/><text x="{}" y="46">{}</text>"#,
            COLORS[k % COLORS.len()],
            x + 16.0,
            esc(s)
        );
    }
    let plot_w = width - left - 20.0;
    for (p, panel) in panels.iter().enumerate() {
        let y0 = top + p as f64 * (panel_h + 70.0) + 20.0;
        let max = panel
            .values
            .iter()
            .flatten()
            .copied()
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max)
            .max(1e-9);
        let _ = write!(
            svg,
            r#"<text x="{left}" y="{}" font-size="14">{} ({})</text>"#,
            y0 - 4.0,
            esc(&panel.title),
            esc(&panel.unit)
        );
        let _ = write!(
            svg,
            r##"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#333"/>"##,
            y0 + panel_h,
            left + plot_w,
            y0 + panel_h
        );
        let group_w = plot_w / groups.len().max(1) as f64;
        let bar_w = (group_w * 0.8) / series.len().max(1) as f64;
        for (g, name) in groups.iter().enumerate() {
            let gx = left + g as f64 * group_w + group_w * 0.1;
            for (k, _) in series.iter().enumerate() {
                let v = panel
                    .values
                    .get(g)
                    .and_then(|row| row.get(k))
                    .copied()
                    .unwrap_or(f64::NAN);
                let h = if v.is_finite() {
                    (v / max) * (panel_h - 16.0)
                } else {
                    0.0
                };
                let x = gx + k as f64 * bar_w;
                let _ = write!(
                    svg,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"/>"#,
                    y0 + panel_h - h,
                    bar_w * 0.92,
                    COLORS[k % COLORS.len()]
                );
                let label = if v.is_finite() {
                    if v >= 100.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.1}")
                    }
                } else {
                    "n/a".to_string()
                };
                let _ = write!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle">{label}</text>"#,
                    x + bar_w * 0.46,
                    y0 + panel_h - h - 3.0
                );
            }
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                gx + group_w * 0.4,
                y0 + panel_h + 16.0,
                esc(name)
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_bar_and_label() {
        let svg = grouped_bars(
            "t<1>",
            &["w1".into(), "w2".into()],
            &["a".into(), "b".into()],
            &[Panel {
                title: "p50".into(),
                unit: "ms".into(),
                values: vec![vec![1.0, 2.0], vec![300.0, f64::NAN]],
            }],
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("t&lt;1&gt;"));
        assert_eq!(
            svg.matches("<rect").count(),
            1 + 2 + 4,
            "background, legend, bars"
        );
        for label in [">1.0<", ">2.0<", ">300<", ">n/a<"] {
            assert!(svg.contains(label), "{label}");
        }
    }
}
