//! What an origin publishes about an object's bytes beyond the ETag that object_store's HEAD
//! returns, for the origin check of blocks from rack peers (see `cache::check`):
//!
//! - S3 keeps a **full-object CRC** (CRC64NVME, CRC32C or CRC32) when the uploader sent one, and
//!   returns it only to a HEAD with `x-amz-checksum-mode: ENABLED`. AWS SDKs send CRC64NVME by
//!   default since 2025, for single-part and multipart uploads alike. A multipart upload's
//!   `COMPOSITE` checksum (a CRC of the parts' CRCs) is not used: it needs every part's size.
//! - S3 answers `HEAD ?partNumber=1` with the **first part's size**, which makes a multipart
//!   ETag checkable without guessing (uploaders cut every part but the last to one size).
//! - GCS sends `x-goog-hash: crc32c=…,md5=…` with every object HEAD; a composite object has the
//!   CRC32C only (its ETag is not an MD5).
//! - Azure sends `Content-MD5` with a blob's properties where the blob has one: the service
//!   computes it for a blob uploaded in one request, and keeps what an uploader of blocks set.
//!   Azure's ETag says nothing of the bytes.
//!
//! object_store asks for none of these, so this sends its own HEAD to a URL presigned with the
//! origin's own credentials (or plain, to an emulator sent none) (object_store's [`Signer`], so the endpoint, addressing style and
//! signature are exactly the store's), with the extra query and header folded into the signature.
//! Anything that goes wrong leaves the check to the ETag: nothing here can fail a read.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use larder_object::crc::FullCrc;
use object_store::path::Path;
use object_store::signer::{HeaderName, HeaderValue, Method, SignedUrlOptions, Signer};
use reqwest::header::{CONTENT_LENGTH, ETAG, HeaderMap};

/// How long a presigned HEAD URL is valid: it is used at once.
const URL_LIFETIME: Duration = Duration::from_secs(60);

/// What the origin published about one object version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Published {
    /// The whole object's CRC, where the store keeps one.
    pub crc: Option<FullCrc>,
    /// A multipart upload's first part size, where the store says it.
    pub first_part: Option<u64>,
    /// The whole object's MD5, where the store publishes it apart from the ETag.
    pub md5: Option<[u8; 16]>,
}

