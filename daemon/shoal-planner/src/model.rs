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
            kv_bytes_per_token_per_layer: meta.kv_bytes_per_token_per_layer(),
        }
    }

    /// Bytes of one f32 hidden-state frame of `tokens` tokens.
    pub fn frame_bytes(&self, tokens: u32) -> u64 {
        u64::from(tokens) * u64::from(self.n_embd) * 4
    }

    /// Memory of a stage holding `layers` (stage 0 when `layers.start == 0`; the tail
    /// when it ends at the last layer), as llama.cpp allocates it on a CPU device:
    ///
    /// - weights: its blocks, the small shared tensors, the embedding on stage 0 and
    ///   the LM head on the tail (exact: tensor bytes from the GGUF);
    /// - KV cache: context × sessions × bytes per token per layer × its layers (exact);
    /// - compute: llama.cpp reserves its graph for a full micro-batch of C tokens with
    ///   logits for all of them, whatever the stage computes: per token 4·n_vocab (the
    ///   logits), 2·context (the f16 attention mask), and 8·n_embd + 6·n_ff for the
    ///   widest intermediate tensors (fitted to llama.cpp's reported sizes for SmolLM2
    ///   and Gemma 3, within 1%); plus the output buffer, n_vocab floats per output row
    ///   (C rows on a non-tail stage, which marks every token as output, one per
    ///   session on the tail).
    pub fn stage_memory(&self, layers: LayerRange, s: &Sizing) -> StageMemory {
        let blocks: u64 = self.layer_bytes[layers.start as usize..layers.end as usize].iter().sum();
        self.memory_of(blocks, layers.end - layers.start, layers.start == 0, layers.end == self.layers, s)
    }

    /// [`ModelProfile::stage_memory`] of `n_layers` blocks of `block_bytes` in all,
    /// on stage 0 (`first`) and/or the tail.
    pub fn memory_of(&self, block_bytes: u64, n_layers: u32, first: bool, tail: bool, s: &Sizing) -> StageMemory {
        let weights = block_bytes
            + self.other_bytes
            + if first { self.embed_bytes } else { 0 }
            + if tail && !(first && self.tied_embeddings) { self.head_bytes } else { 0 };
        let kv = u64::from(s.context) * u64::from(s.sessions) * self.kv_bytes_per_token_per_layer * u64::from(n_layers);
        let per_token = 4 * u64::from(self.n_vocab)
            + 2 * u64::from(s.context)
            + 8 * u64::from(self.n_embd)
            + 6 * u64::from(self.n_ff);
        let out_rows = if tail { s.sessions } else { s.chunk.max(s.sessions) };
        let compute = u64::from(s.chunk) * per_token + u64::from(out_rows) * u64::from(self.n_vocab) * 4;
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
}
