//! "Why this pod?": the scheduling profiles run as a dry run, every step written down.
//!
//! [`Scheduler::explain`] runs exactly what routing runs ([`Scheduler::schedule_traced`]: the
//! producers, each profile's filters, scorers and picker, the P/D decider) with a [`Trace`] that
//! records each filter's verdict, each scorer's raw and weighted score per candidate, the totals
//! and the pick — and records nothing anywhere else: no in-flight charge, no prefix blocks, no
//! session binding (those happen in `pre_request`, which a dry run never calls). A random picker's
//! order is one draw from a fixed seed.
//!
//! The [`Explanation`] is what `POST /debug/schedule` returns and what `epp explain` prints
//! ([`Explanation::render`]).

use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::scheduler::{PdDecider, Profile, Scheduler, Trace, WeightedScorer, clamped};
use super::{Filter, InflightLoad, Prediction, RequestData, SchedRequest};
use crate::datalayer::store::Candidate;

/// One dry run: the request as the scheduler saw it, the candidates, each profile's steps and
/// the outcome.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    pub model: String,
    pub target_model: String,
    /// Prompt length in tokens: the engine's (`tokenized`) or estimated from the text.
    pub prompt_tokens: usize,
    pub tokenized: bool,
    /// The prompt's prefix blocks (when a prefix producer runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixView>,
    pub candidates: Vec<CandidateView>,
    pub profiles: Vec<ProfileView>,
    /// The P/D decider's verdict (disaggregated configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregate: Option<DeciderView>,
    /// The pods routing would send the request to, best first (pod names).
    pub picked: Vec<String>,
    /// The prefill pod of a disaggregated request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<String>,
    /// Why there is no pick (no candidates, all filtered out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefixView {
    pub block_size: usize,
    pub total_blocks: usize,
}

/// A candidate pod and the state its scores came from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CandidateView {
    pub pod: String,
    pub address: String,
    /// No usable metrics (never scraped, or older than the staleness threshold).
    pub stale: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_usage: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active_models: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_models: Vec<String>,
    /// Leading prompt blocks cached on the pod, by the prefix index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_blocks: Option<usize>,
    /// The in-flight ledger's load on the pod (when an in-flight producer runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflight: Option<InflightLoad>,
    /// The cost model's prediction for this request on the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Prediction>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileView {
    pub name: String,
    pub filters: Vec<FilterView>,
    pub scorers: Vec<ScorerView>,
    /// Each kept candidate's total (Σ clamp(raw) × weight), in candidate order.
    pub totals: Vec<Score>,
    pub picker: String,
    /// Picked pods, best first.
    pub picked: Vec<String>,
}

