//! Anthropic's Messages route, `POST /v1/messages`, for clients that speak it: the
//! whole message, or its stream of named events (`message_start`,
//! `content_block_start`, `content_block_delta`…, `message_delta`, `message_stop`).
//! Tools (`tools`, `tool_choice`, `tool_use` and `tool_result` blocks) go through the
//! same generic format as OpenAI's (see `tools`). A reasoning model's thinking comes as
//! a `thinking` block when the request enables `thinking` (see `thinking`).

use crate::backend::{Backend, Failure, PromptOptions};
use crate::common::{self, Dialect};
use crate::gen::{self, Event, Finish, Job, Outcome};
use crate::tools::{self, Call, Reply, Toolbox, Turn};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_types::SamplingParams;
use std::convert::Infallible;
use std::sync::Arc;

#[derive(Debug, Deserialize)]
struct Request {
    model: String,
    max_tokens: u32,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    /// Not Anthropic's: Shoal's switch for speculative decoding (default: the node's).
    #[serde(default)]
    speculative: Option<bool>,
    /// Extended thinking: `{"type": "enabled", "budget_tokens": N}` or `{"type": "disabled"}`.
    #[serde(default)]
    thinking: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// Text, or blocks of which only text ones are taken.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    /// A `tool_use` block's id, tool name and input.
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    /// The call a `tool_result` block answers, and its result (text or text blocks).
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(default)]
    content: Option<Value>,
}

impl Content {
    fn text(&self) -> Result<String, Failure> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Blocks(blocks) => blocks
                .iter()
                .map(|b| match (b.kind.as_str(), &b.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(Failure::bad(format!("content blocks of type {kind:?} are not supported"))),
                })
                .collect(),
        }
    }
}

impl Message {
    /// The message as turns: a user message's `tool_result` blocks become tool turns
    /// (in their place among its text), an assistant message's `tool_use` blocks its
    /// calls.
    fn turns(&self) -> Result<Vec<Turn>, Failure> {
        let blocks = match &self.content {
            Content::Text(s) => {
                return Ok(vec![Turn { role: self.role.clone(), content: s.clone(), ..Turn::default() }])
            }
            Content::Blocks(b) => b,
        };
        let mut out = Vec::new();
        let mut turn = Turn { role: self.role.clone(), ..Turn::default() };
        for b in blocks {
            match (b.kind.as_str(), self.role.as_str()) {
                ("text", _) => turn.content += b.text.as_deref().unwrap_or_default(),
                ("tool_use", "assistant") => {
                    let name = b.name.clone().ok_or_else(|| Failure::bad("a tool_use block without name"))?;
                    let arguments = b.input.clone().unwrap_or_else(|| json!({}));
                    turn.calls.push(Call { id: b.id.clone(), name, arguments });
                }
                // Earlier thinking that a client sends back (Anthropic asks clients to):
                // templates drop earlier turns' thinking, so Shoal does too.
                ("thinking" | "redacted_thinking", "assistant") => {}
                ("tool_result", "user") => {
                    if !turn.content.is_empty() {
                        out.push(std::mem::replace(&mut turn, Turn { role: "user".into(), ..Turn::default() }));
                    }
                    let content = match &b.content {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => parts.iter().filter_map(|p| p.get("text")?.as_str()).collect(),
                        Some(_) => return Err(Failure::bad("a tool_result's content must be text or text blocks")),
                    };
                    out.push(Turn { role: "tool".into(), content, call_id: b.tool_use_id.clone(), ..Turn::default() });
                }
                (kind, role) => {
                    return Err(Failure::bad(format!(
                        "content blocks of type {kind:?} are not supported in {role} turns"
                    )))
                }
            }
        }
        if !turn.content.is_empty() || !turn.calls.is_empty() || out.is_empty() {
            out.push(turn);
        }
        Ok(out)
    }
}

