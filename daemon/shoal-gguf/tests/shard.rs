//! Shard building and the shard cache: contents, atomicity, and detection of torn or
//! corrupted files.

mod common;
use common::*;
use shoal_gguf::shard::{manifest_path, read_manifest, write_shard, KEY_SOURCE_LAYERS};
use shoal_gguf::{open_model, Gguf, ShardCache, Value};
use shoal_types::LayerRange;
use std::fs;

fn tensor_bytes(g: &Gguf, name: &str) -> Vec<u8> {
    let t = g.tensor(name).unwrap_or_else(|| panic!("no tensor {name}"));
    let all = fs::read(&g.path).unwrap();
    all[(g.data_offset + t.offset) as usize..][..t.bytes as usize].to_vec()
}

#[test]
fn shard_holds_the_range_renumbered() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "m.gguf", &synthetic_model(6, false));
    let (g, meta) = open_model(&src).unwrap();
    let dest = dir.path().join("s.gguf");
    let m = write_shard(&g, &meta, LayerRange::new(2, 5), &dest).unwrap();
    assert_eq!(read_manifest(&dest), Some(m.clone()));
    assert_eq!(fs::metadata(&dest).unwrap().len(), m.bytes);

    let (s, smeta) = open_model(&dest).unwrap();
    assert_eq!(smeta.n_layer, 3);
    assert_eq!(s.get("llama.block_count"), Some(&Value::U32(3)));
    assert_eq!(
        s.get("llama.attention.head_count_kv"),
        g.get("llama.attention.head_count_kv")
            .map(|v| match v {
                Value::Array(t, items) => Value::Array(*t, items[2..5].to_vec()),
                _ => unreachable!(),
            })
            .as_ref()
    );
    assert_eq!(s.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.tokens"));
    assert!(s.get(KEY_SOURCE_LAYERS).is_some());
    for (new, old) in [(0, 2), (1, 3), (2, 4)] {
        for part in ["attn_q.weight", "attn_norm.weight"] {
            assert_eq!(tensor_bytes(&s, &format!("blk.{new}.{part}")), tensor_bytes(&g, &format!("blk.{old}.{part}")));
        }
    }
    assert!(s.tensor("blk.3.attn_q.weight").is_none());
    assert_eq!(tensor_bytes(&s, "output_norm.weight"), tensor_bytes(&g, "output_norm.weight"));
    // A middle stage never reads the embedding or the LM head: they are zeros.
    for hole in ["token_embd.weight", "output.weight"] {
        assert!(tensor_bytes(&s, hole).iter().all(|&b| b == 0), "{hole} should be a hole");
    }
}

#[test]
fn first_and_tail_shards_keep_the_tensors_they_use() {
    let dir = tempfile::tempdir().unwrap();
    for tied in [false, true] {
        let src = write(dir.path(), "m.gguf", &synthetic_model(4, tied));
        let (g, meta) = open_model(&src).unwrap();
        let first = dir.path().join("first.gguf");
        write_shard(&g, &meta, LayerRange::new(0, 2), &first).unwrap();
        let f = Gguf::open(&first).unwrap();
        assert_eq!(tensor_bytes(&f, "token_embd.weight"), tensor_bytes(&g, "token_embd.weight"));
        let tail = dir.path().join("tail.gguf");
        write_shard(&g, &meta, LayerRange::new(2, 4), &tail).unwrap();
        let t = Gguf::open(&tail).unwrap();
        if tied {
            // The tied LM head is the embedding: the tail needs it.
            assert_eq!(tensor_bytes(&t, "token_embd.weight"), tensor_bytes(&g, "token_embd.weight"));
        } else {
            assert!(tensor_bytes(&t, "token_embd.weight").iter().all(|&b| b == 0));
            assert_eq!(tensor_bytes(&t, "output.weight"), tensor_bytes(&g, "output.weight"));
            assert!(tensor_bytes(&f, "output.weight").iter().all(|&b| b == 0));
        }
    }
}

