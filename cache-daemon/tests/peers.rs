//! Rack peers end to end: daemons as separate processes on loopback addresses of their own,
//! SeaweedFS behind a counting proxy as the origin, reads through the kernel mounts.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use larder_peer_proto::auth::{ClusterKey, RequestHead, header};
use larder_peer_proto::wire::{HELLO_PATH, RUN_PATH};
use larder_tests::daemon::DaemonProcess;
use larder_tests::dns::DnsServer;
use larder_tests::fake_peer::{self, FakePeer, Misbehaviour};
use larder_tests::rack::{Listing, Rack, SECRET, TlsFiles, member_args, member_ip, write_key_file};
use larder_tests::seaweed::Seaweed;
use larder_tests::{
    Bucket, Fault, RecordingProxy, content, free_port, seed, upload, upload_in_parts, upload_parts,
};
use object_store::ObjectStoreExt;
use test_case::test_case;

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_larder");
const MODEL: &str = "llama/model.safetensors";
const SECOND: &str = "llama/second.safetensors";

/// Peer deadlines for several members and their origin on a machine of two cores.
const LOADED: &[&str] = &["--peer-first-byte-timeout", "2s", "--peer-stall-timeout", "10s"];

/// How a test object is uploaded: in one PUT (its ETag is the object's MD5) or by the
/// harness's multipart upload (32 MiB parts; the ETag is the MD5 of the parts' MD5s, `-N`).
#[derive(Debug, Clone, Copy)]
enum Upload {
    Single,
    Multipart,
    /// Parts of 5.5 MiB: a part size the origin check does not guess, which S3 says.
    OddParts,
    /// Parts of 5.5 MiB with a CRC64NVME: the store keeps the object's full-object CRC.
    Crc64Nvme,
    /// A first part of 6 MiB, then parts of 5.5 MiB: the ETag cannot be checked.
    UnevenParts,
    /// The same with a CRC64NVME: the store keeps the object's full-object CRC.
    UnevenPartsWithCrc,
    /// One PUT with a CRC64NVME: the ETag is the MD5, and the store keeps the CRC too (as
    /// SeaweedFS does for a boto3 `put_object`, with its CRC32).
    SingleWithCrc,
}

/// SeaweedFS with `size` bytes at [`MODEL`], behind a counting proxy.
async fn origin(size: u64) -> (Seaweed, RecordingProxy) {
    origin_of(&[(MODEL, size, Upload::Multipart)]).await
}

/// SeaweedFS with `objects` (key, size, how) of deterministic content, behind a counting proxy.
async fn origin_of(objects: &[(&str, u64, Upload)]) -> (Seaweed, RecordingProxy) {
    let weed = Seaweed::installed_binary();
    assert!(weed.exists(), "{} is missing: run scripts/test", weed.display());
    let server = tokio::task::spawn_blocking(move || Seaweed::start(&weed, "rack"))
        .await
        .expect("join")
        .expect("weed mini");
    let client = server.client().expect("client");
    for &(key, size, how) in objects {
        match how {
            Upload::Multipart => upload(client.as_ref(), key, seed(key, 0), size)
                .await
                .expect("upload"),
            Upload::OddParts => {
                upload_in_parts(client.as_ref(), key, seed(key, 0), size, 11 << 19)
                    .await
                    .expect("upload");
            }
            Upload::Crc64Nvme => {
                let client = server.crc64nvme_client().expect("client");
                upload_in_parts(client.as_ref(), key, seed(key, 0), size, 11 << 19)
                    .await
                    .expect("upload");
            }
            Upload::UnevenParts | Upload::UnevenPartsWithCrc => {
                let (first, rest) = (6 * MIB, 11 * MIB / 2);
                let mut parts = vec![first];
                while parts.iter().sum::<u64>() < size {
                    parts.push(rest.min(size - parts.iter().sum::<u64>()));
                }
                let client = match how {
                    Upload::UnevenPartsWithCrc => server.crc64nvme_client().expect("client"),
                    _ => client.clone(),
                };
                upload_parts(client.as_ref(), key, seed(key, 0), &parts)
                    .await
                    .expect("upload");
            }
            Upload::Single | Upload::SingleWithCrc => {
                let bytes = content(seed(key, 0), 0, size as usize);
                let client = match how {
                    Upload::SingleWithCrc => server.crc64nvme_client().expect("client"),
                    _ => client.clone(),
                };
                client
                    .put(&object_store::path::Path::from(key), bytes.into())
                    .await
                    .expect("put");
            }
        }
    }
    let proxy = RecordingProxy::start(&server).await.expect("proxy");
    (server, proxy)
}

/// Reads the model through every member's mount at once; panics on a wrong byte.
fn read_everywhere(rack: &Rack, members: &[usize], size: u64) {
    read_while(model_paths(rack, members), size, || {});
}

/// The model's path in the mount of each of `members`.
fn model_paths(rack: &Rack, members: &[usize]) -> Vec<(usize, PathBuf)> {
    members
        .iter()
        .map(|&i| (i, rack.daemon(i).mount.join(MODEL)))
        .collect()
}

/// Reads the model at each of `readers` (member, path) at once while `during` runs, and waits
/// for every read; panics on a wrong byte.
fn read_while(readers: Vec<(usize, PathBuf)>, size: u64, during: impl FnOnce()) {
    let expected = content(seed(MODEL, 0), 0, size as usize);
    std::thread::scope(|scope| {
        let readers: Vec<_> = readers
            .into_iter()
            .map(|(i, path)| {
                let expected = &expected;
                scope.spawn(move || {
                    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("n{i}: {e}"));
                    assert!(bytes == *expected, "n{i} read wrong bytes");
                })
            })
            .collect();
        during();
        for reader in readers {
            reader.join().expect("reader");
        }
    });
}

/// Prints how many peer requests of each member failed, and the first failure.
fn report_failures(rack: &Rack, members: &[usize]) {
    for &i in members {
        let log = rack.log(i);
        let failures: Vec<_> = log.lines().filter(|l| l.contains("rack peer failed")).collect();
        eprintln!(
            "n{i}: {} failed peer requests; first: {:?}",
            failures.len(),
            failures.first()
        );
    }
}

/// Bytes member `i` served its readers from peers, by its status.
fn peer_bytes(rack: &Rack, i: usize) -> u64 {
    let status = rack.daemon(i).status();
    status["served"]["peer_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no peer bytes in {status}"))
}

/// Four members started and listed in the shape `listing` read one model of `size` bytes at
/// once through their mounts: the origin sends it about once, and every member received some
/// of it from the others.
async fn four_members_read_one_model(listing: Listing, size: u64) -> (Seaweed, RecordingProxy, Rack) {
    let (server, proxy) = origin(size).await;
    let (rack, proxy) = tokio::task::spawn_blocking(move || {
        // Four members and the origin share two cores here: deadlines for that.
        let rack = Rack::start_listed(Path::new(BIN), &proxy, 4, LOADED, &[], listing).expect("rack");
        let started = Instant::now();
        read_everywhere(&rack, &[0, 1, 2, 3], size);
        eprintln!(
            "4 members read {} MiB each in {:?}",
            size / MIB,
            started.elapsed()
        );
        (rack, proxy)
    })
    .await
    .expect("join");
    let fetched = proxy.body_bytes();
    report_failures(&rack, &[0, 1, 2, 3]);
    eprintln!("origin sent {fetched} bytes for a model of {size}");
    assert!(
        fetched as f64 <= 1.15 * size as f64,
        "{listing:?}: the origin sent {fetched} bytes, {:.2}x the model",
        fetched as f64 / size as f64
    );
    for i in 0..4 {
        assert!(peer_bytes(&rack, i) > 0, "n{i} read nothing from peers");
    }
    (server, proxy, rack)
}

