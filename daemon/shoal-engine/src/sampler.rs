//! Choosing the next token from the tail's logits, with llama.cpp's samplers.

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::LlamaToken;
use serde::{Deserialize, Serialize};
use shoal_types::{TokenId, TokenSampler};

/// How to sample. The defaults are greedy decoding: the most likely token, always.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy; otherwise logits are divided by it before sampling.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    pub top_k: i32,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0: off).
    pub min_p: f32,
    /// Penalise tokens seen in the last `repeat_last_n` (1: off).
    pub repeat_penalty: f32,
    /// Window of the repetition penalty.
    pub repeat_last_n: i32,
    /// Random seed: the same seed and inputs give the same tokens.
    pub seed: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0 }
    }
}

/// A sampler with its state (random generator, recent tokens).
pub struct Sampler {
    /// llama.cpp's sampler chain.
    chain: LlamaSampler,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: &SamplingParams) -> Sampler {
        crate::backend::backend();
        let mut parts = Vec::new();
        if params.repeat_penalty != 1.0 {
            parts.push(LlamaSampler::penalties(0, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0));
        }
        if params.temperature <= 0.0 {
            parts.push(LlamaSampler::greedy());
        } else {
            if params.top_k > 0 {
                parts.push(LlamaSampler::top_k(params.top_k));
            }
            if params.top_p < 1.0 {
                parts.push(LlamaSampler::top_p(params.top_p, 1));
            }
            if params.min_p > 0.0 {
                parts.push(LlamaSampler::min_p(params.min_p, 1));
            }
            parts.push(LlamaSampler::temp(params.temperature));
            parts.push(LlamaSampler::dist(params.seed));
        }
        Sampler { chain: LlamaSampler::chain_simple(parts) }
    }

    /// Choose a token from `logits` (one value per vocabulary entry) and remember it.
    pub fn sample(&mut self, logits: &[f32]) -> TokenId {
        let mut data = LlamaTokenDataArray::from_iter(
            logits.iter().enumerate().map(|(i, &l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)),
            false,
        );
        data.apply_sampler(&mut self.chain);
        // Invariant: every chain ends in greedy or dist, which always select a token.
        let token = data.selected_token().expect("sampler chain selects a token");
        self.chain.accept(token);
        token.0
    }
}

impl TokenSampler for Sampler {
    fn sample(&mut self, logits: &[f32]) -> TokenId {
        // The inherent method (inherent methods take precedence over trait methods).
        Sampler::sample(self, logits)
    }
}
