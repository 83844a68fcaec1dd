//! Ollama's routes, at the root as Ollama serves them: `POST /api/chat` and
//! `/api/generate` (NDJSON streams by default, one object with `"stream": false`),
//! `GET /api/tags`, `/api/ps`, `/api/version`, `POST /api/show`, `DELETE /api/delete`,
//! `POST /api/pull` (a GGUF by URL or `hf://`: Ollama's registry is not Shoal's).
//! `keep_alive`: 0 unloads the model (after the answer, or at once in an empty
//! request, Ollama's "unload" call); any other value keeps it loaded, as Shoal keeps
//! every model until it is unloaded.

use crate::backend::{Backend, ChatMessage, Failure, ModelInfo, ModelState, PromptOptions, TextModel, ThinkingSyntax};
use crate::common::{self, error_response, Dialect};
use crate::gen::{self, Event, Job, Outcome};
use crate::grammar::Structured;
use crate::tools::{self, Reply, Toolbox, Turn};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_types::{SamplingParams, TokenId};
use std::convert::Infallible;
use std::sync::Arc;

/// The version `/api/version` reports: Shoal's own.
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Debug, Default, Deserialize)]
struct Options {
    num_predict: Option<i64>,
    temperature: Option<f32>,
    top_k: Option<i32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<Vec<String>>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<i32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    /// Shoal's own: speculative decoding on or off for this request (default: the node's
    /// setting).
    speculative: Option<bool>,
}

impl Options {
    /// The sampling parameters, with `format`'s grammar (if any).
    fn sampling(&self, grammar: Option<String>) -> SamplingParams {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: self.temperature.unwrap_or(crate::openai::DEFAULT_TEMPERATURE),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: self.repeat_last_n.unwrap_or(d.repeat_last_n),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            seed: self.seed.map_or(d.seed, |s| s as u32),
            grammar,
            logprobs: None,
        }
    }

    /// `num_predict`: a count, or -1 (until the context is full) / -2 (fill it).
    fn max_tokens(&self, model: &ModelInfo, prompt: usize) -> Result<u32, Failure> {
        match self.num_predict {
            None | Some(-1) | Some(-2) => Ok(common::default_max_tokens(model, prompt)),
            Some(n) if n > 0 => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
            Some(n) => Err(Failure::bad(format!("num_predict {n}: give a positive count, -1 or -2"))),
        }
    }
}

fn default_stream() -> bool {
    true
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    #[serde(default)]
    messages: Vec<InMessage>,
    #[serde(default = "default_stream")]
    stream: bool,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Options,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    keep_alive: Option<Value>,
    /// Thinking: true, false, or an effort (`low`, `medium`, `high`); the model's way
    /// when absent.
    #[serde(default)]
    think: Option<Value>,
    #[serde(default)]
    logprobs: bool,
    #[serde(default)]
    top_logprobs: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: String,
    #[serde(default)]
    images: Option<Vec<Value>>,
    /// An assistant turn's calls (`[{"function": {"name", "arguments": {…}}}]`).
    #[serde(default)]
    tool_calls: Option<Value>,
    /// The tool a tool turn's result is from.
    #[serde(default)]
    tool_name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct GenerateRequest {
    model: String,
    #[serde(default)]
    prompt: String,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    raw: bool,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default = "default_stream")]
    stream: bool,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Options,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    keep_alive: Option<Value>,
    /// Thinking: true, false, or an effort (`low`, `medium`, `high`); the model's way
    /// when absent.
    #[serde(default)]
    think: Option<Value>,
    #[serde(default)]
    logprobs: bool,
    #[serde(default)]
    top_logprobs: Option<u32>,
}

/// Whether `keep_alive` asks for the model to be unloaded: 0 (seconds), or a zero
/// duration ("0", "0s", "0m"). Negative values and other durations keep it loaded; a
/// value that is neither a number nor a duration is refused.
fn unloads(keep_alive: &Option<Value>) -> Result<bool, Failure> {
    let bad = || Failure::bad("keep_alive: expected seconds or a duration such as \"5m\" (0 unloads, -1 keeps)");
    match keep_alive {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Number(n)) => n.as_f64().map(|n| n == 0.0).ok_or_else(bad),
        Some(Value::String(s)) => {
            let s = s.trim();
            if s.starts_with('-') {
                Ok(false)
            } else if let Ok(n) = s.parse::<f64>() {
                Ok(n == 0.0)
            } else {
                humantime::parse_duration(s).map(|d| d.is_zero()).map_err(|_| bad())
            }
        }
        Some(_) => Err(bad()),
    }
}