/// A filter's verdict: the pods it removed and how many it left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FilterView {
    #[serde(rename = "type")]
    pub type_name: String,
    pub removed: Vec<String>,
    pub kept: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScorerView {
    pub name: String,
    #[serde(rename = "type")]
    pub type_name: String,
    pub weight: f64,
    /// Per kept candidate, in candidate order.
    pub scores: Vec<ScorerScore>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScorerScore {
    pub pod: String,
    /// What the scorer returned.
    pub raw: f64,
    /// What it added to the total: clamp(raw, 0, 1) × weight.
    pub weighted: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Score {
    pub pod: String,
    pub total: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeciderView {
    #[serde(rename = "type")]
    pub type_name: String,
    pub disaggregate: bool,
}

/// The [`Trace`] of a dry run: builds the profile views as the run goes.
struct Recorder<'a> {
    names: Vec<&'a str>,
    data: Option<RequestData>,
    profiles: Vec<ProfileView>,
    decider: Option<DeciderView>,
    /// The candidates the last filter left (filters remove, so a diff names the removed).
    kept: Vec<usize>,
}

impl Recorder<'_> {
    fn current(&mut self) -> &mut ProfileView {
        if self.profiles.is_empty() {
            self.profiles.push(ProfileView::default());
        }
        let last = self.profiles.len() - 1;
        &mut self.profiles[last]
    }

    fn name(&self, i: usize) -> String {
        self.names.get(i).copied().unwrap_or("?").to_string()
    }
}

impl Trace for Recorder<'_> {
    fn produced(&mut self, data: &RequestData) {
        self.data = Some(data.clone());
    }

    fn profile(&mut self, profile: &Profile) {
        self.kept = (0..self.names.len()).collect();
        self.profiles.push(ProfileView {
            name: profile.name.clone(),
            picker: profile.picker.type_name().to_string(),
            ..ProfileView::default()
        });
    }

    fn filtered(&mut self, filter: &dyn Filter, keep: &[usize]) {
        let removed = self
            .kept
            .iter()
            .filter(|i| !keep.contains(i))
            .map(|i| self.name(*i))
            .collect();
        self.kept = keep.to_vec();
        let view = FilterView {
            type_name: filter.type_name().to_string(),
            removed,
            kept: keep.len(),
        };
        self.current().filters.push(view);
    }

    fn scored(&mut self, scorer: &WeightedScorer, keep: &[usize], raw: &[f64]) {
        let scores = keep
            .iter()
            .zip(raw)
            .map(|(i, r)| ScorerScore {
                pod: self.name(*i),
                raw: *r,
                weighted: clamped(*r) * scorer.weight,
            })
            .collect();
        let view = ScorerView {
            name: scorer.name.clone(),
            type_name: scorer.scorer.type_name().to_string(),
            weight: scorer.weight,
            scores,
        };
        self.current().scorers.push(view);
    }

    fn totals(&mut self, totals: &[(usize, f64)]) {
        let totals = totals
            .iter()
            .map(|(i, t)| Score {
                pod: self.name(*i),
                total: *t,
            })
            .collect();
        self.current().totals = totals;
    }

    fn picked(&mut self, picked: &[usize]) {
        let picked = picked.iter().map(|i| self.name(*i)).collect();
        self.current().picked = picked;
    }

    fn decided(&mut self, decider: &PdDecider, disaggregate: bool) {
        self.decider = Some(DeciderView {
            type_name: decider.type_name().to_string(),
            disaggregate,
        });
    }
}

