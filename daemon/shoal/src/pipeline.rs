//! `shoal key`, `shoal serve` and `shoal generate`: stages in separate processes (on
//! one machine or several) connected over QUIC, as a placement file describes.

use crate::run::{default_cache, Printer, RunReport, TextArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use shoal_engine::{open_model, LlamaStage, Observer, ShardCache, StageConfig, Vocab};
use shoal_net::{Dtype, Identity, Impairment, Node, TransportOptions, TrustedKeys};
use shoal_pipeline::{
    generate as run_generation, serve as serve_stage, GenerateRequest, PipelineError, Placement, RetryPolicy,
    SamplerFactory, ServiceConfig,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `shoal key`.
#[derive(Args, Debug)]
pub struct KeyArgs {
    /// The node's data directory (the key is created there on first use).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// `shoal serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Serve a stage of this placement file (every node of the pipeline shares it)
    /// instead of running as a cluster node.
    #[arg(long)]
    placement: Option<PathBuf>,
    /// The node's data directory (its key) [default: $SHOAL_DATA_DIR, else ~/.local/share/shoal, else the service's /var/lib/shoal].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Address to listen on [default: this node's address in the placement; a cluster
    /// node 0.0.0.0:47070].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// CPU threads for the stage [default: this machine's physical cores].
    #[arg(long)]
    threads: Option<u32>,
    /// With --placement: layers to offload to a GPU (needs a GPU build). A cluster node
    /// offers its GPUs instead, and the leader's plan says how many of each stage's
    /// layers go on which (see --no-gpu).
    #[arg(long, default_value_t = 0)]
    gpu_layers: u32,
    /// A cluster node: offer no GPU to models (their layers stay in RAM).
    #[arg(long)]
    no_gpu: bool,
    /// Keep-alive: while a session generates, the stage's thread spins between tokens
    /// instead of sleeping (no wake-up per token; it yields to any other runnable
    /// thread, so it uses only idle CPU time). auto: for a `--placement` stage, on for
    /// GPU stages and on machines with 2 or more CPUs, where `shoal-lab bench keepalive`
    /// found it faster, off on one; for a cluster node's stages, off (`on` turns it on).
    #[arg(long, value_enum, default_value_t = KeepAlive::Auto)]
    keepalive: KeepAlive,
    /// Send hidden states as f16 (half the bytes; not bit-exact).
    #[arg(long)]
    f16: bool,
    /// A draft model (a small GGUF, e.g. the family's smallest member) for the models
    /// whose vocabulary it shares: where this node runs a model's first stage (it
    /// coordinates that model's generations), speculating requests draft with it
    /// instead of prompt lookup. Loaded whole on this node with the stage's context,
    /// sessions and threads. A cluster node keeps room for it out of the memory it
    /// offers the planner (what the largest takes at 4096 positions, one session), and
    /// loads it only where it fits what the plan leaves (`shoal status` says why not).
    /// Repeat for several families: the first whose vocabulary fits is used.
    #[arg(long, value_name = "GGUF")]
    draft_model: Vec<PathBuf>,
    /// Where shard files are cached [default: ~/.cache/shoal/shards].
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Test/bench only: impair this node's outgoing packets, e.g.
    /// "delay=3ms,jitter=2ms,loss=1%" (the kernel here has no netem).
    #[arg(long, default_value = "")]
    impair: Impairment,
    /// Windows: run under the Service Control Manager (the service `shoal service
    /// install` creates passes it; stopping the service stops the node).
    #[arg(long, hide = true)]
    windows_service: bool,
    #[command(flatten)]
    cluster: crate::cluster::ClusterArgs,
}

/// The keep-alive setting of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KeepAlive {
    /// On for GPU stages, and on CPU when the machine has 2 or more CPUs.
    Auto,
    /// Always on.
    On,
    /// Always off.
    Off,
}

/// Fewest logical CPUs on which `auto` keeps CPU stages alive (with one, the spinner
/// would share the only CPU with the compute).
pub const KEEPALIVE_MIN_CPUS: usize = 2;

impl KeepAlive {
    /// Whether a stage with `gpu_layers` layers on a GPU keeps alive on this machine.
    pub fn enabled(self, gpu_layers: u32) -> bool {
        match self {
            KeepAlive::Auto => {
                gpu_layers > 0 || std::thread::available_parallelism().map_or(1, |n| n.get()) >= KEEPALIVE_MIN_CPUS
            }
            KeepAlive::On => true,
            KeepAlive::Off => false,
        }
    }
}

/// `shoal generate`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["model", "placement"])))]
pub struct GenerateArgs {
    /// A model the cluster has loaded (name or hash prefix): the local node forwards
    /// the generation to its coordinator.
    #[arg(long)]
    model: Option<String>,
    /// Instead: the placement file of a pipeline started by hand (lab).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Data directory whose key identifies this client; the key must be a stage node's
    /// or listed under `clients` in the placement [default: $SHOAL_DATA_DIR, else ~/.local/share/shoal, else the service's /var/lib/shoal].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Print `token N` on stderr as each token arrives (for scripts and tests).
    #[arg(long)]
    progress: bool,
    #[command(flatten)]
    text: TextArgs,
}

/// `shoal status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The placement file of a running pipeline (without it: the cluster).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Data directory whose key identifies this client (see `generate`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Print JSON (one array, a node per entry).
    #[arg(long)]
    json: bool,
}

