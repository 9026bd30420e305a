//! `precise-prefix-cache-producer`: the prefix match from what each engine *reports* it holds.
//!
//! The index ([`index::PreciseIndex`]) is fed by the KV-event subscriber
//! ([`crate::datalayer::kvevents`]); per request the producer hashes the prompt's engine tokens
//! (from the token producer, or a pre-tokenized prompt) into the same key chain and writes the
//! per-candidate match as `PrefixMatchInfo`, which `prefix-cache-scorer`, the affinity filter, the
//! P/D decider and the cost model read unchanged. Without engine tokens (the `estimate` token
//! backend) nothing can match: the producer reports zero matches and counts the request.
//!
//! Parameters are llm-d's (`tokenProcessorConfig`, `indexerConfig`, `kvEventsConfig`); the key
//! chain uses each pod's engine block size from its events (`tokenProcessorConfig.blockSize` is
//! only the fallback before the first event), and the index lives in this process, so
//! `indexerConfig` (tokenizer pools, external index backends) is accepted and not used except
//! `tokenizersPoolConfig.modelName` (the model of pods whose topic names none) and
//! `speculativeIndexing`. With speculative indexing on, a routing decision counts as the pod's
//! for `speculativeTTL` before its engine reports the blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use index::kvevents::KvEvent;
use index::precise::{Applied, GPU, PodKeys, chain_full_blocks};
use index::{BlockHasher, PreciseIndex, PreciseMatch};
use serde::Deserialize;

use super::{PrefixMatchInfo, Producer, RequestData, SchedRequest};
use crate::config::{ConfigError, parse_duration};
use crate::datalayer::kvevents::{KvEventsParams, KvIndex};
use crate::datalayer::store::Candidate;
use crate::request::parse::Prompt;

pub const PRODUCER_TYPE: &str = "precise-prefix-cache-producer";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TokenProcessorConfig {
    #[serde(default = "d_block")]
    pub block_size: usize,
    /// llm-d's root-hash seed; our keys are private to this process, so it changes nothing.
    #[serde(default)]
    pub hash_seed: String,
}

fn d_block() -> usize {
    16
}

