//! What Shoal needs to know about a model, read from its GGUF header: architecture,
//! sizes, and the bytes each layer and each non-layer tensor takes. Architectures
//! are allow-listed: each one's graph must be checked (embedding scaling, layer
//! period) before a split of it can be trusted to give the unsplit model's output.

use crate::file::Gguf;
use crate::value::Value;
use crate::GgufError;
use serde::Serialize;

/// Most transformer blocks accepted (real models have at most a few hundred).
pub const MAX_LAYERS: u32 = 4096;
/// Widest hidden state accepted (real models: up to ~25k).
pub const MAX_EMBD: u32 = 1 << 20;
/// Widest attention head accepted (real models: 64 to 512).
pub const MAX_HEAD_DIM: u32 = 1 << 16;

/// An architecture Shoal has verified split-exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Arch {
    /// `llama` (SmolLM2, Llama 2/3, Mistral …): no per-layer pattern.
    Llama,
    /// `gemma3`: sliding-window attention on 5 of every 6 layers (any boundary: a
    /// shard names its layers' kinds, see [`ModelMeta::swa_layers`]).
    Gemma3,
    /// `deepseek2` (DeepSeek V2, V2.5, V3, R1; Kimi K2; Mistral Large 3): multi-head
    /// latent attention (a compressed KV cache), leading dense layers then experts
    /// with shared experts; no per-layer pattern (the dense lead and any
    /// next-token-prediction layers are restated in each shard). Verified on its zoo
    /// model.
    DeepSeek2,
    /// `gpt-oss` (gpt-oss-20b, gpt-oss-120b): a mixture of experts in every layer (MXFP4
    /// experts with biases), attention sinks, sliding-window attention on every other
    /// layer; boundaries at even layers. Verified on its zoo model.
    GptOss,
    /// `qwen2` (Qwen 2, Qwen 2.5 of every size): llama's stack with q/k/v biases; no
    /// per-layer pattern. Verified on its zoo model.
    Qwen2,
    /// `qwen3` (dense Qwen 3): q/k norms per head; no per-layer pattern. Verified on its
    /// zoo model.
    Qwen3,
    /// `qwen3moe` (Qwen 3 30B-A3B, 235B-A22B): a router and experts in every layer; no
    /// per-layer pattern. Verified on its zoo model.
    Qwen3Moe,
    /// `command-r` (Command R, Aya): parallel attention and feed-forward, layer norms;
    /// no per-layer pattern. Verified on its zoo model; models of 64 layers or more
    /// (Command R+) are refused (see `ModelMeta::from_gguf`).
    CommandR,
    /// `mistral3` (Mistral Small 3.x, Ministral 3, Devstral): llama's stack, an attention
    /// temperature by position; no per-layer pattern. Verified on its zoo model.
    Mistral3,
    /// `llama4` (Llama 4 Scout, Maverick): experts with a shared expert in every layer
    /// or every other one, chunked attention on 3 layers of 4 and no rope on the 4th;
    /// boundaries at multiples of 4 (see [`ModelMeta::layer_period`]). Verified on its
    /// zoo model.
    Llama4,
    /// `phi3` (Phi 3, 3.5, 4): fused q/k/v and gate/up projections; no per-layer pattern
    /// (llama.cpp runs its sliding window disabled). Verified on its zoo model.
    Phi3,
}

/// Why GLM 4 / 4.5 cannot be split on stock llama.cpp (`models/glm4-moe.cpp`, `glm4.cpp`).
const GLM_EMBD_INPUT: &str = "llama.cpp's glm4 and glm4moe graphs abort when given hidden states instead of \
     tokens (\"This GGUF does not support multimodal\") unless the model uses M-RoPE, so no stage after the \
     first can run (Qwen 3 MoE is supported)";

