//! Loading PEM material into tonic's rustls configs (ring provider only, via tonic's
//! `tls-ring` feature).

use tonic::transport::Certificate;
use tonic::transport::ClientTlsConfig;
use tonic::transport::Identity;
use tonic::transport::ServerTlsConfig;

use crate::config::TlsConfig;
use crate::error::ConsensusError;

fn read(path: &std::path::Path, what: &str) -> Result<Vec<u8>, ConsensusError> {
    std::fs::read(path).map_err(|e| ConsensusError::Tls {
        reason: format!("read {what} {}: {e}", path.display()),
    })
}

/// Loaded TLS material.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    identity: Identity,
    ca: Option<Certificate>,
    server_name: Option<String>,
}

impl TlsMaterial {
    /// Reads the files named in `cfg`.
    pub fn load(cfg: &TlsConfig) -> Result<Self, ConsensusError> {
        let cert = read(&cfg.cert_file, "certificate")?;
        let key = read(&cfg.key_file, "private key")?;
        let ca = match &cfg.ca_file {
            Some(path) => Some(Certificate::from_pem(read(path, "CA bundle")?)),
            None => None,
        };
        Ok(Self {
            identity: Identity::from_pem(cert, key),
            ca,
            server_name: cfg.server_name.clone(),
        })
    }

    /// Server side: present our identity; require client certificates signed by the CA if one
    /// is configured.
    pub fn server(&self) -> ServerTlsConfig {
        let tls = ServerTlsConfig::new().identity(self.identity.clone());
        match &self.ca {
            Some(ca) => tls.client_ca_root(ca.clone()),
            None => tls,
        }
    }

    /// Client side for a peer at `host`: verify with the CA, present our identity.
    pub fn client(&self, host: &str) -> ClientTlsConfig {
        let mut tls = ClientTlsConfig::new()
            .identity(self.identity.clone())
            .domain_name(self.server_name.clone().unwrap_or_else(|| host.to_string()));
        if let Some(ca) = &self.ca {
            tls = tls.ca_certificate(ca.clone());
        }
        tls
    }
}
