//! Split exactness on real models: a model split into 2 or 3 in-process stages gives
//! the unsplit model's greedy tokens and logits, replays are exact, sessions do not
//! disturb each other, and bad input changes nothing.

mod common;
use common::{hidden, logits, model};
use shoal_engine::{
    load_split, offload_split, Chain, GpuLayers, LlamaStage, Observer, Sampler, SamplingParams, ShardCache,
    StageConfig, Vocab,
};
use shoal_types::{LayerRange, SessionId, Stage, StageError, StageInput, TokenId};
use std::path::Path;

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";
const PROMPT_TOKENS: usize = 100;
const NEW_TOKENS: usize = 64;

/// Chunk of 32: the 100-token prompt crosses three chunk boundaries.
fn config() -> StageConfig {
    StageConfig {
        n_ctx_per_session: 512,
        max_sessions: 2,
        chunk: 32,
        threads: 1,
        gpu_layers: gpu_layers(),
        gpus: Vec::new(),
    }
}

/// `SHOAL_TEST_GPU_LAYERS=99` runs the same tests with the layers offloaded.
fn gpu_layers() -> u32 {
    std::env::var("SHOAL_TEST_GPU_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn prompt(file: &Path) -> Vec<TokenId> {
    let vocab = Vocab::load(file).unwrap();
    let text = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops \
        to guide ships into harbour. The Pharos of Alexandria, built in the third century BC, stood \
        over a hundred metres tall and was counted among the wonders of the ancient world. Later, \
        Roman engineers raised towers along the coasts of their empire, from Dover to the Black Sea. \
        In the eighteenth century, reflectors and oil lamps replaced open fires, and in 1822 Augustin \
        Fresnel designed the lens that bears his name, which concentrated the light into a beam visible \
        for many miles. Keepers lived in the towers with their families, trimming wicks and winding clocks.";
    let t = vocab.tokenize(text, false);
    assert!(t.len() >= PROMPT_TOKENS, "prompt text too short: {} tokens", t.len());
    t[..PROMPT_TOKENS].to_vec()
}

#[derive(Default)]
struct Record {
    logits: Vec<Vec<f32>>,
}

impl Observer for Record {
    fn logits(&mut self, l: &[f32]) {
        self.logits.push(l.to_vec());
    }
}

fn run(file: &Path, points: &[u32], cache: &ShardCache) -> (Vec<TokenId>, Vec<Vec<f32>>, String) {
    let (_, stages) = load_split(file, points, cache, &config()).unwrap();
    assert_eq!(stages.len(), points.len() + 1);
    let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect()).unwrap();
    let mut rec = Record::default();
    let g = chain
        .generate(SessionId(1), &prompt(file), NEW_TOKENS, &mut Sampler::new(&SamplingParams::default()), &mut rec)
        .unwrap();
    assert_eq!(g.tokens.len(), NEW_TOKENS);
    (g.tokens, rec.logits, g.logits_digest)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn assert_splits_match(file: &Path, splits: &[&[u32]]) {
    let dir = tempfile::tempdir().unwrap();
    let cache = ShardCache::new(dir.path());
    let (tokens, logits, digest) = run(file, &[], &cache);
    assert_eq!(logits.len(), NEW_TOKENS);
    for points in splits {
        let (t, l, d) = run(file, points, &cache);
        let file = file.display();
        assert_eq!(t, tokens, "{file} split at {points:?}: tokens differ from the unsplit model");
        for (step, (a, b)) in logits.iter().zip(&l).enumerate() {
            let diff = max_abs_diff(a, b);
            assert!(diff <= 1e-4, "{file} split at {points:?}: step {step} logits differ by {diff}");
        }
        // The canonical schedule makes them bit-identical, not merely close.
        assert_eq!(d, digest, "{file} split at {points:?}: logits digest differs");
    }
    // A shard of the whole model, written by Shoal, is the model.
    let (g, meta) = shoal_gguf::open_model(file).unwrap();
    let whole = dir.path().join("whole.gguf");
    let range = shoal_types::LayerRange::new(0, meta.n_layer);
    shoal_gguf::shard::write_shard(&g, &meta, range, &whole).unwrap();
    let stage = LlamaStage::load(&whole, range, meta.n_layer, &config()).unwrap();
    let mut chain = Chain::new(vec![Box::new(stage) as Box<dyn Stage>]).unwrap();
    let sampler = &mut Sampler::new(&SamplingParams::default());
    let w = chain.generate(SessionId(1), &prompt(file), NEW_TOKENS, sampler, &mut ()).unwrap();
    let file = file.display();
    assert_eq!((w.tokens, w.logits_digest), (tokens, digest), "{file}: whole-model shard differs from the source");
}

#[test]
fn smollm2_splits_match_unsplit() {
    assert_splits_match(&model(SMOL), &[&[15], &[10, 20]]);
}

/// Gemma 3 slides its attention on 5 layers of every 6: a shard states its layers'
/// kinds, so boundaries inside the pattern (9) are as exact as those on it (12), and
/// so is a stage of one full-attention layer (5..6, run without a window).
#[test]
fn gemma3_splits_match_unsplit() {
    assert_splits_match(&model(GEMMA), &[&[12], &[9], &[5, 6]]);
}

/// Every split of a zoo model (4 layers: 7 ways; those on the family's layer period)
/// gives the unsplit model's tokens and logits, and its replays are exact: what allows
/// its architecture.
#[test]
fn zoo_families_split_exactly_at_every_boundary() {
    let dir = tempfile::tempdir().unwrap();
    for family in shoal_gguf::zoo::Family::ALL {
        let path = dir.path().join(format!("{}.gguf", family.arch()));
        shoal_gguf::zoo::write(*family, &model(SMOL), &path).unwrap();
        let (_, meta) = shoal_gguf::open_model(&path).unwrap();
        assert_eq!((meta.arch.name(), meta.n_layer), (family.arch(), family.layers()));
        // Every split on the family's period (every set of its legal points); one
        // off it is refused with the reason.
        let period = meta.layer_period();
        let points: Vec<u32> = (1..meta.n_layer).filter(|p| p % period == 0).collect();
        let splits: Vec<Vec<u32>> = (1..1u32 << points.len())
            .map(|set| points.iter().enumerate().filter(|(i, _)| set & (1 << i) != 0).map(|(_, p)| *p).collect())
            .collect();
        let splits: Vec<&[u32]> = splits.iter().map(Vec::as_slice).collect();
        assert!(!splits.is_empty(), "{}: no split to check", family.arch());
        assert_splits_match(&path, &splits);
        assert_replays_exact(&path, points[points.len() / 2]);
        if period > 1 {
            let cache = ShardCache::new(dir.path().join("off"));
            let err = load_split(&path, &[1], &cache, &config()).err().expect("a split off the period accepted");
            assert!(err.to_string().contains(&format!("period of {period}")), "{err}");
        }
    }
}

/// A shard carries its layers' sliding-window pattern: without it llama.cpp would
/// restart the architecture's default pattern at the shard's layer 0, and a stage
/// starting on a full-attention layer would slide (the zoo's window, 32, is shorter
/// than the tests' sessions, so that changes the output).
#[test]
fn shards_carry_their_sliding_window_pattern() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt-oss.gguf");
    shoal_gguf::zoo::write(shoal_gguf::zoo::Family::GptOss, &model(SMOL), &path).unwrap();
    let (g, meta) = shoal_gguf::open_model(&path).unwrap();
    assert_eq!(meta.swa_layers, [true, false, true, false]);
    let shard = dir.path().join("shard.gguf");
    shoal_gguf::shard::write_shard(&g, &meta, LayerRange::new(2, 4), &shard).unwrap();
    let (_, part) = shoal_gguf::open_model(&shard).unwrap();
    assert_eq!(part.swa_layers, [true, false]);
    // One full-attention layer alone: llama.cpp's gpt-oss graph needs a sliding one,
    // which even boundaries guarantee.
    let err = shoal_gguf::shard::write_shard(&g, &meta, LayerRange::new(3, 4), &shard).unwrap_err();
    assert!(err.to_string().contains("period of 2"), "{err}");
}

