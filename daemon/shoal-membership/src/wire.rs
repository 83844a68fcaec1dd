//! What crosses the network for membership, joining and administration: JSON
//! messages, each prefixed with its length (u32, big endian) and bounded, on QUIC
//! streams. Anything malformed is an error value for the caller to log, never a panic.

use crate::core::Liveness;
use crate::state::ClusterState;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use shoal_types::{ClusterId, NodeId, Role};

/// Room around a cluster state in a message (the message's own fields).
pub const ENVELOPE: usize = 64 << 10;
/// The largest message accepted: a cluster state of the largest size a change may
/// produce ([`crate::state::MAX_STATE_BYTES`]) with its envelope. The join endpoint uses
/// the same bound, since a welcome carries the whole state.
pub const MAX_MESSAGE: usize = crate::state::MAX_STATE_BYTES + ENVELOPE;

/// Why a message could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The stream failed or ended early.
    #[error("stream: {0}")]
    Stream(String),
    /// A length over [`MAX_MESSAGE`].
    #[error("message of {0} bytes is over the limit")]
    TooLarge(usize),
    /// Not the JSON expected.
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Write one message.
pub async fn write_msg<T: Serialize>(send: &mut quinn::SendStream, msg: &T) -> Result<(), WireError> {
    let body = serde_json::to_vec(msg).map_err(|e| WireError::Malformed(e.to_string()))?;
    if body.len() > MAX_MESSAGE {
        return Err(WireError::TooLarge(body.len()));
    }
    let len = (body.len() as u32).to_be_bytes();
    send.write_all(&len).await.map_err(|e| WireError::Stream(e.to_string()))?;
    send.write_all(&body).await.map_err(|e| WireError::Stream(e.to_string()))
}

/// Read one message; `Ok(None)` at a clean end of stream.
pub async fn read_msg<T: DeserializeOwned>(recv: &mut quinn::RecvStream) -> Result<Option<T>, WireError> {
    read_msg_max(recv, MAX_MESSAGE).await
}

/// Read one message of at most `max` bytes; `Ok(None)` at a clean end of stream.
pub async fn read_msg_max<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    max: usize,
) -> Result<Option<T>, WireError> {
    let mut len = [0u8; 4];
    match recv.read_exact(&mut len).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(WireError::Stream(e.to_string())),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(WireError::TooLarge(len));
    }
    // Memory grows with the bytes that actually arrive, not with the length a peer
    // announced: a stranger who sends only a large length costs nothing.
    let mut body = Vec::with_capacity(len.min(64 << 10));
    while body.len() < len {
        match recv.read_chunk(len - body.len(), true).await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk.bytes),
            Ok(None) => {
                return Err(WireError::Stream(format!(
                    "the stream ended {} bytes into a {len}-byte message",
                    body.len()
                )))
            }
            Err(e) => return Err(WireError::Stream(e.to_string())),
        }
    }
    decode(&body).map(Some)
}

/// Decode a message body.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    serde_json::from_slice(body).map_err(|e| WireError::Malformed(e.to_string()))
}

/// What a node tells anyone who asks on its join endpoint: public facts only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicInfo {
    /// Its key.
    pub node: NodeId,
    /// Its cluster, if it has one.
    pub cluster: Option<ClusterId>,
    /// Host name.
    pub name: String,
    /// Hub or PC.
    pub role: Role,
    /// RAM + VRAM it offers, bytes.
    pub memory_bytes: u64,
    /// Whether its owner armed it to take an approval now (`shoal join --accept`); else
    /// it joins only with a pairing code or a join token.
    #[serde(default)]
    pub accepts_approval: bool,
}