/// Refuses a caller that may not administer (a chat key) a request that unloads the
/// model (`keep_alive: 0`) or is empty (a load on its own).
fn refuse_unless(admin: bool, unload: bool, empty: bool) -> Result<(), Failure> {
    match (admin, unload, empty) {
        (false, true, _) => Err(crate::Caller::refused("unload models (keep_alive 0)")),
        (false, _, true) => Err(crate::Caller::refused("load models on their own (an empty request)")),
        _ => Ok(()),
    }
}

/// An empty chat or generate request: load the model (Ollama's way to preload it), or
/// unload it when `keep_alive` is 0; answered at once.
async fn load_or_unload<B: Backend>(
    backend: &B,
    model: &ModelInfo,
    asked: &str,
    unload: bool,
    shape: Shape,
) -> Result<Response, Failure> {
    let reason = if unload {
        if model.state != ModelState::Available {
            backend.unload(&model.entry.name).await?;
        }
        "unload"
    } else {
        if model.state == ModelState::Available {
            backend.load(&model.entry.name).await?;
        }
        "load"
    };
    let mut v = line(shape, asked, "", None);
    v["done"] = json!(true);
    v["done_reason"] = json!(reason);
    Ok(Json(v).into_response())
}

/// The JSON `format` asks for: none, any JSON object (`"json"`), or a JSON schema's.
fn format_json(format: &Option<Value>) -> Result<Option<Structured>, Failure> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(Structured::object())),
        Some(schema @ Value::Object(_)) => {
            Structured::schema(schema).map(Some).map_err(|e| Failure::bad(format!("format: {e}")))
        }
        Some(other) => Err(Failure::bad(format!("format must be \"json\" or a JSON schema, not {other}"))),
    }
}

/// Ollama's `think`: whether it was asked for, and what the chat template is told.
struct Think {
    /// `Some(true)` for true or an effort, `Some(false)` for false, `None` when absent.
    asked: Option<bool>,
    /// `enable_thinking` false for `think: false`; an effort as `reasoning_effort`.
    options: PromptOptions,
}

/// Read `think` as Ollama does: a boolean, or an effort (`high`, `medium`, `low`).
/// Thinking the model writes goes to `thinking` whatever it says (a model that cannot
/// stop thinking still thinks with `false`, as with Ollama).
fn think(v: &Option<Value>) -> Result<Think, Failure> {
    let mut options = PromptOptions::default();
    let asked = match v {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => {
            options.enable_thinking = Some(*b);
            Some(*b)
        }
        Some(Value::String(e)) if matches!(e.as_str(), "high" | "medium" | "low") => {
            options.reasoning_effort = Some(e.clone());
            Some(true)
        }
        Some(other) => {
            return Err(Failure::bad(format!("think: true, false, \"high\", \"medium\" or \"low\", not {other}")))
        }
    };
    Ok(Think { asked, options })
}

impl Think {
    /// The template's variables for `text`'s model (`model` as the client named it):
    /// where `think` is absent and the model thinks, `enable_thinking` true, as Ollama
    /// turns thinking on for a model that can think unless told otherwise. Thinking
    /// asked of a model that cannot think is refused, in Ollama's words.
    fn options(&self, text: &dyn TextModel, model: &str) -> Result<PromptOptions, Failure> {
        let thinks = text.thinking() != ThinkingSyntax::None;
        if self.asked == Some(true) && !thinks {
            return Err(Failure::bad(format!("{model:?} does not support thinking")));
        }
        let mut options = self.options.clone();
        if self.asked.is_none() && thinks {
            options.enable_thinking = Some(true);
        }
        Ok(options)
    }
}

fn refuse_images(images: bool) -> Result<(), Failure> {
    if images {
        return Err(Failure::bad("images are not supported: Shoal serves text models"));
    }
    Ok(())
}

