//! Shard transfer: a stage node gets the shard of its layers from a member that holds
//! it (or holds the source model and cuts the shard on request), so only its layers
//! cross the network, never the whole model.
//!
//! - [`Server`] answers fetches on [`shoal_net::alpn::SHARD`] (the pinned endpoint:
//!   members only) from its [`ShardCache`](shoal_gguf::ShardCache) or by building the
//!   shard from a full model that [`Sources`] names.
//! - [`fetch`] / [`fetch_from_any`] receive one into the local cache, checking every
//!   chunk against the manifest's hashes as it arrives and resuming after a cut at the
//!   first chunk not already on disk; [`obtain`] is what a stage node calls: cache,
//!   else local build, else fetch.
//! - [`wire`] is the protocol.
//!
//! A shard is named by `(source content hash, layer range, SHARD_FORMAT)`: paths on
//! two machines mean nothing to each other, the model's bytes do.

mod client;
mod locks;
mod server;
pub mod wire;

pub use client::{
    fetch, fetch_from_any, obtain, part_path, FetchError, Obtained, Origin, Progress, TransferStats, SYNC_EVERY,
};
pub use server::{Server, ServerOptions, ServerStats};
pub use shoal_gguf::SourceHash;
pub use wire::Refusal;

use shoal_net::NodeId;
use shoal_types::LayerRange;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Where the full models this node holds are: the catalog implements it. A server
/// builds a shard it lacks from the file named here; [`obtain`] builds locally rather
/// than fetch when the model is here.
pub trait Sources: Send + Sync {
    /// The local path of the full GGUF whose content hash (BLAKE3 of the file) is
    /// `source`, if this node holds it. The implementer vouches for the hash: shards
    /// built from the file carry it in their manifests.
    fn model_path(&self, source: &SourceHash) -> Option<PathBuf>;

    /// Whether this node cuts shard `layers` of `source` for a member that asks (it
    /// serves a shard it already has either way). Each cut shard stays on disk, so a
    /// member asking for every range `a..b` of a large model could fill it (security
    /// review F11): a node says yes only to the ranges the cluster runs. Every range by
    /// default (tests, tools).
    fn cuts(&self, source: &SourceHash, layers: LayerRange) -> bool {
        let _ = (source, layers);
        true
    }
}

/// A fixed map (tests, tools).
impl Sources for HashMap<SourceHash, PathBuf> {
    fn model_path(&self, source: &SourceHash) -> Option<PathBuf> {
        self.get(source).cloned()
    }
}

/// A member that may hold a shard: its key and where to reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Its node id (the key the handshake checks).
    pub peer: NodeId,
    /// Its main endpoint.
    pub addr: SocketAddr,
}
