//! The membership protocol as a pure state machine: liveness from heartbeats, leader
//! election with terms (pre-vote, persisted votes, majority of members, leader
//! stickiness, check-quorum) and replication of the cluster state as whole snapshots.
//! Inputs are messages, proposals and clock values (ms); outputs are [`Action`]s the
//! shell carries out *in order* (a persist action completes before the sends after it).
//! No sockets, no threads, no sleeping: `tests/sim.rs` runs thousands of schedules.
//!
//! It is Raft with the log compacted to its last entry: a snapshot's [`Version`] plays
//! the role of (last log term, last log index). Safety rests on the usual rules:
//! one vote per term, persisted before it is sent; a vote only for a candidate whose
//! state is at least as new; a change is acknowledged only once a majority stored it;
//! a new leader first stores a snapshot of its own term (Raft's no-op entry), and
//! membership changes go one at a time.

use crate::state::{ChangeError, ClusterState, Proposal, Version};

/// How far ahead of ours a term from a peer may be. Terms grow by one per election;
/// further jumps are refused so that no member can push the counters to their end.
pub const MAX_TERM_STEP: u64 = 1 << 32;
/// How far ahead of ours a snapshot index from a peer may be (one per change).
pub const MAX_INDEX_STEP: u64 = 1 << 40;
use serde::{Deserialize, Serialize};
use shoal_types::NodeId;
use std::collections::{BTreeMap, BTreeSet};

/// A successor named by a resigning leader asks for pre-votes again this soon (ms) if
/// the first round did not win (see [`Msg::Resign`]).
const RESIGN_RETRY_MS: u64 = 50;

/// Timing, in milliseconds of the clock the caller passes in.
#[derive(Clone, Debug)]
pub struct Config {
    /// Every node sends every member a beat this often.
    pub beat_ms: u64,
    /// A member not heard from for this long is suspected.
    pub suspect_ms: u64,
    /// A member not heard from for this long is down.
    pub down_ms: u64,
    /// A follower that has not heard from a leader for at least this long campaigns;
    /// voters that heard from a leader more recently refuse to help unseat it.
    pub election_min_ms: u64,
    /// Random extra on top of `election_min_ms`, so that candidates rarely collide.
    pub election_spread_ms: u64,
    /// Extra wait per member of higher priority (hub role, memory): the preferred
    /// node usually campaigns first. A tie-break only; it never decides a vote.
    pub rank_step_ms: u64,
    /// A proposal forwarded to the leader fails if no answer comes within this time.
    pub forward_timeout_ms: u64,
    /// (Shell) A node admitted by a welcome, a code or a token must hear from a member
    /// of its new cluster within this time, or it goes back to unpaired: its admission
    /// never took effect there.
    pub confirm_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        // Seconds, not minutes: suspect after 4 missed beats, down after 12, a new
        // leader typically 1–2.5 s after the old one went quiet.
        Config {
            beat_ms: 250,
            suspect_ms: 1000,
            down_ms: 3000,
            election_min_ms: 1000,
            election_spread_ms: 1000,
            rank_step_ms: 150,
            forward_timeout_ms: 5000,
            confirm_ms: 60_000,
        }
    }
}

/// What must survive a restart before any vote or campaign message leaves the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HardState {
    /// The highest term seen.
    pub term: u64,
    /// Whom this node voted for in `term`.
    pub voted_for: Option<NodeId>,
}

/// Messages between members.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// Sent by every node to every member each beat. From the leader it also asserts
    /// leadership for `term` and says which snapshot is current.
    Beat {
        /// The sender's term.
        term: u64,
        /// Whether the sender is the leader of `term`.
        leader: bool,
        /// The sender's snapshot version.
        version: Version,
    },
    /// The leader's snapshot, sent to a member whose version is older.
    State {
        /// The leader's term.
        term: u64,
        /// The snapshot.
        state: Box<ClusterState>,
    },
    /// A member's answer to the leader: its term, and the version it has stored.
    Ack {
        /// The member's term.
        term: u64,
        /// The version it has stored (persisted).
        version: Version,
    },
    /// "Would you vote for me in `term`?" Changes nothing at the receiver.
    PreVote {
        /// The term the sender would campaign in.
        term: u64,
        /// The sender's snapshot version.
        last: Version,
    },
    /// Answer to a pre-vote.
    PreVoteReply {
        /// The term asked about.
        term: u64,
        /// Whether the receiver would vote.
        granted: bool,
        /// The receiver's own term: a node that fell behind learns the current term
        /// here (else a node with a higher term but older state would refuse it forever).
        current: u64,
    },
    /// A vote request of a candidate.
    Vote {
        /// The candidate's term.
        term: u64,
        /// The candidate's snapshot version.
        last: Version,
    },
    /// Answer to a vote request.
    VoteReply {
        /// The voter's term.
        term: u64,
        /// Whether it voted for the candidate.
        granted: bool,
    },
    /// A newer snapshot for a member that asked for votes with an older one: a node
    /// that missed a change (say, a member added back) may not even accept the
    /// current leader's messages until it has it.
    CatchUp {
        /// The sender's snapshot.
        state: Box<ClusterState>,
    },
    /// A proposal forwarded to the leader, which applies it only as far as
    /// [`Proposal::authorise`] lets the sender.
    Forward {
        /// The sender's request number.
        req: u64,
        /// The change, typed by whose it is.
        proposal: Proposal,
    },
    /// The leader's answer to a forwarded proposal.
    Forwarded {
        /// The request number.
        req: u64,
        /// The committed version, or why not.
        result: Result<Version, ProposeError>,
    },
    /// The leader of `term` is stopping (a service stop, an upgrade): its followers stop
    /// holding on to it, and `successor` (a member that stored the leader's newest
    /// state, if one did) campaigns at once, so a new leader is elected in a round trip
    /// instead of an election timeout.
    Resign {
        /// The leader's term.
        term: u64,
        /// Who should campaign now.
        successor: Option<NodeId>,
    },
}