/// `POST /api/chat`.
pub(crate) async fn chat<B: Backend>(
    State(backend): State<Arc<B>>,
    caller: Option<axum::Extension<crate::Caller>>,
    body: Bytes,
) -> Response {
    let admin = crate::Caller::administers(caller.map(|c| c.0));
    let r = async {
        let req: ChatRequest = common::parse(&body)?;
        let images = req.messages.iter().any(|m| m.images.as_ref().is_some_and(|i| !i.is_empty()));
        refuse_images(images)?;
        // Ollama has no tool_choice: the model calls tools or answers.
        let mut toolbox = Toolbox::new(req.tools.as_deref().unwrap_or_default(), None, None).map_err(Failure::bad)?;
        // With tools the model calls them or replies in `format`.
        let grammar = match (format_json(&req.format)?, toolbox.as_mut()) {
            (format, Some(t)) => {
                t.reply_as(format);
                None
            }
            (format, None) => format.map(|f| f.grammar()),
        };
        let scored = common::top_logprobs(req.logprobs, req.top_logprobs)?;
        let unload = unloads(&req.keep_alive)?;
        refuse_unless(admin, unload, req.messages.is_empty())?;
        let think = think(&req.think)?;
        let model = common::resolve(&*backend, &req.model).await?;
        if req.messages.is_empty() {
            return load_or_unload(&*backend, &model, &req.model, unload, Shape::Chat).await;
        }
        let turns = req
            .messages
            .iter()
            .map(|m| {
                let calls = match &m.tool_calls {
                    None | Some(Value::Null) => Vec::new(),
                    Some(c) => tools::calls_of(c).map_err(|e| Failure::bad(format!("messages: {e}")))?,
                };
                let (role, content, tool) = (m.role.clone(), m.content.clone(), m.tool_name.clone());
                Ok(Turn { role, content, calls, call_id: None, tool })
            })
            .collect::<Result<Vec<_>, Failure>>()?;
        let job = job(&*backend, &model, &req.options, grammar, toolbox.as_mut(), scored, |text, toolbox| {
            let options = think.options(text, &req.model)?;
            let prompt = tools::prompt(text, &turns, toolbox, &options).map_err(Failure::bad)?;
            Ok((text.tokenize(&prompt, true), true))
        })
        .await?;
        let then_unload = unload.then(|| model.entry.name.clone());
        if let Some(toolbox) = toolbox {
            return respond_with_tools(backend, job, req.model, req.stream, toolbox, then_unload).await;
        }
        respond(backend, job, req.model, req.stream, Shape::Chat, then_unload).await
    }
    .await;
    r.unwrap_or_else(|f| error_response(Dialect::Ollama, &f))
}

/// `POST /api/generate`: the prompt in the chat template as one user turn (after
/// `system`), or as is with `raw`.
pub(crate) async fn generate<B: Backend>(
    State(backend): State<Arc<B>>,
    caller: Option<axum::Extension<crate::Caller>>,
    body: Bytes,
) -> Response {
    let admin = crate::Caller::administers(caller.map(|c| c.0));
    let r = async {
        let req: GenerateRequest = common::parse(&body)?;
        refuse_images(req.images.as_ref().is_some_and(|i| !i.is_empty()))?;
        let grammar = format_json(&req.format)?.map(|f| f.grammar());
        let scored = common::top_logprobs(req.logprobs, req.top_logprobs)?;
        let unload = unloads(&req.keep_alive)?;
        refuse_unless(admin, unload, req.prompt.is_empty())?;
        let think = think(&req.think)?;
        let model = common::resolve(&*backend, &req.model).await?;
        if req.prompt.is_empty() {
            return load_or_unload(&*backend, &model, &req.model, unload, Shape::Generate).await;
        }
        let (prompt, raw, system) = (req.prompt.clone(), req.raw, req.system.clone());
        let suffix = req.suffix.clone().filter(|s| !s.is_empty());
        let job = job(&*backend, &model, &req.options, grammar, None, scored, |text, _| {
            let options = think.options(text, &req.model)?;
            // The thinking is kept apart only in a templated answer.
            if let Some(suffix) = &suffix {
                // Fill in the middle: the model's own tokens around both texts, no
                // template (as Ollama does for a model with the insert capability).
                return text
                    .fill_in_middle(&prompt, suffix)
                    .map(|tokens| (tokens, false))
                    .ok_or_else(|| Failure::bad(format!("{} does not support insert", req.model)));
            }
            if raw {
                return Ok((text.tokenize(&prompt, false), false));
            }
            let mut messages = Vec::new();
            if let Some(s) = system.filter(|s| !s.is_empty()) {
                messages.push(ChatMessage { role: "system".into(), content: s });
            }
            messages.push(ChatMessage { role: "user".into(), content: prompt.clone() });
            let templated = text.chat_prompt_as(&messages, &options).map_err(Failure::bad)?;
            Ok((text.tokenize(&templated, true), true))
        })
        .await?;
        let then_unload = unload.then(|| model.entry.name.clone());
        respond(backend, job, req.model, req.stream, Shape::Generate, then_unload).await
    }
    .await;
    r.unwrap_or_else(|f| error_response(Dialect::Ollama, &f))
}

