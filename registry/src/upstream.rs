//! An upstream registry: the pull requests of the OCI distribution API, with the token flow.
//!
//! A request goes out with the token last given for its repository's pull scope, if any. A
//! `401` with a `Bearer` challenge gets a token from the realm it names (with the registry's
//! Basic credentials from the credentials file if the realm is on the registry's own host or
//! one of `registry.token_hosts`, anonymously otherwise) and the request is sent once
//! more; a `Basic` challenge is answered with the credentials. Tokens are kept until they
//! expire (`expires_in`, 60 s when not given) and never logged.
//!
//! [`UpstreamStore`] serves blob and manifest GETs as a [`ReadStore`], the origin's seam for
//! reading, so that the cache fills them through a read-only [`Origin`](larder_origin::Origin)
//! like any object: same retries, deadlines, single-flight and counters. It implements nothing
//! else: an upstream is never listed or written, and its origin says so if asked.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use larder_origin::ReadStore;
use larder_stats::{OriginStats, add};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResult, GetResultPayload, ObjectMeta};
use parking_lot::Mutex;
use reqwest::header::{
    ACCEPT, AUTHORIZATION, CONTENT_LENGTH, HeaderMap, HeaderValue, LINK, RANGE, WWW_AUTHENTICATE,
};
use reqwest::{Method, Response, StatusCode};
use url::Url;

use super::reference::Digest;

/// How long one request to an upstream may take to answer (its body has the origin's
/// deadlines).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a token lives when the token service does not say.
const DEFAULT_TOKEN_LIFE: Duration = Duration::from_secs(60);

/// How long Basic credentials are sent for a scope without a new challenge.
const BASIC_LIFE: Duration = Duration::from_secs(24 * 3600);

/// The largest manifest or index served: OCI registries refuse to store larger ones.
pub const MAX_IMAGE_MANIFEST_BYTES: u64 = 4 << 20;

/// The largest token answer read.
const MAX_TOKEN_BYTES: usize = 64 << 10;

/// The largest tag list passed on (a page of it: clients ask with `n` for more).
const MAX_TAGS_BYTES: usize = 4 << 20;

/// A page of a repository's tags, as the upstream sent it.
#[derive(Debug, Clone)]
pub struct TagsPage {
    /// The JSON body (`{"name": ..., "tags": [...]}`).
    pub body: Bytes,
    /// The `Link` header to the next page, if any.
    pub link: Option<String>,
}

/// Why an upstream request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    /// The registry answered with an error status.
    #[error("registry {host} answered {status} for {what}")]
    Status {
        /// The registry.
        host: String,
        /// What was asked.
        what: String,
        /// Its status.
        status: StatusCode,
    },
    /// The registry could not be reached, or its answer was cut.
    #[error("registry {host} could not be reached for {what}: {reason}")]
    Unreachable {
        /// The registry.
        host: String,
        /// What was asked.
        what: String,
        /// The transport's error.
        reason: String,
    },
    /// The answer lacks what the protocol requires, or is too large.
    #[error("registry {host} gave a bad answer for {what}: {reason}")]
    BadAnswer {
        /// The registry.
        host: String,
        /// What was asked.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl UpstreamError {
    /// Whether the registry said the thing does not exist (as opposed to not answering).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Status { status, .. } if *status == StatusCode::NOT_FOUND)
    }
}

/// A manifest as a registry describes it (what `HEAD /v2/<name>/manifests/<reference>` says),
/// or as the mirror last knew it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    /// Its digest.
    pub digest: Digest,
    /// Its media type.
    pub media_type: String,
    /// Its size in bytes.
    pub size: u64,
}

/// A token and when it stops being good.
struct Token {
    header: HeaderValue,
    until: Instant,
}