impl Arch {
    /// Architectures checked and refused, with why: their zoo models show it.
    pub const REFUSED: &'static [(&'static str, &'static str)] = &[
        (
            "gemma2",
            "llama.cpp's gemma2 graph scales every input by √n_embd, hidden states from a previous \
             stage included, so a split cannot give the unsplit model's output (Gemma 3 is supported)",
        ),
        ("glm4moe", GLM_EMBD_INPUT),
        ("glm4", GLM_EMBD_INPUT),
    ];

    /// Recurrent and hybrid architectures (llama.cpp's `llm_arch_is_recurrent` and
    /// `llm_arch_is_hybrid`): state-space or linear-attention layers keep a state
    /// that `llama_memory_seq_rm` cannot cut back to an earlier position, which the
    /// one-step rollback of Shoal's exact replay needs. Refused until whole-session
    /// replay exists for them (DESIGN point 12).
    pub const RECURRENT: &'static [&'static str] = &[
        "mamba",
        "mamba2",
        "rwkv6",
        "rwkv6qwen2",
        "rwkv7",
        "arwkv7",
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "kimi-linear",
        "kimi-k3",
        "bailingmoe3",
        "glm5-next",
        "deepseek4",
        "minimax-01",
    ];

    /// Unverified architectures and the supported family nearest to each (the same
    /// stack with a difference not yet checked), named in the refusal.
    pub const CLOSEST: &'static [(&'static str, &'static str)] = &[
        ("deepseek", "qwen3moe"),
        ("gemma", "gemma3"),
        ("gemma3n", "gemma3"),
        ("gemma4", "gemma3"),
        ("cohere2", "command-r"),
        ("qwen2moe", "qwen3moe"),
        ("qwen2vl", "qwen2"),
        ("qwen3vl", "qwen3"),
        ("qwen3vlmoe", "qwen3moe"),
        ("phimoe", "phi3"),
        ("olmo2", "llama"),
        ("granite", "llama"),
        ("granitemoe", "qwen3moe"),
        ("smollm3", "llama"),
        ("exaone4", "llama"),
        ("seed_oss", "llama"),
        ("ernie4_5-moe", "qwen3moe"),
        ("hunyuan-moe", "qwen3moe"),
        ("minimax-m2", "qwen3moe"),
        ("dots1", "qwen3moe"),
    ];

    /// Architectures Shoal accepts, by their GGUF name.
    pub const SUPPORTED: &'static [&'static str] = &[
        "llama",
        "command-r",
        "deepseek2",
        "gemma3",
        "gpt-oss",
        "llama4",
        "mistral3",
        "phi3",
        "qwen2",
        "qwen3",
        "qwen3moe",
    ];

    fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "gemma3" => Some(Arch::Gemma3),
            "gpt-oss" => Some(Arch::GptOss),
            "deepseek2" => Some(Arch::DeepSeek2),
            "llama4" => Some(Arch::Llama4),
            "phi3" => Some(Arch::Phi3),
            "command-r" => Some(Arch::CommandR),
            "mistral3" => Some(Arch::Mistral3),
            "qwen3moe" => Some(Arch::Qwen3Moe),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    /// The GGUF name (`general.architecture`), also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gemma3 => "gemma3",
            Arch::GptOss => "gpt-oss",
            Arch::DeepSeek2 => "deepseek2",
            Arch::Llama4 => "llama4",
            Arch::Phi3 => "phi3",
            Arch::CommandR => "command-r",
            Arch::Mistral3 => "mistral3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// Stage boundaries must be multiples of this where llama.cpp derives per-layer
    /// behaviour from the layer index that no metadata key can restate (a shard
    /// renumbers its layers from 0). The sliding-window pattern is not such a
    /// behaviour: each shard states its own (see [`Arch::swa_period`]). gpt-oss: 2,
    /// because llama.cpp's gpt-oss graph needs a sliding-window layer in every
    /// model it loads, and even boundaries give each stage one (a stage of one
    /// full-attention layer would be refused). Llama 4: 4, its layers without rope
    /// (`(il + 1) % 4 == 0`); a model's own period can be longer (see
    /// [`ModelMeta::layer_period`]).
    pub fn layer_period(self) -> u32 {
        match self {
            Arch::GptOss => 2,
            Arch::Llama4 => 4,
            Arch::Llama
            | Arch::DeepSeek2
            | Arch::Gemma3
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Qwen3Moe
            | Arch::Phi3
            | Arch::CommandR
            | Arch::Mistral3 => 1,
        }
    }

    /// The period of the sliding-window pattern llama.cpp gives this architecture
    /// when the GGUF names none (`load_swa_pattern(ml, n)`: layer `il` slides when
    /// `il % n < n - 1`), or `None` where it has no sliding-window layers. A shard
    /// states its layers' pattern as the `<arch>.attention.sliding_window_pattern`
    /// array, which llama.cpp reads first, so any boundary keeps each layer's kind.
    pub fn swa_period(self) -> Option<u32> {
        match self {
            Arch::Gemma3 => Some(6),
            Arch::GptOss => Some(2),
            Arch::Llama4 => Some(4),
            Arch::Llama
            | Arch::DeepSeek2
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Qwen3Moe
            | Arch::Phi3
            | Arch::CommandR
            | Arch::Mistral3 => None,
        }
    }
}

