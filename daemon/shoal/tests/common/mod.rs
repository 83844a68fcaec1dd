//! Helpers shared by the binary's integration tests.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A cached test model; fails with instructions when missing (never a silent pass).
pub fn model(file: &str) -> PathBuf {
    let p = shoal_gguf::models_dir().join(file);
    assert!(p.exists(), "test model {} is missing: run scripts/setup.sh (or set SHOAL_MODELS)", p.display());
    p
}

/// The `shoal` binary under test.
pub fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

/// The lab binary (benchmarks), which starts the `shoal` beside it.
pub fn shoal_lab() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal-lab"))
}

/// The node id of the key in `dir` (created on first use).
pub fn key(dir: &Path) -> String {
    let out = shoal().args(["key", "--data-dir"]).arg(dir).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The JSON a successful command printed.
pub fn json(out: Output) -> Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A prompt of about 100 tokens: more than three chunks of 32.
pub const PROMPT: &str = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops \
    to guide ships into harbour. The Pharos of Alexandria, built in the third century BC, stood over a \
    hundred metres tall and was counted among the wonders of the ancient world. Later, Roman engineers \
    raised towers along the coasts of their empire, from Dover to the Black Sea.";

/// Whether network namespaces can be made here (root, iproute2); says why not, so a
/// namespace test that returns early is seen to skip.
pub fn namespaces_available() -> bool {
    match shoal_testnet::Net::new("probe", 1) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED: network namespaces unavailable here (needs root and iproute2): {e}");
            false
        }
    }
}

/// A UDP port `p` on 127.0.0.1 with `p + 1` free too (for two stages of a written
/// placement).
pub fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::UdpSocket::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two adjacent free UDP ports on 127.0.0.1")
}

/// Poll `f` every 300 ms until it gives a value; fail saying `what` after `secs`.
pub fn wait_for<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `shoal run` of `model` unsplit on this machine (chunk 128, context 512, as the
/// node tests load it), as JSON.
pub fn unsplit(model: &Path, args: &[&str]) -> Value {
    json(
        shoal()
            .args(["run", "--model"])
            .arg(model)
            .args(["--chunk", "128", "--ctx", "512"])
            .args(args)
            .output()
            .unwrap(),
    )
}

/// The lines a `shoal generate --progress` writes to stderr (`token …` per token).
pub type ProgressLines = std::io::Lines<std::io::BufReader<std::process::ChildStderr>>;

/// Start `cmd` (a `shoal`, maybe inside a namespace) as `generate --model MODEL
/// --progress ARGS --data-dir DIR` with its output piped: the child, its stderr lines.
pub fn spawn_generation(
    mut cmd: Command,
    model: &str,
    args: &[&str],
    dir: &Path,
) -> (std::process::Child, ProgressLines) {
    let mut child = cmd
        .args(["generate", "--model", model, "--progress"])
        .args(args)
        .arg("--data-dir")
        .arg(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    (child, std::io::BufRead::lines(std::io::BufReader::new(stderr)))
}
