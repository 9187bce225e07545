//! End to end against a GCS emulator (fake-gcs-server, see `larder_tests::gcs` for where it
//! differs from the real service): the mount reads an object right cold, warm (the page cache
//! dropped) and after a restart of the daemon, the last from the cache alone.

use std::path::Path;

use larder_tests::daemon::DaemonProcess;
use larder_tests::gcs::FakeGcs;
use larder_tests::{content, seed};

const BIN: &str = env!("CARGO_BIN_EXE_larder");
const KEY: &str = "llama/model.safetensors";
const SIZE: usize = 64 << 20;

/// Lists the object's directory (as `ls` does), then reads the object through the mount, the
/// page cache dropped first; whether its bytes are right.
fn read_right(daemon: &DaemonProcess) -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
    let listed: Vec<_> = std::fs::read_dir(daemon.mount.join("llama"))
        .expect("list")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert_eq!(listed, ["model.safetensors"]);
    std::fs::read(daemon.mount.join(KEY)).expect("read") == content(seed(KEY, 0), 0, SIZE)
}

/// Before, a read after a listing got ESTALE: the emulator lists an object's ETag bare and
/// quotes it in a GET's answer, and the daemon took the two for different versions.
#[test]
fn the_mount_reads_a_gcs_object_cold_warm_and_after_a_restart() {
    let bytes = content(seed(KEY, 0), 0, SIZE);
    let gcs = FakeGcs::start("models", &[(KEY, &bytes)]).expect("fake-gcs-server");
    let env = gcs.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let start =
        || DaemonProcess::start_with_env(Path::new(BIN), &gcs, dir.path(), &[], &env).expect("daemon");
    let daemon = start();
    assert!(read_right(&daemon), "cold: wrong bytes");
    let origin = daemon.status()["served"]["origin_bytes"].as_u64().expect("bytes");
    assert!(origin >= SIZE as u64, "cold: {origin} bytes from the origin");
    assert!(read_right(&daemon), "warm: wrong bytes");
    daemon.stop().expect("stop");
    let daemon = start();
    assert!(read_right(&daemon), "after a restart: wrong bytes");
    let status = daemon.status();
    assert_eq!(status["served"]["origin_bytes"], 0, "{status}");
}
