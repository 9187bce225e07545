//! The origin check, the middle tier of trust in rack peers: when an object version is
//! complete in the cache and some of its blocks came from rack members (and no sealed manifest
//! vouched for them), the whole object is checked against a checksum the origin publishes,
//! in the background, one object at a time, reading the blocks from the cache. The strongest
//! of these the origin has is used:
//!
//! - The object's MD5: GCS's `x-goog-hash` md5, Azure's `Content-MD5`, or else a single-part
//!   upload's ETag (32 hex digits).
//! - A multipart upload's ETag: the MD5 of its parts' binary MD5s and `-N`, N the number of
//!   parts. The part sizes are not in the ETag; S3 gives the first part's size
//!   (`HEAD ?partNumber=1`), and every part but the last is taken to have it. Where the store
//!   does not say, the check tries the part sizes that uploaders use: every part but the last
//!   of one size, a whole number of MiB, N parts in all; powers of two first, then the
//!   smallest, at most [`MAX_PART_SIZES`] of them in one pass over the object.
//! - Only where neither is usable: a full-object CRC (CRC64NVME, CRC32C or CRC32) that S3 keeps
//!   when the uploader sent one, or GCS's CRC32C (see [`larder_origin::checksums`]). A match is counted
//!   `crc_only`, not `match`: a CRC is linear, so whoever chooses the bytes can make any change
//!   keep it (a flipped byte and 4 or 8 solved ones per block); it catches corruption, never a
//!   member that lies on purpose.
//! - Any other ETag (a local file's, an Azure blob's without `Content-MD5`), or none: nothing
//!   to check against; counted `unchecked`, and the blocks are kept.
//!
//! Why MD5 over CRC: forging an MD5 to a given value takes a second preimage, which no one can
//! compute; an MD5 collision (two chosen inputs with one MD5, which is practical) does not
//! help, since the origin's object is not the liar's to choose. So a match of the ETag makes
//! the member's blocks the origin's bytes; a match of the CRC does not.
//!
//! A CRC is checked without reading the object again: each block's CRCs (in the three
//! algorithms, since which one the origin used is known only once it is asked) are kept as the
//! block arrives, and combined; only blocks without them (replayed from disk at start) are read
//! back from the cache. The MD5s are computed over the object read back from the cache.
//! `larder_peer_origin_check_read_bytes_total` counts what the checks read back.
//!
//! A checksum that does not match does not yet blame anyone: the part sizes may be wrong,
//! and some ETags of 32 hex digits are not the MD5 (S3 with SSE-KMS or SSE-C). Each block a
//! member supplied is then fetched from the origin and compared with the cached one; only those
//! that differ are a mismatch. If none differs, the checksums of that origin (of that kind:
//! CRC, single-part or multipart ETag) are taken as unusable, and its later objects of the kind
//! are not checked (counted `unchecked`): otherwise every object from a store whose ETags are
//! not the content's MD5 would cost the origin its members' blocks a second time.
//!
//! A mismatch drops the blocks that differ from the cache (later reads fetch them from
//! the origin), opens the circuit of every member that supplied one for the longest backoff
//! (2 minutes), and is logged at warn
//! naming the object and the members. Until its check passes, an object with blocks from a
//! member is never handed to the kernel in passthrough. That a block came from a member and is
//! not yet checked is kept in the object's record (which member, in memory only): after a
//! restart, with peers on or off, the object is checked when it is next complete, and a
//! prefetch does not call it done before.
//!
//! What this tier stops: corruption and bugs, anywhere between the origin and this cache, and,
//! where the ETag is the MD5, a member that lies on purpose, once the object is complete.
//! What it does not: such a member can hand wrong bytes to a reader before the object is
//! complete (only a sealed manifest stops that), and where the origin publishes nothing
//! stronger than a CRC, it can keep its wrong bytes in the cache (counted `crc_only`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use larder_object::ObjectId;
use larder_object::crc::{BlockCrcs, FullCrc};
use larder_stats::add;
use larder_store::{Lookup, UnsettledBlock};
use md5::{Digest, Md5};
use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

use super::fill::Members;
use super::{BlockKey, Cache, OpenObject};

/// Part sizes of a multipart upload tried at once (each costs an MD5 pass over the object).
const MAX_PART_SIZES: usize = 4;

