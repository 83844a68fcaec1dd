//! OpenAI's routes: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed
//! as server-sent events or answered whole), `GET /v1/models` and `/v1/models/{id}`.
//! Fields Shoal cannot honour yet are refused with a 400 that says so, never ignored
//! into a silently different answer. Log-probabilities are the model's (log-softmax
//! of the tail's logits, before sampling), computed only when asked for.

use crate::backend::{Backend, Failure, PromptOptions};
use crate::common::{self, error_response, Dialect};
use crate::gen::{self, Event, Job, Logprob, Outcome};
use crate::grammar::Structured;
use crate::tools::{self, Reply, Toolbox, Turn};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_types::SamplingParams;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Temperature when a request gives none (llama.cpp's and Ollama's default; OpenAI's
/// own is 1.0, which small local models take badly).
pub(crate) const DEFAULT_TEMPERATURE: f32 = 0.8;

/// Sampling and length fields shared by both completion routes.
#[derive(Debug, Default, Deserialize)]
struct Knobs {
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// Not OpenAI's, but llama.cpp's server and vLLM take it.
    top_k: Option<i32>,
    /// Not OpenAI's, but llama.cpp's server and vLLM take it.
    min_p: Option<f32>,
    /// Not OpenAI's: llama.cpp's name for the repetition penalty.
    repeat_penalty: Option<f32>,
    seed: Option<i64>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    stop: Option<Stop>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    n: Option<u32>,
    /// Chat: true or false; completions: how many alternatives (0 to 5).
    logprobs: Option<Value>,
    /// Chat: alternatives per token (0 to 20), with `logprobs: true`.
    top_logprobs: Option<u32>,
    response_format: Option<Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// Not OpenAI's: llama.cpp's server takes it (make `max_tokens`, whatever comes).
    #[serde(default)]
    ignore_eos: bool,
    /// Not OpenAI's: Shoal's switch for speculative decoding (default: the node's setting).
    speculative: Option<bool>,
    /// Not OpenAI's: llama.cpp server's. `none` leaves a reasoning model's thinking in
    /// `content`; `auto` and `deepseek` (the default) put it in `reasoning_content`.
    reasoning_format: Option<String>,
    /// Not OpenAI's: llama.cpp server's variables for the chat template; Shoal takes
    /// `enable_thinking` (a boolean) and `reasoning_effort`.
    chat_template_kwargs: Option<Value>,
    /// OpenAI's reasoning effort (`low`, `medium`, `high` …), given to the chat
    /// template as `reasoning_effort` (gpt-oss's reads it).
    reasoning_effort: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

impl Knobs {
    /// How many alternatives each token's log-probabilities list, if they are asked
    /// for: chat takes `logprobs: true` and `top_logprobs` (0-20), completions take
    /// `logprobs: N` (0-5), as OpenAI does.
    fn logprobs(&self, kind: Kind) -> Result<Option<u32>, Failure> {
        let asked = match (kind, &self.logprobs) {
            (Kind::Text, _) if self.top_logprobs.is_some() => {
                return Err(Failure::bad("top_logprobs is for chat completions; completions take logprobs: N"))
            }
            (_, None | Some(Value::Null | Value::Bool(false))) => false,
            (Kind::Chat, Some(Value::Bool(_))) => true,
            (Kind::Chat, Some(_)) => return Err(Failure::bad("logprobs must be true or false")),
            (Kind::Text, Some(v)) => match v.as_u64() {
                Some(n) if n <= 5 => return Ok(Some(n as u32)),
                _ => return Err(Failure::bad("logprobs must be an integer from 0 to 5")),
            },
        };
        common::top_logprobs(asked, self.top_logprobs)
    }

    /// Refuse what Shoal cannot honour yet; the sampling parameters, stop strings and
    /// the tools the model may call.
    fn check(&self, kind: Kind) -> Result<(SamplingParams, Vec<String>, Option<Toolbox>), Failure> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(Failure::bad("n must be 1: Shoal makes one choice per request"));
        }
        let logprobs = self.logprobs(kind)?;
        let structured = match &self.response_format {
            None => None,
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => None,
                Some("json_object") => Some(Structured::object()),
                Some("json_schema") => {
                    let Some(schema) = f.get("json_schema").and_then(|j| j.get("schema")) else {
                        return Err(Failure::bad("response_format json_schema: json_schema.schema is missing"));
                    };
                    Some(Structured::schema(schema).map_err(|e| Failure::bad(format!("response_format: {e}")))?)
                }
                _ => return Err(Failure::bad("response_format: type must be text, json_object or json_schema")),
            },
        };
        let mut toolbox = match (kind, &self.tools) {
            (Kind::Text, Some(t)) if !t.is_empty() => {
                return Err(Failure::bad("tools are for chat completions (/v1/chat/completions)"))
            }
            (_, tools) => {
                Toolbox::new(tools.as_deref().unwrap_or_default(), self.tool_choice.as_ref(), self.parallel_tool_calls)
                    .map_err(Failure::bad)?
            }
        };
        // With tools the model calls them or replies, the reply in the format asked
        // for. A toolbox's grammar depends on the model's tool syntax: `prepare` sets it.
        let grammar = match toolbox.as_mut() {
            Some(t) => {
                t.reply_as(structured);
                None
            }
            None => structured.map(|s| s.grammar()),
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(Failure::bad("stop: at most 4 sequences"));
        }
        let d = SamplingParams::default();
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(DEFAULT_TEMPERATURE),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: d.repeat_last_n,
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            // Any integer is a seed; the sampler takes 32 bits of it.
            seed: self.seed.map_or(d.seed, |s| s as u32),
            grammar,
            logprobs,
        };
        Ok((params, stop, toolbox))
    }

    fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// Whether a reasoning model's thinking is kept apart (`reasoning_content`): in chat,
    /// unless `reasoning_format` is `none`; never for the prompt as is (completions), as
    /// llama.cpp's server does.
    fn split_thinking(&self, kind: Kind) -> Result<bool, Failure> {
        match self.reasoning_format.as_deref() {
            None | Some("auto" | "deepseek") => Ok(kind == Kind::Chat),
            Some("none") => Ok(false),
            Some(other) => Err(Failure::bad(format!("reasoning_format {other:?}: none, auto or deepseek"))),
        }
    }

    /// The chat template's variables: `chat_template_kwargs`' `enable_thinking` and
    /// `reasoning_effort`, and `reasoning_effort` (which wins). Other variables are
    /// refused: Shoal would not pass them.
    fn prompt_options(&self) -> Result<PromptOptions, Failure> {
        let mut options = PromptOptions::default();
        match &self.chat_template_kwargs {
            None | Some(Value::Null) => {}
            Some(Value::Object(kwargs)) => {
                for (k, v) in kwargs {
                    match (k.as_str(), v) {
                        ("enable_thinking", Value::Bool(b)) => options.enable_thinking = Some(*b),
                        ("reasoning_effort", Value::String(e)) => options.reasoning_effort = Some(e.clone()),
                        ("enable_thinking" | "reasoning_effort", _) => {
                            return Err(Failure::bad(format!(
                                "chat_template_kwargs.{k}: a boolean for enable_thinking, a string for reasoning_effort"
                            )))
                        }
                        _ => {
                            return Err(Failure::bad(format!(
                                "chat_template_kwargs.{k}: Shoal passes only enable_thinking and reasoning_effort"
                            )))
                        }
                    }
                }
            }
            Some(_) => return Err(Failure::bad("chat_template_kwargs must be an object")),
        }
        if let Some(e) = &self.reasoning_effort {
            options.reasoning_effort = Some(e.clone());
        }
        Ok(options)
    }
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<InMessage>,
    #[serde(flatten)]
    knobs: Knobs,
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Content,
    /// An assistant turn's calls.
    #[serde(default)]
    tool_calls: Option<Value>,
    /// The call a tool turn answers.
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// A message's content: text, or parts of which only text ones are taken.
#[derive(Debug, Default, Deserialize)]
#[serde(untagged)]
enum Content {
    #[default]
    None,
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

impl Content {
    fn text(&self) -> Result<String, Failure> {
        match self {
            Content::None => Ok(String::new()),
            Content::Text(s) => Ok(s.clone()),
            Content::Parts(parts) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(Failure::bad(format!("content parts of type {kind:?} are not supported"))),
                })
                .collect(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: Prompt,
    #[serde(flatten)]
    knobs: Knobs,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    One(String),
    Many(Vec<String>),
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    common::respond(Dialect::OpenAi, body, |body| async move {
        let req: ChatRequest = common::parse(&body)?;
        let turns = req
            .messages
            .iter()
            .map(|m| {
                if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                    return Err(Failure::bad(format!("unknown message role {:?}", m.role)));
                }
                // `developer` is OpenAI's newer name for `system`.
                let role = if m.role == "developer" { "system".to_string() } else { m.role.clone() };
                let calls = match (&m.tool_calls, role.as_str()) {
                    (None | Some(Value::Null), _) => Vec::new(),
                    (Some(c), "assistant") => tools::calls_of(c).map_err(|e| Failure::bad(format!("messages: {e}")))?,
                    (Some(_), _) => return Err(Failure::bad("messages: only assistant turns carry tool_calls")),
                };
                let (content, call_id) = (m.content.text()?, m.tool_call_id.clone());
                Ok(Turn { role, content, calls, call_id, tool: None })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if turns.is_empty() {
            return Err(Failure::bad("messages must not be empty"));
        }
        let options = req.knobs.prompt_options()?;
        let (job, knobs, toolbox) = prepare(&*backend, &req.model, req.knobs, Kind::Chat, |text, toolbox| {
            let prompt = tools::prompt(text, &turns, toolbox, &options).map_err(Failure::bad)?;
            Ok(text.tokenize(&prompt, true))
        })
        .await?;
        match toolbox {
            Some(toolbox) => answer_with_tools(backend, job, knobs, toolbox).await,
            None => answer(backend, job, knobs, Kind::Chat).await,
        }
    })
    .await
}

/// `POST /v1/completions`: the prompt as is, no chat template.
pub(crate) async fn completions<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    common::respond(Dialect::OpenAi, body, |body| async move {
        let req: CompletionRequest = common::parse(&body)?;
        let prompt = match req.prompt {
            Prompt::One(p) => p,
            Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
            Prompt::Many(_) => return Err(Failure::bad("prompt: one string per request")),
        };
        let (job, knobs, _) =
            prepare(&*backend, &req.model, req.knobs, Kind::Text, |text, _| Ok(text.tokenize(&prompt, false))).await?;
        answer(backend, job, knobs, Kind::Text).await
    })
    .await
}

/// The model, its vocabulary, the prompt's tokens (by `tokens`, told the tools the
/// model may call), the job, and those tools.
async fn prepare<B: Backend>(
    backend: &B,
    name: &str,
    knobs: Knobs,
    kind: Kind,
    tokens: impl FnOnce(&dyn crate::backend::TextModel, Option<&Toolbox>) -> Result<Vec<shoal_types::TokenId>, Failure>,
) -> Result<(Job, Knobs, Option<Toolbox>), Failure> {
    let (mut sampling, stop, mut toolbox) = knobs.check(kind)?;
    let split_thinking = knobs.split_thinking(kind)?;
    let model = common::resolve(backend, name).await?;
    let model = common::wait_ready(backend, model).await?;
    let text = backend.text(&model.entry.name).await?;
    if let Some(t) = toolbox.as_mut() {
        t.speak(text.tool_syntax());
        sampling.grammar = t.grammar();
        if sampling.logprobs.is_some() && !t.replies_verbatim() {
            return Err(Failure::bad(LOGPROBS_IN_GENERIC_FORMAT));
        }
    }
    let prompt = common::off_the_loop(|| tokens(&*text, toolbox.as_ref()))?;
    let max_tokens = knobs.max_tokens().unwrap_or_else(|| common::default_max_tokens(&model, prompt.len()));
    let (ignore_eos, speculative) = (knobs.ignore_eos, knobs.speculative);
    let shown = toolbox.as_ref().map(|t| t.shown_markers(&*text)).unwrap_or_default();
    let model = model.entry.name.clone();
    let job = Job { model, text, prompt, max_tokens, sampling, stop, ignore_eos, speculative, shown, split_thinking };
    Ok((job, knobs, toolbox))
}

/// Why `logprobs` with tools are refused for a model in the generic tool format.
pub(crate) const LOGPROBS_IN_GENERIC_FORMAT: &str =
    "logprobs with tools (tool_choice auto) need a model whose chat template has a tool syntax of its own \
     (Hermes, Qwen3-Coder, Llama 3, Command R7B, Command R+, DeepSeek, Mistral, harmony): this model answers in \
     Shoal's generic JSON tool format, where a reply is written inside {\"response\": …} and its tokens are not the \
     reply's";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// Run `job`: a stream of chunks, or the whole answer. Failures before the first
/// text come back as an error status.
async fn answer<B: Backend>(backend: Arc<B>, job: Job, knobs: Knobs, kind: Kind) -> Result<Response, Failure> {
    let model = job.model.clone();
    let scored = job.sampling.logprobs.is_some();
    let (first, mut events) = gen::start(backend, job).await?;
    let (id, created) = (common::new_id(if kind == Kind::Chat { "chatcmpl-" } else { "cmpl-" }), common::unix_now());
    if knobs.stream {
        let usage = knobs.stream_options.is_some_and(|o| o.include_usage);
        let chunks = Chunks { id, created, model, kind, usage, scored, offset: Default::default() };
        return Ok(Sse::new(sse(chunks, first, events)).keep_alive(common::keep_alive()).into_response());
    }
    let gen::Whole { text, thinking, logprobs, outcome } = gen::collect(first, &mut events).await?;
    let logprobs = if scored { logprobs_json(kind, &logprobs, 0) } else { Value::Null };
    let choice = match kind {
        Kind::Chat => json!({"index": 0, "message": message(Value::String(text), &thinking), "logprobs": logprobs,
            "finish_reason": outcome.finish.as_str()}),
        Kind::Text => json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": outcome.finish.as_str()}),
    };
    let object = if kind == Kind::Chat { "chat.completion" } else { "text_completion" };
    Ok(Json(json!({"id": id, "object": object, "created": created, "model": model,
        "choices": [choice], "usage": usage(&outcome)}))
    .into_response())
}

/// Run `job` whose answer a [`Toolbox`] grammar holds: the whole answer is read
/// before anything is sent (a call is parsed, not streamed as JSON text), then sent as
/// a message with `tool_calls` (finish reason `tool_calls`; content and logprobs
/// null) or with the reply's text (and, when asked for, its tokens'
/// log-probabilities); a stream sends it as one chunk, then the end.
async fn answer_with_tools<B: Backend>(
    backend: Arc<B>,
    job: Job,
    knobs: Knobs,
    toolbox: Toolbox,
) -> Result<Response, Failure> {
    let model = job.model.clone();
    let scored = job.sampling.logprobs.is_some();
    let (first, mut events) = gen::start(backend, job).await?;
    let gen::Whole { text, thinking, logprobs: entries, outcome } = gen::collect(first, &mut events).await?;
    let (created, id) = (common::unix_now(), common::new_id("chatcmpl-"));
    let mut logprobs = Value::Null;
    let (calls, content, finish) = match toolbox.read(&text) {
        Reply::Calls(calls) => {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    json!({"id": toolbox.new_call_id(), "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments.to_string()}})
                })
                .collect();
            (Some(calls), Value::Null, "tool_calls")
        }
        Reply::Text(t) => {
            // The reply's own tokens; `prepare` refused logprobs where a reply is not
            // a part of the text (the span is then None, and no numbers are sent).
            if let Some(span) = toolbox.reply_span(&text, &t).filter(|_| scored) {
                logprobs = logprobs_json(Kind::Chat, gen::logprobs_within(&entries, text.len(), span), 0);
            }
            (None, Value::String(t), outcome.finish.as_str())
        }
    };
    if !knobs.stream {
        let mut message = message(content, &thinking);
        if let Some(calls) = calls {
            message["tool_calls"] = Value::Array(calls);
        }
        return Ok(Json(json!({"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(&outcome)}))
        .into_response());
    }
    let usage = knobs.stream_options.is_some_and(|o| o.include_usage);
    let chunks = Chunks { id, created, model, kind: Kind::Chat, usage, scored: false, offset: Default::default() };
    let mut delta = message(content, &thinking);
    if let Some(calls) = calls {
        // A streamed call says its place in the list (clients join deltas by index).
        let indexed = calls.into_iter().enumerate().map(|(i, mut c)| {
            c["index"] = json!(i);
            c
        });
        delta["tool_calls"] = Value::Array(indexed.collect());
    }
    let mut out = vec![
        chunks.chunk(Some(json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null})), None)
    ];
    out.extend(chunks.end_as(finish, &outcome, false));
    Ok(Sse::new(stream::iter(out.into_iter().map(Ok::<_, Infallible>))).into_response())
}

/// An answer's message (or a stream's one delta): the assistant's `content`, and its
/// `thinking` as `reasoning_content` (llama.cpp server's field) when there is some.
fn message(content: Value, thinking: &str) -> Value {
    let mut m = json!({"role": "assistant", "content": content});
    if !thinking.is_empty() {
        m["reasoning_content"] = json!(thinking);
    }
    m
}

/// Tokens' log-probabilities in OpenAI's shape: chat's `{"content": [{token, logprob,
/// bytes, top_logprobs}], "refusal": null}`, or the completions route's older
/// `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets in characters from
/// `offset`, where this part of the answer starts). A token that is part of a UTF-8
/// character shows as U+FFFD in `token`; `bytes` holds its real bytes.
fn logprobs_json(kind: Kind, entries: &[Logprob], offset: usize) -> Value {
    let shown = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match kind {
        Kind::Chat => json!({"content": token_entries(entries), "refusal": null}),
        Kind::Text => {
            // Offsets in the text as released: a character split over tokens counts
            // once, at the token that completes it.
            let mut at = offset;
            let mut utf8 = shoal_types::Utf8Stream::default();
            let mut offsets = Vec::new();
            for e in entries {
                offsets.push(at);
                at += utf8.push(&e.bytes).chars().count();
            }
            let top: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut m = serde_json::Map::new();
                    for (b, x) in &e.top {
                        m.entry(shown(b)).or_insert(json!(finite(*x)));
                    }
                    Value::Object(m)
                })
                .collect();
            json!({"tokens": entries.iter().map(|e| shown(&e.bytes)).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| finite(e.logprob)).collect::<Vec<_>>(),
                "top_logprobs": top, "text_offset": offsets})
        }
    }
}

