//! `shoal-lab bench live-plan`: the live path's prediction against reality. Two cluster
//! nodes on loopback (their outgoing packets delayed by the impairment layer) form a
//! cluster; `shoal plan --write-placement` makes them measure themselves (a quick
//! calibration each, link probes) and predicts the placement's decode speed; the
//! placement is served by two stage processes (same delay) and generations measure it.
//! Unlike `bench plan`, which builds the profile from the stages' own counters, every
//! input here comes from the measurements Shoal keeps in the cluster state.

use super::{json_of, median, Children, SHORT_PROMPT};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct LivePlanArgs {
    /// The GGUF model [default: SmolLM2-135M from the test models].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// One-way delays to try, ms, added to every packet each process sends.
    #[arg(long, value_delimiter = ',', default_value = "0,3,10")]
    delays: Vec<u64>,
    /// Tokens generated per measured run.
    #[arg(short = 'n', long, default_value_t = 96)]
    tokens: usize,
    /// Measured runs per delay (the median counts).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// One delay's figures.
#[derive(serde::Serialize)]
struct Row {
    delay_ms: u64,
    predicted_tok_s: f64,
    measured_tok_s: Vec<f64>,
    median_tok_s: f64,
    error: f64,
    /// The plan's first explanation line (what it was measured from).
    basis: String,
}

pub fn live_plan(a: LivePlanArgs) -> Result<()> {
    let model = a.model.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let (_, meta) = shoal_engine::open_model(&model)?;
    let split = super::even_split(meta.n_layer, 2, meta.layer_period())?[0];
    let mut rows = Vec::new();
    for &delay in &a.delays {
        rows.push(one_delay(&model, meta.n_layer, split, delay, &a)?);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "rows": rows }))?);
        return Ok(());
    }
    println!(
        "bench live-plan: {} on two cluster nodes on loopback (split at {split}), measured by Shoal itself; {} tokens, median of {} runs",
        model.display(),
        a.tokens,
        a.rounds
    );
    println!("{:>6} {:>10} {:>10} {:>7}  measured runs", "delay", "predicted", "measured", "error");
    for r in &rows {
        let runs: Vec<String> = r.measured_tok_s.iter().map(|t| format!("{t:.2}")).collect();
        println!(
            "{:>3} ms {:>10.2} {:>10.2} {:>+6.1}%  {}",
            r.delay_ms,
            r.predicted_tok_s,
            r.median_tok_s,
            r.error * 100.0,
            runs.join(", ")
        );
    }
    let worst = rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
    println!("worst error {:.1}%; the plan's basis: {}", worst * 100.0, rows[0].basis);
    Ok(())
}

/// Two fresh cluster nodes with `delay`, planned, served and measured.
fn one_delay(model: &Path, n_layer: u32, split: u32, delay: u64, a: &LivePlanArgs) -> Result<Row> {
    let exe = shoal::shoal_exe().context("locating the shoal binary")?;
    let dir = tempfile::tempdir()?;
    let impair = if delay == 0 { String::new() } else { format!("delay={delay}ms") };
    let data = |n: &str| dir.path().join(n);
    let cli = |args: &[&str], d: &Path| -> Command {
        let mut c = Command::new(&exe);
        c.args(args).arg("--data-dir").arg(d);
        c
    };
    // B's key first: a node and `shoal key` creating it at once would make two.
    let out = cli(&["key"], &data("b")).output()?;
    let id_b = String::from_utf8(out.stdout)?.trim().to_string();
    let mut procs = Children(Vec::new());
    for (name, flag) in [("a", "--create-cluster"), ("b", "--no-create")] {
        let child = cli(&["serve", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0"], &data(name))
            .args(["--mdns-allow", "lo", "--name", name, flag, "--impair", &impair, "--no-http", "--threads", "1"])
            .stderr(Stdio::null())
            .spawn()?;
        procs.0.push(child);
    }
    // B pending at A → approved → both see two live members.
    let t0 = Instant::now();
    let mut approved = false;
    loop {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("the two nodes did not form a cluster within 30 s");
        }
        let st: Option<Value> = cli(&["status", "--json"], &data("a"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| serde_json::from_slice(&o.stdout).ok());
        if let Some(st) = st {
            let members = st["members"].as_array().cloned().unwrap_or_default();
            if approved && members.len() == 2 && members.iter().all(|m| m["state"] == "alive") {
                break;
            }
            let pending = st["pending"].as_array().is_some_and(|p| p.iter().any(|p| p["node"] == id_b.as_str()));
            if !approved && pending {
                // B's owner agrees to an approval from A first: an approval alone is
                // refused.
                let member = st["node"].as_str().unwrap_or_default().to_string();
                let accepted = member.len() >= 16
                    && cli(&["join", "--accept", &member[..16]], &data("b")).output()?.status.success();
                approved = accepted && cli(&["nodes", "approve", &id_b], &data("a")).output()?.status.success();
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Planning the placement measures both nodes (calibration and links) first.
    let placement = dir.path().join("p.toml");
    let pins = format!("0-{split}:a/cpu,{split}-{n_layer}:b/cpu");
    let mut plan = cli(&["plan", "--json", "--context", "1024", "--pin", &pins], &data("a"));
    plan.arg("--write-placement").arg(&placement).arg("--model").arg(model);
    plan.args(["--stage-port", &super::free_port_pair()?.to_string()]);
    let plan: Value = json_of(plan, "plan")?;
    let predicted = plan["predicted_tok_s"].as_f64().context("the plan has no prediction")?;
    let basis = plan["explanation"][0].as_str().unwrap_or_default().to_string();
    for name in ["b", "a"] {
        let mut c = cli(&["serve", "--impair", &impair, "--threads", "1"], &data(name));
        c.arg("--placement").arg(&placement);
        let (child, _) = crate::lab::spawn_ready(&mut c, &format!("the stage on {name}"))?;
        procs.0.push(child);
    }
    let generate = |n: usize| -> Result<f64> {
        let mut c = cli(&["generate", "--json", "--raw", "--ignore-eos", "--prompt", SHORT_PROMPT], &data("a"));
        c.args(["-n", &n.to_string()]).arg("--placement").arg(&placement);
        let out: super::GenOutput = json_of(c, "generate")?;
        Ok(out.tok_per_s)
    };
    generate(8).context("warm-up")?;
    let mut measured = Vec::new();
    for _ in 0..a.rounds.max(1) {
        measured.push(generate(a.tokens)?);
    }
    let median_tok_s = median(&mut measured.clone());
    drop(procs);
    Ok(Row {
        delay_ms: delay,
        predicted_tok_s: predicted,
        error: (predicted - median_tok_s) / median_tok_s,
        measured_tok_s: measured,
        median_tok_s,
        basis,
    })
}
