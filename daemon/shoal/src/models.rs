//! `shoal models …`: the cluster's model catalog, through the local node (the node
//! protocol, holding the node's own key). Files are used in place; a URL or `hf://`
//! is downloaded here first (resumable), then added like a path.

use crate::cluster::DirArg;
use crate::pipeline::{data_dir, runtime};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal_engine::Observer;
use shoal_node::api::{self, CopyState, NodeRequest, NodeResponse, StoreKind};
use shoal_types::fmt_size;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `shoal models`.
#[derive(Subcommand, Debug)]
pub enum ModelsCommand {
    /// Add a GGUF to the cluster's catalog: a path on this machine (used in place, not
    /// copied), or a URL / `hf://org/repo/file.gguf` (downloaded first, resumable).
    Add(AddArgs),
    /// List the catalog: each model, its facts, and which nodes hold it.
    Ls(LsArgs),
    /// Remove a model from the catalog (by name, or 8+ hex digits of its hash).
    Rm(RmArgs),
    /// Find models in Ollama's, LM Studio's or the Hugging Face cache's store on this
    /// machine; with names (or `--all`), add them (used in place).
    Import(ImportArgs),
    /// Keep a model loaded: the leader places its layers on the members, which fetch
    /// their shards and start their stages.
    Load(LoadArgs),
    /// Stop running a model: every stage frees its memory.
    Unload(RmArgs),
    /// Where a model is placed (or would be), and why.
    Plan(PlanArgs),
}

/// `shoal models load`.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// Name or hash prefix.
    model: String,
    /// Positions per session.
    #[arg(long, default_value_t = 4096)]
    context: u32,
    /// Sessions held at once.
    #[arg(long, default_value_t = 1)]
    sessions: u32,
    /// A member (8+ hex digits of its id) the model must not use (repeatable).
    #[arg(long)]
    exclude: Vec<String>,
    /// Wait until every stage runs.
    #[arg(long)]
    wait: bool,
    #[command(flatten)]
    dir: DirArg,
}

/// `shoal models plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Name or hash prefix.
    model: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    dir: DirArg,
}

/// `shoal models add`.
#[derive(Args, Debug)]
pub struct AddArgs {
    /// A GGUF path, an http(s) URL, or hf://org/repo[@rev]/file.gguf.
    source: String,
    /// The name in the catalog [default: the file's name].
    #[arg(long)]
    name: Option<String>,
    /// Where downloads go [default: <data dir>/models].
    #[arg(long)]
    download_dir: Option<PathBuf>,
    #[command(flatten)]
    dir: DirArg,
}

/// `shoal models ls`.
#[derive(Args, Debug)]
pub struct LsArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    dir: DirArg,
}

/// `shoal models rm`.
#[derive(Args, Debug)]
pub struct RmArgs {
    /// Name or hash prefix.
    model: String,
    #[command(flatten)]
    dir: DirArg,
}

/// `shoal models import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The store: ollama, lmstudio or hf.
    #[arg(long, value_parser = parse_store)]
    from: StoreKind,
    /// Models to add, as listed without names.
    names: Vec<String>,
    /// Add every model found.
    #[arg(long, conflicts_with = "names")]
    all: bool,
    #[command(flatten)]
    dir: DirArg,
}

fn parse_store(s: &str) -> Result<StoreKind, String> {
    match s {
        "ollama" => Ok(StoreKind::Ollama),
        "lmstudio" | "lm-studio" => Ok(StoreKind::Lmstudio),
        "hf" | "huggingface" => Ok(StoreKind::Hf),
        _ => Err(format!("{s:?}: one of ollama, lmstudio, hf")),
    }
}

/// Run a `shoal models` command.
pub fn models(c: ModelsCommand) -> Result<()> {
    match c {
        ModelsCommand::Add(a) => add(a),
        ModelsCommand::Ls(a) => ls(a),
        ModelsCommand::Rm(a) => {
            let e = match ask(&a.dir, NodeRequest::ModelRemove { model: a.model })? {
                NodeResponse::Removed(e) => e,
                other => bail!("unexpected answer: {other:?}"),
            };
            println!("removed {} ({}…) from the catalog", e.name, &e.content_hash[..12]);
            Ok(())
        }
        ModelsCommand::Import(a) => import(a),
        ModelsCommand::Load(a) => load(a),
        ModelsCommand::Unload(a) => {
            let NodeResponse::Ok(text) = ask(&a.dir, NodeRequest::ModelUnload { model: a.model })? else {
                bail!("unexpected answer");
            };
            println!("{text}");
            Ok(())
        }
        ModelsCommand::Plan(a) => plan(a),
    }
}

