//! describe() on the real test model and on files it must refuse, and
//! check_unchanged() noticing a file that changed after it was added.

mod common;

use common::{copy_model, real_model, SMOL};
use shoal_catalog::{check_unchanged, describe, hash_file, CatalogError, Verified};
use shoal_types::NodeId;
use std::fs::{self, File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

#[test]
fn describe_reads_the_real_model_facts_and_hashes_the_whole_file() {
    let path = real_model();
    let d = describe(&path).unwrap();
    let e = &d.entry;
    assert_eq!(e.name, SMOL);
    assert_eq!(e.arch, "llama");
    assert_eq!(e.n_layer, 30);
    assert_eq!(e.context_length, 8192);
    assert_eq!(e.quantisation, "Q4_1");
    assert_eq!(e.layer_period, 1);
    let bytes = fs::read(&path).unwrap();
    assert_eq!(e.size, bytes.len() as u64);
    assert_eq!(e.content_hash, blake3::hash(&bytes).to_hex().to_string());
    // The header's own hash: what a node without a copy checks a fetched header
    // against (security review F8).
    let data_offset = shoal_gguf::open_model(&path).unwrap().0.data_offset as usize;
    assert!(data_offset > 1000 && data_offset < bytes.len());
    assert_eq!(e.header_hash.as_deref(), Some(blake3::hash(&bytes[..data_offset]).to_hex().as_str()));
    assert!(e.holders.is_empty());
    assert_eq!(d.holder.path, path.to_str().unwrap());
    assert_eq!(d.holder.size, e.size);
    let mtime = fs::metadata(&path).unwrap().modified().unwrap().duration_since(UNIX_EPOCH).unwrap();
    assert_eq!(d.holder.mtime_ns, mtime.as_nanos() as u64);

    let node = NodeId([3; 32]);
    let entry = d.clone().into_entry(node);
    entry.validate().unwrap();
    assert_eq!(entry.holders[&node], d.holder);
    // Small enough for a cluster state of 2 MiB to hold hundreds.
    assert!(serde_json::to_vec(&entry).unwrap().len() < 1024);
}

#[cfg(unix)]
#[test]
fn describe_makes_a_relative_path_absolute() {
    let dir = tempfile::tempdir().unwrap();
    let abs = dir.path().join(SMOL);
    common::link_model(&abs);
    // The same file reached through `..`s from the working directory, without
    // creating anything inside the repository.
    let cwd = std::env::current_dir().unwrap();
    let mut rel = std::path::PathBuf::new();
    cwd.components().skip(1).for_each(|_| rel.push(".."));
    rel.push(abs.strip_prefix("/").unwrap());
    assert!(rel.is_relative());
    let d = describe(&rel).unwrap();
    assert!(Path::new(&d.holder.path).is_absolute(), "{}", d.holder.path);
    assert_eq!(fs::canonicalize(&d.holder.path).unwrap(), fs::canonicalize(&abs).unwrap());
}

#[test]
fn a_truncated_copy_is_refused_as_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    let bytes = fs::read(real_model()).unwrap();
    fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = describe(&cut).unwrap_err();
    assert!(matches!(err, CatalogError::Truncated { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("cut.gguf") && msg.contains("truncated"), "{msg}");
}

#[test]
fn a_file_cut_inside_its_header_is_refused_as_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("header.gguf");
    let bytes = fs::read(real_model()).unwrap();
    fs::write(&cut, &bytes[..4096]).unwrap();
    assert!(matches!(describe(&cut), Err(CatalogError::Truncated { .. })));
}

#[test]
fn a_non_gguf_file_is_refused_with_what_it_starts_with() {
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("model.gguf");
    fs::write(&html, "<!DOCTYPE html><html>Not Found</html>").unwrap();
    let err = describe(&html).unwrap_err();
    assert!(matches!(err, CatalogError::NotGguf { .. }), "{err:?}");
    assert!(err.to_string().contains("not a GGUF file"), "{err}");

    let empty = dir.path().join("empty.gguf");
    fs::write(&empty, "").unwrap();
    let err = describe(&empty).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
}

#[test]
fn an_unsupported_architecture_is_refused_as_unsupported() {
    // The real model with its architecture renamed in place: "llama" -> "llamz" (same
    // length, so the header stays well-formed).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.gguf");
    let mut bytes = fs::read(real_model()).unwrap();
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    // After the key: a u32 value type and a u64 string length, then the string.
    let value = at + key.len() + 4 + 8;
    assert_eq!(&bytes[value..value + 5], b"llama");
    bytes[value + 4] = b'z';
    fs::write(&path, &bytes).unwrap();
    let err = describe(&path).unwrap_err();
    assert!(matches!(err, CatalogError::Unsupported { .. }), "{err:?}");
    assert!(err.to_string().contains("llamz"), "{err}");
}

#[test]
fn a_missing_file_is_refused_as_unreadable() {
    let err = describe(Path::new("/nonexistent/shoal/model.gguf")).unwrap_err();
    assert!(matches!(err, CatalogError::Unreadable { .. }), "{err:?}");
}

/// Set the file's modification time `secs` seconds away from `from`.
fn set_mtime(path: &Path, from: u64, secs: u64) {
    let t = UNIX_EPOCH + Duration::from_nanos(from) + Duration::from_secs(secs);
    File::options().write(true).open(path).unwrap().set_modified(t).unwrap();
}

#[test]
fn an_untouched_file_passes_the_fast_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SMOL);
    common::link_model(&path);
    let d = describe(&path).unwrap();
    assert_eq!(check_unchanged(&d.entry, &d.holder).unwrap(), Verified::Unchanged);
}

