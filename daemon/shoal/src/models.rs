//! `shoal models …`: the cluster's model catalog, through the local node (the node
//! protocol, holding the node's own key). Files are used in place; a URL or `hf://`
//! is downloaded here first (resumable), then added like a path.

use crate::cluster::DirArg;
use crate::pipeline::{data_dir, runtime};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal_node::api::{self, CopyState, NodeRequest, NodeResponse, StoreKind};
use shoal_planner::plan::gib;
use std::io::Write;
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
    }
}

/// Ask the local node; an error answer becomes an error.
fn ask(dir: &DirArg, req: NodeRequest) -> Result<NodeResponse> {
    let data_dir = data_dir(&dir.data_dir);
    if !data_dir.join(shoal_net::identity::KEY_FILE).exists() {
        bail!("no node has run with the data directory {} yet: start it with `shoal serve`", data_dir.display());
    }
    let identity = Arc::new(shoal_net::Identity::load_or_create(&data_dir)?);
    match runtime()?.block_on(api::request(&data_dir, identity, &req))? {
        NodeResponse::Error(e) => bail!("{e}"),
        answer => Ok(answer),
    }
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
    eprintln!("[shoal] hashing {} on the node…", path.display());
    let req = NodeRequest::ModelAdd { path: path.display().to_string(), name: a.name };
    let e = match ask(&a.dir, req)? {
        NodeResponse::Added(e) => e,
        other => bail!("unexpected answer: {other:?}"),
    };
    println!(
        "added {}: {} {} layers, {}, {} ({}…), held by {} node(s)",
        e.name,
        e.arch,
        e.n_layer,
        e.quantisation,
        gib(e.size),
        &e.content_hash[..12],
        e.holders.len()
    );
    Ok(())
}

/// Download `url` into `dest`, showing progress on stderr; a cut download resumes when
/// the same command runs again.
fn download(url: &str, dest: &Path) -> Result<PathBuf> {
    let mut last = std::time::Instant::now();
    let mut progress = |p: shoal_catalog::Progress| {
        if last.elapsed().as_millis() < 200 {
            return;
        }
        last = std::time::Instant::now();
        match p.total {
            Some(t) if t > 0 => eprint!("\r[shoal] {} of {} ({:.0}%)   ", gib(p.done), gib(t), p.done as f64 * 100.0 / t as f64),
            _ => eprint!("\r[shoal] {}   ", gib(p.done)),
        }
        let _ = std::io::stderr().flush();
    };
    let got = shoal_catalog::download(url, dest, &mut progress);
    eprintln!();
    let got = got.with_context(|| format!("downloading {url} (run the same command again to resume)"))?;
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
    println!("{:<40} {:<10} {:>6} {:<8} {:>10} {:>8}  {:<13} here", "name", "arch", "layers", "quant", "size", "holders", "hash");
    for r in rows {
        let e = &r.entry;
        let here = match r.here {
            None => "-",
            Some(CopyState::Unchanged) => "yes",
            Some(CopyState::Changed) => "CHANGED on disk (re-hashed before use; refused if its bytes differ)",
            Some(CopyState::Missing) => "MISSING on disk",
        };
        println!(
            "{:<40} {:<10} {:>6} {:<8} {:>10} {:>8}  {:<13} {here}",
            e.name,
            e.arch,
            e.n_layer,
            e.quantisation,
            gib(e.size),
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
            println!("add with: shoal models import --from {} NAME… (or --all)", format!("{:?}", a.from).to_lowercase());
        }
        return Ok(());
    }
    let NodeResponse::Imported { added, refused } =
        ask(&a.dir, NodeRequest::ModelImport { from: a.from, names: a.names })?
    else {
        bail!("unexpected answer");
    };
    for e in &added {
        println!("added {} ({} {} layers, {})", e.name, e.arch, e.n_layer, gib(e.size));
    }
    for (name, why) in &refused {
        eprintln!("refused {name}: {why}");
    }
    if !refused.is_empty() {
        bail!("{} of {} model(s) refused", refused.len(), refused.len() + added.len());
    }
    Ok(())
}
