//! The zoo families' real tokenizers and chat templates through the engine's `Vocab`:
//! llama.cpp's vocabulary-only GGUFs (the families' real vocabularies, with llama.cpp's
//! own tokenizer test vectors) and the families' real chat templates, fetched by
//! `scripts/setup.sh`. Each is put into a zoo model of the family (the weights do not
//! matter to a vocabulary), loaded as the coordinator loads a model's vocabulary, and
//! checked: every test vector tokenizes to llama.cpp's ids, a conversation renders in
//! the family's format, and its special tokens come out as single tokens.

use shoal_engine::Vocab;
use shoal_gguf::zoo::Family;
use std::path::{Path, PathBuf};

/// Where setup keeps llama.cpp's vocabularies and templates.
fn vocabs() -> PathBuf {
    let p = shoal_gguf::models_dir().join("llama.cpp-vocabs");
    assert!(p.join(".complete").exists(), "{} is missing: run scripts/setup.sh", p.display());
    p
}

fn smollm2() -> PathBuf {
    shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// One family's tokenizer and template.
struct Case {
    /// What is checked, for messages.
    name: &'static str,
    /// The zoo model that carries them.
    family: Family,
    /// llama.cpp's vocabulary-only GGUF of the family; `None` where llama.cpp ships
    /// none (gpt-oss's o200k, Mistral's Tekken): SmolLM2's then carries the template.
    vocab: Option<&'static str>,
    /// The family's chat template, in llama.cpp's `models/templates`.
    template: &'static str,
    /// Text the rendered conversation must contain.
    markers: &'static [&'static str],
    /// Special tokens of the rendered conversation that must be single tokens.
    specials: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        name: "llama (Llama 3.3 70B)",
        family: Family::Qwen2,
        vocab: Some("ggml-vocab-llama-bpe.gguf"),
        template: "meta-llama-Llama-3.3-70B-Instruct.jinja",
        markers: &["<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>", "<|start_header_id|>assistant"],
        specials: &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    },
    Case {
        name: "qwen2 (Qwen 2.5)",
        family: Family::Qwen2,
        vocab: Some("ggml-vocab-qwen2.gguf"),
        template: "Qwen-Qwen2.5-7B-Instruct.jinja",
        markers: &["<|im_start|>user\nHi there<|im_end|>", "<|im_start|>assistant\n"],
        specials: &["<|im_start|>", "<|im_end|>"],
    },
    Case {
        name: "qwen3 (Qwen 3)",
        family: Family::Qwen3,
        vocab: Some("ggml-vocab-qwen2.gguf"),
        template: "Qwen-Qwen3-0.6B.jinja",
        markers: &["<|im_start|>user\nHi there<|im_end|>", "<|im_start|>assistant\n"],
        specials: &["<|im_start|>", "<|im_end|>"],
    },
    Case {
        name: "qwen3moe (Qwen 3 Coder)",
        family: Family::Qwen3Moe,
        vocab: Some("ggml-vocab-qwen2.gguf"),
        template: "Qwen3-Coder.jinja",
        markers: &["<|im_start|>user\nHi there<|im_end|>", "<|im_start|>assistant\n"],
        specials: &["<|im_start|>", "<|im_end|>"],
    },
    Case {
        name: "phi3 (Phi 3.5)",
        family: Family::Phi3,
        vocab: Some("ggml-vocab-phi-3.gguf"),
        template: "microsoft-Phi-3.5-mini-instruct.jinja",
        markers: &["<|user|>\nHi there<|end|>", "<|assistant|>"],
        specials: &["<|user|>", "<|end|>", "<|assistant|>"],
    },
    Case {
        name: "command-r (Command R+)",
        family: Family::CommandR,
        vocab: Some("ggml-vocab-command-r.gguf"),
        template: "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
        markers: &["<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>"],
        specials: &["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>"],
    },
    Case {
        name: "deepseek2 (DeepSeek V3.1 over DeepSeek V2's vocabulary)",
        family: Family::DeepSeek2,
        vocab: Some("ggml-vocab-deepseek-llm.gguf"),
        template: "deepseek-ai-DeepSeek-V3.1.jinja",
        markers: &["<｜User｜>Hi there", "<｜Assistant｜>"],
        specials: &[],
    },
    Case {
        name: "deepseek2 (Kimi K2)",
        family: Family::DeepSeek2,
        vocab: None,
        template: "moonshotai-Kimi-K2.jinja",
        markers: &["<|im_user|>user<|im_middle|>Hi there<|im_end|>", "<|im_assistant|>assistant<|im_middle|>"],
        specials: &[],
    },
    Case {
        name: "gpt-oss (gpt-oss-120b)",
        family: Family::GptOss,
        vocab: None,
        template: "openai-gpt-oss-120b.jinja",
        markers: &["<|start|>user<|message|>Hi there<|end|>", "<|start|>assistant"],
        specials: &[],
    },
    Case {
        name: "mistral3 (Mistral Small 3.2)",
        family: Family::Mistral3,
        vocab: None,
        template: "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        markers: &["[INST]Hi there[/INST]"],
        specials: &[],
    },
];