/// Why `arch_name` (not in [`Arch::SUPPORTED`]) is refused, in words for the user.
fn refusal(arch_name: &str) -> String {
    if let Some((_, why)) = Arch::REFUSED.iter().find(|(name, _)| *name == arch_name) {
        return format!("architecture {arch_name:?} cannot be split: {why}");
    }
    if Arch::RECURRENT.contains(&arch_name) {
        return format!(
            "architecture {arch_name:?} cannot be split yet: its recurrent (state-space or linear-attention) \
             layers keep a state that llama.cpp cannot roll back to an earlier position, which Shoal's exact \
             replay needs (supported: {})",
            Arch::SUPPORTED.join(", ")
        );
    }
    let closest = match Arch::CLOSEST.iter().find(|(name, _)| *name == arch_name) {
        Some((_, near)) => format!("; the closest supported family is {near}"),
        None => String::new(),
    };
    format!(
        "architecture {arch_name:?} has not been verified for layer splits{closest} (supported: {})",
        Arch::SUPPORTED.join(", ")
    )
}

/// Which of the model's `n_layer` layers slide (see [`ModelMeta::swa_layers`]), read
/// as llama.cpp reads it: no window (or a window of 0) means none (Llama 4: no key
/// means its chunks of 8192); a per-layer array wins; then a period key; then the
/// architecture's default period.
fn swa_layers(g: &Gguf, arch: Arch, n_layer: u32) -> Result<Vec<bool>, String> {
    let Some(default) = arch.swa_period() else { return Ok(Vec::new()) };
    let name = arch.name();
    let window = g.get(&format!("{name}.attention.sliding_window")).and_then(Value::as_u64);
    let slides = match arch {
        Arch::Llama4 => window != Some(0),
        _ => window.unwrap_or(0) > 0,
    };
    if !slides {
        return Ok(Vec::new());
    }
    let key = format!("{name}.attention.sliding_window_pattern");
    match g.get(&key) {
        Some(Value::Array(_, items)) => {
            if items.len() != n_layer as usize {
                return Err(format!("{key} has {} entries for {n_layer} layers", items.len()));
            }
            items
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    v => v.as_u64().map(|x| x != 0).ok_or_else(|| format!("{key} holds a non-integer")),
                })
                .collect()
        }
        Some(v) => {
            let n = v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| format!("{key} is not an integer"))?;
            Ok(swa_pattern(n, n_layer))
        }
        None => Ok(swa_pattern(default, n_layer)),
    }
}

/// Greatest common divisor (of two positive numbers).
fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// llama.cpp's `set_swa_pattern(n)`: layer `il` slides when `il % n < n - 1` (every
/// layer when `n` is 0).
fn swa_pattern(n: u32, n_layer: u32) -> Vec<bool> {
    (0..n_layer).map(|il| n == 0 || il % n < n - 1).collect()
}