impl Scheduler {
    /// Run the profiles for `req` over `candidates` as routing would, recording every step and
    /// changing nothing.
    pub fn explain(&self, req: &SchedRequest<'_>, candidates: &[Candidate]) -> Explanation {
        let mut rec = Recorder {
            names: candidates
                .iter()
                .map(|c| c.endpoint.name.as_str())
                .collect(),
            data: None,
            profiles: Vec::new(),
            decider: None,
            kept: Vec::new(),
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let outcome = self.schedule_traced(req, candidates, &mut rng, &mut rec);
        let data = rec.data.take().unwrap_or_default();
        let mut out = Explanation {
            model: req.model.to_string(),
            target_model: req.target_model.to_string(),
            prompt_tokens: data.prompt_tokens,
            tokenized: req.tokens.is_some(),
            prefix: data.prefix.as_ref().map(|p| PrefixView {
                block_size: p.block_size,
                total_blocks: p.total_blocks,
            }),
            candidates: candidates
                .iter()
                .enumerate()
                .map(|(i, c)| candidate_view(c, i, &data))
                .collect(),
            disaggregate: rec.decider.take(),
            ..Explanation::default()
        };
        match outcome {
            Ok(d) => {
                out.picked = d.picked.iter().map(|i| rec.name(*i)).collect();
                out.prefill = d.prefill.map(|i| rec.name(i));
            }
            Err(e) => out.error = Some(e.to_string()),
        }
        out.profiles = rec.profiles;
        out
    }
}

fn candidate_view(c: &Candidate, i: usize, data: &RequestData) -> CandidateView {
    let m = c.metrics();
    CandidateView {
        pod: c.endpoint.name.clone(),
        address: c.endpoint.hostport.clone(),
        stale: m.is_none(),
        waiting: m.and_then(|m| m.waiting_queue_size),
        running: m.and_then(|m| m.running_requests),
        kv_cache_usage: m.and_then(|m| m.kv_cache_usage),
        active_models: m.map(|m| m.active_models.clone()).unwrap_or_default(),
        waiting_models: m.map(|m| m.waiting_models.clone()).unwrap_or_default(),
        prefix_blocks: data.prefix.as_ref().and_then(|p| p.matched.get(i).copied()),
        inflight: data.inflight.get(i).copied(),
        predicted: data.predicted.get(i).copied(),
    }
}

impl Explanation {
    /// The explanation as text: the request, the candidates' state, then per profile the
    /// filters' verdicts and a table of every scorer's raw score and weighted contribution per
    /// pod (best total first), and the pick.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let model = if self.model == self.target_model {
            self.model.clone()
        } else {
            format!("{} → {}", self.model, self.target_model)
        };
        let tokens = if self.tokenized {
            "tokenized"
        } else {
            "estimated"
        };
        out += &format!(
            "request: model {model}, {} prompt tokens ({tokens})",
            self.prompt_tokens
        );
        if let Some(p) = &self.prefix {
            out += &format!(", {} prefix blocks of {}", p.total_blocks, p.block_size);
        }
        out += "\n\ncandidates:\n";
        let num = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v}"));
        let mut rows = vec![
            [
                "pod",
                "address",
                "waiting",
                "running",
                "kv%",
                "lora (active/waiting)",
                "prefix",
                "in-flight",
                "predicted ttft",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for c in &self.candidates {
            let lora = if c.active_models.is_empty() && c.waiting_models.is_empty() {
                "-".to_string()
            } else {
                format!(
                    "{}/{}",
                    c.active_models.join(","),
                    c.waiting_models.join(",")
                )
            };
            rows.push(vec![
                c.pod.clone(),
                c.address.clone(),
                if c.stale {
                    "stale".to_string()
                } else {
                    num(c.waiting)
                },
                num(c.running),
                c.kv_cache_usage
                    .map_or("-".to_string(), |k| format!("{:.0}", k * 100.0)),
                lora,
                c.prefix_blocks.map_or("-".to_string(), |b| format!("{b}")),
                c.inflight.map_or("-".to_string(), |l| {
                    format!("{} req / {} tok", l.requests, l.tokens)
                }),
                c.predicted
                    .map_or("-".to_string(), |p| format!("{:.1} ms", p.ttft_ms)),
            ]);
        }
        out += &text_table(&rows);
        for p in &self.profiles {
            out += &format!("\nprofile {} (picker {}):\n", p.name, p.picker);
            for f in &p.filters {
                let removed = if f.removed.is_empty() {
                    "none".to_string()
                } else {
                    f.removed.join(", ")
                };
                out += &format!(
                    "  filter {}: removed {removed}; {} left\n",
                    f.type_name, f.kept
                );
            }
            let mut header = vec!["pod".to_string()];
            header.extend(
                p.scorers
                    .iter()
                    .map(|s| format!("{} ×{}", s.name, s.weight)),
            );
            header.push("total".to_string());
            let mut order: Vec<&Score> = p.totals.iter().collect();
            order.sort_by(|a, b| b.total.total_cmp(&a.total));
            let mut rows = vec![header];
            for t in order {
                let mut row = vec![t.pod.clone()];
                for s in &p.scorers {
                    row.push(
                        s.scores
                            .iter()
                            .find(|x| x.pod == t.pod)
                            .map_or("-".to_string(), |x| {
                                format!("{:.3} → {:.3}", x.raw, x.weighted)
                            }),
                    );
                }
                row.push(format!("{:.3}", t.total));
                rows.push(row);
            }
            if !p.totals.is_empty() {
                out += &indent(&text_table(&rows));
            }
            if !p.picked.is_empty() {
                out += &format!("  picked: {}\n", p.picked.join(", "));
            }
        }
        if let Some(d) = &self.disaggregate {
            out += &format!(
                "\n{}: {}\n",
                d.type_name,
                if d.disaggregate {
                    "disaggregate"
                } else {
                    "decode only"
                }
            );
        }
        out += "\n";
        match &self.error {
            Some(e) => out += &format!("no pick: {e}\n"),
            None => {
                out += &format!("picked: {}", self.picked.join(", "));
                if let Some(p) = &self.prefill {
                    out += &format!(" (prefill on {p})");
                }
                out += "\n";
            }
        }
        out
    }
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// Rows as left-aligned columns two spaces apart (the first row is the header).
pub fn text_table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out += line.join("  ").trim_end();
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EndpointPickerConfig;
    use crate::datalayer::EndpointMetrics;
    use crate::request::parse::Prompt;
    use crate::scheduling::testutil::*;

    /// A scorer's type, weight and `(raw, weighted)` per pod.
    type ScorerRow<'a> = (&'a str, f64, Vec<(f64, f64)>);

    /// Prefix ×3, queue ×2, KV ×1, LoRA ×1, behind a label selector that drains pod `e`.
    const CONFIG: &str = r#"
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {autoTune: false, blockSizeTokens: 64}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- name: serving
  type: label-selector-filter
  parameters:
    matchExpressions: [{key: drain, operator: DoesNotExist}]
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: serving
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: lora-affinity-scorer
  - pluginRef: max-score-picker
