//! Peer TLS: PEM files loaded into rustls (the ring provider, as tonic's `tls-ring`), reloaded
//! while the node runs, and node identities bound to certificate names.
//!
//! The peer port accepts TLS itself ([`super::accept`]) so that each connection gets the
//! server configuration current when it arrives; outgoing channels are rebuilt after a reload
//! (existing sessions stay up: a certificate is checked at the handshake). With
//! [`TlsConfig::identity`] set, a certificate the CA signed is not enough: each RPC's sender
//! must present the certificate of the node it acts as ([`PeerIdentity`]), and a node dialing
//! peer `N` expects `N`'s name in the server's certificate.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::RwLock;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use rustls::server::ParsedCertificate;
use rustls::server::WebPkiClientVerifier;
use serde::Deserialize;
use serde::Serialize;
use tonic::transport::Certificate;
use tonic::transport::ClientTlsConfig;
use tonic::transport::Identity;

use crate::config::TlsConfig;
use crate::error::ConsensusError;
use crate::types::NodeId;

/// `s` as a DNS server name (not an IP address), if it is one.
pub(crate) fn dns_name(s: &str) -> Option<ServerName<'static>> {
    match ServerName::try_from(s.to_string()) {
        Ok(n @ ServerName::DnsName(_)) => Some(n),
        _ => None,
    }
}

fn tls_err(reason: String) -> ConsensusError {
    ConsensusError::Tls { reason }
}

/// The files' contents, compared to notice a change.
#[derive(Debug, PartialEq, Eq)]
struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Option<Vec<u8>>,
}

impl Files {
    fn read(cfg: &TlsConfig) -> Result<Self, ConsensusError> {
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read(path).map_err(|e| tls_err(format!("read {what} {}: {e}", path.display())))
        };
        Ok(Self {
            cert: read(&cfg.cert_file, "certificate")?,
            key: read(&cfg.key_file, "private key")?,
            ca: cfg
                .ca_file
                .as_deref()
                .map(|p| read(p, "CA bundle"))
                .transpose()?,
        })
    }
}

/// Loaded TLS material: the server configuration of the peer port and what outgoing channels
/// present and trust.
#[derive(Debug)]
pub struct TlsMaterial {
    files: Files,
    identity: Identity,
    ca: Option<Certificate>,
    server: Arc<ServerConfig>,
}

impl TlsMaterial {
    /// Reads and checks the files named in `cfg` for node `own_id`: the certificate must parse,
    /// match the key, and carry `own_id`'s name when identities are bound.
    pub fn load(cfg: &TlsConfig, own_id: NodeId) -> Result<Self, ConsensusError> {
        Self::build(cfg, own_id, Files::read(cfg)?)
    }

    fn build(cfg: &TlsConfig, own_id: NodeId, files: Files) -> Result<Self, ConsensusError> {
        let cert_path = cfg.cert_file.display();
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&files.cert)
            .collect::<Result<_, _>>()
            .map_err(|e| tls_err(format!("certificate {cert_path}: {e}")))?;
        let Some(leaf) = certs.first() else {
            return Err(tls_err(format!("no certificate in {cert_path}")));
        };
        if let Some(name) = cfg.identity_of(own_id)
            && !has_name(leaf, &name)
        {
            return Err(tls_err(format!(
                "certificate {cert_path} is not valid for this node's identity `{name}` \
                 (tls identity template `{}`)",
                cfg.identity.as_deref().unwrap_or_default()
            )));
        }
        let key = PrivateKeyDer::from_pem_slice(&files.key)
            .map_err(|e| tls_err(format!("private key {}: {e}", cfg.key_file.display())))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err(format!("protocol versions: {e}")))?;
        let builder = match &files.ca {
            Some(pem) => {
                let ca_path = cfg.ca_file.as_deref().unwrap_or(std::path::Path::new(""));
                let bad = |e: String| tls_err(format!("CA bundle {}: {e}", ca_path.display()));
                let mut roots = RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(pem) {
                    roots
                        .add(c.map_err(|e| bad(e.to_string()))?)
                        .map_err(|e| bad(e.to_string()))?;
                }
                if roots.is_empty() {
                    return Err(bad("no certificate".into()));
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| bad(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut server = builder
            .with_single_cert(certs, key)
            .map_err(|e| tls_err(format!("certificate {cert_path} and its key: {e}")))?;
        server.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            identity: Identity::from_pem(&files.cert, &files.key),
            ca: files.ca.as_ref().map(Certificate::from_pem),
            server: Arc::new(server),
            files,
        })
    }

    /// The peer port's server configuration.
    pub(crate) fn server(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.server)
    }

    /// Client side for a peer expected to present `name`: verify with the CA, present our
    /// identity.
    pub fn client(&self, name: &str) -> ClientTlsConfig {
        let mut tls = ClientTlsConfig::new()
            .identity(self.identity.clone())
            .domain_name(name);
        if let Some(ca) = &self.ca {
            tls = tls.ca_certificate(ca.clone());
        }
        tls
    }
}

