//! The one-daemon flow with real processes on loopback (real QUIC, real mDNS on `lo`,
//! llama.cpp): three plain `shoal serve` nodes, each offering little memory; the model
//! is added on the first only and loaded from the third; the leader splits it over all
//! three, the other two receive only their shards, and `shoal generate --model` through
//! two different nodes gives the tokens and logits digest of `shoal run` unsplit, and
//! the HTTP API (OpenAI and Ollama routes) its text; a
//! stage's node SIGKILLed during a 300-token generation (a middle stage, then a
//! coordinator, and the leader's) is replaced by a spare and the answer does not change,
//! also for an HTTP stream running through the same stages when the middle one dies;
//! a node that holds nothing of the model still answers through its API.

mod common;
use common::*;
use serde_json::Value;
use shoal_node::api::{DraftState, NodeRequest, NodeResponse, StageStatus};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// The machine, shared by this file's tests (the harness runs them side by side, one
/// per core). A test whose promise rests on a measured speed runs alone ([`alone`]):
/// a node measured while three other clusters generate on the same cores times them,
/// not itself. Every other test shares ([`sharing`]).
static MACHINE: RwLock<()> = RwLock::new(());

/// Run beside the other tests of this file that share.
fn sharing() -> RwLockReadGuard<'static, ()> {
    // A test that panicked while holding it poisons nothing the others rely on.
    MACHINE.read().unwrap_or_else(PoisonError::into_inner)
}

