//! The on-disk format of a block record.
//!
//! Every cached object version has a sparse data file holding its blocks at their natural
//! offsets (no header, so the file can be handed to the kernel as it is) and a record file:
//!
//! ```text
//! header   magic "LARDREC\0" | format version u32 | header length u32 | block size u32 |
//!          reserved u32 (0) | object size u64 | ObjectId [32] | identity length u32 |
//!          identity bytes | CRC32 of all the preceding header bytes u32
//! entries  kind u8 | 3 zero bytes | block index u32 |
//!          BLAKE3 of the block [32] (zero but for kinds 1 and 3) | CRC32 of the preceding 40 bytes u32
//! ```
//!
//! Entry kinds: 1 present; 2 removed; 3 present and unsettled: awaiting a check from outside
//! the store (the read path writes a rack member's block so, until the object passes the
//! origin's checksum); 4 the unsettled block is settled (its check passed, or there was
//! nothing to check it against). Kinds 3 and 4 came after the format's first release without
//! a version bump, on purpose: a build that does not know them reads the first of them as a
//! torn tail, so it never takes an unchecked block for a checked one; it only loses the blocks
//! recorded after it.
//!
//! Integers are little-endian. Entries are appended after the block's bytes are written, so a
//! present entry never names bytes that were not written. Replay applies entries in order; the
//! first entry that is short, fails its CRC or names a block past the object's end marks a torn
//! tail, and it and everything after it are ignored (and cut off when the record is next
//! opened). A header whose block size is not a power of two is refused.

use std::collections::{HashMap, HashSet};

use larder_object::ObjectId;

/// First bytes of every record file.
pub const MAGIC: [u8; 8] = *b"LARDREC\0";
/// Bumped whenever the layout above changes.
pub const FORMAT_VERSION: u32 = 1;
/// Size of one entry.
pub const ENTRY_LEN: usize = 44;

const FIXED_HEADER_LEN: usize = 68;
const KIND_PRESENT: u8 = 1;
const KIND_REMOVED: u8 = 2;
const KIND_UNSETTLED: u8 = 3;
const KIND_SETTLED: u8 = 4;

/// Why a record could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// Not a record file.
    #[error("bad magic bytes")]
    BadMagic,
    /// Written by another format version.
    #[error("format version {0} is not supported (this build reads {FORMAT_VERSION})")]
    UnsupportedVersion(u32),
    /// Shorter than its header says.
    #[error("the header is truncated")]
    Truncated,
    /// The header's checksum does not match.
    #[error("the header checksum does not match")]
    BadChecksum,
    /// The header is intact but describes something else than expected.
    #[error("the header's {0} does not match")]
    Mismatch(&'static str),
}

/// What a record's header says about its object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    /// Block size the data file was written with.
    pub block_size: u32,
    /// Object size in bytes.
    pub object_size: u64,
    /// BLAKE3 of `identity`.
    pub object_id: ObjectId,
    /// The object version's canonical identity.
    pub identity: Vec<u8>,
}

