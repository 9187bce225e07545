//! One conformance suite that every kind of origin passes, each against a real server: s3s and
//! SeaweedFS (S3), fake-gcs-server (GCS), Azurite (Azure Blob Storage), a local directory, and
//! WsgiDAV (the HTTP origin). Every origin is built from its source URL and an environment
//! written as a user of that cloud writes it: AWS variables (s3s), the AWS CLI's shared files
//! (SeaweedFS), `STORAGE_EMULATOR_HOST` (GCS), `AZURE_STORAGE_CONNECTION_STRING` (Azure).
//!
//! What every origin must do: list a level page by page (more keys than one page), HEAD,
//! ranged GETs at block edges, an object changed while open read as its old bytes or refused
//! (`VersionChanged`, ESTALE at the mount), never mixed; a deleted and a missing key are
//! `NotFound`; credentials the store refuses are `PermissionDenied`, naming the source and not
//! quoting the secret. Where a store cannot do one of these (an emulator that checks no
//! credentials, a local directory to root), the case says why it is left out.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use larder_config::{OriginConfig, SourceConfig};
use larder_object::ObjectVersion;
use larder_origin::environment::Environment;
use larder_origin::{ListEntry, Origin, OriginError, PAGE_KEYS};
use larder_stats::OriginStats;
use larder_tests::azurite::{self, Azurite};
use larder_tests::gcs::FakeGcs;
use larder_tests::seaweed::Seaweed;
use larder_tests::webdav::{WebDav, write_under};
use larder_tests::{ACCESS_KEY, Bucket, RecordingProxy, S3Server, SECRET_KEY, content};
use md5::Digest;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use test_case::test_case;
use tokio::time::Instant;

/// The block size the reads are cut at.
const BLOCK: u64 = 1 << 20;

#[derive(Debug, Clone, Copy)]
enum Kind {
    S3s,
    Seaweed,
    Gcs,
    Azure,
    Local,
    Http,
}

/// How the test writes objects: through the store's own API (fake-gcs-server's JSON API, which
/// object_store does not speak), or into the directory served.
enum Writer {
    Api(Arc<dyn ObjectStore>),
    Gcs(Arc<FakeGcs>),
    Dir(PathBuf),
}

/// One origin under test, its server kept running.
struct Store {
    url: String,
    env: Environment,
    /// A source URL and environment the store refuses; `None` where it checks no credentials.
    denied: Option<(String, Environment)>,
    writer: Writer,
    /// Whether its listings come in pages (the cloud stores) or whole (a directory, WebDAV,
    /// fake-gcs-server).
    paged: bool,
    /// Whether a version is pinned by a number of its own besides the ETag (GCS generations).
    generations: bool,
    /// Whether the store publishes an object's MD5 apart from its ETag (GCS's `x-goog-hash`,
    /// Azure's `Content-MD5`), which the origin check of rack peers' blocks uses.
    publishes_md5: bool,
    _servers: Vec<Box<dyn std::any::Any>>,
}

/// The variables an S3 user sets, signing with `secret`.
fn aws_variables(endpoint: &str, secret: &str) -> Environment {
    [
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", secret),
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ALLOW_HTTP", "true"),
    ]
    .into_iter()
    .collect()
}

/// A home directory with the AWS CLI's two files, as `aws configure` writes them, for the
/// profile `gpu`; the environment that names it.
fn aws_profile(home: &std::path::Path, endpoint: &str, secret: &str) -> Environment {
    std::fs::create_dir_all(home.join(".aws")).expect("mkdir");
    std::fs::write(
        home.join(".aws/credentials"),
        format!("[gpu]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {secret}\n"),
    )
    .expect("credentials");
    std::fs::write(
        home.join(".aws/config"),
        format!("[profile gpu]\nregion = us-east-1\nendpoint_url = {endpoint}\n"),
    )
    .expect("config");
    [("HOME", home.to_str().expect("utf-8")), ("AWS_PROFILE", "gpu")]
        .into_iter()
        .collect()
}

