//! Sampling on hand-made logits: greedy is the argmax, a seed fixes the draw, top-k
//! and the repetition penalty do what they say; and the largest grammar the API lets
//! through builds against the test model's vocabulary (its cost printed).

mod common;

use shoal_engine::{Sampler, SamplingParams, Vocab};

fn flat_logits() -> Vec<f32> {
    (0..100).map(|i| ((i * 37 % 11) as f32) * 0.1 + i as f32 * 1e-3).collect()
}

fn draws(params: &SamplingParams, n: usize) -> Vec<i32> {
    let mut s = Sampler::new(params);
    (0..n).map(|_| s.sample(&flat_logits())).collect()
}

#[test]
fn greedy_is_the_argmax() {
    let mut logits = vec![0.0f32; 1000];
    logits[617] = 3.5;
    logits[12] = 3.4;
    let mut s = Sampler::new(&SamplingParams::default());
    assert_eq!(s.sample(&logits), 617);
    assert_eq!(s.sample(&logits), 617);
}

#[test]
fn a_seed_fixes_the_draw() {
    let p = |seed| SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..Default::default() };
    let a = draws(&p(1), 32);
    assert_eq!(a, draws(&p(1), 32), "same seed, different tokens");
    assert_ne!(a, draws(&p(2), 32), "different seeds gave the same 32 draws");
    // Temperature sampling really samples: several distinct tokens come up.
    let mut distinct = a.clone();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() > 3, "{a:?}");
}

#[test]
fn top_k_one_is_greedy() {
    let p = SamplingParams { temperature: 5.0, top_k: 1, top_p: 1.0, min_p: 0.0, seed: 9, ..Default::default() };
    let argmax = flat_logits().iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as i32).unwrap();
    assert!(draws(&p, 16).iter().all(|&t| t == argmax));
}

#[test]
fn repetition_penalty_discourages_repeats() {
    let mut logits = vec![0.0f32; 50];
    logits[5] = 1.0;
    logits[3] = 0.9;
    let mut plain = Sampler::new(&SamplingParams::default());
    assert_eq!((plain.sample(&logits), plain.sample(&logits)), (5, 5));
    let mut penalised = Sampler::new(&SamplingParams { repeat_penalty: 2.0, ..Default::default() });
    assert_eq!(penalised.sample(&logits), 5);
    assert_eq!(penalised.sample(&logits), 3, "token 5 was just used and should be penalised");
}

/// Security review F14: the largest grammar the API lets through (repetition counts
/// adding up to `MAX_GRAMMAR_REPETITIONS`, llama.cpp's limit of 2,000 per count) builds
/// against a real vocabulary. The tail builds a session's sampler once, when the session
/// opens; the time it takes is printed (`--nocapture`): what one session's opening may
/// hold the tail's loop for.
#[test]
fn the_largest_grammar_within_the_bound_builds_and_its_cost_is_printed() {
    let vocab = std::sync::Arc::new(Vocab::load(&common::model("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap());
    // Ten JSON string properties of up to 1,999 characters: 19,990 repetitions.
    let props: Vec<String> = (0..10).map(|i| format!(r#""\"p{i}\":\"" [a-z ]{{0,1999}} "\"""#)).collect();
    let grammar = format!(r#"root ::= "{{" {} "}}""#, props.join(r#" "," "#));
    let n = shoal_types::grammar_repetitions(&grammar);
    assert!(n > 19_000 && n <= shoal_types::MAX_GRAMMAR_REPETITIONS, "{n} repetitions");
    let params = SamplingParams { grammar: Some(grammar), ..SamplingParams::default() };
    let mut times = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let built = Sampler::with_vocab(&params, Some(vocab.clone()));
        times.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(built.is_ok(), "{:?}", built.err());
    }
    println!("a grammar of {n} repetitions builds in {:.1} / {:.1} / {:.1} ms", times[0], times[1], times[2]);
}
