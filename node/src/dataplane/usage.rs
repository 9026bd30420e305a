//! Token usage read from responses: OpenAI JSON and SSE (`usage` on the final chunk when
//! `stream_options.include_usage` is on), and Anthropic messages (`message_start` carries the input
//! usage, `message_delta` the output count).
//!
//! The scanner sees the body in whatever chunks Envoy forwards. SSE is scanned line by line and
//! only lines mentioning `"usage"` are parsed; a JSON body is kept (bounded) and parsed at its end.

use serde_json::Value;

use crate::scheduling::Prediction;

/// Largest non-streaming body kept for parsing; larger ones report no usage.
const MAX_JSON_BODY: usize = 4 << 20;
/// Longest SSE line kept while waiting for its end.
const MAX_LINE: usize = 1 << 20;

/// Token counts of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
    pub cached: u64,
}

#[derive(Debug, Default)]
pub struct UsageScanner {
    sse: bool,
    buf: Vec<u8>,
    overflow: bool,
    usage: Option<Usage>,
    /// SSE data events that carried output (not the usage-only chunk, not `[DONE]`).
    events: u64,
    /// A Responses-API response's `id` (the body's, or the stream's `response.*` events').
    response_id: Option<String>,
}

impl UsageScanner {
    /// `content_type` of the response decides SSE vs JSON.
    pub fn new(content_type: Option<&str>) -> Self {
        UsageScanner {
            sse: content_type.is_some_and(|c| c.contains("text/event-stream")),
            ..Default::default()
        }
    }

    /// The response is a server-sent event stream (its first bytes are its first token).
    pub fn is_sse(&self) -> bool {
        self.sse
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow {
            return;
        }
        if !self.sse {
            if self.buf.len() + chunk.len() > MAX_JSON_BODY {
                self.overflow = true;
                self.buf = Vec::new();
            } else {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
            if self.buf.is_empty() {
                self.line(&rest[..nl]);
            } else {
                let mut line = std::mem::take(&mut self.buf);
                line.extend_from_slice(&rest[..nl]);
                self.line(&line);
            }
            rest = &rest[nl + 1..];
        }
        if !rest.is_empty() {
            if self.buf.len() + rest.len() > MAX_LINE {
                // A pathological line: drop it, keep scanning after the next newline.
                self.buf.clear();
            } else {
                self.buf.extend_from_slice(rest);
            }
        }
    }

    /// Streamed events forwarded so far that carried output: what a cut stream generated when
    /// it reported no usage (one token per event, as engines stream by default).
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The id of the Responses-API response seen (JSON body: known once [`Self::finish`]ed).
    pub fn response_id(&self) -> Option<&str> {
        self.response_id.as_deref()
    }

    /// The body ended: the usage seen, if any.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.sse {
            if !self.buf.is_empty() {
                let line = std::mem::take(&mut self.buf);
                self.line(&line);
            }
        } else if !self.overflow && !self.buf.is_empty() {
            if let Ok(v) = serde_json::from_slice::<Value>(&self.buf) {
                self.response_id = response_id(Some(&v), false);
                self.absorb(&v);
            }
            self.buf = Vec::new();
        }
        self.usage
    }

    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let d = data.trim_ascii();
        if carries_output(d) {
            self.events += 1;
        }
        // Responses streams name their response in `response.created` (and every event
        // carrying the `response` object).
        let names_response = self.response_id.is_none() && contains(data, b"\"response\":{");
        if !names_response && !contains(data, b"\"usage\"") {
            return;
        }
        if let Ok(v) = serde_json::from_slice::<Value>(data.trim_ascii()) {
            if names_response {
                self.response_id = response_id(v.get("response"), true);
            }
            self.absorb(&v);
        }
    }

    fn absorb(&mut self, v: &Value) {
        // OpenAI: top-level usage; Anthropic streaming: message_start.message.usage,
        // message_delta.usage; Responses streaming: response.completed's response.usage.
        let usage = v
            .get("usage")
            .filter(|u| u.is_object())
            .or_else(|| v.get("message").and_then(|m| m.get("usage")))
            .or_else(|| v.get("response").and_then(|r| r.get("usage")))
            .filter(|u| u.is_object());
        let Some(u) = usage else { return };
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        let got = if let Some(details) = u.get("input_tokens_details").filter(|d| d.is_object()) {
            // Responses: `input_tokens` counts the cached ones too.
            Usage {
                input: n("input_tokens").unwrap_or(0),
                output: n("output_tokens").unwrap_or(0),
                cached: details
                    .get("cached_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            }
        } else if n("prompt_tokens").is_some() || n("completion_tokens").is_some() {
            Usage {
                input: n("prompt_tokens").unwrap_or(0),
                output: n("completion_tokens").unwrap_or(0),
                cached: u
                    .get("prompt_tokens_details")
                    .and_then(|d| d.get("cached_tokens"))
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            }
        } else {
            let cache_read = n("cache_read_input_tokens").unwrap_or(0);
            Usage {
                input: n("input_tokens").unwrap_or(0)
                    + cache_read
                    + n("cache_creation_input_tokens").unwrap_or(0),
                output: n("output_tokens").unwrap_or(0),
                cached: cache_read,
            }
        };
        // Later events complete earlier ones (Anthropic splits input and output); keep maxima.
        let cur = self.usage.get_or_insert_with(Usage::default);
        cur.input = cur.input.max(got.input);
        cur.output = cur.output.max(got.output);
        cur.cached = cur.cached.max(got.cached);
    }
}

/// The `id` of a Responses-API response object: a body says `"object": "response"` (chat
/// completions have ids too); a stream event's `response` is one unless it says otherwise.
fn response_id(v: Option<&Value>, in_stream: bool) -> Option<String> {
    let v = v?;
    match v.get("object").and_then(Value::as_str) {
        Some("response") => {}
        None if in_stream => {}
        _ => return None,
    }
    v.get("id")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty() && id.len() <= 256)
        .map(String::from)
}