impl Default for TokenProcessorConfig {
    fn default() -> Self {
        TokenProcessorConfig {
            block_size: d_block(),
            hash_seed: String::new(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PreciseParams {
    #[serde(default)]
    pub token_processor_config: TokenProcessorConfig,
    #[serde(default)]
    pub indexer_config: Option<serde_json::Value>,
    #[serde(default)]
    pub kv_events_config: KvEventsParams,
    #[serde(default)]
    pub speculative_indexing: bool,
    #[serde(default, rename = "speculativeTTL")]
    pub speculative_ttl: Option<String>,
}

impl PreciseParams {
    /// Refuse what this build does not do rather than ignore it.
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let field = |f: &str, message: String| ConfigError::Field {
            path: format!("{path}.{f}"),
            message,
        };
        if let Some(t) = &self.speculative_ttl {
            match parse_duration(t) {
                Ok(d) if !d.is_zero() => {}
                Ok(_) => return Err(field("speculativeTTL", "must be positive".into())),
                Err(e) => return Err(field("speculativeTTL", e)),
            }
        }
        let bs = self.token_processor_config.block_size;
        if bs == 0 || bs > index::hashing::MAX_BLOCK_SIZE {
            return Err(field(
                "tokenProcessorConfig.blockSize",
                format!(
                    "block size {bs} is outside 1..={}",
                    index::hashing::MAX_BLOCK_SIZE
                ),
            ));
        }
        if let Err(e) = self.tier_weights() {
            return Err(field("indexerConfig.kvCacheBackendConfigs", e));
        }
        if let Some(e) = &self.kv_events_config.engine_type
            && !["vllm", "sglang"].contains(&e.as_str())
        {
            return Err(field(
                "kvEventsConfig.engineType",
                format!("engine type `{e}` is not vllm or sglang"),
            ));
        }
        Ok(())
    }

    /// How long a routing decision counts as the pod's (speculative indexing: on at the top
    /// level or in `indexerConfig`, as llm-d's versions put it), `None` when off.
    pub fn speculation(&self) -> Option<Duration> {
        let in_indexer = self
            .indexer_config
            .as_ref()
            .and_then(|v| v.get("speculativeIndexing"))
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        (self.speculative_indexing || in_indexer).then(|| {
            self.speculative_ttl
                .as_deref()
                .and_then(|t| parse_duration(t).ok())
                .unwrap_or(Duration::from_secs(2))
        })
    }

    /// The scoring weight of each KV-cache tier by medium name: `indexerConfig.kvCacheBackendConfigs`
    /// (llm-d's `[{name, weight}]`), else llm-d's defaults. A medium not listed weighs 1.
    pub fn tier_weights(&self) -> Result<Vec<(String, f32)>, String> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Backend {
            name: String,
            weight: f64,
        }
        let Some(v) = self
            .indexer_config
            .as_ref()
            .and_then(|c| c.get("kvCacheBackendConfigs"))
        else {
            return Ok(default_tier_weights());
        };
        let list: Vec<Backend> = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
        let mut out: Vec<(String, f32)> = Vec::with_capacity(list.len());
        for b in list {
            let name = b.name.to_ascii_lowercase();
            if name.is_empty() {
                return Err("a backend has an empty name".into());
            }
            // A block counts at most as much as a block on the GPU (the scorers' ratios stay
            // within 0..=1).
            if !(b.weight.is_finite() && (0.0..=1.0).contains(&b.weight)) {
                return Err(format!("weight {} of `{name}` is not in 0..=1", b.weight));
            }
            if out.iter().any(|(n, _)| *n == name) {
                return Err(format!("`{name}` is listed twice"));
            }
            out.push((name, b.weight as f32));
        }
        Ok(out)
    }

    /// `indexerConfig.tokenizersPoolConfig.modelName`: the model of pods whose topic names none.
    pub fn model_name(&self) -> Option<&str> {
        self.indexer_config
            .as_ref()?
            .get("tokenizersPoolConfig")?
            .get("modelName")?
            .as_str()
            .filter(|m| !m.is_empty())
    }
}

/// llm-d's tier weights: a block in CPU memory is worth 0.8 of one on the GPU (it must be
/// loaded back), storage tiers less.
pub fn default_tier_weights() -> Vec<(String, f32)> {
    [
        ("gpu", 1.0),
        ("cpu", 0.8),
        ("shared_storage", 0.4),
        ("storage", 0.3),
        ("object_store", 0.2),
    ]
    .into_iter()
    .map(|(n, w)| (n.to_string(), w))
    .collect()
}

/// The root of a key chain: the effective model's seed (the adapter's name for LoRA blocks), as
/// the approximate index seeds its chains.
pub fn root(model: &str) -> u64 {
    BlockHasher::new(model, None, 1, 0).seed
}

/// One pod's changes of its distinct keys waiting for the peers (cluster mode).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PodChanges {
    pub block_size: u32,
    /// GPU tier: key → added (true) or removed (false); the last change of a key wins.
    pub keys: HashMap<u64, bool>,
    /// The same for the offload tiers, by medium name (lowercase).
    pub offload: HashMap<String, HashMap<u64, bool>>,
}

#[derive(Debug)]
pub struct PrecisePrefixProducer {
    pub params: PreciseParams,
    index: RwLock<PreciseIndex>,
    /// Requests routed without engine tokens (nothing could match; counted when the decision is
    /// recorded, so a dry run does not count).
    untokenized: AtomicU64,
    /// Cluster mode: the changes of the pods this replica subscribes to, for the peers.
    outbox: Mutex<Option<HashMap<String, PodChanges>>>,
    /// Speculative indexing's time to live, and the origin of its clock.
    speculation: Option<Duration>,
    started: Instant,
}

impl PrecisePrefixProducer {
    pub fn new(params: PreciseParams) -> Self {
        let mut index = PreciseIndex::new();
        // Validated with the configuration; a bad list here falls back to the defaults.
        index.set_tier_weights(
            &params
                .tier_weights()
                .unwrap_or_else(|_| default_tier_weights()),
        );
        PrecisePrefixProducer {
            speculation: params.speculation(),
            params,
            index: RwLock::new(index),
            untokenized: AtomicU64::new(0),
            outbox: Mutex::new(None),
            started: Instant::now(),
        }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, PreciseIndex> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, PreciseIndex> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Cluster mode: from now on the changes of every pod's distinct keys are kept for the
    /// peers ([`Self::take_changes`]).
    pub fn replicate(&self) {
        self.write().journal();
        *self.outbox.lock().unwrap_or_else(|p| p.into_inner()) = Some(HashMap::new());
    }

    /// Move the index's journal into the outbox (under the index's write lock, so pod ids are
    /// still the pods they name); `keep: false` discards it.
    fn journaled(&self, ix: &mut PreciseIndex, keep: bool) {
        let journal = ix.take_journal();
        if journal.is_empty() || !keep {
            return;
        }
        let mut out = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
        let Some(out) = out.as_mut() else { return };
        for ch in journal {
            let (Some(name), Some(medium)) = (ix.pod_name(ch.pod), ix.tier_name(ch.tier)) else {
                continue;
            };
            let c = out.entry(name.to_string()).or_default();
            c.block_size = ix.block_size(ch.pod).unwrap_or(0) as u32;
            let keys = match ch.tier {
                GPU => &mut c.keys,
                _ => c.offload.entry(medium.to_string()).or_default(),
            };
            keys.insert(ch.key, ch.added);
        }
    }

    /// The changes kept since the last call, by pod.
    pub fn take_changes(&self) -> HashMap<String, PodChanges> {
        self.outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Apply one batch of pod `pod`'s events (`model`: its topic's model).
    pub fn apply(&self, pod: &str, model: &str, events: &[KvEvent]) -> Applied {
        let mut ix = self.write();
        let id = ix.pod(pod);
        let a = ix.apply(id, model, events, &root);
        self.journaled(&mut ix, true);
        a
    }

    /// Forget what pod `pod` holds (resync, restart: the peers forget it too). Returns the
    /// blocks dropped.
    pub fn clear(&self, pod: &str) -> u64 {
        let mut ix = self.write();
        let n = match ix.pod_id(pod) {
            Some(id) => ix.clear_pod(id),
            None => 0,
        };
        self.journaled(&mut ix, true);
        n
    }

    /// Drop pod `pod`'s entries here only (a subscription starting over what a peer's gossip
    /// built; the peers keep theirs).
    pub fn reset_locally(&self, pod: &str) {
        let mut ix = self.write();
        if let Some(id) = ix.pod_id(pod) {
            ix.clear_pod(id);
        }
        self.journaled(&mut ix, false);
    }

    /// This replica stops subscribing to `pod` (another owns it now): keep what it holds as a
    /// mirror, which the owner's gossip maintains from here.
    pub fn hand_over(&self, pod: &str) {
        let mut ix = self.write();
        if let Some(id) = ix.pod_id(pod) {
            let state = ix.pod_state(id);
            ix.replace_mirror(id, &state);
        }
        self.journaled(&mut ix, false);
    }

    pub fn remove(&self, pod: &str) {
        let mut ix = self.write();
        ix.remove_pod(pod);
        self.journaled(&mut ix, false);
    }

    /// A peer's changes of pod `pod` (which it subscribes to) in the tier of `medium` (empty:
    /// the GPU). False, and nothing taken, for a tier this index cannot take (past its limit).
    pub fn mirror(
        &self,
        pod: &str,
        medium: &str,
        block_size: u32,
        adds: &[u64],
        removes: &[u64],
    ) -> bool {
        let mut ix = self.write();
        let Some(tier) = ix.tier(Some(medium).filter(|m| !m.is_empty())) else {
            return false;
        };
        let id = ix.pod(pod);
        ix.mirror(id, tier, block_size, adds, removes);
        self.journaled(&mut ix, false);
        true
    }

    /// A peer's whole state of pod `pod`, replacing ours.
    pub fn replace(&self, pod: &str, state: &PodKeys) {
        let mut ix = self.write();
        let id = ix.pod(pod);
        ix.replace_mirror(id, state);
        self.journaled(&mut ix, false);
    }

    /// Pod `pod`'s distinct keys held and their digest (`(0, 0)` when unknown).
    pub fn digest(&self, pod: &str) -> (u64, u64) {
        let ix = self.read();
        ix.pod_id(pod).map_or((0, 0), |id| ix.digest(id))
    }

    /// Pod `pod`'s block size and distinct keys by tier.
    pub fn state(&self, pod: &str) -> Option<PodKeys> {
        let ix = self.read();
        ix.pod_id(pod).map(|id| ix.pod_state(id))
    }

    /// Every pod's distinct keys and digest, by pod: equal on every replica once converged.
    pub fn digests(&self) -> std::collections::BTreeMap<String, (u64, u64)> {
        let ix = self.read();
        ix.pod_names()
            .into_iter()
            .filter_map(|n| Some((n.clone(), ix.digest(ix.pod_id(&n)?))))
            .collect()
    }

    /// Blocks each pod holds by tier ("gpu", "cpu", ...), the tiers holding any.
    pub fn tiers(&self) -> std::collections::BTreeMap<String, Vec<(String, usize)>> {
        let ix = self.read();
        ix.pod_names()
            .into_iter()
            .filter_map(|n| {
                let id = ix.pod_id(&n)?;
                let tiers = ix.tier_lens(id);
                Some((
                    n,
                    tiers.into_iter().map(|(t, c)| (t.to_string(), c)).collect(),
                ))
            })
            .collect()
    }

    /// Pods in the index.
    pub fn pods(&self) -> Vec<String> {
        self.read().pod_names()
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Requests routed without engine tokens so far.
    pub fn untokenized(&self) -> u64 {
        self.untokenized.load(Ordering::Relaxed)
    }

    /// The engine block size for this request: the first candidate's from its events, else its
    /// metrics, else the configured one.
    fn block_size(&self, ix: &PreciseIndex, candidates: &[Candidate]) -> usize {
        candidates
            .iter()
            .find_map(|c| {
                ix.pod_id(&c.endpoint.hostport)
                    .and_then(|id| ix.block_size(id))
            })
            .or_else(|| {
                candidates
                    .first()
                    .and_then(|c| c.metrics())
                    .and_then(|m| m.block_size)
                    .map(|b| b as usize)
            })
            .filter(|b| (1..=index::hashing::MAX_BLOCK_SIZE).contains(b))
            .unwrap_or(self.params.token_processor_config.block_size)
    }
}

/// The KV-event subscriber's view of the index (the data layer feeds it, it does not know the
/// producer).
impl KvIndex for PrecisePrefixProducer {
    fn apply(&self, pod: &str, model: &str, events: &[KvEvent]) -> Applied {
        PrecisePrefixProducer::apply(self, pod, model, events)
    }
    fn clear(&self, pod: &str) -> u64 {
        PrecisePrefixProducer::clear(self, pod)
    }
    fn reset_locally(&self, pod: &str) {
        PrecisePrefixProducer::reset_locally(self, pod);
    }
    fn hand_over(&self, pod: &str) {
        PrecisePrefixProducer::hand_over(self, pod);
    }
    fn remove(&self, pod: &str) {
        PrecisePrefixProducer::remove(self, pod);
    }
    fn pods(&self) -> Vec<String> {
        PrecisePrefixProducer::pods(self)
    }
    fn pod_blocks(&self, pod: &str) -> usize {
        let ix = self.read();
        ix.pod_id(pod).map_or(0, |id| ix.pod_len(id))
    }
    fn size(&self) -> (usize, usize) {
        let ix = self.read();
        (ix.len(), ix.approx_heap_bytes())
    }
}

/// The request's engine tokens: the token producer's, or a pre-tokenized prompt's (empty when
/// there are none).
fn engine_tokens<'a>(req: &SchedRequest<'a>) -> &'a [u32] {
    match (req.tokens, req.prompt) {
        (Some(t), _) => t,
        (None, Prompt::Tokens(t)) => t.as_slice(),
        _ => &[],
    }
}

impl Producer for PrecisePrefixProducer {
    fn type_name(&self) -> &'static str {
        PRODUCER_TYPE
    }

