//! The mirror's HTTP listener: `GET`/`HEAD` of `/v2/`, manifests and blobs, with `Range` on
//! blobs, a repository's tags (from the upstream, uncached), and errors in the distribution
//! API's shape (`{"errors":[{"code","message"}]}`) with its codes.
//!
//! A `GET` of content follows its check (`Mirror::follow`): the blocks of a whole object go
//! out as the check hashes them in order, all but the last, which waits for the SHA-256 to
//! match the digest, so content that does not never completes at the client (a range, and an
//! object of one block, wait for the verdict). The headers go once the first block can, once
//! the content is verified, or after [`HEADERS_WITHIN`]: what fails by then (an unknown blob,
//! an upstream down) gets its error status. A client that goes away stops waiting; once no request or
//! job waits for the content, its fetch stops (the parts in flight end, no more start).
//! Content larger than the cache's capacity is refused (`503`) before anything is fetched.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::{
    ACCEPT, ACCEPT_RANGES, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, HeaderValue, LINK, RANGE,
};
use hyper::{Method, Request, Response, StatusCode};
use larder_http::{self as http, Body, Limits};
use larder_read_path::OpenObject;
use larder_stats::add;
use tokio::sync::mpsc;

use super::reference::{Reference, Route, RouteError};
use super::upstream::UpstreamError;
use super::{Following, INDEX_TYPES, Mirror, MirrorError, Progress};

/// How long a `GET` waits for its content to be verified before its headers go out.
pub const HEADERS_WITHIN: Duration = Duration::from_secs(5);

/// The listener's limits. containerd on the node is one client with many connections (a
/// layer each, and more for ranges); the deadline covers the answer's head, not its body.
pub const LIMITS: Limits = Limits {
    max_connections: 256,
    max_per_client: 256,
    read_timeout: Duration::from_secs(10),
    request_deadline: Duration::from_secs(60),
    max_body: 0,
    // A puller sends its request as it connects: under a flood, each is answered or told to retry.
    fresh_grace: Duration::from_secs(1),
};

/// The version header every answer carries.
const API_VERSION: (&str, &str) = ("docker-distribution-api-version", "registry/2.0");

/// The mirror as an HTTP service.
pub fn service(mirror: Arc<Mirror>) -> impl http::Service {
    move |request: Request<Bytes>| answer(mirror.clone(), request)
}

async fn answer(mirror: Arc<Mirror>, request: Request<Bytes>) -> Response<Body> {
    let mut response = route(&mirror, &request).await;
    response
        .headers_mut()
        .insert(API_VERSION.0, HeaderValue::from_static(API_VERSION.1));
    response
}

async fn route(mirror: &Arc<Mirror>, request: &Request<Bytes>) -> Response<Body> {
    let head = match *request.method() {
        Method::GET => false,
        Method::HEAD => true,
        _ => {
            return failure(
                StatusCode::METHOD_NOT_ALLOWED,
                "UNSUPPORTED",
                "the mirror serves pulls only (GET and HEAD)",
            );
        }
    };
    let route = match Route::parse(request.uri().path()) {
        Ok(route) => route,
        Err(error) => {
            add(&mirror.stats.registry_refused, 1);
            let status = match error {
                RouteError::NotFound => StatusCode::NOT_FOUND,
                _ => StatusCode::BAD_REQUEST,
            };
            return failure(status, error.code(), &error.to_string());
        }
    };
    let parameter = |wanted: &str| {
        let query = request.uri().query()?;
        url::form_urlencoded::parse(query.as_bytes())
            .find(|(name, _)| name == wanted)
            .map(|(_, value)| value.into_owned())
    };
    let ns = parameter("ns");
    let result = match route {
        Route::Base => return http::full(StatusCode::OK, "application/json", "{}"),
        Route::Manifest { name, reference } => {
            add(&mirror.stats.registry_manifest_requests, 1);
            let indexes = takes_indexes(request.headers().get_all(ACCEPT));
            manifest(mirror, ns.as_deref(), &name, &reference, indexes, head).await
        }
        Route::Blob { name, digest } => {
            add(&mirror.stats.registry_blob_requests, 1);
            let range = request.headers().get(RANGE).and_then(|v| v.to_str().ok());
            blob(mirror, ns.as_deref(), &name, &digest, range, head).await
        }
        Route::Tags { name } => {
            let (n, last) = (parameter("n"), parameter("last"));
            tags(mirror, ns.as_deref(), &name, n.as_deref(), last.as_deref(), head).await
        }
    };
    result.unwrap_or_else(|(error, asked)| {
        if matches!(error, MirrorError::NotConfigured(_) | MirrorError::WhichRegistry) {
            add(&mirror.stats.registry_refused, 1);
        }
        mirror_failure(&error, asked)
    })
}

