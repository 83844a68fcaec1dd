//! Shoal's shared vocabulary: ids, layer ranges and the [`Stage`] trait that every
//! engine (llama.cpp, or a fake one in tests) implements. No I/O lives here, so every
//! crate can depend on it without pulling in llama.cpp, sockets or a store.

use serde::{Deserialize, Serialize};
use std::fmt;

pub mod apikey;
pub use apikey::{ApiKey, KeyScope};
pub mod catalog;
pub use catalog::{CatalogEntry, Holder};
mod inventory;
pub use inventory::{BadClusterId, BadNodeId, ClusterId, DeviceInventory, NodeId, NodeInventory, Role};
pub mod placement;
pub use placement::{GpuOffer, GpuShare, LoadSpec, ModelPlacement, Offer, PlacedStage, Speed};
pub mod sampling;
pub mod size;
pub use size::{fmt_size, parse_size, SizeError};
pub mod speculative;
pub mod text;
pub use sampling::{
    grammar_repetitions, validate_generation, GenerationError, SamplingParams, TokenLogprobs, LOGPROB_FLOOR,
    MAX_GRAMMAR_BYTES, MAX_GRAMMAR_REPETITIONS, MAX_TOP_LOGPROBS,
};
pub use speculative::SpecSettings;
pub use text::{StopText, Utf8Stream};

/// A token id in the model's vocabulary (llama.cpp's `llama_token`).
pub type TokenId = i32;

/// Identifies one generation (a client's request) across every stage that serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// A half-open range of transformer blocks `[start, end)` of the source model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerRange {
    /// First block this range holds.
    pub start: u32,
    /// One past the last block this range holds.
    pub end: u32,
}

impl LayerRange {
    /// The range `[start, end)`.
    pub fn new(start: u32, end: u32) -> Self {
        Self { start, end }
    }

    /// How many blocks the range holds.
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// True when the range holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Does the range contain block `layer`?
    pub fn contains(&self, layer: u32) -> bool {
        (self.start..self.end).contains(&layer)
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// Why a list of split points does not describe a valid split of a model.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SplitError {
    /// Split points must be strictly increasing and lie strictly inside the model.
    #[error("split points {points:?} must be strictly increasing and between 1 and {n_layer_minus_one} (the model has {n_layer} layers)", n_layer_minus_one = n_layer - 1)]
    OutOfOrder { points: Vec<u32>, n_layer: u32 },
    /// The architecture derives per-layer behaviour from the layer index with this
    /// period (e.g. Gemma 3's sliding-window pattern of 6): a boundary elsewhere
    /// silently changes the output.
    #[error(
        "split point {point} breaks the {arch} layer period of {period}: boundaries must be multiples of {period}"
    )]
    Period { point: u32, period: u32, arch: String },
}

/// Turn split points (`--split 10,20`) into consecutive ranges covering `0..n_layer`,
/// checking order and the architecture's layer period.
pub fn split_ranges(n_layer: u32, points: &[u32], period: u32, arch: &str) -> Result<Vec<LayerRange>, SplitError> {
    let mut ranges = Vec::with_capacity(points.len() + 1);
    let mut start = 0;
    for &p in points {
        if p <= start || p >= n_layer {
            return Err(SplitError::OutOfOrder { points: points.to_vec(), n_layer });
        }
        if period > 1 && p % period != 0 {
            return Err(SplitError::Period { point: p, period, arch: arch.to_string() });
        }
        ranges.push(LayerRange::new(start, p));
        start = p;
    }
    ranges.push(LayerRange::new(start, n_layer));
    Ok(ranges)
}

/// What a stage is: which layers of which model it runs, and its place in the chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageInfo {
    /// The blocks of the source model this stage runs.
    pub layers: LayerRange,
    /// Blocks in the whole (unsplit) model.
    pub n_layer_total: u32,
    /// Width of a hidden state: the values per token that cross between stages.
    pub n_embd: u32,
    /// Vocabulary size: the length of the tail's logits.
    pub n_vocab: u32,
    /// Prefill chunk size C, the `n_ubatch` of the context: every forward takes at
    /// most this many tokens, so results do not depend on how a prompt was cut.
    pub chunk: u32,
    /// Most positions one session may hold.
    pub n_ctx_per_session: u32,
    /// Most sessions held at once.
    pub max_sessions: u32,
}

impl StageInfo {
    /// Stage 0 takes token ids.
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// The tail computes logits.
    pub fn is_tail(&self) -> bool {
        self.layers.end == self.n_layer_total
    }
}

/// The input of one forward step.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// Token ids, for stage 0.
    Tokens(&'a [TokenId]),
    /// Hidden states from the previous stage: `n_tokens × n_embd` values, row-major.
    Hidden(&'a [f32]),
}

impl StageInput<'_> {
    /// Number of tokens this input carries, given the hidden-state width.
    pub fn n_tokens(&self, n_embd: u32) -> usize {
        match self {
            StageInput::Tokens(t) => t.len(),
            StageInput::Hidden(h) => h.len() / n_embd.max(1) as usize,
        }
    }
}

/// The output of one forward step.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    /// Hidden states after this stage's last layer, `n_tokens × n_embd` values.
    Hidden(Vec<f32>),
    /// The tail's logits for the last token of the step (`n_vocab` values), or for
    /// every token when asked (`forward_rows`).
    Logits(Vec<f32>),
}

/// Memory a loaded stage holds, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageMemory {
    /// Tensor bytes of the shard's weights (the layers plus the non-layer tensors it keeps).
    pub weights: u64,
    /// KV cache for all sessions at full context.
    pub kv: u64,
    /// Compute buffers and the output (logits/embeddings) buffer.
    pub compute: u64,
}

