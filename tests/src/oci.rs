//! The real components of the OCI registry mirror's end-to-end tests: a registry, a
//! multi-platform test image, a pusher and containerd as the client that pulls.
//!
//! - [`Registry`] runs the CNCF distribution registry (Debian's `docker-registry`) on loopback,
//!   over plain HTTP, optionally behind htpasswd Basic auth or token auth (a token server of its
//!   own, on loopback too, signs the JWTs the registry takes).
//! - [`TestImage`] writes an OCI image layout: an image index of a linux/amd64 and a
//!   linux/arm64 image, each with its own config and uncompressed tar layers of seeded bytes,
//!   with every digest and size kept for the tests to check.
//! - [`push`] copies such a layout into a registry with `skopeo`, digests unchanged;
//!   [`write_auth_file`] writes a registry's credentials into a Docker `config.json`.
//! - [`Containerd`] runs `containerd` with its own root, state and socket, and pulls with `ctr`.
//! - [`hosts_dir`] writes the `hosts.toml` that makes containerd ask a mirror before the
//!   registry itself.
//!
//! A counting and tampering proxy in front of a registry is [`RecordingProxy::start_to`]
//! (the registry's [`Registry::address`]):
//! - the bytes sent for blobs are `proxy.body_bytes_of(is_blob_get)` (see [`is_blob_get`]);
//! - `proxy.set_fault(Fault::FlipByte(64 << 10))` flips a byte in every body longer than
//!   64 KiB, which in a [`TestImage`] with layers larger than that means the layer blobs only (its
//!   manifests, index and configs are a few hundred bytes);
//! - `proxy.set_fault(Fault::CloseConnections)` is an upstream that is down: connections are
//!   taken and closed unanswered. Dropping the proxy frees its port, so connections are refused.
//!
//! `scripts/test` installs `docker-registry`, `skopeo`, `containerd` (with `ctr`) and
//! `htpasswd` (apache2-utils). Everything runs as the test's own child processes, with its
//! files in temporary directories; nothing is written under `/etc` or `/var`.
//!
//! [`RecordingProxy::start_to`]: crate::RecordingProxy::start_to

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use parking_lot::Mutex;
use serde_json::json;
use sha2::{Digest, Sha256};
use tempfile::TempDir;

use crate::ServedRequest;

/// Media type of an OCI image index.
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// Media type of an OCI image manifest.
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// Media type of an OCI image config.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// Media type of an uncompressed tar layer.
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";

/// The platforms of a [`TestImage`], in the order of its index.
pub const PLATFORMS: [&str; 2] = ["linux/amd64", "linux/arm64"];

/// Layers of each platform's image.
const LAYERS: usize = 4;

/// How long a `skopeo` or `ctr` command may take before it is killed.
const COMMAND_DEADLINE: Duration = Duration::from_secs(180);

/// Whether `request` fetches a blob (a layer or a config) from a registry:
/// `GET /v2/<name>/blobs/<digest>`.
pub fn is_blob_get(request: &ServedRequest) -> bool {
    request.method == "GET" && request.path.starts_with("/v2/") && request.path.contains("/blobs/")
}

/// Runs `command` to its end, killed after [`COMMAND_DEADLINE`] so a test never hangs on it.
fn run(command: &mut Command) -> anyhow::Result<Output> {
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {shown}"))?;
    // Read both pipes on their own threads so a chatty child never blocks on a full pipe.
    let mut stdout = child.stdout.take().context("no stdout pipe")?;
    let mut stderr = child.stderr.take().context("no stderr pipe")?;
    let out = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stdout.read_to_end(&mut bytes);
        bytes
    });
    let err = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stderr.read_to_end(&mut bytes);
        bytes
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > COMMAND_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{shown} did not finish within {COMMAND_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let joined = |thread: std::thread::JoinHandle<Vec<u8>>| thread.join().unwrap_or_default();
    Ok(Output {
        status,
        stdout: joined(out),
        stderr: joined(err),
    })
}

/// What `output` said, for an error message.
fn said(output: &Output) -> String {
    format!(
        "{}; stdout: {} stderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout).trim(),
        String::from_utf8_lossy(&output.stderr).trim()
    )
}

/// Sends SIGTERM to `child`, waits up to `grace` for it to exit, then kills it.
fn stop(child: &mut Child, grace: Duration) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on our own child's PID, which `wait` has not reaped yet.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let asked = Instant::now();
    while matches!(child.try_wait(), Ok(None)) && asked.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of the file at `path`, joined by " | ".
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let last: Vec<&str> = text.lines().rev().take(lines).collect();
    last.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// The status code of `GET path` on the HTTP server at `address`, asked without credentials.
pub fn http_status(address: &str, path: &str) -> std::io::Result<u16> {
    http_get(address, path, &[]).map(|(status, _, _)| status)
}

/// `GET path` on the HTTP server at `address` with `headers`, on a connection of its own: the
/// status code, the head (status line and headers) and the body, as text.
pub fn http_get(
    address: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, String, String)> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other("not an HTTP status line"))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok((status, head.to_owned(), body.to_owned()))
}

/// How a [`Registry`] checks who asks.
#[derive(Debug, Clone, Copy)]
enum Auth<'a> {
    /// Everyone may push and pull.
    Anyone,
    /// htpasswd Basic auth with this user and password.
    Htpasswd(&'a str, &'a str),
    /// Token auth with a [`TokenServer`] of this user (anyone when `None`), on this address,
    /// whose tokens the registry takes for this many seconds.
    Token(Option<(&'a str, &'a str)>, Ipv4Addr, u64),
}

/// A running `docker-registry serve` on `127.0.0.1:<free port>` with filesystem storage in a
/// temporary directory; killed (by its PID) and its files removed when dropped.
#[derive(Debug)]
pub struct Registry {
    child: Child,
    address: String,
    /// The token service of a registry with token auth.
    tokens: Option<TokenServer>,
    dir: TempDir,
}

