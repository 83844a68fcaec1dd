//! What the OpenAI and Ollama routes share: naming a model, parsing a body with a clear
//! error, errors in each API's own shape, ids and times.

use crate::backend::{Backend, Failure, FailureKind, ModelInfo, ModelState};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Positions answered when a request gives no limit and the model's context is not
/// known (it is not placed yet).
pub(crate) const DEFAULT_MAX_TOKENS: u32 = 512;

/// Which API's shapes an answer takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"error": "message"}`.
    Ollama,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

/// `failure` as `dialect` answers it, with its status (and `Retry-After` while a model
/// starts).
pub(crate) fn error_response(dialect: Dialect, failure: &Failure) -> Response {
    let status = StatusCode::from_u16(failure.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match dialect {
        Dialect::OpenAi => {
            let (kind, code) = match failure.kind {
                FailureKind::NotFound => ("invalid_request_error", Some("model_not_found")),
                FailureKind::BadRequest => ("invalid_request_error", None),
                FailureKind::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
                FailureKind::Forbidden => ("permission_error", None),
                FailureKind::Busy => ("rate_limit_error", None),
                FailureKind::Loading(_) => ("service_unavailable", Some("model_loading")),
                FailureKind::Unavailable => ("service_unavailable", None),
                FailureKind::Internal => ("server_error", None),
            };
            json!({"error": {"message": failure.message, "type": kind, "param": null, "code": code}})
        }
        Dialect::Ollama => json!({"error": failure.message}),
        Dialect::Anthropic => {
            let kind = match failure.kind {
                FailureKind::BadRequest => "invalid_request_error",
                FailureKind::Unauthorized => "authentication_error",
                FailureKind::Forbidden => "permission_error",
                FailureKind::NotFound => "not_found_error",
                FailureKind::Busy => "rate_limit_error",
                FailureKind::Loading(_) | FailureKind::Unavailable => "overloaded_error",
                FailureKind::Internal => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": failure.message}})
        }
    };
    let mut response = (status, axum::Json(body)).into_response();
    if let FailureKind::Loading(secs) = failure.kind {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// Runs `work` (a chat template's render, a prompt's tokenization: CPU work sized by
/// the request and by a model file's template) where it cannot hold up the tasks of
/// this async worker: on a multi-threaded runtime the worker hands its other tasks on
/// for the while (`block_in_place`), so membership beats, QUIC and other requests go
/// on. A template's own budget (`shoal_engine::template::Budget`) bounds how long.
/// Inline on a single-threaded runtime (tests), which cannot hand tasks on.
pub(crate) fn off_the_loop<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// Parse a JSON body; a malformed one is a 400 that says where and why.
pub(crate) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, Failure> {
    serde_json::from_slice(body).map_err(|e| Failure::bad(format!("invalid request body: {e}")))
}

/// The model a client named: its catalog name, that name with Ollama's `:latest`, or
/// a prefix (8 or more hex digits) of its content hash.
pub(crate) async fn resolve<B: Backend>(backend: &B, name: &str) -> Result<ModelInfo, Failure> {
    let models = backend.models().await;
    let bare = name.strip_suffix(":latest").unwrap_or(name);
    if let Some(m) = models.iter().find(|m| m.entry.name == name || m.entry.name == bare) {
        return Ok(m.clone());
    }
    let hex = name.strip_prefix("sha256:").unwrap_or(name);
    if hex.len() >= 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        let mut found = models.iter().filter(|m| m.entry.content_hash.starts_with(hex));
        if let (Some(m), None) = (found.next(), found.next()) {
            return Ok(m.clone());
        }
    }
    let known: Vec<&str> = models.iter().map(|m| m.entry.name.as_str()).collect();
    Err(Failure::new(
        FailureKind::NotFound,
        if known.is_empty() {
            format!("model '{name}' not found: the cluster's catalog is empty (shoal models add)")
        } else {
            format!("model '{name}' not found; the catalog has: {}", known.join(", "))
        },
    ))
}

/// Wait until `model` answers, before its vocabulary is loaded: a model being placed
/// (again, after a node was lost), whose stages are starting or unreachable from here
/// for a moment (this node's link flapped), or in the catalog but not loaded (this
/// first request loads it, as Ollama does), keeps the request waiting, re-checked
/// with a growing pause up to 1 s, rather than refused. After [`Backend::model_wait`]
/// without the model answering, the request is refused (503, with `Retry-After` while
/// the model is still starting) saying why. Returns the model as it answers now.
pub(crate) async fn wait_ready<B: Backend>(backend: &B, model: ModelInfo) -> Result<ModelInfo, Failure> {
    let waited = tokio::time::Instant::now();
    let bound = backend.model_wait();
    let mut model = model;
    let mut asked_load = false;
    let mut pause = Duration::from_millis(50);
    loop {
        if model.state == ModelState::Ready {
            return Ok(model);
        }
        if model.state == ModelState::Available && !asked_load {
            backend.load(&model.entry.name).await?;
            asked_load = true;
        }
        if waited.elapsed() >= bound {
            let name = &model.entry.name;
            // Whole seconds as such (the product's 120 s), a test's short bound in tenths.
            let secs = if bound.subsec_millis() == 0 {
                format!("{}", bound.as_secs())
            } else {
                format!("{:.1}", bound.as_secs_f64())
            };
            return Err(match &model.state {
                ModelState::Unplaced(why) => Failure::new(
                    FailureKind::Unavailable,
                    format!("model '{name}' cannot be placed now (waited {secs} s): {why}"),
                ),
                ModelState::Available => Failure::new(
                    FailureKind::Loading(10),
                    format!("model '{name}' was not loaded: the cluster is placing it (waited {secs} s)"),
                ),
                _ => Failure::new(
                    FailureKind::Loading(5),
                    format!(
                        "model '{name}' does not answer yet (waited {secs} s): its stages are fetching their \
                         shards, starting, or unreachable from this node"
                    ),
                ),
            });
        }
        tokio::time::sleep(pause.min(bound.saturating_sub(waited.elapsed()))).await;
        pause = (pause * 2).min(Duration::from_secs(1));
        model = resolve(backend, &model.entry.name).await?;
    }
}

/// How many alternatives each token's log-probabilities list, when `asked`
/// (`logprobs: true`) with `top` alternatives (`top_logprobs`, 0 to 20): chat's rule on
/// OpenAI's route and newer Ollama's alike.
pub(crate) fn top_logprobs(asked: bool, top: Option<u32>) -> Result<Option<u32>, Failure> {
    match (asked, top) {
        (false, None) => Ok(None),
        (false, Some(_)) => Err(Failure::bad("top_logprobs needs logprobs: true")),
        (true, Some(n)) if n > shoal_types::MAX_TOP_LOGPROBS => {
            Err(Failure::bad(format!("top_logprobs must be from 0 to {}", shoal_types::MAX_TOP_LOGPROBS)))
        }
        (true, n) => Ok(Some(n.unwrap_or(0))),
    }
}

/// Most tokens to make when the client gives no limit: what the context leaves.
pub(crate) fn default_max_tokens(model: &ModelInfo, prompt_tokens: usize) -> u32 {
    match model.context {
        Some(ctx) => (ctx as usize).saturating_sub(prompt_tokens).max(1) as u32,
        None => DEFAULT_MAX_TOKENS,
    }
}

/// A fresh id: `prefix` and 24 random hex digits.
pub(crate) fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 12];
    // Ids only tell responses apart; a failed draw falls back to the clock.
    if getrandom::getrandom(&mut bytes).is_err() {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        bytes.copy_from_slice(&nanos.to_le_bytes()[..12]);
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}{hex}")
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Now as RFC 3339 with nanoseconds (Ollama's `created_at`).
pub(crate) fn rfc3339_now() -> String {
    humantime::format_rfc3339_nanos(SystemTime::now()).to_string()
}

/// How long a streamed request may take to its first event before its answer starts
/// anyway: fast failures (a bad request, an unknown model, a prompt over the context)
/// keep their status; a slow start (its model being placed again after a fault, its
/// stages starting, a link down) gets a 200 and SSE comments instead of silence, which
/// proxies and clients time out on.
pub(crate) const STREAM_GRACE: Duration = Duration::from_secs(3);

/// How often a started stream that waits for its answer sends an SSE comment.
pub(crate) const WAIT_COMMENT_EVERY: Duration = Duration::from_secs(5);

/// Whether a request body asks for a streamed answer (`"stream": true`); a body that
/// does not parse says no (its handler answers it with a 400).
pub(crate) fn wants_stream(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Flag {
        #[serde(default)]
        stream: bool,
    }
    serde_json::from_slice::<Flag>(body).is_ok_and(|f| f.stream)
}

/// The answer of a generating route: `answer(body)`, a failure turned into the
/// dialect's error response, and for a request that asks for a stream
/// ([`wants_stream`]) one that waits in SSE comments when the answer is slow to start
/// ([`stream_when_slow`]).
pub(crate) async fn respond<F>(
    dialect: Dialect,
    body: axum::body::Bytes,
    answer: impl FnOnce(axum::body::Bytes) -> F,
) -> Response
where
    F: std::future::Future<Output = Result<Response, Failure>> + Send + 'static,
{
    let streamed = wants_stream(&body);
    let answer = answer(body);
    let answer = async move { answer.await.unwrap_or_else(|f| error_response(dialect, &f)) };
    if streamed {
        stream_when_slow(answer, dialect).await
    } else {
        answer.await
    }
}

/// Answer a streamed request with what `answer` gives, if it gives it within
/// [`STREAM_GRACE`]; else start an SSE answer at once that sends a comment (`: waiting
/// for the model`) every [`WAIT_COMMENT_EVERY`] until `answer` is ready, then its
/// events, or, if it failed, its error as the stream's last event (`data: {error}` in
/// OpenAI's shape, `event: error` in Anthropic's). SSE clients ignore comments.
pub(crate) async fn stream_when_slow(
    answer: impl std::future::Future<Output = Response> + Send + 'static,
    dialect: Dialect,
) -> Response {
    use futures_util::StreamExt;
    let mut answer = Box::pin(answer);
    if let Ok(r) = tokio::time::timeout(STREAM_GRACE, &mut answer).await {
        return r;
    }
    enum St {
        Waiting(std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send>>, tokio::time::Interval),
        Body(axum::body::BodyDataStream),
        Done,
    }
    let ticks = tokio::time::interval(WAIT_COMMENT_EVERY);
    let body = futures_util::stream::unfold(St::Waiting(answer, ticks), move |st| async move {
        match st {
            St::Waiting(mut answer, mut ticks) => tokio::select! {
                r = &mut answer => {
                    if r.status().is_success() {
                        let rest = r.into_body().into_data_stream();
                        Some((Ok(axum::body::Bytes::new()), St::Body(rest)))
                    } else {
                        let text = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap_or_default();
                        let text = String::from_utf8_lossy(&text);
                        let event = match dialect {
                            Dialect::Anthropic => format!("event: error\ndata: {text}\n\n"),
                            Dialect::OpenAi | Dialect::Ollama => format!("data: {text}\n\n"),
                        };
                        Some((Ok(axum::body::Bytes::from(event)), St::Done))
                    }
                }
                _ = ticks.tick() => {
                    let comment = axum::body::Bytes::from_static(b": waiting for the model\n\n");
                    Some((Ok(comment), St::Waiting(answer, ticks)))
                }
            },
            St::Body(mut rest) => rest.next().await.map(|chunk| (chunk, St::Body(rest))),
            St::Done => None,
        }
    });
    let mut r = Response::new(axum::body::Body::from_stream(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// SSE comments in a stream that stalls (a fault between two tokens): one after
/// [`WAIT_COMMENT_EVERY`] without an event, so that proxies and clients with read
/// timeouts keep the connection.
pub(crate) fn keep_alive() -> axum::response::sse::KeepAlive {
    axum::response::sse::KeepAlive::new().interval(WAIT_COMMENT_EVERY).text("waiting for the next token")
}
