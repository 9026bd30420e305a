//! Why a request left without being served, and what the client sees — llm-d's outcome table — plus
//! the legacy admission controller used when the `flowControl` feature gate is off.

use serde::{Deserialize, Serialize};

/// The response header carrying the drop reason.
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

/// Every way a request can end without (or after, for `Evicted`) being dispatched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DropReason {
    /// A global or band capacity cap (requests or bytes) was full at enqueue. 429.
    RejectedSaturated,
    /// Waited past its TTL while the pool had endpoints. 429.
    RejectedTtlExpired,
    /// Waited past `noEndpointRequestTTL` (or its TTL) while the pool had no endpoints. 503.
    RejectedNoEndpoints,
    /// The client went away while queued. 503.
    RejectedContextCancelled,
    /// The controller is shutting down. 503.
    RejectedShuttingDown,
    /// An in-flight sheddable request was revoked to make room for higher priority. 429.
    Evicted,
}

/// The HTTP answer for a drop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropResponse {
    pub status: u16,
    /// Value of `x-llm-d-request-dropped-reason`; `None` = no header.
    pub dropped_reason: Option<&'static str>,
    /// Human-readable body text.
    pub message: &'static str,
}

impl DropReason {
    pub const ALL: [DropReason; 6] = [
        DropReason::RejectedSaturated,
        DropReason::RejectedTtlExpired,
        DropReason::RejectedNoEndpoints,
        DropReason::RejectedContextCancelled,
        DropReason::RejectedShuttingDown,
        DropReason::Evicted,
    ];

    /// The header value (also a bounded metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::RejectedSaturated => "rejected-saturated",
            DropReason::RejectedTtlExpired => "rejected-ttl-expired",
            DropReason::RejectedNoEndpoints => "rejected-no-endpoints",
            DropReason::RejectedContextCancelled => "rejected-context-cancelled",
            DropReason::RejectedShuttingDown => "rejected-shutting-down",
            DropReason::Evicted => "evicted",
        }
    }

    /// (status, header value, message) exactly as llm-d's outcome table maps them.
    pub fn http(self) -> DropResponse {
        let (status, message) = match self {
            DropReason::RejectedSaturated => {
                (429, "request rejected: flow control capacity exceeded")
            }
            DropReason::RejectedTtlExpired => (429, "request expired while queued"),
            DropReason::RejectedNoEndpoints => (503, "no endpoints available"),
            DropReason::RejectedContextCancelled => (503, "request cancelled while queued"),
            DropReason::RejectedShuttingDown => (503, "flow controller is shutting down"),
            DropReason::Evicted => (429, "request evicted by flow control"),
        };
        DropResponse {
            status,
            dropped_reason: Some(self.as_str()),
            message,
        }
    }
}

/// Decision of the legacy admission controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LegacyAdmission {
    Admit,
    /// 429 without a dropped-reason header.
    Reject,
}

impl LegacyAdmission {
    pub fn http(self) -> Option<DropResponse> {
        match self {
            LegacyAdmission::Admit => None,
            LegacyAdmission::Reject => Some(DropResponse {
                status: 429,
                dropped_reason: None,
                message: "system saturated, sheddable request dropped",
            }),
        }
    }
}

/// llm-d's `LegacyAdmissionController` (flow-control gate off): non-sheddable requests (priority
/// >= 0) always pass; sheddable ones are rejected while detector saturation is >= 1.0. No queueing.
pub fn legacy_admission(priority: i32, saturation: f64) -> LegacyAdmission {
    // NaN saturation counts as saturated (fail closed), like stale metrics.
    if priority < 0 && (saturation >= 1.0 || saturation.is_nan()) {
        LegacyAdmission::Reject
    } else {
        LegacyAdmission::Admit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_table() {
        let table: Vec<(u16, Option<&str>)> = DropReason::ALL
            .iter()
            .map(|r| (r.http().status, r.http().dropped_reason))
            .collect();
        assert_eq!(
            table,
            vec![
                (429, Some("rejected-saturated")),
                (429, Some("rejected-ttl-expired")),
                (503, Some("rejected-no-endpoints")),
                (503, Some("rejected-context-cancelled")),
                (503, Some("rejected-shutting-down")),
                (429, Some("evicted")),
            ]
        );
        assert_eq!(
            DropReason::Evicted.http().message,
            "request evicted by flow control"
        );
        let json = serde_json::to_string(&DropReason::RejectedTtlExpired).unwrap();
        assert_eq!(json, "\"rejected-ttl-expired\"");
    }

    #[test]
    fn legacy_admission_only_checks_sheddable() {
        assert_eq!(legacy_admission(0, 5.0), LegacyAdmission::Admit);
        assert_eq!(legacy_admission(7, 1.0), LegacyAdmission::Admit);
        assert_eq!(legacy_admission(-1, 0.99), LegacyAdmission::Admit);
        assert_eq!(legacy_admission(-1, 1.0), LegacyAdmission::Reject);
        assert_eq!(legacy_admission(-9, f64::NAN), LegacyAdmission::Reject);
        let r = legacy_admission(-1, 2.0).http().unwrap();
        assert_eq!((r.status, r.dropped_reason), (429, None));
        assert!(LegacyAdmission::Admit.http().is_none());
    }
}