impl Registry {
    /// Starts a registry anyone may push to and pull from.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with_auth(Auth::Anyone)
    }

    /// Starts a registry that answers only requests with the Basic credentials `user` and
    /// `password` (an htpasswd file with the password's bcrypt hash, made by `htpasswd -B`).
    pub fn start_with_htpasswd(user: &str, password: &str) -> anyhow::Result<Self> {
        Self::start_with_auth(Auth::Htpasswd(user, password))
    }

    /// Starts a registry with token auth: it answers requests without a token `401` with a
    /// `Bearer` challenge naming its own token server, which gives pull and push tokens for any
    /// repository to anyone, or only to `user` (user and password, as Basic credentials).
    pub fn start_with_token_auth(user: Option<(&str, &str)>) -> anyhow::Result<Self> {
        Self::start_with_auth(Auth::Token(user, Ipv4Addr::LOCALHOST, TOKEN_LIFE))
    }

    /// As [`Registry::start_with_token_auth`], with the token server on `address` (another
    /// host than the registry's 127.0.0.1, such as 127.0.0.2).
    pub fn start_with_token_auth_at(user: Option<(&str, &str)>, address: Ipv4Addr) -> anyhow::Result<Self> {
        Self::start_with_auth(Auth::Token(user, address, TOKEN_LIFE))
    }

    /// As [`Registry::start_with_token_auth`], with tokens that last `life` (what the token
    /// server says, `expires_in`, and their `exp`; the registry itself allows a minute past
    /// it): a client must ask for a new token when its own expires.
    pub fn start_with_short_tokens(life: Duration) -> anyhow::Result<Self> {
        Self::start_with_auth(Auth::Token(None, Ipv4Addr::LOCALHOST, life.as_secs().max(1)))
    }

    /// Starts the registry with `auth`. Its port is free when chosen but not held until the
    /// registry binds it, so a registry that exits before serving is started again on another
    /// port, three times at most.
    fn start_with_auth(auth: Auth<'_>) -> anyhow::Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::start_once(auth)? {
                Ok(registry) => return Ok(registry),
                Err(exited) if attempt < 3 => {
                    eprintln!("{exited}; starting it again on another port");
                    attempt += 1;
                }
                Err(exited) => bail!(exited),
            }
        }
    }

    /// One start: the registry, or why it exited before serving.
    fn start_once(auth: Auth<'_>) -> anyhow::Result<Result<Self, String>> {
        let dir = tempfile::Builder::new().prefix("larder-registry").tempdir()?;
        let port = crate::free_port(Ipv4Addr::LOCALHOST)?;
        let address = format!("127.0.0.1:{port}");
        let mut config = json!({
            "version": "0.1",
            "log": { "level": "info", "accesslog": { "disabled": false } },
            "storage": {
                "filesystem": { "rootdirectory": dir.path().join("storage") },
                "delete": { "enabled": true },
            },
            "http": { "addr": address, "secret": "larder-test-registry" },
        });
        let mut tokens = None;
        match auth {
            Auth::Anyone => {}
            Auth::Htpasswd(user, password) => {
                let hashed = run(Command::new("htpasswd").args(["-B", "-b", "-n", user, password]))?;
                ensure!(hashed.status.success(), "htpasswd: {}", said(&hashed));
                let htpasswd = dir.path().join("htpasswd");
                std::fs::write(&htpasswd, &hashed.stdout)?;
                config["auth"] = json!({ "htpasswd": { "realm": "larder-test", "path": htpasswd } });
            }
            Auth::Token(user, address, life) => {
                let server = TokenServer::start(dir.path(), user, address, life)?;
                config["auth"] = json!({ "token": {
                    "realm": server.realm(),
                    "service": TOKEN_SERVICE,
                    "issuer": TOKEN_ISSUER,
                    "rootcertbundle": server.certificate_path(),
                } });
                tokens = Some(server);
            }
        }
        // YAML is a superset of JSON: the registry reads this as its config.yml.
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        let log = dir.path().join("registry.log");
        let log_file = File::create(&log)?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .context("starting docker-registry")?;
        let mut registry = Self {
            child,
            address,
            tokens,
            dir,
        };
        let started = Instant::now();
        // Without credentials a registry with auth answers 401: it is serving all the same.
        while !matches!(http_status(&registry.address, "/v2/"), Ok(200 | 401)) {
            if let Some(status) = registry.child.try_wait()? {
                return Ok(Err(format!(
                    "docker-registry exited ({status}) before serving on {}; its log ends: {}",
                    registry.address,
                    tail(&log, 5)
                )));
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "docker-registry did not serve within 30s; its log ends: {}",
                    tail(&log, 5)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Ok(registry))
    }

    /// `127.0.0.1:<port>`: the registry's name in image references.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The end of the registry's log (its last `lines` lines), for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.dir.path().join("registry.log"), lines)
    }

    /// Bytes of blob bodies the registry has sent so far, from its own access log: a count
    /// taken outside anything under test and off the data path (no proxy's copying).
    pub fn blob_bytes_sent(&self) -> anyhow::Result<u64> {
        let log = std::fs::read_to_string(self.dir.path().join("registry.log"))?;
        Ok(log.lines().filter_map(blob_get_bytes).sum())
    }

    /// Mounts blob `digest` of repository `from` into repository `to` (the distribution API's
    /// cross-repository mount: no bytes are sent).
    pub fn mount_blob(&self, digest: &str, from: &str, to: &str) -> anyhow::Result<()> {
        let target = format!("/v2/{to}/blobs/uploads/?mount={digest}&from={from}");
        let (status, body) = crate::http1::request(&self.address, "POST", &target, &[], b"")?;
        ensure!(status == 201, "mounting {digest} into {to}: {status} {body}");
        Ok(())
    }

    /// Pushes the OCI image manifest `manifest` as `repository:tag` (the registry checks that
    /// the blobs it names are in the repository, not their sizes).
    pub fn put_manifest(
        &self,
        repository: &str,
        tag: &str,
        manifest: &serde_json::Value,
    ) -> anyhow::Result<()> {
        let target = format!("/v2/{repository}/manifests/{tag}");
        let headers = [format!("Content-Type: {MANIFEST_MEDIA_TYPE}")];
        let body = serde_json::to_vec(manifest)?;
        let (status, answer) = crate::http1::request(&self.address, "PUT", &target, &headers, &body)?;
        ensure!(status == 201, "pushing {repository}:{tag}: {status} {answer}");
        Ok(())
    }

    /// Every token its token server has given so far, oldest first (none without token auth).
    pub fn tokens_issued(&self) -> Vec<String> {
        self.tokens.as_ref().map(TokenServer::issued).unwrap_or_default()
    }

    /// Token requests its token server took as an OAuth2 `POST` (0 without token auth).
    pub fn token_posts(&self) -> u64 {
        self.tokens
            .as_ref()
            .map_or(0, |tokens| tokens.issuer.posts.load(Ordering::SeqCst))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(5));
    }
}

