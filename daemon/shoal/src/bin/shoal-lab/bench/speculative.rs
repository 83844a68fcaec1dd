//! `shoal-lab bench speculative`: what speculative decoding buys, unsplit and split, on
//! a prompt whose answer repeats it (a paragraph rewritten with small edits) and on a
//! free-form one, over loopback and over a delayed link.

use super::{drop_page_cache, impair_spec, json_of, GenOutput, LoopbackPipeline, SHORT_PROMPT};
use anyhow::{bail, Context, Result};
use clap::Args;
use shoal::stats::{even_split, median};
use shoal_engine::open_model;
use std::path::PathBuf;
use std::process::Command;

#[derive(Args, Debug)]
pub struct SpeculativeArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// Stage processes of the split runs.
    #[arg(long, default_value_t = 2)]
    stages: u32,
    /// Most drafted tokens per step (k).
    #[arg(long, default_value_t = 8)]
    draft: u32,
    /// Tokens generated per run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Alternating rounds (each runs every configuration once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Links to measure the split runs over, separated by `;` ("" is plain loopback).
    #[arg(long, default_value = ";delay=3ms")]
    links: String,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// Also measure drafts from a draft model: a GGUF with the model's vocabulary, or
    /// `q4_0` / `q8_0` for the model itself requantized so (the same network with
    /// other numbers: a stand-in where no smaller sibling is at hand).
    #[arg(long, value_name = "GGUF|q4_0|q8_0")]
    draft_model: Option<String>,
}

/// The paragraph the repetitive prompt asks to rewrite.
const PARAGRAPH: &str = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops to \
guide ships into harbour. The Pharos of Alexandria, built in the third century BC, stood over a hundred metres \
tall and was counted among the wonders of the ancient world. Later, Roman engineers raised towers along the \
coasts of their empire, from Dover to the Black Sea. In the eighteenth century, reflectors and oil lamps \
replaced open fires, and in 1822 Augustin Fresnel designed the lens that bears his name.";

/// Asks for the paragraph back with one word changed, and starts the answer (a raw
/// prompt: a small model follows the pattern rather than the instruction).
fn rewrite_prompt() -> String {
    format!(
        "Rewrite the paragraph below with small edits: write \"beacon\" for \"lighthouse\", and keep everything \
         else as it is.\n\nParagraph: {PARAGRAPH}\n\nRewritten paragraph: The history of the beacon begins in \
         antiquity"
    )
}

/// Median tok/s and the last run of one configuration.
struct Series {
    tok_per_s: Vec<f64>,
    last: Option<GenOutput>,
}

impl Series {
    fn new() -> Self {
        Self { tok_per_s: Vec::new(), last: None }
    }

    fn push(&mut self, g: GenOutput) {
        self.tok_per_s.push(g.tok_per_s);
        self.last = Some(g);
    }

    fn median(&mut self) -> f64 {
        median(&mut self.tok_per_s)
    }

    fn last(&self) -> &GenOutput {
        // Invariant: every series gets one run per round, and there is at least one round.
        self.last.as_ref().expect("at least one round")
    }
}

