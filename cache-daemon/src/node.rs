//! The read side of a node, built as `larder daemon` builds it: the block store on its I/O
//! engine, an origin per configured source, the rack peer tier when members are configured,
//! and the read path over them. The daemon adds the mount, the listeners and the jobs around
//! it ([`crate::daemon`]); the engine's tests build this same one, with fault injectors around
//! the I/O engine and the origins' stores, so that they run the production path: paged
//! listings, the peer tier, one reader per open file.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use larder_config::{Config, PeerConfig};
use larder_engine::IoEngine;
use larder_http as http;
use larder_origin::Origin;
use larder_origin::environment::Environment;
use larder_peer_proto::auth::{ClusterKey, Verifier};
use larder_peer_proto::client::Client;
use larder_peer_proto::tls::{self, Connector};
use larder_peer_proto::wire::Hello;
use larder_peers::listener::PeerListener;
use larder_peers::manifest::Manifests;
use larder_peers::members::Membership;
use larder_peers::{self as peer, AskWho, PeerSource};
use larder_read_path::Cache;
use larder_read_path::fill::PeerTier;
use larder_stats::Stats;
use larder_store::BlockStore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::DaemonError;
use crate::namespace::{ConfiguredSource, Namespace};

/// A node's read side: what the mount, the peer listener, the registry mirror and the jobs
/// read through.
#[derive(Debug)]
pub struct Node {
    /// Every layer's counters.
    pub stats: Arc<Stats>,
    /// The read path over the block store, with the peer tier when members are configured.
    pub cache: Cache,
    /// The configured sources, in the config's order.
    pub sources: Vec<(String, ConfiguredSource)>,
    /// This node as a rack peer.
    pub peers: Peers,
    /// The sealed manifests the peer tier checks members' blocks against, shared with the
    /// sealer.
    pub manifests: Manifests,
}

impl Node {
    /// Opens the block store in `config.cache.dir` on `engine`, builds each source's origin
    /// (its settings from `env`, then passed through `around`: the daemon passes it as it is)
    /// and the peer tier, and starts the members' DNS resolution and hellos on `background`
    /// until `stop`.
    pub async fn open(
        config: &Config,
        engine: Arc<dyn IoEngine>,
        env: &Environment,
        around: impl Fn(Origin) -> Origin,
        background: &TaskTracker,
        stop: &CancellationToken,
    ) -> Result<Self, DaemonError> {
        let stats = Arc::new(Stats::default());
        let store = Arc::new(BlockStore::open(&config.cache, engine, stats.store.clone()).await?);
        let peers = Peers::new(&config.peer)?;
        let manifests = Manifests::new();
        let peer_tier = peers.members.clone().map(|members| PeerTier {
            source: Arc::new(PeerSource::new(
                peers.client.clone(),
                members.clone(),
                manifests.clone(),
                &stats,
            )),
            members: Arc::new(members) as _,
        });
        if let Some(members) = &peers.members {
            let hello = Arc::new(AskWho {
                client: peers.client.clone(),
                rack: config.peer.rack.clone(),
            });
            members.spawn_dns(background, stop.clone(), hello.clone());
            members.spawn_hellos(background, stop.clone(), hello.clone());
            members.spawn_probes(background, stop.clone(), hello, config.peer.probe_interval);
        }
        let cache = Cache::new(
            store,
            &config.origin,
            config.cache.memory_limit,
            &stats,
            peer_tier,
        );
        let sources = config
            .sources
            .iter()
            .map(|source| {
                let origin = Origin::from_config(source, &config.origin, stats.origin.clone(), env)
                    .map_err(Box::new)?;
                let origin = Arc::new(around(origin));
                let ttl = (!source.immutable).then_some(source.metadata_ttl);
                Ok((source.name.clone(), ConfiguredSource { origin, ttl }))
            })
            .collect::<Result<_, DaemonError>>()?;
        Ok(Self {
            stats,
            cache,
            sources,
            peers,
            manifests,
        })
    }

    /// The sources' origins by name.
    pub fn origins(&self) -> Vec<(String, Arc<Origin>)> {
        self.sources
            .iter()
            .map(|(name, source)| (name.clone(), source.origin.clone()))
            .collect()
    }

    /// The file tree of the sources, as the mount serves it (with `passthrough`, opening a
    /// complete object offers the kernel its data file).
    pub fn namespace(&self, passthrough: bool) -> Namespace {
        Namespace::new(
            self.sources.clone(),
            self.cache.clone(),
            passthrough,
            self.stats.mount.clone(),
        )
    }
}

/// This node as a rack peer: who it is, its key, how it asks others, and its members
/// (`None` when peers are off).
pub struct Peers {
    key: Option<ClusterKey>,
    /// Who this node says it is.
    pub hello: Hello,
    /// How it asks members for runs.
    client: Client,
    /// Its members, when peers are on.
    pub members: Option<Membership>,
    /// The listener's TLS, when it speaks TLS.
    acceptor: Option<tokio_rustls::TlsAcceptor>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("hello", &self.hello)
            .field("authenticated", &self.key.is_some())
            .field("tls", &self.acceptor.is_some())
            .finish_non_exhaustive()
    }
}

impl Peers {
    /// Reads the key (needed when peers are on or the listener is, unless told to run
    /// without one) and the node's id: the configured one, or the host name.
    pub fn new(config: &PeerConfig) -> Result<Self, DaemonError> {
        let key = if config.enabled() || config.listen.is_some() {
            peer::cluster_key(config)?
        } else {
            None
        };
        let node = match config.node_id.as_str() {
            "" => rustix::system::uname().nodename().to_string_lossy().into_owned(),
            id => id.to_owned(),
        };
        let hello = Hello {
            node: node.clone(),
            rack: config.rack.clone(),
        };
        let mut client = Client::new(
            key.clone(),
            node.clone(),
            config.first_byte_timeout,
            config.stall_timeout,
            config.min_rate.as_u64(),
        );
        if let Some(ca) = &config.tls_ca {
            client = client.with_tls(Connector::new(ca, &config.tls_name)?);
        }
        let acceptor = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(tls::acceptor(cert, key)?),
            _ => None,
        };
        let members = config
            .enabled()
            .then(|| Membership::new(config, node, config.rack.clone()));
        Ok(Self {
            key,
            hello,
            client,
            members,
            acceptor,
        })
    }

    /// Binds the peer listener and serves `cache`'s blocks of `origins` on a task of its own
    /// until `stop`.
    pub async fn serve(
        &self,
        address: SocketAddr,
        cache: &Cache,
        origins: HashMap<String, Arc<Origin>>,
        stats: &Arc<Stats>,
        stop: CancellationToken,
    ) -> Result<JoinHandle<()>, DaemonError> {
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|source| DaemonError::PeerListen { address, source })?;
        let bound = listener.local_addr().unwrap_or(address);
        let authenticated = self.key.is_some();
        let tls = self.acceptor.is_some();
        tracing::info!(address = %bound, node = %self.hello.node, authenticated, tls, "serving rack peers");
        let service = PeerListener::new(
            self.key.clone().map(Verifier::new),
            self.hello.clone(),
            self.members.clone(),
            cache.clone(),
            origins,
            stats.peer.clone(),
        );
        let (service, limits) = (peer::listener::service(service), peer::listener::LIMITS);
        Ok(match self.acceptor.clone() {
            Some(acceptor) => tokio::spawn(http::serve(
                http::TlsListener::new(listener, acceptor),
                service,
                limits,
                stop,
            )),
            None => tokio::spawn(http::serve(listener, service, limits, stop)),
        })
    }
}
