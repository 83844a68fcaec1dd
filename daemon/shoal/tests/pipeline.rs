//! Stages in separate processes over real QUIC on loopback: `shoal serve` ×3 and
//! `shoal generate` give the same tokens and logits digest as `shoal run` unsplit;
//! a restarted stage or coordinator is served again at once.

mod common;
use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Kills the stage processes when the test ends, passed or failed.
struct Stages(Vec<Child>);

impl Drop for Stages {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn serve_cmd(dir: &Path, placement: &Path, i: usize) -> Command {
    let mut c = shoal();
    let impair = std::fs::read_to_string(dir.join("impair")).unwrap_or_default();
    c.args(["serve", "--impair", &impair, "--threads", "1", "--placement"])
        .arg(placement)
        .arg("--data-dir")
        .arg(dir.join(format!("node{i}")))
        .arg("--cache")
        .arg(dir.join("shards"))
        .stderr(Stdio::piped());
    // Every stage gets the same command line; only stage 0 drafts.
    if let Ok(draft) = std::fs::read_to_string(dir.join("draft_model")) {
        c.args(["--draft-model", &draft]);
    }
    c
}

/// Wait until a `shoal serve` child says it is serving, then keep draining its log.
/// Returns what it printed before. A stage silent for 120 s fails the test (the log is
/// read on a thread of its own, so a stage that hangs without a word is caught too).
fn wait_serving(c: &mut Child) -> Vec<String> {
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut before = Vec::new();
        for line in lines.by_ref().map_while(Result::ok) {
            if line.contains("[shoal] serving") {
                let _ = tx.send(Ok(before));
                lines.for_each(drop);
                return;
            }
            before.push(line);
        }
        let _ = tx.send(Err(before));
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(Ok(before)) => before,
        Ok(Err(before)) => panic!("stage exited before serving: {before:?}"),
        Err(_) => panic!("stage did not start within 120 s"),
    }
}

/// Start one `shoal serve` per split range and wait until each says it is serving.
/// `stages.0[k]` runs stage `n − 1 − k` (they start tail first).
fn start(dir: &Path, model: &Path, splits: &[[u32; 2]], chunk: u32) -> (PathBuf, Stages) {
    start_sessions(dir, model, splits, chunk, 2)
}

/// [`start`] with `sessions` session slots per stage.
fn start_sessions(dir: &Path, model: &Path, splits: &[[u32; 2]], chunk: u32, sessions: u32) -> (PathBuf, Stages) {
    let client = key(&dir.join("client"));
    let mut toml = format!(
        "model = {:?}\nchunk = {chunk}\ncontext = 1024\nsessions = {sessions}\nclients = [\"{client}\"]\n",
        model
    );
    for (i, r) in splits.iter().enumerate() {
        let node = key(&dir.join(format!("node{i}")));
        toml += &format!(
            "[[stage]]\nnode = \"{node}\"\naddr = \"127.0.0.1:{}\"\nlayers = [{}, {}]\n",
            free_port(),
            r[0],
            r[1]
        );
    }
    let placement = dir.join("placement.toml");
    std::fs::write(&placement, toml).unwrap();
    let mut stages = Stages(Vec::new());
    for i in (0..splits.len()).rev() {
        stages.0.push(serve_cmd(dir, &placement, i).spawn().unwrap());
    }
    let impair = std::fs::read_to_string(dir.join("impair")).unwrap_or_default();
    for c in &mut stages.0 {
        let log = wait_serving(c);
        if !impair.is_empty() {
            assert!(log.iter().any(|l| l.contains("impairing outgoing packets")), "impairment not applied: {log:?}");
        }
    }
    (placement, stages)
}

fn check(file: &str, splits: &[[u32; 2]]) {
    check_impaired(file, splits, "", PROMPT, &[]);
}

/// A prompt that asks for a copy: speculation's drafts (prompt lookup) are often right.
fn rewrite_prompt() -> String {
    format!("Copy this paragraph, word for word.\n\n{PROMPT}\n\nCopy:\n\n{}", &PROMPT[..40])
}

