//! Larder's shared test harness: a real S3 server, deterministic object content, and a
//! fault-injecting `ObjectStore` wrapper with a request log.
//!
//! - [`S3Server`] runs s3s-fs (a real S3 implementation over a local directory) in-process on a
//!   loopback port, with signatures enforced.
//! - [`content`] is a seeded function of (key, generation, offset): any range of any object
//!   can be checked without keeping a copy.
//! - [`daemon::DaemonProcess`] runs `larder daemon` as a child process with a real mount.
//! - [`fixture::CacheFixture`] is a block cache over that server, for the engine's tests.
//! - [`rack::Rack`] runs several daemons as the members of one rack, on loopback addresses.
//! - [`seaweed::Seaweed`] runs SeaweedFS, a production object store, for end-to-end runs.
//! - [`dns::DnsServer`] answers A/AAAA queries on loopback from a table the test changes, for
//!   peer membership by DNS.
//! - [`kube::ApiServer`] answers and records the Node patches of the Kubernetes API server;
//!   [`kube::manifests`] reads `deploy/kubernetes` for the tests that check and run it.
//! - [`RecordingProxy`] logs the requests made to a server that keeps no log (SeaweedFS, an OCI
//!   registry), counts the body bytes it returns (in all and per request), and injects a
//!   [`Fault`] switched at run time (latency, bandwidth, stall after headers, a cut connection, a
//!   flipped byte, connections closed unanswered): the TCP fault proxy of process tests.
//! - [`oci`] holds the real components of the OCI registry mirror's tests: a registry
//!   ([`oci::Registry`]), a multi-platform test image, a pusher (skopeo) and containerd.
//! - [`gcs::FakeGcs`], [`azurite::Azurite`] and [`webdav::WebDav`] run the emulators of GCS and
//!   Azure Blob Storage and a WebDAV server (the HTTP origin's), each on a port of its own.
//! - [`FaultStore`] forwards every `ObjectStore` method to a real store, logging requests and
//!   injecting the faults of a [`FaultPlan`].

pub mod azurite;
pub mod daemon;
pub mod dns;
pub mod fake_peer;
mod fault;
pub mod faulty_disk;
pub mod fixture;
pub mod gcs;
mod http1;
pub mod kube;
pub mod logs;
pub mod oci;
mod ports;
mod proxy;
pub mod rack;
pub mod seaweed;
mod server;
pub mod webdav;

pub use fault::{FaultPlan, FaultStore, Request, RequestKind};
pub use ports::free_port;
pub use proxy::{Fault, RecordingProxy};
pub use server::{
    ACCESS_KEY, S3Server, SECRET_KEY, ServedRequest, s3_client, s3_client_with_crc64nvme,
    s3_client_with_secret,
};

/// Uploads `size` bytes of deterministic content with `seed` at `key`, in parts of 32 MiB,
/// without holding the whole object in memory.
pub async fn upload(
    store: &dyn object_store::ObjectStore,
    key: &str,
    seed: u64,
    size: u64,
) -> anyhow::Result<()> {
    upload_in_parts(store, key, seed, size, 32 << 20).await
}

/// As [`upload`], in parts of `part_size` bytes (the last one shorter).
pub async fn upload_in_parts(
    store: &dyn object_store::ObjectStore,
    key: &str,
    seed: u64,
    size: u64,
    part_size: usize,
) -> anyhow::Result<()> {
    use object_store::ObjectStoreExt;
    let upload = store.put_multipart(&object_store::path::Path::from(key)).await?;
    let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, part_size);
    let mut offset = 0;
    while offset < size {
        let len = (size - offset).min(8 << 20) as usize;
        writer.write(&content(seed, offset, len));
        offset += len as u64;
    }
    writer.finish().await?;
    Ok(())
}

/// Uploads deterministic content with `seed` at `key` in one multipart upload whose parts
/// have the sizes `parts`, in order.
pub async fn upload_parts(
    store: &dyn object_store::ObjectStore,
    key: &str,
    seed: u64,
    parts: &[u64],
) -> anyhow::Result<()> {
    use object_store::ObjectStoreExt;
    let mut upload = store.put_multipart(&object_store::path::Path::from(key)).await?;
    let mut offset = 0;
    for &len in parts {
        upload
            .put_part(content(seed, offset, len as usize).into())
            .await?;
        offset += len;
    }
    upload.complete().await?;
    Ok(())
}

/// An S3 bucket a daemon can be pointed at.
pub trait Bucket {
    /// `http://127.0.0.1:<port>`.
    fn endpoint(&self) -> String;
    /// `s3://<bucket>`.
    fn url(&self) -> String;
}

impl Bucket for S3Server {
    fn endpoint(&self) -> String {
        S3Server::endpoint(self)
    }

    fn url(&self) -> String {
        S3Server::url(self)
    }
}

impl Bucket for seaweed::Seaweed {
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn url(&self) -> String {
        seaweed::Seaweed::url(self)
    }
}

/// A splitmix64 step: a well-mixed 64-bit function of its input.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The seed of one object generation: overwrite an object with `generation + 1` to get
/// different bytes under the same key.
pub fn seed(key: &str, generation: u64) -> u64 {
    key.bytes()
        .fold(mix(generation), |acc, b| mix(acc ^ u64::from(b)))
}

/// `len` bytes of the object with `seed`, starting at `offset`.
pub fn content(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut word = offset / 8;
    let skip = (offset % 8) as usize;
    while out.len() < len {
        let bytes = mix(seed ^ word.wrapping_mul(0x2545_f491_4f6c_dd1d)).to_le_bytes();
        let from = if out.is_empty() { skip } else { 0 };
        let take = (8 - from).min(len - out.len());
        out.extend_from_slice(&bytes[from..from + take]);
        word += 1;
    }
    out
}

/// Runs `command` with `args`, which must succeed: its standard output, or an error with its
/// standard error.
pub fn run<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(command: &str, args: &[S]) -> anyhow::Result<String> {
    let output = std::process::Command::new(command)
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("run {command}: {e}"))?;
    anyhow::ensure!(
        output.status.success(),
        "{command} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_a_function_of_offset() {
        let whole = content(7, 0, 1000);
        for (offset, len) in [(0, 1000), (3, 17), (8, 8), (999, 1), (123, 500)] {
            assert_eq!(content(7, offset as u64, len), whole[offset..offset + len]);
        }
        assert_ne!(content(seed("a", 0), 0, 64), content(seed("a", 1), 0, 64));
        assert_ne!(content(seed("a", 0), 0, 64), content(seed("b", 0), 0, 64));
    }
}
