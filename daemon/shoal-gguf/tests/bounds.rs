//! The GGUF reader's bounds on crafted files: the memory parsed values take is
//! counted (not just their bytes in the file), many keys are checked for duplicates
//! without a quadratic scan, and sizes derived from the file's numbers never overflow.

mod common;
use common::*;
use shoal_gguf::{
    header_memory_budget, GgmlType, Gguf, GgufError, ModelMeta, TensorInfo, Value, ValueType, MAX_HEADER_MEMORY,
    MIN_HEADER_MEMORY,
};
use std::path::Path;

fn parse(bytes: &[u8]) -> Result<Gguf, GgufError> {
    Gguf::parse(bytes, bytes.len() as u64, Path::new("mem.gguf"))
}

fn u8_array(n: usize) -> Vec<(String, Value)> {
    vec![("x.bytes".to_string(), Value::Array(ValueType::U8, vec![Value::U8(7); n]))]
}

#[test]
fn small_file_with_a_huge_u8_array_is_refused_for_its_memory() {
    // 2 Mi one-byte elements: a 2 MiB file, but 64 MiB of `Value`s, which is more than
    // 16 bytes of memory per byte of file (and more than the 16 MiB floor).
    let bytes = header_only(&u8_array(2 << 20), &[]);
    assert!(bytes.len() < (2 << 20) + 4096);
    let e = parse(&bytes).expect_err("a 2 MiB file was allowed 64 MiB of memory");
    let m = e.to_string();
    assert!(m.contains("more than") && m.contains("MiB of memory") && m.contains("\"x.bytes\""), "{m}");
    // The same array of 256 Ki elements (8 MiB of memory) is within the floor.
    let g = parse(&header_only(&u8_array(256 << 10), &[])).unwrap();
    assert!(matches!(g.get("x.bytes"), Some(Value::Array(ValueType::U8, v)) if v.len() == 256 << 10));
}

#[test]
fn header_memory_budget_is_bounded_and_grows_with_the_file() {
    assert_eq!(header_memory_budget(0), MIN_HEADER_MEMORY);
    assert_eq!(header_memory_budget(1 << 20), MIN_HEADER_MEMORY);
    assert_eq!(header_memory_budget(2 << 20), 32 << 20);
    assert_eq!(header_memory_budget(1 << 40), MAX_HEADER_MEMORY);
    assert_eq!(header_memory_budget(u64::MAX), MAX_HEADER_MEMORY);
}

#[test]
fn many_distinct_keys_parse_and_a_duplicate_key_is_refused() {
    // 30k keys: a scan of the keys before each one would compare 450M pairs.
    let many = |dup: bool| {
        synthetic_model_with(2, true, |m| {
            for i in 0..30_000 {
                m.push((format!("x.key.{i}"), Value::U32(i)));
            }
            if dup {
                m.push(("x.key.17".to_string(), Value::U32(0)));
            }
        })
    };
    let g = parse(&many(false)).unwrap();
    assert_eq!(g.get("x.key.29999"), Some(&Value::U32(29_999)));
    let e = parse(&many(true)).unwrap_err();
    assert!(e.to_string().contains("duplicate metadata key \"x.key.17\""), "{e}");
}

#[test]
fn tensor_size_near_u64_max_does_not_overflow_the_alignment() {
    // An F64 tensor of 2^61 - 1 elements takes 2^64 - 8 bytes: its end fits a u64,
    // but rounding it up to the alignment does not.
    let f64t = GgmlType::from_id(28).unwrap();
    let t = TensorInfo { name: "x.weight".into(), dims: vec![(1 << 61) - 1], ggml_type: f64t, offset: 0, bytes: 0 };
    let e = parse(&header_only(&[], &[t])).unwrap_err();
    assert!(e.to_string().contains("absurd data offset"), "{e}");
}

fn meta_of(bytes: &[u8]) -> Result<ModelMeta, GgufError> {
    ModelMeta::from_gguf(&parse(bytes).unwrap())
}

#[test]
fn huge_embedding_length_without_ff_width_is_refused_not_overflowed() {
    // No feed_forward_length: the default 4 × n_embd used to overflow a u32.
    let b = synthetic_model_with(2, true, |m| set(m, "llama.embedding_length", Value::U32(1 << 30)));
    let e = meta_of(&b).unwrap_err();
    assert!(e.to_string().contains("absurd sizes"), "{e}");
}

#[test]
fn huge_head_widths_are_refused_not_overflowed() {
    // key + value width used to overflow a u32 in the KV-cache size.
    let b = synthetic_model_with(2, true, |m| {
        set(m, "llama.attention.key_length", Value::U32(u32::MAX));
        set(m, "llama.attention.value_length", Value::U32(u32::MAX));
    });
    let e = meta_of(&b).unwrap_err();
    assert!(e.to_string().contains("absurd head widths: key 4294967295"), "{e}");
    let b = synthetic_model_with(2, true, |m| set(m, "llama.attention.key_length", Value::U32(0)));
    assert!(meta_of(&b).unwrap_err().to_string().contains("absurd head widths: key 0"));
}

#[test]
fn more_heads_than_the_embedding_width_is_refused() {
    // n_embd / n_head would be a head width of 0: a KV cache of 0 bytes.
    let b = synthetic_model_with(2, true, |m| set(m, "llama.attention.head_count", Value::U32(1000)));
    assert!(meta_of(&b).unwrap_err().to_string().contains("absurd sizes"));
}

#[test]
fn sizes_of_hand_built_metas_saturate_instead_of_overflowing() {
    let mut m = meta_of(&synthetic_model(2, false)).unwrap();
    assert_eq!(m.kv_bytes_per_token_per_layer(), 2 * 4 * 2 * (32 / 4));
    m.n_head_kv = u32::MAX;
    m.head_dim_k = u32::MAX;
    m.head_dim_v = u32::MAX;
    assert_eq!(m.kv_bytes_per_token_per_layer(), u64::MAX);
    m.layer_bytes = vec![u64::MAX, 1];
    m.embd_bytes = u64::MAX;
    assert_eq!(m.stage_weight_bytes(true, true), u64::MAX);
}