impl RecordHeader {
    /// Serialises the header with its checksum.
    pub fn encode(&self) -> Vec<u8> {
        let header_len = FIXED_HEADER_LEN + self.identity.len() + 4;
        let mut out = Vec::with_capacity(header_len);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(header_len as u32).to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.object_size.to_le_bytes());
        out.extend_from_slice(&self.object_id.0);
        out.extend_from_slice(&(self.identity.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.identity);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Parses and checks a header; returns it and its length. Checks the magic, version,
    /// checksum, that the block size is a power of two, and that the id is the hash of the
    /// identity.
    pub fn decode(bytes: &[u8]) -> Result<(Self, usize), FormatError> {
        if bytes.len() < FIXED_HEADER_LEN + 4 {
            return Err(FormatError::Truncated);
        }
        if bytes[0..8] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = u32_at(bytes, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let header_len = u32_at(bytes, 12) as usize;
        let identity_len = u32_at(bytes, 64) as usize;
        if header_len != FIXED_HEADER_LEN + identity_len + 4 {
            return Err(FormatError::BadChecksum);
        }
        if bytes.len() < header_len {
            return Err(FormatError::Truncated);
        }
        if crc32fast::hash(&bytes[..header_len - 4]) != u32_at(bytes, header_len - 4) {
            return Err(FormatError::BadChecksum);
        }
        let block_size = u32_at(bytes, 16);
        if !block_size.is_power_of_two() {
            return Err(FormatError::Mismatch("block size"));
        }
        let mut object_id = [0u8; 32];
        object_id.copy_from_slice(&bytes[32..64]);
        let identity = bytes[FIXED_HEADER_LEN..FIXED_HEADER_LEN + identity_len].to_vec();
        if *blake3::hash(&identity).as_bytes() != object_id {
            return Err(FormatError::Mismatch("object id"));
        }
        let header = Self {
            block_size,
            object_size: u64_at(bytes, 24),
            object_id: ObjectId(object_id),
            identity,
        };
        Ok((header, header_len))
    }
}

/// One record entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// The block's bytes are in the data file and hash to this.
    Present {
        /// Block index.
        index: u32,
        /// BLAKE3 of the block's bytes.
        hash: [u8; 32],
    },
    /// The block was dropped (evicted or found corrupt).
    Removed {
        /// Block index.
        index: u32,
    },
    /// The block's bytes are in the data file and hash to this; they await a check from
    /// outside the store (the origin check of a rack member's bytes) that has not passed yet.
    Unsettled {
        /// Block index.
        index: u32,
        /// BLAKE3 of the block's bytes.
        hash: [u8; 32],
    },
    /// The unsettled block passed its check: it counts as any other from now on.
    Settled {
        /// Block index.
        index: u32,
    },
}

impl Entry {
    /// Serialises the entry with its checksum.
    pub fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut out = [0u8; ENTRY_LEN];
        let (kind, index, hash) = match *self {
            Entry::Present { index, hash } => (KIND_PRESENT, index, hash),
            Entry::Removed { index } => (KIND_REMOVED, index, [0; 32]),
            Entry::Unsettled { index, hash } => (KIND_UNSETTLED, index, hash),
            Entry::Settled { index } => (KIND_SETTLED, index, [0; 32]),
        };
        out[0] = kind;
        out[4..8].copy_from_slice(&index.to_le_bytes());
        out[8..40].copy_from_slice(&hash);
        let crc = crc32fast::hash(&out[..40]);
        out[40..44].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Parses an entry; `None` when it is torn or garbage.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < ENTRY_LEN || crc32fast::hash(&bytes[..40]) != u32_at(bytes, 40) {
            return None;
        }
        let index = u32_at(bytes, 4);
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&bytes[8..40]);
        match bytes[0] {
            KIND_PRESENT => Some(Entry::Present { index, hash }),
            KIND_REMOVED => Some(Entry::Removed { index }),
            KIND_UNSETTLED => Some(Entry::Unsettled { index, hash }),
            KIND_SETTLED => Some(Entry::Settled { index }),
            _ => None,
        }
    }
}

/// A replayed record: the header, the blocks present, and where the valid part ends.
#[derive(Debug)]
pub struct Replayed {
    /// The header.
    pub header: RecordHeader,
    /// Present blocks and their hashes.
    pub blocks: HashMap<u32, [u8; 32]>,
    /// The present blocks written unsettled and not settled since.
    pub unsettled: HashSet<u32>,
    /// Length of the valid prefix of the file; anything after it is a torn tail.
    pub valid_len: usize,
    /// Number of valid entries (present and removed), to decide when to compact.
    pub entries: usize,
}

