//! The API's routes on a real HTTP server (127.0.0.1:0) over a fake backend: a byte
//! vocabulary (token = byte) and a model that answers a fixed text one token per step.
//! Shapes, streams against whole answers, limits, stop sequences, every error status,
//! and a client that goes away cancelling its generation.

use serde_json::{json, Value};
use shoal_api::{
    Backend, ChatMessage, Failure, ModelInfo, ModelState, PromptOptions, Sampled, TextModel, ThinkingSyntax, ToolSyntax,
};
use shoal_pipeline::{GenerateRequest, Report};
use shoal_types::{CatalogEntry, TokenId};
use std::io::{BufRead, BufReader, Read};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The tests' GBNF recognizer (the crate's own, test-only).
#[path = "../src/grammar/gbnf.rs"]
mod gbnf;

/// What the fake model answers (then its end-of-generation token).
const ANSWER: &str = "Hello, wörld! 🐟 Bye.";
/// What the fake model answers under a grammar that offers the tool get_weather.
const CALL: &str = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]}"#;
/// The fake vocabulary's end-of-generation token.
const EOG: TokenId = 300;
/// The context of the ready model.
const CONTEXT: u32 = 1024;
/// How the fake node speculates by default.
const NODE_SPECULATION: shoal_types::SpecSettings = shoal_types::SpecSettings {
    max_draft: 5,
    ngram_min: 2,
    ngram_max: 3,
    position_cost: 0,
    step_cost: 0,
    model_cost: 0,
};
/// The step cost the fake node fits to its model's placement.
const FITTED_STEP_COST: u32 = 777;
/// The one key the fake backend takes.
const GOOD_KEY: &str = "sk-shoal-good";
/// A chat client's key (`KeyScope::Chat`; the fake's GOOD_KEY is an admin one).
const CHAT_KEY: &str = "sk-shoal-chat";

/// Fill-in-the-middle tokens of the fake vocabulary (model `slow` has them).
const FIM: [TokenId; 3] = [301, 302, 303];
/// The fake vocabulary's `[TOOL_CALLS]`: a control token (it renders as nothing), as in
/// Mistral's vocabularies. The model answers it wherever its answer has that text.
const TOOL_CALLS: TokenId = 304;
/// Harmony's control tokens, as in gpt-oss's vocabulary (llama.cpp shows its
/// `<|channel|>`, `<|message|>` and `<|start|>` as their text; the fake's are bytes):
/// `<|end|>` renders as nothing, `<|return|>` and `<|call|>` end the generation.
const HARMONY_END: TokenId = 305;
const HARMONY_RETURN: TokenId = 306;
const HARMONY_CALL: TokenId = 307;
/// The fake vocabulary's special tokens and their text.
const SPECIALS: [(&str, TokenId); 4] = [
    ("[TOOL_CALLS]", TOOL_CALLS),
    ("<|end|>", HARMONY_END),
    ("<|return|>", HARMONY_RETURN),
    ("<|call|>", HARMONY_CALL),
];

struct Bytes {
    /// Whether it has fill-in-the-middle tokens.
    fim: bool,
    /// The tool syntax its template speaks.
    syntax: ToolSyntax,
    /// How its template writes thinking.
    thinking: ThinkingSyntax,
    /// Whether its template opens the thinking for the answer (`<think>\n` at the end).
    opens: bool,
}

impl Bytes {
    /// What the fake template writes after the turns: the template variables given,
    /// then the assistant's turn (and, where it opens it, the thinking).
    fn end(&self, options: &PromptOptions) -> String {
        let mut end = String::new();
        if let Some(t) = options.enable_thinking {
            end += &format!("<enable_thinking={t}>");
        }
        if let Some(e) = &options.reasoning_effort {
            end += &format!("<reasoning_effort={e}>");
        }
        end += "<assistant>";
        if self.opens {
            end += "<think>\n";
        }
        end
    }
}

impl TextModel for Bytes {
    fn fill_in_middle(&self, prefix: &str, suffix: &str) -> Option<Vec<TokenId>> {
        let bytes = |t: &str| t.bytes().map(TokenId::from).collect::<Vec<_>>();
        self.fim.then(|| [vec![FIM[0]], bytes(prefix), vec![FIM[1]], bytes(suffix), vec![FIM[2]]].concat())
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.chat_prompt_as(messages, &PromptOptions::default())
    }
    fn chat_prompt_as(&self, messages: &[ChatMessage], options: &PromptOptions) -> Result<String, String> {
        Ok(messages.iter().map(|m| format!("<{}>{}</{}>", m.role, m.content, m.role)).collect::<String>()
            + &self.end(options))
    }
    fn tokenize(&self, text: &str, parse_special: bool) -> Vec<TokenId> {
        if let Some((_, t)) = SPECIALS.iter().find(|(s, _)| parse_special && *s == text) {
            return vec![*t];
        }
        text.bytes().map(TokenId::from).collect()
    }
    fn piece(&self, token: TokenId) -> Vec<u8> {
        if token < 256 {
            vec![token as u8]
        } else {
            // Special tokens are control tokens: they render as nothing.
            Vec::new()
        }
    }
    fn eog_tokens(&self) -> Vec<TokenId> {
        vec![EOG, HARMONY_RETURN, HARMONY_CALL]
    }
    fn tool_syntax(&self) -> ToolSyntax {
        self.syntax
    }
    fn chat_prompt_with_tools(&self, messages: &Value, tools: &Value) -> Result<String, String> {
        self.chat_prompt_with_tools_as(messages, tools, &PromptOptions::default())
    }
    fn chat_prompt_with_tools_as(
        &self,
        messages: &Value,
        tools: &Value,
        options: &PromptOptions,
    ) -> Result<String, String> {
        Ok(format!("{messages}{tools}{}", self.end(options)))
    }
    fn thinking(&self) -> ThinkingSyntax {
        self.thinking
    }
}

#[derive(Default)]
struct Fake {
    /// Generations running now.
    running: AtomicUsize,
    /// Prompts seen, as text.
    prompts: std::sync::Mutex<Vec<String>>,
    /// Prompts seen, as tokens.
    prompt_tokens: std::sync::Mutex<Vec<Vec<TokenId>>>,
    /// Sampling parameters seen, as the wire carries them.
    samplings: std::sync::Mutex<Vec<Value>>,
    /// Speculation settings seen.
    speculations: std::sync::Mutex<Vec<Option<shoal_types::SpecSettings>>>,
    metrics: shoal_api::Metrics,
    /// Models a first request asked to load.
    loads: std::sync::Mutex<Vec<String>>,
    /// Models asked to unload.
    unloads: std::sync::Mutex<Vec<String>>,
    /// Models asked to leave the catalog.
    removed: std::sync::Mutex<Vec<String>>,
    /// The tool syntax of every model's template (none: the generic format).
    syntax: std::sync::Mutex<Option<ToolSyntax>>,
    /// What the model answers, when a test says (else as the grammar allows).
    answer: std::sync::Mutex<Option<String>>,
    /// How every model's template writes thinking (none by default), and whether it
    /// opens the thinking for the answer.
    thinking: std::sync::Mutex<(Option<ThinkingSyntax>, bool)>,
    /// "warming" answers once this is set (its stages came up).
    warmed: std::sync::atomic::AtomicBool,
    /// How long a request waits for a model that does not answer (300 ms unless a
    /// test says).
    wait: std::sync::Mutex<Option<Duration>>,
}

fn entry(name: &str, hash_digit: char) -> CatalogEntry {
    CatalogEntry {
        name: name.into(),
        content_hash: hash_digit.to_string().repeat(64),
        size: 1000,
        arch: "llama".into(),
        n_layer: 4,
        context_length: 2048,
        quantisation: "Q8_0".into(),
        layer_period: 1,
        holders: Default::default(),
        header_hash: None,
    }
}

impl Backend for Fake {
    async fn models(&self) -> Vec<ModelInfo> {
        vec![
            ModelInfo { entry: entry("tiny", 'a'), state: ModelState::Ready, context: Some(CONTEXT) },
            ModelInfo { entry: entry("slow", 'b'), state: ModelState::Ready, context: Some(100_000) },
            ModelInfo { entry: entry("cold", 'c'), state: ModelState::Available, context: None },
            ModelInfo {
                entry: entry("warming", 'd'),
                state: if self.warmed.load(Ordering::SeqCst) { ModelState::Ready } else { ModelState::Starting },
                context: Some(CONTEXT),
            },
        ]
    }

    fn model_wait(&self) -> Duration {
        self.wait.lock().unwrap().unwrap_or(Duration::from_millis(300))
    }

    fn metrics(&self) -> &shoal_api::Metrics {
        &self.metrics
    }

    fn key_scope(&self, key: &str) -> Option<shoal_types::KeyScope> {
        match key {
            GOOD_KEY => Some(shoal_types::KeyScope::Admin),
            CHAT_KEY => Some(shoal_types::KeyScope::Chat),
            _ => None,
        }
    }

    fn speculation(&self) -> Option<shoal_types::SpecSettings> {
        Some(NODE_SPECULATION)
    }

    fn fit_speculation(&self, model: &str, s: shoal_types::SpecSettings) -> shoal_types::SpecSettings {
        let _ = model;
        shoal_types::SpecSettings { step_cost: FITTED_STEP_COST, ..s }
    }

    async fn load(&self, model: &str) -> Result<(), Failure> {
        self.loads.lock().unwrap().push(model.to_string());
        Ok(())
    }

    async fn unload(&self, model: &str) -> Result<(), Failure> {
        self.unloads.lock().unwrap().push(model.to_string());
        Ok(())
    }

    async fn remove(&self, model: &str) -> Result<(), Failure> {
        self.removed.lock().unwrap().push(model.to_string());
        Ok(())
    }

    async fn pull(
        &self,
        source: &str,
        progress: mpsc::UnboundedSender<shoal_api::PullProgress>,
    ) -> Result<String, Failure> {
        if source.contains("fail") {
            let _ = progress.send(shoal_api::PullProgress { completed: 10, total: Some(1000) });
            return Err(Failure::bad(format!("{source}: HTTP 404")));
        }
        for done in (0..=1000).step_by(5) {
            let _ = progress.send(shoal_api::PullProgress { completed: done, total: Some(1000) });
        }
        Ok(source.rsplit('/').next().unwrap().to_string())
    }

    async fn text(&self, model: &str) -> Result<Arc<dyn TextModel>, Failure> {
        let syntax = self.syntax.lock().unwrap().unwrap_or(ToolSyntax::Generic);
        let (thinking, opens) = *self.thinking.lock().unwrap();
        let thinking = thinking.unwrap_or(ThinkingSyntax::None);
        Ok(Arc::new(Bytes { fim: model == "slow", syntax, thinking, opens }))
    }

    async fn generate(
        &self,
        model: &str,
        request: GenerateRequest,
        tokens: mpsc::UnboundedSender<Sampled>,
    ) -> Result<Report, Failure> {
        let ctx = if model == "slow" { 100_000 } else { CONTEXT };
        if request.prompt.len() + request.max_new as usize > ctx as usize {
            return Err(Failure::bad(format!(
                "the prompt of {} tokens and max_tokens {} exceed the context of {ctx} tokens",
                request.prompt.len(),
                request.max_new
            )));
        }
        self.prompts.lock().unwrap().push(request.prompt.iter().map(|&t| t as u8 as char).collect());
        self.prompt_tokens.lock().unwrap().push(request.prompt.clone());
        self.samplings.lock().unwrap().push(request.sampling.clone());
        self.speculations.lock().unwrap().push(request.speculative);
        struct Running<'a>(&'a AtomicUsize);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.running.fetch_add(1, Ordering::SeqCst);
        let _running = Running(&self.running);
        // Under a tool grammar, an answer it allows (as a real model's sampler would
        // make it): a call when the tool get_weather is offered, else a reply.
        let grammar = request.sampling.get("grammar").and_then(Value::as_str).unwrap_or_default();
        let text = match (grammar.contains("tool_calls"), grammar.contains("get_weather")) {
            (true, true) => CALL,
            (true, false) => r#"{"response": "Just text."}"#,
            _ => ANSWER,
        };
        let told = self.answer.lock().unwrap().clone();
        let text = told.as_deref().unwrap_or(text);
        // The slow model makes a long answer unless a test says what it answers.
        let answer: Vec<TokenId> = if model == "slow" && told.is_none() {
            std::iter::repeat_n(b'x' as TokenId, 100_000).collect()
        } else {
            // Bytes, and the special tokens where the answer has their text.
            let mut tokens = Vec::new();
            let mut rest = text.as_bytes();
            while let Some(&b) = rest.first() {
                match SPECIALS.iter().find(|(s, _)| rest.starts_with(s.as_bytes())) {
                    Some((s, t)) => {
                        tokens.push(*t);
                        rest = &rest[s.len()..];
                    }
                    None => {
                        tokens.push(TokenId::from(b));
                        rest = &rest[1..];
                    }
                }
            }
            tokens.into_iter().chain([EOG]).collect()
        };
        let mut made = Vec::new();
        // Log-probabilities as a tail would report them, made up from the token: its
        // own -0.25, then the next ids, each 1 less likely.
        let top_n = request.sampling.get("logprobs").and_then(serde_json::Value::as_u64);
        for t in answer.into_iter().take(request.max_new as usize) {
            if model == "slow" {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            made.push(t);
            let lp = top_n.map(|n| shoal_types::TokenLogprobs {
                logprob: -0.25,
                top: (0..n as i32).map(|i| (t + i, -0.25 - i as f32)).collect(),
            });
            let _ = tokens.send((t, lp));
            if request.stop.contains(&t) {
                break;
            }
        }
        Ok(Report { tokens: made, ..Report::default() })
    }
}