impl Store {
    async fn start(kind: Kind) -> Self {
        match kind {
            Kind::S3s => {
                let server = S3Server::start("conformance").await.expect("s3s");
                Self {
                    url: server.url(),
                    env: aws_variables(&server.endpoint(), SECRET_KEY),
                    denied: Some((server.url(), aws_variables(&server.endpoint(), "wrong-secret"))),
                    writer: Writer::Api(server.client().expect("client")),
                    paged: true,
                    generations: false,
                    publishes_md5: false,
                    _servers: vec![Box::new(server)],
                }
            }
            Kind::Seaweed => {
                let server = Seaweed::start(&Seaweed::installed_binary(), "conformance").expect("weed");
                let homes = tempfile::tempdir().expect("tempdir");
                let env = aws_profile(&homes.path().join("good"), &server.endpoint, SECRET_KEY);
                let denied = aws_profile(&homes.path().join("bad"), &server.endpoint, "wrong-secret");
                Self {
                    url: Seaweed::url(&server),
                    env,
                    denied: Some((Seaweed::url(&server), denied)),
                    writer: Writer::Api(server.client().expect("client")),
                    paged: true,
                    generations: false,
                    publishes_md5: false,
                    _servers: vec![Box::new(server), Box::new(homes)],
                }
            }
            Kind::Gcs => {
                let server = FakeGcs::start("conformance", &[]).expect("fake-gcs-server");
                let env: Environment = server.env().into_iter().collect();
                let server = Arc::new(server);
                Self {
                    url: server.url(),
                    env,
                    // fake-gcs-server takes any credentials, or none.
                    denied: None,
                    writer: Writer::Gcs(server.clone()),
                    // The emulator's XML API ignores max-keys and answers a level in one page
                    // (the service pages at 1000): paging is not proven against GCS here.
                    paged: false,
                    generations: true,
                    publishes_md5: true,
                    _servers: vec![Box::new(server)],
                }
            }
            Kind::Azure => {
                let server = Azurite::start("conformance").expect("azurite");
                let env: Environment = server.env().into_iter().collect();
                // A key of the right shape that is not the account's.
                let wrong = azurite::ACCOUNT_KEY.replace('E', "F");
                let denied: Environment = [(
                    "AZURE_STORAGE_CONNECTION_STRING",
                    server.connection_string(&server.endpoint(), &wrong),
                )]
                .into_iter()
                .collect();
                Self {
                    url: server.url(),
                    env,
                    denied: Some((server.url(), denied)),
                    writer: Writer::Api(server.client().expect("client")),
                    paged: true,
                    generations: false,
                    publishes_md5: true,
                    _servers: vec![Box::new(server)],
                }
            }
            Kind::Local => {
                let dir = tempfile::tempdir().expect("tempdir");
                Self {
                    url: format!("file://{}", dir.path().display()),
                    env: Environment::default(),
                    // Permissions do not stop root, whom the tests run as; a local directory
                    // has no credentials.
                    denied: None,
                    writer: Writer::Dir(dir.path().to_owned()),
                    paged: false,
                    generations: false,
                    publishes_md5: false,
                    _servers: vec![Box::new(dir)],
                }
            }
            Kind::Http => {
                let server = WebDav::start().expect("wsgidav");
                let guarded = WebDav::start_with_password().expect("wsgidav");
                Self {
                    url: server.url(""),
                    env: Environment::default(),
                    // A server that wants a password, asked without one.
                    denied: Some((guarded.url(""), Environment::default())),
                    writer: Writer::Dir(server.root()),
                    paged: false,
                    generations: false,
                    publishes_md5: false,
                    _servers: vec![Box::new(server), Box::new(guarded)],
                }
            }
        }
    }

    fn origin_at(&self, url: &str, env: &Environment) -> Origin {
        let source = SourceConfig::new("conformance", url);
        Origin::from_config(
            &source,
            &OriginConfig::default(),
            Arc::new(OriginStats::default()),
            env,
        )
        .expect("origin")
    }

    fn origin(&self) -> Origin {
        self.origin_at(&self.url, &self.env)
    }

    async fn put(&self, key: &str, bytes: Vec<u8>) {
        match &self.writer {
            Writer::Api(store) => {
                store
                    .put(&Path::from(key), PutPayload::from(bytes))
                    .await
                    .expect("put");
            }
            Writer::Gcs(server) => server.put(key, &bytes).expect("upload"),
            Writer::Dir(root) => write_under(root, key, &bytes).expect("write"),
        }
    }

    async fn delete(&self, key: &str) {
        match &self.writer {
            Writer::Api(store) => store.delete(&Path::from(key)).await.expect("delete"),
            Writer::Gcs(server) => server.delete(key).expect("delete"),
            Writer::Dir(root) => std::fs::remove_file(root.join(key)).expect("remove"),
        }
    }
}

/// `range` of the pinned `version`, whole or the error.
async fn read(
    origin: &Origin,
    version: &ObjectVersion,
    range: std::ops::Range<u64>,
) -> Result<Vec<u8>, OriginError> {
    let mut got = Vec::new();
    origin
        .read_range(version, range, Instant::now(), &mut |bytes: Bytes| {
            got.extend_from_slice(&bytes)
        })
        .await?;
    Ok(got)
}

#[test_case(Kind::S3s ; "s3s")]
#[test_case(Kind::Seaweed ; "seaweedfs")]
#[test_case(Kind::Gcs ; "fake_gcs_server")]
#[test_case(Kind::Azure ; "azurite")]
#[test_case(Kind::Local ; "local_directory")]
#[test_case(Kind::Http ; "webdav")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_origin_conforms(kind: Kind) {
    let store = Store::start(kind).await;
    lists_in_pages(&store).await;
    reads_ranges_pins_versions_and_refuses_what_changed(&store).await;
    tells_missing_from_denied(&store).await;
}