/// The job of a request: the model ready, its vocabulary, the prompt's tokens (by
/// `tokens`, told the tools the model may call; with whether the thinking is kept
/// apart), the sampling and length the options say.
async fn job<B: Backend>(
    backend: &B,
    model: &ModelInfo,
    options: &Options,
    grammar: Option<String>,
    toolbox: Option<&mut Toolbox>,
    logprobs: Option<u32>,
    tokens: impl FnOnce(&dyn TextModel, Option<&Toolbox>) -> Result<(Vec<TokenId>, bool), Failure>,
) -> Result<Job, Failure> {
    let ready = common::wait_ready(backend, model.clone()).await?;
    let model = &ready;
    let text = backend.text(&model.entry.name).await?;
    // A toolbox's grammar depends on the model's tool syntax.
    let mut grammar = grammar;
    let toolbox = toolbox.map(|t| {
        t.speak(text.tool_syntax());
        grammar = t.grammar();
        &*t
    });
    if logprobs.is_some() && toolbox.is_some_and(|t| !t.replies_verbatim()) {
        return Err(Failure::bad(crate::openai::LOGPROBS_IN_GENERIC_FORMAT));
    }
    let (prompt, split_thinking) = common::off_the_loop(|| tokens(&*text, toolbox))?;
    let shown = toolbox.map(|t| t.shown_markers(&*text)).unwrap_or_default();
    Ok(Job {
        model: model.entry.name.clone(),
        text,
        max_tokens: options.max_tokens(model, prompt.len())?,
        prompt,
        sampling: SamplingParams { logprobs, ..options.sampling(grammar) },
        stop: options.stop.clone().unwrap_or_default(),
        ignore_eos: false,
        speculative: options.speculative,
        shown,
        split_thinking,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Chat,
    Generate,
}

/// One line of the answer: `text` so far (`done: false`), or the end with counts and
/// nanosecond timings.
fn line(shape: Shape, model: &str, text: &str, end: Option<&Outcome>) -> Value {
    let mut v = match shape {
        Shape::Chat => json!({"model": model, "created_at": common::rfc3339_now(),
            "message": {"role": "assistant", "content": text}, "done": end.is_some()}),
        Shape::Generate => {
            json!({"model": model, "created_at": common::rfc3339_now(), "response": text, "done": end.is_some()})
        }
    };
    if let Some(o) = end {
        v["done_reason"] = json!(o.finish.as_str());
        v["total_duration"] = json!(o.total.as_nanos() as u64);
        v["load_duration"] = json!(0);
        v["prompt_eval_count"] = json!(o.prompt_tokens);
        v["prompt_eval_duration"] = json!(o.prefill.as_nanos() as u64);
        v["eval_count"] = json!(o.completion_tokens);
        v["eval_duration"] = json!(o.decode.as_nanos() as u64);
    }
    v
}

/// `v`, a line of `shape`, with the model's `thinking` (`message.thinking` in chat,
/// `thinking` in generate) when there is some.
fn with_thinking(mut v: Value, shape: Shape, thinking: &str) -> Value {
    if !thinking.is_empty() {
        match shape {
            Shape::Chat => v["message"]["thinking"] = json!(thinking),
            Shape::Generate => v["thinking"] = json!(thinking),
        }
    }
    v
}

/// Answer `job` as one object or an NDJSON stream; then unload `then_unload` (a
/// catalog name) if given (`keep_alive: 0`), however the answer ends: done, failed,
/// or the client gone.
async fn respond<B: Backend>(
    backend: Arc<B>,
    job: Job,
    model: String,
    streamed: bool,
    shape: Shape,
    then_unload: Option<String>,
) -> Result<Response, Failure> {
    let guard = UnloadOnDrop(then_unload.map(|name| (backend.clone(), name)));
    let scored = job.sampling.logprobs.is_some();
    // Each line's tokens' log-probabilities, when asked for.
    let with = move |mut v: Value, lp: &[gen::Logprob]| {
        if scored {
            v["logprobs"] = Value::Array(crate::openai::token_entries(lp));
        }
        v
    };
    let (first, mut events) = gen::start(backend, job).await?;
    if !streamed {
        let w = gen::collect(first, &mut events).await?;
        let v = with_thinking(line(shape, &model, &w.text, Some(&w.outcome)), shape, &w.thinking);
        return Ok(Json(with(v, &w.logprobs)).into_response());
    }
    // NDJSON: one object a line; after text went out, a failure is an `error` line.
    let lines = stream::unfold((Some(first), events, false, guard), move |(pending, mut events, done, guard)| {
        let model = model.clone();
        async move {
            if done {
                return None;
            }
            let event = match pending {
                Some(e) => e,
                None => events.recv().await?,
            };
            let (v, done) = match event {
                Event::Text(t, lp) => (with(line(shape, &model, &t, None), &lp), false),
                Event::Thinking(t) => (with_thinking(line(shape, &model, "", None), shape, &t), false),
                Event::End(o) => (line(shape, &model, "", Some(&o)), true),
                Event::Failed(f) => (json!({"error": f.message}), true),
            };
            Some((Ok::<_, Infallible>(format!("{v}\n")), (None, events, done, guard)))
        }
    });
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response())
}

/// Answer a chat `job` whose answer a [`Toolbox`] grammar holds: read whole, then
/// sent as a message with `tool_calls` (Ollama's shape: arguments as an object; no
/// `logprobs`) or with the reply's text (and, when asked for, its tokens' `logprobs`);
/// streamed, that message is one line before the end line.
async fn respond_with_tools<B: Backend>(
    backend: Arc<B>,
    job: Job,
    model: String,
    streamed: bool,
    toolbox: Toolbox,
    then_unload: Option<String>,
) -> Result<Response, Failure> {
    let _guard = UnloadOnDrop(then_unload.map(|name| (backend.clone(), name)));
    let scored = job.sampling.logprobs.is_some();
    let (first, mut events) = gen::start(backend, job).await?;
    let gen::Whole { text, thinking, logprobs: entries, outcome: o } = gen::collect(first, &mut events).await?;
    let mut logprobs = None;
    let message = match toolbox.read(&text) {
        Reply::Calls(calls) => {
            let calls: Vec<Value> =
                calls.iter().map(|c| json!({"function": {"name": c.name, "arguments": c.arguments}})).collect();
            json!({"role": "assistant", "content": "", "tool_calls": calls})
        }
        Reply::Text(t) => {
            // The reply's own tokens (`job` refused logprobs where they cannot be told).
            if let Some(span) = toolbox.reply_span(&text, &t).filter(|_| scored) {
                let within = gen::logprobs_within(&entries, text.len(), span);
                logprobs = Some(Value::Array(crate::openai::token_entries(within)));
            }
            json!({"role": "assistant", "content": t})
        }
    };
    let mut message = message;
    if !thinking.is_empty() {
        message["thinking"] = json!(thinking);
    }
    let mut end = line(Shape::Chat, &model, "", Some(&o));
    if !streamed {
        end["message"] = message;
        if let Some(lp) = logprobs {
            end["logprobs"] = lp;
        }
        return Ok(Json(end).into_response());
    }
    let mut said = line(Shape::Chat, &model, "", None);
    said["message"] = message;
    if let Some(lp) = logprobs {
        said["logprobs"] = lp;
    }
    let body = format!("{said}\n{end}\n");
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
}

/// Unloads a model when dropped: what `keep_alive: 0` asks once the answer is over.
struct UnloadOnDrop<B: Backend>(Option<(Arc<B>, String)>);

impl<B: Backend> Drop for UnloadOnDrop<B> {
    fn drop(&mut self) {
        let Some((backend, name)) = self.0.take() else { return };
        // Dropped inside the server's runtime (a route or its body stream).
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = backend.unload(&name).await {
                    tracing::warn!(model = %name, "keep_alive 0: the unload failed: {}", e.message);
                }
            });
        }
    }
}

