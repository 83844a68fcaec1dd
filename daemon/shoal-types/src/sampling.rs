//! A generation's sampling parameters and the one check that keeps a request sane
//! before any engine sees it (llama.cpp trusts its arguments: a `repeat_last_n` of
//! two billion makes its penalties sampler allocate 8 GiB).

use serde::{Deserialize, Serialize};

/// Longest repetition window accepted, in tokens. llama.cpp's penalties sampler keeps
/// a ring of this many tokens (4 bytes each) and a count per distinct token in it, so
/// the bound is what keeps a request from allocating gigabytes; 64 Ki tokens is as long
/// as the longest contexts in common use. A fixed bound rather than the context, so the
/// default window (64) stays valid for small contexts.
pub const MAX_REPEAT_LAST_N: i32 = 1 << 16;

/// Largest `top_k` accepted. Larger than any vocabulary (llama.cpp clamps k to the
/// vocabulary anyway), so a bigger value can only be a client's mistake.
pub const MAX_TOP_K: i32 = 1 << 20;

/// Most repetitions a grammar may ask for in all: the sum over its `{m,n}` counts
/// (`n`, or `m + 1` for `{m,}`). llama.cpp expands each count into that many rules
/// when it builds the sampler, so a 64 KiB grammar of 1,000 `char{0,1999}` would make
/// millions of rules, hundreds of MB and a long stall of the stage that builds it; the
/// JSON building blocks use 54, a schema with ten strings of `maxLength` 1,000 about
/// 10,000.
pub const MAX_GRAMMAR_REPETITIONS: u64 = 20_000;

/// The repetitions `grammar` (GBNF) asks for in all (see [`MAX_GRAMMAR_REPETITIONS`]):
/// its `{m}`, `{m,n}` and `{m,}` counts outside string literals, character classes and
/// comments, added up (saturating).
pub fn grammar_repetitions(grammar: &str) -> u64 {
    let mut total: u64 = 0;
    let mut chars = grammar.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            // A literal or a class: up to its unescaped end.
            '"' | '[' => {
                let end = if c == '"' { '"' } else { ']' };
                while let Some(d) = chars.next() {
                    match d {
                        '\\' => {
                            chars.next();
                        }
                        d if d == end => break,
                        _ => {}
                    }
                }
            }
            '#' => {
                for d in chars.by_ref() {
                    if d == '\n' {
                        break;
                    }
                }
            }
            '{' => {
                let number = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
                    let mut n: Option<u64> = None;
                    while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                        n = Some(n.unwrap_or(0).saturating_mul(10).saturating_add(u64::from(d)));
                        chars.next();
                    }
                    n
                };
                let min = number(&mut chars).unwrap_or(0);
                let count = if chars.peek() == Some(&',') {
                    chars.next();
                    number(&mut chars).unwrap_or(min.saturating_add(1))
                } else {
                    min
                };
                total = total.saturating_add(count);
            }
            _ => {}
        }
    }
    total
}

/// Longest grammar accepted, in bytes (a JSON schema's grammar is a few KiB).
pub const MAX_GRAMMAR_BYTES: usize = 64 << 10;

/// How to sample. The defaults are greedy decoding: the most likely token, always.
///
/// This is the wire form too: the control protocol carries it as a JSON object (every
/// field optional, unknown fields refused).
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
    /// Window of the repetition penalties, in tokens (0: off; at most [`MAX_REPEAT_LAST_N`]).
    pub repeat_last_n: i32,
    /// Subtracted from a token's logit once per time it occurs in the window (OpenAI's
    /// `frequency_penalty`; 0: off; -2 to 2).
    #[serde(skip_serializing_if = "is_zero")]
    pub frequency_penalty: f32,
    /// Subtracted from the logit of every token that occurs in the window (OpenAI's
    /// `presence_penalty`; 0: off; -2 to 2).
    #[serde(skip_serializing_if = "is_zero")]
    pub presence_penalty: f32,
    /// Random seed: the same seed and inputs give the same tokens.
    pub seed: u32,
    /// A GBNF grammar (llama.cpp's format, start rule `root`) every sampled token must
    /// keep the text within: JSON output, a JSON schema. Checked by the tail when it
    /// builds its sampler (llama.cpp parses it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// Report each sampled token's log-probability and this many most likely
    /// alternatives (0 to [`MAX_TOP_LOGPROBS`]), from the model's logits before any
    /// sampler changes them (OpenAI's `logprobs`/`top_logprobs`). `None`: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
}

