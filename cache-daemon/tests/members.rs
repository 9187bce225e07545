//! Rack membership from DNS: a real DNS server on loopback (the harness's `DnsServer`) whose
//! answers the test changes, the daemon's resolver asking it, and a fake `Hello` standing in
//! for the peers' own answers. Members join and leave as their addresses do; only their runs
//! move.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use larder_config::PeerConfig;
use larder_peer_proto::client::PeerError;
use larder_peer_proto::owner::RunId;
use larder_peer_proto::wire::Hello as Said;
use larder_peers::members::{Hello, MemberHealth, Membership, Peer};
use larder_tests::dns::DnsServer;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const NAME: &str = "peers.larder.test";
const PORT: u16 = 7070;

/// Answers for each address the id and rack the test gave it; an address it did not is
/// silent (an error), as a peer that is not up yet.
#[derive(Default)]
struct FakeHello {
    nodes: Mutex<HashMap<String, (String, String)>>,
    asked: Mutex<Vec<String>>,
}

impl FakeHello {
    fn answer(&self, ip: &str, id: &str, rack: &str) {
        self.nodes
            .lock()
            .insert(format!("{ip}:{PORT}"), (id.into(), rack.into()));
    }

    fn asked(&self, ip: &str) -> usize {
        let address = format!("{ip}:{PORT}");
        self.asked.lock().iter().filter(|a| **a == address).count()
    }
}

impl Hello for FakeHello {
    fn hello<'a>(&'a self, address: &'a str, _to: &'a str) -> BoxFuture<'a, Result<Said, PeerError>> {
        self.asked.lock().push(address.to_owned());
        let answer = self.nodes.lock().get(address).cloned();
        Box::pin(async move {
            let (node, rack) = answer.ok_or_else(|| PeerError::Connect {
                address: address.to_owned(),
                reason: "connection refused".to_owned(),
            })?;
            Ok(Said { node, rack })
        })
    }
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|ip| ip.parse().unwrap()).collect()
}

fn ids(membership: &Membership) -> Vec<String> {
    membership.states().into_iter().map(|m| m.id).collect()
}

/// Waits (at most 10 s) until the membership has acted on a resolution of the name that began
/// after this call: three resolutions' queries (an A and an AAAA each) answered from now on,
/// so one began and ended after the call, and its successor's queries prove it was acted on.
async fn resolved_again(dns: &DnsServer) {
    let (start, from) = (Instant::now(), dns.answered());
    while dns.answered() < from + 6 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the name was not resolved again"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (at most 10 s) until `ok` holds for the membership.
async fn until(membership: &Membership, what: &str, ok: impl Fn(&Membership) -> bool) {
    let start = Instant::now();
    while !ok(membership) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what}: {:?}",
            membership.states()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn runs() -> Vec<RunId> {
    (0u64..300)
        .map(|i| RunId {
            object: *blake3::hash(&(i / 10).to_le_bytes()).as_bytes(),
            part: i % 10,
        })
        .collect()
}

fn owners(membership: &Membership) -> Vec<Vec<Peer>> {
    runs().iter().map(|run| membership.owners(run)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_members_join_and_leave_and_only_their_runs_move() {
    let dns = DnsServer::start().await.expect("dns server");
    dns.set(NAME, &ips(&["127.0.0.2", "127.0.0.3"]));
    let hello = Arc::new(FakeHello::default());
    hello.answer("127.0.0.2", "a", "r1");
    hello.answer("127.0.0.3", "b", "r1");
    let config = PeerConfig {
        dns: Some(format!("{NAME}:{PORT}")),
        dns_interval: Duration::from_millis(100),
        dns_server: Some(dns.address),
        members: vec!["s=127.0.0.9:7070@r1".parse().unwrap()],
        ..PeerConfig::default()
    };
    let membership = Membership::new(&config, "a".into(), "r1".into());
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    membership.spawn_dns(&tasks, stop.clone(), hello.clone());

    // This node's own address answers with its own id: it stays one member, now with an
    // address; b joins; the static member is there from the start.
    until(&membership, "b joins", |m| ids(m) == ["a", "b", "s"]).await;
    let states = membership.states();
    assert_eq!(states[0].state, MemberHealth::This);
    assert_eq!(states[0].address, "127.0.0.2:7070");
    assert_eq!(states[1].address, "127.0.0.3:7070");
    assert_eq!(states[1].state, MemberHealth::Unknown);
    let before = owners(&membership);

    // c joins: only the runs c now owns move, each to c.
    dns.set(NAME, &ips(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]));
    hello.answer("127.0.0.4", "c", "r1");
    until(&membership, "c joins", |m| ids(m).contains(&"c".to_owned())).await;
    let with_c = owners(&membership);
    let mut moved = 0;
    for (old, new) in before.iter().zip(&with_c) {
        if new[0].id == "c" {
            moved += 1;
        } else {
            assert_eq!(old[0], new[0]);
        }
        let without_c: Vec<_> = new.iter().filter(|p| p.id != "c").cloned().collect();
        assert_eq!(&without_c, old);
    }
    assert!(moved > 0 && moved < with_c.len(), "{moved}");

    // b's address leaves DNS: b leaves, and only its runs move, to their next candidate.
    dns.set(NAME, &ips(&["127.0.0.2", "127.0.0.4"]));
    until(&membership, "b leaves", |m| ids(m) == ["a", "c", "s"]).await;
    let without_b = owners(&membership);
    for (old, new) in with_c.iter().zip(&without_b) {
        let expected: Vec<_> = old.iter().filter(|p| p.id != "b").cloned().collect();
        assert_eq!(&expected, new);
    }

    // The name stops resolving: the last members stay.
    dns.remove(NAME);
    resolved_again(&dns).await;
    assert_eq!(ids(&membership), ["a", "c", "s"]);

    // A DNS member with a static member's id is that member: one entry, the configured
    // address; when it leaves DNS, the static member stays. An address that does not say who
    // it is is not a member, and is asked again at the next resolution.
    hello.answer("127.0.0.5", "s", "r1");
    dns.set(NAME, &ips(&["127.0.0.2", "127.0.0.4", "127.0.0.5", "127.0.0.6"]));
    until(&membership, "127.0.0.6 asked twice", |_| {
        hello.asked("127.0.0.6") >= 2
    })
    .await;
    assert_eq!(ids(&membership), ["a", "c", "s"]);
    let s = membership.states().into_iter().find(|m| m.id == "s").unwrap();
    assert_eq!(s.address, "127.0.0.9:7070");
    hello.answer("127.0.0.6", "d", "r2");
    until(&membership, "d joins once it answers", |m| {
        ids(m) == ["a", "c", "d", "s"]
    })
    .await;
    // An address already known is not asked again.
    let asked_c = hello.asked("127.0.0.4");
    resolved_again(&dns).await;
    assert_eq!(hello.asked("127.0.0.4"), asked_c);
    assert_eq!(asked_c, 1);
    dns.set(NAME, &ips(&["127.0.0.2", "127.0.0.4", "127.0.0.6"]));
    resolved_again(&dns).await;
    assert_eq!(ids(&membership), ["a", "c", "d", "s"]);

    stop.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .expect("the DNS task stops when told");
}
