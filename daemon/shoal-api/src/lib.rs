//! The HTTP API every node serves: OpenAI's routes under `/v1/`, Ollama's at the root
//! (`/api/…`, where Ollama serves them, so its clients work unchanged), and `/health`.
//! It runs over a [`Backend`] the node provides (the catalog, a model's vocabulary,
//! generation wherever the model's stages run): this crate holds no cluster code and
//! never links llama.cpp, so its routes are tested against a fake backend.
//!
//! Invariants: a request never panics the server, whatever its body; an error has
//! its API's own shape and status; a client that goes away cancels its generation.

pub mod backend;
mod common;
mod gen;
mod ollama;
mod openai;

pub use backend::{Backend, ChatMessage, Failure, FailureKind, ModelInfo, ModelState, TextModel};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::future::Future;
use std::sync::Arc;

/// The port the API listens on unless told otherwise: Ollama's, so that tools set up
/// for Ollama (Open WebUI, Home Assistant, Continue) find Shoal where they look.
pub const DEFAULT_PORT: u16 = 11434;

/// Largest request body accepted (a long conversation fits; more is a 413).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Every route, over `backend`.
pub fn router<B: Backend>(backend: Arc<B>) -> Router {
    Router::new()
        .route("/", get(|| async { "Shoal is running\n" }))
        .route("/health", get(health::<B>))
        .route("/v1/models", get(openai::models::<B>))
        .route("/v1/models/{*id}", get(openai::model::<B>))
        .route("/v1/chat/completions", post(openai::chat::<B>))
        .route("/v1/completions", post(openai::completions::<B>))
        .route("/api/version", get(ollama::version))
        .route("/api/tags", get(ollama::tags::<B>))
        .route("/api/ps", get(ollama::ps::<B>))
        .route("/api/show", post(ollama::show::<B>))
        .route("/api/chat", post(ollama::chat::<B>))
        .route("/api/generate", post(ollama::generate::<B>))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(backend)
}

/// Serve the API on `listener` until `shutdown` completes.
pub async fn serve<B: Backend>(
    listener: tokio::net::TcpListener,
    backend: Arc<B>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(backend)).with_graceful_shutdown(shutdown).await
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