/// The data directory of the node a command talks to: `--data-dir`, else
/// `$SHOAL_DATA_DIR`, else this user's (`$XDG_DATA_HOME/shoal` or
/// `~/.local/share/shoal`) — unless no node has run there and the system service's node
/// has ([`SYSTEM_DATA_DIR`] holds its key): then that one, so that `shoal status` on a
/// machine with the service installed talks to its node.
pub(crate) fn data_dir(given: &Option<PathBuf>) -> PathBuf {
    let own = node_data_dir(given);
    if given.is_some() || std::env::var_os("SHOAL_DATA_DIR").is_some_and(|d| !d.is_empty()) {
        return own;
    }
    let key = shoal_net::identity::KEY_FILE;
    let system = Path::new(SYSTEM_DATA_DIR);
    if !own.join(key).exists() && system.join(key).exists() {
        return system.to_path_buf();
    }
    own
}

/// The data directory of a node this process runs (`shoal serve`): as [`data_dir`],
/// but never the service's: a node started by hand (as root, say) must not take over
/// the service's directory and leave files there its user cannot write.
pub(crate) fn node_data_dir(given: &Option<PathBuf>) -> PathBuf {
    if let Some(d) = given {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("SHOAL_DATA_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    user_data_dir()
}

/// `$XDG_DATA_HOME/shoal`, else `~/.local/share/shoal`.
fn user_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("shoal");
    }
    let home = std::env::var_os("HOME").or_else(|| std::env::var_os("USERPROFILE")).unwrap_or_default();
    PathBuf::from(home).join(".local").join("share").join("shoal")
}

/// Where the system service keeps its node's data (the package, `shoal service`).
#[cfg(target_os = "macos")]
pub const SYSTEM_DATA_DIR: &str = shoal_service::launchd::DATA_DIR;
/// Where the system service keeps its node's data (the package, `shoal service`).
#[cfg(windows)]
pub const SYSTEM_DATA_DIR: &str = shoal_service::windows::DATA_DIR;
/// Where the system service keeps its node's data (the package, `shoal service`).
#[cfg(not(any(target_os = "macos", windows)))]
pub const SYSTEM_DATA_DIR: &str = shoal_service::systemd::DATA_DIR;

/// A hint for an error met in the system service's data directory without the right
/// to read it: the node there belongs to the service's user.
pub fn system_dir_hint(e: &anyhow::Error) -> Option<String> {
    let denied = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
            || c.to_string().contains("Permission denied")
            || c.to_string().contains("Access is denied")
    });
    let there = format!("{e:#}").contains(SYSTEM_DATA_DIR);
    (denied && there).then(|| {
        let who = if cfg!(windows) {
            "an administrator's terminal"
        } else if cfg!(target_os = "macos") {
            "sudo shoal …"
        } else {
            "the user shoal: sudo -u shoal shoal …"
        };
        format!("the node of this machine's service keeps its data in {SYSTEM_DATA_DIR}: run the command as {who}")
    })
}

pub fn key(a: KeyArgs) -> Result<()> {
    let id = Identity::load_or_create(&data_dir(&a.data_dir))?;
    println!("{}", id.id());
    Ok(())
}