const MIB: u64 = 1 << 20;

/// Objects whose mismatch dropped blocks, remembered for the next open, at most this many.
const MISMATCHES_KEPT: usize = 1024;

/// The member of an unsettled block written before this process started: the store's record
/// keeps that the block awaits its check, not who supplied it.
const UNKNOWN_MEMBER: &str = "";

/// Entries of [`Provenance`] below which it is not swept.
const PROVENANCE_SWEEP_MIN: usize = 1024;

/// A block a rack member supplied that no origin check has passed yet.
#[derive(Debug, Clone)]
struct PeerBlock {
    /// The block, as the store has it.
    block: UnsettledBlock,
    /// The member that supplied it ([`UNKNOWN_MEMBER`] if before a restart).
    member: Arc<str>,
}

/// What the read path knows of its blocks beyond the store: the member that supplied a block
/// (written unsettled until its origin check), and the CRCs of a block fetched while the cache
/// has rack peers (the origin check combines them instead of reading the block back). Each
/// entry holds for the block its BLAKE3 names: one whose block the store no longer holds with
/// that hash (evicted, fetched again) is ignored, and swept once the table has doubled. In
/// memory only: after a restart an unsettled block names no member and its CRCs are read.
#[derive(Debug)]
struct Provenance {
    blocks: HashMap<BlockKey, Noted>,
    sweep_at: usize,
}

#[derive(Debug)]
struct Noted {
    hash: [u8; 32],
    member: Option<Arc<str>>,
    crcs: Option<BlockCrcs>,
}

/// The checks of one cache: at most one runs at a time.
#[derive(Debug)]
pub(crate) struct OriginChecks {
    /// The rack's members, when there is a peer tier: a failed check marks them.
    members: Option<Arc<dyn Members>>,
    running: Semaphore,
    /// Objects with a check queued or running.
    busy: Mutex<Busy>,
    /// Woken after each check ends.
    ended: Notify,
    /// Objects whose check dropped blocks since they were last opened: the kernel's page cache
    /// of the file may hold their bytes.
    mismatched: Mutex<HashMap<ObjectId, ()>>,
    /// Origins (by identity URL) and kinds of checksum found not to be the content's: objects
    /// of theirs are not checked.
    unusable: Mutex<HashSet<(String, Kind)>>,
    /// Objects whose blocks from rack peers were settled without proof against a lying
    /// member (a CRC, or nothing to check against), for the prefetch jobs that report them.
    weak: Mutex<HashMap<ObjectId, Checked>>,
    /// Who supplied each unsettled block, and blocks' CRCs.
    provenance: Mutex<Provenance>,
}

/// How an object's blocks from rack peers were checked against the origin, once no check is
/// left to run for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// Against what a member cannot forge (the origin's MD5, or the origin's own bytes), or
    /// no block came from a member.
    Origin,
    /// Against the origin's CRC only: no corruption, but a member could have chosen bytes
    /// that keep it.
    CrcOnly,
    /// Not at all: the origin publishes nothing to check against.
    Unchecked,
}

/// Remembers `id` in `set`, which is emptied when it holds [`MISMATCHES_KEPT`]: a bound, not
/// a cache (what is forgotten costs a kept page cache, or a report, not a wrong byte).
fn remember<V>(set: &Mutex<HashMap<ObjectId, V>>, id: ObjectId, value: V) {
    let mut set = set.lock();
    if set.len() >= MISMATCHES_KEPT {
        set.clear();
    }
    set.insert(id, value);
}

/// Objects with a check queued, and the one whose check runs.
#[derive(Debug, Default)]
struct Busy {
    queued: HashSet<ObjectId>,
    running: Option<ObjectId>,
}

impl OriginChecks {
    /// The checks of a cache with rack peers `members`, if any.
    pub(crate) fn new(members: Option<Arc<dyn Members>>) -> Self {
        Self {
            members,
            running: Semaphore::new(1),
            busy: Mutex::new(Busy::default()),
            ended: Notify::new(),
            mismatched: Mutex::default(),
            unusable: Mutex::new(HashSet::new()),
            weak: Mutex::default(),
            provenance: Mutex::new(Provenance {
                blocks: HashMap::new(),
                sweep_at: PROVENANCE_SWEEP_MIN,
            }),
        }
    }

