//! End to end against the emulators of Google Cloud Storage (fake-gcs-server) and Azure Blob
//! Storage (Azurite; see `larder_tests::gcs` and `larder_tests::azurite` for where each differs
//! from the real service), each behind a proxy that counts the bytes it sends: the ground
//! truth of what came from the origin. The daemons reach each store through the variable a user
//! of that cloud sets (`STORAGE_EMULATOR_HOST`, `AZURE_STORAGE_CONNECTION_STRING`).

use std::path::Path;

use larder_peer_proto::auth::ClusterKey;
use larder_tests::azurite::{ACCOUNT_KEY, Azurite};
use larder_tests::daemon::DaemonProcess;
use larder_tests::fake_peer::{FakePeer, Misbehaviour};
use larder_tests::gcs::FakeGcs;
use larder_tests::rack::{Rack, SECRET};
use larder_tests::{Bucket, RecordingProxy, content, free_port, seed};
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload};
use test_case::test_case;

const BIN: &str = env!("CARGO_BIN_EXE_larder");
const MIB: usize = 1 << 20;

#[derive(Debug, Clone, Copy)]
enum Cloud {
    Gcs,
    Azure,
}

/// An emulator holding objects (the harness's content of each key, seed 0), behind a proxy.
struct Emulator {
    server: Box<dyn Bucket + Send>,
    proxy: RecordingProxy,
    /// The variables that point a daemon at the store through the proxy.
    env: Vec<(&'static str, String)>,
}

impl Emulator {
    async fn start(cloud: Cloud, objects: &[(&str, usize)]) -> Self {
        let objects: Vec<(&str, Vec<u8>)> = objects
            .iter()
            .map(|&(key, size)| (key, content(seed(key, 0), 0, size)))
            .collect();
        match cloud {
            Cloud::Gcs => {
                // The proxy first: the emulator answers only requests to the host it is told.
                let port = free_port(std::net::Ipv4Addr::LOCALHOST).expect("port");
                let proxy = RecordingProxy::start_to(&format!("127.0.0.1:{port}"))
                    .await
                    .expect("proxy");
                let public = proxy.endpoint().trim_start_matches("http://").to_owned();
                let seeded: Vec<(&str, &[u8])> = objects.iter().map(|(k, b)| (*k, b.as_slice())).collect();
                let server = FakeGcs::start_at("models", &seeded, port, &public).expect("fake-gcs-server");
                let env = server.env().to_vec();
                Self {
                    server: Box::new(server),
                    proxy,
                    env,
                }
            }
            Cloud::Azure => {
                let server = tokio::task::spawn_blocking(|| Azurite::start("models"))
                    .await
                    .expect("join")
                    .expect("azurite");
                let client = server.client().expect("client");
                // One request each: the service (and Azurite) keeps such a blob's MD5.
                for (key, bytes) in objects {
                    client
                        .put(&Key::from(key), PutPayload::from(bytes))
                        .await
                        .expect("upload");
                }
                let address = server.endpoint().trim_start_matches("http://").to_owned();
                let proxy = RecordingProxy::start_to(&address).await.expect("proxy");
                let env = vec![(
                    "AZURE_STORAGE_CONNECTION_STRING",
                    server.connection_string(&proxy.endpoint(), ACCOUNT_KEY),
                )];
                Self {
                    server: Box::new(server),
                    proxy,
                    env,
                }
            }
        }
    }

    fn env(&self) -> Vec<(&str, &str)> {
        self.env.iter().map(|(k, v)| (*k, v.as_str())).collect()
    }
}

/// Reads `key` through `daemon`'s mount, the page cache dropped first; whether its bytes are
/// the harness's content of `size` bytes.
fn read_right(daemon: &DaemonProcess, key: &str, size: usize) -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
    std::fs::read(daemon.mount.join(key)).expect("read") == content(seed(key, 0), 0, size)
}

const MODEL: &str = "llama/model.safetensors";
const TOKENIZER: &str = "llama/tokenizer.bin";