fn load(a: LoadArgs) -> Result<()> {
    let req = NodeRequest::ModelLoad {
        model: a.model.clone(),
        context: a.context,
        sessions: a.sessions,
        exclude: a.exclude.clone(),
    };
    let NodeResponse::Ok(text) = ask(&a.dir, req)? else { bail!("unexpected answer") };
    println!("{text}");
    if !a.wait {
        return Ok(());
    }
    // Until the placement is committed and each stage's node says it runs; a line of
    // progress for the placing, then one per stage.
    let t0 = std::time::Instant::now();
    let mut placing = Some(crate::progress::Lines::new(1));
    let mut stages: Option<(u64, crate::progress::Lines)> = None;
    loop {
        if t0.elapsed() > std::time::Duration::from_secs(1800) {
            bail!("not every stage runs after 30 minutes (see `shoal models plan {}`)", a.model);
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        let NodeResponse::Placement { placement, committed: true, .. } =
            ask(&a.dir, NodeRequest::ModelPlan { model: a.model.clone() })?
        else {
            if let Some(lines) = &mut placing {
                lines.set(0, "placing: the leader measures the members and plans", None);
            }
            continue;
        };
        if let Some(e) = &placement.error {
            bail!("the model cannot be placed: {e}");
        }
        if let Some(lines) = placing.take() {
            lines.finish();
        }
        // A new generation of the placement (a stage's node failed and was replaced)
        // gets lines of its own.
        if stages.as_ref().is_none_or(|(generation, _)| *generation != placement.generation) {
            if let Some((_, lines)) = stages.take() {
                lines.finish();
            }
            stages = Some((placement.generation, crate::progress::Lines::new(placement.stages.len())));
        }
        let Some((_, lines)) = &mut stages else { continue };
        if stages_running(&a.dir, &placement, lines)? {
            if let Some((_, lines)) = stages.take() {
                lines.finish();
            }
            println!("ready: {} stage(s), generation {}", placement.stages.len(), placement.generation);
            return Ok(());
        }
    }
}

/// Whether every stage of `p` runs, each stage's state shown on its line of `lines`;
/// an error if one failed.
fn stages_running(dir: &DirArg, p: &shoal_types::ModelPlacement, lines: &mut crate::progress::Lines) -> Result<bool> {
    let mut all = true;
    for (i, (s, st)) in p.stages.iter().zip(stage_states(dir, p)?).enumerate() {
        let node = &s.node.to_string()[..12];
        let on = format!("stage {i} (layers {}) on {node}", s.layers);
        match st.map(|st| st.state) {
            Some(api::StageState::Running) => lines.set(i, &format!("{on}: running"), None),
            Some(api::StageState::Failed(why)) => bail!("the stage on {node} failed: {why}"),
            Some(api::StageState::Fetching { done, of }) => {
                all = false;
                lines.set(i, &format!("{on}: fetching its shard, {done}/{of} chunks"), Some((done, of)));
            }
            Some(api::StageState::Loading) => {
                all = false;
                lines.set(i, &format!("{on}: loading"), None);
            }
            None => {
                all = false;
                lines.set(i, &format!("{on}: starting"), None);
            }
        }
    }
    Ok(all)
}

/// What each stage's node says of its stage of `p` (asked as a fellow member; `None`
/// where the node does not answer or runs another generation of the placement).
fn stage_states(dir: &DirArg, p: &shoal_types::ModelPlacement) -> Result<Vec<Option<api::StageStatus>>> {
    let data_dir = data_dir(&dir.data_dir);
    let identity = Arc::new(shoal_net::Identity::load_or_create(&data_dir)?);
    let status = crate::cluster::status_of(&dir.data_dir)?;
    runtime()?.block_on(async {
        let mut out = Vec::new();
        for s in &p.stages {
            let addr = if s.node == status.node {
                Some(status.addr.clone())
            } else {
                status.members.iter().find(|m| m.node == s.node).and_then(|m| m.addr.clone())
            };
            let Some(mut addr) = addr.and_then(|a| a.parse::<std::net::SocketAddr>().ok()) else {
                out.push(None);
                continue;
            };
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::IpAddr::from([127, 0, 0, 1]));
            }
            let ask = api::request_at(addr, s.node, identity.clone(), &NodeRequest::Stages);
            let answer = tokio::time::timeout(std::time::Duration::from_secs(5), ask).await;
            out.push(match answer {
                Ok(Ok(NodeResponse::Stages(stages))) => {
                    stages.into_iter().find(|st| st.generation == p.generation && st.model == p.model)
                }
                _ => None,
            });
        }
        Ok(out)
    })
}