"#;

    fn pod(
        name: &str,
        ip: &str,
        queue: f64,
        kv: f64,
        lora: (u64, &[&str], &[&str]),
        labels: &[(&str, &str)],
    ) -> Candidate {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        let m = EndpointMetrics {
            waiting_queue_size: Some(queue),
            running_requests: Some(1.0),
            kv_cache_usage: Some(kv),
            max_active_models: Some(lora.0),
            active_models: strings(lora.1),
            waiting_models: strings(lora.2),
            ..Default::default()
        };
        cand_at(name, &format!("{ip}:8000"), Some(m), false, labels)
    }

    fn request<'a>(prompt: &'a Prompt) -> SchedRequest<'a> {
        SchedRequest { prompt, ..req() }
    }

    /// Four pods, each best at one thing: `a` holds half the prompt's prefix and has adapter `m`
    /// loaded, `b` has the shortest queue and a free adapter slot, `c` has `m` waiting, `d` an
    /// empty KV cache but a full adapter table; `e` is drained by the filter.
    #[test]
    fn explains_every_plugins_scores_and_the_pick() {
        let built =
            crate::scheduling::build(&EndpointPickerConfig::from_yaml(CONFIG).unwrap()).unwrap();
        let sched = built.scheduler;
        let pods = vec![
            pod("a", "10.0.0.1", 4.0, 0.5, (4, &["m"], &[]), &[]),
            pod("b", "10.0.0.2", 0.0, 0.2, (4, &["x"], &[]), &[]),
            pod("c", "10.0.0.3", 2.0, 0.9, (2, &["x", "y"], &["m"]), &[]),
            pod("d", "10.0.0.4", 8.0, 0.0, (2, &["x", "y"], &[]), &[]),
            pod(
                "e",
                "10.0.0.5",
                0.0,
                0.0,
                (4, &["m"], &[]),
                &[("drain", "yes")],
            ),
        ];
        // 64-token blocks of 4-byte estimate tokens: 256 bytes a block. `a` served the first 8
        // blocks of the 16-block prompt explained below.
        let text: Vec<u8> = (0..4096u32).map(|i| b'a' + (i % 23) as u8).collect();
        let head = Prompt::Text(text[..2048].to_vec());
        let only_a = &pods[..1];
        let d = sched
            .schedule(&request(&head), only_a, &mut rand::rng())
            .unwrap();
        sched.pre_request(&request(&head), &d, only_a);

        let prompt = Prompt::Text(text);
        let before = sched.schedule(&request(&prompt), &pods, &mut rand::rng());
        let x = sched.explain(&request(&prompt), &pods);

        assert_eq!(x.prompt_tokens, 1024);
        assert_eq!(
            x.prefix,
            Some(PrefixView {
                block_size: 64,
                total_blocks: 16
            })
        );
        let blocks: Vec<_> = x.candidates.iter().map(|c| c.prefix_blocks).collect();
        assert_eq!(blocks, [Some(8), Some(0), Some(0), Some(0), Some(0)]);
        assert_eq!(x.profiles.len(), 1);
        let p = &x.profiles[0];
        assert_eq!(p.filters.len(), 1);
        assert_eq!(p.filters[0].type_name, "label-selector-filter");
        assert_eq!(p.filters[0].removed, ["e"]);
        assert_eq!(p.filters[0].kept, 4);
        let table: Vec<ScorerRow> = p
            .scorers
            .iter()
            .map(|s| {
                let scores = s.scores.iter().map(|x| (x.raw, x.weighted)).collect();
                (s.type_name.as_str(), s.weight, scores)
            })
            .collect();
        let expected: Vec<ScorerRow> = vec![
            // matched / total blocks
            (
                "prefix-cache-scorer",
                3.0,
                vec![(0.5, 1.5), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)],
            ),
            // (maxQ − q) / (maxQ − minQ) over queues 4, 0, 2, 8
            (
                "queue-scorer",
                2.0,
                vec![(0.5, 1.0), (1.0, 2.0), (0.75, 1.5), (0.0, 0.0)],
            ),
            // 1 − KV usage
            (
                "kv-cache-utilization-scorer",
                1.0,
                vec![(0.5, 0.5), (0.8, 0.8), (0.1, 0.1), (1.0, 1.0)],
            ),
            // active 1.0, free slot 0.8, waiting 0.6, full 0
            (
                "lora-affinity-scorer",
                1.0,
                vec![(1.0, 1.0), (0.8, 0.8), (0.6, 0.6), (0.0, 0.0)],
            ),
        ];
        assert_eq!(table.len(), expected.len());
        for (got, want) in table.iter().zip(&expected) {
            assert_eq!(got.0, want.0);
            assert_eq!(got.1, want.1);
            for (g, w) in got.2.iter().zip(&want.2) {
                assert!(
                    (g.0 - w.0).abs() < 1e-9 && (g.1 - w.1).abs() < 1e-9,
                    "{}: {:?} ≠ {:?}",
                    got.0,
                    got.2,
                    want.2
                );
            }
        }
        let totals: Vec<(&str, f64)> = p.totals.iter().map(|t| (t.pod.as_str(), t.total)).collect();
        for ((pod, t), (wpod, w)) in
            totals
                .iter()
                .zip([("a", 4.0), ("b", 3.6), ("c", 2.2), ("d", 1.0)])
        {
            assert_eq!(*pod, wpod);
            assert!((t - w).abs() < 1e-9, "{pod}: {t} ≠ {w}");
        }
        assert_eq!(p.picked, ["a"]);
        assert_eq!(x.picked, ["a"]);
        assert_eq!(x.error, None);
        // The dry run agrees with routing and changed nothing: explaining again gives the same.
        assert_eq!(before.unwrap().picked, [0]);
        assert_eq!(sched.explain(&request(&prompt), &pods), x);

        // The printed form carries the same numbers, best total first.
        let text = x.render();
        assert!(
            text.contains("filter label-selector-filter: removed e; 4 left"),
            "{text}"
        );
        let rows: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.contains("prefix-cache-scorer ×3"))
            .skip(1)
            .take(4)
            .collect();
        assert!(rows[0].trim_start().starts_with('a'), "{text}");
        assert!(
            rows[0].contains("0.500 → 1.500") && rows[0].ends_with("4.000"),
            "{text}"
        );
        assert!(
            rows[1].trim_start().starts_with('b') && rows[1].ends_with("3.600"),
            "{text}"
        );
        assert!(
            rows[3].trim_start().starts_with('d') && rows[3].ends_with("1.000"),
            "{text}"
        );
        assert!(text.ends_with("picked: a\n"), "{text}");
        // And it survives the trip through JSON that `epp explain` makes.
        let back: Explanation = serde_json::from_str(&serde_json::to_string(&x).unwrap()).unwrap();
        assert_eq!(back, x);
    }

    #[test]
    fn no_pick_is_explained() {
        let built =
            crate::scheduling::build(&EndpointPickerConfig::from_yaml(CONFIG).unwrap()).unwrap();
        let pods = vec![pod(
            "e",
            "10.0.0.5",
            0.0,
            0.0,
            (4, &["m"], &[]),
            &[("drain", "yes")],
        )];
        let prompt = Prompt::None;
        let x = built.scheduler.explain(&request(&prompt), &pods);
        assert_eq!(x.error.as_deref(), Some("all endpoints were filtered out"));
        assert_eq!(x.profiles[0].filters[0].removed, ["e"]);
        assert!(x.picked.is_empty());
        assert!(
            x.render()
                .ends_with("no pick: all endpoints were filtered out\n")
        );
        let none = built.scheduler.explain(&request(&prompt), &[]);
        assert_eq!(none.error.as_deref(), Some("no candidate endpoints"));
    }
}
