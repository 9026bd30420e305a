//! Every way the EPP refuses a request, mapped to one HTTP status, llm-d's error-code name and
//! (where llm-d has one) an `x-llm-d-request-dropped-reason`. The data plane delivers them as
//! ext_proc immediate responses.

pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub code: &'static str,
    pub reason: Option<&'static str>,
    pub message: String,
    /// Further response headers (`Retry-After`, rate-limit state, `WWW-Authenticate`).
    pub headers: Vec<(String, String)>,
}

impl Rejection {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Rejection {
            status: 400,
            code: "BadRequest",
            reason: None,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Rejection {
            status: 404,
            code: "NotFound",
            reason: None,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Rejection {
            status: 413,
            code: "PayloadTooLarge",
            reason: None,
            message: format!("request body exceeds the {limit}-byte limit"),
            headers: Vec::new(),
        }
    }

    /// 503: the replica's budget for buffered request bodies is spent (retryable).
    pub fn body_budget(limit: usize) -> Self {
        Rejection {
            status: 503,
            code: "ServiceUnavailable",
            reason: Some("body-buffer-budget"),
            message: format!(
                "the replica is buffering {limit} bytes of request bodies already; retry"
            ),
            headers: vec![("retry-after".into(), "1".into())],
        }
    }

    pub fn saturated(message: impl Into<String>) -> Self {
        Rejection {
            status: 429,
            code: "ResourceExhausted",
            reason: Some("rejected-saturated"),
            message: message.into(),
            headers: Vec::new(),
        }
    }

    pub fn no_endpoints() -> Self {
        Rejection {
            status: 503,
            code: "ServiceUnavailable",
            reason: Some("rejected-no-endpoints"),
            message: "no ready endpoints in the pool".into(),
            headers: Vec::new(),
        }
    }

    /// A flow-control drop, with llm-d's status and `x-llm-d-request-dropped-reason`.
    pub fn dropped(reason: flowctl::DropReason) -> Self {
        let h = reason.http();
        Rejection {
            status: h.status,
            code: if h.status == 429 {
                "ResourceExhausted"
            } else {
                "ServiceUnavailable"
            },
            reason: h.dropped_reason,
            message: h.message.into(),
            headers: Vec::new(),
        }
    }

    /// The legacy admission controller's refusal of a sheddable request (no dropped-reason header).
    pub fn sheddable_saturated() -> Self {
        let h = flowctl::LegacyAdmission::Reject.http();
        Rejection {
            status: 429,
            code: "ResourceExhausted",
            reason: h.and_then(|h| h.dropped_reason),
            message: h.map_or("system saturated", |h| h.message).into(),
            headers: Vec::new(),
        }
    }

    /// 401: the request carries no valid API key (tenant mode).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Rejection {
            status: 401,
            code: "Unauthorized",
            reason: None,
            message: message.into(),
            headers: vec![("www-authenticate".into(), "Bearer".into())],
        }
    }

    /// 429: over a tenant quota (`rejected-quota-*`), with `Retry-After` and the rate-limit state.
    pub fn over_quota(
        reason: &'static str,
        message: String,
        headers: Vec<(String, String)>,
    ) -> Self {
        Rejection {
            status: 429,
            code: "ResourceExhausted",
            reason: Some(reason),
            message,
            headers,
        }
    }

    /// The body llm-d sends: `inference error: <Code> - <message>`.
    pub fn body(&self) -> String {
        format!("inference error: {} - {}", self.code, self.message)
    }
}
