//! The eviction policy: a segmented LRU over blocks, sized in bytes.
//!
//! A block enters the probation segment when it is written. A hit on a block in probation
//! promotes it to the protected segment, which holds at most a fixed share of the capacity
//! (its least recently used blocks are demoted back to probation). The first read of a block
//! fetched ahead of its reader is its first use, not a hit: it only makes the block the newest
//! in probation, so a sequential read's blocks fetched ahead are not the first victims of the
//! blocks it has read. Victims come from the least recently used end of probation first. A one-off scan of a large dataset therefore
//! cycles through probation and does not flush the weights that every job reads again.

use std::hash::Hash;

use hashlink::LinkedHashMap;

/// Segmented LRU of keys with sizes in bytes.
#[derive(Debug)]
pub(crate) struct Slru<K: Hash + Eq> {
    probation: LinkedHashMap<K, u64>,
    protected: LinkedHashMap<K, u64>,
    probation_bytes: u64,
    protected_bytes: u64,
    protected_limit: u64,
}

impl<K: Hash + Eq + Copy> Slru<K> {
    /// A policy whose protected segment holds at most `protected_limit` bytes.
    pub(crate) fn new(protected_limit: u64) -> Self {
        Self {
            probation: LinkedHashMap::new(),
            protected: LinkedHashMap::new(),
            probation_bytes: 0,
            protected_bytes: 0,
            protected_limit,
        }
    }

    /// Bytes of every tracked key: what eviction could free.
    pub(crate) fn bytes(&self) -> u64 {
        self.probation_bytes + self.protected_bytes
    }

    /// Tracks a new key, in probation.
    pub(crate) fn insert(&mut self, key: K, bytes: u64) {
        self.remove(&key);
        self.probation.insert(key, bytes);
        self.probation_bytes += bytes;
    }

    /// Records a hit: promotes from probation, refreshes in protected.
    pub(crate) fn touch(&mut self, key: &K) {
        if let Some(bytes) = self.probation.remove(key) {
            self.probation_bytes -= bytes;
            self.protected.insert(*key, bytes);
            self.protected_bytes += bytes;
            while self.protected_bytes > self.protected_limit {
                let Some((demoted, bytes)) = self.protected.pop_front() else {
                    break;
                };
                self.protected_bytes -= bytes;
                self.probation.insert(demoted, bytes);
                self.probation_bytes += bytes;
            }
        } else if self.protected.contains_key(key) {
            self.protected.to_back(key);
        }
    }

    /// Records a first use: the key becomes the most recently used of its segment, without
    /// a promotion.
    pub(crate) fn refresh(&mut self, key: &K) {
        if self.probation.contains_key(key) {
            self.probation.to_back(key);
        } else if self.protected.contains_key(key) {
            self.protected.to_back(key);
        }
    }

    /// Stops tracking a key (dropped, or pinned); true if it was tracked.
    pub(crate) fn remove(&mut self, key: &K) -> bool {
        if let Some(bytes) = self.probation.remove(key) {
            self.probation_bytes -= bytes;
            true
        } else if let Some(bytes) = self.protected.remove(key) {
            self.protected_bytes -= bytes;
            true
        } else {
            false
        }
    }

    /// Takes the next victim: the least recently used key of probation, else of protected.
    pub(crate) fn pop_victim(&mut self) -> Option<(K, u64)> {
        if let Some((key, bytes)) = self.probation.pop_front() {
            self.probation_bytes -= bytes;
            return Some((key, bytes));
        }
        let (key, bytes) = self.protected.pop_front()?;
        self.protected_bytes -= bytes;
        Some((key, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(policy: &mut Slru<u32>) -> Vec<u32> {
        std::iter::from_fn(|| policy.pop_victim().map(|(k, _)| k)).collect()
    }

    #[test]
    fn a_scan_does_not_evict_blocks_read_twice() {
        let mut policy = Slru::new(80);
        for hot in 0..4 {
            policy.insert(hot, 10);
            policy.touch(&hot);
        }
        for scanned in 100..110 {
            policy.insert(scanned, 10);
        }
        assert_eq!(policy.bytes(), 140);
        let order = drain(&mut policy);
        assert_eq!(order[..10], (100..110).collect::<Vec<_>>());
        assert_eq!(order[10..], [0, 1, 2, 3]);
        assert_eq!(policy.bytes(), 0);
    }

    #[test]
    fn the_protected_segment_is_bounded_and_recency_ordered() {
        let mut policy = Slru::new(20);
        for key in 0..3 {
            policy.insert(key, 10);
            policy.touch(&key);
        }
        // 0 was demoted when 2 was promoted; a hit on 1 makes 2 the older protected key.
        policy.touch(&1);
        assert_eq!(drain(&mut policy), [0, 2, 1]);
    }

    #[test]
    fn a_first_use_keeps_a_key_in_probation_as_its_newest() {
        let mut policy = Slru::new(100);
        for key in 0..3 {
            policy.insert(key, 10);
        }
        policy.refresh(&0);
        assert_eq!(drain(&mut policy), [1, 2, 0]);
    }

    #[test]
    fn removed_keys_are_no_longer_victims() {
        let mut policy = Slru::new(100);
        policy.insert(1, 5);
        policy.insert(2, 7);
        policy.touch(&2);
        assert!(policy.remove(&2));
        assert!(!policy.remove(&2));
        policy.insert(1, 6);
        assert_eq!(policy.bytes(), 6);
        assert_eq!(drain(&mut policy), [1]);
    }
}
