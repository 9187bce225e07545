//! A small client of the Kubernetes API server, with only what warm-node labels need: a JSON
//! merge patch (RFC 7386) of one label of one Node, `PATCH /api/v1/nodes/{name}`.
//!
//! It authenticates with the pod's service-account token, read from its file for every request
//! (the kubelet rotates bound tokens), and trusts only the CA certificates of the configured file
//! (the pod's `ca.crt`), never the system's roots or a proxy from the environment. The API
//! server's URL is the configured one or, by default, the one every pod is given in
//! `KUBERNETES_SERVICE_HOST` and `KUBERNETES_SERVICE_PORT`. The token never appears in errors or
//! logs: only the token file's path does.
//!
//! This is a few dozen lines over the HTTP client the daemon already has (reqwest: hyper and
//! rustls) instead of `kube` and `k8s-openapi`, which would add minutes to every build for one
//! request.

use std::path::{Path, PathBuf};
use std::time::Duration;

use larder_config::WarmConfig;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use url::Url;

/// How long a request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest error body kept from the API server's answer.
const MAX_ERROR_BODY: usize = 512;

/// Why the client cannot be built or a patch failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No API server is configured and the pod's variables do not name one.
    #[error(
        "no Kubernetes API server: set warm.api_server, or run in a pod (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT)"
    )]
    NoServer,
    /// The API server's URL is not one.
    #[error("Kubernetes API server URL {url:?}: {reason}")]
    BadServer {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The CA file cannot be read or holds no certificate.
    #[error("CA certificates {path} (warm.ca_file): {reason}")]
    Ca {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The HTTP client cannot be built.
    #[error("building the Kubernetes API client: {0}")]
    Client(#[source] reqwest::Error),
    /// The token file cannot be read.
    #[error("service-account token {path} (warm.token_file): {source}")]
    Token {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The request did not get an answer.
    #[error("PATCH of node {node}: {source}")]
    Request {
        /// The node.
        node: String,
        /// What went wrong.
        source: reqwest::Error,
    },
    /// The API server refused the patch.
    #[error("PATCH of node {node}: the API server answered {status}: {body}")]
    Refused {
        /// The node.
        node: String,
        /// The answer's status.
        status: reqwest::StatusCode,
        /// The start of the answer's body (a Kubernetes `Status`).
        body: String,
    },
}

/// Patches the labels of one Node.
#[derive(Debug, Clone)]
pub struct NodeClient {
    http: reqwest::Client,
    url: Url,
    node: String,
    token_file: PathBuf,
}

impl NodeClient {
    /// A client of the API server `config` names (or the pod's) for the Node named `node`.
    pub fn new(config: &WarmConfig, node: &str) -> Result<Self, KubeError> {
        let server = match &config.api_server {
            Some(url) => url.clone(),
            None => in_cluster_server(
                std::env::var("KUBERNETES_SERVICE_HOST").ok(),
                std::env::var("KUBERNETES_SERVICE_PORT").ok(),
            )?,
        };
        let bad = |reason: &str| KubeError::BadServer {
            url: server.clone(),
            reason: reason.to_owned(),
        };
        let base = Url::parse(&server).map_err(|e| bad(&e.to_string()))?;
        let mut url = base.clone();
        url.path_segments_mut()
            .map_err(|()| bad("cannot be a base URL"))?
            .pop_if_empty()
            .extend(["api", "v1", "nodes", node]);
        // The ring provider, as for the origins' clients; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT / 3);
        match base.scheme() {
            "https" => builder = builder.tls_certs_only(ca_certificates(&config.ca_file)?),
            "http" => tracing::warn!(
                server = %base,
                "the Kubernetes API server is reached over plain HTTP: the service-account token travels in clear"
            ),
            _ => return Err(bad("expected http:// or https://")),
        }
        let http = builder.build().map_err(KubeError::Client)?;
        Ok(Self {
            http,
            url,
            node: node.to_owned(),
            token_file: config.token_file.clone(),
        })
    }

    /// The Node this client patches.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Sets label `key` to `value`, or removes it when `value` is `None` (a merge patch setting
    /// it to null, which also succeeds when the label is not there).
    pub async fn set_label(&self, key: &str, value: Option<&str>) -> Result<(), KubeError> {
        let token = std::fs::read_to_string(&self.token_file).map_err(|source| KubeError::Token {
            path: self.token_file.clone(),
            source,
        })?;
        let mut bearer =
            HeaderValue::from_str(&format!("Bearer {}", token.trim())).map_err(|_| KubeError::Token {
                path: self.token_file.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not a token"),
            })?;
        bearer.set_sensitive(true);
        let body = serde_json::json!({ "metadata": { "labels": { key: value } } });
        let response = self
            .http
            .patch(self.url.clone())
            .header(AUTHORIZATION, bearer)
            .header(CONTENT_TYPE, "application/merge-patch+json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|source| KubeError::Request {
                node: self.node.clone(),
                source: source.without_url(),
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        let mut end = text.len().min(MAX_ERROR_BODY);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        Err(KubeError::Refused {
            node: self.node.clone(),
            status,
            body: text[..end].to_owned(),
        })
    }
}

/// The API server's URL from the variables Kubernetes gives every pod.
fn in_cluster_server(host: Option<String>, port: Option<String>) -> Result<String, KubeError> {
    let (Some(host), Some(port)) = (host, port) else {
        return Err(KubeError::NoServer);
    };
    if host.contains(':') {
        Ok(format!("https://[{host}]:{port}"))
    } else {
        Ok(format!("https://{host}:{port}"))
    }
}

/// Every certificate of the PEM file at `path`.
fn ca_certificates(path: &Path) -> Result<Vec<reqwest::Certificate>, KubeError> {
    let problem = |reason: String| KubeError::Ca {
        path: path.to_owned(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| problem(e.to_string()))?;
    let certificates = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| problem(e.to_string()))?;
    if certificates.is_empty() {
        return Err(problem("no certificate in it".into()));
    }
    Ok(certificates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_in_cluster_server_comes_from_the_pod_variables() {
        let server = |host: Option<&str>, port: Option<&str>| {
            in_cluster_server(host.map(Into::into), port.map(Into::into))
        };
        assert_eq!(
            server(Some("10.96.0.1"), Some("443")).unwrap(),
            "https://10.96.0.1:443"
        );
        assert_eq!(
            server(Some("fd00::1"), Some("443")).unwrap(),
            "https://[fd00::1]:443"
        );
        assert!(matches!(server(None, Some("443")), Err(KubeError::NoServer)));
    }

    #[test]
    fn the_node_path_is_built_from_segments() {
        let config = WarmConfig {
            api_server: Some("http://127.0.0.1:8080/".into()),
            ..WarmConfig::default()
        };
        let client = NodeClient::new(&config, "gpu-017").unwrap();
        assert_eq!(client.url.as_str(), "http://127.0.0.1:8080/api/v1/nodes/gpu-017");
        let config = WarmConfig {
            api_server: Some("https://10.0.0.1:6443".into()),
            ca_file: "/nonexistent/ca.crt".into(),
            ..WarmConfig::default()
        };
        let error = NodeClient::new(&config, "n").unwrap_err().to_string();
        assert!(error.contains("/nonexistent/ca.crt (warm.ca_file)"), "{error}");
    }
}
