//! The response filter: the few requests whose response the EPP must act on.
//!
//! The routing filter answers the request phase only, and responses are merely observed, so that
//! a dying EPP replica never cuts a response (I9). Two features need more, for some requests only:
//! - **eviction** (`flowControl.enableEviction`): flow control may abort an in-flight sheddable
//!   request (priority < 0);
//! - **model restore**: a request whose model was rewritten must show the client the model it
//!   asked for, so the response's `"model"` is rewritten back.
//!
//! The routing stream marks such requests with [`RESPONSE_FILTER_HEADER`] (`evict`,
//! `restore-model`, comma-separated); Envoy's route for that header enables a third ext_proc filter
//! (gRPC initial metadata [`ROLE_METADATA`]` = response`) that sends the request headers, the
//! response headers and every response body chunk (STREAMED) — Envoy keeps an ext_proc stream open
//! only while a phase is pending, so this stream lives as long as the request. Eviction: the stream
//! attaches to the request's in-flight entry (only then does flow control count the request as
//! evictable) and, when evicted, sends an immediate response — 429 `evicted` — which Envoy delivers
//! to the client (or, once response bytes have flowed, turns into a reset) while resetting the
//! upstream request. Model restore: each chunk comes back with `"model":"<target>"` replaced.
//!
//! The price, documented in the operations guide: these requests depend on the replica that holds
//! their response stream, so they give up I9.

use std::sync::Arc;

use base64::Engine as _;

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest,
    ProcessingResponse, body_mutation,
};
use tokio::sync::oneshot;
use tonic::Streaming;

use super::context::PickerContext;
use super::reply::{header_value, immediate};
use super::usage::{ROUTE_INFO_HEADER, RouteInfo};
use crate::request::reject::Rejection;

/// Request header the routing stream sets on requests the response filter must handle (its
/// route enables the filter and removes the header before the model server).
pub const RESPONSE_FILTER_HEADER: &str = "x-llm-d-response-filter";
/// gRPC initial metadata naming the ext_proc filter a stream belongs to (`response`; absent for
/// the routing and observing filters).
pub const ROLE_METADATA: &str = "x-llm-d-ext-proc-role";
pub const EVICT: &str = "evict";
pub const RESTORE_MODEL: &str = "restore-model";

use crate::dataplane::reply::Tx;

/// `target` (what the model server answers with) back to `incoming` (what the client asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    pub target: String,
    pub incoming: String,
}

impl Restore {
    /// The [`RESPONSE_FILTER_HEADER`] item that carries it: `restore-model=<target>.<incoming>`,
    /// each base64url. It rides on the request, so whichever replica gets the response stream
    /// can restore (the routing filter strips any client-sent copy; the route removes it before
    /// the model server).
    pub fn header_item(&self) -> String {
        let b = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "{RESTORE_MODEL}={}.{}",
            b.encode(&self.target),
            b.encode(&self.incoming)
        )
    }

    fn from_item(item: &str) -> Option<Restore> {
        let b = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let (t, i) = item
            .strip_prefix(RESTORE_MODEL)?
            .strip_prefix('=')?
            .split_once('.')?;
        let s = |x: &str| String::from_utf8(b.decode(x).ok()?).ok();
        Some(Restore {
            target: s(t)?,
            incoming: s(i)?,
        })
    }
}

/// Whether a stream belongs to the response filter.
pub fn is_response_stream(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata
        .get(ROLE_METADATA)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "response")
}

