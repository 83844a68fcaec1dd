//! API keys across real network stacks: a node on one namespace host serves the HTTP
//! API on all its addresses; a client on another host (a non-loopback address) is
//! refused without a key, answered with one made by `shoal keys create`, and refused
//! again once the key is revoked; on the node's own host, loopback needs no key. Needs
//! root (`ip netns`); without it the test says it skipped.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `shoal ARGS --data-dir DIR` on host `k`: its stdout, or a panic with its stderr.
fn on_host(net: &shoal_testnet::Net, k: usize, args: &[&str], dir: &Path) -> Option<String> {
    let out = net.command(k, env!("CARGO_BIN_EXE_shoal")).args(args).arg("--data-dir").arg(dir).output().unwrap();
    out.status.success().then(|| String::from_utf8(out.stdout).unwrap())
}

/// POST a chat request from host `k` to `url` with Python's standard library (any
/// Debian has python3: the setup needs it); the status and the body.
fn chat_from(net: &shoal_testnet::Net, k: usize, url: &str, key: Option<&str>) -> (u16, String) {
    let script = r#"
import json, sys, urllib.request, urllib.error
url, key = sys.argv[1], sys.argv[2]
body = json.dumps({"model": sys.argv[3], "messages": [{"role": "user", "content": "Say hi."}],
                   "temperature": 0, "max_tokens": 8}).encode()
req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
if key:
    req.add_header("Authorization", "Bearer " + key)
try:
    r = urllib.request.urlopen(req, timeout=60)
    print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
"#;
    let out = net.command(k, "python3").args(["-c", script, url, key.unwrap_or(""), SMOL]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (status, body) = text.split_once('\n').unwrap_or_else(|| panic!("python: {text} {:?}", out.stderr));
    (status.trim().parse().unwrap(), body.to_string())
}

#[test]
fn other_machines_need_a_key_and_a_revoked_key_stops_working() {
    if !namespaces_available() {
        return;
    }
    let model = model(SMOL);
    let mut net = shoal_testnet::Net::new("key", 2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a");
    let child = net
        .command(0, env!("CARGO_BIN_EXE_shoal"))
        .args(["serve", "--create-cluster", "--listen", "0.0.0.0:0", "--join-listen", "127.0.0.1:0"])
        .args(["--mdns-allow", "lo", "--http-listen", "0.0.0.0:11434", "--max-memory", "400M", "--data-dir"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    net.adopt(child);
    let t0 = Instant::now();
    while on_host(&net, 0, &["status", "--json"], &dir)
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .is_none_or(|s| s["cluster"].is_null())
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "the node did not form its cluster");
        std::thread::sleep(Duration::from_millis(300));
    }
    on_host(&net, 0, &["models", "add", model.to_str().unwrap()], &dir).expect("models add");
    on_host(&net, 0, &["models", "load", SMOL, "--context", "512", "--wait"], &dir).expect("models load");

    let url = format!("http://{}:11434/v1/chat/completions", net.addr(0));
    // From the other host: no key, a wrong key → 401.
    let (status, body) = chat_from(&net, 1, &url, None);
    assert_eq!(status, 401, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], "invalid_api_key");
    assert_eq!(chat_from(&net, 1, &url, Some("sk-shoal-0000")).0, 401);
    // On the node's own host, over loopback: no key needed.
    assert_eq!(chat_from(&net, 0, "http://127.0.0.1:11434/v1/chat/completions", None).0, 200);

    let secret = on_host(&net, 0, &["keys", "create", "laptop"], &dir).expect("keys create");
    let secret = secret.trim();
    assert!(secret.starts_with("sk-shoal-"), "{secret}");
    let listed = on_host(&net, 0, &["keys", "ls"], &dir).unwrap();
    assert!(listed.contains("laptop") && !listed.contains(secret), "{listed}");
    let (status, body) = chat_from(&net, 1, &url, Some(secret));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(!v["choices"][0]["message"]["content"].as_str().unwrap().is_empty(), "{v}");

    on_host(&net, 0, &["keys", "revoke", "laptop"], &dir).expect("keys revoke");
    assert_eq!(chat_from(&net, 1, &url, Some(secret)).0, 401, "a revoked key still works");
}