/// Whether `cert` (an end-entity certificate, already verified against the CA) is valid for the
/// DNS name `name`.
fn has_name(cert: &CertificateDer<'_>, name: &str) -> bool {
    ParsedCertificate::try_from(cert).is_ok_and(|parsed| names(&parsed, name))
}

fn names(cert: &ParsedCertificate<'_>, name: &str) -> bool {
    dns_name(name).is_some_and(|n| rustls::client::verify_server_name(cert, &n).is_ok())
}

/// Node ids bound to certificate names by a template (`epp-node-{id}`): checks that a peer's
/// client certificate is the one of the node it claims to be. Also for the application's
/// services on the peer port.
#[derive(Debug, Clone)]
pub struct PeerIdentity {
    template: String,
}

impl PeerIdentity {
    /// The binding `cfg` configures, if any.
    pub fn of(cfg: &TlsConfig) -> Option<Self> {
        cfg.identity.clone().map(|template| Self { template })
    }

    /// Node `id`'s certificate name.
    pub fn name(&self, id: NodeId) -> String {
        crate::config::identity_name(&self.template, id)
    }

    /// `Ok` when `certs` (the peer's chain, as `tonic::Request::peer_certs` returns it) is valid
    /// for one of `ids`; `PermissionDenied` otherwise.
    pub fn check(
        &self,
        certs: Option<&[CertificateDer<'static>]>,
        ids: impl IntoIterator<Item = NodeId>,
        acting_as: &str,
    ) -> Result<(), tonic::Status> {
        let Some(leaf) = certs.and_then(<[_]>::first) else {
            return Err(tonic::Status::permission_denied(
                "peer identity: no client certificate",
            ));
        };
        let parsed = ParsedCertificate::try_from(leaf).map_err(|e| {
            tonic::Status::permission_denied(format!("peer identity: bad certificate: {e}"))
        })?;
        let mut tried = Vec::new();
        for id in ids {
            let name = self.name(id);
            if names(&parsed, &name) {
                return Ok(());
            }
            tried.push(name);
        }
        Err(tonic::Status::permission_denied(format!(
            "peer identity: the client certificate is not valid for {acting_as} ({})",
            if tried.is_empty() {
                "no node qualifies".to_string()
            } else {
                tried.join(", ")
            }
        )))
    }
}

/// Counters of the peer port's authentication (cumulative since the node started).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerTlsStats {
    /// Connections whose TLS handshake failed or timed out (no or untrusted certificate, not
    /// TLS at all).
    pub handshake_failures: u64,
    /// Raft RPCs refused because the certificate was not the claimed node's.
    pub refused: u64,
    /// Changed material loaded from the files.
    pub reloads: u64,
    /// Reloads that failed (unreadable or invalid files; the previous material stays).
    pub reload_failures: u64,
}

/// One node's peer TLS: the current material, its identity binding and counters.
#[derive(Debug)]
pub(crate) struct PeerTls {
    cfg: TlsConfig,
    own_id: NodeId,
    current: RwLock<Arc<TlsMaterial>>,
    generation: AtomicU64,
    pub(crate) identity: Option<PeerIdentity>,
    handshake_failures: AtomicU64,
    refused: AtomicU64,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
    last_warning: Mutex<Option<Instant>>,
}

