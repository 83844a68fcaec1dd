//! The cluster commands: `shoal serve` without a placement (a cluster node: discovery,
//! joining, membership, leader election), `shoal status` of the cluster, `shoal nodes
//! approve|remove|pair|token`, `shoal join CODE|TOKEN` / `shoal join --accept CLUSTER`,
//! `shoal leave` and `shoal reset`. The CLI talks to the local node as its owner, with the
//! node's own key from the data directory.

use crate::inventory::Refresher;
use crate::pipeline::{data_dir, runtime};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal_membership::node::{self, CreatePolicy, NodeConfig};
use shoal_membership::token::JoinToken;
use shoal_membership::wire::{AdminRequest, AdminResponse, ClusterStatus};
use shoal_membership::Config;
use shoal_net::discovery::InterfaceFilter;
use shoal_net::{Identity, Impairment, TransportOptions};
use shoal_types::Role;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Default port of a node's main endpoint (members only).
pub const DEFAULT_PORT: u16 = 47070;
/// Default port of a node's join endpoint (advertised over mDNS, so any port works).
pub const DEFAULT_JOIN_PORT: u16 = 47071;

/// Options of `shoal serve` as a cluster node (no `--placement`).
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Join endpoint address (pairing and approval of new nodes; any key, nothing else).
    #[arg(long, default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_JOIN_PORT)))]
    join_listen: SocketAddr,
    /// This node's name as the cluster shows it [default: the host name].
    #[arg(long)]
    name: Option<String>,
    /// `hub` for a dedicated always-on box (preferred as leader), else `pc`.
    #[arg(long, default_value = "pc")]
    role: Role,
    /// Network interfaces mDNS may use (comma-separated, `*` globs; e.g. "eth0,wlan*").
    /// Default: every real interface except container/VM bridges.
    #[arg(long, value_delimiter = ',')]
    mdns_allow: Vec<String>,
    /// Interfaces mDNS must not use (comma-separated, `*` globs).
    #[arg(long, value_delimiter = ',')]
    mdns_deny: Vec<String>,
    /// Create a new cluster now if this node has none.
    #[arg(long, conflicts_with = "no_create")]
    create_cluster: bool,
    /// Never create a cluster: wait to be approved or to pair with a code.
    #[arg(long)]
    no_create: bool,
    /// With neither flag: listen this long (ms) for a cluster on the LAN before creating one.
    #[arg(long, default_value_t = 3000)]
    create_after_ms: u64,
    /// Take an approval from the member whose node id starts with this (at least 16
    /// hex digits: `shoal key` on it). Without it, an approval is taken only after
    /// `shoal join --accept`; a pairing code or a join token joins either way.
    #[arg(long, value_name = "MEMBER")]
    accept: Option<String>,
    /// Join the cluster this token admits to (made by `shoal nodes token` on a member);
    /// also read from the file `join-token` in the data directory.
    #[arg(long, value_name = "TOKEN")]
    join_token: Option<String>,
    /// Memory this node offers to models (the leader places within it), e.g. 12G,
    /// 12GiB, 512MiB, 1.5G: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB
    /// powers of 1000 [default: what is free at start, less 512 MiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    max_memory: Option<u64>,
    /// Where the HTTP API (OpenAI and Ollama routes) listens. Requests from other
    /// machines need an API key (`shoal keys create`); from this one, none.
    #[arg(long, value_name = "ADDR", default_value_t = SocketAddr::from(([0, 0, 0, 0], shoal_api::DEFAULT_PORT)))]
    http_listen: SocketAddr,
    /// Serve no HTTP API.
    #[arg(long)]
    no_http: bool,
    /// Let every machine call the API without a key (a LAN whose every machine you trust).
    #[arg(long)]
    api_open: bool,
    /// A web origin (`http://host:port`) whose pages may call the API from a browser
    /// (CORS); repeat for more, `*` for any. None by default.
    #[arg(long, value_name = "ORIGIN")]
    cors_origin: Vec<String>,
    /// Let `/api/pull` download from addresses on this machine or the LAN (a model
    /// server there); by default a URL a client gives reaches public addresses only.
    #[arg(long)]
    allow_private_downloads: bool,
    /// For the hub box's disk image only (with --role hub): this node is a hub appliance
    /// whose system is managed from the admin page. The page sets the time zone and
    /// WiFi, installs updates, reboots and factory-resets the box by writing files in
    /// <data-dir>/appliance/ for the image's root-owned scripts (the node itself needs
    /// no privilege), and the first admin password may be set from another machine of
    /// the LAN (at http://shoal.local:11434/admin/ or the box's IP address).
    #[arg(long)]
    appliance: bool,
    /// Speculative decoding for API requests that do not say (`"speculative": true/false`
    /// in the request): verify up to K tokens drafted by prompt lookup per step; 0: off.
    #[arg(long, value_name = "K", default_value_t = 0)]
    draft: u32,
}

