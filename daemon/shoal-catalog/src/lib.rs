//! Shoal's model catalog, as a library: describe a GGUF file for the catalog
//! (validated, hashed whole with BLAKE3, its facts read), notice a file that changed
//! after it was added, find models already kept by Ollama, the Hugging Face cache and
//! LM Studio (used in place, never copied), and download models resumably.
//!
//! The entries themselves ([`CatalogEntry`], [`Holder`]) live in `shoal-types`, so the
//! replicated cluster state can hold them without depending on this crate's I/O.
//! Everything here blocks (file hashing, HTTP): async callers use a blocking thread.

pub mod describe;
pub mod download;
pub mod scan;

pub use describe::{
    check_unchanged, describe, describe_with_progress, hash_file, mtime_ns, CatalogError, Described, Verified,
};
pub use download::{
    download, download_within, is_public, resolve_url, DownloadError, Downloaded, Limits, Progress, Resolved, RESERVE,
};
pub use scan::{
    hf_cache_root, lmstudio_roots, ollama_roots, scan_hf_cache, scan_lmstudio, scan_ollama, Candidate, Scan,
    SkipReason, Skipped, Source,
};
pub use shoal_types::{CatalogEntry, Holder};