/// Why a proposal failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ProposeError {
    /// No leader is known (election under way, or no majority reachable).
    #[error("no leader: an election is under way or a majority of members is unreachable")]
    NoLeader,
    /// The change itself is invalid.
    #[error(transparent)]
    Invalid(#[from] ChangeError),
    /// Another membership change has not committed yet.
    #[error("another membership change is still being committed; try again")]
    Busy,
    /// Leadership changed before a majority stored the change: it may or may not
    /// take effect.
    #[error("the leader changed before the change was confirmed; check and retry")]
    Interrupted,
    /// No answer from the leader in time.
    #[error("the leader did not answer in time")]
    Timeout,
}

/// How a member looks from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    /// Heard from recently.
    Alive,
    /// A few beats missed.
    Suspected,
    /// Silent past the timeout.
    Down,
}

/// Something the shell should know about (log, status, admin page).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The leader this node knows of changed.
    Leader {
        /// The leader, if any.
        leader: Option<NodeId>,
        /// Current term.
        term: u64,
    },
    /// A member's liveness changed.
    Liveness {
        /// The member.
        node: NodeId,
        /// Its new state.
        liveness: Liveness,
    },
    /// A new snapshot was adopted (members may have changed: update the trusted keys).
    State {
        /// Its version.
        version: Version,
    },
    /// The leader learned that a majority stored `version` (leader only).
    Committed {
        /// The newest committed version.
        version: Version,
    },
    /// This node was removed from the cluster; the core is inert from now on.
    Removed,
}

/// What the shell must do, in this order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Store the hard state durably before carrying out later actions.
    PersistHard(HardState),
    /// Store the snapshot durably before carrying out later actions.
    PersistState(Box<ClusterState>),
    /// Send `msg` to member `to` (best effort: loss is tolerated).
    Send {
        /// The member.
        to: NodeId,
        /// The message.
        msg: Msg,
    },
    /// The outcome of a local proposal.
    Reply {
        /// The request number given to [`Core::propose`].
        req: u64,
        /// The committed version, or why not.
        result: Result<Version, ProposeError>,
    },
    /// Report an event.
    Event(Event),
}

/// This node's part in the election.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Follows `leader` (if one is known).
    Follower,
    /// Asking whether a campaign could win, without changing terms.
    PreCandidate,
    /// Campaigning in the current term.
    Candidate,
    /// Leads the current term.
    Leader,
    /// Removed from the cluster.
    Removed,
}

/// Who asked for a proposal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Local(u64),
    Remote(NodeId, u64),
}

/// A tiny deterministic generator (xorshift64*) for election jitter: the sim replays
/// schedules exactly from a seed.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        if n == 0 {
            0
        } else {
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
        }
    }
}

/// The membership state machine of one node.
#[derive(Debug)]
pub struct Core {
    /// Timing.
    config: Config,
    /// This node.
    me: NodeId,
    /// Term and vote (persisted before use).
    hard: HardState,
    /// The cluster state this node holds (persisted before it is acknowledged).
    state: ClusterState,
    /// Election role.
    role: Role,
    /// The leader of `hard.term`, once known.
    leader: Option<NodeId>,
    /// When we last heard from `leader` (leader stickiness and follower timeouts).
    leader_heard: Option<u64>,
    /// When a follower starts a campaign, or a candidate gives up and retries.
    election_deadline: u64,
    /// Votes (pre-votes while a pre-candidate) received in this campaign.
    votes: BTreeSet<NodeId>,
    /// The next beat is due at this time.
    next_beat: u64,
    /// Last time each member was heard from (any message).
    heard: BTreeMap<NodeId, u64>,
    /// Last liveness reported per member.
    liveness: BTreeMap<NodeId, Liveness>,
    /// Leader only: when this node became leader (check-quorum gives everyone a full
    /// window from then).
    leader_since: u64,
    /// Leader only: the newest version a majority has stored.
    committed: Version,
    /// Leader only: the version each member has stored.
    acked: BTreeMap<NodeId, Version>,
    /// Leader only: when each member last acknowledged this leader's term.
    ack_heard: BTreeMap<NodeId, u64>,
    /// Leader only: whether a snapshot of this leader's own term has committed. Until
    /// then membership changes wait (Raft's single-server change needs the new leader's
    /// no-op committed first, or an old configuration's majority can undo a change).
    term_committed: bool,
    /// Leader only: proposals waiting for a majority, by the version that holds them.
    pending: Vec<(Version, Origin, bool)>,
    /// Proposals forwarded to the leader: request number → deadline.
    forwarded: BTreeMap<u64, u64>,
    /// The leader this node accepted for each of the last few terms.
    leaders: BTreeMap<u64, NodeId>,
    /// The leader of this term resigned (see [`Msg::Resign`]): its beats and snapshots
    /// sent before it resigned may still arrive (reordered), and must not make this
    /// node follow it again.
    resigned: Option<u64>,
    /// Named successor of a resigning leader: until this time (ms), a pre-vote that did
    /// not win is asked again after [`RESIGN_RETRY_MS`], not after an election timeout
    /// (voters may hear the resignation later than the successor, over slower links).
    handover_until: u64,
    /// Election jitter.
    rng: Rng,
    /// Actions produced by the current call.
    out: Vec<Action>,
}

impl Core {
    /// A node starting (or restarting) at `now` with what it had persisted. `seed`
    /// varies election jitter between nodes (the shell passes randomness; tests a seed).
    pub fn new(config: Config, me: NodeId, hard: HardState, state: ClusterState, now: u64, seed: u64) -> Core {
        let mut core = Core {
            me,
            hard,
            // Even outside its own configuration: the change that removed it may not
            // have committed, and it may be needed to finish it (see `own_vote`).
            role: Role::Follower,
            state,
            leader: None,
            leader_heard: None,
            leader_since: 0,
            term_committed: false,
            committed: Version::default(),
            election_deadline: 0,
            votes: BTreeSet::new(),
            next_beat: now,
            heard: BTreeMap::new(),
            liveness: BTreeMap::new(),
            acked: BTreeMap::new(),
            ack_heard: BTreeMap::new(),
            pending: Vec::new(),
            forwarded: BTreeMap::new(),
            leaders: BTreeMap::new(),
            resigned: None,
            handover_until: 0,
            rng: Rng(seed | 1),
            out: Vec::new(),
            config,
        };
        for id in core.state.members.keys() {
            // Everyone gets a grace period from our start before being suspected.
            core.heard.insert(*id, now);
        }
        core.reset_election(now);
        core
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.me
    }

