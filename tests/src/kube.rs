//! Kubernetes stand-ins for tests: the manifests of `deploy/kubernetes` read as JSON values,
//! and [`ApiServer`], an HTTP server on loopback that answers the Node merge patches of the
//! API server and records them.
//!
//! YAML is read by the Python of `bench/.venv` (PyYAML comes with `kubernetes-validate`, which
//! `scripts/test` installs there), so the workspace needs no YAML crate.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The repository's `deploy/kubernetes` directory.
pub fn manifest_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// The venv's bin directory, where `scripts/test` installs `kubernetes-validate`.
pub fn venv_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/bin")
}

/// Every `.yaml` file under `dir` (sorted) but kustomize's own `kustomization.yaml` files,
/// with its documents as JSON values.
pub fn manifests(dir: &Path) -> anyhow::Result<Vec<(PathBuf, Vec<serde_json::Value>)>> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") && !path.ends_with("kustomization.yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
    let script = "import json, sys, yaml\n\
                  print(json.dumps([list(yaml.safe_load_all(open(f))) for f in sys.argv[1:]]))";
    let output = Command::new(venv_bin().join("python3"))
        .args(["-c", script])
        .args(&files)
        .output()
        .context("running the venv's python3 (scripts/test creates bench/.venv)")?;
    if !output.status.success() {
        bail!(
            "reading the manifests: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let documents: Vec<Vec<serde_json::Value>> = serde_json::from_slice(&output.stdout)?;
    Ok(files.into_iter().zip(documents).collect())
}

/// The documents of the YAML stream `text`, as JSON values.
pub fn yaml_documents(text: &[u8]) -> anyhow::Result<Vec<serde_json::Value>> {
    let script = "import json, sys, yaml\n\
                  print(json.dumps(list(yaml.safe_load_all(sys.stdin))))";
    let mut python = Command::new(venv_bin().join("python3"))
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running the venv's python3 (scripts/test creates bench/.venv)")?;
    let mut stdin = python.stdin.take().context("no stdin pipe")?;
    let text = text.to_vec();
    // Written from a thread of its own, so that a long stream cannot fill both pipes.
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &text));
    let output = python.wait_with_output()?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("the writer panicked"))??;
    if !output.status.success() {
        bail!("reading YAML: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// One request the [`ApiServer`] received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    /// The method.
    pub method: String,
    /// The path.
    pub path: String,
    /// The `Content-Type` header.
    pub content_type: String,
    /// The `Authorization` header.
    pub authorization: String,
    /// The body, as JSON.
    pub body: serde_json::Value,
}

impl Patch {
    /// The value the patch gives `label`: `Some(Some(v))` sets it, `Some(None)` removes it,
    /// `None` when the patch does not name it.
    pub fn label(&self, label: &str) -> Option<Option<String>> {
        let value = self.body.get("metadata")?.get("labels")?.get(label)?;
        Some(value.as_str().map(str::to_owned))
    }
}

/// An HTTP server on a loopback port that answers every request 200 with `{}` (as the API
/// server answers a Node patch, give or take the Node) and records it. It can be stopped and
/// started again on the same port, to play an API server that goes away and comes back.
/// Every answer closes its connection, so a client cannot keep talking to a stopped server.
#[derive(Debug)]
pub struct ApiServer {
    /// Where it listens.
    pub address: SocketAddr,
    patches: Arc<Mutex<Vec<Patch>>>,
    task: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts a server on a free port of 127.0.0.1.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let patches = Arc::new(Mutex::new(Vec::new()));
        let task = Some(tokio::spawn(serve(listener, patches.clone())));
        Ok(Self {
            address,
            patches,
            task,
        })
    }

    /// The URL a client is given.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Stops listening: connections are refused until [`ApiServer::resume`].
    pub fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }

    /// Listens again on the same port.
    pub async fn resume(&mut self) -> anyhow::Result<()> {
        self.stop();
        // The aborted task drops its listener when it is next polled.
        let started = Instant::now();
        let listener = loop {
            match TcpListener::bind(self.address).await {
                Ok(listener) => break listener,
                Err(e) if started.elapsed() > Duration::from_secs(5) => return Err(e.into()),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        self.task = Some(tokio::spawn(serve(listener, self.patches.clone())));
        Ok(())
    }

    /// Every request received so far, oldest first.
    pub fn patches(&self) -> Vec<Patch> {
        self.patches.lock().clone()
    }

    /// Waits at most `within` until a request satisfies `done`; returns the requests received
    /// until then.
    pub async fn wait_for(
        &self,
        within: Duration,
        done: impl Fn(&[Patch]) -> bool,
    ) -> anyhow::Result<Vec<Patch>> {
        let started = Instant::now();
        loop {
            let patches = self.patches();
            if done(&patches) {
                return Ok(patches);
            }
            if started.elapsed() > within {
                bail!("not seen within {within:?}; received: {patches:#?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(listener: TcpListener, patches: Arc<Mutex<Vec<Patch>>>) {
    while let Ok((stream, _)) = listener.accept().await {
        let patches = patches.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let patches = patches.clone();
                async move {
                    let header = |name: &str| {
                        request
                            .headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned()
                    };
                    let (method, path) = (request.method().to_string(), request.uri().path().to_owned());
                    let (content_type, authorization) = (header("content-type"), header("authorization"));
                    let body = request.into_body().collect().await?.to_bytes();
                    patches.lock().push(Patch {
                        method,
                        path,
                        content_type,
                        authorization,
                        body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
                    });
                    let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                    *response.status_mut() = StatusCode::OK;
                    Ok::<_, hyper::Error>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
