//! Checking part of a block: a block's BLAKE3 is the root of a tree whose subtrees of 16 KiB
//! (aligned "groups") have chaining values of their own. The store keeps the chaining values of
//! every subtree of groups next to each block ([`Tree::nodes`]), so a read checks only the
//! groups it touches: it hashes them and merges them up to the root with the stored values of
//! the subtrees beside them, one merge per level, and the result must be the block's recorded
//! hash. Stored values that were tampered with, like bytes that were, give another root.
//!
//! A rack peer sends a block's group values ahead of its bytes, so the asker checks each group
//! as it arrives ([`GroupCheck`]) and drops a bad answer at its first bad group.
//!
//! This uses blake3's `hazmat` module (the crate's own tree primitives) rather than a
//! verified-streaming crate: the store needs exactly one level of the tree, and the root stays
//! the plain BLAKE3 of the block that the record format already names. The tests check every
//! root against `blake3::hash`.

use std::ops::Range;

use blake3::Hasher;
use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root,
};

/// Bytes per group: a power of two number of BLAKE3 chunks, so every aligned group of a block
/// is a subtree of its tree.
///
/// 16 KiB because a small random read reads and hashes the whole group it touches: on the NVMe
/// of the nodes measured, an O_DIRECT read of 16 KiB takes about as long as one of 4 KiB, and
/// one of 64 KiB two to three times as long. Smaller groups would not read faster, but would
/// cost more values to store (the tree of a 4 MiB block is 510 values: 16 KiB) and a level
/// more of merges per read.
pub const GROUP: usize = 16 * 1024;

/// Bytes of one stored chaining value.
pub const CV_LEN: usize = 32;

/// A block's BLAKE3 and the chaining values of its groups (none for a block of one group,
/// whose only check is the whole hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub root: [u8; 32],
    pub groups: Vec<ChainingValue>,
}

/// Pushes the nodes of the subtree made of `groups`, `len` bytes long, in pre-order; gives
/// its chaining value.
fn push_subtree(groups: &[ChainingValue], len: u64, nodes: &mut Vec<ChainingValue>) -> ChainingValue {
    if let [only] = groups {
        nodes.push(*only);
        return *only;
    }
    let at = nodes.len();
    nodes.push([0; CV_LEN]);
    let (left, right, left_len) = split(groups, len);
    let left = push_subtree(left, left_len, nodes);
    let right = push_subtree(right, len - left_len, nodes);
    nodes[at] = merge_subtrees_non_root(&left, &right, Mode::Hash);
    nodes[at]
}

impl Tree {
    /// Hashes a whole block.
    pub fn of(block: &[u8]) -> Self {
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

    /// The chaining values of every subtree of groups of the block (`len` bytes) but the
    /// whole, in pre-order: a subtree, then its left part's, then its right part's;
    /// [`nodes_in`] of them. What [`check_groups`] checks a read with.
    pub fn nodes(&self, len: usize) -> Vec<ChainingValue> {
        let mut nodes = Vec::with_capacity(nodes_in(len));
        if !self.groups.is_empty() {
            let (left, right, left_len) = split(&self.groups, len as u64);
            push_subtree(left, left_len, &mut nodes);
            push_subtree(right, len as u64 - left_len, &mut nodes);
        }
        nodes
    }
}

/// A block's [`Tree`] computed while its bytes arrive: each group is hashed as soon as it is
/// complete, while its bytes are still in the CPU's caches, instead of in one pass over the
/// whole block at its end.
#[derive(Debug, Default)]
pub struct GroupHasher {
    groups: Vec<ChainingValue>,
}

impl GroupHasher {
    /// Hashes the groups of `so_far` (the block's first bytes) completed since the last call.
    pub fn update(&mut self, so_far: &[u8]) {
        while (self.groups.len() + 1) * GROUP <= so_far.len() {
            let i = self.groups.len();
            self.groups
                .push(group_value(i, &so_far[i * GROUP..(i + 1) * GROUP]));
        }
    }