/// Why the origin's published checksums could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PublishedError {
    /// The store could not presign the HEAD (no signing credentials, say).
    #[error("cannot presign a HEAD: {0}")]
    Presign(#[from] object_store::Error),
    /// The store's URL and the key make no URL.
    #[error("no URL for the HEAD: {0}")]
    Url(#[from] url::ParseError),
    /// The HEAD itself failed.
    #[error("HEAD failed: {0}")]
    Request(#[from] reqwest::Error),
    /// The HEAD was answered with an error status.
    #[error("HEAD answered {0}")]
    Status(reqwest::StatusCode),
    /// The object changed since its version was pinned.
    #[error("the object changed: its ETag is now {0}")]
    Changed(String),
}

/// Which store's conventions to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Convention {
    /// Amazon S3 and compatible stores.
    S3,
    /// Google Cloud Storage (XML API).
    Gcs,
    /// Azure Blob Storage.
    Azure,
}

/// How a HEAD's URL is made.
#[derive(Debug)]
pub enum Urls {
    /// Presigned with the origin's own credentials.
    Presigned(Arc<dyn Signer>),
    /// Under this base (the bucket's URL), unsigned: for a store that is sent no credentials
    /// (an emulator), whose signer would go looking for some.
    Unsigned(String),
}

/// Asks one origin store for what it publishes.
#[derive(Debug)]
pub struct PublishedChecksums {
    urls: Urls,
    convention: Convention,
    http: reqwest::Client,
}

impl PublishedChecksums {
    /// Asks at `urls`, with requests bounded by `timeout`.
    pub fn new(urls: Urls, convention: Convention, timeout: Duration) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()?;
        Ok(Self {
            urls,
            convention,
            http,
        })
    }

    /// What the store publishes about `location`, pinned at `etag`; `multipart` says whether
    /// its ETag is a multipart upload's (so that the first part's size is worth asking).
    pub async fn describe(
        &self,
        location: &Path,
        etag: Option<&str>,
        multipart: bool,
    ) -> Result<Published, PublishedError> {
        let headers = self.head(location, None, etag).await?;
        let (crc, md5) = match self.convention {
            Convention::S3 => (s3_full_crc(&headers), None),
            Convention::Gcs => (
                gcs_hash(&headers, "crc32c=").map(|crc| FullCrc::Crc32c(u32::from_be_bytes(crc))),
                gcs_hash(&headers, "md5="),
            ),
            Convention::Azure => (
                None,
                headers
                    .get("content-md5")
                    .and_then(|v| v.to_str().ok())
                    .and_then(base64_number::<16>),
            ),
        };
        // The multipart ETag is checked before the CRC (the stronger), so its part size is
        // asked whether or not a CRC is published.
        let first_part = if multipart && self.convention == Convention::S3 {
            let part = self.head(location, Some(1), etag).await?;
            part.get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
        } else {
            None
        };
        Ok(Published { crc, first_part, md5 })
    }

    /// A HEAD of `location` (of one part of it), its answer's headers; the ETag must still be
    /// `etag`.
    async fn head(
        &self,
        location: &Path,
        part: Option<u32>,
        etag: Option<&str>,
    ) -> Result<HeaderMap, PublishedError> {
        let mut options = SignedUrlOptions::default();
        let mut headers = HeaderMap::new();
        if self.convention == Convention::S3 {
            let mode = (
                HeaderName::from_static("x-amz-checksum-mode"),
                HeaderValue::from_static("ENABLED"),
            );
            options = options.with_signed_header(mode.0.clone(), mode.1.clone());
            headers.insert(mode.0, mode.1);
            if let Some(part) = part {
                options = options.with_query([("partNumber", part.to_string())]);
            }
        }
        // An Azure SAS grants permissions, not a method, and object_store grants none for a
        // HEAD: one for reading (GET) lets a HEAD read the blob's properties. S3's and GCS's
        // signatures cover the method itself.
        let method = match self.convention {
            Convention::Azure => Method::GET,
            Convention::S3 | Convention::Gcs => Method::HEAD,
        };
        let url = match &self.urls {
            Urls::Unsigned(base) => url::Url::parse(&format!("{base}/{location}"))?,
            Urls::Presigned(signer) if options.is_empty() => {
                signer.signed_url(method, location, URL_LIFETIME).await?
            }
            Urls::Presigned(signer) => {
                signer
                    .signed_url_opts(method, location, URL_LIFETIME, &options)
                    .await?
            }
        };
        let mut response = self.http.head(url).headers(headers).send().await?;
        if !response.status().is_success() {
            return Err(PublishedError::Status(response.status()));
        }
        let headers = std::mem::take(response.headers_mut());
        let now = headers.get(ETAG).and_then(|v| v.to_str().ok());
        if let (Some(pinned), Some(now)) = (etag, now)
            && !crate::same_entity_tag(pinned, now)
        {
            return Err(PublishedError::Changed(now.to_owned()));
        }
        Ok(headers)
    }
}

/// The big-endian number `N` bytes of base64 give, if they give exactly `N` bytes.
fn base64_number<const N: usize>(text: &str) -> Option<[u8; N]> {
    BASE64.decode(text.trim()).ok()?.try_into().ok()
}

/// The full-object CRC an S3 HEAD in checksum mode carries, if any. A `COMPOSITE` checksum (or
/// a value with a `-N` part count, which is one) is not a CRC of the object's bytes.
fn s3_full_crc(headers: &HeaderMap) -> Option<FullCrc> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if text("x-amz-checksum-type").is_some_and(|t| !t.eq_ignore_ascii_case("FULL_OBJECT")) {
        return None;
    }
    if let Some(crc) = text("x-amz-checksum-crc64nvme").and_then(base64_number::<8>) {
        return Some(FullCrc::Crc64Nvme(u64::from_be_bytes(crc)));
    }
    if let Some(crc) = text("x-amz-checksum-crc32c").and_then(base64_number::<4>) {
        return Some(FullCrc::Crc32c(u32::from_be_bytes(crc)));
    }
    text("x-amz-checksum-crc32")
        .and_then(base64_number::<4>)
        .map(|crc| FullCrc::Crc32(u32::from_be_bytes(crc)))
}

/// The hash named by `name` (`crc32c=`, `md5=`) in GCS's `x-goog-hash` headers (one header per
/// hash, or several in one), if it is `N` bytes long.
fn gcs_hash<const N: usize>(headers: &HeaderMap, name: &str) -> Option<[u8; N]> {
    headers
        .get_all("x-goog-hash")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|hash| hash.trim().strip_prefix(name))
        .and_then(base64_number::<N>)
}