/// Run with no other test of this file beside.
fn alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(PoisonError::into_inner)
}

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

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
    let _machine = sharing();
    let model = model(SMOL);
    let model_bytes = std::fs::metadata(&model).unwrap().len();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    // B lets clients pull from the LAN (a model server there); A and C do not.
    let mut nodes = start_cluster(&dir, &["a"]);
    add_node_with(&mut nodes, &dir, "a", "b", "90M", "1", &["--allow-private-downloads"]);
    add_node(&mut nodes, &dir, "a", "c");

    // Added on A only; loaded from C (which holds no copy).
    let added = run_ok(&["models", "add", model.to_str().unwrap()], &dir("a"));
    assert!(added.contains("llama 30 layers"), "{added}");
    let loaded = run_ok(&["models", "load", SMOL, "--context", "512", "--wait"], &dir("c"));
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");

    // Where it runs, as people see it.
    let plan = run_ok(&["models", "plan", SMOL], &dir("b"));
    assert_eq!(plan.matches("running, shard").count(), 3, "{plan}");
    assert!(plan.contains("shard built from this node's copy") && plan.contains("shard fetched from"), "{plan}");
    let ls = run_ok(&["models", "ls"], &dir("b"));
    assert!(ls.contains("3 stage(s)"), "{ls}");

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
    let r = unsplit(&model, &args);
    for n in ["a", "b"] {
        let g = json(
            shoal().args(["generate", "--model", SMOL]).args(args).arg("--data-dir").arg(dir(n)).output().unwrap(),
        );
        assert_eq!(g["tokens"].as_array().unwrap().len(), 24);
        assert_eq!(g["tokens"], r["tokens"], "through {n}: tokens differ from the unsplit run");
        assert_eq!(g["logits_digest"], r["logits_digest"], "through {n}: logits differ from the unsplit run");
    }

    // Each stage's memory as its node measures it, against the planner's promise
    // (within 5% or 64 MiB): the node's RSS growth since the stage loaded, its weights
    // paged in by the generations above; `models plan` shows it beside the prediction.
    for n in ["a", "b", "c"] {
        let s = &stages(&dir(n))[0];
        let resident = s.resident_bytes.unwrap_or_else(|| panic!("{n}: no resident memory: {s:?}"));
        let slack = (s.predicted_bytes / 20).max(64 << 20);
        assert!(resident > 0 && resident <= s.predicted_bytes + slack, "{n}: {s:?}");
    }
    let shown = run_ok(&["models", "plan", SMOL], &dir("c"));
    assert_eq!(shown.matches("; the node's RSS grew ").count(), 3, "{shown}");
    let status = run_ok(&["status"], &dir("b"));
    assert!(status.contains("this node's stage: layers") && status.contains("running; memory predicted"), "{status}");
    assert!(!status.contains("RSS grew ?"), "{status}");
    // The generations above were timed round the ring: each stage's share of a step.
    assert!(status.contains("where a decode step's time goes"), "{status}");
    for part in ["stage 0 compute", "stage 1 compute", "stage 2 sampling", "hop 0→1 QUIC and wire", "hop 2→0"] {
        assert!(status.contains(part), "{part}: {status}");
    }

    // B's HTTP API (B holds only its shard, and tokenizes with it): OpenAI whole and
    // streamed, and Ollama's stream, all give the unsplit run's greedy text.
    let api = std::fs::read_to_string(dir("b").join("http")).unwrap().trim().to_string();
    let want = r["text"].as_str().unwrap();
    let finish = if r["tokens"].as_array().unwrap().len() == 24 { "length" } else { "stop" };
    let msgs = serde_json::json!([{"role": "user", "content": PROMPT}]);
    let chat = format!("http://{api}/v1/chat/completions");
    let req = serde_json::json!({"model": SMOL, "messages": msgs, "temperature": 0, "max_tokens": 24});
    let (status, body) = http_post(&chat, &req);
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], want, "OpenAI whole: {v}");
    assert_eq!(v["choices"][0]["finish_reason"], finish);
    // Log-probabilities from the tail (on another node), through the coordinator: the
    // same greedy answer, each token the most likely of its step, the alternatives in
    // order, and the tokens' bytes making the answer.
    let req = serde_json::json!({"model": SMOL, "messages": msgs, "temperature": 0, "max_tokens": 24,
        "logprobs": true, "top_logprobs": 3});
    let (status, body) = http_post(&chat, &req);
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], want, "with logprobs: {v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let mut bytes = Vec::new();
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0 && lp == top[0]["logprob"].as_f64().unwrap(), "greedy takes the most likely: {e}");
        assert_eq!(e["bytes"], top[0]["bytes"], "{e}");
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()), "{e}");
        let p: f64 = top.iter().map(|t| t["logprob"].as_f64().unwrap().exp()).sum();
        assert!(p <= 1.0 + 1e-4, "{e}");
        bytes.extend(e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8));
    }
    assert_eq!(String::from_utf8_lossy(&bytes), want, "the tokens' bytes make the answer");
    let req = serde_json::json!({"model": SMOL, "messages": msgs, "temperature": 0, "max_tokens": 24, "stream": true});
    let (status, body) = http_post(&chat, &req);
    assert_eq!(status, 200, "{body}");
    let streamed: String = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, want, "OpenAI stream");
    let req = serde_json::json!({"model": SMOL, "messages": msgs, "options": {"temperature": 0, "num_predict": 24}});
    let (status, body) = http_post(&format!("http://{api}/api/chat"), &req);
    assert_eq!(status, 200, "{body}");
    let lines: Vec<Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let text: String = lines.iter().filter_map(|l| l["message"]["content"].as_str()).collect();
    assert_eq!(text, want, "Ollama stream");
    assert_eq!(lines.last().unwrap()["eval_count"], r["tokens"].as_array().unwrap().len());
    let req = serde_json::json!({"model": "no-such-model", "messages": msgs});
    assert_eq!(http_post(&chat, &req).0, 404);
    // Structured output through the stages (the tail reads the grammar against its
    // shard's vocabulary): a JSON schema's object, in its order; Ollama's "json".
    let cat =
        serde_json::json!([{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}]);
    let schema = serde_json::json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"}}, "required": ["name", "age"]});
    let req = serde_json::json!({"model": SMOL, "messages": cat, "temperature": 0, "max_tokens": 120,
        "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}}});
    let (status, body) = http_post(&chat, &req);
    assert_eq!(status, 200, "{body}");
    let content = serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["message"]["content"].clone();
    let v: Value = serde_json::from_str(content.as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {content}"));
    assert_eq!(v.as_object().unwrap().keys().collect::<Vec<_>>(), ["name", "age"], "{v}");
    assert!(v["age"].is_i64(), "{v}");
    let req = serde_json::json!({"model": SMOL, "messages": cat, "format": "json", "stream": false,
        "options": {"temperature": 0, "num_predict": 120}});
    let (status, body) = http_post(&format!("http://{api}/api/chat"), &req);
    assert_eq!(status, 200, "{body}");
    let content = serde_json::from_str::<Value>(&body).unwrap()["message"]["content"].clone();
    assert!(serde_json::from_str::<Value>(content.as_str().unwrap()).is_ok_and(|v| v.is_object()), "{content}");
    let req = serde_json::json!({"model": SMOL, "messages": cat, "response_format": {"type": "json_schema",
        "json_schema": {"schema": {"type": "string", "pattern": "^a$"}}}});
    let (status, body) = http_post(&chat, &req);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("pattern"), "{body}");
    // The official clients (scripts/setup.sh installs them): the same text, every way.
    let clients = std::env::var_os("HOME").map(PathBuf::from).unwrap().join(".cache/shoal/py/clients");
    assert!(clients.join("openai").is_dir(), "{} is missing: run scripts/setup.sh", clients.display());
    let py = std::process::Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients.py"))
        .args([&format!("http://{api}"), SMOL, PROMPT, want, "24"])
        .env("PYTHONPATH", &clients)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&py.stdout).to_string() + &String::from_utf8_lossy(&py.stderr);
    assert!(py.status.success(), "the Python clients: {said}");
    assert!(said.contains("all client checks passed"), "{said}");
    // `shoal chat` keeps the conversation: the second turn's context holds the first.
    let mut chat = shoal()
        .args(["chat", "--temperature", "0", "--max-tokens", "16", "--data-dir"])
        .arg(dir("b"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut chat.stdin.take().unwrap(), b"Name a colour.\nAnd another one?\n").unwrap();
    let out = chat.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let contexts: Vec<u64> =
        err.lines().filter_map(|l| l.split("context ").nth(1)?.split(' ').next()?.parse().ok()).collect();
    assert_eq!(contexts.len(), 2, "two answers: {err}");
    assert!(contexts[1] > contexts[0] + 5, "the second turn carries the first: {contexts:?}");
    assert!(String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.trim().is_empty()).count() >= 2);
    // What B did, as Prometheus reads it: its stage's memory, the tokens it streamed.
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let metrics = agent.get(&format!("http://{api}/metrics")).call().unwrap().body_mut().read_to_string().unwrap();
    for kind in ["predicted", "loaded", "resident"] {
        assert!(metrics.contains(&format!("kind=\"{kind}\"")), "{kind}: {metrics}");
    }
    let streamed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("shoal_completion_tokens_total "))
        .and_then(|n| n.parse::<u64>().ok());
    assert!(streamed.is_some_and(|n| n >= 3 * 24), "{metrics}");

    // SmolLM2 has no fill-in-the-middle tokens: Ollama's `suffix` is refused as Ollama
    // refuses it, and /api/show does not list `insert`.
    let req = serde_json::json!({"model": SMOL, "prompt": "def f(", "suffix": "return x", "stream": false});
    let (status, body) = http_post(&format!("http://{api}/api/generate"), &req);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("does not support insert"), "{body}");
    let (status, body) = http_post(&format!("http://{api}/api/show"), &serde_json::json!({"model": SMOL}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["capabilities"],
        serde_json::json!(["completion", "tools"])
    );

    // Unloaded the way Ollama's clients do it (an empty request with keep_alive 0):
    // every stage stops.
    let (status, body) =
        http_post(&format!("http://{api}/api/generate"), &serde_json::json!({"model": SMOL, "keep_alive": 0}));
    assert_eq!(status, 200, "{body}");
    for n in ["a", "b", "c"] {
        wait_for("stage stopped", 30, || stages(&dir(n)).is_empty().then_some(()));
    }
    // Loaded again, then deleted through the API: unloaded and out of the catalog on
    // every node; the file stays where it was.
    run_ok(&["models", "load", SMOL, "--context", "512", "--wait"], &dir("c"));
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let r = agent
        .delete(&format!("http://{api}/api/delete"))
        .force_send_body()
        .header("content-type", "application/json")
        .send(serde_json::json!({"model": SMOL}).to_string())
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    for n in ["a", "b", "c"] {
        wait_for("stage stopped", 30, || stages(&dir(n)).is_empty().then_some(()));
        wait_for("out of the catalog", 30, || (!run_ok(&["models", "ls"], &dir(n)).contains(SMOL)).then_some(()));
    }
    assert!(model.exists());
    // Pulled back by URL through B's API (Ollama's /api/pull): B downloads it to its
    // data dir and the catalog has it again, with B holding the copy.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut web = std::process::Command::new("python3")
        .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
        .arg(model.parent().unwrap())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let source = format!("http://127.0.0.1:{port}/{SMOL}");
    // Through A's API the same URL is refused: a client's URL reaches public addresses
    // only (review F6: no requests to this machine's or the LAN's services).
    let api_a = std::fs::read_to_string(dir("a").join("http")).unwrap().trim().to_string();
    let (status, body) = http_post(&format!("http://{api_a}/api/pull"), &serde_json::json!({"model": source}));
    assert!(body.contains("not a public address"), "{status}: {body}");
    assert!(!dir("a").join("models").join(SMOL).exists());
    let pulled = wait_for("the pull", 60, || {
        let (status, body) = http_post(&format!("http://{api}/api/pull"), &serde_json::json!({"model": source}));
        (status == 200 && body.lines().last().is_some_and(|l| l.contains("success"))).then_some(body)
    });
    let _ = web.kill();
    let _ = web.wait();
    assert!(pulled.starts_with("{\"status\":\"pulling manifest\"}"), "{pulled}");
    assert!(pulled.contains("\"completed\""), "{pulled}");
    assert_eq!(
        std::fs::metadata(dir("b").join("models").join(SMOL)).unwrap().len(),
        std::fs::metadata(&model).unwrap().len()
    );
    for n in ["a", "b", "c"] {
        wait_for("in the catalog again", 30, || run_ok(&["models", "ls"], &dir(n)).contains(SMOL).then_some(()));
    }
    nodes.kill_all();
}

