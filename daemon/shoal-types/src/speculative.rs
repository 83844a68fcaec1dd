//! Speculative decoding's pure parts, shared by the in-process `Chain` and the
//! pipeline's coordinator and tail so that both follow one schedule to the bit:
//! drafts by prompt lookup ([`draft`]), the verify rule ([`verify`]), and the
//! schedule a finished generation's tokens imply ([`schedule_of`], for replays).
//!
//! A decode step normally computes one position: the last token. With speculation it
//! computes `1 + k` positions, the last token and `k` drafted ones, in one batch; the
//! tail samples row 0, and while the sample equals the next draft it samples the next
//! row too. Every sampled token is emitted: the accepted drafts and the first token
//! that differs (or one more after the last draft). Rejected positions are dropped on
//! every stage by the next step, which starts right after the accepted ones (the
//! `Stage` contract drops what a session holds from a step's first position on).
//!
//! Why the output distribution is unchanged: a prompt-lookup draft is one token, not a
//! distribution (q is a point mass on d). The standard speculative-sampling rule then
//! accepts d with probability min(1, p(d)/q(d)) = p(d) and otherwise samples from
//! p without d, renormalised. Sampling y from p and accepting iff y = d does exactly
//! that, and keeps the sampler's state (penalties, grammar, random stream) as a
//! non-speculative run's: one sample per emitted token.
//!
//! Why split equals unsplit: drafts depend only on the tokens so far and the settings,
//! so the same request makes the same verify batches whatever the placement (DESIGN
//! point 10: batch shapes decide the numbers). Greedy output with speculation may
//! differ from greedy output without it at near-ties, because a position's logits
//! computed in a batch of `1 + k` rows are not bit-identical to the same position
//! computed alone.

use crate::{LogitsDigest, TokenId, TokenSampler};
use serde::{Deserialize, Serialize};

/// Longest draft a step may carry.
pub const MAX_DRAFT: u32 = 32;
/// Longest n-gram prompt lookup matches.
pub const MAX_NGRAM: u32 = 8;

/// How a generation speculates. The wire form (JSON) in generation requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpecSettings {
    /// Most drafted tokens per step (k); 0 turns speculation off.
    pub max_draft: u32,
    /// Shortest suffix of the text so far that prompt lookup matches.
    pub ngram_min: u32,
    /// Longest suffix tried first.
    pub ngram_max: u32,
    /// The cost model that chooses k at each step ([`draft_cap`]): what each drafted
    /// position adds to a pass, in thousandths of a one-position pass. The model is on
    /// where this or `model_cost` is above 0; both 0: every step drafts up to
    /// `max_draft`.
    pub position_cost: u32,
    /// What a step costs besides its positions' compute (hops, wake-ups), in
    /// thousandths of a one-position pass: the dearer a step, the longer the drafts
    /// worth sending.
    pub step_cost: u32,
    /// With a draft model ([`Proposer`]): what it spends on each token it drafts, in
    /// thousandths of a one-position pass of the target (drafting k tokens takes k of
    /// its passes, one after the other). 0 without a draft model. Left out of the wire
    /// form when 0, so peers that predate it read the settings as before.
    #[serde(skip_serializing_if = "is_zero")]
    pub model_cost: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Default for SpecSettings {
    /// Up to 8 drafted tokens, k chosen by the cost model with what a CPU pass costs
    /// on a small model (`shoal-lab bench speculative` measured each extra position at
    /// ~0.45 of a one-position pass for SmolLM2 on one thread).
    fn default() -> Self {
        Self { max_draft: 8, ngram_min: 2, ngram_max: 4, position_cost: 450, step_cost: 100, model_cost: 0 }
    }
}

/// Settings outside their bounds.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// `max_draft` over [`MAX_DRAFT`].
    #[error("speculation: max_draft {0} is over {MAX_DRAFT}")]
    Draft(u32),
    /// The n-gram lengths are not 1 ≤ min ≤ max ≤ [`MAX_NGRAM`].
    #[error("speculation: n-gram lengths {0}..={1} must satisfy 1 <= min <= max <= {MAX_NGRAM}")]
    Ngram(u32, u32),
    /// A cost over [`MAX_COST`].
    #[error("speculation: position_cost {0}, step_cost {1} and model_cost {2} must be at most {MAX_COST}")]
    Cost(u32, u32, u32),
}

/// Largest cost accepted (in thousandths of a one-position pass: a step that costs a
/// thousand passes is no step to speculate on).
pub const MAX_COST: u32 = 1_000_000;

impl SpecSettings {
    /// Speculation off.
    pub const OFF: SpecSettings =
        SpecSettings { max_draft: 0, ngram_min: 2, ngram_max: 4, position_cost: 0, step_cost: 0, model_cost: 0 };

    /// These settings for drafts from a draft model that costs `model_cost` per drafted
    /// token ([`DraftSource::cost`]): where they choose k by a cost model and do not
    /// price the draft model's passes themselves, its price. Without a cost model (k
    /// fixed) they stay as they are. The coordinator and `shoal run` both apply it, so
    /// a request means the same on either.
    pub fn priced_for(self, model_cost: u32) -> SpecSettings {
        if self.is_on() && self.model_cost == 0 && (self.position_cost > 0 || self.step_cost > 0) {
            SpecSettings { model_cost, ..self }
        } else {
            self
        }
    }