/// Whether an SSE `data:` payload streamed output: an OpenAI chunk with choices, a Responses
/// `*.delta` event, an Anthropic `content_block_delta` — not the envelope events around them
/// (created, in progress, message start and stop, pings), nor the usage-only chunk or `[DONE]`.
fn carries_output(d: &[u8]) -> bool {
    if d.is_empty() || d == b"[DONE]" {
        return false;
    }
    // OpenAI chunks carry no top-level `type`: one scan decides for them.
    if !contains(d, b"\"type\":\"") {
        return !contains(d, b"\"choices\":[]");
    }
    if contains(d, b"\"type\":\"response.") {
        return contains(d, b".delta\"");
    }
    if contains(d, b"\"type\":\"message_")
        || contains(d, b"\"type\":\"content_block_st")
        || contains(d, b"\"type\":\"ping\"")
    {
        return false;
    }
    !contains(d, b"\"choices\":[]")
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(ct: &str, chunks: &[&str]) -> Option<Usage> {
        let mut s = UsageScanner::new(Some(ct));
        for c in chunks {
            s.feed(c.as_bytes());
        }
        s.finish()
    }

    #[test]
    fn openai_json() {
        let body = r#"{"choices":[],"usage":{"prompt_tokens":120,"completion_tokens":7,"total_tokens":127,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        let (a, b) = body.split_at(40);
        assert_eq!(
            scan("application/json", &[a, b]),
            Some(Usage {
                input: 120,
                output: 7,
                cached: 64
            })
        );
        assert_eq!(scan("application/json", &["{\"choices\":[]}"]), None);
        assert_eq!(scan("application/json", &["not json"]), None);
    }

    #[test]
    fn openai_sse_split_across_chunks() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":3,\"prompt_tokens_details\":null}}\n\ndata: [DONE]\n\n";
        for cut in [1, 30, 70, 100, stream.len() - 3] {
            let (a, b) = stream.split_at(cut);
            assert_eq!(
                scan("text/event-stream; charset=utf-8", &[a, b]),
                Some(Usage {
                    input: 50,
                    output: 3,
                    cached: 0
                }),
                "cut at {cut}"
            );
        }
        // No usage chunk (client did not ask and nothing was injected).
        assert_eq!(
            scan(
                "text/event-stream",
                &["data: {\"choices\":[]}\n\ndata: [DONE]\n\n"]
            ),
            None
        );
    }

    #[test]
    fn continuous_usage_of_a_cut_stream_is_the_last_chunk_seen() {
        let chunk = |n: u64| {
            format!(
                "data: {{\"choices\":[{{\"delta\":{{\"content\":\"t\"}}}}],\"usage\":{{\"prompt_tokens\":40,\"completion_tokens\":{n}}}}}\n\n"
            )
        };
        let mut s = UsageScanner::new(Some("text/event-stream"));
        for n in 1..=5 {
            s.feed(chunk(n).as_bytes());
        }
        // Cut mid-event: the partial line is not a usage.
        s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"t\"}}],\"usage\":{\"prompt_to");
        assert_eq!(s.events(), 5);
        assert_eq!(
            s.finish(),
            Some(Usage {
                input: 40,
                output: 5,
                cached: 0
            })
        );
    }

    #[test]
    fn responses_json_and_stream() {
        let body = r#"{"id":"resp_1","object":"response","status":"completed","usage":{"input_tokens":90,"input_tokens_details":{"cached_tokens":64},"output_tokens":12,"total_tokens":102}}"#;
        let want = Some(Usage {
            input: 90,
            output: 12,
            cached: 64,
        });
        assert_eq!(scan("application/json", &[body]), want);
        let mut s = UsageScanner::new(Some("application/json"));
        s.feed(body.as_bytes());
        s.finish();
        assert_eq!(s.response_id(), Some("resp_1"));
        let mut chat = UsageScanner::new(Some("application/json"));
        chat.feed(br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[]}"#);
        chat.finish();
        assert_eq!(
            chat.response_id(),
            None,
            "only Responses-API objects are bound"
        );
        let events = [
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"usage\":null}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n",
            "event: response.output_text.delta\ndata: {\"delta\":\"b\",\"type\":\"response.output_text.delta\"}\n\n",
            "event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"text\":\"ab\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":90,\"input_tokens_details\":{\"cached_tokens\":64},\"output_tokens\":12}}}\n\n",
        ];
        let mut s = UsageScanner::new(Some("text/event-stream"));
        for e in &events[..4] {
            s.feed(e.as_bytes());
        }
        assert_eq!(s.events(), 2, "only the deltas carried output");
        assert_eq!(s.response_id(), Some("resp_1"), "named by response.created");
        s.feed(events[4].as_bytes());
        assert_eq!(s.finish(), want);
    }

    #[test]
    fn anthropic_stream_and_message() {
        let stream = [
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":30,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"usage\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n",
        ];
        let mut s = UsageScanner::new(Some("text/event-stream"));
        s.feed(stream[0].as_bytes());
        s.feed(b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
        s.feed(stream[1].as_bytes());
        assert_eq!(s.events(), 1, "only the content delta carried output");
        assert_eq!(
            scan("text/event-stream", &stream),
            Some(Usage {
                input: 40,
                output: 9,
                cached: 30
            })
        );
        let msg = r#"{"type":"message","usage":{"input_tokens":5,"output_tokens":2}}"#;
        assert_eq!(
            scan("application/json", &[msg]),
            Some(Usage {
                input: 5,
                output: 2,
                cached: 0
            })
        );
    }
}

