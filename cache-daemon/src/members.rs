//! Rack membership: who the peers are, which of them owns a run, and which are failing.
//!
//! Members come from the config's static list and, where `peer.dns` is set, from the addresses
//! of a DNS name (a Kubernetes headless Service) resolved again every `dns_interval`. A DNS
//! answer gives addresses only: each new address is asked its node id and rack ([`Hello`])
//! before it becomes a member; an address that leaves the answer leaves the membership, so its
//! runs move to their next candidate. A static member and a DNS member with the same id are
//! one member. This node is always a member.
//!
//! [`Membership::owners`] ranks the members for a run by rendezvous hashing, this node's rack
//! first ([`larder_peer_proto::owner::candidates`]); every node with the same members ranks
//! them the same way. A per-member circuit breaker leaves out a member that just failed: for
//! [`FIRST_BACKOFF`] after a failure, twice as long after each further failure in a row, at
//! most [`MAX_BACKOFF`]; then it is tried again, and one success closes the circuit. A member
//! that was only slow (a timeout, an answer that broke off) is left out so only after
//! [`SLOW_STRIKES`] such failures in a row: a loaded node that misses one deadline keeps its
//! runs, or every asker would take them to the origin for the whole backoff. A member whose
//! blocks the origin check proved wrong is left out for [`MAX_BACKOFF`] at once.
//!
//! Time is tokio's clock, so tests can pause and advance it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Resolver, TokioResolver};
use larder_config::PeerConfig;
use larder_peer_proto::owner::{self, Member, Run};
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::control_api::{MemberHealth, MemberState, RackBytes};

/// How long a member stays out after its first failure in a row.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(10);

/// Slow answers in a row (timeouts, answers that broke off) after which a member is left out.
pub const SLOW_STRIKES: u32 = 3;

/// The longest a member stays out, however many failures in a row it has.
pub const MAX_BACKOFF: Duration = Duration::from_secs(120);

/// How long a new DNS address has to say who it is before it is asked again at the next
/// resolution.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// A member to ask for a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its node id.
    pub id: String,
    /// Its rack label.
    pub rack: String,
    /// `HOST:PORT` of its peer listener.
    pub address: String,
}

/// Asks the peer at an address who it is, over the authenticated peer protocol: its node id
/// and rack, or why it did not say.
pub trait Hello: Send + Sync {
    /// The node id and rack of the peer listening at `address` (`HOST:PORT`).
    fn hello<'a>(&'a self, address: &'a str) -> BoxFuture<'a, Result<(String, String), String>>;
}

/// The members of the rack, shared by the fill path, the DNS task, the status and the metrics.
/// Cloning is cheap.
#[derive(Clone)]
pub struct Membership {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("self_id", &self.inner.self_id)
            .field("self_rack", &self.inner.self_rack)
            .field("members", &self.inner.state.lock().members.len())
            .finish_non_exhaustive()
    }
}

struct Inner {
    self_id: String,
    self_rack: String,
    dns: Option<DnsSource>,
    state: Mutex<State>,
}

/// Where the DNS members come from.
struct DnsSource {
    /// The name as configured, without the port.
    name: String,
    /// The port of every address.
    port: u16,
    /// How often it is resolved.
    interval: Duration,
    /// The DNS server to ask instead of the system's (tests).
    nameserver: Option<SocketAddr>,
}

#[derive(Default)]
struct State {
    /// Every member but this node, by id.
    members: BTreeMap<String, Entry>,
    /// This node's address, as the static list or DNS gives it.
    self_address: String,
    /// Bytes received from peers by the rack they were in, kept after they leave.
    received_by_rack: BTreeMap<String, u64>,
}

/// One member other than this node.
#[derive(Debug, Default)]
struct Entry {
    /// Address and rack from the static list.
    configured: Option<(String, String)>,
    /// Address and rack from DNS and the member's own answer.
    discovered: Option<(String, String)>,
    /// Failures since the last success.
    failures: u32,
    /// Slow answers in a row, towards [`SLOW_STRIKES`].
    strikes: u32,
    /// Left out of [`Membership::owners`] until then.
    open_until: Option<Instant>,
    /// The last request to it succeeded (and none failed since).
    up: bool,
    /// Block bytes received from it.
    received: u64,
}