/// One configured upstream registry.
pub struct Upstream {
    host: String,
    base: Url,
    http: reqwest::Client,
    /// `Basic <base64 user:password>`, from the credentials file.
    basic: Option<HeaderValue>,
    /// Tokens by scope.
    tokens: Mutex<HashMap<String, Token>>,
    /// Hosts of token services other than its own that may be sent `basic`.
    token_hosts: Arc<[String]>,
    /// Whether a realm was refused the credentials yet (said once).
    withheld: AtomicBool,
    /// Where its HEADs and their failures are counted, as origin requests (its GETs are
    /// counted by the [`larder_origin::Origin`] over its [`UpstreamStore`]).
    stats: Arc<OriginStats>,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("host", &self.host)
            .field("base", &self.base.as_str())
            .field("credentials", &self.basic.is_some())
            .finish_non_exhaustive()
    }
}

/// Why an upstream's client cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// reqwest cannot build a client (its TLS backend).
    #[error("registry {host}: cannot build its HTTP client: {source}")]
    Client {
        /// The upstream's name.
        host: String,
        /// reqwest's error.
        source: reqwest::Error,
    },
    /// Its credentials cannot be a header value.
    #[error("registry {0}: its credentials are not base64")]
    Credentials(String),
}

impl Upstream {
    /// The registry named `host` in image references, reached at `base`; `auth` is the
    /// base64 `user:password` of its credentials, if any, which are sent to token services on
    /// its own host and on `token_hosts` only. Its HEADs count in `stats`.
    pub fn new(
        host: &str,
        base: Url,
        auth: Option<&str>,
        token_hosts: Arc<[String]>,
        stats: Arc<OriginStats>,
    ) -> Result<Self, SetupError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|source| SetupError::Client {
                host: host.to_owned(),
                source,
            })?;
        let basic = match auth {
            Some(auth) => {
                // The header as sent, so that a server's echo of it never shows.
                larder_config::hide_secret(auth);
                let mut value = HeaderValue::from_str(&format!("Basic {auth}"))
                    .map_err(|_| SetupError::Credentials(host.to_owned()))?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        Ok(Self {
            host: host.to_owned(),
            base,
            http,
            basic,
            tokens: Mutex::new(HashMap::new()),
            token_hosts,
            withheld: AtomicBool::new(false),
            stats,
        })
    }

    /// Counts one request on `requests` (the origin's HEADs or GETs) and, if it failed, its
    /// failure by kind, as the origin's requests are.
    fn counted<T>(&self, requests: &AtomicU64, result: Result<T, UpstreamError>) -> Result<T, UpstreamError> {
        let stats = &self.stats;
        add(requests, 1);
        if let Err(error) = &result {
            let counter = match error {
                UpstreamError::Status { status, .. } => match status.as_u16() {
                    404 => &stats.origin_errors_not_found,
                    401 | 403 => &stats.origin_errors_permission,
                    408 | 429 | 500.. => &stats.origin_errors_transient,
                    _ => &stats.origin_errors_other,
                },
                UpstreamError::Unreachable { .. } => &stats.origin_errors_transient,
                UpstreamError::BadAnswer { .. } => &stats.origin_errors_other,
            };
            add(counter, 1);
        }
        result
    }

    /// Its name in image references.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Where it is reached.
    pub fn base(&self) -> &Url {
        &self.base
    }

    fn unreachable(&self, what: &str, error: &reqwest::Error) -> UpstreamError {
        UpstreamError::Unreachable {
            host: self.host.clone(),
            what: what.to_owned(),
            reason: chain(error),
        }
    }

    /// `response` to a request for `what`, if its status is a success; else the error naming it.
    fn succeeded(&self, what: &str, response: Response) -> Result<Response, UpstreamError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        Err(UpstreamError::Status {
            host: self.host.clone(),
            what: what.to_owned(),
            status,
        })
    }

    fn bad_answer(&self, what: &str, reason: impl Into<String>) -> UpstreamError {
        UpstreamError::BadAnswer {
            host: self.host.clone(),
            what: what.to_owned(),
            reason: reason.into(),
        }
    }

    /// Sends `method` for `/v2/<repository>/<path>` with `headers`, through the token flow.
    /// Any status is returned but a `401` the credentials cannot answer.
    pub async fn send(
        &self,
        method: Method,
        repository: &str,
        path: &str,
        headers: HeaderMap,
    ) -> Result<Response, UpstreamError> {
        let what = format!("{repository}/{path}");
        let url = self
            .base
            .join(&format!("/v2/{repository}/{path}"))
            .map_err(|e| self.bad_answer(&what, e.to_string()))?;
        let scope = format!("repository:{repository}:pull");
        let mut challenged = false;
        loop {
            let mut request = self
                .http
                .request(method.clone(), url.clone())
                .headers(headers.clone());
            if let Some(auth) = self.authorization(&scope) {
                request = request.header(AUTHORIZATION, auth);
            }
            let response = request.send().await.map_err(|e| self.unreachable(&what, &e))?;
            if response.status() != StatusCode::UNAUTHORIZED || challenged {
                return Ok(response);
            }
            challenged = true;
            let challenge = response
                .headers()
                .get(WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .map(Challenge::parse);
            match challenge {
                Some(Challenge::Bearer { realm, service }) => {
                    self.fetch_token(&realm, service.as_deref(), &scope).await?;
                }
                Some(Challenge::Basic) if self.basic.is_some() => {
                    if let Some(basic) = &self.basic {
                        self.remember(&scope, basic.clone(), BASIC_LIFE);
                    }
                }
                _ => return Ok(response),
            }
        }
    }

    /// The `Authorization` header to send for `scope`, if a live one is known.
    fn authorization(&self, scope: &str) -> Option<HeaderValue> {
        let tokens = self.tokens.lock();
        tokens
            .get(scope)
            .filter(|token| token.until > Instant::now())
            .map(|token| token.header.clone())
    }

    fn remember(&self, scope: &str, mut header: HeaderValue, life: Duration) {
        header.set_sensitive(true);
        let until = Instant::now().checked_add(life).unwrap_or_else(Instant::now);
        let mut tokens = self.tokens.lock();
        tokens.retain(|_, token| token.until > Instant::now());
        tokens.insert(scope.to_owned(), Token { header, until });
    }

    /// Asks the token service at `realm` for a pull token of `scope`.
    async fn fetch_token(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: &str,
    ) -> Result<(), UpstreamError> {
        let what = format!("a token for {scope}");
        let mut url =
            Url::parse(realm).map_err(|_| self.bad_answer(&what, format!("realm {realm:?} is not a URL")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(self.bad_answer(&what, format!("realm {realm:?} is not http(s)")));
        }
        {
            let mut query = url.query_pairs_mut();
            if let Some(service) = service {
                query.append_pair("service", service);
            }
            query.append_pair("scope", scope);
        }
        let trusted = url.host_str().is_some_and(|host| {
            Some(host) == self.base.host_str() || self.token_hosts.iter().any(|h| h == host)
        });
        let mut request = self.http.get(url.clone());
        match &self.basic {
            Some(basic) if trusted => request = request.header(AUTHORIZATION, basic.clone()),
            Some(_) if !self.withheld.swap(true, Ordering::Relaxed) => tracing::warn!(
                registry = %self.host,
                realm = %url.origin().ascii_serialization(),
                "the registry's token service is on another host, not in registry.token_hosts: \
                 asking it for an anonymous token, without the registry's credentials (said once)"
            ),
            _ => {}
        }
        let response = request.send().await.map_err(|e| self.unreachable(&what, &e))?;
        let response = self.succeeded(&what, response)?;
        let body = read_at_most(response, MAX_TOKEN_BYTES)
            .await
            .map_err(|e| self.unreachable(&what, &e))?
            .ok_or_else(|| self.bad_answer(&what, "the answer is too large"))?;
        #[derive(serde::Deserialize)]
        struct Answer {
            token: Option<String>,
            access_token: Option<String>,
            expires_in: Option<u64>,
        }
        let answer: Answer = serde_json::from_slice(&body)
            .map_err(|e| self.bad_answer(&what, format!("not a token answer: {e}")))?;
        let token = answer
            .token
            .or(answer.access_token)
            .ok_or_else(|| self.bad_answer(&what, "no token in the answer"))?;
        let header = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| self.bad_answer(&what, "the token is not a header value"))?;
        let life = answer.expires_in.map_or(DEFAULT_TOKEN_LIFE, Duration::from_secs);
        // A little early, so that a token never expires in flight.
        self.remember(
            scope,
            header,
            life.saturating_sub(Duration::from_secs(5))
                .max(Duration::from_secs(1)),
        );
        Ok(())
    }

    /// What `reference` (a tag or digest) of `repository` names: its digest, media type and
    /// size, asked with `HEAD` and the `accept`ed manifest types.
    pub async fn describe_manifest(
        &self,
        repository: &str,
        reference: &str,
        accept: &str,
    ) -> Result<Described, UpstreamError> {
        let result = self.head_manifest(repository, reference, accept).await;
        self.counted(&self.stats.origin_head_requests, result)
    }

    async fn head_manifest(
        &self,
        repository: &str,
        reference: &str,
        accept: &str,
    ) -> Result<Described, UpstreamError> {
        let path = format!("manifests/{reference}");
        let what = format!("{repository}/{path}");
        let mut headers = HeaderMap::new();
        headers.insert(
            ACCEPT,
            HeaderValue::from_str(accept).map_err(|_| self.bad_answer(&what, "bad Accept"))?,
        );
        let response = self.send(Method::HEAD, repository, &path, headers).await?;
        let response = self.succeeded(&what, response)?;
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
        let digest = header("docker-content-digest")
            .ok_or_else(|| self.bad_answer(&what, "no Docker-Content-Digest"))?
            .parse::<Digest>()
            .map_err(|e| self.bad_answer(&what, e.to_string()))?;
        let media_type = header("content-type")
            .map(|t| t.split(';').next().unwrap_or(t).trim().to_owned())
            .ok_or_else(|| self.bad_answer(&what, "no Content-Type"))?;
        let size =
            content_length(response.headers()).ok_or_else(|| self.bad_answer(&what, "no Content-Length"))?;
        if size > MAX_IMAGE_MANIFEST_BYTES {
            return Err(self.bad_answer(
                &what,
                format!("a manifest of {size} bytes is larger than the {MAX_IMAGE_MANIFEST_BYTES} served"),
            ));
        }
        if let Ok(named) = reference.parse::<Digest>()
            && named != digest
        {
            return Err(self.bad_answer(&what, format!("it says its digest is {digest}")));
        }
        Ok(Described {
            digest,
            media_type,
            size,
        })
    }

    /// The size of blob `digest` of `repository`, asked with `HEAD`.
    pub async fn blob_size(&self, repository: &str, digest: &Digest) -> Result<u64, UpstreamError> {
        let result = self.head_blob(repository, digest).await;
        self.counted(&self.stats.origin_head_requests, result)
    }

    /// A page of `repository`'s tags, `query` (`n`, `last`) passed on as the client gave it.
    pub async fn tags(&self, repository: &str, query: Option<&str>) -> Result<TagsPage, UpstreamError> {
        let result = self.get_tags(repository, query).await;
        self.counted(&self.stats.origin_get_requests, result)
    }

    async fn get_tags(&self, repository: &str, query: Option<&str>) -> Result<TagsPage, UpstreamError> {
        let path = match query {
            Some(query) => format!("tags/list?{query}"),
            None => "tags/list".to_owned(),
        };
        let what = format!("{repository}/tags/list");
        let response = self
            .send(Method::GET, repository, &path, HeaderMap::new())
            .await?;
        let response = self.succeeded(&what, response)?;
        let link = response
            .headers()
            .get(LINK)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = read_at_most(response, MAX_TAGS_BYTES)
            .await
            .map_err(|e| self.unreachable(&what, &e))?
            .ok_or_else(|| self.bad_answer(&what, "a page of tags over 4 MiB"))?;
        Ok(TagsPage {
            body: body.into(),
            link,
        })
    }

    async fn head_blob(&self, repository: &str, digest: &Digest) -> Result<u64, UpstreamError> {
        let path = format!("blobs/{digest}");
        let what = format!("{repository}/{path}");
        let response = self
            .send(Method::HEAD, repository, &path, HeaderMap::new())
            .await?;
        let response = self.succeeded(&what, response)?;
        content_length(response.headers()).ok_or_else(|| self.bad_answer(&what, "no Content-Length"))
    }
}