/// The body bytes of an access-log line (`"GET /v2/<name>/blobs/<digest> HTTP/1.1" 200 1234
/// ...`) of a blob GET; `None` for any other line.
fn blob_get_bytes(line: &str) -> Option<u64> {
    let (_, request) = line.split_once("\"GET /v2/")?;
    let (path, answer) = request.split_once('"')?;
    if !path.contains("/blobs/") {
        return None;
    }
    answer.split_whitespace().nth(1)?.parse().ok()
}

/// The `issuer` of the tokens a [`TokenServer`] signs, which the registry trusts.
const TOKEN_ISSUER: &str = "larder-test-token-issuer";

/// The `service` of a registry with token auth: its challenge names it, and tokens are for it
/// (their audience).
const TOKEN_SERVICE: &str = "larder-test-registry";

/// How long a token is good for, in seconds (`expires_in` and the token's `exp`).
const TOKEN_LIFE: u64 = 300;

/// The token service of a registry with token auth (distribution's `auth: token`), on
/// `127.0.0.1:<free port>`: `GET /token?service=..&scope=repository:<name>:<actions>` is
/// answered with a JWT (RS256) granting every action asked on every repository asked, signed
/// with an RSA key made for it by `openssl`, whose self-signed certificate rides in the
/// token's `x5c` header and is the registry's `rootcertbundle`. It gives tokens to anyone, or
/// — when it has a user — only to requests with that user's Basic credentials (`401`
/// otherwise). Other methods (containerd tries an OAuth `POST` first when it has credentials)
/// are answered `405`. Each connection is served on a thread of its own and closed after one
/// answer; the server stops when dropped.
#[derive(Debug)]
struct TokenServer {
    address: String,
    issuer: Arc<TokenIssuer>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

/// What a [`TokenServer`] signs with and whom it serves.
#[derive(Debug)]
struct TokenIssuer {
    /// The PEM private key.
    key: PathBuf,
    /// The PEM certificate of the key.
    certificate: PathBuf,
    /// The certificate's DER in standard base64: the `x5c` of every token.
    x5c: String,
    /// The user tokens are given to, and the `Authorization` header that user sends; anyone
    /// gets tokens when `None`.
    user: Option<(String, String)>,
    /// Every token given, oldest first.
    issued: Mutex<Vec<String>>,
    /// Token requests that came as an OAuth2 `POST`.
    posts: AtomicU64,
    /// Seconds the tokens are good for (their `exp`, and the `expires_in` of the answer).
    life: u64,
}

impl TokenServer {
    /// Makes a key and its certificate in `dir` and starts serving tokens to `user` (anyone
    /// when `None`) on `address`, good for `life` seconds.
    fn start(dir: &Path, user: Option<(&str, &str)>, address: Ipv4Addr, life: u64) -> anyhow::Result<Self> {
        let key = dir.join("token-key.pem");
        let certificate = dir.join("token-cert.pem");
        let made = run(Command::new("openssl")
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"])
            .args(["-subj", "/CN=larder-test-token-issuer", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&certificate))?;
        ensure!(made.status.success(), "openssl req: {}", said(&made));
        // A PEM certificate is the base64 of its DER between its two armour lines.
        let pem = std::fs::read_to_string(&certificate)?;
        let x5c: String = pem.lines().filter(|line| !line.starts_with("-----")).collect();
        let issuer = Arc::new(TokenIssuer {
            key,
            certificate,
            x5c,
            user: user.map(|(name, password)| {
                let basic = format!("Basic {}", base64(format!("{name}:{password}").as_bytes(), true));
                (name.to_owned(), basic)
            }),
            issued: Mutex::new(Vec::new()),
            posts: AtomicU64::new(0),
            life,
        });
        let listener = TcpListener::bind((address, 0))?;
        let address = listener.local_addr()?.to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let (issuer, stop) = (Arc::clone(&issuer), Arc::clone(&stop));
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let issuer = Arc::clone(&issuer);
                    std::thread::spawn(move || {
                        if let Err(error) = issuer.serve(stream) {
                            eprintln!("token server: {error:#}");
                        }
                    });
                }
            })
        };
        Ok(Self {
            address,
            issuer,
            stop,
            accept: Some(accept),
        })
    }

    /// The URL of its token endpoint: the `realm` of the registry's challenges.
    fn realm(&self) -> String {
        format!("http://{}/token", self.address)
    }

    /// The file of the certificate its tokens chain to.
    fn certificate_path(&self) -> &Path {
        &self.issuer.certificate
    }

    /// Every token given so far, oldest first.
    fn issued(&self) -> Vec<String> {
        self.issuer.issued.lock().clone()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accepting thread, which then sees the stop.
        let _ = TcpStream::connect(&self.address);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

impl TokenIssuer {
    /// Reads one request from `stream` and answers it.
    fn serve(&self, stream: TcpStream) -> anyhow::Result<()> {
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let mut words = line.split_whitespace();
        let method = words.next().unwrap_or_default().to_owned();
        let target = words.next().unwrap_or_default().to_owned();
        let (mut authorization, mut length) = (None, 0);
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                match name.trim().to_ascii_lowercase().as_str() {
                    "authorization" => authorization = Some(value.trim().to_owned()),
                    "content-length" => length = value.trim().parse().unwrap_or(0),
                    _ => {}
                }
            }
        }
        // The body: a POST's form (containerd's OAuth2 request, when it has credentials).
        let mut form = Vec::new();
        reader.by_ref().take(length).read_to_end(&mut form)?;
        let (status, extra, body) = if method == "POST" {
            self.answer_form(&target, &String::from_utf8_lossy(&form))?
        } else {
            self.answer(&method, &target, authorization.as_deref())?
        };
        let mut stream = stream;
        write!(
            stream,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n{extra}\r\n",
            body.len()
        )?;
        stream.write_all(body.as_bytes())?;
        Ok(())
    }

    /// The answer to an OAuth2 token request (`POST /token` with a form, as containerd sends
    /// with credentials): `grant_type=password` with the user's name and password, the scopes
    /// in `scope`. Asked the same, in the form a GET's query and `Authorization` would carry.
    fn answer_form(&self, target: &str, form: &str) -> anyhow::Result<(&'static str, String, String)> {
        let field = |name: &str| {
            form.split('&')
                .find_map(|pair| pair.strip_prefix(&format!("{name}=")))
                .map(|value| percent_decoded(&value.replace('+', " ")))
        };
        self.posts.fetch_add(1, Ordering::SeqCst);
        let authorization = match (field("username"), field("password")) {
            (Some(user), Some(password)) => Some(format!(
                "Basic {}",
                base64(format!("{user}:{password}").as_bytes(), true)
            )),
            _ => None,
        };
        let scopes: Vec<String> = field("scope")
            .map(|scopes| scopes.split(' ').map(|s| format!("scope={s}")).collect())
            .unwrap_or_default();
        let path = target.split_once('?').map_or(target, |(path, _)| path);
        let target = format!("{path}?{}", scopes.join("&"));
        self.answer("GET", &target, authorization.as_deref())
    }

    /// The status line's status, any extra header lines, and the body that answer `method
    /// target` with `authorization`.
    fn answer(
        &self,
        method: &str,
        target: &str,
        authorization: Option<&str>,
    ) -> anyhow::Result<(&'static str, String, String)> {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        if path != "/token" {
            return Ok(("404 Not Found", String::new(), String::new()));
        }
        if method != "GET" {
            return Ok(("405 Method Not Allowed", String::new(), String::new()));
        }
        let subject = match &self.user {
            Some((name, basic)) if authorization == Some(basic.as_str()) => name.as_str(),
            Some(_) => {
                let refused = json!({ "errors": [{ "code": "UNAUTHORIZED", "message": "bad credentials" }] });
                return Ok((
                    "401 Unauthorized",
                    "WWW-Authenticate: Basic realm=\"larder-test-token\"\r\n".to_owned(),
                    refused.to_string(),
                ));
            }
            None => "",
        };
        // `scope=repository:<name>:<actions>`, as many as asked; a name may hold colons.
        let access: Vec<serde_json::Value> = query
            .split('&')
            .filter_map(|pair| pair.strip_prefix("scope="))
            .map(percent_decoded)
            .filter_map(|scope| {
                let (kind, rest) = scope.split_once(':')?;
                let (name, actions) = rest.rsplit_once(':')?;
                let actions: Vec<&str> = actions.split(',').collect();
                Some(json!({ "type": kind, "name": name, "actions": actions }))
            })
            .collect();
        let token = self.sign(subject, &access)?;
        let answer = json!({ "token": token, "access_token": token, "expires_in": self.life });
        self.issued.lock().push(token);
        Ok(("200 OK", String::new(), answer.to_string()))
    }

    /// A JWT for `subject` granting `access`, signed RS256 with the key (by `openssl dgst`).
    fn sign(&self, subject: &str, access: &[serde_json::Value]) -> anyhow::Result<String> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let serial = self.issued.lock().len();
        let header = json!({ "alg": "RS256", "typ": "JWT", "x5c": [self.x5c] });
        let claims = json!({
            "iss": TOKEN_ISSUER,
            "sub": subject,
            "aud": TOKEN_SERVICE,
            "exp": now + self.life,
            "nbf": now,
            "iat": now,
            "jti": format!("larder-test-{now}-{serial}"),
            "access": access,
        });
        let signed = format!(
            "{}.{}",
            base64(header.to_string().as_bytes(), false),
            base64(claims.to_string().as_bytes(), false)
        );
        let mut openssl = Command::new("openssl")
            .args(["dgst", "-sha256", "-sign"])
            .arg(&self.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting openssl dgst")?;
        // The input is far smaller than a pipe's buffer: written whole before the output is read.
        openssl
            .stdin
            .take()
            .context("no stdin pipe")?
            .write_all(signed.as_bytes())?;
        let output = openssl.wait_with_output()?;
        ensure!(output.status.success(), "openssl dgst: {}", said(&output));
        Ok(format!("{signed}.{}", base64(&output.stdout, false)))
    }
}