impl Entry {
    /// The address and rack in use: the configured ones first.
    fn place(&self) -> Option<&(String, String)> {
        self.configured.as_ref().or(self.discovered.as_ref())
    }

    fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|until| until > now)
    }
}

impl Membership {
    /// The membership of the config's static members (and this node), with this node as
    /// `self_id` in `self_rack`. DNS members come once [`Membership::spawn_dns`] runs.
    pub fn new(config: &PeerConfig, self_id: String, self_rack: String) -> Self {
        let mut state = State {
            self_address: config.listen.map(|a| a.to_string()).unwrap_or_default(),
            ..State::default()
        };
        for member in &config.members {
            if member.id == self_id {
                state.self_address.clone_from(&member.address);
                continue;
            }
            state.members.entry(member.id.clone()).or_default().configured =
                Some((member.address.clone(), member.rack.clone()));
        }
        // The config checked the form NAME:PORT; a DNS name that is not so is left out.
        let dns = config.dns.as_deref().and_then(|dns| {
            let (name, port) = dns.rsplit_once(':')?;
            Some(DnsSource {
                name: name.to_owned(),
                port: port.parse().ok()?,
                interval: config.dns_interval,
                nameserver: config.dns_server,
            })
        });
        Self {
            inner: Arc::new(Inner {
                self_id,
                self_rack,
                dns,
                state: Mutex::new(state),
            }),
        }
    }

    /// This node's id.
    pub fn self_id(&self) -> &str {
        &self.inner.self_id
    }

    /// This node's rack label.
    pub fn self_rack(&self) -> &str {
        &self.inner.self_rack
    }

    /// The members to ask for `run`, best first: every member (this node included) whose
    /// circuit is closed, ranked by rendezvous hashing with this node's rack first. When this
    /// node comes first, it fills the run from the origin itself.
    pub fn owners(&self, run: &Run) -> Vec<Peer> {
        let now = Instant::now();
        let state = self.inner.state.lock();
        let mut members = vec![Member {
            id: self.inner.self_id.clone(),
            rack: self.inner.self_rack.clone(),
        }];
        let mut addresses = HashMap::from([(self.inner.self_id.as_str(), state.self_address.as_str())]);
        for (id, entry) in &state.members {
            let Some((address, rack)) = entry.place() else {
                continue;
            };
            if entry.is_open(now) {
                continue;
            }
            members.push(Member {
                id: id.clone(),
                rack: rack.clone(),
            });
            addresses.insert(id, address);
        }
        owner::candidates(&members, run, &self.inner.self_rack)
            .into_iter()
            .map(|m| Peer {
                id: m.id.clone(),
                rack: m.rack.clone(),
                address: addresses
                    .get(m.id.as_str())
                    .copied()
                    .unwrap_or_default()
                    .to_owned(),
            })
            .collect()
    }

    /// A request to member `id` failed: it is left out of [`Membership::owners`] for a while,
    /// twice as long as last time if it failed last time too.
    pub fn failed(&self, id: &str) {
        self.leave_out(id, |failures| {
            let doublings = (failures - 1).min(16);
            FIRST_BACKOFF.saturating_mul(1 << doublings).min(MAX_BACKOFF)
        });
    }

    /// A request to member `id` timed out or its answer broke off: after [`SLOW_STRIKES`] in a
    /// row, it is left out as by [`Membership::failed`].
    pub fn slow(&self, id: &str) {
        {
            let mut state = self.inner.state.lock();
            let Some(entry) = state.members.get_mut(id) else {
                return;
            };
            entry.up = false;
            entry.strikes += 1;
            if entry.strikes < SLOW_STRIKES {
                tracing::debug!(member = id, strikes = entry.strikes, "peer slow; its runs stay");
                return;
            }
        }
        self.failed(id);
    }

    /// Blocks member `id` sent, which its answer had vouched for, proved wrong against the
    /// origin: it is left out for [`MAX_BACKOFF`] at once. Its answers succeed in transit, so
    /// the doubling of [`Membership::failed`] would start again at [`FIRST_BACKOFF`] each time.
    pub fn sent_wrong_blocks(&self, id: &str) {
        self.leave_out(id, |_| MAX_BACKOFF);
    }

