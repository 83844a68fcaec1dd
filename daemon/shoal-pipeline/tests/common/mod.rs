//! A deterministic fake engine for pipeline tests: output depends on the input and on
//! everything the session saw before (like a KV cache), so reordering, loss or a bad
//! rollback changes the numbers.
#![allow(dead_code)]

use shoal_types::{
    LayerRange, SessionId, Stage, StageError, StageInfo, StageInput, StageMemory, StageOutput, TokenId, TokenSampler,
};
use std::collections::HashMap;

pub const N_EMBD: u32 = 8;
pub const N_VOCAB: u32 = 50;
pub const N_LAYER: u32 = 6;
pub const CHUNK: u32 = 4;

/// Output depends on the input and on everything the session saw before (like a KV
/// cache), so reordering, loss or a bad rollback changes the numbers.
pub struct FakeStage {
    info: StageInfo,
    seen: HashMap<SessionId, Vec<f32>>,
}

impl FakeStage {
    pub fn new(layers: LayerRange) -> Self {
        Self::with_context(layers, 256)
    }

    /// A stage whose sessions hold `n_ctx` positions.
    pub fn with_context(layers: LayerRange, n_ctx: u32) -> Self {
        let info = StageInfo {
            layers,
            n_layer_total: N_LAYER,
            n_embd: N_EMBD,
            n_vocab: N_VOCAB,
            chunk: CHUNK,
            n_ctx_per_session: n_ctx,
            max_sessions: 4,
        };
        Self { info, seen: HashMap::new() }
    }
}

impl Stage for FakeStage {
    fn info(&self) -> &StageInfo {
        &self.info
    }

    fn forward_rows(
        &mut self,
        session: SessionId,
        first_pos: u32,
        input: StageInput<'_>,
        all_rows: bool,
    ) -> Result<StageOutput, StageError> {
        let rows: Vec<Vec<f32>> = match input {
            StageInput::Tokens(t) => {
                t.iter().map(|&t| (0..N_EMBD).map(|j| (t as f32 + j as f32) * 0.01).collect()).collect()
            }
            StageInput::Hidden(h) => h.chunks(N_EMBD as usize).map(<[f32]>::to_vec).collect(),
        };
        // Like the engine: a fixed number of session slots, taken by a session's first
        // step and given back only by `free_session`.
        if !self.seen.contains_key(&session) && self.seen.len() >= self.info.max_sessions as usize {
            return Err(StageError::NoFreeSession { max: self.info.max_sessions });
        }
        let seen = self.seen.entry(session).or_default();
        if first_pos as usize > seen.len() {
            return Err(StageError::PositionGap { session, first_pos, have: seen.len() as u32 });
        }
        seen.truncate(first_pos as usize);
        let mut out = Vec::new();
        for row in rows {
            let history: f32 = seen.iter().sum::<f32>() * 1e-3;
            let next: Vec<f32> = row
                .iter()
                .enumerate()
                .map(|(j, v)| (v * 1.1 + self.info.layers.start as f32 * 0.1 + history + j as f32 * 1e-4).sin())
                .collect();
            seen.push(next.iter().sum());
            out.extend(next);
        }
        if self.info.is_tail() {
            // The last row's logits, or every row's (a verify step).
            let first_row = if all_rows { 0 } else { out.len() / N_EMBD as usize - 1 };
            let logits = out
                .chunks(N_EMBD as usize)
                .skip(first_row)
                .flat_map(|row| {
                    (0..N_VOCAB).map(|i| row.iter().enumerate().map(|(j, v)| (v * (i + j as u32) as f32).cos()).sum())
                })
                .collect();
            Ok(StageOutput::Logits(logits))
        } else {
            Ok(StageOutput::Hidden(out))
        }
    }

    fn free_session(&mut self, session: SessionId) {
        self.seen.remove(&session);
    }

    fn memory(&self) -> StageMemory {
        StageMemory::default()
    }
}

pub struct Greedy;
impl TokenSampler for Greedy {
    fn sample(&mut self, logits: &[f32]) -> TokenId {
        logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as TokenId)
    }
}

