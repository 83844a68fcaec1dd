//! The HTTP API every node serves: OpenAI's routes under `/v1/`, Anthropic's
//! `/v1/messages`, Ollama's at the root (`/api/…`, where Ollama serves them, so its
//! clients work unchanged), and `/health`.
//! It runs over a [`Backend`] the node provides (the catalog, a model's vocabulary,
//! generation wherever the model's stages run): this crate holds no cluster code and
//! never links llama.cpp, so its routes are tested against a fake backend.
//!
//! Invariants: a request never panics the server, whatever its body; an error has
//! its API's own shape and status; a client that goes away cancels its generation.

mod anthropic;
pub mod backend;
mod metrics;
pub use metrics::Metrics;
mod common;
mod gen;
mod ollama;
mod openai;
mod serve;
pub use serve::{serve_router, Limits};

pub use backend::{Backend, ChatMessage, Failure, FailureKind, ModelInfo, ModelState, TextModel};

use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::Dialect;
use serde_json::json;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

/// The port the API listens on unless told otherwise: Ollama's, so that tools set up
/// for Ollama (Open WebUI, Home Assistant, Continue) find Shoal where they look.
pub const DEFAULT_PORT: u16 = 11434;

/// Largest request body accepted (a long conversation fits; more is a 413).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Who may call the API without a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// Requests from this machine (loopback) need no key.
    pub loopback_free: bool,
    /// No request needs a key (a LAN whose every machine is trusted).
    pub open: bool,
}

impl Default for Access {
    /// Keys for every other machine; none for this one.
    fn default() -> Access {
        Access { loopback_free: true, open: false }
    }
}

/// Every route, over `backend`, with keys checked as `access` says.
pub fn router<B: Backend>(backend: Arc<B>, access: Access) -> Router {
    Router::new()
        .route("/", get(|| async { "Shoal is running\n" }))
        .route("/health", get(health::<B>))
        .route("/metrics", get(metrics::<B>))
        .route("/v1/models", get(openai::models::<B>))
        .route("/v1/models/{*id}", get(openai::model::<B>))
        .route("/v1/chat/completions", post(openai::chat::<B>))
        .route("/v1/completions", post(openai::completions::<B>))
        .route("/v1/messages", post(anthropic::messages::<B>))
        .route("/api/version", get(ollama::version))
        .route("/api/tags", get(ollama::tags::<B>))
        .route("/api/ps", get(ollama::ps::<B>))
        .route("/api/show", post(ollama::show::<B>))
        .route("/api/chat", post(ollama::chat::<B>))
        .route("/api/generate", post(ollama::generate::<B>))
        .layer(axum::middleware::from_fn_with_state((backend.clone(), access), auth::<B>))
        .layer(axum::middleware::from_fn_with_state(backend.clone(), count::<B>))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(backend)
}

/// Count each answered request by its route (the pattern, not the path: model ids
/// would make unbounded labels) and status.
async fn count<B: Backend>(State(backend): State<Arc<B>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("other", |p| p.as_str()).to_string();
    let response = next.run(req).await;
    backend.metrics().request(&route, response.status().as_u16());
    response
}

/// `GET /metrics`.
async fn metrics<B: Backend>(State(backend): State<Arc<B>>) -> Response {
    let extra = backend.node_metrics().await;
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], backend.metrics().render(&extra)).into_response()
}

/// Let a request through when `access` allows it without a key, or with one of the
/// cluster's keys (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`); else
/// 401 in the shape of the route's API. The key is never logged.
async fn auth<B: Backend>(
    State((backend, access)): State<(Arc<B>, Access)>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let loopback = serve::is_loopback(peer.ip());
    if access.open || (access.loopback_free && loopback) || req.uri().path() == "/" {
        return next.run(req).await;
    }
    let headers = req.headers();
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    if presented.is_some_and(|k| backend.authorized(k)) {
        return next.run(req).await;
    }
    let message = if presented.is_some() {
        "invalid API key (make one with `shoal keys create NAME` on a node)"
    } else {
        "an API key is needed from other machines: send `Authorization: Bearer KEY` (`shoal keys create NAME`)"
    };
    let dialect = match req.uri().path() {
        "/v1/messages" => Dialect::Anthropic,
        p if p.starts_with("/v1/") => Dialect::OpenAi,
        _ => Dialect::Ollama,
    };
    common::error_response(dialect, &Failure::new(FailureKind::Unauthorized, message))
}

/// Serve the API on `listener` until `shutdown` completes, within the default
/// [`Limits`].
pub async fn serve<B: Backend>(
    listener: tokio::net::TcpListener,
    backend: Arc<B>,
    access: Access,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_router(listener, router(backend, access), Limits::default(), shutdown).await
}

/// `GET /health`: 200 when a model answers, 503 while none does (loading, or none
/// loaded), with the models' states either way.
async fn health<B: Backend>(State(backend): State<Arc<B>>) -> Response {
    let models = backend.models().await;
    let state = |m: &ModelInfo| match &m.state {
        ModelState::Available => "available".to_string(),
        ModelState::Starting => "loading".to_string(),
        ModelState::Ready => "ready".to_string(),
        ModelState::Unplaced(why) => format!("unplaced: {why}"),
    };
    let ready = models.iter().any(|m| m.state == ModelState::Ready);
    let list: serde_json::Map<String, serde_json::Value> =
        models.iter().map(|m| (m.entry.name.clone(), json!(state(m)))).collect();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"status": if ready { "ready" } else { "no model ready" }, "models": list}))).into_response()
}