    /// Current term.
    pub fn term(&self) -> u64 {
        self.hard.term
    }

    /// Election role.
    pub fn role(&self) -> &Role {
        &self.role
    }

    /// The known leader of the current term.
    pub fn leader(&self) -> Option<NodeId> {
        if self.role == Role::Leader {
            Some(self.me)
        } else {
            self.leader
        }
    }

    /// The cluster state held here.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// How `node` looks from here (`None` for non-members).
    pub fn liveness(&self, node: &NodeId) -> Option<Liveness> {
        if *node == self.me && self.state.is_member(node) {
            return Some(Liveness::Alive);
        }
        self.liveness.get(node).copied().or_else(|| self.state.is_member(node).then_some(Liveness::Alive))
    }

    /// Advance the clock: beats, liveness, timeouts, campaigns.
    pub fn tick(&mut self, now: u64) -> Vec<Action> {
        if self.role != Role::Removed {
            self.update_liveness(now);
            self.expire_forwards(now);
            if now >= self.next_beat {
                self.next_beat = now + self.config.beat_ms;
                self.beat();
            }
            match self.role {
                Role::Leader => self.check_quorum(now),
                _ if now >= self.election_deadline => self.start_pre_vote(now),
                _ => {}
            }
        }
        std::mem::take(&mut self.out)
    }

    /// A message from `from` arrived at `now`. Messages from non-members are ignored.
    pub fn receive(&mut self, now: u64, from: NodeId, msg: Msg) -> Vec<Action> {
        if self.role == Role::Removed || from == self.me || !self.state.is_member(&from) {
            return Vec::new();
        }
        if !self.plausible(&msg) {
            // Terms and versions move by one per election and per change; a jump this
            // large is a broken or hostile member, and following it could exhaust the
            // counters (no term after u64::MAX: no election could ever succeed).
            return Vec::new();
        }
        self.heard.insert(from, now);
        self.update_liveness(now);
        match msg {
            Msg::Beat { term, leader, .. } => self.on_beat(now, from, term, leader),
            Msg::State { term, state } => self.on_state(now, from, term, *state),
            Msg::Ack { term, version } => self.on_ack(now, from, term, version),
            Msg::PreVote { term, last } => {
                let granted = term > self.hard.term && last >= self.state.version && !self.leader_is_fresh(now);
                self.send(from, Msg::PreVoteReply { term, granted, current: self.hard.term });
                self.catch_up(from, last);
            }
            Msg::CatchUp { state } => {
                // Strictly newer only: a newer version holds every committed change of an
                // older one (leader completeness), so this never loses one; and it only
                // makes this node's votes stricter. From the node this node accepted as
                // the leader of the term that made the snapshot; from another member only
                // while this node campaigns without a fresh leader (it asked for votes
                // with an old state, and may not even know the leader as a member):
                // never can a member hand a following node a made-up state.
                let trusted = self.leaders.get(&state.version.term) == Some(&from)
                    || (matches!(self.role, Role::PreCandidate | Role::Candidate) && !self.leader_is_fresh(now));
                if self.role != Role::Leader
                    && trusted
                    && state.cluster == self.state.cluster
                    && state.version > self.state.version
                {
                    self.state = *state;
                    self.out.push(Action::PersistState(Box::new(self.state.clone())));
                    self.out.push(Action::Event(Event::State { version: self.state.version }));
                    for id in self.state.members.keys() {
                        self.heard.entry(*id).or_insert(now);
                    }
                }
            }
            Msg::PreVoteReply { term, granted, current } => {
                if current > self.hard.term {
                    if !self.sticky(now, from) {
                        self.adopt_term(now, current, None);
                    }
                } else if self.role == Role::PreCandidate && term == self.hard.term.saturating_add(1) && granted {
                    self.votes.insert(from);
                    if self.votes.len() >= self.state.majority() {
                        self.start_campaign(now);
                    }
                }
            }
            Msg::Vote { term, last } => self.on_vote(now, from, term, last),
            Msg::VoteReply { term, granted } => {
                if term > self.hard.term {
                    if !self.sticky(now, from) {
                        self.adopt_term(now, term, None);
                    }
                } else if self.role == Role::Candidate && term == self.hard.term && granted {
                    self.votes.insert(from);
                    if self.votes.len() >= self.state.majority() {
                        self.become_leader(now);
                    }
                }
            }
            Msg::Forward { req, proposal } => {
                if self.role == Role::Leader {
                    self.propose_as_leader(now, Origin::Remote(from, req), proposal);
                } else {
                    self.send(from, Msg::Forwarded { req, result: Err(ProposeError::NoLeader) });
                }
            }
            Msg::Forwarded { req, result } => {
                if self.forwarded.remove(&req).is_some() {
                    self.out.push(Action::Reply { req, result });
                }
            }
            Msg::Resign { term, successor } => self.on_resign(now, from, term, successor),
        }
        std::mem::take(&mut self.out)
    }

    /// This node is stopping: a leader hands over (see [`Msg::Resign`]) and steps down,
    /// so the others need not wait out an election timeout. Anything else has nothing
    /// to hand over. Call it last: the node must stop right after sending the actions
    /// (it would campaign again after an election timeout).
    pub fn resign(&mut self, now: u64) -> Vec<Action> {
        if self.role != Role::Leader {
            return Vec::new();
        }
        // The successor must hold the newest state, or the others would refuse it their
        // votes; among those, recently heard, the one the elections prefer.
        let window = self.config.election_min_ms;
        let successor = self
            .state
            .members
            .values()
            .filter(|m| m.id != self.me)
            .filter(|m| self.acked.get(&m.id) == Some(&self.state.version))
            .filter(|m| self.ack_heard.get(&m.id).is_some_and(|t| now.saturating_sub(*t) < window))
            .max_by_key(|m| m.priority())
            .map(|m| m.id);
        let term = self.hard.term;
        // The successor last: it asks the others for votes as soon as it hears, and
        // they should have heard first.
        let mut order = self.others();
        order.sort_by_key(|id| Some(*id) == successor);
        for to in order {
            self.send(to, Msg::Resign { term, successor });
        }
        self.step_down();
        self.leader = None;
        self.leader_heard = None;
        self.out.push(Action::Event(Event::Leader { leader: None, term }));
        self.reset_election(now);
        std::mem::take(&mut self.out)
    }

