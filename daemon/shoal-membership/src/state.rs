//! The cluster state the leader maintains and every member keeps a copy of: who is an
//! approved member, who was revoked, and named entries (catalog, placements). Changes
//! are applied by the leader only; members receive whole snapshots, ordered by
//! [`Version`].

use serde::{Deserialize, Serialize};
use shoal_types::{ClusterId, NodeId, Role};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

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

    /// Whose lane the change is in (see [`Lane`]).
    pub fn lane(&self) -> Lane {
        match self {
            Change::AddMember(_) | Change::RemoveMember(_) => Lane::Owner,
            Change::Put { key, .. } | Change::Delete { key } => lane_of(key),
        }
    }

    /// What the change does, for people (the audit log): `approve NAME (ID)`, `remove
    /// ID`, `set KEY`, `delete KEY`.
    pub fn describe(&self) -> String {
        let short = |id: &NodeId| id.to_string().chars().take(12).collect::<String>();
        let text = match self {
            Change::AddMember(m) => format!("approve {} ({})", m.name, short(&m.id)),
            Change::RemoveMember(id) => format!("remove {}", short(id)),
            Change::Put { key, .. } => format!("set {key}"),
            Change::Delete { key } => format!("delete {key}"),
        };
        text.chars().take(MAX_ACTION).collect()
    }
}

/// Who may propose a change, by what it writes (security review F1): a member's
/// automatic traffic stays in its own lane, placements are the leader's alone, and
/// everything else (who is in, the admin password, API keys, settings, the catalog) is
/// an owner's action, recorded in the [`ClusterState::audit`] log with the node it came
/// through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// An entry in this node's own namespace: its memory offer (`offer/ID`), its
    /// measured speeds (`speed/ID/…`), its links (`links/ID`), its device profiles
    /// (`profile/ID/…`).
    Own(NodeId),
    /// A placement (`placement/…`): only the leader decides them.
    Leader,
    /// Anything else: membership and every shared entry.
    Owner,
}

/// Prefixes of the entries a node keeps about itself, each followed by the node's id
/// (and, where the bool says so, a `/` and more: `profile/HASH` without one is a model's
/// description, which is shared).
const OWN_PREFIXES: [(&str, bool); 4] = [
    (shoal_types::Offer::KEY_PREFIX, false),
    (shoal_types::Speed::KEY_PREFIX, true),
    ("links/", false),
    ("profile/", true),
];

/// The lane of the entry named `key` (see [`Lane`]).
pub fn lane_of(key: &str) -> Lane {
    if key.starts_with(shoal_types::ModelPlacement::KEY_PREFIX) {
        return Lane::Leader;
    }
    for (prefix, nested) in OWN_PREFIXES {
        let Some(rest) = key.strip_prefix(prefix) else { continue };
        let (id, tail) = match rest.split_once('/') {
            Some((id, tail)) => (id, Some(tail)),
            None => (rest, None),
        };
        if nested != tail.is_some() {
            continue;
        }
        if let Ok(id) = id.parse::<NodeId>() {
            return Lane::Own(id);
        }
    }
    Lane::Owner
}

/// A change as a node proposes it, typed by who it is for (see [`Lane`]). The leader
/// applies a proposal only when its kind matches the lane of what it writes
/// ([`Proposal::authorise`]): a member's [`Proposal::Own`] may write only its own
/// namespace; [`Proposal::Lead`] never comes from another node; an
/// [`Proposal::Owner`] action is recorded with the node it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Proposal {
    /// The proposing node's automatic traffic about itself.
    Own(Change),
    /// The leader's own decision (a placement).
    Lead(Change),
    /// An owner's action made on the proposing node (its local CLI, its admin page, an
    /// API call it authorised): recorded in the audit log as `action`.
    Owner {
        /// What the owner did, for people.
        action: String,
        /// The change.
        change: Change,
    },
}

impl Proposal {
    /// How node `me` proposes `change` on its own behalf: in its own lane when the entry
    /// is its own, as the leader's decision for a placement, else as an owner's action.
    pub fn of(me: &NodeId, change: Change) -> Proposal {
        match change.lane() {
            Lane::Own(id) if id == *me => Proposal::Own(change),
            Lane::Leader => Proposal::Lead(change),
            _ => Proposal::Owner { action: change.describe(), change },
        }
    }

    /// The change proposed.
    pub fn change(&self) -> &Change {
        match self {
            Proposal::Own(c) | Proposal::Lead(c) | Proposal::Owner { change: c, .. } => c,
        }
    }

