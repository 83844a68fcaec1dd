//! The model zoo: tiny GGUF files with random weights for architectures whose real
//! weights cannot be downloaded here, written with the architecture's own metadata
//! keys, tensor names and shapes (a few layers, small widths) and quantised like real
//! files (Q8_0 matrices, MXFP4 experts where the family ships them, F32 norms and
//! biases). llama.cpp's loader checks names and shapes strictly, so a zoo model that
//! loads and runs builds the same graph as the real model: what the split check needs
//! to allow an architecture. The vocabulary (every `tokenizer.*` key) is copied from a
//! real model, so prompts tokenize and answers detokenize as they would.
//! Deterministic: the same family gives the same bytes.

use crate::file::{align, write_header, Gguf, TensorInfo, DEFAULT_ALIGNMENT};
use crate::value::{Value, ValueType};
use crate::{GgmlType, GgufError};
use std::io::{BufWriter, Write};
use std::path::Path;

/// A family the zoo writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen 2 / 2.5: biases on the q, k and v projections; LM head tied to the
    /// embedding (as the small Qwen 2.5 models ship).
    Qwen2,
    /// Qwen 3 (dense): RMS norms on each head's q and k; its own LM head.
    Qwen3,
    /// Qwen 3 mixture of experts (30B-A3B, 235B-A22B): Qwen 3's attention, a router
    /// and experts in every layer (4 experts, 2 used).
    Qwen3Moe,
    /// Phi 3 / 3.5 / 4: one fused q/k/v projection, one fused gate/up projection;
    /// its own LM head.
    Phi3,
    /// Mistral 3 (Mistral Small 3.x, Ministral 3, Devstral): llama's stack with an
    /// attention temperature that grows with the position (set short here, so that the
    /// tests' positions cross its steps).
    Mistral3,
    /// Command R (Cohere): layer norms (not RMS), attention and feed-forward in
    /// parallel from one norm, a logit scale; LM head tied.
    CommandR,
    /// gpt-oss (20b, 120b): a router with a bias and experts with biases in every
    /// layer (MXFP4, as OpenAI ships them; 4 experts, 2 used), q/k/v and output
    /// biases, attention sinks, norms after attention, sliding-window attention on
    /// every other layer (a window shorter than the tests' prompts, so that it
    /// matters), YaRN rope scaling; its own LM head.
    GptOss,
    /// Llama 4 (Scout, Maverick): Maverick's layout, experts (4, 1 used, sigmoid
    /// routing) with a shared expert on every other layer and a dense feed-forward on
    /// the others; chunked attention on 3 layers of 4 and no rope on the 4th; its own
    /// LM head. 8 layers, so that a split on its period of 4 exists.
    Llama4,
    /// DeepSeek V3 (and V2, R1, Kimi K2): multi-head latent attention (low-rank query
    /// and a compressed key/value latent with a separate rope part, the value and key
    /// up-projections split per head as current GGUFs store them), one leading dense
    /// layer, then experts (4, 2 used, sigmoid routing with a bias, weights
    /// normalised and scaled) with a shared expert, YaRN; one next-token-prediction
    /// block after the stack, as DeepSeek V3's GGUFs carry it.
    DeepSeek2,
    /// Gemma 2: sliding-window attention on every other layer, norms after attention
    /// and feed-forward too, logit soft-capping, the embedding scaled by √n_embd; LM
    /// head tied.
    Gemma2,
}

impl Family {
    /// The families whose architectures Shoal allows (each verified on its zoo model).
    pub const ALL: &'static [Family] = &[
        Family::Qwen2,
        Family::Qwen3,
        Family::Qwen3Moe,
        Family::Phi3,
        Family::CommandR,
        Family::Mistral3,
        Family::GptOss,
        Family::Llama4,
        Family::DeepSeek2,
    ];

    /// Families written to show why their architecture is refused (`Arch::REFUSED`).
    pub const REFUSED: &'static [Family] = &[Family::Gemma2];

    /// Layers of its zoo model: 4, or 8 where the family's split period is 4.
    pub fn layers(self) -> u32 {
        match self {
            Family::Llama4 => 8,
            _ => N_LAYER,
        }
    }

    /// The GGUF architecture name.
    pub fn arch(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3moe",
            Family::Phi3 => "phi3",
            Family::CommandR => "command-r",
            Family::Mistral3 => "mistral3",
            Family::GptOss => "gpt-oss",
            Family::Llama4 => "llama4",
            Family::DeepSeek2 => "deepseek2",
            Family::Gemma2 => "gemma2",
        }
    }
}

