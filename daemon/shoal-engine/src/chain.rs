//! [`Chain`]: the stages of one process driven on Shoal's canonical schedule — the
//! prompt in chunks of C, then one token per step, or with speculation one verify
//! batch per step (`shoal_types::speculative`) — so that output depends only on
//! (model, prompt, sampling, seed, C, speculation settings), never on how the layers
//! are split.

use crate::sampler::Sampler;
use shoal_types::speculative::{self, Proposer, SpecSettings};
use shoal_types::{LayerRange, LogitsDigest, SessionId, Stage, StageError, StageInput, StageOutput, TokenId};
use std::time::{Duration, Instant};

/// Why a chain could not be built or a generation failed.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// The stages do not form one model: gaps, overlaps, or different settings.
    #[error("stages do not form a chain: {0}")]
    Shape(String),
    /// A stage refused or failed a step.
    #[error("stage {layers}: {source}")]
    Stage { layers: LayerRange, source: StageError },
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A verify step's logits do not split into its rows (an engine fault).
    #[error("{0}")]
    Verify(#[from] speculative::VerifyError),
    /// The prompt plus the tokens asked for do not fit the context.
    #[error("prompt of {prompt} tokens + {new} new tokens exceeds the context of {n_ctx} tokens")]
    ContextExceeded { prompt: usize, new: usize, n_ctx: u32 },
}

/// Time spent in each stage, summed over a generation.
#[derive(Clone, Debug, Default)]
pub struct StepTiming {
    /// Per stage, in chain order.
    pub per_stage: Vec<Duration>,
}

/// The result of [`Chain::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated token ids (the end-of-generation token included, if one came).
    pub tokens: Vec<TokenId>,
    /// BLAKE3 over the tail's logits of every step, bit for bit (hex): equal digests
    /// mean identical logits, not merely identical tokens.
    pub logits_digest: String,
    /// Time to process the prompt (until the first token's logits).
    pub prefill: Duration,
    /// Time of the remaining decode steps.
    pub decode: Duration,
    /// Where the time went.
    pub timing: StepTiming,
    /// Decode steps taken (the prompt's chunks not counted).
    pub decode_steps: usize,
    /// Tokens drafted, and of them accepted, over all decode steps (speculation).
    pub drafted: usize,
    pub accepted: usize,
}

impl Generation {
    /// Decode speed: tokens produced after the first, per second of decode.
    pub fn decode_tok_per_s(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if steps == 0 || self.decode.is_zero() {
            return 0.0;
        }
        steps as f64 / self.decode.as_secs_f64()
    }
}

/// Receives what a generation produces as it goes.
pub trait Observer {
    /// The tail's logits of one step (the last prompt chunk, then each decode step).
    fn logits(&mut self, _logits: &[f32]) {}
    /// A token was chosen. Return false to stop.
    fn token(&mut self, _token: TokenId) -> bool {
        true
    }
}

impl Observer for () {}

/// Stages covering a whole model, in order, run one after another in this process.
pub struct Chain {
    stages: Vec<Box<dyn Stage>>,
}

impl Chain {
    /// Check that `stages` cover `0..n_layer` contiguously with one chunk size and
    /// hidden-state width.
    pub fn new(stages: Vec<Box<dyn Stage>>) -> Result<Chain, ChainError> {
        let first = stages.first().ok_or_else(|| ChainError::Shape("no stages".into()))?.info().clone();
        let mut expect = 0;
        for s in &stages {
            let i = s.info();
            if i.layers.start != expect {
                return Err(ChainError::Shape(format!("stage {} follows layer {expect}", i.layers)));
            }
            if (i.chunk, i.n_embd, i.n_layer_total) != (first.chunk, first.n_embd, first.n_layer_total) {
                return Err(ChainError::Shape(format!("stage {} differs in chunk size, n_embd or model", i.layers)));
            }
            expect = i.layers.end;
        }
        if expect != first.n_layer_total {
            return Err(ChainError::Shape(format!("stages end at layer {expect} of {}", first.n_layer_total)));
        }
        Ok(Chain { stages })
    }

    /// The stages.
    pub fn stages(&self) -> &[Box<dyn Stage>] {
        &self.stages
    }

    /// Prefill chunk size C.
    pub fn chunk(&self) -> u32 {
        self.stages[0].info().chunk
    }

    /// Context per session (the smallest of the stages').
    pub fn n_ctx(&self) -> u32 {
        self.stages.iter().map(|s| s.info().n_ctx_per_session).min().unwrap_or(0)
    }

    /// Run positions `first_pos..` of `session` (at most C tokens) through every stage;
    /// returns the tail's logits for the last token.
    pub fn step(
        &mut self,
        session: SessionId,
        first_pos: u32,
        tokens: &[TokenId],
        timing: &mut StepTiming,
    ) -> Result<Vec<f32>, ChainError> {
        self.step_rows(session, first_pos, tokens, false, timing)
    }

    /// [`Chain::step`], returning every position's logits when `all_rows` (a verify step).
    pub fn step_rows(
        &mut self,
        session: SessionId,
        first_pos: u32,
        tokens: &[TokenId],
        all_rows: bool,
        timing: &mut StepTiming,
    ) -> Result<Vec<f32>, ChainError> {
        timing.per_stage.resize(self.stages.len(), Duration::ZERO);
        let mut hidden: Vec<f32> = Vec::new();
        for (k, stage) in self.stages.iter_mut().enumerate() {
            let input = if k == 0 { StageInput::Tokens(tokens) } else { StageInput::Hidden(&hidden) };
            let t0 = Instant::now();
            let out = stage
                .forward_rows(session, first_pos, input, all_rows)
                .map_err(|source| ChainError::Stage { layers: stage.info().layers, source })?;
            timing.per_stage[k] += t0.elapsed();
            match out {
                StageOutput::Hidden(h) => hidden = h,
                StageOutput::Logits(l) => return Ok(l),
            }
        }
        Err(ChainError::Shape("the last stage returned hidden states, not logits".into()))
    }