/// Most alternatives a token's log-probabilities list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The log-probability of a token the model gives no chance (OpenAI's answers use
/// -9999 for it too).
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// A sampled token's log-probability and the most likely tokens at its step, in the
/// model's distribution (log-softmax of the logits): what the tail reports when a
/// request asks for [`SamplingParams::logprobs`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The sampled token's natural-log probability.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (ties: lower id first).
    pub top: Vec<(crate::TokenId, f32)>,
}

impl TokenLogprobs {
    /// The log-probability of `token` and the `top` most likely tokens under `logits`
    /// (one value per vocabulary entry). Every value is finite, in
    /// [`LOGPROB_FLOOR`, 0] (JSON has no infinities): a token the model gives no chance
    /// (a -inf or NaN logit, or one outside the vocabulary) gets the floor.
    pub fn of(logits: &[f32], token: crate::TokenId, top: usize) -> TokenLogprobs {
        // log-softmax over the finite logits: x - max - ln(sum(exp(x - max))), in f64
        // for a stable sum. (A +inf logit would be certain: it gets 0.)
        let max = logits.iter().copied().filter(|x| x.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().filter(|x| x.is_finite()).map(|&x| (f64::from(x) - f64::from(max)).exp()).sum();
        let log_z = f64::from(max) + sum.ln();
        let lp = |x: f32| {
            let v = f64::from(x) - log_z;
            if v.is_nan() {
                LOGPROB_FLOOR
            } else {
                v.clamp(f64::from(LOGPROB_FLOOR), 0.0) as f32
            }
        };
        let logprob = usize::try_from(token).ok().and_then(|i| logits.get(i)).map_or(LOGPROB_FLOOR, |&x| lp(x));
        // The `top` best in one pass (a small sorted list), not a sort of the vocabulary.
        let mut best: Vec<(crate::TokenId, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &x) in logits.iter().enumerate() {
                if x.is_nan() || (best.len() == top && x <= best[top - 1].1) {
                    continue;
                }
                let at = best.partition_point(|&(_, b)| b >= x);
                best.insert(at, (i as crate::TokenId, x));
                best.truncate(top);
            }
        }
        TokenLogprobs { logprob, top: best.into_iter().map(|(t, x)| (t, lp(x))).collect() }
    }
}

/// Leaves an unused penalty off the wire (a node without it still reads the request).
fn is_zero(v: &f32) -> bool {
    *v == 0.0
}

/// Largest frequency or presence penalty, either sign (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            grammar: None,
            logprobs: None,
        }
    }
}

