//! Every way the EPP refuses a request, mapped to one HTTP status, llm-d's error-code name and
//! (where llm-d has one) an `x-llm-d-request-dropped-reason`.

pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub code: &'static str,
    pub reason: Option<&'static str>,
    pub message: String,
}

impl Rejection {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Rejection {
            status: 400,
            code: "BadRequest",
            reason: None,
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Rejection {
            status: 404,
            code: "NotFound",
            reason: None,
            message: message.into(),
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Rejection {
            status: 413,
            code: "PayloadTooLarge",
            reason: None,
            message: format!("request body exceeds the {limit}-byte limit"),
        }
    }

    pub fn saturated(message: impl Into<String>) -> Self {
        Rejection {
            status: 429,
            code: "ResourceExhausted",
            reason: Some("rejected-saturated"),
            message: message.into(),
        }
    }

    pub fn no_endpoints() -> Self {
        Rejection {
            status: 503,
            code: "ServiceUnavailable",
            reason: Some("rejected-no-endpoints"),
            message: "no ready endpoints in the pool".into(),
        }
    }

    /// The body llm-d sends: `inference error: <Code> - <message>`.
    pub fn body(&self) -> String {
        format!("inference error: {} - {}", self.code, self.message)
    }
}