    /// Counts a failure of member `id` and opens its circuit for `backoff(failures in a row)`.
    fn leave_out(&self, id: &str, backoff: impl FnOnce(u32) -> Duration) {
        let mut state = self.inner.state.lock();
        let Some(entry) = state.members.get_mut(id) else {
            return;
        };
        entry.failures = entry.failures.saturating_add(1);
        entry.strikes = 0;
        let backoff = backoff(entry.failures);
        entry.open_until = Some(Instant::now() + backoff);
        entry.up = false;
        tracing::debug!(member = id, failures = entry.failures, backoff = ?backoff, "peer left out after a failure");
    }

    /// A request to member `id` succeeded: its circuit closes and its failures are forgotten.
    pub fn succeeded(&self, id: &str) {
        let mut state = self.inner.state.lock();
        if let Some(entry) = state.members.get_mut(id) {
            entry.failures = 0;
            entry.strikes = 0;
            entry.open_until = None;
            entry.up = true;
        }
    }

    /// `bytes` of checked blocks came from member `id`. Bytes from a member that has left
    /// meanwhile are not counted.
    pub fn received(&self, id: &str, bytes: u64) {
        let mut state = self.inner.state.lock();
        let State {
            members,
            received_by_rack,
            ..
        } = &mut *state;
        let Some(entry) = members.get_mut(id) else {
            return;
        };
        entry.received += bytes;
        if let Some((_, rack)) = entry.place() {
            *received_by_rack.entry(rack.clone()).or_default() += bytes;
        }
    }

    /// Every member now, this node first, then by id.
    pub fn states(&self) -> Vec<MemberState> {
        let now = Instant::now();
        let state = self.inner.state.lock();
        let this = MemberState {
            id: self.inner.self_id.clone(),
            rack: self.inner.self_rack.clone(),
            address: state.self_address.clone(),
            state: MemberHealth::This,
            retry_in_seconds: None,
            failures: 0,
            received_bytes: 0,
        };
        let others = state.members.iter().filter_map(|(id, entry)| {
            let (address, rack) = entry.place()?;
            let (health, retry_in_seconds) = match entry.open_until {
                Some(until) if until > now => (
                    MemberHealth::Down,
                    Some((until - now).as_secs_f64().ceil() as u64),
                ),
                _ if entry.up => (MemberHealth::Up, None),
                _ => (MemberHealth::Unknown, None),
            };
            Some(MemberState {
                id: id.clone(),
                rack: rack.clone(),
                address: address.clone(),
                state: health,
                retry_in_seconds,
                failures: entry.failures,
                received_bytes: entry.received,
            })
        });
        std::iter::once(this).chain(others).collect()
    }

    /// Bytes received from peers, by the rack of the peer, since start.
    pub fn received_by_rack(&self) -> Vec<RackBytes> {
        self.inner
            .state
            .lock()
            .received_by_rack
            .iter()
            .map(|(rack, &bytes)| RackBytes {
                rack: rack.clone(),
                bytes,
            })
            .collect()
    }

    /// Resolves `peer.dns` now and every `dns_interval` until `stop`, on a task of `tasks`,
    /// asking each new address who it is with `hello`. Does nothing without `peer.dns`. If the
    /// system's resolver config cannot be read, logs it and keeps the static members only.
    pub fn spawn_dns(&self, tasks: &TaskTracker, stop: CancellationToken, hello: Arc<dyn Hello>) {
        if self.inner.dns.is_none() {
            return;
        }
        let membership = self.clone();
        tasks.spawn(async move {
            stop.run_until_cancelled(membership.follow_dns(hello)).await;
        });
    }

