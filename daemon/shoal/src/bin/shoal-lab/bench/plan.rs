//! `shoal-lab bench plan`: checks the planner's predictions against reality. For each
//! configuration (a split of SmolLM2 over 2–3 namespace hosts, a one-way delay on every
//! link applied by the impairment layer, keep-alive off or on) it starts the stages,
//! calibrates the profile as Shoal does when it first places a model (a generation;
//! then each node's measured decode compute per token gives ms per layer and the LM
//! head's ms; bare QUIC between two endpoints gives a hop's cost back to back, which
//! goes to the link, and what an idle receiver adds, which is the device's wake-up
//! cost, waived with keep-alive), asks `shoal_planner::predict` for the decode speed,
//! and then measures it with further generations. Calibrating per configuration keeps
//! a shared, noisy machine's drift out of the comparison.

use super::{json_of, median, quinn_alone, GenOutput, SHORT_PROMPT};
use crate::lab::Lab;
use anyhow::{bail, Context, Result};
use clap::Args;
use shoal_engine::open_model;
use shoal_planner::{predict, Cluster, Device, Link, ModelProfile, Options, Pin};
use shoal_types::LayerRange;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct PlanBenchArgs {
    /// The GGUF model [default: SmolLM2-135M from the test models].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Tokens generated per measured run.
    #[arg(short = 'n', long, default_value_t = 96)]
    tokens: usize,
    /// Measured runs per configuration (the median counts).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Only the first N configurations.
    #[arg(long)]
    configs: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// (split points, one-way delay on every link in ms, keep-alive). Keep-alive runs with
/// two stages only: three spinning stages would share this machine's two cores.
const CONFIGS: [(&[u32], u64, bool); 7] = [
    (&[15], 0, false),
    (&[10], 3, false),
    (&[10, 20], 3, false),
    (&[20], 10, false),
    (&[10], 3, true),
    (&[8, 22], 0, false),
    (&[15], 0, true),
];

/// One configuration's figures.
#[derive(serde::Serialize)]
struct Row {
    split: Vec<u32>,
    delay_ms: u64,
    keepalive: bool,
    ms_per_layer: f64,
    head_ms: f64,
    wake_ms: f64,
    /// Predicted from the compute the nodes measured during the measured runs.
    predicted_tok_s: f64,
    measured_tok_s: f64,
    error: f64,
    /// Predicted from the calibration run before them.
    prior_predicted_tok_s: f64,
    prior_error: f64,
}

pub fn plan(a: PlanBenchArgs) -> Result<()> {
    let model = a.model.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let (_, meta) = open_model(&model)?;
    let profile = ModelProfile::from_meta(&meta);
    let n = a.tokens.to_string();
    let mut rows = Vec::new();
    if !a.json {
        println!(
            "bench plan: {} ({} layers), stages on network-namespace hosts, {} tokens, median of {} runs per configuration",
            model.display(),
            meta.n_layer,
            a.tokens,
            a.rounds
        );
        println!(
            "{:<10} {:>6} {:>5} {:>9} {:>8} {:>7} {:>6} {:>10} {:>10} {:>7} {:>10} {:>7}",
            "split",
            "delay",
            "k-a",
            "ms/layer",
            "head ms",
            "wake ms",
            "hosts",
            "predicted",
            "measured",
            "error",
            "prior pred",
            "error"
        );
    }
    for (split, delay_ms, keepalive) in CONFIGS.iter().take(a.configs.unwrap_or(CONFIGS.len())) {
        let stages: Vec<LayerRange> = {
            let mut b = vec![0];
            b.extend(split.iter());
            b.push(meta.n_layer);
            b.windows(2).map(|w| LayerRange { start: w[0], end: w[1] }).collect()
        };
        let impair: shoal_net::Impairment = format!("delay={delay_ms}ms").parse().map_err(anyhow::Error::msg)?;
        let lab = Lab::start(
            "pl",
            &model,
            &stages,
            128,
            2048,
            &impair,
            &["--keepalive", if *keepalive { "on" } else { "off" }],
        )?;
        let run = |n: &str| -> Result<GenOutput> {
            let mut c = lab.generate();
            c.args(["--raw", "--ignore-eos", "--json", "--prompt", SHORT_PROMPT, "-n", n]);
            json_of(c, "generate")
        };
        // Calibration, as Shoal profiles a device when it first places a model there:
        // a generation, then each node's measured decode compute per token.
        run(&(a.tokens / 2).max(8).to_string()).context("calibration run")?;
        let calibration = lab.status()?;
        let compute: Vec<f64> = calibration.iter().map(|s| s.decode_compute_ms).collect();
        // A hop: bare QUIC back to back is the link's part (with the delay); what an
        // idle receiver adds to it, plus the receiving node's hand-off to its stage
        // thread and back (the mean over the nodes), is the wake-up cost.
        let handoff = calibration.iter().map(|s| s.decode_handoff_ms).sum::<f64>() / calibration.len() as f64;
        let (idle_ms, _) = quinn_alone(profile.frame_bytes(1) as usize, Duration::from_millis(10))?;
        let (hot_ms, _) = quinn_alone(profile.frame_bytes(1) as usize, Duration::ZERO)?;
        let wake_ms = (idle_ms - hot_ms).max(0.0) + handoff;
        let hosts: Vec<String> = (0..stages.len()).map(|k| format!("h{k}")).collect();
        let predict_with = |compute: &[f64]| -> Result<(f64, f64, f64)> {
            let (ms_per_layer, head_ms) = per_layer_and_head(compute, &stages);
            let cluster = Cluster {
                devices: hosts
                    .iter()
                    .map(|h| Device {
                        id: format!("{h}/cpu"),
                        host: h.clone(),
                        memory_bytes: 64 << 30,
                        ms_per_layer,
                        prefill_ms_per_layer_token: None,
                        head_ms,
                        wake_ms,
                        keepalive: *keepalive,
                        estimated: false,
                        offload: false,
                    })
                    .collect(),
                links: hosts
                    .iter()
                    .flat_map(|x| hosts.iter().map(move |y| (x, y)))
                    .filter(|(x, y)| x < y)
                    .map(|(x, y)| Link {
                        hosts: [x.clone(), y.clone()],
                        ms_per_frame: *delay_ms as f64 + hot_ms,
                        mbit_per_s: None,
                    })
                    .collect(),
            };
            let placement: Vec<Pin> =
                stages.iter().zip(&hosts).map(|(r, h)| Pin { device: format!("{h}/cpu"), layers: *r }).collect();
            Ok((predict(&profile, &cluster, &placement, &Options::default())?.predicted_tok_s, ms_per_layer, head_ms))
        };
        let (prior, ms_per_layer, head_ms) = predict_with(&compute)?;
        // Each measured run is also predicted from the compute the nodes measured during
        // it, so the machine's drift between runs falls out of the comparison.
        let (mut measured, mut same_run) = (Vec::new(), Vec::new());
        let mut before = lab.status()?;
        for _ in 0..a.rounds.max(1) {
            measured.push(run(&n)?.tok_per_s);
            let after = lab.status()?;
            let compute: Vec<f64> = before
                .iter()
                .zip(&after)
                .map(|(b, a)| {
                    let steps = a.decode_steps.saturating_sub(b.decode_steps).max(1) as f64;
                    (a.decode_compute_ms * a.decode_steps as f64 - b.decode_compute_ms * b.decode_steps as f64) / steps
                })
                .collect();
            same_run.push(predict_with(&compute)?.0);
            before = after;
        }
        drop(lab);
        let errors: Vec<f64> = same_run.iter().zip(&measured).map(|(p, m)| (p - m) / m).collect();
        let error = errors[errors.len() / 2];
        let predicted = median(&mut same_run);
        let measured = median(&mut measured);
        let prior_error = (prior - measured) / measured;
        let row = Row {
            split: split.to_vec(),
            delay_ms: *delay_ms,
            keepalive: *keepalive,
            ms_per_layer,
            head_ms,
            wake_ms,
            predicted_tok_s: predicted,
            measured_tok_s: measured,
            error,
            prior_predicted_tok_s: prior,
            prior_error,
        };
        if !a.json {
            println!(
                "{:<10} {:>3} ms {:>5} {:>9.4} {:>8.3} {:>7.3} {:>6} {:>10.2} {:>10.2} {:>+6.1}% {:>10.2} {:>+6.1}%",
                format!("{:?}", row.split),
                row.delay_ms,
                if row.keepalive { "on" } else { "off" },
                row.ms_per_layer,
                row.head_ms,
                row.wake_ms,
                stages.len(),
                row.predicted_tok_s,
                row.measured_tok_s,
                row.error * 100.0,
                row.prior_predicted_tok_s,
                row.prior_error * 100.0
            );
        }
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("no configuration ran");
    }
    let mut errors: Vec<f64> = rows.iter().map(|r| r.error.abs()).collect();
    let worst = errors.iter().copied().fold(0.0, f64::max);
    let med = median(&mut errors);
    let mut prior: Vec<f64> = rows.iter().map(|r| r.prior_error.abs()).collect();
    let prior_worst = prior.iter().copied().fold(0.0, f64::max);
    let prior_med = median(&mut prior);
    if a.json {
        let v = serde_json::json!({
            "rows": rows,
            "worst_error": worst,
            "median_error": med,
            "prior_worst_error": prior_worst,
            "prior_median_error": prior_med,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "predicted from the nodes' compute in the same runs: worst error {:.1}%, median {:.1}% (target: worst ≤ 10%, median ≤ 5%)",
            worst * 100.0,
            med * 100.0
        );
        println!(
            "predicted from a calibration run before them: worst error {:.1}%, median {:.1}% (this machine's speed drifts between runs)",
            prior_worst * 100.0,
            prior_med * 100.0
        );
    }
    Ok(())
}

/// Decode ms per layer and LM-head ms from the nodes' measured compute per token:
/// the non-tail stages give ms per layer (all hosts share this machine's CPU); the
/// tail's excess over its layers is the head.
fn per_layer_and_head(compute_ms: &[f64], stages: &[LayerRange]) -> (f64, f64) {
    let k = stages.len() - 1;
    let (ms, layers) =
        compute_ms[..k].iter().zip(stages).fold((0.0, 0u32), |(m, l), (c, r)| (m + c, l + (r.end - r.start)));
    let per_layer = ms / f64::from(layers.max(1));
    let tail_layers = f64::from(stages[k].end - stages[k].start);
    (per_layer, (compute_ms[k] - per_layer * tail_layers).max(0.0))
}
