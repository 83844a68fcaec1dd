//! Scans of an Ollama store, a Hugging Face cache and an LM Studio folder laid out in
//! a temp folder as those tools lay them out, with the real test model as the file:
//! the right names and paths are found, and what cannot be used is skipped with a
//! reason, never a panic.

mod common;

use common::{link_model, SMOL};
use shoal_catalog::{describe, scan_hf_cache, scan_lmstudio, scan_ollama, Scan, SkipReason, Source};
use std::fs;
use std::path::{Path, PathBuf};

/// A manifest as Ollama writes it (docker v2 schema, config + layers).
fn ollama_manifest(model_digest: &str) -> String {
    format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
"config":{{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"sha256:{cfg}","size":487}},
"layers":[
 {{"mediaType":"application/vnd.ollama.image.model","digest":"{model_digest}","size":98362432}},
 {{"mediaType":"application/vnd.ollama.image.template","digest":"sha256:{tpl}","size":1615}},
 {{"mediaType":"application/vnd.ollama.image.license","digest":"sha256:{tpl}","size":11343}}]}}"#,
        cfg = "d9".repeat(32),
        tpl = "1e".repeat(32)
    )
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

fn names(scan: &Scan) -> Vec<&str> {
    scan.found.iter().map(|c| c.name.as_str()).collect()
}

fn skipped<'a>(scan: &'a Scan, path: &Path) -> &'a SkipReason {
    &scan
        .skipped
        .iter()
        .find(|s| s.path == path)
        .unwrap_or_else(|| panic!("{} not skipped: {scan:#?}", path.display()))
        .reason
}

#[test]
fn ollama_scan_finds_the_model_blob_by_manifest_and_names_it_model_tag() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let digest = "3f".repeat(32);
    let blob = r.join("blobs").join(format!("sha256-{digest}"));
    link_model(&blob);
    let lib = r.join("manifests/registry.ollama.ai/library");
    write(&lib.join("smollm2/135m"), &ollama_manifest(&format!("sha256:{digest}")));
    // A second tag of the same blob: proposed once.
    write(&lib.join("smollm2/latest"), &ollama_manifest(&format!("sha256:{digest}")));
    // Other namespaces and registries, with blobs of their own.
    let other = "4a".repeat(32);
    write(&r.join("blobs").join(format!("sha256-{other}")), "not scanned for content");
    write(&r.join("manifests/registry.ollama.ai/someone/mine/v1"), &ollama_manifest(&format!("sha256:{other}")));
    let third = "5b".repeat(32);
    write(&r.join("blobs").join(format!("sha256-{third}")), "x");
    write(&r.join("manifests/hf.co/bartowski/SmolLM2-GGUF/Q4_1"), &ollama_manifest(&format!("sha256:{third}")));

    let scan = scan_ollama(r);
    assert_eq!(
        names(&scan),
        ["ollama:hf.co/bartowski/SmolLM2-GGUF:Q4_1", "ollama:smollm2:135m", "ollama:someone/mine:v1"]
    );
    let smol = scan.found.iter().find(|c| c.name == "ollama:smollm2:135m").unwrap();
    assert_eq!((smol.path.as_path(), smol.source), (blob.as_path(), Source::Ollama));
    assert!(
        matches!(skipped(&scan, &lib.join("smollm2/latest")), SkipReason::SameFileAs(n) if n == "ollama:smollm2:135m")
    );
    // The candidate is the real model: describe() takes it.
    let d = describe(&smol.path).unwrap();
    assert_eq!((d.entry.arch.as_str(), d.entry.n_layer), ("llama", 30));
}

#[test]
fn ollama_scan_skips_malformed_manifests_with_reasons() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let lib = r.join("manifests/registry.ollama.ai/library");
    let good = "6c".repeat(32);
    write(&r.join("blobs").join(format!("sha256-{good}")), "blob");
    write(&lib.join("good/latest"), &ollama_manifest(&format!("sha256:{good}")));
    write(&lib.join("broken/latest"), "{\"layers\": [");
    write(&lib.join("wrongshape/latest"), "{\"layers\": 3}");
    write(
        &lib.join("adapter/latest"),
        r#"{"layers":[{"mediaType":"application/vnd.ollama.image.adapter","digest":"sha256:00","size":1}]}"#,
    );
    write(&lib.join("escape/latest"), &ollama_manifest("sha256:../../../../etc/passwd"));
    write(&lib.join("gone/latest"), &ollama_manifest(&format!("sha256:{}", "7d".repeat(32))));
    // A folder where a tag file belongs, and a file where a model folder belongs.
    fs::create_dir_all(lib.join("good/odd-dir")).unwrap();
    write(&lib.join("stray-file"), "x");

    let scan = scan_ollama(r);
    assert_eq!(names(&scan), ["ollama:good:latest"]);
    assert!(matches!(skipped(&scan, &lib.join("broken/latest")), SkipReason::MalformedManifest(_)));
    assert!(matches!(skipped(&scan, &lib.join("wrongshape/latest")), SkipReason::MalformedManifest(_)));
    assert!(matches!(skipped(&scan, &lib.join("adapter/latest")), SkipReason::NoModelLayer));
    assert!(matches!(skipped(&scan, &lib.join("escape/latest")), SkipReason::BadDigest(_)));
    assert!(matches!(skipped(&scan, &lib.join("gone/latest")), SkipReason::MissingBlob(_)));
    for s in &scan.skipped {
        assert!(!s.reason.to_string().is_empty());
    }
}