/// Tokens' log-probabilities as chat's entries (`[{token, logprob, bytes,
/// top_logprobs: [{token, logprob, bytes}]}]`), the shape Ollama's `logprobs` took too.
pub(crate) fn token_entries(entries: &[Logprob]) -> Vec<Value> {
    let shown = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    entries
        .iter()
        .map(|e| {
            let top: Vec<Value> =
                e.top.iter().map(|(b, x)| json!({"token": shown(b), "logprob": finite(*x), "bytes": b})).collect();
            json!({"token": shown(&e.bytes), "logprob": finite(e.logprob), "bytes": e.bytes, "top_logprobs": top})
        })
        .collect()
}

/// A log-probability JSON can hold: -inf (a token the model gave no chance) as -9999,
/// the floor OpenAI's own answers use.
fn finite(x: f32) -> f64 {
    if x.is_finite() {
        f64::from(x)
    } else {
        -9999.0
    }
}

fn usage(o: &Outcome) -> Value {
    json!({"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens})
}

/// What every chunk of one stream repeats.
struct Chunks {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Send a last chunk with the usage and no choices (`stream_options.include_usage`).
    usage: bool,
    /// Whether chunks carry their tokens' log-probabilities (else `"logprobs": null`).
    scored: bool,
    /// Characters of the answer sent so far (the completions route's `text_offset`).
    offset: std::cell::Cell<usize>,
}

impl Chunks {
    fn chunk(&self, choice: Option<Value>, usage: Option<Value>) -> SseEvent {
        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choice.into_iter().collect::<Vec<_>>()});
        if self.usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(v.to_string())
    }

    fn text(&self, text: &str, logprobs: &[Logprob], first: bool) -> SseEvent {
        let lp = if self.scored { logprobs_json(self.kind, logprobs, self.offset.get()) } else { Value::Null };
        self.offset.set(self.offset.get() + text.chars().count());
        let choice = match self.kind {
            Kind::Chat if first => json!({"index": 0, "delta": {"role": "assistant", "content": text},
                "logprobs": lp, "finish_reason": null}),
            Kind::Chat => json!({"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}),
            Kind::Text => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": null}),
        };
        self.chunk(Some(choice), None)
    }

    /// A chunk of the model's thinking: `delta.reasoning_content`, as llama.cpp's server
    /// streams it (chat only: completions never split it).
    fn thinking(&self, text: &str, first: bool) -> SseEvent {
        let mut delta = json!({"reasoning_content": text});
        if first {
            delta["role"] = json!("assistant");
        }
        self.chunk(Some(json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})), None)
    }

    fn end(&self, o: &Outcome, first: bool) -> Vec<SseEvent> {
        self.end_as(o.finish.as_str(), o, first)
    }

    /// [`Chunks::end`] with the finish reason `finish` (a tool call's, not the
    /// generation's).
    fn end_as(&self, finish: &str, o: &Outcome, first: bool) -> Vec<SseEvent> {
        let choice = match self.kind {
            Kind::Chat if first => json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": finish}),
            Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}),
            Kind::Text => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish}),
        };
        let mut out = vec![self.chunk(Some(choice), None)];
        if self.usage {
            out.push(self.chunk(None, Some(usage(o))));
        }
        out.push(SseEvent::default().data("[DONE]"));
        out
    }
}

