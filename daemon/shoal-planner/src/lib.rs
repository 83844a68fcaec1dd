//! The placement planner. Given a model's sizes, the devices of a cluster with their
//! measured (or estimated) speeds, the links between hosts and the options, it picks
//! the placement with the best predicted decode speed that fits every device's
//! memory, predicts its tokens/s and time to first token, and explains the choice.
//!
//! Everything here is a pure function of its inputs: no I/O, no clock, no
//! randomness. Profiles come from the store or a TOML file ([`profile`]); the binary
//! reads them and hands the values in.

mod exhaustive;
pub mod model;
pub mod plan;
pub mod profile;
mod search;

pub use model::{ModelProfile, Sizing};
pub use plan::{plan, predict, Options, Pin, Plan, PlanError, PlannedStage};
pub use profile::{Cluster, Device, Link, ModelSpec, Profile, ProfileError};