/// `bytes` in base64: the standard alphabet with padding when `standard`, else the URL-safe
/// alphabet without padding (JWTs).
fn base64(bytes: &[u8], standard: bool) -> String {
    let alphabet: &[u8; 64] = if standard {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    };
    let mut text = String::new();
    for chunk in bytes.chunks(3) {
        let group = chunk.iter().enumerate().fold(0u32, |group, (at, &byte)| {
            group | u32::from(byte) << (16 - 8 * at)
        });
        for sextet in 0..=chunk.len() {
            text.push(char::from(alphabet[(group >> (18 - 6 * sextet) & 63) as usize]));
        }
        if standard {
            text.push_str(&"=".repeat(3 - chunk.len()));
        }
    }
    text
}

/// `text` (a query value) with its `%XX` escapes and `+` decoded.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escaped = (bytes[at] == b'%')
            .then(|| bytes.get(at + 1..at + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok());
        match (bytes[at], escaped) {
            (_, Some(byte)) => {
                decoded.push(byte);
                at += 3;
            }
            (b'+', None) => {
                decoded.push(b' ');
                at += 1;
            }
            (byte, None) => {
                decoded.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

/// One content-addressed blob of an image: what an OCI descriptor says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    /// Its media type.
    pub media_type: &'static str,
    /// `sha256:<hex>` of its bytes.
    pub digest: String,
    /// Its length in bytes.
    pub size: u64,
}

impl Blob {
    /// The OCI descriptor of this blob, as manifests and indexes list it.
    fn descriptor(&self) -> serde_json::Value {
        json!({ "mediaType": self.media_type, "digest": self.digest, "size": self.size })
    }
}

/// The image of one platform in a [`TestImage`].
#[derive(Debug, Clone)]
pub struct PlatformImage {
    /// `os/architecture`, as `ctr --platform` takes it.
    pub platform: &'static str,
    /// The image manifest.
    pub manifest: Blob,
    /// The image config.
    pub config: Blob,
    /// The layers, bottom first.
    pub layers: Vec<Blob>,
}

impl PlatformImage {
    /// The digests of the manifest, the config and the layers: what a pull of this platform
    /// fetches besides the index.
    pub fn digests(&self) -> BTreeSet<String> {
        let blobs = [&self.manifest, &self.config].into_iter().chain(&self.layers);
        blobs.map(|blob| blob.digest.clone()).collect()
    }

    /// The bytes of all the layer blobs together (tar headers and padding included).
    pub fn layer_bytes(&self) -> u64 {
        self.layers.iter().map(|layer| layer.size).sum()
    }
}

/// A multi-platform image written as an OCI image layout directory (`oci-layout`,
/// `index.json`, `blobs/sha256/...`), removed when dropped. The layout's `index.json` names
/// the image index `latest`.
///
/// Each platform's image has `LAYERS` layers; each layer is an uncompressed tar holding one
/// file of seeded random bytes, so every byte and digest is a function of the seed.
#[derive(Debug)]
pub struct TestImage {
    dir: TempDir,
    /// The image index: what a tag of this image names.
    pub index: Blob,
    /// The image of each platform, in the order of [`PLATFORMS`].
    pub images: Vec<PlatformImage>,
}

impl TestImage {
    /// Writes the image of `seed` with about `layer_bytes` bytes of file content in the layers
    /// of each platform (so twice that in the whole image), split evenly between its layers.
    pub fn write(seed: u64, layer_bytes: u64) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("larder-image").tempdir()?;
        let blobs = dir.path().join("blobs/sha256");
        std::fs::create_dir_all(&blobs)?;
        let mut images = Vec::new();
        for platform in PLATFORMS {
            let (os, architecture) = platform.split_once('/').context("platform without a slash")?;
            let mut layers = Vec::new();
            for layer in 0..LAYERS {
                let share = layer_bytes / LAYERS as u64;
                let len = if layer + 1 == LAYERS {
                    layer_bytes - share * (LAYERS as u64 - 1)
                } else {
                    share
                };
                let name = format!("{os}-{architecture}-layer-{layer}.bin");
                let layer_seed = crate::seed(&name, seed);
                layers.push(write_layer(&blobs, &name, layer_seed, len)?);
            }
            let config = json!({
                "architecture": architecture,
                "os": os,
                "config": { "Labels": { "dev.larder.test.seed": seed.to_string() } },
                "rootfs": {
                    "type": "layers",
                    "diff_ids": layers.iter().map(|layer| &layer.digest).collect::<Vec<_>>(),
                },
            });
            let config = write_blob(&blobs, CONFIG_MEDIA_TYPE, &serde_json::to_vec(&config)?)?;
            let manifest = json!({
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA_TYPE,
                "config": config.descriptor(),
                "layers": layers.iter().map(Blob::descriptor).collect::<Vec<_>>(),
            });
            let manifest = write_blob(&blobs, MANIFEST_MEDIA_TYPE, &serde_json::to_vec(&manifest)?)?;
            images.push(PlatformImage {
                platform,
                manifest,
                config,
                layers,
            });
        }
        let manifests = images.iter().map(|image| {
            let (os, architecture) = image.platform.split_once('/').unwrap_or_default();
            let mut descriptor = image.manifest.descriptor();
            descriptor["platform"] = json!({ "architecture": architecture, "os": os });
            descriptor
        });
        let index = json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": manifests.collect::<Vec<_>>(),
        });
        let index = write_blob(&blobs, INDEX_MEDIA_TYPE, &serde_json::to_vec(&index)?)?;
        let mut top = index.descriptor();
        top["annotations"] = json!({ "org.opencontainers.image.ref.name": "latest" });
        let layout = json!({ "schemaVersion": 2, "manifests": [top] });
        std::fs::write(dir.path().join("index.json"), serde_json::to_vec(&layout)?)?;
        std::fs::write(
            dir.path().join("oci-layout"),
            br#"{"imageLayoutVersion":"1.0.0"}"#,
        )?;
        Ok(Self { dir, index, images })
    }

    /// The layout directory (`skopeo`'s `oci:<path>`).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The image of `platform` (`linux/amd64` or `linux/arm64`).
    pub fn image(&self, platform: &str) -> anyhow::Result<&PlatformImage> {
        self.images
            .iter()
            .find(|image| image.platform == platform)
            .with_context(|| format!("the test image has no {platform} image"))
    }

    /// What a pull of `platform` puts in a content store: the index and that platform's
    /// manifest, config and layers.
    pub fn pulled(&self, platform: &str) -> anyhow::Result<BTreeSet<String>> {
        let mut digests = self.image(platform)?.digests();
        digests.insert(self.index.digest.clone());
        Ok(digests)
    }

    /// The digests of every blob: the index and each platform's manifest, config and layers.
    pub fn digests(&self) -> BTreeSet<String> {
        let mut digests: BTreeSet<String> = self.images.iter().flat_map(PlatformImage::digests).collect();
        digests.insert(self.index.digest.clone());
        digests
    }
}

