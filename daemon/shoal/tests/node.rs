//! The one-daemon flow with real processes on loopback (real QUIC, real mDNS on `lo`,
//! llama.cpp): three plain `shoal serve` nodes, each offering little memory; the model
//! is added on the first only and loaded from the third; the leader splits it over all
//! three, the other two receive only their shards, and `shoal generate --model` through
//! two different nodes gives the tokens and logits digest of `shoal run` unsplit.

mod common;
use common::*;
use serde_json::Value;
use shoal_node::api::{NodeRequest, NodeResponse, StageStatus};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Kills the node processes when the test ends, passed or failed.
struct Nodes(Vec<Child>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn serve(dir: &Path, name: &str, create: bool) -> Child {
    let mut c = shoal();
    c.args(["serve", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0", "--mdns-allow", "lo"])
        .args(["--name", name, "--max-memory", "90M"])
        .arg(if create { "--create-cluster" } else { "--no-create" })
        .arg("--data-dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c.spawn().unwrap()
}

fn status(dir: &Path) -> Option<Value> {
    let out = shoal().args(["status", "--json", "--data-dir"]).arg(dir).output().ok()?;
    out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
}

fn wait_for<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn run_ok(args: &[&str], dir: &Path) -> String {
    let out = shoal().args(args).arg("--data-dir").arg(dir).output().unwrap();
    assert!(out.status.success(), "shoal {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The stages a node runs, asked over the node protocol with its own key.
fn stages(dir: &Path) -> Vec<StageStatus> {
    let identity = Arc::new(shoal_net::Identity::load_or_create(dir).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    match rt.block_on(shoal_node::api::request(dir, identity, &NodeRequest::Stages)) {
        Ok(NodeResponse::Stages(s)) => s,
        other => panic!("stages: {other:?}"),
    }
}

#[test]
fn three_plain_nodes_split_a_model_added_on_one_and_answer_like_the_unsplit_run() {
    let model = model(SMOL);
    let model_bytes = std::fs::metadata(&model).unwrap().len();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    let mut nodes = Nodes(vec![serve(&dir("a"), "a", true)]);
    wait_for("A's cluster", 30, || status(&dir("a")).filter(|s| !s["cluster"].is_null()));
    for n in ["b", "c"] {
        nodes.0.push(serve(&dir(n), n, false));
        wait_for("the node up", 30, || status(&dir(n)));
        wait_for(&format!("{n} joined"), 60, || {
            let code = run_ok(&["nodes", "pair"], &dir("a"));
            let out = shoal().args(["join", code.trim(), "--data-dir"]).arg(dir(n)).output().unwrap();
            out.status.success().then_some(())
        });
    }
    wait_for("three members", 30, || {
        status(&dir("a")).filter(|s| s["members"].as_array().is_some_and(|m| m.len() == 3))
    });

    // Added on A only; loaded from C (which holds no copy).
    let added = run_ok(&["models", "add", model.to_str().unwrap()], &dir("a"));
    assert!(added.contains("llama 30 layers"), "{added}");
    let loaded = run_ok(&["models", "load", SMOL, "--context", "512", "--wait"], &dir("c"));
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");

    // B and C received their shards: far less than the model; A cut its own.
    for n in ["a", "b", "c"] {
        let s = stages(&dir(n));
        assert_eq!(s.len(), 1, "{n}: {s:?}");
        if n == "a" {
            assert_eq!(s[0].shard_bytes_received, 0, "{s:?}");
        } else {
            let got = s[0].shard_bytes_received;
            assert!(got > 0 && got < model_bytes * 2 / 3, "{n} received {got} of a {model_bytes}-byte model: {s:?}");
        }
    }

    // Through A (which holds the model) and B (which holds only its shard): the same
    // tokens and logits as the unsplit run.
    let args = ["--prompt", PROMPT, "-n", "24", "--json"];
    let r = json(
        shoal().args(["run", "--model"]).arg(&model).args(["--chunk", "128", "--ctx", "512"]).args(args).output().unwrap(),
    );
    for n in ["a", "b"] {
        let g = json(shoal().args(["generate", "--model", SMOL]).args(args).arg("--data-dir").arg(dir(n)).output().unwrap());
        assert_eq!(g["tokens"].as_array().unwrap().len(), 24);
        assert_eq!(g["tokens"], r["tokens"], "through {n}: tokens differ from the unsplit run");
        assert_eq!(g["logits_digest"], r["logits_digest"], "through {n}: logits differ from the unsplit run");
    }

    // Unloaded: every stage stops.
    run_ok(&["models", "unload", SMOL], &dir("b"));
    for n in ["a", "b", "c"] {
        wait_for("stage stopped", 30, || stages(&dir(n)).is_empty().then_some(()));
    }
}