/// What the routing stream tells the stream that observes the response (which may run on another
/// replica): carried upstream in [`ROUTE_INFO_HEADER`] — Envoy's route removes it before the model
/// server — as `key=value` pairs joined by `;`, values percent-encoded.
pub const ROUTE_INFO_HEADER: &str = "x-llm-d-epp-route";

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouteInfo {
    /// The EPP's key for this request ([`new_request_key`]): what its in-flight charge, its
    /// flow-control slot and its ledger entry are filed under. Never the client's `x-request-id`,
    /// which clients choose (and reuse); empty when the header carried none of ours.
    pub key: String,
    pub model: String,
    pub target_model: String,
    pub fairness_id: String,
    pub priority: i32,
    /// The cost model's prediction for the chosen pod, when it ran (the observer learns from it).
    pub cost: Option<Prediction>,
    /// Prompt tokens the prefix index predicted cached on the chosen pod (the observer compares
    /// them with what the pod reports).
    pub cached: Option<u64>,
    /// The routing span's `traceparent`, when traces are exported (the observing stream links
    /// its response span to it).
    pub trace: Option<String>,
}

impl RouteInfo {
    pub fn encode(&self) -> String {
        let mut s = format!(
            "k={};m={};t={};f={};p={}",
            self.key,
            pct(&self.model),
            pct(&self.target_model),
            pct(&self.fairness_id),
            self.priority
        );
        if let Some(c) = &self.cost {
            s.push_str(";c=");
            s.push_str(&c.encode());
        }
        if let Some(x) = self.cached {
            s.push_str(&format!(";x={x}"));
        }
        if let Some(t) = &self.trace {
            s.push_str(";s=");
            s.push_str(t);
        }
        s
    }

    pub fn decode(s: &str) -> Option<RouteInfo> {
        let mut info = RouteInfo::default();
        for kv in s.split(';') {
            let (k, v) = kv.split_once('=')?;
            match k.trim() {
                // Only a key of ours is a key: anything else files the request under nothing.
                "k" if is_request_key(v) => info.key = v.to_string(),
                "m" => info.model = unpct(v)?,
                "t" => info.target_model = unpct(v)?,
                "f" => info.fairness_id = unpct(v)?,
                "p" => info.priority = v.parse().ok()?,
                // Advisory: a malformed prediction is dropped, not the route info.
                "c" => info.cost = Prediction::decode(v),
                "x" => info.cached = v.parse().ok(),
                // Advisory too; a traceparent is 55 characters.
                "s" if v.len() <= 128 && v.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') => {
                    info.trace = Some(v.to_string());
                }
                _ => {}
            }
        }
        Some(info)
    }
}