    /// Whether steps may carry drafts at all.
    pub fn is_on(&self) -> bool {
        self.max_draft > 0
    }

    /// Check the bounds (values come from the network and from users).
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.max_draft > MAX_DRAFT {
            return Err(SpecError::Draft(self.max_draft));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > MAX_NGRAM {
            return Err(SpecError::Ngram(self.ngram_min, self.ngram_max));
        }
        if self.position_cost > MAX_COST || self.step_cost > MAX_COST || self.model_cost > MAX_COST {
            return Err(SpecError::Cost(self.position_cost, self.step_cost, self.model_cost));
        }
        Ok(())
    }
}

/// What bounds a step's draft besides the settings.
#[derive(Clone, Copy, Debug)]
pub struct DraftLimits<'a> {
    /// Most tokens the generation may still emit (max_new − emitted): a step emits at
    /// most `1 + k`, so k ≤ this − 1 and a generation never computes past its end.
    pub remaining: usize,
    /// Positions left in the session's context after the step's first one.
    pub context_left: usize,
    /// The chunk size C: a step carries at most C positions.
    pub chunk: u32,
    /// Tokens that end a generation: a draft stops before the first of them, so an
    /// emitted stop token is always a step's last and nothing is computed after it.
    pub stop: &'a [TokenId],
}

/// Drafts for the next step of a generation whose text so far is `prompt` followed by
/// `tokens` (at least one: the step's first input is the last token): the tokens that
/// followed the most recent earlier occurrence of the longest suffix (from
/// `ngram_max` down to `ngram_min` tokens) found in that text. Empty when nothing
/// matches or speculation is off. Pure and deterministic: the schedule it makes is a
/// function of the tokens alone.
pub fn draft(prompt: &[TokenId], tokens: &[TokenId], s: &SpecSettings, limits: &DraftLimits<'_>) -> Vec<TokenId> {
    let k = draft_len(s, limits, tokens);
    if k == 0 {
        return Vec::new();
    }
    let text = Text { prompt, tokens };
    let len = text.len();
    for n in (s.ngram_min as usize..=s.ngram_max as usize).rev() {
        if n >= len {
            continue;
        }
        let suffix = len - n;
        // The most recent earlier occurrence: its start lies before the suffix's.
        let found = (0..suffix).rev().find(|&i| (0..n).all(|j| text.at(i + j) == text.at(suffix + j)));
        if let Some(i) = found {
            let from = i + n;
            let mut out: Vec<TokenId> = (from..len.min(from + k)).map(|p| text.at(p)).collect();
            if let Some(cut) = out.iter().position(|t| limits.stop.contains(t)) {
                out.truncate(cut);
            }
            return out;
        }
    }
    Vec::new()
}

/// The most tokens a step after `tokens` may draft: `max_draft`, and room for the
/// step's answer within `limits` (0 before the first token: the prompt's last chunk
/// makes it).
fn draft_len(s: &SpecSettings, limits: &DraftLimits<'_>, tokens: &[TokenId]) -> usize {
    if tokens.is_empty() {
        return 0;
    }
    (s.max_draft as usize)
        .min(limits.remaining.saturating_sub(1))
        .min(limits.context_left)
        .min((limits.chunk as usize).saturating_sub(1))
}

/// A draft model's side of speculation, for one generation: proposes the tokens a
/// smaller model with the target's vocabulary predicts next (the engine's draft
/// model; tests use fakes). The coordinator and `Chain` call it once per decode step,
/// in the schedule's order, in place of prompt lookup.
///
/// Contract, what keeps split equal to unsplit: the answer to a call is a function of
/// the calls made on this proposer since it was created (the engine runs the same
/// batches for the same calls), so two runs that make the same calls — a split run
/// and an unsplit one, or a resumed generation rebuilding its schedule with
/// [`schedule_of_with`] — get the same drafts. A proposer is made per generation and
/// dropped with it (that frees what it holds).
pub trait Proposer: Send {
    /// Up to `k` (≥ 1) tokens predicted after `prompt` followed by `tokens`, stopping
    /// after any token of `stop` (the caller drops it and what follows). An error
    /// means no drafts for this step; it must be as deterministic as the answers.
    fn propose(
        &mut self,
        prompt: &[TokenId],
        tokens: &[TokenId],
        k: usize,
        stop: &[TokenId],
    ) -> Result<Vec<TokenId>, ProposeError>;

    /// Read the generation's prompt before the first [`Proposer::propose`] (a draft
    /// model computes its KV cache for it), so the first step's call finds it done.
    /// Every run calls it once, first, with the prompt (the coordinator's off its
    /// event loop), so their later answers are computed alike. An error leaves the
    /// prompt to the first call. Default: nothing to read.
    fn read_prompt(&mut self, prompt: &[TokenId]) -> Result<(), ProposeError> {
        let _ = prompt;
        Ok(())
    }
}

/// Makes a [`Proposer`] for each generation (the node's loaded draft model).
pub trait DraftSource: Send + Sync {
    /// A fresh proposer (holding nothing yet).
    fn proposer(&self) -> Box<dyn Proposer>;
    /// What it spends per drafted token, in thousandths of a one-position pass of the
    /// target: [`SpecSettings::model_cost`] for requests that do not say. A function
    /// of the two models alone (not a timing), so every node and `shoal run` with the
    /// same draft model choose the same drafts.
    fn cost(&self) -> u32;
}