/// Anthropic's `tools` and `tool_choice` as the generic toolbox: each tool's
/// `input_schema` is its parameters; `any` is OpenAI's `required`, `tool` names one.
fn toolbox(tools: &[Value], choice: Option<&Value>) -> Result<Option<Toolbox>, Failure> {
    let tools = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.get("type").is_some_and(|k| k != "custom") {
                return Err(Failure::bad(format!("tools[{i}]: only client tools (name, input_schema) are supported")));
            }
            let mut f = json!({"name": t.get("name"), "parameters": t.get("input_schema")});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let kind = choice.and_then(|c| c.get("type")).and_then(Value::as_str);
    let openai_choice = match kind {
        None | Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => json!({"type": "function", "function": {"name": choice.and_then(|c| c.get("name"))}}),
        Some(other) => return Err(Failure::bad(format!("tool_choice type {other:?}: auto, any, tool or none"))),
    };
    let parallel = choice.and_then(|c| c.get("disable_parallel_tool_use")).and_then(Value::as_bool).map(|d| !d);
    Toolbox::new(&tools, Some(&openai_choice), parallel).map_err(Failure::bad)
}

/// The request's `thinking`: whether thinking blocks are sent, and what the chat
/// template is told. `enabled` sends them (its `budget_tokens` checked as Anthropic
/// checks it: at least 1024 and below `max_tokens`; Shoal does not cut the thinking
/// short at the budget, `max_tokens` bounds it); `disabled` asks the template for an
/// answer without thinking (`enable_thinking` false); absent leaves the model as it is.
/// Without `enabled` no thinking block is sent, as Anthropic's API sends none: thinking
/// the model writes anyway is left out of the answer.
fn thinking(v: &Option<Value>, max_tokens: u32) -> Result<(bool, PromptOptions), Failure> {
    let mut options = PromptOptions::default();
    let Some(v) = v.as_ref().filter(|v| !v.is_null()) else { return Ok((false, options)) };
    match v.get("type").and_then(Value::as_str) {
        Some("enabled") => {
            let budget = v.get("budget_tokens").and_then(Value::as_u64);
            match budget {
                Some(b) if b >= 1024 && b < u64::from(max_tokens) => Ok((true, options)),
                Some(_) => Err(Failure::bad("thinking.budget_tokens: at least 1024 and less than max_tokens")),
                None => Err(Failure::bad("thinking.budget_tokens: required, an integer")),
            }
        }
        Some("disabled") => {
            options.enable_thinking = Some(false);
            Ok((false, options))
        }
        _ => Err(Failure::bad("thinking.type: enabled or disabled")),
    }
}

/// `POST /v1/messages`.
pub(crate) async fn messages<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    common::respond(Dialect::Anthropic, body, |body| async move {
        let req: Request = common::parse(&body)?;
        if req.max_tokens == 0 {
            return Err(Failure::bad("max_tokens: must be at least 1"));
        }
        let mut toolbox = toolbox(req.tools.as_deref().unwrap_or_default(), req.tool_choice.as_ref())?;
        let (show_thinking, options) = thinking(&req.thinking, req.max_tokens)?;
        let mut turns = Vec::new();
        if let Some(system) = &req.system {
            turns.push(Turn { role: "system".into(), content: system.text()?, ..Turn::default() });
        }
        for m in &req.messages {
            if m.role != "user" && m.role != "assistant" {
                return Err(Failure::bad(format!("messages: role {:?} (user or assistant)", m.role)));
            }
            turns.extend(m.turns()?);
        }
        if req.messages.is_empty() {
            return Err(Failure::bad("messages: at least one"));
        }
        let model = common::resolve(&*backend, &req.model).await?;
        let model = common::wait_ready(&*backend, model).await?;
        let text = backend.text(&model.entry.name).await?;
        if let Some(t) = toolbox.as_mut() {
            t.speak(text.tool_syntax());
        }
        let prompt = common::off_the_loop(|| {
            tools::prompt(&*text, &turns, toolbox.as_ref(), &options)
                .map(|p| text.tokenize(&p, true))
                .map_err(Failure::bad)
        })?;
        let d = SamplingParams::default();
        let sampling = SamplingParams {
            // Anthropic's default temperature is 1.0; Shoal's, for every API, 0.8.
            temperature: req.temperature.unwrap_or(crate::openai::DEFAULT_TEMPERATURE),
            top_k: req.top_k.unwrap_or(d.top_k),
            top_p: req.top_p.unwrap_or(d.top_p),
            grammar: toolbox.as_ref().and_then(Toolbox::grammar),
            ..d
        };
        let shown = toolbox.as_ref().map(|t| t.shown_markers(&*text)).unwrap_or_default();
        let job = Job {
            model: model.entry.name.clone(),
            text,
            prompt,
            max_tokens: req.max_tokens,
            sampling,
            stop: req.stop_sequences.clone(),
            ignore_eos: false,
            speculative: req.speculative,
            shown,
            // Always apart: thinking is a block of its own or left out.
            split_thinking: true,
        };
        match toolbox {
            Some(toolbox) => answer_with_tools(backend, job, req.model, req.stream, toolbox, show_thinking).await,
            None => answer(backend, job, req.model, req.stream, show_thinking).await,
        }
    })
    .await
}