    /// Whether blocks' CRCs are kept as they arrive, for the checks to combine: while the
    /// cache has rack peers.
    pub(crate) fn keeps_crcs(&self) -> bool {
        self.members.is_some()
    }
}

/// Why an object's blocks from rack peers do not count as the origin's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OriginCheckError {
    /// Its blocks from rack peers did not match the origin's checksum and were dropped.
    #[error(
        "blocks from rack peers did not match the origin's checksum and were dropped; run it again to fetch them from the origin"
    )]
    Dropped,
    /// The check could not finish (a block evicted while read, the origin unreachable).
    #[error("the check of blocks from rack peers against the origin's checksum could not finish")]
    Unfinished,
}

/// What the origin lets this node check an object against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checksum {
    /// The whole object's CRC.
    Crc(FullCrc),
    /// The MD5 of the whole object: a single-part upload.
    Md5([u8; 16]),
    /// The MD5 of the parts' MD5s, how many parts, and the first part's size if the origin
    /// said it: a multipart upload.
    Multipart {
        digest: [u8; 16],
        parts: u32,
        first_part: Option<u64>,
    },
}

/// The kinds of checksum, each found usable or not per origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Crc,
    Md5,
    Multipart,
}

impl Checksum {
    fn kind(self) -> Kind {
        match self {
            Self::Crc(_) => Kind::Crc,
            Self::Md5(_) => Kind::Md5,
            Self::Multipart { .. } => Kind::Multipart,
        }
    }

    /// The checksum an ETag (quoted or not) carries, if it has a shape this node knows.
    fn of_etag(etag: &str) -> Option<Self> {
        let etag = etag.trim_matches('"');
        let (hex, parts) = match etag.split_once('-') {
            Some((hex, parts)) => (hex, Some(parts)),
            None => (etag, None),
        };
        let mut digest = [0; 16];
        if hex.len() != 32 {
            return None;
        }
        hex::decode_to_slice(hex, &mut digest).ok()?;
        match parts {
            None => Some(Self::Md5(digest)),
            Some(parts) if parts.bytes().all(|b| b.is_ascii_digit()) => {
                let parts = parts.parse().ok().filter(|&n| n > 0)?;
                Some(Self::Multipart {
                    digest,
                    parts,
                    first_part: None,
                })
            }
            Some(_) => None,
        }
    }
}

/// The strongest checksum of those the origin publishes whose kind is `usable` for it: the
/// ETag's MD5 (single-part or multipart), else the full-object CRC.
fn strongest(
    etag: Option<Checksum>,
    crc: Option<FullCrc>,
    usable: impl Fn(Kind) -> bool,
) -> Option<Checksum> {
    [etag, crc.map(Checksum::Crc)]
        .into_iter()
        .flatten()
        .find(|checksum| usable(checksum.kind()))
}

/// The part sizes to try for an object of `size` bytes uploaded in `parts` parts: every part
/// but the last of one size, the last one not empty. The first part's size where the origin
/// said it and it fits; else whole numbers of MiB, powers of two first (the AWS CLI's 8 MiB and
/// its doublings), then the smallest; at most [`MAX_PART_SIZES`].
fn part_sizes(size: u64, parts: u32, first_part: Option<u64>) -> Vec<u64> {
    let parts = u64::from(parts);
    if parts == 1 {
        return vec![size.max(1)];
    }
    // P with (parts - 1) * P < size <= parts * P.
    let (low, high) = (size.div_ceil(parts), size.saturating_sub(1) / (parts - 1));
    if let Some(first) = first_part.filter(|p| (low..=high).contains(p)) {
        return vec![first];
    }
    let mut sizes: Vec<u64> = (low.div_ceil(MIB)..=high / MIB)
        .filter(|&mib| mib > 0)
        .map(|mib| mib * MIB)
        .collect();
    sizes.sort_by_key(|&p| (!(p / MIB).is_power_of_two(), p));
    sizes.truncate(MAX_PART_SIZES);
    sizes
}

/// The multipart ETag digest of a stream of bytes cut into parts of one size.
#[derive(Debug, Clone)]
struct PartsMd5 {
    part_size: u64,
    /// Bytes of the current part so far.
    filled: u64,
    part: Md5,
    parts: Md5,
    count: u32,
}

