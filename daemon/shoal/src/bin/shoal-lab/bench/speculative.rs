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
}

/// The paragraph the repetitive prompt asks to rewrite.
const PARAGRAPH: &str = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops to \
guide ships into harbour. The Pharos of Alexandria, built in the third century BC, stood over a hundred metres \
tall and was counted among the wonders of the ancient world. Later, Roman engineers raised towers along the \
coasts of their empire, from Dover to the Black Sea. In the eighteenth century, reflectors and oil lamps \
replaced open fires, and in 1822 Augustin Fresnel designed the lens that bears his name.";

fn rewrite_prompt() -> String {
    format!(
        "Rewrite the paragraph below with small edits: write \"beacon\" for \"lighthouse\", and keep everything \
         else as it is.\n\nParagraph: {PARAGRAPH}\n\nRewritten paragraph: The history of the beacon"
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
    let unsplit = |prompt: &str, spec: bool| -> Result<GenOutput> {
        drop_page_cache(&a.model);
        let mut cmd = Command::new(&exe);
        cmd.arg("run").arg("--model").arg(&a.model).args(["--raw", "--ignore-eos", "--json", "--prompt", prompt]);
        cmd.args(["--threads", "1", "-n", &a.tokens.to_string(), "--chunk", &a.chunk.to_string()]);
        cmd.args(["--ctx", &context.to_string()]);
        if spec {
            cmd.args(["--draft", &draft]);
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
    let prompts = [("repetitive", rewrite_prompt()), ("free-form", SHORT_PROMPT.to_string())];
    let mut identical = true;
    for link in a.links.split(';') {
        let impair: shoal_net::Impairment = link.parse().map_err(|e| anyhow::anyhow!("--links {link:?}: {e}"))?;
        let impair_arg = if impair.is_none() { String::new() } else { impair_spec(&impair) };
        let lp = LoopbackPipeline::start(&a.model, &points, a.chunk, context, &["--impair", &impair_arg])?;
        lp.generate(SHORT_PROMPT, 8).context("warm-up")?;
        let link_name = if impair.is_none() { "loopback".to_string() } else { format!("loopback, {link} per hop") };
        for (name, prompt) in &prompts {
            // Unsplit without, unsplit with, split without, split with: alternating.
            let mut s: Vec<Series> = (0..4).map(|_| Series::new()).collect();
            for _ in 0..a.rounds {
                s[0].push(unsplit(prompt, false)?);
                s[1].push(unsplit(prompt, true)?);
                s[2].push(lp.generate_with(prompt, a.tokens, &[])?);
                s[3].push(lp.generate_with(prompt, a.tokens, &["--draft", &draft])?);
            }
            let m: Vec<f64> = s.iter_mut().map(Series::median).collect();
            let (plain, spec) = (s[0].last(), s[1].last());
            let same_spec = s[3].last().tokens == spec.tokens && s[3].last().logits_digest == spec.logits_digest;
            let same_plain = s[2].last().tokens == plain.tokens && s[2].last().logits_digest == plain.logits_digest;
            identical &= same_spec && same_plain;
            let acceptance = spec.accepted as f64 / spec.drafted.max(1) as f64;
            let mean_k = spec.drafted as f64 / spec.decode_steps.max(1) as f64;
            let per_step = (spec.tokens.len() - 1) as f64 / spec.decode_steps.max(1) as f64;
            let differ = plain.tokens.iter().zip(&spec.tokens).position(|(x, y)| x != y);
            println!("\n{name} prompt, split over {link_name}: median decode tok/s of {} rounds", a.rounds);
            println!("{:<34} {:>9} {:>10}", "", "tok/s", "vs unsplit");
            for (label, v) in [
                ("unsplit, no speculation", m[0]),
                ("unsplit, speculation", m[1]),
                ("split, no speculation", m[2]),
                ("split, speculation", m[3]),
            ] {
                println!("{label:<34} {v:>9.2} {:>10.3}", v / m[0]);
            }
            println!(
                "acceptance {:.1}% ({} of {} drafts), mean k {mean_k:.2} per step, {per_step:.2} tokens per step",
                acceptance * 100.0,
                spec.accepted,
                spec.drafted
            );
            let overhead_plain = 1000.0 / m[2] - 1000.0 / m[0];
            let overhead_spec = 1000.0 / m[3] - 1000.0 / m[1];
            println!(
                "per-token overhead of the split (split minus unsplit ms/token): {overhead_plain:.2} ms without \
                 speculation, {overhead_spec:.2} ms with (ratio {:.2})",
                overhead_spec / overhead_plain
            );
            println!(
                "split == unsplit (tokens and logits digest): {} without speculation, {} with; speculative greedy \
                 output first differs from non-speculative at token {}",
                if same_plain { "yes" } else { "NO" },
                if same_spec { "yes" } else { "NO" },
                differ.map_or("— (never)".to_string(), |i| i.to_string())
            );
        }
    }
    if !identical {
        bail!("a split run's output differs from the unsplit run's with the same settings");
    }
    Ok(())
}
