//! The peer tier of the fill path: ask the run's owner before the origin. A node asks its
//! rack's owner of the run; the rack owner (or a node that is its own rack's owner) asks the
//! fleet owner, in another rack; the fleet owner fills from the origin (see
//! `larder_peer_proto::owner`).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use larder_engine::AlignedBuf;
use larder_peer_proto::client::{BlockBuf, Client, PeerError};
use larder_peer_proto::owner::RunId;
use larder_peer_proto::wire::{RunRequest, VersionTag};
use larder_read_path::fill::{BlockSource, FillFor, NotNext, Provenance, Run};
use larder_read_path::{OpenObject, ReadError, Source};
use larder_stats::{PeerLatencies, PeerStats, Stats, add};
use larder_store::VerifiedBlock;

use crate::manifest::Manifests;
use crate::members::{Membership, Peer};

/// Asks rack peers for runs.
#[derive(Debug)]
pub struct PeerSource {
    client: Client,
    members: Membership,
    manifests: Manifests,
    stats: Arc<PeerStats>,
    latency: Arc<PeerLatencies>,
}

impl PeerSource {
    /// A peer tier asking `members` with `client`, checking blocks against the sealed
    /// manifests `manifests` finds, counting in its part of `stats`.
    pub fn new(client: Client, members: Membership, manifests: Manifests, stats: &Stats) -> Self {
        Self {
            client,
            members,
            manifests,
            stats: stats.peer.clone(),
            latency: stats.peer_latency.clone(),
        }
    }

    /// Counts a failed request by its result, and holds it against the member
    /// ([`Membership::request_failed`]).
    fn failed(&self, member: &str, error: &PeerError) {
        let stats = &self.stats;
        let counter = match error {
            PeerError::Declined(_) => &stats.peer_requests_miss,
            PeerError::Connect { .. } | PeerError::Broken(_) => &stats.peer_requests_refused,
            PeerError::Timeout(_) => &stats.peer_requests_timeout,
            PeerError::Unauthorized(_) | PeerError::BadTag(_) => &stats.peer_requests_unauthorized,
            PeerError::BadData { .. } => &stats.peer_requests_bad_data,
        };
        add(counter, 1);
        self.members.request_failed(member, error);
        match error {
            PeerError::Unauthorized(_) | PeerError::BadTag(_) | PeerError::BadData { .. } => {
                tracing::warn!(peer = member, %error, "rack peer failed; its runs go elsewhere for a while");
            }
            _ => tracing::debug!(peer = member, %error, "rack peer failed"),
        }
    }
}

/// Why the peer tier supplied no run.
#[derive(Debug, thiserror::Error)]
enum NoPeer {
    /// No member is up.
    #[error("no members")]
    NoMembers,
    /// This node owns the run (is its fleet owner, or was asked across racks): it fetches it
    /// from its origin.
    #[error("this node owns the run")]
    OwnRun,
    /// The run's owner failed.
    #[error("{member}: {error}")]
    Failed {
        /// The owner's id.
        member: String,
        /// What went wrong.
        #[source]
        error: PeerError,
    },
}

/// Why a block a rack peer sent was refused (the rest of its run then comes from the origin).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PeerBlockError {
    /// It is not the block the run waits for next (or the run wants no more).
    #[error(transparent)]
    NotNext(#[from] NotNext),
    /// Its hash is not the one a sealed manifest gives for it.
    #[error("the block's hash is not the sealed manifest's")]
    NotSealed,
    /// Its bytes do not hash to the hash its answer gave.
    #[error("the bytes do not hash to the block's hash")]
    HashMismatch,
}

/// A block from a peer, received into the aligned buffer the block store writes from.
struct PeerBuf(AlignedBuf);

impl AsRef<[u8]> for PeerBuf {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref()
    }
}

