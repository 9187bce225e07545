//! Checking part of a block: a block's BLAKE3 is the root of a tree whose subtrees of 64 KiB
//! (aligned "groups") have chaining values of their own. The store keeps the groups' chaining
//! values next to each block, so a read checks only the groups it touches: it hashes them,
//! compares them with the stored values, and merges the stored values up to the root, which
//! must be the block's recorded hash. Stored values that were tampered with do not merge to
//! the root; bytes that were do not hash to their group's value.
//!
//! This uses blake3's `hazmat` module (the crate's own tree primitives) rather than a
//! verified-streaming crate: the store needs exactly one level of the tree, and the root stays
//! the plain BLAKE3 of the block that the record format already names. The tests check every
//! root against `blake3::hash`.

use blake3::Hasher;
use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root,
};

/// Bytes per group: a power of two number of BLAKE3 chunks, so every aligned group of a block
/// is a subtree of its tree.
pub(crate) const GROUP: usize = 64 * 1024;

/// Bytes of one stored chaining value.
pub(crate) const CV_LEN: usize = 32;

/// A block's BLAKE3 and the chaining values of its groups (none for a block of one group,
/// whose only check is the whole hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tree {
    pub(crate) root: [u8; 32],
    pub(crate) groups: Vec<ChainingValue>,
}

impl Tree {
    /// Hashes a whole block.
    pub(crate) fn of(block: &[u8]) -> Self {
        if block.len() <= GROUP {
            return Self {
                root: *blake3::hash(block).as_bytes(),
                groups: Vec::new(),
            };
        }
        let groups: Vec<_> = block
            .chunks(GROUP)
            .enumerate()
            .map(|(i, bytes)| group_value(i, bytes))
            .collect();
        Self {
            root: root_of(&groups, block.len() as u64),
            groups,
        }
    }
}

/// How many groups a block of `len` bytes has stored values for.
pub(crate) fn groups_in(len: usize) -> usize {
    if len <= GROUP { 0 } else { len.div_ceil(GROUP) }
}

/// Whether `bytes`, groups `first..` of a block of `len` bytes, are what `stored` (the block's
/// stored chaining values) and `root` (its recorded hash) say.
pub(crate) fn check_groups(
    bytes: &[u8],
    first: usize,
    stored: &[ChainingValue],
    len: usize,
    root: &[u8; 32],
) -> bool {
    if stored.len() != groups_in(len) || stored.is_empty() {
        return false;
    }
    let mut touched = bytes.chunks(GROUP).enumerate();
    touched.all(|(i, group)| stored.get(first + i) == Some(&group_value(first + i, group)))
        && root_of(stored, len as u64) == *root
}

/// The chaining value of group `index`, whose bytes are `bytes`.
fn group_value(index: usize, bytes: &[u8]) -> ChainingValue {
    Hasher::new()
        .set_input_offset((index * GROUP) as u64)
        .update(bytes)
        .finalize_non_root()
}

/// The root hash the groups of a block of `len` bytes (more than one group) merge to.
fn root_of(groups: &[ChainingValue], len: u64) -> [u8; 32] {
    let (left, right, left_len) = split(groups, len);
    let root = merge_subtrees_root(
        &subtree(left, left_len),
        &subtree(right, len - left_len),
        Mode::Hash,
    );
    *root.as_bytes()
}

/// The chaining value of the subtree made of `groups`, `len` bytes long.
fn subtree(groups: &[ChainingValue], len: u64) -> ChainingValue {
    if let [only] = groups {
        return *only;
    }
    let (left, right, left_len) = split(groups, len);
    merge_subtrees_non_root(
        &subtree(left, left_len),
        &subtree(right, len - left_len),
        Mode::Hash,
    )
}

/// Splits groups where BLAKE3 splits their bytes: the left subtree is the largest power of two
/// number of chunks short of `len`, a whole number of groups since `len` is more than a group.
fn split(groups: &[ChainingValue], len: u64) -> (&[ChainingValue], &[ChainingValue], u64) {
    let left_len = left_subtree_len(len);
    let (left, right) = groups.split_at((left_len / GROUP as u64) as usize);
    (left, right, left_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn the_root_is_the_blake3_of_the_block_at_every_shape() {
        let lens = [
            1,
            GROUP - 1,
            GROUP,
            GROUP + 1,
            2 * GROUP,
            3 * GROUP + 5,
            5 * GROUP,
            (1 << 20) + 4097,
            4 << 20,
            (4 << 20) - 1,
        ];
        for len in lens {
            let block = bytes(len);
            let tree = Tree::of(&block);
            assert_eq!(tree.root, *blake3::hash(&block).as_bytes(), "len {len}");
            assert_eq!(tree.groups.len(), groups_in(len), "len {len}");
        }
    }

    #[test]
    fn a_read_checks_the_groups_it_touches_against_the_root() {
        let len = 3 * GROUP + 77;
        let block = bytes(len);
        let tree = Tree::of(&block);
        let read = &block[GROUP..3 * GROUP + 77];
        assert!(check_groups(read, 1, &tree.groups, len, &tree.root));
        assert!(check_groups(&block[..GROUP], 0, &tree.groups, len, &tree.root));

        let mut flipped = read.to_vec();
        flipped[GROUP + 3] ^= 1;
        assert!(!check_groups(&flipped, 1, &tree.groups, len, &tree.root));

        // Stored values made up to match flipped bytes do not merge to the root.
        let mut forged = tree.groups.clone();
        forged[2] = group_value(2, &flipped[GROUP..2 * GROUP]);
        assert!(!check_groups(&flipped, 1, &forged, len, &tree.root));

        assert!(
            !check_groups(read, 1, &tree.groups[..3], len, &tree.root),
            "too few values"
        );
        assert!(
            !check_groups(read, 2, &tree.groups, len, &tree.root),
            "misplaced groups"
        );
    }
}