/// Replays a whole record file.
pub fn replay(bytes: &[u8]) -> Result<Replayed, FormatError> {
    let (header, mut offset) = RecordHeader::decode(bytes)?;
    // Nonzero: the header's block size is a power of two.
    let block_count = header.object_size.div_ceil(u64::from(header.block_size));
    let in_object = |entry: &Entry| match *entry {
        Entry::Present { index, .. }
        | Entry::Removed { index }
        | Entry::Unsettled { index, .. }
        | Entry::Settled { index } => u64::from(index) < block_count,
    };
    let mut blocks = HashMap::new();
    let mut unsettled = HashSet::new();
    let mut entries = 0;
    while let Some(entry) = bytes
        .get(offset..offset + ENTRY_LEN)
        .and_then(Entry::decode)
        .filter(in_object)
    {
        match entry {
            Entry::Present { index, hash } => {
                blocks.insert(index, hash);
                unsettled.remove(&index);
            }
            Entry::Unsettled { index, hash } => {
                blocks.insert(index, hash);
                unsettled.insert(index);
            }
            Entry::Removed { index } => {
                blocks.remove(&index);
                unsettled.remove(&index);
            }
            Entry::Settled { index } => {
                unsettled.remove(&index);
            }
        }
        offset += ENTRY_LEN;
        entries += 1;
    }
    Ok(Replayed {
        header,
        blocks,
        unsettled,
        valid_len: offset,
        entries,
    })
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn header() -> RecordHeader {
        let identity = b"larder.object.v1 test identity".to_vec();
        RecordHeader {
            block_size: 4 << 20,
            object_size: 10_000_000,
            object_id: ObjectId(*blake3::hash(&identity).as_bytes()),
            identity,
        }
    }

    /// Fails when the format changes: bump FORMAT_VERSION and update the golden bytes.
    #[test]
    fn golden_bytes() {
        let mut record = header().encode();
        record.extend_from_slice(
            &Entry::Present {
                index: 2,
                hash: [0xab; 32],
            }
            .encode(),
        );
        record.extend_from_slice(&Entry::Removed { index: 2 }.encode());
        record.extend_from_slice(
            &Entry::Unsettled {
                index: 1,
                hash: [0xcd; 32],
            }
            .encode(),
        );
        record.extend_from_slice(&Entry::Settled { index: 1 }.encode());
        let golden = concat!(
            "4c41524452454300",
            "01000000",
            "66000000",
            "00004000",
            "00000000",
            "8096980000000000",
            "9da2780521b5cbb03095b4eb293ade3ed2962ff4cab51c053c233b0ee9d6f982",
            "1e000000",
            "6c61726465722e6f626a6563742e76312074657374206964656e74697479",
            "b15de9c2",
            "01000000",
            "02000000",
            "abababababababababababababababababababababababababababababababab",
            "389eb877",
            "02000000",
            "02000000",
            "0000000000000000000000000000000000000000000000000000000000000000",
            "15b0849d",
            "03000000",
            "01000000",
            "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",
            "b5f4c9ff",
            "04000000",
            "01000000",
            "0000000000000000000000000000000000000000000000000000000000000000",
            "fbaa1dac",
        );
        assert_eq!(hex::encode(&record), golden);
    }

    #[test]
    fn replay_applies_entries_in_order_and_stops_at_a_torn_tail() {
        let mut record = header().encode();
        let header_len = record.len();
        for entry in [
            Entry::Present {
                index: 0,
                hash: [1; 32],
            },
            Entry::Present {
                index: 1,
                hash: [2; 32],
            },
            Entry::Removed { index: 0 },
        ] {
            record.extend_from_slice(&entry.encode());
        }
        let whole = record.len();
        // A torn append: half an entry.
        record.extend_from_slice(
            &Entry::Present {
                index: 5,
                hash: [5; 32],
            }
            .encode()[..20],
        );
        let replayed = replay(&record).expect("replay");
        assert_eq!(replayed.header, header());
        assert_eq!(replayed.blocks, HashMap::from([(1, [2; 32])]));
        assert_eq!(replayed.valid_len, whole);
        assert_eq!(replayed.entries, 3);

        // An entry naming a block past the object's end (3 blocks of 4 MiB) ends it too.
        let mut past_the_end = record[..header_len + ENTRY_LEN].to_vec();
        past_the_end.extend_from_slice(
            &Entry::Present {
                index: 3,
                hash: [3; 32],
            }
            .encode(),
        );
        let replayed = replay(&past_the_end).expect("replay");
        assert_eq!(replayed.blocks, HashMap::from([(0, [1; 32])]));
        assert_eq!(replayed.valid_len, header_len + ENTRY_LEN);

        // A flipped bit in an entry ends the replay there.
        let mut flipped = record[..whole].to_vec();
        flipped[header_len + ENTRY_LEN + 9] ^= 1;
        let replayed = replay(&flipped).expect("replay");
        assert_eq!(replayed.blocks, HashMap::from([(0, [1; 32])]));
        assert_eq!(replayed.valid_len, header_len + ENTRY_LEN);
    }

    #[test]
    fn unsettled_blocks_stay_so_until_settled_replaced_or_removed() {
        let mut record = header().encode();
        let hash = [7; 32];
        for entry in [
            Entry::Unsettled { index: 0, hash },
            Entry::Unsettled { index: 1, hash },
            Entry::Unsettled { index: 2, hash },
            Entry::Settled { index: 0 },
            Entry::Present { index: 1, hash },
            Entry::Removed { index: 2 },
            Entry::Unsettled { index: 2, hash },
        ] {
            record.extend_from_slice(&entry.encode());
        }
        let replayed = replay(&record).expect("replay");
        assert_eq!(replayed.blocks.len(), 3);
        assert_eq!(replayed.unsettled, HashSet::from([2]));
    }

    #[test]
    fn damaged_headers_are_refused() {
        let good = header().encode();
        assert_eq!(
            RecordHeader::decode(&good[..good.len() - 1]),
            Err(FormatError::Truncated)
        );
        let mut bad = good.clone();
        bad[0] = b'X';
        assert_eq!(RecordHeader::decode(&bad), Err(FormatError::BadMagic));
        let mut bad = good.clone();
        bad[8] = 9;
        assert_eq!(
            RecordHeader::decode(&bad),
            Err(FormatError::UnsupportedVersion(9))
        );
        let mut bad = good.clone();
        bad[30] ^= 1;
        assert_eq!(RecordHeader::decode(&bad), Err(FormatError::BadChecksum));
        let mut forged = header();
        forged.block_size = 0;
        assert_eq!(
            RecordHeader::decode(&forged.encode()),
            Err(FormatError::Mismatch("block size"))
        );
        let mut forged = header();
        forged.object_id = ObjectId([7; 32]);
        assert_eq!(
            RecordHeader::decode(&forged.encode()),
            Err(FormatError::Mismatch("object id"))
        );
    }

    /// A record of `entries` under a header with these fields, encoded as it would be written.
    fn record_of(block_size: u32, object_size: u64, identity: Vec<u8>, entries: &[(bool, u32)]) -> Vec<u8> {
        let header = RecordHeader {
            block_size,
            object_size,
            object_id: ObjectId(*blake3::hash(&identity).as_bytes()),
            identity,
        };
        let mut record = header.encode();
        for &(present, index) in entries {
            let entry = if present {
                Entry::Present {
                    index,
                    hash: [index as u8; 32],
                }
            } else {
                Entry::Removed { index }
            };
            record.extend_from_slice(&entry.encode());
        }
        record
    }

    /// What any replay result must satisfy for the `len` bytes it read: its valid part lies
    /// within them, is the header and whole entries, and every block it keeps lies within
    /// the object (so the store's accounting of a replayed record is bounded by its size).
    fn check_bounded(replayed: &Replayed, len: usize) {
        let header_len = replayed.header.encode().len();
        assert!(replayed.valid_len <= len);
        assert_eq!(replayed.valid_len, header_len + replayed.entries * ENTRY_LEN);
        assert!(replayed.blocks.len() <= replayed.entries);
        let block_size = u64::from(replayed.header.block_size);
        let blocks = replayed.header.object_size.div_ceil(block_size);
        assert!(
            replayed.blocks.keys().all(|&index| u64::from(index) < blocks),
            "a block outside an object of {blocks} blocks: {:?}",
            replayed.blocks.keys()
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any bytes at all: an error or a bounded record, never a panic.
        #[test]
        fn replay_of_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(replayed) = replay(&bytes) {
                check_bounded(&replayed, bytes.len());
            }
        }

        /// A well-formed record (whatever its fields and entries say), then cut short or with
        /// one bit flipped: an error or a bounded record, never a panic.
        #[test]
        fn replay_of_a_damaged_record_is_bounded(
            block_size in prop_oneof![any::<u32>(), (0u32..8).prop_map(|s| 1 << (20 + s))],
            object_size in prop_oneof![any::<u64>(), 0u64..(1 << 30)],
            identity in prop::collection::vec(any::<u8>(), 0..64),
            entries in prop::collection::vec((any::<bool>(), prop_oneof![0u32..300, any::<u32>()]), 0..24),
            cut in any::<usize>(),
            flip in prop::option::of((any::<usize>(), 0u8..8)),
        ) {
            let mut record = record_of(block_size, object_size, identity, &entries);
            let len = record.len() - cut % (record.len() + 1) / 2;
            record.truncate(len);
            if let Some((at, bit)) = flip {
                let at = at % record.len();
                record[at] ^= 1 << bit;
            }
            if let Ok(replayed) = replay(&record) {
                check_bounded(&replayed, record.len());
            }
        }
    }
}