/// A draft model could not propose (its context is full, no session slot is free).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("draft model: {0}")]
pub struct ProposeError(pub String);

/// The prompt and the tokens so far as one sequence, without copying.
struct Text<'a> {
    prompt: &'a [TokenId],
    tokens: &'a [TokenId],
}

impl Text<'_> {
    fn len(&self) -> usize {
        self.prompt.len() + self.tokens.len()
    }

    fn at(&self, i: usize) -> TokenId {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.tokens[i - self.prompt.len()]
        }
    }
}

/// The tail's verify rule for a step whose input was `step_tokens` (the last emitted
/// token, then the drafts) and whose logits are `logits` (one row of `n_vocab` per
/// input position, in order): sample row 0; while the sample equals the next draft,
/// sample the next row. Returns every sampled token (1 to `step_tokens.len()`); each
/// sampled row's logits go into `digest`, as a non-speculative step's do.
pub fn verify(
    sampler: &mut dyn TokenSampler,
    logits: &[f32],
    step_tokens: &[TokenId],
    digest: &mut LogitsDigest,
) -> Result<Vec<TokenId>, VerifyError> {
    let n = step_tokens.len();
    if n == 0 || logits.is_empty() || !logits.len().is_multiple_of(n) {
        return Err(VerifyError { rows: n, values: logits.len() });
    }
    let n_vocab = logits.len() / n;
    let mut out = Vec::with_capacity(n);
    for (i, row) in logits.chunks_exact(n_vocab).enumerate() {
        digest.update(row);
        let t = sampler.sample(row);
        out.push(t);
        if step_tokens.get(i + 1) != Some(&t) {
            break;
        }
    }
    Ok(out)
}

/// A verify step's logits do not match its positions.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{values} logits do not split into {rows} rows")]
pub struct VerifyError {
    rows: usize,
    values: usize,
}

/// One decode step of a schedule: the step's input is the last of the first
/// `n_before` emitted tokens, then `drafts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeStep {
    /// Tokens emitted before this step (≥ 1: the prompt's last chunk emits the first).
    pub n_before: usize,
    /// The drafted tokens the step verifies (empty: an ordinary one-token step).
    pub drafts: Vec<TokenId>,
}

/// Verify steps whose acceptance sets the next cap ([`draft_cap`]).
const WINDOW: usize = 8;
/// Steps without drafts after which a step drafts again (to see whether drafts have
/// become worth it).
const PROBE_AFTER: usize = 16;

/// The step cost (thousandths of a one-position pass) of a placement whose planner
/// predicts `tok_s` decode tokens per second with `compute_ms` of them computing (all
/// stages together): what a step spends on hops, wake-ups and the protocol beside its
/// compute. A placement over slow links gets a dear step and so longer drafts. `None`
/// when the prediction has no compute to relate to (an old placement, or no plan).
pub fn step_cost_for(tok_s: f64, compute_ms: f64) -> Option<u32> {
    if !(tok_s > 0.0 && compute_ms > 0.0 && tok_s.is_finite() && compute_ms.is_finite()) {
        return None;
    }
    let overhead_ms = (1000.0 / tok_s - compute_ms).max(0.0);
    Some((1000.0 * overhead_ms / compute_ms).round().min(f64::from(MAX_COST)) as u32)
}

/// The most tokens the next step drafts, given `steps` so far (all answered) and the
/// tokens they emitted: `max_draft` without a cost model; with one, the k that makes
/// most tokens per unit of cost, E(k) / (1 + step_cost + k × (position_cost +
/// model_cost)), where
/// E(k) = 1 + a + … + a^k and a is the acceptance rate of drafted tokens over the
/// last verify steps (Laplace-smoothed). k = 0 when no draft pays, but after
/// [`PROBE_AFTER`] such steps one step drafts again. A function of the tokens alone
/// (plain float arithmetic, no clock): replays and unsplit runs choose alike.
pub fn draft_cap(s: &SpecSettings, steps: &[DecodeStep], n_tokens: usize) -> usize {
    if (s.position_cost == 0 && s.model_cost == 0) || !s.is_on() {
        return s.max_draft as usize;
    }
    let emitted = |i: usize| emitted(steps, i, n_tokens);
    let (mut drafted, mut accepted, mut verify_steps) = (0usize, 0usize, 0usize);
    let mut idle = 0;
    for i in (0..steps.len()).rev() {
        if steps[i].drafts.is_empty() {
            if verify_steps == 0 {
                idle += 1;
            }
            continue;
        }
        drafted += steps[i].drafts.len();
        accepted += emitted(i).saturating_sub(1);
        verify_steps += 1;
        if verify_steps == WINDOW {
            break;
        }
    }
    let a = (accepted as f64 + 1.0) / (drafted as f64 + 2.0);
    let step = f64::from(s.step_cost) / 1000.0;
    // A drafted token costs its position in the verify pass and, with a draft model,
    // the model's pass that proposed it.
    let position = (f64::from(s.position_cost) + f64::from(s.model_cost)) / 1000.0;
    let (mut best, mut best_value) = (0, 1.0 / (1.0 + step));
    let (mut expected, mut power) = (1.0, 1.0);
    for k in 1..=s.max_draft as usize {
        power *= a;
        expected += power;
        let value = expected / (1.0 + step + k as f64 * position);
        if value > best_value {
            (best, best_value) = (k, value);
        }
    }
    // Drafts that were all accepted pay iff a drafted position costs less than a step
    // ((k + 1) / (1 + step + k × position) > 1 / (1 + step) ⟺ position < 1 + step):
    // dearer drafts never pay, so nothing is worth a look.
    let could_pay = position < 1.0 + step;
    if best == 0 && idle >= PROBE_AFTER && could_pay {
        // A look at whether drafts pay again: prompt lookup's drafts cost nothing to
        // make, so the longest; a draft model's each cost a pass, so one.
        return if s.model_cost > 0 { 1 } else { s.max_draft as usize };
    }
    best
}