#[test]
fn a_stage_node_killed_mid_generation_is_replaced_and_the_answer_does_not_change() {
    let _machine = sharing();
    let model = model(SMOL);
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    // Three stages (the offers force it) and two spares: one for each node killed.
    let names = ["a", "b", "c", "d", "e"];
    let mut nodes = start_cluster(&dir, &names);
    run_ok(&["models", "add", model.to_str().unwrap()], &dir("a"));
    // Two sessions: the first round also streams through the HTTP API meanwhile.
    let loaded = run_ok(&["models", "load", SMOL, "--context", "512", "--sessions", "2", "--wait"], &dir("a"));
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    let args = ["--prompt", PROMPT, "-n", "300", "--ignore-eos", "--json"];
    let r = unsplit(&model, &args);
    let r_eos = unsplit(&model, &["--prompt", PROMPT, "-n", "300", "--json"]);
    // The second round speculates: its answer is the unsplit run's with the same drafts.
    let spec_args = ["--prompt", PROMPT, "-n", "300", "--ignore-eos", "--json", "--draft", "8"];
    let r_spec = unsplit(&model, &spec_args);
    assert!(r_spec["accepted"].as_u64().unwrap() > 0, "no draft accepted: the round would not test speculation");
    let id_of = |n: &str| key(&dir(n));

    // A spare holds neither the model nor a shard; its API still answers: it fetches
    // the model's header from A and tokenizes with a vocabulary-only file (sparse).
    let plan = placement(&dir("a"));
    let placed: Vec<&str> = plan["stages"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap()).collect();
    // A spare that was in an earlier placement (a member that looked down for 3 s while
    // five nodes loaded on two cores is repaired away) keeps that shard in its cache and
    // tokenizes with it: the vocabulary-only file is checked on one that never held any.
    let shard_dir = |n: &str| dir(n).join(format!("shards/blake3-{}", plan["model"].as_str().unwrap()));
    let holds_shard = |n: &str| {
        std::fs::read_dir(shard_dir(n))
            .map(|d| d.flatten().any(|e| e.file_name() != "vocab-only.gguf"))
            .unwrap_or(false)
    };
    let spares: Vec<&str> = names.iter().copied().filter(|n| !placed.contains(&id_of(n).as_str())).collect();
    let fresh = spares.iter().copied().find(|n| !holds_shard(n));
    let spare = fresh.unwrap_or(spares[0]);
    let api = std::fs::read_to_string(dir(spare).join("http")).unwrap().trim().to_string();
    let req = serde_json::json!({"model": SMOL, "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0, "max_tokens": 24});
    let (status, body) = http_post(&format!("http://{api}/v1/chat/completions"), &req);
    assert_eq!(status, 200, "through the spare {spare}: {body}");
    let text =
        serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty() && r["text"].as_str().unwrap().starts_with(&text), "{text:?} vs {}", r["text"]);
    if fresh.is_some() {
        let meta = std::fs::metadata(shard_dir(spare).join("vocab-only.gguf")).unwrap();
        assert_eq!(meta.len(), std::fs::metadata(&model).unwrap().len(), "as long as the model");
        assert!(std::os::unix::fs::MetadataExt::blocks(&meta) * 512 < 16 << 20, "not sparse: {meta:?}");
    } else {
        eprintln!("every spare ({spares:?}) held a shard from an earlier placement: {plan}");
    }
    // The middle stage's node, and then the (new) coordinator's, unless it is A: A holds
    // the only copy of the model and is where the generation is asked.
    for round in 0..2 {
        let plan = placement(&dir("a"));
        let stages: Vec<String> =
            plan["stages"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap().to_string()).collect();
        let pick = if round == 0 { [1, 0, 2] } else { [0, 1, 2] };
        let Some(victim) = pick
            .iter()
            .map(|&i| stages[i].clone())
            .find(|id| *id != id_of("a") && nodes.alive().any(|n| id_of(n) == *id))
        else {
            panic!("no stage to kill in {stages:?}");
        };
        let victim_name = names.iter().copied().find(|n| id_of(n) == victim).unwrap();
        // Round 0: an HTTP stream through A's API runs through the same stages meanwhile.
        let a_api = std::fs::read_to_string(dir("a").join("http")).unwrap().trim().to_string();
        let stream = (round == 0).then(|| {
            std::thread::spawn(move || {
                let req = serde_json::json!({"model": SMOL, "messages": [{"role": "user", "content": PROMPT}],
                    "temperature": 0, "max_tokens": 300, "stream": true});
                let (status, body) = http_post(&format!("http://{a_api}/v1/chat/completions"), &req);
                assert_eq!(status, 200, "{body}");
                let text: String = body
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter(|d| *d != "[DONE]")
                    .map(|d| serde_json::from_str::<Value>(d).unwrap())
                    .inspect(|v| assert!(v.get("error").is_none(), "the stream failed: {v}"))
                    .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                    .collect();
                text
            })
        });
        // Round 1 kills the coordinator with speculation on: the resumed generation
        // recovers its draft schedule from the tokens and goes on as the unfaulted run.
        let (args, r): (&[&str], &Value) = if round == 0 { (&args, &r) } else { (&spec_args, &r_spec) };
        let (gen, mut lines) = spawn_generation(shoal(), SMOL, args, &dir("a"));
        // Kill the victim once 40 tokens came.
        let mut seen = 0;
        for line in lines.by_ref() {
            if line.unwrap().starts_with("token ") {
                seen += 1;
                if seen == 40 {
                    break;
                }
            }
        }
        assert_eq!(seen, 40, "the generation did not get under way");
        let killed_at = Instant::now();
        nodes.kill(victim_name);
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let out = gen.wait_with_output().unwrap();
        assert!(out.status.success(), "round {round}: the generation failed: {rest:?}");
        eprintln!(
            "round {round}: {victim_name} killed; the generation ended {:.1} s later",
            killed_at.elapsed().as_secs_f64()
        );
        let g: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(g["tokens"].as_array().unwrap().len(), 300);
        assert_eq!(
            g["tokens"], r["tokens"],
            "round {round} ({victim_name} killed): tokens differ from the unsplit run"
        );
        assert_eq!(g["logits_digest"], r["logits_digest"], "round {round}: logits differ from the unsplit run");
        assert_eq!(rest.iter().filter(|l| l.starts_with("token ")).count(), 260, "tokens missing or repeated");
        let after = placement(&dir("a"));
        assert!(after["generation"].as_u64() > plan["generation"].as_u64(), "not re-placed: {after}");
        if let Some(stream) = stream {
            let text = stream.join().unwrap();
            assert_eq!(text, r_eos["text"].as_str().unwrap(), "the HTTP stream across the kill");
        }
    }
    nodes.kill_all();
}

#[test]
fn the_leaders_node_killed_mid_generation_is_replaced_and_the_answer_does_not_change() {
    let _machine = sharing();
    let model = model(SMOL);
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    // A creates the cluster (so it leads) and, with three nodes offering 90 MB each,
    // runs one of the three stages; D joins once the model runs, as the spare.
    let mut nodes = start_cluster(&dir, &["a", "b", "c"]);
    // B holds a copy too: A's dies with it, and the spare needs a source for A's shard.
    run_ok(&["models", "add", model.to_str().unwrap()], &dir("a"));
    run_ok(&["models", "add", model.to_str().unwrap()], &dir("b"));
    let loaded = run_ok(&["models", "load", SMOL, "--context", "512", "--wait"], &dir("b"));
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    add_node(&mut nodes, &dir, "b", "d");
    let leader = status(&dir("b")).unwrap()["leader"].as_str().unwrap().to_string();
    assert_eq!(leader, key(&dir("a")), "the creator leads");
    let plan = placement(&dir("b"));
    let runs_a = plan["stages"].as_array().unwrap().iter().any(|s| s["node"].as_str() == Some(&leader));
    assert!(runs_a, "the leader runs no stage: {plan}");

    let args = ["--prompt", PROMPT, "-n", "300", "--ignore-eos", "--json"];
    let r = unsplit(&model, &args);
    let (gen, mut lines) = spawn_generation(shoal(), SMOL, &args, &dir("b"));
    let seen = lines.by_ref().map_while(Result::ok).filter(|l| l.starts_with("token ")).take(40).count();
    assert_eq!(seen, 40, "the generation did not get under way");
    let killed_at = Instant::now();
    nodes.kill("a");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let out = gen.wait_with_output().unwrap();
    assert!(out.status.success(), "the generation failed: {rest:?}");
    eprintln!("the leader killed; the generation ended {:.1} s later", killed_at.elapsed().as_secs_f64());
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(g["tokens"], r["tokens"], "tokens differ from the unsplit run");
    assert_eq!(g["logits_digest"], r["logits_digest"], "logits differ from the unsplit run");
    assert_eq!(rest.iter().filter(|l| l.starts_with("token ")).count(), 260, "tokens missing or repeated");
    // A new leader re-placed A's stage on the spare.
    let new_leader = status(&dir("b")).unwrap()["leader"].as_str().map(str::to_string);
    assert!(new_leader.is_some_and(|l| l != leader), "no new leader");
    let after = placement(&dir("b"));
    assert!(after["generation"].as_u64() > plan["generation"].as_u64(), "not re-placed: {after}");
    let on_d = after["stages"].as_array().unwrap().iter().any(|s| s["node"].as_str() == Some(&key(&dir("d"))));
    assert!(on_d, "the spare runs no stage: {after}");
    nodes.kill_all();
}

#[test]
fn a_bigger_node_joining_takes_the_model_but_only_once_no_generation_runs() {
    // The newcomer must measure faster than the others (it has twice their threads):
    // measured beside other tests' generations, it may not, and then never wins a re-plan.
    let _machine = alone();
    let model = model(SMOL);
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    // 105 MiB each: the model at a 2048-position context needs all three (~295 MiB).
    let mut nodes = Nodes(vec![("a", serve_offering(&dir("a"), "a", true, "105M", "1"))]);
    wait_for("the first node's cluster", 30, || status(&dir("a")).filter(|s| !s["cluster"].is_null()));
    for n in ["b", "c"] {
        add_node_offering(&mut nodes, &dir, "a", n, "105M", "1");
    }
    run_ok(&["models", "add", model.to_str().unwrap()], &dir("a"));
    let loaded = run_ok(&["models", "load", SMOL, "--context", "2048", "--wait"], &dir("a"));
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    let before = placement(&dir("a"));

    // A long generation runs while a node that holds the whole model's needs joins. Long
    // for this machine: ~15 s at the unsplit speed (faster than the split one), so that a
    // faster machine, which also joins and measures faster, still runs it past that.
    let speed = unsplit(&model, &["--prompt", PROMPT, "-n", "64", "--ignore-eos", "--json"])["tok_per_s"]
        .as_f64()
        .expect("the unsplit run's speed");
    let n = ((speed * 15.0) as usize).clamp(400, 1900).to_string();
    let args = ["--prompt", PROMPT, "-n", n.as_str(), "--ignore-eos", "--json"];
    let r = unsplit_ctx(&model, 2048, &args);
    let (mut gen, lines) = spawn_generation(shoal(), SMOL, &args, &dir("a"));
    let tokens = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = tokens.clone();
    let reader = std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if line.starts_with("token ") {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    wait_for("the generation under way", 60, || (tokens.load(std::sync::atomic::Ordering::SeqCst) >= 40).then_some(()));
    // Twice the threads of the others: measured faster, as a bigger PC would be (the
    // move must predict REPLAN_GAIN; with equal speeds one stage instead of three gains
    // only the two hops, about 1.2x for this model).
    add_node_offering(&mut nodes, &dir, "a", "big", "1G", "2");
    let joined = Instant::now();
    // Busy: the placement stays as it is, however long the leader has had to re-plan.
    let mut checked_late = false;
    while gen.try_wait().unwrap().is_none() {
        let now = placement(&dir("a"));
        assert_eq!(now["generation"], before["generation"], "re-placed during a generation: {now}");
        checked_late |= joined.elapsed() > Duration::from_secs(3);
        std::thread::sleep(Duration::from_millis(300));
    }
    reader.join().unwrap();
    // The generation ran long after the join (the leader measured the newcomer and could
    // have re-planned); only a machine decoding ~1900 tokens in under 3 s misses this.
    assert!(checked_late, "the generation ended within 3 s of the join, before the leader could re-plan ({n} tokens)");
    let out = gen.wait_with_output().unwrap();
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(g["tokens"], r["tokens"], "tokens differ from the unsplit run");

    // Idle now: the leader moves the model to one stage on the big node.
    let big = key(&dir("big"));
    let mut last = Value::Null;
    let t0 = Instant::now();
    let after = loop {
        let p = placement(&dir("a"));
        if p["stages"].as_array().unwrap().len() == 1 && p["stages"][0]["node"] == big.as_str() {
            break p;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            if std::env::var_os("SHOAL_TEST_LOGS").is_some() {
                let _ = std::fs::remove_dir_all("/tmp/shoal-test-logs");
                let _ = std::process::Command::new("cp").arg("-r").arg(tmp.path()).arg("/tmp/shoal-test-logs").status();
            }
            panic!("no re-plan onto the big node within 60 s: {last}");
        }
        last = p;
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(after["explanation"][0].as_str().unwrap().starts_with("re-planned while idle"), "{after}");
    eprintln!("re-planned: {}", after["explanation"]);
    // And it answers as the unsplit model through another node.
    wait_for("the new stage running", 60, || {
        run_ok(&["models", "plan", SMOL], &dir("b")).contains("running, shard").then_some(())
    });
    let args = ["--prompt", PROMPT, "-n", "24", "--json"];
    let r = unsplit(&model, &args);
    let g =
        json(shoal().args(["generate", "--model", SMOL]).args(args).arg("--data-dir").arg(dir("b")).output().unwrap());
    assert_eq!(g["tokens"], r["tokens"]);
    assert_eq!(g["logits_digest"], r["logits_digest"]);
    nodes.kill_all();
    if std::env::var_os("SHOAL_TEST_LOGS").is_some() {
        let _ = std::fs::remove_dir_all("/tmp/shoal-test-logs");
        let _ = std::process::Command::new("cp").arg("-r").arg(tmp.path()).arg("/tmp/shoal-test-logs").status();
    }
}

/// The stream's text of an OpenAI chat request through `api` (greedy, `max` tokens).
fn streamed_chat(api: &str, prompt: &str, max: u32) -> String {
    let req = serde_json::json!({"model": SMOL, "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": max, "stream": true});
    let (status, body) = http_post(&format!("http://{api}/v1/chat/completions"), &req);
    assert_eq!(status, 200, "{body}");
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            assert!(v.get("error").is_none(), "the stream failed: {v}");
            v["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect()
}

/// The value of the gauge `name` on the node whose API is `api` (0 when absent).
fn gauge(api: &str, name: &str) -> u64 {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let text = agent.get(&format!("http://{api}/metrics")).call().unwrap().body_mut().read_to_string().unwrap();
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn concurrent_streams_each_answer_as_alone_a_full_queue_is_429_and_a_client_gone_frees_its_place() {
    let _machine = sharing();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    let mut nodes = start_cluster(&dir, &["a", "b", "c"]);
    run_ok(&["models", "add", model(SMOL).to_str().unwrap()], &dir("a"));
    let loaded = run_ok(&["models", "load", SMOL, "--context", "512", "--sessions", "2", "--wait"], &dir("a"));
    assert!(loaded.contains("ready: 3 stage(s)"), "{loaded}");
    let api_of = |n: &str| std::fs::read_to_string(dir(n).join("http")).unwrap().trim().to_string();
    let api = api_of("b");
    // The coordinator (the first stage's node) reports the sessions and the queue.
    let plan = placement(&dir("a"));
    let first = plan["stages"][0]["node"].as_str().unwrap().to_string();
    let coordinator = ["a", "b", "c"].into_iter().find(|n| key(&dir(n)) == first).unwrap();
    let coord_api = api_of(coordinator);

    // Four prompts alone, then all four at once (two run, two queue): the same texts.
    let prompts = ["Name three rivers.", "What is two plus two?", "Write a haiku about salt.", "List four colours."];
    let alone: Vec<String> = prompts.iter().map(|p| streamed_chat(&api, p, 32)).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| streamed_chat(&api, p, 32))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert!(!a.is_empty());
        assert_eq!(a, t, "prompt {i}: concurrent text differs from its solo run");
    }

    // Fill both sessions and the queue (4 per session) with long requests whose clients
    // then stay silent; the next request is refused with 429.
    let body = serde_json::json!({"model": SMOL, "messages": [{"role": "user", "content": "Tell a long story."}],
        "temperature": 0, "max_tokens": 400, "ignore_eos": true, "stream": true})
    .to_string();
    let holders: Vec<std::net::TcpStream> = (0..10)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&api).unwrap();
            let req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: {api}\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            );
            std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
            s
        })
        .collect();
    wait_for("2 sessions busy and 8 queued", 60, || {
        (gauge(&coord_api, "shoal_stage_sessions") == 2 && gauge(&coord_api, "shoal_stage_queued") == 8).then_some(())
    });
    let req = serde_json::json!({"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let (status, body) = http_post(&format!("http://{api}/v1/chat/completions"), &req);
    assert_eq!(status, 429, "{body}");
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].is_string(), "{body}");
    // The clients go away: their sessions and places in the queue are freed.
    drop(holders);
    wait_for("sessions and queue freed", 60, || {
        (gauge(&coord_api, "shoal_stage_sessions") == 0 && gauge(&coord_api, "shoal_stage_queued") == 0).then_some(())
    });
    assert_eq!(streamed_chat(&api, prompts[0], 32), alone[0], "served again as before");
    nodes.kill_all();
}