/// Gemma 2's graph scales hidden-state input as it scales the embedding, so a split
/// differs from the unsplit run (its zoo model showed it: split at 2, other tokens):
/// the architecture is refused, with that reason.
#[test]
fn gemma2_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gemma2.gguf");
    shoal_gguf::zoo::write(shoal_gguf::zoo::Family::Gemma2, &model(SMOL), &path).unwrap();
    let err = shoal_gguf::open_model(&path).expect_err("gemma2 accepted");
    assert!(err.to_string().contains("scales every input by √n_embd"), "{err}");
}

/// Command R+ (64 layers or more) gets per-head q/k norms from llama.cpp only because of
/// its layer count, which a shard lacks: refused, with the reason.
/// DeepSeek: llama.cpp takes any model of 26 or 27 layers for V2-Lite (no low-rank
/// query), so a full model's shard may not have that size; and the
/// next-token-prediction block DeepSeek V3's GGUFs carry after the stack is in no
/// shard.
#[test]
fn deepseek_shards_avoid_the_sizes_llama_cpp_misreads_and_leave_out_the_prediction_block() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deepseek2.gguf");
    shoal_gguf::zoo::write_layers(shoal_gguf::zoo::Family::DeepSeek2, 30, &model(SMOL), &path).unwrap();
    let (g, meta) = shoal_gguf::open_model(&path).unwrap();
    assert_eq!((meta.n_layer, meta.nextn_layers, meta.mla), (30, 1, true));
    assert_eq!(meta.refused_stage_layers, [26, 27]);
    let shard = dir.path().join("shard.gguf");
    let err = shoal_gguf::shard::write_shard(&g, &meta, LayerRange::new(3, 30), &shard).unwrap_err();
    assert!(err.to_string().contains("would take a deepseek2 model of 27 layers for another variant"), "{err}");
    shoal_gguf::shard::write_shard(&g, &meta, LayerRange::new(2, 30), &shard).unwrap();
    let (part, part_meta) = shoal_gguf::open_model(&shard).unwrap();
    assert_eq!((part_meta.n_layer, part_meta.nextn_layers), (28, 0));
    assert!(part.tensors.iter().all(|t| !t.name.contains("nextn")), "a prediction block's tensor in the shard");
}