/// Why a generation request is refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GenerationError {
    /// No prompt token.
    #[error("empty prompt: there is nothing to generate from")]
    EmptyPrompt,
    /// `max_tokens` (the request's `max_new`) is 0.
    #[error("max_tokens is 0: nothing to generate")]
    NothingToGenerate,
    /// The prompt alone does not fit the context.
    #[error("the prompt of {prompt} tokens exceeds the context of {n_ctx} tokens")]
    PromptOverContext {
        /// Prompt tokens.
        prompt: usize,
        /// The context (positions per session).
        n_ctx: u32,
    },
    /// The prompt fits, but not with `max_new` tokens after it.
    #[error(
        "prompt of {prompt} tokens + {max_new} new tokens exceeds the context of {n_ctx} \
         (at most {room} new tokens fit after this prompt)"
    )]
    AnswerOverContext {
        /// Prompt tokens.
        prompt: usize,
        /// New tokens asked for.
        max_new: u32,
        /// The context (positions per session).
        n_ctx: u32,
        /// New tokens that would fit.
        room: usize,
    },
    /// Negative, NaN or infinite temperature.
    #[error("temperature {0} is not a finite number ≥ 0 (0 is greedy)")]
    Temperature(f32),
    /// Negative or absurd `top_k`.
    #[error("top_k {0} is outside 0 (off) ..= {MAX_TOP_K}")]
    TopK(i32),
    /// `top_p` outside [0, 1] or NaN.
    #[error("top_p {0} is outside [0, 1] (1 is off)")]
    TopP(f32),
    /// `min_p` outside [0, 1] or NaN.
    #[error("min_p {0} is outside [0, 1] (0 is off)")]
    MinP(f32),
    /// Zero, negative, NaN or infinite repetition penalty (llama.cpp divides by it).
    #[error("repeat_penalty {0} is not a finite number > 0 (1 is off)")]
    RepeatPenalty(f32),
    /// A repetition window below 0 or over [`MAX_REPEAT_LAST_N`]. llama.cpp's tools
    /// read -1 as "the whole context", but its sampler silently turns -1 into 0 (off);
    /// rather than guess, the window must be given as a number.
    #[error(
        "repeat_last_n {0} is outside 0 (off) ..= {MAX_REPEAT_LAST_N}; \
         give the window in tokens (-1 for the whole context is not accepted)"
    )]
    RepeatLastN(i32),
    /// A frequency or presence penalty outside -2..=2 or NaN.
    #[error("{name} {value} is outside -{MAX_PENALTY} ..= {MAX_PENALTY} (0 is off)")]
    Penalty {
        /// `frequency_penalty` or `presence_penalty`.
        name: &'static str,
        /// What was given.
        value: f32,
    },
    /// The grammar is longer than [`MAX_GRAMMAR_BYTES`] or empty.
    #[error("a grammar must be 1 to {MAX_GRAMMAR_BYTES} bytes, not {0}")]
    Grammar(usize),
    /// The grammar asks for more repetitions than [`MAX_GRAMMAR_REPETITIONS`].
    #[error(
        "the grammar's repetition counts add up to {0} (at most {MAX_GRAMMAR_REPETITIONS}: lower maxLength, maxItems or the {{m,n}} counts)"
    )]
    GrammarRepetitions(u64),
    /// More alternatives asked for than [`MAX_TOP_LOGPROBS`].
    #[error("top_logprobs {0} is outside 0 ..= {MAX_TOP_LOGPROBS}")]
    TopLogprobs(u32),
}

impl SamplingParams {
    /// Check every parameter against what the sampler can take without misbehaving or
    /// allocating more than a stated bound.
    pub fn validate(&self) -> Result<(), GenerationError> {
        // `!(x >= 0)` and friends are written so that NaN fails them.
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(GenerationError::Temperature(self.temperature));
        }
        if !(0..=MAX_TOP_K).contains(&self.top_k) {
            return Err(GenerationError::TopK(self.top_k));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(GenerationError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(GenerationError::MinP(self.min_p));
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return Err(GenerationError::RepeatPenalty(self.repeat_penalty));
        }
        // The penalties sampler allocates a ring of `repeat_last_n` tokens up front.
        if !(0..=MAX_REPEAT_LAST_N).contains(&self.repeat_last_n) {
            return Err(GenerationError::RepeatLastN(self.repeat_last_n));
        }
        for (name, value) in
            [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)]
        {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&value) {
                return Err(GenerationError::Penalty { name, value });
            }
        }
        if let Some(g) = &self.grammar {
            if g.is_empty() || g.len() > MAX_GRAMMAR_BYTES {
                return Err(GenerationError::Grammar(g.len()));
            }
            let n = grammar_repetitions(g);
            if n > MAX_GRAMMAR_REPETITIONS {
                return Err(GenerationError::GrammarRepetitions(n));
            }
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(GenerationError::TopLogprobs(n));
        }
        Ok(())
    }
}

