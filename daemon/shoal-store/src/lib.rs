//! Shoal's durable node state: the `Store` trait, its spaces, and two implementations.
//!
//! Everything a node must still know after a crash, a power cut or a `SIGKILL` goes
//! through the [`Store`] trait: a handful of small key-value *spaces*, keys are UTF-8
//! strings, values are bytes (JSON through [`StoreExt`]). Every write is on disk
//! (flushed) before the call returns, so what a node acknowledged, it still has.
//! The trait is deliberately small so that the backend ([`SledStore`], over sled 0.34)
//! can be swapped (redb, SQLite) by changing this crate only; [`MemStore`] is the
//! in-memory implementation for tests.
//!
//! # What is kept, in which space
//! | [`Space`] | sled tree | contents |
//! |---|---|---|
//! | [`Space::Node`] | `node` | this node's own facts: the store's format ([`FORMAT_KEY`]), join tokens made here |
//! | [`Space::Members`] | `members` | approved member records, one key per member |
//! | [`Space::Election`] | `election` | the current term and this node's vote in it; written (and flushed) *before* any vote is sent, so a node never votes twice in a term |
//! | [`Space::Cluster`] | `cluster` | the replicated cluster state snapshot |
//! | [`Space::Settings`] | `settings` | the user's settings |
//! | [`Space::Profiles`] | `profiles` | the planner's measurements (device and link profiles) |
//!
//! Writes to several spaces that must stay consistent go through [`Store::apply`],
//! which is atomic across spaces.
//!
//! # Where
//! Everything lives in the node's data directory:
//! ```text
//! <data dir>/
//!   node.key        the node's Ed25519 key, mode 0600 (shoal-net `identity`); NOT in the store
//!   state.sled/     the store (SledStore::open(<data dir>)): sled's own files
//!     conf  db  blobs/  snap.*   (sled's own layout; one process at a time: sled locks `db`)
//! ```
//! The node key stays a plain file beside the store: it is the node's identity, read
//! before anything else, and must never be replicated or exported with the state.

mod error;
mod mem;
mod sled_store;

#[cfg(test)]
mod tests;

pub use error::StoreError;
pub use mem::MemStore;
pub use sled_store::{SledStore, FORMAT, FORMAT_KEY, STORE_DIR};

use serde::{de::DeserializeOwned, Serialize};
use std::fmt;

/// Which part of the node's state a key belongs to; one sled tree each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// This node's own facts: the cluster id it belongs to, its role.
    Node,
    /// Approved member records.
    Members,
    /// The current term and this node's vote (written before any vote is sent).
    Election,
    /// The replicated cluster state snapshot.
    Cluster,
    /// The user's settings.
    Settings,
    /// The planner's measurements.
    Profiles,
}

impl Space {
    /// Every space, in a fixed order.
    pub const ALL: [Space; 6] =
        [Space::Node, Space::Members, Space::Election, Space::Cluster, Space::Settings, Space::Profiles];

    /// The space's name: the name of its sled tree, also used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Space::Node => "node",
            Space::Members => "members",
            Space::Election => "election",
            Space::Cluster => "cluster",
            Space::Settings => "settings",
            Space::Profiles => "profiles",
        }
    }

    /// The space's position in [`Space::ALL`].
    pub(crate) fn index(self) -> usize {
        match self {
            Space::Node => 0,
            Space::Members => 1,
            Space::Election => 2,
            Space::Cluster => 3,
            Space::Settings => 4,
            Space::Profiles => 5,
        }
    }
}

impl fmt::Display for Space {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One write of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    /// Set `key` in `space` to `value`.
    Put {
        /// The space written.
        space: Space,
        /// The key set.
        key: String,
        /// The new value.
        value: Vec<u8>,
    },
    /// Remove `key` from `space` (nothing happens if it is absent).
    Remove {
        /// The space written.
        space: Space,
        /// The key removed.
        key: String,
    },
}

impl Write {
    /// A `Put` of `value` encoded as JSON (as [`StoreExt::put_json`] would write it).
    pub fn put_json<T: Serialize + ?Sized>(space: Space, key: &str, value: &T) -> Result<Write, StoreError> {
        let value =
            serde_json::to_vec(value).map_err(|source| StoreError::Encode { space, key: key.to_owned(), source })?;
        Ok(Write::Put { space, key: key.to_owned(), value })
    }
}

/// The node's durable state. Every method that writes returns only after the write is
/// on disk (flushed): what it acknowledged survives power loss and SIGKILL.
pub trait Store: Send + Sync + 'static {
    /// The value of `key` in `space`, if any.
    fn get(&self, space: Space, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Set `key` in `space` to `value`, then flush.
    fn put(&self, space: Space, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Remove `key` from `space` (no error if absent), then flush.
    fn remove(&self, space: Space, key: &str) -> Result<(), StoreError>;
    /// Every (key, value) of a space, in key order.
    fn list(&self, space: Space) -> Result<Vec<(String, Vec<u8>)>, StoreError>;
    /// Several writes, atomically (all or none, also across spaces), then flushed.
    /// Writes apply in order: a later write to the same key wins.
    fn apply(&self, batch: Vec<Write>) -> Result<(), StoreError>;
}

/// Typed helpers over any [`Store`], JSON-encoded with serde_json.
pub trait StoreExt: Store {
    /// The value of `key` decoded from JSON; a value that does not decode is
    /// [`StoreError::Corrupt`].
    fn get_json<T: DeserializeOwned>(&self, space: Space, key: &str) -> Result<Option<T>, StoreError> {
        match self.get(space, key)? {
            None => Ok(None),
            Some(bytes) => decode(space, key, &bytes).map(Some),
        }
    }

    /// Write `value` as JSON under `key`, then flush.
    fn put_json<T: Serialize + ?Sized>(&self, space: Space, key: &str, value: &T) -> Result<(), StoreError> {
        let bytes =
            serde_json::to_vec(value).map_err(|source| StoreError::Encode { space, key: key.to_owned(), source })?;
        self.put(space, key, &bytes)
    }

    /// Every (key, value) of a space decoded from JSON, in key order; the first value
    /// that does not decode is [`StoreError::Corrupt`].
    fn list_json<T: DeserializeOwned>(&self, space: Space) -> Result<Vec<(String, T)>, StoreError> {
        self.list(space)?
            .into_iter()
            .map(|(key, bytes)| {
                let value = decode(space, &key, &bytes)?;
                Ok((key, value))
            })
            .collect()
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

fn decode<T: DeserializeOwned>(space: Space, key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        space,
        key: key.to_owned(),
        why: format!("the value is not the JSON expected: {e}"),
    })
}
