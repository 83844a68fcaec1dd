//! The one-daemon flow across real network stacks: each node in its own network
//! namespace (its own addresses, a bridge between them, mDNS over it), each started
//! as a user would, `shoal serve` with only a data dir and `--max-memory` (the memory
//! it offers, set so the small model must split in three). The model is added on the
//! first node only and loaded from the third; the other two receive only their shards
//! (the bytes that travelled equal what their shard files hold); a generation through
//! a node holding only its shard equals `shoal run` unsplit; then three spares join (the
//! last adds the model too: a second copy), and the middle stage's node, then another
//! stage's (the coordinator's unless a model holder runs it), then the leader's (here
//! also a stage's), is SIGKILLed during a 300-token generation: the
//! leader (a new one in the last round) re-places the lost stage and each generation
//! ends with the unsplit run's tokens and logits. Each dead member is removed, as an
//! owner would, so that the living keep a majority. A second test cuts a shard
//! transfer with a link down. Needs root (`ip netns`); without it the test says it
//! skipped.

mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The hosts and their nodes' data dirs.
struct Hosts {
    net: shoal_testnet::Net,
    dirs: Vec<PathBuf>,
    /// Which host each adopted child (in `net`) runs on.
    children: Vec<usize>,
}

impl Hosts {
    /// `shoal ARGS --data-dir DIR` on host `k`; its output.
    fn shoal(&self, k: usize, args: &[&str]) -> std::process::Output {
        self.net
            .command(k, env!("CARGO_BIN_EXE_shoal"))
            .args(args)
            .arg("--data-dir")
            .arg(&self.dirs[k])
            .output()
            .unwrap()
    }

