//! Runs the scheduling profiles for one request: producers once, then per profile filters,
//! weighted scorers and the picker; the profile handler decides which profiles run.
//!
//! Aggregation follows llm-d: every scorer's per-endpoint score is clamped to [0, 1], multiplied by
//! its weight and summed (not normalised by the sum of weights). Filters run in order and stop the
//! profile when they leave nothing (→ 429 `rejected-saturated`).

use std::sync::Arc;

use super::{Filter, Picker, Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

#[derive(Debug, Clone)]
pub struct WeightedScorer {
    pub name: String,
    pub weight: f64,
    pub scorer: Arc<dyn Scorer>,
}

#[derive(Debug, Clone)]
pub struct Profile {
    pub name: String,
    pub filters: Vec<Arc<dyn Filter>>,
    pub scorers: Vec<WeightedScorer>,
    pub picker: Arc<dyn Picker>,
}

/// Whether a prefill/decode split is worth it for this request (llm-d's P/D deciders).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PdDecider {
    /// `prefix-based-pd-decider`: disaggregate when the prompt has at least `prompt_tokens` tokens
    /// (0 = no gate) and at least `non_cached_tokens` of them are not cached on the chosen decode
    /// pod (0 = never disaggregate).
    PrefixBased {
        non_cached_tokens: usize,
        prompt_tokens: usize,
    },
    /// `always-disagg-pd-decider`.
    Always,
    /// `always-disagg-multimodal-decider`: disaggregate requests whose prompt carries images,
    /// audio or video.
    Multimodal,
}

impl PdDecider {
    pub fn type_name(&self) -> &'static str {
        match self {
            PdDecider::PrefixBased { .. } => PREFIX_BASED_PD_DECIDER,
            PdDecider::Always => ALWAYS_DISAGG_PD_DECIDER,
            PdDecider::Multimodal => ALWAYS_DISAGG_MULTIMODAL_DECIDER,
        }
    }

    /// Decide for the request routed to decode candidate `decode`.
    pub fn disaggregate(&self, req: &SchedRequest<'_>, data: &RequestData, decode: usize) -> bool {
        match *self {
            PdDecider::Always => true,
            PdDecider::Multimodal => req.multimodal(),
            PdDecider::PrefixBased {
                non_cached_tokens,
                prompt_tokens,
            } => {
                non_cached_tokens > 0
                    && data.prompt_tokens >= prompt_tokens
                    && data.uncached_tokens(decode) >= non_cached_tokens
            }
        }
    }
}

pub const PREFIX_BASED_PD_DECIDER: &str = "prefix-based-pd-decider";
pub const ALWAYS_DISAGG_PD_DECIDER: &str = "always-disagg-pd-decider";
pub const ALWAYS_DISAGG_MULTIMODAL_DECIDER: &str = "always-disagg-multimodal-decider";

/// The profile handler.
#[derive(Debug, Clone)]
pub enum Handler {
    /// `single-profile-handler`: run the one profile.
    Single(Profile),
    /// `disagg-profile-handler`: run the decode profile; then, if the decider approves, the
    /// prefill profile, whose pick is sent upstream as `x-prefiller-host-port`.
    Disagg {
        decode: Profile,
        prefill: Option<(Profile, PdDecider)>,
    },
    /// `header-profile-handler` (llm-d, alpha): the request header `header` names the profile to
    /// run, `default` when it is absent or empty; with a single profile, that one whatever the
    /// header says.
    Header {
        header: String,
        default: String,
        profiles: Vec<Profile>,
    },
}