/// A size in bytes as the user wrote it (see [`shoal_types::size::SIZE_SPELLINGS`]).
fn parse_size(s: &str) -> Result<u64, String> {
    shoal_types::parse_size(s).map_err(|e| e.to_string())
}

/// VRAM kept free on each GPU for the driver, the display and other programs.
pub const GPU_RESERVE_BYTES: u64 = 512 << 20;

/// The GPUs a node offers to models: each discrete GPU with what it has free less
/// [`GPU_RESERVE_BYTES`]. Integrated GPUs are left out: their memory is the RAM the
/// node already offers (counting it twice would plan layers into memory that is not
/// there), and llama.cpp gains little from them over the CPU on the same memory.
pub fn gpu_offers(inv: &shoal_types::NodeInventory) -> Vec<shoal_types::GpuOffer> {
    inv.gpus
        .iter()
        .filter(|g| g.kind == "gpu" && g.free_bytes > GPU_RESERVE_BYTES)
        .map(|g| shoal_types::GpuOffer {
            device: g.name.clone(),
            description: g.description.clone(),
            memory_bytes: g.free_bytes - GPU_RESERVE_BYTES,
        })
        .collect()
}

/// How the node runs the stages the leader gives it.
#[derive(Debug, Clone)]
pub struct StageArgs {
    /// CPU threads per stage.
    pub threads: u32,
    /// Whether the node offers its GPUs to models.
    pub offer_gpus: bool,
    /// Where shards are kept.
    pub cache: Option<PathBuf>,
    /// Whether stages spin between tokens.
    pub keepalive: crate::pipeline::KeepAlive,
    /// Draft models for the models this node coordinates (`--draft-model`).
    pub draft_models: Vec<PathBuf>,
}

/// `shoal nodes`.
#[derive(Subcommand, Debug)]
pub enum NodesCommand {
    /// Approve a pending node (a unique prefix of its id is enough).
    Approve(NodeArg),
    /// Remove a member and revoke its key everywhere.
    Remove(NodeArg),
    /// Make a pairing code a new node can join with (`shoal join CODE` there).
    Pair(DirArg),
    /// Make a join token for a node installed unattended (`shoal serve --join-token T`,
    /// or the file `join-token` in its data directory). One node, until it expires.
    Token(TokenArgs),
}

/// `shoal nodes token`.
#[derive(Args, Debug)]
pub struct TokenArgs {
    /// How long the token stays valid, e.g. 30m, 24h, 7d (at most 30 days).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    valid: Duration,
    #[command(flatten)]
    dir: DirArg,
}

/// `shoal reset`.
#[derive(Args, Debug)]
pub struct ResetArgs {
    /// Also make a new key (a new node id) at the next start; the node must be stopped.
    #[arg(long)]
    new_key: bool,
    #[command(flatten)]
    dir: DirArg,
}

