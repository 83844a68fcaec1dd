//! The model catalog's entries as plain data: what a model is (content hash, size,
//! architecture, layers, quantisation) and which nodes hold a copy where. No I/O: the
//! replicated cluster state holds these, and `shoal-catalog` fills them from files.

use crate::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Longest catalog name accepted, in bytes. Names are typed by people and shown in
/// lists; the cluster state (2 MiB in all) must hold many entries.
pub const MAX_CATALOG_NAME: usize = 200;
/// Longest holder path accepted, in bytes (Linux's `PATH_MAX`).
pub const MAX_HOLDER_PATH: usize = 4096;
/// Most holders one entry may list: more nodes than a household or office has, and a
/// bound on the entry's size (each holder takes ~200 bytes of JSON).
pub const MAX_HOLDERS: usize = 64;

/// One model in the catalog. The same bytes (by `content_hash`) are one entry however
/// many nodes hold them and wherever they keep them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogEntry {
    /// The name people and clients use, e.g. `ollama:llama3.2:3b` or
    /// `bartowski/Llama-3.2-3B-Instruct-GGUF/Llama-3.2-3B-Instruct-Q4_K_M.gguf`.
    pub name: String,
    /// BLAKE3 of the whole file, 64 lowercase hex digits.
    pub content_hash: String,
    /// Size of the whole file in bytes.
    pub size: u64,
    /// GGUF architecture (`general.architecture`), e.g. `llama`.
    pub arch: String,
    /// Transformer blocks.
    pub n_layer: u32,
    /// Context the model was trained for.
    pub context_length: u32,
    /// Quantisation, e.g. `Q4_1` or `Q4_K_M` (from `general.file_type`, else the
    /// tensor type holding most of the bytes).
    pub quantisation: String,
    /// Stage boundaries must be multiples of this (see `Arch::layer_period`).
    pub layer_period: u32,
    /// The nodes holding a copy, and where.
    pub holders: BTreeMap<NodeId, Holder>,
    /// BLAKE3 of the file's header (its bytes before the tensor data: metadata,
    /// vocabulary, chat template), 64 lowercase hex digits, as the node that added it
    /// read them: a node without a copy that fetches the header from a member checks it
    /// against this (security review F8). `None` in entries added before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_hash: Option<String>,
}

/// Where one node keeps its copy of a model, and what the file looked like when its
/// hash was last checked (so an unchanged file needs no re-hash before it is used).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The file's path on that node (UTF-8; the model is used in place, never copied).
    pub path: String,
    /// Its size in bytes when last hashed.
    pub size: u64,
    /// Its modification time when last hashed, in nanoseconds since the Unix epoch
    /// (0 for a time before it).
    pub mtime_ns: u64,
}

/// Why an entry is not one the catalog accepts (checked before it enters the state,
/// which every member must be able to hold).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// Empty, too long, or with control characters or a leading/trailing space.
    #[error(
        "catalog name {0:?} must be 1..={MAX_CATALOG_NAME} bytes without control characters or surrounding spaces"
    )]
    BadName(String),
    /// Not 64 lowercase hex digits.
    #[error("content hash {0:?} is not 64 lowercase hex digits")]
    BadHash(String),
    /// A holder path empty or longer than [`MAX_HOLDER_PATH`].
    #[error("holder path of {len} bytes (1..={MAX_HOLDER_PATH} allowed)")]
    BadPath {
        /// Its length in bytes.
        len: usize,
    },
    /// More holders than [`MAX_HOLDERS`].
    #[error("{0} holders (at most {MAX_HOLDERS})")]
    TooManyHolders(usize),
}

impl CatalogEntry {
    /// Prefix of the cluster-state keys of catalog entries.
    pub const KEY_PREFIX: &'static str = "catalog/";

    /// The entry's key in the cluster state: `catalog/<content hash>`. Keyed by
    /// content, not name, so two nodes adding the same file meet in one entry.
    pub fn key(&self) -> String {
        format!("{}{}", Self::KEY_PREFIX, self.content_hash)
    }

