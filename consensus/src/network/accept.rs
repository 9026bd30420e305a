//! The peer port's TLS accept loop: each connection's handshake runs in its own task (a slow or
//! silent client cannot hold up the others) with the server configuration current when it
//! arrived, so reloaded certificates apply to new connections at once.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use super::tls::PeerTls;

/// A handshake not done by then is dropped (and counted as failed).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; a connection past it is closed at once (and counted as a
/// failed handshake): anyone who reaches the peer port could otherwise hold a task and a TLS
/// state each with connections that never finish (a member's few connections are long-lived).
pub(crate) const MAX_HANDSHAKES: usize = 256;

/// Accepted, handshaken connections for tonic's `serve_with_incoming`. The loop ends when the
/// server drops the stream.
pub(crate) fn tls_incoming(
    listener: TcpListener,
    tls: Arc<PeerTls>,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = mpsc::channel(64);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let (tcp, from) = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "peer port accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                tls.handshake_failed(from, "too many handshakes in progress");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = TlsAcceptor::from(tls.material().server());
            let (tx, tls) = (tx.clone(), Arc::clone(&tls));
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tls.handshake_failed(from, &e.to_string()),
                    Err(_) => tls.handshake_failed(from, "timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