    /// The DNS task: resolve, apply, wait, forever.
    async fn follow_dns(self, hello: Arc<dyn Hello>) {
        let Some(dns) = &self.inner.dns else {
            return;
        };
        // Reading the system's resolver config reads files.
        let nameserver = dns.nameserver;
        let resolver = match tokio::task::spawn_blocking(move || resolver(nameserver)).await {
            Ok(Ok(resolver)) => resolver,
            Ok(Err(error)) => {
                tracing::error!(%error, name = %dns.name, "cannot read the system's DNS resolver config: peers from DNS are off");
                return;
            }
            Err(_) => return,
        };
        let mut known = Discovered::default();
        let mut failing = false;
        let mut tick = tokio::time::interval(dns.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            resolver.clear_cache();
            match resolver.lookup_ip(dns.name.as_str()).await {
                Ok(lookup) => {
                    if failing {
                        tracing::info!(name = %dns.name, "the peers' DNS name resolves again");
                        failing = false;
                    }
                    let addresses = lookup
                        .iter()
                        .map(|ip| SocketAddr::new(ip, dns.port).to_string())
                        .collect();
                    self.apply(&mut known, addresses, hello.as_ref()).await;
                }
                Err(error) => {
                    if !failing {
                        tracing::warn!(name = %dns.name, %error, "cannot resolve the peers' DNS name: keeping the members it gave last");
                        failing = true;
                    }
                }
            }
        }
    }

    /// Makes the DNS members those at `addresses`: addresses gone leave, new ones are asked
    /// who they are and join (an address that does not answer is asked again next time).
    async fn apply(&self, known: &mut Discovered, addresses: HashSet<String>, hello: &dyn Hello) {
        let gone: Vec<String> = known
            .ids
            .keys()
            .filter(|a| !addresses.contains(*a))
            .cloned()
            .collect();
        for address in gone {
            if let Some(id) = known.ids.remove(&address) {
                self.forget(&id, &address);
            }
        }
        let new: Vec<&String> = addresses.iter().filter(|a| !known.ids.contains_key(*a)).collect();
        let answers = futures::future::join_all(new.iter().map(|&address| async move {
            let answer = tokio::time::timeout(HELLO_TIMEOUT, hello.hello(address))
                .await
                .unwrap_or_else(|_| Err("no answer in time".to_owned()));
            (address, answer)
        }))
        .await;
        known.silent.retain(|a| addresses.contains(a));
        for (address, answer) in answers {
            match answer {
                Ok((id, rack)) => {
                    known.silent.remove(address);
                    known.ids.insert(address.clone(), id.clone());
                    self.discover(id, rack, address.clone());
                }
                Err(error) => {
                    if known.silent.insert(address.clone()) {
                        tracing::warn!(%address, %error, "a peer address from DNS did not say who it is; asking again at the next resolution");
                    }
                }
            }
        }
    }

    /// Member `id` answered at `address` from DNS, in `rack`.
    fn discover(&self, id: String, rack: String, address: String) {
        let mut state = self.inner.state.lock();
        if id == self.inner.self_id {
            if state.self_address.is_empty() {
                state.self_address = address;
            }
            return;
        }
        let entry = state.members.entry(id.clone()).or_default();
        if entry.place().is_none() {
            tracing::info!(member = %id, %rack, %address, "a peer joined");
        }
        entry.discovered = Some((address, rack));
    }

    /// `address`, which DNS had given for member `id`, is gone.
    fn forget(&self, id: &str, address: &str) {
        let mut state = self.inner.state.lock();
        let Some(entry) = state.members.get_mut(id) else {
            return;
        };
        // A member that came back at another address keeps that one.
        if entry.discovered.as_ref().is_some_and(|(a, _)| a == address) {
            entry.discovered = None;
        }
        if entry.place().is_none() {
            tracing::info!(member = id, address, "a peer left");
            state.members.remove(id);
        }
    }
}

/// What the DNS task remembers between resolutions.
#[derive(Default)]
struct Discovered {
    /// The member id each answered address gave.
    ids: HashMap<String, String>,
    /// Addresses that did not say who they are, warned about once.
    silent: HashSet<String>,
}