/// llama.cpp's tokenizer test vectors for `vocab`: (text, ids), split and parsed as
/// its `test-tokenizer-0` does.
fn vectors(vocab: &Path) -> Vec<(String, Vec<i32>)> {
    let read = |ext: &str| {
        let p = PathBuf::from(format!("{}.{ext}", vocab.display()));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let (inp, out) = (read("inp"), read("out"));
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(sep) {
            Some(i) => {
                texts.push(rest[..i].to_string());
                rest = &rest[i + sep.len()..];
            }
            None => {
                texts.push(rest.to_string());
                rest = "";
            }
        }
    }
    let ids: Vec<Vec<i32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().expect("a token id")).collect()).collect();
    assert_eq!(texts.len(), ids.len(), "{}: test vectors", vocab.display());
    texts.into_iter().zip(ids).collect()
}

#[test]
fn each_familys_tokenizer_and_chat_template_work_through_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let vocabs = vocabs();
    for case in CASES {
        let vocab_file = case.vocab.map_or_else(smollm2, |v| vocabs.join(v));
        let template = std::fs::read_to_string(vocabs.join("templates").join(case.template)).unwrap();
        let path = dir.path().join(format!("{}.gguf", case.name.replace([' ', '(', ')', '.'], "_")));
        shoal_gguf::zoo::write_with_template(case.family, &vocab_file, &template, &path).unwrap();
        let v = Vocab::load(&path).unwrap_or_else(|e| panic!("{}: {e}", case.name));

        if case.vocab.is_some() {
            // The real tokenizer: llama.cpp's own vectors, no BOS, special text as text.
            let vectors = vectors(&vocab_file);
            assert!(vectors.len() >= 20, "{}: {} vectors", case.name, vectors.len());
            for (text, want) in &vectors {
                let got: Vec<i32> =
                    v.model().vocab().tokenize(text.as_bytes(), false, false).iter().map(|t| t.0).collect();
                assert_eq!(&got, want, "{}: {text:?}", case.name);
            }
        }

        // The model's own template, a conversation in the family's format.
        let chat =
            v.chat(&[("system", "Be brief."), ("user", "Hi there")]).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        for m in case.markers {
            assert!(chat.contains(m), "{}: {m:?} not in {chat:?}", case.name);
        }
        assert_special_tokens_whole(&v, &chat, case.specials, case.name);
    }
}

/// Each of `specials` is one token, and one of `chat`'s tokens.
fn assert_special_tokens_whole(v: &Vocab, chat: &str, specials: &[&str], what: &str) {
    let tokens = v.tokenize(chat, true);
    // `tokenize` starts with the BOS where the model wants one.
    let bos = v.tokenize("", false).len();
    for s in specials {
        let ids = v.tokenize(s, true)[bos..].to_vec();
        assert_eq!(ids.len(), 1, "{what}: {s:?} is not one token: {ids:?}");
        assert!(tokens.contains(&ids[0]), "{what}: {s:?} ({}) not among the tokens of {chat:?}", ids[0]);
    }
}