    /// Generate up to `max_new` tokens after `prompt` for `session`, stopping early
    /// when `observer.token` says so. The session is freed on every stage afterwards.
    pub fn generate(
        &mut self,
        session: SessionId,
        prompt: &[TokenId],
        max_new: usize,
        sampler: &mut Sampler,
        observer: &mut dyn Observer,
    ) -> Result<Generation, ChainError> {
        self.generate_speculative(session, prompt, max_new, sampler, observer, &SpecSettings::OFF, &[])
    }

    /// [`Chain::generate`] with speculative decoding: each decode step verifies the
    /// drafts prompt lookup proposes (`spec`; drafts stop before any token of `stop`,
    /// which should be the tokens that end the generation). The schedule is the
    /// pipeline coordinator's, so a split run with the same settings gives the same
    /// tokens and logits digest.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_speculative(
        &mut self,
        session: SessionId,
        prompt: &[TokenId],
        max_new: usize,
        sampler: &mut Sampler,
        observer: &mut dyn Observer,
        spec: &SpecSettings,
        stop: &[TokenId],
    ) -> Result<Generation, ChainError> {
        self.generate_drafted(session, prompt, max_new, sampler, observer, spec, stop, None)
    }

    /// [`Chain::generate_speculative`] with the drafts of `proposer` (a draft model's
    /// session, fresh for this generation) in place of prompt lookup when given: the
    /// pipeline's coordinator asks its proposer the same, so a split run with the same
    /// draft model and settings gives the same tokens and logits digest.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_drafted(
        &mut self,
        session: SessionId,
        prompt: &[TokenId],
        max_new: usize,
        sampler: &mut Sampler,
        observer: &mut dyn Observer,
        spec: &SpecSettings,
        stop: &[TokenId],
        proposer: Option<&mut (dyn Proposer + '_)>,
    ) -> Result<Generation, ChainError> {
        let result = self.generate_inner(session, prompt, max_new, sampler, observer, spec, stop, proposer);
        for s in &mut self.stages {
            s.free_session(session);
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn generate_inner(
        &mut self,
        session: SessionId,
        prompt: &[TokenId],
        max_new: usize,
        sampler: &mut Sampler,
        observer: &mut dyn Observer,
        spec: &SpecSettings,
        stop: &[TokenId],
        mut proposer: Option<&mut (dyn Proposer + '_)>,
    ) -> Result<Generation, ChainError> {
        if prompt.is_empty() {
            return Err(ChainError::EmptyPrompt);
        }
        let n_ctx = self.n_ctx();
        if prompt.len() + max_new > n_ctx as usize {
            return Err(ChainError::ContextExceeded { prompt: prompt.len(), new: max_new, n_ctx });
        }
        let chunk = self.chunk();
        // A draft model reads the prompt first, as the pipeline's coordinator has it do
        // (`Prepared`), so its answers are computed alike.
        if let Some(p) = proposer.as_deref_mut().filter(|_| spec.is_on()) {
            let _ = p.read_prompt(prompt);
        }
        let mut timing = StepTiming::default();
        let mut digest = LogitsDigest::default();
        let mut tokens: Vec<TokenId> = Vec::with_capacity(max_new);
        let t0 = Instant::now();
        let mut logits = Vec::new();
        let mut pos = 0u32;
        for piece in prompt.chunks(chunk as usize) {
            logits = self.step(session, pos, piece, &mut timing)?;
            pos += piece.len() as u32;
        }
        let prefill = t0.elapsed();
        let t1 = Instant::now();
        // The steps so far: the adaptive draft length reads their acceptance.
        let mut steps = Vec::new();
        // The prompt's last chunk gives the first token.
        let mut emitted = Vec::new();
        if max_new > 0 {
            digest.update(&logits);
            observer.logits(&logits);
            emitted.push(sampler.sample(&logits));
        }
        'generate: while !emitted.is_empty() {
            for &token in &emitted {
                tokens.push(token);
                if !observer.token(token) || tokens.len() == max_new {
                    break 'generate;
                }
            }
            // A decode step: the last token, and the drafts (if any) to verify.
            let n = tokens.len();
            let limits = speculative::limits_at(prompt.len(), n, max_new, n_ctx as usize, chunk, stop);
            let drafts = speculative::next_draft_with(prompt, &tokens, &steps, spec, &limits, proposer.as_deref_mut());
            let mut input = Vec::with_capacity(1 + drafts.len());
            input.push(tokens[n - 1]);
            input.extend(&drafts);
            steps.push(speculative::DecodeStep { n_before: n, drafts });
            // Without drafts this is an ordinary one-token step, and `verify` samples
            // its one row as such a step does.
            let first_pos = (prompt.len() + n - 1) as u32;
            let rows = self.step_rows(session, first_pos, &input, input.len() > 1, &mut timing)?;
            emitted = speculative::verify(sampler, &rows, &input, &mut digest)?;
            for row in rows.chunks_exact(rows.len() / input.len()).take(emitted.len()) {
                observer.logits(row);
            }
        }
        let (drafted, accepted) = speculative::tally(&steps, tokens.len());
        Ok(Generation {
            tokens,
            logits_digest: digest.hex(),
            prefill,
            decode: t1.elapsed(),
            timing,
            decode_steps: steps.len(),
            drafted,
            accepted,
        })
    }
}