#[test]
fn same_size_different_bytes_with_a_new_mtime_is_refused_as_changed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SMOL);
    copy_model(&path);
    let d = describe(&path).unwrap();
    let mut f = OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(d.entry.size / 2)).unwrap();
    f.write_all(b"changed!").unwrap();
    drop(f);
    set_mtime(&path, d.holder.mtime_ns, 5);
    assert_eq!(fs::metadata(&path).unwrap().len(), d.entry.size);
    let err = check_unchanged(&d.entry, &d.holder).unwrap_err();
    assert!(matches!(err, CatalogError::Changed { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("changed since it was added") && msg.contains("content hash"), "{msg}");
    assert!(msg.contains("add it to the catalog again"), "{msg}");
}

#[test]
fn a_size_change_is_refused_as_changed_without_rehashing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SMOL);
    copy_model(&path);
    let d = describe(&path).unwrap();
    OpenOptions::new().append(true).open(&path).unwrap().write_all(b"x").unwrap();
    // Even with the time put back, a size change alone refuses it.
    set_mtime(&path, d.holder.mtime_ns, 0);
    let err = check_unchanged(&d.entry, &d.holder).unwrap_err();
    assert!(matches!(err, CatalogError::Changed { ref what, .. } if what.contains("size")), "{err:?}");
}

#[test]
fn a_touched_but_identical_file_is_rehashed_and_accepted_with_its_new_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SMOL);
    copy_model(&path);
    let d = describe(&path).unwrap();
    set_mtime(&path, d.holder.mtime_ns, 7);
    let Verified::Rehashed(h) = check_unchanged(&d.entry, &d.holder).unwrap() else { panic!("expected a re-hash") };
    assert_eq!(h.mtime_ns, d.holder.mtime_ns + 7_000_000_000);
    assert_eq!(h.size, d.holder.size);
    // Recorded, the new time makes the next check fast again.
    assert_eq!(check_unchanged(&d.entry, &h).unwrap(), Verified::Unchanged);
}

#[test]
fn a_removed_file_fails_the_check_as_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SMOL);
    common::link_model(&path);
    let d = describe(&path).unwrap();
    fs::remove_file(&path).unwrap();
    assert!(matches!(check_unchanged(&d.entry, &d.holder), Err(CatalogError::Unreadable { .. })));
}

#[test]
fn hash_file_matches_describe() {
    let d = describe(&real_model()).unwrap();
    assert_eq!(hash_file(&real_model()).unwrap(), d.entry.content_hash);
}