/// Writes `bytes` as a blob of `media_type` into `blobs` (a layout's `blobs/sha256`).
fn write_blob(blobs: &Path, media_type: &'static str, bytes: &[u8]) -> anyhow::Result<Blob> {
    let hex = hex::encode(Sha256::digest(bytes));
    std::fs::write(blobs.join(&hex), bytes)?;
    Ok(Blob {
        media_type,
        digest: format!("sha256:{hex}"),
        size: bytes.len() as u64,
    })
}

/// Writes a layer into `blobs`: an uncompressed tar of one file `name` holding `len` bytes of
/// the content of `seed`, streamed through the hash rather than held in memory.
fn write_layer(blobs: &Path, name: &str, seed: u64, len: u64) -> anyhow::Result<Blob> {
    let partial = blobs.join(format!("{name}.partial"));
    let mut out = BufWriter::new(File::create(&partial)?);
    let mut hash = Sha256::new();
    let mut size = 0;
    let mut put = |bytes: &[u8]| -> std::io::Result<()> {
        hash.update(bytes);
        size += bytes.len() as u64;
        out.write_all(bytes)
    };
    put(&tar_header(name, len)?)?;
    let mut offset = 0;
    while offset < len {
        let chunk = (len - offset).min(1 << 20);
        put(&crate::content(seed, offset, chunk as usize))?;
        offset += chunk;
    }
    // The file's last block is padded to 512 bytes; two zero blocks end the archive.
    let padding = (512 - len % 512) % 512;
    put(&vec![0; padding as usize + 1024])?;
    out.into_inner().map_err(|error| error.into_error())?.sync_all()?;
    let hex = hex::encode(hash.finalize());
    std::fs::rename(&partial, blobs.join(&hex))?;
    Ok(Blob {
        media_type: LAYER_MEDIA_TYPE,
        digest: format!("sha256:{hex}"),
        size,
    })
}

