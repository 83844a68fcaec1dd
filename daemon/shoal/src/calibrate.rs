//! `shoal calibrate`: measure what the planner needs about this machine for a model
//! (decode ms per layer, prefill ms per layer and token, LM-head ms, the wake-up cost
//! after an idle pause) and keep it in the cluster state, where `shoal plan` on the live
//! cluster finds it; then the node measures its links to the other members. The model
//! runs split in two in this process: the first stage times layers alone (no head),
//! the tail times layers plus head. The same measurement runs inside a cluster node
//! when a plan asks for it ([`calibrator`]).

use crate::pipeline::{data_dir, runtime};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use shoal_engine::{load_split, open_model, Chain, LlamaStage, ShardCache, StageConfig, StepTiming};
use shoal_membership::node;
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_types::{SessionId, Stage};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// The GGUF model.
    #[arg(long, short)]
    model: PathBuf,
    /// Decode steps timed.
    #[arg(short = 'n', long, default_value_t = DEFAULT_TOKENS as usize)]
    tokens: usize,
    /// CPU threads, as the stage will use [default: this machine's physical cores,
    /// a stage's default].
    #[arg(long)]
    threads: Option<u32>,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = DEFAULT_CHUNK)]
    chunk: u32,
    /// The local node's data directory [default: $SHOAL_DATA_DIR, else ~/.local/share/shoal, else the service's /var/lib/shoal].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Only print; do not store the profile in the cluster state.
    #[arg(long)]
    no_store: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// A measured device profile, as kept in the cluster state under
/// [`profile_key`] and read by `shoal plan`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredProfile {
    /// Which device ("cpu").
    pub device: String,
    /// Decode time of one layer for one token, ms.
    pub ms_per_layer: f64,
    /// Prefill time of one layer per prompt token, ms.
    pub prefill_ms_per_layer_token: f64,
    /// Output norm + LM head for one token, ms.
    pub head_ms: f64,
    /// How much longer a decode step takes after the device idled between tokens, ms.
    #[serde(default)]
    pub wake_ms: f64,
    /// Whether a CPU stage keeps alive on this machine by default (`serve --keepalive
    /// auto`): it then pays no wake-up between tokens.
    #[serde(default)]
    pub keepalive: bool,
    /// Threads it was measured with.
    pub threads: u32,
    /// Decode steps timed.
    pub tokens: usize,
    /// Shoal's version.
    pub shoal_version: String,
}

/// The cluster-state entry of `node`'s profile for the model file `model`.
pub fn profile_key(node: &shoal_types::NodeId, model: &Path) -> String {
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("profile/{node}/{name}")
}

/// What a cluster node runs when a plan asks it to calibrate: the same measurement,
/// returned as the cluster-state entry of `node`'s profile; a job of 0 threads is
/// timed with `stage_threads`, what this node's stages use.
pub fn calibrator(node: shoal_types::NodeId, stage_threads: u32) -> node::Calibrator {
    node::Calibrator(Arc::new(move |job: &node::CalibrationJob| {
        // The whole model is loaded to time it: refuse rather than swap for minutes.
        let need = std::fs::metadata(&job.model).map_err(|e| format!("{}: {e}", job.model.display()))?.len();
        let free = crate::inventory::Refresher::new().refresh().ram_available_bytes;
        if need + need / 10 > free {
            return Err(format!(
                "calibrating {} needs about {} MiB of free memory; {} MiB are free",
                job.model.display(),
                (need + need / 10) >> 20,
                free >> 20
            ));
        }
        let threads = if job.threads == 0 { stage_threads } else { job.threads };
        let profile = measure(&job.model, job.tokens as usize, threads, DEFAULT_CHUNK)
            .map_err(|e| format!("calibrating {}: {e:#}", job.model.display()))?;
        let value = serde_json::to_value(&profile).map_err(|e| e.to_string())?;
        Ok((profile_key(&node, &job.model), value))
    }))
}

/// Prefill chunk calibrations use (the default of serving).
pub const DEFAULT_CHUNK: u32 = 128;
/// Decode steps a calibration times by default.
pub const DEFAULT_TOKENS: u32 = 48;

pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    let threads = a.threads.unwrap_or_else(crate::inventory::default_threads);
    let profile = measure(&a.model, a.tokens, threads, a.chunk)?;
    let dir = data_dir(&a.data_dir);
    let mut links = None;
    let stored = if a.no_store {
        None
    } else if !dir.join(node::ENDPOINT_FILE).exists() {
        Some(Err("not stored: no cluster node runs with this data directory".to_string()))
    } else {
        let identity = Arc::new(shoal_net::Identity::load_or_create(&dir)?);
        let key = profile_key(&identity.id(), &a.model);
        let req = AdminRequest::Put { key, value: serde_json::to_value(&profile)? };
        let rt = runtime()?;
        let stored = match rt.block_on(node::admin(&dir, identity.clone(), &req)) {
            Ok(AdminResponse::Ok(text)) => Ok(text),
            Ok(AdminResponse::Error(e)) => Err(format!("not stored: {e}")),
            Ok(other) => Err(format!("not stored: unexpected answer {other:?}")),
            Err(e) => Err(format!("not stored: {e}")),
        };
        // The links to the other members, timed with this model's decode frames.
        let (_, meta) = open_model(&a.model)?;
        let req = AdminRequest::ProbeLinks { frame_bytes: meta.n_embd * 4 };
        links = Some(match rt.block_on(node::admin(&dir, identity, &req)) {
            Ok(AdminResponse::Ok(_)) => "links to the other members measured".to_string(),
            Ok(AdminResponse::Error(e)) => format!("links not measured: {e}"),
            Ok(other) => format!("links not measured: unexpected answer {other:?}"),
            Err(e) => format!("links not measured: {e}"),
        });
        Some(stored)
    };
    if a.json {
        let mut v = serde_json::to_value(&profile)?;
        v["stored"] = serde_json::json!(matches!(stored, Some(Ok(_))));
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{}: decode {:.4} ms per layer, prefill {:.4} ms per layer and token, LM head {:.3} ms, wake-up {:.3} ms ({} thread(s))",
            a.model.display(),
            profile.ms_per_layer,
            profile.prefill_ms_per_layer_token,
            profile.head_ms,
            profile.wake_ms,
            profile.threads
        );
    }
    match stored {
        Some(Ok(text)) => eprintln!("{text}"),
        Some(Err(e)) => eprintln!("{e}"),
        None => {}
    }
    if let Some(links) = links {
        eprintln!("{links}");
    }
    Ok(())
}

/// Idle pause before each timed wake-up step (a stage waits about this long for the
/// next token when the other stages compute).
const IDLE: std::time::Duration = std::time::Duration::from_millis(20);
/// Wake-up steps timed.
const WAKE_STEPS: usize = 8;

/// Time `model` on this machine's CPU: `tokens` decode steps back to back after a
/// prefill of `chunk` tokens, then a few steps each after an idle pause.
pub fn measure(model: &Path, tokens: usize, threads: u32, chunk: u32) -> Result<MeasuredProfile> {
    let (_, meta) = open_model(model)?;
    let mid = crate::stats::even_split(meta.n_layer, 2, meta.layer_period())
        .with_context(|| format!("{} is too small to calibrate (it cannot be split in two)", model.display()))?;
    let tokens = tokens.max(1);
    let config = StageConfig {
        n_ctx_per_session: chunk + (tokens + WAKE_STEPS) as u32 + 8,
        max_sessions: 1,
        chunk,
        threads: threads.max(1),
        gpu_layers: 0,
        gpus: Vec::new(),
    };
    let cache = ShardCache::new(crate::run::default_cache());
    let (_, stages) = load_split(model, &mid, &cache, &config)?;
    let layers: Vec<u32> = stages.iter().map(|s| s.info().layers.len()).collect();
    let mut chain = Chain::new(stages.into_iter().map(|s: LlamaStage| Box::new(s) as Box<dyn Stage>).collect())?;
    let session = SessionId(1);
    // Any token ids will do for timing; spread them over the vocabulary.
    let prompt: Vec<i32> = (0..chunk).map(|i| ((i as u64 * 7919) % u64::from(meta.n_vocab)) as i32).collect();
    let mut prefill = StepTiming::default();
    let mut logits = chain.step(session, 0, &prompt, &mut prefill)?;
    let mut decode = StepTiming::default();
    let mut pos = chunk;
    let mut back_to_back = Vec::with_capacity(tokens);
    for _ in 0..tokens {
        let t0 = Instant::now();
        logits = chain.step(session, pos, &[argmax(&logits)], &mut decode)?;
        back_to_back.push(t0.elapsed().as_secs_f64() * 1000.0);
        pos += 1;
    }
    // The same step after the threads slept as long as a stage waits for its next
    // token: caches and clocks cool down; the difference is the wake-up cost.
    let mut after_idle = Vec::with_capacity(WAKE_STEPS);
    for _ in 0..WAKE_STEPS {
        std::thread::sleep(IDLE);
        let t0 = Instant::now();
        logits = chain.step(session, pos, &[argmax(&logits)], &mut StepTiming::default())?;
        after_idle.push(t0.elapsed().as_secs_f64() * 1000.0);
        pos += 1;
    }
    let ms = |t: &StepTiming, k: usize| t.per_stage[k].as_secs_f64() * 1000.0;
    let n = tokens as f64;
    let per_layer = ms(&decode, 0) / n / f64::from(layers[0]);
    let head = (ms(&decode, 1) / n - per_layer * f64::from(layers[1])).max(0.0);
    let prefill_per_layer_token = ms(&prefill, 0) / f64::from(chunk) / f64::from(layers[0]);
    if !(per_layer.is_finite() && per_layer > 0.0) {
        bail!("the measurement gave no usable time per layer");
    }
    let wake = (crate::stats::median(&mut after_idle) - crate::stats::median(&mut back_to_back)).max(0.0);
    Ok(MeasuredProfile {
        device: "cpu".into(),
        ms_per_layer: per_layer,
        prefill_ms_per_layer_token: prefill_per_layer_token,
        head_ms: head,
        wake_ms: wake,
        keepalive: crate::pipeline::KeepAlive::Auto.enabled(0),
        threads: config.threads,
        tokens,
        shoal_version: env!("CARGO_PKG_VERSION").into(),
    })
}

fn argmax(logits: &[f32]) -> i32 {
    logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as i32)
}
