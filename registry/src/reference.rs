//! The names of the distribution API: repositories, tags, digests, and the request paths that
//! hold them. Everything a client sends is checked against the API's grammar before it is
//! used, so a name such as `a/../b` never reaches an upstream or a cache key.

use std::fmt;
use std::str::FromStr;

use larder_object::{Identity, IdentityError};

/// A `sha256:<64 lower-case hex digits>` digest, the only algorithm served.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    /// The identity of `size` bytes named by this digest.
    pub fn identity(&self, size: u64) -> Result<Identity, IdentityError> {
        Identity::digest(&self.0, size)
    }

    /// The lower-case hex of the SHA-256.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }
}

impl FromStr for Digest {
    type Err = IdentityError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Identity::digest(text, 0)?;
        Ok(Self(text.to_owned()))
    }
}

impl TryFrom<String> for Digest {
    type Error = IdentityError;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<Digest> for String {
    fn from(digest: Digest) -> Self {
        digest.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The longest repository name served (the distribution spec's limit for a whole name).
const MAX_NAME: usize = 255;

/// Whether `name` is a repository name: components of `[a-z0-9]` runs joined by `.`, `_`,
/// `__` or dashes, separated by `/`.
pub fn is_repository(name: &str) -> bool {
    name.len() <= MAX_NAME && !name.is_empty() && name.split('/').all(is_component)
}

fn is_component(component: &str) -> bool {
    let bytes = component.as_bytes();
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if !bytes.first().is_some_and(alnum) || !bytes.last().is_some_and(alnum) {
        return false;
    }
    let mut at = 0;
    while at < bytes.len() {
        if alnum(&bytes[at]) {
            at += 1;
            continue;
        }
        // A separator: `.`, `_`, `__`, or one or more `-`, between alphanumerics.
        let run = bytes[at..].iter().take_while(|b| !alnum(b)).count();
        let separator = &component[at..at + run];
        if !(matches!(separator, "." | "_" | "__") || separator.bytes().all(|b| b == b'-')) {
            return false;
        }
        at += run;
    }
    true
}

/// Whether `tag` is a tag: a word character, then up to 127 of word characters, `.` and `-`.
pub fn is_tag(tag: &str) -> bool {
    let bytes = tag.as_bytes();
    let word = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    (1..=128).contains(&bytes.len())
        && bytes.first().is_some_and(word)
        && bytes.iter().all(|b| word(b) || matches!(b, b'.' | b'-'))
}

/// What a manifest request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reference {
    /// A tag, resolved upstream.
    Tag(String),
    /// A digest, content addressed.
    Digest(Digest),
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tag(tag) => f.write_str(tag),
            Self::Digest(digest) => digest.fmt(f),
        }
    }
}

/// A request path of the pull API, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`: the API version check.
    Base,
    /// `/v2/<name>/manifests/<reference>`.
    Manifest {
        /// The repository.
        name: String,
        /// The tag or digest.
        reference: Reference,
    },
    /// `/v2/<name>/blobs/<digest>`.
    Blob {
        /// The repository.
        name: String,
        /// The blob's digest.
        digest: Digest,
    },
    /// `/v2/<name>/tags/list`.
    Tags {
        /// The repository.
        name: String,
    },
}

/// Why a request path is refused, in the registry's error codes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// Not a path of the pull API.
    #[error("not a path of the registry pull API")]
    NotFound,
    /// The repository name breaks the grammar.
    #[error("invalid repository name {0:?}")]
    Name(String),
    /// The tag or digest breaks the grammar.
    #[error("invalid tag or digest {0:?}")]
    Reference(String),
    /// The digest is not a sha256 digest.
    #[error("invalid digest {0:?}: only sha256:<64 lower-case hex digits> is served")]
    Digest(String),
}

impl RouteError {
    /// The distribution API's error code for it.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NotFound => "UNSUPPORTED",
            Self::Name(_) => "NAME_INVALID",
            Self::Reference(_) => "MANIFEST_INVALID",
            Self::Digest(_) => "DIGEST_INVALID",
        }
    }
}

impl Route {
    /// Parses a request path (without its query).
    pub fn parse(path: &str) -> Result<Self, RouteError> {
        if path == "/v2/" || path == "/v2" {
            return Ok(Self::Base);
        }
        let rest = path.strip_prefix("/v2/").ok_or(RouteError::NotFound)?;
        if let Some((name, reference)) = rest.rsplit_once("/manifests/") {
            check_name(name)?;
            let reference = if reference.contains(':') {
                Reference::Digest(
                    reference
                        .parse()
                        .map_err(|_| RouteError::Digest(reference.to_owned()))?,
                )
            } else if is_tag(reference) {
                Reference::Tag(reference.to_owned())
            } else {
                return Err(RouteError::Reference(reference.to_owned()));
            };
            return Ok(Self::Manifest {
                name: name.to_owned(),
                reference,
            });
        }
        if let Some(name) = rest.strip_suffix("/tags/list") {
            check_name(name)?;
            return Ok(Self::Tags {
                name: name.to_owned(),
            });
        }
        if let Some((name, digest)) = rest.rsplit_once("/blobs/") {
            check_name(name)?;
            let digest = digest
                .parse()
                .map_err(|_| RouteError::Digest(digest.to_owned()))?;
            return Ok(Self::Blob {
                name: name.to_owned(),
                digest,
            });
        }
        Err(RouteError::NotFound)
    }
}

