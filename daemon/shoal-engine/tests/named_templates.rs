//! A GGUF's named chat templates through the engine's `Vocab`: a model that keeps a
//! `tool_use` template beside its default one (`tokenizer.chat_template.tool_use`, as
//! Cohere's Command R, R+ and R7B GGUFs do) renders requests with tools through it and
//! every other request through the default one; a model without one, or with one that
//! cannot be used, renders everything through its default one, as before.

use serde_json::json;
use shoal_engine::Vocab;
use shoal_gguf::zoo::Family;
use std::path::{Path, PathBuf};

/// Where setup keeps llama.cpp's vocabularies and templates.
fn vocabs() -> PathBuf {
    let p = shoal_gguf::models_dir().join("llama.cpp-vocabs");
    assert!(p.join(".complete").exists(), "{} is missing: run scripts/setup.sh", p.display());
    p
}

/// The template of `name` among llama.cpp's.
fn template(name: &str) -> String {
    std::fs::read_to_string(vocabs().join("templates").join(name)).unwrap()
}

/// The chat template `key` of the GGUF at `path`.
fn template_in(path: &Path, key: &str) -> String {
    let gguf = shoal_gguf::Gguf::open(path).unwrap();
    gguf.get(key).and_then(shoal_gguf::Value::as_str).unwrap_or_else(|| panic!("{key} in {}", path.display())).into()
}

/// A conversation with one question and a tool offered, as the API hands them over.
fn ask_with_tools(v: &Vocab) -> String {
    let messages = json!([{"role": "user", "content": "Hi there"}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    v.chat_with_tools(&messages, &tools).unwrap()
}

/// Text only Command R7B's `tool_use` template writes (its system preamble), and text
/// it writes where tools are offered.
const R7B_PREAMBLE: &str = "# System Preamble";
const R7B_TOOLS: &str = "Available Tools";

#[test]
fn requests_with_tools_use_the_tool_use_template_and_the_rest_the_default_one() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = vocabs().join("ggml-vocab-command-r.gguf");
    // Command R's own default template (which has no tool syntax), as its GGUFs carry it,
    // with Command R7B's tool_use template beside it.
    let default = template_in(&vocab, "tokenizer.chat_template");
    let tool_use = template("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja");
    let path = dir.path().join("both.gguf");
    let named = [("tool_use", tool_use.as_str())];
    shoal_gguf::zoo::write_with_templates(Family::CommandR, &vocab, Some(&default), &named, &path).unwrap();
    assert_eq!(template_in(&path, "tokenizer.chat_template.tool_use"), tool_use);
    let v = Vocab::load(&path).unwrap();
    assert!(v.has_chat_template());
    assert_eq!(v.template_source().as_deref(), Some(default.as_str()));
    assert_eq!(v.tool_template_source().as_deref(), Some(tool_use.as_str()));
    // Without tools: the default template.
    let chat = v.chat(&[("user", "Hi there")]).unwrap();
    assert!(chat.contains("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"), "{chat:?}");
    assert!(!chat.contains(R7B_PREAMBLE), "{chat:?}");
    // With tools: the tool_use template, which lists them.
    let chat = ask_with_tools(&v);
    for part in [R7B_PREAMBLE, R7B_TOOLS, "get_weather", "Hi there"] {
        assert!(chat.contains(part), "{part:?} not in {chat:?}");
    }

    // The vocabulary as llama.cpp ships it: a real Command R GGUF's three templates
    // (default, tool_use, rag; the last is not read).
    let path = dir.path().join("command-r.gguf");
    shoal_gguf::zoo::write(Family::CommandR, &vocab, &path).unwrap();
    let v = Vocab::load(&path).unwrap();
    assert_eq!(v.template_source().as_deref(), Some(default.as_str()));
    let own = template_in(&vocab, "tokenizer.chat_template.tool_use");
    assert_ne!(own, default);
    assert_eq!(v.tool_template_source().as_deref(), Some(own.as_str()));
}

#[test]
fn a_model_without_a_usable_tool_use_template_renders_tools_through_its_default_one() {
    let dir = tempfile::tempdir().unwrap();
    let qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja");
    let vocab = vocabs().join("ggml-vocab-qwen2.gguf");
    let with = |name: &str, named: &[(&str, &str)]| {
        let path = dir.path().join(name);
        shoal_gguf::zoo::write_with_templates(Family::Qwen2, &vocab, Some(&qwen), named, &path).unwrap();
        Vocab::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    // None named (as before), an empty one, one that does not parse: each left out (the
    // last two with a warning), never an error.
    for (name, named) in [
        ("none.gguf", &[][..]),
        ("empty.gguf", &[("tool_use", " \n")][..]),
        ("broken.gguf", &[("tool_use", "{% for m in messages %}<|START_ACTION|>")][..]),
        // Another name: only tool_use is read.
        ("rag.gguf", &[("rag", "{{ 'rag' }}")][..]),
    ] {
        let v = with(name, named);
        assert_eq!(v.tool_template_source().as_deref(), Some(qwen.as_str()), "{name}");
        let chat = ask_with_tools(&v);
        // Qwen 2.5's own tool listing.
        assert!(chat.contains("<tools>") && chat.contains("get_weather"), "{name}: {chat:?}");
        assert!(chat.contains("<|im_start|>user\nHi there<|im_end|>"), "{name}: {chat:?}");
    }

    // Only a tool_use template: it serves every request, as llama.cpp's server uses it.
    let path = dir.path().join("only.gguf");
    let named = [("tool_use", qwen.as_str())];
    shoal_gguf::zoo::write_with_templates(Family::Qwen2, &vocab, None, &named, &path).unwrap();
    let v = Vocab::load(&path).unwrap();
    assert!(v.has_chat_template());
    assert_eq!(v.template_source().as_deref(), Some(qwen.as_str()));
    let chat = v.chat(&[("user", "Hi there")]).unwrap();
    assert!(chat.contains("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"), "{chat:?}");
}
