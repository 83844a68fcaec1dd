//! Helpers shared by the binary's integration tests.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
