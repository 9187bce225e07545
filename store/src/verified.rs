//! `VerifiedBlock`: a block's bytes with their BLAKE3 tree, the only way bytes enter the
//! store, and `HashMismatch`, why bytes were refused.

use std::sync::Arc;

use bytes::Bytes;
use larder_block_tree::{GroupCheck, GroupHasher, Tree};
use larder_engine::AlignedBuf;

/// The bytes of a block together with their BLAKE3: the only way bytes enter the block store,
/// so every stored block has a hash computed from exactly what is stored. How the hash was
/// come by is in the constructor's name: bytes from anywhere but this node's own origin
/// request must be checked against a hash known beforehand ([`VerifiedBlock::verify`],
/// [`VerifiedBlock::checked_on_arrival`]). The
/// buffer is aligned for O_DIRECT and shared with the readers it was handed to: no copy.
#[derive(Debug, Clone)]
pub struct VerifiedBlock {
    buf: Arc<AlignedBuf>,
    tree: Arc<Tree>,
}

/// Bytes that did not match the hash they were expected to have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the bytes do not match their expected BLAKE3")]
pub struct HashMismatch;

impl VerifiedBlock {
    /// A block this node fetched from the origin itself, hashed here. Never for bytes from a
    /// peer or a disk: those go through [`VerifiedBlock::verify`]. `groups` holds the groups
    /// hashed as the bytes arrived (see [`GroupHasher`]), fed only the start of these very
    /// bytes.
    pub fn hashed_here(buf: Arc<AlignedBuf>, groups: GroupHasher) -> Self {
        let tree = Arc::new(groups.finish(buf.as_ref().as_ref()));
        Self { buf, tree }
    }

    /// Bytes from a rack peer, checked group by group as they arrived by `check` (see
    /// [`GroupCheck`]), which is finished here on these very bytes: accepted only if it passes.
    pub fn checked_on_arrival(buf: Arc<AlignedBuf>, check: GroupCheck) -> Result<Self, HashMismatch> {
        let tree = check.finish(buf.as_ref().as_ref()).map_err(|_| HashMismatch)?;
        Ok(Self {
            buf,
            tree: Arc::new(tree),
        })
    }

    /// Bytes from elsewhere, accepted only if they hash to `expected`.
    pub fn verify(buf: Arc<AlignedBuf>, expected: [u8; 32]) -> Result<Self, HashMismatch> {
        let tree = Tree::of(buf.as_ref().as_ref());
        if tree.root != expected {
            return Err(HashMismatch);
        }
        Ok(Self {
            buf,
            tree: Arc::new(tree),
        })
    }

    /// Length of the block.
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }

    /// The bytes' buffer, shared with the block.
    pub(crate) fn buf(&self) -> &Arc<AlignedBuf> {
        &self.buf
    }

    /// The block's tree, of which the BLAKE3 is the root.
    pub(crate) fn tree(&self) -> &Arc<Tree> {
        &self.tree
    }

    /// The bytes, shared with the block (no copy).
    pub fn bytes(&self) -> Bytes {
        AlignedBuf::shared_bytes(&self.buf)
    }

    /// The block's BLAKE3.
    pub fn hash(&self) -> [u8; 32] {
        self.tree.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(bytes: &[u8]) -> Arc<AlignedBuf> {
        Arc::new(AlignedBuf::copy_from(bytes))
    }

    #[test]
    fn bytes_from_elsewhere_are_verified_only_against_the_hash_expected() {
        let good = *blake3::hash(b"the origin's bytes").as_bytes();
        assert!(VerifiedBlock::verify(block(b"the origin's bytes"), good).is_ok());
        // A sender's own hash of its bytes proves nothing: only the expected one counts.
        let lie = block(b"a peer's other bytes");
        assert_eq!(VerifiedBlock::verify(lie, good).err(), Some(HashMismatch));
    }

    #[test]
    fn a_block_hashed_here_carries_the_hash_of_exactly_its_bytes() {
        let hashed = VerifiedBlock::hashed_here(block(b"fetched from the origin"), GroupHasher::default());
        assert_eq!(
            hashed.tree.root,
            *blake3::hash(b"fetched from the origin").as_bytes()
        );
        assert_eq!(hashed.bytes(), Bytes::from_static(b"fetched from the origin"));
    }
}
