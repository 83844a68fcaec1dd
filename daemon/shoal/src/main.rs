//! The `shoal` binary: command-line parsing and wiring. Each subcommand lives in its
//! own module of the library (`lib.rs`); this file only dispatches. Benchmarks and the
//! namespace lab are another binary, `shoal-lab`.

use clap::{Parser, Subcommand};
use shoal::{calibrate, chat, cluster, inventory, keys, models, pipeline, plan, run, service};

/// Shoal pools the memory of the computers you own into one LLM server.
#[derive(Parser)]
#[command(name = "shoal", version = shoal::version_text(), about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant (`serve`'s flags) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run a model in this process, split into in-process stages, and stream its answer.
    Run(run::RunArgs),
    /// The demo: a local cluster of three nodes on this machine splits the small test
    /// model and answers a question (`--in-process`: three stages in this process).
    Demo(run::DemoArgs),
    /// Run this node: a cluster node (discovery, joining, leader election), or with
    /// `--placement`, this node's stage of a placement.
    Serve(pipeline::ServeArgs),
    /// Run one generation through a running pipeline (ask its coordinator).
    Generate(pipeline::GenerateArgs),
    /// The cluster as this node sees it: members, leader, term, pending nodes; with
    /// `--placement`, each node of a running pipeline.
    Status(pipeline::StatusArgs),
    /// Approve, remove or pair nodes of this node's cluster.
    #[command(subcommand)]
    Nodes(cluster::NodesCommand),
    /// The cluster's model catalog: add (a path, URL or hf://), ls, rm, import.
    #[command(subcommand)]
    Models(models::ModelsCommand),
    /// Chat in the terminal with a model the cluster runs (through a node's HTTP API).
    Chat(chat::ChatArgs),
    /// API keys for the HTTP API from other machines: create (shown once), ls, revoke.
    #[command(subcommand)]
    Keys(keys::KeysCommand),
    /// Join a cluster: with a pairing code or a join token from one of its members, or
    /// (`--accept MEMBER`) by taking an approval from that member.
    Join(cluster::JoinArgs),
    /// Set the admin page's password from this node (the first one, or one forgotten):
    /// read without echo, or one line from standard input; every page session ends.
    Password(cluster::DirArg),
    /// Leave this node's cluster cleanly: the other members revoke its key.
    Leave(cluster::DirArg),
    /// Forget this node's cluster here without asking anyone (its cluster is gone or
    /// unreachable); `--new-key` also gives it a new identity.
    Reset(cluster::ResetArgs),
    /// Print this node's id (its public key), creating the key on first use.
    Key(pipeline::KeyArgs),
    /// Describe a GGUF model: architecture, sizes, bytes per layer.
    Inspect(run::InspectArgs),
    /// Choose the fastest placement of a model that fits (or predict a given one), and say why.
    Plan(plan::PlanArgs),
    /// Measure this machine's speed on a model for the planner and keep it in the cluster state.
    Calibrate(calibrate::CalibrateArgs),
    /// What this machine offers: host, OS, CPU, RAM and the GPUs llama.cpp sees.
    Inventory(inventory::InventoryArgs),
    /// Run Shoal as this machine's service (systemd on Linux, launchd on macOS, the
    /// Service Control Manager on Windows): install (and start, and join with
    /// `--join TOKEN`), uninstall, status.
    #[command(subcommand)]
    Service(service::ServiceCommand),
}

fn main() -> std::process::ExitCode {
    shoal::init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Demo(a) => run::demo(a),
        Command::Inspect(a) => run::inspect(a),
        Command::Serve(a) => pipeline::serve(a),
        Command::Generate(a) => pipeline::generate(a),
        Command::Key(a) => pipeline::key(a),
        Command::Status(a) => pipeline::status(a),
        Command::Nodes(c) => cluster::nodes(c),
        Command::Models(c) => models::models(c),
        Command::Keys(c) => keys::keys(c),
        Command::Chat(a) => chat::chat(a),
        Command::Join(a) => cluster::join(a),
        Command::Leave(a) => cluster::leave(a),
        Command::Password(a) => cluster::password(a),
        Command::Reset(a) => cluster::reset(a),
        Command::Plan(a) => plan::plan(a),
        Command::Inventory(a) => inventory::inventory(a),
        Command::Calibrate(a) => calibrate::calibrate(a),
        Command::Service(c) => service::service(c),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if let Some(hint) = pipeline::system_dir_hint(&e) {
                eprintln!("{hint}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