fn check_name(name: &str) -> Result<(), RouteError> {
    if is_repository(name) {
        Ok(())
    } else {
        Err(RouteError::Name(name.to_owned()))
    }
}

/// An image reference as `larder prefetch image:` takes it: `HOST/REPOSITORY[:TAG|@DIGEST]`
/// (the tag `latest` when neither is given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// The registry, as configured upstream.
    pub host: String,
    /// The repository.
    pub name: String,
    /// The tag or digest.
    pub reference: Reference,
}

impl FromStr for ImageRef {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (host, rest) = text
            .split_once('/')
            .ok_or_else(|| format!("{text:?}: expected REGISTRY/REPOSITORY[:TAG|@DIGEST]"))?;
        let (name, reference) = if let Some((name, digest)) = rest.split_once('@') {
            let digest = digest
                .parse()
                .map_err(|_| format!("{text:?}: {digest:?} is not a sha256 digest"))?;
            (name, Reference::Digest(digest))
        } else {
            match rest.rsplit_once(':') {
                Some((name, tag)) if !tag.contains('/') => {
                    if !is_tag(tag) {
                        return Err(format!("{text:?}: {tag:?} is not a tag"));
                    }
                    (name, Reference::Tag(tag.to_owned()))
                }
                _ => (rest, Reference::Tag("latest".to_owned())),
            }
        };
        if !is_repository(name) {
            return Err(format!("{text:?}: {name:?} is not a repository name"));
        }
        Ok(Self {
            host: host.to_owned(),
            name: name.to_owned(),
            reference,
        })
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.reference {
            Reference::Tag(tag) => write!(f, "{}/{}:{tag}", self.host, self.name),
            Reference::Digest(digest) => write!(f, "{}/{}@{digest}", self.host, self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";

    #[test]
    fn repository_names_follow_the_grammar() {
        for good in ["a", "library/ubuntu", "nvidia/cuda", "a.b_c__d---e/f0", "x/y/z"] {
            assert!(is_repository(good), "{good}");
        }
        for bad in [
            "", "A", "a/../b", "..", "a/", "/a", "a//b", "-a", "a-", "a..b", "a___b", "a b", "a%2fb",
        ] {
            assert!(!is_repository(bad), "{bad}");
        }
        assert!(!is_repository(&"a".repeat(256)));
    }

    #[test]
    fn routes_parse_and_refuse_what_breaks_the_grammar() {
        assert_eq!(Route::parse("/v2/"), Ok(Route::Base));
        assert_eq!(
            Route::parse("/v2/nvidia/cuda/manifests/12.4-runtime"),
            Ok(Route::Manifest {
                name: "nvidia/cuda".into(),
                reference: Reference::Tag("12.4-runtime".into()),
            })
        );
        assert_eq!(
            Route::parse(&format!("/v2/a/blobs/{DIGEST}")),
            Ok(Route::Blob {
                name: "a".into(),
                digest: DIGEST.parse().unwrap(),
            })
        );
        assert_eq!(
            Route::parse("/v2/a/../b/manifests/latest"),
            Err(RouteError::Name("a/../b".into()))
        );
        assert_eq!(
            Route::parse("/v2/a/blobs/sha512:00"),
            Err(RouteError::Digest("sha512:00".into()))
        );
        assert_eq!(
            Route::parse("/v2/a/manifests/.hidden"),
            Err(RouteError::Reference(".hidden".into()))
        );
        assert_eq!(
            Route::parse("/v2/nvidia/cuda/tags/list"),
            Ok(Route::Tags {
                name: "nvidia/cuda".into()
            })
        );
        assert_eq!(
            Route::parse("/v2/a/../b/tags/list"),
            Err(RouteError::Name("a/../b".into()))
        );
        assert_eq!(Route::parse("/v2/_catalog"), Err(RouteError::NotFound));
        assert_eq!(RouteError::NotFound.code(), "UNSUPPORTED");
        assert_eq!(Route::parse("/metrics"), Err(RouteError::NotFound));
    }

    #[test]
    fn image_references_parse_with_tag_digest_or_latest() {
        let image: ImageRef = "localhost:5000/team/model:v1".parse().unwrap();
        assert_eq!(
            (
                image.host.as_str(),
                image.name.as_str(),
                image.reference.to_string()
            ),
            ("localhost:5000", "team/model", "v1".to_owned())
        );
        let image: ImageRef = format!("nvcr.io/nvidia/cuda@{DIGEST}").parse().unwrap();
        assert_eq!(image.reference, Reference::Digest(DIGEST.parse().unwrap()));
        let image: ImageRef = "nvcr.io/nvidia/cuda".parse().unwrap();
        assert_eq!(image.to_string(), "nvcr.io/nvidia/cuda:latest");
        for bad in [
            "cuda",
            "nvcr.io/Cuda:1",
            "nvcr.io/cuda:bad tag",
            "nvcr.io/cuda@sha256:0",
        ] {
            assert!(bad.parse::<ImageRef>().is_err(), "{bad}");
        }
    }
}