fn stop_reason(o: &Outcome) -> &'static str {
    match (o.finish, &o.stop_sequence) {
        (Finish::Length, _) => "max_tokens",
        (Finish::Stop, Some(_)) => "stop_sequence",
        (Finish::Stop, None) => "end_turn",
    }
}

/// Run `job` whose answer a [`Toolbox`] grammar holds: read whole, then sent as
/// `tool_use` blocks (stop reason `tool_use`) or one text block; streamed, each block
/// is sent whole (a call's input as one `input_json_delta`).
async fn answer_with_tools<B: Backend>(
    backend: Arc<B>,
    job: Job,
    model: String,
    streamed: bool,
    toolbox: Toolbox,
    show_thinking: bool,
) -> Result<Response, Failure> {
    let prompt_tokens = job.prompt.len();
    let (first, mut events) = gen::start(backend, job).await?;
    let gen::Whole { text, thinking, outcome: o, .. } = gen::collect(first, &mut events).await?;
    let id = common::new_id("msg_");
    let (mut blocks, stop) = match toolbox.read(&text) {
        Reply::Calls(calls) => {
            let blocks = calls
                .iter()
                .map(|c| json!({"type": "tool_use", "id": common::new_id("toolu_"), "name": c.name, "input": c.arguments}))
                .collect();
            (blocks, "tool_use")
        }
        Reply::Text(t) => (vec![json!({"type": "text", "text": t})], stop_reason(&o)),
    };
    if show_thinking && !thinking.is_empty() {
        blocks.insert(0, thinking_block(&thinking));
    }
    if !streamed {
        return Ok(Json(message(&id, &model, Value::Array(blocks), stop, &o)).into_response());
    }
    let mut out = vec![message_start(&id, &model, prompt_tokens)];
    for (index, b) in blocks.into_iter().enumerate() {
        let thought = b["type"] == "thinking";
        let (start, delta) = if b["type"] == "tool_use" {
            let input = b["input"].to_string();
            let mut start = b;
            start["input"] = json!({});
            (start, json!({"type": "input_json_delta", "partial_json": input}))
        } else if thought {
            (thinking_block(""), json!({"type": "thinking_delta", "thinking": b["thinking"]}))
        } else {
            (json!({"type": "text", "text": ""}), json!({"type": "text_delta", "text": b["text"]}))
        };
        out.push(named(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        out.push(named("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta})));
        if thought {
            out.push(signature(index));
        }
        out.push(named("content_block_stop", json!({"type": "content_block_stop", "index": index})));
    }
    out.extend(message_end(stop, &o));
    Ok(Sse::new(stream::iter(out.into_iter().map(Ok::<_, Infallible>))).into_response())
}

/// A thinking block of `text`. Its signature is empty: Anthropic's proves the thinking
/// came from its model, Shoal has nothing to prove it with (and ignores thinking sent back).
fn thinking_block(text: &str) -> Value {
    json!({"type": "thinking", "thinking": text, "signature": ""})
}

/// A thinking block's `signature_delta`, sent before it stops, as Anthropic's stream does.
fn signature(index: usize) -> SseEvent {
    named(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": ""}}),
    )
}

/// A whole message: `content` (its blocks), why it stopped, the usage.
fn message(id: &str, model: &str, content: Value, stop: &str, o: &Outcome) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop, "stop_sequence": o.stop_sequence,
        "usage": {"input_tokens": o.prompt_tokens, "output_tokens": o.completion_tokens}})
}

/// A stream's named event.
fn named(name: &str, v: Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}

/// A stream's first event: the message, empty, with the prompt's tokens.
fn message_start(id: &str, model: &str, prompt_tokens: usize) -> SseEvent {
    named(
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
    )
}

/// A stream's last events: why it stopped, the tokens made, the end.
fn message_end(stop: &str, o: &Outcome) -> [SseEvent; 2] {
    [
        named(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": o.stop_sequence},
                "usage": {"output_tokens": o.completion_tokens}}),
        ),
        named("message_stop", json!({"type": "message_stop"})),
    ]
}

