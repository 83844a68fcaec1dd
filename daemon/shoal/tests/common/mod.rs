//! Helpers shared by the binary's integration tests.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
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

/// Run a command; its stdout, or a panic with everything it said.
pub fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
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

/// Whether network namespaces can be made here (root, iproute2); where not, the suite's
/// rule for a missing precondition ([`shoal_testnet::precondition::skip`]) decides: the
/// test fails (CI, a bare `cargo test`) or is skipped and listed by `scripts/test.sh`.
pub fn namespaces_available() -> bool {
    shoal_testnet::precondition::namespaces("probe", 1).is_some()
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
    unsplit_ctx(model, 512, args)
}

/// [`unsplit`] with a context of `ctx` positions (a long generation's).
pub fn unsplit_ctx(model: &Path, ctx: u32, args: &[&str]) -> Value {
    json(
        shoal()
            .args(["run", "--model"])
            .arg(model)
            .args(["--chunk", "128", "--ctx", &ctx.to_string()])
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

// --- clusters of `shoal serve` processes on loopback (real QUIC, mDNS on `lo`) ---

/// The node processes by name; killed when the test ends, passed or failed.
pub struct Nodes(pub Vec<(&'static str, Child)>);

impl Nodes {
    /// SIGKILL one node.
    pub fn kill(&mut self, name: &str) {
        if let Some(i) = self.0.iter().position(|(n, _)| *n == name) {
            let (_, mut c) = self.0.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The names of the nodes still running.
    pub fn alive(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.0.iter().map(|(n, _)| *n)
    }

    pub fn kill_all(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.0.clear();
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        self.kill_all();
    }
}

pub fn serve(dir: &Path, name: &str, create: bool) -> Child {
    serve_offering(dir, name, create, "90M", "1")
}

/// [`serve`] offering `memory` to models, its stages running `threads` threads.
pub fn serve_offering(dir: &Path, name: &str, create: bool, memory: &str, threads: &str) -> Child {
    serve_with(dir, name, create, memory, threads, &[])
}

/// [`serve_offering`] with `extra` flags.
pub fn serve_with(dir: &Path, name: &str, create: bool, memory: &str, threads: &str, extra: &[&str]) -> Child {
    let mut c = shoal();
    c.args(["serve", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0", "--mdns-allow", "lo"])
        .args(["--http-listen", "127.0.0.1:0"])
        .args(["--name", name, "--max-memory", memory, "--threads", threads])
        .args(extra)
        .arg(if create { "--create-cluster" } else { "--no-create" })
        .arg("--data-dir")
        .arg(dir)
        .stdout(Stdio::null());
    // SHOAL_TEST_LOGS=1 keeps each node's log in its data dir (serve.log), to debug.
    if std::env::var_os("SHOAL_TEST_LOGS").is_some() {
        std::fs::create_dir_all(dir).unwrap();
        c.env("RUST_LOG", "info").stderr(std::fs::File::create(dir.join("serve.log")).unwrap());
    } else {
        c.stderr(Stdio::null());
    }
    c.spawn().unwrap()
}

pub fn status(dir: &Path) -> Option<Value> {
    let out = shoal().args(["status", "--json", "--data-dir"]).arg(dir).output().ok()?;
    out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
}

pub fn run_ok(args: &[&str], dir: &Path) -> String {
    let out = shoal().args(args).arg("--data-dir").arg(dir).output().unwrap();
    assert!(out.status.success(), "shoal {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Start `names[0]` creating a cluster and the others joining it with codes.
pub fn start_cluster(dir: &dyn Fn(&str) -> PathBuf, names: &[&'static str]) -> Nodes {
    let mut nodes = Nodes(Vec::new());
    nodes.0.push((names[0], serve(&dir(names[0]), names[0], true)));
    wait_for("the first node's cluster", 30, || status(&dir(names[0])).filter(|s| !s["cluster"].is_null()));
    for n in &names[1..] {
        add_node(&mut nodes, dir, names[0], n);
    }
    nodes
}

/// Start node `name` and pair it into the cluster of `member`.
pub fn add_node(nodes: &mut Nodes, dir: &dyn Fn(&str) -> PathBuf, member: &str, name: &'static str) {
    add_node_offering(nodes, dir, member, name, "90M", "1")
}

/// [`add_node`] offering `memory` to models.
pub fn add_node_offering(
    nodes: &mut Nodes,
    dir: &dyn Fn(&str) -> PathBuf,
    member: &str,
    name: &'static str,
    memory: &str,
    threads: &str,
) {
    add_node_with(nodes, dir, member, name, memory, threads, &[])
}

/// [`add_node_offering`] with `extra` arguments to its `shoal serve`.
pub fn add_node_with(
    nodes: &mut Nodes,
    dir: &dyn Fn(&str) -> PathBuf,
    member: &str,
    name: &'static str,
    memory: &str,
    threads: &str,
    extra: &[&str],
) {
    let before = members(&dir(member));
    nodes.0.push((name, serve_with(&dir(name), name, false, memory, threads, extra)));
    wait_for("the node up", 30, || status(&dir(name)));
    wait_for(&format!("{name} joined"), 60, || {
        let code = run_ok(&["nodes", "pair"], &dir(member));
        let out = shoal().args(["join", code.trim(), "--data-dir"]).arg(dir(name)).output().unwrap();
        out.status.success().then_some(())
    });
    wait_for("the new member listed", 30, || (members(&dir(member)) == before + 1).then_some(()));
}

/// How many members `dir`'s node lists.
pub fn members(dir: &Path) -> usize {
    status(dir).and_then(|s| s["members"].as_array().map(|m| m.len())).unwrap_or(0)
}