/// Four nodes in two racks of two read one model at once: the origin sends it about once for
/// the whole fleet, not once per rack, and what crosses the spine (bytes from members of the
/// other rack) is at most the model once per rack. Before, each rack's owners filled their runs
/// from the origin: it sent 2x the model.
#[tokio::test(flavor = "multi_thread")]
async fn two_racks_reading_one_model_at_once_pull_it_from_the_origin_about_once() {
    let size = 128 * MIB;
    let listing = Listing {
        racks: 2,
        ..Listing::HARNESS
    };
    let (_server, _proxy, rack) = four_members_read_one_model(listing, size).await;
    let spine: f64 = (0..4)
        .map(|i| {
            rack.metric(i, "larder_peer_fetched_across_racks_bytes_total")
                .expect("metrics")
        })
        .sum();
    eprintln!("across the spine: {spine} bytes for a model of {size}");
    assert!(spine > 0.0, "no bytes crossed the spine: the racks did not share");
    assert!(
        spine <= 2.0 * size as f64,
        "{:.2}x the model crossed the spine",
        spine / size as f64
    );
    for i in 0..4 {
        for (id, rack_label, state, _) in members_seen(&rack, i) {
            let expected = if id == "n0" || id == "n1" { "r1" } else { "r2" };
            assert_eq!(rack_label, expected, "n{i} sees {id}");
            assert_ne!(state, "down", "n{i} sees {id}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn four_members_reading_one_model_at_once_pull_it_from_the_origin_about_once() {
    let (server, proxy, rack) = four_members_read_one_model(Listing::HARNESS, 512 * MIB).await;

    // The same with `larder prefetch --wait` on all four at once.
    let second = 256 * MIB;
    let client = server.client().expect("client");
    upload(client.as_ref(), SECOND, seed(SECOND, 0), second)
        .await
        .expect("upload");
    let before = proxy.body_bytes();
    let rack = tokio::task::spawn_blocking(move || {
        std::thread::scope(|scope| {
            for i in 0..4 {
                let rack = &rack;
                scope.spawn(move || {
                    let target = format!("models:{SECOND}");
                    let output = rack.daemon(i).larder(&["prefetch", "--wait", &target]);
                    let warnings: Vec<_> = rack
                        .log(i)
                        .lines()
                        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                        .map(str::to_owned)
                        .collect();
                    assert!(
                        output.status.success(),
                        "n{i} prefetch: {}\nits log's warnings:\n{}",
                        String::from_utf8_lossy(&output.stderr),
                        warnings.join("\n")
                    );
                });
            }
        });
        rack
    })
    .await
    .expect("join");
    let fetched = proxy.body_bytes() - before;
    eprintln!("origin sent {fetched} bytes for a prefetch of {second} on four members");
    assert!(
        fetched as f64 <= 1.15 * second as f64,
        "prefetch: the origin sent {:.2}x the object",
        fetched as f64 / second as f64
    );
    drop(rack);
}

/// Each member's view of the others in its status: `(id, rack, state, note)`.
fn members_seen(rack: &Rack, i: usize) -> Vec<(String, String, String, String)> {
    let status = rack.daemon(i).status();
    let members = status["peers"]["members"].as_array().cloned().unwrap_or_default();
    members
        .iter()
        .filter(|m| m["state"] != "this")
        .map(|m| {
            let text = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
            (text("id"), text("rack"), text("state"), text("note"))
        })
        .collect()
}

/// Members listed without `@RACK` (the README's grammar makes it optional), all on one address
/// with a port each: they learn each other's rack and share the model as if it were listed.
/// Before the fix each ranked itself alone in its rack, and the origin sent 4.00x the model.
#[tokio::test(flavor = "multi_thread")]
async fn members_listed_without_a_rack_on_one_address_share_the_model() {
    let listing = Listing {
        one_address: true,
        racks_listed: false,
        node_rack: true,
        racks: 1,
    };
    let (_server, _proxy, rack) = four_members_read_one_model(listing, 128 * MIB).await;
    for i in 0..4 {
        for (id, rack_label, state, note) in members_seen(&rack, i) {
            assert_eq!((rack_label.as_str(), note.as_str()), ("r1", ""), "n{i} sees {id}");
            assert_ne!(state, "down", "n{i} sees {id}");
        }
    }
}

/// Nodes started without `--rack` and listed without `@RACK`, an address each: one rack of
/// unnamed racks, sharing the model.
#[tokio::test(flavor = "multi_thread")]
async fn nodes_without_a_rack_listed_without_one_share_the_model() {
    let listing = Listing {
        one_address: false,
        racks_listed: false,
        node_rack: false,
        racks: 1,
    };
    let (_server, _proxy, rack) = four_members_read_one_model(listing, 128 * MIB).await;
    for i in 0..4 {
        for (id, rack_label, _, note) in members_seen(&rack, i) {
            assert_eq!((rack_label.as_str(), note.as_str()), ("", ""), "n{i} sees {id}");
        }
    }
    let status = rack.daemon(0).larder(&["status"]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("peer n1 (rack -, "), "{text}");
    // The rack's share beside the hit rate: bytes from members are not hits.
    assert!(text.contains("from rack peers (bytes): "), "{text}");
    let share = rack.daemon(0).status()["served"]["peer_share"]
        .as_f64()
        .unwrap_or(0.0);
    assert!(share > 0.0, "no share from the rack in n0's status");
}

/// Member `i`'s peer requests that ended with `result`, by its metrics.
fn peer_requests(rack: &Rack, i: usize, result: &str) -> f64 {
    let series = format!("larder_peer_requests_total{{result=\"{result}\"}}");
    rack.metric(i, &series).expect("metrics")
}

/// A model of `size` bytes, read through the mount of a rack of one member whose only peer is
/// a fake one that misbehaves as `misbehaviour`; the member started with `extra` flags.
async fn read_beside_a_fake(
    misbehaviour: Misbehaviour,
    size: u64,
    extra: &'static [&'static str],
) -> (Rack, FakePeer, RecordingProxy, Seaweed) {
    let (server, proxy) = origin(size).await;
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let fake = FakePeer::start(key, misbehaviour).await.expect("fake peer");
    let member = format!("f={}@r1", fake.address);
    let (rack, proxy, fake) = tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 1, extra, &[member]).expect("rack");
        read_everywhere(&rack, &[0], size);
        (rack, proxy, fake)
    })
    .await
    .expect("join");
    report_failures(&rack, &[0]);
    assert!(fake.requests() > 0, "the fake member owned no run of the model");
    (rack, fake, proxy, server)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_owner_costs_a_deadline_and_the_origin_serves_its_runs() {
    let extra = &["--peer-stall-timeout", "1s"];
    let (rack, ..) = read_beside_a_fake(Misbehaviour::StallAfterHead, 64 * MIB, extra).await;
    assert!(peer_requests(&rack, 0, "timeout") > 0.0);
    assert_eq!(peer_bytes(&rack, 0), 0);
}

/// A peer's block is checked group by group as it arrives: an owner whose first 16 KiB does
/// not hash to the value it sent is dropped then, as bad data, not after the stall deadline
/// the rest of the block would have taken.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_group_from_an_owner_ends_its_answer_as_it_arrives() {
    // A stall deadline longer than the test takes: waiting for the block's end would end in
    // a timeout, a minute later.
    let extra = &["--peer-stall-timeout", "60s"];
    let (rack, ..) = read_beside_a_fake(Misbehaviour::BadGroupThenStall, 64 * MIB, extra).await;
    assert!(peer_requests(&rack, 0, "bad_data") > 0.0);
    // The first failure is the bad group, not a stall (a later request, once the member's
    // circuit closes again, may meet a loaded machine's first-byte deadline).
    let log = rack.log(0);
    let first = log
        .lines()
        .find(|l| l.contains("rack peer failed"))
        .unwrap_or_default();
    assert!(
        first.contains("group 0 does not hash to its value"),
        "the first failure is not the bad group: {first}"
    );
    assert_eq!(peer_bytes(&rack, 0), 0);
}