    fn on_resign(&mut self, now: u64, from: NodeId, term: u64, successor: Option<NodeId>) {
        // Only the leader this node follows in this very term may hand over; anyone
        // else's resignation is not theirs to give.
        if term != self.hard.term || self.leader != Some(from) || self.role != Role::Follower {
            return;
        }
        self.leader = None;
        self.leader_heard = None;
        self.resigned = Some(term);
        self.out.push(Action::Event(Event::Leader { leader: None, term }));
        if successor == Some(self.me) {
            // A voter may hear this node's pre-vote before the leader's resignation (other
            // links) and refuse it: ask again soon, for up to an election timeout, not
            // after one. (Pre-votes change no term: asking again costs a message.)
            self.handover_until = now + self.config.election_min_ms;
            self.start_pre_vote(now);
        } else {
            self.reset_election(now);
        }
    }

    /// Ask for `proposal`; the answer comes as [`Action::Reply`] with `req` once a
    /// majority stored it (or it failed). A follower forwards it to the leader (but for
    /// a [`Proposal::Lead`]: only the leader decides those, and this node no longer
    /// leads).
    pub fn propose(&mut self, now: u64, req: u64, proposal: Proposal) -> Vec<Action> {
        match (&self.role, self.leader) {
            (Role::Leader, _) => self.propose_as_leader(now, Origin::Local(req), proposal),
            (_, _) if matches!(proposal, Proposal::Lead(_)) => {
                self.out.push(Action::Reply { req, result: Err(ProposeError::NoLeader) })
            }
            (Role::Follower, Some(leader)) => {
                self.forwarded.insert(req, now + self.config.forward_timeout_ms);
                self.send(leader, Msg::Forward { req, proposal });
            }
            _ => self.out.push(Action::Reply { req, result: Err(ProposeError::NoLeader) }),
        }
        std::mem::take(&mut self.out)
    }

    fn on_beat(&mut self, now: u64, from: NodeId, term: u64, leader: bool) {
        if !leader {
            // Plain liveness; a follower's term never unsettles anyone (pre-vote does that job).
            return;
        }
        if term < self.hard.term {
            // A deposed leader: tell it the current term so it steps down.
            self.send(from, Msg::Ack { term: self.hard.term, version: self.state.version });
            return;
        }
        if !self.follow(now, from, term) {
            return;
        }
        // Say what we hold; if it is not the leader's version (older, or an
        // uncommitted snapshot of an older term), the leader sends its snapshot.
        self.send(from, Msg::Ack { term, version: self.state.version });
    }

    fn on_state(&mut self, now: u64, from: NodeId, term: u64, state: ClusterState) {
        if term < self.hard.term {
            self.send(from, Msg::Ack { term: self.hard.term, version: self.state.version });
            return;
        }
        if !self.follow(now, from, term) {
            return;
        }
        if state.cluster != self.state.cluster || state.version.term > term {
            // Not our cluster, or a snapshot its sender could not have made: ignore.
            return;
        }
        // The leader of `term` is authoritative: take its snapshot unless we already
        // have exactly it (or a newer one of the same leader, arriving reordered).
        if state.version != self.state.version
            && !(state.version < self.state.version && self.state.version.term == term)
        {
            self.state = state;
            self.out.push(Action::PersistState(Box::new(self.state.clone())));
            self.out.push(Action::Event(Event::State { version: self.state.version }));
            for id in self.state.members.keys() {
                self.heard.entry(*id).or_insert(now);
            }
        }
        self.send(from, Msg::Ack { term, version: self.state.version });
    }

    fn on_ack(&mut self, now: u64, from: NodeId, term: u64, version: Version) {
        if term > self.hard.term {
            // Even a leader a majority acknowledges steps down: a member with a higher
            // term (from a campaign pre-vote did not stop, say after a partition) would
            // otherwise refuse this leader for ever. (A member can abuse this to force
            // an election; signed votes would close that, see ARCHITECTURE.md.)
            self.adopt_term(now, term, None);
            return;
        }
        if self.role != Role::Leader || term != self.hard.term {
            return;
        }
        self.ack_heard.insert(from, now);
        let acked = self.acked.entry(from).or_default();
        // A member's stored version from the current term only grows; an older one
        // (reordered ack) must not lower it.
        if version > *acked {
            *acked = version;
        }
        if version != self.state.version {
            self.send(from, Msg::State { term, state: Box::new(self.state.clone()) });
        }
        self.commit();
    }

    /// Send our snapshot to `to` if it campaigns with an older one.
    fn catch_up(&mut self, to: NodeId, last: Version) {
        if last < self.state.version {
            self.send(to, Msg::CatchUp { state: Box::new(self.state.clone()) });
        }
    }

    fn on_vote(&mut self, now: u64, from: NodeId, term: u64, last: Version) {
        self.catch_up(from, last);
        if term < self.hard.term || (term > self.hard.term && self.leader_is_fresh(now) && self.leader != Some(from)) {
            // Stale, or a live leader exists: refuse without adopting the term, so a
            // node that was cut off cannot unseat a working leader.
            self.send(from, Msg::VoteReply { term: self.hard.term, granted: false });
            return;
        }
        if term > self.hard.term {
            self.adopt_term(now, term, None);
        }
        let granted = self.hard.voted_for.is_none_or(|v| v == from) && last >= self.state.version;
        if granted {
            if self.hard.voted_for.is_none() {
                self.hard.voted_for = Some(from);
                self.out.push(Action::PersistHard(self.hard));
            }
            self.reset_election(now);
        }
        self.send(from, Msg::VoteReply { term, granted });
    }