/// Speculation on (`--draft 6`): the split run verifies the same drafts in the same
/// batches as the unsplit one, so tokens and logits digest are equal; drafts were
/// accepted, so it took fewer steps than tokens.
fn check_speculative(file: &str, splits: &[[u32; 2]]) {
    let (g, r) = check_impaired(file, splits, "", &rewrite_prompt(), &["--draft", "6"]);
    for k in ["decode_steps", "drafted", "accepted"] {
        assert_eq!(g[k], r[k], "{file}: {k} differs between the pipeline and the unsplit run");
    }
    assert!(g["accepted"].as_u64().unwrap() > 0, "{file}: no draft accepted: {g}");
    assert!(g["decode_steps"].as_u64().unwrap() < 63, "{file}: {g}");
    eprintln!(
        "{file}: {} decode steps for 64 tokens, {} of {} drafts accepted",
        g["decode_steps"], g["accepted"], g["drafted"]
    );
}

/// `impair` applies to every stage's outgoing packets (so once per hop). Returns the
/// pipeline's and the unsplit run's JSON reports.
fn check_impaired(file: &str, splits: &[[u32; 2]], impair: &str, prompt: &str, extra: &[&str]) -> (Value, Value) {
    let m = model(file);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("impair"), impair).unwrap();
    let chunk = 32;
    let (placement, _stages) = start(dir.path(), &m, splits, chunk);
    let mut args = vec!["--prompt", prompt, "--raw", "-n", "64", "--ignore-eos", "--json"];
    args.extend(extra);
    let g = json(
        shoal()
            .args(["generate", "--placement"])
            .arg(&placement)
            .arg("--data-dir")
            .arg(dir.path().join("client"))
            .args(&args)
            .output()
            .unwrap(),
    );
    let r = json(
        shoal().args(["run", "--model"]).arg(&m).args(["--chunk", "32", "--ctx", "1024"]).args(&args).output().unwrap(),
    );
    assert!(g["prompt_tokens"].as_u64().unwrap() > 2 * chunk as u64, "prompt should span at least 3 chunks");
    assert_eq!(g["tokens"].as_array().unwrap().len(), 64);
    assert_eq!(g["tokens"], r["tokens"], "{file}: pipeline tokens differ from the unsplit run");
    assert_eq!(g["logits_digest"], r["logits_digest"], "{file}: pipeline logits differ from the unsplit run");
    assert_eq!(g["text"], r["text"]);
    (g, r)
}

#[test]
fn smollm2_in_three_processes_matches_unsplit() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf", &[[0, 10], [10, 20], [20, 30]]);
}

#[test]
fn gemma3_in_three_processes_matches_unsplit() {
    check("gemma-3-270m-q4_k_m.gguf", &[[0, 6], [6, 12], [12, 18]]);
}

#[test]
fn wifi_like_impairment_changes_nothing() {
    let splits = &[[0, 10], [10, 20], [20, 30]];
    check_impaired("SmolLM2-135M-Instruct.Q4_1.gguf", splits, "delay=3ms,jitter=2ms,loss=1%", PROMPT, &[]);
}

#[test]
fn smollm2_speculative_in_two_and_three_processes_matches_unsplit() {
    check_speculative("SmolLM2-135M-Instruct.Q4_1.gguf", &[[0, 15], [15, 30]]);
    check_speculative("SmolLM2-135M-Instruct.Q4_1.gguf", &[[0, 10], [10, 20], [20, 30]]);
}

#[test]
fn gemma3_speculative_in_three_processes_matches_unsplit() {
    check_speculative("gemma-3-270m-q4_k_m.gguf", &[[0, 6], [6, 12], [12, 18]]);
}

#[test]
fn a_client_outside_the_placement_is_refused() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let dir = tempfile::tempdir().unwrap();
    let (placement, _stages) = start(dir.path(), &m, &[[0, 15], [15, 30]], 32);
    let out = shoal()
        .args(["generate", "--placement"])
        .arg(&placement)
        .arg("--data-dir")
        .arg(dir.path().join("stranger"))
        .args(["--prompt", "hi", "-n", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("neither a stage node nor listed under `clients`"), "{err}");
}

/// SIGKILL the middle stage after 100 generated tokens and start it again: the
/// coordinator replays the session in its original shapes (with `extra` = `--draft K`,
/// its verify batches too) and the output is unchanged.
fn restart_middle(file: &str, splits: &[[u32; 2]], prompt: &str, extra: &[&str]) {
    restart_middle_drafting(file, splits, prompt, extra, None)
}