/// An endpoint on any local port, of the pipeline's address family, for a client of it.
pub fn client_node(placement: &Placement, identity: Arc<Identity>) -> Result<Node> {
    let any: SocketAddr = if placement.stages[0].addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse()?;
    Ok(Node::bind(any, identity, TrustedKeys::new(placement.trusted()), &TransportOptions::default())?)
}

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let Some(placement_file) = a.placement.clone() else {
        if a.gpu_layers != 0 {
            bail!(
                "--gpu-layers is for --placement stages: a cluster node offers its GPUs and the leader \
                 chooses each stage's GPU layers (`shoal models plan` shows them; --no-gpu offers none)"
            );
        }
        let stage = crate::cluster::StageArgs {
            threads: a.threads.unwrap_or_else(crate::inventory::default_threads),
            offer_gpus: !a.no_gpu,
            cache: a.cache.clone(),
            keepalive: a.keepalive,
            draft_models: a.draft_model.clone(),
        };
        if a.windows_service {
            return serve_as_windows_service(a, stage);
        }
        return crate::cluster::serve(a.data_dir, a.listen, a.impair, a.cluster, stage, shutdown_signal());
    };
    let placement = Placement::load(&placement_file)?;
    let dir = data_dir(&a.data_dir);
    let identity = Arc::new(Identity::load_or_create(&dir)?);
    let Some(index) = placement.stage_of(identity.id()) else {
        bail!("this node ({}, key in {}) has no stage in {}", identity.id(), dir.display(), placement_file.display());
    };
    let place = placement.stages[index].clone();
    let (g, meta) = open_model(&placement.model)?;
    if meta.n_layer != placement.n_layer() {
        bail!(
            "{} has {} layers, but the placement covers {}",
            placement.model.display(),
            meta.n_layer,
            placement.n_layer()
        );
    }
    let cache = ShardCache::new(a.cache.clone().unwrap_or_else(default_cache));
    let shard = cache.get_or_build(&placement.model, &g, &meta, place.layers)?;
    let config = StageConfig {
        n_ctx_per_session: placement.context,
        max_sessions: placement.sessions,
        chunk: placement.chunk,
        threads: a.threads.unwrap_or_else(crate::inventory::default_threads),
        gpu_layers: a.gpu_layers,
        gpus: Vec::new(),
    };
    let stage = LlamaStage::load(&shard.path, place.layers, meta.n_layer, &config)?;
    let drafts = if a.draft_model.is_empty() {
        None
    } else if index != 0 {
        // One command line for every node of a placement is fine: only stage 0 drafts.
        eprintln!("[shoal] --draft-model ignored: only stage 0 drafts, and this node serves stage {index}");
        None
    } else {
        let size = std::fs::metadata(&placement.model)
            .with_context(|| format!("reading {}", placement.model.display()))?
            .len();
        let engine = crate::engine::LlamaEngine { threads: config.threads, draft_models: a.draft_model.clone() };
        let sizing = shoal_node::runtime::StageSizing {
            context: placement.context,
            sessions: placement.sessions,
            chunk: placement.chunk,
        };
        // A placement file's stage has no memory offer to keep within: room for any.
        let Some(d) = shoal_node::runtime::Engine::drafts(&engine, &placement.model, size, sizing, u64::MAX)
            .map_err(anyhow::Error::msg)?
        else {
            bail!("no --draft-model shares the vocabulary of {}", placement.model.display());
        };
        eprintln!("[shoal] drafting with {} ({})", d.file, shoal_types::fmt_size(d.bytes));
        Some(d.source)
    };
    let samplers: SamplerFactory = crate::engine::sampler_factory(shard.path.clone());
    // One thread for all of the node's networking: a frame's path through the link
    // task, quinn's driver and the reader task then costs no cross-thread wake-ups
    // (each is tens of µs on a loaded machine); the stage computes on its own thread.
    let rt =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")?;
    let keepalive = a.keepalive.enabled(a.gpu_layers).then_some(shoal_pipeline::KEEPALIVE_WINDOW);
    rt.block_on(async move {
        let listen = a.listen.unwrap_or(place.addr);
        let opts = TransportOptions { impair: a.impair, ..TransportOptions::default() };
        if !a.impair.is_none() {
            eprintln!("[shoal] impairing outgoing packets (test option): {:?}", a.impair);
        }
        let node = Arc::new(Node::bind(listen, identity.clone(), TrustedKeys::new(placement.trusted()), &opts)?);
        let serving = format!(
            "serving layers {} of {} on {} as node {}{}{}",
            place.layers,
            placement.model.display(),
            node.local_addr()?,
            identity.id(),
            if keepalive.is_some() { " (keep-alive on)" } else { "" },
            if a.impair.is_none() { "" } else { " (impairing outgoing packets)" }
        );
        eprintln!("[shoal] {serving}");
        // The stage serves from here on (its endpoint accepts): tell a service manager
        // or a lab waiting on NOTIFY_SOCKET. Without one this does nothing.
        shoal_node::notify::ready(&serving);
        let dtype = if a.f16 { Dtype::F16 } else { Dtype::F32 };
        let cfg = ServiceConfig {
            placement,
            index,
            stage: Box::new(stage),
            samplers,
            dtype,
            retry: RetryPolicy::default(),
            keepalive,
            drafts,
            // Stages started by hand are where their placement file says.
            addresses: None,
        };
        tokio::select! {
            r = serve_stage(node.clone(), cfg) => r?,
            _ = shutdown_signal() => eprintln!("[shoal] shutting down"),
        }
        node.close();
        Ok(())
    })
}