/// Gemma 3: the test model's own vocabulary (SentencePiece, 262k tokens) carries
/// Gemma's turn format (the Gemma 2 template: Gemma 3 keeps its turns), as the real
/// model's GGUFs do; the test model itself has no template.
#[test]
fn gemma3s_tokenizer_and_turn_format_work_through_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let gemma = shoal_gguf::models_dir().join("gemma-3-270m-q4_k_m.gguf");
    let template = std::fs::read_to_string(vocabs().join("templates/google-gemma-2-2b-it.jinja")).unwrap();
    let path = dir.path().join("gemma.gguf");
    shoal_gguf::zoo::write_with_template(Family::Qwen2, &gemma, &template, &path).unwrap();
    let v = Vocab::load(&path).unwrap();
    let chat = v.chat(&[("user", "Hi there")]).unwrap();
    assert!(chat.contains("<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"), "{chat:?}");
    assert_special_tokens_whole(&v, &chat, &["<start_of_turn>", "<end_of_turn>"], "gemma");
    let text = "Fish 🐟 swim";
    assert_eq!(v.detokenize(&v.tokenize(text, false)).trim_start(), text);
}

/// Every chat template llama.cpp ships (71 models' real templates) renders as Jinja in
/// Shoal's renderer, but for the two that refuse such a conversation themselves: Gemma
/// 2's refuses a system turn (it renders without one) and FireFunction's needs a
/// `functions` variable of its own API. A change of renderer that breaks a template
/// shows here.
#[test]
fn llama_cpps_model_templates_all_render_as_jinja() {
    use shoal_engine::template::{render, Turn};
    let with_system = [Turn { role: "system", content: "Be brief." }, Turn { role: "user", content: "Hi there" }];
    let dir = vocabs().join("templates");
    let mut rendered = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "jinja") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let template = std::fs::read_to_string(&path).unwrap();
        match (name.as_str(), render(&template, &with_system, "<s>", "</s>")) {
            ("google-gemma-2-2b-it.jinja", Err(e)) => {
                assert!(e.contains("System role not supported"), "{name}: {e}");
                let out = render(&template, &with_system[1..], "<s>", "</s>").unwrap();
                assert!(out.contains("Hi there"), "{name}: {out}");
            }
            ("fireworks-ai-llama-3-firefunction-v2.jinja", Err(e)) => assert!(e.contains("functions"), "{name}: {e}"),
            (_, Ok(out)) => assert!(out.contains("Hi there"), "{name}: {out}"),
            (_, Err(e)) => panic!("{name}: {e}"),
        }
        rendered += 1;
    }
    assert!(rendered >= 70, "only {rendered} templates in {}", dir.display());
}

/// The real templates of reasoning models take the variables a request sets: Qwen 3's
/// closes the thinking at once with `enable_thinking` false and leaves it to the model
/// otherwise; gpt-oss's writes the effort asked for (medium by default), ends the
/// prompt at `<|start|>assistant`, and writes an earlier call and its result (the
/// messages as Shoal's API gives them to it, OpenAI's shape with the call's content
/// empty, not null) as harmony's commentary messages.
#[test]
fn reasoning_templates_take_the_requests_variables() {
    use shoal_engine::template::{render_as, render_json_as, Turn, Vars};
    let dir = vocabs().join("templates");
    let hi = [Turn { role: "user", content: "Hi there" }];
    let qwen3 = std::fs::read_to_string(dir.join("Qwen-Qwen3-0.6B.jinja")).unwrap();
    let think = render_as(&qwen3, &hi, "", "", Vars::default()).unwrap();
    assert!(think.ends_with("<|im_start|>assistant\n"), "{think:?}");
    let off = Vars { enable_thinking: Some(false), ..Vars::default() };
    let no_think = render_as(&qwen3, &hi, "", "", off).unwrap();
    assert!(no_think.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{no_think:?}");

    let gpt_oss = std::fs::read_to_string(dir.join("openai-gpt-oss-120b.jinja")).unwrap();
    let medium = render_as(&gpt_oss, &hi, "", "", Vars::default()).unwrap();
    assert!(medium.contains("Reasoning: medium") && medium.ends_with("<|start|>assistant"), "{medium:?}");
    let high = Vars { reasoning_effort: Some("high"), ..Vars::default() };
    assert!(render_as(&gpt_oss, &hi, "", "", high).unwrap().contains("Reasoning: high"));
    let weather = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let messages = serde_json::json!([{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1", "name": "get_weather"}]);
    let out = render_json_as(&gpt_oss, &messages, &weather, "", "", Vars::default()).unwrap();
    for part in [
        "namespace functions",
        "type get_weather = (_: {",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|call|>",
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"-3 C\"<|end|>",
    ] {
        assert!(out.contains(part), "{part:?} not in {out:?}");
    }
    assert!(out.ends_with("<|start|>assistant"), "{out:?}");
}
