//! The draft model of speculative decoding: a small GGUF with the target model's
//! vocabulary, run whole on the coordinator's node, that proposes the tokens it
//! predicts greedily (`shoal_types::speculative::Proposer`), where prompt lookup finds
//! nothing to copy (free-form text).
//!
//! Each generation gets its own session in the draft model's context ([`DraftModel::proposer`]).
//! A session keeps the KV of the text it last saw plus its own drafts, and on the next
//! call recomputes only from where the new text departs from it: an accepted draft is
//! not computed twice. What it computes, and in which batches, is a function of the
//! calls made on it, so a split run, an unsplit run and a resumed generation that
//! make the same calls get the same drafts (the `Proposer` contract).

use crate::stage::{LlamaStage, LoadError, StageConfig};
use shoal_gguf::{Gguf, GgufError, Value};
use shoal_types::speculative::{DraftSource, ProposeError, Proposer};
use shoal_types::{LayerRange, SessionId, Stage, StageInput, StageOutput, TokenId};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Vocabulary entries a draft model may have more or fewer than its target
/// (llama.cpp's speculative example allows the same: models of one family often pad
/// their vocabularies differently).
pub const MAX_VOCAB_DIFFERENCE: usize = 128;
/// Token ids below this are not compared (llama.cpp's rule: families reuse the first
/// few ids for different control tokens).
const CHECK_FROM: usize = 5;

/// Why a draft model cannot serve a target.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    /// Either GGUF could not be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// llama.cpp could not load the draft model.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The vocabularies differ: the draft's token ids would mean other text.
    #[error("the draft model {draft} cannot draft for {target}: {why}")]
    Vocabulary { draft: PathBuf, target: PathBuf, why: String },
}

/// A loaded draft model, shared by the generations of one coordinator.
pub struct DraftModel {
    /// The model, whole (one tail stage); one forward at a time.
    stage: Arc<Mutex<LlamaStage>>,
    /// The target's vocabulary size: a proposal at or past it is cut (the target's
    /// first stage would refuse it).
    target_vocab: u32,
    /// Session ids for proposers.
    next_session: AtomicU64,
    /// [`DraftSource::cost`]: the draft's file bytes per thousand of the target's
    /// (decoding one token reads every weight once, so bytes stand for time; file
    /// sizes, which every node and `shoal run` know alike).
    cost: u32,
}

impl DraftModel {
    /// Load `draft` to draft for the model whose vocabulary is in `target` (the model
    /// or a shard of it; checked to match) and whose GGUF file takes `target_bytes`, with
    /// `config`'s context, sessions and threads: give it at least the coordinator's
    /// context per session and sessions, or long generations and busy nodes run without
    /// drafts.
    pub fn load(
        draft: &Path,
        target: &Path,
        target_bytes: u64,
        config: &StageConfig,
    ) -> Result<DraftModel, DraftError> {
        let target_vocab = check_vocabularies(draft, target)?;
        let (_, meta) = shoal_gguf::open_model(draft)?;
        let draft_bytes =
            std::fs::metadata(draft).map_err(|e| GgufError::Io { path: draft.to_owned(), source: e })?.len();
        let cost = (1000.0 * draft_bytes as f64 / target_bytes.max(1) as f64)
            .round()
            .min(f64::from(shoal_types::speculative::MAX_COST)) as u32;
        let stage = LlamaStage::load(draft, LayerRange::new(0, meta.n_layer), meta.n_layer, config)?;
        Ok(DraftModel { stage: Arc::new(Mutex::new(stage)), target_vocab, next_session: AtomicU64::new(1), cost })
    }

    /// What it holds (llama.cpp's buffers for its weights, KV cache and compute).
    pub fn memory(&self) -> shoal_types::StageMemory {
        // Poisoned only if a forward panicked; its buffers are as allocated.
        self.stage.lock().unwrap_or_else(|p| p.into_inner()).memory()
    }

    /// [`DraftSource::cost`].
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// A proposer for one generation.
    pub fn proposer(&self) -> Box<dyn Proposer> {
        let session = SessionId(self.next_session.fetch_add(1, Ordering::Relaxed));
        Box::new(DraftSession { stage: self.stage.clone(), session, target_vocab: self.target_vocab, held: Vec::new() })
    }
}

impl DraftSource for DraftModel {
    fn proposer(&self) -> Box<dyn Proposer> {
        DraftModel::proposer(self)
    }

    fn cost(&self) -> u32 {
        self.cost
    }
}