#[derive(Debug, Clone)]
pub struct Scheduler {
    pub producers: Vec<Arc<dyn Producer>>,
    pub handler: Handler,
    /// The approximate prefix index, when one runs (its size is a metric).
    pub prefix_index: Option<Arc<super::prefix::ApproxPrefixProducer>>,
    /// The precise prefix index, when one runs (the KV-event subscriber feeds it).
    pub precise: Option<Arc<super::precise::PrecisePrefixProducer>>,
    /// The cost model, when one runs (`/debug/cost-model`).
    pub cost_model: Option<Arc<super::cost_model::CostModel>>,
    /// Session-affinity plugins in use (they bind sessions and write tokens back).
    pub sessions: Vec<Arc<super::session::SessionAffinity>>,
    /// The prefill profile's name (a session plugin's `profileName` may point at it).
    pub prefill_profile: Option<String>,
    /// Admitter plugins, asked in order after the producers.
    pub admitters: Vec<Arc<dyn super::admitter::Admitter>>,
    /// Data-parallel ranks (`data-parallel-profile-handler`, `pd-profile-handler.primaryPort`):
    /// the candidates are DP ranks (`ip:rankPort`); the request goes to `ip:` this port with the
    /// rank in `x-data-parallel-host-port`.
    pub rank_port: Option<u16>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SchedError {
    #[error("no candidate endpoints")]
    NoCandidates,
    #[error("all endpoints were filtered out")]
    AllFiltered,
    /// An admitter plugin turned the request away.
    #[error("shed by {0}")]
    NotAdmitted(&'static str),
    /// `header-profile-handler`: no profile has the name the request asked for.
    #[error("no scheduling profile `{0}`")]
    NoProfile(String),
}

/// The outcome: chosen candidate indices, best first, each candidate's total score (0 for
/// filtered-out candidates) and the data the producers computed.
#[derive(Debug, Clone)]
pub struct Decision {
    pub picked: Vec<usize>,
    pub scores: Vec<f64>,
    pub data: RequestData,
    /// The prefill pod of a disaggregated request.
    pub prefill: Option<usize>,
}

impl Scheduler {
    /// The request headers that steer scheduling: the SLO headers (latency-aware plugins) and the
    /// header that names a profile (`header-profile-handler`). For the EPP only — removed before
    /// the model server — and, in tenant mode, not the client's to set: nothing grants them.
    pub fn control_headers(&self) -> impl Iterator<Item = &str> {
        let profile = match &self.handler {
            Handler::Header { header, .. } => Some(header.as_str()),
            _ => None,
        };
        super::latency::TTFT_SLO_HEADERS
            .into_iter()
            .chain(super::latency::TPOT_SLO_HEADERS)
            .chain(profile)
    }

    /// The headers scheduling may read: all of them, or in tenant mode (`untrusted`) a copy
    /// without the [control headers](Self::control_headers) when the client sent one.
    pub fn granted_headers<'a>(
        &self,
        headers: &'a std::collections::HashMap<String, String>,
        untrusted: bool,
    ) -> std::borrow::Cow<'a, std::collections::HashMap<String, String>> {
        if !untrusted || !self.control_headers().any(|h| headers.contains_key(h)) {
            return std::borrow::Cow::Borrowed(headers);
        }
        let mut h = headers.clone();
        for name in self.control_headers() {
            h.remove(name);
        }
        std::borrow::Cow::Owned(h)
    }

    /// The primary profile (the single one, the decode profile, or the header handler's default
    /// — its first profile when the default names none).
    pub fn primary(&self) -> &Profile {
        match &self.handler {
            Handler::Single(p) => p,
            Handler::Disagg { decode, .. } => decode,
            Handler::Header {
                default, profiles, ..
            } => profiles
                .iter()
                .find(|p| p.name == *default)
                .unwrap_or(&profiles[0]),
        }
    }

