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
pub use metrics::{Metrics, Snapshot};
mod common;
mod gen;
pub mod grammar;
mod ollama;
mod openai;
mod serve;
mod thinking;
mod tools;
pub use serve::{is_loopback, machine, serve_router, Limits};

pub use backend::{
    Backend, ChatMessage, Failure, FailureKind, ModelInfo, ModelState, PromptOptions, PullProgress, Sampled, TextModel,
    ThinkingSyntax, ToolSyntax, MODEL_WAIT,
};

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

/// Who may call the API without a key, and which web pages may call it from a browser.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// Requests from this machine (loopback) need no key, unless a web page sent them
    /// (see [`local_caller`]).
    pub loopback_free: bool,
    /// No request needs a key (a LAN whose every machine is trusted).
    pub open: bool,
    /// Web origins (`http://host:port`, or `*`) whose pages may call the API from a
    /// browser (CORS). Empty: none, the default; a page on this machine's own
    /// addresses (`localhost`) needs no entry to be let in without a key, but still
    /// one to read answers across origins.
    pub cors_origins: Vec<String>,
    /// `/api/pull` may download from loopback, LAN and other non-public addresses (a
    /// model server on the LAN: `shoal serve --allow-private-downloads`); else from
    /// public ones only, whatever a URL's name resolves to, redirects included.
    pub private_downloads: bool,
}

impl Default for Access {
    /// Keys for every other machine; none for this one; no CORS.
    fn default() -> Access {
        Access { loopback_free: true, open: false, cors_origins: Vec::new(), private_downloads: false }
    }
}

/// Every route, over `backend`, with keys checked as `access` says.
pub fn router<B: Backend>(backend: Arc<B>, access: Access) -> Router {
    Router::new()
        .route("/", get(root))
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
        .route("/api/delete", axum::routing::delete(ollama::delete::<B>))
        .route("/api/pull", post(ollama::pull::<B>))
        .route("/api/chat", post(ollama::chat::<B>))
        .route("/api/generate", post(ollama::generate::<B>))
        .layer(axum::middleware::from_fn_with_state((backend.clone(), access.clone()), auth::<B>))
        .layer(axum::middleware::from_fn_with_state(backend.clone(), count::<B>))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        // Outermost: a browser's preflight (OPTIONS, no key) is answered here.
        .layer(cors(&access.cors_origins))
        .with_state(backend)
}

/// `GET /`: a browser goes to the admin page; tools that probe the server (as they
/// probe Ollama's) get a line of text.
async fn root(headers: header::HeaderMap) -> Response {
    let browser = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|a| a.contains("text/html"));
    if browser {
        return axum::response::Redirect::to("/admin/").into_response();
    }
    "Shoal is running\n".into_response()
}

/// OpenAI's model list and chat route alone, with no key check and no CORS: for a
/// caller that checks access itself (the admin page's chat, behind its login).
pub fn chat_routes<B: Backend>(backend: Arc<B>) -> Router {
    Router::new()
        .route("/v1/models", get(openai::models::<B>))
        .route("/v1/chat/completions", post(openai::chat::<B>))
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

/// Who a request comes from, as the key check found; routes that change what the
/// cluster holds (`/api/pull`, `/api/delete`, loading or unloading on its own) ask
/// [`Caller::administers`]. Absent (the admin page's chat routes, behind its login):
/// the owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// This machine's own tools, or anyone where the owner opened the API.
    Owner,
    /// A client with one of the cluster's API keys, of this scope.
    Key(shoal_types::KeyScope),
}

impl Caller {
    /// Whether it may change what the cluster holds.
    pub fn administers(caller: Option<Caller>) -> bool {
        !matches!(caller, Some(Caller::Key(shoal_types::KeyScope::Chat)))
    }

    /// The refusal for a chat key asking for `what`.
    pub(crate) fn refused(what: &str) -> Failure {
        Failure::new(
            FailureKind::Forbidden,
            format!(
                "this API key may chat and list models, not {what}: use an admin key (`shoal keys create NAME --admin`) \
                 or this machine's own tools"
            ),
        )
    }
}

/// Routes that change what the cluster holds, whatever their body says.
const ADMIN_ROUTES: &[&str] = &["/api/pull", "/api/delete"];