impl PartsMd5 {
    fn new(part_size: u64) -> Self {
        Self {
            part_size,
            filled: 0,
            part: Md5::new(),
            parts: Md5::new(),
            count: 0,
        }
    }

    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (self.part_size - self.filled).min(bytes.len() as u64) as usize;
            self.part.update(&bytes[..take]);
            self.filled += take as u64;
            bytes = &bytes[take..];
            if self.filled == self.part_size {
                self.end_part();
            }
        }
    }

    fn end_part(&mut self) {
        let part = std::mem::replace(&mut self.part, Md5::new()).finalize();
        self.parts.update(part);
        self.count += 1;
        self.filled = 0;
    }

    /// The number of parts and the MD5 of their MD5s.
    fn finish(mut self) -> (u32, [u8; 16]) {
        if self.filled > 0 {
            self.end_part();
        }
        (self.count, self.parts.finalize().into())
    }
}

/// Hashers for one checksum, fed the object in order.
#[derive(Debug, Clone)]
enum Hashers {
    Md5(Md5),
    Parts(Vec<PartsMd5>),
}

impl Hashers {
    /// The hashers for an MD5 checksum; a CRC is combined from the blocks' own instead (the
    /// error gives it back).
    fn new(checksum: Checksum, size: u64) -> Result<Self, FullCrc> {
        Ok(match checksum {
            Checksum::Crc(crc) => return Err(crc),
            Checksum::Md5(_) => Self::Md5(Md5::new()),
            Checksum::Multipart {
                parts, first_part, ..
            } => Self::Parts(
                part_sizes(size, parts, first_part)
                    .into_iter()
                    .map(PartsMd5::new)
                    .collect(),
            ),
        })
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Md5(md5) => md5.update(bytes),
            Self::Parts(guesses) => guesses.iter_mut().for_each(|g| g.update(bytes)),
        }
    }

    /// Whether the object fed gives `checksum` (for a multipart one, with any part size tried).
    fn matches(self, checksum: Checksum) -> bool {
        match (self, checksum) {
            (Self::Md5(md5), Checksum::Md5(digest)) => <[u8; 16]>::from(md5.finalize()) == digest,
            (Self::Parts(guesses), Checksum::Multipart { digest, parts, .. }) => {
                guesses.into_iter().any(|g| g.finish() == (parts, digest))
            }
            _ => false,
        }
    }
}

/// Why a check could not finish: it is tried again when the object next completes.
#[derive(Debug, thiserror::Error)]
enum CheckError {
    /// A block left the cache while it was read.
    #[error("block {0} left the cache during the check")]
    BlockGone(u32),
    /// The origin could not supply a block to compare.
    #[error(transparent)]
    Origin(#[from] larder_origin::OriginError),
    /// The hashing task was lost.
    #[error("the hashing task failed")]
    Hashing,
}

impl Cache {
    /// Notes, for the origin check, who supplied the block `key` the store now holds with
    /// BLAKE3 `hash` (a member, written unsettled) and its CRCs, where either is known.
    pub(crate) fn note_written(
        &self,
        key: BlockKey,
        hash: [u8; 32],
        member: Option<Arc<str>>,
        crcs: Option<BlockCrcs>,
    ) {
        if member.is_none() && crcs.is_none() {
            return;
        }
        let store = self.store();
        let mut provenance = self.checks().provenance.lock();
        if provenance.blocks.len() >= provenance.sweep_at {
            provenance
                .blocks
                .retain(|&(id, index), noted| store.block_hash(id, index) == Some(noted.hash));
            provenance.sweep_at = (2 * provenance.blocks.len()).max(PROVENANCE_SWEEP_MIN);
        }
        provenance.blocks.insert(key, Noted { hash, member, crcs });
    }

    /// What is noted of block `key`, if it still holds for the block the store has.
    fn noted<T>(&self, key: BlockKey, hash: [u8; 32], what: impl FnOnce(&Noted) -> Option<T>) -> Option<T> {
        let provenance = self.checks().provenance.lock();
        provenance
            .blocks
            .get(&key)
            .filter(|noted| noted.hash == hash)
            .and_then(what)
    }