/// The origin's bytes of ranged GETs within blocks `blocks` of `key` (`block` bytes each).
fn origin_bytes_within(proxy: &RecordingProxy, key: &str, blocks: std::ops::Range<u64>, block: u64) -> u64 {
    let (start, end) = (blocks.start * block, blocks.end * block);
    proxy
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(key))
        .filter_map(|r| {
            let (a, b) = r.range.as_deref()?.strip_prefix("bytes=")?.split_once('-')?;
            let (a, b): (u64, u64) = (a.parse().ok()?, b.parse().ok()?);
            Some((b + 1).min(end).saturating_sub(a.max(start)))
        })
        .sum()
}

/// An owner that answers late (past the first-byte deadline) but is alive costs the asker one
/// block from the origin, not the run: the asker takes that block from the origin so that its
/// reader moves on, then asks the owner again for the rest.
#[tokio::test(flavor = "multi_thread")]
async fn a_late_owner_costs_one_block_from_the_origin_not_its_run() {
    let late = Misbehaviour::LateOnce(Duration::from_secs(3));
    let extra = &["--peer-first-byte-timeout", "1s"];
    let (rack, fake, proxy, _server) = read_beside_a_fake(late, 64 * MIB, extra).await;
    let late = fake.late_runs();
    let [(_, first, count)] = late.as_slice() else {
        panic!("the fake member answered {late:?} late: it was asked for no run of two blocks or more");
    };
    let block = 4 * MIB;
    let run = u64::from(*first)..u64::from(first + count);
    let from_origin = origin_bytes_within(&proxy, MODEL, run.clone(), block);
    assert!(
        from_origin <= block,
        "the origin sent {from_origin} bytes of the late run's blocks {run:?}"
    );
    assert!(peer_bytes(&rack, 0) > 0);
    // The late run's block, and any other answer that came late on a loaded machine.
    let hedged = hedged_blocks(&rack, 0);
    assert!(hedged >= 1.0, "no block was taken from the origin");
}

/// Member `i`'s status entry for member `id`.
fn member_entry(rack: &Rack, i: usize, id: &str) -> serde_json::Value {
    let status = rack.daemon(i).status();
    let members = status["peers"]["members"].as_array().cloned().unwrap_or_default();
    members
        .into_iter()
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("no member {id} in {status}"))
}

/// A member whose answers pass their first 100 KB and then trickle (1 B/s), or each come at a
/// steady 100 KB/s (a fault proxy between the members, as a congested or failing link would
/// be): the asker takes each of its blocks from the origin once it is slower than the rate
/// floor, holds it against the member until its circuit opens, and the read succeeds. Before,
/// every byte moved the stall deadline on: the reader got ETIMEDOUT after 70 s (119 s at
/// 100 KB/s) and no block was hedged.
#[test_case(Fault::Trickle { after: 100_000, per_second: 1 } ; "trickle after 100 KB")]
#[test_case(Fault::Trickle { after: 0, per_second: 100_000 } ; "a steady 100 KB per second")]
#[tokio::test(flavor = "multi_thread")]
async fn a_member_slower_than_the_rate_floor_is_hedged_and_the_read_succeeds(fault: Fault) {
    // Eight parts: n1 owns some of them but for one chance in 256.
    let size = 128 * MIB;
    let (_server, proxy) = origin(size).await;
    // n0 reaches n1 through the slow link; n1 reaches n0 directly.
    let (link, start) = two_members_one_behind_a_proxy(proxy).await;
    link.set_fault(fault);
    let (rack, took) = tokio::task::spawn_blocking(move || {
        let (rack, _origin) = start();
        let started = Instant::now();
        let read = std::fs::read(rack.daemon(0).mount.join(MODEL));
        let took = started.elapsed();
        let expected = content(seed(MODEL, 0), 0, size as usize);
        match read {
            Ok(bytes) => assert!(bytes == expected, "wrong bytes"),
            Err(error) => panic!("the read failed after {took:?}: {error}; log:\n{}", rack.log(0)),
        }
        (rack, took)
    })
    .await
    .expect("join");
    report_failures(&rack, &[0]);
    eprintln!("{fault:?}: read {} MiB in {took:?}", size / MIB);
    assert!(!link.requests().is_empty(), "n0 never asked n1");
    assert!(peer_requests(&rack, 0, "timeout") >= 1.0);
    let hedged = hedged_blocks(&rack, 0);
    assert!(hedged >= 1.0, "no block of the slow member's runs was hedged");
    let n1 = member_entry(&rack, 0, "n1");
    assert!(
        n1["failures"].as_u64() >= Some(1),
        "no strike against the slow member: {n1}"
    );
}

/// Two members of rack r1 over the origin behind `proxy`, n0 reaching n1 through a proxy of
/// its own (returned, to slow or cut that link) and n1 reaching n0 directly; the rack is
/// started by the function returned (it blocks: call it off the runtime), which hands back
/// the origin's proxy with it.
async fn two_members_one_behind_a_proxy(
    proxy: RecordingProxy,
) -> (
    RecordingProxy,
    impl FnOnce() -> (Rack, RecordingProxy) + Send + 'static,
) {
    let addresses: Vec<SocketAddr> = (0..2)
        .map(|i| SocketAddr::from((member_ip(i), free_port(member_ip(i)).expect("port"))))
        .collect();
    let link = RecordingProxy::start_to(&addresses[1].to_string())
        .await
        .expect("proxy");
    let through = link.endpoint().trim_start_matches("http://").to_owned();
    let lists = vec![
        format!("n0={}@r1,n1={through}@r1", addresses[0]),
        format!("n0={}@r1,n1={}@r1", addresses[0], addresses[1]),
    ];
    let racks = vec!["r1".to_owned(); 2];
    let start = move || {
        let rack =
            Rack::start_with_lists(Path::new(BIN), &proxy, addresses, racks, lists, &[]).expect("rack");
        (rack, proxy)
    };
    (link, start)
}

