//! Optional TLS for rack peer links, for networks where blocks must not cross in clear text.
//! The cluster key already authenticates every request and every block; TLS adds privacy.
//!
//! Every member presents a certificate for one shared name ([`Connector::new`]'s `name`,
//! e.g. `larder-peer`) issued by the cluster's CA, so that members can be addressed by IP
//! address (pods come and go) and still be verified. No client certificates: the request MAC
//! says who asks. The crypto is rustls with *ring*, set per config (no process-wide default).

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Why TLS could not be set up from the configured files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or held nothing of the kind wanted.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// rustls refused the certificates or key.
    #[error("TLS: {0}")]
    Rustls(#[from] rustls::Error),
    /// The name to verify members' certificates against is not a DNS name or IP address.
    #[error("{0:?} is not a name a certificate can be issued for")]
    Name(String),
}

/// The TLS side of the peer listener: this node's certificate chain and key.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let chain = certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| file_error(key, e))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The TLS side of the asker: the CA members' certificates must chain to, and the name they
/// must be issued for.
#[derive(Clone)]
pub struct Connector {
    connector: TlsConnector,
    name: ServerName<'static>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// Trusts the certificates in `ca` (PEM) for members' certificates issued for `name`.
    pub fn new(ca: &Path, name: &str) -> Result<Self, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for certificate in certificates(ca)? {
            roots.add(certificate)?;
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::try_from(name.to_owned()).map_err(|_| TlsError::Name(name.to_owned()))?;
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
            name,
        })
    }

    /// Runs the handshake on `stream`, verifying the member's certificate.
    pub async fn connect(&self, stream: TcpStream) -> io::Result<TlsStream<TcpStream>> {
        self.connector.connect(self.name.clone(), stream).await
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in the PEM file `path`; at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if chain.is_empty() {
        return Err(TlsError::File {
            path: path.display().to_string(),
            reason: "no certificate in the file".into(),
        });
    }
    Ok(chain)
}

fn file_error(path: &Path, error: rustls::pki_types::pem::Error) -> TlsError {
    TlsError::File {
        path: path.display().to_string(),
        reason: error.to_string(),
    }
}