/// A 256 MiB object read right cold (every byte from the origin), warm and after a restart
/// (none); another object prefetched with `larder prefetch --wait`, then read with none.
/// A listing first, as `ls` does: before, a read after a listing got ESTALE from GCS (the
/// emulator lists an ETag bare and quotes it in a GET's answer).
#[test_case(Cloud::Gcs ; "gcs")]
#[test_case(Cloud::Azure ; "azure")]
#[tokio::test(flavor = "multi_thread")]
async fn the_mount_reads_cold_warm_after_a_restart_and_prefetched(cloud: Cloud) {
    let (model, tokenizer) = (256 * MIB, 24 * MIB + 5);
    let store = Emulator::start(cloud, &[(MODEL, model), (TOKENIZER, tokenizer)]).await;
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().expect("tempdir");
        let env = store.env();
        let start = || {
            DaemonProcess::start_with_env(Path::new(BIN), store.server.as_ref(), dir.path(), &[], &env)
                .expect("daemon")
        };
        let daemon = start();
        let listed: Vec<_> = std::fs::read_dir(daemon.mount.join("llama"))
            .expect("list")
            .map(|entry| entry.expect("entry").file_name())
            .collect();
        assert_eq!(listed.len(), 2, "{listed:?}");
        let sent = || store.proxy.body_bytes();
        let before = sent();
        assert!(read_right(&daemon, MODEL, model), "cold: wrong bytes");
        assert!(
            sent() - before >= model as u64,
            "cold: {} bytes from the origin",
            sent() - before
        );
        let before = sent();
        assert!(read_right(&daemon, MODEL, model), "warm: wrong bytes");
        assert_eq!(sent() - before, 0, "warm: bytes from the origin");

        let output = daemon.larder(&["prefetch", "--wait", &format!("models:{TOKENIZER}")]);
        assert!(output.status.success(), "prefetch: {output:?}");
        let before = sent();
        assert!(
            read_right(&daemon, TOKENIZER, tokenizer),
            "prefetched: wrong bytes"
        );
        assert_eq!(sent() - before, 0, "prefetched: bytes from the origin");

        daemon.stop().expect("stop");
        let daemon = start();
        let before = sent();
        assert!(read_right(&daemon, MODEL, model), "after a restart: wrong bytes");
        assert!(
            read_right(&daemon, TOKENIZER, tokenizer),
            "after a restart: wrong bytes"
        );
        // Only metadata (a HEAD or a listing per object) after a restart.
        assert!(
            sent() - before < MIB as u64,
            "after a restart: {} bytes from the origin",
            sent() - before
        );
    })
    .await
    .expect("join");
}

/// A member that lies (wrong bytes with their own BLAKE3 and tags) is caught by the checksum
/// the store publishes (GCS's `x-goog-hash` MD5, Azure's `Content-MD5`; an Azure ETag says
/// nothing of the bytes, so before Azure's MD5 was asked for the liar's blocks were kept,
/// counted `unchecked`): its blocks are dropped, a reread gets the origin's bytes, and it is
/// marked down.
#[test_case(Cloud::Gcs ; "gcs")]
#[test_case(Cloud::Azure ; "azure")]
#[tokio::test(flavor = "multi_thread")]
async fn a_lying_member_is_caught_by_what_the_store_publishes(cloud: Cloud) {
    let size = 64 * MIB;
    let store = Emulator::start(cloud, &[(MODEL, size)]).await;
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let liar = FakePeer::start(key, Misbehaviour::Lie).await.expect("fake peer");
    let member = format!("f={}@r1", liar.address);
    let expected = content(seed(MODEL, 0), 0, size);
    tokio::task::spawn_blocking(move || {
        let env = store.env();
        // Runs of one 4 MiB part: the object's 16 runs are the liar's but for one chance in
        // 65,536 (its 4 runs of 16 MiB all stayed with the node once in 16: the object's id,
        // and so its owners, depend on the emulator's port).
        let parts = ["--part-size", "4MiB"];
        let rack = Rack::start_with_env(Path::new(BIN), store.server.as_ref(), 1, &parts, &[member], &env)
            .expect("rack");
        let first = std::fs::read(rack.daemon(0).mount.join(MODEL)).expect("first read");
        let premise = |holds: bool, what: &str| {
            assert!(holds, "{what}: the test proves nothing; log:\n{}", rack.log(0));
        };
        premise(liar.requests() > 0, "the liar owned no run of the model");
        premise(first != expected, "the liar's bytes never reached the cache");
        let caught = rack.wait_for_origin_checks(0, "mismatch", 1.0);
        let results = ["match", "crc_only", "unchecked"].map(|r| (r, rack.origin_checks(0, r)));
        assert!(caught, "no mismatch counted ({results:?}); log:\n{}", rack.log(0));
        let before = store.proxy.body_bytes();
        std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
        let reread = std::fs::read(rack.daemon(0).mount.join(MODEL)).expect("reread");
        assert!(reread == expected, "the liar's blocks stayed in the cache");
        assert!(
            store.proxy.body_bytes() > before,
            "the reread did not fetch the dropped blocks from the origin"
        );
        assert_eq!(rack.origin_checks(0, "unchecked"), 0.0);
        assert_eq!(rack.member_state(0, "f"), "\"down\"");
    })
    .await
    .expect("join");
}
