//! The cluster state the leader maintains and every member keeps a copy of: who is an
//! approved member, who was revoked, and named entries (catalog, placements). Changes
//! are applied by the leader only; members receive whole snapshots, ordered by
//! [`Version`].

use serde::{Deserialize, Serialize};
use shoal_types::{ClusterId, NodeId, Role};
use std::collections::{BTreeMap, BTreeSet};

/// Orders snapshots: the term of the leader that made it, then a counter. A snapshot
/// with a higher version contains every change of the lower ones made in its history
/// (the election rule guarantees it for committed changes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    /// Term of the leader that produced the snapshot.
    pub term: u64,
    /// Counts snapshots over the cluster's life.
    pub index: u64,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.term, self.index)
    }
}

/// An approved member.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its key.
    pub id: NodeId,
    /// A name for people (host name at approval).
    pub name: String,
    /// Hub or PC: hubs are preferred as leader.
    pub role: Role,
    /// Memory it offers (RAM + VRAM, bytes at approval): the second leader preference.
    pub memory_bytes: u64,
}

impl Member {
    /// Leader preference (higher first): hub role, then memory, then id so that it is a
    /// total order. Only ever a tie-break: it shortens election timeouts, never decides votes.
    pub fn priority(&self) -> (bool, u64, NodeId) {
        (self.role == Role::Hub, self.memory_bytes, self.id)
    }
}

/// The longest entry key, and the largest entry value (encoded JSON), accepted.
pub const MAX_KEY: usize = 200;
/// See [`MAX_KEY`].
pub const MAX_VALUE: usize = 64 * 1024;
/// The largest cluster state (encoded JSON) a change may produce. Every message that
/// carries a state (membership snapshots, welcomes on the join endpoint) is bounded by
/// this plus [`crate::wire::ENVELOPE`], so a state the leader accepted always fits the
/// messages that must carry it.
pub const MAX_STATE_BYTES: usize = 2 << 20;

/// One change the leader can make.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Change {
    /// Approve a node (also lifts an earlier revocation).
    AddMember(Member),
    /// Remove a member and revoke its key everywhere.
    RemoveMember(NodeId),
    /// Set an entry (catalog, placement…).
    Put {
        /// Entry name, e.g. `placement/smollm2`.
        key: String,
        /// Its value.
        value: serde_json::Value,
    },
    /// Delete an entry.
    Delete {
        /// Entry name.
        key: String,
    },
}

impl Change {
    /// Does it change who votes? (Such changes go one at a time.)
    pub fn is_membership(&self) -> bool {
        matches!(self, Change::AddMember(_) | Change::RemoveMember(_))
    }
}

/// Why a change was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ChangeError {
    /// Approving a node that already is a member.
    #[error("{0} is already a member")]
    AlreadyMember(NodeId),
    /// Removing a node that is not a member.
    #[error("{0} is not a member")]
    NotMember(NodeId),
    /// Removing the only member would leave no cluster.
    #[error("cannot remove the last member of the cluster")]
    LastMember,
    /// A key or value over the limits.
    #[error("entry {0:?} is too large or its key is empty")]
    TooLarge(String),
    /// The change would make the state larger than [`MAX_STATE_BYTES`].
    #[error("the cluster state would exceed {} bytes; delete entries first", MAX_STATE_BYTES)]
    StateFull,
}

/// The replicated cluster state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Which cluster this is.
    pub cluster: ClusterId,
    /// The node that created it.
    pub owner: NodeId,
    /// Version of this snapshot.
    pub version: Version,
    /// Approved members: the only keys any node accepts, and the voters.
    pub members: BTreeMap<NodeId, Member>,
    /// Removed keys: refused everywhere, even if offered again by discovery.
    pub revoked: BTreeSet<NodeId>,
    /// Named entries (catalog, placements).
    pub entries: BTreeMap<String, serde_json::Value>,
}

impl ClusterState {
    /// A new cluster whose only member is its creator.
    pub fn create(cluster: ClusterId, creator: Member) -> ClusterState {
        ClusterState {
            cluster,
            owner: creator.id,
            version: Version { term: 0, index: 1 },
            members: BTreeMap::from([(creator.id, creator)]),
            revoked: BTreeSet::new(),
            entries: BTreeMap::new(),
        }
    }

    /// Is `id` an approved member?
    pub fn is_member(&self, id: &NodeId) -> bool {
        self.members.contains_key(id)
    }

    /// How many votes make a majority of the members.
    pub fn majority(&self) -> usize {
        self.members.len() / 2 + 1
    }

