//! Two node processes in this process on 127.0.0.1 (real QUIC, real mDNS on `lo`, the
//! real test model): the catalog is added to on one node and seen on the other, bad
//! files are refused with the reason, a file changed after adding is noticed, only the
//! owner changes the catalog, and models are imported from an Ollama-style store.

mod common;
use common::*;
use shoal_membership::node::CreatePolicy;
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_node::api::{self, CopyState, ErrorKind, NodeRequest, NodeResponse, StoreKind};
use std::path::Path;

fn add(path: &Path, name: Option<&str>) -> NodeRequest {
    NodeRequest::ModelAdd { path: path.display().to_string(), name: name.map(str::to_string) }
}

fn error_of(r: NodeResponse) -> api::ApiError {
    match r {
        NodeResponse::Error(e) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A copy of the test model with one byte of tensor data changed: a valid GGUF with
/// other content.
fn altered_copy(dest: &Path) {
    let mut bytes = std::fs::read(real_model()).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x55;
    std::fs::write(dest, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_added_on_one_node_are_seen_on_all_and_bad_or_changed_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let a = start(&dir("a"), "a", CreatePolicy::Now, Default::default());
    wait_for("A's cluster", 10, || async { a.status().await.cluster }).await;
    // B joins with a code made on A.
    let b = start(&dir("b"), "b", CreatePolicy::Never, Default::default());
    let code = match a.admin(AdminRequest::Pair).await {
        AdminResponse::Code { code, .. } => code,
        other => panic!("pair: {other:?}"),
    };
    wait_for("B joined", 30, || async {
        match b.admin(AdminRequest::Join { code: code.clone() }).await {
            AdminResponse::Ok(_) => Some(()),
            _ => None,
        }
    })
    .await;
    wait_for("two members", 20, || async { (a.status().await.members.len() == 2).then_some(()) }).await;

    // Added on A, with A as the holder; seen on B.
    let model = real_model();
    let entry = match a.ask(add(&model, None)).await {
        NodeResponse::Added(e) => e,
        other => panic!("add: {other:?}"),
    };
    assert_eq!((entry.name.as_str(), entry.arch.as_str(), entry.n_layer), (SMOL, "llama", 30));
    assert_eq!(entry.size, std::fs::metadata(&model).unwrap().len());
    assert_eq!(entry.holders.keys().copied().collect::<Vec<_>>(), vec![a.id]);
    let rows = wait_for("the entry at B", 10, || async {
        let rows = b.models().await;
        (!rows.is_empty()).then_some(rows)
    })
    .await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].entry, entry);
    assert_eq!(rows[0].here, None, "B holds no copy yet");
    assert_eq!(a.models().await[0].here, Some(CopyState::Unchanged));

    // The same bytes added on B: one entry, two holders.
    match b.ask(add(&model, Some("another name"))).await {
        NodeResponse::Added(e) => {
            assert_eq!(e.name, SMOL, "the same content keeps its first name");
            assert_eq!(e.holders.len(), 2);
        }
        other => panic!("add at B: {other:?}"),
    }

    // Bad files are refused with the reason, and change nothing.
    let truncated = dir("truncated.gguf");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let e = error_of(a.ask(add(&truncated, None)).await);
    assert_eq!(e.kind, ErrorKind::Refused, "{e}");
    assert!(e.message.contains("truncated"), "{e}");
    let text = dir("notes.gguf");
    std::fs::write(&text, "these are not weights\n").unwrap();
    let e = error_of(a.ask(add(&text, None)).await);
    assert_eq!(e.kind, ErrorKind::Refused, "{e}");
    let e = error_of(a.ask(add(Path::new("relative/model.gguf"), None)).await);
    assert_eq!(e.kind, ErrorKind::BadRequest, "{e}");
    // Another model under a name that is taken.
    let other = dir("other.gguf");
    altered_copy(&other);
    let e = error_of(a.ask(add(&other, Some(SMOL))).await);
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    assert_eq!(a.models().await.len(), 1, "a refused file entered the catalog");

    // A file changed after adding is noticed.
    let other_entry = match a.ask(add(&other, Some("other"))).await {
        NodeResponse::Added(e) => e,
        r => panic!("add other: {r:?}"),
    };
    assert_ne!(other_entry.content_hash, entry.content_hash);
    std::fs::OpenOptions::new().append(true).open(&other).unwrap().set_len(1000).unwrap();
    let rows = a.models().await;
    let row = rows.iter().find(|r| r.entry.name == "other").unwrap();
    assert_eq!(row.here, Some(CopyState::Changed));

    // A member may read another node's catalog, not change it.
    let addr: std::net::SocketAddr = a.status().await.addr.parse().unwrap();
    let list = api::request_at(addr, a.id, b.identity(), &NodeRequest::ModelList).await.unwrap();
    assert!(matches!(list, NodeResponse::Models(r) if r.len() == 2));
    let remove = NodeRequest::ModelRemove { model: "other".into() };
    let e = error_of(api::request_at(addr, a.id, b.identity(), &remove).await.unwrap());
    assert_eq!(e.kind, ErrorKind::Forbidden);

    // Removed by its hash prefix: gone everywhere.
    match a.ask(NodeRequest::ModelRemove { model: other_entry.content_hash[..10].into() }).await {
        NodeResponse::Removed(e) => assert_eq!(e.name, "other"),
        r => panic!("remove: {r:?}"),
    }
    wait_for("removed at B", 10, || async { (b.models().await.len() == 1).then_some(()) }).await;
    let e = error_of(a.ask(NodeRequest::ModelRemove { model: "other".into() }).await);
    assert_eq!(e.kind, ErrorKind::NotFound);

    // An Ollama-style store on this machine (the test model as its blob), found and
    // imported under its Ollama name; the same bytes join the existing entry.
    let store = dir("ollama");
    let blob_hash = "0".repeat(63) + "1";
    std::fs::create_dir_all(store.join("blobs")).unwrap();
    altered_copy(&store.join("blobs").join(format!("sha256-{blob_hash}")));
    let manifest_dir = store.join("manifests/registry.ollama.ai/library/tiny");
    std::fs::create_dir_all(&manifest_dir).unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": format!("sha256:{}", "2".repeat(64)), "size": 10},
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": format!("sha256:{blob_hash}"), "size": 1}]
    });
    std::fs::write(manifest_dir.join("latest"), manifest.to_string()).unwrap();
    // SAFETY-free in practice: the only test in this binary; the node reads it per request.
    std::env::set_var("OLLAMA_MODELS", &store);
    match a.ask(NodeRequest::ModelScan { from: StoreKind::Ollama }).await {
        NodeResponse::Found { found, .. } => assert!(found.iter().any(|(n, _)| n == "ollama:tiny:latest"), "{found:?}"),
        r => panic!("scan: {r:?}"),
    }
    match a.ask(NodeRequest::ModelImport { from: StoreKind::Ollama, names: vec!["ollama:tiny:latest".into()] }).await {
        NodeResponse::Imported { added, refused } => {
            assert!(refused.is_empty(), "{refused:?}");
            assert_eq!(added.len(), 1);
            assert_eq!(added[0].name, "ollama:tiny:latest");
        }
        r => panic!("import: {r:?}"),
    }
    wait_for("imported at B", 10, || async { (b.models().await.len() == 2).then_some(()) }).await;

    b.stop().await;
    a.stop().await;
}
