//! The cluster commands: `shoal serve` without a placement (a cluster node: discovery,
//! joining, membership, leader election), `shoal status` of the cluster, `shoal nodes
//! approve|remove|pair` and `shoal join CODE`. The CLI talks to the local node as its
//! owner, with the node's own key from the data directory.

use crate::inventory::Refresher;
use crate::pipeline::{data_dir, runtime};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal_membership::node::{self, CreatePolicy, NodeConfig};
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
    /// Join only with a pairing code, not by an approval from any cluster on the LAN.
    #[arg(long)]
    code_only: bool,
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
    /// The node's data directory [default: ~/.local/share/shoal].
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// `shoal join`.
#[derive(Args, Debug)]
pub struct JoinArgs {
    /// The code a member showed (`shoal nodes pair`), e.g. 1234-5678.
    code: String,
    #[command(flatten)]
    dir: DirArg,
}

/// Run a cluster node until Ctrl-C or SIGTERM.
pub fn serve(dir: Option<PathBuf>, listen: Option<SocketAddr>, impair: Impairment, args: ClusterArgs) -> Result<()> {
    let data_dir = data_dir(&dir);
    std::fs::create_dir_all(&data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let identity = Arc::new(Identity::load_or_create(&data_dir)?);
    let mut refresher = Refresher::new();
    let inventory = refresher.refresh();
    let name = args.name.clone().unwrap_or_else(|| inventory.hostname.clone());
    let create = if args.create_cluster {
        CreatePolicy::Now
    } else if args.no_create {
        CreatePolicy::Never
    } else {
        CreatePolicy::Auto { after_ms: args.create_after_ms }
    };
    let cfg = NodeConfig {
        data_dir: data_dir.clone(),
        listen: listen.unwrap_or(SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT))),
        join_listen: args.join_listen,
        name,
        role: args.role,
        interfaces: InterfaceFilter { allow: args.mdns_allow, deny: args.mdns_deny },
        create,
        accept_approval: !args.code_only,
        timing: Config::default(),
        transport: TransportOptions { impair, ..TransportOptions::default() },
        calibrator: Some(crate::calibrate::calibrator(identity.id())),
    };
    eprintln!("[shoal] cluster node {} (data in {})", identity.id(), data_dir.display());
    runtime()?.block_on(async move {
        let (tx, rx) = tokio::sync::watch::channel(inventory);
        // Memory and GPU free figures change; the advert follows them every 10 s.
        tokio::task::spawn_blocking(move || loop {
            std::thread::sleep(Duration::from_secs(10));
            if tx.send(refresher.refresh()).is_err() {
                return;
            }
        });
        node::run(cfg, identity, rx, crate::pipeline::shutdown_signal()).await
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
    };
    match ask(&dir, req)? {
        AdminResponse::Ok(text) => println!("{text}"),
        AdminResponse::Code { code, valid_s } => {
            println!("{code}");
            eprintln!("on the new node run: shoal join {code}   (valid {} min, one node)", valid_s / 60);
        }
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `shoal join CODE`.
pub fn join(a: JoinArgs) -> Result<()> {
    match ask(&a.dir.data_dir, AdminRequest::Join { code: a.code })? {
        AdminResponse::Ok(text) => println!("{text}"),
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `shoal status` of the cluster the local node belongs to.
pub fn status(dir: &Option<PathBuf>, json: bool) -> Result<()> {
    let AdminResponse::Status(st) = ask(dir, AdminRequest::Status)? else { bail!("unexpected answer to status") };
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
    } else {
        print_status(&st);
    }
    Ok(())
}

fn gib(b: Option<u64>) -> String {
    b.map_or("?".into(), |b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
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
        None => println!("unpaired: not in a cluster yet (approve it from a member, or `shoal join CODE`)"),
    }
    println!("this node {} ({}) at {}: {}", short(&st.node), st.name, st.addr, st.role);
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
                m.name,
                m.role.to_string(),
                format!("{:?}{}", m.state, if m.leader { " *" } else { "" }).to_lowercase(),
                gib(m.ram_available),
                gib(m.vram_free),
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
                p.name,
                p.role.to_string(),
                gib(Some(p.memory_bytes)),
                p.addr
            );
        }
    }
    if let Some(s) = st.pairing_s {
        println!("a pairing code is active for {} more min", s / 60 + 1);
    }
}