    /// Check the bounds that keep an entry small and printable.
    pub fn validate(&self) -> Result<(), EntryError> {
        validate_name(&self.name)?;
        let hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
        if self.content_hash.len() != 64 || !self.content_hash.chars().all(hex) {
            return Err(EntryError::BadHash(self.content_hash.chars().take(80).collect()));
        }
        if let Some(h) = self.header_hash.as_ref().filter(|h| h.len() != 64 || !h.chars().all(hex)) {
            return Err(EntryError::BadHash(h.chars().take(80).collect()));
        }
        if self.holders.len() > MAX_HOLDERS {
            return Err(EntryError::TooManyHolders(self.holders.len()));
        }
        for h in self.holders.values() {
            if h.path.is_empty() || h.path.len() > MAX_HOLDER_PATH {
                return Err(EntryError::BadPath { len: h.path.len() });
            }
        }
        Ok(())
    }
}

/// Check a catalog name: 1..=[`MAX_CATALOG_NAME`] bytes, no control characters, no
/// leading or trailing whitespace (names are shown in terminals and matched exactly).
pub fn validate_name(name: &str) -> Result<(), EntryError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_CATALOG_NAME
        && !name.chars().any(char::is_control)
        && name.trim() == name;
    if ok {
        Ok(())
    } else {
        Err(EntryError::BadName(name.chars().take(80).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> CatalogEntry {
        CatalogEntry {
            name: "ollama:llama3.2:3b".into(),
            content_hash: "ab".repeat(32),
            size: 2_000_000_000,
            arch: "llama".into(),
            n_layer: 28,
            context_length: 131072,
            quantisation: "Q4_K_M".into(),
            layer_period: 1,
            holders: BTreeMap::from([(
                NodeId([7; 32]),
                Holder { path: "/home/a/.ollama/models/blobs/sha256-00".into(), size: 2_000_000_000, mtime_ns: 1 },
            )]),
            header_hash: Some("b".repeat(64)),
        }
    }

    #[test]
    fn entry_round_trips_through_json_with_node_ids_as_hex_keys() {
        let e = entry();
        let json = serde_json::to_string(&e).unwrap();
        assert!(json.contains(&"07".repeat(32)), "{json}");
        assert_eq!(serde_json::from_str::<CatalogEntry>(&json).unwrap(), e);
        assert_eq!(e.key(), format!("catalog/{}", "ab".repeat(32)));
        // An entry of a version before header hashes reads as one without.
        let mut old: serde_json::Value = serde_json::from_str(&json).unwrap();
        old.as_object_mut().unwrap().remove("header_hash");
        let read: CatalogEntry = serde_json::from_value(old).unwrap();
        assert_eq!(read.header_hash, None);
    }

    #[test]
    fn an_entry_with_every_holder_stays_small() {
        // The cluster state is capped at 2 MiB: a full entry must stay a few KiB.
        let mut e = entry();
        for i in 0..MAX_HOLDERS {
            let h = Holder { path: "/x".repeat(60), size: u64::MAX, mtime_ns: u64::MAX };
            e.holders.insert(NodeId([i as u8; 32]), h);
        }
        e.validate().unwrap();
        assert!(serde_json::to_vec(&e).unwrap().len() < 24 << 10);
    }

    #[test]
    fn validate_refuses_bad_names_hashes_and_paths() {
        let mut e = entry();
        e.name = "a\nb".into();
        assert!(matches!(e.validate(), Err(EntryError::BadName(_))));
        e.name = " padded".into();
        assert!(matches!(e.validate(), Err(EntryError::BadName(_))));
        e.name = "x".repeat(MAX_CATALOG_NAME + 1);
        assert!(matches!(e.validate(), Err(EntryError::BadName(_))));
        let mut e = entry();
        e.content_hash = "AB".repeat(32);
        assert!(matches!(e.validate(), Err(EntryError::BadHash(_))));
        let mut e = entry();
        e.header_hash = Some("ab".into());
        assert!(matches!(e.validate(), Err(EntryError::BadHash(_))));
        e.header_hash = None;
        e.validate().unwrap();
        let mut e = entry();
        e.holders.values_mut().for_each(|h| h.path.clear());
        assert_eq!(e.validate(), Err(EntryError::BadPath { len: 0 }));
    }
}
