//! `shoal plan`: the planner's answer for a model on a described cluster (a profile
//! file: what-if) or on this machine, or its prediction for a given placement. The
//! planner itself is pure (`shoal-planner`); this file reads files and the machine.

use anyhow::{bail, Context, Result};
use clap::Args;
use shoal_engine::open_model;
use shoal_planner::plan::{gib, parse_stages};
use shoal_planner::{predict, Cluster, Device, ModelProfile, ModelSpec, Options, Plan, Profile};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The GGUF model (or give it in the profile's [model]).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// A cluster profile (TOML: [model], [[device]], [[link]]; see the README). Without
    /// it, Shoal plans for this machine alone (the live cluster comes with membership).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Predict this placement instead of choosing one: "0-16:host/dev,16-30:host2/dev".
    #[arg(long)]
    placement: Option<String>,
    /// Positions per session [default: the profile's, else 4096].
    #[arg(long)]
    context: Option<u32>,
    /// Sessions held at once.
    #[arg(long, default_value_t = 1)]
    sessions: u32,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// Prompt length of the time-to-first-token prediction.
    #[arg(long, default_value_t = 1000)]
    prompt_tokens: u32,
    /// Memory kept free on every device, MiB.
    #[arg(long, default_value_t = shoal_planner::plan::DEFAULT_RESERVE >> 20)]
    reserve_mib: u64,
    /// Layers that must go on a device, e.g. "0-20:desktop/gpu0" (repeatable or comma-separated).
    #[arg(long)]
    pin: Vec<String>,
    /// A device id or host name not to use (repeatable).
    #[arg(long)]
    exclude: Vec<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Memory bandwidth assumed for this machine's CPU when nothing was measured (dual-channel DDR4).
const ASSUMED_GB_PER_S: f64 = 20.0;

pub fn plan(a: PlanArgs) -> Result<()> {
    let (model, cluster, profile_context, local) = inputs(&a)?;
    let mut opts = Options {
        prompt_tokens: a.prompt_tokens,
        reserve_bytes: a.reserve_mib << 20,
        exclude: a.exclude.clone(),
        ..Options::default()
    };
    opts.sizing.context = a.context.or(profile_context).unwrap_or(opts.sizing.context);
    opts.sizing.sessions = a.sessions.max(1);
    opts.sizing.chunk = a.chunk.max(1);
    for p in &a.pin {
        opts.pins.extend(parse_stages(p)?);
    }
    let mut result = match &a.placement {
        Some(s) => predict(&model, &cluster, &parse_stages(s)?, &opts)?,
        None => shoal_planner::plan(&model, &cluster, &opts)?,
    };
    if local {
        result.explanation.insert(
            0,
            "Planned for this machine alone, its speed estimated from an assumed memory bandwidth (pass --profile to plan a cluster).".into(),
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print_plan(&result);
    }
    Ok(())
}

/// The model's sizes and the cluster: from the profile, else this machine.
fn inputs(a: &PlanArgs) -> Result<(ModelProfile, Cluster, Option<u32>, bool)> {
    let from_gguf = |p: &std::path::Path| -> Result<ModelProfile> {
        let (_, meta) = open_model(p)?;
        Ok(ModelProfile::from_meta(&meta))
    };
    match &a.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let profile = Profile::parse(&text).with_context(|| path.display().to_string())?;
            let model = match (&a.model, profile.model) {
                (Some(m), _) => from_gguf(m)?,
                (None, ModelSpec::Given(m)) => m,
                (None, ModelSpec::Path(p)) => {
                    // Relative to the profile file.
                    let base = path.parent().unwrap_or(std::path::Path::new("."));
                    from_gguf(&base.join(p))?
                }
            };
            if profile.cluster.devices.is_empty() {
                bail!("{} lists no [[device]]", path.display());
            }
            Ok((model, profile.cluster, profile.context, false))
        }
        None => {
            let Some(m) = &a.model else { bail!("give --model (or a --profile with a [model])") };
            let model = from_gguf(m)?;
            Ok((model.clone(), this_machine(&model), None, true))
        }
    }
}

/// This machine as one CPU device: its available memory, and decode speed estimated
/// from memory bandwidth (each token reads every weight once).
fn this_machine(model: &ModelProfile) -> Cluster {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    let host = sysinfo::System::host_name().unwrap_or_else(|| "this-host".into());
    let avg_layer = model.layer_bytes.iter().sum::<u64>() as f64 / f64::from(model.layers.max(1));
    let ms_per_layer = avg_layer / (ASSUMED_GB_PER_S * 1e9) * 1000.0;
    Cluster {
        devices: vec![Device {
            id: format!("{host}/cpu"),
            host,
            memory_bytes: sys.available_memory(),
            ms_per_layer,
            prefill_ms_per_layer_token: None,
            head_ms: model.head_bytes as f64 / (ASSUMED_GB_PER_S * 1e9) * 1000.0,
            wake_ms: 0.0,
            keepalive: false,
            estimated: true,
        }],
        links: Vec::new(),
    }
}

fn print_plan(p: &Plan) {
    println!("{:>5}  {:<24} {:>7} {:>12} {:>13}", "stage", "device", "layers", "memory", "ms per token");
    for (i, s) in p.stages.iter().enumerate() {
        println!(
            "{i:>5}  {:<24} {:>7} {:>12} {:>13.2}",
            s.device,
            format!("{}-{}", s.first, s.last),
            gib(s.memory_bytes),
            s.ms_per_token
        );
    }
    println!(
        "predicted: {:.1} tok/s decode, {:.2} s to first token for a {}-token prompt{}",
        p.predicted_tok_s,
        p.predicted_ttft_s,
        p.prompt_tokens,
        if p.fits { "" } else { " (DOES NOT FIT)" }
    );
    for line in &p.explanation {
        println!("- {line}");
    }
    for r in &p.replicas {
        let devs: Vec<&str> = r.stages.iter().map(|s| s.device.as_str()).collect();
        println!("replica on {}: {} ({:.1} tok/s)", r.host, devs.join(" → "), r.predicted_tok_s);
    }
}
