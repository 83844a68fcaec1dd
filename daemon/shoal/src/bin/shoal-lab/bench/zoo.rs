//! `shoal-lab bench zoo`: the model zoo's cost and speed. Each family's zoo model is
//! written (the time that takes is what the suite pays to build the zoo), then decoded
//! unsplit and split into two in-process stages, alternating round by round: tok/s
//! side by side, their ratio, and whether the outputs were identical.

use super::{even_split, json_of, median, RunOutput, SHORT_PROMPT};
use anyhow::{bail, Context, Result};
use clap::Args;
use shoal_gguf::zoo::Family;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ZooArgs {
    /// Tokens generated per run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Alternating rounds (each runs every family unsplit once and split once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 32)]
    chunk: u32,
    /// The GGUF whose vocabulary the zoo models copy [default: the SmolLM2 test model].
    #[arg(long)]
    vocab: Option<PathBuf>,
}

/// One family's figures.
struct Row {
    family: Family,
    write_ms: f64,
    bytes: u64,
    point: u32,
    unsplit: Vec<f64>,
    split: Vec<f64>,
    identical: bool,
}

pub fn zoo(a: ZooArgs) -> Result<()> {
    let vocab = a.vocab.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !vocab.exists() {
        bail!("{} is missing: run scripts/setup.sh (or pass --vocab)", vocab.display());
    }
    let dir = tempfile::tempdir().context("creating a directory for the zoo")?;
    let exe = shoal::shoal_exe().context("locating the shoal binary")?;

    // Write the zoo, timing each family.
    let mut rows = Vec::new();
    let t_all = Instant::now();
    for family in Family::ALL {
        let path = dir.path().join(format!("{}.gguf", family.arch()));
        let t = Instant::now();
        shoal_gguf::zoo::write(*family, &vocab, &path)
            .with_context(|| format!("writing the {} zoo model", family.arch()))?;
        let write_ms = t.elapsed().as_secs_f64() * 1000.0;
        let (_, meta) = shoal_gguf::open_model(&path)?;
        let point = even_split(meta.n_layer, 2, meta.layer_period())?[0];
        let bytes = std::fs::metadata(&path)?.len();
        rows.push(Row {
            family: *family,
            write_ms,
            bytes,
            point,
            unsplit: Vec::new(),
            split: Vec::new(),
            identical: true,
        });
    }
    let zoo_ms = t_all.elapsed().as_secs_f64() * 1000.0;

    let cache = dir.path().join("shards");
    let run = |family: Family, split: Option<u32>| -> Result<RunOutput> {
        let mut cmd = Command::new(&exe);
        cmd.arg("run").arg("--model").arg(dir.path().join(format!("{}.gguf", family.arch())));
        cmd.args(["--raw", "--ignore-eos", "--json", "--prompt", SHORT_PROMPT, "--threads", "1"]);
        cmd.args(["-n", &a.tokens.to_string(), "--chunk", &a.chunk.to_string()]);
        cmd.arg("--cache").arg(&cache);
        if let Some(p) = split {
            cmd.args(["--split", &p.to_string()]);
        }
        json_of(cmd, "run")
    };
    // Build the shards once, outside the measurements.
    for r in &rows {
        run(r.family, Some(r.point)).with_context(|| format!("warm-up run of {}", r.family.arch()))?;
    }
    for _ in 0..a.rounds {
        for r in &mut rows {
            let u = run(r.family, None)?;
            let s = run(r.family, Some(r.point))?;
            r.identical &= u.tokens == s.tokens && u.logits_digest == s.logits_digest;
            r.unsplit.push(u.tok_per_s);
            r.split.push(s.tok_per_s);
        }
    }

    println!(
        "bench zoo: {} families written in {zoo_ms:.0} ms (vocabulary of {}); unsplit vs 2 in-process stages, \
         {} tokens, 1 thread per stage, chunk {}, medians of {} alternating rounds",
        rows.len(),
        vocab.display(),
        a.tokens,
        a.chunk,
        a.rounds
    );
    println!(
        "{:<10} {:>9} {:>9} {:>6} {:>14} {:>12} {:>7} {:>10}",
        "family", "write ms", "MiB", "split", "unsplit tok/s", "split tok/s", "ratio", "identical"
    );
    let mut all_identical = true;
    for r in &mut rows {
        let (u, s) = (median(&mut r.unsplit), median(&mut r.split));
        all_identical &= r.identical;
        println!(
            "{:<10} {:>9.1} {:>9.2} {:>6} {:>14.1} {:>12.1} {:>7.4} {:>10}",
            r.family.arch(),
            r.write_ms,
            r.bytes as f64 / (1024.0 * 1024.0),
            r.point,
            u,
            s,
            s / u,
            if r.identical { "yes" } else { "NO" }
        );
    }
    if !all_identical {
        bail!("a split run's output differs from its unsplit run's");
    }
    Ok(())
}