/// `DELETE /api/delete`: the model leaves the catalog (unloaded first if it runs); its
/// file stays on disk. 200 with an empty body, as Ollama answers.
pub(crate) async fn delete<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    let r = async {
        let req: ShowRequest = common::parse(&body)?;
        let m = common::resolve(&*backend, &req.model).await?;
        backend.remove(&m.entry.name).await?;
        Ok::<_, Failure>(axum::http::StatusCode::OK.into_response())
    }
    .await;
    r.unwrap_or_else(|f| error_response(Dialect::Ollama, &f))
}

#[derive(Deserialize)]
struct PullRequest {
    #[serde(alias = "name")]
    model: String,
    #[serde(default = "default_stream")]
    stream: bool,
}

/// `POST /api/pull`: download a GGUF by URL (`https://…/model.gguf`) or
/// `hf://org/repo/file.gguf` to this node and add it to the catalog, with Ollama's
/// status lines (`pulling manifest`, then `downloading` with `total`/`completed`, then
/// `success`), or one object when `"stream": false`. Registry names (`llama3.2`) are
/// refused with where to get the file instead.
pub(crate) async fn pull<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    let req = match common::parse::<PullRequest>(&body) {
        Ok(r) => r,
        Err(f) => return error_response(Dialect::Ollama, &f),
    };
    let source = req.model.trim().to_string();
    let is_url = ["http://", "https://", "hf://"].iter().any(|p| source.starts_with(p));
    if !is_url {
        let f = Failure::bad(format!(
            "{source:?}: Shoal pulls a GGUF file by URL (https://…/model.gguf) or hf://org/repo/file.gguf; \
             Ollama's registry names are not Shoal's (a model already in Ollama's store: \
             `shoal models import --from ollama`)"
        ));
        return error_response(Dialect::Ollama, &f);
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let job = {
        let backend = backend.clone();
        let source = source.clone();
        tokio::spawn(async move { backend.pull(&source, tx).await })
    };
    if !req.stream {
        while rx.recv().await.is_some() {}
        return match job.await {
            Ok(Ok(_)) => Json(json!({"status": "success"})).into_response(),
            Ok(Err(f)) => error_response(Dialect::Ollama, &f),
            Err(_) => error_response(Dialect::Ollama, &Failure::new(crate::FailureKind::Internal, "the pull vanished")),
        };
    }
    // Progress lines at most every 1% (or when the size is unknown, every 8 MiB).
    let lines = pull_lines(source, rx, job);
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response()
}