/// Sizes of every zoo model: 4 layers (every split can be checked; see [`Family::layers`]), 4 query heads of
/// 16 sharing 2 key/value heads (grouped-query attention), widths that Q8_0's blocks of
/// 32 divide.
const N_LAYER: u32 = 4;
const N_EMBD: u64 = 64;
const N_HEAD: u64 = 4;
const N_HEAD_KV: u64 = 2;
const HEAD_DIM: u64 = 16;
const N_FF: u64 = 128;
/// Experts of a mixture-of-experts layer, those each token uses, and each one's width.
const N_EXPERT: u64 = 4;
const N_EXPERT_USED: u64 = 2;
const N_FF_EXP: u64 = 32;

/// Write the zoo model of `family` to `dest`, its vocabulary copied from the GGUF at
/// `vocab_from`.
pub fn write(family: Family, vocab_from: &Path, dest: &Path) -> Result<(), GgufError> {
    write_layers(family, family.layers(), vocab_from, dest)
}

/// [`write`] with `n_layer` layers (where a family's graph depends on the count).
pub fn write_layers(family: Family, n_layer: u32, vocab_from: &Path, dest: &Path) -> Result<(), GgufError> {
    write_model(family, n_layer, vocab_from, None, dest)
}

/// [`write`] with `chat_template` as the model's `tokenizer.chat_template` (in place of
/// the vocabulary source's templates, named ones included): a family's real template
/// over its real vocabulary, when `vocab_from` is one of llama.cpp's vocabulary-only
/// GGUFs.
pub fn write_with_template(
    family: Family,
    vocab_from: &Path,
    chat_template: &str,
    dest: &Path,
) -> Result<(), GgufError> {
    write_with_templates(family, vocab_from, Some(chat_template), &[], dest)
}

/// [`write`] with exactly these chat templates, in place of every one the vocabulary
/// source carries: `default` as `tokenizer.chat_template` (none where `None`), each
/// `(name, template)` of `named` as `tokenizer.chat_template.<name>`, their names listed
/// in `tokenizer.chat_templates`, as llama.cpp's convert script writes Hugging Face's
/// named templates (Cohere's `tool_use` and `rag`).
pub fn write_with_templates(
    family: Family,
    vocab_from: &Path,
    default: Option<&str>,
    named: &[(&str, &str)],
    dest: &Path,
) -> Result<(), GgufError> {
    let templates = Templates { default, named };
    write_model(family, family.layers(), vocab_from, Some(templates), dest)
}

/// The chat templates a zoo model carries in place of its vocabulary source's.
#[derive(Clone, Copy)]
struct Templates<'a> {
    default: Option<&'a str>,
    named: &'a [(&'a str, &'a str)],
}