/// At most one warning per this long about refused peers (the counters count them all).
const WARN_EVERY: Duration = Duration::from_secs(10);

impl PeerTls {
    pub(crate) fn load(cfg: &TlsConfig, own_id: NodeId) -> Result<Arc<Self>, ConsensusError> {
        let material = TlsMaterial::load(cfg, own_id)?;
        Ok(Arc::new(Self {
            cfg: cfg.clone(),
            own_id,
            current: RwLock::new(Arc::new(material)),
            generation: AtomicU64::new(0),
            identity: PeerIdentity::of(cfg),
            handshake_failures: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
            last_warning: Mutex::new(None),
        }))
    }

    pub(crate) fn material(&self) -> Arc<TlsMaterial> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Bumped by every reload that changed the material.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub(crate) fn reload_interval(&self) -> Duration {
        self.cfg.reload_interval
    }

    /// Re-reads the files; swaps in changed material if it loads (`Ok(true)`). Invalid files
    /// keep the previous material (`Err`).
    pub(crate) fn reload(&self) -> Result<bool, ConsensusError> {
        let outcome = Files::read(&self.cfg).and_then(|files| {
            if files == self.material().files {
                return Ok(None);
            }
            TlsMaterial::build(&self.cfg, self.own_id, files).map(Some)
        });
        match outcome {
            Ok(None) => Ok(false),
            Ok(Some(m)) => {
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(m);
                self.generation.fetch_add(1, Ordering::AcqRel);
                self.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) => {
                self.reload_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// The name to expect in the certificate of the peer `target` at `host`.
    pub(crate) fn server_name(&self, target: Option<NodeId>, host: &str) -> String {
        target
            .and_then(|t| self.identity.as_ref().map(|i| i.name(t)))
            .or_else(|| self.cfg.server_name.clone())
            .unwrap_or_else(|| host.to_string())
    }

    /// [`PeerIdentity::check`] when identities are bound (else `Ok`), counting and (rate
    /// limited) logging refusals.
    pub(crate) fn authorize(
        &self,
        certs: Option<&[CertificateDer<'static>]>,
        ids: impl IntoIterator<Item = NodeId>,
        acting_as: &str,
    ) -> Result<(), tonic::Status> {
        let Some(identity) = &self.identity else {
            return Ok(());
        };
        identity.check(certs, ids, acting_as).inspect_err(|e| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            self.warn(|| tracing::warn!(reason = e.message(), "peer RPC refused"));
        })
    }

    pub(crate) fn handshake_failed(&self, from: std::net::SocketAddr, reason: &str) {
        self.handshake_failures.fetch_add(1, Ordering::Relaxed);
        self.warn(|| {
            tracing::warn!(
                %from,
                reason,
                total = self.handshake_failures.load(Ordering::Relaxed),
                "peer TLS handshake failed"
            );
        });
    }

    fn warn(&self, log: impl FnOnce()) {
        let mut last = self
            .last_warning
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            log();
        }
    }

    pub(crate) fn stats(&self) -> PeerTlsStats {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PeerTlsStats {
            handshake_failures: n(&self.handshake_failures),
            refused: n(&self.refused),
            reloads: n(&self.reloads),
            reload_failures: n(&self.reload_failures),
        }
    }
}

/// Re-reads the peer TLS files every `reload_interval`; changed material that loads is used for
/// new connections, invalid files keep the old one (and say so).
pub(crate) async fn reload_loop(tls: Arc<PeerTls>, node_id: NodeId) {
    let mut every = tokio::time::interval(tls.reload_interval());
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        every.tick().await;
        match tls.reload() {
            Ok(true) => tracing::info!(node_id, "peer TLS material reloaded"),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                node_id,
                error = %e,
                "peer TLS files changed but do not load; keeping the previous material"
            ),
        }
    }
}