/// The NDJSON lines of a streamed pull: the start, progress, then success or an error.
fn pull_lines(
    source: String,
    rx: tokio::sync::mpsc::UnboundedReceiver<crate::PullProgress>,
    job: tokio::task::JoinHandle<Result<String, Failure>>,
) -> impl futures_util::Stream<Item = Result<String, Infallible>> {
    enum Phase {
        Start,
        Progress,
        Done,
    }
    let state = (Phase::Start, rx, Some(job), 0u64, source);
    stream::unfold(state, |(phase, mut rx, job, last, source)| async move {
        match phase {
            Phase::Start => {
                let line = json!({"status": "pulling manifest"});
                Some((Ok(format!("{line}\n")), (Phase::Progress, rx, job, last, source)))
            }
            Phase::Progress => loop {
                let Some(p) = rx.recv().await else {
                    // The pull is over (its sender dropped): its outcome is the last line.
                    let vanished = || Failure::new(crate::FailureKind::Internal, "the pull vanished");
                    let outcome = match job {
                        Some(j) => j.await.unwrap_or_else(|_| Err(vanished())),
                        None => Err(vanished()),
                    };
                    let line = match outcome {
                        Ok(name) => json!({"status": "success", "model": name}),
                        Err(f) => json!({"error": f.message}),
                    };
                    return Some((Ok(format!("{line}\n")), (Phase::Done, rx, None, last, source)));
                };
                let step = p.total.map_or(8 << 20, |t| (t / 100).max(1));
                if p.completed >= last + step || p.total == Some(p.completed) {
                    let line = json!({"status": format!("downloading {source}"), "digest": source,
                        "total": p.total, "completed": p.completed});
                    return Some((Ok(format!("{line}\n")), (Phase::Progress, rx, job, p.completed, source)));
                }
            },
            Phase::Done => None,
        }
    })
}

