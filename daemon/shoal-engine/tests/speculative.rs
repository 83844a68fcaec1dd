//! Speculative decoding on real models, in process: a model split into stages gives the
//! unsplit model's tokens and logits digest with the same draft/verify schedule, and a
//! rejected draft leaves nothing behind in any stage's KV cache.

mod common;
use common::{hidden, logits, model};
use shoal_engine::{load_split, Chain, DraftModel, Sampler, SamplingParams, ShardCache, StageConfig, Vocab};
use shoal_types::{SessionId, SpecSettings, Stage, StageInput, TokenId};
use std::path::Path;

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";
const NEW_TOKENS: usize = 64;

fn config() -> StageConfig {
    StageConfig { n_ctx_per_session: 512, max_sessions: 2, chunk: 32, threads: 1, gpu_layers: 0, gpus: Vec::new() }
}

const PARAGRAPH: &str = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops \
    to guide ships into harbour. The Pharos of Alexandria, built in the third century BC, stood over a \
    hundred metres tall and was counted among the wonders of the ancient world.";

/// A prompt asking for a copy, so prompt lookup's drafts are often right.
fn copy_prompt(file: &Path) -> Vec<TokenId> {
    let vocab = Vocab::load(file).unwrap();
    vocab.tokenize(&format!("Copy this paragraph.\n\n{PARAGRAPH}\n\nCopy:\n\n{}", &PARAGRAPH[..30]), false)
}

/// (tokens, digest, decode steps, drafted, accepted) of a greedy run split at `points`.
fn run(
    file: &Path,
    points: &[u32],
    cache: &ShardCache,
    spec: &SpecSettings,
) -> (Vec<TokenId>, String, usize, usize, usize) {
    let (_, stages) = load_split(file, points, cache, &config()).unwrap();
    let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect()).unwrap();
    let sampler = &mut Sampler::new(&SamplingParams::default());
    let g =
        chain.generate_speculative(SessionId(1), &copy_prompt(file), NEW_TOKENS, sampler, &mut (), spec, &[]).unwrap();
    assert_eq!(g.tokens.len(), NEW_TOKENS);
    (g.tokens, g.logits_digest, g.decode_steps, g.drafted, g.accepted)
}

fn assert_speculative_splits_match(file: &Path, splits: &[&[u32]]) {
    let dir = tempfile::tempdir().unwrap();
    let cache = ShardCache::new(dir.path());
    let spec = SpecSettings { max_draft: 6, ..SpecSettings::default() };
    let whole = run(file, &[], &cache, &spec);
    let (_, _, steps, drafted, accepted) = whole;
    let name = file.file_name().unwrap().to_string_lossy();
    assert!(accepted > 0 && steps < NEW_TOKENS - 1, "{name}: no draft accepted ({drafted} drafted)");
    for points in splits {
        assert_eq!(run(file, points, &cache, &spec), whole, "{name} split at {points:?} differs from unsplit");
    }
    // Against the same model without speculation: how often near-ties in verify batches
    // change a greedy token (informational; DESIGN point 10).
    let plain = run(file, &[], &cache, &SpecSettings::OFF);
    let first_diff = plain.0.iter().zip(&whole.0).position(|(a, b)| a != b);
    eprintln!(
        "{name}: {steps} steps for {NEW_TOKENS} tokens, {accepted}/{drafted} drafts accepted; \
         first token that differs from the non-speculative run: {first_diff:?}"
    );
}

#[test]
fn smollm2_speculative_split_matches_unsplit() {
    assert_speculative_splits_match(&model(SMOL), &[&[15], &[10, 20]]);
}

#[test]
fn gemma3_speculative_split_matches_unsplit() {
    assert_speculative_splits_match(&model(GEMMA), &[&[6], &[6, 12]]);
}