    /// The size of this state as JSON, as it crosses the network.
    pub fn encoded_len(&self) -> usize {
        // Invariant: the state is plain data (string keys, JSON values): it serialises.
        serde_json::to_vec(self).map(|v| v.len()).unwrap_or(usize::MAX)
    }

    /// Apply `change` (without touching the version: the caller stamps it).
    pub fn apply(&mut self, change: &Change) -> Result<(), ChangeError> {
        match change {
            Change::AddMember(m) => {
                if self.members.contains_key(&m.id) {
                    return Err(ChangeError::AlreadyMember(m.id));
                }
                self.revoked.remove(&m.id);
                self.members.insert(m.id, m.clone());
                if self.encoded_len() > MAX_STATE_BYTES {
                    self.members.remove(&m.id);
                    return Err(ChangeError::StateFull);
                }
            }
            Change::RemoveMember(id) => {
                if !self.members.contains_key(id) {
                    return Err(ChangeError::NotMember(*id));
                }
                if self.members.len() == 1 {
                    return Err(ChangeError::LastMember);
                }
                self.members.remove(id);
                self.revoked.insert(*id);
            }
            Change::Put { key, value } => {
                let size = serde_json::to_vec(value).map(|v| v.len()).unwrap_or(usize::MAX);
                if key.is_empty() || key.len() > MAX_KEY || size > MAX_VALUE {
                    return Err(ChangeError::TooLarge(key.chars().take(40).collect()));
                }
                let old = self.entries.insert(key.clone(), value.clone());
                if self.encoded_len() > MAX_STATE_BYTES {
                    match old {
                        Some(old) => self.entries.insert(key.clone(), old),
                        None => self.entries.remove(key),
                    };
                    return Err(ChangeError::StateFull);
                }
            }
            Change::Delete { key } => {
                self.entries.remove(key);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(k: u8) -> Member {
        Member { id: NodeId([k; 32]), name: format!("n{k}"), role: Role::Pc, memory_bytes: 1 << 30 }
    }

    #[test]
    fn members_come_and_go_and_removal_revokes() {
        let mut s = ClusterState::create(ClusterId([1; 16]), member(1));
        assert_eq!(s.majority(), 1);
        assert_eq!(s.apply(&Change::RemoveMember(NodeId([1; 32]))), Err(ChangeError::LastMember));
        s.apply(&Change::AddMember(member(2))).unwrap();
        assert_eq!(s.apply(&Change::AddMember(member(2))), Err(ChangeError::AlreadyMember(NodeId([2; 32]))));
        s.apply(&Change::AddMember(member(3))).unwrap();
        assert_eq!(s.majority(), 2);
        s.apply(&Change::RemoveMember(NodeId([2; 32]))).unwrap();
        assert!(!s.is_member(&NodeId([2; 32])) && s.revoked.contains(&NodeId([2; 32])));
        s.apply(&Change::AddMember(member(2))).unwrap();
        assert!(s.revoked.is_empty());
    }

    #[test]
    fn oversized_entries_are_refused() {
        let mut s = ClusterState::create(ClusterId([1; 16]), member(1));
        let big = serde_json::Value::String("x".repeat(MAX_VALUE + 1));
        assert!(s.apply(&Change::Put { key: "a".into(), value: big }).is_err());
        assert!(s.apply(&Change::Put { key: String::new(), value: 1.into() }).is_err());
        s.apply(&Change::Put { key: "a".into(), value: 1.into() }).unwrap();
        assert_eq!(s.entries["a"], 1);
    }

    #[test]
    fn a_state_never_grows_past_what_a_welcome_can_carry() {
        let mut s = ClusterState::create(ClusterId([1; 16]), member(1));
        let value = serde_json::Value::String("x".repeat(MAX_VALUE - 100));
        let mut refused = None;
        for i in 0..100 {
            if let Err(e) = s.apply(&Change::Put { key: format!("k{i}"), value: value.clone() }) {
                refused = Some((i, e));
                break;
            }
        }
        let (i, e) = refused.expect("the state grew without bound");
        assert_eq!(e, ChangeError::StateFull);
        assert!(!s.entries.contains_key(&format!("k{i}")), "a refused change was kept");
        assert!(s.encoded_len() <= MAX_STATE_BYTES);
        const { assert!(MAX_STATE_BYTES + crate::wire::ENVELOPE <= crate::wire::MAX_MESSAGE) };
        // Replacing an entry by a smaller one is still allowed when full.
        s.apply(&Change::Put { key: "k0".into(), value: 1.into() }).unwrap();
    }

    #[test]
    fn versions_order_by_term_first() {
        assert!(Version { term: 2, index: 1 } > Version { term: 1, index: 9 });
    }
}