    /// The blocks of `object` rack members supplied that no origin check has passed, when it
    /// is complete in the store and holds any (see [`larder_store::BlockStore::unsettled`]).
    fn peer_blocks(&self, object: &OpenObject) -> Option<Vec<PeerBlock>> {
        let blocks = self.store().unsettled(object.id, object.version.size)?;
        let peer_block = |block: UnsettledBlock| {
            let member = self.noted((object.id, block.index), block.hash, |n| n.member.clone());
            PeerBlock {
                member: member.unwrap_or_else(|| UNKNOWN_MEMBER.into()),
                block,
            }
        };
        Some(blocks.into_iter().map(peer_block).collect())
    }

    /// The store settles `blocks` of `object`; what was noted of their members goes.
    async fn settle(&self, object: &OpenObject, blocks: &[PeerBlock]) {
        let unsettled: Vec<UnsettledBlock> = blocks.iter().map(|b| b.block.clone()).collect();
        self.store().settle(object.id, &unsettled).await;
        let mut provenance = self.checks().provenance.lock();
        for block in blocks {
            if let Some(noted) = provenance.blocks.get_mut(&(object.id, block.block.index)) {
                noted.member = None;
            }
        }
    }

    /// If `object` is complete in the cache and holds blocks from rack members not yet
    /// checked, queues its origin check (after each write, and before a prefetch calls it done).
    pub fn queue_check(&self, object: &Arc<OpenObject>) {
        // Peers may be off now, and the blocks from before a restart: they are checked anyway.
        if self.store().unsettled(object.id, object.version.size).is_none() {
            return;
        }
        if !self.checks().busy.lock().queued.insert(object.id) {
            return;
        }
        let (cache, object) = (self.clone(), object.clone());
        self.spawn(async move {
            let checks = cache.checks();
            if let Ok(_running) = checks.running.acquire().await {
                {
                    // Blocks written from now on queue a new check.
                    let mut busy = checks.busy.lock();
                    busy.queued.remove(&object.id);
                    busy.running = Some(object.id);
                }
                tokio::select! {
                    biased;
                    () = cache.stopped() => {}
                    () = cache.check(&object) => {}
                }
            }
            let mut busy = checks.busy.lock();
            busy.queued.remove(&object.id);
            busy.running = None;
            checks.ended.notify_waiters();
        });
    }

    /// Waits for the origin check of `object` (queued here if its last write has not queued it
    /// yet) and says whether it leaves the object's blocks counted as the origin's, and how
    /// they were checked: what a prefetch job needs before it calls an object done.
    pub async fn origin_checked(&self, object: &Arc<OpenObject>) -> Result<Checked, OriginCheckError> {
        let checks = self.checks();
        self.queue_check(object);
        loop {
            let ended = checks.ended.notified();
            tokio::pin!(ended);
            // Registered before the look, so a check ending in between still wakes us.
            ended.as_mut().enable();
            {
                let busy = checks.busy.lock();
                if !busy.queued.contains(&object.id) && busy.running != Some(object.id) {
                    break;
                }
            }
            ended.await;
        }
        let store = self.store();
        let complete = (0..self.block_count(object)).all(|index| store.contains(object.id, index));
        if !complete && checks.mismatched.lock().contains_key(&object.id) {
            return Err(OriginCheckError::Dropped);
        }
        match store.unsettled(object.id, object.version.size) {
            Some(_) => Err(OriginCheckError::Unfinished),
            None => Ok(checks
                .weak
                .lock()
                .get(&object.id)
                .copied()
                .unwrap_or(Checked::Origin)),
        }
    }

    /// Whether an origin check dropped blocks of `id` since this was last asked: the file's
    /// pages the kernel keeps may hold a member's bytes, so its next open must not keep them.
    pub fn take_origin_mismatch(&self, id: ObjectId) -> bool {
        self.checks().mismatched.lock().remove(&id).is_some()
    }