/// What a request asked for, for the code of its error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    Manifest,
    Blob,
    Tags,
}

type Answer = Result<Response<Body>, (MirrorError, Asked)>;

async fn tags(
    mirror: &Arc<Mirror>,
    ns: Option<&str>,
    name: &str,
    n: Option<&str>,
    last: Option<&str>,
    head: bool,
) -> Answer {
    let failed = |error| (error, Asked::Tags);
    let (registry, upstream_name) = mirror.registry_for(ns, name).map_err(failed)?;
    let page = mirror
        .tags(registry, name, upstream_name, n, last)
        .await
        .map_err(failed)?;
    let length = page.body.len();
    let body = if head { Bytes::new() } else { page.body };
    let mut response = http::full(StatusCode::OK, "application/json", body);
    let headers = response.headers_mut();
    headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
    if let Some(link) = page.link.and_then(|link| HeaderValue::from_str(&link).ok()) {
        headers.insert(LINK, link);
    }
    Ok(response)
}

/// Whether the `Accept` headers (a client may send several) take image indexes and manifest
/// lists: none at all, `*/*`, or one of their types.
fn takes_indexes(accept: hyper::header::GetAll<'_, HeaderValue>) -> bool {
    let mut items = accept
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|item| item.split(';').next().unwrap_or_default().trim())
        .peekable();
    items.peek().is_none() || items.any(|media| media == "*/*" || INDEX_TYPES.contains(&media))
}

async fn manifest(
    mirror: &Arc<Mirror>,
    ns: Option<&str>,
    name: &str,
    reference: &Reference,
    indexes: bool,
    head: bool,
) -> Answer {
    let failed = |error| (error, Asked::Manifest);
    let (registry, name) = mirror.registry_for(ns, name).map_err(failed)?;
    let resolved = mirror
        .resolve(registry, name, reference, indexes)
        .await
        .map_err(failed)?;
    let object = mirror
        .object(registry, name, &resolved.digest, resolved.size, true)
        .map_err(failed)?;
    let content_type = HeaderValue::from_str(&resolved.media_type)
        .unwrap_or_else(|_| HeaderValue::from_static("application/octet-stream"));
    content(
        mirror,
        object,
        &resolved.digest.to_string(),
        content_type,
        None,
        head,
    )
    .await
    .map_err(failed)
}

async fn blob(
    mirror: &Arc<Mirror>,
    ns: Option<&str>,
    name: &str,
    digest: &super::Digest,
    range: Option<&str>,
    head: bool,
) -> Answer {
    let failed = |error| (error, Asked::Blob);
    let (registry, name) = mirror.registry_for(ns, name).map_err(failed)?;
    let size = mirror.blob_size(registry, name, digest).await.map_err(failed)?;
    let range = match range.map(|text| parse_range(text, size)) {
        None => None,
        Some(Some(range)) => Some(range),
        Some(None) => {
            let mut response = failure(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "BLOB_UNKNOWN",
                "the range is not one range within the blob",
            );
            if let Ok(value) = HeaderValue::from_str(&format!("bytes */{size}")) {
                response.headers_mut().insert(CONTENT_RANGE, value);
            }
            return Ok(response);
        }
    };
    let object = mirror
        .object(registry, name, digest, size, false)
        .map_err(failed)?;
    let content_type = HeaderValue::from_static("application/octet-stream");
    content(mirror, object, &digest.to_string(), content_type, range, head)
        .await
        .map_err(failed)
}