/// A duration like 90s, 30m, 24h or 7d.
fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("{s:?}: a number then s, m, h or d"))?;
    let secs = match unit {
        "s" | "" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        "d" => n.saturating_mul(86_400),
        _ => return Err(format!("{s:?}: the unit is s, m, h or d")),
    };
    if secs == 0 {
        return Err("a validity of zero".into());
    }
    Ok(Duration::from_secs(secs))
}

/// A node id (or prefix) and the local node's data directory.
#[derive(Args, Debug)]
pub struct NodeArg {
    /// Node id, or a unique prefix of it.
    id: String,
    #[command(flatten)]
    dir: DirArg,
}

/// The local node's data directory.
#[derive(Args, Debug)]
pub struct DirArg {
    /// The node's data directory [default: $SHOAL_DATA_DIR, else ~/.local/share/shoal, else the service's /var/lib/shoal].
    #[arg(long)]
    pub(crate) data_dir: Option<PathBuf>,
}

/// `shoal join`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("how").required(true).args(["code", "accept"])))]
pub struct JoinArgs {
    /// The code a member showed (`shoal nodes pair`), e.g. 1234-5678, or a join token
    /// (`shoal nodes token`).
    code: Option<String>,
    /// Instead: take an approval from this member for 10 minutes (its node id, at least
    /// the first 16 hex digits: `shoal key` or `shoal status` on it); then approve this
    /// node there. Not a cluster id: anyone on the LAN can see those.
    #[arg(long, value_name = "MEMBER")]
    accept: Option<String>,
    #[command(flatten)]
    dir: DirArg,
}