fn plan(a: PlanArgs) -> Result<()> {
    let NodeResponse::Placement { entry, placement, committed } =
        ask(&a.dir, NodeRequest::ModelPlan { model: a.model })?
    else {
        bail!("unexpected answer");
    };
    if a.json {
        // Each committed stage's state as its node tells it (null: not answering).
        let stages = if committed { stage_states(&a.dir, &placement)? } else { Vec::new() };
        let v = serde_json::json!({"committed": committed, "placement": placement, "stages": stages});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{} ({} layers): {}",
        entry.name,
        entry.n_layer,
        if committed {
            format!("placed, generation {}", placement.generation)
        } else {
            "not loaded; this is what `shoal models load` would do now".to_string()
        }
    );
    if let Some(e) = &placement.error {
        println!("cannot be placed: {e}");
    }
    let states = if committed { stage_states(&a.dir, &placement)? } else { vec![None; placement.stages.len()] };
    for (i, (s, st)) in placement.stages.iter().zip(states).enumerate() {
        // What the node measures of it: llama.cpp's buffers, and its RSS growth.
        let measured = st.as_ref().map_or(String::new(), |st| {
            let loaded = st.loaded_bytes.map(|b| format!(", {} loaded", fmt_size(b))).unwrap_or_default();
            // The process's growth holds more than the stage (the API's tokenizer,
            // samplers, the allocator's slack): said as the node's, not the stage's.
            let resident =
                st.resident_bytes.map(|b| format!("; the node's RSS grew {} since", fmt_size(b))).unwrap_or_default();
            loaded + &resident
        });
        let state = match st {
            None if committed => "not answering".to_string(),
            None => String::new(),
            Some(st) => {
                let shard = st.shard_origin.map(|o| format!(", shard {o}")).unwrap_or_default();
                // The coordinator's draft model (stage 0 only).
                let draft = st.draft.map(|d| format!(", {}", d.describe(fmt_size))).unwrap_or_default();
                match st.state {
                    api::StageState::Fetching { done, of } => {
                        format!("fetching its shard: {done}/{of} chunks, {}", fmt_size(st.shard_bytes_received))
                    }
                    api::StageState::Loading => format!("loading{shard}"),
                    api::StageState::Running => format!("running{shard}{draft}"),
                    api::StageState::Failed(why) => format!("FAILED: {why}"),
                }
            }
        };
        // The plan's offload: each stage's last layers on its node's GPUs.
        let offload: String = s
            .gpus
            .iter()
            .map(|g| {
                let head = if g.head { " + head" } else { "" };
                format!(", {} on {}{head} ({})", g.layers, g.device, fmt_size(g.memory_bytes))
            })
            .collect();
        println!(
            "  stage {i}: layers {:>7} on {}  ({} predicted{offload}{measured})  {state}",
            s.layers.to_string(),
            &s.node.to_string()[..12],
            fmt_size(s.memory_bytes)
        );
    }
    if !placement.stages.is_empty() {
        println!("  predicted {:.1} tok/s", placement.predicted_tok_s);
    }
    for line in &placement.explanation {
        println!("- {line}");
    }
    Ok(())
}

