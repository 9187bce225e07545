//! A Hugging Face model in a bucket, read through the mount by `huggingface_hub` (PyPI, in
//! bench/.venv, installed by scripts/test) offline, as docs/HUGGINGFACE.md says to lay it out:
//! the hub cache's snapshot as plain objects (no symlinks: a store keeps none) and its
//! `refs/main`.

use std::path::Path;
use std::process::Command;

use larder_tests::daemon::DaemonProcess;
use larder_tests::{S3Server, content, seed};

const BIN: &str = env!("CARGO_BIN_EXE_larder");
const REPO: &str = "hub/models--larder--tiny-llama";
const REVISION: &str = "5f1a2b3c4d5e6f708192a3b4c5d6e7f809102030";
const WEIGHTS: usize = (9 << 20) + 3;

/// `HF_HUB_CACHE` at the mount's `hub/` and `HF_HUB_OFFLINE=1`: `snapshot_download` and
/// `hf_hub_download` find the model by its name, at the revision `refs/main` names, and every
/// byte read through the snapshot's path is the bucket's.
#[tokio::test(flavor = "multi_thread")]
async fn huggingface_hub_finds_a_model_in_the_bucket_offline() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let snapshot = format!("{REPO}/snapshots/{REVISION}");
    let weights_key = format!("{snapshot}/model.safetensors");
    server
        .put(&weights_key, seed(&weights_key, 0), WEIGHTS)
        .await
        .expect("put");
    let bucket = server.bucket_dir();
    std::fs::create_dir_all(bucket.join(REPO).join("refs")).expect("refs dir");
    std::fs::write(bucket.join(REPO).join("refs/main"), REVISION).expect("refs/main");
    std::fs::write(
        bucket.join(&snapshot).join("config.json"),
        r#"{"model_type": "llama"}"#,
    )
    .expect("config.json");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/bin/python3");
    let script = r#"
import hashlib, sys
from huggingface_hub import hf_hub_download, snapshot_download
path = snapshot_download("larder/tiny-llama")
print(path)
print(open(hf_hub_download("larder/tiny-llama", "config.json")).read())
weights = hf_hub_download("larder/tiny-llama", "model.safetensors")
print(hashlib.sha256(open(weights, "rb").read()).hexdigest())
"#;
    let output = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .args(["-c", script])
            .env("HF_HUB_CACHE", daemon.mount.join("hub"))
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .expect("python3 with huggingface_hub (scripts/test installs it in bench/.venv)")
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].ends_with(&format!("hub/models--larder--tiny-llama/snapshots/{REVISION}")),
        "{stdout}"
    );
    assert_eq!(lines[1], r#"{"model_type": "llama"}"#, "{stdout}");
    let expected = content(seed(&weights_key, 0), 0, WEIGHTS);
    let expected = {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(&expected))
    };
    assert_eq!(lines[2], expected, "the weights read are not the bucket's");
}