/// A level with more keys than one page, and a directory among them, lists whole.
async fn lists_in_pages(store: &Store) {
    let keys: Vec<String> = (0..PAGE_KEYS + 5).map(|i| format!("many/k-{i:05}")).collect();
    futures::stream::iter(keys.iter().map(|key| store.put(key, key.as_bytes().to_vec())))
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    store.put("many/sub/inner", b"x".to_vec()).await;
    let origin = store.origin();
    let (mut listed, mut pages, mut from) = (BTreeSet::new(), 0, None);
    loop {
        let page = origin.list_page("many", from.as_ref()).await.expect("list");
        pages += 1;
        for entry in page.entries {
            let name = match entry {
                ListEntry::Prefix(prefix) => format!("{prefix}/"),
                ListEntry::Object(object) => {
                    assert_eq!(object.size, object.key.len() as u64, "{}", object.key);
                    object.key
                }
            };
            assert!(listed.insert(name.clone()), "{name} listed twice");
        }
        match page.next {
            Some(next) => from = Some(next),
            None => break,
        }
    }
    let mut expected: BTreeSet<String> = keys.into_iter().collect();
    expected.insert("many/sub/".into());
    assert_eq!(listed.len(), expected.len());
    assert_eq!(listed, expected);
    if store.paged {
        assert!(pages >= 2, "{} keys in {pages} page(s)", expected.len());
    }
    assert!(origin.is_dir("many/sub").await.expect("is_dir"));
    assert!(!origin.is_dir("many/k-00001").await.expect("is_dir"));
}

/// HEAD, ranged reads at block edges, and a version pinned at open: after the object is
/// replaced the old version reads as its old bytes or fails `VersionChanged`, never as the new
/// bytes; after it is deleted, `NotFound` or `VersionChanged`.
async fn reads_ranges_pins_versions_and_refuses_what_changed(store: &Store) {
    let size = 3 * BLOCK + 17;
    let old = content(1, 0, size as usize);
    store.put("weights/model.bin", old.clone()).await;
    let origin = store.origin();
    let pinned = origin.head("weights/model.bin").await.expect("head");
    assert_eq!(pinned.size, size);
    assert!(pinned.etag.is_some(), "every store gives an ETag: {pinned:?}");
    assert_eq!(pinned.version.is_some(), store.generations, "{pinned:?}");
    let published = origin.published(&pinned, false).await;
    let md5: [u8; 16] = md5::Md5::digest(&old).into();
    assert_eq!(published.md5, store.publishes_md5.then_some(md5), "{published:?}");
    for range in [
        0..1,
        BLOCK - 1..BLOCK + 1,
        2 * BLOCK..3 * BLOCK,
        size - 1..size,
        0..size,
    ] {
        let got = read(&origin, &pinned, range.clone()).await.expect("read");
        assert!(got == old[range.start as usize..range.end as usize], "{range:?}");
    }

    // The first block read, then the object replaced (same size, other bytes).
    let first = read(&origin, &pinned, 0..BLOCK).await.expect("read");
    let new = content(2, 0, size as usize);
    store.put("weights/model.bin", new.clone()).await;
    let current = origin.head("weights/model.bin").await.expect("head");
    assert_ne!(
        (&current.etag, &current.version),
        (&pinned.etag, &pinned.version),
        "the new version must be told from the old"
    );
    match read(&origin, &pinned, BLOCK..size).await {
        Ok(rest) => assert!(
            first.iter().chain(&rest).eq(old.iter()),
            "a read of the pinned version mixed in other bytes"
        ),
        Err(error) => assert!(matches!(error, OriginError::VersionChanged { .. }), "{error}"),
    }
    assert!(read(&origin, &current, 0..size).await.expect("read") == new);

    store.delete("weights/model.bin").await;
    let gone = origin.head("weights/model.bin").await.expect_err("deleted");
    assert!(matches!(gone, OriginError::NotFound { .. }), "{gone}");
    let error = read(&origin, &current, 0..BLOCK).await.expect_err("deleted");
    assert!(
        matches!(
            error,
            OriginError::NotFound { .. } | OriginError::VersionChanged { .. }
        ),
        "{error}"
    );
}