    /// The profile that routes `req` (the primary one but with the header handler).
    fn profile_for(&self, req: &SchedRequest<'_>) -> Result<&Profile, SchedError> {
        let Handler::Header {
            header,
            default,
            profiles,
        } = &self.handler
        else {
            return Ok(self.primary());
        };
        if let [only] = profiles.as_slice() {
            return Ok(only);
        }
        let name = req
            .headers
            .get(header)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
            .unwrap_or(default);
        profiles
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| SchedError::NoProfile(name.chars().take(64).collect()))
    }

    pub fn schedule(
        &self,
        req: &SchedRequest<'_>,
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> Result<Decision, SchedError> {
        self.schedule_traced(req, candidates, rng, &mut ())
    }

    /// [`Self::schedule`], showing `trace` every step (the dry run of `explain` does; routing
    /// passes `()`, which compiles to nothing).
    pub(crate) fn schedule_traced<T: Trace>(
        &self,
        req: &SchedRequest<'_>,
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
        trace: &mut T,
    ) -> Result<Decision, SchedError> {
        if candidates.is_empty() {
            return Err(SchedError::NoCandidates);
        }
        let mut data = RequestData {
            prompt_tokens: req
                .tokens
                .map_or(req.prompt.estimated_tokens() as usize, <[u32]>::len),
            ..RequestData::default()
        };
        for p in &self.producers {
            p.produce(req, candidates, &mut data);
        }
        trace.produced(&data);
        if let Some(a) = self
            .admitters
            .iter()
            .find(|a| !a.admit(req, &data, candidates, rng))
        {
            return Err(SchedError::NotAdmitted(a.type_name()));
        }
        let mut scores = vec![0.0; candidates.len()];
        let picked = run_profile(
            self.profile_for(req)?,
            req,
            &data,
            candidates,
            rng,
            &mut scores,
            trace,
        )?;
        let mut prefill = None;
        if let Handler::Disagg {
            prefill: Some((profile, decider)),
            ..
        } = &self.handler
        {
            let split = decider.disaggregate(req, &data, picked[0]);
            trace.decided(decider, split);
            if split {
                let mut unused = vec![0.0; candidates.len()];
                // No prefill pod left (all filtered): decode does the prefill itself, as llm-d.
                prefill = run_profile(profile, req, &data, candidates, rng, &mut unused, trace)
                    .ok()
                    .and_then(|p| p.first().copied())
                    .filter(|p| *p != picked[0]);
            }
        }
        Ok(Decision {
            picked,
            scores,
            data,
            prefill,
        })
    }

    /// Let producers record the decision (prefix blocks → the chosen pod, in-flight load).
    pub fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        decision: &Decision,
        candidates: &[Candidate],
    ) {
        let Some(&primary) = decision.picked.first() else {
            return;
        };
        if primary >= candidates.len() {
            return;
        }
        let prefill = decision.prefill.filter(|p| *p < candidates.len());
        // In the reverse of `produce`'s order: a decision reads the prefix index before the
        // in-flight ledger, so the ledger is charged before the index records — a decision taken
        // meanwhile that sees this request's prefix on the pod sees its load there too (seeing the
        // prefix without the load, bursts of long prompts sharing a system prompt piled up).
        for p in self.producers.iter().rev() {
            p.pre_request(req, &decision.data, candidates, primary, prefill);
        }
        if decision.picked.len() > 1
            && let Some(index) = &self.prefix_index
        {
            // Envoy may serve it from a fallback: the response will say (served endpoint).
            index.remember_for_fallback(req.request_id, &decision.data);
        }
        for s in &self.sessions {
            if let Some(pod) = s.pinned(self.prefill_profile.as_deref(), primary, prefill) {
                s.pre_request(req, candidates, pod);
            }
        }
    }

    /// A response ended and was observed here: producers that learn from outcomes learn.
    pub fn observed(&self, obs: &super::Observation<'_>) {
        for p in &self.producers {
            p.observed(obs);
        }
    }

    /// Session tokens to write back on the response, `(header, token)`.
    pub fn session_tokens(
        &self,
        decision: &Decision,
        candidates: &[Candidate],
    ) -> Vec<(String, String)> {
        let Some(&primary) = decision.picked.first() else {
            return Vec::new();
        };
        self.sessions
            .iter()
            .filter_map(|s| {
                let pod = s.pinned(self.prefill_profile.as_deref(), primary, decision.prefill)?;
                s.response_token(candidates, pod)
            })
            .collect()
    }
}