/// A single `bytes=` range within `size` bytes, as start..end; `None` if it is not one.
fn parse_range(text: &str, size: u64) -> Option<std::ops::Range<u64>> {
    let spec = text.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (start, end) = spec.split_once('-')?;
    let range = match (start.trim(), end.trim()) {
        ("", suffix) => {
            let suffix: u64 = suffix.parse().ok()?;
            size.saturating_sub(suffix)..size
        }
        (start, "") => start.parse().ok()?..size,
        (start, end) => start.parse().ok()?..end.parse::<u64>().ok()?.saturating_add(1).min(size),
    };
    (range.start < range.end && range.start < size).then_some(range)
}

/// The answer for verified content `object`: headers, and (for a `GET`) its bytes, or those
/// of `range`.
async fn content(
    mirror: &Arc<Mirror>,
    object: Arc<OpenObject>,
    digest: &str,
    content_type: HeaderValue,
    range: Option<std::ops::Range<u64>>,
    head: bool,
) -> Result<Response<Body>, MirrorError> {
    let size = object.version().size;
    let status = if range.is_some() {
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    let range = range.unwrap_or(0..size);
    let mut response = if head {
        http::full(status, "application/octet-stream", Bytes::new())
    } else {
        // What fails at once gets its status; the headers go once a block can (the first of
        // content of several blocks, whole, is hashed), once the content is verified, or after
        // HEADERS_WITHIN whatever takes long.
        let mut following = mirror.follow(&object);
        let streams = range == (0..size) && size > mirror.cache.store().block_size();
        if let Following::UnderWay { result, progress, .. } = &mut following {
            let started = async {
                let first_block = async {
                    let hashed = progress
                        .wait_for(|p| p.early && !p.hashes.is_empty())
                        .await
                        .is_ok();
                    if !(hashed && streams) {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    verified = result.clone() => verified.map(drop),
                    () = first_block => Ok(()),
                }
            };
            if let Ok(Err(error)) = tokio::time::timeout(HEADERS_WITHIN, started).await {
                return Err(error);
            }
        }
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(send(mirror.clone(), object, range.clone(), tx, following));
        let mut response = Response::new(http::channel_body(rx));
        *response.status_mut() = status;
        response
    };
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, content_type);
    headers.insert(CONTENT_LENGTH, HeaderValue::from(range.end - range.start));
    headers.insert(ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Ok(value) = HeaderValue::from_str(digest) {
        headers.insert("docker-content-digest", value);
    }
    if status == StatusCode::PARTIAL_CONTENT
        && let Ok(value) = HeaderValue::from_str(&format!("bytes {}-{}/{size}", range.start, range.end - 1))
    {
        headers.insert(CONTENT_RANGE, value);
    }
    Ok(response)
}

/// Sends `range` of `object`, each block checked against the BLAKE3 it was hashed with, as
/// `following` allows: a block of the whole content as soon as the check has hashed it in
/// order, but the last only once the whole content matches its digest (so that content that
/// does not never completes at the client); a range only once the whole is verified. Stops
/// (cutting the answer short) on any failure, and when the client goes away.
async fn send(
    mirror: Arc<Mirror>,
    object: Arc<OpenObject>,
    range: std::ops::Range<u64>,
    tx: mpsc::Sender<Bytes>,
    following: Following,
) {
    let key = object.version().key.clone();
    let size = object.version().size;
    let block_size = mirror.cache.store().block_size();
    let whole = range == (0..size);
    let (mut hashes, mut under_way) = match following {
        Following::Verified(hashes) => (Some(hashes), None),
        Following::UnderWay {
            result,
            progress,
            pace,
            waiting,
        } => {
            // Only the whole content streams as it is hashed; a range waits for the verdict.
            let place = whole.then(|| pace.join());
            (None, Some((result, progress, place, waiting)))
        }
    };
    // The check's attempt the bytes sent so far came from.
    let mut sent_from = None;
    let mut at = range.start;
    while at < range.end {
        let index = (at / block_size) as u32;
        let holds_end = u64::from(index + 1) * block_size >= size;
        // The block's BLAKE3, and its bytes when the check hands over those it just hashed.
        let expected = match (&hashes, &mut under_way) {
            // The check that verified the content may still hold the block for its clients.
            (Some(hashes), under_way) => hashes.get(index as usize).map(|&hash| {
                let kept = under_way
                    .as_ref()
                    .and_then(|(_, progress, ..)| kept(&progress.borrow(), index));
                (hash, kept)
            }),
            (None, None) => None,
            (None, Some((result, progress, place, _))) => {
                if let Some(place) = place {
                    place.at(index);
                }
                let hashed = tokio::select! {
                    hashed = hashed_block(progress, index, whole && !holds_end) => Ok(hashed),
                    verified = result.clone() => Err(verified),
                    () = tx.closed() => {
                        tracing::debug!(%key, at, "the client went away before the content was verified");
                        return;
                    }
                };
                match hashed {
                    Ok(hashed) if sent_from.is_none_or(|from| from == hashed.attempt) => {
                        sent_from = Some(hashed.attempt);
                        Some((hashed.hash, hashed.bytes))
                    }
                    Ok(_) => None,
                    Err(Ok(verified)) => {
                        let attempt = progress.borrow().attempt;
                        if sent_from.is_some_and(|from| from != attempt) {
                            tracing::warn!(%key, "registry answer cut: the bytes sent were of an attempt that failed its digest");
                            return;
                        }
                        let kept = kept(&progress.borrow(), index);
                        let hash = verified.get(index as usize).map(|&hash| (hash, kept));
                        hashes = Some(verified);
                        hash
                    }
                    Err(Err(error)) => {
                        tracing::warn!(%key, %error, "registry answer cut: the content could not be verified");
                        return;
                    }
                }
            }
        };
        let block = match expected {
            None => {
                tracing::warn!(%key, index, "registry answer cut: the check started again after a mismatch");
                return;
            }
            Some((_, Some(hashed))) => hashed,
            Some((expected, None)) => match mirror.verified_block(&object, &expected, index).await {
                Some(block) => block,
                None => return,
            },
        };
        let start = (at - u64::from(index) * block_size) as usize;
        let end = (range.end - u64::from(index) * block_size).min(block.len() as u64) as usize;
        let chunk = block.slice(start..end);
        at += chunk.len() as u64;
        add(&mirror.stats.registry_sent_bytes, chunk.len() as u64);
        if tx.send(chunk).await.is_err() {
            tracing::debug!(%key, at, "the client went away");
            return;
        }
    }
}

/// Block `index` once the check has hashed it, if it may go before the whole content is
/// verified (`early`, and the attempt's blocks may); else never (the caller waits for the
/// result).
async fn hashed_block(
    progress: &mut tokio::sync::watch::Receiver<Progress>,
    index: u32,
    early: bool,
) -> Hashed {
    if early
        && let Ok(progress) = progress
            .wait_for(|p| p.early && p.hashes.len() > index as usize)
            .await
    {
        return Hashed {
            attempt: progress.attempt,
            hash: progress.hashes[index as usize],
            bytes: kept(&progress, index),
        };
    }
    std::future::pending().await
}

/// Block `index`'s bytes, if the check still keeps them for the clients streaming it.
fn kept(progress: &Progress, index: u32) -> Option<Bytes> {
    progress
        .recent
        .iter()
        .find(|(kept, _)| *kept == index)
        .map(|(_, bytes)| bytes.clone())
}

/// A block the check has hashed: in which attempt, its BLAKE3, and its bytes if the check
/// still holds them.
struct Hashed {
    attempt: u32,
    hash: [u8; 32],
    bytes: Option<Bytes>,
}

/// The distribution API's error answer.
fn failure(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "errors": [{ "code": code, "message": message }] }).to_string();
    http::full(status, "application/json", body)
}