/// Run `job`: the whole message, or its stream of events. The model's thinking (when
/// `show_thinking`) is a thinking block before the text block; streamed, each block
/// starts when its first text comes.
async fn answer<B: Backend>(
    backend: Arc<B>,
    job: Job,
    model: String,
    streamed: bool,
    show_thinking: bool,
) -> Result<Response, Failure> {
    let prompt_tokens = job.prompt.len();
    let (first, mut events) = gen::start(backend, job).await?;
    let id = common::new_id("msg_");
    if !streamed {
        let w = gen::collect(first, &mut events).await?;
        let mut content = vec![json!({"type": "text", "text": w.text})];
        if show_thinking && !w.thinking.is_empty() {
            content.insert(0, thinking_block(&w.thinking));
        }
        return Ok(
            Json(message(&id, &model, Value::Array(content), stop_reason(&w.outcome), &w.outcome)).into_response()
        );
    }
    /// The block a stream has open.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Open {
        None,
        Thinking,
        Text,
    }
    struct St {
        queue: std::collections::VecDeque<SseEvent>,
        pending: Option<Event>,
        events: tokio::sync::mpsc::Receiver<Event>,
        done: bool,
        open: Open,
        /// The open block's index (or the next one's, when none is open).
        index: usize,
    }
    impl St {
        /// Make `kind` the open block: close another one, start this one.
        fn open(&mut self, kind: Open) {
            if self.open == kind {
                return;
            }
            self.close();
            let block = match kind {
                Open::Thinking => thinking_block(""),
                Open::Text | Open::None => json!({"type": "text", "text": ""}),
            };
            self.queue.push_back(named(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.index, "content_block": block}),
            ));
            self.open = kind;
        }

        /// Close the open block, if one is.
        fn close(&mut self) {
            if self.open == Open::None {
                return;
            }
            if self.open == Open::Thinking {
                self.queue.push_back(signature(self.index));
            }
            self.queue
                .push_back(named("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
            self.open = Open::None;
            self.index += 1;
        }
    }
    let st = St {
        queue: std::iter::once(message_start(&id, &model, prompt_tokens)).collect(),
        pending: Some(first),
        events,
        done: false,
        open: Open::None,
        index: 0,
    };
    let out = stream::unfold(st, move |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(e), st));
            }
            if st.done {
                return None;
            }
            let event = match st.pending.take() {
                Some(e) => e,
                None => st.events.recv().await?,
            };
            match event {
                Event::Thinking(t) if show_thinking => {
                    st.open(Open::Thinking);
                    let delta = json!({"type": "content_block_delta", "index": st.index,
                        "delta": {"type": "thinking_delta", "thinking": t}});
                    st.queue.push_back(named("content_block_delta", delta));
                }
                Event::Thinking(_) => {}
                Event::Text(t, _) => {
                    st.open(Open::Text);
                    let delta = json!({"type": "content_block_delta", "index": st.index,
                        "delta": {"type": "text_delta", "text": t}});
                    st.queue.push_back(named("content_block_delta", delta));
                }
                Event::End(o) => {
                    // A message always has its text block, empty or not.
                    st.open(Open::Text);
                    st.close();
                    st.queue.extend(message_end(stop_reason(&o), &o));
                    st.done = true;
                }
                Event::Failed(f) => {
                    st.queue.push_back(named(
                        "error",
                        json!({"type": "error",
                        "error": {"type": "api_error", "message": f.message}}),
                    ));
                    st.done = true;
                }
            }
        }
    });
    Ok(Sse::new(out).keep_alive(common::keep_alive()).into_response())
}