pub fn speculative(a: SpeculativeArgs) -> Result<()> {
    if a.rounds == 0 || a.draft == 0 {
        bail!("--rounds and --draft must be at least 1");
    }
    let (_, meta) = open_model(&a.model)?;
    let points = even_split(meta.n_layer, a.stages, meta.layer_period())?;
    let exe = shoal::shoal_exe().context("locating the shoal binary")?;
    let context = 2048;
    let draft = a.draft.to_string();
    // The configurations: no speculation, k up to --draft every step (no cost model),
    // and k chosen step by step by the default cost model.
    let fixed = ["--draft", &draft, "--draft-cost", "0,0"];
    let adaptive = ["--draft", &draft];
    let mut configs: Vec<(&str, &[&str])> =
        vec![("no speculation", &[]), ("speculation, k fixed", &fixed), ("speculation, k adaptive", &adaptive)];
    // A draft model: its file, and its configurations (k fixed; k adaptive with what
    // its pass costs against the target's).
    let temp = tempfile::tempdir()?;
    let draft_file = match a.draft_model.as_deref() {
        None => None,
        Some(q @ ("q4_0" | "q8_0")) => {
            let to = if q == "q4_0" { shoal_engine::Quant::Q4_0 } else { shoal_engine::Quant::Q8_0 };
            let file = temp.path().join(format!("draft-{q}.gguf"));
            shoal_engine::requantize(&a.model, &file, to).map_err(anyhow::Error::msg)?;
            Some(file)
        }
        Some(path) => Some(PathBuf::from(path)),
    };
    let model_cost = match &draft_file {
        Some(f) => (1000.0 * one_pass_ms(f, a.chunk)? / one_pass_ms(&a.model, a.chunk)?).round() as u32,
        None => 0,
    };
    let model_costs = format!("450,100,{model_cost}");
    let model_fixed = ["--draft", &draft, "--draft-cost", "0,0", "--draft-model"];
    let model_adaptive = ["--draft", &draft, "--draft-cost", &model_costs, "--draft-model"];
    if draft_file.is_some() {
        configs.push(("draft model, k fixed", &model_fixed));
        configs.push(("draft model, k adaptive", &model_adaptive));
    }
    // The draft model's file goes after --draft-model (unsplit: `shoal run`'s flag;
    // split: stage 0's, so the request itself does not name it).
    let uses_model = |extra: &[&str]| extra.last() == Some(&"--draft-model");
    let unsplit = |prompt: &str, extra: &[&str]| -> Result<GenOutput> {
        drop_page_cache(&a.model);
        let mut cmd = Command::new(&exe);
        cmd.arg("run").arg("--model").arg(&a.model).args(["--raw", "--ignore-eos", "--json", "--prompt", prompt]);
        cmd.args(["--threads", "1", "-n", &a.tokens.to_string(), "--chunk", &a.chunk.to_string()]);
        cmd.args(["--ctx", &context.to_string()]);
        cmd.args(extra);
        if uses_model(extra) {
            // Invariant: configurations ending in --draft-model exist only with a file.
            cmd.arg(draft_file.as_ref().expect("a draft model file"));
        }
        json_of(cmd, "run")
    };
    println!(
        "bench speculative: {} ({}, {} layers), split runs in {} stage processes at {:?} on loopback, {} tokens, \
         k ≤ {}, 1 thread per stage, chunk {}, {} rounds",
        a.model.display(),
        meta.arch.name(),
        meta.n_layer,
        a.stages,
        points,
        a.tokens,
        a.draft,
        a.chunk,
        a.rounds
    );
    pass_costs(&a)?;
    let prompts = [("repetitive", rewrite_prompt()), ("free-form", SHORT_PROMPT.to_string())];
    let mut identical = true;
    for link in a.links.split(';') {
        let impair: shoal_net::Impairment = link.parse().map_err(|e| anyhow::anyhow!("--links {link:?}: {e}"))?;
        let impair_arg = if impair.is_none() { String::new() } else { impair_spec(&impair) };
        let lp = LoopbackPipeline::start(&a.model, &points, a.chunk, context, &["--impair", &impair_arg])?;
        lp.generate(SHORT_PROMPT, 8).context("warm-up")?;
        // The same pipeline with the draft model on stage 0 (the other stages ignore it).
        let drafting = match &draft_file {
            Some(f) => {
                let f = f.to_string_lossy();
                let p = LoopbackPipeline::start(
                    &a.model,
                    &points,
                    a.chunk,
                    context,
                    &["--impair", &impair_arg, "--draft-model", &f],
                )?;
                p.generate(SHORT_PROMPT, 8).context("warm-up")?;
                Some(p)
            }
            None => None,
        };
        let link_name = if impair.is_none() { "loopback".to_string() } else { format!("loopback, {link} per hop") };
        for (name, prompt) in &prompts {
            // Unsplit and split in each configuration, alternating round by round.
            let mut runs: Vec<Series> = (0..2 * configs.len()).map(|_| Series::new()).collect();
            for _ in 0..a.rounds {
                for (i, (_, extra)) in configs.iter().enumerate() {
                    runs[2 * i].push(unsplit(prompt, extra)?);
                    runs[2 * i + 1].push(match (&drafting, uses_model(extra)) {
                        (Some(p), true) => p.generate_with(prompt, a.tokens, &extra[..extra.len() - 1])?,
                        _ => lp.generate_with(prompt, a.tokens, extra)?,
                    });
                }
            }
            let m: Vec<f64> = runs.iter_mut().map(Series::median).collect();
            println!("\n{name} prompt, split over {link_name}: median decode tok/s of {} rounds", a.rounds);
            println!(
                "{:<34} {:>9} {:>10} {:>11} {:>8} {:>10} {:>6}",
                "", "tok/s", "vs unsplit", "tok/step", "accepted", "mean k", "same"
            );
            let plain = runs[0].last().tokens.clone();
            for (i, (label, _)) in configs.iter().enumerate() {
                for (j, place) in ["unsplit", "split"].iter().enumerate() {
                    let r = runs[2 * i + j].last();
                    let steps = r.decode_steps.max(1) as f64;
                    let u = runs[2 * i].last();
                    // Split == unsplit with the same settings, tokens and logits digest.
                    let same = r.tokens == u.tokens && r.logits_digest == u.logits_digest;
                    identical &= same;
                    println!(
                        "{:<34} {:>9.2} {:>10.3} {:>11.2} {:>7.1}% {:>10.2} {:>6}",
                        format!("{place}, {label}"),
                        m[2 * i + j],
                        m[2 * i + j] / m[0],
                        (r.tokens.len() - 1) as f64 / steps,
                        100.0 * r.accepted as f64 / r.drafted.max(1) as f64,
                        r.drafted as f64 / steps,
                        if same { "yes" } else { "NO" }
                    );
                }
            }
            for (i, (label, _)) in configs.iter().enumerate().skip(1) {
                let overhead_plain = 1000.0 / m[1] - 1000.0 / m[0];
                let overhead = 1000.0 / m[2 * i + 1] - 1000.0 / m[2 * i];
                let differ = plain.iter().zip(&runs[2 * i].last().tokens).position(|(x, y)| x != y);
                println!(
                    "{label}: per-token overhead of the split (split minus unsplit ms/token) {overhead:.2} ms vs \
                     {overhead_plain:.2} ms without (ratio {:.2}); greedy output first differs from the \
                     non-speculative run at token {}",
                    overhead / overhead_plain,
                    differ.map_or("— (never)".to_string(), |i| i.to_string())
                );
            }
        }
    }
    if !identical {
        bail!("a split run's output differs from the unsplit run's with the same settings");
    }
    Ok(())
}