/// The same stages run in order in-process, on the canonical schedule.
pub fn reference(ranges: &[LayerRange], prompt: &[TokenId], max_new: usize) -> (Vec<TokenId>, String) {
    let mut stages: Vec<FakeStage> = ranges.iter().map(|r| FakeStage::new(*r)).collect();
    let s = SessionId(1);
    let mut step = |first_pos: u32, tokens: &[TokenId]| {
        let mut out = stages[0].forward(s, first_pos, StageInput::Tokens(tokens)).unwrap();
        for st in stages.iter_mut().skip(1) {
            let StageOutput::Hidden(h) = out else { unreachable!() };
            out = st.forward(s, first_pos, StageInput::Hidden(&h)).unwrap();
        }
        let StageOutput::Logits(l) = out else { unreachable!() };
        l
    };
    let mut pos = 0;
    let mut logits = Vec::new();
    for c in prompt.chunks(CHUNK as usize) {
        logits = step(pos, c);
        pos += c.len() as u32;
    }
    let mut digest = blake3::Hasher::new();
    let mut tokens = Vec::new();
    loop {
        digest.update(&logits.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let t = Greedy.sample(&logits);
        tokens.push(t);
        if tokens.len() == max_new {
            break;
        }
        logits = step(pos, &[t]);
        pos += 1;
    }
    (tokens, digest.finalize().to_hex().to_string())
}

/// What [`reference_speculative`] returns: tokens, digest, drafted, accepted.
pub type SpecRun = (Vec<TokenId>, String, usize, usize);

/// The same stages in-process on the speculative schedule (the engine's `Chain` does
/// the same with llama.cpp stages): drafts by prompt lookup, one verify batch per step.
pub fn reference_speculative(
    ranges: &[LayerRange],
    prompt: &[TokenId],
    max_new: usize,
    spec: &shoal_types::SpecSettings,
    mut proposer: Option<&mut (dyn shoal_types::speculative::Proposer + '_)>,
) -> SpecRun {
    use shoal_types::speculative;
    let mut stages: Vec<FakeStage> = ranges.iter().map(|r| FakeStage::new(*r)).collect();
    let s = SessionId(1);
    let mut step = |first_pos: u32, tokens: &[TokenId], all: bool| {
        let mut out = stages[0].forward_rows(s, first_pos, StageInput::Tokens(tokens), all).unwrap();
        for st in stages.iter_mut().skip(1) {
            let StageOutput::Hidden(h) = out else { unreachable!() };
            out = st.forward_rows(s, first_pos, StageInput::Hidden(&h), all).unwrap();
        }
        let StageOutput::Logits(l) = out else { unreachable!() };
        l
    };
    let mut pos = 0;
    let mut logits = Vec::new();
    for c in prompt.chunks(CHUNK as usize) {
        logits = step(pos, c, false);
        pos += c.len() as u32;
    }
    let mut digest = shoal_types::LogitsDigest::default();
    digest.update(&logits);
    let mut tokens = vec![Greedy.sample(&logits)];
    let (mut drafted, mut accepted) = (0, 0);
    let mut steps = Vec::new();
    while tokens.len() < max_new {
        let n = tokens.len();
        let limits = speculative::limits_at(prompt.len(), n, max_new, 256, CHUNK, &[]);
        let drafts = speculative::next_draft_with(prompt, &tokens, &steps, spec, &limits, proposer.as_deref_mut());
        steps.push(speculative::DecodeStep { n_before: n, drafts: drafts.clone() });
        let mut input = vec![tokens[n - 1]];
        input.extend(&drafts);
        let rows = step((prompt.len() + n - 1) as u32, &input, !drafts.is_empty());
        let out = speculative::verify(&mut Greedy, &rows, &input, &mut digest).unwrap();
        drafted += drafts.len();
        accepted += out.len() - 1;
        tokens.extend(out);
    }
    (tokens, digest.hex(), drafted, accepted)
}

/// A fake draft model: prompt lookup's drafts (a guess from the text's length where it
/// finds none), with the last one changed on every third call, so that its answers
/// depend on its history as a real model's depend on its batches.
pub struct FakeDrafts;

impl shoal_types::speculative::DraftSource for FakeDrafts {
    fn proposer(&self) -> Box<dyn shoal_types::speculative::Proposer> {
        Box::new(FakeProposer { calls: 0 })
    }

    fn cost(&self) -> u32 {
        150
    }
}

struct FakeProposer {
    calls: usize,
}

impl shoal_types::speculative::Proposer for FakeProposer {
    fn propose(
        &mut self,
        prompt: &[TokenId],
        tokens: &[TokenId],
        k: usize,
        stop: &[TokenId],
    ) -> Result<Vec<TokenId>, shoal_types::speculative::ProposeError> {
        use shoal_types::speculative::{draft, DraftLimits};
        self.calls += 1;
        let s = shoal_types::SpecSettings { max_draft: k as u32, ngram_min: 1, ngram_max: 3, ..Default::default() };
        let limits = DraftLimits { remaining: k + 1, context_left: usize::MAX, chunk: u32::MAX, stop };
        let mut d = draft(prompt, tokens, &s, &limits);
        if d.is_empty() {
            d.push(((prompt.len() + tokens.len()) as u32 % N_VOCAB) as TokenId);
        }
        if self.calls.is_multiple_of(3) {
            if let Some(last) = d.last_mut() {
                *last = ((*last as u32 + 1) % N_VOCAB) as TokenId;
            }
        }
        Ok(d)
    }
}