/// A name from the network made safe to store and print: control characters become
/// spaces, at most 64 bytes (cut on a character boundary), never empty.
pub fn clean_name(name: &str) -> String {
    let mut out: String = name.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if out.len() > 64 {
        let mut cut = 64;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    let out = out.trim().to_string();
    if out.is_empty() {
        "unnamed".into()
    } else {
        out
    }
}

/// Requests on the join endpoint (a bidirectional stream; a pairing takes two rounds).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinRequest {
    /// Who are you?
    Hello,
    /// A pairing exchange begins (the joiner's first SPAKE2 message and its facts).
    PairStart {
        /// The joiner's first message.
        msg: Vec<u8>,
        /// The joiner's facts, for its member record.
        info: PublicInfo,
        /// The join token whose secret the joiner uses (its public id); none: the
        /// member's current pairing code.
        #[serde(default)]
        token: Option<String>,
    },
    /// The joiner's key confirmation.
    PairConfirm {
        /// Its MAC.
        msg: Vec<u8>,
    },
    /// A member tells a removed node that it was removed (its key is no longer
    /// accepted on the main endpoint, so the news comes here).
    Revoked {
        /// The cluster state without the receiver.
        state: Box<ClusterState>,
    },
    /// A member tells an unpaired node that it was approved.
    Welcome {
        /// The cluster state, holding the receiver as a member.
        state: Box<ClusterState>,
    },
    /// Is the asker (the key it proved in the handshake) a member of this node's
    /// cluster? A node told it was removed asks the members before it believes it.
    AmIMember,
}

/// Answers on the join endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinResponse {
    /// Public facts.
    Info(PublicInfo),
    /// The member's SPAKE2 message and confirmation.
    PairReply {
        /// The message.
        msg: Vec<u8>,
    },
    /// Paired and approved: the cluster state to start from.
    Joined {
        /// The state, holding the joiner as a member.
        state: Box<ClusterState>,
    },
    /// The welcome was taken.
    Accepted,
    /// This node has no pairing code active (the joiner tries another member).
    NoOffer,
    /// The answer to [`JoinRequest::AmIMember`], from this node's state.
    Membership {
        /// This node's cluster.
        cluster: ClusterId,
        /// Its state's version.
        version: crate::state::Version,
        /// Whether the asker is a member in it.
        member: bool,
    },
    /// Refused, and why.
    Error(String),
}

/// Requests on the admin protocol: from the owner's CLI (the node's own key), every
/// one; from another member, only those [`AdminRequest::member_may`] allows.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminRequest {
    /// This node's view of the cluster.
    Status,
    /// Approve a pending node (a unique prefix of its id will do).
    Approve {
        /// Id or id prefix.
        node: String,
    },
    /// Remove a member and revoke its key (a unique prefix of its id will do).
    Remove {
        /// Id or id prefix.
        node: String,
    },
    /// Make a pairing code for a new node to join with.
    Pair,
    /// Join a cluster with a code shown by one of its members, or a join token.
    Join {
        /// The code or token.
        code: String,
    },
    /// Take an approval from the member whose node id starts with `member` (for 10
    /// minutes): the owner of an unpaired node agrees to be approved by that member.
    Accept {
        /// Node id or prefix (at least `node::ACCEPT_ID_DIGITS` hex digits).
        member: String,
    },
    /// Make a join token (a one-time secret for a node installed unattended).
    Token {
        /// Validity, seconds.
        valid_s: u64,
    },
    /// Leave the cluster cleanly: this node's removal is committed by the others,
    /// which revoke its key, and it becomes unpaired.
    Leave,
    /// Forget the cluster here, at once, without asking anyone (for a node whose
    /// cluster is gone or unreachable); the members still list it until removed.
    Reset,
    /// Set a named entry of the cluster state (e.g. a device profile), replicated to
    /// every member once a majority stored it.
    Put {
        /// Entry name.
        key: String,
        /// Its value.
        value: serde_json::Value,
    },
    /// Delete a named entry of the cluster state (absent: nothing to do).
    Delete {
        /// Entry name.
        key: String,
    },
    /// The entries of the cluster state whose names start with `prefix`.
    Entries {
        /// Name prefix ("" for all).
        prefix: String,
    },
    /// Measure the links from this node to every live member (frame time to an idle
    /// receiver, bandwidth) and keep them in the cluster state as `links/<node id>`.
    ProbeLinks {
        /// Frame size to time (a decode step's hidden state of the model planned).
        frame_bytes: u32,
    },
    /// Measure this node's speed on a model (a quick calibration) and keep it in the
    /// cluster state. Needs a node started with a calibrator (the `shoal` binary).
    Calibrate {
        /// The GGUF file, as a path on this node.
        model: String,
        /// Decode steps timed.
        tokens: u32,
        /// CPU threads; 0: as many as the node's stages use.
        threads: u32,
    },
}

