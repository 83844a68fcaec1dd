//! `shoal calibrate`: measure what the planner needs about this machine for a model
//! (decode ms per layer, prefill ms per layer and token, LM-head ms) and keep it in the
//! cluster state, where `shoal plan` on the live cluster finds it. The model runs split
//! in two in this process: the first stage times layers alone (no head), the tail
//! times layers plus head.

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

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// The GGUF model.
    #[arg(long, short)]
    model: PathBuf,
    /// Decode steps timed.
    #[arg(short = 'n', long, default_value_t = 48)]
    tokens: usize,
    /// CPU threads (as the stage will use).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// The local node's data directory [default: ~/.local/share/shoal].
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

pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    let profile = measure(&a)?;
    let dir = data_dir(&a.data_dir);
    let stored = if a.no_store {
        None
    } else if !dir.join(node::ENDPOINT_FILE).exists() {
        Some(Err("not stored: no cluster node runs with this data directory".to_string()))
    } else {
        let identity = Arc::new(shoal_net::Identity::load_or_create(&dir)?);
        let key = profile_key(&identity.id(), &a.model);
        let req = AdminRequest::Put { key, value: serde_json::to_value(&profile)? };
        Some(match runtime()?.block_on(node::admin(&dir, identity, &req)) {
            Ok(AdminResponse::Ok(text)) => Ok(text),
            Ok(AdminResponse::Error(e)) => Err(format!("not stored: {e}")),
            Ok(other) => Err(format!("not stored: unexpected answer {other:?}")),
            Err(e) => Err(format!("not stored: {e}")),
        })
    };
    if a.json {
        let mut v = serde_json::to_value(&profile)?;
        v["stored"] = serde_json::json!(matches!(stored, Some(Ok(_))));
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{}: decode {:.4} ms per layer, prefill {:.4} ms per layer and token, LM head {:.3} ms ({} thread(s))",
            a.model.display(),
            profile.ms_per_layer,
            profile.prefill_ms_per_layer_token,
            profile.head_ms,
            profile.threads
        );
    }
    match stored {
        Some(Ok(text)) => eprintln!("{text}"),
        Some(Err(e)) => eprintln!("{e}"),
        None => {}
    }
    Ok(())
}

fn measure(a: &CalibrateArgs) -> Result<MeasuredProfile> {
    let (_, meta) = open_model(&a.model)?;
    let mid = crate::bench::even_split(meta.n_layer, 2, meta.layer_period())
        .with_context(|| format!("{} is too small to calibrate (it cannot be split in two)", a.model.display()))?;
    let config = StageConfig {
        n_ctx_per_session: a.chunk + a.tokens as u32 + 8,
        max_sessions: 1,
        chunk: a.chunk,
        threads: a.threads.max(1),
        gpu_layers: 0,
    };
    let cache = ShardCache::new(crate::run::default_cache());
    let (_, stages) = load_split(&a.model, &mid, &cache, &config)?;
    let layers: Vec<u32> = stages.iter().map(|s| s.info().layers.len()).collect();
    let mut chain = Chain::new(stages.into_iter().map(|s: LlamaStage| Box::new(s) as Box<dyn Stage>).collect())?;
    let session = SessionId(1);
    // Any token ids will do for timing; spread them over the vocabulary.
    let prompt: Vec<i32> = (0..a.chunk).map(|i| ((i as u64 * 7919) % u64::from(meta.n_vocab)) as i32).collect();
    let mut prefill = StepTiming::default();
    let mut logits = chain.step(session, 0, &prompt, &mut prefill)?;
    let mut decode = StepTiming::default();
    for step in 0..a.tokens {
        let next = argmax(&logits);
        logits = chain.step(session, a.chunk + step as u32, &[next], &mut decode)?;
    }
    let ms = |t: &StepTiming, k: usize| t.per_stage[k].as_secs_f64() * 1000.0;
    let n = a.tokens.max(1) as f64;
    let per_layer = ms(&decode, 0) / n / f64::from(layers[0]);
    let head = (ms(&decode, 1) / n - per_layer * f64::from(layers[1])).max(0.0);
    let prefill_per_layer_token = ms(&prefill, 0) / f64::from(a.chunk) / f64::from(layers[0]);
    if !(per_layer.is_finite() && per_layer > 0.0) {
        bail!("the measurement gave no usable time per layer");
    }
    Ok(MeasuredProfile {
        device: "cpu".into(),
        ms_per_layer: per_layer,
        prefill_ms_per_layer_token: prefill_per_layer_token,
        head_ms: head,
        threads: config.threads,
        tokens: a.tokens,
        shoal_version: env!("CARGO_PKG_VERSION").into(),
    })
}

fn argmax(logits: &[f32]) -> i32 {
    logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as i32)
}
