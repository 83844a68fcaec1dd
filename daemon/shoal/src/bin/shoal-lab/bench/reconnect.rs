//! `shoal-lab bench reconnect`: stages on namespace hosts; during one long generation the
//! middle host's link is taken down for a few seconds, several times. Prints, for
//! each flap, the time from the link coming back up to the next token arriving, and
//! checks that the output equals the unsplit model's bit for bit. With `--flaps 0`
//! and `--impair` it is the exactness check on an impaired (WiFi-like) network.

use super::{even_split, json_of, median, GenOutput};
use crate::lab::Lab;
use anyhow::{bail, Context, Result};
use clap::Args;
use shoal_engine::open_model;
use shoal_types::split_ranges;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct ReconnectArgs {
    /// The GGUF model file [default: SmolLM2-135M from the test models].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Stages, one per host.
    #[arg(long, default_value_t = 3)]
    stages: u32,
    /// Tokens generated.
    #[arg(short = 'n', long, default_value_t = 400)]
    tokens: usize,
    /// Times the link goes down.
    #[arg(long, default_value_t = 3)]
    flaps: usize,
    /// Seconds the link stays down each time.
    #[arg(long, default_value_t = 3.0)]
    down_secs: f64,
    /// Impairment of every host's outgoing packets, e.g. "delay=3ms,jitter=2ms,loss=1%".
    #[arg(long, default_value = "")]
    impair: shoal_net::Impairment,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Chunk size and context of the run: the prompt spans several chunks.
const CHUNK: u32 = 32;
const CONTEXT: u32 = 1024;

/// About 100 tokens: more than three chunks of 32.
const PROMPT: &str = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops \
    to guide ships into harbour. The Pharos of Alexandria, built in the third century BC, stood over a \
    hundred metres tall and was counted among the wonders of the ancient world. Later, Roman engineers \
    raised towers along the coasts of their empire, from Dover to the Black Sea.";

pub fn reconnect(a: ReconnectArgs) -> Result<()> {
    let model = a.model.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let (_, meta) = open_model(&model)?;
    if a.stages < 2 {
        bail!("--stages must be at least 2 (a link between two hosts)");
    }
    if a.tokens + 150 > CONTEXT as usize {
        bail!("-n {} does not fit the context of {CONTEXT} with the prompt", a.tokens);
    }
    let points = even_split(meta.n_layer, a.stages, meta.layer_period())?;
    let stages = split_ranges(meta.n_layer, &points, meta.layer_period(), meta.arch.name())?;
    let lab = Lab::start("rc", &model, &stages, CHUNK, CONTEXT, &a.impair, &[])?;
    let flapped = (a.stages / 2) as usize;
    let args = ["--prompt", PROMPT, "--raw", "-n", &a.tokens.to_string(), "--ignore-eos", "--json"];
    // Token arrival times, read as they come.
    let crate::lab::Generation { child: gen, tokens: rx, errors } = lab.spawn_generation(&args)?;
    // The first arrival at or after token `n`.
    let wait_for = |n: usize| -> Result<(usize, Instant)> {
        loop {
            match rx.recv_timeout(Duration::from_secs(120)) {
                Ok((k, t)) if k >= n => return Ok((k, t)),
                Ok(_) => {}
                Err(_) => bail!("the generation stalled before token {n}"),
            }
        }
    };
    let mut flaps = Vec::new();
    for i in 1..=a.flaps {
        let at = a.tokens * i / (a.flaps + 1);
        wait_for(at)?;
        lab.net.link(flapped, false)?;
        std::thread::sleep(Duration::from_secs_f64(a.down_secs));
        // Tokens that arrived while the link was down were already on their way.
        let mut seen = at;
        while let Ok((k, _)) = rx.try_recv() {
            seen = k;
        }
        lab.net.link(flapped, true)?;
        let up = Instant::now();
        let (_, next) = wait_for(seen + 1)?;
        flaps.push((at, next.saturating_duration_since(up)));
    }
    let out = gen.wait_with_output()?;
    if !out.status.success() {
        bail!("shoal generate failed: {}", errors.join().unwrap_or_default());
    }
    let piped: GenOutput = serde_json::from_slice(&out.stdout).context("parsing shoal generate --json")?;
    let mut run = Command::new(shoal::shoal_exe()?);
    run.arg("run").arg("--model").arg(&model);
    run.args(["--chunk", &CHUNK.to_string(), "--ctx", &CONTEXT.to_string()]).args(args);
    let unsplit: GenOutput = json_of(run, "run")?;
    let identical = piped.tokens == unsplit.tokens && piped.logits_digest == unsplit.logits_digest;
    let ms: Vec<f64> = flaps.iter().map(|(_, d)| d.as_secs_f64() * 1000.0).collect();
    let (p50, max) =
        if ms.is_empty() { (0.0, 0.0) } else { (median(&mut ms.clone()), ms.iter().copied().fold(0.0, f64::max)) };
    if a.json {
        let v = serde_json::json!({
            "stages": a.stages,
            "flapped_host": flapped,
            "down_s": a.down_secs,
            "flaps": flaps.iter().map(|(at, d)| serde_json::json!({"at_token": at, "link_up_to_next_token_ms": d.as_secs_f64() * 1000.0})).collect::<Vec<_>>(),
            "p50_ms": p50,
            "max_ms": max,
            "tokens": piped.tokens.len(),
            "identical": identical,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "bench reconnect: {} ({} layers), {} hosts in network namespaces, split at {points:?}, {} tokens, host {flapped}'s link down {:.1} s × {}{}",
            model.display(),
            meta.n_layer,
            a.stages,
            a.tokens,
            a.down_secs,
            a.flaps,
            if a.impair.is_none() { String::new() } else { format!(", impairment on every host: {:?}", a.impair) }
        );
        println!("{:>5} {:>9} {:>22}", "flap", "at token", "link up → next token");
        for (i, (at, d)) in flaps.iter().enumerate() {
            println!("{:>5} {at:>9} {:>19.0} ms", i + 1, d.as_secs_f64() * 1000.0);
        }
        if !flaps.is_empty() {
            println!("link up → next token: p50 {p50:.0} ms, max {max:.0} ms (target p50 ≤ 500 ms)");
        }
        println!(
            "tokens and logits identical to the unsplit run: {} ({} tokens)",
            if identical { "yes" } else { "NO" },
            piped.tokens.len()
        );
    }
    if !identical {
        bail!("the pipeline's output differs from the unsplit run's");
    }
    Ok(())
}