/// Run a cluster node until `shutdown` completes (Ctrl-C or SIGTERM from a terminal or
/// systemd, the SCM's stop on Windows).
pub fn serve(
    dir: Option<PathBuf>,
    listen: Option<SocketAddr>,
    impair: Impairment,
    args: ClusterArgs,
    stage: StageArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let data_dir = crate::pipeline::node_data_dir(&dir);
    std::fs::create_dir_all(&data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    // Absolute from here on: paths under it go into the cluster state (downloaded
    // models' paths), which only takes absolute ones.
    let data_dir = std::fs::canonicalize(&data_dir).with_context(|| format!("resolving {}", data_dir.display()))?;
    let identity = Arc::new(Identity::load_or_create(&data_dir)?);
    let mut refresher = Refresher::new();
    let inventory = refresher.refresh();
    let inventory_now = inventory.clone();
    let name = args.name.clone().unwrap_or_else(|| inventory.hostname.clone());
    let create = if args.create_cluster {
        CreatePolicy::Now
    } else if args.no_create {
        CreatePolicy::Never
    } else {
        CreatePolicy::Auto { after_ms: args.create_after_ms }
    };
    let join_token = match args.join_token.clone() {
        Some(t) => Some(t),
        None => match std::fs::read_to_string(data_dir.join(node::JOIN_TOKEN_FILE)) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => bail!("reading {}: {e}", data_dir.join(node::JOIN_TOKEN_FILE).display()),
        },
    };
    let join_token = join_token
        .map(|t| t.trim().parse::<JoinToken>())
        .transpose()
        .map_err(|e| anyhow::anyhow!("the join token: {e}"))?;
    if let Some(prefix) = &args.accept {
        let digits = shoal_membership::node::ACCEPT_ID_DIGITS;
        if prefix.len() < digits || prefix.len() > 64 || !prefix.chars().all(|c| c.is_ascii_hexdigit()) {
            bail!("--accept takes the node id of the member that will approve this node, at least its first {digits} hex digits (`shoal key` on it)");
        }
    }
    let appliance = if args.appliance {
        if args.role != Role::Hub {
            bail!("--appliance is for a hub box: add --role hub");
        }
        let a = shoal_admin::Appliance::open(&data_dir, Some(inventory.hostname.clone()))
            .context("the appliance folder (--appliance)")?;
        eprintln!("[shoal] hub appliance: system settings through {}", a.dir().display());
        Some(a)
    } else {
        None
    };
    let speculation = match args.draft {
        0 => None,
        k => {
            let s = shoal_types::SpecSettings { max_draft: k, ..Default::default() };
            s.validate()?;
            Some(s)
        }
    };
    let cfg = NodeConfig {
        data_dir: data_dir.clone(),
        listen: listen.unwrap_or(SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT))),
        join_listen: args.join_listen,
        name,
        role: args.role,
        interfaces: InterfaceFilter { allow: args.mdns_allow, deny: args.mdns_deny },
        // The node fills it in once its HTTP API is bound.
        web_port: None,
        create,
        accept: args.accept.clone(),
        join_token,
        timing: Config::default(),
        transport: TransportOptions { impair, ..TransportOptions::default() },
        calibrator: Some(crate::calibrate::calibrator(identity.id(), stage.threads)),
    };
    eprintln!("[shoal] cluster node {} (data in {})", identity.id(), data_dir.display());
    runtime()?.block_on(async move {
        let (tx, rx) = tokio::sync::watch::channel(inventory);
        // Memory and GPU free figures change; the advert follows them every 10 s.
        // A task, not a blocking thread that sleeps: the runtime waits for blocking
        // threads when it shuts down, and a stop must not wait out the sleep.
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(10));
            every.tick().await;
            loop {
                every.tick().await;
                let Ok((r, inv)) = tokio::task::spawn_blocking(move || {
                    let inv = refresher.refresh();
                    (refresher, inv)
                })
                .await
                else {
                    return;
                };
                refresher = r;
                if tx.send(inv).is_err() {
                    return;
                }
            }
        });
        let options = shoal_node::Options {
            engine: Some(Arc::new(crate::engine::LlamaEngine {
                threads: stage.threads,
                draft_models: stage.draft_models.clone(),
            })),
            max_memory: args.max_memory,
            gpus: if stage.offer_gpus { gpu_offers(&inventory_now) } else { Vec::new() },
            shard_dir: stage.cache,
            http: (!args.no_http).then_some(args.http_listen),
            api_access: shoal_api::Access {
                loopback_free: true,
                open: args.api_open,
                cors_origins: args.cors_origin.clone(),
                private_downloads: args.allow_private_downloads,
            },
            // Only when asked: `shoal-lab bench serve` measured no gain for one stream and a
            // loss for concurrent ones with several nodes on one machine (they spin on
            // shared cores); machines of their own may differ (`--keepalive on`).
            keepalive: (stage.keepalive == crate::pipeline::KeepAlive::On).then_some(shoal_pipeline::KEEPALIVE_WINDOW),
            appliance,
            speculation,
        };
        shoal_node::run(cfg, options, identity, rx, shutdown).await
    })?;
    Ok(())
}

fn ask(dir: &Option<PathBuf>, req: AdminRequest) -> Result<AdminResponse> {
    let data_dir = data_dir(dir);
    // The CLI speaks with the node's own key; it never makes one (that would be a
    // different node's).
    if !data_dir.join(shoal_net::identity::KEY_FILE).exists() {
        bail!("no node has run with the data directory {} yet: start it with `shoal serve`", data_dir.display());
    }
    let identity = Arc::new(Identity::load_or_create(&data_dir)?);
    let answer = runtime()?.block_on(node::admin(&data_dir, identity, &req))?;
    if let AdminResponse::Error(e) = answer {
        bail!("{e}");
    }
    Ok(answer)
}

