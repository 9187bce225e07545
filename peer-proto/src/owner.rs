//! Which member owns a run of blocks: rendezvous (highest random weight) hashing.
//!
//! Every node ranks the live members for a run the same way, with no coordination: members of
//! the asker's rack first, then the others, each group by a weight hashed from the member's id
//! and the run. The first is the owner, the rest are the fallbacks in order. A member that
//! leaves moves only the runs it owned (to their next candidate); one that joins takes only
//! the runs it now weighs most for.

/// A member of the cluster as ownership sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The node id, unique in the cluster.
    pub id: String,
    /// The rack label; `None` while the member's rack is not known (listed without one, and
    /// not heard from yet): it ranks as a member of another rack.
    pub rack: Option<String>,
}

/// A run of blocks: one origin part of one object version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    /// The object version's id.
    pub object: [u8; 32],
    /// The part's index in the object.
    pub part: u64,
}

/// The weight of `member` for `run`: the first 8 bytes of the BLAKE3 of both.
pub fn weight(member: &str, run: &Run) -> u64 {
    let mut hasher = blake3::Hasher::new_derive_key("larder peer owner v1");
    hasher.update(&run.object);
    hasher.update(&run.part.to_le_bytes());
    hasher.update(member.as_bytes());
    let hash = hasher.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// The members to ask for `run`, in order: those in `rack` first, then the rest (those of
/// unknown rack among them), each by descending weight (ties, which take a hash collision, by
/// id).
pub fn candidates<'a>(members: &'a [Member], run: &Run, rack: &str) -> Vec<&'a Member> {
    let mut ranked: Vec<(bool, u64, &Member)> = members
        .iter()
        .map(|m| (m.rack.as_deref() != Some(rack), weight(&m.id, run), m))
        .collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.id.cmp(&b.2.id)));
    ranked.into_iter().map(|(_, _, m)| m).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize, racks: usize) -> Vec<Member> {
        (0..n)
            .map(|i| Member {
                id: format!("node-{i}"),
                rack: Some(format!("rack-{}", i % racks)),
            })
            .collect()
    }

    fn runs(n: u64) -> impl Iterator<Item = Run> {
        (0..n).map(|i| Run {
            object: *blake3::hash(&(i / 16).to_le_bytes()).as_bytes(),
            part: i % 16,
        })
    }

    #[test]
    fn runs_spread_evenly_over_members() {
        let members = members(8, 1);
        let mut owned = [0usize; 8];
        for run in runs(8000) {
            let owner = candidates(&members, &run, "rack-0")[0];
            owned[members.iter().position(|m| m == owner).expect("a member")] += 1;
        }
        // 1,000 each on average; a fair hash stays well within ±20%.
        assert!(owned.iter().all(|&n| (800..=1200).contains(&n)), "{owned:?}");
    }

    #[test]
    fn a_member_leaving_moves_only_its_own_runs_to_their_next_candidate() {
        let all = members(8, 1);
        let left: Vec<Member> = all.iter().filter(|m| m.id != "node-3").cloned().collect();
        let mut moved = 0;
        for run in runs(4000) {
            let before = candidates(&all, &run, "rack-0");
            let after = candidates(&left, &run, "rack-0");
            if before[0].id == "node-3" {
                moved += 1;
                assert_eq!(after[0], before[1]);
            } else {
                assert_eq!(after[0], before[0]);
            }
        }
        assert!(moved > 0);
    }

    #[test]
    fn members_of_the_askers_rack_come_first() {
        let members = members(6, 2);
        for run in runs(100) {
            let order = candidates(&members, &run, "rack-1");
            assert_eq!(order.len(), 6);
            assert!(order[..3].iter().all(|m| m.rack.as_deref() == Some("rack-1")));
            assert!(order[3..].iter().all(|m| m.rack.as_deref() == Some("rack-0")));
            // Every node ranks the same way within a rack.
            let again = candidates(&members, &run, "rack-1");
            assert_eq!(order, again);
        }
    }
}
