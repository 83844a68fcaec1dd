//! `shoal-lab`: the tools around the product, apart from its binary: benchmarks that
//! print figures (`shoal-lab bench …`) and the namespace lab they use. It starts the
//! `shoal` binary beside it for nodes and runs.

mod bench;
mod lab;

use clap::{Parser, Subcommand};

/// Shoal's benchmarks and lab tools (they start the `shoal` binary beside this one).
#[derive(Parser)]
#[command(name = "shoal-lab", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmarks that print figures.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> std::process::ExitCode {
    shoal::init_logging();
    let result = match Cli::parse().command {
        Command::Bench(b) => bench::bench(b),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
