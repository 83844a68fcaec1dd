//! Shoal's cluster membership: which nodes are approved members, which of them is
//! alive, and which one leads. `state` is the replicated cluster state; `core` the
//! election and replication protocol as a pure state machine (messages and clock values
//! in, actions out), tested by simulation in `tests/sim.rs`; `pairing` the pairing codes
//! and their password-authenticated exchange; `wire` what crosses the network; `node` the
//! async shell that runs it all on QUIC endpoints, mDNS discovery and the store.

pub mod core;
pub mod node;
pub mod pairing;
pub mod state;
pub mod token;
pub mod wire;

pub use crate::core::{Action, Config, Core, Event, HardState, Liveness, Msg, ProposeError, Role};
pub use crate::state::{Audit, Change, ChangeError, ClusterState, Lane, Member, Proposal, Version};
