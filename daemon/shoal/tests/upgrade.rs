//! Data written by an older Shoal is read by this one: a copy of
//! `tests/data/node-0.1.0` (a member's data directory from Shoal 0.1.0, store format 0:
//! see its README) is the data directory of a node of this build. The node keeps its
//! key, its cluster, the members, the catalog and the API keys, and its store is
//! upgraded to the current format (so an older build refuses it instead of misreading).

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const ALPHA: &str = "89fb2d9251a38c3c4ab215dffebe175e400e9335f2e546548255881684dd02c6";
const BETA: &str = "4e4a89b9c1033cd962f006fd6901d1f0a2d3676a8ee2a20bfb132675a6b8e566";
const CLUSTER: &str = "6977271b4e67bb8451a1681aab587991";

/// Copy a directory tree (the checked-in data is read-only to the test).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn cli(args: &[&str], dir: &Path) -> String {
    let out = shoal().args(args).arg("--data-dir").arg(dir).output().unwrap();
    assert!(out.status.success(), "shoal {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_node_keeps_its_key_cluster_catalog_and_api_keys_from_shoal_0_1_0() {
    let tmp = tempfile::tempdir().unwrap();
    let old = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/node-0.1.0");
    let format = |dir: &Path| shoal_store::SledStore::open(dir).unwrap().format().unwrap();
    // The store alone: format 0 as checked in, the current one once opened.
    let store = tmp.path().join("store");
    copy_tree(&old, &store);
    assert_eq!(shoal_store::SledStore::open(&store).unwrap().format().unwrap(), shoal_store::FORMAT);

    // The node process on another copy.
    let dir = tmp.path().join("node");
    copy_tree(&old, &dir);
    // Git keeps no file modes but the executable bit; the node refuses a key others can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("node.key"), std::fs::Permissions::from_mode(0o600)).unwrap();

    assert_eq!(cli(&["key"], &dir).trim(), ALPHA, "the node's key");
    let mut node = shoal()
        .args(["serve", "--no-create", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0", "--mdns-allow", "lo", "--data-dir"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status: Value = loop {
        let out = shoal().args(["status", "--json", "--data-dir"]).arg(&dir).output().unwrap();
        if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
            break v;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the node did not answer");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status["node"], ALPHA, "{status}");
    assert_eq!(status["cluster"], CLUSTER, "{status}");
    let mut members: Vec<(String, String)> = status["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["node"].as_str().unwrap().to_string(), m["name"].as_str().unwrap().to_string()))
        .collect();
    members.sort();
    assert_eq!(members, [(BETA.to_string(), "beta".to_string()), (ALPHA.to_string(), "alpha".to_string())]);
    let keys = cli(&["keys", "ls"], &dir);
    assert!(keys.contains("ci-key"), "{keys}");
    let models = cli(&["models", "ls"], &dir);
    assert!(models.contains("SmolLM2-135M-Instruct.Q4_1.gguf") && models.contains("5f4fa13bfc6d"), "{models}");
    std::process::Command::new("kill").args(["-TERM", &node.id().to_string()]).status().unwrap();
    assert!(node.wait().unwrap().success(), "the node stops cleanly on SIGTERM");
    assert_eq!(format(&dir), shoal_store::FORMAT);
}