    /// Whether the leader may apply this proposal from `from` (`local`: the leader's
    /// own). An owner's action may delete another node's entries (forgetting a model
    /// drops every node's speeds on it), never write them.
    pub fn authorise(&self, from: &NodeId, local: bool) -> Result<(), ChangeError> {
        let lane = self.change().lane();
        let ok = match self {
            Proposal::Own(_) => lane == Lane::Own(*from),
            Proposal::Lead(_) => local && lane == Lane::Leader,
            Proposal::Owner { change, .. } => {
                lane == Lane::Owner || (matches!(change, Change::Delete { .. }) && matches!(lane, Lane::Own(_)))
            }
        };
        if ok {
            return Ok(());
        }
        let what = self.change().describe();
        Err(ChangeError::NotAllowed(match (self, lane) {
            (_, Lane::Leader) => format!("{what}: placements come from the leader only"),
            (_, Lane::Own(id)) if id != *from => format!("{what}: another node's entry"),
            (Proposal::Own(_), _) => format!("{what}: not this node's own entry"),
            _ => format!("{what}: not an owner's action"),
        }))
    }
}

/// One owner action in the [`ClusterState::audit`] log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// The state version that holds it.
    pub version: Version,
    /// The member it came through.
    pub from: NodeId,
    /// What the owner did ([`Proposal::Owner`]'s `action`).
    pub action: String,
}

/// Owner actions the audit log keeps (the newest).
pub const AUDIT_KEEP: usize = 64;
/// Longest action text kept (characters).
pub const MAX_ACTION: usize = 200;

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
    /// The proposer may not make this change (see [`Lane`]).
    #[error("not allowed: {0}")]
    NotAllowed(String),
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
    /// The newest owner actions ([`Proposal::Owner`]), oldest first, at most
    /// [`AUDIT_KEEP`]: every node's event log shows them with the member they came
    /// through. (Empty in states of versions before it.)
    #[serde(default)]
    pub audit: VecDeque<Audit>,
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
            audit: VecDeque::new(),
        }
    }

    /// Record an owner action that version `version` holds, forgetting the oldest past
    /// [`AUDIT_KEEP`], and while the state would exceed [`MAX_STATE_BYTES`] (a full state
    /// keeps no record rather than outgrow the messages that carry it).
    pub fn record(&mut self, version: Version, from: NodeId, action: &str) {
        self.audit.push_back(Audit { version, from, action: action.chars().take(MAX_ACTION).collect() });
        while self.audit.len() > AUDIT_KEEP || (!self.audit.is_empty() && self.encoded_len() > MAX_STATE_BYTES) {
            self.audit.pop_front();
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
    fn entries_fall_in_the_lane_of_the_node_they_name() {
        let id = NodeId([7; 32]);
        let own =
            [format!("offer/{id}"), format!("links/{id}"), format!("speed/{id}/abc"), format!("profile/{id}/x.gguf")];
        for key in own {
            assert_eq!(lane_of(&key), Lane::Own(id), "{key}");
        }
        let shared = [
            format!("offer/{id}/x"),
            format!("speed/{id}"),
            format!("profile/{id}"),
            "offer/nobody".to_string(),
            "admin/auth".into(),
            "apikey/abc".into(),
            "settings/api_open".into(),
            "catalog/abc".into(),
            "load/abc".into(),
        ];
        for key in shared {
            assert_eq!(lane_of(&key), Lane::Owner, "{key}");
        }
        assert_eq!(lane_of("placement/abc"), Lane::Leader);
        assert_eq!(Change::RemoveMember(id).lane(), Lane::Owner);
        // A node proposes its own entries in its own lane, others' as an owner's action
        // (which the leader refuses for a write: see `Proposal::authorise`).
        let put = |key: String| Change::Put { key, value: 1.into() };
        assert!(matches!(Proposal::of(&id, put(format!("offer/{id}"))), Proposal::Own(_)));
        assert!(matches!(Proposal::of(&NodeId([8; 32]), put(format!("offer/{id}"))), Proposal::Owner { .. }));
        assert!(matches!(Proposal::of(&id, put("placement/m".into())), Proposal::Lead(_)));
        match Proposal::of(&id, put("settings/api_open".into())) {
            Proposal::Owner { action, .. } => assert_eq!(action, "set settings/api_open"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_audit_log_keeps_the_newest_and_never_outgrows_the_state_bound() {
        let mut s = ClusterState::create(ClusterId([1; 16]), member(1));
        for i in 0..(AUDIT_KEEP as u64 + 10) {
            s.record(Version { term: 1, index: i }, NodeId([1; 32]), &"a".repeat(MAX_ACTION * 2));
        }
        assert_eq!(s.audit.len(), AUDIT_KEEP);
        assert_eq!(s.audit.front().map(|a| a.version.index), Some(10));
        assert!(s.audit.iter().all(|a| a.action.chars().count() == MAX_ACTION));
        // A full state keeps no record rather than grow past the bound.
        let value = serde_json::Value::String("x".repeat(MAX_VALUE - 100));
        for i in 0.. {
            if s.apply(&Change::Put { key: format!("k{i}"), value: value.clone() }).is_err() {
                break;
            }
        }
        s.record(Version { term: 2, index: 1 }, NodeId([1; 32]), "one more");
        assert!(s.encoded_len() <= MAX_STATE_BYTES);
    }

    #[test]
    fn versions_order_by_term_first() {
        assert!(Version { term: 2, index: 1 } > Version { term: 1, index: 9 });
    }
}