/// `GET /api/version`.
pub(crate) async fn version() -> Response {
    Json(json!({"version": VERSION})).into_response()
}

fn details(m: &ModelInfo) -> Value {
    json!({"parent_model": "", "format": "gguf", "family": m.entry.arch, "families": [m.entry.arch],
        "parameter_size": "", "quantization_level": m.entry.quantisation})
}

/// `GET /api/tags`: the catalog.
pub(crate) async fn tags<B: Backend>(State(backend): State<Arc<B>>) -> Response {
    let models: Vec<Value> = backend
        .models()
        .await
        .iter()
        .map(|m| {
            json!({"name": m.entry.name, "model": m.entry.name, "modified_at": "1970-01-01T00:00:00Z",
                "size": m.entry.size, "digest": m.entry.content_hash, "details": details(m)})
        })
        .collect();
    Json(json!({"models": models})).into_response()
}

/// `GET /api/ps`: the models that run.
pub(crate) async fn ps<B: Backend>(State(backend): State<Arc<B>>) -> Response {
    let models: Vec<Value> = backend
        .models()
        .await
        .iter()
        .filter(|m| m.state == ModelState::Ready || m.state == ModelState::Starting)
        .map(|m| {
            json!({"name": m.entry.name, "model": m.entry.name, "size": m.entry.size,
                "digest": m.entry.content_hash, "details": details(m), "expires_at": "2318-01-01T00:00:00Z",
                "size_vram": 0, "context_length": m.context})
        })
        .collect();
    Json(json!({"models": models})).into_response()
}

#[derive(Deserialize)]
struct ShowRequest {
    #[serde(alias = "name")]
    model: String,
}

/// `POST /api/show`.
pub(crate) async fn show<B: Backend>(State(backend): State<Arc<B>>, body: Bytes) -> Response {
    let r = async {
        let req: ShowRequest = common::parse(&body)?;
        let m = common::resolve(&*backend, &req.model).await?;
        let ctx = m.context.unwrap_or(m.entry.context_length);
        let arch = &m.entry.arch;
        let mut capabilities = vec!["completion"];
        // Its vocabulary says whether it fills in (a node reads it without the weights);
        // any model with a chat template calls tools (Shoal's generic tool format).
        if let Ok(t) = backend.text(&m.entry.name).await {
            if t.fill_in_middle("", "").is_some() {
                capabilities.push("insert");
            }
            let hi = [ChatMessage { role: "user".into(), content: "Hi".into() }];
            if common::off_the_loop(|| t.chat_prompt(&hi)).is_ok() {
                capabilities.push("tools");
            }
            if t.thinking() != ThinkingSyntax::None {
                capabilities.push("thinking");
            }
        }
        Ok::<_, Failure>(
            Json(json!({
                "parameters": format!("num_ctx {ctx}"),
                "template": "",
                "details": details(&m),
                "model_info": {
                    "general.architecture": arch,
                    format!("{arch}.block_count"): m.entry.n_layer,
                    format!("{arch}.context_length"): m.entry.context_length,
                },
                "capabilities": capabilities,
                "modified_at": "1970-01-01T00:00:00Z",
            }))
            .into_response(),
        )
    }
    .await;
    r.unwrap_or_else(|f| error_response(Dialect::Ollama, &f))
}