    /// The tree of `block`, the whole of the bytes `update` was fed the start of: what was not
    /// hashed yet is hashed now.
    pub fn finish(mut self, block: &[u8]) -> Tree {
        if block.len() <= GROUP {
            return Tree::of(block);
        }
        self.update(block);
        let done = self.groups.len() * GROUP;
        if done < block.len() {
            self.groups.push(group_value(self.groups.len(), &block[done..]));
        }
        Tree {
            root: root_of(&self.groups, block.len() as u64),
            groups: self.groups,
        }
    }
}

/// The group a received block's bytes first differed from their sender's values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadGroup(pub usize);

/// Checks a block from elsewhere while its bytes arrive, against the group values its sender
/// gave first (which must merge to the hash it named): a bad group is found when it completes,
/// not at the block's end.
#[derive(Debug)]
pub struct GroupCheck {
    hashed: GroupHasher,
    values: Vec<ChainingValue>,
    root: [u8; 32],
}

impl GroupCheck {
    /// A check of a block of `len` bytes named `root`, whose sender gave the group values
    /// `values` (each [`CV_LEN`] bytes, [`groups_in`] of them). `None` if there are not as many
    /// as the block has groups, or they do not merge to `root`.
    pub fn new(values: &[u8], len: usize, root: [u8; 32]) -> Option<Self> {
        let (values, rest) = values.as_chunks::<CV_LEN>();
        let values = values.to_vec();
        let fits = rest.is_empty()
            && values.len() == groups_in(len)
            && (values.is_empty() || root_of(&values, len as u64) == root);
        fits.then(|| Self {
            hashed: GroupHasher::default(),
            values,
            root,
        })
    }

    /// Checks the groups of `so_far` (the block's first bytes) completed since the last call.
    pub fn update(&mut self, so_far: &[u8]) -> Result<(), BadGroup> {
        let from = self.hashed.groups.len();
        self.hashed.update(so_far);
        first_bad(&self.hashed.groups, &self.values, from)
    }

    /// Checks what is left of `block`, all of the bytes `update` was fed the start of, and
    /// gives its tree.
    pub fn finish(mut self, block: &[u8]) -> Result<Tree, BadGroup> {
        let from = self.hashed.groups.len();
        let tree = std::mem::take(&mut self.hashed).finish(block);
        first_bad(&tree.groups, &self.values, from)?;
        // Groups that all match values merging to the root have that root: only a block of
        // one group, which has no values, can fail here.
        if tree.root != self.root {
            return Err(BadGroup(0));
        }
        Ok(tree)
    }
}

/// The first of groups `from..` whose value `got` differs from the sender's `sent`.
fn first_bad(got: &[ChainingValue], sent: &[ChainingValue], from: usize) -> Result<(), BadGroup> {
    let mut pairs = got.iter().zip(sent).skip(from);
    match pairs.position(|(got, sent)| got != sent) {
        Some(i) => Err(BadGroup(from + i)),
        None => Ok(()),
    }
}

/// The bytes of a block of `len` bytes that the groups `range` touches cover.
pub fn covering(range: &Range<usize>, len: usize) -> Range<usize> {
    range.start / GROUP * GROUP..(range.end.div_ceil(GROUP) * GROUP).min(len)
}

/// How many groups a block of `len` bytes has values for.
pub fn groups_in(len: usize) -> usize {
    if len <= GROUP { 0 } else { len.div_ceil(GROUP) }
}

/// How many values [`Tree::nodes`] gives for a block of `len` bytes: every subtree of its
/// groups but the whole.
pub fn nodes_in(len: usize) -> usize {
    (2 * groups_in(len)).saturating_sub(2)
}

/// Whether `bytes`, groups `first..` of a block of `len` bytes, are what `nodes` (the block's
/// stored [`Tree::nodes`]) and `root` (its recorded hash) say. The groups read are hashed and
/// merged up to the root; the subtrees they do not touch count with their stored values. The
/// stored values of the subtrees they do touch are not used: the root says whether the bytes
/// and the values beside them are right.
pub fn check_groups(
    bytes: &[u8],
    first: usize,
    nodes: &[ChainingValue],
    len: usize,
    root: &[u8; 32],
) -> bool {
    let groups = groups_in(len);
    let read = Read { bytes, first };
    if groups == 0 || nodes.len() != nodes_in(len) || read.end() > groups || bytes.is_empty() {
        return false;
    }
    let (left, right) = read.halves(0, len as u64, nodes);
    *merge_subtrees_root(&left, &right, Mode::Hash).as_bytes() == *root
}

/// The bytes of a read: whole groups from group `first` (the last may be a block's short
/// one).
struct Read<'a> {
    bytes: &'a [u8],
    first: usize,
}