/// A server on 127.0.0.1:0 over a fresh fake; its base URL.
async fn server() -> (String, Arc<Fake>) {
    server_with(shoal_api::Access::default()).await
}

/// [`server`] with keys checked as `access` says.
async fn server_with(access: shoal_api::Access) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(shoal_api::serve(listener, fake.clone(), access, std::future::pending()));
    (url, fake)
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

/// POST `body` (a JSON value or raw text); the status, headers' Retry-After, and body.
async fn post(url: String, body: Value) -> (u16, Option<String>, String) {
    tokio::task::spawn_blocking(move || {
        let raw = match body {
            Value::String(s) => s,
            v => v.to_string(),
        };
        let mut r = agent().post(&url).header("content-type", "application/json").send(raw).unwrap();
        let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
        (r.status().as_u16(), retry, r.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

async fn get(url: String) -> (u16, Value) {
    tokio::task::spawn_blocking(move || {
        let mut r = agent().get(&url).call().unwrap();
        (r.status().as_u16(), serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap())
    })
    .await
    .unwrap()
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat_streams_the_same_text_it_answers_whole_with_usage() {
    let (url, fake) = server().await;
    let chat = format!("{url}/v1/chat/completions");
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let (status, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": messages, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    let whole: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(whole["model"], "tiny");
    assert_eq!(whole["choices"][0]["message"], json!({"role": "assistant", "content": ANSWER}));
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    let prompt = "<system>Be brief.</system><user>Hi</user><assistant>";
    assert_eq!(fake.prompts.lock().unwrap()[0], prompt, "the chat template got the messages");
    let n = ANSWER.len() as u64 + 1; // every byte, and the end-of-generation token
    assert_eq!(
        whole["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": n, "total_tokens": prompt.len() as u64 + n})
    );

    let req = json!({"model": "tiny", "messages": messages, "stream": true,
        "stream_options": {"include_usage": true}});
    let (status, _, body) = post(chat, req).await;
    assert_eq!(status, 200, "{body}");
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, ANSWER, "the stream's deltas make the whole answer");
    let last_choice = &chunks[chunks.len() - 2];
    assert_eq!(last_choice["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], whole["usage"]);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_ends_with_length_and_stop_sequences_are_cut_on_text() {
    let (url, _) = server().await;
    let chat = format!("{url}/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let (_, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "max_tokens": 5})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    // max_completion_tokens is the newer name; 9 tokens end inside "ö" (2 bytes),
    // which is then shown as the replacement character, never as a broken string.
    let (_, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "max_completion_tokens": 9})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello, w\u{FFFD}");

    // A stop sequence spanning tokens: cut before it, in the stream too.
    for stream in [false, true] {
        let req = json!({"model": "tiny", "messages": msgs, "stop": ["wörld", "zzz"], "stream": stream});
        let (status, _, body) = post(chat.clone(), req).await;
        assert_eq!(status, 200);
        let text = if stream {
            let data = sse_data(&body);
            let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
            assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<String>()
        } else {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        };
        assert_eq!(text, "Hello, ", "stream {stream}");
    }

    // Completions: the prompt as is, no template.
    let (status, _, body) =
        post(format!("{url}/v1/completions"), json!({"model": "tiny", "prompt": "Once", "max_tokens": 3})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Hel");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
}

/// A request for a model that does not answer yet (its stages starting, or a node
/// re-placing it after a fault) waits for it instead of being refused, on every
/// route, streamed or not, and is answered once the model comes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_its_model_to_come_up_instead_of_a_503() {
    let (url, fake) = server().await;
    *fake.wait.lock().unwrap() = Some(Duration::from_secs(60));
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let requests = [
        (format!("{url}/v1/chat/completions"), json!({"model": "warming", "messages": msgs, "max_tokens": 3})),
        (
            format!("{url}/v1/chat/completions"),
            json!({"model": "warming", "messages": msgs, "max_tokens": 3, "stream": true}),
        ),
        (format!("{url}/api/chat"), json!({"model": "warming", "messages": msgs, "stream": false})),
        (format!("{url}/v1/messages"), json!({"model": "warming", "max_tokens": 3, "messages": msgs})),
    ];
    let waiting: Vec<_> = requests.into_iter().map(|(u, b)| tokio::spawn(post(u, b))).collect();
    // Nothing is answered while the model does not answer.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(waiting.iter().all(|w| !w.is_finished()), "a request was answered before its model came up");
    assert_eq!(fake.running.load(Ordering::SeqCst), 0);
    fake.warmed.store(true, Ordering::SeqCst);
    for w in waiting {
        let (status, _, body) = w.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    assert!(fake.loads.lock().unwrap().is_empty(), "a starting model is not loaded again");
}

/// A streamed request that waits longer than the grace (its model being placed again
/// after a fault) gets its 200 at once and SSE comments while it waits, then its
/// answer; one whose wait runs out gets the error as the stream's last event, in its
/// API's shape. A proxy or client with a read timeout keeps the connection meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_stream_starts_with_comments_and_ends_with_its_answer_or_its_error() {
    let (url, fake) = server().await;
    *fake.wait.lock().unwrap() = Some(Duration::from_secs(60));
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let chat = format!("{url}/v1/chat/completions");
    let body = json!({"model": "warming", "messages": msgs, "max_tokens": 3, "stream": true});
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = tokio::task::spawn_blocking(move || {
        let mut r = agent().post(&chat).header("content-type", "application/json").send(body.to_string()).unwrap();
        tx.send(r.status().as_u16()).unwrap();
        r.body_mut().read_to_string().unwrap()
    });
    let status = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(30))).await.unwrap();
    assert_eq!(status, Ok(200), "the answer started");
    assert_eq!(fake.running.load(Ordering::SeqCst), 0, "started before the model came up");
    fake.warmed.store(true, Ordering::SeqCst);
    let text = reader.await.unwrap();
    assert!(text.starts_with(": waiting for the model\n\n"), "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    assert!(data.iter().any(|d| d.contains("\"delta\"")), "the answer followed the comments: {text}");

    // The wait runs out (a bound past the grace): the error ends the stream.
    let (url, fake) = server().await;
    *fake.wait.lock().unwrap() = Some(Duration::from_secs(4));
    let (status, _, text) = post(
        format!("{url}/v1/chat/completions"),
        json!({"model": "warming", "messages": msgs, "max_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(text.starts_with(": waiting for the model"), "{text}");
    let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
    assert!(last["error"]["message"].as_str().unwrap().contains("waited 4"), "{text}");
    let (status, _, text) = post(
        format!("{url}/v1/messages"),
        json!({"model": "warming", "messages": msgs, "max_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(text.contains("event: error\ndata: "), "{text}");
    let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
    assert_eq!(last["type"], "error", "{text}");

    // A fast failure keeps its status.
    let (status, _, _) =
        post(format!("{url}/v1/chat/completions"), json!({"model": "nope", "messages": msgs, "stream": true})).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_has_its_status_and_its_apis_shape() {
    let (url, fake) = server().await;
    let chat = format!("{url}/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let openai_error = |body: &str| -> Value { serde_json::from_str::<Value>(body).unwrap()["error"].clone() };

    let (status, _, body) = post(chat.clone(), json!({"model": "nope", "messages": msgs})).await;
    assert_eq!(status, 404);
    let e = openai_error(&body);
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("tiny"), "names what there is: {e}");

    let (status, _, body) = post(chat.clone(), Value::String("{\"model\": ".into())).await;
    assert_eq!(status, 400);
    assert_eq!(openai_error(&body)["type"], "invalid_request_error");
    let (status, _, _) = post(chat.clone(), json!({"model": "tiny"})).await;
    assert_eq!(status, 400, "messages missing");
    let (status, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "n": 2})).await;
    assert_eq!((status, openai_error(&body)["message"].as_str().unwrap().contains("n must be 1")), (400, true));
    let (status, _, body) =
        post(chat.clone(), json!({"model": "tiny", "messages": msgs, "tools": [{"type": "function"}]})).await;
    assert_eq!(status, 400, "a tool without a function is refused, not ignored: {body}");
    assert!(openai_error(&body)["message"].as_str().unwrap().contains("tools[0]"), "{body}");

    // Not loaded: the first request loads it (once) and waits for it; a model that
    // does not come up within the node's bound is a 503 that says to come back.
    let (status, retry, body) = post(chat.clone(), json!({"model": "cold", "messages": msgs})).await;
    assert_eq!((status, retry.as_deref()), (503, Some("10")), "{body}");
    assert!(openai_error(&body)["message"].as_str().unwrap().contains("placing it (waited"), "{body}");
    assert_eq!(*fake.loads.lock().unwrap(), ["cold"]);
    let (status, retry, body) = post(chat.clone(), json!({"model": "warming", "messages": msgs})).await;
    assert_eq!((status, retry.as_deref()), (503, Some("5")));
    assert!(openai_error(&body)["message"].as_str().unwrap().contains("does not answer yet"), "{body}");

    // Over the context: a 400 that gives both numbers, before any stream starts.
    let long = "x".repeat(CONTEXT as usize + 44);
    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": long}], "stream": true});
    let (status, _, body) = post(chat.clone(), req).await;
    assert_eq!(status, 400, "{body}");
    let m = openai_error(&body)["message"].as_str().unwrap().to_string();
    assert!(m.contains(&CONTEXT.to_string()) && m.contains("tokens"), "{m}");

    // Ollama's shape: {"error": "…"}.
    let (status, _, body) = post(format!("{url}/api/chat"), json!({"model": "nope", "messages": msgs})).await;
    assert_eq!(status, 404);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].as_str().unwrap().contains("not found"));
    let (status, _, body) = post(format!("{url}/api/generate"), Value::String("[1, 2".into())).await;
    assert_eq!(status, 400);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].is_string());
    let (status, _, _) = post(format!("{url}/api/show"), json!({"model": "nope"})).await;
    assert_eq!(status, 404);
    let (status, _) = get(format!("{url}/v1/models/nope")).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_routes_stream_ndjson_and_answer_whole() {
    let (url, fake) = server().await;
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let (status, _, body) = post(format!("{url}/api/chat"), json!({"model": "tiny", "messages": msgs})).await;
    assert_eq!(status, 200);
    let lines: Vec<Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let text: String = lines.iter().filter_map(|l| l["message"]["content"].as_str()).collect();
    assert_eq!(text, ANSWER);
    let last = lines.last().unwrap();
    assert_eq!((last["done"].clone(), last["done_reason"].clone()), (json!(true), json!("stop")));
    assert_eq!(last["eval_count"], ANSWER.len() + 1);
    assert_eq!(last["prompt_eval_count"], "<user>Hi</user><assistant>".len());
    assert!(last["total_duration"].as_u64().unwrap() > 0);
    assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false));

    let req = json!({"model": "tiny:latest", "messages": msgs, "stream": false, "options": {"num_predict": 5}});
    let (_, _, body) = post(format!("{url}/api/chat"), req).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"], json!({"role": "assistant", "content": "Hello"}));
    assert_eq!(v["done_reason"], "length");

    let req = json!({"model": "tiny", "prompt": "Hi", "system": "Be brief.", "stream": false,
        "options": {"stop": ["!"]}});
    let (_, _, body) = post(format!("{url}/api/generate"), req).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["response"], "Hello, wörld");
    assert_eq!(fake.prompts.lock().unwrap().last().unwrap(), "<system>Be brief.</system><user>Hi</user><assistant>");
    let req = json!({"model": "tiny", "prompt": "Hi", "raw": true, "stream": false});
    post(format!("{url}/api/generate"), req).await;
    assert_eq!(fake.prompts.lock().unwrap().last().unwrap(), "Hi", "raw: no template");

    let (status, tags) = get(format!("{url}/api/tags")).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = tags["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["tiny", "slow", "cold", "warming"]);
    assert_eq!(tags["models"][0]["details"]["quantization_level"], "Q8_0");
    let (_, ps) = get(format!("{url}/api/ps")).await;
    assert_eq!(ps["models"].as_array().unwrap().len(), 3, "cold is not running: {ps}");
    let (_, version) = get(format!("{url}/api/version")).await;
    assert!(version["version"].as_str().unwrap().split('.').all(|p| p.parse::<u32>().is_ok()));
    let (status, _, body) = post(format!("{url}/api/show"), json!({"model": "tiny"})).await;
    assert_eq!(status, 200);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["parameters"]
        .as_str()
        .unwrap()
        .contains(&format!("num_ctx {CONTEXT}")));
    let (_, models) = get(format!("{url}/v1/models")).await;
    assert_eq!(models["data"].as_array().unwrap().len(), 4);
    let (status, m) = get(format!("{url}/v1/models/tiny")).await;
    assert_eq!((status, m["id"].clone()), (200, json!("tiny")));
    let (status, health) = get(format!("{url}/health")).await;
    assert_eq!((status, health["models"]["warming"].clone()), (200, json!("loading")));

    // What happened, as Prometheus reads it.
    let text = tokio::task::spawn_blocking(move || {
        agent().get(&format!("{url}/metrics")).call().unwrap().body_mut().read_to_string().unwrap()
    })
    .await
    .unwrap();
    assert!(text.contains("shoal_http_requests_total{route=\"/api/chat\",status=\"200\"} 2"), "{text}");
    assert!(text.contains("shoal_http_requests_total{route=\"/v1/models/{*id}\",status=\"200\"} 1"), "{text}");
    // Four generations ran: 22 + 5 + 12 + 22 tokens (the end-of-generation ones counted).
    let n = 2 * (ANSWER.len() + 1) + 5 + "Hello, wörld".len() + 1;
    assert!(text.contains(&format!("shoal_completion_tokens_total {n}")), "{text}");
    assert!(text.contains("shoal_time_to_first_token_seconds_count 4"), "{text}");
    assert!(text.contains("shoal_generations_in_flight 0"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_generation() {
    let (url, fake) = server().await;
    let body = json!({"model": "slow", "messages": [{"role": "user", "content": "Hi"}], "stream": true}).to_string();
    let chat = format!("{url}/v1/chat/completions");
    let seen = fake.clone();
    tokio::task::spawn_blocking(move || {
        let mut r = agent().post(&chat).header("content-type", "application/json").send(body).unwrap();
        let mut reader = BufReader::new(r.body_mut().as_reader());
        let mut line = String::new();
        let mut chunks = 0;
        while chunks < 5 {
            line.clear();
            reader.read_line(&mut line).unwrap();
            chunks += line.starts_with("data: ") as usize;
        }
        assert_eq!(seen.running.load(Ordering::SeqCst), 1, "the generation runs while the client reads");
        let _ = reader.read(&mut [0u8; 1]);
        // Dropping the response here closes the connection.
    })
    .await
    .unwrap();
    // Uncancelled, the slow model's answer (100,000 tokens, 5 ms each) runs for minutes:
    // its end within 30 s is the cancellation (how fast is not the point, and two shared
    // cores under the suite's load made a 1 s bound flaky).
    let t0 = Instant::now();
    while fake.running.load(Ordering::SeqCst) > 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the generation still runs 30 s after the client left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// POST `body` with `headers`; the status and body.
async fn post_with(url: String, body: Value, headers: Vec<(&'static str, String)>) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        let mut req = agent().post(&url).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let mut r = req.send(body.to_string()).unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_loopback_exemption_a_key_is_needed_and_checked() {
    // As a request from another machine is treated (loopback here is not exempt).
    let (url, fake) = server_with(shoal_api::Access { loopback_free: false, open: false, ..Default::default() }).await;
    let chat = format!("{url}/v1/chat/completions");
    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": false});
    let (status, body) = post_with(chat.clone(), req.clone(), vec![]).await;
    assert_eq!(status, 401, "{body}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(e["error"]["code"], "invalid_api_key");
    assert!(e["error"]["message"].as_str().unwrap().contains("shoal keys create"));
    let (status, body) =
        post_with(chat.clone(), req.clone(), vec![("authorization", "Bearer sk-shoal-bad".into())]).await;
    assert_eq!(status, 401);
    assert!(!body.contains("sk-shoal-bad"), "the key is not echoed: {body}");
    let (status, body) = post_with(format!("{url}/api/chat"), req.clone(), vec![]).await;
    assert_eq!(status, 401);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].is_string(), "Ollama's shape: {body}");
    assert!(fake.prompts.lock().unwrap().is_empty(), "nothing reached the model");

    for header in [("authorization", format!("Bearer {GOOD_KEY}")), ("x-api-key", GOOD_KEY.to_string())] {
        let (status, body) = post_with(chat.clone(), req.clone(), vec![header]).await;
        assert_eq!(status, 200, "{body}");
    }
    // The root says the server runs, key or not (clients probe it).
    let status =
        tokio::task::spawn_blocking(move || agent().get(&url).call().unwrap().status().as_u16()).await.unwrap();
    assert_eq!(status, 200);

    // Open: no key needed at all.
    let (url, _) = server_with(shoal_api::Access { loopback_free: false, open: true, ..Default::default() }).await;
    let (status, _) = post_with(format!("{url}/v1/chat/completions"), req, vec![]).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_whole_and_as_named_events() {
    let (url, fake) = server().await;
    let msgs = format!("{url}/v1/messages");
    let req = json!({"model": "tiny", "max_tokens": 100, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]});
    let (status, _, body) = post(msgs.clone(), req).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"], json!([{"type": "text", "text": ANSWER}]));
    assert_eq!((v["stop_reason"].clone(), v["stop_sequence"].clone()), (json!("end_turn"), Value::Null));
    assert_eq!(fake.prompts.lock().unwrap()[0], "<system>Be brief.</system><user>Hi</user><assistant>");
    assert_eq!(v["usage"]["output_tokens"], ANSWER.len() + 1);

    let req = json!({"model": "tiny", "max_tokens": 100, "stop_sequences": ["wörld"], "stream": true,
        "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, body) = post(msgs.clone(), req).await;
    assert_eq!(status, 200);
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(events.first(), Some(&"message_start"));
    assert_eq!(events[events.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let data: Vec<Value> =
        body.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
    let text: String = data.iter().filter_map(|d| d["delta"]["text"].as_str()).collect();
    assert_eq!(text, "Hello, ");
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": "wörld"}));

    let req = json!({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]});
    let (_, _, body) = post(msgs.clone(), req).await;
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["stop_reason"], "max_tokens");
    let req = json!({"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, body) = post(msgs.clone(), req).await;
    assert_eq!(status, 404);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["type"].clone(), v["error"]["type"].clone()), (json!("error"), json!("not_found_error")));
    let (status, _, _) = post(msgs, json!({"model": "tiny", "messages": []})).await;
    assert_eq!(status, 400, "max_tokens is required");
}

/// A server within `limits`; its address.
async fn limited(limits: shoal_api::Limits) -> std::net::SocketAddr {
    let fake = Arc::new(Fake::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = shoal_api::router(fake, shoal_api::Access::default());
    tokio::spawn(shoal_api::serve_router(listener, router, limits, std::future::pending()));
    addr
}

/// Read `s` until the server closes it (EOF or reset), at most `secs`; what was read,
/// or `None` if it was still open then.
fn read_until_closed(s: &mut std::net::TcpStream, secs: u64) -> Option<String> {
    s.set_read_timeout(Some(Duration::from_secs(secs))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(String::from_utf8_lossy(&got).into_owned())
            }
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_closed_and_a_freed_place_is_served() {
    // (Loopback's own places: the test's connections are this machine's.)
    let limits = shoal_api::Limits { loopback: 2, header_timeout: Duration::from_secs(60), ..Default::default() };
    let addr = limited(limits).await;
    tokio::task::spawn_blocking(move || {
        let first = std::net::TcpStream::connect(addr).unwrap();
        let _second = std::net::TcpStream::connect(addr).unwrap();
        let mut third = std::net::TcpStream::connect(addr).unwrap();
        assert_eq!(read_until_closed(&mut third, 10).as_deref(), Some(""), "the third is closed at once");
        drop(first);
        // The server notices the close and frees the place; then a request is served.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answer = agent().get(&format!("http://{addr}/")).call();
            if let Ok(mut r) = answer {
                assert_eq!(r.status().as_u16(), 200);
                assert!(r.body_mut().read_to_string().unwrap().contains("Shoal is running"));
                break;
            }
            assert!(Instant::now() < deadline, "no place freed: {answer:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_closed_after_the_header_timeout() {
    let limits = shoal_api::Limits { loopback: 8, header_timeout: Duration::from_secs(1), ..Default::default() };
    let addr = limited(limits).await;
    tokio::task::spawn_blocking(move || {
        // Says nothing.
        let mut silent = std::net::TcpStream::connect(addr).unwrap();
        // Starts a request and never ends its headers.
        let mut slow = std::net::TcpStream::connect(addr).unwrap();
        std::io::Write::write_all(&mut slow, b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
        // One whole request on a keep-alive connection, then silence.
        let mut idle = std::net::TcpStream::connect(addr).unwrap();
        std::io::Write::write_all(&mut idle, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let start = Instant::now();
        assert_eq!(read_until_closed(&mut silent, 20).as_deref(), Some(""), "the silent one");
        assert!(read_until_closed(&mut slow, 20).is_some(), "the slow one stayed open");
        let answered = read_until_closed(&mut idle, 20).expect("the idle keep-alive one stayed open");
        assert!(answered.starts_with("HTTP/1.1 200") && answered.contains("Shoal is running"), "{answered}");
        assert!(start.elapsed() < Duration::from_secs(20));
    })
    .await
    .unwrap();
}

/// Security review F7: a request whose body trickles (the review's login body of 60,000
/// bytes, one byte a minute) no longer holds its connection: it fails once it falls
/// behind the minimum rate after the grace, and the connection closes; a body sent at
/// once is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_trickles_loses_its_connection() {
    let limits = shoal_api::Limits { body_grace: Duration::from_secs(1), ..Default::default() };
    let addr = limited(limits).await;
    tokio::task::spawn_blocking(move || {
        let mut slow = std::net::TcpStream::connect(addr).unwrap();
        let head = "POST /api/generate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 60000\r\n\r\n{";
        std::io::Write::write_all(&mut slow, head.as_bytes()).unwrap();
        let start = Instant::now();
        // One byte every 200 ms: 5 B/s, far under the minimum.
        let writer = {
            let mut s = slow.try_clone().unwrap();
            std::thread::spawn(move || {
                for _ in 0..100 {
                    std::thread::sleep(Duration::from_millis(200));
                    if std::io::Write::write_all(&mut s, b" ").is_err() {
                        return;
                    }
                }
            })
        };
        // Meanwhile a whole request is answered.
        let (status, _) = raw(&addr.to_string(), "GET", "/api/tags", &[], "");
        assert_eq!(status, 200);
        let answer = read_until_closed(&mut slow, 15).expect("the trickling request still holds its connection");
        let took = start.elapsed();
        assert!(took < Duration::from_secs(10), "closed only after {took:?}");
        assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
        let _ = slow.shutdown(std::net::Shutdown::Both);
        let _ = writer.join();
    })
    .await
    .unwrap();
}

/// Wait (at most 5 s) until `list` holds `want`.
async fn eventually(list: &std::sync::Mutex<Vec<String>>, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while *list.lock().unwrap() != want {
        assert!(Instant::now() < deadline, "{:?} is not {want:?}", list.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_keep_alive_zero_unloads_after_the_answer_and_delete_leaves_the_catalog() {
    let (url, fake) = server().await;
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    // Other values keep the model loaded: numbers, durations, -1.
    for keep in [json!(300), json!("5m"), json!("-1"), json!(-1), json!("1h30m")] {
        let req = json!({"model": "tiny", "messages": msgs, "stream": false, "keep_alive": keep});
        let (status, _, body) = post(format!("{url}/api/chat"), req).await;
        assert_eq!(status, 200, "{keep}: {body}");
    }
    // Not a duration: refused, nothing done.
    let req = json!({"model": "tiny", "messages": msgs, "keep_alive": "soon"});
    let (status, _, body) = post(format!("{url}/api/chat"), req).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("keep_alive"), "{body}");
    assert!(fake.unloads.lock().unwrap().is_empty());

    // An empty request with 0: Ollama's "unload" call, answered at once.
    let (status, _, body) = post(format!("{url}/api/generate"), json!({"model": "tiny", "keep_alive": 0})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["done"].clone(), v["done_reason"].clone()), (json!(true), json!("unload")));
    eventually(&fake.unloads, &["tiny"]).await;
    // A whole answer, then the unload.
    let req = json!({"model": "tiny", "messages": msgs, "stream": false, "keep_alive": "0s"});
    let (status, _, body) = post(format!("{url}/api/chat"), req).await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["message"]["content"], ANSWER);
    eventually(&fake.unloads, &["tiny", "tiny"]).await;
    // A stream, then the unload (of the catalog name, whatever tag the client used).
    let req = json!({"model": "tiny:latest", "prompt": "Hi", "keep_alive": "0"});
    let (status, _, body) = post(format!("{url}/api/generate"), req).await;
    assert_eq!(status, 200);
    let text: String = body
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["response"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, ANSWER);
    eventually(&fake.unloads, &["tiny", "tiny", "tiny"]).await;
    // An empty request without keep_alive on a model not loaded loads it.
    let (status, _, body) = post(format!("{url}/api/chat"), json!({"model": "cold"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["done_reason"], "load");
    assert_eq!(*fake.loads.lock().unwrap(), ["cold"]);

    // DELETE /api/delete: 200, the catalog name; an unknown model is a 404.
    let del = |model: &'static str| {
        let url = format!("{url}/api/delete");
        tokio::task::spawn_blocking(move || {
            let mut r = agent()
                .delete(&url)
                .force_send_body()
                .header("content-type", "application/json")
                .send(json!({"model": model}).to_string())
                .unwrap();
            (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
        })
    };
    assert_eq!(del("cold:latest").await.unwrap().0, 200);
    assert_eq!(*fake.removed.lock().unwrap(), ["cold"]);
    let (status, body) = del("nothing").await.unwrap();
    assert_eq!(status, 404, "{body}");
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].as_str().is_some(), "{body}");
}

/// POST `body` to `path` over a raw connection with exactly `headers` (Host included);
/// the status and the response's head (its headers), lower-cased.
fn raw_post(addr: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut req = format!("POST {path} HTTP/1.1\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    req += body;
    std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let head = out.split("\r\n\r\n").next().unwrap().to_ascii_lowercase();
    (head[9..12].parse().unwrap(), head)
}

/// A preflight (`OPTIONS`) from `origin`; the response's head, lower-cased.
fn preflight(addr: &str, origin: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let req = format!(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\norigin: {origin}\r\nconnection: close\r\n\
         access-control-request-method: POST\r\naccess-control-request-headers: authorization, content-type\r\n\r\n"
    );
    std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split("\r\n\r\n").next().unwrap().to_ascii_lowercase()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_pages_get_no_free_loopback_access_and_cors_is_off_unless_configured() {
    let (url, fake) = server().await;
    let addr = url.trim_start_matches("http://").to_string();
    let with_cors = shoal_api::Access { cors_origins: vec!["http://app.example:8080".into()], ..Default::default() };
    let (cors_url, _) = server_with(with_cors).await;
    let cors_addr = cors_url.trim_start_matches("http://").to_string();
    tokio::task::spawn_blocking(move || {
        let body = json!({"model": "tiny", "prompt": "Hi", "stream": false}).to_string();
        let post = |host: &str, origin: Option<&str>, key: Option<&str>| {
            let mut h = vec![("host", host), ("content-type", "text/plain")];
            h.extend(origin.map(|o| ("origin", o)));
            let bearer = key.map(|k| format!("Bearer {k}"));
            h.extend(bearer.as_deref().map(|b| ("authorization", b)));
            raw_post(&addr, "/api/generate", &h, &body).0
        };
        // This machine's own tools: no Origin, or a page on this machine.
        assert_eq!(post(&addr, None, None), 200);
        assert_eq!(post("localhost:11434", Some("http://localhost:3000"), None), 200);
        assert_eq!(post(&addr, Some(&format!("http://{addr}")), None), 200);
        assert_eq!(post("[::1]:11434", Some("https://[::1]"), None), 200);
        // This machine's name (Debian resolves it to 127.0.1.1), or an address.
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
        let named = format!("http://{name}:11434");
        assert_eq!(post(&format!("{name}:11434"), Some(&named), None), 200);
        assert_eq!(post("192.168.1.20:11434", None, None), 200);
        // A page from elsewhere (a "simple" text/plain POST needs no preflight), or a
        // name of its own rebound to 127.0.0.1: a key is needed, as from another machine.
        let before = fake.prompts.lock().unwrap().len();
        assert_eq!(post(&addr, Some("http://evil.example"), None), 401);
        assert_eq!(post("evil.example:11434", Some("http://evil.example:11434"), None), 401);
        assert_eq!(post("evil.example:11434", None, None), 401);
        assert_eq!(post(&addr, Some("null"), None), 401);
        assert_eq!(fake.prompts.lock().unwrap().len(), before, "nothing reached the model");
        assert_eq!(post(&addr, Some("http://evil.example"), Some(GOOD_KEY)), 200, "with a key it is a client");

        // CORS off by default: a preflight gets no allow-origin.
        let head = preflight(&addr, "http://app.example:8080");
        assert!(!head.contains("access-control-allow-origin"), "{head}");
        // Configured: the listed origin is allowed (preflight and answer), another is not.
        let head = preflight(&cors_addr, "http://app.example:8080");
        assert!(head.contains("access-control-allow-origin: http://app.example:8080"), "{head}");
        assert!(head.contains("authorization"), "{head}");
        let h = [("host", cors_addr.as_str()), ("origin", "http://app.example:8080")];
        let (status, head) = raw_post(&cors_addr, "/api/generate", &h, &body);
        assert_eq!(status, 200, "{head}");
        assert!(head.contains("access-control-allow-origin: http://app.example:8080"), "{head}");
        let head = preflight(&cors_addr, "http://other.example");
        assert!(!head.contains("access-control-allow-origin"), "{head}");
    })
    .await
    .unwrap();
}

/// Fields whose values change from run to run (ids, clocks, durations, the version):
/// masked in the golden files, which keep only that the field is there.
const VOLATILE: &[&str] = &[
    "id",
    "created",
    "created_at",
    "modified_at",
    "expires_at",
    "total_duration",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
    "version",
];

fn mask(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if VOLATILE.contains(&k.as_str()) && !x.is_object() {
                    *x = json!("<masked>");
                } else {
                    mask(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(mask),
        _ => {}
    }
}

/// What curl got, as one JSON document: the status, the content type, and the body
/// (JSON; NDJSON and SSE as the list of their lines or events, SSE event names kept).
fn curl(method: &str, url: &str, body: Option<&Value>, headers: &[&str]) -> Value {
    let mut c = std::process::Command::new("curl");
    c.args(["-sS", "-X", method, url, "-o", "-", "-w", "\n%{http_code} %{content_type}"]);
    for h in headers {
        c.args(["-H", h]);
    }
    if let Some(b) = body {
        c.args(["-H", "content-type: application/json", "--data-binary", &b.to_string()]);
    }
    let out = c.output().expect("curl is needed for the route checks (apt-get install curl)");
    assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, tail) = text.rsplit_once('\n').unwrap();
    let (status, ctype) = tail.split_once(' ').unwrap();
    let ctype = ctype.split(';').next().unwrap().trim().to_string();
    let mut parsed = match ctype.as_str() {
        "application/x-ndjson" => Value::Array(body.lines().map(|l| serde_json::from_str(l).unwrap()).collect()),
        "text/event-stream" => Value::Array(
            body.split("\n\n")
                .filter(|e| !e.trim().is_empty())
                .map(|e| {
                    let event = e.lines().find_map(|l| l.strip_prefix("event: "));
                    let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or_default();
                    let data = serde_json::from_str(data).unwrap_or_else(|_| Value::String(data.to_string()));
                    match event {
                        Some(name) => json!({"event": name, "data": data}),
                        None => data,
                    }
                })
                .collect(),
        ),
        _ => serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string())),
    };
    mask(&mut parsed);
    json!({"status": status.parse::<u16>().unwrap(), "content_type": ctype, "body": parsed})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_routes_shape_matches_its_golden_file() {
    let (url, _) = server().await;
    let (keyed, _) = server_with(shoal_api::Access { loopback_free: false, ..Default::default() }).await;
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let cases: Vec<(&str, &str, String, Option<Value>)> = vec![
        (
            "openai_chat",
            "POST",
            format!("{url}/v1/chat/completions"),
            Some(json!({"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 8})),
        ),
        (
            "openai_chat_stream",
            "POST",
            format!("{url}/v1/chat/completions"),
            Some(json!({"model": "tiny", "messages": msgs, "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true}})),
        ),
        (
            "openai_completions",
            "POST",
            format!("{url}/v1/completions"),
            Some(json!({"model": "tiny", "prompt": "Once", "max_tokens": 4, "stop": [","]})),
        ),
        ("openai_models", "GET", format!("{url}/v1/models"), None),
        ("openai_model", "GET", format!("{url}/v1/models/tiny"), None),
        (
            "openai_unknown_model",
            "POST",
            format!("{url}/v1/chat/completions"),
            Some(json!({"model": "nope", "messages": msgs})),
        ),
        (
            "openai_unsupported",
            "POST",
            format!("{url}/v1/chat/completions"),
            Some(json!({"model": "tiny", "messages": msgs, "n": 2})),
        ),
        (
            "openai_no_key",
            "POST",
            format!("{keyed}/v1/chat/completions"),
            Some(json!({"model": "tiny", "messages": msgs})),
        ),
        (
            "anthropic_messages",
            "POST",
            format!("{url}/v1/messages"),
            Some(json!({"model": "tiny", "max_tokens": 5, "messages": msgs})),
        ),
        (
            "anthropic_stream",
            "POST",
            format!("{url}/v1/messages"),
            Some(json!({"model": "tiny", "max_tokens": 3, "messages": msgs, "stream": true})),
        ),
        (
            "anthropic_no_key",
            "POST",
            format!("{keyed}/v1/messages"),
            Some(json!({"model": "tiny", "max_tokens": 5, "messages": msgs})),
        ),
        (
            "ollama_chat_stream",
            "POST",
            format!("{url}/api/chat"),
            Some(json!({"model": "tiny", "messages": msgs, "options": {"num_predict": 3}})),
        ),
        (
            "ollama_generate",
            "POST",
            format!("{url}/api/generate"),
            Some(json!({"model": "tiny", "prompt": "Hi", "stream": false, "options": {"num_predict": 5}})),
        ),
        ("ollama_generate_load", "POST", format!("{url}/api/generate"), Some(json!({"model": "tiny"}))),
        ("ollama_tags", "GET", format!("{url}/api/tags"), None),
        ("ollama_ps", "GET", format!("{url}/api/ps"), None),
        ("ollama_show", "POST", format!("{url}/api/show"), Some(json!({"model": "tiny"}))),
        ("ollama_version", "GET", format!("{url}/api/version"), None),
        ("ollama_bad_json", "POST", format!("{url}/api/chat"), Some(json!("not an object"))),
        (
            "ollama_not_loaded_yet",
            "POST",
            format!("{url}/api/chat"),
            Some(json!({"model": "warming", "messages": msgs})),
        ),
        ("health", "GET", format!("{url}/health"), None),
        (
            "openai_chat_tools",
            "POST",
            format!("{url}/v1/chat/completions"),
            Some(json!({"model": "tiny", "messages": msgs, "tools": [weather_tool()]})),
        ),
        (
            "openai_chat_tools_stream",
            "POST",
            format!("{url}/v1/chat/completions"),
            Some(json!({"model": "tiny", "messages": msgs, "tools": [weather_tool()], "stream": true,
                "stream_options": {"include_usage": true}})),
        ),
        (
            "anthropic_tools_stream",
            "POST",
            format!("{url}/v1/messages"),
            Some(json!({"model": "tiny", "max_tokens": 200, "messages": msgs, "stream": true,
                "tools": [{"name": "get_weather", "input_schema": weather_tool()["function"]["parameters"]}]})),
        ),
        (
            "ollama_chat_tools",
            "POST",
            format!("{url}/api/chat"),
            Some(json!({"model": "tiny", "messages": msgs, "tools": [weather_tool()]})),
        ),
    ];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let update = std::env::var_os("SHOAL_UPDATE_GOLDEN").is_some();
    tokio::task::spawn_blocking(move || {
        let mut wrong = Vec::new();
        for (name, method, url, body) in cases {
            let got = curl(method, &url, body.as_ref(), &[]);
            let file = dir.join(format!("{name}.json"));
            let text = serde_json::to_string_pretty(&got).unwrap() + "\n";
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&file, &text).unwrap();
                continue;
            }
            let want = std::fs::read_to_string(&file)
                .unwrap_or_else(|_| panic!("{} is missing (SHOAL_UPDATE_GOLDEN=1 writes it)", file.display()));
            if want != text {
                wrong.push(format!("{name}: got\n{text}\nwant\n{want}"));
            }
        }
        assert!(wrong.is_empty(), "shapes changed (SHOAL_UPDATE_GOLDEN=1 rewrites the files):\n{}", wrong.join("\n"));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_suffix_fills_in_the_middle_with_the_models_own_tokens_or_is_refused() {
    let (base, fake) = server().await;
    // A model with fill-in-the-middle tokens: prefix, suffix and middle around them,
    // no chat template; /api/show says it can insert.
    let req = json!({"model": "slow", "prompt": "ab", "suffix": "cd", "stream": false,
        "options": {"num_predict": 3, "temperature": 0}});
    let (status, _, body) = post(format!("{base}/api/generate"), req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["response"], "xxx");
    let sent = fake.prompt_tokens.lock().unwrap().last().cloned().unwrap();
    let want: Vec<TokenId> = [FIM[0], 97, 98, FIM[1], 99, 100, FIM[2]].into();
    assert_eq!(sent, want);
    let (status, _, body) = post(format!("{base}/api/show"), json!({"model": "slow"})).await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["capabilities"], json!(["completion", "insert", "tools"]));
    // A model without them: 400 in Ollama's words, nothing generated.
    let before = fake.prompt_tokens.lock().unwrap().len();
    let req = json!({"model": "tiny", "prompt": "def f(", "suffix": "return x", "stream": false});
    let (status, _, body) = post(format!("{base}/api/generate"), req).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"], "tiny does not support insert");
    assert_eq!(fake.prompt_tokens.lock().unwrap().len(), before);
    let (_, _, body) = post(format!("{base}/api/show"), json!({"model": "tiny"})).await;
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["capabilities"], json!(["completion", "tools"]));
    // An empty suffix is no suffix: the prompt goes through the template as usual.
    let req = json!({"model": "tiny", "prompt": "hi", "suffix": "", "stream": false, "options": {"num_predict": 2}});
    let (status, _, body) = post(format!("{base}/api/generate"), req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(fake.prompts.lock().unwrap().last().unwrap(), "<user>hi</user><assistant>");
}

/// `speculative` in a request of any API turns speculation off or on; without it, the
/// node's setting holds.
#[tokio::test]
async fn the_speculative_switch_reaches_the_coordinator_from_every_api() {
    let (base, fake) = server().await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for switch in [None, Some(false), Some(true)] {
        let with = |mut body: Value, at_options: bool| {
            if let Some(on) = switch {
                let target = if at_options { &mut body["options"] } else { &mut body };
                target["speculative"] = json!(on);
            }
            body
        };
        // Fitted to the model's placement (the backend's step cost), whichever way on.
        let want = if switch == Some(false) {
            None
        } else {
            Some(shoal_types::SpecSettings { step_cost: FITTED_STEP_COST, ..NODE_SPECULATION })
        };
        for (path, body) in [
            ("/v1/chat/completions", with(json!({"model": "tiny", "messages": msgs, "max_tokens": 2}), false)),
            ("/api/chat", with(json!({"model": "tiny", "messages": msgs, "stream": false, "options": {}}), true)),
            ("/v1/messages", with(json!({"model": "tiny", "messages": msgs, "max_tokens": 2}), false)),
        ] {
            let (status, _, text) = post(format!("{base}{path}"), body).await;
            assert_eq!(status, 200, "{path}: {text}");
            assert_eq!(*fake.speculations.lock().unwrap().last().unwrap(), want, "{path} with {switch:?}");
        }
    }
    // Not a boolean: refused like any malformed field.
    let bad = json!({"model": "tiny", "messages": msgs, "speculative": "yes"});
    let (status, _, text) = post(format!("{base}/v1/chat/completions"), bad).await;
    assert_eq!(status, 400, "{text}");
}

#[tokio::test]
async fn presence_and_frequency_penalties_reach_the_sampler_from_openai_and_ollama_and_bad_ones_are_400() {
    let (base, fake) = server().await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let openai = json!({"model": "tiny", "messages": msgs, "max_tokens": 2,
        "presence_penalty": 0.5, "frequency_penalty": -0.25});
    let ollama = json!({"model": "tiny", "messages": msgs, "stream": false,
        "options": {"num_predict": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25}});
    for (path, body) in [("/v1/chat/completions", openai), ("/api/chat", ollama)] {
        let (status, _, text) = post(format!("{base}{path}"), body).await;
        assert_eq!(status, 200, "{path}: {text}");
        let seen = fake.samplings.lock().unwrap().last().cloned().unwrap();
        assert_eq!((seen["presence_penalty"].as_f64(), seen["frequency_penalty"].as_f64()), (Some(0.5), Some(-0.25)));
    }
    // Without them, none on the wire.
    let (status, _, _) = post(format!("{base}/v1/chat/completions"), json!({"model": "tiny", "messages": msgs})).await;
    assert_eq!(status, 200);
    let seen = fake.samplings.lock().unwrap().last().cloned().unwrap();
    assert!(seen.get("presence_penalty").is_none() && seen.get("frequency_penalty").is_none(), "{seen}");
    // Out of OpenAI's range: 400 in each API's shape, nothing generated.
    let before = fake.samplings.lock().unwrap().len();
    let bad = json!({"model": "tiny", "messages": msgs, "presence_penalty": 2.5});
    let (status, _, text) = post(format!("{base}/v1/chat/completions"), bad).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("presence_penalty 2.5 is outside"), "{text}");
    let bad = json!({"model": "tiny", "messages": msgs, "stream": false, "options": {"frequency_penalty": -3}});
    let (status, _, text) = post(format!("{base}/api/chat"), bad).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("frequency_penalty -3 is outside"), "{text}");
    assert_eq!(fake.samplings.lock().unwrap().len(), before);
}

#[tokio::test]
async fn ollama_pull_streams_progress_then_success_and_refuses_registry_names() {
    let (url, _) = server().await;
    let pull = format!("{url}/api/pull");
    let (status, _, body) = post(pull.clone(), json!({"model": "https://example.com/m/tiny.gguf"})).await;
    assert_eq!(status, 200, "{body}");
    let lines: Vec<Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0], json!({"status": "pulling manifest"}));
    assert_eq!(lines.last().unwrap(), &json!({"status": "success", "model": "tiny.gguf"}));
    let progress: Vec<u64> = lines[1..lines.len() - 1].iter().map(|l| l["completed"].as_u64().unwrap()).collect();
    assert!(progress.len() >= 10 && progress.len() <= 102, "about one line per 1%: {}", progress.len());
    assert!(progress.windows(2).all(|w| w[0] < w[1]) && progress.last() == Some(&1000), "{progress:?}");
    assert!(lines[1..lines.len() - 1].iter().all(|l| l["total"] == 1000));
    // Whole, and failures.
    let (status, _, body) = post(pull.clone(), json!({"name": "hf://org/repo/tiny.gguf", "stream": false})).await;
    assert_eq!((status, serde_json::from_str::<Value>(&body).unwrap()), (200, json!({"status": "success"})));
    let (status, _, body) = post(pull.clone(), json!({"model": "https://fail.example/x.gguf", "stream": false})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("404"), "{body}");
    let (status, _, body) = post(pull.clone(), json!({"model": "https://fail.example/x.gguf"})).await;
    assert_eq!(status, 200);
    assert!(body.lines().last().unwrap().contains("\"error\""), "{body}");
    let (status, _, body) = post(pull, json!({"model": "llama3.2"})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("hf://") && body.contains("models import --from ollama"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_logprobs_come_per_token_in_both_routes_shapes_and_bad_asks_are_400() {
    let (base, fake) = server().await;
    let chat = format!("{base}/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    // The fake's tokens are bytes: "H" is 72, and its made-up alternatives the next ids.
    let entry = |b: u8| {
        let s = (b as char).to_string();
        json!({"token": s, "logprob": -0.25, "bytes": [b], "top_logprobs": [
            {"token": s, "logprob": -0.25, "bytes": [b]},
            {"token": ((b + 1) as char).to_string(), "logprob": -1.25, "bytes": [b + 1]}]})
    };
    let req = json!({"model": "tiny", "messages": msgs, "max_tokens": 5, "logprobs": true, "top_logprobs": 2});
    let (status, _, body) = post(chat.clone(), req).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(fake.samplings.lock().unwrap().last().unwrap()["logprobs"], 2, "the tail is asked for 2");
    let want: Vec<Value> = b"Hello".iter().map(|&b| entry(b)).collect();
    assert_eq!(v["choices"][0]["logprobs"], json!({"content": want, "refusal": null}));
    // Not asked: null, and nothing asked of the tail.
    let (_, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "max_tokens": 2})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert!(fake.samplings.lock().unwrap().last().unwrap().get("logprobs").is_none());

    // Streamed: each chunk lists the tokens of its text; together, every token of the
    // answer but the end-of-generation one, a character split over two tokens as two
    // entries (U+FFFD as text, the real bytes in `bytes`).
    let req = json!({"model": "tiny", "messages": msgs, "logprobs": true, "stream": true});
    let (status, _, body) = post(chat.clone(), req).await;
    assert_eq!(status, 200, "{body}");
    let data = sse_data(&body);
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let mut bytes = Vec::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        if choice["finish_reason"].is_null() {
            let content = choice["logprobs"]["content"].as_array().unwrap();
            assert!(!content.is_empty(), "a chunk with text has its tokens: {c}");
            for e in content {
                assert_eq!(e["top_logprobs"], json!([]), "top_logprobs defaults to 0");
                bytes.extend(e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8));
            }
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), ANSWER);
    let split: Vec<&Value> =
        chunks.iter().flat_map(|c| c["choices"][0]["logprobs"]["content"].as_array().into_iter().flatten()).collect();
    assert!(split.iter().any(|e| e["token"] == "\u{FFFD}" && e["bytes"] == json!([0xC3])), "the first byte of ö");

    // Completions: the older shape, `logprobs` being the number of alternatives.
    let req = json!({"model": "tiny", "prompt": "Once", "max_tokens": 3, "logprobs": 1});
    let (status, _, body) = post(format!("{base}/v1/completions"), req).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["choices"][0]["logprobs"],
        json!({"tokens": ["H", "e", "l"], "token_logprobs": [-0.25, -0.25, -0.25],
            "top_logprobs": [{"H": -0.25}, {"e": -0.25}, {"l": -0.25}], "text_offset": [0, 1, 2]})
    );

    // A character split over two tokens counts once in the offsets, at its last byte.
    let req = json!({"model": "tiny", "prompt": "Once", "max_tokens": 11, "logprobs": 0});
    let (_, _, body) = post(format!("{base}/v1/completions"), req).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], "Hello, wör");
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"], json!([0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9]));
    // `logprobs: false` asks for none (the completions route too).
    let req = json!({"model": "tiny", "prompt": "Once", "max_tokens": 2, "logprobs": false});
    let (status, _, body) = post(format!("{base}/v1/completions"), req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["logprobs"], Value::Null);

    // Asked wrongly: 400 in OpenAI's shape, nothing generated.
    let before = fake.samplings.lock().unwrap().len();
    for (path, extra, says) in [
        ("/v1/chat/completions", json!({"top_logprobs": 2}), "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs must be from 0 to 20"),
        ("/v1/chat/completions", json!({"logprobs": 3}), "logprobs must be true or false"),
        ("/v1/completions", json!({"logprobs": 6}), "logprobs must be an integer from 0 to 5"),
        ("/v1/completions", json!({"logprobs": 2, "top_logprobs": 2}), "top_logprobs is for chat completions"),
    ] {
        let mut req = json!({"model": "tiny", "messages": msgs, "prompt": "Once"});
        req.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, _, body) = post(format!("{base}{path}"), req).await;
        assert_eq!(status, 400, "{path} {extra}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{body}");
    }
    assert_eq!(fake.samplings.lock().unwrap().len(), before);
}

/// A tool as OpenAI's and Ollama's clients describe it.
fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"]}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_offered_in_the_prompt_held_by_a_grammar_and_calls_come_back_parsed() {
    let openai_error = |body: &str| -> Value { serde_json::from_str::<Value>(body).unwrap()["error"].clone() };
    let (base, fake) = server().await;
    let chat = format!("{base}/v1/chat/completions");
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]);
    let req = json!({"model": "tiny", "messages": msgs, "tools": [weather_tool()], "temperature": 0});
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], Value::Null);
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    assert_eq!((&call["type"], &call["function"]["name"]), (&json!("function"), &json!("get_weather")));
    // Arguments are JSON text, as OpenAI sends them.
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "unit": "c"}));
    // The model was told the tools after the client's system text, and the sampler got
    // a grammar naming the tool and allowing a reply.
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.starts_with("<system>Be brief.\n\nYou can call any of the following tools"), "{prompt}");
    assert!(prompt.contains("The weather in a city"), "{prompt}");
    let grammar = fake.samplings.lock().unwrap().last().unwrap()["grammar"].as_str().unwrap().to_string();
    assert!(grammar.contains("get_weather") && grammar.contains("response"), "{grammar}");

    // tool_choice required: no reply allowed; none: no tools, no grammar, plain text.
    let mut required = req.clone();
    required["tool_choice"] = json!("required");
    assert_eq!(post(chat.clone(), required).await.0, 200);
    let grammar = fake.samplings.lock().unwrap().last().unwrap()["grammar"].as_str().unwrap().to_string();
    assert!(!grammar.contains("response"), "{grammar}");
    let mut none = req.clone();
    none["tool_choice"] = json!("none");
    let (_, _, body) = post(chat.clone(), none).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER);
    assert!(fake.samplings.lock().unwrap().last().unwrap().get("grammar").is_none_or(Value::is_null));

    // A reply (the tools offered do not fit): the response's text, finish stop.
    let other = json!({"type": "function", "function": {"name": "noop"}});
    let (_, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "tools": [other]})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (&v["choices"][0]["message"]["content"], &v["choices"][0]["finish_reason"]),
        (&json!("Just text."), &json!("stop"))
    );
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");

    // The conversation goes on: the call and its result reach the model in the format
    // it answers in, the result named after the call it answers.
    let history = json!([{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]);
    let (status, _, body) =
        post(chat.clone(), json!({"model": "tiny", "messages": history, "tools": [weather_tool()]})).await;
    assert_eq!(status, 200, "{body}");
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(
        prompt.contains(
            r#"<assistant>{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}]}</assistant>"#
        ),
        "{prompt}"
    );
    assert!(prompt.contains(r#"<user>{"tool_response":{"content":"18 C","tool":"get_weather""#), "{prompt}");

    // Ollama: the same tools, arguments as an object, the history in its shape.
    let (status, _, body) = post(
        format!("{base}/api/chat"),
        json!({"model": "tiny", "messages": msgs, "stream": false,
        "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["message"]["tool_calls"][0]["function"],
        json!({"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}})
    );
    assert_eq!((&v["done"], &v["done_reason"]), (&json!(true), &json!("stop")));
    let history = json!([{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "18 C"}]);
    let (status, _, body) = post(
        format!("{base}/api/chat"),
        json!({"model": "tiny", "messages": history, "stream": false,
        "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.contains(r#"<user>{"tool_response":{"content":"18 C","tool":"get_weather"}}</user>"#), "{prompt}");

    // Anthropic: tools with input_schema; tool_use blocks back, tool_result blocks in.
    let weather = &weather_tool()["function"];
    let anthropic_tool = json!({"name": "get_weather", "description": weather["description"],
        "input_schema": weather["parameters"]});
    let messages = format!("{base}/v1/messages");
    let ask = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let (status, _, body) = post(
        messages.clone(),
        json!({"model": "tiny", "max_tokens": 200, "messages": ask,
        "tools": [anthropic_tool], "tool_choice": {"type": "any"}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["stop_reason"], "tool_use");
    let block = &v["content"][0];
    assert_eq!((&block["type"], &block["name"]), (&json!("tool_use"), &json!("get_weather")));
    assert_eq!(block["input"], json!({"city": "Paris", "unit": "c"}));
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"), "{block}");
    let grammar = fake.samplings.lock().unwrap().last().unwrap()["grammar"].as_str().unwrap().to_string();
    assert!(!grammar.contains("response"), "any: a call, no reply: {grammar}");
    let history = json!([{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
            "content": [{"type": "text", "text": "18 C"}]}, {"type": "text", "text": "Thanks"}]}]);
    let (status, _, body) = post(
        messages.clone(),
        json!({"model": "tiny", "max_tokens": 200, "messages": history,
        "tools": [anthropic_tool]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.contains(r#"<user>{"tool_response":{"content":"18 C","tool":"get_weather""#), "{prompt}");
    assert!(prompt.contains("</user><user>Thanks</user>"), "{prompt}");
    let (status, _, body) = post(
        messages.clone(),
        json!({"model": "tiny", "max_tokens": 200, "messages": ask,
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    )
    .await;
    assert_eq!(status, 400, "server tools are refused: {body}");

    // Bad asks are 400s and reach no model.
    let seen = fake.prompts.lock().unwrap().len();
    let named = |n: &str| json!({"type": "function", "function": {"name": n}});
    for (bad, why) in [
        (json!({"tool_choice": named("nope")}), "not a tool"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"logprobs": true}), "generic JSON tool format"),
        (json!({"tools": [weather_tool(), weather_tool()]}), "twice"),
    ] {
        let mut r = req.clone();
        for (k, x) in bad.as_object().unwrap() {
            r[k] = x.clone();
        }
        let (status, _, body) = post(chat.clone(), r).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(openai_error(&body)["message"].as_str().unwrap().contains(why), "{bad}: {body}");
    }
    let (status, _, body) = post(
        format!("{base}/v1/completions"),
        json!({"model": "tiny", "prompt": "x",
        "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = post(
        format!("{base}/api/chat"),
        json!({"model": "tiny", "messages": msgs,
        "tools": [weather_tool()], "logprobs": true}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("generic JSON tool format"), "{body}");
    assert_eq!(fake.prompts.lock().unwrap().len(), seen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_logprobs_come_with_each_lines_tokens_and_bad_asks_are_400() {
    let (base, fake) = server().await;
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    // Whole: one entry per token, the alternatives asked for, the bytes making the text.
    let req = json!({"model": "tiny", "messages": msgs, "stream": false, "logprobs": true, "top_logprobs": 2,
        "options": {"num_predict": 6}});
    let (status, _, body) = post(format!("{base}/api/chat"), req).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let entries = v["logprobs"].as_array().unwrap();
    assert_eq!(entries.len() as u64, v["eval_count"].as_u64().unwrap(), "{v}");
    let bytes: Vec<u8> =
        entries.iter().flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), v["message"]["content"].as_str().unwrap());
    assert!(entries.iter().all(|e| e["logprob"] == json!(-0.25) && e["top_logprobs"].as_array().unwrap().len() == 2));
    assert_eq!(fake.samplings.lock().unwrap().last().unwrap()["logprobs"], 2);
    // Streamed (generate): each line lists its own tokens; together, every token.
    let req = json!({"model": "tiny", "prompt": "Hi", "logprobs": true, "options": {"num_predict": 6}});
    let (status, _, body) = post(format!("{base}/api/generate"), req).await;
    assert_eq!(status, 200, "{body}");
    let lines: Vec<Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let listed: usize = lines.iter().filter_map(|l| l["logprobs"].as_array()).map(Vec::len).sum();
    assert_eq!(listed as u64, lines.last().unwrap()["eval_count"].as_u64().unwrap(), "{body}");
    assert!(lines.iter().filter_map(|l| l["logprobs"].as_array()).flatten().all(|e| e["top_logprobs"] == json!([])));
    // Not asked: no field.
    let (_, _, body) =
        post(format!("{base}/api/chat"), json!({"model": "tiny", "messages": msgs, "stream": false})).await;
    assert!(serde_json::from_str::<Value>(&body).unwrap().get("logprobs").is_none(), "{body}");
    for bad in [json!({"top_logprobs": 2}), json!({"logprobs": true, "top_logprobs": 21})] {
        let mut req = json!({"model": "tiny", "messages": msgs});
        for (k, x) in bad.as_object().unwrap() {
            req[k] = x.clone();
        }
        let (status, _, body) = post(format!("{base}/api/chat"), req).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body.contains("top_logprobs"), "{body}");
    }
}

/// The recorded grammar of the last generation.
fn last_grammar(fake: &Fake) -> String {
    let sampling = fake.samplings.lock().unwrap().last().cloned().unwrap();
    sampling["grammar"].as_str().unwrap_or_default().to_string()
}

/// A reply format: an object with a city and a whole temperature.
fn forecast_schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
        "required": ["city", "temp"]})
}

/// Tools with `response_format` (OpenAI) or `format` (Ollama): the model calls a tool
/// or replies, the reply held to the format by the grammar beside the calls, in the
/// generic format and in a model's own syntax; a required call is not held to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_with_a_reply_format_call_or_reply_in_that_format() {
    let (base, fake) = server().await;
    let chat = format!("{base}/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let schema_format =
        json!({"type": "json_schema", "json_schema": {"name": "forecast", "schema": forecast_schema()}});
    let req = json!({"model": "tiny", "messages": msgs, "tools": [weather_tool()], "response_format": schema_format});
    let reply = r#"{"city": "Oslo", "temp": -3}"#;

    // Generic format: a call comes back as before; the grammar takes a call or a
    // `response` in the schema, nothing else.
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let g = last_grammar(&fake);
    assert!(gbnf::accepts(&g, CALL), "{g}");
    assert!(gbnf::accepts(&g, &format!(r#"{{"response": {reply}}}"#)), "{g}");
    for bad in [r#"{"response": {"city": "Oslo"}}"#, r#"{"response": "Just text."}"#, reply] {
        assert!(!gbnf::accepts(&g, bad), "{bad}: {g}");
    }
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.contains("follows this JSON schema"), "the model is told the reply's schema: {prompt}");
    // A reply: the content is the reply's JSON.
    *fake.answer.lock().unwrap() = Some(format!(r#"{{"response": {reply}}}"#));
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");
    let content: Value = serde_json::from_str(choice["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(content, json!({"city": "Oslo", "temp": -3}));
    *fake.answer.lock().unwrap() = None;
    // json_object: any object as the response.
    let mut object = req.clone();
    object["response_format"] = json!({"type": "json_object"});
    assert_eq!(post(chat.clone(), object).await.0, 200);
    let g = last_grammar(&fake);
    assert!(gbnf::accepts(&g, CALL) && gbnf::accepts(&g, r#"{"response": {"any": [1]}}"#), "{g}");
    assert!(!gbnf::accepts(&g, r#"{"response": "Just text."}"#), "{g}");
    // A required call: no reply offered, the format does not apply.
    let mut required = req.clone();
    required["tool_choice"] = json!("required");
    assert_eq!(post(chat.clone(), required).await.0, 200);
    let g = last_grammar(&fake);
    assert!(gbnf::accepts(&g, CALL) && !gbnf::accepts(&g, &format!(r#"{{"response": {reply}}}"#)), "{g}");

    // Ollama: `format` with tools, the same grammar and reply.
    let ollama = json!({"model": "tiny", "messages": msgs, "stream": false, "tools": [weather_tool()],
        "format": forecast_schema()});
    let (status, _, body) = post(format!("{base}/api/chat"), ollama.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"]["tool_calls"][0]["function"]["name"], "get_weather", "{v}");
    let g = last_grammar(&fake);
    assert!(gbnf::accepts(&g, CALL) && gbnf::accepts(&g, &format!(r#"{{"response": {reply}}}"#)), "{g}");
    assert!(!gbnf::accepts(&g, r#"{"response": {"city": "Oslo"}}"#), "{g}");
    *fake.answer.lock().unwrap() = Some(format!(r#"{{"response": {reply}}}"#));
    let (status, _, body) = post(format!("{base}/api/chat"), ollama.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let content: Value = serde_json::from_str(v["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(content, json!({"city": "Oslo", "temp": -3}));

    // A model's own syntax (Hermes): `auto` now has a grammar, a call block or the
    // reply; Command R7B's reply between its markers comes back as the JSON alone.
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::Hermes);
    *fake.answer.lock().unwrap() = Some(reply.to_string());
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], reply, "{v}");
    let g = last_grammar(&fake);
    let block =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>";
    assert!(gbnf::accepts(&g, block) && gbnf::accepts(&g, reply), "{g}");
    assert!(!gbnf::accepts(&g, r#"{"city": "Oslo"}"#) && !gbnf::accepts(&g, "It is cold."), "{g}");
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::CommandR7b);
    *fake.answer.lock().unwrap() = Some(format!("<|START_RESPONSE|>{reply}<|END_RESPONSE|>"));
    let (status, _, body) = post(format!("{base}/api/chat"), ollama).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"]["content"], reply, "{v}");
    assert!(gbnf::accepts(&last_grammar(&fake), &format!("<|START_RESPONSE|>{reply}<|END_RESPONSE|>")));
}

/// Tools with logprobs: a reply lists its own tokens, in OpenAI's shape (whole and in
/// the stream's one chunk) and Ollama's; a call has null content and no logprobs; in
/// the generic format (where a reply's tokens are not the reply's) `auto` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_with_logprobs_list_a_replys_tokens_and_none_for_calls() {
    let (base, fake) = server().await;
    let chat = format!("{base}/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let plain = json!({"model": "tiny", "messages": msgs, "logprobs": true, "top_logprobs": 2});
    let mut req = plain.clone();
    req["tools"] = json!([weather_tool()]);
    let bytes_of = |logprobs: &Value| -> String {
        let bytes = logprobs["content"].as_array().unwrap().iter().flat_map(|e| e["bytes"].as_array().unwrap().clone());
        String::from_utf8(bytes.map(|b| b.as_u64().unwrap() as u8).collect()).unwrap()
    };

    // Hermes' syntax, a reply in words: the same entries as without tools.
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::Hermes);
    let (_, _, body) = post(chat.clone(), plain.clone()).await;
    let without: Value = serde_json::from_str(&body).unwrap();
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER);
    assert_eq!(v["choices"][0]["logprobs"], without["choices"][0]["logprobs"], "{v}");
    assert_eq!(bytes_of(&v["choices"][0]["logprobs"]), ANSWER);
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][0]["logprobs"]["refusal"], Value::Null);
    // Streamed: the answer's one chunk carries them.
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (status, _, body) = post(chat.clone(), streamed.clone()).await;
    assert_eq!(status, 200, "{body}");
    let first: Value = serde_json::from_str(&sse_data(&body)[0]).unwrap();
    assert_eq!(first["choices"][0]["logprobs"], v["choices"][0]["logprobs"], "{body}");

    // A call: null content, no logprobs (whole and streamed).
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    *fake.answer.lock().unwrap() = Some(call.to_string());
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!((&choice["message"]["content"], &choice["logprobs"]), (&Value::Null, &Value::Null), "{v}");
    let (_, _, body) = post(chat.clone(), streamed).await;
    let first: Value = serde_json::from_str(&sse_data(&body)[0]).unwrap();
    assert_eq!(first["choices"][0]["logprobs"], Value::Null, "{body}");
    // Ollama: the reply's entries; none for a call.
    let ollama = json!({"model": "tiny", "messages": msgs, "stream": false, "tools": [weather_tool()],
        "logprobs": true});
    let (status, _, body) = post(format!("{base}/api/chat"), ollama.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert!(serde_json::from_str::<Value>(&body).unwrap().get("logprobs").is_none(), "{body}");
    *fake.answer.lock().unwrap() = None;
    let (status, _, body) = post(format!("{base}/api/chat"), ollama.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(bytes_of(&json!({"content": v["logprobs"]})), ANSWER, "{v}");

    // Command R7B: the tokens between its reply markers, not the markers'.
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::CommandR7b);
    *fake.answer.lock().unwrap() = Some("<|START_RESPONSE|>Hi there.<|END_RESPONSE|>".into());
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hi there.");
    assert_eq!(bytes_of(&v["choices"][0]["logprobs"]), "Hi there.");
    let (status, _, body) = post(format!("{base}/api/chat"), ollama).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(bytes_of(&json!({"content": v["logprobs"]})), "Hi there.", "{v}");

    // Generic format: `auto` is refused before any generation, with why; a required
    // call (whose answer is never a reply inside JSON) is not.
    *fake.syntax.lock().unwrap() = None;
    *fake.answer.lock().unwrap() = None;
    let seen = fake.prompts.lock().unwrap().len();
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 400, "{body}");
    let message = serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("logprobs with tools") && message.contains("generic JSON tool format"), "{message}");
    assert_eq!(fake.prompts.lock().unwrap().len(), seen);
    let mut required = req.clone();
    required["tool_choice"] = json!("required");
    let (status, _, body) = post(chat.clone(), required).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((&v["choices"][0]["finish_reason"], &v["choices"][0]["logprobs"]), (&json!("tool_calls"), &Value::Null));
}

/// Mistral's syntaxes through the routes: a call read back from Nemo's list (its
/// `[TOOL_CALLS]` a control token, shown as its text so the answer reads) gets a
/// 9-character id; the ids of a conversation sent back (OpenAI's `call_…`, Ollama's
/// none) reach the template as 9-character ones, the same for a call and its result;
/// a required call's grammar is Nemo's list; the later syntax with a reply format
/// calls or replies in that format, and a reply lists its tokens' logprobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mistral_calls_come_back_with_nine_character_ids_and_ids_sent_back_are_mapped() {
    let (base, fake) = server().await;
    let chat = format!("{base}/v1/chat/completions");
    let mistral_id =
        |v: &Value| v.as_str().is_some_and(|s| s.len() == 9 && s.bytes().all(|b| b.is_ascii_alphanumeric()));
    let msgs = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let req = json!({"model": "tiny", "messages": msgs, "tools": [weather_tool()]});
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::MistralNemo);
    let nemo = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}, \
                \"id\": \"a1B2c3D4e\"}]";
    *fake.answer.lock().unwrap() = Some(nemo.to_string());
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let call = v["choices"][0]["message"]["tool_calls"][0].clone();
    assert!(mistral_id(&call["id"]), "{call}");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Oslo", "unit": "c"}));
    // `auto`: the model writes freely; required: Nemo's list, held.
    assert_eq!(last_grammar(&fake), "");
    let mut required = req.clone();
    required["tool_choice"] = json!("required");
    assert_eq!(post(chat.clone(), required).await.0, 200);
    let g = last_grammar(&fake);
    assert!(gbnf::accepts(&g, nemo) && !gbnf::accepts(&g, CALL), "{g}");
    // Ollama: the same call, arguments as an object.
    let ollama = json!({"model": "tiny", "messages": msgs, "stream": false, "tools": [weather_tool()]});
    let (status, _, body) = post(format!("{base}/api/chat"), ollama).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"]["tool_calls"][0]["function"]["arguments"], json!({"city": "Oslo", "unit": "c"}), "{v}");

    // The conversation sent back with OpenAI's ids: the template gets 9-character ones.
    *fake.answer.lock().unwrap() = Some("It is -3 C.".into());
    let history = json!([{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]);
    let (status, _, body) =
        post(chat.clone(), json!({"model": "tiny", "messages": history, "tools": [weather_tool()]})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "It is -3 C.", "{v}");
    let seen = |fake: &Fake| -> Value {
        let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
        // The fake template writes the messages' JSON, then the tools'.
        let mut values = serde_json::Deserializer::from_str(&prompt).into_iter::<Value>();
        values.next().unwrap().unwrap()
    };
    let m = seen(&fake);
    let id = &m[1]["tool_calls"][0]["id"];
    assert!(mistral_id(id) && m[2]["tool_call_id"] == *id && m[1]["content"] == "", "{m}");
    assert!(!m.to_string().contains("call_1"), "{m}");
    // Ollama's history has no ids: the call gets one, and its result the same.
    let history = json!([{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
            "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "-3 C"}]);
    let (status, _, body) = post(
        format!("{base}/api/chat"),
        json!({"model": "tiny", "messages": history, "stream": false, "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let m = seen(&fake);
    let id = &m[1]["tool_calls"][0]["id"];
    assert!(mistral_id(id) && m[2]["tool_call_id"] == *id, "{m}");

    // The later syntax with a reply format: a call or the reply, held; the reply's
    // tokens' logprobs.
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::Mistral { call_ids: false });
    let schema_format =
        json!({"type": "json_schema", "json_schema": {"name": "forecast", "schema": forecast_schema()}});
    let reply = r#"{"city": "Oslo", "temp": -3}"#;
    *fake.answer.lock().unwrap() = Some(reply.to_string());
    let mut formatted = req.clone();
    formatted["response_format"] = schema_format;
    formatted["logprobs"] = json!(true);
    let (status, _, body) = post(chat.clone(), formatted.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], reply, "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["content"].as_array().unwrap().len(), reply.len(), "{v}");
    let g = last_grammar(&fake);
    let later = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\", \"unit\": \"c\"}";
    assert!(gbnf::accepts(&g, later) && gbnf::accepts(&g, reply), "{g}");
    assert!(!gbnf::accepts(&g, r#"{"city": "Oslo"}"#) && !gbnf::accepts(&g, "It is cold."), "{g}");
    *fake.answer.lock().unwrap() = Some(later.to_string());
    let (status, _, body) = post(chat.clone(), formatted).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!((&choice["finish_reason"], &choice["logprobs"]), (&json!("tool_calls"), &Value::Null), "{v}");
    assert!(mistral_id(&choice["message"]["tool_calls"][0]["id"]), "{v}");
    *fake.syntax.lock().unwrap() = None;
    *fake.answer.lock().unwrap() = None;
}

/// `<think>` tags, as Qwen 3's and DeepSeek R1's templates write them.
const THINK: ThinkingSyntax = ThinkingSyntax::Tags { open: "<think>", close: "</think>" };
/// A thinking model's answer: its thinking, then the reply (every byte a token, so the
/// closing tag comes over eight).
const THOUGHT: &str = "<think>\nThe user says hi.\n</think>\n\nHello!";

/// Every model of `fake` thinks in `syntax` (its template opening the thinking when
/// `opens`) and answers `answer`.
fn thinks(fake: &Fake, syntax: ThinkingSyntax, opens: bool, answer: &str) {
    *fake.thinking.lock().unwrap() = (Some(syntax), opens);
    *fake.answer.lock().unwrap() = Some(answer.to_string());
}

/// A stream's chunks (the SSE `data:` payloads before `[DONE]`).
fn chunks(body: &str) -> Vec<Value> {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

/// The thinking and the content a chat stream's deltas carry, joined.
fn deltas(chunks: &[Value]) -> (String, String) {
    let field = |name: &str| chunks.iter().filter_map(|c| c["choices"][0]["delta"][name].as_str()).collect();
    (field("reasoning_content"), field("content"))
}

/// OpenAI's chat: a thinking model's thinking comes in `reasoning_content`, apart from
/// the `content`, whole and streamed (no chunk shows a part of the closing tag), where
/// the template opened it too; usage counts every token; a stop sequence and
/// `max_tokens` still end it; `reasoning_format: none` leaves it in the content; the
/// prompt as is (completions) never splits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_keeps_a_thinking_models_thinking_apart() {
    let (url, fake) = server().await;
    let chat = format!("{url}/v1/chat/completions");
    thinks(&fake, THINK, false, THOUGHT);
    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, body) = post(chat.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let message = &v["choices"][0]["message"];
    assert_eq!(
        *message,
        json!({"role": "assistant", "content": "Hello!", "reasoning_content": "The user says hi."}),
        "{v}"
    );
    assert_eq!(v["usage"]["completion_tokens"], THOUGHT.len() + 1, "every token counts");

    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (status, _, body) = post(chat.clone(), streamed.clone()).await;
    assert_eq!(status, 200, "{body}");
    let cs = chunks(&body);
    assert_eq!(cs[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(deltas(&cs), ("The user says hi.".into(), "Hello!".into()));
    for c in &cs {
        let delta = &c["choices"][0]["delta"];
        for field in ["content", "reasoning_content"] {
            let text = delta[field].as_str().unwrap_or_default();
            assert!(!text.contains('<') && !text.contains('>'), "a tag's part leaked: {c}");
        }
    }
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "stop");

    // Log-probabilities list the reply's tokens, not the thinking's or its tags'.
    let mut scored = req.clone();
    scored["logprobs"] = json!(true);
    let v: Value = serde_json::from_str(&post(chat.clone(), scored).await.2).unwrap();
    let tokens: String = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens, "Hello!", "{v}");

    // The template opened the thinking: the answer starts inside it.
    thinks(&fake, THINK, true, "Hmm.</think>Hi there.");
    let (_, _, body) = post(chat.clone(), streamed.clone()).await;
    assert_eq!(deltas(&chunks(&body)), ("Hmm.".into(), "Hi there.".into()));
    assert!(fake.prompts.lock().unwrap().last().unwrap().ends_with("<assistant><think>\n"));

    // A stop sequence in the reply; max_tokens inside the thinking.
    thinks(&fake, THINK, false, THOUGHT);
    let mut stopped = req.clone();
    stopped["stop"] = json!("!");
    let v: Value = serde_json::from_str(&post(chat.clone(), stopped).await.2).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "The user says hi.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut cut = req.clone();
    cut["max_tokens"] = json!(14);
    let v: Value = serde_json::from_str(&post(chat.clone(), cut).await.2).unwrap();
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "", "reasoning_content": "The us"}));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 14);

    // As llama.cpp's server: `reasoning_format: none` keeps it in the content.
    let mut none = req.clone();
    none["reasoning_format"] = json!("none");
    let v: Value = serde_json::from_str(&post(chat.clone(), none).await.2).unwrap();
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": THOUGHT}));
    let mut bad = req.clone();
    bad["reasoning_format"] = json!("qwen");
    assert_eq!(post(chat.clone(), bad).await.0, 400);
    let (_, _, body) = post(format!("{url}/v1/completions"), json!({"model": "tiny", "prompt": "Hi"})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], THOUGHT);

    // The template's variables: chat_template_kwargs and reasoning_effort reach it.
    let mut kwargs = req.clone();
    kwargs["chat_template_kwargs"] = json!({"enable_thinking": false});
    kwargs["reasoning_effort"] = json!("low");
    assert_eq!(post(chat.clone(), kwargs).await.0, 200);
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.ends_with("<enable_thinking=false><reasoning_effort=low><assistant>"), "{prompt}");
    let mut unknown = req.clone();
    unknown["chat_template_kwargs"] = json!({"tools_in_user_message": true});
    assert_eq!(post(chat.clone(), unknown).await.0, 400);

    // A model without thinking: `<think>` in its answer is its text.
    *fake.thinking.lock().unwrap() = (None, false);
    let v: Value = serde_json::from_str(&post(chat, req).await.2).unwrap();
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": THOUGHT}));
}

/// Ollama's `think`: absent or true, the thinking comes in `thinking` (`message.thinking`
/// in chat), streamed on lines of its own, and the template is told to think; false
/// tells the template not to (`enable_thinking`, as Ollama passes it); true on a model
/// that cannot think is refused as Ollama refuses it; a raw generate is not split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_think_keeps_the_thinking_apart_or_turns_it_off() {
    let (url, fake) = server().await;
    let chat = format!("{url}/api/chat");
    thinks(&fake, THINK, false, THOUGHT);
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let last_prompt = || fake.prompts.lock().unwrap().last().unwrap().clone();
    for think in [Value::Null, json!(true)] {
        let mut req = json!({"model": "tiny", "messages": msgs, "stream": false});
        if !think.is_null() {
            req["think"] = think.clone();
        }
        let (status, _, body) = post(chat.clone(), req).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["message"],
            json!({"role": "assistant", "content": "Hello!", "thinking": "The user says hi."}),
            "think {think}"
        );
        assert_eq!(v["eval_count"], THOUGHT.len() + 1);
        assert!(last_prompt().ends_with("<enable_thinking=true><assistant>"), "{}", last_prompt());
    }
    let (status, _, _) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "think": false})).await;
    assert_eq!(status, 200);
    assert!(last_prompt().ends_with("<enable_thinking=false><assistant>"), "{}", last_prompt());
    let (status, _, _) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "think": "high"})).await;
    assert_eq!(status, 200);
    assert!(last_prompt().ends_with("<reasoning_effort=high><assistant>"), "{}", last_prompt());
    assert_eq!(post(chat.clone(), json!({"model": "tiny", "messages": msgs, "think": "max"})).await.0, 400);

    // Streamed: thinking lines, then content lines, then the end.
    let (_, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs})).await;
    let lines: Vec<Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let joined = |f: &str| -> String { lines.iter().filter_map(|l| l["message"][f].as_str()).collect() };
    assert_eq!((joined("thinking"), joined("content")), ("The user says hi.".to_string(), "Hello!".to_string()));
    let first_content = lines.iter().position(|l| l["message"]["content"] != "").unwrap();
    assert!(lines[..first_content].iter().any(|l| l["message"].get("thinking").is_some()));
    assert!(lines[first_content..].iter().all(|l| l["message"].get("thinking").is_none()));
    assert_eq!(lines.last().unwrap()["done"], true);

    // Generate: `thinking` beside `response`; raw, the text as it came.
    let generate = format!("{url}/api/generate");
    let (_, _, body) = post(generate.clone(), json!({"model": "tiny", "prompt": "Hi", "stream": false})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["response"].clone(), v["thinking"].clone()), (json!("Hello!"), json!("The user says hi.")));
    let raw = json!({"model": "tiny", "prompt": "Hi", "raw": true, "stream": false});
    let v: Value = serde_json::from_str(&post(generate, raw).await.2).unwrap();
    assert_eq!((v["response"].clone(), v.get("thinking")), (json!(THOUGHT), None));

    // `/api/show` says it thinks; a model that does not is refused `think: true`.
    let (_, _, body) = post(format!("{url}/api/show"), json!({"model": "tiny"})).await;
    assert!(serde_json::from_str::<Value>(&body).unwrap()["capabilities"].to_string().contains("thinking"));
    *fake.thinking.lock().unwrap() = (None, false);
    let (status, _, body) = post(chat.clone(), json!({"model": "tiny", "messages": msgs, "think": true})).await;
    assert_eq!(status, 400);
    assert!(body.contains("does not support thinking"), "{body}");
    let (_, _, body) = post(chat, json!({"model": "tiny", "messages": msgs, "stream": false})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"], json!({"role": "assistant", "content": THOUGHT}));
    assert!(!last_prompt().contains("enable_thinking"), "a model that cannot think is not told to");
}

/// Anthropic's `thinking`: enabled, a thinking block before the text block (streamed:
/// its `thinking_delta`s and a `signature_delta`, then the text block at the next
/// index); absent, no thinking block and the thinking left out; disabled, the template
/// told not to think; thinking blocks sent back in the history are taken (and dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_thinking_comes_as_thinking_blocks_when_enabled() {
    let (url, fake) = server().await;
    let msgs = format!("{url}/v1/messages");
    thinks(&fake, THINK, false, THOUGHT);
    let enabled = json!({"type": "enabled", "budget_tokens": 1024});
    // A model whose context holds max_tokens above the least budget.
    let req = json!({"model": "slow", "max_tokens": 2000, "thinking": enabled,
        "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, body) = post(msgs.clone(), req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["content"],
        json!([{"type": "thinking", "thinking": "The user says hi.", "signature": ""},
            {"type": "text", "text": "Hello!"}])
    );
    assert_eq!(v["usage"]["output_tokens"], THOUGHT.len() + 1);

    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (_, _, body) = post(msgs.clone(), streamed).await;
    let events: Vec<(String, Value)> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap().to_string();
            (name, serde_json::from_str(e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap())
        })
        .collect();
    let starts: Vec<&Value> = events.iter().filter(|(n, _)| n == "content_block_start").map(|(_, d)| d).collect();
    assert_eq!(starts.len(), 2, "{body}");
    assert_eq!((starts[0]["index"].clone(), starts[0]["content_block"]["type"].clone()), (json!(0), json!("thinking")));
    assert_eq!((starts[1]["index"].clone(), starts[1]["content_block"]["type"].clone()), (json!(1), json!("text")));
    let joined = |index: u64, kind: &str, field: &str| -> String {
        events
            .iter()
            .filter(|(_, d)| d["index"] == index && d["delta"]["type"] == kind)
            .filter_map(|(_, d)| d["delta"][field].as_str())
            .collect()
    };
    assert_eq!(joined(0, "thinking_delta", "thinking"), "The user says hi.");
    assert_eq!(joined(1, "text_delta", "text"), "Hello!");
    let signature = events.iter().position(|(_, d)| d["delta"]["type"] == "signature_delta").unwrap();
    let first_stop = events.iter().position(|(n, _)| n == "content_block_stop").unwrap();
    assert_eq!(signature + 1, first_stop, "the signature comes just before the thinking block stops");
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);

    // Not enabled: no thinking block, and no thinking in the text.
    let mut absent = req.clone();
    absent.as_object_mut().unwrap().remove("thinking");
    let v: Value = serde_json::from_str(&post(msgs.clone(), absent.clone()).await.2).unwrap();
    assert_eq!(v["content"], json!([{"type": "text", "text": "Hello!"}]));
    absent["stream"] = json!(true);
    let (_, _, body) = post(msgs.clone(), absent).await;
    let text: String = sse_data(&body)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok()?["delta"]["text"].as_str().map(str::to_string))
        .collect();
    assert!(!body.contains("thinking") && text == "Hello!", "{body}");
    let mut disabled = req.clone();
    disabled["thinking"] = json!({"type": "disabled"});
    assert_eq!(post(msgs.clone(), disabled).await.0, 200);
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.ends_with("<enable_thinking=false><assistant>"), "{prompt}");
    for bad in [
        json!({"type": "enabled", "budget_tokens": 100}),
        json!({"type": "enabled", "budget_tokens": 4000}),
        json!({"type": "sometimes"}),
    ] {
        let mut r = req.clone();
        r["thinking"] = bad.clone();
        assert_eq!(post(msgs.clone(), r).await.0, 400, "{bad}");
    }

    // The history as clients send it back, thinking blocks included.
    let mut history = req.clone();
    history["messages"] = json!([{"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "x"},
            {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"}]);
    let (status, _, body) = post(msgs, history).await;
    assert_eq!(status, 200, "{body}");
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.contains("<assistant>Hello!</assistant><user>Bye</user>"), "{prompt}");
}

/// gpt-oss's harmony answers: its channels split (`analysis` the thinking, `final` the
/// content; `<|end|>`, a control token that renders as nothing, shown so the answer
/// reads), whole and streamed; a call in a `commentary` message to a function comes
/// back as a tool call, a malformed one as text; a required call is held to the syntax.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harmony_answers_are_split_into_channels_and_calls() {
    let (url, fake) = server().await;
    let chat = format!("{url}/v1/chat/completions");
    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]});
    thinks(&fake, ThinkingSyntax::Harmony, false, "<|channel|>final<|message|>Hello!<|return|>");
    let v: Value = serde_json::from_str(&post(chat.clone(), req.clone()).await.2).unwrap();
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "Hello!"}), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let harmony = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final\
                   <|message|>Hello!<|return|>";
    thinks(&fake, ThinkingSyntax::Harmony, false, harmony);
    let v: Value = serde_json::from_str(&post(chat.clone(), req.clone()).await.2).unwrap();
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets."}),
        "{v}"
    );
    // The answer's tokens less `<|return|>` and the fake's own end: `<|return|>` ended it.
    assert_eq!(v["usage"]["completion_tokens"], harmony.len() - "<|end|><|return|>".len() + 2);
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (_, _, body) = post(chat.clone(), streamed).await;
    let cs = chunks(&body);
    assert_eq!(deltas(&cs), ("The user greets.".into(), "Hello!".into()));
    assert!(!body.contains("<|"), "{body}");
    // Ollama's `thinking` too.
    let ollama = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": false});
    let v: Value = serde_json::from_str(&post(format!("{url}/api/chat"), ollama).await.2).unwrap();
    assert_eq!(v["message"], json!({"role": "assistant", "content": "Hello!", "thinking": "The user greets."}));

    // A call, after the thinking.
    *fake.syntax.lock().unwrap() = Some(ToolSyntax::Harmony);
    let call = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary \
                to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\", \"unit\": \"c\"}<|call|>";
    *fake.answer.lock().unwrap() = Some(call.to_string());
    let mut tools = req.clone();
    tools["tools"] = json!([weather_tool()]);
    let (status, _, body) = post(chat.clone(), tools.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "Need the weather.");
    assert_eq!(message["content"], Value::Null);
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(message["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Oslo", "unit": "c"}));
    assert_eq!(last_grammar(&fake), "", "auto: the model writes freely");
    // Anthropic's tool_use block, after the thinking block.
    let anthropic = json!({"model": "slow", "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]});
    let v: Value = serde_json::from_str(&post(format!("{url}/v1/messages"), anthropic).await.2).unwrap();
    assert_eq!(v["content"][0], json!({"type": "thinking", "thinking": "Need the weather.", "signature": ""}));
    assert_eq!(
        (v["content"][1]["type"].clone(), v["content"][1]["input"].clone()),
        (json!("tool_use"), json!({"city": "Oslo", "unit": "c"}))
    );
    assert_eq!(v["stop_reason"], "tool_use");

    // The call and its result go back to the template, the call's content text (gpt-oss's
    // template looks inside it), not null.
    *fake.answer.lock().unwrap() = Some("<|channel|>final<|message|>It is -3 C.".into());
    let mut history = tools.clone();
    history["messages"] = json!([{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]);
    let v: Value = serde_json::from_str(&post(chat.clone(), history).await.2).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "It is -3 C.", "{v}");
    let prompt = fake.prompts.lock().unwrap().last().unwrap().clone();
    assert!(prompt.contains(r#""content":"""#) && !prompt.contains("null"), "{prompt}");
    assert!(prompt.contains(r#""name":"get_weather""#) && prompt.contains("-3 C"), "{prompt}");

    // A malformed call: the text as it came (less the thinking).
    let broken = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": ";
    *fake.answer.lock().unwrap() = Some(broken.to_string());
    let v: Value = serde_json::from_str(&post(chat.clone(), tools.clone()).await.2).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["content"], broken);

    // Required: the grammar holds a call in harmony's syntax.
    *fake.answer.lock().unwrap() = Some(call.to_string());
    tools["tool_choice"] = json!("required");
    assert_eq!(post(chat, tools).await.0, 200);
    let g = last_grammar(&fake);
    let held = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                {\"city\": \"Oslo\", \"unit\": \"c\"}";
    assert!(gbnf::accepts(&g, held) && !gbnf::accepts(&g, "<|channel|>final<|message|>Hi"), "{g}");
}

/// A raw request of `method` to `addr`; the status and the head, lower-cased.
fn raw(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    req += body;
    std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let lower = out.to_ascii_lowercase();
    (lower[9..12].parse().unwrap(), lower)
}

/// Security review F6: a key made for a chat client chats and lists models, and cannot
/// pull, delete, load or unload (an admin key can); the routes that change what the
/// cluster holds take JSON only; and where the owner opened the API to every machine,
/// a web page of another site still cannot change anything (a "simple" POST needs no
/// preflight), while this node's own pages and listed origins can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_key_chats_only_and_an_open_api_refuses_other_sites() {
    // Keys needed even on loopback: the tests stand for another machine.
    let keyed = shoal_api::Access { loopback_free: false, ..Default::default() };
    let (url, fake) = server_with(keyed).await;
    let open = shoal_api::Access {
        loopback_free: false,
        open: true,
        cors_origins: vec!["http://app.example:8080".into()],
        private_downloads: false,
    };
    let (open_url, open_fake) = server_with(open).await;
    tokio::task::spawn_blocking(move || {
        let addr = url.trim_start_matches("http://").to_string();
        let json = ("content-type", "application/json");
        let with = |key: &'static str| (("authorization", format!("Bearer {key}")), json);
        let send = |method: &str, path: &str, key: &'static str, body: Value| {
            let ((h, v), j) = with(key);
            raw(&addr, method, path, &[(h, v.as_str()), j], &body.to_string())
        };
        let generate = json!({"model": "tiny", "prompt": "Hi", "stream": false});
        // A chat key: generates, lists …
        assert_eq!(send("POST", "/api/generate", CHAT_KEY, generate.clone()).0, 200);
        assert_eq!(
            send(
                "POST",
                "/v1/chat/completions",
                CHAT_KEY,
                json!({"model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}]})
            )
            .0,
            200
        );
        assert_eq!(send("GET", "/api/tags", CHAT_KEY, json!(null)).0, 200);
        // … and no more.
        let refused = [
            ("POST", "/api/pull", json!({"model": "http://example.com/x.gguf", "stream": false})),
            ("DELETE", "/api/delete", json!({"model": "tiny"})),
            ("POST", "/api/generate", json!({"model": "tiny", "prompt": "Hi", "keep_alive": 0, "stream": false})),
            ("POST", "/api/generate", json!({"model": "cold", "prompt": ""})),
            ("POST", "/api/chat", json!({"model": "tiny", "messages": []})),
            (
                "POST",
                "/api/chat",
                json!({"model": "tiny", "keep_alive": "0s", "stream": false,
                "messages": [{"role": "user", "content": "Hi"}]}),
            ),
        ];
        let prompts = fake.prompts.lock().unwrap().len();
        for (method, path, body) in &refused {
            let (status, text) = send(method, path, CHAT_KEY, body.clone());
            assert_eq!(status, 403, "{method} {path} {body}: {text}");
            assert!(text.contains("admin key"), "{text}");
        }
        assert_eq!(fake.prompts.lock().unwrap().len(), prompts, "a refused request reached the model");
        assert!(fake.loads.lock().unwrap().is_empty() && fake.unloads.lock().unwrap().is_empty());
        assert!(fake.removed.lock().unwrap().is_empty());
        // An admin key may.
        assert_eq!(send("DELETE", "/api/delete", GOOD_KEY, json!({"model": "tiny"})).0, 200);
        assert_eq!(send("POST", "/api/generate", GOOD_KEY, json!({"model": "cold", "prompt": ""})).0, 200);
        assert_eq!(fake.loads.lock().unwrap().as_slice(), ["cold"]);
        // Pull and delete take JSON only (what a page's form or text POST is not).
        let bearer = format!("Bearer {GOOD_KEY}");
        for ct in ["text/plain", "application/x-www-form-urlencoded"] {
            let h = [("authorization", bearer.as_str()), ("content-type", ct)];
            let (status, text) = raw(&addr, "POST", "/api/pull", &h, r#"{"model": "x"}"#);
            assert_eq!(status, 400, "{text}");
            assert!(text.contains("application/json"), "{text}");
        }

        // The open API: any machine, no key …
        let open_addr = open_url.trim_start_matches("http://").to_string();
        let post = |origin: Option<&str>, ct: &str| {
            let mut h = vec![("content-type", ct)];
            h.extend(origin.map(|o| ("origin", o)));
            raw(&open_addr, "POST", "/api/generate", &h, &generate.to_string()).0
        };
        assert_eq!(post(None, "application/json"), 200);
        // … the node's own page, a listed origin …
        assert_eq!(post(Some(&format!("http://{open_addr}")), "application/json"), 200);
        assert_eq!(post(Some("http://app.example:8080"), "application/json"), 200);
        // … but not another site's page, whatever its body.
        let before = open_fake.prompts.lock().unwrap().len();
        for ct in ["text/plain", "application/json"] {
            assert_eq!(post(Some("http://evil.example"), ct), 403);
        }
        let h = [("origin", "http://evil.example"), json];
        assert_eq!(raw(&open_addr, "POST", "/api/pull", &h, r#"{"model": "x"}"#).0, 403);
        assert_eq!(open_fake.prompts.lock().unwrap().len(), before, "another site's page reached the model");
        // Reading is still open to it (the browser keeps the answer from the page
        // unless CORS allows it).
        assert_eq!(raw(&open_addr, "GET", "/api/tags", &[("origin", "http://evil.example")], "").0, 200);
    })
    .await
    .unwrap();
}