    /// [`Hosts::shoal`] that must succeed; its stdout.
    fn ok(&self, k: usize, args: &[&str]) -> String {
        let out = self.shoal(k, args);
        assert!(out.status.success(), "host {k}: shoal {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// `shoal status --json` on host `k`, once the node answers.
    fn status(&self, k: usize) -> Option<Value> {
        let out = self.shoal(k, &["status", "--json"]);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    /// Start a plain `shoal serve` on host `k`.
    fn serve(&mut self, k: usize) {
        self.serve_with(k, &[]);
    }

    /// [`Hosts::serve`] with `extra` arguments.
    fn serve_with(&mut self, k: usize, extra: &[&str]) {
        let child = self
            .net
            .command(k, env!("CARGO_BIN_EXE_shoal"))
            .args(["serve", "--max-memory", "90M"])
            .args(extra)
            .arg("--data-dir")
            .arg(&self.dirs[k])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.net.adopt(child);
        self.children.push(k);
        wait_for(&format!("host {k}'s node up"), 60, || self.status(k));
    }

    /// Start host `k`'s node and pair it into host 0's cluster as a user would: a code
    /// made on a member, typed on the new machine.
    fn join(&mut self, k: usize) {
        let before = self.members(0);
        self.serve(k);
        // 120 s: on a loaded 2-core CI machine a sixth host's join once took over 60 s
        // (not traced: CI keeps no node logs; the leader times and probes members that
        // just joined, one at a time, which loads the machine); a hang still fails.
        wait_for(&format!("host {k} joined"), 120, || {
            let code = self.ok(0, &["nodes", "pair"]);
            self.shoal(k, &["join", code.trim()]).status.success().then_some(())
        });
        wait_for("the new member listed", 30, || (self.members(0) == before + 1).then_some(()));
    }

    fn members(&self, k: usize) -> usize {
        self.status(k).and_then(|s| s["members"].as_array().map(|m| m.len())).unwrap_or(0)
    }

    /// SIGKILL host `k`'s node.
    fn kill(&mut self, k: usize) {
        let i = self.children.iter().position(|&h| h == k).unwrap();
        let c = &mut self.net.children()[i];
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// The hosts of the test model's stages, in order, as host `k` sees the placement.
    fn placed(&self, k: usize) -> Vec<usize> {
        let plan: Value = serde_json::from_str(&self.ok(k, &["models", "plan", SMOL, "--json"])).unwrap();
        plan["placement"]["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| self.host_of(s["node"].as_str().unwrap()))
            .collect()
    }

    /// The host whose node has id `node`.
    fn host_of(&self, node: &str) -> usize {
        (0..self.dirs.len()).find(|&k| key(&self.dirs[k]) == node).unwrap()
    }
}

/// Bytes the shard files under `dir` hold on disk (allocated blocks: a shard keeps
/// the model's offsets, with holes where other stages' tensors are).
fn shard_bytes_on_disk(dir: &Path) -> u64 {
    let mut total = 0;
    for model in std::fs::read_dir(dir.join("shards")).unwrap() {
        for f in std::fs::read_dir(model.unwrap().path()).unwrap() {
            let f = f.unwrap();
            let name = f.file_name().to_string_lossy().to_string();
            if name.starts_with("layers-") && name.ends_with(".gguf") {
                total += std::os::unix::fs::MetadataExt::blocks(&f.metadata().unwrap()) * 512;
            }
        }
    }
    total
}

#[test]
fn plain_nodes_on_their_own_hosts_split_a_model_move_only_shards_and_survive_a_killed_stage() {
    if !namespaces_available() {
        return;
    }
    let model = model(SMOL);
    let model_bytes = std::fs::metadata(&model).unwrap().len();
    let tmp = tempfile::tempdir().unwrap();
    let net = shoal_testnet::Net::new("one", 6).unwrap();
    let dirs = (0..6).map(|k| tmp.path().join(format!("h{k}"))).collect();
    let mut h = Hosts { net, dirs, children: Vec::new() };

    // The first node, finding no cluster on the LAN, creates one; two more join it.
    h.serve(0);
    wait_for("host 0's cluster", 60, || h.status(0).filter(|s| !s["cluster"].is_null()));
    h.join(1);
    h.join(2);

    // Added on host 0 only; loaded from host 2 (which holds no copy).
    let added = h.ok(0, &["models", "add", model.to_str().unwrap()]);
    assert!(added.contains("llama 30 layers"), "{added}");
    let loaded = h.ok(2, &["models", "load", SMOL, "--context", "512", "--wait"]);
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    let plan: Value = serde_json::from_str(&h.ok(1, &["models", "plan", SMOL, "--json"])).unwrap();
    let placed: Vec<usize> = plan["placement"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| h.host_of(s["node"].as_str().unwrap()))
        .collect();
    let mut hosts = placed.clone();
    hosts.sort();
    assert_eq!(hosts, [0, 1, 2], "one stage on each host: {plan}");

    // Hosts 1 and 2 received their shards and nothing more: the bytes that came over
    // the network are what their shard files hold (within a 4 KiB block per chunk
    // edge, and the header), a fraction of the model; host 0 cut its own.
    for (i, &k) in placed.iter().enumerate() {
        let st = &plan["stages"][i];
        let received = st["shard_bytes_received"].as_u64().unwrap();
        if k == 0 {
            assert_eq!(received, 0, "host 0 holds the model: {st}");
            continue;
        }
        let on_disk = shard_bytes_on_disk(&h.dirs[k]);
        eprintln!(
            "host {k}: stage {i} received {received} bytes; its shard holds {on_disk} on disk; model {model_bytes}"
        );
        assert!(received < model_bytes * 2 / 3, "host {k} received {received} of a {model_bytes}-byte model");
        let (lo, hi) = (on_disk.min(received) as f64, on_disk.max(received) as f64);
        assert!(hi - lo <= 0.05 * hi + (1 << 20) as f64, "host {k}: received {received} vs shard {on_disk}");
    }

    // Through host 1 (which holds only its shard): the unsplit run's tokens and logits.
    let args = ["--prompt", PROMPT, "-n", "24", "--json"];
    let r = unsplit(&model, &args);
    let g: Value = serde_json::from_str(&h.ok(1, &[&["generate", "--model", SMOL][..], &args].concat())).unwrap();
    assert_eq!(g["tokens"], r["tokens"], "through host 1: tokens differ from the unsplit run");
    assert_eq!(g["logits_digest"], r["logits_digest"], "through host 1: logits differ from the unsplit run");

    // Three spares join, the last with a copy of the model (the same file: the hosts
    // share a disk); the middle stage's node, then the coordinator's (the first
    // stage's), then the leader's, die each during a 300-token generation. Hosts 0 and
    // 5 hold the model, so they are not among the first two victims; the generation is
    // asked on host 0, and on host 5 when host 0 is the victim.
    h.join(3);
    h.join(4);
    h.join(5);
    let added = h.ok(5, &["models", "add", model.to_str().unwrap()]);
    assert!(added.contains("llama 30 layers"), "{added}");
    let args = ["--prompt", PROMPT, "-n", "300", "--ignore-eos", "--json"];
    let r = unsplit(&model, &args);
    let mut dead = Vec::new();
    for round in 0..3 {
        let placed = h.placed(5);
        let (victim, ask) = if round < 2 {
            let order = if round == 0 { [1, 0, 2] } else { [0, 1, 2] };
            (order.iter().map(|&i| placed[i]).find(|&k| k != 0 && k != 5).unwrap(), 0)
        } else {
            let leader = h.host_of(h.status(5).unwrap()["leader"].as_str().unwrap());
            assert_ne!(leader, 5, "the leader is the node the last generation is asked on");
            (leader, 5)
        };
        let (gen, mut lines) =
            spawn_generation(h.net.command(ask, env!("CARGO_BIN_EXE_shoal")), SMOL, &args, &h.dirs[ask]);
        let seen = lines.by_ref().map_while(Result::ok).filter(|l| l.starts_with("token ")).take(40).count();
        assert_eq!(seen, 40, "round {round}: the generation did not get under way");
        let killed_at = Instant::now();
        h.kill(victim);
        dead.push(victim);
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let out = gen.wait_with_output().unwrap();
        assert!(out.status.success(), "round {round}: the generation failed: {rest:?}");
        eprintln!(
            "round {round}: host {victim} (of stages on {placed:?}{}) killed; the generation ended {:.1} s later",
            if round == 2 { ", the leader" } else { "" },
            killed_at.elapsed().as_secs_f64()
        );
        let g: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(g["tokens"], r["tokens"], "round {round}: tokens differ from the unsplit run");
        assert_eq!(g["logits_digest"], r["logits_digest"], "round {round}: logits differ from the unsplit run");
        assert_eq!(rest.iter().filter(|l| l.starts_with("token ")).count(), 260, "tokens missing or repeated");
        let now = h.placed(5);
        assert!(now.iter().all(|k| !dead.contains(k)) && now.len() == 3, "re-placed on the living: {now:?}");
        if round == 2 {
            let leader = h.status(5).unwrap()["leader"].as_str().map(|l| h.host_of(l));
            assert!(leader.is_some_and(|l| !dead.contains(&l)), "a new leader among the living: {leader:?}");
        } else {
            // The owner removes the dead member: the living stay a majority of the rest.
            h.ok(ask, &["nodes", "remove", &key(&h.dirs[victim])]);
        }
    }
}

/// A shard transfer survives its receiver's link going down mid-way: host 0 (the only
/// holder) sends at 40 Mbit/s (the impairment layer; loopback-fast veths would finish
/// before the cut), and when a receiver holds a quarter of its shard its link goes
/// down for 1 s (3 s of silence would mark it down, and the leader would move its
/// stage). The transfer goes on where it stopped: the bytes received stay those of
/// the shard (nothing fetched twice), and the model answers as unsplit.
#[test]
fn a_shard_transfer_cut_by_a_link_down_goes_on_where_it_stopped() {
    if !namespaces_available() {
        return;
    }
    let model = model(SMOL);
    let tmp = tempfile::tempdir().unwrap();
    let net = shoal_testnet::Net::new("cut", 3).unwrap();
    let dirs = (0..3).map(|k| tmp.path().join(format!("h{k}"))).collect();
    let mut h = Hosts { net, dirs, children: Vec::new() };
    h.serve_with(0, &["--impair", "rate=40mbit"]);
    wait_for("host 0's cluster", 60, || h.status(0).filter(|s| !s["cluster"].is_null()));
    h.join(1);
    h.join(2);
    h.ok(0, &["models", "add", model.to_str().unwrap()]);
    h.ok(0, &["models", "load", SMOL, "--context", "512"]);

    // A receiver a quarter through its shard.
    let (victim, of) = wait_for("a transfer under way", 120, || {
        let plan: Value = serde_json::from_str(&h.ok(0, &["models", "plan", SMOL, "--json"])).ok()?;
        let stages = plan["placement"]["stages"].as_array()?;
        stages.iter().zip(plan["stages"].as_array()?).find_map(|(s, st)| {
            let k = h.host_of(s["node"].as_str()?);
            let (done, of) = (st["state"]["fetching"]["done"].as_u64()?, st["state"]["fetching"]["of"].as_u64()?);
            (k != 0 && done * 4 >= of && done * 2 < of).then_some((k, of))
        })
    });
    // Cut for 1 s: long enough that the transfer stalls and must go on where it stopped,
    // and far from the 3 s after which members suspect a silent node (2 s left too
    // little margin on two loaded cores: a late beat then cost the victim its stage).
    h.net.link(victim, false).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1000));
    h.net.link(victim, true).unwrap();
    // The members hear each other again before the load is waited on: on a loaded
    // machine the first beats after the cut can come late enough for a moment's
    // "suspected", and a load asked then is refused (2 devices do not hold the model).
    wait_for("every member alive after the cut", 30, || {
        let s = h.status(0)?;
        let members = s["members"].as_array()?;
        (members.len() == 3 && members.iter().all(|m| m["state"] == "alive")).then_some(())
    });
    let loaded = wait_for("the model loaded after the cut", 120, || {
        let out = h.shoal(0, &["models", "load", SMOL, "--context", "512", "--wait"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() || err.contains("cannot be placed"), "load --wait: {err}");
        out.status.success().then(|| String::from_utf8(out.stdout).unwrap())
    });
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    let plan: Value = serde_json::from_str(&h.ok(0, &["models", "plan", SMOL, "--json"])).unwrap();
    let stages = plan["placement"]["stages"].as_array().unwrap();
    let i = stages.iter().position(|s| h.host_of(s["node"].as_str().unwrap()) == victim);
    let i = i.unwrap_or_else(|| panic!("host {victim} lost its stage: {plan}"));
    let st = &plan["stages"][i];
    let received = st["shard_bytes_received"].as_u64().unwrap();
    let on_disk = shard_bytes_on_disk(&h.dirs[victim]);
    eprintln!("host {victim}: cut 1 s at a quarter of {of} chunks; received {received} bytes, shard {on_disk} on disk");
    assert!(st["shard_origin"].as_str().unwrap().starts_with("fetched from"), "{st}");
    // Nothing twice: at most the shard's bytes (a transfer resumed on a new connection
    // counts only what that one moved, so this is an upper bound).
    assert!(
        received as f64 <= 1.05 * on_disk as f64 + (1 << 20) as f64,
        "host {victim}: received {received} for a shard of {on_disk}"
    );

    let args = ["--prompt", PROMPT, "-n", "24", "--json"];
    let r = unsplit(&model, &args);
    let g: Value = serde_json::from_str(&h.ok(victim, &[&["generate", "--model", SMOL][..], &args].concat())).unwrap();
    assert_eq!(g["tokens"], r["tokens"], "through host {victim}: tokens differ from the unsplit run");
    assert_eq!(g["logits_digest"], r["logits_digest"], "through host {victim}: logits differ");
}

/// A stage's host gets a new address mid-generation, as DHCP renumbers a laptop that
/// wakes up (the old address gone at once): its links out move with it (QUIC follows
/// a peer that sends from a new address), the members find it again at the new one
/// (it proves its key there: an mDNS advert alone moves no member), the stage before
/// it reconnects there, and the 300-token generation ends with the unsplit run's
/// tokens and logits, its stages where they were.
#[test]
fn a_renumbered_member_is_found_again_and_the_answer_is_exact() {
    if !namespaces_available() {
        return;
    }
    let model = model(SMOL);
    let tmp = tempfile::tempdir().unwrap();
    let net = shoal_testnet::Net::new("ren", 3).unwrap();
    let dirs = (0..3).map(|k| tmp.path().join(format!("h{k}"))).collect();
    let mut h = Hosts { net, dirs, children: Vec::new() };
    h.serve(0);
    wait_for("host 0's cluster", 60, || h.status(0).filter(|s| !s["cluster"].is_null()));
    h.join(1);
    h.join(2);
    h.ok(0, &["models", "add", model.to_str().unwrap()]);
    let loaded = h.ok(0, &["models", "load", SMOL, "--context", "512", "--wait"]);
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    let placed = h.placed(0);
    // A stage after the first, on a host other than the one asked (whose client would
    // move with it): the link into it is the one that must find it again.
    let victim = placed.iter().skip(1).copied().find(|&k| k != 0).unwrap();
    let args = ["--prompt", PROMPT, "-n", "300", "--ignore-eos", "--json"];
    let r = unsplit(&model, &args);
    let (gen, mut lines) = spawn_generation(h.net.command(0, env!("CARGO_BIN_EXE_shoal")), SMOL, &args, &h.dirs[0]);
    let seen = lines.by_ref().map_while(Result::ok).filter(|l| l.starts_with("token ")).take(40).count();
    assert_eq!(seen, 40, "the generation did not get under way");
    let old = h.net.addr(victim);
    let new = h.net.renumber(victim).unwrap();
    let renumbered = Instant::now();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let out = gen.wait_with_output().unwrap();
    assert!(out.status.success(), "the generation failed: {rest:?}");
    eprintln!(
        "host {victim} (stages on {placed:?}) renumbered {old} -> {new}; the generation ended {:.1} s later",
        renumbered.elapsed().as_secs_f64()
    );
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(g["tokens"], r["tokens"], "tokens differ from the unsplit run");
    assert_eq!(g["logits_digest"], r["logits_digest"], "logits differ from the unsplit run");
    assert_eq!(rest.iter().filter(|l| l.starts_with("token ")).count(), 260, "tokens missing or repeated");
    assert_eq!(h.placed(0), placed, "the model was placed again instead of its member found");
    // Every member knows it at its new address.
    for k in (0..3).filter(|&k| k != victim) {
        let id = key(&h.dirs[victim]);
        wait_for(&format!("host {k} reaches host {victim} at {new}"), 60, || {
            let s = h.status(k)?;
            let m = s["members"].as_array()?.iter().find(|m| m["node"] == id.as_str())?.clone();
            (m["addr"].as_str()?.starts_with(&format!("{new}:")) && m["state"] == "alive").then_some(())
        });
    }
}