    /// `from` leads `term` (≥ ours): follow it. False, and nothing changes, when another
    /// node is already the leader of this very term here: a term has one leader, and a
    /// member claiming to be a second one is lying.
    fn follow(&mut self, now: u64, from: NodeId, term: u64) -> bool {
        if term == self.hard.term && (self.leader.is_some_and(|l| l != from) || self.resigned == Some(term)) {
            return false;
        }
        if term > self.hard.term && self.sticky(now, from) {
            // A new leader can only have been elected by voters that stopped hearing
            // the current one (they refuse votes while it is fresh), and a current
            // leader that loses its majority steps down: while ours is fresh, a claim
            // to a newer term is a member lying. A real new leader is followed at most
            // `election_min_ms` later, once ours has gone quiet.
            return false;
        }
        self.remember_leader(term, from);
        if term > self.hard.term {
            self.adopt_term(now, term, Some(from));
        } else if self.leader != Some(from) || self.role != Role::Follower {
            // Same term: a candidate (or pre-candidate) learns the winner.
            self.step_down();
            self.leader = Some(from);
            self.out.push(Action::Event(Event::Leader { leader: Some(from), term }));
        }
        self.leader_heard = Some(now);
        self.reset_election(now);
        true
    }

    /// Keep who led `term` (the last few terms): only they may send a catch-up snapshot
    /// made in their term.
    fn remember_leader(&mut self, term: u64, leader: NodeId) {
        self.leaders.insert(term, leader);
        while self.leaders.len() > 8 {
            self.leaders.pop_first();
        }
    }

    /// Whether a message's numbers are within reach of ours (see `receive`).
    fn plausible(&self, msg: &Msg) -> bool {
        let near = |term: u64| term <= self.hard.term.saturating_add(MAX_TERM_STEP);
        let version_ok =
            |v: &Version| near(v.term) && v.index <= self.state.version.index.saturating_add(MAX_INDEX_STEP);
        match msg {
            Msg::Beat { term, version, .. } => near(*term) && version_ok(version),
            Msg::State { term, state } => near(*term) && version_ok(&state.version),
            Msg::Ack { term, version } => near(*term) && version_ok(version),
            Msg::PreVote { term, last } | Msg::Vote { term, last } => near(*term) && version_ok(last),
            Msg::PreVoteReply { term, current, .. } => near(*term) && near(*current),
            Msg::VoteReply { term, .. } => near(*term),
            Msg::CatchUp { state } => version_ok(&state.version),
            Msg::Resign { term, .. } => near(*term),
            Msg::Forward { .. } | Msg::Forwarded { .. } => true,
        }
    }

    /// Move to a higher term as a follower (of `leader`, if known).
    fn adopt_term(&mut self, now: u64, term: u64, leader: Option<NodeId>) {
        self.step_down();
        self.hard = HardState { term, voted_for: None };
        self.out.push(Action::PersistHard(self.hard));
        self.leader = leader;
        self.leader_heard = leader.map(|_| now);
        self.out.push(Action::Event(Event::Leader { leader, term }));
        self.reset_election(now);
    }

    /// Leave any leader/candidate role (pending proposals fail as interrupted).
    fn step_down(&mut self) {
        if self.role == Role::Leader {
            for (_, origin, _) in std::mem::take(&mut self.pending) {
                self.answer(origin, Err(ProposeError::Interrupted));
            }
            self.acked.clear();
        }
        if self.role != Role::Removed {
            self.role = Role::Follower;
        }
        self.votes.clear();
    }

    fn start_pre_vote(&mut self, now: u64) {
        self.reset_election(now);
        if now < self.handover_until {
            self.election_deadline = now + RESIGN_RETRY_MS;
        }
        if self.role == Role::Leader || self.hard.term == u64::MAX {
            // No term after the last: campaigning again in it could vote twice.
            return;
        }

        if self.leader.is_some() {
            self.leader = None;
            self.out.push(Action::Event(Event::Leader { leader: None, term: self.hard.term }));
        }
        self.role = Role::PreCandidate;
        self.votes = self.own_vote();
        if self.votes.len() >= self.state.majority() {
            self.start_campaign(now);
            return;
        }
        let (term, last) = (self.hard.term.saturating_add(1), self.state.version);
        for to in self.others() {
            self.send(to, Msg::PreVote { term, last });
        }
    }

    fn start_campaign(&mut self, now: u64) {
        self.hard = HardState { term: self.hard.term.saturating_add(1), voted_for: Some(self.me) };
        // The vote for ourselves is stored before anyone hears of the campaign.
        self.out.push(Action::PersistHard(self.hard));
        self.role = Role::Candidate;
        self.leader = None;
        self.leader_heard = None;
        self.votes = self.own_vote();
        self.reset_election(now);
        if self.votes.len() >= self.state.majority() {
            self.become_leader(now);
            return;
        }
        let (term, last) = (self.hard.term, self.state.version);
        for to in self.others() {
            self.send(to, Msg::Vote { term, last });
        }
    }

    fn become_leader(&mut self, now: u64) {
        self.role = Role::Leader;
        self.leader = Some(self.me);
        self.remember_leader(self.hard.term, self.me);
        self.votes.clear();
        self.acked.clear();
        self.ack_heard.clear();
        self.pending.clear();
        self.leader_since = now;
        self.term_committed = false;
        self.out.push(Action::Event(Event::Leader { leader: Some(self.me), term: self.hard.term }));
        // Raft's no-op: a snapshot of our own term, so that what earlier terms left
        // committed-but-unconfirmed commits with it.
        self.stamp_and_send(None);
        self.next_beat = now + self.config.beat_ms;
    }