/// `shoal generate --model`: tokenize here with the model's vocabulary (this node's
/// copy of the model, or any shard of it in this node's cache), and let the local node
/// forward the request to the coordinator.
pub fn generate(model: String, dir: &Option<PathBuf>, progress: bool, t: &crate::run::TextArgs) -> Result<()> {
    let dir_arg = DirArg { data_dir: dir.clone() };
    let rows = match ask(&dir_arg, NodeRequest::ModelList)? {
        NodeResponse::Models(rows) => rows,
        other => bail!("unexpected answer: {other:?}"),
    };
    let row = rows
        .iter()
        .find(|r| r.entry.name == model || (model.len() >= 8 && r.entry.content_hash.starts_with(&model)))
        .with_context(|| format!("no model {model:?} in the catalog (see `shoal models ls`)"))?;
    let vocab_file = vocab_file(dir, row)?;
    let vocab = shoal_engine::Vocab::load(&vocab_file)?;
    let prompt = t.prompt_tokens(&vocab)?;
    let sampling = t.sampling()?;
    let request = shoal_pipeline::GenerateRequest {
        prompt: prompt.clone(),
        max_new: u32::try_from(t.max_tokens).unwrap_or(u32::MAX),
        stop: t.stop_tokens(&vocab),
        sampling: serde_json::to_value(sampling)?,
        resume: Vec::new(),
        speculative: t.speculation()?,
        tag: None,
    };
    let data_dir = data_dir(dir);
    let identity = Arc::new(shoal_net::Identity::load_or_create(&data_dir)?);
    let mut out = crate::run::Printer::new(&vocab, !t.json, false);
    let mut count = 0;
    let req = NodeRequest::Generate { model: row.entry.content_hash.clone(), request };
    let last = runtime()?.block_on(api::request_stream(&data_dir, identity, &req, &mut |m| {
        if let NodeResponse::Token(tok) = m {
            out.token(*tok);
            count += 1;
            if progress {
                eprintln!("token {count}");
            }
        }
    }))?;
    let report = match last {
        NodeResponse::Generated(r) => r,
        NodeResponse::Error(e) => bail!("{e}"),
        other => bail!("unexpected answer: {other:?}"),
    };
    let tail = out.finish();
    if t.json {
        let r = crate::run::RunReport {
            tokens: report.tokens,
            text: out.text.clone(),
            stages: Vec::new(),
            prompt_tokens: prompt.len(),
            tok_per_s: report.tok_per_s,
            prefill_s: report.prefill_s,
            decode_s: report.decode_s,
            logits_digest: report.logits_digest,
            chunk: 0,
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

/// A file holding `row`'s vocabulary on this machine: the model itself where this node
/// holds it, else a shard of it in this node's cache (every shard keeps the metadata).
fn vocab_file(dir: &Option<PathBuf>, row: &api::ModelRow) -> Result<PathBuf> {
    if row.here == Some(CopyState::Unchanged) {
        if let Some(h) = row.entry.holders.values().find(|h| Path::new(&h.path).exists()) {
            return Ok(PathBuf::from(&h.path));
        }
    }
    let shards = data_dir(dir).join("shards").join(format!("blake3-{}", row.entry.content_hash));
    if let Ok(entries) = std::fs::read_dir(&shards) {
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "gguf") {
                return Ok(p);
            }
        }
    }
    bail!(
        "this node holds neither {} nor a shard of it, so it cannot tokenize the prompt;          run the command on a node that does (one that runs a stage of it, or `shoal models add` it here)",
        row.entry.name
    )
}

/// Ask the local node for a streamed answer: progress and tokens go to `on_message`;
/// an error answer becomes an error.
fn ask_stream(
    dir: &DirArg,
    req: &NodeRequest,
    on_message: &mut (dyn FnMut(&NodeResponse) + Send),
) -> Result<NodeResponse> {
    let data_dir = data_dir(&dir.data_dir);
    if !data_dir.join(shoal_net::identity::KEY_FILE).exists() {
        bail!("no node has run with the data directory {} yet: start it with `shoal serve`", data_dir.display());
    }
    let identity = Arc::new(shoal_net::Identity::load_or_create(&data_dir)?);
    match runtime()?.block_on(api::request_stream(&data_dir, identity, req, on_message))? {
        NodeResponse::Error(e) => bail!("{e}"),
        answer => Ok(answer),
    }
}

/// Ask the local node; an error answer becomes an error.
pub(crate) fn ask(dir: &DirArg, req: NodeRequest) -> Result<NodeResponse> {
    ask_stream(dir, &req, &mut |_| {})
}

fn add(a: AddArgs) -> Result<()> {
    let is_url = a.source.starts_with("http://") || a.source.starts_with("https://") || a.source.starts_with("hf://");
    let path = if is_url {
        let dest = a.download_dir.clone().unwrap_or_else(|| data_dir(&a.dir.data_dir).join("models"));
        std::fs::create_dir_all(&dest).with_context(|| format!("creating {}", dest.display()))?;
        download(&a.source, &dest)?
    } else {
        std::path::absolute(Path::new(&a.source)).with_context(|| format!("{}: not a usable path", a.source))?
    };
    let file = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    let mut bar = crate::progress::Bytes::new(format!("hashing {file} on the node"));
    let req = NodeRequest::ModelAddWatched { path: path.display().to_string(), name: a.name };
    let answer = ask_stream(&a.dir, &req, &mut |m| {
        if let NodeResponse::Progress { done, total } = m {
            bar.set(*done, Some(*total));
        }
    });
    let e = match answer {
        Ok(NodeResponse::Added(e)) => {
            bar.finish("done");
            e
        }
        Ok(other) => {
            bar.abandon();
            bail!("unexpected answer: {other:?}")
        }
        Err(e) => {
            bar.abandon();
            return Err(e);
        }
    };
    println!(
        "added {}: {} {} layers, {}, {} ({}…), held by {} node(s)",
        e.name,
        e.arch,
        e.n_layer,
        e.quantisation,
        fmt_size(e.size),
        &e.content_hash[..12],
        e.holders.len()
    );
    Ok(())
}

/// Download `url` into `dest`, showing progress on stderr; a cut download resumes when
/// the same command runs again.
fn download(url: &str, dest: &Path) -> Result<PathBuf> {
    let mut bar = crate::progress::Bytes::new(format!("downloading {url}"));
    let got = shoal_catalog::download(url, dest, &mut |p: shoal_catalog::Progress| bar.set(p.done, p.total));
    let got = match got {
        Ok(got) => {
            bar.finish("done");
            got
        }
        Err(e) => {
            bar.abandon();
            return Err(e).with_context(|| format!("downloading {url} (run the same command again to resume)"));
        }
    };
    eprintln!("[shoal] downloaded {}", got.path.display());
    Ok(got.path)
}

fn ls(a: LsArgs) -> Result<()> {
    let rows = match ask(&a.dir, NodeRequest::ModelList)? {
        NodeResponse::Models(rows) => rows,
        other => bail!("unexpected answer: {other:?}"),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("the catalog is empty: add a model with `shoal models add PATH`");
        return Ok(());
    }
    println!(
        "{:<40} {:<10} {:>6} {:<8} {:>10} {:>8}  {:<13} {:<12} here",
        "name", "arch", "layers", "quant", "size", "holders", "hash", "loaded"
    );
    for r in rows {
        let e = &r.entry;
        let here = match r.here {
            None => "-",
            Some(CopyState::Unchanged) => "yes",
            Some(CopyState::Changed) => "CHANGED on disk since added: not served (add it again)",
            Some(CopyState::Missing) => "MISSING on disk",
        };
        let loaded = match &r.placement {
            None => "-".to_string(),
            Some(p) if p.error.is_some() => "cannot place".to_string(),
            Some(p) => format!("{} stage(s)", p.stages.len()),
        };
        println!(
            "{:<40} {:<10} {:>6} {:<8} {:>10} {:>8}  {:<13} {loaded:<12} {here}",
            e.name,
            e.arch,
            e.n_layer,
            e.quantisation,
            fmt_size(e.size),
            e.holders.len(),
            format!("{}…", &e.content_hash[..12])
        );
    }
    Ok(())
}

fn import(a: ImportArgs) -> Result<()> {
    if a.names.is_empty() && !a.all {
        let NodeResponse::Found { found, skipped } = ask(&a.dir, NodeRequest::ModelScan { from: a.from })? else {
            bail!("unexpected answer");
        };
        if found.is_empty() {
            println!("no models found in the {:?} store on this machine", a.from);
        }
        for (name, path) in &found {
            println!("{name:<50} {path}");
        }
        for (path, why) in &skipped {
            eprintln!("skipped {path}: {why}");
        }
        if !found.is_empty() {
            println!(
                "add with: shoal models import --from {} NAME… (or --all)",
                format!("{:?}", a.from).to_lowercase()
            );
        }
        return Ok(());
    }
    let NodeResponse::Imported { added, refused } =
        ask(&a.dir, NodeRequest::ModelImport { from: a.from, names: a.names })?
    else {
        bail!("unexpected answer");
    };
    for e in &added {
        println!("added {} ({} {} layers, {})", e.name, e.arch, e.n_layer, fmt_size(e.size));
    }
    for (name, why) in &refused {
        eprintln!("refused {name}: {why}");
    }
    if !refused.is_empty() {
        bail!("{} of {} model(s) refused", refused.len(), refused.len() + added.len());
    }
    Ok(())
}