/// Let a request through when `access` allows it without a key, or with one of the
/// cluster's keys (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`); else
/// 401 in the shape of the route's API. The key is never logged. What it found goes
/// into the request as a [`Caller`]. Where no key is needed because the owner opened
/// the API, a request that changes something (any but GET) from a web page of another
/// site is refused (a page can make a browser send a "simple" POST anywhere); and
/// [`ADMIN_ROUTES`] take JSON only (a form or text body is what such a page sends).
async fn auth<B: Backend>(
    State((backend, access)): State<(Arc<B>, Access)>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let dialect = match req.uri().path() {
        "/v1/messages" => Dialect::Anthropic,
        p if p.starts_with("/v1/") => Dialect::OpenAi,
        _ => Dialect::Ollama,
    };
    let admin_route = ADMIN_ROUTES.contains(&req.uri().path());
    if admin_route && !json_body(req.headers()) {
        let why = "send the body as JSON (Content-Type: application/json)";
        return common::error_response(dialect, &Failure::new(FailureKind::BadRequest, why));
    }
    let loopback = serve::is_loopback(peer.ip());
    let local = access.loopback_free && loopback && local_caller(req.headers(), &access.cors_origins);
    let caller = if local || req.uri().path() == "/" {
        Some(Caller::Owner)
    } else if access.open || backend.open() {
        let changes = !matches!(*req.method(), axum::http::Method::GET | axum::http::Method::HEAD);
        if changes && !origin_allowed(req.headers(), &access.cors_origins) {
            let why = "a web page of another site may not change anything here (its Origin is not this node's nor a --cors-origin)";
            return common::error_response(dialect, &Failure::new(FailureKind::Forbidden, why));
        }
        Some(Caller::Owner)
    } else {
        let headers = req.headers();
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        match presented.and_then(|k| backend.key_scope(k)) {
            Some(scope) => Some(Caller::Key(scope)),
            None => {
                let message = if presented.is_some() {
                    "invalid API key (make one with `shoal keys create NAME` on a node)"
                } else {
                    "an API key is needed from other machines: send `Authorization: Bearer KEY` (`shoal keys create NAME`)"
                };
                return common::error_response(dialect, &Failure::new(FailureKind::Unauthorized, message));
            }
        }
    };
    if admin_route && !Caller::administers(caller) {
        let what = if req.uri().path() == "/api/pull" { "pull models" } else { "delete models" };
        return common::error_response(dialect, &Caller::refused(what));
    }
    if let Some(c) = caller {
        req.extensions_mut().insert(c);
    }
    next.run(req).await
}

/// Whether the request says its body is JSON (`application/json`, parameters aside).
fn json_body(headers: &header::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")))
}

/// Whether a request's `Origin`, if any, is this machine, the node itself (the same
/// host and port as the request's `Host`: a page it served), or one listed for CORS.
fn origin_allowed(headers: &header::HeaderMap, cors_origins: &[String]) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else { return true };
    let Ok(origin) = origin.to_str() else { return false };
    if cors_origins.iter().any(|c| c == origin || c == "*") {
        return true;
    }
    let Some((scheme, rest)) = origin.split_once("://") else { return false };
    let authority = rest.trim_end_matches('/');
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    matches!(scheme, "http" | "https")
        && (is_this_machine(&host_of(authority)) || host.is_some_and(|h| h.eq_ignore_ascii_case(authority)))
}

/// The CORS layer: the listed origins (or any, for `*`) may call every route from a
/// browser, with the headers clients send (auth, JSON); none when the list is empty.
fn cors(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let layer = CorsLayer::new()
        .allow_methods([axum::http::Method::GET, axum::http::Method::POST, axum::http::Method::DELETE])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, header::HeaderName::from_static("x-api-key")])
        .max_age(std::time::Duration::from_secs(3600));
    if origins.iter().any(|o| o == "*") {
        return layer.allow_origin(AllowOrigin::any());
    }
    let list: Vec<header::HeaderValue> = origins.iter().filter_map(|o| o.parse().ok()).collect();
    layer.allow_origin(AllowOrigin::list(list))
}

/// Whether a request that came over loopback was sent by this machine's own tools, not
/// by a web page in a browser here: a page on any site can make the browser send a
/// "simple" POST to `127.0.0.1:11434` (or, by DNS rebinding, to a name of its own that
/// resolves there), which would otherwise run generations or unload models without a
/// key. So the `Host` must be an address or a name of this machine (`localhost`, its
/// host name, which Debian resolves to 127.0.1.1), and an `Origin`, if any, must be
/// this machine too or one listed for CORS.
pub fn local_caller(headers: &header::HeaderMap, cors_origins: &[String]) -> bool {
    let host_ok = headers.get(header::HOST).is_none_or(|h| {
        h.to_str().is_ok_and(|h| {
            let h = host_of(h);
            is_this_machine(&h) || h.parse::<std::net::IpAddr>().is_ok()
        })
    });
    let origin_ok = headers.get(header::ORIGIN).is_none_or(|o| {
        o.to_str().is_ok_and(|o| {
            cors_origins.iter().any(|c| c == o)
                || o.split_once("://").is_some_and(|(scheme, rest)| {
                    matches!(scheme, "http" | "https") && is_this_machine(&host_of(rest.trim_end_matches('/')))
                })
        })
    });
    host_ok && origin_ok
}

/// The host of `host[:port]` (IPv6 without its brackets), lower-cased.
fn host_of(authority: &str) -> String {
    let host = if let Some(rest) = authority.strip_prefix('[') {
        rest.split_once(']').map_or(rest, |(h, _)| h)
    } else {
        match authority.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => authority,
        }
    };
    host.to_ascii_lowercase()
}

/// Whether `host` names this machine: `localhost` (or a name under it), a loopback
/// address, or this machine's host name (also under `.local`).
fn is_this_machine(host: &str) -> bool {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let name = NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("COMPUTERNAME").ok())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|n| n.trim().to_ascii_lowercase())
            .filter(|n| !n.is_empty())
    });
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(serve::is_loopback)
        || name.as_deref().is_some_and(|n| host == n || host.strip_suffix(".local") == Some(n))
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