impl StageMemory {
    /// Everything together.
    pub fn total(&self) -> u64 {
        // The parts are estimates from file and profile sizes: saturate, never overflow.
        self.weights.saturating_add(self.kv).saturating_add(self.compute)
    }
}

/// Why a forward step or a session operation failed. The stage is left unchanged
/// unless the variant says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Token ids were given to a stage that expects hidden states, or the reverse.
    #[error("stage {layers} expects {expected} as input")]
    WrongInput { layers: LayerRange, expected: &'static str },
    /// The hidden-state payload is not a whole number of `n_embd` rows, or is empty.
    #[error("hidden-state input of {len} values is not a positive multiple of n_embd = {n_embd}")]
    BadHiddenLength { len: usize, n_embd: u32 },
    /// More tokens than the chunk size C in one step.
    #[error("{n} tokens in one step exceed the chunk size {chunk}")]
    ChunkTooLarge { n: usize, chunk: u32 },
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary (0..{n_vocab})")]
    BadToken { token: TokenId, n_vocab: u32 },
    /// The step would leave a gap in the session's positions.
    #[error("session {session}: step starts at position {first_pos}, but the session holds only {have} positions")]
    PositionGap { session: SessionId, first_pos: u32, have: u32 },
    /// The session would exceed its context.
    #[error("session {session}: positions up to {end} exceed the context of {n_ctx} per session")]
    ContextFull { session: SessionId, end: u32, n_ctx: u32 },
    /// Every session slot of this stage is taken.
    #[error("all {max} session slots of this stage are in use")]
    NoFreeSession { max: u32 },
    /// The engine failed; the session's state for this step is rolled back.
    #[error("engine error: {0}")]
    Engine(String),
}

/// One pipeline stage: runs a range of layers for several sessions.
///
/// Contract: `forward(session, first_pos, input)` computes positions
/// `first_pos..first_pos + n` of `session`. If the session already holds positions at or
/// after `first_pos`, they are dropped first, so re-running a step (a replay) gives the
/// same output as the first time. The engine behind it decides nothing else.
pub trait Stage: Send {
    /// What this stage runs.
    fn info(&self) -> &StageInfo;
    /// Run one step; see the trait's contract. The tail returns the last position's logits.
    fn forward(
        &mut self,
        session: SessionId,
        first_pos: u32,
        input: StageInput<'_>,
    ) -> Result<StageOutput, StageError> {
        self.forward_rows(session, first_pos, input, false)
    }
    /// Run one step; with `all_rows` the tail returns the logits of every position of
    /// the step, in order (`n × n_vocab` values: a speculative verify step), otherwise of
    /// the last. Other stages ignore `all_rows`.
    fn forward_rows(
        &mut self,
        session: SessionId,
        first_pos: u32,
        input: StageInput<'_>,
        all_rows: bool,
    ) -> Result<StageOutput, StageError>;
    /// Forget a session and free its KV cache. Unknown sessions are ignored.
    fn free_session(&mut self, session: SessionId);
    /// Memory this stage holds.
    fn memory(&self) -> StageMemory;
}

/// A generation's `logits_digest`: BLAKE3 over the little-endian bytes of the tail's
/// logits at every sampled step, in order. Equal digests mean bit-identical logits. One
/// definition, so that `shoal run` and the pipeline's tail can be compared exactly.
#[derive(Clone, Debug, Default)]
pub struct LogitsDigest {
    hasher: blake3::Hasher,
    /// Reused byte buffer (a step's logits are up to a MB).
    bytes: Vec<u8>,
}

impl LogitsDigest {
    /// Add one sampled step's logits.
    pub fn update(&mut self, logits: &[f32]) {
        // Copied value by value into a reused buffer: a loop the compiler vectorises (an
        // iterator of byte arrays was not, and cost more than the hash itself).
        self.bytes.resize(logits.len() * 4, 0);
        for (b, v) in self.bytes.chunks_exact_mut(4).zip(logits) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        self.hasher.update(&self.bytes);
    }

    /// The digest so far, as hex.
    pub fn hex(&self) -> String {
        self.hasher.finalize().to_hex().to_string()
    }
}

/// Chooses the next token from the tail's logits; holds per-session state (random
/// generator, recent tokens). The engine provides llama.cpp's samplers.
pub trait TokenSampler: Send {
    /// Choose a token from `logits` (one value per vocabulary entry) and remember it.
    fn sample(&mut self, logits: &[f32]) -> TokenId;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_points_become_ranges() {
        let r = split_ranges(30, &[10, 20], 1, "llama").unwrap();
        assert_eq!(r, vec![LayerRange::new(0, 10), LayerRange::new(10, 20), LayerRange::new(20, 30)]);
        assert_eq!(split_ranges(30, &[], 1, "llama").unwrap(), vec![LayerRange::new(0, 30)]);
    }

    #[test]
    fn bad_split_points_are_refused() {
        assert!(matches!(split_ranges(30, &[20, 10], 1, "llama"), Err(SplitError::OutOfOrder { .. })));
        assert!(matches!(split_ranges(30, &[0], 1, "llama"), Err(SplitError::OutOfOrder { .. })));
        assert!(matches!(split_ranges(30, &[30], 1, "llama"), Err(SplitError::OutOfOrder { .. })));
        let e = split_ranges(18, &[9], 6, "gemma3").unwrap_err();
        assert_eq!(e, SplitError::Period { point: 9, period: 6, arch: "gemma3".into() });
        assert!(e.to_string().contains("period of 6"));
        assert!(split_ranges(18, &[6, 12], 6, "gemma3").is_ok());
    }
}