/// The 512-byte ustar header of a regular file `name` (under 100 bytes) of `size` bytes,
/// mode 0644, owned by root, dated 1970.
fn tar_header(name: &str, size: u64) -> anyhow::Result<[u8; 512]> {
    ensure!(name.len() < 100, "tar member name {name} is too long");
    ensure!(
        size < 8 << 30,
        "tar member of {size} bytes is too big for an octal size field"
    );
    let mut header = [0u8; 512];
    let mut field = |at: usize, value: &[u8]| header[at..at + value.len()].copy_from_slice(value);
    field(0, name.as_bytes());
    field(100, b"0000644\0");
    field(108, b"0000000\0");
    field(116, b"0000000\0");
    field(124, format!("{size:011o}\0").as_bytes());
    field(136, b"00000000000\0");
    // The checksum is summed with its own field as spaces.
    field(148, b"        ");
    field(156, b"0");
    field(257, b"ustar\0");
    field(263, b"00");
    field(265, b"root");
    field(297, b"root");
    let sum: u32 = header.iter().map(|&byte| u32::from(byte)).sum();
    header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    Ok(header)
}

/// A `skopeo` command to add arguments to. As root, skopeo keeps a blob-info cache in
/// /var/lib/containers, with no flag to move it: it runs in a mount namespace of its own with a
/// tmpfs on /var/lib, gone when it exits.
fn skopeo() -> Command {
    let mut skopeo = Command::new("unshare");
    skopeo
        .args(["--mount", "--propagation=private", "--", "sh", "-c"])
        .arg(r#"mount -t tmpfs -o size=16m larder-skopeo /var/lib && exec "$@""#)
        .args(["sh", "skopeo"]);
    skopeo
}

/// Copies `reference` (`repo:tag`, the platform `os/architecture`) from the registry at
/// `registry` (`host:port`, plain HTTP) into an OCI layout at `dest`: skopeo checks every
/// digest and size as it copies.
pub fn copy_out(registry: &str, reference: &str, platform: &str, dest: &Path) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, br#"{"default":[{"type":"insecureAcceptAnything"}]}"#)?;
    let (os, arch) = platform
        .split_once('/')
        .context("a platform is os/architecture")?;
    let mut copy = skopeo();
    copy.arg("--policy")
        .arg(&policy)
        .args(["--override-os", os, "--override-arch", arch])
        .args(["copy", "--src-tls-verify=false"])
        .arg(format!("docker://{registry}/{reference}"))
        .arg(format!("oci:{}", dest.display()));
    let output = run(&mut copy)?;
    ensure!(output.status.success(), "skopeo copy: {}", said(&output));
    Ok(())
}

/// What `skopeo inspect` says of `reference` (`repo:tag`) in the registry at `registry`
/// (`host:port`, plain HTTP): the image's manifest and config, and the repository's tags.
pub fn inspect(registry: &str, reference: &str) -> anyhow::Result<serde_json::Value> {
    let mut inspect = skopeo();
    inspect
        .args(["inspect", "--tls-verify=false"])
        .arg(format!("docker://{registry}/{reference}"));
    let output = run(&mut inspect)?;
    ensure!(output.status.success(), "skopeo inspect: {}", said(&output));
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// `podman` (the containers/image library CRI-O pulls with) with a storage of its own under a
/// temporary directory (`--root`, `--runroot`, the `vfs` driver: the host's is untouched) and
/// a `registries.conf` of its own.
#[derive(Debug)]
pub struct Podman {
    dir: TempDir,
}

impl Podman {
    /// A podman reading `registries_conf` (the text of a `registries.conf`).
    pub fn new(registries_conf: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("larder-podman").tempdir()?;
        std::fs::write(dir.path().join("registries.conf"), registries_conf)?;
        Ok(Self { dir })
    }

    /// Runs `podman args...`; its output, whatever its status.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<Output> {
        let root = self.dir.path();
        let mut podman = Command::new("podman");
        podman
            .env("CONTAINERS_REGISTRIES_CONF", root.join("registries.conf"))
            .arg("--root")
            .arg(root.join("storage"))
            .arg("--runroot")
            .arg(root.join("run"))
            .args(["--storage-driver", "vfs", "--events-backend", "none"])
            .args(args);
        run(&mut podman)
    }

    /// Runs `podman args...` and fails unless it succeeds; its standard output.
    pub fn run_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = self.run(args)?;
        ensure!(output.status.success(), "podman {args:?}: {}", said(&output));
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}