#[test]
fn command_r_plus_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("command-r-plus.gguf");
    shoal_gguf::zoo::write_layers(shoal_gguf::zoo::Family::CommandR, 64, &model(SMOL), &path).unwrap();
    let err = shoal_gguf::open_model(&path).expect_err("command-r of 64 layers accepted");
    assert!(err.to_string().contains("64 layers or more"), "{err}");
}

fn two_stages() -> (tempfile::TempDir, LlamaStage, LlamaStage) {
    two_stages_of(&model(SMOL), 15)
}

/// `file` split in two at `point`.
fn two_stages_of(file: &Path, point: u32) -> (tempfile::TempDir, LlamaStage, LlamaStage) {
    let dir = tempfile::tempdir().unwrap();
    let (_, mut stages) = load_split(file, &[point], &ShardCache::new(dir.path()), &config()).unwrap();
    let tail = stages.pop().unwrap();
    let head = stages.pop().unwrap();
    (dir, head, tail)
}

#[test]
fn replayed_steps_give_identical_output() {
    assert_replays_exact(&model(SMOL), 15);
}

/// Steps of `file` split at `point`, sent again (one token back, a chunk back, from the
/// start) give the same output, and a restarted tail replaying the session's steps
/// gives the same logits.
fn assert_replays_exact(file: &Path, point: u32) {
    let (_dir, mut head, mut tail) = two_stages_of(file, point);
    let p = prompt(file);
    let s = SessionId(7);
    let (c1, c2) = (&p[..32], &p[32..64]);
    let h1 = hidden(head.forward(s, 0, StageInput::Tokens(c1)).unwrap());
    let h2 = hidden(head.forward(s, 32, StageInput::Tokens(c2)).unwrap());
    let l1 = logits(tail.forward(s, 0, StageInput::Hidden(&h1)).unwrap());
    let l2 = logits(tail.forward(s, 32, StageInput::Hidden(&h2)).unwrap());
    let h3 = hidden(head.forward(s, 64, StageInput::Tokens(&[42])).unwrap());
    let l3 = logits(tail.forward(s, 64, StageInput::Hidden(&h3)).unwrap());
    assert_eq!(h1.len(), 32 * head.info().n_embd as usize);

    // The same step again (rolls back one token) …
    assert_eq!(hidden(head.forward(s, 64, StageInput::Tokens(&[42])).unwrap()), h3);
    assert_eq!(logits(tail.forward(s, 64, StageInput::Hidden(&h3)).unwrap()), l3);
    // … a step further back (rolls back a chunk and the token) …
    assert_eq!(hidden(head.forward(s, 32, StageInput::Tokens(c2)).unwrap()), h2);
    assert_eq!(logits(tail.forward(s, 32, StageInput::Hidden(&h2)).unwrap()), l2);
    // … and from the very start.
    assert_eq!(hidden(head.forward(s, 0, StageInput::Tokens(c1)).unwrap()), h1);
    assert_eq!(logits(tail.forward(s, 0, StageInput::Hidden(&h1)).unwrap()), l1);
    assert_eq!(hidden(head.forward(s, 32, StageInput::Tokens(c2)).unwrap()), h2);
    assert_eq!(logits(tail.forward(s, 32, StageInput::Hidden(&h2)).unwrap()), l2);
    // A restarted tail (a fresh process's stage) replaying the session.
    let (_dir2, _, mut restarted) = two_stages_of(file, point);
    assert_eq!(logits(restarted.forward(s, 0, StageInput::Hidden(&h1)).unwrap()), l1);
    assert_eq!(logits(restarted.forward(s, 32, StageInput::Hidden(&h2)).unwrap()), l2);
    assert_eq!(logits(restarted.forward(s, 64, StageInput::Hidden(&h3)).unwrap()), l3);
}