#[test]
fn bad_ranges_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "m.gguf", &synthetic_model(4, true));
    let (g, meta) = open_model(&src).unwrap();
    for r in [LayerRange::new(2, 2), LayerRange::new(3, 9)] {
        let e = write_shard(&g, &meta, r, &dir.path().join("x.gguf")).unwrap_err();
        assert!(e.to_string().contains("cannot build shard"), "{e}");
    }
    assert!(!dir.path().join("x.gguf").exists());
}

#[test]
fn cache_reuses_verified_shards_and_rebuilds_corrupted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "m.gguf", &synthetic_model(6, false));
    let (g, meta) = open_model(&src).unwrap();
    let cache = ShardCache::new(dir.path().join("cache"));
    let r = LayerRange::new(2, 4);

    let a = cache.get_or_build(&src, &g, &meta, r).unwrap();
    assert!(a.built);
    let good = fs::read(&a.path).unwrap();
    assert!(!cache.get_or_build(&src, &g, &meta, r).unwrap().built, "a valid shard should be reused");

    // One flipped byte in the middle of a tensor: caught by the hash, rebuilt.
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    fs::write(&a.path, &bad).unwrap();
    let b = cache.get_or_build(&src, &g, &meta, r).unwrap();
    assert!(b.built, "a corrupted shard must be rebuilt");
    assert_eq!(fs::read(&b.path).unwrap(), good);

    // Truncated shard with its manifest: rebuilt.
    fs::write(&a.path, &good[..good.len() - 100]).unwrap();
    assert!(cache.get_or_build(&src, &g, &meta, r).unwrap().built);
    assert_eq!(fs::read(&a.path).unwrap(), good);

    // The whole model is the source itself, not a copy.
    assert_eq!(cache.get_or_build(&src, &g, &meta, LayerRange::new(0, 6)).unwrap().path, src);
}

#[test]
fn killed_write_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "m.gguf", &synthetic_model(6, false));
    let (g, meta) = open_model(&src).unwrap();
    let cache = ShardCache::new(dir.path().join("cache"));
    let r = LayerRange::new(0, 3);
    let path = cache.shard_path(&src, r).unwrap();

    // A write killed half way leaves a truncated temporary file and no shard.
    let full = cache.get_or_build(&src, &g, &meta, r).unwrap();
    let good = fs::read(&full.path).unwrap();
    fs::remove_file(&path).unwrap();
    fs::remove_file(manifest_path(&path)).unwrap();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp-12345");
    fs::write(&tmp, &good[..good.len() / 2]).unwrap();
    let again = cache.get_or_build(&src, &g, &meta, r).unwrap();
    assert!(again.built);
    assert_eq!(fs::read(&again.path).unwrap(), good);

    // Killed after the rename but before the manifest: the shard is not trusted.
    fs::remove_file(manifest_path(&path)).unwrap();
    fs::write(&path, &good[..good.len() / 2]).unwrap();
    let third = cache.get_or_build(&src, &g, &meta, r).unwrap();
    assert!(third.built);
    assert_eq!(fs::read(&third.path).unwrap(), good);
}

#[test]
fn changed_source_gets_a_new_shard() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "m.gguf", &synthetic_model(4, false));
    let cache = ShardCache::new(dir.path().join("cache"));
    let before = cache.shard_path(&src, LayerRange::new(0, 2)).unwrap();
    write(dir.path(), "m.gguf", &synthetic_model(4, true));
    assert_ne!(cache.shard_path(&src, LayerRange::new(0, 2)).unwrap(), before);
}

#[cfg(unix)]
#[test]
fn middle_shard_of_a_real_model_is_sparse() {
    use std::os::unix::fs::MetadataExt;
    let src = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let (g, meta) = open_model(&src).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("mid.gguf");
    write_shard(&g, &meta, LayerRange::new(10, 20), &dest).unwrap();
    let md = fs::metadata(&dest).unwrap();
    let on_disk = md.blocks() * 512;
    // The embedding (not needed in the middle) takes no disk space.
    assert!(on_disk + meta.embd_bytes / 2 < md.len(), "shard of {} bytes uses {on_disk} on disk", md.len());
    assert_eq!(open_model(&dest).unwrap().1.n_layer, 10);
}