/// `shoal nodes …`.
pub fn nodes(c: NodesCommand) -> Result<()> {
    let (dir, req) = match c {
        NodesCommand::Approve(a) => (a.dir.data_dir, AdminRequest::Approve { node: a.id }),
        NodesCommand::Remove(a) => (a.dir.data_dir, AdminRequest::Remove { node: a.id }),
        NodesCommand::Pair(d) => (d.data_dir, AdminRequest::Pair),
        NodesCommand::Token(t) => (t.dir.data_dir, AdminRequest::Token { valid_s: t.valid.as_secs() }),
    };
    match ask(&dir, req)? {
        AdminResponse::Ok(text) => println!("{text}"),
        AdminResponse::Code { code, valid_s } if shoal_membership::token::is_token(&code) => {
            println!("{code}");
            eprintln!(
                "give it to the new node: shoal serve --join-token {code}\n(or put it in the file {} of its data \
                 directory; valid {}, one node; it joins while this node runs)",
                node::JOIN_TOKEN_FILE,
                if valid_s >= 3600 { format!("{} h", valid_s / 3600) } else { format!("{} min", valid_s.div_ceil(60)) }
            );
        }
        AdminResponse::Code { code, valid_s } => {
            println!("{code}");
            eprintln!("on the new node run: shoal join {code}   (valid {} min, one node)", valid_s / 60);
        }
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `shoal join CODE|TOKEN`, or `shoal join --accept MEMBER`.
pub fn join(a: JoinArgs) -> Result<()> {
    let req = match (a.code, a.accept) {
        (_, Some(member)) => AdminRequest::Accept { member },
        (Some(code), None) => AdminRequest::Join { code },
        // clap's group requires one of them.
        (None, None) => bail!("give a code, a token or --accept MEMBER"),
    };
    match ask(&a.dir.data_dir, req)? {
        AdminResponse::Ok(text) => println!("{text}"),
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `shoal leave`: this node leaves its cluster; the others revoke its key.
pub fn leave(d: DirArg) -> Result<()> {
    match ask(&d.data_dir, AdminRequest::Leave)? {
        AdminResponse::Ok(text) => println!("{text}"),
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `shoal password`: the admin page's password, set through this node (its owner needs
/// no page login): hashed here (Argon2id) and kept in the cluster state, with a new
/// session key, so every page session on every node ends.
pub fn password(d: DirArg) -> Result<()> {
    use std::io::IsTerminal;
    let password = if std::io::stdin().is_terminal() {
        let first = rpassword::prompt_password("New admin password: ")?;
        if rpassword::prompt_password("The same again: ")? != first {
            bail!("the two passwords differ; nothing changed");
        }
        first
    } else {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        line.trim_end_matches(['\r', '\n']).to_string()
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_secs());
    let record = shoal_admin::AuthRecord::new(&password, now)?;
    let value = serde_json::to_value(&record)?;
    match ask(&d.data_dir, AdminRequest::Put { key: shoal_admin::AUTH_KEY.into(), value })? {
        AdminResponse::Ok(_) => println!("the admin password is set; every page session has ended"),
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `shoal reset`: forget the cluster here (through the running node, or in its store
/// when it is stopped); `--new-key` also makes the node a new one at its next start.
pub fn reset(a: ResetArgs) -> Result<()> {
    let data_dir = data_dir(&a.dir.data_dir);
    if !a.new_key && data_dir.join(shoal_net::identity::KEY_FILE).exists() {
        let identity = Arc::new(Identity::load_or_create(&data_dir)?);
        match runtime()?.block_on(node::admin(&data_dir, identity, &AdminRequest::Reset)) {
            Ok(AdminResponse::Ok(text)) => {
                println!("{text}");
                return Ok(());
            }
            Ok(AdminResponse::Error(e)) => bail!("{e}"),
            Ok(other) => bail!("unexpected answer: {other:?}"),
            // Not running (or not reachable): the store is the truth; opening it fails
            // if a node does hold it.
            Err(_) => {}
        }
    }
    match node::reset_offline(&data_dir, a.new_key) {
        Ok(text) => println!("{text}"),
        Err(node::NodeError::Store(shoal_store::StoreError::InUse { .. })) => bail!(
            "the node with data directory {} is running{}: stop it first",
            data_dir.display(),
            if a.new_key { " (a new key needs a restart)" } else { " but does not answer" }
        ),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// The local node's view of its cluster.
pub fn status_of(dir: &Option<PathBuf>) -> Result<Box<shoal_membership::wire::ClusterStatus>> {
    let AdminResponse::Status(st) = ask(dir, AdminRequest::Status)? else { bail!("unexpected answer to status") };
    Ok(st)
}

/// `shoal status` of the cluster the local node belongs to.
pub fn status(dir: &Option<PathBuf>, json: bool) -> Result<()> {
    let AdminResponse::Status(st) = ask(dir, AdminRequest::Status)? else { bail!("unexpected answer to status") };
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
    } else {
        print_status(&st);
        print_stage(dir);
        print_breakdowns(dir);
    }
    Ok(())
}

/// Where each loaded model's decode steps spend their time (nothing before a model has
/// generated, or when a stage's node does not answer).
fn print_breakdowns(dir: &Option<PathBuf>) {
    let data_dir = data_dir(dir);
    let Ok(identity) = Identity::load_or_create(&data_dir) else { return };
    let ask = shoal_node::api::request(&data_dir, Arc::new(identity), &shoal_node::api::NodeRequest::Breakdowns);
    let Ok(Ok(shoal_node::api::NodeResponse::Breakdowns(all))) = runtime().map(|rt| rt.block_on(ask)) else { return };
    for (model, b) in all {
        println!("model {model}:");
        for line in b.lines() {
            println!("  {line}");
        }
    }
}

/// The stage this node runs, with its memory: the planner's prediction, llama.cpp's
/// buffers, and how much the node's RSS grew since it loaded (`shoal models plan NAME`
/// shows every stage).
/// Nothing when it runs none or does not answer.
fn print_stage(dir: &Option<PathBuf>) {
    let data_dir = data_dir(dir);
    let Ok(identity) = Identity::load_or_create(&data_dir) else { return };
    let ask = shoal_node::api::request(&data_dir, Arc::new(identity), &shoal_node::api::NodeRequest::Stages);
    let Ok(Ok(shoal_node::api::NodeResponse::Stages(stages))) = runtime().map(|rt| rt.block_on(ask)) else { return };
    for st in stages {
        let state = match &st.state {
            shoal_node::api::StageState::Fetching { done, of } => format!("fetching its shard ({done}/{of} chunks)"),
            shoal_node::api::StageState::Loading => "loading".to_string(),
            shoal_node::api::StageState::Running => "running".to_string(),
            shoal_node::api::StageState::Failed(why) => format!("failed: {why}"),
        };
        // A coordinator's draft model is memory beside the stage's.
        let draft = st.draft.as_ref().map(|d| format!("; {}", d.describe(shoal_types::fmt_size))).unwrap_or_default();
        println!(
            "this node's stage: layers {} of model {}, generation {}: {state}; memory predicted {}, loaded {} (the node's RSS grew {} since){draft}",
            st.layers,
            &st.model[..st.model.len().min(12)],
            st.generation,
            size_or_unknown(Some(st.predicted_bytes)),
            size_or_unknown(st.loaded_bytes),
            size_or_unknown(st.resident_bytes),
        );
    }
}

/// A size, or "?" when it is not known.
fn size_or_unknown(b: Option<u64>) -> String {
    b.map_or("?".into(), shoal_types::fmt_size)
}

fn print_status(st: &ClusterStatus) {
    let short = |id: &shoal_types::NodeId| id.to_string()[..12].to_string();
    match &st.cluster {
        Some(c) => {
            let leader = st.leader.as_ref().map_or("none (election under way?)".into(), |l| {
                let name = st.members.iter().find(|m| m.node == *l).map_or("", |m| m.name.as_str());
                format!("{} ({name})", short(l))
            });
            println!("cluster {c}  term {}  leader {leader}  state {}", st.term, st.version);
        }
        None => println!("unpaired: not in a cluster yet (`shoal join CODE|TOKEN`, or `shoal join --accept MEMBER` and an approval there)"),
    }
    println!("this node {} ({}) at {}: {}", short(&st.node), shown(&st.name), st.addr, st.role);
    if st.cluster.is_none() {
        if st.lan_clusters.is_empty() {
            println!("no cluster advertises on the LAN");
        }
        for (c, n) in &st.lan_clusters {
            println!("cluster on the LAN: {c}  ({n} node(s))");
        }
        if let Some(m) = &st.accepting {
            println!("takes an approval from member {m}… (agreed with `shoal join --accept`)");
        }
        if let Some(t) = &st.join_token {
            println!("join token: {}", shown(t));
        }
    }
    if !st.members.is_empty() {
        println!("members:");
        println!(
            "  {:<12}  {:<16} {:<4} {:<10} {:>10} {:>10}  addr",
            "node", "name", "role", "state", "RAM free", "VRAM free"
        );
        for m in &st.members {
            println!(
                "  {:<12}  {:<16} {:<4} {:<10} {:>10} {:>10}  {}",
                short(&m.node),
                shown(&m.name),
                m.role.to_string(),
                format!("{:?}{}", m.state, if m.leader { " *" } else { "" }).to_lowercase(),
                size_or_unknown(m.ram_available),
                size_or_unknown(m.vram_free),
                m.addr.as_deref().unwrap_or("?")
            );
        }
    }
    if !st.pending.is_empty() {
        println!("pending (approve with `shoal nodes approve ID`):");
        for p in &st.pending {
            println!(
                "  {}  {:<16} {:<4} {:>10}  {}",
                short(&p.node),
                shown(&p.name),
                p.role.to_string(),
                size_or_unknown(Some(p.memory_bytes)),
                p.addr
            );
        }
    }
    if let Some(s) = st.pairing_s {
        println!("a pairing code is active for {} more min", s / 60 + 1);
    }
    if st.tokens > 0 {
        println!("{} join token(s) made here are still usable", st.tokens);
    }
}

/// Text that came from other nodes, safe for a terminal: no control characters (escape
/// sequences could rewrite the screen or the title), at most 64 characters.
fn shown(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::{gpu_offers, parse_size, GPU_RESERVE_BYTES};
    use shoal_types::{DeviceInventory, NodeInventory};

    #[test]
    fn max_memory_takes_sizes_as_people_write_them() {
        use clap::Parser;
        #[derive(Parser)]
        struct Serve {
            #[command(flatten)]
            a: super::ClusterArgs,
        }
        let offer = |size: &str| Serve::try_parse_from(["serve", "--max-memory", size]).map(|s| s.a.max_memory);
        for (size, bytes) in [("100MiB", 100 << 20), ("12GiB", 12 << 30), ("12GB", 12_000_000_000), ("1.5G", 3 << 29)] {
            assert_eq!(offer(size).unwrap(), Some(bytes), "{size}");
        }
        let refused = offer("12X").expect_err("12X is refused").to_string();
        assert!(refused.contains("KiB/MiB/GiB/TiB"), "{refused}");
        assert_eq!(parse_size("99999999999T"), Err("\"99999999999T\" is too large".into()));
    }

    #[test]
    fn a_node_offers_its_discrete_gpus_less_a_reserve_and_no_igpu() {
        let dev = |name: &str, kind: &str, free: u64| DeviceInventory {
            name: name.into(),
            description: format!("{name} card"),
            kind: kind.into(),
            free_bytes: free,
            total_bytes: free,
        };
        let inv = NodeInventory {
            gpus: vec![
                dev("CUDA0", "gpu", 8 << 30),
                // Its memory is the RAM the node already offers.
                dev("Vulkan1", "igpu", 4 << 30),
                // Less free than the reserve: nothing to offer.
                dev("CUDA1", "gpu", GPU_RESERVE_BYTES - 1),
            ],
            ..NodeInventory::default()
        };
        let offers = gpu_offers(&inv);
        assert_eq!(offers.len(), 1, "{offers:?}");
        assert_eq!(offers[0].device, "CUDA0");
        assert_eq!(offers[0].description, "CUDA0 card");
        assert_eq!(offers[0].memory_bytes, (8 << 30) - GPU_RESERVE_BYTES);
        assert!(gpu_offers(&NodeInventory::default()).is_empty());
    }
}