/// A resolver that asks `nameserver`, or the system's servers, and keeps nothing from one
/// resolution to the next.
fn resolver(nameserver: Option<SocketAddr>) -> Result<TokioResolver, hickory_resolver::net::NetError> {
    let provider = TokioRuntimeProvider::default();
    let mut builder = match nameserver {
        Some(server) => {
            let mut udp = ConnectionConfig::udp();
            udp.port = server.port();
            let mut config = NameServerConfig::udp(server.ip());
            config.connections = vec![udp];
            Resolver::builder_with_config(ResolverConfig::from_name_servers(vec![config]), provider)
        }
        None => Resolver::builder(provider)?,
    };
    let options = builder.options_mut();
    options.ip_strategy = hickory_resolver::config::LookupIpStrategy::Ipv4AndIpv6;
    options.cache_size = 0;
    builder.build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use larder_config::PeerMember;

    fn config(members: &[&str]) -> PeerConfig {
        PeerConfig {
            members: members.iter().map(|m| m.parse::<PeerMember>().unwrap()).collect(),
            ..PeerConfig::default()
        }
    }

    fn runs(n: u64) -> impl Iterator<Item = Run> {
        (0..n).map(|i| Run {
            object: *blake3::hash(&(i / 8).to_le_bytes()).as_bytes(),
            part: i % 8,
        })
    }

    const FOUR: [&str; 4] = [
        "a=127.0.0.1:7001@r1",
        "b=127.0.0.2:7001@r1",
        "c=127.0.0.3:7001@r2",
        "d=127.0.0.4:7001@r2",
    ];

    #[test]
    fn every_node_of_a_rack_ranks_the_same_owners() {
        let nodes: Vec<Membership> = [("a", "r1"), ("b", "r1")]
            .iter()
            .map(|(id, rack)| Membership::new(&config(&FOUR), (*id).into(), (*rack).into()))
            .collect();
        for run in runs(200) {
            let first = nodes[0].owners(&run);
            assert_eq!(first.len(), 4);
            assert_eq!(first, nodes[1].owners(&run));
            // Same rack first.
            assert!(first[..2].iter().all(|p| p.rack == "r1"), "{first:?}");
        }
        // Across racks the owner within the asker's rack differs, but each rack agrees.
        let c = Membership::new(&config(&FOUR), "c".into(), "r2".into());
        let d = Membership::new(&config(&FOUR), "d".into(), "r2".into());
        for run in runs(50) {
            assert_eq!(c.owners(&run), d.owners(&run));
        }
        // This node's own address comes from the list; it is ranked like the others.
        let owners = nodes[0].owners(&runs(1).next().unwrap());
        let me = owners.iter().find(|p| p.id == "a").unwrap();
        assert_eq!(me.address, "127.0.0.1:7001");
    }

    #[test]
    fn this_node_is_a_member_even_when_the_list_leaves_it_out() {
        let m = Membership::new(&config(&FOUR[1..]), "a".into(), "r1".into());
        let run = runs(1).next().unwrap();
        let ids = |m: &Membership| m.owners(&run).into_iter().map(|p| p.id).collect::<Vec<_>>();
        assert_eq!(
            ids(&m),
            ids(&Membership::new(&config(&FOUR), "a".into(), "r1".into()))
        );
        assert_eq!(m.states()[0].state, MemberHealth::This);
        assert_eq!(m.states().len(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_member_is_left_out_then_tried_again_with_a_growing_backoff() {
        let m = Membership::new(&config(&FOUR), "a".into(), "r1".into());
        let ids = |run: &Run| m.owners(run).into_iter().map(|p| p.id).collect::<Vec<_>>();
        let run = runs(1).next().unwrap();
        assert!(ids(&run).contains(&"b".to_owned()));
        m.failed("b");
        assert!(!ids(&run).contains(&"b".to_owned()));
        let b = |m: &Membership| m.states().into_iter().find(|s| s.id == "b").unwrap();
        assert_eq!(
            (b(&m).state, b(&m).retry_in_seconds, b(&m).failures),
            (MemberHealth::Down, Some(10), 1)
        );

        tokio::time::advance(Duration::from_millis(9_900)).await;
        assert!(!ids(&run).contains(&"b".to_owned()));
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(ids(&run).contains(&"b".to_owned()), "tried again after 10 s");
        assert_eq!(b(&m).state, MemberHealth::Unknown);

        // A second failure in a row: 20 s out; then 40, 80, and at most 120.
        for expected in [20, 40, 80, 120, 120] {
            m.failed("b");
            assert_eq!(b(&m).retry_in_seconds, Some(expected));
            tokio::time::advance(Duration::from_secs(expected - 1)).await;
            assert!(!ids(&run).contains(&"b".to_owned()));
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(ids(&run).contains(&"b".to_owned()));
        }

        // A success closes the circuit and forgets the failures.
        m.succeeded("b");
        assert_eq!((b(&m).state, b(&m).failures), (MemberHealth::Up, 0));
        m.failed("b");
        assert_eq!(b(&m).retry_in_seconds, Some(10));
        // This node is never left out.
        m.failed("a");
        assert!(ids(&run).contains(&"a".to_owned()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_member_keeps_its_runs_until_it_is_slow_three_times_in_a_row() {
        let m = Membership::new(&config(&FOUR), "a".into(), "r1".into());
        let ids = |run: &Run| m.owners(run).into_iter().map(|p| p.id).collect::<Vec<_>>();
        let run = runs(1).next().unwrap();
        let b = |m: &Membership| m.states().into_iter().find(|s| s.id == "b").unwrap();
        // Two slow answers, a success, two more: never out.
        for _ in 0..2 {
            m.slow("b");
            m.slow("b");
            assert!(ids(&run).contains(&"b".to_owned()));
            assert_eq!(b(&m).state, MemberHealth::Unknown);
            m.succeeded("b");
        }
        // Three in a row: out, as after a failure.
        for _ in 0..3 {
            m.slow("b");
        }
        assert!(!ids(&run).contains(&"b".to_owned()));
        assert_eq!(
            (b(&m).state, b(&m).retry_in_seconds, b(&m).failures),
            (MemberHealth::Down, Some(10), 1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_that_sent_wrong_blocks_is_left_out_for_the_longest_backoff_at_once() {
        let m = Membership::new(&config(&FOUR), "a".into(), "r1".into());
        let b = |m: &Membership| m.states().into_iter().find(|s| s.id == "b").unwrap();
        // Its answers succeeded in transit; the origin check proves them wrong afterwards.
        for _ in 0..2 {
            m.succeeded("b");
            m.sent_wrong_blocks("b");
            assert_eq!(
                (b(&m).state, b(&m).retry_in_seconds),
                (MemberHealth::Down, Some(MAX_BACKOFF.as_secs()))
            );
            tokio::time::advance(MAX_BACKOFF).await;
        }
        assert_eq!(b(&m).state, MemberHealth::Unknown);
    }

    #[test]
    fn a_member_joining_or_leaving_moves_only_its_own_runs() {
        let three = Membership::new(&config(&FOUR[..3]), "a".into(), "r1".into());
        let four = Membership::new(&config(&FOUR), "a".into(), "r1".into());
        let mut moved = 0;
        for run in runs(400) {
            let (before, after) = (three.owners(&run), four.owners(&run));
            // Ranked by rack first, so compare the owner within each rack's members.
            let owner =
                |peers: &[Peer], rack: &str| peers.iter().find(|p| p.rack == rack).unwrap().id.clone();
            if owner(&after, "r2") == "d" {
                moved += 1;
            } else {
                assert_eq!(owner(&before, "r2"), owner(&after, "r2"));
            }
            assert_eq!(owner(&before, "r1"), owner(&after, "r1"));
            // Without d, d's runs go to the next candidate it had.
            let next: Vec<_> = after.iter().filter(|p| p.id != "d").cloned().collect();
            assert_eq!(next, before);
        }
        assert!(moved > 0);
    }

    #[test]
    fn bytes_received_are_counted_by_member_and_by_rack() {
        let m = Membership::new(&config(&FOUR), "a".into(), "r1".into());
        m.received("b", 10);
        m.received("c", 5);
        m.received("d", 7);
        m.received("gone", 100);
        let b = m.states().into_iter().find(|s| s.id == "b").unwrap();
        assert_eq!(b.received_bytes, 10);
        assert_eq!(
            m.received_by_rack(),
            vec![
                RackBytes {
                    rack: "r1".into(),
                    bytes: 10
                },
                RackBytes {
                    rack: "r2".into(),
                    bytes: 12
                }
            ]
        );
    }
}
