//! A model as the planner sees it: per-layer bytes, the non-layer tensors, the KV
//! cache per token and layer; and what a stage of it occupies in memory.

use serde::{Deserialize, Serialize};
use shoal_gguf::ModelMeta;
use shoal_types::{LayerRange, StageMemory};

/// The sizes of a model that decide placement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// Transformer blocks.
    pub layers: u32,
    /// Tensor bytes of each block (length `layers`).
    pub layer_bytes: Vec<u64>,
    /// Bytes of the token embedding (stage 0 reads it).
    pub embed_bytes: u64,
    /// Bytes of the LM head the tail reads (the embedding again when tied).
    pub head_bytes: u64,
    /// The LM head is the embedding (tied): a single stage holds it once.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Small non-layer tensors every stage keeps (output norm and the like).
    pub other_bytes: u64,
    /// Hidden-state width: a decode frame is `n_embd` floats.
    pub n_embd: u32,
    /// Vocabulary size: logits rows are `n_vocab` floats (0 when unknown).
    pub n_vocab: u32,
    /// Feed-forward width (for the compute-buffer estimate).
    pub n_ff: u32,
    /// Split boundaries must be multiples of this (the architecture's period).
    pub period: u32,
    /// KV-cache bytes per token per layer.
    pub kv_bytes_per_token_per_layer: u64,
    /// Some layers attend over a sliding window (Gemma 3, gpt-oss): llama.cpp then
    /// keeps a second KV cache, and reserves a second attention mask in every
    /// stage's compute buffer.
    #[serde(default)]
    pub sliding_window: bool,
    /// Stage sizes (in layers) no stage may have: llama.cpp would take a stage of that
    /// many layers for another variant of the model (`ModelMeta::refused_stage_layers`).
    #[serde(default)]
    pub refused_stage_layers: Vec<u32>,
}

/// The run settings that size a stage's buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sizing {
    /// Positions per session.
    pub context: u32,
    /// Sessions held at once.
    pub sessions: u32,
    /// Prefill chunk size C (the micro-batch of every context).
    pub chunk: u32,
}

impl ModelProfile {
    /// The profile of a GGUF model.
    pub fn from_meta(meta: &ModelMeta) -> ModelProfile {
        ModelProfile {
            layers: meta.n_layer,
            layer_bytes: meta.layer_bytes.clone(),
            embed_bytes: meta.embd_bytes,
            head_bytes: if meta.tied_embeddings { meta.embd_bytes } else { meta.output_bytes },
            tied_embeddings: meta.tied_embeddings,
            other_bytes: meta.other_bytes,
            n_embd: meta.n_embd,
            n_vocab: meta.n_vocab,
            n_ff: meta.n_ff,
            period: meta.layer_period(),
            sliding_window: !meta.swa_layers.is_empty(),
            refused_stage_layers: meta.refused_stage_layers.clone(),
            kv_bytes_per_token_per_layer: meta.kv_bytes_per_token_per_layer(),
        }
    }

    /// Bytes of one f32 hidden-state frame of `tokens` tokens.
    pub fn frame_bytes(&self, tokens: u32) -> u64 {
        // At most 2^32 · 2^32 · 4: saturate rather than overflow.
        u64::from(tokens).saturating_mul(u64::from(self.n_embd)).saturating_mul(4)
    }

    /// Memory of a stage holding `layers` (stage 0 when `layers.start == 0`; the tail
    /// when it ends at the last layer), as llama.cpp allocates it on a CPU device:
    ///
    /// - weights: its blocks, the small shared tensors, the embedding on stage 0 and
    ///   the LM head on the tail (exact: tensor bytes from the GGUF);
    /// - KV cache: context × sessions × bytes per token per layer × its layers (exact);
    /// - compute: llama.cpp reserves its graph for a full micro-batch of C tokens with
    ///   logits for all of them, whatever the stage computes: per token 4·n_vocab (the
    ///   logits), 2·context (the f16 attention mask), 4·context more where some layers
    ///   slide (the sliding-window layers' own f32 mask), and 8·n_embd + 6·n_ff for
    ///   the widest intermediate tensors (fitted to llama.cpp's reported sizes for
    ///   SmolLM2, Gemma 3 and the zoo's families, within 1%); plus the output buffer,
    ///   n_vocab floats per output row
    ///   (C rows on a non-tail stage, which marks every token as output, one per
    ///   session on the tail).
    ///
    /// Sizes come from a GGUF or a profile file, so the arithmetic saturates instead
    /// of overflowing: an absurd model needs `u64::MAX` bytes and fits nowhere. A range
    /// past the profile's blocks counts the blocks it has.
    pub fn stage_memory(&self, layers: LayerRange, s: &Sizing) -> StageMemory {
        self.memory_of(self.block_bytes(layers), layers.len(), layers.start == 0, layers.end == self.layers, s)
    }

