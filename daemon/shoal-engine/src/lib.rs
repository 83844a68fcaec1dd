//! The layer-range engine: runs layers `a..b` of a GGUF model with stock llama.cpp,
//! through shard files (see `shoal-gguf`). This crate holds all of Shoal's `unsafe`
//! code; everything above it speaks the Rust types of `shoal-types`.
//!
//! - [`LlamaStage`]: a loaded shard with a context serving several sessions.
//! - [`Vocab`]: tokenizer, chat template (rendered as Jinja) and streaming detokenizer.
//! - [`Sampler`]: sampling from the tail's logits.
//! - [`Chain`]: stages of one process driven on the canonical schedule.
//! - [`DraftModel`]: a small model proposing drafts for speculative decoding.
//! - [`devices()`]: the CPU, GPUs and accelerators llama.cpp can use, with their memory.

mod backend;
mod chain;
mod devices;
mod draft;
mod sampler;
mod stage;
/// The chat template renderer (its own crate: it needs no llama.cpp, and the fuzzer
/// builds it alone).
pub use shoal_template as template;
mod vocab;

pub use backend::{ggml_type_geometry, requantize, system_info, Quant, COMPILED_BACKENDS};
pub use chain::{Chain, ChainError, Generation, Observer, StepTiming};
pub use devices::devices;
pub use draft::{check_vocabularies, DraftError, DraftModel, MAX_VOCAB_DIFFERENCE};
pub use sampler::{Sampler, SamplerError, SamplingParams};
pub use shoal_gguf::{open_model, Arch, Gguf, ModelMeta, ShardCache};
pub use stage::{load_split, offload_split, GpuLayers, LlamaStage, LoadError, StageConfig};
pub use vocab::{Utf8Stream, Vocab, VocabError};
