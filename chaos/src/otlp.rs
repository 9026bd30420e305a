//! An in-process OTLP/gRPC trace receiver (the OTLP protobuf types' `TraceService`): what a
//! collector would receive from the EPP, for tests and the tracing benchmark.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;

/// One span received and its resource's `service.name` and `service.instance.id`.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub instance: String,
    pub span: Span,
}

/// Every span received.
#[derive(Clone, Default)]
pub struct Receiver {
    pub spans: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        for rs in req.into_inner().resource_spans {
            let resource = |key: &str| {
                rs.resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == key)
                    .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                        Any::StringValue(s) => Some(s.clone()),
                        _ => None,
                    })
                    .unwrap_or_default()
            };
            let (service, instance) = (resource("service.name"), resource("service.instance.id"));
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received {
                        service: service.clone(),
                        instance: instance.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

pub async fn receiver() -> anyhow::Result<(Receiver, std::net::SocketAddr)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let r = Receiver::default();
    let svc = TraceServiceServer::new(r.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    Ok((r, addr))
}