/// The cluster node under Windows' SCM: its stop request is the node's shutdown.
#[cfg(windows)]
fn serve_as_windows_service(a: ServeArgs, stage: crate::cluster::StageArgs) -> Result<()> {
    shoal_service::windows::run_as_service(Box::new(move |stop: std::sync::mpsc::Receiver<()>| {
        // The SCM's stop comes on a std channel; a thread of its own (not the runtime's
        // blocking pool, which the runtime waits for when it shuts down) forwards it,
        // so a node that stops by itself is not held up by a stop that never comes.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            if stop.recv().is_ok() {
                let _ = tx.send(());
            }
        });
        let shutdown = async move {
            let _ = rx.await;
        };
        crate::cluster::serve(a.data_dir, a.listen, a.impair, a.cluster, stage, shutdown).map_err(|e| format!("{e:#}"))
    }))?;
    Ok(())
}

#[cfg(not(windows))]
fn serve_as_windows_service(_: ServeArgs, _: crate::cluster::StageArgs) -> Result<()> {
    bail!("--windows-service is for Windows' Service Control Manager")
}

pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// How long `shoal generate --placement` keeps trying to reach a coordinator that went
/// away (it restarts) before it gives up; the node's API waits as long.
const RESUME_WINDOW: std::time::Duration = shoal_node::runtime::RESUME_WINDOW;