/// What a scheduling run shows an observer, step by step. Every method defaults to nothing: `()`
/// is the router's (free) trace, `explain`'s dry run records everything.
pub(crate) trait Trace {
    /// The producers filled the request's data.
    fn produced(&mut self, _data: &RequestData) {}
    /// A profile starts.
    fn profile(&mut self, _profile: &Profile) {}
    /// `filter` ran and left `keep`.
    fn filtered(&mut self, _filter: &dyn Filter, _keep: &[usize]) {}
    /// A scorer scored the kept candidates `keep`: `raw[k]` belongs to `keep[k]`, before the
    /// clamp to [0, 1] and the weight.
    fn scored(&mut self, _scorer: &WeightedScorer, _keep: &[usize], _raw: &[f64]) {}
    /// The totals the picker receives, `(candidate, total)`.
    fn totals(&mut self, _totals: &[(usize, f64)]) {}
    /// What the picker picked, best first.
    fn picked(&mut self, _picked: &[usize]) {}
    /// The P/D decider's verdict.
    fn decided(&mut self, _decider: &PdDecider, _disaggregate: bool) {}
}

impl Trace for () {}

/// One profile: filters in order, weighted scorers summed, the picker. `scores` receives every
/// kept candidate's total.
fn run_profile<T: Trace>(
    profile: &Profile,
    req: &SchedRequest<'_>,
    data: &RequestData,
    candidates: &[Candidate],
    rng: &mut dyn rand::RngCore,
    scores: &mut [f64],
    trace: &mut T,
) -> Result<Vec<usize>, SchedError> {
    trace.profile(profile);
    let mut keep: Vec<usize> = (0..candidates.len()).collect();
    for f in &profile.filters {
        f.filter(req, data, candidates, &mut keep);
        trace.filtered(f.as_ref(), &keep);
        if keep.is_empty() {
            return Err(SchedError::AllFiltered);
        }
    }
    let mut total = vec![0.0f64; keep.len()];
    let mut buf = vec![0.0f64; keep.len()];
    for ws in &profile.scorers {
        buf.iter_mut().for_each(|s| *s = 0.0);
        ws.scorer.score(req, data, candidates, &keep, &mut buf);
        trace.scored(ws, &keep, &buf);
        for (t, s) in total.iter_mut().zip(&buf) {
            *t += clamped(*s) * ws.weight;
        }
    }
    let mut scored: Vec<(usize, f64)> = keep.iter().copied().zip(total).collect();
    for (i, s) in &scored {
        scores[*i] = *s;
    }
    trace.totals(&scored);
    let picked = profile.picker.pick(&mut scored, rng);
    trace.picked(&picked);
    if picked.is_empty() {
        return Err(SchedError::AllFiltered);
    }
    Ok(picked)
}

/// A scorer's score as it counts: clamped to [0, 1], anything not finite is 0.
pub(crate) fn clamped(s: f64) -> f64 {
    if s.is_finite() {
        s.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::req;

    #[test]
    fn pd_decider_formula() {
        let data = RequestData {
            prompt_tokens: 1000,
            prefix: Some(crate::scheduling::PrefixMatchInfo {
                block_size: 64,
                total_blocks: 15,
                matched: vec![10, 0],
                hashes: vec![],
                weighted: Vec::new(),
            }),
            inflight: vec![],
            ..Default::default()
        };
        let d = PdDecider::PrefixBased {
            non_cached_tokens: 400,
            prompt_tokens: 0,
        };
        let r = req();
        // 1000 − 10·64 = 360 uncached on pod 0 (< 400), 1000 on pod 1.
        assert!(!d.disaggregate(&r, &data, 0));
        assert!(d.disaggregate(&r, &data, 1));
        let gated = PdDecider::PrefixBased {
            non_cached_tokens: 400,
            prompt_tokens: 2000,
        };
        assert!(
            !gated.disaggregate(&r, &data, 1),
            "prompt below the promptTokens gate"
        );
        let never = PdDecider::PrefixBased {
            non_cached_tokens: 0,
            prompt_tokens: 0,
        };
        assert!(
            !never.disaggregate(&r, &data, 1),
            "nonCachedTokens 0 = never"
        );
        assert!(PdDecider::Always.disaggregate(&r, &data, 0));
        // The multimodal decider: media in the prompt, whatever the cache holds.
        assert!(!PdDecider::Multimodal.disaggregate(&r, &data, 1));
        let media = SchedRequest {
            media: &[7],
            ..req()
        };
        assert!(PdDecider::Multimodal.disaggregate(&media, &data, 0));
    }
}
