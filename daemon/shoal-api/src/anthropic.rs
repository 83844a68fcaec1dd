//! Anthropic's Messages route, `POST /v1/messages`, for clients that speak it: the
//! whole message, or its stream of named events (`message_start`,
//! `content_block_start`, `content_block_delta`…, `message_delta`, `message_stop`).

use crate::backend::{Backend, ChatMessage, Failure};
use crate::common::{self, error_response, Dialect};
use crate::gen::{self, Event, Finish, Job, Outcome};
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

/// `POST /v1/messages`.
pub(crate) async fn messages<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    let r = async {
        let req: Request = common::parse(&body)?;
        if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(Failure::bad("tools are not supported yet"));
        }
        if req.max_tokens == 0 {
            return Err(Failure::bad("max_tokens: must be at least 1"));
        }
        let mut turns = Vec::new();
        if let Some(system) = &req.system {
            turns.push(ChatMessage { role: "system".into(), content: system.text()? });
        }
        for m in &req.messages {
            if m.role != "user" && m.role != "assistant" {
                return Err(Failure::bad(format!("messages: role {:?} (user or assistant)", m.role)));
            }
            turns.push(ChatMessage { role: m.role.clone(), content: m.content.text()? });
        }
        if req.messages.is_empty() {
            return Err(Failure::bad("messages: at least one"));
        }
        let model = common::resolve(&*backend, &req.model).await?;
        common::ready_or_failure(&*backend, &model).await?;
        let text = backend.text(&model.entry.name).await?;
        let prompt = text.tokenize(&text.chat_prompt(&turns).map_err(Failure::bad)?, true);
        let d = SamplingParams::default();
        let sampling = SamplingParams {
            // Anthropic's default temperature is 1.0; Shoal's, for every API, 0.8.
            temperature: req.temperature.unwrap_or(crate::openai::DEFAULT_TEMPERATURE),
            top_k: req.top_k.unwrap_or(d.top_k),
            top_p: req.top_p.unwrap_or(d.top_p),
            ..d
        };
        let job = Job {
            model: model.entry.name.clone(),
            text,
            prompt,
            max_tokens: req.max_tokens,
            sampling,
            stop: req.stop_sequences.clone(),
            ignore_eos: false,
        };
        answer(backend, job, req.model, req.stream).await
    }
    .await;
    r.unwrap_or_else(|f| error_response(Dialect::Anthropic, &f))
}

fn stop_reason(o: &Outcome) -> &'static str {
    match (o.finish, &o.stop_sequence) {
        (Finish::Length, _) => "max_tokens",
        (Finish::Stop, Some(_)) => "stop_sequence",
        (Finish::Stop, None) => "end_turn",
    }
}

async fn answer<B: Backend>(backend: Arc<B>, job: Job, model: String, streamed: bool) -> Result<Response, Failure> {
    let prompt_tokens = job.prompt.len();
    let (first, mut events) = gen::start(backend, job).await?;
    let id = common::new_id("msg_");
    if !streamed {
        let (text, outcome) = gen::collect(first, &mut events).await?;
        return Ok(Json(json!({"id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason(&outcome),
            "stop_sequence": outcome.stop_sequence,
            "usage": {"input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens}}))
        .into_response());
    }
    let named = |name: &str, v: Value| SseEvent::default().event(name).data(v.to_string());
    let opening = vec![
        named(
            "message_start",
            json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
                "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
        ),
        named(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ),
    ];
    let st = (opening.into_iter().collect::<std::collections::VecDeque<_>>(), Some(first), events, false);
    let out = stream::unfold(st, move |(mut queue, mut pending, mut events, mut done)| async move {
        loop {
            if let Some(e) = queue.pop_front() {
                return Some((Ok::<_, Infallible>(e), (queue, pending, events, done)));
            }
            if done {
                return None;
            }
            let event = match pending.take() {
                Some(e) => e,
                None => events.recv().await?,
            };
            match event {
                Event::Text(t, _) => queue.push_back(named(
                    "content_block_delta",
                    json!({"type": "content_block_delta",
                    "index": 0, "delta": {"type": "text_delta", "text": t}}),
                )),
                Event::End(o) => {
                    queue.push_back(named("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                    queue.push_back(named(
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(&o), "stop_sequence": o.stop_sequence},
                        "usage": {"output_tokens": o.completion_tokens}}),
                    ));
                    queue.push_back(named("message_stop", json!({"type": "message_stop"})));
                    done = true;
                }
                Event::Failed(f) => {
                    queue.push_back(named(
                        "error",
                        json!({"type": "error",
                        "error": {"type": "api_error", "message": f.message}}),
                    ));
                    done = true;
                }
            }
        }
    });
    Ok(Sse::new(out).into_response())
}