    fn propose_as_leader(&mut self, now: u64, origin: Origin, proposal: Proposal) {
        let (from, local) = match origin {
            Origin::Local(_) => (self.me, true),
            Origin::Remote(from, _) => (from, false),
        };
        if let Err(e) = proposal.authorise(&from, local) {
            self.answer(origin, Err(e.into()));
            return;
        }
        let change = proposal.change();
        if change.is_membership() && (!self.term_committed || self.pending.iter().any(|(_, _, membership)| *membership))
        {
            self.answer(origin, Err(ProposeError::Busy));
            return;
        }
        let mut next = self.state.clone();
        if let Err(e) = next.apply(change) {
            self.answer(origin, Err(e.into()));
            return;
        }
        if let Proposal::Owner { action, .. } = &proposal {
            // The version `stamp_and_send` gives it next.
            let version = Version { term: self.hard.term, index: self.state.version.index.saturating_add(1) };
            next.record(version, from, action);
        }
        let removed: Vec<NodeId> =
            self.state.members.keys().filter(|id| !next.members.contains_key(id)).copied().collect();
        for id in next.members.keys() {
            // A new member gets a full check-quorum window to start answering.
            self.heard.entry(*id).or_insert(now);
        }
        self.state = next;
        self.stamp_and_send(Some((origin, change.is_membership())));
        // A removed member hears of its removal (best effort) and goes inert.
        for id in removed {
            self.send(id, Msg::State { term: self.hard.term, state: Box::new(self.state.clone()) });
            self.acked.remove(&id);
        }
    }

    /// Give the held state the next version, store it, send it to every member, and
    /// remember `pending` to answer once a majority stored it.
    fn stamp_and_send(&mut self, pending: Option<(Origin, bool)>) {
        self.state.version = Version { term: self.hard.term, index: self.state.version.index.saturating_add(1) };
        self.out.push(Action::PersistState(Box::new(self.state.clone())));
        self.out.push(Action::Event(Event::State { version: self.state.version }));
        if let Some((origin, membership)) = pending {
            self.pending.push((self.state.version, origin, membership));
        }
        let term = self.hard.term;
        for to in self.others() {
            self.send(to, Msg::State { term, state: Box::new(self.state.clone()) });
        }
        self.commit();
    }

    /// Answer every pending proposal a majority has stored.
    fn commit(&mut self) {
        let mut versions: Vec<Version> = self
            .state
            .members
            .keys()
            .map(|id| if *id == self.me { self.state.version } else { self.acked.get(id).copied().unwrap_or_default() })
            .collect();
        versions.sort_unstable_by(|a, b| b.cmp(a));
        // Invariant: members is never empty (the last member cannot be removed), and
        // majority() ≤ len.
        let Some(committed) = versions.get(self.state.majority() - 1).copied() else { return };
        if committed.term != self.hard.term {
            return;
        }
        if committed > self.committed {
            self.committed = committed;
            self.out.push(Action::Event(Event::Committed { version: committed }));
        }
        self.term_committed = true;
        let (done, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.pending).into_iter().partition(|p| p.0 <= committed);
        self.pending = rest;
        for (version, origin, _) in done {
            self.answer(origin, Ok(version));
        }
        if !self.state.is_member(&self.me) && self.pending.is_empty() {
            // We removed ourselves and a majority knows: hand over by going quiet.
            self.removed();
        }
    }

    fn answer(&mut self, origin: Origin, result: Result<Version, ProposeError>) {
        match origin {
            Origin::Local(req) => self.out.push(Action::Reply { req, result }),
            Origin::Remote(to, req) => self.send(to, Msg::Forwarded { req, result }),
        }
    }

    /// A leader that has not heard from a majority within an election timeout steps
    /// down, so that a minority side of a partition has no leader.
    fn check_quorum(&mut self, now: u64) {
        let window = self.config.election_min_ms + self.config.election_spread_ms;
        if now.saturating_sub(self.leader_since) < window {
            return;
        }
        let reachable = self
            .state
            .members
            .keys()
            .filter(|id| **id == self.me || self.heard.get(*id).is_some_and(|t| now.saturating_sub(*t) < window))
            .count();
        if reachable < self.state.majority() {
            self.step_down();
            self.leader = None;
            self.out.push(Action::Event(Event::Leader { leader: None, term: self.hard.term }));
            self.reset_election(now);
        }
    }

    fn beat(&mut self) {
        let (term, leader, version) = (self.hard.term, self.role == Role::Leader, self.state.version);
        for to in self.others() {
            self.send(to, Msg::Beat { term, leader, version });
        }
    }

    fn update_liveness(&mut self, now: u64) {
        let members: Vec<NodeId> = self.state.members.keys().filter(|id| **id != self.me).copied().collect();
        for id in members {
            let silent = now.saturating_sub(self.heard.get(&id).copied().unwrap_or(now));
            let liveness = if silent >= self.config.down_ms {
                Liveness::Down
            } else if silent >= self.config.suspect_ms {
                Liveness::Suspected
            } else {
                Liveness::Alive
            };
            if self.liveness.insert(id, liveness).unwrap_or(Liveness::Alive) != liveness {
                self.out.push(Action::Event(Event::Liveness { node: id, liveness }));
            }
        }
        self.liveness.retain(|id, _| self.state.members.contains_key(id));
    }

    fn expire_forwards(&mut self, now: u64) {
        let expired: Vec<u64> = self.forwarded.iter().filter(|(_, d)| **d <= now).map(|(r, _)| *r).collect();
        for req in expired {
            self.forwarded.remove(&req);
            self.out.push(Action::Reply { req, result: Err(ProposeError::Timeout) });
        }
    }

    /// Has the current leader been heard from within the minimum election timeout?
    /// Whether this node holds on to the leader it has against `from`'s claim of a newer
    /// term: a leader while a majority acknowledged it recently (or it was just elected);
    /// anyone else while it hears from a leader other than `from`.
    fn sticky(&self, now: u64, from: NodeId) -> bool {
        let window = self.config.election_min_ms;
        match self.role {
            Role::Leader => {
                let acked = self
                    .state
                    .members
                    .keys()
                    .filter(|id| {
                        **id == self.me || self.ack_heard.get(*id).is_some_and(|t| now.saturating_sub(*t) < window)
                    })
                    .count();
                now.saturating_sub(self.leader_since) < window || acked >= self.state.majority()
            }
            _ => self.leader.is_some_and(|l| l != from) && self.leader_is_fresh(now),
        }
    }