/// Serve one response-filter stream until the request ends or is evicted.
pub async fn run(ctx: Arc<PickerContext>, mut inbound: Streaming<ProcessingRequest>, tx: Tx) {
    let (key, wants) = loop {
        match inbound.message().await {
            Ok(Some(ProcessingRequest {
                request: Some(Req::RequestHeaders(h)),
                ..
            })) => {
                let get = |k| {
                    header_value(h.headers.as_ref(), k)
                        .map(|v| v.into_owned())
                        .unwrap_or_default()
                };
                // The request's key, from the route info the routing filter set (a client's
                // own route info never reaches here: the routing filter replaced it).
                let key = RouteInfo::decode(&get(ROUTE_INFO_HEADER)).map(|i| i.key);
                break (key.unwrap_or_default(), get(RESPONSE_FILTER_HEADER));
            }
            Ok(Some(_)) => continue,
            _ => return,
        }
    };
    let wants: Vec<&str> = wants.split(',').map(str::trim).collect();
    let restore = wants.iter().find_map(|w| Restore::from_item(w));
    let evictor = if wants.contains(&EVICT) && !key.is_empty() {
        ctx.gate.attach_evictor(&key)
    } else {
        None
    };
    if restore.is_none() && evictor.is_none() {
        // Nothing to do here (another replica admitted it, or it already ended): let it through
        // and close our side — Envoy then proceeds without us.
        tracing::debug!(%key, "response stream for a request with nothing to do here");
        let _ = send(&tx, Resp::RequestHeaders(HeadersResponse::default())).await;
        return;
    }
    let evicting = evictor.is_some();
    let evicted = hold(&ctx, &mut inbound, &tx, &key, evictor, restore).await;
    if evicting && !evicted {
        // The stream ended without an eviction (the response is over, or Envoy gave up on us):
        // the request can no longer be aborted, so flow control must stop counting on it.
        ctx.gate.detach_evictor(&key);
    }
}