/// The check every generation passes before an engine is touched: the request's shape
/// (a prompt, something to generate, both within the context of `n_ctx` positions per
/// session) and then its sampling parameters ([`SamplingParams::validate`]).
pub fn validate_generation(
    params: &SamplingParams,
    prompt_len: usize,
    max_new: u32,
    n_ctx: u32,
) -> Result<(), GenerationError> {
    if prompt_len == 0 {
        return Err(GenerationError::EmptyPrompt);
    }
    if max_new == 0 {
        return Err(GenerationError::NothingToGenerate);
    }
    let n_ctx_len = n_ctx as usize;
    if prompt_len >= n_ctx_len {
        // A prompt that fills the context leaves no position for a new token either.
        return Err(GenerationError::PromptOverContext { prompt: prompt_len, n_ctx });
    }
    let room = n_ctx_len - prompt_len;
    if max_new as usize > room {
        return Err(GenerationError::AnswerOverContext { prompt: prompt_len, max_new, n_ctx, room });
    }
    params.validate()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: u32 = 256;

    fn check(p: SamplingParams) -> Result<(), GenerationError> {
        validate_generation(&p, 10, 20, CTX)
    }

    #[test]
    fn a_grammars_repetitions_are_counted_outside_literals_classes_and_comments() {
        assert_eq!(
            grammar_repetitions("root ::= [a-z]{2,5} x{3} y{4,} \"{9}\" [{]{1} # z{100}\nw{0,2}"),
            5 + 3 + 5 + 1 + 2
        );
        assert_eq!(grammar_repetitions("s ::= \"\\\"{7}\" t{1}"), 1);
        assert_eq!(grammar_repetitions("x{99999999999999999999999}"), u64::MAX);
        assert_eq!(grammar_repetitions("x{"), 0);
    }

    #[test]
    fn defaults_and_edges_are_accepted() {
        assert_eq!(check(SamplingParams::default()), Ok(()));
        let edges = SamplingParams {
            temperature: 0.0,
            top_k: MAX_TOP_K,
            top_p: 0.0,
            min_p: 1.0,
            repeat_penalty: f32::MIN_POSITIVE,
            repeat_last_n: MAX_REPEAT_LAST_N,
            frequency_penalty: -MAX_PENALTY,
            presence_penalty: MAX_PENALTY,
            seed: u32::MAX,
            grammar: Some("x".repeat(MAX_GRAMMAR_BYTES)),
            logprobs: Some(MAX_TOP_LOGPROBS),
        };
        assert_eq!(check(edges), Ok(()));
        for g in [String::new(), "x".repeat(MAX_GRAMMAR_BYTES + 1)] {
            let n = g.len();
            assert_eq!(
                check(SamplingParams { grammar: Some(g), ..Default::default() }),
                Err(GenerationError::Grammar(n))
            );
        }
        let off = SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.0, repeat_last_n: 0, ..Default::default() };
        assert_eq!(check(off), Ok(()));
        // The review's schema (F14) as a grammar: 1,000 strings of up to 1,999
        // characters fit in 64 KiB and would make millions of rules.
        let many: String = (0..1000).map(|i| format!("p{i} ::= \"\\\"\" char{{0,1999}} \"\\\"\"\n")).collect();
        assert!(many.len() <= MAX_GRAMMAR_BYTES);
        assert_eq!(
            check(SamplingParams { grammar: Some(many), ..Default::default() }),
            Err(GenerationError::GrammarRepetitions(1_999_000))
        );
        // The default window is valid whatever the context.
        assert_eq!(validate_generation(&SamplingParams::default(), 1, 7, 8), Ok(()));
        // Prompt plus answer exactly filling the context is fine.
        assert_eq!(validate_generation(&SamplingParams::default(), 200, 56, CTX), Ok(()));
    }

    #[test]
    fn penalties_outside_plus_minus_two_or_nan_are_refused_and_unused_ones_stay_off_the_wire() {
        for v in [2.01, -2.01, f32::NAN, f32::INFINITY] {
            let e = check(SamplingParams { frequency_penalty: v, ..Default::default() }).unwrap_err();
            assert!(matches!(e, GenerationError::Penalty { name: "frequency_penalty", .. }), "{v}: {e}");
            let e = check(SamplingParams { presence_penalty: v, ..Default::default() }).unwrap_err();
            assert!(matches!(e, GenerationError::Penalty { name: "presence_penalty", .. }), "{v}: {e}");
        }
        let wire = serde_json::to_value(SamplingParams::default()).unwrap();
        assert!(wire.get("frequency_penalty").is_none() && wire.get("presence_penalty").is_none(), "{wire}");
        let p = SamplingParams { presence_penalty: 0.5, ..Default::default() };
        let back: SamplingParams = serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn huge_repeat_last_n_is_refused() {
        for value in [i32::MAX, MAX_REPEAT_LAST_N + 1, 1 << 20] {
            let p = SamplingParams { repeat_last_n: value, ..Default::default() };
            assert_eq!(check(p), Err(GenerationError::RepeatLastN(value)));
        }
    }

    #[test]
    fn negative_repeat_last_n_is_refused() {
        for value in [-1, i32::MIN] {
            let e = check(SamplingParams { repeat_last_n: value, ..Default::default() }).unwrap_err();
            assert_eq!(e, GenerationError::RepeatLastN(value));
            assert!(e.to_string().contains("-1 for the whole context is not accepted"), "{e}");
        }
    }

    #[test]
    fn negative_or_absurd_top_k_is_refused() {
        for k in [-1, i32::MIN, MAX_TOP_K + 1, i32::MAX] {
            assert_eq!(check(SamplingParams { top_k: k, ..Default::default() }), Err(GenerationError::TopK(k)));
        }
    }

    #[test]
    fn top_p_outside_unit_interval_or_nan_is_refused() {
        for p in [-0.1, 1.01, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = check(SamplingParams { top_p: p, ..Default::default() }).unwrap_err();
            assert!(matches!(e, GenerationError::TopP(_)), "{p}: {e}");
        }
    }

    #[test]
    fn min_p_outside_unit_interval_or_nan_is_refused() {
        for p in [-0.1, 1.01, f32::NAN, f32::INFINITY] {
            let e = check(SamplingParams { min_p: p, ..Default::default() }).unwrap_err();
            assert!(matches!(e, GenerationError::MinP(_)), "{p}: {e}");
        }
    }

    #[test]
    fn negative_nan_or_infinite_temperature_is_refused() {
        for t in [-0.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = check(SamplingParams { temperature: t, ..Default::default() }).unwrap_err();
            assert!(matches!(e, GenerationError::Temperature(_)), "{t}: {e}");
        }
    }

    #[test]
    fn non_positive_nan_or_infinite_repeat_penalty_is_refused() {
        for r in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = check(SamplingParams { repeat_penalty: r, ..Default::default() }).unwrap_err();
            assert!(matches!(e, GenerationError::RepeatPenalty(_)), "{r}: {e}");
        }
    }

    #[test]
    fn zero_max_tokens_is_refused() {
        assert_eq!(
            validate_generation(&SamplingParams::default(), 10, 0, CTX),
            Err(GenerationError::NothingToGenerate)
        );
    }

    #[test]
    fn empty_prompt_is_refused() {
        assert_eq!(validate_generation(&SamplingParams::default(), 0, 5, CTX), Err(GenerationError::EmptyPrompt));
    }

    #[test]
    fn prompt_over_context_is_refused_and_says_so() {
        for len in [CTX as usize, CTX as usize + 1, usize::MAX] {
            let e = validate_generation(&SamplingParams::default(), len, 1, CTX).unwrap_err();
            assert_eq!(e, GenerationError::PromptOverContext { prompt: len, n_ctx: CTX });
        }
    }

    #[test]
    fn prompt_plus_max_tokens_over_context_is_refused_and_says_how_many_fit() {
        let e = validate_generation(&SamplingParams::default(), 200, u32::MAX, CTX).unwrap_err();
        assert_eq!(e, GenerationError::AnswerOverContext { prompt: 200, max_new: u32::MAX, n_ctx: CTX, room: 56 });
        assert!(e.to_string().contains("exceeds the context of 256 (at most 56 new tokens fit"), "{e}");
        let e = validate_generation(&SamplingParams::default(), 200, 57, CTX).unwrap_err();
        assert!(matches!(e, GenerationError::AnswerOverContext { room: 56, .. }), "{e}");
    }

    #[test]
    fn unknown_sampling_fields_are_refused_on_the_wire() {
        let e = serde_json::from_str::<SamplingParams>(r#"{"repeat_last_n": 8, "mirostat": 2}"#).unwrap_err();
        assert!(e.to_string().contains("mirostat"), "{e}");
        let p: SamplingParams = serde_json::from_str(r#"{"repeat_last_n": 8}"#).unwrap();
        assert_eq!(p, SamplingParams { repeat_last_n: 8, ..Default::default() });
    }

    #[test]
    fn logprobs_are_the_log_softmax_with_the_best_alternatives_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        let lp = TokenLogprobs::of(&logits, 2, 3);
        // log-softmax over the numbers (NaN counts for nothing).
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0, -1.0].iter().map(|x| x.exp()).sum::<f64>().ln();
        assert!((f64::from(lp.logprob) - (2.0 - z)).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2], "ties keep the lower id first");
        assert!((f64::from(lp.top[0].1) - (3.0 - z)).abs() < 1e-6);
        let p: f64 = logits.iter().filter(|x| !x.is_nan()).map(|&x| (f64::from(x) - z).exp()).sum();
        assert!((p - 1.0).abs() < 1e-9);
        assert!(TokenLogprobs::of(&logits, 4, 0).top.is_empty());
        assert_eq!(TokenLogprobs::of(&logits, 4, 0).logprob, LOGPROB_FLOOR, "NaN logit");
        assert_eq!(TokenLogprobs::of(&logits, 99, 1).logprob, LOGPROB_FLOOR, "outside the vocabulary");
        // Infinities give finite values (they travel as JSON): -inf the floor, +inf 0.
        let odd = [f32::NEG_INFINITY, 1.0, f32::INFINITY];
        let lp = TokenLogprobs::of(&odd, 0, 3);
        assert_eq!(lp.logprob, LOGPROB_FLOOR);
        assert_eq!(lp.top[0], (2, 0.0));
        assert!(lp.top.iter().all(|t| t.1.is_finite()), "{lp:?}");
        let json = serde_json::to_string(&lp).unwrap();
        assert_eq!(serde_json::from_str::<TokenLogprobs>(&json).unwrap(), lp, "round-trips as JSON");
        assert!(TokenLogprobs::of(&[f32::NAN; 3], 1, 2).top.iter().all(|t| t.1 == LOGPROB_FLOOR));
        assert_eq!(TokenLogprobs::of(&logits, 0, 50).top.len(), 5, "at most the vocabulary");
        // Asked for more than OpenAI's 20: refused before any node sees it.
        let p = SamplingParams { logprobs: Some(21), ..Default::default() };
        assert_eq!(check(p), Err(GenerationError::TopLogprobs(21)));
        assert!(!serde_json::to_string(&SamplingParams::default()).unwrap().contains("logprobs"));
    }
}
