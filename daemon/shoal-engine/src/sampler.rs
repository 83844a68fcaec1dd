//! Choosing the next token from the tail's logits, with llama.cpp's samplers.

use crate::vocab::Vocab;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::LlamaToken;
use shoal_types::{TokenId, TokenSampler};
use std::sync::Arc;

/// How to sample (defined with its checks in `shoal-types`, which builds without
/// llama.cpp, so the control boundary can refuse bad values before any sampler exists).
pub use shoal_types::SamplingParams;

/// A sampler with its state (random generator, recent tokens, grammar position).
pub struct Sampler {
    /// llama.cpp's sampler chain.
    chain: LlamaSampler,
    /// The vocabulary a grammar sampler points into: kept alive as long as the chain.
    _vocab: Option<Arc<Vocab>>,
}

/// Why a sampler could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SamplerError {
    /// A grammar was given without the vocabulary it needs.
    #[error("a grammar needs the model's vocabulary")]
    NoVocab,
    /// llama.cpp did not accept the grammar.
    #[error("the grammar does not parse (GBNF with a `root` rule expected): {0}")]
    Grammar(String),
}

impl Sampler {
    /// A sampler for `params` (without a grammar: see [`Sampler::with_vocab`]).
    pub fn new(params: &SamplingParams) -> Sampler {
        Self::build(params, None)
    }

    /// A sampler for `params`, whose grammar (if any) is read against `vocab`.
    pub fn with_vocab(params: &SamplingParams, vocab: Option<Arc<Vocab>>) -> Result<Sampler, SamplerError> {
        let grammar = match (&params.grammar, &vocab) {
            (None, _) => None,
            (Some(_), None) => return Err(SamplerError::NoVocab),
            (Some(g), Some(v)) => {
                crate::backend::backend();
                Some(LlamaSampler::grammar(v.model(), g, "root").map_err(|e| SamplerError::Grammar(e.to_string()))?)
            }
        };
        let mut s = Self::build(params, grammar);
        s._vocab = vocab;
        Ok(s)
    }

    fn build(params: &SamplingParams, grammar: Option<LlamaSampler>) -> Sampler {
        crate::backend::backend();
        let mut parts = Vec::new();
        if params.repeat_penalty != 1.0 || params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
            parts.push(LlamaSampler::penalties(
                0,
                params.repeat_last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ));
        }
        // Before the choice: tokens that would leave the grammar are ruled out.
        parts.extend(grammar);
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
        Sampler { chain: LlamaSampler::chain_simple(parts), _vocab: None }
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