#[test]
fn interleaved_sessions_match_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ShardCache::new(dir.path());
    let p = prompt(&model(SMOL));
    let prompts = [p[..60].to_vec(), p[40..].to_vec()];
    let greedy = || Sampler::new(&SamplingParams::default());

    // Each alone.
    let alone: Vec<(Vec<TokenId>, String)> = prompts
        .iter()
        .map(|pr| {
            let (_, stages) = load_split(&model(SMOL), &[10, 20], &cache, &config()).unwrap();
            let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect()).unwrap();
            let g = chain.generate(SessionId(1), pr, 24, &mut greedy(), &mut ()).unwrap();
            (g.tokens, g.logits_digest)
        })
        .collect();

    // Interleaved step by step on one set of stages.
    let (_, stages) = load_split(&model(SMOL), &[10, 20], &cache, &config()).unwrap();
    let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect()).unwrap();
    let mut timing = Default::default();
    // Per session: tokens so far, next position, last logits, its sampler, its digest.
    type Session = (Vec<TokenId>, u32, Vec<f32>, Sampler, blake3::Hasher);
    let mut state: Vec<Session> =
        prompts.iter().map(|_| (Vec::new(), 0, Vec::new(), greedy(), blake3::Hasher::new())).collect();
    // Prompts chunk by chunk, alternating sessions.
    for k in 0..2 {
        for (i, pr) in prompts.iter().enumerate() {
            if let Some(c) = pr.chunks(32).nth(k) {
                state[i].2 = chain.step(SessionId(i as u64 + 10), state[i].1, c, &mut timing).unwrap();
                state[i].1 += c.len() as u32;
            }
        }
    }
    for step in 0..24 {
        for (i, st) in state.iter_mut().enumerate() {
            st.4.update(&st.2.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>());
            let t = st.3.sample(&st.2);
            st.0.push(t);
            if step + 1 < 24 {
                st.2 = chain.step(SessionId(i as u64 + 10), st.1, &[t], &mut timing).unwrap();
                st.1 += 1;
            }
        }
    }
    for (i, st) in state.iter().enumerate() {
        assert_eq!(st.0, alone[i].0, "session {i}: interleaved tokens differ from running alone");
        assert_eq!(st.4.finalize().to_hex().to_string(), alone[i].1, "session {i}: logits differ");
    }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let (_dir, mut head, mut tail) = two_stages();
    let p = prompt(&model(SMOL));
    let s = SessionId(3);
    let h1 = hidden(head.forward(s, 0, StageInput::Tokens(&p[..32])).unwrap());
    let l1 = logits(tail.forward(s, 0, StageInput::Hidden(&h1)).unwrap());

    let e = head.forward(s, 32, StageInput::Hidden(&h1)).unwrap_err();
    assert!(matches!(e, StageError::WrongInput { .. }), "{e}");
    let e = tail.forward(s, 32, StageInput::Tokens(&p[..4])).unwrap_err();
    assert!(matches!(e, StageError::WrongInput { .. }), "{e}");
    let e = tail.forward(s, 32, StageInput::Hidden(&h1[..1000])).unwrap_err();
    assert!(matches!(e, StageError::BadHiddenLength { .. }), "{e}");
    let e = head.forward(s, 32, StageInput::Tokens(&p[..33])).unwrap_err();
    assert!(matches!(e, StageError::ChunkTooLarge { .. }), "{e}");
    let e = head.forward(s, 40, StageInput::Tokens(&p[..4])).unwrap_err();
    assert!(matches!(e, StageError::PositionGap { first_pos: 40, have: 32, .. }), "{e}");
    let e = head.forward(s, 32, StageInput::Tokens(&[49152])).unwrap_err();
    assert!(matches!(e, StageError::BadToken { .. }), "{e}");
    let e = head.forward(s, 32, StageInput::Tokens(&[-1])).unwrap_err();
    assert!(matches!(e, StageError::BadToken { .. }), "{e}");
    let e = head.forward(SessionId(99), 5, StageInput::Tokens(&p[..4])).unwrap_err();
    assert!(matches!(e, StageError::PositionGap { .. }), "{e}");
    let e = head.forward(s, 500, StageInput::Tokens(&p[..20])).unwrap_err();
    assert!(matches!(e, StageError::PositionGap { .. } | StageError::ContextFull { .. }), "{e}");

    // The session is as it was: the next chunk gives what it gives on fresh stages.
    let h2 = hidden(head.forward(s, 32, StageInput::Tokens(&p[32..64])).unwrap());
    let l2 = logits(tail.forward(s, 32, StageInput::Hidden(&h2)).unwrap());
    let (_dir2, mut head2, mut tail2) = two_stages();
    let g1 = hidden(head2.forward(s, 0, StageInput::Tokens(&p[..32])).unwrap());
    assert_eq!(logits(tail2.forward(s, 0, StageInput::Hidden(&g1)).unwrap()), l1);
    let g2 = hidden(head2.forward(s, 32, StageInput::Tokens(&p[32..64])).unwrap());
    assert_eq!(g2, h2);
    assert_eq!(logits(tail2.forward(s, 32, StageInput::Hidden(&g2)).unwrap()), l2);
}

