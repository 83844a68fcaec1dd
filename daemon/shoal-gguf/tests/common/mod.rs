//! Builds small synthetic GGUF models for the tests (real models are tested too,
//! where the test needs what only a real file has).
#![allow(dead_code)]

use shoal_gguf::{write_header, GgmlType, TensorInfo, Value, ValueType};
use std::path::{Path, PathBuf};

pub const N_EMBD: u64 = 32;
pub const N_VOCAB: u64 = 10;

/// A llama-arch GGUF with `n_layer` blocks of two F32 tensors each, whose bytes are
/// distinct per tensor so that a misplaced copy is visible.
pub fn synthetic_model(n_layer: u32, tied: bool) -> Vec<u8> {
    synthetic_model_with(n_layer, tied, |_| {})
}

/// [`synthetic_model`] with its metadata changed by `edit` first.
pub fn synthetic_model_with(n_layer: u32, tied: bool, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> Vec<u8> {
    let mut metadata = vec![
        ("general.architecture".to_string(), Value::String(b"llama".to_vec())),
        ("general.name".to_string(), Value::String(b"synthetic".to_vec())),
        ("llama.block_count".to_string(), Value::U32(n_layer)),
        ("llama.embedding_length".to_string(), Value::U32(N_EMBD as u32)),
        ("llama.context_length".to_string(), Value::U32(128)),
        ("llama.attention.head_count".to_string(), Value::U32(4)),
        // A per-layer array: must be sliced in a shard.
        (
            "llama.attention.head_count_kv".to_string(),
            Value::Array(ValueType::U32, (0..n_layer).map(|i| Value::U32(1 + i % 2)).collect()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(
                ValueType::String,
                (0..N_VOCAB).map(|i| Value::String(format!("t{i}").into_bytes())).collect(),
            ),
        ),
    ];
    edit(&mut metadata);
    let f32t = GgmlType::from_id(0).unwrap();
    let mut specs: Vec<(String, Vec<u64>)> = vec![("token_embd.weight".into(), vec![N_EMBD, N_VOCAB])];
    for i in 0..n_layer {
        specs.push((format!("blk.{i}.attn_q.weight"), vec![N_EMBD, N_EMBD]));
        specs.push((format!("blk.{i}.attn_norm.weight"), vec![N_EMBD]));
    }
    specs.push(("output_norm.weight".into(), vec![N_EMBD]));
    if !tied {
        specs.push(("output.weight".into(), vec![N_EMBD, N_VOCAB]));
    }
    let mut tensors = Vec::new();
    let mut off = 0;
    for (name, dims) in specs {
        let bytes = dims.iter().product::<u64>() * 4;
        tensors.push(TensorInfo { name, dims, ggml_type: f32t, offset: off, bytes });
        off = (off + bytes).div_ceil(32) * 32;
    }
    let mut out = Vec::new();
    write_header(&mut out, &metadata, &tensors, 32).unwrap();
    let base = out.len();
    for (k, t) in tensors.iter().enumerate() {
        out.resize(base + t.offset as usize, 0);
        out.extend((0..t.bytes).map(|b| (k as u8).wrapping_mul(31).wrapping_add((b % 251) as u8) | 1));
    }
    out
}

/// Set metadata `key` to `value`, replacing it where present.
pub fn set(metadata: &mut Vec<(String, Value)>, key: &str, value: Value) {
    metadata.retain(|(k, _)| k != key);
    metadata.push((key.to_string(), value));
}

/// A header of `metadata` and `tensors` (offsets as given) without tensor data.
pub fn header_only(metadata: &[(String, Value)], tensors: &[TensorInfo]) -> Vec<u8> {
    let mut out = Vec::new();
    write_header(&mut out, metadata, tensors, 32).unwrap();
    out
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// The cached test models (see scripts/setup.sh); a test that needs one fails with
/// instructions when it is missing rather than passing silently.
pub fn real_model(file: &str) -> PathBuf {
    let p = shoal_gguf::models_dir().join(file);
    assert!(p.exists(), "test model {} is missing: run scripts/setup.sh (or set SHOAL_MODELS)", p.display());
    p
}
