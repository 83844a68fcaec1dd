//! The GGUF reader on real models, and on malformed input: every defect gives an
//! error naming the file, never a panic.

mod common;
use common::*;
use shoal_gguf::{open_model, Arch, Gguf, GgufError};
use std::path::Path;

fn parse(bytes: &[u8]) -> Result<Gguf, GgufError> {
    Gguf::parse(bytes, bytes.len() as u64, Path::new("mem.gguf"))
}

#[test]
fn reads_smollm2() {
    let (g, m) = open_model(&real_model("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    assert_eq!(m.arch, Arch::Llama);
    assert_eq!((m.n_layer, m.n_embd, m.n_vocab), (30, 576, 49152));
    assert!(m.n_ctx_train >= 2048);
    assert!(m.tied_embeddings);
    assert_eq!(m.layer_bytes.len(), 30);
    let tensor_total: u64 = g.tensors.iter().map(|t| t.bytes).sum();
    assert_eq!(m.layer_bytes.iter().sum::<u64>() + m.embd_bytes + m.output_bytes + m.other_bytes, tensor_total);
    assert!(g.data_offset + tensor_total <= g.file_size);
    assert_eq!(m.layer_period(), 1);
}

#[test]
fn reads_gemma3() {
    let (_, m) = open_model(&real_model("gemma-3-270m-q4_k_m.gguf")).unwrap();
    assert_eq!(m.arch, Arch::Gemma3);
    assert_eq!((m.n_layer, m.n_embd), (18, 640));
    assert_eq!(m.n_vocab, 262144);
    // Any boundary: shards state their layers' sliding-window pattern.
    assert_eq!(m.layer_period(), 1);
    let pattern: Vec<bool> = (0..18).map(|il| il % 6 != 5).collect();
    assert_eq!(m.swa_layers, pattern, "5 sliding layers of every 6");
}

#[test]
fn synthetic_model_round_trips() {
    let bytes = synthetic_model(4, false);
    let g = parse(&bytes).unwrap();
    assert_eq!(g.tensors.len(), 1 + 4 * 2 + 2);
    assert_eq!(g.tensors[1].layer(), Some((0, "attn_q.weight")));
}

fn assert_err(bytes: &[u8], want: &str) {
    let e = parse(bytes).expect_err("malformed input was accepted");
    let msg = e.to_string();
    assert!(msg.starts_with("mem.gguf: "), "error does not name the file: {msg}");
    assert!(msg.contains(want), "error {msg:?} does not say {want:?}");
}

#[test]
fn empty_and_truncated_files_are_refused() {
    assert_err(b"", "truncated");
    let bytes = synthetic_model(2, true);
    // Every cut inside the header, and a cut inside the tensor data.
    for cut in (0..bytes.len() - 1).step_by(7) {
        assert!(parse(&bytes[..cut]).is_err(), "file cut at {cut} of {} accepted", bytes.len());
    }
    assert_err(&bytes[..bytes.len() - 5], "truncated");
}

#[test]
fn wrong_magic_and_version_are_refused() {
    let mut b = synthetic_model(2, true);
    b[0] = b'X';
    assert_err(&b, "not a GGUF file");
    let mut b = synthetic_model(2, true);
    b[4..8].copy_from_slice(&7u32.to_le_bytes());
    assert_err(&b, "GGUF version 7");
}

#[test]
fn absurd_counts_are_refused_without_allocating() {
    let mut b = synthetic_model(2, true);
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    assert!(parse(&b).is_err());
    let mut b = synthetic_model(2, true);
    b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes()); // metadata count
    assert_err(&b, "metadata count");
    // A key length far beyond the file.
    let mut b = synthetic_model(2, true);
    b[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert_err(&b, "absurd");
}

/// Position of the tensor table entry of `name` (its name length field).
fn tensor_entry(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    bytes.windows(needle.len()).position(|w| w == needle).unwrap()
}

#[test]
fn bad_tensor_entries_are_refused() {
    let name = "blk.1.attn_q.weight";
    let at = |b: &[u8]| tensor_entry(b, name) + 8 + name.len();
    // Absurd offset.
    let mut b = synthetic_model(2, true);
    let off = at(&b) + 4 + 2 * 8 + 4;
    b[off..off + 8].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    assert_err(&b, "offset");
    // Too many dimensions.
    let mut b = synthetic_model(2, true);
    let p = at(&b);
    b[p..p + 4].copy_from_slice(&9u32.to_le_bytes());
    assert_err(&b, "dimensions");
    // A dimension of zero, and one whose product overflows.
    let mut b = synthetic_model(2, true);
    b[p + 4..p + 12].copy_from_slice(&0u64.to_le_bytes());
    assert_err(&b, "absurd dimensions");
    let mut b = synthetic_model(2, true);
    b[p + 4..p + 12].copy_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(parse(&b).is_err());
    // An unknown ggml type.
    let mut b = synthetic_model(2, true);
    let t = p + 4 + 2 * 8;
    b[t..t + 4].copy_from_slice(&40u32.to_le_bytes());
    assert_err(&b, "ggml type id 40");
}

/// The refusal of `arch` (five letters, put where the synthetic model says "llama").
fn refusal_of(arch: &[u8; 5]) -> String {
    let mut b = synthetic_model(2, true);
    let pos = b.windows(5).position(|w| w == b"llama").unwrap();
    b[pos..pos + 5].copy_from_slice(arch);
    let g = parse(&b).unwrap();
    shoal_gguf::ModelMeta::from_gguf(&g).unwrap_err().to_string()
}

#[test]
fn unknown_architecture_is_refused_by_name() {
    let e = refusal_of(b"zzzzz");
    assert!(e.contains("architecture \"zzzzz\" has not been verified"), "{e}");
    assert!(e.contains("supported: llama, command-r, deepseek2, gemma3, gpt-oss, llama4"), "{e}");
    // One Shoal knows of is refused naming the family nearest to it …
    let e = refusal_of(b"gemma");
    assert!(e.contains("has not been verified for layer splits; the closest supported family is gemma3"), "{e}");
    // … and a recurrent or hybrid one with why it cannot be split.
    for arch in [b"mamba", b"jamba"] {
        let e = refusal_of(arch);
        assert!(e.contains("recurrent (state-space or linear-attention) layers keep a state"), "{e}");
    }
}

/// llama.cpp's vocabulary-only GGUFs have no tensors, so no data section: they parse
/// (a tokenizer can be read from them), and are refused as models with the reason.
#[test]
fn a_gguf_of_no_tensors_parses_and_is_no_model() {
    let path = shoal_gguf::models_dir().join("llama.cpp-vocabs/ggml-vocab-qwen2.gguf");
    assert!(path.exists(), "{} is missing: run scripts/setup.sh", path.display());
    let g = Gguf::open(&path).unwrap();
    assert!(g.tensors.is_empty());
    assert!(g.get("tokenizer.ggml.tokens").is_some());
    let e = shoal_gguf::ModelMeta::from_gguf(&g).unwrap_err();
    assert!(e.to_string().contains("no token_embd.weight"), "{e}");
}

#[test]
fn missing_file_names_the_path() {
    let e = Gguf::open(Path::new("/nonexistent/x.gguf")).unwrap_err();
    assert!(e.to_string().starts_with("/nonexistent/x.gguf: "));
}

#[test]
fn huge_embedding_length_without_feed_forward_length_is_refused() {
    // Found by the gguf fuzz target: the default n_ff (4·n_embd) overflowed its u32.
    let mut g = parse(&synthetic_model(2, true)).unwrap();
    for (key, value) in g.metadata.iter_mut() {
        if key == "llama.embedding_length" {
            *value = shoal_gguf::Value::U32(1 << 30);
        }
    }
    assert!(!g.metadata.iter().any(|(k, _)| k == "llama.feed_forward_length"));
    let e = shoal_gguf::ModelMeta::from_gguf(&g).unwrap_err();
    assert!(e.to_string().contains("absurd sizes") && e.to_string().contains("n_embd 1073741824"), "{e}");
}
