//! A model file from anywhere cannot freeze a node (security review F4): a GGUF whose
//! chat template nests two loops of 100,000, added to a real node's catalog. Before
//! templates had a budget, two `/api/show` for it pinned both of the node's async
//! workers (its `/health` stopped answering, its RSS grew past 2 GB). Now each render
//! is refused within its budget, off the async workers: `/health` answers within a
//! second throughout, the chat is a 400 that says why, the node's memory stays put,
//! and the same model still answers a raw prompt (the weights are fine).

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The review's template.
const NESTED: &str = "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages }}{% endfor %}{% endfor %}";

/// Resident memory of process `pid`, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kb / 1024
}

/// POST `body` to `url`; the status and the body.
fn post(url: &str, body: &Value) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let mut r = agent.post(url).header("content-type", "application/json").send(body.to_string()).unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

#[test]
fn a_chat_template_that_would_run_for_ever_is_refused_and_the_node_keeps_answering() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("nested.gguf");
    // A real model (its weights load and run) with the hostile template, over the test
    // model's vocabulary.
    shoal_gguf::zoo::write_with_template(
        shoal_gguf::zoo::Family::Qwen2,
        &model("SmolLM2-135M-Instruct.Q4_1.gguf"),
        NESTED,
        &path,
    )
    .unwrap();
    let dir = tmp.path().join("a");
    let node = shoal()
        .args(["serve", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0", "--mdns-allow", "lo"])
        .args(["--http-listen", "127.0.0.1:0", "--name", "a", "--threads", "1", "--create-cluster", "--data-dir"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = node.id();
    let _node = Nodes(vec![("a", node)]);
    wait_for("the node's cluster", 30, || status(&dir).filter(|s| !s["cluster"].is_null()));
    let out = shoal().args(["models", "add"]).arg(&path).arg("--data-dir").arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let api = std::fs::read_to_string(dir.join("http")).unwrap().trim().to_string();
    let health = format!("http://{api}/health");
    // `/health` answers 503 while no model is ready: any answer is the node answering.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    assert!(agent.get(&health).call().is_ok());
    let before = rss_mib(pid);

    // Two renders at once (the review's two `/api/show`), and two chats; `/health`
    // asked throughout.
    let show = format!("http://{api}/api/show");
    let chat = format!("http://{api}/api/chat");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let mut asks = Vec::new();
    for i in 0..4 {
        let (show, chat, done) = (show.clone(), chat.clone(), done_tx.clone());
        asks.push(std::thread::spawn(move || {
            let r = if i < 2 {
                post(&show, &json!({"model": "nested.gguf"}))
            } else {
                post(
                    &chat,
                    &json!({"model": "nested.gguf", "stream": false,
                    "messages": [{"role": "user", "content": "Hi"}]}),
                )
            };
            let _ = done.send(());
            r
        }));
    }
    drop(done_tx);
    let mut slowest = Duration::ZERO;
    let mut asked = 0;
    loop {
        let t = Instant::now();
        let ok = agent.get(&health).call().is_ok();
        slowest = slowest.max(t.elapsed());
        asked += 1;
        assert!(ok, "/health failed while the template was rendered");
        // Until every request has its answer (the chats load the model first).
        if done_rx.recv_timeout(Duration::from_millis(50)) == Err(std::sync::mpsc::RecvTimeoutError::Disconnected) {
            break;
        }
    }
    let answers: Vec<(u16, String)> = asks.into_iter().map(|a| a.join().unwrap()).collect();
    eprintln!("/health asked {asked} times, slowest {slowest:?}; RSS {before} MiB before");
    assert!(slowest < Duration::from_secs(1), "/health took {slowest:?} while the template was rendered");
    // `/api/show` answers: the model is there, without the capabilities its template
    // would give.
    for (status, body) in &answers[..2] {
        assert_eq!(*status, 200, "{body}");
        let v: Value = serde_json::from_str(body).unwrap();
        let caps = v["capabilities"].as_array().unwrap();
        assert!(!caps.contains(&json!("tools")), "{v}");
    }
    // A chat is refused, and says why.
    for (status, body) in &answers[2..] {
        assert_eq!(*status, 400, "{body}");
        assert!(body.contains("chat template is over its budget"), "{body}");
    }
    // Memory: the model's weights loaded for the chats (a few MiB), nothing like the
    // gigabytes the render made before.
    let after = rss_mib(pid);
    assert!(after < before + 300, "the node's RSS went from {before} to {after} MiB");
    // The model itself is fine: a raw prompt (no template) generates.
    let (status, body) = post(
        &format!("http://{api}/api/generate"),
        &json!({"model": "nested.gguf", "prompt": "Hello", "raw": true, "stream": false, "options": {"num_predict": 3}}),
    );
    assert_eq!(status, 200, "{body}");
}