/// [`restart_middle`] with stage 0 (and the unsplit reference) drafting with
/// `draft_model`.
fn restart_middle_drafting(file: &str, splits: &[[u32; 2]], prompt: &str, extra: &[&str], draft_model: Option<&Path>) {
    let m = model(file);
    let dir = tempfile::tempdir().unwrap();
    if let Some(d) = draft_model {
        std::fs::write(dir.path().join("draft_model"), d.to_str().unwrap()).unwrap();
    }
    let (placement, mut stages) = start(dir.path(), &m, splits, 32);
    let mut args = vec!["--prompt", prompt, "--raw", "-n", "160", "--ignore-eos", "--json"];
    args.extend(extra);
    let mut gen = shoal()
        .args(["generate", "--progress", "--placement"])
        .arg(&placement)
        .arg("--data-dir")
        .arg(dir.path().join("client"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut progress = BufReader::new(gen.stderr.take().unwrap()).lines();
    let t0 = Instant::now();
    loop {
        let line = progress.next().expect("generate ended before 100 tokens").unwrap();
        if line == "token 100" {
            break;
        }
    }
    // stages.0 = [tail, middle, head]
    let middle = &mut stages.0[1];
    middle.kill().unwrap();
    middle.wait().unwrap();
    let mut again = serve_cmd(dir.path(), &placement, 1).spawn().unwrap();
    wait_serving(&mut again);
    let up = Instant::now();
    stages.0[1] = again;
    // The restarted stage is up: the next token follows within seconds (the product's
    // figure: its previous run's connections are reset at once, and the coordinator's
    // re-drives are at most 2 s apart). A minute would be the no-progress bound.
    let mut rest: Vec<String> = Vec::new();
    let mut next_token = None;
    for line in progress.map_while(Result::ok) {
        if next_token.is_none() && line.starts_with("token ") {
            next_token = Some(up.elapsed());
        }
        rest.push(line);
    }
    if let Some(t) = next_token {
        eprintln!("{file}: restarted stage up -> next token: {:.2} s", t.as_secs_f64());
        assert!(t < Duration::from_secs(30), "the next token came {:.1} s after the restart", t.as_secs_f64());
    }
    let out = gen.wait_with_output().unwrap();
    assert!(out.status.success(), "generate failed after the restart: {rest:?}");
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("{file}: generation with a middle-stage restart took {:.1} s", t0.elapsed().as_secs_f64());
    let mut run = shoal();
    run.args(["run", "--model"]).arg(&m).args(["--chunk", "32", "--ctx", "1024"]).args(&args);
    if let Some(d) = draft_model {
        run.arg("--draft-model").arg(d);
    }
    let r = json(run.output().unwrap());
    assert_eq!(g["tokens"].as_array().unwrap().len(), 160);
    assert_eq!(g["tokens"], r["tokens"], "{file}: tokens changed across the restart");
    assert_eq!(g["logits_digest"], r["logits_digest"], "{file}: logits changed across the restart");
    assert_eq!((&g["decode_steps"], &g["accepted"]), (&r["decode_steps"], &r["accepted"]), "{file}");
    assert_eq!(rest.iter().filter(|l| l.starts_with("token ")).count(), 60, "tokens missing or duplicated: {rest:?}");
    // The coordinator counted the recovery; every node answers status.
    let st = placement_status(&placement, &dir.path().join("client"));
    let nodes = st.as_array().unwrap();
    assert_eq!(nodes.len(), splits.len());
    assert!(nodes.iter().all(|n| n.get("error").is_none()), "{st}");
    let c = &nodes[0]["counters"];
    assert!(c["replays"].as_u64().unwrap() + c["redrives"].as_u64().unwrap() >= 1, "{st}");
    eprintln!("{file}: coordinator counters after the restart: {c}");
}

#[test]
fn smollm2_survives_a_middle_stage_restart() {
    restart_middle("SmolLM2-135M-Instruct.Q4_1.gguf", &[[0, 10], [10, 20], [20, 30]], PROMPT, &[]);
}

#[test]
fn gemma3_survives_a_middle_stage_restart() {
    restart_middle("gemma-3-270m-q4_k_m.gguf", &[[0, 6], [6, 12], [12, 18]], PROMPT, &[]);
}

#[test]
fn smollm2_speculative_survives_a_middle_stage_restart() {
    let splits = &[[0, 10], [10, 20], [20, 30]];
    restart_middle("SmolLM2-135M-Instruct.Q4_1.gguf", splits, &rewrite_prompt(), &["--draft", "6"]);
}

/// Stage 0 drafts with a draft model (SmolLM2 requantized to Q4_0) on free-form text:
/// the pipeline's answer, drafts and steps equal `shoal run --draft-model`'s, across a
/// middle stage's restart (the coordinator replays its verify batches; its draft
/// model's sessions are untouched).
#[test]
fn smollm2_draft_model_survives_a_middle_stage_restart() {
    let file = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let dir = tempfile::tempdir().unwrap();
    let draft = dir.path().join("draft-q4_0.gguf");
    shoal_engine::requantize(&model(file), &draft, shoal_engine::Quant::Q4_0).unwrap();
    let splits = &[[0, 10], [10, 20], [20, 30]];
    restart_middle_drafting(file, splits, PROMPT, &["--draft", "4", "--draft-cost", "0,0"], Some(&draft));
}

/// `shoal generate --progress` for `n` tokens, its progress lines readable.
fn spawn_generate(
    dir: &Path,
    placement: &Path,
    n: u32,
) -> (Child, std::io::Lines<BufReader<std::process::ChildStderr>>) {
    let mut gen = shoal()
        .args(["generate", "--progress", "--placement"])
        .arg(placement)
        .arg("--data-dir")
        .arg(dir.join("client"))
        .args(["--prompt", PROMPT, "--raw", "-n", &n.to_string(), "--ignore-eos", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let progress = BufReader::new(gen.stderr.take().unwrap()).lines();
    (gen, progress)
}

/// SIGKILL the coordinator while 4 generations fill every stage's 4 session slots, and
/// start it again: the other stages free the dead coordinator's sessions when its new
/// incarnation's first Open reaches them, so a new generation starts at once (the
/// issue's bound: within 30 s of the restart) instead of being refused for want of a
/// slot until the old sessions expire.
#[test]
fn a_restarted_coordinator_serves_again_at_once() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let dir = tempfile::tempdir().unwrap();
    let (placement, mut stages) = start_sessions(dir.path(), &m, &[[0, 10], [10, 20], [20, 30]], 32, 4);
    let mut gens: Vec<_> = (0..4).map(|_| spawn_generate(dir.path(), &placement, 600)).collect();
    for (gen, progress) in &mut gens {
        let started = progress.by_ref().map(|l| l.unwrap()).any(|l| l == "token 5");
        assert!(started, "a generation ended before its 5th token: {:?}", gen.try_wait());
    }
    // stages.0 = [tail, middle, head]: the head is the coordinator.
    let head = &mut stages.0[2];
    head.kill().unwrap();
    head.wait().unwrap();
    for (mut gen, _) in gens {
        let _ = gen.kill();
        let _ = gen.wait();
    }
    let restarted = Instant::now();
    let mut again = serve_cmd(dir.path(), &placement, 0).spawn().unwrap();
    wait_serving(&mut again);
    stages.0[2] = again;
    let serving = restarted.elapsed();
    let (gen, mut progress) = spawn_generate(dir.path(), &placement, 8);
    let mut log = Vec::new();
    let first = progress.by_ref().map(|l| l.unwrap()).find(|l| {
        log.push(l.clone());
        l == "token 1"
    });
    let started = restarted.elapsed();
    log.extend(progress.map(|l| l.unwrap()));
    let out = gen.wait_with_output().unwrap();
    assert!(first.is_some() && out.status.success(), "the restarted coordinator could not serve: {log:?}");
    eprintln!(
        "restarted coordinator: serving after {:.1} s, first token after {:.1} s",
        serving.as_secs_f64(),
        started.as_secs_f64()
    );
    assert!(started < Duration::from_secs(30), "a new generation started only after {started:?}");
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(g["tokens"].as_array().unwrap().len(), 8);
    // Both other stages freed the 4 sessions of the dead incarnation, and hold none now.
    let st = placement_status(&placement, &dir.path().join("client"));
    let nodes = st.as_array().unwrap();
    for k in [1, 2] {
        assert_eq!(nodes[k]["counters"]["orphans_freed"], 4, "stage {k}: {st}");
        assert_eq!(nodes[k]["sessions"], 0, "stage {k}: {st}");
    }
}

/// `shoal status --json` of every node of `placement`, asked with the key in `client`.
fn placement_status(placement: &std::path::Path, client: &std::path::Path) -> Value {
    json(
        shoal()
            .args(["status", "--json", "--placement"])
            .arg(placement)
            .arg("--data-dir")
            .arg(client)
            .output()
            .unwrap(),
    )
}