    /// Checks `object` against its ETag, and keeps or drops its blocks from members.
    async fn check(&self, object: &Arc<OpenObject>) {
        let stats = self.stats();
        let Some(blocks) = self.peer_blocks(object) else {
            return;
        };
        let key = object.version.key.as_str();
        let etag = object.version.etag.as_deref().and_then(Checksum::of_etag);
        let multipart = matches!(etag, Some(Checksum::Multipart { .. }));
        let published = object.origin.published(&object.version, multipart).await;
        let etag = etag.map(|etag| match etag {
            Checksum::Multipart { digest, parts, .. } => Checksum::Multipart {
                digest,
                parts,
                first_part: published.first_part,
            },
            etag => etag,
        });
        // An MD5 the store publishes apart from the ETag is the content's for sure.
        let etag = published.md5.map(Checksum::Md5).or(etag);
        let identity = object.origin.identity_url();
        let usable = |kind: Kind| {
            let shape = (identity.to_owned(), kind);
            !self.checks().unusable.lock().contains(&shape)
        };
        let Some(checksum) = strongest(etag, published.crc, usable) else {
            add(&stats.origin_checks_unchecked, 1);
            remember(&self.checks().weak, object.id, Checked::Unchecked);
            tracing::debug!(
                key,
                "the origin publishes no checksum to check blocks from rack peers against"
            );
            self.settle(object, &blocks).await;
            return;
        };
        // The ETag may be wrong about the bytes (SSE-KMS gives 32 hex digits that are not the
        // MD5) or the part sizes guessed may be: only the origin's own bytes blame a member.
        let hashed = self.hash_cached(object, checksum).await;
        // A CRC that matched proves no more than that nothing was corrupted by accident.
        let forgeable = matches!((&hashed, checksum), (Ok(true), Checksum::Crc(_)));
        let bad = match hashed {
            Ok(true) => {
                tracing::debug!(
                    key,
                    ?checksum,
                    "blocks from rack peers match the origin's checksum"
                );
                Ok(Vec::new())
            }
            Ok(false) => {
                let bad = self.compare_with_origin(object, &blocks).await;
                if bad.as_ref().is_ok_and(Vec::is_empty) {
                    tracing::info!(
                        key,
                        kind = ?checksum.kind(),
                        "this origin's checksums of this kind are not of the bytes (ETags under \
                         SSE-KMS or SSE-C, or part sizes not guessed): its objects are not \
                         checked against them from now on; seal them (larder seal) to check \
                         blocks from rack peers"
                    );
                    let shape = (identity.to_owned(), checksum.kind());
                    self.checks().unusable.lock().insert(shape);
                }
                bad
            }
            Err(error) => Err(error),
        };
        match bad {
            Ok(bad) => {
                if bad.is_empty() {
                    if forgeable {
                        add(&stats.origin_checks_crc_only, 1);
                        remember(&self.checks().weak, object.id, Checked::CrcOnly);
                    } else {
                        add(&stats.origin_checks_match, 1);
                    }
                } else {
                    self.mismatch(object, &bad).await;
                }
                // The rest are the origin's.
                self.settle(object, &blocks).await;
            }
            Err(error) => {
                tracing::debug!(key, %error, "origin check not finished; it runs again when the object is next complete")
            }
        }
    }

    /// Whether the cached object gives `checksum`, reading its blocks from the store in order
    /// (for a CRC, only those whose CRCs were not kept).
    async fn hash_cached(&self, object: &OpenObject, checksum: Checksum) -> Result<bool, CheckError> {
        let store = self.store();
        let mut hashers = match Hashers::new(checksum, object.version.size) {
            Ok(hashers) => hashers,
            Err(crc) => return self.crc_cached(object, crc).await,
        };
        for index in 0..self.block_count(object) {
            let bytes = match store.read_block(&object.version, object.id, index).await {
                Ok(Lookup::Hit(hit)) => hit.bytes,
                Ok(Lookup::Miss | Lookup::LostRace) | Err(_) => return Err(CheckError::BlockGone(index)),
            };
            add(&self.stats().origin_check_read_bytes, bytes.len() as u64);
            hashers = tokio::task::spawn_blocking(move || {
                hashers.update(&bytes);
                hashers
            })
            .await
            .map_err(|_| CheckError::Hashing)?;
        }
        Ok(hashers.matches(checksum))
    }