    fn leader_is_fresh(&self, now: u64) -> bool {
        self.role == Role::Leader
            || (self.leader.is_some()
                && self.leader_heard.is_some_and(|t| now.saturating_sub(t) < self.config.election_min_ms))
    }

    fn reset_election(&mut self, now: u64) {
        let me = self.state.members.get(&self.me).map(|m| m.priority());
        let rank = me.map_or(0, |p| self.state.members.values().filter(|m| m.priority() > p).count() as u64);
        self.election_deadline = now
            + self.config.election_min_ms
            + self.rng.below(self.config.election_spread_ms)
            + rank * self.config.rank_step_ms;
    }

    fn removed(&mut self) {
        self.step_down();
        self.role = Role::Removed;
        self.leader = None;
        self.out.push(Action::Event(Event::Removed));
    }

    /// Our own vote counts only if we are in our own configuration: a node removed by
    /// a change it has not seen commit may still campaign (it may be the one holding
    /// that change, Raft §4.2.2), but only the members' votes make its majority.
    fn own_vote(&self) -> BTreeSet<NodeId> {
        if self.state.is_member(&self.me) {
            BTreeSet::from([self.me])
        } else {
            BTreeSet::new()
        }
    }

    fn others(&self) -> Vec<NodeId> {
        self.state.members.keys().filter(|id| **id != self.me).copied().collect()
    }

    fn send(&mut self, to: NodeId, msg: Msg) {
        self.out.push(Action::Send { to, msg });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Change, Member};
    use shoal_types::{ClusterId, Role as NodeRole};

    fn member(k: u8) -> Member {
        Member { id: NodeId([k; 32]), name: format!("n{k}"), role: NodeRole::Pc, memory_bytes: 1 << 30 }
    }

    #[test]
    fn a_single_node_elects_itself_and_commits_alone() {
        let state = ClusterState::create(ClusterId([1; 16]), member(1));
        let mut core = Core::new(Config::default(), NodeId([1; 32]), HardState::default(), state, 0, 7);
        let actions = core.tick(5000);
        assert_eq!(core.role(), &Role::Leader);
        assert_eq!(core.term(), 1);
        // The vote is persisted before leadership is announced.
        let persist = actions.iter().position(|a| matches!(a, Action::PersistHard(h) if h.term == 1)).unwrap();
        let leader = actions.iter().position(|a| matches!(a, Action::Event(Event::Leader { .. }))).unwrap();
        assert!(persist < leader);
        let actions =
            core.propose(5001, 9, Proposal::of(&NodeId([1; 32]), Change::Put { key: "k".into(), value: 1.into() }));
        assert!(actions.iter().any(|a| matches!(a, Action::Reply { req: 9, result: Ok(_) })));
        assert_eq!(core.state().entries["k"], 1);
    }

    /// Node 1 leading node 2 (two members), from time 10 s.
    fn leader_of_two() -> Core {
        let mut state = ClusterState::create(ClusterId([1; 16]), member(1));
        state.apply(&Change::AddMember(member(2))).unwrap();
        let mut core = Core::new(Config::default(), NodeId([1; 32]), HardState::default(), state, 0, 7);
        core.tick(10_000);
        core.receive(10_001, NodeId([2; 32]), Msg::PreVoteReply { term: 1, granted: true, current: 0 });
        core.receive(10_002, NodeId([2; 32]), Msg::VoteReply { term: 1, granted: true });
        assert_eq!(core.role(), &Role::Leader);
        core
    }

    /// Security review F1: the leader applied any change any member forwarded.
    #[test]
    fn a_member_writes_only_its_own_entries_placements_are_the_leaders_and_owner_actions_are_recorded() {
        let mut core = leader_of_two();
        let (one, two) = (NodeId([1; 32]), NodeId([2; 32]));
        let put = |key: &str| Change::Put { key: key.to_string(), value: 1.into() };
        let owner = |change: Change| Proposal::Owner { action: "x".into(), change };
        let forward = |core: &mut Core, req: u64, proposal: Proposal| {
            let actions = core.receive(10_100, two, Msg::Forward { req, proposal });
            actions
                .into_iter()
                .find_map(|a| match a {
                    Action::Send { to, msg: Msg::Forwarded { req: r, result } } if to == two && r == req => {
                        Some(result)
                    }
                    _ => None,
                })
                .expect("an answer to the member")
        };
        let (their_offer, my_offer) = (format!("offer/{one}"), format!("offer/{two}"));
        let refused = [
            // Another member's entries, as the member's own traffic or as an owner's action.
            Proposal::Own(put(&their_offer)),
            owner(put(&their_offer)),
            Proposal::Own(put(&format!("speed/{one}/m"))),
            // A placement from a member, however it is labelled.
            Proposal::Lead(put("placement/m")),
            owner(put("placement/m")),
            Proposal::Own(put("placement/m")),
            owner(Change::Delete { key: "placement/m".into() }),
            // Shared entries and membership as a member's automatic traffic.
            Proposal::Own(put("admin/auth")),
            Proposal::Own(Change::AddMember(member(9))),
            // Its own entries labelled as an owner's action are still its own lane.
            owner(put(&my_offer)),
        ];
        for (req, p) in refused.into_iter().enumerate() {
            let what = format!("{p:?}");
            let answer = forward(&mut core, req as u64, p);
            assert!(matches!(answer, Err(ProposeError::Invalid(ChangeError::NotAllowed(_)))), "{what}: {answer:?}");
        }
        assert!(core.state().entries.is_empty() && core.state().audit.is_empty());
        assert!(!core.state().is_member(&NodeId([9; 32])));
        // Its own offer: taken.
        let _ = forward_taken(&mut core, 20, Proposal::Own(put(&my_offer)));
        assert_eq!(core.state().entries[&my_offer], 1);
        // An owner's action through the member: taken, and recorded with the member.
        let _ = forward_taken(
            &mut core,
            21,
            Proposal::Owner { action: "set the admin password".into(), change: put("admin/auth") },
        );
        assert_eq!(core.state().entries["admin/auth"], 1);
        let audit: Vec<_> = core.state().audit.iter().map(|a| (a.from, a.action.clone(), a.version)).collect();
        assert_eq!(audit, [(two, "set the admin password".to_string(), core.state().version)]);
        // An owner may forget another node's entries (a model's speeds), not write them.
        let _ = forward_taken(&mut core, 22, owner(Change::Delete { key: format!("speed/{one}/m") }));
        // The leader's own placement: taken.
        let actions = core.propose(10_300, 99, Proposal::Lead(put("placement/m")));
        assert!(!actions.iter().any(|a| matches!(a, Action::Reply { result: Err(_), .. })));
        assert_eq!(core.state().entries["placement/m"], 1);
        assert_eq!(core.state().audit.len(), 2);
    }

