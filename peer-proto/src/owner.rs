//! Which member owns a run of blocks: rendezvous (highest random weight) hashing.
//!
//! Every node ranks the live members for a run the same way, with no coordination, by a weight
//! hashed from the member's id and the run. A run has two owners: its **fleet owner**, the
//! member that weighs most of all, which fills it from the origin; and in each rack its **rack
//! owner**, the member of that rack that weighs most, which the rest of the rack asks and which
//! asks the fleet owner in turn. The fleet owner is its own rack's owner. So a scale-up across
//! racks pulls each run from the origin once, and across the spine once per rack. A member that
//! leaves moves only the runs it owned, at each level (to their next candidate); one that joins
//! takes only the runs it now weighs most for.

/// A member of the cluster as ownership sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The node id, unique in the cluster.
    pub id: String,
    /// The rack label; `None` while the member's rack is not known (listed without one, and
    /// not heard from yet): it ranks as a member of another rack.
    pub rack: Option<String>,
}

/// Which run of blocks: one origin part of one object version (the fill path's `Run` is the
/// blocks of a fill in progress).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RunId {
    /// The object version's id.
    pub object: [u8; 32],
    /// The part's index in the object.
    pub part: u64,
}

/// The weight of `member` for `run`: the first 8 bytes of the BLAKE3 of both.
pub fn weight(member: &str, run: &RunId) -> u64 {
    let mut hasher = blake3::Hasher::new_derive_key("larder peer owner v1");
    hasher.update(&run.object);
    hasher.update(&run.part.to_le_bytes());
    hasher.update(member.as_bytes());
    let hash = hasher.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// The members to ask for `run`, in order: with a `rack`, those in it first, then the rest
/// (those of unknown rack among them); without one, all as one group (the fleet's ranking);
/// each group by descending weight (ties, which take a hash collision, by id).
pub fn candidates<'a>(members: &'a [Member], run: &RunId, rack: Option<&str>) -> Vec<&'a Member> {
    let mut ranked: Vec<(bool, u64, &Member)> = members
        .iter()
        .map(|m| (rack.is_some() && m.rack.as_deref() != rack, weight(&m.id, run), m))
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

    fn runs(n: u64) -> impl Iterator<Item = RunId> {
        (0..n).map(|i| RunId {
            object: *blake3::hash(&(i / 16).to_le_bytes()).as_bytes(),
            part: i % 16,
        })
    }

    #[test]
    fn runs_spread_evenly_over_members() {
        let members = members(8, 1);
        let mut owned = [0usize; 8];
        for run in runs(8000) {
            let owner = candidates(&members, &run, Some("rack-0"))[0];
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
            let before = candidates(&all, &run, Some("rack-0"));
            let after = candidates(&left, &run, Some("rack-0"));
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
            let order = candidates(&members, &run, Some("rack-1"));
            assert_eq!(order.len(), 6);
            assert!(order[..3].iter().all(|m| m.rack.as_deref() == Some("rack-1")));
            assert!(order[3..].iter().all(|m| m.rack.as_deref() == Some("rack-0")));
            // Every node ranks the same way within a rack.
            let again = candidates(&members, &run, Some("rack-1"));
            assert_eq!(order, again);
        }
    }

    #[test]
    fn the_fleet_owner_owns_its_racks_runs_and_every_rack_agrees_on_it() {
        let members = members(8, 2);
        for run in runs(200) {
            let fleet = candidates(&members, &run, None)[0];
            let rack = fleet.rack.as_deref();
            // The fleet owner is its own rack's owner, as every node of that rack ranks it.
            assert_eq!(candidates(&members, &run, rack)[0], fleet);
            // The other rack's owner is of that rack.
            let other = if rack == Some("rack-0") {
                "rack-1"
            } else {
                "rack-0"
            };
            assert_eq!(
                candidates(&members, &run, Some(other))[0].rack.as_deref(),
                Some(other)
            );
        }
    }
}