    /// Whether the cached object's CRC is `crc`: its blocks' kept CRCs combined, a block whose
    /// CRC was not kept read from the store.
    async fn crc_cached(&self, object: &OpenObject, crc: FullCrc) -> Result<bool, CheckError> {
        let store = self.store();
        let (algorithm, expected) = crc.algorithm();
        let count = self.block_count(object);
        let mut whole = None;
        for index in 0..count {
            let len = store.block_len(object.version.size, index);
            let kept = store
                .block_hash(object.id, index)
                .and_then(|hash| self.noted((object.id, index), hash, |n| n.crcs));
            let block = match kept {
                Some(crcs) => crcs.get(crc),
                None => {
                    let bytes = match store.read_block(&object.version, object.id, index).await {
                        Ok(Lookup::Hit(hit)) => hit.bytes,
                        Ok(Lookup::Miss | Lookup::LostRace) | Err(_) => {
                            return Err(CheckError::BlockGone(index));
                        }
                    };
                    add(&self.stats().origin_check_read_bytes, len);
                    tokio::task::spawn_blocking(move || crc_fast::checksum(algorithm, &bytes))
                        .await
                        .map_err(|_| CheckError::Hashing)?
                }
            };
            whole = Some(whole.map_or(block, |acc| {
                crc_fast::checksum_combine(algorithm, acc, block, len)
            }));
        }
        Ok(whole.unwrap_or_else(|| crc_fast::checksum(algorithm, b"")) == expected)
    }

    /// The ETag did not match: fetches each block a member supplied from the origin and
    /// compares their BLAKE3s. The blocks that differ.
    async fn compare_with_origin(
        &self,
        object: &OpenObject,
        blocks: &[PeerBlock],
    ) -> Result<Vec<PeerBlock>, CheckError> {
        let store = self.store();
        let mut bad = Vec::new();
        for peer_block in blocks {
            let block = &peer_block.block;
            let start = self.block_start(block.index);
            let end = start + store.block_len(object.version.size, block.index);
            let mut hasher = blake3::Hasher::new();
            let mut sink = |chunk: bytes::Bytes| {
                hasher.update(&chunk);
            };
            let started = tokio::time::Instant::now();
            object
                .origin
                .read_range(&object.version, start..end, started, &mut sink)
                .await?;
            if *hasher.finalize().as_bytes() != block.hash {
                bad.push(peer_block.clone());
            }
        }
        Ok(bad)
    }