    fn produce(&self, req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        let tokens = engine_tokens(req);
        let ix = self.read();
        let block_size = self.block_size(&ix, candidates);
        let mut matched = vec![0usize; candidates.len()];
        if tokens.is_empty() {
            data.prefix = Some(PrefixMatchInfo {
                block_size,
                total_blocks: data.prompt_tokens.div_ceil(block_size.max(1)),
                matched,
                hashes: Vec::new(),
                weighted: Vec::new(),
            });
            return;
        }
        let seed = BlockHasher::new(req.target_model, req.cache_salt, 1, 0).seed;
        let mut keys = Vec::with_capacity(tokens.len() / block_size + 1);
        chain_full_blocks(seed, tokens, block_size, &mut keys);
        let mut runs: Vec<PreciseMatch> = Vec::new();
        let now = self.speculation.map(|_| self.now_ms());
        ix.match_prefix_at(&keys, now, &mut runs);
        let mut weighted = Vec::new();
        if !runs.is_empty() {
            matched = super::matched_by_candidate(
                candidates,
                runs.iter().map(|m| (m.pod, m.blocks)),
                ix.pod_slots(),
                |name| ix.pod_id(name),
            );
            // Offloaded blocks in some run: they count at their tier's weight.
            if runs.iter().any(|m| m.score != m.blocks as f32) {
                weighted = super::matched_by_candidate(
                    candidates,
                    runs.iter().map(|m| (m.pod, f64::from(m.score))),
                    ix.pod_slots(),
                    |name| ix.pod_id(name),
                );
            }
        }
        data.prefix = Some(PrefixMatchInfo {
            block_size,
            // The partial tail block is never cached, but it is part of the prompt.
            total_blocks: tokens.len().div_ceil(block_size),
            matched,
            hashes: keys,
            weighted,
        });
    }