/// Facts about a model, from its GGUF header alone.
#[derive(Clone, Debug, Serialize)]
pub struct ModelMeta {
    /// Verified architecture.
    pub arch: Arch,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Transformer blocks (`<arch>.block_count`).
    pub n_layer: u32,
    /// Hidden-state width (`<arch>.embedding_length`).
    pub n_embd: u32,
    /// Vocabulary size (rows of `token_embd.weight`).
    pub n_vocab: u32,
    /// Context the model was trained for (`<arch>.context_length`).
    pub n_ctx_train: u32,
    /// Attention heads.
    pub n_head: u32,
    /// Key/value heads (grouped-query attention).
    pub n_head_kv: u32,
    /// Feed-forward width (`<arch>.feed_forward_length`; 4 × n_embd when absent).
    pub n_ff: u32,
    /// Key width per head.
    pub head_dim_k: u32,
    /// Value width per head.
    pub head_dim_v: u32,
    /// Tensor bytes of each block, in order.
    pub layer_bytes: Vec<u64>,
    /// Bytes of `token_embd.weight`.
    pub embd_bytes: u64,
    /// Bytes of `output.weight` (0 when the LM head is tied to the embedding).
    pub output_bytes: u64,
    /// Bytes of every other non-layer tensor (`output_norm`, `rope_freqs` …).
    pub other_bytes: u64,
    /// The LM head reuses `token_embd.weight` (no `output.weight`).
    pub tied_embeddings: bool,
    /// The tensor types used, with how many tensors of each.
    pub tensor_types: Vec<(String, usize)>,
    /// Which layers attend over a sliding window, one flag per layer; empty when the
    /// model has none. From the GGUF's `<arch>.attention.sliding_window_pattern` (an
    /// array, or a period) or llama.cpp's default for the architecture; a shard
    /// writes its slice of it (llama.cpp would otherwise restart the pattern at the
    /// shard's layer 0).
    pub swa_layers: Vec<bool>,
    /// Trailing next-token-prediction blocks (`<arch>.nextn_predict_layers`: GLM 4.5,
    /// DeepSeek V3): stored after the main stack as blocks `n_layer..`, used only for
    /// speculative decoding, which Shoal does not run through them; no stage holds
    /// them, and their bytes are in none of the counts above.
    pub nextn_layers: u32,
    /// Multi-head latent attention (DeepSeek): the cache holds one compressed key per
    /// token and layer (`head_dim_k` wide: latent plus rope part) and no values.
    pub mla: bool,
    /// Stage sizes (in layers) that llama.cpp would misread, so no stage may have:
    /// a DeepSeek model of 26 or 27 layers is taken for V2-Lite (no low-rank query),
    /// which a shard of a full model with that many layers is not.
    pub refused_stage_layers: Vec<u32>,
    /// Stage boundaries must be multiples of this: [`Arch::layer_period`], or longer
    /// where the model's metadata makes more behaviour depend on the layer index
    /// (Llama 4's `interleave_moe_layer_step`).
    pub period: u32,
}