    /// The blocks `bad` of `object` came from members and are not the origin's: drops them,
    /// counts it, opens the members' circuits and says so.
    async fn mismatch(&self, object: &OpenObject, bad: &[PeerBlock]) {
        let checks = self.checks();
        let dropped: Vec<UnsettledBlock> = bad.iter().map(|b| b.block.clone()).collect();
        self.store().drop_unsettled(object.id, &dropped).await;
        // Nor may a copy kept in memory for a reader serve them.
        for block in &dropped {
            self.sharing().release_kept((object.id, block.index));
        }
        add(&self.stats().origin_checks_mismatch, 1);
        remember(&checks.mismatched, object.id, ());
        // Blocks recorded before a restart name no member ("a member before the restart").
        let members: BTreeSet<&str> = bad
            .iter()
            .map(|b| match &*b.member {
                UNKNOWN_MEMBER => "(a member, before a restart)",
                member => member,
            })
            .collect();
        if let Some(membership) = &checks.members {
            for member in &members {
                membership.sent_wrong_blocks(member);
            }
        }
        tracing::warn!(
            key = %object.version.key,
            object = %object.id,
            ?members,
            blocks = bad.len(),
            "blocks from rack peers do not match the origin's checksum: dropped from the cache \
             (later reads fetch them from the origin), and the members are left out for 2 minutes"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CRC is what a member holding the key can forge; the MD5 in the ETag is not: the ETag
    /// comes first wherever both are published (the check used the CRC before).
    #[test]
    fn the_etags_md5_is_used_over_a_crc_and_the_crc_only_when_nothing_stronger_is_usable() {
        let md5 = Checksum::of_etag("\"0123456789abcdef0123456789abcdef\"");
        let parts = Checksum::of_etag("0123456789abcdef0123456789abcdef-3");
        let crc = Some(FullCrc::Crc32(7));
        let all = |_| true;
        assert_eq!(strongest(md5, crc, all), md5);
        assert_eq!(strongest(parts, crc, all), parts);
        assert_eq!(strongest(None, crc, all), Some(Checksum::Crc(FullCrc::Crc32(7))));
        // This origin's ETags proved not to be the MD5 (SSE-KMS): the CRC is all there is.
        let no_md5 = |kind| kind == Kind::Crc;
        assert_eq!(
            strongest(md5, crc, no_md5),
            Some(Checksum::Crc(FullCrc::Crc32(7)))
        );
        assert_eq!(strongest(md5, None, no_md5), None);
        assert_eq!(strongest(None, None, all), None);
    }

    fn md5(bytes: &[u8]) -> [u8; 16] {
        Md5::digest(bytes).into()
    }

    #[test]
    fn etag_shapes() {
        let hex = "d41d8cd98f00b204e9800998ecf8427e";
        let digest = md5(b"");
        assert_eq!(Checksum::of_etag(hex), Some(Checksum::Md5(digest)));
        assert_eq!(
            Checksum::of_etag(&format!("\"{hex}\"")),
            Some(Checksum::Md5(digest))
        );
        assert_eq!(
            Checksum::of_etag(&format!("\"{hex}-12\"")),
            Some(Checksum::Multipart {
                digest,
                parts: 12,
                first_part: None
            })
        );
        for other in [
            "",
            "\"\"",
            "abc",
            &format!("{hex}-"),
            &format!("{hex}-0"),
            &format!("{hex}-x"),
            &format!("{hex}-+3"),
            &format!("W/\"{hex}\""),
            "0x8DC1B2C3D4E5F60",
            "zz1d8cd98f00b204e9800998ecf8427e",
        ] {
            assert_eq!(Checksum::of_etag(other), None, "{other}");
        }
    }

    #[test]
    fn part_sizes_fit_the_number_of_parts() {
        // 100 MiB in 13 parts: 8 MiB parts (12 of them and 4 MiB).
        assert_eq!(part_sizes(100 * MIB, 13, None), vec![8 * MIB]);
        // 64 MiB in 2 parts: 32 MiB first, then whole MiB from 33.
        assert_eq!(
            part_sizes(64 * MIB, 2, None),
            vec![32 * MIB, 33 * MIB, 34 * MIB, 35 * MIB]
        );
        assert_eq!(part_sizes(10, 1, None), vec![10]);
        // No whole MiB fits.
        assert!(
            part_sizes(10 * MIB + 7, 3, None)
                .iter()
                .all(|p| (10 * MIB + 7).div_ceil(*p) == 3)
        );
        assert!(part_sizes(5, 3, None).is_empty());
        for (size, parts) in [
            (100 * MIB, 13),
            (64 * MIB, 2),
            (1 << 40, 10_000),
            (77 * MIB + 3, 9),
        ] {
            for p in part_sizes(size, parts, None) {
                assert_eq!(size.div_ceil(p), u64::from(parts), "{size} {parts} {p}");
            }
        }
        // The first part's size as the origin said it, where it fits; else the guesses.
        let odd = 11 * MIB / 2;
        assert_eq!(part_sizes(64 * MIB, 12, Some(odd)), vec![odd]);
        assert_eq!(
            part_sizes(100 * MIB, 13, Some(odd)),
            part_sizes(100 * MIB, 13, None)
        );
    }

    #[test]
    fn the_multipart_digest_is_the_md5_of_the_part_md5s() {
        let data: Vec<u8> = (0..(5 * MIB as usize / 2)).map(|i| (i * 7 % 251) as u8).collect();
        let expected = {
            let mut parts = Vec::new();
            for part in data.chunks(MIB as usize) {
                parts.extend_from_slice(&md5(part));
            }
            md5(&parts)
        };
        let checksum = Checksum::Multipart {
            digest: expected,
            parts: 3,
            first_part: None,
        };
        let mut hashers = Hashers::new(checksum, data.len() as u64).expect("an MD5");
        // Fed in pieces that do not line up with the parts.
        for piece in data.chunks(333_333) {
            hashers.update(piece);
        }
        assert!(hashers.clone().matches(checksum));
        let other = Checksum::Multipart {
            digest: md5(b"x"),
            parts: 3,
            first_part: None,
        };
        assert!(!hashers.matches(other));

        let whole = Checksum::Md5(md5(&data));
        let mut single = Hashers::new(whole, data.len() as u64).expect("an MD5");
        single.update(&data);
        assert!(single.clone().matches(whole));
        assert!(!single.matches(Checksum::Md5(md5(b"x"))));
    }
}
