//! `shoal-lab bench load` and `shoal-lab bench replace`: the one-daemon flow with plain
//! `shoal serve` processes on loopback (real QUIC, mDNS on `lo`, llama.cpp) or, with
//! `--netns`, each on a namespace host of its own, each offering little memory so that
//! the model must split.
//! - load: time from `models load` to every stage running, cold (shards travel) and
//!   warm (unloaded and loaded again: shards from the cache); transfer throughput
//!   against the loopback link's bandwidth as a node measures it; per stage, the
//!   planner's predicted memory against what llama.cpp allocated and the process's RSS
//!   growth.
//! - replace: during a generation, SIGKILL a stage's node; time from the kill to the
//!   next token, and the tokens replayed on the new placement.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;
use shoal::local::{wait, Lab};
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_node::api::{NodeRequest, NodeResponse};
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A prompt of about 100 tokens.
pub(crate) const PROMPT: &str =
    "The history of the lighthouse begins in antiquity, when fires were lit on hilltops to guide \
    ships into harbour. The Pharos of Alexandria, built in the third century BC, stood over a hundred metres tall \
    and was counted among the wonders of the ancient world. Later, Roman engineers raised towers along the coasts \
    of their empire, from Dover to the Black Sea.";

/// `shoal-lab bench load`.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// The GGUF model [default: the test model].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Nodes (each a `shoal serve` process).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Memory each node offers, MiB (small, so the model splits).
    #[arg(long, default_value_t = 90)]
    max_memory_mib: u64,
    /// Positions per session of the loaded model.
    #[arg(long, default_value_t = 512)]
    context: u32,
    /// Impair every node's sending (e.g. `rate=100mbit` for a LAN-like link, which
    /// loopback is not: there a transfer is bound by the CPU, not the link).
    #[arg(long)]
    impair: Option<shoal_net::Impairment>,
    /// Each node on a host of its own (network namespaces on a bridge, default ports,
    /// mDNS on every interface; needs root), not all on loopback.
    #[arg(long)]
    netns: bool,
}

/// `shoal-lab bench replace`.
#[derive(Args, Debug)]
pub struct ReplaceArgs {
    /// The GGUF model [default: the test model].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Stage nodes killed, one per round (a spare node is started for each; the dead
    /// node is removed after its round, so the cluster keeps its majority).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Memory each node offers, MiB (small, so the model splits in three).
    #[arg(long, default_value_t = 90)]
    max_memory_mib: u64,
    /// Tokens per generation.
    #[arg(short = 'n', long, default_value_t = 200)]
    tokens: usize,
    /// Which stage's node to kill: 1 (a middle stage), 0 (the coordinator's) or 2 (the
    /// last); another when n0 runs that one (n0 holds the only copy and asks).
    #[arg(long, default_value_t = 1)]
    stage: usize,
    /// Each node on a host of its own (network namespaces on a bridge; needs root).
    #[arg(long)]
    netns: bool,
}

pub(crate) fn model_or_default(m: &Option<PathBuf>) -> Result<PathBuf> {
    let p = m.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !p.exists() {
        bail!("{}: no such model (scripts/setup.sh fetches the test model)", p.display());
    }
    Ok(std::fs::canonicalize(&p)?)
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 20)
}