/// Writes the credentials `user` and `password` of the registry at `registry` (`host:port`)
/// into the Docker config file `path` (`{"auths": {"<registry>": {"auth": ...}}}`, what
/// `docker login` writes), with `skopeo login`, which checks them with the registry first.
pub fn write_auth_file(path: &Path, registry: &str, user: &str, password: &str) -> anyhow::Result<()> {
    let mut login = skopeo();
    login
        .args(["login", "--tls-verify=false", "--authfile"])
        .arg(path)
        .args(["--username", user, "--password", password, registry]);
    let output = run(&mut login)?;
    ensure!(output.status.success(), "skopeo login: {}", said(&output));
    Ok(())
}

/// Copies the OCI layout at `image` (a [`TestImage::path`]) into the registry at `registry`
/// (`host:port`, plain HTTP) as `reference` (`repo:tag`), every platform, with `skopeo copy
/// --all --preserve-digests`: the registry then holds the very blobs and digests of the layout.
/// `credentials` are the registry's user and password, if it asks for them.
pub fn push(
    image: &Path,
    registry: &str,
    reference: &str,
    credentials: Option<(&str, &str)>,
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, br#"{"default":[{"type":"insecureAcceptAnything"}]}"#)?;
    let mut skopeo = skopeo();
    skopeo.arg("--policy").arg(&policy).args([
        "copy",
        "--all",
        "--preserve-digests",
        "--dest-tls-verify=false",
    ]);
    if let Some((user, password)) = credentials {
        skopeo.arg(format!("--dest-creds={user}:{password}"));
    }
    skopeo
        .arg(format!("oci:{}", image.display()))
        .arg(format!("docker://{registry}/{reference}"));
    let output = run(&mut skopeo)?;
    ensure!(output.status.success(), "skopeo copy: {}", said(&output));
    Ok(())
}