    /// Deliver a forwarded proposal that must be taken (stored by the leader, sent to the
    /// others): no refusal comes back.
    fn forward_taken(core: &mut Core, req: u64, proposal: Proposal) -> Vec<Action> {
        let actions = core.receive(10_200, NodeId([2; 32]), Msg::Forward { req, proposal });
        assert!(
            !actions.iter().any(|a| matches!(a, Action::Send { msg: Msg::Forwarded { result: Err(_), .. }, .. })),
            "refused: {actions:?}"
        );
        actions
    }

    #[test]
    fn a_follower_does_not_forward_placements() {
        let mut core = follower_of_2(100);
        let actions = core.propose(150, 5, Proposal::Lead(Change::Put { key: "placement/m".into(), value: 1.into() }));
        assert!(matches!(&actions[..], [Action::Reply { req: 5, result: Err(ProposeError::NoLeader) }]), "{actions:?}");
    }

    #[test]
    fn messages_from_strangers_are_ignored() {
        let state = ClusterState::create(ClusterId([1; 16]), member(1));
        let mut core = Core::new(Config::default(), NodeId([1; 32]), HardState::default(), state, 0, 7);
        let actions = core.receive(10, NodeId([9; 32]), Msg::Vote { term: 99, last: Version::default() });
        assert!(actions.is_empty());
        assert_eq!(core.term(), 0);
    }

    /// Three members; node 1 follows node 2, the leader of term 1, heard at `now`.
    fn follower_of_2(now: u64) -> Core {
        let mut state = ClusterState::create(ClusterId([1; 16]), member(1));
        for k in [2, 3] {
            state.apply(&Change::AddMember(member(k))).unwrap();
        }
        let mut core = Core::new(Config::default(), NodeId([1; 32]), HardState::default(), state, 0, 7);
        core.receive(now, NodeId([2; 32]), Msg::Beat { term: 1, leader: true, version: Version::default() });
        assert_eq!((core.leader(), core.term()), (Some(NodeId([2; 32])), 1));
        core
    }

    #[test]
    fn a_second_leader_of_the_same_term_is_ignored() {
        let mut core = follower_of_2(100);
        let mut forged = core.state().clone();
        forged.apply(&Change::AddMember(member(9))).unwrap();
        forged.version = Version { term: 1, index: 50 };
        core.receive(150, NodeId([3; 32]), Msg::State { term: 1, state: Box::new(forged) });
        assert_eq!(core.leader(), Some(NodeId([2; 32])));
        assert!(!core.state().is_member(&NodeId([9; 32])));
    }

    #[test]
    fn a_newer_term_claimed_while_the_leader_is_fresh_is_ignored_until_it_goes_quiet() {
        let mut core = follower_of_2(100);
        let mut forged = core.state().clone();
        forged.apply(&Change::AddMember(member(9))).unwrap();
        forged.version = Version { term: 2, index: 50 };
        core.receive(150, NodeId([3; 32]), Msg::State { term: 2, state: Box::new(forged.clone()) });
        assert_eq!((core.leader(), core.term()), (Some(NodeId([2; 32])), 1));
        assert!(!core.state().is_member(&NodeId([9; 32])));
        // Forged vote replies (to a vote it never asked for) cannot push the term up either.
        core.receive(160, NodeId([3; 32]), Msg::PreVoteReply { term: 2, granted: false, current: 7 });
        core.receive(160, NodeId([3; 32]), Msg::VoteReply { term: 7, granted: false });
        assert_eq!(core.term(), 1);
        // A catch-up snapshot from a node that did not lead its term is ignored.
        core.receive(170, NodeId([3; 32]), Msg::CatchUp { state: Box::new(forged.clone()) });
        assert!(!core.state().is_member(&NodeId([9; 32])));
        // Once the leader has been quiet past the election timeout, node 3 may really
        // have won term 2: it is followed.
        let later = 100 + Config::default().election_min_ms + 1;
        core.receive(later, NodeId([3; 32]), Msg::State { term: 2, state: Box::new(forged) });
        assert_eq!((core.leader(), core.term()), (Some(NodeId([3; 32])), 2));
    }

    #[test]
    fn terms_and_versions_near_the_end_of_the_counter_are_ignored() {
        let mut core = follower_of_2(100);
        let later = 100 + Config::default().election_min_ms + 1;
        for term in [u64::MAX, u64::MAX - 1, 1 + MAX_TERM_STEP + 1] {
            core.receive(later, NodeId([3; 32]), Msg::Beat { term, leader: true, version: Version::default() });
            core.receive(later, NodeId([3; 32]), Msg::Vote { term, last: Version::default() });
            assert_eq!(core.term(), 1, "term {term} was taken");
        }
        let mut state = core.state().clone();
        state.version = Version { term: 1, index: u64::MAX };
        core.receive(later, NodeId([2; 32]), Msg::State { term: 1, state: Box::new(state) });
        assert_ne!(core.state().version.index, u64::MAX);
        // A campaign from the largest term this node holds does not overflow.
        let mut core = follower_of_2(100);
        core.hard.term = u64::MAX;
        core.tick(later + 10_000);
        assert_eq!(core.term(), u64::MAX);
        assert_eq!(core.role(), &Role::Follower);
    }
}
