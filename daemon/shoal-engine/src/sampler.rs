//! Choosing the next token from the tail's logits, with llama.cpp's samplers.

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::LlamaToken;
use shoal_types::{TokenId, TokenSampler};

/// How to sample (defined with its checks in `shoal-types`, which builds without
/// llama.cpp, so the control boundary can refuse bad values before any sampler exists).
pub use shoal_types::SamplingParams;

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