#[test]
fn sessions_are_limited_and_freed() {
    let (_dir, mut head, _tail) = two_stages();
    let p = prompt(&model(SMOL));
    head.forward(SessionId(1), 0, StageInput::Tokens(&p[..4])).unwrap();
    head.forward(SessionId(2), 0, StageInput::Tokens(&p[..4])).unwrap();
    let e = head.forward(SessionId(3), 0, StageInput::Tokens(&p[..4])).unwrap_err();
    assert!(matches!(e, StageError::NoFreeSession { max: 2 }), "{e}");
    head.free_session(SessionId(1));
    let a = hidden(head.forward(SessionId(3), 0, StageInput::Tokens(&p[..4])).unwrap());
    // The freed slot holds nothing of session 1: session 3 at position 0 equals a fresh run.
    let b = hidden(head.forward(SessionId(2), 0, StageInput::Tokens(&p[..4])).unwrap());
    assert_eq!(a, b);
}

#[test]
fn stages_report_their_memory() {
    let (_dir, head, tail) = two_stages();
    let (_, meta) = shoal_gguf::open_model(&model(SMOL)).unwrap();
    let layers = |r: std::ops::Range<usize>| meta.layer_bytes[r].iter().sum::<u64>();
    // Stage 0 reads the embedding; the tail reads it too, as the tied LM head.
    assert_eq!(head.memory().weights, layers(0..15) + meta.other_bytes + meta.embd_bytes);
    assert_eq!(tail.memory().weights, layers(15..30) + meta.other_bytes + meta.embd_bytes);
    // Output rows: C (32) on the non-tail stage, one per session (2) on the tail.
    assert!(head.memory().compute >= 32 * 49152 * 4);
    assert!(tail.memory().compute >= 2 * 49152 * 4 && tail.memory().compute < head.memory().compute);
    for s in [&head, &tail] {
        let m = s.memory();
        // 15 layers × 512 positions × 2 sessions × (K+V: 3 heads × 64 × 2 B × 2).
        assert_eq!(m.kv, 15 * 512 * 2 * 3 * 64 * 2 * 2, "{m:?}");
        assert!(m.compute > 0, "{m:?}");
    }
}

