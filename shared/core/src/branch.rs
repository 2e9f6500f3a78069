//! Branch logs (DESIGN §10). A fork copies nothing: its log is its ancestors' events up to
//! the fork point followed by its own. A session's *lineage* names the ancestors whose
//! events its branch log reads, root first, each with the last seq read from it; the
//! session's own events follow the last one. An ancestor appears only if the branch reads
//! at least one of its own events, so a fork through a seq its parent inherited names the
//! grandparent, not the parent.

use serde::{Deserialize, Serialize};

use crate::ids::SessionId;

/// How deep forks may nest: a branch log reads at most this many ancestors.
pub const MAX_FORK_DEPTH: usize = 128;

/// One ancestor segment of a branch log: the events of `session` with seq ≤ `through`
/// (its own events all follow the previous segment's `through`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub session: SessionId,
    pub through: i64,
}

/// The lineage of a fork of `parent` (whose lineage is `parent_lineage`) through
/// `through_seq`: the parent's segments that reach below the fork point, the last one cut
/// there, and then the parent itself when the fork point is one of its own events.
pub fn fork_lineage(parent: SessionId, parent_lineage: &[Segment], through_seq: i64) -> Vec<Segment> {
    let mut out = Vec::with_capacity(parent_lineage.len() + 1);
    let mut start = 1;
    for seg in parent_lineage {
        if through_seq < start {
            return out;
        }
        out.push(Segment { session: seg.session, through: seg.through.min(through_seq) });
        start = seg.through + 1;
    }
    if through_seq >= start {
        out.push(Segment { session: parent, through: through_seq });
    }
    out
}

/// The first seq of a session's own events, given its lineage.
pub fn first_own_seq(lineage: &[Segment]) -> i64 {
    lineage.last().map_or(1, |s| s.through + 1)
}

/// Which session of a branch owns `seq`: the ancestor whose segment holds it, or `own`.
pub fn owner_of_seq(own: SessionId, lineage: &[Segment], seq: i64) -> SessionId {
    lineage.iter().find(|s| seq <= s.through).map_or(own, |s| s.session)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(session: SessionId, through: i64) -> Segment {
        Segment { session, through }
    }

    #[test]
    fn a_fork_names_only_the_ancestors_whose_events_it_reads() {
        let (root, a, b) = (SessionId::new(), SessionId::new(), SessionId::new());
        // a forks root through 10; b forks a through 15 (a's own events start at 11).
        let la = fork_lineage(root, &[], 10);
        assert_eq!(la, vec![seg(root, 10)]);
        let lb = fork_lineage(a, &la, 15);
        assert_eq!(lb, vec![seg(root, 10), seg(a, 15)]);
        assert_eq!(first_own_seq(&lb), 16);
        // A fork of b through a seq a inherited reads only root.
        assert_eq!(fork_lineage(b, &lb, 7), vec![seg(root, 7)]);
        // Through the first of a's own events: root to 10, then a's 11.
        assert_eq!(fork_lineage(b, &lb, 11), vec![seg(root, 10), seg(a, 11)]);
        // Through b's own: the whole lineage, then b.
        assert_eq!(fork_lineage(b, &lb, 20), vec![seg(root, 10), seg(a, 15), seg(b, 20)]);
        assert_eq!(owner_of_seq(b, &lb, 3), root);
        assert_eq!(owner_of_seq(b, &lb, 12), a);
        assert_eq!(owner_of_seq(b, &lb, 16), b);
    }
}
