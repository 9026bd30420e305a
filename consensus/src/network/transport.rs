//! Peer transports other than the host's TCP: connections accepted and dialed through something
//! else — the deterministic simulation's network (`chaos/tests/it/dst`), where hosts, links and time
//! are simulated. Such a transport carries no TLS: it is for tests of the protocol, never for
//! a deployment.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Context;
use std::task::Poll;

use hyper_util::rt::TokioIo;
use tokio::io::AsyncRead;
use tokio::io::AsyncWrite;
use tokio::io::ReadBuf;
use tokio_stream::Stream;
use tonic::transport::Uri;
use tonic::transport::server::Connected;

/// A byte stream both ways.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A connection accepted or dialed on a custom transport.
pub struct PeerConn(pub Box<dyn Io>);

impl PeerConn {
    pub fn new(io: impl Io) -> Self {
        Self(Box::new(io))
    }
}

impl AsyncRead for PeerConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl Connected for PeerConn {
    type ConnectInfo = ();

    fn connect_info(&self) {}
}

/// What dialing returns.
pub type Dialing = Pin<Box<dyn Future<Output = io::Result<PeerConn>> + Send>>;

/// Dials a peer address (`host:port`).
#[derive(Clone)]
pub struct Dialer(Arc<dyn Fn(String) -> Dialing + Send + Sync>);

impl Dialer {
    pub fn new(dial: impl Fn(String) -> Dialing + Send + Sync + 'static) -> Self {
        Self(Arc::new(dial))
    }
}

/// The connections the peer port accepts.
pub type Incoming = Pin<Box<dyn Stream<Item = io::Result<PeerConn>> + Send>>;

/// A peer transport: what the peer port accepts and how peers are dialed.
pub struct Transport {
    pub incoming: Incoming,
    pub dialer: Dialer,
}

/// The [`Dialer`] as the connector tonic's channels take.
#[derive(Clone)]
pub(crate) struct DialService(pub(crate) Dialer);

impl tonic::codegen::Service<Uri> for DialService {
    type Response = TokioIo<PeerConn>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<PeerConn>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let addr = uri.authority().map(ToString::to_string);
        let dial = Arc::clone(&self.0.0);
        Box::pin(async move {
            let addr = addr.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "peer address without authority",
                )
            })?;
            dial(addr).await.map(TokioIo::new)
        })
    }
}