#[cfg(test)]
mod tests {
    use larder_object::crc::BlockCrcs;

    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().expect("header value"));
        }
        map
    }

    #[test]
    fn s3_full_object_crcs() {
        // Values as SeaweedFS sends them.
        assert_eq!(
            s3_full_crc(&headers(&[("x-amz-checksum-crc64nvme", "6Ahb4mH8Zrs=")])),
            Some(FullCrc::Crc64Nvme(0xe808_5be2_61fc_66bb))
        );
        assert_eq!(
            s3_full_crc(&headers(&[
                ("x-amz-checksum-type", "FULL_OBJECT"),
                ("x-amz-checksum-crc32c", "lOTA5w=="),
            ])),
            Some(FullCrc::Crc32c(0x94e4_c0e7))
        );
        assert_eq!(
            s3_full_crc(&headers(&[("x-amz-checksum-crc32", "oMzxQQ==")])),
            Some(FullCrc::Crc32(0xa0cc_f141))
        );
        for other in [
            headers(&[]),
            headers(&[
                ("x-amz-checksum-type", "COMPOSITE"),
                ("x-amz-checksum-crc32c", "lOTA5w=="),
            ]),
            // A composite value carries its part count.
            headers(&[("x-amz-checksum-crc32c", "lOTA5w==-3")]),
            // Not 8 bytes.
            headers(&[("x-amz-checksum-crc64nvme", "lOTA5w==")]),
            headers(&[("x-amz-checksum-crc32", "not base64")]),
        ] {
            assert_eq!(s3_full_crc(&other), None, "{other:?}");
        }
    }

    #[test]
    fn gcs_hash_headers() {
        let crc = Some(0x94e4_c0e7_u32.to_be_bytes());
        // The MD5 of nothing.
        let md5 = Some([
            0xd4, 0x1d, 0x8c, 0xd9, 0x8f, 0x00, 0xb2, 0x04, 0xe9, 0x80, 0x09, 0x98, 0xec, 0xf8, 0x42, 0x7e,
        ]);
        let one = headers(&[("x-goog-hash", "crc32c=lOTA5w==,md5=1B2M2Y8AsgTpgAmY7PhCfg==")]);
        let two = headers(&[
            ("x-goog-hash", "md5=1B2M2Y8AsgTpgAmY7PhCfg=="),
            ("x-goog-hash", "crc32c=lOTA5w=="),
        ]);
        for both in [one, two] {
            assert_eq!(gcs_hash::<4>(&both, "crc32c="), crc);
            assert_eq!(gcs_hash::<16>(&both, "md5="), md5);
        }
        let composite = headers(&[("x-goog-hash", "crc32c=lOTA5w==")]);
        assert_eq!(gcs_hash::<16>(&composite, "md5="), None);
        // A value of the wrong length is no hash.
        assert_eq!(
            gcs_hash::<16>(&headers(&[("x-goog-hash", "md5=lOTA5w==")]), "md5="),
            None
        );
    }

    #[test]
    fn block_crcs_combine_into_the_objects() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 31 % 253) as u8).collect();
        for crc in [FullCrc::Crc64Nvme(0), FullCrc::Crc32c(0), FullCrc::Crc32(0)] {
            let (algorithm, _) = crc.algorithm();
            let mut whole = None;
            for piece in data.chunks(1 << 20) {
                let block = BlockCrcs::of(piece).get(crc);
                whole = Some(whole.map_or(block, |acc| {
                    crc_fast::checksum_combine(algorithm, acc, block, piece.len() as u64)
                }));
            }
            assert_eq!(
                whole,
                Some(crc_fast::checksum(algorithm, &data)),
                "{}",
                crc.name()
            );
        }
    }

    #[test]
    fn the_algorithms_are_the_stores() {
        // The check value of each CRC: the CRC of "123456789".
        for (crc, expected) in [
            (FullCrc::Crc64Nvme(0), 0xae8b_1486_0a79_9888),
            (FullCrc::Crc32c(0), 0xe306_9283),
            (FullCrc::Crc32(0), 0xcbf4_3926),
        ] {
            let (algorithm, _) = crc.algorithm();
            assert_eq!(
                crc_fast::checksum(algorithm, b"123456789"),
                expected,
                "{}",
                crc.name()
            );
        }
    }
}