impl Read<'_> {
    /// The group after the last one read.
    fn end(&self) -> usize {
        self.first + self.bytes.len().div_ceil(GROUP)
    }

    /// The chaining value of the subtree of `len` bytes from group `start` whose stored
    /// nodes are `nodes` (its own first): hashed and merged where the read touches it, the
    /// stored value where it does not.
    fn subtree(&self, start: usize, len: u64, nodes: &[ChainingValue]) -> ChainingValue {
        let groups = (len as usize).div_ceil(GROUP);
        if start + groups <= self.first || self.end() <= start {
            return nodes[0];
        }
        if groups == 1 {
            let from = (start - self.first) * GROUP;
            let to = (from + GROUP).min(self.bytes.len());
            return group_value(start, &self.bytes[from..to]);
        }
        let (left, right) = self.halves(start, len, &nodes[1..]);
        merge_subtrees_non_root(&left, &right, Mode::Hash)
    }

    /// The chaining values of the two halves of the subtree of `len` bytes (more than a group)
    /// from group `start`, whose stored nodes below its own are `below`.
    fn halves(&self, start: usize, len: u64, below: &[ChainingValue]) -> (ChainingValue, ChainingValue) {
        let left_len = left_subtree_len(len);
        let left_groups = (left_len / GROUP as u64) as usize;
        let (left_nodes, right_nodes) = below.split_at(2 * left_groups - 1);
        (
            self.subtree(start, left_len, left_nodes),
            self.subtree(start + left_groups, len - left_len, right_nodes),
        )
    }
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
    fn groups_hashed_as_the_bytes_arrive_make_the_same_tree() {
        for len in [1, GROUP, GROUP + 1, 3 * GROUP + 5, 4 << 20, (4 << 20) - 1] {
            let block = bytes(len);
            for step in [1000, 4096, GROUP, 100_003] {
                let mut hasher = GroupHasher::default();
                let mut at = 0;
                while at < len {
                    at = (at + step).min(len);
                    hasher.update(&block[..at]);
                }
                assert_eq!(hasher.finish(&block), Tree::of(&block), "len {len}, step {step}");
            }
            assert_eq!(GroupHasher::default().finish(&block), Tree::of(&block));
        }
    }

    #[test]
    fn a_block_checked_as_it_arrives_stops_at_its_first_bad_group() {
        for len in [100, GROUP, GROUP + 1, 3 * GROUP + 5, 4 << 20] {
            let block = bytes(len);
            let tree = Tree::of(&block);
            let values = tree.groups.as_flattened();
            let check = |block: &[u8]| -> Result<Tree, (BadGroup, usize)> {
                let mut check = GroupCheck::new(values, len, tree.root).expect("values fit");
                let mut at = 0;
                while at < len {
                    at = (at + 10_000).min(len);
                    check.update(&block[..at]).map_err(|bad| (bad, at))?;
                }
                check.finish(block).map_err(|bad| (bad, len))
            };
            assert_eq!(check(&block), Ok(tree.clone()), "len {len}");

            let mut flipped = block.clone();
            let at = (2 * GROUP + 9).min(len - 1);
            flipped[at] ^= 1;
            let (bad, seen_at) = check(&flipped).expect_err("a flipped byte");
            let group = at / GROUP;
            if tree.groups.is_empty() {
                assert_eq!(bad, BadGroup(0), "len {len}");
            } else {
                assert_eq!(bad, BadGroup(group), "len {len}");
                let group_end = ((group + 1) * GROUP).min(len);
                assert!(seen_at < group_end + 10_000, "len {len}: found at {seen_at}");
            }
        }
    }

    #[test]
    fn group_values_that_do_not_fit_the_block_are_refused() {
        let len = 3 * GROUP + 5;
        let block = bytes(len);
        let tree = Tree::of(&block);
        let values = tree.groups.as_flattened();
        assert!(GroupCheck::new(values, len, tree.root).is_some());
        assert!(
            GroupCheck::new(&values[..3 * CV_LEN], len, tree.root).is_none(),
            "too few"
        );
        assert!(GroupCheck::new(&values[1..], len, tree.root).is_none(), "ragged");
        assert!(GroupCheck::new(values, len, [0; 32]).is_none(), "another root");
        let mut forged = values.to_vec();
        forged[40] ^= 1;
        assert!(
            GroupCheck::new(&forged, len, tree.root).is_none(),
            "a forged value"
        );
        assert!(
            GroupCheck::new(values, GROUP, tree.root).is_none(),
            "values for one group"
        );
    }

    #[test]
    fn a_read_checks_the_groups_it_touches_against_the_root() {
        let len = 3 * GROUP + 77;
        let block = bytes(len);
        let tree = Tree::of(&block);
        let nodes = tree.nodes(len);
        assert_eq!(nodes.len(), nodes_in(len));
        let read = &block[GROUP..3 * GROUP + 77];
        assert!(check_groups(read, 1, &nodes, len, &tree.root));
        assert!(check_groups(&block[..GROUP], 0, &nodes, len, &tree.root));

        let mut flipped = read.to_vec();
        flipped[GROUP + 3] ^= 1;
        assert!(!check_groups(&flipped, 1, &nodes, len, &tree.root));

        // Stored values made up to match flipped bytes do not merge to the root.
        let mut forged = tree.clone();
        forged.groups[2] = group_value(2, &flipped[GROUP..2 * GROUP]);
        assert!(!check_groups(&flipped, 1, &forged.nodes(len), len, &tree.root));

        assert!(
            !check_groups(read, 1, &nodes[..3], len, &tree.root),
            "too few values"
        );
        assert!(
            !check_groups(read, 2, &nodes, len, &tree.root),
            "misplaced groups"
        );
        assert!(!check_groups(&[], 1, &nodes, len, &tree.root), "no bytes");
    }

    #[test]
    fn every_group_and_run_of_groups_checks_and_every_changed_value_beside_it_is_caught() {
        for len in [
            2 * GROUP,
            3 * GROUP + 77,
            5 * GROUP,
            7 * GROUP - 1,
            64 * GROUP,
            1 << 20,
        ] {
            let block = bytes(len);
            let tree = Tree::of(&block);
            let nodes = tree.nodes(len);
            let groups = groups_in(len);
            for first in 0..groups {
                for count in [1, 2, 5] {
                    let end = (first + count).min(groups);
                    let read = &block[first * GROUP..(end * GROUP).min(len)];
                    assert!(
                        check_groups(read, first, &nodes, len, &tree.root),
                        "len {len}: groups {first}..{end}"
                    );
                }
            }
            // A read of one group: any value changed is either one the check merges with
            // (caught) or one it does not read.
            let first = groups / 2;
            let read = &block[first * GROUP..((first + 1) * GROUP).min(len)];
            let mut used = 0;
            for i in 0..nodes.len() {
                let mut changed = nodes.clone();
                changed[i][5] ^= 1;
                if !check_groups(read, first, &changed, len, &tree.root) {
                    used += 1;
                }
            }
            // One value per level of the tree: the subtrees beside the group's path.
            let depth = usize::BITS - (groups - 1).leading_zeros();
            assert!(
                used >= 1 && used <= depth as usize,
                "len {len}: {used} values used"
            );
        }
    }
}