/// Median ms of a one-position decode step of `model`, unsplit, 1 thread, after a
/// 100-token prompt (15 timed steps).
fn one_pass_ms(model: &std::path::Path, chunk: u32) -> Result<f64> {
    use shoal_engine::{load_split, Chain, StageConfig, Vocab};
    use shoal_types::{SessionId, Stage};
    let config =
        StageConfig { n_ctx_per_session: 512, max_sessions: 1, chunk, threads: 1, gpu_layers: 0, gpus: Vec::new() };
    let cache = shoal_engine::ShardCache::new(shoal::run::default_cache());
    let (_, stages) = load_split(model, &[], &cache, &config)?;
    let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect())?;
    let mut prompt = Vocab::load(model)?.tokenize(PARAGRAPH, false);
    prompt.truncate(100);
    let (s, mut timing, mut pos) = (SessionId(1), Default::default(), 0);
    for c in prompt.chunks(chunk as usize) {
        chain.step(s, pos, c, &mut timing)?;
        pos += c.len() as u32;
    }
    let mut ms = Vec::new();
    for _ in 0..15 {
        let t0 = std::time::Instant::now();
        chain.step_rows(s, pos, &prompt[..1], false, &mut timing)?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(&mut ms))
}

/// What a verify pass costs: one step of n positions (n = 1 … k + 1) of the unsplit
/// model in this process (1 thread), after a 100-token prompt, each timed 15 times
/// (the session rolled back between), median ms and the ratio to one position.
fn pass_costs(a: &SpeculativeArgs) -> Result<()> {
    use shoal_engine::{load_split, Chain, StageConfig, Vocab};
    use shoal_types::{SessionId, Stage};
    let config = StageConfig {
        n_ctx_per_session: 512,
        max_sessions: 1,
        chunk: a.chunk,
        threads: 1,
        gpu_layers: 0,
        gpus: Vec::new(),
    };
    let cache = shoal_engine::ShardCache::new(shoal::run::default_cache());
    let (_, stages) = load_split(&a.model, &[], &cache, &config)?;
    let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect())?;
    let vocab = Vocab::load(&a.model)?;
    let mut prompt = vocab.tokenize(PARAGRAPH, false);
    prompt.truncate(100);
    let s = SessionId(1);
    let mut timing = Default::default();
    let mut pos = 0;
    for c in prompt.chunks(a.chunk as usize) {
        chain.step(s, pos, c, &mut timing)?;
        pos += c.len() as u32;
    }
    let max_n = (a.draft + 1).min(a.chunk) as usize;
    let mut line = String::new();
    let mut one = 0.0;
    for n in 1..=max_n {
        let mut ms = Vec::new();
        for _ in 0..15 {
            let t0 = std::time::Instant::now();
            chain.step_rows(s, pos, &prompt[..n], n > 1, &mut timing)?;
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let m = median(&mut ms);
        if n == 1 {
            one = m;
        }
        line += &format!(" {n}: {m:.2} ms ({:.2}×)", m / one);
    }
    println!("a pass of n positions, unsplit, 1 thread —{line}");
    Ok(())
}