impl AdminRequest {
    /// Whether another member (not the owner) may ask this: reading, and measuring for
    /// a plan. Changing membership or pairing stays with each node's owner.
    pub fn member_may(&self) -> bool {
        matches!(
            self,
            AdminRequest::Status
                | AdminRequest::Entries { .. }
                | AdminRequest::ProbeLinks { .. }
                | AdminRequest::Calibrate { .. }
        )
    }

    /// How long an asker should wait for the answer.
    pub fn patience(&self) -> std::time::Duration {
        match self {
            // Loading a big model to time it takes a while.
            AdminRequest::Calibrate { .. } => std::time::Duration::from_secs(900),
            _ => std::time::Duration::from_secs(60),
        }
    }
}

/// Answers to the admin protocol.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminResponse {
    /// The status.
    Status(Box<ClusterStatus>),
    /// Done.
    Ok(String),
    /// A pairing code and until when (ms from now) it is valid.
    Code {
        /// The code, "dddd-dddd".
        code: String,
        /// Validity, seconds.
        valid_s: u64,
    },
    /// Entries of the cluster state.
    Entries(std::collections::BTreeMap<String, serde_json::Value>),
    /// Refused, and why.
    Error(String),
}

/// A node's view of its cluster, for `shoal status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// This node.
    pub node: NodeId,
    /// Its name.
    pub name: String,
    /// Its main endpoint.
    pub addr: String,
    /// Its join endpoint (advertised over mDNS).
    pub join_addr: String,
    /// Its cluster, or none while unpaired.
    pub cluster: Option<ClusterId>,
    /// The current term.
    pub term: u64,
    /// The leader known here.
    pub leader: Option<NodeId>,
    /// This node's election role ("leader", "follower", "candidate", "unpaired", …).
    pub role: String,
    /// The cluster state version held here.
    pub version: String,
    /// Approved members.
    pub members: Vec<MemberStatus>,
    /// Nodes seen on the LAN, verified, waiting for approval.
    pub pending: Vec<PendingStatus>,
    /// Seconds left on an active pairing code.
    pub pairing_s: Option<u64>,
    /// Join tokens made here and still usable.
    #[serde(default)]
    pub tokens: usize,
    /// Unpaired: the clusters whose members advertise on the LAN, with how many.
    #[serde(default)]
    pub lan_clusters: Vec<(ClusterId, usize)>,
    /// Unpaired: the member (node id or prefix) whose approval this node's owner agreed
    /// to take.
    #[serde(default)]
    pub accepting: Option<String>,
    /// Unpaired with a join token: how joining with it goes.
    #[serde(default)]
    pub join_token: Option<String>,
    /// Membership messages this node sent, and their bytes (beats, votes, states).
    pub sent_msgs: u64,
    /// See `sent_msgs`.
    pub sent_bytes: u64,
    /// Seconds since this node started (to turn the counters into rates).
    pub uptime_s: f64,
}

/// One member in [`ClusterStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberStatus {
    /// Its key.
    pub node: NodeId,
    /// Its name.
    pub name: String,
    /// Hub or PC.
    pub role: Role,
    /// Alive, suspected or down, as seen here.
    pub state: Liveness,
    /// Whether it leads.
    pub leader: bool,
    /// Available RAM it advertises (mDNS), bytes.
    pub ram_available: Option<u64>,
    /// Free VRAM it advertises, bytes.
    pub vram_free: Option<u64>,
    /// Where it was last reached.
    pub addr: Option<String>,
}

/// One pending node in [`ClusterStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingStatus {
    /// Its key.
    pub node: NodeId,
    /// Its name.
    pub name: String,
    /// Hub or PC.
    pub role: Role,
    /// Memory it offers, bytes.
    pub memory_bytes: u64,
    /// Where it answered.
    pub addr: String,
}
