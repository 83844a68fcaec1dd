//! The model zoo's families (tiny random-weight GGUFs written by `shoal_gguf::zoo`)
//! through what a user's model goes through: the planner's memory prediction per stage
//! against what llama.cpp allocates for it, and `shoal run` split against unsplit.
//! (The engine's tests check every split of each family bit for bit.)

mod common;

use common::model;
use shoal_engine::{load_split, ShardCache, StageConfig};
use shoal_gguf::zoo::Family;
use shoal_planner::model::{ModelProfile, Sizing};
use shoal_types::Stage;

#[test]
fn the_planners_memory_prediction_is_within_one_percent_of_llama_cpps_for_every_zoo_family_and_gemma3() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ShardCache::new(dir.path().join("shards"));
    let sizing = Sizing { context: 512, sessions: 2, chunk: 32 };
    let config = StageConfig {
        n_ctx_per_session: sizing.context,
        max_sessions: sizing.sessions,
        chunk: sizing.chunk,
        threads: 1,
        gpu_layers: 0,
        gpus: Vec::new(),
    };
    // Each zoo family split in the middle, and Gemma 3 (two kinds of layer, two KV caches)
    // split inside its sliding-window pattern.
    let mut models: Vec<(std::path::PathBuf, u32)> = Family::ALL
        .iter()
        .map(|family| {
            let path = dir.path().join(format!("{}.gguf", family.arch()));
            shoal_gguf::zoo::write(*family, &model("SmolLM2-135M-Instruct.Q4_1.gguf"), &path).unwrap();
            // The middle (4 layers: 2; Llama 4's 8, on its period of 4: 4).
            (path, family.layers() / 2)
        })
        .collect();
    models.push((model("gemma-3-270m-q4_k_m.gguf"), 9));
    for (path, point) in &models {
        let (meta, stages) = load_split(path, &[*point], &cache, &config).unwrap();
        let family = meta.arch;
        let profile = ModelProfile::from_meta(&meta);
        for stage in &stages {
            let layers = stage.info().layers;
            let (predicted, loaded) = (profile.stage_memory(layers, &sizing), stage.memory());
            let (p, l) = (predicted.total() as f64, loaded.total() as f64);
            eprintln!(
                "{} layers {layers}: predicted {predicted:?}, llama.cpp {loaded:?}, ratio {:.4}",
                family.name(),
                l / p
            );
            assert_eq!(predicted.weights, loaded.weights, "{} {layers}", family.name());
            // The KV cache exactly, up to llama.cpp's rounding of each of its (at most
            // two) buffers to 0.01 MiB: at the zoo's sizes the total's 1% would hide a
            // cache counted twice over (values that latent attention does not store).
            let rounding = 2 * 5243;
            assert!(
                predicted.kv.abs_diff(loaded.kv) <= rounding,
                "{} {layers}: KV predicted {}, llama.cpp {}",
                family.name(),
                predicted.kv,
                loaded.kv
            );
            assert!((l / p - 1.0).abs() <= 0.01, "{} {layers}: predicted {p}, llama.cpp {l}", family.name());
        }
    }
}