impl ModelMeta {
    /// Read the model's facts from a parsed header; refuses architectures Shoal has
    /// not verified and headers missing what llama.cpp needs.
    pub fn from_gguf(g: &Gguf) -> Result<ModelMeta, GgufError> {
        let bad = |what: String| GgufError::Model { path: g.path.clone(), what };
        let arch_name = g
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no general.architecture string".into()))?;
        let arch = Arch::from_name(arch_name)
            .ok_or_else(|| GgufError::Unsupported { path: g.path.clone(), what: refusal(arch_name) })?;
        let key_u32 = |k: &str| -> Result<u32, GgufError> {
            let key = format!("{arch_name}.{k}");
            g.get(&key)
                .and_then(Value::as_u64)
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| bad(format!("missing or non-integer {key}")))
        };
        let n_layer_all = key_u32("block_count")?;
        let nextn_layers = key_u32("nextn_predict_layers").unwrap_or(0);
        if nextn_layers >= n_layer_all && n_layer_all > 0 {
            return Err(bad(format!("{nextn_layers} next-token-prediction blocks of {n_layer_all} leave no model")));
        }
        let n_layer = n_layer_all - nextn_layers.min(n_layer_all);
        let n_embd = key_u32("embedding_length")?;
        let n_ctx_train = key_u32("context_length")?;
        let n_head = key_u32("attention.head_count")?;
        let n_head_kv = key_u32("attention.head_count_kv").unwrap_or(n_head);
        if n_layer == 0
            || n_embd == 0
            || n_head == 0
            || n_head_kv == 0
            || n_layer > MAX_LAYERS
            || n_embd > MAX_EMBD
            || n_head > n_embd
            || n_head_kv > n_embd
        {
            return Err(bad(format!("absurd sizes: {n_layer} layers, n_embd {n_embd}, {n_head}/{n_head_kv} heads")));
        }
        if arch == Arch::CommandR && n_layer >= 64 {
            // llama.cpp builds Command R's per-head q/k norms only when the model has
            // 64 layers or more: a shard (fewer layers) would leave them out.
            return Err(GgufError::Unsupported {
                path: g.path.clone(),
                what: format!(
                    "command-r with {n_layer} layers (Command R+) cannot be split: llama.cpp uses its q/k norms \
                     only in models of 64 layers or more, so a shard of fewer layers would run without them"
                ),
            });
        }
        // Within MAX_EMBD, 4 × n_embd fits a u32; checked all the same.
        let n_ff = match key_u32("feed_forward_length") {
            Ok(n) => n,
            Err(_) => n_embd.checked_mul(4).ok_or_else(|| bad(format!("n_embd {n_embd} is absurd")))?,
        };
        // n_head ≤ n_embd, so the defaults are at least 1.
        let head_dim_k = key_u32("attention.key_length").unwrap_or(n_embd / n_head);
        let head_dim_v = key_u32("attention.value_length").unwrap_or(n_embd / n_head);
        if !(1..=MAX_HEAD_DIM).contains(&head_dim_k) || !(1..=MAX_HEAD_DIM).contains(&head_dim_v) {
            return Err(bad(format!(
                "absurd head widths: key {head_dim_k}, value {head_dim_v} (1..={MAX_HEAD_DIM} allowed)"
            )));
        }

        let embd = g.tensor("token_embd.weight").ok_or_else(|| bad("no token_embd.weight tensor".into()))?;
        if embd.dims.len() != 2 || embd.dims[0] != u64::from(n_embd) {
            return Err(bad(format!("token_embd.weight has shape {:?}, expected [{n_embd}, n_vocab]", embd.dims)));
        }
        let n_vocab = u32::try_from(embd.dims[1]).map_err(|_| bad("absurd vocabulary size".into()))?;
        let output = g.tensor("output.weight");

