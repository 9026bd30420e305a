//! The per-connection service of one pod: the two requests a fleet receives most often — `GET
//! /metrics` (every pod scraped every 50 ms) and `GET /health` — are answered right here from
//! prebuilt headers and the pod's cached exposition; every other request (and `/metrics` while a
//! metrics fault or delay is set) goes through the axum router of [`crate::server::pod_router`].
//!
//! Why not just the router: a scrape through it clones the boxed route service, walks the path
//! router, records the matched path, runs two middlewares and builds the headers one insert at a
//! time — about half of the simulator's CPU per scrape. Here a scrape costs a path compare, one lock
//! of the pod state, a `HeaderMap` clone and a reference-count increment of the cached bytes, which
//! hyper writes without copying. Both paths produce the same status, headers and body.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, header};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::service::{TowerToHyperService, TowerToHyperServiceFuture};

use crate::engine::Pod;
use crate::knobs::MetricsFault;
use crate::server::{self, DESTINATION_HEADER, PROMETHEUS_TEXT, RECEIVED_DESTINATION_HEADER};

/// Response body of a pod: bytes held in full (the fast path) or whatever the router produced.
#[derive(Debug)]
pub enum PodBody {
    /// `None` once the bytes went out (or for an empty body).
    Full(Option<Bytes>),
    Router(axum::body::Body),
}

impl hyper::body::Body for PodBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match self.get_mut() {
            PodBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            PodBody::Router(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            PodBody::Full(bytes) => bytes.is_none(),
            PodBody::Router(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            PodBody::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            PodBody::Router(body) => body.size_hint(),
        }
    }
}

#[derive(Debug)]
struct Inner {
    pod: Arc<Pod>,
    router: TowerToHyperService<Router>,
    /// `content-type` of the exposition plus the pod's identity headers.
    metrics_headers: HeaderMap,
    /// The pod's identity headers alone.
    health_headers: HeaderMap,
}

/// One pod's HTTP service; cloning it (once per connection) is a reference-count increment.
#[derive(Clone, Debug)]
pub struct PodService(Arc<Inner>);

impl PodService {
    pub fn new(pod: Arc<Pod>) -> PodService {
        let mut health_headers = HeaderMap::with_capacity(4);
        for (name, value) in server::identity_headers(&pod) {
            health_headers.insert(name, value);
        }
        let mut metrics_headers = HeaderMap::with_capacity(4);
        metrics_headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROMETHEUS_TEXT),
        );
        metrics_headers.extend(health_headers.clone());
        let router = TowerToHyperService::new(server::pod_router(Arc::clone(&pod)));
        PodService(Arc::new(Inner {
            pod,
            router,
            metrics_headers,
            health_headers,
        }))
    }

    /// The fast-path answer to `req`, or `None` when the router must answer it.
    fn fast(&self, req: &Request<Incoming>) -> Option<Response<PodBody>> {
        if req.method() != Method::GET {
            return None;
        }
        let inner = &*self.0;
        let (headers, body) = match req.uri().path() {
            "/metrics" => {
                let (knobs, key) = inner.pod.metrics_inputs();
                if knobs.metrics_fault != MetricsFault::None || knobs.metrics_delay_ms > 0.0 {
                    return None;
                }
                let text = server::exposition(&inner.pod, &knobs, key);
                (&inner.metrics_headers, Some(text))
            }
            "/health" => (&inner.health_headers, None),
            _ => return None,
        };
        let mut res = Response::new(PodBody::Full(body));
        *res.headers_mut() = headers.clone();
        if let Some(dest) = req.headers().get(DESTINATION_HEADER) {
            res.headers_mut()
                .insert(RECEIVED_DESTINATION_HEADER, dest.clone());
        }
        if let Some(names) = server::received_headers(req.headers()) {
            res.headers_mut()
                .insert(server::RECEIVED_HEADERS_HEADER, names);
        }
        Some(res)
    }
}

/// The future of [`PodService`]: ready at once on the fast path, the router's otherwise (boxed, so
/// the enum stays `Unpin` without pin projection).
pub enum PodFuture {
    Ready(Option<Response<PodBody>>),
    Router(Pin<Box<TowerToHyperServiceFuture<Router, Request<Incoming>>>>),
}

impl Future for PodFuture {
    type Output = Result<Response<PodBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            PodFuture::Ready(res) => match res.take() {
                Some(r) => Poll::Ready(Ok(r)),
                // Polled again after completion: a bug in the caller, answer rather than panic.
                None => Poll::Ready(Ok(Response::new(PodBody::Full(None)))),
            },
            PodFuture::Router(fut) => fut
                .as_mut()
                .poll(cx)
                .map(|r| r.map(|res| res.map(PodBody::Router))),
        }
    }
}

impl hyper::service::Service<Request<Incoming>> for PodService {
    type Response = Response<PodBody>;
    type Error = Infallible;
    type Future = PodFuture;

    fn call(&self, req: Request<Incoming>) -> PodFuture {
        match self.fast(&req) {
            Some(res) => PodFuture::Ready(Some(res)),
            None => PodFuture::Router(Box::pin(hyper::service::Service::call(&self.0.router, req))),
        }
    }
}