#[test]
fn scans_of_missing_folders_find_nothing_and_skip_nothing() {
    let root = tempfile::tempdir().unwrap();
    let none = root.path().join("absent");
    for scan in [scan_ollama(&none), scan_hf_cache(&none), scan_lmstudio(&none)] {
        assert!(scan.found.is_empty() && scan.skipped.is_empty(), "{scan:?}");
    }
}

#[cfg(unix)]
/// A hub cache repo folder with `file` in snapshot `rev`, as a symlink into blobs/.
fn hf_file(repo: &Path, rev: &str, file: &str, blob_name: &str) -> PathBuf {
    let snap = repo.join("snapshots").join(rev).join(file);
    fs::create_dir_all(snap.parent().unwrap()).unwrap();
    let depth = file.matches('/').count();
    let target = PathBuf::from("../".repeat(2 + depth)).join("blobs").join(blob_name);
    std::os::unix::fs::symlink(target, &snap).unwrap();
    snap
}

#[cfg(unix)]
#[test]
fn hf_cache_scan_names_files_org_repo_path_through_snapshot_symlinks() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let repo = r.join("models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF");
    let (main_rev, old_rev) = ("a".repeat(40), "b".repeat(40));
    write(&repo.join("refs/main"), &main_rev);
    let blob = repo.join("blobs").join("e3b0c44298fc1c149afbf4c8996fb924");
    link_model(&blob);
    let snap = hf_file(&repo, &main_rev, SMOL, "e3b0c44298fc1c149afbf4c8996fb924");
    // The same blob in an older revision: proposed once, under main's name.
    let old_same = hf_file(&repo, &old_rev, SMOL, "e3b0c44298fc1c149afbf4c8996fb924");
    // A different file only in the older revision, in a subfolder: named with @rev.
    write(&repo.join("blobs/0ld"), "old bytes");
    hf_file(&repo, &old_rev, "q8/old.gguf", "0ld");
    // Things to skip: a dangling link, a split part, a projector, a non-GGUF file.
    let dangling = hf_file(&repo, &main_rev, "gone.gguf", "missing-blob");
    write(&repo.join("blobs/p1"), "x");
    let part = hf_file(&repo, &main_rev, "big-00001-of-00002.gguf", "p1");
    write(&repo.join("blobs/mm"), "x");
    let mmproj = hf_file(&repo, &main_rev, "mmproj-model-f16.gguf", "mm");
    write(&repo.join("blobs/cfg"), "{}");
    hf_file(&repo, &main_rev, "config.json", "cfg");
    // Datasets, spaces and lock folders hold no models.
    write(&r.join("datasets--x--y/snapshots/c/data.gguf"), "x");
    write(&r.join(".locks/models--a--b/x.lock"), "");

    let scan = scan_hf_cache(r);
    assert_eq!(
        names(&scan),
        [
            "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf".to_owned(),
            format!("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF@{old_rev}/q8/old.gguf"),
        ]
    );
    let c = &scan.found[0];
    assert_eq!((c.path.as_path(), c.source), (snap.as_path(), Source::HfCache));
    assert_eq!(fs::canonicalize(&c.path).unwrap(), fs::canonicalize(&blob).unwrap());
    assert!(matches!(skipped(&scan, &old_same), SkipReason::SameFileAs(_)));
    assert!(matches!(skipped(&scan, &dangling), SkipReason::DanglingSymlink));
    assert!(matches!(skipped(&scan, &part), SkipReason::SplitGguf));
    assert!(matches!(skipped(&scan, &mmproj), SkipReason::Projector));
    assert_eq!(scan.skipped.len(), 4, "{scan:#?}");
    let d = describe(&c.path).unwrap();
    assert_eq!(d.entry.quantisation, "Q4_1");
    // The symlink is what is recorded: the name users know, resolved at open.
    assert_eq!(d.holder.path, snap.to_str().unwrap());
}

#[test]
fn lmstudio_scan_finds_publisher_repo_file() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let dir = r.join("lmstudio-community/SmolLM2-135M-Instruct-GGUF");
    let model = dir.join(SMOL);
    link_model(&model);
    write(&dir.join("README.md"), "# readme");
    write(&dir.join("mmproj-SmolLM2-F16.gguf"), "x");
    // Files at the wrong depth are not LM Studio models.
    write(&r.join("loose.gguf"), "x");
    write(&r.join("lmstudio-community/loose.gguf"), "x");

    let scan = scan_lmstudio(r);
    assert_eq!(names(&scan), ["lmstudio-community/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf"]);
    assert_eq!((scan.found[0].path.as_path(), scan.found[0].source), (model.as_path(), Source::LmStudio));
    assert!(matches!(skipped(&scan, &dir.join("mmproj-SmolLM2-F16.gguf")), SkipReason::Projector));
    assert_eq!(describe(&scan.found[0].path).unwrap().entry.n_layer, 30);
}
