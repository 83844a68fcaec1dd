//! `shoal-lab bench keepalive`: does keeping a stage awake between tokens pay? The same
//! split of a model runs twice on loopback, one set of stage processes with keep-alive
//! off (their threads sleep between tokens) and one with it on (they spin while a
//! session generates); generations alternate between the two, and the bench prints
//! decode tok/s and CPU seconds per token for each, side by side. The default of
//! `shoal serve --keepalive auto` for CPU stages follows what this shows.

use super::{even_split, median, LoopbackPipeline, SHORT_PROMPT};
use anyhow::{bail, Result};
use clap::Args;
use shoal_engine::open_model;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct KeepaliveArgs {
    /// The GGUF model [default: SmolLM2-135M from the test models].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Stage processes per set.
    #[arg(long, default_value_t = 2)]
    stages: u32,
    /// Tokens generated per run.
    #[arg(short = 'n', long, default_value_t = 96)]
    tokens: usize,
    /// Alternating rounds (one run of each set per round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// CPU threads per stage.
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// One set's figures.
#[derive(serde::Serialize)]
struct Side {
    tok_per_s: Vec<f64>,
    median_tok_per_s: f64,
    /// CPU time of all its stage processes per generated token, ms.
    cpu_ms_per_token: f64,
}

pub fn keepalive(a: KeepaliveArgs) -> Result<()> {
    let model = a.model.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let (_, meta) = open_model(&model)?;
    let points = even_split(meta.n_layer, a.stages, meta.layer_period())?;
    let threads = a.threads.max(1).to_string();
    let context = a.tokens + 256;
    let off = LoopbackPipeline::start(&model, &points, 128, context, &["--threads", &threads, "--keepalive", "off"])?;
    let on = LoopbackPipeline::start(&model, &points, 128, context, &["--threads", &threads, "--keepalive", "on"])?;
    // Warm both (shards in the page cache, connections up).
    off.generate(SHORT_PROMPT, 8)?;
    on.generate(SHORT_PROMPT, 8)?;
    std::thread::sleep(shoal_pipeline::KEEPALIVE_WINDOW * 2);
    if !a.json {
        println!(
            "bench keepalive: {} split at {:?} on loopback, {} thread(s) per stage, {} tokens, {} alternating rounds",
            model.display(),
            points,
            threads,
            a.tokens,
            a.rounds
        );
        println!("{:>6} {:>12} {:>12} {:>7}", "round", "off tok/s", "on tok/s", "on/off");
    }
    let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
    let (mut cpu_off, mut cpu_on) = (0.0, 0.0);
    let mut first: Option<Vec<i32>> = None;
    let mut identical = true;
    // The spinning set stops a window after its generation; each run is followed by a
    // pause that waits it out, so it never competes with the other set's run.
    let settle = shoal_pipeline::KEEPALIVE_WINDOW * 2;
    for round in 1..=a.rounds.max(1) {
        let mut runs = [(&off, &mut t_off, &mut cpu_off), (&on, &mut t_on, &mut cpu_on)];
        // Alternate which goes first, so neither always follows the other.
        if round % 2 == 0 {
            runs.reverse();
        }
        let mut row = [0.0; 2];
        for (set, tps, cpu) in runs {
            let before = set.cpu_seconds();
            let out = set.generate(SHORT_PROMPT, a.tokens)?;
            // The spinning after the run's last token counts too (it stops in the pause).
            std::thread::sleep(settle);
            *cpu += set.cpu_seconds() - before;
            identical &= *first.get_or_insert_with(|| out.tokens.clone()) == out.tokens;
            tps.push(out.tok_per_s);
            row[usize::from(std::ptr::eq(set, &on))] = out.tok_per_s;
        }
        if !a.json {
            println!("{round:>6} {:>12.2} {:>12.2} {:>7.3}", row[0], row[1], row[1] / row[0]);
        }
    }
    let tokens = (a.tokens * a.rounds.max(1)) as f64;
    let side = |mut v: Vec<f64>, cpu: f64| Side {
        median_tok_per_s: median(&mut v.clone()),
        tok_per_s: std::mem::take(&mut v),
        cpu_ms_per_token: cpu * 1000.0 / tokens,
    };
    let (off_side, on_side) = (side(t_off, cpu_off), side(t_on, cpu_on));
    let ratio = on_side.median_tok_per_s / off_side.median_tok_per_s;
    if a.json {
        let v = serde_json::json!({ "off": off_side, "on": on_side, "ratio": ratio, "identical": identical });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{:>6} {:>12.2} {:>12.2} {:>7.3}",
            "median", off_side.median_tok_per_s, on_side.median_tok_per_s, ratio
        );
        println!(
            "CPU time of the stage processes per token: off {:.2} ms, on {:.2} ms; keep-alive is {} here",
            off_side.cpu_ms_per_token,
            on_side.cpu_ms_per_token,
            if ratio > 1.0 { "faster" } else { "slower" }
        );
    }
    if !identical {
        bail!("the two sets generated different tokens");
    }
    Ok(())
}
