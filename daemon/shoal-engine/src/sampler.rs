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
    /// The candidates array, reused from token to token (one entry per vocabulary
    /// entry: allocating and faulting in ~0.5-3 MB per token showed in its time).
    candidates: Vec<LlamaTokenData>,
    /// The chain is llama.cpp's greedy sampler alone (no penalties, no grammar): its
    /// choice is the first largest logit, found without building the candidates.
    greedy_only: bool,
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
        let greedy_only = parts.is_empty() && params.temperature <= 0.0;
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
        Sampler { chain: LlamaSampler::chain_simple(parts), _vocab: None, candidates: Vec::new(), greedy_only }
    }

    /// Choose a token from `logits` (one value per vocabulary entry) and remember it.
    pub fn sample(&mut self, logits: &[f32]) -> TokenId {
        if self.greedy_only {
            // llama.cpp's greedy sampler, on the logits in place: the first index whose
            // logit is larger than every earlier one's (a strict `>`, so ties and NaNs
            // resolve as it resolves them). Tested against the chain below.
            let mut best = 0;
            for (i, &l) in logits.iter().enumerate().skip(1) {
                if l > logits[best] {
                    best = i;
                }
            }
            let token = LlamaToken(best as i32);
            self.chain.accept(token);
            return token.0;
        }
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        candidates.extend(logits.iter().enumerate().map(|(i, &l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)));
        let mut data = LlamaTokenDataArray::new(candidates, false);
        data.apply_sampler(&mut self.chain);
        // Invariant: every chain ends in greedy or dist, which always select a token.
        let token = data.selected_token().expect("sampler chain selects a token");
        self.chain.accept(token);
        self.candidates = data.data;
        token.0
    }
}

impl TokenSampler for Sampler {
    fn sample(&mut self, logits: &[f32]) -> TokenId {
        // The inherent method (inherent methods take precedence over trait methods).
        Sampler::sample(self, logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The greedy fast path picks what llama.cpp's greedy sampler picks: the first of
    /// equal maxima, and a NaN in first place stays (nothing compares larger).
    #[test]
    fn greedy_fast_path_agrees_with_llama_cpps_greedy_sampler() {
        let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
        let mut fast = Sampler::new(&params);
        assert!(fast.greedy_only);
        let mut chain = Sampler::new(&params);
        chain.greedy_only = false;
        let mut seed = 7u64;
        let mut cases: Vec<Vec<f32>> = (0..50)
            .map(|_| {
                (0..1000)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        // Few distinct values: ties for the maximum are common.
                        ((seed >> 33) % 40) as f32 / 4.0 - 5.0
                    })
                    .collect()
            })
            .collect();
        cases.push(vec![1.0, 3.0, 2.0, 3.0]);
        cases.push(vec![f32::NAN, 3.0, 2.0]);
        cases.push(vec![1.0, f32::NAN, 2.0, f32::NEG_INFINITY]);
        cases.push(vec![f32::NEG_INFINITY; 5]);
        for (i, logits) in cases.iter().enumerate() {
            assert_eq!(fast.sample(logits), chain.sample(logits), "case {i}: {:?}", &logits[..logits.len().min(8)]);
        }
        // With penalties the chain is needed (they reshape the logits).
        let penalised = SamplingParams { temperature: 0.0, repeat_penalty: 1.3, ..SamplingParams::default() };
        assert!(!Sampler::new(&penalised).greedy_only);
    }
}