/// POST `body` as JSON; the status and the body.
fn http_post(url: &str, body: &Value) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent.post(url).header("content-type", "application/json").send(body.to_string()).unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

/// The committed placement of the test model, as `models plan --json` prints it.
fn placement(dir: &Path) -> Value {
    let v: Value = serde_json::from_str(&run_ok(&["models", "plan", SMOL, "--json"], dir)).unwrap();
    assert_eq!(v["committed"], true, "{v}");
    v["placement"].clone()
}

/// A node started with `--draft-model` drafts with it where it coordinates a model of
/// the draft's vocabulary: a speculating generation through the cluster (free text,
/// where prompt lookup drafts little) equals `shoal run --draft-model` with the same
/// settings, drafts, steps and acceptance included.
#[test]
fn a_node_drafts_with_its_draft_model_like_the_unsplit_run() {
    let _machine = sharing();
    let model = model(SMOL);
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("draft-q4_0.gguf");
    shoal_engine::requantize(&model, &draft, shoal_engine::Quant::Q4_0).unwrap();
    // The planner's predictions (what the node checks the draft against): the draft
    // whole and the model in one stage, at a sizing.
    let predict = |path: &Path, context: u32, sessions: u32| {
        let (_, meta) = shoal_gguf::open_model(path).unwrap();
        let sizing = shoal_planner::Sizing { context, sessions, chunk: shoal_node::schedule::CHUNK };
        shoal_planner::ModelProfile::from_meta(&meta)
            .stage_memory(shoal_types::LayerRange::new(0, meta.n_layer), &sizing)
            .total()
    };
    // The node keeps room for the draft at a default load (4096 positions, 1 session)
    // out of what it offers the planner. Memory for the model at 2048 positions × 4
    // sessions and that reserve, but short of the model and its draft at that sizing,
    // and of the model at 5 sessions and the reserve (though the model alone fits).
    let reserve = predict(&draft, 4096, 1);
    let (model_4, draft_4, model_5) = (predict(&model, 2048, 4), predict(&draft, 2048, 4), predict(&model, 2048, 5));
    let memory = model_4 + reserve + (model_5 - model_4) / 2;
    assert!(memory < model_4 + draft_4 && memory >= model_5, "{memory} {model_4} {draft_4} {model_5} {reserve}");
    let dir = tmp.path().join("a");
    let extra = ["--draft-model", draft.to_str().unwrap()];
    let mut nodes = Nodes(vec![("a", serve_with(&dir, "a", true, &format!("{}", memory), "1", &extra))]);
    wait_for("the cluster", 30, || status(&dir).filter(|s| !s["cluster"].is_null()));
    run_ok(&["models", "add", model.to_str().unwrap()], &dir);
    let loaded = run_ok(&["models", "load", SMOL, "--context", "512", "--wait"], &dir);
    assert!(loaded.contains("ready: 1 stage(s)"), "{loaded}");
    let args = ["--prompt", PROMPT, "-n", "48", "--ignore-eos", "--json", "--draft", "4", "--draft-cost", "0,0"];
    let generate =
        || json(shoal().args(["generate", "--model", SMOL]).args(args).arg("--data-dir").arg(&dir).output().unwrap());
    let g = generate();
    let mut with_draft: Vec<&str> = args.to_vec();
    with_draft.extend(extra);
    let r = unsplit(&model, &with_draft);
    assert!(r["accepted"].as_u64().unwrap() > 10, "the draft model drafted little: {r}");
    for k in ["tokens", "logits_digest", "decode_steps", "drafted", "accepted"] {
        assert_eq!(g[k], r[k], "{k} differs from shoal run --draft-model: {g}");
    }
    // The stage says what it drafts with and what that holds; `shoal status` shows it.
    let st = &stages(&dir)[0];
    match &st.draft {
        Some(DraftState::Loaded { file, bytes, cost }) => {
            assert_eq!(file, "draft-q4_0.gguf");
            assert!(*bytes > 0 && *bytes <= predict(&draft, 512, 1) + (16 << 20), "{st:?}");
            assert!(*cost > 500, "a requantized copy costs about a target pass: {st:?}");
        }
        other => panic!("no draft model in the stage's status: {other:?}"),
    }
    let shown = run_ok(&["status"], &dir);
    assert!(shown.contains("drafting with draft-q4_0.gguf"), "{shown}");
    // And the admin page's overview (its model card's stage 0), once a password is set.
    let http = std::fs::read_to_string(dir.join("http")).unwrap().trim().to_string();
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let setup = agent
        .post(&format!("http://{http}/admin/api/setup"))
        .header("content-type", "application/json")
        .send(r#"{"password":"a long enough password"}"#)
        .unwrap();
    assert_eq!(setup.status().as_u16(), 200);
    let cookie = setup.headers().get("set-cookie").unwrap().to_str().unwrap().split(';').next().unwrap().to_string();
    let overview: Value = serde_json::from_str(
        &agent
            .get(&format!("http://{http}/admin/api/overview"))
            .header("cookie", &cookie)
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap(),
    )
    .unwrap();
    let card = &overview["models"].as_array().unwrap().iter().find(|m| m["name"] == SMOL).unwrap()["stages"][0];
    assert!(card["draft"].as_str().unwrap().starts_with("drafts with draft-q4_0.gguf"), "{card}");

    // Loaded for 4 sessions of 2048 positions, the draft does not fit what the plan
    // leaves: the stage runs without it, says why, and drafts by prompt lookup.
    run_ok(&["models", "unload", SMOL], &dir);
    let loaded = run_ok(&["models", "load", SMOL, "--context", "2048", "--sessions", "4", "--wait"], &dir);
    assert!(loaded.contains("ready: 1 stage(s)"), "{loaded}");
    let st = &stages(&dir)[0];
    match &st.draft {
        Some(DraftState::NotLoaded(why)) => assert!(why.contains("MiB are left of this node's memory"), "{why}"),
        other => panic!("the draft model should not fit: {other:?}"),
    }
    let g = generate();
    let lookup = unsplit(&model, &args);
    for k in ["tokens", "logits_digest", "decode_steps", "drafted", "accepted"] {
        assert_eq!(g[k], lookup[k], "{k} differs from shoal run's prompt lookup: {g}");
    }

    // The reserve is not offered to the planner: 5 sessions would fit the node's
    // memory, not its offer.
    run_ok(&["models", "unload", SMOL], &dir);
    let out = shoal()
        .args(["models", "load", SMOL, "--context", "2048", "--sessions", "5", "--wait", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() && said.contains("does not fit"), "placed into the draft model's reserve: {said}");
    nodes.kill_all();
}