/// Every chunk the manifest lists matches the file: holes are zeros, data chunks hash
/// to their entry; and the manifest describes itself consistently.
fn assert_chunks_match(path: &std::path::Path, m: &shoal_gguf::Manifest) {
    use shoal_gguf::Chunk;
    m.check().unwrap();
    let bytes = fs::read(path).unwrap();
    assert_eq!(bytes.len() as u64, m.bytes);
    for (i, c) in m.chunks.iter().enumerate() {
        let (off, len) = m.chunk_span(i).unwrap();
        let data = &bytes[off as usize..(off + len) as usize];
        match c {
            Chunk::Hole => assert!(data.iter().all(|&b| b == 0), "chunk {i} flagged as a hole holds data"),
            Chunk::Data(h) => {
                assert_eq!(blake3::hash(data), *h, "chunk {i} hash");
                assert!(data.iter().any(|&b| b != 0), "chunk {i} is all zeros but not flagged as a hole");
            }
        }
    }
    assert!(m.chunk_span(m.chunks.len()).is_none());
}

#[test]
fn manifest_records_chunk_hashes_and_holes_at_build_time() {
    let src = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let (g, meta) = open_model(&src).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hash = shoal_gguf::SourceHash::of_file(&src).unwrap();
    let mid = dir.path().join("mid.gguf");
    let m = shoal_gguf::shard::write_shard_of(&g, &meta, LayerRange::new(10, 20), &mid, Some(hash)).unwrap();
    assert_eq!(m.source, Some(hash));
    assert_eq!(read_manifest(&mid), Some(m.clone()));
    assert_chunks_match(&mid, &m);
    // The embedding hole spans whole chunks: they travel as markers.
    assert!(m.data_bytes() + meta.embd_bytes / 2 < m.bytes, "data {} of {}", m.data_bytes(), m.bytes);

    // A synthetic model smaller than one chunk: one data chunk, short.
    let small = write(dir.path(), "m.gguf", &synthetic_model(6, false));
    let (g, meta) = open_model(&small).unwrap();
    let m = write_shard(&g, &meta, LayerRange::new(2, 4), &dir.path().join("s.gguf")).unwrap();
    assert_eq!(m.chunks.len(), 1);
    assert_chunks_match(&dir.path().join("s.gguf"), &m);
}

#[test]
fn manifests_without_chunks_still_read_and_fail_the_check() {
    let old = r#"{"format":1,"layers":{"start":2,"end":4},"bytes":10,"blake3":"00"}"#;
    let m: shoal_gguf::Manifest = serde_json::from_str(old).unwrap();
    assert!(m.chunks.is_empty() && m.source.is_none());
    assert!(m.check().is_err());
}

#[test]
fn content_keyed_cache_builds_once_and_reuses() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "m.gguf", &synthetic_model(6, false));
    let hash = shoal_gguf::SourceHash::of_file(&src).unwrap();
    let cache = ShardCache::new(dir.path().join("cache"));
    let r = LayerRange::new(2, 4);
    assert!(cache.cached(&hash, r).unwrap().is_none());
    let (a, m) = cache.build_for(&hash, &src, r).unwrap();
    assert!(a.built);
    assert_eq!(a.path, cache.content_path(&hash, r));
    assert_eq!(cache.content_manifest(&hash, r), Some(m.clone()));
    let (b, _) = cache.build_for(&hash, &src, r).unwrap();
    assert!(!b.built);
    // Another source hash does not match this shard.
    assert!(cache.cached(&shoal_gguf::SourceHash([7; 32]), r).unwrap().is_none());
    assert!(cache.build_for(&hash, &src, LayerRange::new(3, 9)).is_err());
    // Hex round trip.
    assert_eq!(hash.to_hex().parse::<shoal_gguf::SourceHash>().unwrap(), hash);
}