/// The SSE stream of a generation whose first event is `first`. A failure after text
/// went out can only be told in the stream: an `error` object, as OpenAI sends.
fn sse(
    chunks: Chunks,
    first: Event,
    events: mpsc::Receiver<Event>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send {
    struct St {
        chunks: Chunks,
        pending: Option<Event>,
        events: mpsc::Receiver<Event>,
        sent_text: bool,
        out: std::collections::VecDeque<SseEvent>,
        done: bool,
    }
    let st = St { chunks, pending: Some(first), events, sent_text: false, out: Default::default(), done: false };
    stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            let event = match st.pending.take() {
                Some(e) => e,
                None => match st.events.recv().await {
                    Some(e) => e,
                    None => {
                        st.done = true;
                        continue;
                    }
                },
            };
            match event {
                Event::Text(t, lp) => {
                    st.out.push_back(st.chunks.text(&t, &lp, !st.sent_text));
                    st.sent_text = true;
                }
                Event::Thinking(t) => {
                    st.out.push_back(st.chunks.thinking(&t, !st.sent_text));
                    st.sent_text = true;
                }
                Event::End(o) => {
                    st.out.extend(st.chunks.end(&o, !st.sent_text));
                    st.done = true;
                }
                Event::Failed(f) => {
                    let v = json!({"error": {"message": f.message, "type": "server_error", "param": null,
                        "code": null}});
                    st.out.push_back(SseEvent::default().data(v.to_string()));
                    st.done = true;
                }
            }
        }
    })
}

/// `GET /v1/models`.
pub(crate) async fn models<B: Backend>(State(backend): State<Arc<B>>) -> Response {
    let data: Vec<Value> = backend.models().await.iter().map(model_json).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}` (an id may hold slashes: Hugging Face names do).
pub(crate) async fn model<B: Backend>(State(backend): State<Arc<B>>, Path(id): Path<String>) -> Response {
    match common::resolve(&*backend, &id).await {
        Ok(m) => Json(model_json(&m)).into_response(),
        Err(f) => error_response(Dialect::OpenAi, &f),
    }
}

fn model_json(m: &crate::backend::ModelInfo) -> Value {
    json!({"id": m.entry.name, "object": "model", "created": 0, "owned_by": "shoal"})
}