/// Waits up to `within` for member `i` to say member `id` is `state`; how long that took.
fn wait_for_state(rack: &Rack, i: usize, id: &str, state: &str, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let now = rack.member_state(i, id);
        if now == format!("\"{state}\"") {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "n{i} still says {id} is {now} after {within:?}, not {state}; log:\n{}",
            rack.log(i)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// On a node no read goes through, a member that stops answering is marked down within a
/// bounded time, and comes back up once it answers again: members are probed while idle (an
/// authenticated hello every `peer.probe_interval`, default 10s). Before, only traffic moved
/// a member's state: an idle node never said a member was up, and kept a dead one up for
/// ever, so `LarderRackMembersDown` resolved while the member was still dead.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_node_probes_its_members_so_a_dead_one_is_down_and_a_live_one_up() {
    let (_server, proxy) = origin(MIB).await;
    // n0 reaches n1 through a proxy that can make n1 look dead.
    let (link, start) = two_members_one_behind_a_proxy(proxy).await;
    let (rack, _origin) = tokio::task::spawn_blocking(start).await.expect("join");
    let bound = Duration::from_secs(40);
    let (rack, link) = tokio::task::spawn_blocking(move || {
        let up = wait_for_state(&rack, 0, "n1", "up", bound);
        link.set_fault(Fault::CloseConnections);
        let down = wait_for_state(&rack, 0, "n1", "down", bound);
        link.set_fault(Fault::PassThrough);
        let back = wait_for_state(&rack, 0, "n1", "up", bound);
        eprintln!("n1 up after {up:?}, down {down:?} after it stopped answering, up {back:?} after it answered again");
        (rack, link)
    })
    .await
    .expect("join");
    // No read went through n0: what reached n1 was probes, at most one each interval (and the
    // few of the start).
    let hellos = link.requests().len();
    assert!(hellos < 20, "{hellos} requests to n1 from an idle node");
    assert_eq!(
        peer_requests(&rack, 0, "hit") + peer_requests(&rack, 0, "filled"),
        0.0
    );
}

/// Blocks member `i` took from the origin because an owner was late, by its metrics.
fn hedged_blocks(rack: &Rack, i: usize) -> f64 {
    rack.metric(i, "larder_peer_hedged_blocks_total")
        .expect("metrics")
}

/// Members `readers` read the model of `size` bytes through their mounts while member
/// `victim` is killed (SIGKILL) once it has sent peers something: each must read the right
/// bytes.
fn read_while_killing(rack: &mut Rack, readers: &[usize], victim: usize, size: u64) {
    read_while(model_paths(rack, readers), size, || {
        let started = Instant::now();
        while rack
            .metric(victim, "larder_peer_sent_bytes_total")
            .expect("metrics")
            == 0.0
        {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "n{victim} never served a peer"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        rack.kill9(victim).expect("kill");
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_killed_mid_transfer_leaves_its_askers_reading_the_right_bytes() {
    let size = 256 * MIB;
    let (_server, proxy) = origin(size).await;
    // A slow origin, so that the owner dies with runs in flight.
    proxy.set_fault(Fault::Latency(Duration::from_millis(200)));
    tokio::task::spawn_blocking(move || {
        let mut rack = Rack::start(Path::new(BIN), &proxy, 3, LOADED, &[]).expect("rack");
        read_while_killing(&mut rack, &[0, 1], 2, size);
        report_failures(&rack, &[0, 1]);
        let fetched = |i| {
            rack.metric(i, "larder_peer_fetched_bytes_total")
                .expect("metrics")
        };
        assert!(
            fetched(0) > 0.0 && fetched(1) > 0.0,
            "a member fetched nothing from peers"
        );
        // The kill cut answers short (a connection that broke off counts as refused).
        let cut = peer_requests(&rack, 0, "refused") + peer_requests(&rack, 1, "refused");
        assert!(cut > 0.0, "no answer was cut by the kill");
    })
    .await
    .expect("join");
}

/// Two racks of two; n2, an owner in the second rack (of its rack's runs, and the fleet owner
/// of some), is killed while n0, n1 and n3 read a model through it: every reader gets the right
/// bytes, and the origin sends the model about once more at most (only n2's runs move: to their
/// next candidate at each level).
#[tokio::test(flavor = "multi_thread")]
async fn a_rack_owner_killed_mid_transfer_moves_only_its_runs_across_two_racks() {
    let size = 128 * MIB;
    let (_server, proxy) = origin(size).await;
    // A slow origin, so that the owner dies with runs in flight.
    proxy.set_fault(Fault::Latency(Duration::from_millis(200)));
    let listing = Listing {
        racks: 2,
        ..Listing::HARNESS
    };
    let (rack, proxy) = tokio::task::spawn_blocking(move || {
        let mut rack = Rack::start_listed(Path::new(BIN), &proxy, 4, LOADED, &[], listing).expect("racks");
        read_while_killing(&mut rack, &[0, 1, 3], 2, size);
        (rack, proxy)
    })
    .await
    .expect("join");
    report_failures(&rack, &[0, 1, 3]);
    let fetched = proxy.body_bytes() as f64 / size as f64;
    eprintln!("the origin sent {fetched:.2}x the model");
    assert!(fetched <= 2.0, "the origin sent {fetched:.2}x the model");
    let across = |i| {
        rack.metric(i, "larder_peer_fetched_across_racks_bytes_total")
            .expect("metrics")
    };
    assert!(across(0) + across(1) + across(3) > 0.0, "nothing crossed racks");
    assert_eq!(rack.member_state(3, "n2"), "\"down\"");
}

/// Two racks of two, every request between them through a proxy (one per member, for the other
/// rack), read one model; once something has crossed, the link between the racks is cut (the
/// proxies close every connection). Each rack goes on without the other: every reader gets the
/// right bytes, answers across the cut fail and their runs go to the next candidate (in the
/// asker's own rack, which fetches them from the origin), and the origin sends the model at
/// most about once per rack.
#[tokio::test(flavor = "multi_thread")]
async fn racks_cut_off_from_each_other_mid_read_each_go_on_alone() {
    let size = 256 * MIB;
    let (_server, proxy) = origin(size).await;
    // A slow origin, so that the cut comes with runs in flight.
    proxy.set_fault(Fault::Latency(Duration::from_millis(200)));
    let addresses: Vec<SocketAddr> = (0..4)
        .map(|i| SocketAddr::from((member_ip(i), free_port(member_ip(i)).expect("port"))))
        .collect();
    let rack_of = |i: usize| if i < 2 { "r1" } else { "r2" };
    let mut between = Vec::new();
    for address in &addresses {
        between.push(
            RecordingProxy::start_to(&address.to_string())
                .await
                .expect("proxy"),
        );
    }
    let lists: Vec<String> = (0..4)
        .map(|i| {
            let entries: Vec<String> = (0..4)
                .map(|j| {
                    let seen = if rack_of(i) == rack_of(j) {
                        addresses[j].to_string()
                    } else {
                        between[j].endpoint().trim_start_matches("http://").to_owned()
                    };
                    format!("n{j}={seen}@{}", rack_of(j))
                })
                .collect();
            entries.join(",")
        })
        .collect();
    let racks = (0..4).map(|i| rack_of(i).to_owned()).collect();
    let (rack, proxy) = tokio::task::spawn_blocking(move || {
        let rack =
            Rack::start_with_lists(Path::new(BIN), &proxy, addresses, racks, lists, LOADED).expect("racks");
        read_while(model_paths(&rack, &[0, 1, 2, 3]), size, || {
            // Cut at the first bytes between the racks.
            let started = Instant::now();
            while between.iter().all(|p| p.body_bytes() == 0) {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "nothing crossed racks"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            for cut in &between {
                cut.set_fault(Fault::CloseConnections);
            }
        });
        (rack, proxy)
    })
    .await
    .expect("join");
    report_failures(&rack, &[0, 1, 2, 3]);
    let fetched = proxy.body_bytes() as f64 / size as f64;
    eprintln!("the origin sent {fetched:.2}x the model");
    assert!(fetched <= 2.3, "the origin sent {fetched:.2}x the model");
    let cut: f64 = (0..4).map(|i| peer_requests(&rack, i, "refused")).sum();
    assert!(
        cut > 0.0,
        "no request across the cut failed: the cut came too late"
    );
}

/// The answer to `request`, sent as is to `address`: its status line and headers, and its
/// body as far as its `content-length` says.
fn exchange(address: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(address).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = stream.write_all(request);
    let mut answer = Vec::new();
    let mut buf = [0; 4096];
    while !complete(&answer) {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// Whether `answer` holds a whole HTTP answer: its head, and its body as far as its
/// `content-length` says.
fn complete(answer: &[u8]) -> bool {
    let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: ")?.trim().parse::<usize>().ok())
        .unwrap_or(0);
    answer.len() >= end + 4 + length
}

/// The answer to `request`, sent as is to `address` from a connection bound to `source` (the
/// address a member is listed at, or another).
async fn exchange_from(source: Ipv4Addr, address: SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::from((source, 0))).expect("bind");
    let mut stream = socket.connect(address).await.expect("connect");
    let _ = stream.write_all(request).await;
    let mut answer = Vec::new();
    let mut buf = [0; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !complete(&answer) {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// A GET of `path` signed with `key` as node `node` for member `to`, at `time_ms`, with `nonce`.
fn signed(key: &ClusterKey, path: &str, node: &str, to: &str, time_ms: u64, nonce: [u8; 16]) -> Vec<u8> {
    let head = RequestHead {
        method: "GET",
        path_and_query: path,
        node,
        to,
        time_ms,
        nonce,
    };
    let mac = hex::encode(key.request_mac(&head));
    format!(
        "GET {path} HTTP/1.1\r\nhost: x\r\n{}: {node}\r\n{}: {to}\r\n{}: {time_ms}\r\n{}: {}\r\n{}: {mac}\r\n\r\n",
        header::NODE,
        header::TO,
        header::TIME,
        header::NONCE,
        hex::encode(nonce),
        header::MAC,
    )
    .into_bytes()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread")]
async fn unauthenticated_replayed_and_abusive_requests_are_refused_and_the_member_keeps_serving() {
    let size = 8 * MIB;
    let (_server, proxy) = origin(size).await;
    tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 1, &[], &[]).expect("rack");
        let address = rack.addresses[0];
        let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
        let other = ClusterKey::from_secret(&[b'x'; 40]).expect("other key");
        let requests_before = proxy.requests().len();

        let status = |answer: &str| answer.lines().next().unwrap_or_default().to_owned();
        let unsigned = exchange(address, format!("GET {HELLO_PATH} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes());
        assert!(status(&unsigned).contains(" 401 "), "no headers: {unsigned}");
        let wrong_key = exchange(address, &signed(&other, HELLO_PATH, "a", "n0", now_ms(), [1; 16]));
        assert!(status(&wrong_key).contains(" 401 "), "another key: {wrong_key}");
        assert!(wrong_key.contains("cluster key is not"), "another key is named: {wrong_key}");
        // Clocks two minutes apart: the answer says so, and that the key is not in question
        // (the asker's log quotes it; before, it blamed the key).
        let stale = exchange(address, &signed(&key, HELLO_PATH, "a", "n0", now_ms() - 120_000, [2; 16]));
        assert!(status(&stale).contains(" 401 "), "two minutes old: {stale}");
        assert!(
            stale.contains("sync the nodes' clocks") && stale.contains("key is not in question"),
            "{stale}"
        );
        let once = signed(&key, HELLO_PATH, "a", "n0", now_ms(), [3; 16]);
        assert!(status(&exchange(address, &once)).contains(" 200 "), "a good request");
        let replayed = exchange(address, &once);
        assert!(status(&replayed).contains(" 401 "), "replayed: {replayed}");
        // A run of a URL-shaped source, and a run past the object's end: refused, nothing fetched.
        let run = format!("{RUN_PATH}?object=00&source=http%3A%2F%2Felsewhere&key=k&version=-&size=1&block_size=4194304&first=0&count=1");
        let malformed = exchange(address, &signed(&key, &run, "a", "n0", now_ms(), [4; 16]));
        assert!(status(&malformed).contains(" 400 "), "malformed run: {malformed}");
        // The same run signed for another member (seen on its way there, sent here instead),
        // and one signed for no member in particular: refused before it is read.
        let elsewhere = exchange(address, &signed(&key, &run, "a", "n1", now_ms(), [6; 16]));
        assert!(status(&elsewhere).contains(" 401 "), "signed for n1: {elsewhere}");
        let anyone = exchange(address, &signed(&key, &run, "a", "", now_ms(), [7; 16]));
        assert!(status(&anyone).contains(" 401 "), "a run signed for no member: {anyone}");

        // A header of a megabyte: refused without reading it all.
        let mut huge = format!("GET {HELLO_PATH} HTTP/1.1\r\nhost: x\r\nx-filler: ").into_bytes();
        huge.extend(std::iter::repeat_n(b'a', 1 << 20));
        huge.extend_from_slice(b"\r\n\r\n");
        let answer = exchange(address, &huge);
        assert!(
            answer.is_empty() || status(&answer).contains(" 431 ") || status(&answer).contains(" 400 "),
            "a megabyte of header: {answer}"
        );
        // A client that sends its head a byte every 300 ms (12 s for the head) is cut off when
        // its 2 s to send a head are up (the README's limit; 2 s more for a loaded machine).
        let mut slow = TcpStream::connect(address).expect("connect");
        slow.set_read_timeout(Some(Duration::from_millis(300))).expect("read timeout");
        let started = Instant::now();
        let mut answer = [0; 256];
        let cut = format!("GET {HELLO_PATH} HTTP/1.1\r\nhost: x\r\n").bytes().any(|byte| {
            // A write after the close fails; a read sees the close (or an answer before it),
            // else waits 300 ms for one.
            slow.write_all(&[byte]).is_err()
                || match slow.read(&mut answer) {
                    Ok(_) => true,
                    Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                }
        });
        let took = started.elapsed();
        assert!(cut, "a client sending its head a byte at a time was never cut off");
        assert!(took < Duration::from_secs(4), "a slow client was cut off after {took:?}, not 2 s");

        assert_eq!(proxy.requests().len(), requests_before, "refused requests reached the origin");
        let hello = exchange(address, &signed(&key, HELLO_PATH, "a", "", now_ms(), [5; 16]));
        assert!(status(&hello).contains(" 200 "), "the member stopped serving: {hello}");
        read_everywhere(&rack, &[0], size);
    })
    .await
    .expect("join");
}

/// A member's rack is taken only from the member itself: a hello signed as n1 (anyone with the
/// key can sign so) from an address that is not n1's listed one does not move n1 to another
/// rack; a rack label the config would refuse (a line break, 6,000 bytes) is refused from
/// anyone; and each change of n1's rack is logged. Before, n0 took `rack=r9` for n1 from
/// any address, kept it, and said nothing, and a line break reached `larder status`.
#[tokio::test(flavor = "multi_thread")]
async fn a_members_rack_is_taken_only_from_its_own_address_checked_and_logged() {
    let (_server, proxy) = origin(MIB).await;
    // n1 is listed without a rack, at an address nobody listens on: its rack is not known.
    let n1 = SocketAddr::from((member_ip(1), free_port(member_ip(1)).expect("port")));
    let others = [format!("n1={n1}")];
    let rack = tokio::task::spawn_blocking(move || {
        Rack::start(Path::new(BIN), &proxy, 1, &[], &others).expect("rack")
    })
    .await
    .expect("join");
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let address = rack.addresses[0];
    let mut nonce = 0;
    let mut hello = |rack_label: &str| {
        nonce += 1;
        let path = larder_peer_proto::wire::hello_path(rack_label);
        signed(&key, &path, "n1", "n0", now_ms(), [nonce; 16])
    };
    let status = |answer: &str| answer.lines().next().unwrap_or_default().to_owned();
    let n1_rack = || {
        member_entry(&rack, 0, "n1")["rack"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };

    // Signed as n1, from another address than n1's.
    let forged = exchange_from(Ipv4Addr::LOCALHOST, address, &hello("r9")).await;
    eprintln!("forged hello: {}", status(&forged));
    assert_eq!(n1_rack(), "", "a hello from another address moved n1 to its rack");
    // Labels the config refuses, even from n1's own address.
    for bad in ["r1\nr2", &"x".repeat(6000)] {
        let answer = exchange_from(member_ip(1), address, &hello(bad)).await;
        assert!(
            status(&answer).contains(" 400 "),
            "rack {:?}: {answer}",
            &bad[..bad.len().min(8)]
        );
        assert_eq!(n1_rack(), "", "a bad label became n1's rack");
    }
    // From n1's listed address: taken, and each change logged.
    for label in ["r2", "r3"] {
        let answer = exchange_from(member_ip(1), address, &hello(label)).await;
        assert!(status(&answer).contains(" 200 "), "{answer}");
        assert_eq!(n1_rack(), label);
    }
    let log = rack.log(0);
    let changes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("rack") && l.contains("n1"))
        .collect();
    assert!(
        changes.iter().any(|l| l.contains("r2"))
            && changes.iter().any(|l| l.contains("r2") && l.contains("r3")),
        "the changes of n1's rack were not logged: {changes:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lying_member_is_caught_by_the_sealed_manifest_and_its_bytes_never_served_or_kept() {
    let size = 64 * MIB;
    let (_server, proxy) = origin(size).await;
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let liar = FakePeer::start(key, Misbehaviour::Lie).await.expect("fake peer");
    let member = format!("f={}@r1", liar.address);
    let (rack, liar) = tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 1, &[], &[member]).expect("rack");
        let sealed = rack.daemon(0).larder(&["seal", "--wait", "models:llama"]);
        assert!(
            sealed.status.success(),
            "seal: {}",
            String::from_utf8_lossy(&sealed.stderr)
        );
        read_everywhere(&rack, &[0], size);
        (rack, liar)
    })
    .await
    .expect("join");
    assert!(liar.requests() > 0, "the liar owned no run of the model");
    assert!(peer_requests(&rack, 0, "bad_data") > 0.0);
    assert_eq!(peer_bytes(&rack, 0), 0);
    // What the cache kept is the origin's: a second read comes from disk, right.
    tokio::task::spawn_blocking(move || read_everywhere(&rack, &[0], size))
        .await
        .expect("join");
}

/// The ids of the members `rack`'s member `i` knows, itself included, sorted.
fn member_ids(rack: &Rack, i: usize) -> Vec<String> {
    let status = rack.daemon(i).status();
    let mut ids: Vec<String> = status["peers"]["members"]
        .as_array()
        .unwrap_or_else(|| panic!("no members in {status}"))
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_owned())
        .collect();
    ids.sort();
    ids
}

/// Waits until member `i` of `rack` knows exactly `ids`.
fn wait_for_members(rack: &Rack, i: usize, ids: &[&str]) {
    let started = Instant::now();
    while member_ids(rack, i) != ids {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "n{i} knows {:?}, not {ids:?}",
            member_ids(rack, i)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn members_found_by_dns_join_and_leave_during_a_read() {
    const NAME: &str = "larder-peers.rack.test";
    let size = 256 * MIB;
    let (_server, proxy) = origin(size).await;
    // A slow origin (8 s for the model), so that the read is still going when the members
    // change.
    proxy.set_fault(Fault::Bandwidth(32 * MIB));
    let dns = DnsServer::start().await.expect("dns server");
    let ip = |i: usize| IpAddr::V4(member_ip(i));
    // n3 runs from the start but is not in the name's answer yet.
    dns.set(NAME, &[ip(0), ip(1), ip(2)]);
    let server = dns.address;
    let dns = tokio::task::spawn_blocking(move || {
        let mut rack = Rack::start_dns(Path::new(BIN), &proxy, 4, LOADED, NAME, server).expect("rack");
        wait_for_members(&rack, 0, &["n0", "n1", "n2"]);
        let expected = content(seed(MODEL, 0), 0, size as usize);
        std::thread::scope(|scope| {
            let path = rack.daemon(0).mount.join(MODEL);
            let reader = scope.spawn(|| {
                let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("n0: {e}"));
                assert!(bytes == expected, "n0 read wrong bytes");
            });
            // Once n0 has had blocks from peers: n3 joins, n2 leaves (and dies).
            let started = Instant::now();
            while rack
                .metric(0, "larder_peer_fetched_bytes_total")
                .expect("metrics")
                == 0.0
            {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "n0 had nothing from peers"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            dns.set(NAME, &[ip(0), ip(1), ip(3)]);
            rack.kill9(2).expect("kill n2");
            wait_for_members(&rack, 0, &["n0", "n1", "n3"]);
            assert!(!reader.is_finished(), "the read ended before the members changed");
            reader.join().expect("reader");
        });
        report_failures(&rack, &[0]);
        // Every live member knows the new members, and a read on the newcomer is right.
        wait_for_members(&rack, 1, &["n0", "n1", "n3"]);
        read_everywhere(&rack, &[3], size);
        assert!(peer_bytes(&rack, 3) > 0, "n3 read nothing from peers");
        dns
    })
    .await
    .expect("join");
    drop(dns);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rack_over_tls_shares_blocks_and_a_member_of_another_ca_gets_none() {
    let size = 64 * MIB;
    let (_server, proxy) = origin(size).await;
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = TlsFiles::make(dir.path(), "ours").expect("certificates");
        let theirs = TlsFiles::make(dir.path(), "theirs").expect("certificates");
        let args = |files: &TlsFiles| {
            let mut args: Vec<String> = LOADED.iter().map(|a| (*a).to_owned()).collect();
            args.extend(files.args());
            args
        };
        let ours_args = args(&ours);
        let ours_args: Vec<&str> = ours_args.iter().map(String::as_str).collect();
        let rack = Rack::start(Path::new(BIN), &proxy, 2, &ours_args, &[]).expect("rack");
        read_everywhere(&rack, &[0], size);
        read_everywhere(&rack, &[1], size);
        assert!(
            peer_bytes(&rack, 0) > 0 && peer_bytes(&rack, 1) > 0,
            "no blocks crossed over TLS"
        );
        assert!(
            proxy.body_bytes() as f64 <= 1.15 * size as f64,
            "the origin sent {:.2}x the model",
            proxy.body_bytes() as f64 / size as f64
        );
        // Plain HTTP gets no answer from a TLS listener.
        let answer = exchange(
            rack.addresses[0],
            format!("GET {HELLO_PATH} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes(),
        );
        assert!(!answer.starts_with("HTTP/"), "plain HTTP was answered: {answer}");
        // A client that never starts its handshake is cut off after the read timeout (2 s).
        let mut stalled = TcpStream::connect(rack.addresses[0]).expect("connect");
        stalled
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let started = Instant::now();
        let read = stalled.read(&mut [0; 16]);
        assert!(
            matches!(read, Ok(0)) && started.elapsed() < Duration::from_secs(5),
            "a stalled handshake: {read:?} after {:?}",
            started.elapsed()
        );

        // A member whose CA is another one trusts neither member, and they not it: it reads
        // everything from the origin.
        let members: Vec<String> = rack
            .addresses
            .iter()
            .enumerate()
            .map(|(i, address)| format!("ours{i}={address}@r1"))
            .collect();
        let theirs_args = args(&theirs);
        let theirs_args: Vec<&str> = theirs_args.iter().map(String::as_str).collect();
        let before = proxy.body_bytes();
        let stranger = Rack::start(Path::new(BIN), &proxy, 1, &theirs_args, &members).expect("stranger");
        read_everywhere(&stranger, &[0], size);
        assert_eq!(peer_bytes(&stranger, 0), 0);
        assert!(
            peer_requests(&stranger, 0, "refused") > 0.0,
            "the stranger asked no member"
        );
        // (Besides the model, the origin's answers for the missing manifest.)
        let fetched = proxy.body_bytes() - before;
        assert!(
            fetched >= size,
            "the stranger had {fetched} bytes from the origin"
        );
    })
    .await
    .expect("join");
}

/// A member that lies (wrong bytes with their own BLAKE3 and tags) and no sealed manifest:
/// its bytes reach the reader, but once the object is complete its check against the origin's
/// ETag drops them; a reread gets the origin's bytes, fetched again; the liar is marked down.
async fn a_lying_member_is_caught_by_the_origin_checksum(
    how: Upload,
    lie: Misbehaviour,
    extra: &'static [&'static str],
) {
    let size = 64 * MIB;
    let (_server, proxy) = origin_of(&[(MODEL, size, how)]).await;
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let liar = FakePeer::start(key, lie).await.expect("fake peer");
    let member = format!("f={}@r1", liar.address);
    let expected = content(seed(MODEL, 0), 0, size as usize);
    let (rack, proxy, first, caught) = tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 1, extra, &[member]).expect("rack");
        let first = std::fs::read(rack.daemon(0).mount.join(MODEL)).expect("first read");
        let caught = rack.wait_for_origin_checks(0, "mismatch", 1.0);
        (rack, proxy, first, caught)
    })
    .await
    .expect("join");
    assert!(liar.requests() > 0, "the liar owned no run of the model");
    assert!(
        first != expected,
        "the liar's bytes never reached the cache: the test proves nothing"
    );
    let before = proxy.body_bytes();
    let (rack, reread) = tokio::task::spawn_blocking(move || {
        let reread = std::fs::read(rack.daemon(0).mount.join(MODEL)).expect("reread");
        (rack, reread)
    })
    .await
    .expect("join");
    assert!(
        reread == expected,
        "the liar's blocks stayed in the cache: a reread got wrong bytes"
    );
    assert!(caught, "no mismatch counted; log:\n{}", rack.log(0));
    assert!(
        proxy.body_bytes() > before,
        "the reread did not fetch the dropped blocks from the origin"
    );
    assert_eq!(rack.origin_checks(0, "match"), 0.0);
    assert_eq!(rack.origin_checks(0, "crc_only"), 0.0);
    assert_eq!(rack.member_state(0, "f"), "\"down\"");
    let log = rack.log(0);
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("origin's checksum")
            && l.contains(MODEL)
            && l.contains("\"f\"")),
        "no warning naming the object and the member:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lying_member_is_caught_by_the_md5_etag_of_a_single_part_upload() {
    a_lying_member_is_caught_by_the_origin_checksum(Upload::Single, Misbehaviour::Lie, &[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lying_member_is_caught_by_the_etag_of_a_multipart_upload() {
    a_lying_member_is_caught_by_the_origin_checksum(Upload::Multipart, Misbehaviour::Lie, &[]).await;
}

/// The origin publishes a CRC and the MD5 ETag; the liar keeps every block's CRC. Before the
/// fix the check used the CRC, counted a match and kept the forged blocks. (The liar makes its
/// answers in a test build: a deadline long enough for that.)
#[tokio::test(flavor = "multi_thread")]
async fn a_member_forging_the_crc_is_caught_by_the_md5_etag_beside_it() {
    let extra = &["--peer-first-byte-timeout", "20s", "--peer-stall-timeout", "30s"];
    a_lying_member_is_caught_by_the_origin_checksum(
        Upload::SingleWithCrc,
        Misbehaviour::ForgeCrc64Nvme,
        extra,
    )
    .await;
}

/// Every kind of ETag the origin publishes checks a truthful member's blocks without the
/// origin sending them again: a single-part MD5 ETag, a multipart ETag of 32 MiB parts
/// (guessed), of 5.5 MiB parts (S3 says the first part's size), and a multipart upload with a
/// full-object CRC64NVME beside its ETag (the ETag, the stronger, is used).
#[tokio::test(flavor = "multi_thread")]
async fn a_truthful_rack_passes_the_origin_check_and_nothing_is_fetched_twice() {
    let objects = [
        (MODEL, 64 * MIB, Upload::Single),
        ("llama/shard.bin", 96 * MIB, Upload::Multipart),
        ("llama/odd.bin", 64 * MIB, Upload::OddParts),
        ("llama/crc.bin", 64 * MIB, Upload::Crc64Nvme),
    ];
    let total: u64 = objects.iter().map(|o| o.1).sum();
    let (_server, proxy) = origin_of(&objects).await;
    let (rack, proxy, checked) = tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 2, LOADED, &[]).expect("rack");
        for (key, size, _) in objects {
            let bytes = std::fs::read(rack.daemon(0).mount.join(key)).expect("read");
            assert!(
                bytes == content(seed(key, 0), 0, size as usize),
                "{key}: wrong bytes"
            );
        }
        let checked = rack.wait_for_origin_checks(0, "match", objects.len() as f64);
        (rack, proxy, checked)
    })
    .await
    .expect("join");
    report_failures(&rack, &[0, 1]);
    assert!(peer_bytes(&rack, 0) > 0, "n0 read nothing from its peer");
    assert!(checked, "not every object was checked; log:\n{}", rack.log(0));
    assert_eq!(rack.origin_checks(0, "mismatch"), 0.0);
    assert_eq!(rack.origin_checks(0, "unchecked"), 0.0);
    assert_eq!(rack.member_state(0, "n1"), "\"up\"");
    // Each byte once (and the blocks of answers that came late on a loaded machine): the
    // checks read the cache, not the origin.
    let fetched = proxy.body_bytes();
    let hedged = hedged_blocks(&rack, 0) * (4 * MIB) as f64;
    assert!(
        fetched as f64 <= 1.05 * total as f64 + hedged,
        "the origin sent {fetched} bytes for {total} of objects"
    );
    // Each object was read back from the cache for its MD5s, none combined from CRCs.
    let read_back = rack
        .metric(0, "larder_peer_origin_check_read_bytes_total")
        .expect("metrics");
    assert_eq!(read_back, total as f64);
    assert_eq!(rack.origin_checks(0, "crc_only"), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prefetch_with_a_lying_member_fails_until_the_origin_check_passes() {
    let size = 64 * MIB;
    let (_server, proxy) = origin_of(&[(MODEL, size, Upload::Single)]).await;
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let liar = FakePeer::start(key, Misbehaviour::Lie).await.expect("fake peer");
    let member = format!("f={}@r1", liar.address);
    let (rack, first) = tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 1, &[], &[member]).expect("rack");
        let first = rack.daemon(0).larder(&["prefetch", "--wait", "models:llama"]);
        (rack, first)
    })
    .await
    .expect("join");
    assert!(liar.requests() > 0, "the liar owned no run of the model");
    let said = String::from_utf8_lossy(&first.stderr).into_owned() + &String::from_utf8_lossy(&first.stdout);
    assert!(
        !first.status.success(),
        "a prefetch with the liar's blocks reported done: {said}"
    );
    assert!(said.contains("origin's checksum"), "{said}");
    // The liar is left out now: the second run fills the dropped blocks from the origin.
    tokio::task::spawn_blocking(move || {
        let again = rack.daemon(0).larder(&["prefetch", "--wait", "models:llama"]);
        assert!(
            again.status.success(),
            "{}",
            String::from_utf8_lossy(&again.stderr)
        );
        read_everywhere(&rack, &[0], size);
    })
    .await
    .expect("join");
}

/// ETags that do not give the content's MD5 (here: parts of two sizes, which neither the first
/// part's size nor a guess gives) cost the origin the members' blocks of one object, compared
/// once, not of every object. An object of that origin with a CRC is then checked against the
/// CRC alone, which is counted `crc_only` and said by a prefetch of it, not called a match.
#[tokio::test(flavor = "multi_thread")]
async fn etags_that_are_not_the_md5_cost_one_comparison_per_origin_not_one_per_object() {
    const SHARD: &str = "llama/shard.bin";
    const WITH_CRC: &str = "llama/with-crc.bin";
    let size = 64 * MIB;
    let (_server, proxy) = origin_of(&[
        (MODEL, size, Upload::UnevenParts),
        (SHARD, size, Upload::UnevenParts),
        (WITH_CRC, size, Upload::UnevenPartsWithCrc),
    ])
    .await;
    let (rack, proxy, first_from_peer) = tokio::task::spawn_blocking(move || {
        let rack = Rack::start(Path::new(BIN), &proxy, 2, LOADED, &[]).expect("rack");
        // Bytes received from the peer (a reader may have been served some of them from disk).
        let mut first_from_peer = 0.0;
        for key in [MODEL, SHARD] {
            if key == SHARD {
                first_from_peer = rack
                    .metric(0, "larder_peer_fetched_bytes_total")
                    .expect("metrics");
            }
            let bytes = std::fs::read(rack.daemon(0).mount.join(key)).expect("read");
            assert!(
                bytes == content(seed(key, 0), 0, size as usize),
                "{key}: wrong bytes"
            );
            // One object's check at a time, in the order read.
            assert!(
                rack.wait_for_origin_checks(0, "match", 1.0),
                "no check; log:\n{}",
                rack.log(0)
            );
        }
        assert!(
            rack.wait_for_origin_checks(0, "unchecked", 1.0),
            "the second object was compared too"
        );
        (rack, proxy, first_from_peer)
    })
    .await
    .expect("join");
    assert!(peer_bytes(&rack, 0) > 0, "n0 read nothing from its peer");
    assert_eq!(rack.origin_checks(0, "match"), 1.0);
    assert_eq!(rack.origin_checks(0, "mismatch"), 0.0);
    // Both objects once, and the first object's blocks from the peer a second time (and the
    // blocks of answers that came late on a loaded machine).
    let fetched = proxy.body_bytes() as f64;
    let hedged = hedged_blocks(&rack, 0) * (4 * MIB) as f64;
    let bound = 1.02 * (2 * size) as f64 + first_from_peer + hedged;
    assert!(
        fetched <= bound,
        "the origin sent {fetched} bytes, more than the objects and the first one's {first_from_peer} bytes from the peer"
    );

    // The third: its multipart ETag is known not to be the MD5 here, its CRC is all there is.
    let said = tokio::task::spawn_blocking(move || {
        let bytes = std::fs::read(rack.daemon(0).mount.join(WITH_CRC)).expect("read");
        assert!(
            bytes == content(seed(WITH_CRC, 0), 0, size as usize),
            "wrong bytes"
        );
        assert!(
            rack.wait_for_origin_checks(0, "crc_only", 1.0),
            "no CRC check; log:\n{}",
            rack.log(0)
        );
        let prefetch = rack
            .daemon(0)
            .larder(&["prefetch", "--wait", &format!("models:{WITH_CRC}")]);
        assert!(
            prefetch.status.success(),
            "{}",
            String::from_utf8_lossy(&prefetch.stderr)
        );
        assert_eq!(rack.origin_checks(0, "match"), 1.0, "a CRC was called a match");
        String::from_utf8_lossy(&prefetch.stderr).into_owned()
    })
    .await
    .expect("join");
    assert!(
        said.contains("1 object(s) checked against the origin's CRC only"),
        "{said}"
    );
}

/// A rack pre-pulling one image on every member at once fetches each blob from the registry
/// about once: members ask the owner of each run for image content as for any object, by the
/// content's digest. Each member then serves the image whole and verified to containerd.
#[tokio::test(flavor = "multi_thread")]
async fn a_rack_pre_pulling_an_image_fetches_it_from_the_registry_about_once() {
    use larder_tests::Bucket;
    use larder_tests::oci::{Containerd, Registry, TestImage, hosts_dir, is_blob_get, push};
    const HOST: &str = "registry.larder.test";
    let (_server, bucket) = origin_of(&[]).await;
    let (image, registry) = tokio::task::spawn_blocking(|| {
        let image = TestImage::write(21, 48 * MIB).expect("image");
        let registry = Registry::start().expect("registry");
        push(image.path(), registry.address(), "larder/test:v1", None).expect("push");
        (image, registry)
    })
    .await
    .expect("join");
    let proxy = RecordingProxy::start_to(registry.address()).await.expect("proxy");
    let upstream = format!("{HOST}={}", proxy.endpoint());
    let rack = tokio::task::spawn_blocking(move || {
        let mut extra = vec!["--registry-upstream", &upstream];
        extra.extend_from_slice(LOADED);
        let rack = Rack::start(Path::new(BIN), &bucket, 3, &extra, &[]).expect("rack");
        let target = format!("image:{HOST}/larder/test:v1");
        std::thread::scope(|scope| {
            let prefetches: Vec<_> = (0..3)
                .map(|i| {
                    let (rack, target) = (&rack, &target);
                    scope.spawn(move || {
                        rack.daemon(i)
                            .larder(&["prefetch", "--wait", "--platform", "linux/amd64", target])
                    })
                })
                .collect();
            for (i, prefetch) in prefetches.into_iter().enumerate() {
                let output = prefetch.join().expect("thread");
                assert!(
                    output.status.success(),
                    "n{i}: {}\nlog:\n{}",
                    String::from_utf8_lossy(&output.stderr),
                    rack.log(i)
                );
            }
        });
        rack
    })
    .await
    .expect("join");
    let amd64 = image.image("linux/amd64").expect("amd64");
    let blobs = amd64.layer_bytes() + amd64.config.size;
    let wanted = image.pulled("linux/amd64").expect("amd64");
    let fetched = proxy.body_bytes_of(is_blob_get);
    assert!(
        fetched as f64 <= 1.15 * blobs as f64,
        "the registry sent {fetched} blob bytes for {blobs} to a rack of 3"
    );
    let from_peers: f64 = (0..3)
        .map(|i| rack.metric(i, "larder_peer_fetched_bytes_total").expect("metric"))
        .sum();
    assert!(from_peers > 0.0, "no member fetched from a peer");

    // Each member serves the image whole: containerd pulls it from n2 with every digest right.
    let mirror = format!("http://{}", rack.registries[2]);
    tokio::task::spawn_blocking(move || {
        let hosts = tempfile::tempdir().expect("hosts");
        hosts_dir(hosts.path(), HOST, &mirror, "http://127.0.0.1:1").expect("hosts.toml");
        let containerd = Containerd::start().expect("containerd");
        let reference = format!("{HOST}/larder/test:v1");
        let pull = containerd
            .pull(&reference, Some(hosts.path()), Some("linux/amd64"))
            .expect("ctr");
        assert!(pull.status.success(), "{}", String::from_utf8_lossy(&pull.stderr));
        assert_eq!(containerd.content_digests().expect("content"), wanted);
        drop(rack);
        drop(registry);
    })
    .await
    .expect("join");
    assert!(proxy.body_bytes_of(is_blob_get) as f64 <= 1.15 * blobs as f64);
}

/// A lying member supplies one run (a 4 KiB read), the daemon is restarted without peers: the
/// record kept that those blocks came from a member unchecked, so the prefetch that completes
/// the object checks it, drops them and fails; run again, it fetches them from the origin.
/// Before the fix the prefetch said done and every later read got the liar's bytes.
#[tokio::test(flavor = "multi_thread")]
async fn blocks_from_a_member_are_checked_after_a_restart_and_no_prefetch_calls_them_done() {
    let size = 64 * MIB;
    let (_server, proxy) = origin_of(&[(MODEL, size, Upload::Single)]).await;
    let key = ClusterKey::from_secret(SECRET.as_bytes()).expect("key");
    let liar = FakePeer::start(key, Misbehaviour::Lie).await.expect("fake peer");
    tokio::task::spawn_blocking(move || {
        let root = tempfile::tempdir().expect("tempdir");
        let key_file = write_key_file(root.path(), SECRET).expect("key file");
        let listen = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).expect("port"));
        let mut args = member_args("n0", Some("r1"), &listen, &key_file);
        args.extend([
            "--peers".to_owned(),
            format!("{}={}@r1", fake_peer::ID, liar.address),
        ]);
        // Deadlines a loaded machine keeps: a liar found late would have its run hedged to
        // the origin, and no block of its would be cached (seen once in a full run).
        args.extend(["--peer-first-byte-timeout", "20s", "--peer-stall-timeout", "30s"].map(str::to_owned));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let dir = root.path().join("n0");
        std::fs::create_dir_all(&dir).expect("dir");
        let daemon = DaemonProcess::start(Path::new(BIN), &proxy, &dir, &args).expect("daemon");
        // One 4 KiB read at the start of each part until the liar has answered one.
        let file = std::fs::File::open(daemon.mount.join(MODEL)).expect("open");
        let mut page = [0; 4096];
        for part in 0..size / (16 * MIB) {
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut page, part * 16 * MIB).expect("read");
            if liar.requests() > 0 {
                break;
            }
        }
        drop(file);
        assert!(liar.requests() > 0, "the liar owned no run of the model");
        let written = Instant::now();
        while daemon.status()["blocks"].as_u64().unwrap_or(0) < 4 {
            assert!(
                written.elapsed() < Duration::from_secs(30),
                "the liar's run was never cached"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        daemon.stop().expect("stop");
        drop(liar);

        // Peers off now: the check needs only the origin.
        let daemon = DaemonProcess::start(Path::new(BIN), &proxy, &dir, &[]).expect("restart");
        let target = format!("models:{MODEL}");
        let first = daemon.larder(&["prefetch", "--wait", &target]);
        let said =
            String::from_utf8_lossy(&first.stderr).into_owned() + &String::from_utf8_lossy(&first.stdout);
        assert!(
            !first.status.success(),
            "a prefetch over a member's unchecked blocks reported done: {said}"
        );
        assert!(said.contains("origin's checksum"), "{said}");
        let again = daemon.larder(&["prefetch", "--wait", &target]);
        assert!(
            again.status.success(),
            "{}",
            String::from_utf8_lossy(&again.stderr)
        );
        let bytes = std::fs::read(daemon.mount.join(MODEL)).expect("read");
        assert!(
            bytes == content(seed(MODEL, 0), 0, size as usize),
            "the liar's bytes outlived the restart"
        );
    })
    .await
    .expect("join");
}