/// Answer the request's remaining ext_proc messages until it ends; true if it was evicted.
async fn hold(
    ctx: &PickerContext,
    inbound: &mut Streaming<ProcessingRequest>,
    tx: &Tx,
    key: &str,
    evictor: Option<oneshot::Receiver<()>>,
    restore: Option<Restore>,
) -> bool {
    if send(tx, Resp::RequestHeaders(HeadersResponse::default()))
        .await
        .is_err()
    {
        return false;
    }
    let mut restorer = restore.map(|r| ModelRestorer::new(&r));
    let mut evictor = evictor;
    loop {
        tokio::select! {
            fired = async {
                match evictor.as_mut() {
                    Some(rx) => rx.await,
                    None => std::future::pending().await,
                }
            }, if evictor.is_some() => {
                if fired.is_ok() {
                    evict(ctx, tx, key).await;
                    return true;
                }
                // The request ended on its own: keep restoring if asked to, else we are done.
                evictor = None;
                if restorer.is_none() {
                    return false;
                }
            }
            msg = inbound.message() => {
                let answer = match msg {
                    Ok(Some(ProcessingRequest { request: Some(Req::ResponseHeaders(_)), .. })) => {
                        // A restored body changes length: the model server's Content-Length no
                        // longer holds.
                        let remove_headers = if restorer.is_some() {
                            vec!["content-length".to_string()]
                        } else {
                            Vec::new()
                        };
                        Resp::ResponseHeaders(HeadersResponse {
                            response: Some(CommonResponse {
                                header_mutation: Some(HeaderMutation {
                                    set_headers: vec![],
                                    remove_headers,
                                }),
                                ..Default::default()
                            }),
                        })
                    }
                    Ok(Some(ProcessingRequest { request: Some(Req::ResponseBody(b)), .. })) => {
                        match &mut restorer {
                            Some(r) => Resp::ResponseBody(BodyResponse {
                                response: Some(CommonResponse {
                                    body_mutation: Some(BodyMutation {
                                        mutation: Some(body_mutation::Mutation::Body(
                                            r.feed(&b.body, b.end_of_stream),
                                        )),
                                    }),
                                    ..Default::default()
                                }),
                            }),
                            None => Resp::ResponseBody(BodyResponse::default()),
                        }
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => return false,
                };
                if send(tx, answer).await.is_err() {
                    return false;
                }
            }
        }
    }
}

async fn evict(ctx: &PickerContext, tx: &Tx, key: &str) {
    tracing::info!(%key, "request evicted by flow control");
    let r = Rejection::dropped(flowctl::DropReason::Evicted);
    let labels = ctx.metrics.request_labels("", "");
    ctx.metrics.refused(&labels, r.code, r.status, r.reason);
    let _ = send(tx, Resp::ImmediateResponse(immediate(&r))).await;
}

async fn send(tx: &Tx, resp: Resp) -> Result<(), ()> {
    tx.send(Box::new(ProcessingResponse {
        response: Some(resp),
        ..Default::default()
    }))
    .await
    .map_err(|_| ())
}

/// Rewrites `"model":"<target>"` (and `"model": "<target>"`) back to the client's model in a
/// response body that arrives in chunks; a match split across chunks is held back until the next
/// chunk completes it. In generated text such a match cannot occur: its quotes are escaped.
pub struct ModelRestorer {
    from: [Vec<u8>; 2],
    to: [Vec<u8>; 2],
    carry: Vec<u8>,
}

impl ModelRestorer {
    pub fn new(r: &Restore) -> ModelRestorer {
        let json = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let (t, i) = (json(&r.target), json(&r.incoming));
        ModelRestorer {
            from: [
                format!("\"model\":{t}").into_bytes(),
                format!("\"model\": {t}").into_bytes(),
            ],
            to: [
                format!("\"model\":{i}").into_bytes(),
                format!("\"model\": {i}").into_bytes(),
            ],
            carry: Vec::new(),
        }
    }

    /// The restored bytes to send for `chunk` (the held-back tail comes with a later chunk, or
    /// with the last one).
    pub fn feed(&mut self, chunk: &[u8], end_of_stream: bool) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(buf.len());
        let mut i = 0;
        'scan: while i < buf.len() {
            for (from, to) in self.from.iter().zip(&self.to) {
                if buf[i..].starts_with(from) {
                    out.extend_from_slice(to);
                    i += from.len();
                    continue 'scan;
                }
            }
            // A possible match cut by the chunk's end: keep it for the next chunk.
            if !end_of_stream
                && self
                    .from
                    .iter()
                    .any(|f| f.len() > buf.len() - i && f.starts_with(&buf[i..]))
            {
                self.carry = buf[i..].to_vec();
                return out;
            }
            out.push(buf[i]);
            i += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn restorer() -> ModelRestorer {
        ModelRestorer::new(&Restore {
            target: "base-v2".into(),
            incoming: "assistant".into(),
        })
    }

    #[test]
    fn restores_whole_and_split_matches() {
        let body = br#"{"id":"x","model":"base-v2","choices":[{"text":"\"model\":\"base-v2\""}]}"#;
        let want =
            br#"{"id":"x","model":"assistant","choices":[{"text":"\"model\":\"base-v2\""}]}"#;
        assert_eq!(restorer().feed(body, true), want.to_vec());
        // Every split point gives the same bytes in total.
        for cut in 0..body.len() {
            let mut r = restorer();
            let mut got = r.feed(&body[..cut], false);
            got.extend(r.feed(&body[cut..], true));
            assert_eq!(got, want.to_vec(), "cut at {cut}");
        }
        // SSE with a space after the colon, two events.
        let sse =
            b"data: {\"model\": \"base-v2\"}\n\ndata: {\"model\":\"base-v2\"}\n\ndata: [DONE]\n\n";
        let got = restorer().feed(sse, true);
        assert_eq!(
            String::from_utf8(got).unwrap(),
            "data: {\"model\": \"assistant\"}\n\ndata: {\"model\":\"assistant\"}\n\ndata: [DONE]\n\n"
        );
        // A prefix that turns out not to match is released with the next chunk.
        let mut r = restorer();
        assert_eq!(r.feed(b"{\"model\":\"base", false), b"{".to_vec());
        assert_eq!(r.feed(b"-v3\"}", true), b"\"model\":\"base-v3\"}".to_vec());
    }

    #[test]
    fn restores_ride_in_the_header() {
        let r = Restore {
            target: "meta/llama-3.1,8b".into(),
            incoming: "assistant=v1".into(),
        };
        let item = r.header_item();
        assert!(
            !item[RESTORE_MODEL.len() + 1..].contains([',', '=']),
            "{item}"
        );
        assert_eq!(Restore::from_item(&item), Some(r));
        assert_eq!(Restore::from_item("restore-model=%%.x"), None);
        assert_eq!(Restore::from_item(EVICT), None);
    }
}