/// A missing key is `NotFound`, naming key and source; credentials the store refuses are
/// `PermissionDenied` (for a read and for a listing), naming the source and not quoting the
/// secret.
async fn tells_missing_from_denied(store: &Store) {
    store.put("present.bin", b"here".to_vec()).await;
    let origin = store.origin();
    let missing = origin.head("absent.bin").await.expect_err("missing");
    assert!(
        matches!(missing, OriginError::NotFound { ref key, .. } if key == "absent.bin"),
        "{missing}"
    );
    assert!(missing.to_string().contains("conformance"), "{missing}");
    let Some((url, env)) = &store.denied else {
        return;
    };
    let refused = store.origin_at(url, env);
    let denied = refused.head("present.bin").await.expect_err("refused");
    assert!(matches!(denied, OriginError::PermissionDenied { .. }), "{denied}");
    // object_store types a refused HEAD or GET itself, not a refused listing.
    let listing = refused.list_page("", None).await.expect_err("refused listing");
    assert!(
        matches!(listing, OriginError::PermissionDenied { .. }),
        "{listing}"
    );
    let message = denied.to_string();
    assert!(message.contains("conformance"), "{message}");
    assert!(!message.contains("wrong-secret"), "the secret leaked: {message}");
}

/// The user and password of an `http(s)://` source's URL are its credentials (HTTP Basic).
#[tokio::test]
async fn an_http_origin_signs_in_with_the_user_and_password_of_its_url() {
    let server = WebDav::start_with_password().expect("wsgidav");
    server.write("weights/a.bin", b"guarded").expect("write");
    let url = server.url("").replace("http://", "http://larder:secret@");
    let source = SourceConfig::new("conformance", url.as_str());
    let origin = Origin::from_config(
        &source,
        &OriginConfig::default(),
        Arc::new(OriginStats::default()),
        &Environment::default(),
    )
    .expect("origin");
    let version = origin
        .head("weights/a.bin")
        .await
        .expect("head with the URL's password");
    assert_eq!(version.size, 7);
    assert!(read(&origin, &version, 0..7).await.expect("read") == b"guarded");
}

/// GCS credentials from the file `GOOGLE_APPLICATION_CREDENTIALS` names (a service account's
/// key, as the console and gcloud write it): requests carry a token signed with its key, and
/// the published checksums are asked through a URL signed with it. fake-gcs-server takes any
/// credentials, so what proves the file was used is what reached it, seen by a proxy.
#[tokio::test]
async fn gcs_signs_with_the_service_account_key_file_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pem = dir.path().join("key.pem");
    let made = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&pem)
        .output()
        .expect("openssl (scripts/test installs it)");
    assert!(made.status.success(), "{made:?}");
    let key = serde_json::json!({
        "type": "service_account",
        "project_id": "larder-test",
        "private_key_id": "larder-test-key",
        "private_key": std::fs::read_to_string(&pem).expect("key"),
        "client_email": "larder@larder-test.iam.gserviceaccount.com",
        "client_id": "1",
        // Never asked (the token is signed here), and on loopback if it were.
        "token_uri": "http://127.0.0.1:9/token",
    });
    let file = dir.path().join("service-account.json");
    std::fs::write(&file, key.to_string()).expect("write");

    let port = larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port");
    let proxy = RecordingProxy::start_to(&format!("127.0.0.1:{port}"))
        .await
        .expect("proxy");
    let public = proxy.endpoint().trim_start_matches("http://").to_owned();
    let server = FakeGcs::start_at("conformance", &[], port, &public).expect("fake-gcs-server");
    let bytes = content(3, 0, 1000);
    server.put("signed.bin", &bytes).expect("upload");
    let env: Environment = [
        (
            "GOOGLE_APPLICATION_CREDENTIALS",
            file.to_str().expect("utf-8").to_owned(),
        ),
        ("GOOGLE_BASE_URL", proxy.endpoint()),
    ]
    .into_iter()
    .collect();
    let source = SourceConfig::new("conformance", server.url().as_str());
    let origin = Origin::from_config(
        &source,
        &OriginConfig::default(),
        Arc::new(OriginStats::default()),
        &env,
    )
    .expect("origin");
    let version = origin.head("signed.bin").await.expect("head");
    let published = origin.published(&version, false).await;
    let md5: [u8; 16] = md5::Md5::digest(&bytes).into();
    assert_eq!(published.md5, Some(md5), "the signed HEAD got no checksums");

    let requests = proxy.requests();
    let token = requests
        .iter()
        .find_map(|r| r.authorization.as_deref()?.strip_prefix("Bearer "))
        .expect("a request with a bearer token");
    let header = token.split('.').next().expect("a JWT");
    let header = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header)
        .expect("base64url");
    let header: serde_json::Value = serde_json::from_slice(&header).expect("JSON");
    assert_eq!(header["kid"], "larder-test-key", "{header}");
    assert!(
        requests.iter().any(|r| r.query.as_deref().is_some_and(|q| {
            q.contains("X-Goog-Signature=") && q.contains("larder%40larder-test.iam.gserviceaccount.com")
        })),
        "no HEAD signed with the key: {requests:?}"
    );
}