fn write_model(
    family: Family,
    n_layer: u32,
    vocab_from: &Path,
    templates: Option<Templates<'_>>,
    dest: &Path,
) -> Result<(), GgufError> {
    let source = Gguf::open(vocab_from)?;
    let bad = |what: String| GgufError::Model { path: vocab_from.to_owned(), what };
    let n_vocab = match source.get("tokenizer.ggml.tokens") {
        Some(Value::Array(_, tokens)) => tokens.len() as u64,
        _ => return Err(bad("no tokenizer.ggml.tokens to copy".into())),
    };
    let arch = family.arch();
    let u32v = |k: &str, v: u64| (format!("{arch}.{k}"), Value::U32(v as u32));
    let mut metadata = vec![
        ("general.architecture".to_string(), Value::String(arch.as_bytes().to_vec())),
        // Not the family's name: llama.cpp tweaks the vocabulary of models named like
        // Phi 3 (RSTRIP on tokens of Phi's own vocabulary, which the copied one lacks).
        ("general.name".to_string(), Value::String(b"shoal zoo model".to_vec())),
        u32v("block_count", u64::from(n_layer)),
        u32v("context_length", 4096),
        u32v("embedding_length", N_EMBD),
        u32v("feed_forward_length", N_FF),
        u32v("attention.head_count", N_HEAD),
        u32v("attention.head_count_kv", N_HEAD_KV),
        (format!("{arch}.rope.freq_base"), Value::F32(1_000_000.0)),
    ];
    if family == Family::CommandR {
        metadata.push((format!("{arch}.attention.layer_norm_epsilon"), Value::F32(1e-5)));
        metadata.push((format!("{arch}.logit_scale"), Value::F32(0.0625)));
    } else {
        metadata.push((format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6)));
    }
    if matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma2 | Family::GptOss) {
        metadata.push(u32v("attention.key_length", HEAD_DIM));
        metadata.push(u32v("attention.value_length", HEAD_DIM));
    }
    if family == Family::Mistral3 {
        metadata.push((format!("{arch}.attention.temperature_scale"), Value::F32(0.1)));
        metadata.push(u32v("rope.scaling.original_context_length", 16));
    }
    if matches!(family, Family::Qwen3Moe | Family::GptOss | Family::Llama4 | Family::DeepSeek2) {
        metadata.push(u32v("expert_count", N_EXPERT));
        // Llama 4 routes each token to one expert.
        metadata.push(u32v("expert_used_count", if family == Family::Llama4 { 1 } else { N_EXPERT_USED }));
        metadata.push(u32v("expert_feed_forward_length", N_FF_EXP));
    }
    if matches!(family, Family::Gemma2 | Family::GptOss) {
        // A window shorter than the tests' prompts, so that it matters.
        metadata.push(u32v("attention.sliding_window", 32));
    }
    if family == Family::GptOss {
        // gpt-oss's own rope scaling (YaRN, 32x over 4096), as its GGUFs carry it.
        metadata.push((format!("{arch}.rope.scaling.type"), Value::String(b"yarn".to_vec())));
        metadata.push((format!("{arch}.rope.scaling.factor"), Value::F32(32.0)));
        metadata.push(u32v("rope.scaling.original_context_length", 4096));
    }
    if family == Family::DeepSeek2 {
        metadata.push(u32v("leading_dense_block_count", 1));
        metadata.push(u32v("expert_shared_count", 1));
        metadata.push((format!("{arch}.expert_weights_scale"), Value::F32(2.5)));
        metadata.push((format!("{arch}.expert_weights_norm"), Value::Bool(true)));
        // 2: sigmoid, as DeepSeek V3's GGUFs say.
        metadata.push(u32v("expert_gating_func", 2));
        metadata.push(u32v("attention.q_lora_rank", MLA_Q_LORA));
        metadata.push(u32v("attention.kv_lora_rank", MLA_KV_LORA));
        // The cache's key is the latent plus the rope part; its value the latent.
        metadata.push(u32v("attention.key_length", MLA_KV_LORA + MLA_ROPE));
        metadata.push(u32v("attention.value_length", MLA_KV_LORA));
        metadata.push(u32v("attention.key_length_mla", MLA_NOPE + MLA_ROPE));
        metadata.push(u32v("attention.value_length_mla", MLA_V));
        metadata.push(u32v("rope.dimension_count", MLA_ROPE));
        metadata.push((format!("{arch}.rope.scaling.type"), Value::String(b"yarn".to_vec())));
        metadata.push((format!("{arch}.rope.scaling.factor"), Value::F32(40.0)));
        metadata.push(u32v("rope.scaling.original_context_length", 4096));
        metadata.push((format!("{arch}.rope.scaling.yarn_log_multiplier"), Value::F32(0.1)));
        metadata.push(u32v("nextn_predict_layers", 1));
        // block_count counts the prediction block too.
        for (k, v) in metadata.iter_mut() {
            if *k == format!("{arch}.block_count") {
                *v = Value::U32(n_layer + 1);
            }
            if *k == format!("{arch}.attention.head_count_kv") {
                *v = Value::U32(1);
            }
        }
    }
    if family == Family::Llama4 {
        // Maverick's: experts on every other layer (those whose index + 1 is even).
        metadata.push(u32v("interleave_moe_layer_step", 2));
    }
    if family == Family::Gemma2 {
        metadata.push((format!("{arch}.attn_logit_softcapping"), Value::F32(50.0)));
        metadata.push((format!("{arch}.final_logit_softcapping"), Value::F32(30.0)));
    }
    // Own templates replace all of the source's (`tokenizer.chat_template`, its named
    // ones and their list): a source's named template left beside a replaced default
    // would be read with it.
    let own_template = |k: &str| templates.is_some() && k.starts_with("tokenizer.chat_template");
    metadata.extend(source.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.") && !own_template(k)).cloned());
    if let Some(Templates { default, named }) = templates {
        let text = |t: &str| Value::String(t.as_bytes().to_vec());
        if let Some(t) = default {
            metadata.push(("tokenizer.chat_template".to_string(), text(t)));
        }
        for (name, t) in named {
            metadata.push((format!("tokenizer.chat_template.{name}"), text(t)));
        }
        if !named.is_empty() {
            let names = named.iter().map(|(name, _)| text(name)).collect();
            metadata.push(("tokenizer.chat_templates".to_string(), Value::Array(ValueType::String, names)));
        }
    }

    // (name, dims innermost first, storage)
    let mut plan: Vec<(String, Vec<u64>, Store)> = vec![("token_embd.weight".into(), vec![N_EMBD, n_vocab], Q8)];
    let blocks = if family == Family::DeepSeek2 { n_layer + 1 } else { n_layer };
    for i in 0..blocks {
        let t = |name: &str, dims: &[u64], q: Store| (format!("blk.{i}.{name}"), dims.to_vec(), q);
        plan.push(t("attn_norm.weight", &[N_EMBD], F32));
        if family == Family::DeepSeek2 {
            plan.extend(deepseek2_block(i, n_layer));
            continue;
        }
        if family == Family::Phi3 {
            plan.push(t("attn_qkv.weight", &[N_EMBD, (N_HEAD + 2 * N_HEAD_KV) * HEAD_DIM], Q8));
        } else {
            plan.push(t("attn_q.weight", &[N_EMBD, N_HEAD * HEAD_DIM], Q8));
            plan.push(t("attn_k.weight", &[N_EMBD, N_HEAD_KV * HEAD_DIM], Q8));
            plan.push(t("attn_v.weight", &[N_EMBD, N_HEAD_KV * HEAD_DIM], Q8));
        }
        match family {
            Family::Qwen2 | Family::GptOss => {
                plan.push(t("attn_q.bias", &[N_HEAD * HEAD_DIM], F32));
                plan.push(t("attn_k.bias", &[N_HEAD_KV * HEAD_DIM], F32));
                plan.push(t("attn_v.bias", &[N_HEAD_KV * HEAD_DIM], F32));
            }
            Family::Qwen3 | Family::Qwen3Moe => {
                plan.push(t("attn_q_norm.weight", &[HEAD_DIM], F32));
                plan.push(t("attn_k_norm.weight", &[HEAD_DIM], F32));
            }
            Family::Phi3
            | Family::CommandR
            | Family::Mistral3
            | Family::Gemma2
            | Family::Llama4
            | Family::DeepSeek2 => {}
        }
        plan.push(t("attn_output.weight", &[N_HEAD * HEAD_DIM, N_EMBD], Q8));
        if family == Family::GptOss {
            plan.push(t("attn_output.bias", &[N_EMBD], F32));
            plan.push(t("attn_sinks.weight", &[N_HEAD], F32));
            // gpt-oss's norm before the experts is named as a norm after attention.
            plan.push(t("post_attention_norm.weight", &[N_EMBD], F32));
            plan.push(t("ffn_gate_inp.weight", &[N_EMBD, N_EXPERT], F32));
            plan.push(t("ffn_gate_inp.bias", &[N_EXPERT], F32));
            plan.push(t("ffn_gate_exps.weight", &[N_EMBD, N_FF_EXP, N_EXPERT], Mxfp4));
            plan.push(t("ffn_gate_exps.bias", &[N_FF_EXP, N_EXPERT], F32));
            plan.push(t("ffn_up_exps.weight", &[N_EMBD, N_FF_EXP, N_EXPERT], Mxfp4));
            plan.push(t("ffn_up_exps.bias", &[N_FF_EXP, N_EXPERT], F32));
            plan.push(t("ffn_down_exps.weight", &[N_FF_EXP, N_EMBD, N_EXPERT], Mxfp4));
            plan.push(t("ffn_down_exps.bias", &[N_EMBD, N_EXPERT], F32));
            continue;
        }
        if family == Family::Llama4 && (i + 1) % 2 == 0 {
            plan.push(t("ffn_norm.weight", &[N_EMBD], F32));
            plan.push(t("ffn_gate_inp.weight", &[N_EMBD, N_EXPERT], F32));
            plan.extend(experts(i, true));
            continue;
        }
        if family == Family::Gemma2 {
            plan.push(t("post_attention_norm.weight", &[N_EMBD], F32));
        }
        if family != Family::CommandR {
            plan.push(t("ffn_norm.weight", &[N_EMBD], F32));
        }
        if family == Family::Phi3 {
            plan.push(t("ffn_up.weight", &[N_EMBD, 2 * N_FF], Q8));
        } else if family == Family::Qwen3Moe {
            // The router stays F32, as converted models keep it.
            plan.push(t("ffn_gate_inp.weight", &[N_EMBD, N_EXPERT], F32));
            plan.extend(experts(i, false));
        } else {
            plan.push(t("ffn_gate.weight", &[N_EMBD, N_FF], Q8));
            plan.push(t("ffn_up.weight", &[N_EMBD, N_FF], Q8));
        }
        if family != Family::Qwen3Moe {
            plan.push(t("ffn_down.weight", &[N_FF, N_EMBD], Q8));
        }
        if family == Family::Gemma2 {
            plan.push(t("post_ffw_norm.weight", &[N_EMBD], F32));
        }
    }
    plan.push(("output_norm.weight".into(), vec![N_EMBD], F32));
    if matches!(
        family,
        Family::Qwen3
            | Family::Qwen3Moe
            | Family::Phi3
            | Family::Mistral3
            | Family::GptOss
            | Family::Llama4
            | Family::DeepSeek2
    ) {
        plan.push(("output.weight".into(), vec![N_EMBD, n_vocab], Q8));
    }

    // Invariant: the table holds ids 0 (F32), 8 (Q8_0) and 39 (MXFP4), which ggml keeps.
    let (f32t, q8, mxfp4) = (
        GgmlType::from_id(0).expect("F32"),
        GgmlType::from_id(8).expect("Q8_0"),
        GgmlType::from_id(39).expect("MXFP4"),
    );
    let mut rng = 0x5eed_0000_0000_0001u64 ^ (family as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut tensors = Vec::new();
    let mut data: Vec<Vec<u8>> = Vec::new();
    let mut offset = 0u64;
    for (name, dims, store) in plan {
        let n: u64 = dims.iter().product();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            // Norm scales near 1, as trained models have them.
            (0..n).map(|_| 1.0 + 0.1 * uniform(&mut rng)).collect()
        } else {
            // Small weights keep the activations of a random model in range.
            let scale = if name.ends_with(".bias") || name.ends_with("sinks.weight") {
                0.1
            } else {
                0.5 / (dims[0] as f32).sqrt()
            };
            (0..n).map(|_| scale * uniform(&mut rng)).collect()
        };
        let (ggml_type, bytes) = match store {
            F32 => (f32t, f32_bytes(&values)),
            Q8 => (q8, q8_0(&values)),
            Mxfp4 => (mxfp4, mxfp4_blocks(&values)),
        };
        tensors.push(TensorInfo { name, dims, ggml_type, offset, bytes: bytes.len() as u64 });
        offset = align(offset + bytes.len() as u64, DEFAULT_ALIGNMENT);
        data.push(bytes);
    }

    let io = |e: std::io::Error| GgufError::Io { path: dest.to_owned(), source: e };
    let mut w = BufWriter::new(std::fs::File::create(dest).map_err(io)?);
    write_header(&mut w, &metadata, &tensors, DEFAULT_ALIGNMENT).map_err(io)?;
    for (t, bytes) in tensors.iter().zip(&data) {
        w.write_all(bytes).map_err(io)?;
        let pad = align(t.bytes, DEFAULT_ALIGNMENT) - t.bytes;
        w.write_all(&vec![0u8; pad as usize]).map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(())
}

/// Multi-head latent attention's widths (DeepSeek): the low-rank query, the key/value
/// latent, each head's key part without and with rope, and its value.
const MLA_Q_LORA: u64 = 32;
const MLA_KV_LORA: u64 = 32;
const MLA_NOPE: u64 = 32;
const MLA_ROPE: u64 = 16;
const MLA_V: u64 = 32;

/// Block `i`'s experts (Q8_0, after its router): gate, up and down projections of
/// every expert, then, with `shared`, the shared expert's (Llama 4, DeepSeek).
fn experts(i: u32, shared: bool) -> Vec<(String, Vec<u64>, Store)> {
    let t = |name: &str, dims: &[u64]| (format!("blk.{i}.{name}"), dims.to_vec(), Q8);
    let mut v = vec![
        t("ffn_gate_exps.weight", &[N_EMBD, N_FF_EXP, N_EXPERT]),
        t("ffn_up_exps.weight", &[N_EMBD, N_FF_EXP, N_EXPERT]),
        t("ffn_down_exps.weight", &[N_FF_EXP, N_EMBD, N_EXPERT]),
    ];
    if shared {
        v.push(t("ffn_gate_shexp.weight", &[N_EMBD, N_FF_EXP]));
        v.push(t("ffn_up_shexp.weight", &[N_EMBD, N_FF_EXP]));
        v.push(t("ffn_down_shexp.weight", &[N_FF_EXP, N_EMBD]));
    }
    v
}

/// A DeepSeek V3 block's tensors after its `attn_norm` (block `i` of `n_layer`; the
/// one after them is the next-token-prediction block).
fn deepseek2_block(i: u32, n_layer: u32) -> Vec<(String, Vec<u64>, Store)> {
    let t = |name: &str, dims: &[u64], q: Store| (format!("blk.{i}.{name}"), dims.to_vec(), q);
    let mut v = vec![
        t("attn_q_a_norm.weight", &[MLA_Q_LORA], F32),
        t("attn_kv_a_norm.weight", &[MLA_KV_LORA], F32),
        t("attn_q_a.weight", &[N_EMBD, MLA_Q_LORA], Q8),
        t("attn_q_b.weight", &[MLA_Q_LORA, N_HEAD * (MLA_NOPE + MLA_ROPE)], Q8),
        t("attn_kv_a_mqa.weight", &[N_EMBD, MLA_KV_LORA + MLA_ROPE], Q8),
        t("attn_k_b.weight", &[MLA_NOPE, MLA_KV_LORA, N_HEAD], Q8),
        t("attn_v_b.weight", &[MLA_KV_LORA, MLA_V, N_HEAD], Q8),
        t("attn_output.weight", &[N_HEAD * MLA_V, N_EMBD], Q8),
        t("ffn_norm.weight", &[N_EMBD], F32),
    ];
    if i == 0 {
        // The leading dense layer.
        v.push(t("ffn_gate.weight", &[N_EMBD, N_FF], Q8));
        v.push(t("ffn_up.weight", &[N_EMBD, N_FF], Q8));
        v.push(t("ffn_down.weight", &[N_FF, N_EMBD], Q8));
    } else {
        v.push(t("ffn_gate_inp.weight", &[N_EMBD, N_EXPERT], F32));
        v.push(t("exp_probs_b.bias", &[N_EXPERT], F32));
        v.extend(experts(i, true));
    }
    if i == n_layer {
        v.push(t("nextn.eh_proj.weight", &[2 * N_EMBD, N_EMBD], Q8));
        v.push(t("nextn.enorm.weight", &[N_EMBD], F32));
        v.push(t("nextn.hnorm.weight", &[N_EMBD], F32));
        v.push(t("nextn.shared_head_norm.weight", &[N_EMBD], F32));
    }
    v
}

/// How the zoo stores a tensor, as converted models of the family store it.
#[derive(Clone, Copy)]
enum Store {
    /// Norms, biases, routers, sinks.
    F32,
    /// Matrices.
    Q8,
    /// gpt-oss's experts.
    Mxfp4,
}
use Store::{Mxfp4, F32, Q8};

/// A uniform number in [-1, 1) from xorshift64* state `s`.
fn uniform(s: &mut u64) -> f32 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    let x = s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
    (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// ggml's MXFP4: blocks of 32 values as an E8M0 exponent byte `e` (scale 2^(e-128),
/// ggml's `GGML_E8M0_TO_FP32_HALF`) and 16 bytes of 4-bit E2M1 codes, value `j` in the
/// low nibble of byte `j` and value `j + 16` in its high nibble.
fn mxfp4_blocks(v: &[f32]) -> Vec<u8> {
    // ggml's kvalues_mxfp4: E2M1 values doubled, by code.
    const K: [f32; 16] = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0];
    let mut out = Vec::with_capacity(v.len() / 32 * 17);
    for block in v.chunks(32) {
        let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        // The smallest scale that brings the block within ±12.
        let e = if amax > 0.0 { (128.0 + (amax / 12.0).log2().ceil()).clamp(1.0, 254.0) as u8 } else { 0 };
        let d = 2f32.powi(i32::from(e) - 128);
        let code = |x: f32| {
            let (mut best, mut err) = (0u8, f32::INFINITY);
            for (c, k) in K.iter().enumerate() {
                if (k * d - x).abs() < err {
                    (best, err) = (c as u8, (k * d - x).abs());
                }
            }
            best
        };
        out.push(e);
        out.extend((0..16).map(|j| code(block[j]) | (code(block[j + 16]) << 4)));
    }
    out
}

/// ggml's Q8_0: blocks of 32 values as an f16 scale and 32 signed bytes.
fn q8_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() / 32 * 34);
    for block in v.chunks(32) {
        let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|x| ((x * inv).round() as i8) as u8));
    }
    out
}