/// Check that `draft`'s token ids mean what `target`'s do: the same tokenizer model,
/// sizes within [`MAX_VOCAB_DIFFERENCE`], the same token text for every id both have
/// (from id 5), the same BOS and EOS. Returns the target's vocabulary size.
pub fn check_vocabularies(draft: &Path, target: &Path) -> Result<u32, DraftError> {
    let (d, t) = (Gguf::open(draft)?, Gguf::open(target)?);
    let refuse = |why: String| DraftError::Vocabulary { draft: draft.to_owned(), target: target.to_owned(), why };
    let tokens = |g: &Gguf| match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array(_, v)) => Some(v.len()),
        _ => None,
    };
    let (Some(nd), Some(nt)) = (tokens(&d), tokens(&t)) else {
        return Err(refuse("one of them has no vocabulary (tokenizer.ggml.tokens)".into()));
    };
    for key in ["tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
        if d.get(key) != t.get(key) {
            return Err(refuse(format!("{key} differs ({:?} vs {:?})", d.get(key), t.get(key))));
        }
    }
    if nd.abs_diff(nt) > MAX_VOCAB_DIFFERENCE {
        return Err(refuse(format!("{nd} tokens against {nt} (at most {MAX_VOCAB_DIFFERENCE} apart)")));
    }
    if let (Some(Value::Array(_, a)), Some(Value::Array(_, b))) =
        (d.get("tokenizer.ggml.tokens"), t.get("tokenizer.ggml.tokens"))
    {
        if let Some(i) = (CHECK_FROM..nd.min(nt)).find(|&i| a[i] != b[i]) {
            let text = |v: &Value| v.as_str().unwrap_or("?").to_string();
            return Err(refuse(format!("token {i} is {:?} in one and {:?} in the other", text(&a[i]), text(&b[i]))));
        }
    }
    Ok(nt as u32)
}

/// One generation's session in the draft model.
struct DraftSession {
    stage: Arc<Mutex<LlamaStage>>,
    session: SessionId,
    target_vocab: u32,
    /// The tokens whose KV the session holds, positions `0..held.len()`.
    held: Vec<TokenId>,
}

impl Proposer for DraftSession {
    fn propose(
        &mut self,
        prompt: &[TokenId],
        tokens: &[TokenId],
        k: usize,
        stop: &[TokenId],
    ) -> Result<Vec<TokenId>, ProposeError> {
        let text: Vec<TokenId> = prompt.iter().chain(tokens).copied().collect();
        if text.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        // Recompute from where the text departs from what the session holds, and at
        // least its last token (its logits are the first draft's).
        let same = self.held.iter().zip(&text).take_while(|(a, b)| a == b).count().min(text.len() - 1);
        let shared = self.stage.clone();
        // Poisoned only by a panic in another session's forward: no drafts then.
        let mut stage = shared.lock().map_err(|_| ProposeError("the draft model failed earlier".into()))?;
        let mut logits = self.catch_up(&mut stage, &text, same)?;
        let mut out = Vec::with_capacity(k);
        loop {
            let t = first_largest(&logits);
            if t as u32 >= self.target_vocab {
                break;
            }
            out.push(t);
            if out.len() == k || stop.contains(&t) {
                break;
            }
            logits = last_logits(&mut stage, self.session, self.held.len(), &[t]).map_err(ProposeError)?;
            self.held.push(t);
        }
        Ok(out)
    }

    fn read_prompt(&mut self, prompt: &[TokenId]) -> Result<(), ProposeError> {
        let shared = self.stage.clone();
        let mut stage = shared.lock().map_err(|_| ProposeError("the draft model failed earlier".into()))?;
        self.catch_up(&mut stage, prompt, 0).map(drop)
    }
}

impl DraftSession {
    /// Make the session hold `text` (it holds its first `same` tokens already),
    /// computing the rest in chunks of the stage's C; the logits after it (empty where
    /// nothing was computed).
    ///
    /// A token the draft model does not have (the target's vocabulary may be up to
    /// [`MAX_VOCAB_DIFFERENCE`] larger) refuses the call before any compute: the
    /// answer depends on the text alone, and no call recomputes the text for nothing.
    /// A failed forward leaves the session as it was (the Stage contract), so what it
    /// holds stays what `held` says; the next forward at `held.len()` drops anything
    /// past it.
    fn catch_up(&mut self, stage: &mut LlamaStage, text: &[TokenId], same: usize) -> Result<Vec<f32>, ProposeError> {
        let n_vocab = stage.info().n_vocab;
        if let Some(t) = text[same..].iter().find(|&&t| t < 0 || t as u32 >= n_vocab) {
            return Err(ProposeError(format!("token {t} is past the draft model's vocabulary ({n_vocab})")));
        }
        let chunk = stage.info().chunk as usize;
        // The stage drops what the session held from `same` on (the Stage contract).
        self.held.truncate(same);
        let mut logits = Vec::new();
        for piece in text[same..].chunks(chunk) {
            logits = last_logits(stage, self.session, self.held.len(), piece).map_err(ProposeError)?;
            self.held.extend(piece);
        }
        Ok(logits)
    }
}

impl Drop for DraftSession {
    fn drop(&mut self) {
        if let Ok(mut stage) = self.stage.lock() {
            stage.free_session(self.session);
        }
    }
}

/// The logits after `tokens` placed at `pos` in `session`.
fn last_logits(stage: &mut LlamaStage, session: SessionId, pos: usize, tokens: &[TokenId]) -> Result<Vec<f32>, String> {
    match stage.forward(session, pos as u32, StageInput::Tokens(tokens)).map_err(|e| e.to_string())? {
        StageOutput::Logits(l) => Ok(l),
        // Not expected: the draft stage holds every layer, so it is a tail.
        StageOutput::Hidden(_) => Err("the draft model returned hidden states, not logits".into()),
    }
}

/// Greedy choice, llama.cpp's rule: the first largest logit.
fn first_largest(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as TokenId
}