impl BlockBuf for PeerBuf {
    fn with_room(len: usize) -> Self {
        Self(AlignedBuf::new(len))
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

impl PeerSource {
    /// Whom to ask for `run`, filled for `fill_for`, and whether that member may ask on: the
    /// run's rack owner (which may ask the fleet owner); where this node is the rack owner, or
    /// was asked by a member of its rack, the fleet owner, which fills from the origin.
    fn owner(&self, run: &RunId, fill_for: FillFor) -> Result<(Peer, bool), ReadError> {
        let none = |why| Err(ReadError::Peer(Arc::new(why)));
        let (me, rack) = (self.members.self_id(), Some(self.members.self_rack()));
        // One ranking gives both owners: the fleet owner is its first member, this rack's
        // owner the first of this rack (the same weights, ranked within the rack).
        let ranked = self.members.fleet_owners(run);
        let Some(fleet) = ranked.first() else {
            return none(NoPeer::NoMembers);
        };
        if let FillFor::Node | FillFor::Job = fill_for
            && let Some(owner) = ranked.iter().find(|p| p.rack.as_deref() == rack)
            && owner.id != me
        {
            // Only a member of this rack may pass the request on.
            return Ok((owner.clone(), true));
        }
        // The fleet owner is asked across racks only: one of this rack is its rack owner too,
        // which is this node or was asked already (views that differ for a moment must not
        // bounce a run around the rack).
        if fleet.id == me || fleet.rack.as_deref() == rack {
            return none(NoPeer::OwnRun);
        }
        Ok((fleet.clone(), false))
    }
}

impl BlockSource for PeerSource {
    fn kind(&self) -> Source {
        Source::Peer
    }

    /// A member of another rack asked this node for the run: filled from the origin only, so
    /// that no request is passed on twice (see [`FillFor::Peer`]).
    fn serves(&self, fill_for: FillFor) -> bool {
        fill_for != FillFor::Peer { relay: false }
    }

    fn fetch<'a>(
        &'a self,
        object: &'a OpenObject,
        range: Range<u64>,
        run: &'a mut Run<'_>,
    ) -> BoxFuture<'a, Result<(), ReadError>> {
        async move {
            let block_size = run.block_size();
            let first = (range.start / block_size) as u32;
            let owned = RunId {
                object: object.id().0,
                part: u64::from(first / run.part_blocks()),
            };
            // Only an owner is asked. A fallback member would have to fill the run from the
            // origin too, a second copy of it; a member whose circuit is open is left out of
            // the ranking, so the next one becomes the owner of its runs for everyone.
            let (peer, relay) = self.owner(&owned, run.fill_for())?;
            let version = object.version();
            // Looked up once per version and kept: where the version is sealed, every block
            // must match the manifest, which a peer cannot forge.
            let sealed = self
                .manifests
                .for_version(object.origin(), version, block_size)
                .await;
            let request = RunRequest {
                object: object.id().0,
                source: object.origin().name().to_owned(),
                key: version.key.clone(),
                version: VersionTag::of(version.etag.as_deref(), version.version.as_deref()),
                size: version.size,
                block_size,
                first: run.next_block(),
                count: run.blocks_left(),
                relay,
            };
            let started = Instant::now();
            let member: Arc<str> = peer.id.as_str().into();
            let mut received = 0;
            let answer = self
                .client
                .fetch_run(&peer.address, &peer.id, &request, |head, PeerBuf(buf), check| {
                    let sealed = sealed.as_ref().and_then(|m| m.block_hash(head.index));
                    if sealed.is_some_and(|sealed| sealed != head.hash) {
                        return Err(PeerBlockError::NotSealed);
                    }
                    let len = buf.len() as u64;
                    // Checked group by group as it arrived; finished here on these very bytes.
                    let block = VerifiedBlock::checked_on_arrival(Arc::new(buf), check)
                        .map_err(|_| PeerBlockError::HashMismatch)?;
                    // Without a sealed manifest, the member answers for the block until the
                    // object's origin check.
                    let unchecked = sealed.is_none().then(|| member.clone());
                    run.push(head.index, block, Provenance::Peer { unchecked })?;
                    received += len;
                    Ok(())
                })
                .await;
            add(&self.stats.peer_fetched_bytes, received);
            if peer.rack.as_deref() != Some(self.members.self_rack()) {
                add(&self.stats.peer_fetched_across_racks_bytes, received);
            }
            self.members.received(&peer.id, received);
            match answer {
                Ok(answer) => {
                    let counter = if answer.hit {
                        &self.stats.peer_requests_hit
                    } else {
                        &self.stats.peer_requests_filled
                    };
                    add(counter, 1);
                    self.latency.fill_peer.observe(started.elapsed());
                    self.members.succeeded(&peer.id);
                    Ok(())
                }
                Err(error) => {
                    self.failed(&peer.id, &error);
                    let late = matches!(error, PeerError::Timeout(_));
                    let error = Arc::new(NoPeer::Failed {
                        member: peer.id,
                        error,
                    });
                    Err(if late {
                        ReadError::PeerLate(error)
                    } else {
                        ReadError::Peer(error)
                    })
                }
            }
        }
        .boxed()
    }
}