/// A fresh request key: 128 random bits as 32 hex digits, then — in cluster mode — `-` and the
/// node id of the replica that made it (hex). Unique across replicas and restarts without
/// coordination, and unguessable, so no client can name another's request; the owner's id tells
/// a replica that observes the response which peer holds the request ([`request_key_owner`]).
pub fn new_request_key(owner: Option<u64>) -> String {
    let random = uuid::Uuid::new_v4().simple();
    match owner {
        Some(id) => format!("{random}-{id:x}"),
        None => random.to_string(),
    }
}

/// The node id a request key names as its owner (`None` for a key made outside cluster mode).
pub fn request_key_owner(key: &str) -> Option<u64> {
    let (_, owner) = key.split_once('-')?;
    u64::from_str_radix(owner, 16).ok()
}

fn is_request_key(s: &str) -> bool {
    let (random, owner) = match s.split_once('-') {
        Some((r, o)) => (r, Some(o)),
        None => (s, None),
    };
    random.len() == 32
        && random.bytes().all(|b| b.is_ascii_hexdigit())
        && owner
            .is_none_or(|o| (1..=16).contains(&o.len()) && o.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn pct(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:/@".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unpct(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod route_info_tests {
    use super::*;

    #[test]
    fn keys_are_ours_or_nothing() {
        let a = new_request_key(None);
        assert_ne!(a, new_request_key(None));
        let owned = new_request_key(Some(0xdead_beef_0042));
        assert_eq!(request_key_owner(&owned), Some(0xdead_beef_0042));
        assert_eq!(request_key_owner(&a), None);
        for key in [&a, &owned] {
            let info = RouteInfo {
                key: key.clone(),
                ..Default::default()
            };
            assert_eq!(&RouteInfo::decode(&info.encode()).unwrap().key, key);
        }
        let random = &a[..32];
        for forged in [
            "client-chosen-id",
            "",
            "zz",
            &"f".repeat(64),
            &format!("{random}-"),
            &format!("{random}-{}", "1".repeat(17)),
            &format!("{random}-x1"),
            &format!("{random}-1-2"),
        ] {
            let d = RouteInfo::decode(&format!("k={forged};m=m;p=0")).unwrap();
            assert_eq!(d.key, "", "{forged}");
        }
    }

    #[test]
    fn round_trip_with_awkward_values() {
        let info = RouteInfo {
            key: new_request_key(None),
            model: "meta-llama/Llama-3.1-8B".into(),
            target_model: "lora;a=b %".into(),
            fairness_id: "tenant é 1".into(),
            priority: -7,
            cost: None,
            cached: Some(1024),
            trace: None,
        };
        let enc = info.encode();
        assert!(enc.ends_with(";x=1024"), "{enc}");
        assert!(enc.is_ascii() && !enc.contains(' '), "{enc}");
        assert_eq!(RouteInfo::decode(&enc), Some(info.clone()));
        // The routing span's context rides along; anything but a traceparent's characters is
        // dropped.
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let traced = RouteInfo {
            trace: Some(tp.into()),
            ..info.clone()
        };
        assert_eq!(RouteInfo::decode(&traced.encode()), Some(traced));
        let forged = format!("{};s=<script>", info.encode());
        assert_eq!(RouteInfo::decode(&forged).unwrap().trace, None);
        assert_eq!(RouteInfo::decode("m=a;p=x"), None);
        assert_eq!(RouteInfo::decode("m=%zz"), None);
    }

    #[test]
    fn the_prediction_rides_along_and_garbage_is_dropped() {
        let info = RouteInfo {
            model: "m".into(),
            priority: 1,
            cost: Some(Prediction {
                ttft_ms: 12.5,
                queue_ms: 0.0,
                others_ms: 0.0,
                uncached_tokens: 300,
                queued_tokens: 40,
                running: 2,
            }),
            ..Default::default()
        };
        let enc = info.encode();
        assert!(enc.ends_with(";c=12.5,0.0,300,40,2"), "{enc}");
        assert_eq!(RouteInfo::decode(&enc), Some(info.clone()));
        for bad in [
            "1,2",
            "nan,0,1,1,1",
            "-1,0,1,1,1",
            "1,0,1,1,1,9",
            "1e300,0,1,1,1",
        ] {
            let d = RouteInfo::decode(&format!("m=m;p=1;c={bad}")).unwrap();
            assert_eq!(d.cost, None, "{bad}");
            assert_eq!(d.model, "m");
        }
    }
}
