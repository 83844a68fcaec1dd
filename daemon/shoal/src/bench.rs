//! `shoal bench …`: commands that print figures. Each measurement runs in a child
//! process (`shoal run --json`) so that peak RSS is per configuration, and the
//! configurations alternate round by round so that a noisy machine hurts both alike.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::Deserialize;
use shoal_engine::{open_model, ShardCache};
use shoal_types::split_ranges;
use std::path::PathBuf;
use std::process::Command;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Unsplit vs split into K in-process stages: decode tok/s, ratio, peak RSS.
    Split(SplitArgs),
}

#[derive(Args, Debug)]
pub struct SplitArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// Number of stages of the split run.
    #[arg(long, default_value_t = 2)]
    stages: u32,
    /// Tokens generated per run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Alternating rounds (each runs unsplit once and split once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// CPU threads per stage (and for the unsplit run).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// Where shard files are cached [default: ~/.cache/shoal/shards].
    #[arg(long)]
    cache: Option<PathBuf>,
}

/// The part of `shoal run --json` a benchmark reads.
#[derive(Deserialize)]
struct RunOutput {
    tokens: Vec<i32>,
    tok_per_s: f64,
    logits_digest: String,
    stage_ms: Vec<f64>,
    peak_rss_bytes: Option<u64>,
}

pub fn bench(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Split(a) => split(a),
    }
}

/// Split points for `k` stages of `n_layer` layers, as even as the period allows.
pub fn even_split(n_layer: u32, k: u32, period: u32) -> Result<Vec<u32>> {
    let mut points = Vec::new();
    for i in 1..k {
        let ideal = f64::from(i) * f64::from(n_layer) / f64::from(k) / f64::from(period);
        let p = (ideal.round() as u32) * period;
        if p == 0 || p >= n_layer || points.last().is_some_and(|&l| p <= l) {
            bail!("cannot split {n_layer} layers into {k} stages on a period of {period}");
        }
        points.push(p);
    }
    Ok(points)
}

fn split(a: SplitArgs) -> Result<()> {
    let (_, meta) = open_model(&a.model)?;
    let points = even_split(meta.n_layer, a.stages, meta.layer_period())?;
    let cache = ShardCache::new(a.cache.clone().unwrap_or_else(crate::run::default_cache));
    let ranges = split_ranges(meta.n_layer, &points, meta.layer_period(), meta.arch.name())?;
    let mut files = vec![a.model.clone()];
    for r in ranges {
        files.push(cache.shard_path(&a.model, r)?);
    }
    let exe = std::env::current_exe().context("locating the shoal binary")?;
    let run_once = |split: &[u32]| -> Result<RunOutput> {
        // Every run starts with the model's files out of the page cache. Otherwise the
        // history of a file's pages decides the speed: a freshly written copy of the
        // same bytes was measured decoding 15% faster than an old one.
        files.iter().for_each(|f| drop_page_cache(f));
        let mut cmd = Command::new(&exe);
        cmd.arg("run").arg("--model").arg(&a.model).args(["--raw", "--ignore-eos", "--json"]);
        cmd.args(["--prompt", "Once upon a time, in a quiet harbour town, there lived an old lighthouse keeper who"]);
        cmd.args(["-n", &a.tokens.to_string(), "--threads", &a.threads.to_string(), "--chunk", &a.chunk.to_string()]);
        cmd.arg("--cache").arg(cache.dir());
        if !split.is_empty() {
            cmd.arg("--split").arg(split.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
        }
        let out = cmd.output().context("running shoal run")?;
        if !out.status.success() {
            bail!("shoal run failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        serde_json::from_slice(&out.stdout).context("parsing shoal run --json")
    };
    // Build the shards once, outside the measurements.
    run_once(&points).context("warm-up run")?;

    println!(
        "bench split: {} ({}, {} layers), {} stages split at {:?}, {} tokens, {} thread(s) per stage, chunk {}, \
         page cache of the model files dropped before each run",
        a.model.display(),
        meta.arch.name(),
        meta.n_layer,
        a.stages,
        points,
        a.tokens,
        a.threads,
        a.chunk
    );
    println!("{:>6} {:>14} {:>12} {:>7}   split ms per stage", "round", "unsplit tok/s", "split tok/s", "ratio");
    let (mut u, mut s) = (Vec::new(), Vec::new());
    let (mut rss_u, mut rss_s) = (0u64, 0u64);
    let mut identical = true;
    for round in 1..=a.rounds {
        let ru = run_once(&[])?;
        let rs = run_once(&points)?;
        identical &= ru.tokens == rs.tokens && ru.logits_digest == rs.logits_digest;
        let per_stage: Vec<String> = rs.stage_ms.iter().map(|ms| format!("{ms:.0}")).collect();
        println!(
            "{round:>6} {:>14.2} {:>12.2} {:>7.4}   {}",
            ru.tok_per_s,
            rs.tok_per_s,
            rs.tok_per_s / ru.tok_per_s,
            per_stage.join(" / ")
        );
        rss_u = rss_u.max(ru.peak_rss_bytes.unwrap_or(0));
        rss_s = rss_s.max(rs.peak_rss_bytes.unwrap_or(0));
        u.push(ru.tok_per_s);
        s.push(rs.tok_per_s);
    }
    let (mu, ms) = (median(&mut u), median(&mut s));
    println!("{:>6} {mu:>14.2} {ms:>12.2} {:>7.4}", "median", ms / mu);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "peak RSS: unsplit {:.1} MiB, split {:.1} MiB (all {} stages in one process), ratio {:.3}",
        mib(rss_u),
        mib(rss_s),
        a.stages,
        rss_s as f64 / rss_u.max(1) as f64
    );
    println!("tokens and logits identical: {}", if identical { "yes" } else { "NO" });
    if !identical {
        bail!("the split run's output differs from the unsplit run's");
    }
    Ok(())
}

/// Ask the kernel to forget the file's cached pages (best effort; Linux only).
fn drop_page_cache(path: &std::path::Path) {
    #[cfg(target_os = "linux")]
    if let Ok(f) = std::fs::File::open(path) {
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = path;
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::even_split;

    #[test]
    fn even_splits_respect_the_period() {
        assert_eq!(even_split(30, 2, 1).unwrap(), vec![15]);
        assert_eq!(even_split(30, 3, 1).unwrap(), vec![10, 20]);
        assert_eq!(even_split(18, 3, 6).unwrap(), vec![6, 12]);
        assert_eq!(even_split(18, 2, 6).unwrap(), vec![12]);
        assert!(even_split(18, 4, 6).is_err());
    }
}
