//! End to end: `larder seal` against a daemon process. The manifests it writes are read back
//! from the object store and every block hash checked against the BLAKE3 of the object's
//! bytes computed here and against the hashes the block store records for the same blocks;
//! the mount does not show them, prefetch does not fetch them, a re-seal
//! writes the same bytes, and wrong targets are refused with a clear message.

use std::path::Path;
use std::process::Output;
use std::time::SystemTime;

use larder_object::{ObjectVersion, canonical_source_url};
use larder_store::format::replay;
use larder_store::object_paths;
use larder_tests::daemon::DaemonProcess;
use larder_tests::seaweed::Seaweed;
use larder_tests::{content, seed, upload};
use object_store::ObjectStoreExt;
use object_store::path::Path as Key;

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");

/// Objects under the sealed prefix, and one outside it.
const SEALED: &[(&str, u64)] = &[
    ("llama/model-00001.safetensors", 3 * MIB + 5),
    ("llama/model-00002.safetensors", 2 * MIB),
    ("llama/config.json", 700),
];
const OTHER: (&str, u64) = ("other/x.bin", MIB);

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `larder args` against `daemon`, off the async runtime.
async fn larder(daemon: &std::sync::Arc<DaemonProcess>, args: &[&str]) -> Output {
    let (daemon, args) = (
        daemon.clone(),
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
    );
    tokio::task::spawn_blocking(move || daemon.larder(&args.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .expect("join")
}

/// SeaweedFS serving an empty bucket.
fn seaweed() -> Seaweed {
    let weed = Seaweed::installed_binary();
    assert!(
        weed.exists(),
        "{} is missing: run scripts/test (it installs SeaweedFS)",
        weed.display()
    );
    Seaweed::start(&weed, "larder-seal").expect("weed mini")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sealed_prefix_has_a_manifest_of_every_block_hidden_from_the_mount_and_a_reseal_is_identical() {
    let server = seaweed();
    let client = server.client().expect("client");
    for &(key, size) in SEALED.iter().chain([&OTHER]) {
        upload(client.as_ref(), key, seed(key, 0), size)
            .await
            .expect("upload");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(
        Path::new(BIN),
        &server,
        dir.path(),
        &["--block-size", "1MiB", "--part-size", "2MiB"],
    )
    .expect("daemon");
    let daemon = std::sync::Arc::new(daemon);

    let output = larder(&daemon, &["seal", "--wait", "models:llama"]).await;
    assert!(output.status.success(), "seal: {}", stderr(&output));
    for &(key, _) in SEALED {
        let line = format!("sealed {key} -> .larder-seal/{key}.json");
        assert!(
            stdout(&output).contains(&line),
            "{line} not in {}",
            stdout(&output)
        );
    }

    let mut manifests = Vec::new();
    for &(key, size) in SEALED {
        let path = Key::from(format!(".larder-seal/{key}.json"));
        let bytes = client
            .get(&path)
            .await
            .expect("manifest")
            .bytes()
            .await
            .expect("body");
        let etag = client.head(&Key::from(key)).await.expect("head").e_tag;
        let manifest: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(manifest["format"], "larder-seal-v1");
        assert_eq!(manifest["key"], key);
        assert_eq!(manifest["size"], size);
        assert_eq!(manifest["block_size"], MIB);
        assert_eq!(manifest["etag"].as_str(), etag.as_deref(), "{manifest}");
        let data = content(seed(key, 0), 0, size as usize);
        let expected: Vec<String> = data
            .chunks(MIB as usize)
            .map(|block| blake3::hash(block).to_hex().to_string())
            .collect();
        let blocks: Vec<String> = manifest["blocks"]
            .as_array()
            .expect("blocks")
            .iter()
            .map(|h| h.as_str().expect("hex").to_owned())
            .collect();
        assert_eq!(blocks, expected, "{key}");
        manifests.push((path, bytes));
    }
    let outside = client.head(&Key::from(".larder-seal/other/x.bin.json")).await;
    assert!(
        matches!(outside, Err(object_store::Error::NotFound { .. })),
        "an object outside the prefix was sealed: {outside:?}"
    );

    // The mount shows neither the directory of manifests nor anything in it.
    let names: Vec<String> = std::fs::read_dir(&daemon.mount)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.contains(&"llama".to_owned()), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with(".larder")), "{names:?}");
    let hidden = std::fs::metadata(daemon.mount.join(".larder-seal"));
    assert_eq!(
        hidden.map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::NotFound)
    );

    // Prefetch of the whole source plans the four objects, not the manifests.
    let output = larder(&daemon, &["prefetch", "--wait", "models:"]).await;
    assert!(output.status.success(), "prefetch: {}", stderr(&output));
    assert!(stderr(&output).contains(": 4 objects,"), "{}", stderr(&output));

    // The block store recorded the very hashes the manifests hold.
    for (&(key, size), (_, bytes)) in SEALED.iter().zip(&manifests) {
        let version = ObjectVersion {
            origin_url: canonical_source_url(&server.url()),
            key: key.to_owned(),
            etag: client.head(&Key::from(key)).await.expect("head").e_tag,
            version: None,
            size,
            modified: SystemTime::UNIX_EPOCH,
            content: None,
        };
        let (_, record) = object_paths(&daemon.cache, version.id());
        let recorded = replay(&std::fs::read(&record).expect("record")).expect("replay");
        let manifest: serde_json::Value = serde_json::from_slice(bytes).expect("JSON");
        for (index, hash) in manifest["blocks"].as_array().expect("blocks").iter().enumerate() {
            let stored = recorded.blocks.get(&(index as u32)).map(hex::encode);
            assert_eq!(stored.as_deref(), hash.as_str(), "{key} block {index}");
        }
    }

    // A re-seal of the unchanged objects writes the same manifests, byte for byte.
    let output = larder(&daemon, &["seal", "--wait", "models:llama/"]).await;
    assert!(output.status.success(), "re-seal: {}", stderr(&output));
    for (path, bytes) in manifests {
        let again = client
            .get(&path)
            .await
            .expect("manifest")
            .bytes()
            .await
            .expect("body");
        assert_eq!(again, bytes, "{path} changed on a re-seal");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_targets_are_refused_clearly_and_a_failed_object_fails_the_command() {
    let server = seaweed();
    let client = server.client().expect("client");
    upload(client.as_ref(), "a/b.bin", seed("a/b.bin", 0), 1000)
        .await
        .expect("upload");
    // Valid as a key (1007 bytes), but its manifest's key would pass S3's 1024 bytes.
    let long = format!("a/{}/{}", vec!["x".repeat(200); 4].join("/"), "y".repeat(201));
    assert_eq!(long.len(), 1007);
    upload(client.as_ref(), &long, seed(&long, 0), 10)
        .await
        .expect("upload");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let daemon = std::sync::Arc::new(daemon);

    for (target, message) in [
        ("nosuch:x", "no source is named \"nosuch\""),
        ("models:a/../b", "target \"models:a/../b\""),
        ("models:missing/", "no object and no prefix"),
        ("models:.larder-seal", "no object and no prefix"),
        ("plain", "not under the mount"),
    ] {
        let output = larder(&daemon, &["seal", "--wait", target]).await;
        assert!(!output.status.success(), "{target}: {}", stderr(&output));
        assert!(stderr(&output).contains(message), "{target}: {}", stderr(&output));
    }
    let output = larder(&daemon, &["seal"]).await;
    assert!(!output.status.success());

    let output = larder(&daemon, &["seal", "--wait", "models:a"]).await;
    assert!(!output.status.success(), "{}", stdout(&output));
    assert!(
        stdout(&output).contains("sealed a/b.bin -> .larder-seal/a/b.bin.json"),
        "{}",
        stdout(&output)
    );
    assert!(
        stdout(&output).contains(&format!("failed {long}: its manifest's key")),
        "{}",
        stdout(&output)
    );
    assert!(
        stderr(&output).contains("1 of 2 objects sealed"),
        "{}",
        stderr(&output)
    );
}

/// One key of a prefix cannot be a path (a newline in it): `larder seal --wait` seals the
/// others, names that key as failed (skipped: never read, no manifest) and fails the command,
/// instead of failing whole with a 502 from the listing.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_that_cannot_be_a_path_is_named_and_the_rest_sealed() {
    let server = larder_tests::S3Server::start("larder-seal")
        .await
        .expect("s3 server");
    let good = ["odd/a.bin", "odd/b.bin"];
    for key in good {
        server.put(key, seed(key, 0), 3000).await.expect("put");
    }
    let odd = "odd/line\nbreak.bin";
    // Written into the bucket's files, as an object another client stored.
    std::fs::write(server.bucket_dir().join(odd), "odd").expect("write");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let daemon = std::sync::Arc::new(daemon);

    let output = larder(&daemon, &["seal", "--wait", "models:odd"]).await;
    assert!(
        !stderr(&output).contains("invalid path"),
        "failed whole: {}",
        stderr(&output)
    );
    assert!(!output.status.success(), "{}", stdout(&output));
    for key in good {
        assert!(
            stdout(&output).contains(&format!("sealed {key} -> .larder-seal/{key}.json")),
            "{}",
            stdout(&output)
        );
        assert!(
            server
                .bucket_dir()
                .join(format!(".larder-seal/{key}.json"))
                .exists()
        );
    }
    assert!(
        stdout(&output).contains(&format!("failed {}: ", odd.escape_debug())),
        "{}",
        stdout(&output)
    );
    assert!(
        stderr(&output).contains("2 of 3 objects sealed"),
        "{}",
        stderr(&output)
    );
}