/// The answer for a failed request for what was `asked`.
fn mirror_failure(error: &MirrorError, asked: Asked) -> Response<Body> {
    let unknown = match asked {
        Asked::Manifest => "MANIFEST_UNKNOWN",
        Asked::Blob => "BLOB_UNKNOWN",
        Asked::Tags => "NAME_UNKNOWN",
    };
    let invalid = match asked {
        Asked::Blob => "BLOB_UNKNOWN",
        Asked::Manifest | Asked::Tags => "MANIFEST_INVALID",
    };
    let (status, code) = match error {
        MirrorError::NotConfigured(_) => (StatusCode::FORBIDDEN, "DENIED"),
        MirrorError::WhichRegistry => (StatusCode::NOT_FOUND, "NAME_UNKNOWN"),
        MirrorError::Upstream(UpstreamError::Status { status, .. }) => match *status {
            StatusCode::NOT_FOUND => (StatusCode::NOT_FOUND, unknown),
            StatusCode::UNAUTHORIZED => (StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
            StatusCode::FORBIDDEN => (StatusCode::FORBIDDEN, "DENIED"),
            StatusCode::TOO_MANY_REQUESTS => (StatusCode::TOO_MANY_REQUESTS, "TOOMANYREQUESTS"),
            _ => (StatusCode::BAD_GATEWAY, "UNAVAILABLE"),
        },
        MirrorError::Upstream(UpstreamError::Unreachable { .. }) => {
            (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE")
        }
        MirrorError::Upstream(UpstreamError::BadAnswer { .. }) | MirrorError::Manifest { .. } => {
            (StatusCode::BAD_GATEWAY, invalid)
        }
        MirrorError::DigestMismatch(_) => (StatusCode::BAD_GATEWAY, "DIGEST_INVALID"),
        MirrorError::Fill { .. } | MirrorError::TooLarge { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE")
        }
    };
    tracing::debug!(%error, %status, "registry request failed");
    failure(status, code, &error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_single_and_within_the_blob() {
        assert_eq!(parse_range("bytes=0-9", 100), Some(0..10));
        assert_eq!(parse_range("bytes=90-", 100), Some(90..100));
        assert_eq!(parse_range("bytes=-10", 100), Some(90..100));
        assert_eq!(parse_range("bytes=50-500", 100), Some(50..100));
        for bad in [
            "bytes=100-",
            "bytes=5-1",
            "bytes=0-1,4-5",
            "items=0-1",
            "bytes=x-1",
        ] {
            assert_eq!(parse_range(bad, 100), None, "{bad}");
        }
    }

    #[test]
    fn accept_headers_that_take_indexes() {
        let takes = |values: &[&str]| {
            let mut headers = hyper::HeaderMap::new();
            for value in values {
                headers.append(ACCEPT, HeaderValue::from_str(value).unwrap());
            }
            takes_indexes(headers.get_all(ACCEPT))
        };
        assert!(takes(&[]));
        assert!(takes(&["*/*"]));
        assert!(takes(&[
            "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json"
        ]));
        assert!(takes(&[
            "application/vnd.docker.distribution.manifest.v2+json",
            "application/vnd.docker.distribution.manifest.list.v2+json"
        ]));
        assert!(!takes(&["application/vnd.docker.distribution.manifest.v2+json"]));
    }
}