/// Writes `dir/<registry_host>/hosts.toml`: containerd asks `mirror_url` first (to pull and
/// to resolve tags), then `upstream_url`, the registry itself. `registry_host` is the host of
/// the image references (`host` or `host:port`); both URLs are `http://host:port`.
pub fn hosts_dir(
    dir: &Path,
    registry_host: &str,
    mirror_url: &str,
    upstream_url: &str,
) -> anyhow::Result<()> {
    let host_dir = dir.join(registry_host);
    std::fs::create_dir_all(&host_dir)?;
    let toml = format!(
        "server = \"{upstream_url}\"\n\n[host.\"{mirror_url}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    );
    std::fs::write(host_dir.join("hosts.toml"), toml)?;
    Ok(())
}

/// A running `containerd` with its own config, root, state and socket in a temporary
/// directory (no CRI plugin), and `ctr` to drive it in namespace `larder`. Stopped (by its
/// PID) when dropped; the mounts it left under its directory are detached and the directory
/// removed.
#[derive(Debug)]
pub struct Containerd {
    child: Child,
    dir: TempDir,
    /// `overlayfs` where the kernel and file system allow it, `native` (plain copies) where not.
    snapshotter: String,
}

impl Containerd {
    /// Starts containerd and waits until `ctr version` reaches it.
    pub fn start() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("larder-containerd").tempdir()?;
        let path = |name: &str| dir.path().join(name).display().to_string();
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
            root = path("root"),
            state = path("state"),
            socket = path("containerd.sock"),
            opt = path("opt"),
        );
        std::fs::write(path("config.toml"), config)?;
        let log = File::create(path("containerd.log"))?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(path("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting containerd")?;
        let mut containerd = Self {
            child,
            dir,
            snapshotter: String::new(),
        };
        let started = Instant::now();
        while !containerd
            .ctr(&["version"])
            .is_ok_and(|output| output.status.success())
        {
            if let Some(status) = containerd.child.try_wait()? {
                bail!(
                    "containerd exited ({status}); its log ends: {}",
                    containerd.log_tail(5)
                );
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "containerd did not answer within 30s; its log ends: {}",
                    containerd.log_tail(5)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        containerd.snapshotter = if containerd.plugin_loaded("io.containerd.snapshotter.v1", "overlayfs")? {
            "overlayfs".to_owned()
        } else {
            "native".to_owned()
        };
        Ok(containerd)
    }

    /// The socket `ctr --address` takes.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// The snapshotter that pulls unpack into.
    pub fn snapshotter(&self) -> &str {
        &self.snapshotter
    }

    /// The end of containerd's log (its last `lines` lines), for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.dir.path().join("containerd.log"), lines)
    }

    /// Runs `ctr --address <socket> -n larder <args>`.
    pub fn ctr(&self, args: &[&str]) -> anyhow::Result<Output> {
        run(Command::new("ctr")
            .arg("--address")
            .arg(self.socket())
            .args(["-n", "larder"])
            .args(args))
    }

    /// Runs `ctr <args>` and returns its standard output, or fails with what it said.
    fn ctr_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = self.ctr(args)?;
        ensure!(
            output.status.success(),
            "ctr {}: {}",
            args.join(" "),
            said(&output)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Whether the plugin `id` of `kind` loaded (`ctr plugins ls` says `ok`).
    fn plugin_loaded(&self, kind: &str, id: &str) -> anyhow::Result<bool> {
        let plugins = self.ctr_ok(&["plugins", "ls"])?;
        Ok(plugins.lines().any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.first() == Some(&kind) && fields.get(1) == Some(&id) && fields.last() == Some(&"ok")
        }))
    }

    /// Pulls and unpacks `reference` with `ctr images pull --plain-http`: the registries of
    /// `hosts_dir` (see [`hosts_dir`]) when given, the reference's host over plain HTTP when
    /// not; the host's platform unless `platform` (`linux/arm64`) is given. The output is
    /// returned whether the pull succeeded or not.
    pub fn pull(
        &self,
        reference: &str,
        hosts_dir: Option<&Path>,
        platform: Option<&str>,
    ) -> anyhow::Result<Output> {
        self.pull_as(reference, hosts_dir, platform, None)
    }

    /// As [`Containerd::pull`], with the registry credentials `user` (`--user name:password`,
    /// as the kubelet hands containerd a pod's pull secret).
    pub fn pull_as(
        &self,
        reference: &str,
        hosts_dir: Option<&Path>,
        platform: Option<&str>,
        user: Option<(&str, &str)>,
    ) -> anyhow::Result<Output> {
        let mut args = vec![
            "images".to_owned(),
            "pull".to_owned(),
            "--plain-http".to_owned(),
            format!("--snapshotter={}", self.snapshotter),
        ];
        if let Some(dir) = hosts_dir {
            args.push(format!("--hosts-dir={}", dir.display()));
        }
        if let Some(platform) = platform {
            args.push(format!("--platform={platform}"));
        }
        if let Some((name, password)) = user {
            args.push(format!("--user={name}:{password}"));
        }
        args.push(reference.to_owned());
        self.ctr(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// The digests of every blob in the content store.
    pub fn content_digests(&self) -> anyhow::Result<BTreeSet<String>> {
        let listed = self.ctr_ok(&["content", "ls", "--quiet"])?;
        Ok(listed
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect())
    }

    /// The digest `reference` names in the image store (the index's, for a multi-platform
    /// image), or an error if it is not there.
    pub fn image_digest(&self, reference: &str) -> anyhow::Result<String> {
        // Columns: REF TYPE DIGEST SIZE PLATFORMS LABELS.
        let listed = self.ctr_ok(&["images", "ls"])?;
        listed
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|fields| fields.first() == Some(&reference))
            .and_then(|fields| fields.get(2).map(|digest| (*digest).to_owned()))
            .with_context(|| format!("no image {reference} in: {listed}"))
    }

    /// Removes every image, snapshot, blob and half-written blob (ingest), so that the next
    /// pull starts from nothing; fails if some content is left.
    pub fn remove_all(&self) -> anyhow::Result<()> {
        let images = self.ctr_ok(&["images", "ls", "--quiet"])?;
        let images: Vec<&str> = images.split_whitespace().collect();
        if !images.is_empty() {
            self.ctr_ok(&[&["images", "rm"], images.as_slice()].concat())?;
        }
        // Leases keep content (a killed pull's lease outlives it), and until the garbage
        // collection runs so do the ingests of a failed pull, which the next pull would resume
        // and commit as they are. Removing every lease with --sync runs the collection at
        // once; with no lease left, one made for the purpose does the same.
        let leases = self.ctr_ok(&["leases", "ls", "--quiet"])?;
        let mut leases: Vec<&str> = leases.split_whitespace().collect();
        if leases.is_empty() {
            self.ctr_ok(&["leases", "create", "--id=larder-reset"])?;
            leases.push("larder-reset");
        }
        self.ctr_ok(&[&["leases", "rm", "--sync"], leases.as_slice()].concat())?;
        let left = self.content_digests()?;
        ensure!(
            left.is_empty(),
            "content left after removing everything: {left:?}"
        );
        // Columns: REF SIZE AGE.
        let active = self.ctr_ok(&["content", "active"])?;
        ensure!(
            active.lines().nth(1).is_none(),
            "ingests left after removing everything: {active}"
        );
        Ok(())
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(10));
        // Mounts containerd left under its own directory (unpacks mount layers for a moment),
        // deepest first; nothing else is touched.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut mounts: Vec<PathBuf> = mountinfo
            .lines()
            .filter_map(|line| line.split(' ').nth(4).map(PathBuf::from))
            .filter(|mount| mount.starts_with(self.dir.path()))
            .collect();
        mounts.sort_by_key(|mount| std::cmp::Reverse(mount.components().count()));
        for mount in mounts {
            if let Ok(path) = std::ffi::CString::new(mount.as_os_str().as_encoded_bytes()) {
                // SAFETY: umount2(2) with a NUL-terminated path that outlives the call.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_pads_only_the_standard_alphabet() {
        let cases: [(&[u8], &str, &str); 4] = [
            (b"", "", ""),
            (b"f", "Zg==", "Zg"),
            (b"fo\xfb", "Zm/7", "Zm_7"),
            (
                b"larder:s3cret-pass!",
                "bGFyZGVyOnMzY3JldC1wYXNzIQ==",
                "bGFyZGVyOnMzY3JldC1wYXNzIQ",
            ),
        ];
        for (bytes, standard, url) in cases {
            assert_eq!(base64(bytes, true), standard);
            assert_eq!(base64(bytes, false), url);
        }
    }

    #[test]
    fn blob_bytes_come_from_blob_gets_of_the_access_log_only() {
        let log = [
            r#"127.0.0.1 - - [04/Dec/2026:19:18:23 +0000] "GET /v2/t/x/blobs/sha256:5f21 HTTP/1.1" 200 16 "" "curl/7.88.1""#,
            r#"127.0.0.1 - - [04/Dec/2026:19:18:23 +0000] "GET /v2/t/x/blobs/sha256:5f21 HTTP/1.1" 206 4 "" "curl/7.88.1""#,
            r#"127.0.0.1 - - [04/Dec/2026:19:18:23 +0000] "HEAD /v2/t/x/blobs/sha256:5f21 HTTP/1.1" 200 0 "" "curl""#,
            r#"127.0.0.1 - - [04/Dec/2026:19:18:23 +0000] "GET /v2/t/x/manifests/v1 HTTP/1.1" 200 500 "" "curl""#,
            r#"time="2026-12-04T19:18:23Z" level=info msg="response completed" http.request.uri="/v2/t/x/blobs/sha256:5f21" http.response.written=4"#,
        ];
        assert_eq!(log.into_iter().filter_map(blob_get_bytes).sum::<u64>(), 20);
    }

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(
            percent_decoded("repository%3Alarder%2Ftest%3Apull%2Cpush"),
            "repository:larder/test:pull,push"
        );
        assert_eq!(percent_decoded("a+b%2"), "a b%2");
    }
}