/// `shoal-lab bench load`.
pub fn load(a: LoadArgs) -> Result<()> {
    let model = model_or_default(&a.model)?;
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let extra = match &a.impair {
        Some(i) => vec!["--impair".to_string(), crate::bench::impair_spec(i)],
        None => Vec::new(),
    };
    let lab = if a.netns {
        Lab::start_on_hosts(a.nodes, a.max_memory_mib, &extra)?
    } else {
        Lab::start_with(a.nodes, a.max_memory_mib, None, &extra)?
    };
    lab.ask("n0", NodeRequest::ModelAdd { path: model.display().to_string(), name: None })?;
    // The link's bandwidth as the nodes measure it (a 4 MiB transfer).
    lab.admin("n1", AdminRequest::ProbeLinks { frame_bytes: 2304 })?;
    let links = match lab.admin("n1", AdminRequest::Entries { prefix: "links/".into() })? {
        AdminResponse::Entries(e) => e,
        _ => Default::default(),
    };
    let mbit: Vec<f64> = links
        .values()
        .filter_map(|v| {
            v.get("peers")?.as_object().map(|p| p.values().filter_map(|m| m["mbit_per_s"].as_f64()).collect::<Vec<_>>())
        })
        .flatten()
        .filter(|b| *b > 0.0)
        .collect();
    let link_mb_s = if mbit.is_empty() { 0.0 } else { mbit.iter().sum::<f64>() / mbit.len() as f64 / 8.0 };

    let mut generation = 0;
    println!(
        "{:<6} {:>8} {:>9} {:>8} {:>12} {:>12} {:>10}",
        "load", "stages", "placed s", "ready s", "bytes moved", "MB/s", "vs link"
    );
    let mut cold_stages = Vec::new();
    let mut warm_stages = Vec::new();
    for round in ["cold", "warm"] {
        let req = NodeRequest::ModelLoad { model: name.clone(), context: a.context, sessions: 1, exclude: vec![] };
        let t0 = Instant::now();
        lab.ask(&format!("n{}", a.nodes - 1), req)?;
        // Committed: after the members measured themselves and their links (the first
        // time only), before shards move.
        wait("the placement", 600, || Ok(lab.placement(&name)?.filter(|p| p.generation != generation)))?;
        let placed = t0.elapsed().as_secs_f64();
        let (p, stages) = lab.running(&name, generation)?;
        let ready = t0.elapsed().as_secs_f64();
        generation = p.generation;
        let moved: u64 = stages.iter().map(|(_, s)| s.shard_bytes_received).sum();
        let fetch_s: f64 =
            stages.iter().filter(|(_, s)| s.shard_bytes_received > 0).map(|(_, s)| s.shard_seconds).fold(0.0, f64::max);
        let mb_s = if fetch_s > 0.0 { moved as f64 / 1e6 / fetch_s } else { 0.0 };
        println!(
            "{round:<6} {:>8} {:>9.2} {:>8.2} {:>12} {:>12.1} {:>10}",
            stages.len(),
            placed,
            ready,
            moved,
            mb_s,
            if link_mb_s > 0.0 && mb_s > 0.0 { format!("{:.2}", mb_s / link_mb_s) } else { "-".into() }
        );
        if round == "warm" {
            // One short generation first: a stage's weights are mapped, and count as
            // resident once its layers have run.
            let out = lab
                .command("n0")
                .args(["generate", "--model", &name, "--ignore-eos", "--json", "-n", "8", "--prompt", "Hello"])
                .arg("--data-dir")
                .arg(lab.dir("n0"))
                .output()?;
            if !out.status.success() {
                bail!("the generation after the warm load failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            let (_, after) = lab.running(&name, u64::MAX)?;
            warm_stages = after;
        }
        if round == "cold" {
            cold_stages = stages.clone();
            lab.ask("n0", NodeRequest::ModelUnload { model: name.clone() })?;
            for n in lab.names() {
                wait("stages stopped", 60, || {
                    Ok(matches!(lab.ask(&n, NodeRequest::Stages)?, NodeResponse::Stages(s) if s.is_empty())
                        .then_some(()))
                })?;
            }
        }
    }
    println!(
        "link as the nodes measured it: {link_mb_s:.1} MB/s ({}{})",
        if a.netns { "namespace hosts on a bridge" } else { "loopback" },
        a.impair.as_ref().map_or(String::new(), |i| format!(", {}", crate::bench::impair_spec(i)))
    );
    println!();
    println!(
        "{:<6} {:>8} {:>14} {:>14} {:>10} {:>14} {:>10}",
        "node", "layers", "predicted MiB", "llama.cpp MiB", "ratio", "resident MiB", "ratio"
    );
    for (n, s) in &cold_stages {
        // The node's own figure (`shoal status`), of its warm stage: RSS growth since
        // that stage started loading.
        let grew = warm_stages
            .iter()
            .find(|(m, w)| m == n && w.layers == s.layers)
            .and_then(|(_, w)| w.resident_bytes)
            .unwrap_or(0);
        let loaded = s.loaded_bytes.unwrap_or(0);
        println!(
            "{n:<6} {:>8} {:>14.1} {:>14.1} {:>10.3} {:>14.1} {:>10.3}",
            s.layers.to_string(),
            mib(s.predicted_bytes),
            mib(loaded),
            loaded as f64 / s.predicted_bytes.max(1) as f64,
            mib(grew),
            grew as f64 / s.predicted_bytes.max(1) as f64
        );
    }
    println!("(resident: as each node reports its warm stage after an 8-token generation: its RSS growth since the stage loaded)");
    Ok(())
}

/// `shoal-lab bench replace`.
pub fn replace(a: ReplaceArgs) -> Result<()> {
    let model = model_or_default(&a.model)?;
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut lab = if a.netns {
        Lab::start_on_hosts(3 + a.rounds, a.max_memory_mib, &[])?
    } else {
        Lab::start(3 + a.rounds, a.max_memory_mib)?
    };
    lab.ask("n0", NodeRequest::ModelAdd { path: model.display().to_string(), name: None })?;
    // Room for the prompt (about 100 tokens) and the answer; small, so that the
    // offers force three stages and the spares can take a stage each.
    let context = (a.tokens as u32 + 128).div_ceil(128).max(4) * 128;
    lab.ask("n0", NodeRequest::ModelLoad { model: name.clone(), context, sessions: 1, exclude: vec![] })?;
    let (mut p, _) = lab.running(&name, 0)?;
    let prompt = PROMPT;
    println!(
        "{:<6} {:<8} {:>10} {:>14} {:>16} {:>12}",
        "round", "killed", "stage", "kill→token s", "tokens replayed", "same answer"
    );
    let mut gaps = Vec::new();
    let mut reference: Option<Value> = None;
    for round in 0..a.rounds {
        // A stage's node other than n0 (which holds the only copy and asks).
        let n0 = lab.id_of("n0")?;
        let pick = [a.stage, 1, 0, 2];
        let Some(i) = pick.iter().copied().find(|&i| p.stages.get(i).is_some_and(|s| s.node.to_string() != n0)) else {
            bail!("no stage to kill");
        };
        let victim_id = p.stages[i].node.to_string();
        let victim = lab
            .names()
            .into_iter()
            .find(|n| lab.id_of(n).ok().as_deref() == Some(victim_id.as_str()))
            .context("victim")?;
        let mut gen = lab
            .command("n0")
            .args(["generate", "--model", &name, "--progress", "--ignore-eos", "--json", "--prompt", prompt])
            .args(["-n", &a.tokens.to_string()])
            .arg("--data-dir")
            .arg(lab.dir("n0"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = gen.stderr.take().context("stderr")?;
        let (tx, rx) = std::sync::mpsc::channel::<Instant>();
        // What the generation said besides its tokens (its error, if it fails).
        let reader = std::thread::spawn(move || {
            let mut said = Vec::new();
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if !line.starts_with("token ") {
                    said.push(line);
                } else if tx.send(Instant::now()).is_err() {
                    break;
                }
            }
            said
        });
        let mut seen = 0;
        while seen < a.tokens / 4 {
            rx.recv_timeout(Duration::from_secs(120)).context("the generation did not get under way")?;
            seen += 1;
        }
        let killed = Instant::now();
        lab.kill(&victim);
        let Ok(next) = rx.recv_timeout(Duration::from_secs(300)) else {
            let _ = gen.kill();
            let said = reader.join().unwrap_or_default();
            bail!("round {round}: no token after the kill: {}", said.join(" | "));
        };
        let gap = next.saturating_duration_since(killed).as_secs_f64();
        while rx.recv_timeout(Duration::from_secs(300)).is_ok() {}
        let out = gen.wait_with_output()?;
        let said = reader.join().unwrap_or_default();
        if !out.status.success() {
            bail!("round {round}: the generation failed: {}", said.join(" | "));
        }
        let g: Value = serde_json::from_slice(&out.stdout)?;
        let same = match &reference {
            None => {
                // The first round's answer against an unsplit run.
                let r = Command::new(&lab.exe)
                    .args(["run", "--model"])
                    .arg(&model)
                    .args([
                        "--chunk",
                        "128",
                        "--ctx",
                        &context.to_string(),
                        "--ignore-eos",
                        "--json",
                        "--prompt",
                        prompt,
                    ])
                    .args(["-n", &a.tokens.to_string()])
                    .output()?;
                let r: Value = serde_json::from_slice(&r.stdout)?;
                let same = r["tokens"] == g["tokens"] && r["logits_digest"] == g["logits_digest"];
                reference = Some(r);
                same
            }
            Some(r) => r["tokens"] == g["tokens"] && r["logits_digest"] == g["logits_digest"],
        };
        let replayed = g["prompt_tokens"].as_u64().unwrap_or(0) + seen as u64;
        println!("{round:<6} {victim:<8} {:>10} {gap:>14.2} {replayed:>16} {same:>12}", i.to_string());
        gaps.push(gap);
        let (q, _) = lab.running(&name, p.generation)?;
        p = q;
        // The owner removes the dead node, as after a machine is gone for good: the
        // cluster keeps a majority of its members up for the next round.
        lab.admin("n0", AdminRequest::Remove { node: victim_id.clone() })?;
    }
    gaps.sort_by(f64::total_cmp);
    println!(
        "kill → next token: p50 {:.2} s, max {:.2} s over {} rounds",
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1],
        gaps.len()
    );
    Ok(())
}