/// An error and its sources, as one line: reqwest's own text says only that a request failed.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The `Content-Length` of an answer.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The body of `response`, or `None` if it is longer than `max`.
async fn read_at_most(response: Response, max: usize) -> Result<Option<Vec<u8>>, reqwest::Error> {
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if body.len() + chunk.len() > max {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// A `WWW-Authenticate` challenge.
#[derive(Debug, PartialEq, Eq)]
enum Challenge {
    /// Get a token from `realm` for `service`.
    Bearer { realm: String, service: Option<String> },
    /// Send Basic credentials.
    Basic,
    /// Something else.
    Other,
}

impl Challenge {
    /// Parses `Bearer realm="...",service="...",scope="..."` or `Basic realm="..."`.
    fn parse(text: &str) -> Self {
        let (scheme, params) = text.trim().split_once(' ').unwrap_or((text.trim(), ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return Self::Basic;
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Self::Other;
        }
        let mut realm = None;
        let mut service = None;
        for param in split_params(params) {
            if let Some((name, value)) = param.split_once('=') {
                let value = value.trim().trim_matches('"').to_owned();
                match name.trim().to_ascii_lowercase().as_str() {
                    "realm" => realm = Some(value),
                    "service" => service = Some(value),
                    _ => {}
                }
            }
        }
        match realm {
            Some(realm) => Self::Bearer { realm, service },
            None => Self::Other,
        }
    }
}

/// The comma-separated parameters of a challenge, commas inside quotes kept.
fn split_params(text: &str) -> Vec<&str> {
    let mut params = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (at, c) in text.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                params.push(&text[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    params.push(&text[start..]);
    params
}

/// Blob and manifest GETs of an upstream as a [`ReadStore`]: location
/// `<repository>/blobs/<digest>` or `<repository>/manifests/<digest>`. Reading is all an
/// upstream does for the cache: it is never written, listed or deleted.
#[derive(Debug)]
pub struct UpstreamStore {
    upstream: Arc<Upstream>,
}

impl UpstreamStore {
    /// The store over `upstream`.
    pub fn new(upstream: Arc<Upstream>) -> Self {
        Self { upstream }
    }
}

/// Where a location of an [`UpstreamStore`] splits: repository, and `blobs/<digest>` or
/// `manifests/<digest>`.
fn split_location(location: &str) -> Option<(&str, &str)> {
    for kind in ["/blobs/", "/manifests/"] {
        if let Some(at) = location.rfind(kind) {
            return Some((&location[..at], &location[at + 1..]));
        }
    }
    None
}

#[async_trait]
impl ReadStore for UpstreamStore {
    async fn get_opts(&self, location: &Path, options: GetOptions) -> object_store::Result<GetResult> {
        let path = location.to_string();
        let generic = |message: String| object_store::Error::Generic {
            store: "registry",
            source: message.into(),
        };
        let (repository, rest) = split_location(&path)
            .ok_or_else(|| generic(format!("{path}: not a blob or manifest location")))?;
        let mut headers = HeaderMap::new();
        let range = match options.range {
            Some(GetRange::Bounded(range)) => Some(range),
            None => None,
            Some(other) => return Err(generic(format!("{path}: range {other} is not served"))),
        };
        if let Some(range) = &range {
            let value = format!("bytes={}-{}", range.start, range.end.saturating_sub(1));
            headers.insert(
                RANGE,
                HeaderValue::from_str(&value).map_err(|e| generic(e.to_string()))?,
            );
        }
        if rest.starts_with("manifests/") {
            headers.insert(ACCEPT, HeaderValue::from_static(MANIFEST_ACCEPT));
        }
        let response = self
            .upstream
            .send(Method::GET, repository, rest, headers)
            .await
            .map_err(|e| generic(e.to_string()))?;
        let status = response.status();
        match status {
            StatusCode::OK | StatusCode::PARTIAL_CONTENT => {}
            StatusCode::NOT_FOUND => {
                return Err(object_store::Error::NotFound {
                    path,
                    source: format!("registry {} answered 404", self.upstream.host).into(),
                });
            }
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(object_store::Error::PermissionDenied {
                    path,
                    source: format!("registry {} answered {status}", self.upstream.host).into(),
                });
            }
            status => {
                return Err(generic(format!(
                    "registry {} answered {status}",
                    self.upstream.host
                )));
            }
        }
        let length = content_length(response.headers());
        // A registry that ignores Range answers 200 with the whole body: skip to the start.
        let skip = match (&range, status) {
            (Some(range), StatusCode::OK) => range.start,
            _ => 0,
        };
        let returned: Range<u64> = match &range {
            Some(range) => range.clone(),
            None => 0..length.unwrap_or(0),
        };
        let size = match status {
            StatusCode::OK => length.unwrap_or(returned.end),
            _ => returned.end,
        };
        let stream = skip_bytes(response.bytes_stream(), skip);
        Ok(GetResult {
            payload: GetResultPayload::Stream(stream),
            meta: ObjectMeta {
                location: location.clone(),
                last_modified: Default::default(),
                size,
                e_tag: None,
                version: None,
            },
            range: returned,
            attributes: Default::default(),
            extensions: Default::default(),
        })
    }
}

/// The `Accept` header of a manifest GET: every type served.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json";

/// `stream` without its first `skip` bytes, its errors as the store's.
fn skip_bytes(
    stream: impl futures::Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
    skip: u64,
) -> BoxStream<'static, object_store::Result<Bytes>> {
    let mut left = skip;
    stream
        .filter_map(move |chunk| {
            let item = match chunk {
                Err(e) => Some(Err(object_store::Error::Generic {
                    store: "registry",
                    source: Box::new(e.without_url()),
                })),
                Ok(chunk) if left >= chunk.len() as u64 => {
                    left -= chunk.len() as u64;
                    None
                }
                Ok(chunk) => {
                    let chunk = chunk.slice(left as usize..);
                    left = 0;
                    Some(Ok(chunk))
                }
            };
            futures::future::ready(item)
        })
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse_with_quoted_commas() {
        assert_eq!(
            Challenge::parse(
                r#"Bearer realm="https://auth.example/token",service="reg,istry",scope="repository:a:pull""#
            ),
            Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("reg,istry".into()),
            }
        );
        assert_eq!(Challenge::parse(r#"Basic realm="Registry""#), Challenge::Basic);
        assert_eq!(Challenge::parse("Bearer service=x"), Challenge::Other);
        assert_eq!(Challenge::parse("Negotiate"), Challenge::Other);
    }

    #[test]
    fn locations_split_at_the_last_kind() {
        assert_eq!(
            split_location("library/blobs/x/blobs/sha256:ab"),
            Some(("library/blobs/x", "blobs/sha256:ab"))
        );
        assert_eq!(
            split_location("a/b/manifests/sha256:ab"),
            Some(("a/b", "manifests/sha256:ab"))
        );
        assert_eq!(split_location("a/b/c"), None);
    }
}
