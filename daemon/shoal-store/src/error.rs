//! `StoreError`: everything a store operation can fail with, as values with clear messages.

use crate::Space;
use std::path::PathBuf;

/// A backend's own error, kept opaque so that the backend can change.
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong with the node's store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be opened (or created).
    #[error("cannot open the store at {}: {source}", path.display())]
    Open {
        /// The store's directory (`<data dir>/state.sled`).
        path: PathBuf,
        /// What the backend reported.
        #[source]
        source: BackendError,
    },
    /// Another process (or another handle in this one) has the store open.
    #[error(
        "the store at {} is in use by another shoal process (stop it, or give this one another data directory)",
        path.display()
    )]
    InUse {
        /// The store's directory (`<data dir>/state.sled`).
        path: PathBuf,
    },
    /// A file-system operation on the store's files failed.
    #[error("store I/O on {} failed: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The backend failed to read, write or flush.
    #[error("the store failed to {op}: {source}")]
    Backend {
        /// What was being done ("read members", "flush", ...).
        op: String,
        /// What the backend reported.
        #[source]
        source: BackendError,
    },
    /// A stored key or value is not what it must be (not UTF-8, not the JSON expected).
    #[error("corrupt entry {space}/{key} in the store: {why}")]
    Corrupt {
        /// The space of the entry.
        space: Space,
        /// The entry's key (lossily decoded if the key itself is the problem).
        key: String,
        /// What is wrong with it.
        why: String,
    },
    /// The store was written by a newer Shoal, in a format this one cannot read.
    #[error(
        "the store at {} was written by a newer Shoal (store format {found}; this one reads up to {supported}): \
         run that version or a newer one",
        path.display()
    )]
    TooNew {
        /// The store's directory (`<data dir>/state.sled`).
        path: PathBuf,
        /// The format the store records.
        found: u32,
        /// The newest format this build reads ([`crate::FORMAT`]).
        supported: u32,
    },
    /// A value could not be encoded as JSON.
    #[error("cannot encode the value for {space}/{key} as JSON: {source}")]
    Encode {
        /// The space written.
        space: Space,
        /// The key written.
        key: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
}
