//! The `shoal` binary's commands as a library: the product CLI (`src/main.rs`) and the
//! lab tool (`src/bin/shoal-lab`, benchmarks and the namespace lab) share them. Each
//! module is one command or one piece the commands share.

pub mod calibrate;
pub mod chat;
pub mod cluster;
pub mod engine;
pub mod inventory;
pub mod keys;
pub mod local;
pub mod models;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod run;
pub mod service;
pub mod stats;

/// The `shoal` binary to start nodes and runs with: this program, unless it is
/// `shoal-lab`, which starts the `shoal` beside it (as cargo and packages install them).
pub fn shoal_exe() -> std::io::Result<std::path::PathBuf> {
    let me = std::env::current_exe()?;
    let name = format!("shoal{}", std::env::consts::EXE_SUFFIX);
    // The product may be renamed (a release file `shoal-linux-x86_64`): it is itself.
    if !me.file_stem().is_some_and(|n| n.to_string_lossy().starts_with("shoal-lab")) {
        return Ok(me);
    }
    let beside = me.with_file_name(&name);
    if beside.exists() {
        Ok(beside)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no {name} beside {} (build both: cargo build -p shoal)", me.display()),
        ))
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default: warnings, llama.cpp's errors only).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,llama.cpp=error")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// What `shoal --version` prints after the name: the version, the commit it was built
/// from, and the llama.cpp backends compiled in (`cpu` alone unless built with the
/// `cuda`, `vulkan` or `metal` feature).
pub fn version_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        format!(
            "{} (commit {})\nbackends: {}",
            env!("CARGO_PKG_VERSION"),
            env!("SHOAL_GIT_COMMIT"),
            shoal_engine::COMPILED_BACKENDS.join(", ")
        )
    })
}
