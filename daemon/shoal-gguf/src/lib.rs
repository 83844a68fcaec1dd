//! GGUF for Shoal, in pure Rust: read and validate a model's header, describe the
//! model ([`ModelMeta`]), and write layer-range shards that stock llama.cpp loads.
//! Kept apart from the engine so that it builds, tests and fuzzes without llama.cpp,
//! and so that every file reaches llama.cpp's C reader only after passing ours.

mod file;
mod ggml_type;
mod model;
pub mod shard;
mod value;
pub mod zoo;

pub use file::{
    header_memory_budget, write_header, Gguf, TensorInfo, DEFAULT_ALIGNMENT, HEADER_MEMORY_PER_FILE_BYTE,
    MAX_HEADER_BYTES, MAX_HEADER_MEMORY, MIN_HEADER_MEMORY,
};
pub use ggml_type::GgmlType;
pub use model::{Arch, ModelMeta};
pub use shard::{manifest_path, Chunk, Manifest, ShardCache, ShardError, ShardFile, SourceHash, CHUNK_BYTES};
pub use value::{Value, ValueType};

use std::path::{Path, PathBuf};

/// Why a GGUF file was refused. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The file ends before what its header describes.
    #[error("{path}: truncated GGUF: {what}")]
    Truncated { path: PathBuf, what: String },
    /// The header is malformed.
    #[error("{path}: invalid GGUF at byte {offset}: {what}")]
    Invalid { path: PathBuf, offset: u64, what: String },
    /// Well-formed, but uses something Shoal does not support.
    #[error("{path}: unsupported: {what}")]
    Unsupported { path: PathBuf, what: String },
    /// Well-formed GGUF, but not a model llama.cpp could load.
    #[error("{path}: not a usable model: {what}")]
    Model { path: PathBuf, what: String },
}

impl GgufError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        GgufError::Io { path: path.to_owned(), source }
    }
}

/// Shoal's cache directory: `$XDG_CACHE_HOME/shoal`, else `~/.cache/shoal`.
pub fn cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("shoal");
    }
    let home = std::env::var_os("HOME").or_else(|| std::env::var_os("USERPROFILE")).unwrap_or_default();
    PathBuf::from(home).join(".cache").join("shoal")
}

/// Where downloaded models are cached: `$SHOAL_MODELS`, else `<cache_root>/models`
/// (`scripts/setup.sh` fills it with the test models).
pub fn models_dir() -> PathBuf {
    std::env::var_os("SHOAL_MODELS").map(PathBuf::from).unwrap_or_else(|| cache_root().join("models"))
}

/// Open `path`, validate its header and describe the model.
pub fn open_model(path: &Path) -> Result<(Gguf, ModelMeta), GgufError> {
    let g = Gguf::open(path)?;
    let meta = ModelMeta::from_gguf(&g)?;
    Ok((g, meta))
}