#[test]
fn ggml_type_table_matches_linked_ggml() {
    for t in shoal_gguf::GgmlType::all() {
        assert_eq!(shoal_engine::ggml_type_geometry(t.id), (t.block_size, t.type_size), "{}", t.name);
    }
}

#[test]
fn chat_template_and_detokenize() {
    let v = Vocab::load(&model(SMOL)).unwrap();
    let chat = v.chat_prompt("Hi there").unwrap();
    assert!(chat.contains("Hi there") && chat.contains("<|im_start|>assistant"), "{chat}");
    let t = v.tokenize(&chat, true);
    assert!(t.iter().any(|&t| v.piece(t).is_empty()), "special tokens should be parsed as such");
    let text = "Fish 🐟 swim";
    assert_eq!(v.detokenize(&v.tokenize(text, false)).trim_start(), text);
}

/// A placement that offloads to a GPU this build does not have is refused with the
/// devices it does have, before llama.cpp sees it (here: a CPU build).
#[test]
fn offloading_to_a_gpu_the_build_lacks_is_refused_clearly() {
    let gpus = vec![GpuLayers { device: "NoSuchGPU0".into(), layers: 3, head: false }];
    let config = StageConfig { gpus, ..config() };
    let err = match LlamaStage::load(&model(SMOL), LayerRange::new(0, 30), 30, &config) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("loaded with a GPU that does not exist"),
    };
    assert!(err.contains("offloads to NoSuchGPU0, which this build does not have (its devices: CPU"), "{err}");
}

/// llama.cpp's split of the offloaded layers: its count includes the output layer, put
/// on the last GPU; the shares are each GPU's layers.
#[test]
fn the_offload_split_counts_the_output_layer_on_the_last_gpu() {
    let g = |layers, head| GpuLayers { device: "x".into(), layers, head };
    assert_eq!(offload_split(&[g(16, false), g(10, false)]), (27, vec![16.0, 11.0]));
    assert_eq!(offload_split(&[g(30, true)]), (31, vec![31.0]));
}