/// After a verify step whose last drafts were rejected, every stage holds exactly the
/// accepted positions: two sessions verify the same accepted prefix followed by
/// different rejected drafts, continue from the first rejected position, and get
/// bit-identical logits (a leftover of a rejected draft would change them). The
/// accepted rows of both verify batches are identical too.
#[test]
fn a_rejected_draft_leaves_nothing_behind() {
    let file = model(SMOL);
    let dir = tempfile::tempdir().unwrap();
    let cache = ShardCache::new(dir.path());
    let (_, mut stages) = load_split(&file, &[10, 20], &cache, &config()).unwrap();
    let prompt = copy_prompt(&file);
    let n_vocab = stages[2].info().n_vocab as usize;
    // Run `tokens` at `pos` through the three stages; every row's logits when `all`.
    let mut step = |s: SessionId, pos: u32, tokens: &[TokenId], all: bool| -> Vec<f32> {
        let h = hidden(stages[0].forward_rows(s, pos, StageInput::Tokens(tokens), all).unwrap());
        let h = hidden(stages[1].forward_rows(s, pos, StageInput::Hidden(&h), all).unwrap());
        logits(stages[2].forward_rows(s, pos, StageInput::Hidden(&h), all).unwrap())
    };
    let p = prompt.len() as u32;
    let (last, accepted) = (prompt[5], prompt[6]);
    let mut after = Vec::new();
    let mut accepted_rows = Vec::new();
    for (i, rejected) in [[101, 102, 103], [7, 8, 9]].iter().enumerate() {
        let s = SessionId(i as u64 + 1);
        for (k, c) in prompt.chunks(32).enumerate() {
            step(s, 32 * k as u32, c, false);
        }
        // Verify [last, accepted, rejected…] at p: 5 rows of logits.
        let rows = step(s, p, &[last, accepted, rejected[0], rejected[1], rejected[2]], true);
        assert_eq!(rows.len(), 5 * n_vocab);
        accepted_rows.push(rows[..2 * n_vocab].to_vec());
        // The next step starts after the accepted positions (p, p + 1): the stages drop
        // the rejected ones themselves (the Stage contract).
        after.push(step(s, p + 2, &[42], false));
        after.push(step(s, p + 3, &[43, 44], true));
    }
    assert_eq!(accepted_rows[0], accepted_rows[1], "the accepted rows depend on the rejected drafts");
    assert_eq!(after[0], after[2], "the step after the rejected drafts sees them");
    assert_eq!(after[1], after[3], "a later verify step sees the rejected drafts");
}

/// A draft model drafts free-form text, where prompt lookup has nothing to copy: a
/// split run asking a fresh session of the same draft model gives the unsplit run's
/// tokens and logits digest. The draft is SmolLM2 itself requantized to Q4_0 (the
/// same network, other numbers: it agrees with the target often, not always).
#[test]
fn a_draft_model_drafts_and_split_matches_unsplit() {
    let file = model(SMOL);
    let dir = tempfile::tempdir().unwrap();
    let draft = dir.path().join("draft-q4_0.gguf");
    shoal_engine::requantize(&file, &draft, shoal_engine::Quant::Q4_0).unwrap();
    let cache = ShardCache::new(dir.path());
    let drafter = DraftModel::load(&draft, &file, std::fs::metadata(&file).unwrap().len(), &config()).unwrap();
    // A requantized copy of the model reads about as many bytes per token.
    assert!((700..=1300).contains(&drafter.cost()), "cost {}", drafter.cost());
    let vocab = Vocab::load(&file).unwrap();
    let prompt = vocab.tokenize("Once upon a time, in a small village by the sea, there lived", false);
    let spec = SpecSettings { max_draft: 4, position_cost: 0, ..SpecSettings::default() };
    let run = |points: &[u32], spec: &SpecSettings, drafted: bool| {
        let (_, stages) = load_split(&file, points, &cache, &config()).unwrap();
        let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect()).unwrap();
        let sampler = &mut Sampler::new(&SamplingParams::default());
        let mut proposer = drafted.then(|| drafter.proposer());
        let g = chain
            .generate_drafted(SessionId(1), &prompt, NEW_TOKENS, sampler, &mut (), spec, &[], proposer.as_deref_mut())
            .unwrap();
        (g.tokens, g.logits_digest, g.decode_steps, g.drafted, g.accepted)
    };
    let whole = run(&[], &spec, true);
    let (_, _, steps, drafted, accepted) = whole;
    assert!(accepted > 0 && accepted < drafted, "{accepted}/{drafted} drafts accepted");
    for points in [&[15][..], &[10, 20]] {
        assert_eq!(run(points, &spec, true), whole, "split at {points:?} differs from unsplit");
    }
    let lookup = run(&[], &spec, false);
    eprintln!(
        "draft model: {steps} steps for {NEW_TOKENS} tokens, {accepted}/{drafted} accepted; \
         prompt lookup: {} steps, {}/{} accepted",
        lookup.2, lookup.4, lookup.3
    );
    assert!(steps < lookup.2, "the draft model saves no step over prompt lookup on free text");
}

/// A draft model whose token ids mean other text is refused with the first token
/// that differs, before anything is loaded.
#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let Err(e) = DraftModel::load(&model(GEMMA), &model(SMOL), 1 << 20, &config()) else {
        panic!("Gemma's vocabulary accepted to draft for SmolLM2");
    };
    let msg = e.to_string();
    assert!(matches!(e, shoal_engine::DraftError::Vocabulary { .. }) && msg.contains("cannot draft for"), "{msg}");
}