    /// Bytes of the blocks in `layers` (saturating; a range past the profile's blocks
    /// counts the blocks it has).
    pub fn block_bytes(&self, layers: LayerRange) -> u64 {
        let (start, end) = (layers.start as usize, layers.end as usize);
        let held = self.layer_bytes.get(start..end.min(self.layer_bytes.len())).unwrap_or(&[]);
        held.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// [`ModelProfile::stage_memory`] of `n_layers` blocks of `block_bytes` in all,
    /// on stage 0 (`first`) and/or the tail.
    pub fn memory_of(&self, block_bytes: u64, n_layers: u32, first: bool, tail: bool, s: &Sizing) -> StageMemory {
        let weights = block_bytes
            .saturating_add(self.other_bytes)
            .saturating_add(if first { self.embed_bytes } else { 0 })
            .saturating_add(if tail && !(first && self.tied_embeddings) { self.head_bytes } else { 0 });
        let kv = u64::from(s.context)
            .saturating_mul(u64::from(s.sessions))
            .saturating_mul(self.kv_bytes_per_token_per_layer)
            .saturating_mul(u64::from(n_layers));
        // Each term is a u32 times a small constant, so their sum fits a u64.
        let per_token = 4 * u64::from(self.n_vocab)
            + 2 * u64::from(s.context)
            + if self.sliding_window { 4 * u64::from(s.context) } else { 0 }
            + 8 * u64::from(self.n_embd)
            + 6 * u64::from(self.n_ff);
        let out_rows = if tail { s.sessions } else { s.chunk.max(s.sessions) };
        let compute = u64::from(s.chunk)
            .saturating_mul(per_token)
            .saturating_add(u64::from(out_rows).saturating_mul(u64::from(self.n_vocab)).saturating_mul(4));
        StageMemory { weights, kv, compute }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> ModelProfile {
        ModelProfile {
            layers: 4,
            layer_bytes: vec![100, 100, 100, 100],
            embed_bytes: 1000,
            head_bytes: 2000,
            tied_embeddings: false,
            other_bytes: 7,
            n_embd: 8,
            n_vocab: 50,
            n_ff: 32,
            period: 1,
            sliding_window: false,
            refused_stage_layers: Vec::new(),
            kv_bytes_per_token_per_layer: 3,
        }
    }

    #[test]
    fn stages_count_what_they_hold() {
        let m = toy();
        let s = Sizing { context: 10, sessions: 2, chunk: 4 };
        let first = m.stage_memory(LayerRange { start: 0, end: 2 }, &s);
        assert_eq!(first.weights, 200 + 7 + 1000);
        assert_eq!(first.kv, 10 * 2 * 3 * 2);
        let per_token = 4 * 50 + 2 * 10 + 8 * 8 + 6 * 32;
        assert_eq!(first.compute, 4 * per_token + 4 * 50 * 4);
        let tail = m.stage_memory(LayerRange { start: 2, end: 4 }, &s);
        assert_eq!(tail.weights, 200 + 7 + 2000);
        assert_eq!(tail.compute, 4 * per_token + 2 * 50 * 4);
        let whole = m.stage_memory(LayerRange { start: 0, end: 4 }, &s);
        assert_eq!(whole.weights, 400 + 7 + 1000 + 2000);
        let tied = ModelProfile { head_bytes: 1000, tied_embeddings: true, ..m };
        assert_eq!(tied.stage_memory(LayerRange { start: 0, end: 4 }, &s).weights, 400 + 7 + 1000);
    }

    #[test]
    fn absurd_sizes_saturate_instead_of_overflowing() {
        let m = ModelProfile {
            layer_bytes: vec![u64::MAX; 4],
            other_bytes: u64::MAX,
            n_embd: u32::MAX,
            n_vocab: u32::MAX,
            n_ff: u32::MAX,
            kv_bytes_per_token_per_layer: u64::MAX,
            ..toy()
        };
        let s = Sizing { context: u32::MAX, sessions: u32::MAX, chunk: u32::MAX };
        let mem = m.stage_memory(LayerRange { start: 0, end: 4 }, &s);
        assert_eq!((mem.weights, mem.kv, mem.compute), (u64::MAX, u64::MAX, u64::MAX));
        assert_eq!(mem.total(), u64::MAX);
        assert_eq!(m.frame_bytes(u32::MAX), u64::MAX);
    }

    #[test]
    fn a_range_past_the_profile_blocks_does_not_panic() {
        // A profile whose `layer_bytes` is shorter than its `layers`, or a range past
        // them: the blocks it has are counted.
        let m = ModelProfile { layer_bytes: vec![100, 100], ..toy() };
        let s = Sizing { context: 10, sessions: 2, chunk: 4 };
        assert_eq!(m.stage_memory(LayerRange { start: 1, end: 4 }, &s).weights, 100 + 7 + 2000);
        assert_eq!(m.stage_memory(LayerRange { start: 9, end: 12 }, &s).weights, 7);
        assert_eq!(m.stage_memory(LayerRange { start: 3, end: 1 }, &s).kv, 0);
    }
}