        let mut layer_bytes = vec![0u64; n_layer as usize];
        let mut other_bytes = 0;
        let mut types: Vec<(String, usize)> = Vec::new();
        for t in &g.tensors {
            match types.iter_mut().find(|(n, _)| n == t.ggml_type.name) {
                Some((_, c)) => *c += 1,
                None => types.push((t.ggml_type.name.to_string(), 1)),
            }
            match t.layer() {
                Some((i, _)) if i < n_layer => {
                    // Tensors were checked to lie within the file, so their sum cannot
                    // overflow; checked all the same, as these are the file's numbers.
                    let sum = &mut layer_bytes[i as usize];
                    *sum = sum.checked_add(t.bytes).ok_or_else(|| bad(format!("block {i} has absurd size")))?;
                }
                // A next-token-prediction block: in no stage.
                Some((i, _)) if i < n_layer_all => {}
                Some((i, _)) => {
                    return Err(bad(format!("tensor {} names block {i}, but the model has {n_layer_all}", t.name)))
                }
                None if t.name == "token_embd.weight" || t.name == "output.weight" => {}
                None => {
                    other_bytes = u64::checked_add(other_bytes, t.bytes)
                        .ok_or_else(|| bad("the non-layer tensors have absurd size".into()))?
                }
            }
        }
        if let Some(empty) = layer_bytes.iter().position(|&b| b == 0) {
            return Err(bad(format!("block {empty} has no tensors")));
        }
        let swa_layers = swa_layers(g, arch, n_layer).map_err(bad)?;
        let positive = |k: &str| key_u32(k).is_ok_and(|v| v > 0);
        let mla =
            arch == Arch::DeepSeek2 && positive("attention.key_length_mla") && positive("attention.value_length_mla");
        // llama.cpp (`models/deepseek2.cpp`) reads the low-rank query only when the
        // model is not "lite" by its layer count (26, 27, or 48 with a vocabulary of
        // 128256): a full model's stage of such a size would load without it.
        let refused_stage_layers = if arch == Arch::DeepSeek2 && g.get("deepseek2.attention.q_lora_rank").is_some() {
            let vocab = g.get("deepseek2.vocab_size").and_then(Value::as_u64).unwrap_or(u64::from(n_vocab));
            let mut sizes = vec![26, 27];
            if vocab == 128_256 {
                sizes.push(48);
            }
            sizes.retain(|&n| n < n_layer);
            sizes
        } else {
            Vec::new()
        };
        let period = match arch {
            Arch::Llama4 => {
                if g.get(&format!("{arch_name}.attention.sliding_window")).and_then(Value::as_u64) == Some(0) {
                    // Then llama.cpp skips rope on the layer whose index + 1 is a
                    // multiple of the layer count: a shard's own last layer.
                    return Err(GgufError::Unsupported {
                        path: g.path.clone(),
                        what: "llama4 without chunked attention cannot be split: llama.cpp then leaves rope out of \
                               the last layer of whatever it loads, so each stage's last layer would run without it"
                            .into(),
                    });
                }
                // Experts on the layers whose index + 1 is a multiple of the step.
                let step = key_u32("interleave_moe_layer_step").unwrap_or(1).max(1);
                let base = arch.layer_period();
                let lcm = u64::from(base) * u64::from(step) / u64::from(gcd(base, step));
                u32::try_from(lcm)
                    .ok()
                    .filter(|&p| p <= n_layer.max(base))
                    .ok_or_else(|| bad(format!("absurd {arch_name}.interleave_moe_layer_step {step}")))?
            }
            _ => arch.layer_period(),
        };
        Ok(ModelMeta {
            arch,
            name: g.get("general.name").and_then(Value::as_str).map(str::to_owned),
            n_layer,
            n_embd,
            n_vocab,
            n_ctx_train,
            n_head,
            n_head_kv,
            n_ff,
            head_dim_k,
            head_dim_v,
            layer_bytes,
            embd_bytes: embd.bytes,
            output_bytes: output.map_or(0, |t| t.bytes),
            other_bytes,
            tied_embeddings: output.is_none(),
            tensor_types: types,
            swa_layers,
            nextn_layers,
            mla,
            refused_stage_layers,
            period,
        })
    }

    /// KV-cache bytes per token per layer at f16 (llama.cpp's default cache type): keys
    /// and values of each key/value head, or the compressed key alone under
    /// multi-head latent attention.
    /// Saturates rather than overflows (a parsed model's sizes are far from it).
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        let per_head = u64::from(self.head_dim_k) + if self.mla { 0 } else { u64::from(self.head_dim_v) };
        2u64.saturating_mul(u64::from(self.n_head_kv)).saturating_mul(per_head)
    }

    /// Tensor bytes a stage over this file reads: its layers, the small non-layer
    /// tensors, the embedding on stage 0 (and on the tail when the LM head is tied to
    /// it), the LM head on the tail. A shard's unused tensors are holes, not counted.
    pub fn stage_weight_bytes(&self, is_first: bool, is_tail: bool) -> u64 {
        let embd = is_first || (is_tail && self.tied_embeddings);
        // Parts of one file, so the sum fits; saturating for hand-built values.
        self.layer_bytes
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
            .saturating_add(self.other_bytes)
            .saturating_add(if embd { self.embd_bytes } else { 0 })
            .saturating_add(if is_tail { self.output_bytes } else { 0 })
    }

    /// Stage boundaries must be multiples of this (see [`ModelMeta::period`]).
    pub fn layer_period(&self) -> u32 {
        self.period
    }
}
