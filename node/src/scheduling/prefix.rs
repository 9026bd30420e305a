//! Approximate prefix-cache affinity: `approx-prefix-cache-producer`, `prefix-cache-scorer` and
//! `prefix-cache-affinity-filter`.
//!
//! The producer hashes the prompt's estimate tokens into a block chain (`index::hashing`), matches
//! it against the index of what was routed where (`index::ApproxIndex`) and, once a pod is chosen,
//! records the chain for that pod. The scorer and the filter read the per-candidate match.

use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use index::{
    ApproxIndex, BlockHasher, DeltaSink, Hlc, PodDigest, PodId, PodMatch, PodState, Replicated,
    block_hashes_of_text, block_hashes_of_tokens,
};
use serde::Deserialize;

use super::{Filter, PrefixMatchInfo, Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::scraper::unix_us;
use crate::datalayer::store::Candidate;
use crate::request::parse::Prompt;

pub const PRODUCER_TYPE: &str = "approx-prefix-cache-producer";
pub const SCORER_TYPE: &str = "prefix-cache-scorer";
pub const AFFINITY_FILTER_TYPE: &str = "prefix-cache-affinity-filter";
/// llm-d clamps the block size up to this (issue #1158).
pub const MIN_BLOCK_SIZE: usize = 64;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProducerParams {
    #[serde(default = "yes")]
    pub auto_tune: bool,
    #[serde(default = "d_block_tokens")]
    pub block_size_tokens: usize,
    #[serde(default = "d_max_tokens")]
    pub max_prefix_tokens_to_match: usize,
    #[serde(default = "d_max_blocks")]
    pub max_prefix_blocks_to_match: usize,
    #[serde(default = "d_lru")]
    pub lru_capacity_per_server: usize,
    /// Deprecated (characters per block in older llm-d); accepted and ignored.
    #[serde(default)]
    pub block_size: Option<usize>,
}

fn yes() -> bool {
    true
}
fn d_block_tokens() -> usize {
    16
}
fn d_max_tokens() -> usize {
    131_072
}
fn d_max_blocks() -> usize {
    2048
}
fn d_lru() -> usize {
    31_250
}

impl Default for ProducerParams {
    fn default() -> Self {
        ProducerParams {
            auto_tune: true,
            block_size_tokens: d_block_tokens(),
            max_prefix_tokens_to_match: d_max_tokens(),
            max_prefix_blocks_to_match: d_max_blocks(),
            lru_capacity_per_server: d_lru(),
            block_size: None,
        }
    }
}

/// The index with the clock that stamps its entries.
#[derive(Debug)]
struct Indexed {
    index: ApproxIndex,
    /// Hybrid logical clock (µs since the UNIX epoch): comparable across replicas, and above
    /// every timestamp merged from a peer, so a local routing decision always counts as newest.
    clock: Hlc,
}

/// How many requests routed with fallbacks are remembered until their response names the pod.
pub const FALLBACK_MEMORY: usize = 4096;

type FallbackEntry = (Vec<u64>, usize, std::time::Instant);

#[derive(Debug)]
pub struct ApproxPrefixProducer {
    params: ProducerParams,
    state: RwLock<Indexed>,
    /// Requests routed with fallbacks, by request key: (block hashes, block size, when).
    fallbacks: std::sync::Mutex<std::collections::HashMap<String, FallbackEntry>>,
    /// Set in cluster mode with replication on: every insert's delta goes here for the peers.
    outbox: OnceLock<Arc<dyn DeltaSink>>,
}

impl ApproxPrefixProducer {
    /// Index entries over all pods (`prefix_indexer_size`).
    pub fn entries(&self) -> usize {
        self.read().index.len()
    }

    pub fn new(params: ProducerParams) -> Self {
        ApproxPrefixProducer {
            state: RwLock::new(Indexed {
                index: ApproxIndex::new(params.lru_capacity_per_server),
                clock: Hlc::default(),
            }),
            params,
            fallbacks: Default::default(),
            outbox: OnceLock::new(),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Indexed> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Indexed> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Block size for this request: the first candidate's engine block size when auto-tuning,
    /// else the configured one; never below 64.
    fn block_size(&self, candidates: &[Candidate]) -> usize {
        let tuned = if self.params.auto_tune {
            candidates
                .first()
                .and_then(|c| c.sample.as_ref())
                .and_then(|s| s.metrics.block_size)
                .map(|b| b as usize)
        } else {
            None
        };
        tuned
            .unwrap_or(self.params.block_size_tokens)
            .max(MIN_BLOCK_SIZE)
    }

    fn max_blocks(&self, block_size: usize) -> usize {
        if self.params.max_prefix_tokens_to_match > 0 {
            (self.params.max_prefix_tokens_to_match / block_size).max(1)
        } else {
            self.params.max_prefix_blocks_to_match // 0 = unlimited
        }
    }

    /// Entries held in the index (for metrics and tests).
    pub fn index_len(&self) -> usize {
        self.read().index.len()
    }

    /// The pods the index holds entries for.
    pub fn pods(&self) -> Vec<String> {
        self.read().index.pod_names()
    }

    /// Drop every entry of `pods` (they left the pool).
    pub fn forget(&self, pods: &[String]) {
        let mut st = self.write();
        for p in pods {
            st.index.remove_pod(p);
        }
    }
}

/// The index replicates in the cluster room's gossip (its "prefix" space).
impl Replicated for ApproxPrefixProducer {
    fn replicate_into(&self, outbox: Arc<dyn DeltaSink>) -> bool {
        self.outbox.set(outbox).is_ok()
    }

    fn merge(&self, states: &[PodState]) -> (usize, u64) {
        let mut st = self.write();
        let (changed, newest) = st.index.merge_pods(states);
        st.clock.observe(newest);
        (changed, newest)
    }

    fn digests(&self) -> Vec<PodDigest> {
        self.read().index.digests()
    }

    fn export(&self, pods: &[String]) -> Vec<PodState> {
        self.read().index.export_pods(pods)
    }
}

/// The pod's KV capacity in index entries of `block_size` tokens: `num_gpu_blocks` engine blocks
/// of the engine's block size. (llm-d uses `num_gpu_blocks` entries directly, which overstates
/// capacity 4× when the engine's 16-token blocks are indexed as 64-token blocks: the index then
/// believes evicted conversations are still warm.)
fn engine_capacity(m: &crate::datalayer::EndpointMetrics, block_size: usize) -> Option<usize> {
    let blocks = m.num_gpu_blocks.filter(|n| *n > 0)? as usize;
    let engine_block = m
        .block_size
        .filter(|b| *b > 0)
        .map_or(block_size, |b| b as usize);
    Some((blocks.saturating_mul(engine_block) / block_size.max(1)).max(1))
}

impl ApproxPrefixProducer {
    /// Apply every pod's capacity and incarnation from its latest metrics. Replicated indexes
    /// converge only if every replica bounds each pod alike — including pods it never routes to
    /// and replicas that route nothing — so the gossip loop calls this periodically.
    pub fn refresh_bounds(&self, candidates: &[Candidate]) {
        let block_size = self.block_size(candidates);
        let mut st = self.write();
        for c in candidates {
            self.apply_bounds(&mut st.index, c, block_size);
        }
    }

    /// Record that `targets` now hold the blocks `hashes` (replicated when gossip is on).
    pub(crate) fn record<'a>(
        &self,
        hashes: &[u64],
        block_size: usize,
        targets: impl Iterator<Item = &'a Candidate>,
    ) {
        if hashes.is_empty() {
            return;
        }
        let outbox = self.outbox.get();
        let mut st = self.write();
        let ts = st.clock.now(unix_us());
        let ix = &mut st.index;
        for target in targets {
            let pod = self.apply_bounds(ix, target, block_size);
            match outbox {
                Some(out) => {
                    if let Some(delta) = ix.insert_delta(pod, hashes, ts) {
                        out.push(delta);
                    }
                }
                None => ix.insert(pod, hashes, ts),
            }
        }
    }

    /// A request routed with fallback endpoints: keep its blocks until its response says which
    /// pod served it (at most [`FALLBACK_MEMORY`] requests, the oldest forgotten first).
    pub fn remember_for_fallback(&self, request_id: &str, data: &RequestData) {
        let Some(info) = &data.prefix else { return };
        if info.hashes.is_empty() {
            return;
        }
        let mut f = match self.fallbacks.lock() {
            Ok(f) => f,
            Err(p) => p.into_inner(),
        };
        if f.len() >= FALLBACK_MEMORY
            && let Some(oldest) = f
                .iter()
                .min_by_key(|(_, (_, _, at))| *at)
                .map(|(k, _)| k.clone())
        {
            f.remove(&oldest);
        }
        f.insert(
            request_id.to_string(),
            (
                info.hashes.clone(),
                info.block_size,
                std::time::Instant::now(),
            ),
        );
    }

    /// The response of `request_id` ended its request-phase uncertainty: `served` is the pod
    /// Envoy used. When it is not the primary (a fallback), the blocks are recorded for it too —
    /// the index would otherwise send the conversation back to a pod that never saw it. Returns
    /// whether a correction was made.
    pub fn served(
        &self,
        request_id: &str,
        primary: &str,
        served: &str,
        candidates: &[Candidate],
    ) -> bool {
        let entry = {
            let mut f = match self.fallbacks.lock() {
                Ok(f) => f,
                Err(p) => p.into_inner(),
            };
            f.remove(request_id)
        };
        let Some((hashes, block_size, _)) = entry else {
            return false;
        };
        if served == primary {
            return false;
        }
        let Some(target) = candidates.iter().find(|c| c.endpoint.hostport == served) else {
            return false;
        };
        self.record(&hashes, block_size, std::iter::once(target));
        true
    }

    /// The pod of `c` in the index, in its current incarnation and bounded to its capacity.
    fn apply_bounds(&self, ix: &mut ApproxIndex, c: &Candidate, block_size: usize) -> PodId {
        let metrics = c.sample.as_ref().map(|s| &s.metrics);
        let capacity = metrics
            .filter(|_| self.params.auto_tune)
            .and_then(|m| engine_capacity(m, block_size))
            .unwrap_or(self.params.lru_capacity_per_server);
        // The server's start time tells a recreated pod at the same address from the old one.
        let epoch = metrics.and_then(|m| m.started_ms).unwrap_or(0);
        let pod = ix.pod_with_epoch(&c.endpoint.hostport, epoch);
        ix.set_capacity(pod, capacity);
        pod
    }
}

impl Producer for ApproxPrefixProducer {
    fn type_name(&self) -> &'static str {
        PRODUCER_TYPE
    }

    fn produce(&self, req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        let block_size = self.block_size(candidates);
        let hasher = BlockHasher::new(
            req.target_model,
            req.cache_salt,
            block_size,
            self.max_blocks(block_size),
        );
        let hashes = match req.prompt {
            Prompt::Text(t) => block_hashes_of_text(&hasher, t),
            Prompt::Tokens(t) => block_hashes_of_tokens(&hasher, t),
            Prompt::None => Vec::new(),
        };
        let mut matched = vec![0usize; candidates.len()];
        if !hashes.is_empty() {
            let st = self.read();
            let ix = &st.index;
            let mut runs: Vec<PodMatch> = Vec::new();
            ix.match_prefix(&hashes, &mut runs);
            if !runs.is_empty() {
                matched = super::matched_by_candidate(
                    candidates,
                    runs.iter().map(|m| (m.pod, m.blocks)),
                    ix.pod_slots(),
                    |name| ix.pod_id(name),
                );
            }
        }
        data.prefix = Some(PrefixMatchInfo {
            block_size,
            total_blocks: hashes.len(),
            matched,
            hashes,
            weighted: Vec::new(),
        });
    }

    fn pre_request(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        prefill: Option<usize>,
    ) {
        let Some(info) = &data.prefix else { return };
        // The decode pod receives the KV blocks; a prefill pod computed them too.
        let targets = std::iter::once(primary)
            .chain(prefill)
            .filter_map(|c| candidates.get(c));
        self.record(&info.hashes, info.block_size, targets);
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScorerParams {
    #[serde(default)]
    pub prefix_match_info_producer_name: Option<String>,
    #[serde(default)]
    pub match_length_weight: f64,
    #[serde(default = "d_scale")]
    pub match_length_scale_tokens: f64,
}

fn d_scale() -> f64 {
    8192.0
}

/// score = w·min(1, matched·blockSize/scale)² + (1−w)·matched/total; 0 without match data
/// (`matched` tier-weighted when the producer knows tiers: [`PrefixMatchInfo::effective`]).
#[derive(Debug)]
pub struct PrefixCacheScorer {
    pub params: ScorerParams,
}

impl Scorer for PrefixCacheScorer {
    fn type_name(&self) -> &'static str {
        SCORER_TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let w = self.params.match_length_weight;
        for (slot, &i) in out.iter_mut().zip(idx) {
            *slot = match &data.prefix {
                Some(p) if p.total_blocks > 0 => {
                    let m = p.effective(i);
                    let len =
                        (m * p.block_size as f64 / self.params.match_length_scale_tokens).min(1.0);
                    w * len * len + (1.0 - w) * m / p.total_blocks as f64
                }
                _ => 0.0,
            };
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AffinityParams {
    #[serde(default = "d_threshold")]
    pub affinity_threshold: f64,
    #[serde(default)]
    pub exploration_probability: f64,
    #[serde(default = "d_penalty", rename = "maxTTFTPenaltyMs")]
    pub max_ttft_penalty_ms: f64,
    #[serde(default = "d_peak")]
    pub peak_prefill_throughput: f64,
    #[serde(default = "d_source")]
    pub ttft_source: String,
    #[serde(default)]
    pub prefix_match_info_producer_name: Option<String>,
}

fn d_threshold() -> f64 {
    0.80
}
fn d_penalty() -> f64 {
    18_000.0
}
fn d_peak() -> f64 {
    15_928.0
}
fn d_source() -> String {
    TTFT_SOURCE_PREFILL.into()
}

/// llm-d's estimate: the pod's in-flight prefill tokens at `peakPrefillThroughput`.
pub const TTFT_SOURCE_PREFILL: &str = "prefillThroughput";
/// The cost model's prediction (`cost-model-producer`, injected when this is used).
pub const TTFT_SOURCE_COST_MODEL: &str = "costModel";
/// llm-d's trained predictor; here the cost model's prediction too.
pub const TTFT_SOURCE_LATENCY_PREDICTOR: &str = "latencyPredictor";
pub const TTFT_SOURCES: [&str; 3] = [
    TTFT_SOURCE_PREFILL,
    TTFT_SOURCE_COST_MODEL,
    TTFT_SOURCE_LATENCY_PREDICTOR,
];

/// The TTFT source is the cost model's prediction.
pub fn ttft_from_cost_model(source: &str) -> bool {
    source == TTFT_SOURCE_COST_MODEL || source == TTFT_SOURCE_LATENCY_PREDICTOR
}

/// Keeps the endpoints whose cached share of the prompt reaches the threshold ("sticky"), unless
/// none does, the exploration coin says skip, or the best sticky endpoint's estimated TTFT exceeds
/// the best other endpoint's by more than `maxTTFTPenaltyMs` (then all are kept and the scorers
/// decide: the affinity breaks on an overloaded pod).
#[derive(Debug)]
pub struct PrefixAffinityFilter {
    pub params: AffinityParams,
}

impl PrefixAffinityFilter {
    fn ttft_ms(&self, data: &RequestData, i: usize) -> f64 {
        if ttft_from_cost_model(&self.params.ttft_source)
            && let Some(p) = data.predicted.get(i)
        {
            return p.ttft_ms;
        }
        let tokens = data.inflight.get(i).map_or(0, |l| l.tokens) as f64;
        tokens / self.params.peak_prefill_throughput * 1000.0
    }
}

impl Filter for PrefixAffinityFilter {
    fn type_name(&self) -> &'static str {
        AFFINITY_FILTER_TYPE
    }

    fn filter(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        let Some(p) = &data.prefix else { return };
        if p.total_blocks == 0 {
            return;
        }
        if self.params.exploration_probability > 0.0
            && rand::random::<f64>() < self.params.exploration_probability
        {
            return;
        }
        let ratio = |i: usize| p.effective(i) / p.total_blocks as f64;
        let (sticky, rest): (Vec<usize>, Vec<usize>) = keep
            .iter()
            .partition(|&&i| ratio(i) >= self.params.affinity_threshold);
        if sticky.is_empty() {
            return;
        }
        if self.params.max_ttft_penalty_ms > 0.0 && !rest.is_empty() {
            let best = |set: &[usize]| {
                set.iter()
                    .map(|&i| self.ttft_ms(data, i))
                    .fold(f64::INFINITY, f64::min)
            };
            if best(&sticky) - best(&rest) > self.params.max_ttft_penalty_ms {
                return;
            }
        }
        *keep = sticky;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalayer::EndpointMetrics;
    use crate::scheduling::InflightLoad;
    use crate::scheduling::testutil::*;

    fn info(matched: Vec<usize>, total: usize) -> RequestData {
        RequestData {
            prompt_tokens: total * 64,
            prefix: Some(PrefixMatchInfo {
                block_size: 64,
                total_blocks: total,
                matched,
                hashes: vec![],
                weighted: Vec::new(),
            }),
            inflight: vec![],
            ..Default::default()
        }
    }

    #[test]
    fn scorer_formula() {
        let cs = [
            cand("a", None, false),
            cand("b", None, false),
            cand("c", None, false),
        ];
        let s = PrefixCacheScorer {
            params: ScorerParams {
                prefix_match_info_producer_name: None,
                match_length_weight: 0.0,
                match_length_scale_tokens: 8192.0,
            },
        };
        assert_eq!(
            score_all(&s, &info(vec![4, 1, 0], 4), &cs),
            vec![1.0, 0.25, 0.0]
        );
        // w = 0.5: a has 4 blocks × 64 = 256 tokens → (256/8192)² = 1/1024
        let s = PrefixCacheScorer {
            params: ScorerParams {
                prefix_match_info_producer_name: None,
                match_length_weight: 0.5,
                match_length_scale_tokens: 8192.0,
            },
        };
        let got = score_all(&s, &info(vec![4, 0, 2], 4), &cs);
        assert!((got[0] - (0.5 / 1024.0 + 0.5)).abs() < 1e-12, "{got:?}");
        assert_eq!(got[1], 0.0);
        // no match data, or an empty prompt → 0
        assert_eq!(score_all(&s, &RequestData::default(), &cs), vec![0.0; 3]);
        assert_eq!(score_all(&s, &info(vec![0, 0, 0], 0), &cs), vec![0.0; 3]);
    }

    fn affinity(threshold: f64, penalty: f64) -> PrefixAffinityFilter {
        PrefixAffinityFilter {
            params: AffinityParams {
                affinity_threshold: threshold,
                exploration_probability: 0.0,
                max_ttft_penalty_ms: penalty,
                peak_prefill_throughput: 1000.0,
                ttft_source: d_source(),
                prefix_match_info_producer_name: None,
            },
        }
    }

    #[test]
    fn affinity_keeps_sticky_or_all() {
        let cs = [
            cand("a", None, false),
            cand("b", None, false),
            cand("c", None, false),
        ];
        let f = affinity(0.8, 0.0);
        let mut keep = vec![0, 1, 2];
        f.filter(&req(), &info(vec![5, 4, 1], 5), &cs, &mut keep);
        assert_eq!(keep, vec![0, 1]);
        let mut keep = vec![0, 1, 2];
        f.filter(&req(), &info(vec![3, 0, 1], 5), &cs, &mut keep);
        assert_eq!(keep, vec![0, 1, 2]);
    }

    #[test]
    fn affinity_breaks_when_the_sticky_pod_is_overloaded() {
        let cs = [cand("a", None, false), cand("b", None, false)];
        let f = affinity(0.8, 500.0);
        let mut data = info(vec![5, 0], 5);
        // a: 2000 in-flight tokens = 2000 ms at 1000 tok/s; b idle → 2000 ms > 500 ms penalty
        data.inflight = vec![
            InflightLoad {
                requests: 3,
                tokens: 2000,
                prefilling: 0,
            },
            InflightLoad::default(),
        ];
        let mut keep = vec![0, 1];
        f.filter(&req(), &data, &cs, &mut keep);
        assert_eq!(keep, vec![0, 1]);
        data.inflight[0].tokens = 400; // 400 ms ≤ 500 ms → stick
        let mut keep = vec![0, 1];
        f.filter(&req(), &data, &cs, &mut keep);
        assert_eq!(keep, vec![0]);
    }

    #[test]
    fn engine_capacity_is_counted_in_tokens() {
        let m = |blocks, bs| crate::datalayer::EndpointMetrics {
            num_gpu_blocks: blocks,
            block_size: bs,
            ..Default::default()
        };
        // 1600 vLLM blocks of 16 tokens = 25 600 tokens = 400 entries of 64 tokens.
        assert_eq!(engine_capacity(&m(Some(1600), Some(16)), 64), Some(400));
        assert_eq!(engine_capacity(&m(Some(1600), Some(128)), 128), Some(1600));
        assert_eq!(engine_capacity(&m(Some(1600), None), 64), Some(1600));
        assert_eq!(engine_capacity(&m(Some(0), Some(16)), 64), None);
        assert_eq!(engine_capacity(&m(None, Some(16)), 64), None);
    }

    /// A producer with fixed 64-token blocks, two pods and a 2000-byte prompt (8 blocks).
    fn producer_pods_prompt() -> (ApproxPrefixProducer, [Candidate; 2], Vec<u8>) {
        let p = ApproxPrefixProducer::new(ProducerParams {
            auto_tune: false,
            ..ProducerParams::default()
        });
        let cs = [
            cand_at("a", "10.0.0.1:8000", None, false, &[]),
            cand_at("b", "10.0.0.2:8000", None, false, &[]),
        ];
        let text: Vec<u8> = (0..2000u32).map(|i| b'a' + (i % 26) as u8).collect();
        (p, cs, text)
    }

    #[test]
    fn producer_matches_what_it_recorded() {
        let (p, cs, text) = producer_pods_prompt();
        let prompt = Prompt::Text(text.clone());
        let mut r = req();
        r.prompt = &prompt;
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        let info = data.prefix.clone().unwrap();
        // 2000 bytes = 500 tokens → 8 blocks of 64 (the last partial)
        assert_eq!((info.block_size, info.total_blocks), (64, 8));
        assert_eq!(info.matched, vec![0, 0]);
        p.pre_request(&r, &data, &cs, 1, None);
        // A longer prompt sharing the first 1024 bytes (4 full blocks) matches 4 blocks on b.
        let mut longer = text[..1024].to_vec();
        longer.extend_from_slice(&[b'z'; 600]);
        let prompt2 = Prompt::Text(longer);
        r.prompt = &prompt2;
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        assert_eq!(data.prefix.unwrap().matched, vec![0, 4]);
        assert_eq!(p.index_len(), 8);
    }

    #[test]
    fn a_fallback_that_served_learns_the_prompt() {
        let (p, cs, text) = producer_pods_prompt();
        let prompt = Prompt::Text(text);
        let mut r = req();
        r.prompt = &prompt;
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        p.pre_request(&r, &data, &cs, 0, None);
        p.remember_for_fallback("r", &data);
        // Served by the primary: nothing to correct, and the request is forgotten.
        assert!(!p.served("r", "10.0.0.1:8000", "10.0.0.1:8000", &cs));
        assert!(!p.served("r", "10.0.0.1:8000", "10.0.0.2:8000", &cs));
        // Served by the fallback b: b now matches the whole prompt too.
        p.remember_for_fallback("r", &data);
        assert!(p.served("r", "10.0.0.1:8000", "10.0.0.2:8000", &cs));
        let mut again = RequestData::default();
        p.produce(&r, &cs, &mut again);
        assert_eq!(again.prefix.unwrap().matched, vec![8, 8]);
        // Unknown requests and pods are ignored.
        assert!(!p.served("unknown", "10.0.0.1:8000", "10.0.0.2:8000", &cs));
        p.remember_for_fallback("r2", &data);
        assert!(!p.served("r2", "10.0.0.1:8000", "10.9.9.9:1", &cs));
    }

    #[test]
    fn auto_tune_reads_engine_block_size_and_clamps() {
        let p = ApproxPrefixProducer::new(ProducerParams::default());
        let big = Some(EndpointMetrics {
            block_size: Some(128),
            ..Default::default()
        });
        let small = Some(EndpointMetrics {
            block_size: Some(16),
            ..Default::default()
        });
        assert_eq!(p.block_size(&[cand("a", big, false)]), 128);
        assert_eq!(p.block_size(&[cand("a", small, false)]), 64);
        assert_eq!(p.block_size(&[]), 64);
        assert_eq!(p.max_blocks(64), 2048);
    }
}