    /// The engines report what they store; with speculative indexing the chosen pods count as
    /// holding the prompt's blocks until the time to live ends (a burst sharing a prompt sees the
    /// first request's pod before its engine has said anything).
    fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        prefill: Option<usize>,
    ) {
        if engine_tokens(req).is_empty() && !matches!(req.prompt, Prompt::None) {
            self.untokenized.fetch_add(1, Ordering::Relaxed);
        }
        let (Some(ttl), Some(info)) = (self.speculation, &data.prefix) else {
            return;
        };
        if info.hashes.is_empty() {
            return;
        }
        let now = self.now_ms();
        let expires = now.saturating_add(ttl.as_millis() as u64);
        let mut ix = self.write();
        for c in std::iter::once(primary)
            .chain(prefill)
            .filter_map(|i| candidates.get(i))
        {
            let id = ix.pod(&c.endpoint.hostport);
            ix.speculate(id, &info.hashes, now, expires);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::*;
    use index::kvevents::BlockStored;

    #[test]
    fn params_follow_llmd_and_refuse_what_is_not_built() {
        let p: PreciseParams = serde_json::from_value(serde_json::json!({
            "tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"},
            "indexerConfig": {"tokenizersPoolConfig": {"modelName": "m"}},
            "kvEventsConfig": {"topicFilter": "kv@", "concurrency": 4,
                               "podDiscoveryConfig": {"socketPort": 5556, "replayPort": 5557}},
        }))
        .unwrap();
        p.validate("p").unwrap();
        assert_eq!(p.model_name(), Some("m"));
        assert_eq!(
            p.kv_events_config.pod_discovery_config.replay_port,
            Some(5557)
        );
        for bad in [
            serde_json::json!({"speculativeIndexing": true, "speculativeTTL": "0s"}),
            serde_json::json!({"speculativeTTL": "soon"}),
            serde_json::json!({"tokenProcessorConfig": {"blockSize": 0}}),
            serde_json::json!({"indexerConfig": {"kvCacheBackendConfigs": [{"name": "cpu", "weight": -1}]}}),
            serde_json::json!({"indexerConfig": {"kvCacheBackendConfigs": [{"name": "gpu", "weight": 2}]}}),
            serde_json::json!({"indexerConfig": {"kvCacheBackendConfigs": [{"name": "", "weight": 1}]}}),
            serde_json::json!({"indexerConfig": {"kvCacheBackendConfigs": [{"name": "cpu", "weight": 1, "x": 1}]}}),
            serde_json::json!({"indexerConfig": {"kvCacheBackendConfigs": [{"name": "cpu", "weight": 1}, {"name": "CPU", "weight": 1}]}}),
        ] {
            let p: PreciseParams = serde_json::from_value(bad.clone()).unwrap();
            assert!(p.validate("p").is_err(), "{bad}");
        }
        assert!(serde_json::from_value::<PreciseParams>(serde_json::json!({"nope": 1})).is_err());
        // Tier weights: llm-d's defaults, or its `kvCacheBackendConfigs` (names lowercased).
        assert_eq!(p.tier_weights().unwrap(), default_tier_weights());
        let p: PreciseParams = serde_json::from_value(serde_json::json!({
            "indexerConfig": {"kvCacheBackendConfigs": [{"name": "GPU", "weight": 1.0}, {"name": "cpu", "weight": 0.5}]},
        }))
        .unwrap();
        p.validate("p").unwrap();
        assert_eq!(
            p.tier_weights().unwrap(),
            vec![("gpu".to_string(), 1.0), ("cpu".to_string(), 0.5)]
        );
        // Centralized mode: the pods connect to zmqEndpoint (llm-d's default address).
        let central = |v| {
            let p: PreciseParams = serde_json::from_value(v).unwrap();
            p.validate("p").unwrap();
            p.kv_events_config.central_endpoint().map(str::to_string)
        };
        assert_eq!(
            central(serde_json::json!({"kvEventsConfig": {"discoverPods": false}})).as_deref(),
            Some("tcp://*:5557")
        );
        assert_eq!(
            central(serde_json::json!({"kvEventsConfig": {"discoverPods": false, "zmqEndpoint": "tcp://0.0.0.0:6000"}}))
                .as_deref(),
            Some("tcp://0.0.0.0:6000")
        );
        assert_eq!(central(serde_json::json!({})), None);
        assert_eq!(p.speculation(), None);
        let on = |v| {
            serde_json::from_value::<PreciseParams>(v)
                .unwrap()
                .speculation()
        };
        assert_eq!(
            on(serde_json::json!({"indexerConfig": {"speculativeIndexing": true}})),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            on(serde_json::json!({"speculativeIndexing": true, "speculativeTTL": "500ms"})),
            Some(Duration::from_millis(500))
        );
    }

    #[test]
    fn the_match_follows_the_engines_events() {
        let p = PrecisePrefixProducer::new(PreciseParams::default());
        let cs = [
            cand_at("a", "10.0.0.1:8000", None, false, &[]),
            cand_at("b", "10.0.0.2:8000", None, false, &[]),
        ];
        let tokens: Vec<u32> = (0..40).collect();
        // b's engine stored the first two 16-token blocks of model `m`.
        let a = p.apply(
            "10.0.0.2:8000",
            "m",
            &[KvEvent::BlockStored(BlockStored {
                block_hashes: vec![7, 8],
                token_ids: tokens[..32].to_vec(),
                block_size: 16,
                ..BlockStored::default()
            })],
        );
        assert_eq!(a.stored, 2);
        let prompt = Prompt::Text(b"ignored".to_vec());
        let mut r = req();
        r.prompt = &prompt;
        r.target_model = "m";
        r.tokens = Some(&tokens);
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        let info = data.prefix.unwrap();
        assert_eq!((info.block_size, info.total_blocks), (16, 3));
        assert_eq!(info.matched, vec![0, 2]);
        // Without engine tokens nothing matches, and the request is counted once routed.
        r.tokens = None;
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        assert_eq!(data.prefix.as_ref().unwrap().matched, vec![0, 0]);
        assert_eq!(
            p.untokenized(),
            0,
            "scoring alone (a dry run) counts nothing"
        );
        p.pre_request(&r, &data, &cs, 0, None);
        assert_eq!(p.untokenized(), 1);
        // The pod's engine evicted the second block.
        p.apply(
            "10.0.0.2:8000",
            "m",
            &[KvEvent::BlockRemoved {
                block_hashes: vec![8],
                medium: None,
                group_idx: None,
            }],
        );
        r.tokens = Some(&tokens);
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        assert_eq!(data.prefix.unwrap().matched, vec![0, 1]);
        assert_eq!(p.clear("10.0.0.2:8000"), 1);
    }

    /// vLLM's CPU offloading: a pod whose engine moved the prompt's blocks to CPU memory still
    /// has them (the engine will report them cached), but they are worth less than the same
    /// blocks on another pod's GPU: `matched` counts them, `weighted` at llm-d's 0.8, and the
    /// prefix-cache scorer prefers the GPU copy.
    #[test]
    fn offloaded_blocks_count_as_cached_at_their_tiers_weight() {
        use crate::scheduling::Scorer;
        let p = PrecisePrefixProducer::new(PreciseParams::default());
        let cs = [
            cand_at("a", "10.0.0.1:8000", None, false, &[]),
            cand_at("b", "10.0.0.2:8000", None, false, &[]),
        ];
        let tokens: Vec<u32> = (0..40).collect();
        let gpu = |hashes: Vec<u64>| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                token_ids: tokens[..32].to_vec(),
                block_size: 16,
                ..BlockStored::default()
            })
        };
        p.apply("10.0.0.1:8000", "m", &[gpu(vec![1, 2])]);
        // b: stored on the GPU, offloaded by hash only, evicted from the GPU.
        let offloaded = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![7, 8],
            block_size: 16,
            medium: Some("CPU".into()),
            ..BlockStored::default()
        });
        let evicted = KvEvent::BlockRemoved {
            block_hashes: vec![7, 8],
            medium: Some("GPU".into()),
            group_idx: None,
        };
        let a = p.apply("10.0.0.2:8000", "m", &[gpu(vec![7, 8]), offloaded, evicted]);
        assert_eq!((a.stored, a.removed, a.orphaned), (4, 2, 0));
        let prompt = Prompt::Tokens(tokens.clone());
        let mut r = req();
        r.prompt = &prompt;
        r.target_model = "m";
        let mut data = RequestData {
            prompt_tokens: 40,
            ..RequestData::default()
        };
        p.produce(&r, &cs, &mut data);
        let info = data.prefix.clone().unwrap();
        assert_eq!(info.matched, vec![2, 2]);
        assert_eq!(info.weighted.len(), 2);
        assert!((info.weighted[1] - 1.6).abs() < 1e-6, "{info:?}");
        assert_eq!((info.effective(0), data.uncached_tokens(0)), (2.0, 8));
        assert_eq!(data.uncached_tokens(1), 40 - 26);
        let scorer = crate::scheduling::prefix::PrefixCacheScorer {
            params: serde_json::from_value(serde_json::json!({})).unwrap(),
        };
        let mut out = [0.0; 2];
        scorer.score(&r, &data, &cs, &[0, 1], &mut out);
        assert!(out[0] > out[1], "the GPU copy scores higher: {out:?}");
        // The peers learn the tier by name.
        let st = p.state("10.0.0.2:8000").unwrap();
        assert_eq!((st.gpu.len(), st.offload.len()), (0, 1));
        assert_eq!(st.offload[0].0, "cpu");
    }

    #[test]
    fn speculation_counts_a_routed_prompt_until_the_engine_speaks() {
        let p = PrecisePrefixProducer::new(
            serde_json::from_value(serde_json::json!({"speculativeIndexing": true})).unwrap(),
        );
        let cs = [
            cand_at("a", "10.0.0.1:8000", None, false, &[]),
            cand_at("b", "10.0.0.2:8000", None, false, &[]),
        ];
        let tokens: Vec<u32> = (0..40).collect();
        let prompt = Prompt::Tokens(tokens.clone());
        let mut r = req();
        r.prompt = &prompt;
        let mut data = RequestData::default();
        p.produce(&r, &cs, &mut data);
        assert_eq!(data.prefix.as_ref().unwrap().matched, vec![0, 0]);
        p.pre_request(&r, &data, &cs, 1, None);
        let mut again = RequestData::default();
        p.produce(&r, &cs, &mut again);
        assert_eq!(again.prefix.unwrap().matched, vec![0, 2]);
    }
}