/// Tokens step `i` of `steps` emitted, when all of them emitted `n_tokens` in all.
fn emitted(steps: &[DecodeStep], i: usize, n_tokens: usize) -> usize {
    steps.get(i + 1).map_or(n_tokens, |next| next.n_before) - steps[i].n_before
}

/// Tokens drafted and of them accepted over `steps`, which emitted `n_tokens` in all
/// (the figures a generation reports).
pub fn tally(steps: &[DecodeStep], n_tokens: usize) -> (usize, usize) {
    (0..steps.len())
        .filter(|&i| !steps[i].drafts.is_empty())
        .fold((0, 0), |(d, a), i| (d + steps[i].drafts.len(), a + emitted(steps, i, n_tokens).saturating_sub(1)))
}

/// The next step's drafts after `steps` (all answered) emitted `tokens`: prompt lookup
/// within `limits` and [`draft_cap`].
pub fn next_draft(
    prompt: &[TokenId],
    tokens: &[TokenId],
    steps: &[DecodeStep],
    s: &SpecSettings,
    limits: &DraftLimits<'_>,
) -> Vec<TokenId> {
    next_draft_with(prompt, tokens, steps, s, limits, None)
}

/// [`next_draft`], with the drafts of `proposer` (a draft model) in place of prompt
/// lookup when there is one. A proposer's error gives a step without drafts.
pub fn next_draft_with(
    prompt: &[TokenId],
    tokens: &[TokenId],
    steps: &[DecodeStep],
    s: &SpecSettings,
    limits: &DraftLimits<'_>,
    proposer: Option<&mut (dyn Proposer + '_)>,
) -> Vec<TokenId> {
    let cap = draft_cap(s, steps, tokens.len()) as u32;
    let s = SpecSettings { max_draft: cap.min(s.max_draft), ..*s };
    let Some(proposer) = proposer else {
        return draft(prompt, tokens, &s, limits);
    };
    let k = draft_len(&s, limits, tokens);
    if k == 0 {
        return Vec::new();
    }
    let mut out = proposer.propose(prompt, tokens, k, limits.stop).unwrap_or_default();
    // A proposer is trusted for nothing the schedule depends on: its answer is held
    // to the step's room and cut before a stop token, as prompt lookup's is.
    out.truncate(k);
    if let Some(cut) = out.iter().position(|t| limits.stop.contains(t)) {
        out.truncate(cut);
    }
    out
}

/// The decode steps that produced `tokens` (after `prompt`), as a run with settings
/// `s` took them: each step's drafts are recomputed from the text before it, and it
/// emitted the drafts that match what followed, plus one. Used to replay a generation
/// in its original shapes on a new placement (only the tokens survive there). Steps
/// end at the last whole one; the step that makes the next token is not included.
pub fn schedule_of(
    prompt: &[TokenId],
    tokens: &[TokenId],
    s: &SpecSettings,
    max_new: usize,
    n_ctx: usize,
    chunk: u32,
    stop: &[TokenId],
) -> Vec<DecodeStep> {
    schedule_of_with(prompt, tokens, s, max_new, n_ctx, chunk, stop, None)
}

/// [`schedule_of`] for a generation that drafted with a draft model: `proposer`, a
/// fresh one, is asked what the original run asked it, step by step, so it proposes
/// what it proposed then and ends holding what the original's held.
#[allow(clippy::too_many_arguments)]
pub fn schedule_of_with(
    prompt: &[TokenId],
    tokens: &[TokenId],
    s: &SpecSettings,
    max_new: usize,
    n_ctx: usize,
    chunk: u32,
    stop: &[TokenId],
    mut proposer: Option<&mut (dyn Proposer + '_)>,
) -> Vec<DecodeStep> {
    let mut steps = Vec::new();
    let mut n = 1;
    while n < tokens.len() {
        let limits = limits_at(prompt.len(), n, max_new, n_ctx, chunk, stop);
        let mut drafts = next_draft_with(prompt, &tokens[..n], &steps, s, &limits, proposer.as_deref_mut());
        let rest = &tokens[n..];
        let accepted = drafts.iter().zip(rest).take_while(|(d, t)| d == t).count();
        // A step emits accepted + 1 tokens; one that would run past the known tokens
        // (not a whole step of the original run) is cut so that it ends with them.
        if accepted + 1 > rest.len() {
            drafts.truncate(rest.len() - 1);
        }
        let emitted = (accepted + 1).min(rest.len());
        steps.push(DecodeStep { n_before: n, drafts });
        n += emitted;
    }
    steps
}

/// The draft limits of the step after `n` emitted tokens.
pub fn limits_at(
    prompt_len: usize,
    n: usize,
    max_new: usize,
    n_ctx: usize,
    chunk: u32,
    stop: &[TokenId],
) -> DraftLimits<'_> {
    // The step's first position is prompt_len + n − 1 (the last emitted token's).
    DraftLimits {
        remaining: max_new.saturating_sub(n),
        context_left: n_ctx.saturating_sub(prompt_len + n),
        chunk,
        stop,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placements_step_cost_is_its_predicted_overhead_per_unit_of_compute() {
        // 50 tok/s = 20 ms a token, 16 of them compute: 4 ms of hops = 0.25 of a pass.
        assert_eq!(step_cost_for(50.0, 16.0), Some(250));
        // Predicted faster than its compute (rounding in the planner): no overhead.
        assert_eq!(step_cost_for(100.0, 12.0), Some(0));
        // A slow link: 2 tok/s with 10 ms of compute is capped.
        assert_eq!(step_cost_for(0.001, 10.0), Some(MAX_COST));
        for (t, c) in [(0.0, 10.0), (50.0, 0.0), (f64::NAN, 1.0), (f64::INFINITY, 1.0), (-1.0, 5.0)] {
            assert_eq!(step_cost_for(t, c), None, "{t} {c}");
        }
        // A dearer step drafts longer (or as long) at the same acceptance.
        let s = SpecSettings { max_draft: 8, position_cost: 450, ..SpecSettings::default() };
        // Eight verify steps of three drafts, one accepted each (acceptance ~0.35).
        let steps: Vec<DecodeStep> =
            (0..8).map(|i| DecodeStep { n_before: 1 + 2 * i, drafts: vec![1, 2, 3] }).collect();
        let n = 1 + 2 * 8;
        let near = draft_cap(&SpecSettings { step_cost: step_cost_for(55.0, 17.5).unwrap(), ..s }, &steps, n);
        let far = draft_cap(&SpecSettings { step_cost: step_cost_for(30.0, 17.5).unwrap(), ..s }, &steps, n);
        assert!(far > near, "{near} {far}");
    }

    fn lim(stop: &[TokenId]) -> DraftLimits<'_> {
        DraftLimits { remaining: 100, context_left: 100, chunk: 16, stop }
    }

    #[test]
    fn lookup_proposes_what_followed_the_most_recent_match() {
        let s =
            SpecSettings { max_draft: 3, ngram_min: 2, ngram_max: 3, position_cost: 0, step_cost: 0, model_cost: 0 };
        // prompt: 1 2 3 4 5 ... 1 2 9 7; text ends with "1 2": the latest "1 2" earlier
        // is followed by 9 7.
        let prompt = [1, 2, 3, 4, 5, 1, 2, 9, 7, 8];
        assert_eq!(draft(&prompt, &[1, 2], &s, &lim(&[])), vec![9, 7, 8]);
        // A longer suffix wins: "5 1 2" occurs once, followed by 9 7 8.
        assert_eq!(draft(&prompt, &[5, 1, 2], &s, &lim(&[])), vec![9, 7, 8]);
        // No match: no draft. Speculation off: no draft.
        assert!(draft(&prompt, &[42, 43], &s, &lim(&[])).is_empty());
        assert!(draft(&prompt, &[1, 2], &SpecSettings::OFF, &lim(&[])).is_empty());
        // The draft stops before a stop token, and within every limit.
        assert_eq!(draft(&prompt, &[1, 2], &s, &lim(&[7])), vec![9]);
        for (remaining, context_left, chunk, want) in [(2, 100, 16, 1), (100, 2, 16, 2), (100, 100, 3, 2), (1, 9, 9, 0)]
        {
            let l = DraftLimits { remaining, context_left, chunk, stop: &[] };
            assert_eq!(draft(&prompt, &[1, 2], &s, &l).len(), want, "{remaining} {context_left} {chunk}");
        }
    }

    #[test]
    fn lookup_runs_up_to_the_end_of_the_text() {
        let s =
            SpecSettings { max_draft: 8, ngram_min: 1, ngram_max: 2, position_cost: 0, step_cost: 0, model_cost: 0 };
        // "7 7" then "7": the match at 0 is followed by the text's own end.
        assert_eq!(draft(&[7, 7], &[7], &s, &lim(&[])), vec![7]);
    }

    struct Fixed(Vec<TokenId>);
    impl TokenSampler for Fixed {
        fn sample(&mut self, _: &[f32]) -> TokenId {
            self.0.remove(0)
        }
    }

    #[test]
    fn verify_emits_accepted_drafts_and_one_more() {
        let logits = vec![0.0; 4 * 3];
        let mut d = LogitsDigest::default();
        // Input [last, 5, 6, 7]: samples 5 (= draft), 6 (= draft), 9 (≠ 7): stop there.
        let got = verify(&mut Fixed(vec![5, 6, 9, 1]), &logits, &[0, 5, 6, 7], &mut d).unwrap();
        assert_eq!(got, vec![5, 6, 9]);
        // Every draft accepted: one more token after them.
        assert_eq!(verify(&mut Fixed(vec![5, 6, 7, 8]), &logits, &[0, 5, 6, 7], &mut d).unwrap(), vec![5, 6, 7, 8]);
        // The first sample differs: one token, as without speculation.
        assert_eq!(verify(&mut Fixed(vec![4]), &logits, &[0, 5, 6, 7], &mut d).unwrap(), vec![4]);
        assert!(verify(&mut Fixed(vec![4]), &logits[..5], &[0, 5, 6, 7], &mut d).is_err());
        // Digests count the sampled rows only.
        let (mut a, mut b) = (LogitsDigest::default(), LogitsDigest::default());
        verify(&mut Fixed(vec![4]), &logits, &[0, 5, 6, 7], &mut a).unwrap();
        b.update(&logits[..3]);
        assert_eq!(a.hex(), b.hex());
    }

    #[test]
    fn the_schedule_is_recovered_from_the_tokens() {
        let fixed =
            SpecSettings { max_draft: 4, ngram_min: 1, ngram_max: 2, position_cost: 0, step_cost: 0, model_cost: 0 };
        let adaptive = SpecSettings { position_cost: 300, step_cost: 100, ..fixed };
        for s in [fixed, adaptive] {
            let prompt = [10, 11, 12, 13, 10, 11, 12, 14];
            let chunk = 16;
            let (max_new, n_ctx) = (12, 64);
            // Run the schedule forward with a "model" that continues a fixed answer.
            let answer = [10, 11, 12, 13, 15, 10, 11, 12, 13, 16, 17, 18];
            let mut tokens = vec![answer[0]];
            let mut steps = Vec::new();
            while tokens.len() < max_new {
                let n = tokens.len();
                let limits = limits_at(prompt.len(), n, max_new, n_ctx, chunk, &[]);
                let drafts = next_draft(&prompt, &tokens, &steps, &s, &limits);
                let mut input = vec![tokens[n - 1]];
                input.extend(&drafts);
                let mut model = Fixed(answer[n..].to_vec());
                let out = verify(&mut model, &vec![0.0; input.len()], &input, &mut LogitsDigest::default()).unwrap();
                steps.push(DecodeStep { n_before: n, drafts });
                tokens.extend(out);
            }
            assert_eq!(tokens, answer);
            assert!(steps.iter().any(|s| s.drafts.len() > 1), "the answer repeats the prompt: drafts were accepted");
            assert!(steps.len() < max_new - 1);
            assert_eq!(schedule_of(&prompt, &tokens, &s, max_new, n_ctx, chunk, &[]), steps, "{s:?}");
        }
        // Without speculation: one step per token.
        let tokens = [1, 2, 3, 4, 5];
        let plain = schedule_of(&[1, 2, 3], &tokens, &SpecSettings::OFF, 12, 64, 16, &[]);
        assert_eq!(plain.len(), tokens.len() - 1);
        assert!(plain.iter().enumerate().all(|(i, s)| s.n_before == i + 1 && s.drafts.is_empty()));
    }

    /// Steps that drafted `d` tokens each and had `a` of them accepted, `n` times.
    fn history(n: usize, d: usize, a: usize) -> (Vec<DecodeStep>, usize) {
        let mut steps = Vec::new();
        let mut at = 1;
        for _ in 0..n {
            steps.push(DecodeStep { n_before: at, drafts: vec![0; d] });
            at += a + 1;
        }
        (steps, at)
    }

    #[test]
    fn the_draft_length_follows_acceptance_and_costs() {
        let s = SpecSettings { max_draft: 8, position_cost: 150, step_cost: 100, ..SpecSettings::default() };
        // Without a cost model: always the most.
        let (steps, n) = history(8, 4, 0);
        assert_eq!(draft_cap(&SpecSettings { position_cost: 0, ..s }, &steps, n), 8);
        // Drafts all accepted: long drafts pay.
        let (steps, n) = history(8, 8, 8);
        assert_eq!(draft_cap(&s, &steps, n), 8);
        // None accepted: none pay.
        let (steps, n) = history(8, 8, 0);
        assert_eq!(draft_cap(&s, &steps, n), 0);
        // Half accepted: a short draft; over a dear link (step cost 3 passes) a longer one.
        let (steps, n) = history(8, 4, 2);
        let (cheap, dear) = (draft_cap(&s, &steps, n), draft_cap(&SpecSettings { step_cost: 3000, ..s }, &steps, n));
        assert!(cheap >= 1 && cheap < dear, "{cheap} {dear}");
        // After 16 steps without drafts, one step drafts again.
        let (mut steps, mut n) = history(8, 8, 0);
        for _ in 0..PROBE_AFTER {
            assert_eq!(draft_cap(&s, &steps, n), 0);
            steps.push(DecodeStep { n_before: n, drafts: vec![] });
            n += 1;
        }
        assert_eq!(draft_cap(&s, &steps, n), 8);
        // With a draft model (each draft costs a pass) the look is one token long; with
        // one so dear that even drafts all accepted would not pay, there is none.
        assert_eq!(draft_cap(&SpecSettings { model_cost: 900, ..s }, &steps, n), 1);
        assert_eq!(draft_cap(&SpecSettings { model_cost: 1000, ..s }, &steps, n), 0);
        let (all, n_all) = history(8, 8, 8);
        assert_eq!(draft_cap(&SpecSettings { model_cost: 1000, ..s }, &all, n_all), 0);
    }

    /// A fake draft model whose answers depend on its history, as a real one's do
    /// (batch shapes): it proposes `(calls so far + text length + i) % 5` and logs
    /// every call.
    #[derive(Default)]
    struct Model {
        calls: Vec<(usize, usize)>,
    }
    impl Proposer for Model {
        fn propose(
            &mut self,
            prompt: &[TokenId],
            tokens: &[TokenId],
            k: usize,
            _: &[TokenId],
        ) -> Result<Vec<TokenId>, ProposeError> {
            let len = prompt.len() + tokens.len();
            self.calls.push((len, k));
            if len.is_multiple_of(7) {
                return Err(ProposeError("full".into()));
            }
            // One more than asked: the caller must hold it to k.
            Ok((0..=k).map(|i| ((self.calls.len() + len + i) % 5) as TokenId).collect())
        }
    }

    #[test]
    fn a_draft_models_proposals_are_held_to_the_step_and_cut_at_stop_tokens() {
        let s =
            SpecSettings { max_draft: 4, ngram_min: 1, ngram_max: 2, position_cost: 0, step_cost: 0, model_cost: 0 };
        let mut m = Model::default();
        // Text of 3: call 1 proposes (1 + 3 + i) % 5 = 4 0 1 2 (and one more, dropped).
        assert_eq!(next_draft_with(&[9, 9], &[9], &[], &s, &lim(&[]), Some(&mut m)), vec![4, 0, 1, 2]);
        // Within the step's room (2 of the 1 2 3 proposed), and before a stop token.
        let l = DraftLimits { remaining: 3, ..lim(&[2]) };
        assert_eq!(next_draft_with(&[9, 9], &[9, 9], &[], &s, &l, Some(&mut m)), vec![1]);
        assert_eq!(m.calls, vec![(3, 4), (4, 2)]);
        // An error is a step without drafts; no room asks nothing.
        assert!(next_draft_with(&[9; 6], &[9], &[], &s, &lim(&[]), Some(&mut m)).is_empty());
        let l = DraftLimits { remaining: 1, ..lim(&[]) };
        assert!(next_draft_with(&[9], &[9], &[], &s, &l, Some(&mut m)).is_empty());
        assert_eq!(m.calls.len(), 3);
        // Without a model, prompt lookup as before.
        assert_eq!(next_draft_with(&[5, 6, 5], &[6], &[], &s, &lim(&[]), None), vec![5, 6]);
    }

    /// A resumed generation rebuilds its schedule by asking a fresh draft model what
    /// the original run asked: the same calls, so the same drafts, step by step.
    #[test]
    fn a_schedule_rebuilt_with_a_draft_model_asks_it_what_the_run_asked() {
        let s =
            SpecSettings { max_draft: 3, position_cost: 300, step_cost: 200, model_cost: 100, ..Default::default() };
        let prompt = [1, 2, 3, 4];
        let (max_new, n_ctx, chunk) = (40, 100, 8);
        // The original run: the "target" emits (position × 3) % 5, so drafts are
        // accepted at times and rejected at others.
        let mut model = Model::default();
        let target = |pos: usize| ((pos * 3) % 5) as TokenId;
        let mut tokens = vec![target(prompt.len())];
        let mut steps = Vec::new();
        while tokens.len() < max_new {
            let limits = limits_at(prompt.len(), tokens.len(), max_new, n_ctx, chunk, &[]);
            let drafts = next_draft_with(&prompt, &tokens, &steps, &s, &limits, Some(&mut model));
            let n = tokens.len();
            let mut emitted = Vec::new();
            for d in drafts.iter().map(Some).chain(std::iter::once(None)) {
                let t = target(prompt.len() + n + emitted.len());
                emitted.push(t);
                if d != Some(&t) {
                    break;
                }
            }
            steps.push(DecodeStep { n_before: n, drafts });
            tokens.extend(emitted);
        }
        tokens.truncate(max_new);
        let (drafted, accepted) = tally(&steps, tokens.len());
        assert!(accepted > 0 && accepted < drafted, "{accepted}/{drafted}: the test needs both outcomes");
        for cut in [2, 17, tokens.len()] {
            let mut fresh = Model::default();
            let rebuilt = schedule_of_with(&prompt, &tokens[..cut], &s, max_new, n_ctx, chunk, &[], Some(&mut fresh));
            let whole = steps.iter().take_while(|st| st.n_before < cut).count();
            assert_eq!(rebuilt[..whole.min(rebuilt.len())], steps[..whole.min(rebuilt.len())], "cut at {cut}");
            assert_eq!(fresh.calls[..], model.calls[..fresh.calls.len()], "cut at {cut}");
        }
        // Without the model the rebuilt schedule is prompt lookup's, another one.
        assert_ne!(schedule_of(&prompt, &tokens, &s, max_new, n_ctx, chunk, &[]), steps);
    }

    /// A seeded sampler drawing from softmax(logits) (temperature 1).
    struct Draw(u64);
    impl Draw {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }
    impl TokenSampler for Draw {
        fn sample(&mut self, logits: &[f32]) -> TokenId {
            let max = logits.iter().copied().fold(f32::MIN, f32::max);
            let w: Vec<f64> = logits.iter().map(|l| f64::from(l - max).exp()).collect();
            let mut u = self.uniform() * w.iter().sum::<f64>();
            for (i, x) in w.iter().enumerate() {
                if u < *x {
                    return i as TokenId;
                }
                u -= x;
            }
            (w.len() - 1) as TokenId
        }
    }

    /// The fake model: a Markov chain over 4 tokens, p(next | this token).
    const P: [[f64; 4]; 4] = [[0.1, 0.6, 0.2, 0.1], [0.05, 0.15, 0.7, 0.1], [0.3, 0.1, 0.2, 0.4], [0.5, 0.2, 0.2, 0.1]];

    /// Chi-square statistic of `n` sequences of 3 tokens after token 0, generated with
    /// prompt-lookup drafts and `rule` deciding what a verify step emits, against the
    /// chain's exact distribution (64 outcomes).
    fn chi_square(n: usize, rule: impl Fn(&mut Draw, &[f32], &[TokenId]) -> Vec<TokenId>) -> f64 {
        // The prompt cycles 0 1 2 3, so lookup drafts the cycle (often right: P favours
        // it, sometimes wrong).
        let prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0];
        let s =
            SpecSettings { max_draft: 2, ngram_min: 1, ngram_max: 2, position_cost: 0, step_cost: 0, model_cost: 0 };
        let mut rng = Draw(0x9E37_79B9_7F4A_7C15);
        let mut counts = [0usize; 64];
        let logits_of = |t: TokenId| P[t as usize].iter().map(|p| p.ln() as f32).collect::<Vec<f32>>();
        for _ in 0..n {
            let mut tokens = vec![rng.sample(&logits_of(0))];
            while tokens.len() < 3 {
                let limits = DraftLimits { remaining: 3 - tokens.len(), context_left: 99, chunk: 8, stop: &[] };
                let drafts = draft(&prompt, &tokens, &s, &limits);
                let mut input = vec![*tokens.last().unwrap()];
                input.extend(&drafts);
                // Row i is the model's distribution after input[i].
                let rows: Vec<f32> = input.iter().flat_map(|&t| logits_of(t)).collect();
                tokens.extend(rule(&mut rng, &rows, &input));
            }
            counts[(tokens[0] * 16 + tokens[1] * 4 + tokens[2]) as usize] += 1;
        }
        let mut chi = 0.0;
        for (i, &c) in counts.iter().enumerate() {
            let (a, b, c2) = (i / 16, i / 4 % 4, i % 4);
            let expected = n as f64 * P[0][a] * P[a][b] * P[b][c2];
            chi += (c as f64 - expected).powi(2) / expected;
        }
        chi
    }

    /// The verify rule keeps the model's distribution for sampled requests: sequences
    /// generated with drafts follow the exact target distribution. Fixed seed; the
    /// tolerance is the chi-square critical value for 63 degrees of freedom at
    /// p = 0.001 (103.4). A rule that accepts every draft is caught by the same test.
    #[test]
    fn sampled_verification_keeps_the_target_distribution() {
        let n = 200_000;
        let verified =
            chi_square(n, |rng, rows, input| verify(rng, rows, input, &mut LogitsDigest::default()).unwrap());
        assert!(verified < 103.4, "chi-square {verified:.1} over 63 degrees of freedom");
        let wrong = chi_square(n, |rng, rows, input| {
            let mut out = input[1..].to_vec();
            out.push(rng.sample(&rows[rows.len() - 4..]));
            out
        });
        assert!(wrong > 1000.0, "accepting every draft must be caught: chi-square {wrong:.1}");
        eprintln!("chi-square over 63 degrees of freedom: {verified:.1} (verify rule), {wrong:.1} (accept all)");
    }

    #[test]
    fn a_draft_models_price_applies_where_a_cost_model_chooses_k() {
        let adaptive = SpecSettings::default();
        assert_eq!(adaptive.priced_for(800).model_cost, 800);
        // Priced by the request, k fixed, or off: unchanged.
        let priced = SpecSettings { model_cost: 30, ..adaptive };
        assert_eq!(priced.priced_for(800), priced);
        let fixed = SpecSettings { position_cost: 0, step_cost: 0, ..adaptive };
        assert_eq!(fixed.priced_for(800), fixed);
        assert_eq!(SpecSettings::OFF.priced_for(800), SpecSettings::OFF);
        // And the price shortens drafts: a dear draft model drafts less at the same acceptance.
        let steps: Vec<DecodeStep> =
            (0..8).map(|i| DecodeStep { n_before: 1 + 3 * i, drafts: vec![1, 2, 3] }).collect();
        let (cheap, dear) =
            (draft_cap(&adaptive.priced_for(10), &steps, 25), draft_cap(&adaptive.priced_for(900), &steps, 25));
        assert!(dear < cheap, "{cheap} {dear}");
    }

    #[test]
    fn settings_are_bounded() {
        assert!(SpecSettings::default().validate().is_ok());
        assert_eq!(SpecSettings { max_draft: 33, ..Default::default() }.validate(), Err(SpecError::Draft(33)));
        for (a, b) in [(0, 2), (3, 2), (2, 9)] {
            let s = SpecSettings { ngram_min: a, ngram_max: b, ..Default::default() };
            assert_eq!(s.validate(), Err(SpecError::Ngram(a, b)));
        }
    }
}