/// Models whose templates speak a tool syntax Shoal reads call tools in it through a
/// node's OpenAI route: Qwen 2.5 (Hermes' `<tool_call>` blocks), Qwen3-Coder (XML
/// `<tool_call>` blocks, `<function=NAME>` with a `<parameter=KEY>` per argument, its
/// template run on Qwen 2's vocabulary, which its own extends), Llama 3.3 (one
/// `{"name", "parameters"}` object), Command R7B (`<|START_ACTION|>` lists), Command
/// R+ (`Action:` and a `` ```json `` fenced list), DeepSeek R1's Qwen distill and
/// DeepSeek V3.1 (`<｜tool▁calls▁begin｜>` calls), Mistral Nemo (a `[TOOL_CALLS]`
/// list), Mistral Small 3.2 and Ministral 3 (`[TOOL_CALLS]NAME[ARGS]` calls), each the zoo's qwen2 weights under the family's real vocabulary (V3.1:
/// DeepSeek LLM's, the nearest there is; Mistral's: none of llama.cpp's test
/// vocabularies is one, so their templates run on Llama 3's BPE one, the nearest to
/// their Tekken) and chat template. Command R7B's and Command R+'s are their `tool_use`
/// templates, each kept beside a default one without tool syntax (Command R's, the
/// vocabulary's own) as Cohere's GGUFs keep it: requests with tools go through the
/// former, the rest the latter (Command R+'s, which needs every parameter described,
/// gets empty descriptions from the API where a request's tool has none). The
/// template (or, for DeepSeek's, which do not list tools, the system message) lists
/// the tools, a grammar holds a required call to the model's syntax, and the answer
/// comes back as parsed `tool_calls` whose arguments follow the tool's schema; the
/// conversation with the call and its result goes back through the template, which
/// writes them in the model's syntax, for the next turn.
/// The syntax's markers must come back as text from the vocabulary (the answer is
/// read from text): in these vocabularies they are not tokens of their own but
/// ordinary text (Mistral's, control tokens in its own vocabularies, are shown as their
/// text: the route tests check that on a fake vocabulary). Mistral's templates take
/// only 9-character call ids: the call sent back is the API's, with such an id.
/// The node reads each model's thinking syntax off the same templates (gpt-oss's
/// harmony and the other reasoning templates are read off their files). The other
/// templates that write Qwen3-Coder's XML (Qwen 3.5's, Nemotron 3 Nano's, Step 3.5
/// Flash's) are read as such off their files, and GLM's `<arg_key>` ones (whose
/// architectures Shoal does not run) as none Shoal reads.
#[test]
fn models_call_tools_in_their_own_syntax_through_the_api() {
    use common::{shoal, wait_for};
    use serde_json::{json, Value};
    use shoal_api::{ThinkingSyntax, ToolSyntax};
    use shoal_node::runtime::Engine;
    let tmp = tempfile::tempdir().unwrap();
    let vocabs = shoal_gguf::models_dir().join("llama.cpp-vocabs");
    // What the template writes for an earlier call of get_weather(Oslo, c) and its
    // result "-3 c".
    // (file, vocabulary, template, written as the `tool_use` template beside the
    // vocabulary's default one, its syntax, what it writes)
    type Row = (&'static str, &'static str, &'static str, bool, ToolSyntax, &'static [&'static str]);
    let models: [Row; 10] = [
        (
            "qwen-tools.gguf",
            "ggml-vocab-qwen2.gguf",
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            false,
            ToolSyntax::Hermes,
            &[
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>",
                "<tool_response>\n-3 c\n</tool_response>",
            ],
        ),
        (
            "qwen3-coder-tools.gguf",
            "ggml-vocab-qwen2.gguf",
            "Qwen3-Coder.jinja",
            false,
            ToolSyntax::QwenXml,
            &[
                "<tools>\n<function>\n<name>get_weather</name>\n<description>The weather in a city</description>",
                "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n\
                 <parameter=unit>\nc\n</parameter>\n</function>\n</tool_call><|im_end|>",
                "<|im_start|>user\n<tool_response>\n-3 c\n</tool_response>\n<|im_end|>",
            ],
        ),
        (
            "llama-tools.gguf",
            "ggml-vocab-llama-bpe.gguf",
            "meta-llama-Llama-3.3-70B-Instruct.jinja",
            false,
            ToolSyntax::Llama3,
            &[
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"c\"}}",
                "<|start_header_id|>ipython<|end_header_id|>\n\n",
                "-3 c",
            ],
        ),
        (
            "command-r7b-tools.gguf",
            "ggml-vocab-command-r.gguf",
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
            true,
            ToolSyntax::CommandR7b,
            &[
                "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": \
                 {\"city\": \"Oslo\", \"unit\": \"c\"}}\n]<|END_ACTION|>",
                "<|START_TOOL_RESULT|>[\n    {\n        \"tool_call_id\": \"0\",\n        \"results\": {\n            \
                 \"0\": \"-3 c\"",
            ],
        ),
        (
            "command-r-plus-tools.gguf",
            "ggml-vocab-command-r.gguf",
            "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
            true,
            ToolSyntax::CommandRPlus,
            &[
                "```python\ndef get_weather(city: str, unit: Any) -> List[Dict]:\n    \"\"\"The weather in a city\n\n    \
                 Args:\n        city (str): The city.\n        unit (Any): The unit.\n    \"\"\"\n    pass\n```",
                "<|CHATBOT_TOKEN|>\nAction:\n```json\n[\n    {\n        \"tool_name\": \"get_weather\",\n        \
                 \"parameters\": {\n            \"city\": \"Oslo\",\n            \"unit\": \"c\"\n        }\n    }\n]```\n\
                 <|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><results>\n-3 c</results><|END_OF_TURN_TOKEN|>",
                "You should use the `directly-answer` tool",
            ],
        ),
        (
            "deepseek-r1-tools.gguf",
            "ggml-vocab-qwen2.gguf",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            false,
            ToolSyntax::DeepSeekR1 { lists_tools: false },
            &[
                "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n\
                 {\"city\": \"Oslo\", \"unit\": \"c\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>\
                 <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>-3 c<｜tool▁output▁end｜>",
            ],
        ),
        (
            "deepseek-v31-tools.gguf",
            "ggml-vocab-deepseek-llm.gguf",
            "deepseek-ai-DeepSeek-V3.1.jinja",
            false,
            ToolSyntax::DeepSeekV31 { lists_tools: false },
            &[
                "<｜Assistant｜><think></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>\
                 {\"city\": \"Oslo\", \"unit\": \"c\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>\
                 <｜tool▁output▁begin｜>-3 c<｜tool▁output▁end｜>",
            ],
        ),
        (
            "mistral-nemo-tools.gguf",
            "ggml-vocab-llama-bpe.gguf",
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            false,
            ToolSyntax::MistralNemo,
            &[
                "[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \
                 \"The weather in a city\", \"parameters\": {\"type\": \"object\"",
                "[/AVAILABLE_TOOLS][INST]What is the weather in Oslo?[/INST]",
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}, \"id\": \
                 \"call00001\"}]<|end_of_text|>",
                "[TOOL_RESULTS]{\"content\": -3 c, \"call_id\": \"call00001\"}[/TOOL_RESULTS]",
            ],
        ),
        (
            "mistral-small-tools.gguf",
            "ggml-vocab-llama-bpe.gguf",
            "Mistral-Small-3.2-24B-Instruct-2506.jinja",
            false,
            ToolSyntax::Mistral { call_ids: true },
            &[
                "[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"",
                "[/INST][TOOL_CALLS]get_weather[CALL_ID]call00001[ARGS]{\"city\": \"Oslo\", \"unit\": \"c\"}",
                "[TOOL_RESULTS]call00001[TOOL_CONTENT]-3 c[/TOOL_RESULTS]",
            ],
        ),
        (
            "ministral-tools.gguf",
            "ggml-vocab-llama-bpe.gguf",
            "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
            false,
            ToolSyntax::Mistral { call_ids: false },
            &[
                "[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"",
                "[/INST][TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\", \"unit\": \"c\"}",
                "[TOOL_RESULTS]-3 c[/TOOL_RESULTS]",
            ],
        ),
    ];
    // The texts a syntax's answers are read by.
    let markers = |syntax: ToolSyntax| -> &[&str] {
        match syntax {
            ToolSyntax::CommandR7b => &["<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
            ToolSyntax::CommandRPlus => &["Action:", "```json"],
            ToolSyntax::DeepSeekR1 { .. } | ToolSyntax::DeepSeekV31 { .. } => &[
                "<｜tool▁calls▁begin｜>",
                "<｜tool▁call▁begin｜>",
                "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>",
            ],
            ToolSyntax::MistralNemo => &["[TOOL_CALLS]"],
            ToolSyntax::Mistral { .. } => &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            ToolSyntax::QwenXml => {
                &["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"]
            }
            _ => &[],
        }
    };
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}});
    let ask = json!({"role": "user", "content": "What is the weather in Oslo?"});
    // Devstral's (Unsloth's) template speaks the later Mistral syntax too, without ids.
    let devstral = std::fs::read_to_string(vocabs.join("templates/unsloth-mistral-Devstral-Small-2507.jinja")).unwrap();
    assert_eq!(ToolSyntax::of(&devstral), ToolSyntax::Mistral { call_ids: false });
    // gpt-oss's speaks harmony (its calls and its thinking); the other reasoning
    // models' templates write `<think>` (there is no o200k vocabulary here to run it on).
    let read = |t: &str| std::fs::read_to_string(vocabs.join("templates").join(t)).unwrap();
    let gpt_oss = read("openai-gpt-oss-120b.jinja");
    assert_eq!(
        (ToolSyntax::of(&gpt_oss), ThinkingSyntax::of(&gpt_oss)),
        (ToolSyntax::Harmony, ThinkingSyntax::Harmony)
    );
    for t in ["Qwen-Qwen3-0.6B.jinja", "Qwen-QwQ-32B.jinja", "HuggingFaceTB-SmolLM3-3B.jinja"] {
        assert_eq!(ThinkingSyntax::of(&read(t)), ThinkingSyntax::Tags { open: "<think>", close: "</think>" }, "{t}");
    }
    // Qwen3-Coder's XML calls in the templates of architectures Shoal does not run yet.
    for t in ["Qwen3.5-4B.jinja", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "StepFun3.5-Flash.jinja"] {
        assert_eq!(ToolSyntax::of(&read(t)), ToolSyntax::QwenXml, "{t}");
    }
    // Cohere's later template keeps Command R7B's markers (and says `"tool_name"` and
    // shows a `json` fence, as Command R+'s does).
    assert_eq!(ToolSyntax::of(&read("Cohere2MoE.jinja")), ToolSyntax::CommandR7b);
    // GLM's `<tool_call>NAME<arg_key>…` calls are not Hermes' (and not read yet); nor is
    // Seed-OSS's `<seed:tool_call>` XML Qwen's.
    for t in [
        "GLM-4.6.jinja",
        "GLM-4.7-Flash.jinja",
        "Spark2.5.jinja",
        "inclusionai-ling-3.0-flash.jinja",
        "poolside-Laguna-S-2.1.jinja",
        "poolside-Laguna-XS-2.1.jinja",
        "poolside-Laguna-XS.2.jinja",
        "ByteDance-Seed-OSS.jinja",
    ] {
        assert_eq!(ToolSyntax::of(&read(t)), ToolSyntax::Generic, "{t}");
    }
    for (name, vocab, template_name, tool_use, syntax, rendered) in models {
        let template = std::fs::read_to_string(vocabs.join("templates").join(template_name)).unwrap();
        let path = tmp.path().join(name);
        let vocab = vocabs.join(vocab);
        if tool_use {
            // Its default template: one without tool syntax.
            let gguf = shoal_gguf::Gguf::open(&vocab).unwrap();
            let own = gguf.get("tokenizer.chat_template").and_then(shoal_gguf::Value::as_str).unwrap().to_string();
            assert_eq!(ToolSyntax::of(&own), ToolSyntax::Generic, "{name}");
            let named = [("tool_use", template.as_str())];
            shoal_gguf::zoo::write_with_templates(Family::Qwen2, &vocab, Some(&own), &named, &path).unwrap();
        } else {
            shoal_gguf::zoo::write_with_template(Family::Qwen2, &vocab, &template, &path).unwrap();
        }
        // The syntax the node will speak, read off the template it renders tools with.
        let text = shoal::engine::LlamaEngine { threads: 1, draft_models: Vec::new() }.text(&path).unwrap();
        assert_eq!(text.tool_syntax(), syntax, "{name}");
        // The thinking, read off the same templates (Command R7B's off its `tool_use`
        // one, its default one having none).
        let thinking = match template_name {
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja" => Some(("<|START_THINKING|>", "<|END_THINKING|>")),
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja" | "deepseek-ai-DeepSeek-V3.1.jinja" => {
                Some(("<think>", "</think>"))
            }
            "mistralai-Ministral-3-14B-Reasoning-2512.jinja" => Some(("[THINK]", "[/THINK]")),
            _ => None,
        };
        let thinking = thinking.map_or(ThinkingSyntax::None, |(open, close)| ThinkingSyntax::Tags { open, close });
        assert_eq!(text.thinking(), thinking, "{name}");
        if tool_use {
            // A request without tools: the default template (Command R's turns, none
            // of Command R7B's system preamble).
            let hi = shoal_api::ChatMessage { role: "user".into(), content: "Hi there".into() };
            let plain = text.chat_prompt(&[hi]).unwrap();
            assert!(plain.contains("<|USER_TOKEN|>Hi there") && !plain.contains("# System Preamble"), "{plain:?}");
        }
        for marker in markers(syntax) {
            let tokens = text.tokenize(marker, true);
            eprintln!("{name}: {marker} is {} token(s) (BOS included where the model adds one)", tokens.len());
            let back: Vec<u8> = tokens.iter().flat_map(|&t| text.piece(t)).collect();
            assert_eq!(String::from_utf8_lossy(&back), *marker, "{name}: {tokens:?}");
        }
        // An earlier call and its result, as the API gives them to the template (to
        // Mistral's: a 9-character id, content "" beside calls; to Command R+'s, which
        // writes the content before the call, content "").
        let mistral = matches!(syntax, ToolSyntax::MistralNemo | ToolSyntax::Mistral { .. });
        let content = if mistral || syntax == ToolSyntax::CommandRPlus { json!("") } else { Value::Null };
        let messages = json!([ask, {"role": "assistant", "content": content, "tool_calls": [{"type": "function",
            "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]},
            {"role": "tool", "content": "-3 c", "tool_call_id": "call00001", "name": "get_weather"}]);
        let mut tool = weather.clone();
        if syntax == ToolSyntax::CommandRPlus {
            // Its template writes every parameter's description, which must be there
            // (the API gives an empty one to a request's tool that has none).
            for p in ["city", "unit"] {
                tool["function"]["parameters"]["properties"][p]["description"] = json!(format!("The {p}."));
            }
        }
        let prompt = text.chat_prompt_with_tools(&messages, &json!([tool])).unwrap();
        for part in rendered {
            assert!(prompt.contains(part), "{name}: {part:?} not in {prompt:?}");
        }
    }

    let dir = tmp.path().join("a");
    let mut node = shoal()
        .args(["serve", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0", "--mdns-allow", "lo"])
        .args(["--http-listen", "127.0.0.1:0", "--name", "a", "--threads", "1", "--create-cluster", "--data-dir"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _node = Kill(&mut node);
    let run = |args: &[&str]| {
        let out = shoal().args(args).arg("--data-dir").arg(&dir).output().unwrap();
        assert!(out.status.success(), "shoal {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    wait_for("the node's cluster", 30, || {
        let out = shoal().args(["status", "--json", "--data-dir"]).arg(&dir).output().ok()?;
        let s: Value = serde_json::from_slice(&out.stdout).ok()?;
        (!s["cluster"].is_null()).then_some(())
    });
    let api = std::fs::read_to_string(dir.join("http")).unwrap().trim().to_string();
    let post = |body: &Value| {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut r = agent
            .post(&format!("http://{api}/v1/chat/completions"))
            .header("content-type", "application/json")
            .send(body.to_string())
            .unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    for (name, _, _, _, syntax, _) in models {
        run(&["models", "add", tmp.path().join(name).to_str().unwrap()]);
        let loaded = run(&["models", "load", name, "--context", "2048", "--wait"]);
        assert!(loaded.contains("ready: 1 stage(s)"), "{loaded}");
        // At most ~250 tokens whatever the model writes: the grammar bounds whitespace
        // and the city's length.
        let v = post(&json!({"model": name, "messages": [ask], "tools": [weather], "tool_choice": "required",
            "parallel_tool_calls": false, "temperature": 0, "max_tokens": 512}));
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{name}: {v}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{name}: {v}");
        assert_eq!(calls[0]["function"]["name"], "get_weather", "{name}: {v}");
        let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string() && ["c", "f"].contains(&args["unit"].as_str().unwrap()), "{name}: {args}");
        // The prompt was the model's own: the tools listed by its template (which the
        // question alone does not have).
        let with_tools = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let plain = post(&json!({"model": name, "messages": [ask], "temperature": 0, "max_tokens": 1}));
        assert!(with_tools > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 60, "{name}: {v}");

        // The call and its result go back through the template; a free (auto) answer.
        let id = calls[0]["id"].as_str().unwrap();
        if matches!(syntax, ToolSyntax::MistralNemo | ToolSyntax::Mistral { .. }) {
            assert!(id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()), "{name}: {v}");
        }
        let v = post(&json!({"model": name, "tools": [weather], "temperature": 0, "max_tokens": 8,
            "messages": [ask, {"role": "assistant", "content": null, "tool_calls": calls},
                {"role": "tool", "tool_call_id": id, "content": "-3 c"}]}));
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > with_tools, "{name}: {v}");
        // A node runs one model at a time: make room for the next.
        run(&["models", "unload", name]);
    }
}