pub fn generate(a: GenerateArgs) -> Result<()> {
    let Some(placement_file) = &a.placement else {
        return crate::models::generate(a.model.clone().unwrap_or_default(), &a.data_dir, a.progress, &a.text);
    };
    let placement = Placement::load(placement_file)?;
    let t = &a.text;
    let vocab = Vocab::load(&placement.model)?;
    let prompt = t.prompt_tokens(&vocab)?;
    let max_new = t.max_tokens.min((placement.context as usize).saturating_sub(prompt.len()));
    if max_new == 0 {
        bail!("the prompt takes {} tokens, which leaves no room in the context of {}", prompt.len(), placement.context);
    }
    // The coordinator refuses bad parameters too; checking here says so before connecting.
    let sampling = t.sampling()?;
    shoal_types::validate_generation(&sampling, prompt.len(), max_new as u32, placement.context)?;
    let request = GenerateRequest {
        prompt: prompt.clone(),
        max_new: max_new as u32,
        stop: t.stop_tokens(&vocab),
        sampling: serde_json::to_value(sampling)?,
        resume: Vec::new(),
        speculative: t.speculation()?,
        tag: None,
    };
    let dir = data_dir(&a.data_dir);
    let identity = Arc::new(Identity::load_or_create(&dir)?);
    let me = identity.id();
    if !placement.trusted().contains(&me) {
        bail!(
            "this client's key {me} (in {}) is neither a stage node nor listed under `clients` in the placement",
            dir.display()
        );
    }
    let mut out = Printer::new(&vocab, !t.json, false);
    let report = runtime()?.block_on(async {
        let node = client_node(&placement, identity)?;
        // The tokens so far: a generation whose coordinator went away (it restarted)
        // resumes from them, exactly (the coordinator replays them in their original
        // shapes), as the API does.
        let mut made: Vec<shoal_types::TokenId> = Vec::new();
        let mut progress_at = std::time::Instant::now();
        let r = loop {
            let req = GenerateRequest { resume: made.clone(), ..request.clone() };
            let r = run_generation(&node, &placement.stages[0], &req, |tok, _| {
                out.token(tok);
                made.push(tok);
                progress_at = std::time::Instant::now();
                if a.progress {
                    eprintln!("token {}", made.len());
                }
            })
            .await;
            match r {
                Err(e @ (PipelineError::Net(_) | PipelineError::Stream(_))) => {
                    if progress_at.elapsed() > RESUME_WINDOW {
                        break Err(anyhow::anyhow!("no progress for {} s: {e}", RESUME_WINDOW.as_secs()));
                    }
                    if a.progress {
                        eprintln!("[shoal] the coordinator went away ({e}); resuming after {} tokens", made.len());
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                r => break r.map_err(anyhow::Error::from),
            }
        };
        node.close();
        r
    })?;
    let tail = out.finish();
    if t.json {
        let r = RunReport {
            tokens: report.tokens,
            text: out.text.clone(),
            stages: placement.stages.iter().map(|s| s.layers).collect(),
            prompt_tokens: prompt.len(),
            tok_per_s: report.tok_per_s,
            prefill_s: report.prefill_s,
            decode_s: report.decode_s,
            logits_digest: report.logits_digest,
            chunk: placement.chunk,
            memory: None,
            stage_ms: None,
            peak_rss_bytes: None,
            decode_steps: report.decode_steps,
            drafted: report.drafted,
            accepted: report.accepted,
        };
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("{tail}");
        eprintln!(
            "[shoal] {} tokens, {:.1} tok/s decode, prefill {:.2} s",
            report.tokens.len(),
            report.tok_per_s,
            report.prefill_s
        );
    }
    Ok(())
}

pub fn status(a: StatusArgs) -> Result<()> {
    let Some(placement_file) = &a.placement else {
        return crate::cluster::status(&a.data_dir, a.json);
    };
    let placement = Placement::load(placement_file)?;
    let identity = Arc::new(Identity::load_or_create(&data_dir(&a.data_dir))?);
    let answers = runtime()?.block_on(async {
        let node = client_node(&placement, identity)?;
        let mut answers = Vec::new();
        for place in &placement.stages {
            let r = tokio::time::timeout(std::time::Duration::from_secs(5), shoal_pipeline::status(&node, place)).await;
            answers.push(match r {
                Ok(Ok(st)) => Ok(st),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer within 5 s".to_string()),
            });
        }
        node.close();
        anyhow::Ok(answers)
    })?;
    if a.json {
        let v: Vec<serde_json::Value> = answers
            .iter()
            .zip(&placement.stages)
            .map(|(r, p)| match r {
                Ok(st) => serde_json::to_value(st).unwrap_or_default(),
                Err(e) => serde_json::json!({"node": p.node.to_string(), "layers": p.layers, "error": e}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    for (r, p) in answers.iter().zip(&placement.stages) {
        let id = p.node.to_string();
        match r {
            Ok(st) => {
                let c = &st.counters;
                println!(
                    "stage {:<8} {} {}  sessions {}  frames in/out {}/{}  re-drives {}  replays {}  lost {}  stale {}  duplicates {}  link connects {}  malformed in {}  refused by next {}  keep-alive {}",
                    p.layers.to_string(), &id[..12], p.addr, st.sessions, c.frames_in, c.frames_out, c.redrives, c.replays,
                    c.lost_reported, c.stale_dropped, c.duplicates_dropped, st.link_connects, st.malformed_frames, st.refused_by_next,
                    match (st.keepalive, st.keepalive_spinning) { (false, _) => "off", (true, false) => "on (idle)", (true, true) => "on (spinning)" }
                );
                if !st.start_announced {
                    println!("    its start has not reached the stage before it and the coordinator yet (they may still send to its previous life)");
                }
                for h in &st.hop_in {
                    println!(
                        "    frames in, {:<16} {:>7} frames  mean {:>7} B  latency p50 {:>6} us  p99 {:>6} us  max {:>7} us",
                        h.class, h.frames, h.mean_bytes, h.p50_us, h.p99_us, h.max_us
                    );
                }
            }
            Err(e) => println!("stage {:<8} {} {}  unreachable: {e}", p.layers.to_string(), &id[..12], p.addr),
        }
    }
    let ring: Option<Vec<_>> = answers.into_iter().map(Result::ok).collect();
    if let Some(b) = ring.as_deref().and_then(shoal_pipeline::TokenBreakdown::of) {
        for line in b.lines() {
            println!("{line}");
        }
    }
    Ok(())
}
