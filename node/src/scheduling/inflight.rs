//! `inflight-load-producer`: every candidate's in-flight load from the ledger
//! ([`crate::datalayer::inflight`], cluster-wide in cluster mode), and the charge of the routed
//! request: one request and its uncached prompt tokens (plus, optionally, an estimate of its
//! output) on the chosen endpoint.

use std::sync::Arc;

use serde::Deserialize;

use super::{Producer, RequestData, SchedRequest};
use crate::datalayer::inflight::InflightTracker;
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "inflight-load-producer";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InflightParams {
    #[serde(default)]
    pub add_estimated_output_tokens: bool,
    #[serde(default = "d_ratio")]
    pub output_ratio: f64,
    #[serde(default)]
    pub max_estimated_output_tokens: Option<u64>,
}

fn d_ratio() -> f64 {
    1.5
}

impl Default for InflightParams {
    fn default() -> Self {
        InflightParams {
            add_estimated_output_tokens: false,
            output_ratio: d_ratio(),
            max_estimated_output_tokens: None,
        }
    }
}

#[derive(Debug)]
pub struct InflightProducer {
    pub params: InflightParams,
    pub tracker: Arc<InflightTracker>,
}

impl Producer for InflightProducer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn produce(&self, _req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        let endpoints = candidates.iter().map(|c| c.endpoint.hostport.as_str());
        let prefix = data
            .prefix
            .as_ref()
            .map(|p| (p.hashes.as_slice(), p.matched.as_slice()));
        (data.inflight, data.pending) = self.tracker.loads_and_pending(endpoints, prefix);
    }

    fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        _prefill: Option<usize>,
    ) {
        let uncached = data.prefill_tokens(primary) as u64;
        let mut tokens = uncached;
        if self.params.add_estimated_output_tokens {
            let mut out = (data.prompt_tokens as f64 * self.params.output_ratio) as u64;
            if let Some(cap) = self.params.max_estimated_output_tokens {
                out = out.min(cap);
            }
            tokens += out;
        }
        // The blocks it brings to the pod: its chain past the part already cached there.
        let blocks = data.prefix.as_ref().map_or(Vec::new(), |p| {
            let cached = p
                .matched
                .get(primary)
                .copied()
                .unwrap_or(0)
                .saturating_sub(data.pending.get(primary).copied().unwrap_or(0));
            p.hashes.get(cached..).unwrap_or_default().to_vec()
        });
        self.tracker.reserve_prefill(
            req.request_id,
            &candidates[primary].endpoint.hostport,
            tokens,
            blocks,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalayer::inflight::InflightLoad;
    use crate::scheduling::PrefixMatchInfo;
    use crate::scheduling::testutil::*;

    #[test]
    fn producer_charges_uncached_tokens_of_the_primary() {
        let tracker = Arc::new(InflightTracker::default());
        let p = InflightProducer {
            params: InflightParams::default(),
            tracker: tracker.clone(),
        };
        let cs = [
            cand_at("a", "10.0.0.1:1", None, false, &[]),
            cand_at("b", "10.0.0.2:1", None, false, &[]),
        ];
        let data = RequestData {
            prompt_tokens: 1000,
            prefix: Some(PrefixMatchInfo {
                block_size: 64,
                total_blocks: 16,
                matched: vec![0, 10],
                hashes: vec![],
                weighted: Vec::new(),
            }),
            inflight: vec![],
            ..Default::default()
        };
        p.pre_request(&req(), &data, &cs, 1, None);
        assert_eq!(
            tracker.load("10.0.0.2:1"),
            InflightLoad {
                requests: 1,
                tokens: 360,
                prefilling: 1,
            }
        );
        let mut d2 = RequestData::default();
        p.produce(&req(), &cs, &mut d2);
        assert_eq!(d2.inflight[1].requests, 1);
        assert_eq!(d2.inflight[0], InflightLoad::default());
    }
}
